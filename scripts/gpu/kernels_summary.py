#!/usr/bin/env python3
"""The compact summary of scripts/gpu/kernels.sh: step exit codes, the GPU tests' outcome, the
engine bench with each kernel setting run (triton, torch, auto) side by side (tok/s, ms/token, vs the plain 1-row engine
decode, tau, draft/verify ms per round, the verify-cost ratio) and profile_engine's ratios.
Reads what exists under the results folder (a step that failed or ran out of time leaves a
partial JSON or none); never raises. No torch.

  python3 scripts/gpu/kernels_summary.py $OUT/r
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _f(x, d=2) -> str:
    return f"{x:.{d}f}" if isinstance(x, (int, float)) else "-"


def tests(r: Path) -> list[str]:
    """The pytest summary line and failures of each test log."""
    out = []
    for name in ("engine", "kernels"):
        try:
            lines = (r / f"{name}.log").read_text().splitlines()
        except OSError:
            continue
        tail = [x for x in lines if x.startswith(("FAILED", "ERROR"))]
        last = next((x for x in reversed(lines) if " in " in x and ("passed" in x or "failed" in x
                                                                      or "error" in x)), "no summary")
        out += [f"- {name} tests: {last.strip('= ')}"] + [f"  - {x[:160]}" for x in tail[:12]]
    return out


def bench(r: Path) -> list[str]:
    runs = {k: _load(r / f"bench_{k}.json") for k in ("triton", "torch", "auto")}
    runs = {k: v for k, v in runs.items() if v}
    if not runs:
        return ["- bench: no results"]
    names = list(dict.fromkeys(n for v in runs.values() for n in v["rows"]))
    head = "| row | " + " | ".join(f"{k}: tok/s | ms/tok | vs base | tau | draft/verify ms"
                                    for k in runs) + " |"
    lines = [head, "|---|" + "---|---|---|---|---|" * len(runs)]
    base = {k: (v["rows"].get("base_1row") or v["rows"].get("base") or {}).get("tok_s")
            for k, v in runs.items()}
    for n in names:
        cells = []
        for k, v in runs.items():
            x = v["rows"].get(n)
            if x is None:
                cells.append("| | | | ")
            elif "error" in x:
                cells.append(f"error: {x['error'][:60]} | | | | ")
            else:
                vs = x["tok_s"] / base[k] if base[k] else None
                cells.append(f"{_f(x['tok_s'], 1)} | {_f(x['ms_per_token'])} | {_f(vs)}x | "
                             f"{_f(x.get('tau'))} | {_f(x.get('draft_ms_per_round'))}/"
                             f"{_f(x.get('verify_ms_per_round'))}")
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    if "auto" in runs:
        lines.append(f"- auto resolved to kernels={runs['auto'].get('kernels')} (expected torch)")
    for k, v in runs.items():
        vc = v.get("verify_cost") or {}
        if "ms" in vc:
            lines.append(f"- {k}: verify {vc['configs'][0]} {_f(vc['ms'][0], 3)} ms, "
                         f"{vc['configs'][1]} {_f(vc['ms'][1], 3)} ms: ratio {_f(vc['ratio'])}x "
                         "(issue 18: <= 1.3)")
        elif vc:
            lines.append(f"- {k}: verify cost error: {vc.get('error', '?')[:120]}")
    if "triton" in runs and "torch" in runs:
        t, p = runs["triton"]["rows"].get("base", {}), runs["torch"]["rows"].get("base", {})
        if t.get("tok_s") and p.get("tok_s"):
            lines.append(f"- 1-row decode: fused {_f(t['ms_per_token'])} ms/token vs torch "
                         f"{_f(p['ms_per_token'])}: {_f(t['tok_s'] / p['tok_s'])}x")
    hs = runs.get("triton", {}).get("rows", {}).get("hf_static", {})
    if hs.get("tok_s") and base.get("triton"):
        lines.append(f"- fused 1-row decode vs HF static compiled generate: "
                     f"{_f(base['triton'] / hs['tok_s'])}x (issue 19: >= 2.5)")
    return lines


def profile(r: Path) -> list[str]:
    res = _load(r / "profile_engine.json")
    if not res or "ratios" not in res:
        return ["- profile: no results"]
    keys = ("token_ms", "round_ms", "round_in_tokens", "draft_over_layer", "tree16_over_verify5",
            "layer_ms")
    paths = list(res["ratios"])
    lines = ["| profile | " + " | ".join(paths) + " |", "|---|" + "---|" * len(paths)]
    for k in keys:
        lines.append(f"| {k} | " + " | ".join(_f(res["ratios"][p].get(k), 3) for p in paths)
                     + " |")
    errs = [f"{n}/{p}: {row['error'][:80]}" for n, rows in res.get("steps", {}).items()
            for p, row in rows.items() if "error" in row]
    return lines + [f"- profile error: {e}" for e in errs[:8]]


def main(argv=None) -> int:
    r = Path((argv or sys.argv[1:] or ["."])[0])
    out = ["## kernels.sh summary"]
    try:
        out += [(r / "machine.txt").read_text().strip().replace("\n", "; ")]
    except OSError:
        pass
    try:
        out += ["- " + x for x in (r / "rc.txt").read_text().splitlines()]
    except OSError:
        pass
    for part in (tests, bench, profile):
        try:
            out += [""] + part(r)
        except Exception as e:  # noqa: BLE001 - a summary never fails the run
            out += ["", f"- {part.__name__}: cannot summarise ({type(e).__name__}: {e})"]
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
