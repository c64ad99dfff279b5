#!/usr/bin/env python
"""Extraction throughput vs the plain forward-with-hidden-states of the same model, same run.

    python scripts/bench_extract.py --device cpu --batch 2 --seq 256 --batches 3 --out runs/bench-extract
    python scripts/bench_extract.py --device cuda --batch 8 --seq 2048 --out runs/bench-extract

Measures (tokens/s, median over batches after one warm-up batch, CUDA synchronised):
- plain:   model(input_ids, output_hidden_states=True) on [batch, seq] (HF default: all hidden
           states + logits), the reference the issue names (~405k tok/s for SmolLM2 on an H200).
- capture: jobs.extract.forward_features (aux hooks + pre-norm last hidden, no LM head), incl.
           the copy to the CPU.
- extract: jobs.extract.extract_samples end to end: forward, shard assembly, safetensors
           serialisation, sha256 and the atomic write of every shard (one shard per batch), and
           the one fsync pass over all shards at the end (reported alone as sync_s).
ratio = extract / plain; the target is >= 0.70. Writes bench_extract.json and bench_extract.md
into --out. Inputs are random token ids (throughput does not depend on content). The weights are
the fetched SmolLM2 (jobs.target.load_target) or, with --random-init or when it is not fetched,
a randomly initialised model of the same geometry.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, head_dim=64,
               max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
               tie_word_embeddings=True)


def load_model(args):
    import torch
    from jobs.target import load_target, resolve_device, resolve_dtype
    dev = resolve_device(args.device)
    dt = resolve_dtype(args.dtype, dev)
    if not args.random_init:
        try:
            target = args.target
            if target is None:
                from runner.assets import asset_path
                target = asset_path("smollm2")
            model, _tok, _cfg = load_target(target, device=dev, dtype=dt)
            return model, f"{target}", dev, dt
        except Exception as e:  # noqa: BLE001 - fall back, and say so
            print(f"bench_extract: cannot load the target ({e}); using a random init",
                  file=sys.stderr)
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM2)).to(device=dev, dtype=dt).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model, "random-init SmolLM2-135M geometry", dev, dt


def sync(dev):
    import torch
    if str(dev).startswith("cuda"):
        torch.cuda.synchronize()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="examples:\n  python scripts/bench_extract.py --device cuda "
                                        "--batch 8 --seq 2048 --out runs/bench-extract")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batches", type=int, default=4, help="timed batches (after 1 warm-up)")
    ap.add_argument("--aux", default="1,14,26", help="SGLang aux layer ids")
    ap.add_argument("--target", default=None, help="HF folder or .gguf (default: fetched SmolLM2)")
    ap.add_argument("--random-init", action="store_true")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads")
    ap.add_argument("--writers", type=int, default=None,
                    help="shard writer threads (default: jobs.extract.default_writers)")
    ap.add_argument("--out", default="runs/bench-extract")
    args = ap.parse_args(argv)

    import torch
    import jobs.extract as ex
    torch.set_num_threads(args.threads)
    model, source, dev, dt = load_model(args)
    aux = [int(x) for x in args.aux.split(",")]
    ex.check_aux_ids(model, aux)
    B, S, n = args.batch, args.seq, args.batches
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, V, (B, S), generator=g) for _ in range(n + 1)]
    tok_per_batch = B * S

    # plain forward with hidden states (the reference)
    plain = []
    with torch.inference_mode():
        for i, x in enumerate(batches):
            x = x.to(dev)
            sync(dev)
            t = time.perf_counter()
            out = model(input_ids=x, output_hidden_states=True)
            sync(dev)
            if i:
                plain.append(time.perf_counter() - t)
            del out
    # capture only (hooks + copy to CPU)
    capture = []
    for i, x in enumerate(batches):
        sync(dev)
        t = time.perf_counter()
        ex.forward_features(model, x.tolist(), aux)
        sync(dev)
        if i:
            capture.append(time.perf_counter() - t)
    # full extraction with shard writing: one shard per batch
    samples = [(row, [1] * S) for x in batches for row in x.tolist()]
    Path(args.out).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.out) as d:  # shards go to the --out filesystem
        for sub in ("warm", "run"):
            (Path(d) / sub).mkdir()
        ex.extract_samples(model, samples[:B], aux, Path(d) / "warm", B, B * S, progress=False,
                           writers=args.writers)
        sync(dev)
        res = ex.extract_samples(model, samples[B:], aux, Path(d) / "run", B, B * S,
                                 progress=False, writers=args.writers)
        sync(dev)
        shard_bytes = sum(f.stat().st_size for f in (Path(d) / "run").glob("shard-*"))
    t_plain, t_cap = statistics.median(plain), statistics.median(capture)
    r = {
        "device": str(dev), "device_name": (torch.cuda.get_device_name() if str(dev).startswith(
            "cuda") else platform.processor() or platform.machine()),
        "dtype": str(dt).removeprefix("torch."), "model": source, "batch": B, "seq": S,
        "timed_batches": n, "aux_layer_ids": aux, "threads": args.threads,
        "writers": args.writers or ex.default_writers(model),
        "plain_tok_s": tok_per_batch / t_plain, "capture_tok_s": tok_per_batch / t_cap,
        "extract_tok_s": n * tok_per_batch / res["seconds"],
        "sync_s": res["sync_seconds"], "shard_mib": shard_bytes / 2**20,
        "bytes_per_token": shard_bytes / (n * tok_per_batch),
        "torch": torch.__version__,
    }
    r["ratio_extract_vs_plain"] = r["extract_tok_s"] / r["plain_tok_s"]
    r["ratio_capture_vs_plain"] = r["capture_tok_s"] / r["plain_tok_s"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_extract.json").write_text(json.dumps(r, indent=1))
    md = ("| device | dtype | batch x seq | plain fwd+hidden tok/s | capture tok/s | extract "
          "(+shards) tok/s | extract/plain | bytes/token | writers | final fsync s |\n"
          "|---|---|---|---|---|---|---|---|---|---|\n"
          f"| {r['device_name']} ({r['device']}) | {r['dtype']} | {B}x{S} | "
          f"{r['plain_tok_s']:,.0f} | {r['capture_tok_s']:,.0f} | {r['extract_tok_s']:,.0f} | "
          f"{r['ratio_extract_vs_plain']:.2f} | {r['bytes_per_token']:,.0f} | {r['writers']} | "
          f"{r['sync_s']:.3f} |\n")
    (out / "bench_extract.md").write_text(md)
    print(md)
    return r


if __name__ == "__main__":
    main()
