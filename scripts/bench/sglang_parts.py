#!/usr/bin/env python3
"""What a bench cut short measured on SGLang: the summaries of the servers whose recordings are
complete, from the recordings alone (no GPU, no server).

    python scripts/bench/sglang_parts.py --spec specs/smollm2-pays-gpu.yaml [-o a.b=v ...] \
        --sglang BENCH_SGLANG_DIR [--json OUT]

BENCH_SGLANG_DIR: a bench stage's `sglang/` folder, finished (runs/<spec>/bench/<key>/sglang) or
cut (runs/<spec>/bench/.partial-<key>/sglang), as scripts/gpu/pays.sh brings it back in
sglang-rec.tgz. A server counts when keep_measured marked its recording complete (measured.json:
it answered every request); the plain server of its cuda_graph setting must be complete too.
The rows are the bench stage's own (targets/sglang_bench.py rows_and_summaries: tau, SGLang's
accept length, tok/s against plain, the round cost as plain tokens = break-even tau, SGLang's
per-position acceptance), so they equal what the stage would have written for those servers.

Why: the stage writes its rows only at its end; a call killed by the device's time limit after
some waves (the fifth H100 window of 2026-12-07: plain, 3/1/4 and 5/1/6 complete, 5/4/8 cut)
otherwise leaves the measured servers as raw recordings.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

KEEP = ("num_steps", "eagle_topk", "num_draft_tokens", "cuda_graph", "prompt_set",
        "max_new_tokens", "n_prompts", "tau", "server_accept_length", "spec_tok_s", "base_tok_s",
        "speedup", "break_even_tau", "accept_per_pos", "lossless_prompts", "server_version")


def recorded_sets(folder: Path) -> dict[str, list[tuple[str, list[int]]]]:
    """{prompt_set: [(prompt_id, input_ids)]} in the order a recorded plain server was asked
    (its generate.jsonl, targets/sglang_bench.py read_recording). Raises SystemExit naming the
    file when it is missing, unreadable, empty or a line is not a recorded request."""
    from eagle3_runner.targets.sglang_bench import read_recording
    f = folder / "generate.jsonl"
    try:
        recs = read_recording(folder)
    except OSError as e:
        sys.exit(f"sglang_parts: cannot read {f} ({e.strerror or e}): --sglang must be a bench "
                 "stage's sglang/ folder whose plain server answered")
    except ValueError as e:
        sys.exit(f"sglang_parts: {e}: --sglang must be a bench stage's sglang/ folder")
    sets: dict = {}
    for r in recs:
        ids = r["request"].get("input_ids")
        if not isinstance(ids, list):
            sys.exit(f"sglang_parts: {f}: request {r['prompt_id']!r} has no input_ids list")
        if r["prompt_id"] not in {pid for pid, _ in sets.get(r["prompt_set"], [])}:
            sets.setdefault(r["prompt_set"], []).append((r["prompt_id"], ids))
    if not sets:
        sys.exit(f"sglang_parts: {f} holds no recorded request (a server that never answered)")
    return sets


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", required=True)
    ap.add_argument("-o", dest="overrides", action="append", default=[],
                    help="a spec override, as runner apply takes it (the bench's configs)")
    ap.add_argument("--sglang", type=Path, required=True)
    ap.add_argument("--json", type=Path, help="write the summaries here too")
    a = ap.parse_args()
    from eagle3_runner.runner.files import atomic_write
    from eagle3_runner.runner.spec.load import load_spec
    from eagle3_runner.targets.sglang_bench import load_measured, plan_servers, rows_and_summaries

    if not a.sglang.is_dir():
        sys.exit(f"sglang_parts: --sglang {a.sglang} is not a folder: give a bench stage's "
                 "sglang/ folder (runs/<spec>/bench/<key>/sglang or .partial-<key>/sglang)")
    if a.json is not None and not a.json.parent.is_dir():
        sys.exit(f"sglang_parts: --json {a.json}: its folder {a.json.parent} does not exist")
    p = load_spec(a.spec, a.overrides).stages.bench
    if p is None:
        sys.exit(f"sglang_parts: {a.spec} has no stages.bench")
    plan = plan_servers(p)
    sets = recorded_sets(a.sglang / plan[0].name)
    measured = {}
    for pl in plan:
        m = load_measured(a.sglang, pl, sets, p.max_new_tokens, any_machine=True)
        if m is not None:
            measured[pl.name] = m
    cut = [pl.name for pl in plan if pl.name not in measured]
    if not measured:
        sys.exit(f"sglang_parts: no server's recording in {a.sglang} is complete (a "
                 "measured.json beside a generate.jsonl that answers every prompt): nothing was "
                 "measured to report")
    timed = {n: m for n, m in measured.items()
             if f"plain-cg{int(m.planned.cuda_graph)}" in measured}
    _rows, summaries = rows_and_summaries(timed, p, sets, None)
    out = [{k: s.get(k) for k in KEEP + ("flags", "explanation")} for s in summaries]
    for s in out:
        if s["tau"] is None:  # bench_rows.failed_summary_row: a recording without spec counts
            print(f"{s['num_steps']}/{s['eagle_topk']}/{s['num_draft_tokens']} "
                  f"{s['prompt_set']}: {s['flags']}: {s['explanation']}")
            continue
        pos = ", ".join(f"{x:.3f}" for x in s["accept_per_pos"] or [])
        print(f"{s['num_steps']}/{s['eagle_topk']}/{s['num_draft_tokens']} {s['prompt_set']} "
              f"({s['n_prompts']} prompts): tau {s['tau']:.3f} (SGLang's accept length "
              f"{s['server_accept_length']:.3f}), {s['spec_tok_s']:.1f} vs plain "
              f"{s['base_tok_s']:.1f} tok/s = {s['speedup']:.3f}x, break-even tau "
              f"{s['break_even_tau']:.2f}, per position [{pos}]")
    print(f"not complete (cut or never started): {', '.join(cut) or 'none'}")
    if a.json:
        atomic_write(a.json, json.dumps({"summaries": out, "not_complete": cut}, indent=1))
    return 0


if __name__ == "__main__":
    from eagle3_runner.runner.errors import exit_code
    sys.exit(exit_code(main))  # a spec error: one `error:` line
