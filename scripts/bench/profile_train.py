#!/usr/bin/env python
"""Where a real train stage's step time goes: the spec's own train setup (jobs/train.py `setup`:
its data, target, drafter and kernels), then optimizer steps on its real batches, timed by phase
with a device sync between phases, then the same steps unsynchronised (the stage's own rate),
then a torch.profiler window (the CUDA kernels that take the time, and how many launch per step).

    python scripts/bench/profile_train.py specs/smollm2-scale-gpu-trained.yaml --steps 40 \\
        --out runs/profile-train
    python scripts/bench/profile_train.py specs/demo.yaml -o target.device=cpu --steps 4 --warm 1

Phases of one step (seconds, median over --steps, after --warm steps):
  batch    the sample source's batch (online: the target's forward over the padded batch and the
           capture, target/capture.py; offline: the shard reads)
  prepare  packing and the target's draft-vocab logits (trainer/fast_step.py prepare), timed alone
  step     jobs/train.py train_step (prepare again, the K-step loss, backward, clip, AdamW)
  learn    step - prepare
Shapes per step: samples, sequence tokens, capture tokens (samples x the longest: the padded
batch the target runs), packed rows x length (what the drafter runs).
Writes profile_train.json and profile_train.md in --out; nothing of the stage's artifacts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path



def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__[__doc__.index("    python"):])
    ap.add_argument("spec")
    ap.add_argument("-o", dest="overrides", action="append", default=[],
                    help="a spec override, as runner apply's -o (repeatable)")
    ap.add_argument("--steps", type=int, default=40, help="timed steps per mode (default 40)")
    ap.add_argument("--warm", type=int, default=40,
                    help="steps before timing (compiles; default 40)")
    ap.add_argument("--profile-steps", type=int, default=5, help="torch.profiler window (CUDA)")
    ap.add_argument("--out", default="runs/profile-train")
    a = ap.parse_args(argv)

    import torch
    from eagle3_runner.trainer.recipe import setup, train_step
    from eagle3_runner.trainer.sources import batch_indices
    from eagle3_runner.runner.errors import RunnerError
    from eagle3_runner.runner.spec.load import load_spec
    from eagle3_runner.runner.stage import StageContext

    try:
        spec = load_spec(a.spec, a.overrides)
    except RunnerError as e:
        print(f"profile_train: {e}", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="profile-train-"))
    ctx = StageContext(spec=spec, stage="train", variant="base", run_id="profile", inputs={},
                       out_dir=tmp / "train", db_path=tmp / "profile.duckdb")
    t0 = time.perf_counter()
    run = setup(ctx)
    setup_s = time.perf_counter() - t0
    L, p = run.learner, ctx.params
    cuda = L.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def samples_of(step):
        idx = batch_indices(step, len(run.train_ids), p.batch_size, p.seed)
        return [run.train_ids[i] for i in idx]

    def timed(step):
        ids = samples_of(step)
        sync()
        t = [time.perf_counter()]
        s = run.source.batch(ids)
        sync()
        t.append(time.perf_counter())
        b, _tgt = L.prepare(s)
        sync()
        t.append(time.perf_counter())
        out = train_step(L, s)
        sync()
        t.append(time.perf_counter())
        lens = [int(x["input_ids"].numel()) for x in s]
        R, T = b["pos"].shape
        return {"batch": t[1] - t[0], "prepare": t[2] - t[1], "step": t[3] - t[2],
                "tokens": sum(lens), "capture_tokens": len(lens) * max(lens),
                "rows": R, "row_len": T, "loss": out.loss}

    first = []
    t0 = time.perf_counter()
    for k in range(a.warm):
        first.append(time.perf_counter())
        timed(k)
    warm_s = time.perf_counter() - t0
    rows = [timed(a.warm + k) for k in range(a.steps)]
    med = {k: statistics.median(r[k] for r in rows) for k in ("batch", "prepare", "step")}
    med["learn"] = med["step"] - med["prepare"]
    shapes = {k: statistics.mean(r[k] for r in rows)
              for k in ("tokens", "capture_tokens", "rows", "row_len")}

    # the stage's own rate: no sync between steps (the host runs ahead of the device)
    base = a.warm + a.steps
    sync()
    t0 = time.perf_counter()
    toks = 0
    for k in range(a.steps):
        s = run.source.batch(samples_of(base + k))
        toks += sum(int(x["input_ids"].numel()) for x in s)
        train_step(L, s)
    sync()
    free_s = time.perf_counter() - t0

    kernels = []
    launches = None
    if cuda and a.profile_steps:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for k in range(a.profile_steps):
                train_step(L, run.source.batch(samples_of(base + a.steps + k)))
            sync()
        ev = prof.key_averages()
        dev_total = sum(e.self_device_time_total for e in ev if e.device_type.name == "CUDA")
        launches = sum(e.count for e in ev if e.device_type.name == "CUDA") / a.profile_steps
        for e in sorted(ev, key=lambda e: -e.self_device_time_total)[:25]:
            if e.self_device_time_total <= 0:
                break
            kernels.append({"name": e.key[:90], "calls_per_step": e.count / a.profile_steps,
                            "ms_per_step": e.self_device_time_total / 1e3 / a.profile_steps,
                            "share": e.self_device_time_total / max(dev_total, 1)})
        kernels.insert(0, {"name": "(all CUDA kernels)", "calls_per_step": launches,
                           "ms_per_step": dev_total / 1e3 / a.profile_steps, "share": 1.0})
    try:
        from torch._dynamo.utils import counters
        dyn = {k: dict(v) for k, v in counters.items() if k in ("stats", "recompiles")}
    except Exception:  # noqa: BLE001 - diagnostics only
        dyn = {}
    res = {"spec": a.spec, "overrides": a.overrides, "device": str(L.device),
           "kernels": p.kernels, "batch_size": p.batch_size, "ttt_steps": p.ttt_steps,
           "setup_s": setup_s, "warm_steps": a.warm, "warm_s": warm_s,
           "phase_s": med, "shapes": shapes,
           "synced_tok_s": shapes["tokens"] / med["step"] if med["step"] else 0.0,
           "unsynced_s_per_step": free_s / a.steps, "unsynced_tok_s": toks / free_s,
           "profile": kernels, "dynamo": dyn}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile_train.json").write_text(json.dumps(res, indent=1, default=str))
    md = [f"# profile_train: {a.spec} {' '.join(a.overrides)}", "",
          f"device {L.device}, kernels {p.kernels}, batch {p.batch_size}, K {p.ttt_steps}; "
          f"setup {setup_s:.1f} s, {a.warm} warm-up steps {warm_s:.1f} s", "",
          "| phase | ms (median, synced) |", "|---|---|"]
    md += [f"| {k} | {v * 1e3:.1f} |" for k, v in med.items()]
    md += ["", f"per step: {shapes['tokens']:.0f} tokens, capture {shapes['capture_tokens']:.0f} "
           f"padded tokens, packed {shapes['rows']:.1f} rows x {shapes['row_len']:.0f}", "",
           f"unsynchronised: {free_s / a.steps * 1e3:.1f} ms/step, {toks / free_s:,.0f} tok/s", ""]
    if kernels:
        md += ["| CUDA kernel | calls/step | ms/step | share |", "|---|---|---|---|"]
        md += [f"| {k['name']} | {k['calls_per_step']:.0f} | {k['ms_per_step']:.2f} | "
               f"{k['share']:.3f} |" for k in kernels]
    (out / "profile_train.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
