#!/usr/bin/env python
"""Extraction throughput vs the plain forward-with-hidden-states of the same model, same run.

    python scripts/bench/bench_extract.py --device cpu --batch 2 --seq 256 --batches 3 --out runs/bench-extract
    python scripts/bench/bench_extract.py --device cuda --batch 8 --seq 2048 --batches 128 --rounds 3 \
        --random-init --out runs/bench-extract

Measures (tokens/s, median over batches after one warm-up batch, CUDA synchronised):
- plain:   model(input_ids, output_hidden_states=True) on [batch, seq] (HF default: all hidden
           states + logits), the reference the issue names (~405k tok/s for SmolLM2 on an H200).
- capture: jobs.extract.forward_features (aux hooks + pre-norm last hidden, no LM head), incl.
           the copy to the CPU.
- extract: jobs.extract.extract_samples end to end: forward, shard assembly, safetensors
           serialisation, sha256 and the atomic write of every shard (one shard per batch), and
           the one fsync pass over all shards at the end (reported alone as sync_s).
- extract_no_wb: the same without targets.shards.start_writeback (the shards stay in the page
           cache until the final fsync pass), the A/B for that choice; the two alternate in order.
- write_only: the same bytes written by the same writer threads with no GPU work (the disk's
           ceiling on this machine).
Each of --rounds rounds runs plain, capture, both extracts, write-only, then plain again; plain =
the mean of its two timings, and the summary row is the median over rounds.
ratio = extract / plain; the target is >= 0.70. Writes bench_extract.json and bench_extract.md
into --out. Inputs are random token ids (throughput does not depend on content). The weights are
the fetched SmolLM2 (targets.load.load_target) or, with --random-init or when it is not fetched,
a randomly initialised model of the same geometry.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path


SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, head_dim=64,
               max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
               tie_word_embeddings=True)


def load_model(args):
    import torch
    from eagle3_runner.targets.load import load_target, resolve_device, resolve_dtype
    dev = resolve_device(args.device)
    dt = resolve_dtype(args.dtype, dev)
    if not args.random_init:
        try:
            target = args.target
            if target is None:
                from eagle3_runner.runner.assets import asset_path
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


def write_only(out: Path, n: int, tokens: int, model, aux: list[int], writers: int | None) -> float:
    """Seconds to write n shards of `tokens` tokens each through the extract stage's own writer
    (targets.shards.write_shard on the same number of threads, then sync_shards), no GPU work: the
    disk's ceiling for extraction on this machine, measured in the same run."""
    import torch
    from concurrent.futures import ThreadPoolExecutor
    import eagle3_runner.jobs.extract as ex
    from eagle3_runner.targets.shards import shard_index, sync_shards, write_shard
    out.mkdir()
    H, dt = model.config.hidden_size, next(model.parameters()).dtype
    pin = next(model.parameters()).is_cuda
    idx = shard_index([([0] * tokens, [1] * tokens)], [0])
    tensors = {**idx, "aux_hidden": torch.randn(tokens, len(aux) * H).to(dt),
               "last_hidden": torch.randn(tokens, H).to(dt)}
    if pin:
        tensors = {k: v.pin_memory() for k, v in tensors.items()}
    paths = [out / ex.SHARD.format(i) for i in range(n)]
    t = time.perf_counter()
    with ThreadPoolExecutor(max_workers=writers or ex.default_writers(model)) as pool:
        list(pool.map(lambda p: write_shard(p, tensors), paths))
    sync_shards(paths, out)
    return time.perf_counter() - t


HEADER = ("| round | plain tok/s (before / after) | capture tok/s | extract tok/s | extract, "
          "no writeback, tok/s | write-only tok/s | final fsync s (extract / no writeback) | "
          "**extract / plain** | no writeback / plain | write-only / plain |\n"
          "|---|---|---|---|---|---|---|---|---|---|\n")


def row_md(r: dict) -> str:
    """One markdown row of HEADER."""
    return (f"| {r['round']} | {r['plain_tok_s']:,.0f} ({r['plain_before_tok_s']:,.0f} / "
            f"{r['plain_after_tok_s']:,.0f}) | {r['capture_tok_s']:,.0f} | "
            f"{r['extract_tok_s']:,.0f} | {r['extract_no_wb_tok_s']:,.0f} | "
            f"{r['write_only_tok_s']:,.0f} | {r['extract_sync_s']:.3f} / "
            f"{r['extract_no_wb_sync_s']:.3f} | "
            f"**{r['ratio_extract_vs_plain']:.2f}** | {r['ratio_extract_no_wb_vs_plain']:.2f} | "
            f"{r['ratio_write_only_vs_plain']:.2f} |\n")


def time_plain(model, batches, dev) -> float:
    """Median seconds per batch of model(x, output_hidden_states=True), the first batch a
    warm-up."""
    import torch
    ts = []
    with torch.inference_mode():
        for i, x in enumerate(batches):
            x = x.to(dev)
            sync(dev)
            t = time.perf_counter()
            out = model(input_ids=x, output_hidden_states=True)
            sync(dev)
            if i:
                ts.append(time.perf_counter() - t)
            del out
    return statistics.median(ts)


def time_capture(model, batches, aux, dev) -> float:
    """Median seconds per batch of jobs.extract.forward_features (hooks + copy to the CPU), the
    first batch a warm-up."""
    import eagle3_runner.jobs.extract as ex
    ts = []
    for i, x in enumerate(batches):
        sync(dev)
        t = time.perf_counter()
        ex.forward_features(model, x.tolist(), aux)
        sync(dev)
        if i:
            ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def time_extract(model, samples, aux, out: Path, shard_samples: int, batch_tokens: int, writers,
                 **kw) -> tuple[dict, int]:
    """(jobs.extract.extract_samples' result, shard bytes) for `samples` written into `out`,
    which is removed after."""
    import eagle3_runner.jobs.extract as ex
    out.mkdir()
    res = ex.extract_samples(model, samples, aux, out, shard_samples, batch_tokens,
                             progress=False, writers=writers, **kw)
    nbytes = sum(f.stat().st_size for f in out.glob("shard-*"))
    shutil.rmtree(out)
    return res, nbytes


def device_name(dev) -> str:
    import torch
    return (torch.cuda.get_device_name() if str(dev).startswith("cuda")
            else platform.processor() or platform.machine())


def parse_runs(ap, text: str) -> list[tuple[str, int]]:
    """--runs "sorted:128,dataset:128" -> [("sorted", 128), ("dataset", 128)]; ap.error (exit
    2, one line) on anything else."""
    runs = []
    for item in text.split(","):
        order, _, n = item.partition(":")
        if order not in ("sorted", "dataset") or not n.isdigit() or int(n) < 1:
            ap.error(f"--runs: {item!r} is not ORDER:SHARD_SAMPLES with ORDER sorted or dataset "
                     "and SHARD_SAMPLES >= 1, e.g. sorted:128")
        runs.append((order, int(n)))
    return runs


def varlen(args, model, source, dev, dt, aux, batches) -> dict:
    """The --varlen mode: real-data-like lengths, the stage's batching, shard orders and sizes."""
    import random
    import torch
    import eagle3_runner.jobs.extract as ex
    S, V = args.seq, model.config.vocab_size
    rng = random.Random(0)
    samples = []
    for _ in range(args.varlen):  # a length, then its tokens (the sequence BENCHMARKS.md used)
        n = rng.randint(S // 16, S)
        samples.append(([rng.randrange(V) for _ in range(n)], [1] * n))
    tok = sum(len(x[0]) for x in samples)
    rows, plain = [], [time_plain(model, batches, dev)]
    Path(args.out).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.out) as d:
        d = Path(d)
        (d / "warm").mkdir()  # warm-up: allocator, kernels for the bucketed shapes
        ex.extract_samples(model, samples[:64], aux, d / "warm", 64, args.batch_tokens,
                           progress=False, writers=args.writers)
        for order, n in args.runs:
            res, nbytes = time_extract(model, samples, aux, d / "x", n, args.batch_tokens,
                                       args.writers, length_sorted=order == "sorted")
            rows.append({"order": order, "shard_samples": n, "shards": len(res["shards"]),
                         "shard_mib": nbytes / len(res["shards"]) / 2**20,
                         "extract_tok_s": tok / res["seconds"], "sync_s": res["sync_seconds"]})
    plain.append(time_plain(model, batches, dev))
    plain_tok_s = args.batch * S / statistics.mean(plain)
    md = (f"{device_name(dev)}, "
          f"{str(dt).removeprefix('torch.')}, {len(samples)} samples, {tok:,} tokens, "
          f"batch_tokens {args.batch_tokens}; plain {plain_tok_s:,.0f} tok/s "
          f"({args.batch * S / plain[0]:,.0f} before / {args.batch * S / plain[1]:,.0f} after)"
          "\n\n| shard order | shard_samples | shards | MiB per shard | extract tok/s | final fsync s | "
          "**extract / plain** |\n|---|---|---|---|---|---|---|\n")
    for r in rows:
        r["ratio_extract_vs_plain"] = r["extract_tok_s"] / plain_tok_s
        md += (f"| {r['order']} | {r['shard_samples']} | {r['shards']} | {r['shard_mib']:,.0f} | "
               f"{r['extract_tok_s']:,.0f} | {r['sync_s']:.3f} | "
               f"**{r['ratio_extract_vs_plain']:.2f}** |\n")
    out = {"model": source, "samples": len(samples), "tokens": tok, "plain_tok_s": plain_tok_s,
           "batch_tokens": args.batch_tokens, "rows": rows, "torch": torch.__version__}
    (Path(args.out) / "bench_extract_varlen.json").write_text(json.dumps(out, indent=1))
    (Path(args.out) / "bench_extract_varlen.md").write_text(md)
    print(md)
    return out


def sync(dev):
    import torch
    if str(dev).startswith("cuda"):
        torch.cuda.synchronize()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="examples:\n  python scripts/bench/bench_extract.py --device cuda "
                                        "--batch 8 --seq 2048 --batches 128 --rounds 4 "
                                        "--random-init\n  python scripts/bench/bench_extract.py --device "
                                        "cuda --batch 8 --seq 2048 --batches 32 --random-init "
                                        "--varlen 3000 --batch-tokens 65536")
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
    ap.add_argument("--rounds", type=int, default=1,
                    help="repeat plain/capture/extract/write-only this many times; medians")
    ap.add_argument("--varlen", type=int, default=0, metavar="N",
                    help="instead: N samples of lengths uniform in [seq/16, seq] (seeded), "
                         "extracted as the stage does (length-bucketed batches of --batch-tokens) "
                         "once per --runs entry, against plain on full batches")
    ap.add_argument("--runs", default=None,
                    help="with --varlen: ORDER:SHARD_SAMPLES runs, in this order; ORDER sorted = "
                         "the stage's length-sorted shards, dataset = shards in dataset order "
                         "(default sorted:128,dataset:128,sorted:128,dataset:128)")
    ap.add_argument("--batch-tokens", type=int, default=65536, help="with --varlen")
    ap.add_argument("--out", default="runs/bench-extract")
    args = ap.parse_args(argv)
    for name in ("batch", "seq", "batches", "rounds", "batch_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.varlen < 0:
        ap.error("--varlen must be >= 0 (0: the fixed-length mode)")
    if not args.varlen and args.runs is not None:
        ap.error("--runs needs --varlen N")
    if args.varlen and args.rounds != 1:
        ap.error("--rounds is for the fixed-length mode; with --varlen, repeat runs in --runs")
    args.runs = parse_runs(ap, args.runs or "sorted:128,dataset:128,sorted:128,dataset:128")

    import torch
    import eagle3_runner.jobs.extract as ex
    import eagle3_runner.targets.shards as shards
    from eagle3_runner.targets.capture import check_aux_ids
    torch.set_num_threads(args.threads)
    model, source, dev, dt = load_model(args)
    aux = [int(x) for x in args.aux.split(",")]
    check_aux_ids(model, aux)
    B, S, n = args.batch, args.seq, args.batches
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, V, (B, S), generator=g) for _ in range(n + 1)]

    if args.varlen:
        return varlen(args, model, source, dev, dt, aux, batches)
    samples = [(row, [1] * S) for x in batches for row in x.tolist()]
    variants = {"extract": shards.start_writeback, "extract_no_wb": lambda fd: None}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    rounds = []
    with tempfile.TemporaryDirectory(dir=args.out) as d:  # shards go to the --out filesystem
        d = Path(d)
        (d / "warm").mkdir()
        ex.extract_samples(model, samples[:B], aux, d / "warm", B, B * S, progress=False,
                           writers=args.writers)
        for k in range(args.rounds):
            rd = {"plain_before": time_plain(model, batches, dev),
                  "capture": time_capture(model, batches, aux, dev)}
            order = list(variants) if k % 2 == 0 else list(variants)[::-1]
            for name in order:
                shards.start_writeback = variants[name]
                try:
                    res, shard_bytes = time_extract(model, samples[B:], aux, d / name, B, B * S,
                                                    args.writers)
                    rd[name], rd[f"{name}_sync"] = res["seconds"], res["sync_seconds"]
                finally:
                    shards.start_writeback = variants["extract"]
            rd["write_only"] = write_only(d / "write", n, B * S, model, aux, args.writers)
            shutil.rmtree(d / "write")
            rd["plain_after"] = time_plain(model, batches, dev)
            tok = n * B * S
            row = {"round": k + 1, "order": order,
                   "plain_tok_s": B * S / statistics.mean([rd["plain_before"], rd["plain_after"]]),
                   "plain_before_tok_s": B * S / rd["plain_before"],
                   "plain_after_tok_s": B * S / rd["plain_after"],
                   "capture_tok_s": B * S / rd["capture"],
                   "write_only_tok_s": tok / rd["write_only"]}
            for name in variants:
                row[f"{name}_tok_s"] = tok / rd[name]
                row[f"{name}_sync_s"] = rd[f"{name}_sync"]
            for key in ("capture", "write_only", *variants):
                row[f"ratio_{key}_vs_plain"] = row[f"{key}_tok_s"] / row["plain_tok_s"]
            rounds.append(row)
            print(row_md(row), end="", flush=True)
    med = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]
           if key not in ("round", "order")}
    r = {
        "device": str(dev), "device_name": device_name(dev),
        "dtype": str(dt).removeprefix("torch."), "model": source, "batch": B, "seq": S,
        "timed_batches": n, "rounds": rounds, "median": med, "aux_layer_ids": aux,
        "threads": args.threads, "writers": args.writers or ex.default_writers(model),
        "shard_mib": shard_bytes / 2**20,
        "bytes_per_token": shard_bytes / (n * B * S),
        "torch": torch.__version__,
        "ratio_extract_vs_plain": med["ratio_extract_vs_plain"],
    }
    out = Path(args.out)
    (out / "bench_extract.json").write_text(json.dumps(r, indent=1))
    md = (f"{r['device_name']} ({r['device']}), {r['dtype']}, {B}x{S}, {n} timed batches, "
          f"{r['bytes_per_token']:,.0f} bytes/token, {r['writers']} writers\n\n" + HEADER
          + "".join(row_md(x) for x in rounds) + row_md({"round": "median", **med}))
    (out / "bench_extract.md").write_text(md)
    print(md)
    return r


if __name__ == "__main__":
    from eagle3_runner.runner.errors import exit_code
    sys.exit(exit_code(main))
