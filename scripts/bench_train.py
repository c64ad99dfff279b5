#!/usr/bin/env python
"""Drafter training throughput (tokens/s) and peak memory vs TTT steps K, sequence length and
draft vocab size.

    python scripts/bench_train.py --device cpu --out runs/bench-train            # small grid
    python scripts/bench_train.py --device cuda --geometry smollm2 --out runs/bench-train
    python scripts/bench_train.py --device cuda --geometry llama3-8b --out runs/bench-train-8b

What is timed: jobs.train.train_step, the exact optimizer step of the train stage (batch
assembly, the target's distribution = norm + full-vocab lm_head + draft-vocab softmax, K TTT
steps forward, backward, grad clipping, AdamW; bf16 autocast on CUDA, float32 on the CPU), on
random features of the chosen target geometry (throughput does not depend on content).
tokens/s = batch x seq / median step time (after --warmup steps; CUDA synchronised); each
sequence token passes through all K draft steps.
Peak memory: CUDA = torch.cuda.max_memory_allocated during the measured steps (total, and
`step` = minus what was allocated before the first step: model, AdamW state, target head);
CPU = the process's max RSS (each configuration runs in its own subprocess).
The grid varies one factor at a time around a base point (--base K,seq,vocab). Writes
bench_train.json and bench_train.md into --out.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

GEOMETRIES = {
    "smollm2": dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                    intermediate_size=1536, vocab_size=49152),
    "llama3-8b": dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=128, intermediate_size=14336, vocab_size=128256),
}
DEFAULTS = {"cpu": dict(base="3,256,8192", ks="1,3,7", seqs="128,256,512", vocabs="2048,8192,32000",
                        batch=1, warmup=1, iters=3),
            "cuda": dict(base="7,2048,32000", ks="1,3,5,7,10", seqs="512,1024,2048,4096",
                         vocabs="8192,16384,32000,65536", batch=1, warmup=2, iters=5)}


def one(cfg: dict) -> dict:
    """Run one configuration in this process; returns its measurements."""
    import resource
    import torch
    from types import SimpleNamespace
    from jobs.draft_model import DraftConfig, Eagle3Draft
    from jobs.train import Learner, train_step
    dev = torch.device(cfg["device"])
    if dev.type == "cpu":
        torch.set_num_threads(cfg["threads"])
    g = GEOMETRIES[cfg["geometry"]]
    H, V, Vd, K, T, B = g["hidden_size"], g["vocab_size"], cfg["vocab"], cfg["K"], cfg["seq"], cfg["batch"]
    torch.manual_seed(0)
    c = DraftConfig(**g, draft_vocab_size=Vd, target_hidden_size=H, aux_layer_ids=[1, 2, 3])
    hdt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    head = {"norm": torch.ones(H, device=dev, dtype=hdt),
            "lm_head": (torch.randn(V, H, device=dev) * 0.02).to(hdt)}
    model = Eagle3Draft(c, (torch.randn(V, H) * 0.02)).to(dev)
    used = torch.randperm(V)[:Vd].sort().values
    model.d2t.copy_(used - torch.arange(Vd))
    model.t2d[used.to(dev)] = True
    used, t2d = used.to(dev), model.t2d
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    p = SimpleNamespace(ttt_steps=K, step_decay=0.8, grad_clip=0.5)
    dt = torch.float32  # features as extract writes them on CPU; bf16 on CUDA
    fdt = torch.bfloat16 if dev.type == "cuda" else dt
    samples = [{"input_ids": torch.randint(0, V, (T,)), "loss_mask": torch.ones(T, dtype=torch.uint8),
                "aux_hidden": torch.randn(T, 3 * H).to(fdt), "last_hidden": torch.randn(T, H).to(fdt)}
               for _ in range(B)]
    learner = Learner(model, opt, p, head, used, t2d, 1e-5, dev)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    for _ in range(cfg["warmup"]):
        train_step(learner, samples)
    sync()
    base_alloc = 0
    if dev.type == "cuda":
        base_alloc = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    times = []
    for _ in range(cfg["iters"]):
        t0 = time.perf_counter()
        train_step(learner, samples)
        sync()
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    if dev.type == "cuda":
        peak = torch.cuda.max_memory_allocated(dev) / 2**20
        step_peak = peak - base_alloc / 2**20
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        step_peak = None
    n_params = sum(x.numel() for x in model.parameters())
    return {**cfg, "step_s": med, "tokens_per_s": B * T / med, "peak_mib": peak,
            "step_peak_mib": step_peak, "draft_params": n_params}


def grid(a) -> list[dict]:
    K0, T0, V0 = (int(x) for x in a.base.split(","))
    pts = [(K0, T0, V0)]
    pts += [(int(k), T0, V0) for k in a.ks.split(",")]
    pts += [(K0, int(t), V0) for t in a.seqs.split(",")]
    pts += [(K0, T0, int(v)) for v in a.vocabs.split(",")]
    seen, out = set(), []
    for k, t, v in pts:
        if (k, t, v) not in seen:
            seen.add((k, t, v))
            out.append(dict(K=k, seq=t, vocab=v))
    return out


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"### Drafter training: {meta['geometry']} geometry on {meta['device_name']}",
             "", f"batch {meta['batch']}, median of {meta['iters']} steps after {meta['warmup']} "
             f"warm-up; {meta['precision']}; tokens/s = sequence tokens per optimizer step time "
             "(each token runs all K TTT steps).", "",
             "| K | seq | draft vocab | step (s) | tokens/s | peak mem (MiB) | step peak (MiB) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['K']} | {r['seq']} | {r['vocab']} | error: {r['error'][:60]} | | | |")
            continue
        sp = "" if r["step_peak_mib"] is None else f"{r['step_peak_mib']:.0f}"
        lines.append(f"| {r['K']} | {r['seq']} | {r['vocab']} | {r['step_s']:.3f} | "
                     f"{r['tokens_per_s']:.0f} | {r['peak_mib']:.0f} | {sp} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--geometry", choices=sorted(GEOMETRIES), default="smollm2")
    for k in ("base", "ks", "seqs", "vocabs"):
        ap.add_argument(f"--{k}", default=None)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--threads", type=int, default=2, help="CPU threads per configuration")
    ap.add_argument("--out", default="runs/bench-train")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: one configuration as JSON
    a = ap.parse_args()
    if a.one:
        print("RESULT " + json.dumps(one(json.loads(a.one))))
        return
    for k, v in DEFAULTS[a.device].items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    import torch
    dev_name = (torch.cuda.get_device_name(0) if a.device == "cuda"
                else f"CPU ({platform.processor() or platform.machine()}, {a.threads} threads)")
    rows = []
    V = GEOMETRIES[a.geometry]["vocab_size"]
    for pt in grid(a):
        if pt["vocab"] > V:
            print(f"skip draft vocab {pt['vocab']}: larger than the {a.geometry} vocab {V}",
                  file=sys.stderr)
            continue
        cfg = dict(pt, device=a.device, geometry=a.geometry, batch=a.batch, warmup=a.warmup,
                   iters=a.iters, threads=a.threads)
        r = subprocess.run([sys.executable, __file__, "--one", json.dumps(cfg)],
                           capture_output=True, text=True)
        got = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
        if r.returncode or not got:
            err = (r.stderr.strip().splitlines() or ["failed"])[-1]
            rows.append({**cfg, "error": err})
            print(f"K={pt['K']} seq={pt['seq']} vocab={pt['vocab']}: {err}", file=sys.stderr)
            continue
        rows.append(json.loads(got[-1][7:]))
        x = rows[-1]
        print(f"K={x['K']:>2} seq={x['seq']:>5} vocab={x['vocab']:>6}: {x['tokens_per_s']:>9.0f} "
              f"tok/s  step {x['step_s']:.3f} s  peak {x['peak_mib']:.0f} MiB", file=sys.stderr)
    meta = {"geometry": a.geometry, "device": a.device, "device_name": dev_name,
            "batch": a.batch, "warmup": a.warmup, "iters": a.iters,
            "precision": "bf16 autocast" if a.device == "cuda" else "float32",
            "torch": torch.__version__}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_train.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (out / "bench_train.md").write_text(markdown(rows, meta))
    print(markdown(rows, meta))


if __name__ == "__main__":
    main()
