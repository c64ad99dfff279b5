#!/usr/bin/env python3
"""Recorded SGLang servers -> a fixture set for the CPU tests (tests/data/sglang/README.md).

    python3 scripts/gpu/sglang_fixtures.py --bench BENCH_SGLANG_DIR [--lab LAB_REC_DIR --lab-json
        lab.json] --out tests/data/sglang/h200-0.5.14 [--prompts 3] [--decode-lines 12]

BENCH_SGLANG_DIR: a bench stage's `sglang/` folder (runs/<spec>/bench/<key>/sglang, in the
state.tgz scripts/gpu/sglang34.sh brings back); LAB_REC_DIR: the `lab/` folder of lab-rec.tgz
(scripts/gpu/sglang_lab.py). Per server it keeps argv.json (machine paths replaced by
/models/target and /runs/export), server_info.json, the first --prompts requests of
generate.jsonl (the same prompts on every server) and a trimmed server.log: the lines that say
what the server loaded and when it was ready, the first --decode-lines decode and prefill lines,
every line naming an error, and the last 10 lines. The lab's rows go to <out>/lab/lab.json (what
we said, what SGLang did) and its servers to <out>/lab/<case>/, the same way.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

KEEP = re.compile(r"server_args=|Load weight end|KV Cache is allocated|Capture cuda graph end|"
                  r"fired up and ready|draft|Draft|speculative|EAGLE|eagle|max_total_num_tokens|"
                  r"WARNING|Warning|Error|error:|Exception|Traceback|Assertion|CUDA error")
DECODE = re.compile(r"Decode batch|Prefill batch")
PATH_FLAGS = {"--model-path": "/models/target", "--speculative-draft-model-path": "/runs/export"}


def trim_log(text: str, decode_lines: int) -> str:
    """The lines of a server log a test reads (module docstring), each cut to 400 characters."""
    lines = text.splitlines()
    keep, decodes = set(range(max(len(lines) - 10, 0), len(lines))), 0
    for i, ln in enumerate(lines):
        if KEEP.search(ln):
            keep.add(i)
        elif DECODE.search(ln) and decodes < decode_lines:
            keep.add(i)
            decodes += 1
    return "\n".join(lines[i][:400] for i in sorted(keep)) + "\n"


def trim_argv(argv: list[str]) -> list[str]:
    out = list(argv)
    for i, a in enumerate(out[:-1]):
        if a in PATH_FLAGS:
            out[i + 1] = PATH_FLAGS[a]
    out[0] = "python3"
    return out


def copy_server(src: Path, dst: Path, prompts: int, decode_lines: int) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    if (src / "argv.json").exists():
        argv = trim_argv(json.loads((src / "argv.json").read_text()))
        (dst / "argv.json").write_text(json.dumps(argv, indent=1) + "\n")
    if (src / "server.log").exists():
        (dst / "server.log").write_text(trim_log((src / "server.log").read_text(errors="replace"),
                                                 decode_lines))
    if (src / "server_info.json").exists():
        info = json.loads((src / "server_info.json").read_text())
        for flag, path in PATH_FLAGS.items():
            k = flag[2:].replace("-", "_")
            if info.get(k):
                info[k] = path
        (dst / "server_info.json").write_text(json.dumps(info, indent=1) + "\n")
    gen = src / "generate.jsonl"
    if gen.exists():
        recs = [json.loads(x) for x in gen.read_text().splitlines() if x.strip()]
        first = {r["prompt_id"] for r in recs[:prompts]}
        (dst / "generate.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in recs if r["prompt_id"] in first))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bench", required=True, type=Path)
    ap.add_argument("--lab", type=Path)
    ap.add_argument("--lab-json", type=Path)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--decode-lines", type=int, default=12)
    a = ap.parse_args(argv)
    if a.out.exists():
        shutil.rmtree(a.out)
    servers = sorted(d for d in a.bench.iterdir() if d.is_dir())
    if not any(d.name.startswith("plain-") for d in servers):
        raise SystemExit(f"{a.bench}: no plain-cg* server: not a bench stage's sglang/ folder")
    for d in servers:
        copy_server(d, a.out / d.name, a.prompts, a.decode_lines)
    if a.lab is not None:
        for d in sorted(x for x in a.lab.iterdir() if x.is_dir()):
            copy_server(d, a.out / "lab" / d.name, 2, a.decode_lines)
    if a.lab_json is not None:
        lab = json.loads(a.lab_json.read_text())
        for r in lab["rows"]:
            r.pop("argv", None)
        (a.out / "lab").mkdir(parents=True, exist_ok=True)
        (a.out / "lab" / "lab.json").write_text(json.dumps(lab, indent=1) + "\n")
    size = sum(f.stat().st_size for f in a.out.rglob("*") if f.is_file())
    print(f"{a.out}: {len(servers)} bench servers"
          + (f", {sum(1 for x in (a.out / 'lab').iterdir() if x.is_dir())} lab servers"
             if (a.out / "lab").exists() else "") + f", {size / 1024:.0f} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
