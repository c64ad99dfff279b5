#!/usr/bin/env python3
r"""The SGLang conformance lab on a GPU (targets/sglang_lab.py; the cases: runner/drafts/lab.py).

    python3 scripts/gpu/sglang_lab.py --draft runs/<spec>/export/<key> --target <GGUF or HF folder> \
        --python ~/sglang-python --out $OUT/lab [--prompts 4] [--max-new 128] [--parallel 32] \
        [--mem-fraction 0.5] [--timeout 300] [--extra "--attention-backend triton ..."] \
        [--cases good,d2t_absolute] [--work /tmp/lab] [--dry-run]

Writes the broken variants under --work, runs `runner inspect` (SGLang 0.5.14, with each server
line) and the spec's rules on each BEFORE any server, then serves them all (--parallel at once
on the one GPU, free ports, --mem-fraction each, --timeout each), sends the first --prompts
MT-bench prompts (chat template, input_ids, greedy, --max-new tokens) to each, and writes to
--out: lab.json (rows + the claims map), lab.md (the table), lab-rec.tgz (per case: argv.json,
server.log, server_info.json, generate.jsonl; scripts/gpu/sglang_fixtures.py --lab reads it).
lab.json and lab.md are written whatever happens (a dry run or a failure: the rows so far).

Memory, many servers on one GPU: SGLang 0.5.14 sizes its KV pool from the memory free when the
server starts minus (1 - mem_fraction_static) x the memory free before it loaded its weights
(model_executor/model_runner_kv_cache_mixin.py), and refuses to start when that is negative, so
servers starting side by side can refuse each other when the fraction is SMALL (the others'
weights and pools land in between). Give a LARGE fraction and cap the pool with
`--max-total-tokens` in --extra: each server then holds ~1.5 GB (SmolLM2) whatever the fraction.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tarfile
import time
from pathlib import Path

from eagle3_runner.data.prompts import load_prompt_set, render
from eagle3_runner.runner.drafts.lab import VERSION
from eagle3_runner.targets.load import end_of_turn_ids, hf_folder, load_tokenizer
from eagle3_runner.targets.sglang_lab import LabSettings, judge, markdown, prepare, serve


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", required=True, help="the good exported draft directory")
    ap.add_argument("--target", required=True, help="the target: GGUF (converted once) or HF folder")
    ap.add_argument("--python", default="python3", help="an interpreter with sglang")
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default="/tmp/sglang-lab")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--parallel", type=int, default=32)
    ap.add_argument("--mem-fraction", type=float, default=0.5,
                    help="--mem-fraction-static of every server (see the module docstring)")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--extra", default="", help="launch flags for every server (one string)")
    ap.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    ap.add_argument("--dry-run", action="store_true", help="variants and checks only")
    a = ap.parse_args(argv)
    out, work = Path(a.out), Path(a.work)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    model = hf_folder(a.target)
    tok = load_tokenizer(a.target)
    prompts = [(q["id"], render(tok, q["messages"])) for q in load_prompt_set("mtbench", None,
                                                                              a.prompts)]
    st = LabSettings(python=a.python, model=str(model),
                     target=json.loads((Path(model) / "config.json").read_text()),
                     prompts=prompts, max_new=a.max_new, mem_fraction_static=a.mem_fraction,
                     extra=shlex.split(a.extra), timeout_s=a.timeout, parallel=a.parallel,
                     stop_ids=end_of_turn_ids(a.target, tok))
    rows, claims, rec = [], [], work / "rec"
    meta = {"version": VERSION, "draft": a.draft, "prompts": f"{len(prompts)} MT-bench x "
            f"{a.max_new} new tokens, greedy", "servers": f"{a.parallel} at once, "
            f"--mem-fraction-static {a.mem_fraction}, {a.extra}"}
    try:
        rows = prepare(Path(a.draft), work, st, [c for c in a.cases.split(",") if c] or None)
        print(f"lab: {len(rows)} variants written and checked in {time.time() - t0:.1f} s",
              flush=True)
        if not a.dry_run:
            serve(rows, st, rec)
            print(f"lab: served in {time.time() - t0:.1f} s", flush=True)
        claims = judge(rows, rec)
        versions = {r.get("info", {}).get("version") for r in rows} - {None}
        meta["version"] = ", ".join(sorted(versions)) or VERSION
    finally:
        meta["seconds"] = round(time.time() - t0, 1)
        for r in rows:
            r.pop("dir", None)
        (out / "lab.json").write_text(json.dumps({"meta": meta, "rows": rows, "claims": claims},
                                                 indent=1, default=str))
        (out / "lab.md").write_text(markdown(rows, claims, meta))
        if rec.exists():
            with tarfile.open(out / "lab-rec.tgz", "w:gz") as tar:
                tar.add(rec, arcname="lab")
    print((out / "lab.md").read_text())
    return 0


if __name__ == "__main__":
    from eagle3_runner.runner.errors import exit_code
    sys.exit(exit_code(main))
