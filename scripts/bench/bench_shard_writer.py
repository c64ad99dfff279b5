#!/usr/bin/env python
"""Shard-writer benchmark (CPU only, no model): 12 shards of 8 x 2048 tokens in the H200's bf16
layout (75.6 MB each) written by targets.shards.write_shard, with a 30 ms pause between shards
standing in for the GPU forward, then the final fsync pass (sync_shards); with and without
start_writeback (asynchronous writeback right after each shard), alternating, same run.

  python scripts/bench/bench_shard_writer.py [DIR]      # DIR: a folder on the disk to measure (default runs/)
"""
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
import eagle3_runner.targets.shards as shards  # noqa: E402

T, N = 8 * 2048, 12  # tokens per shard, shards per pass


def shard_tensors() -> dict:
    """One shard in the extract layout (targets/features.py): aux [T, 3*576] and last hidden
    [T, 576] in bf16, 8 samples of 2048 tokens."""
    g = torch.Generator().manual_seed(0)
    return {"aux_hidden": torch.randn(T, 1728, generator=g).bfloat16(),
            "last_hidden": torch.randn(T, 576, generator=g).bfloat16(),
            "input_ids": torch.randint(0, 49152, (T,), generator=g),
            "loss_mask": torch.ones(T, dtype=torch.uint8),
            "offsets": torch.arange(0, T + 1, 2048), "sample_ids": torch.arange(T // 2048)}


def one_pass(out: str, t: dict) -> tuple[list, float, float]:
    """Write N shards (30 ms apart), then the final sync. Returns (per-shard s, sync s, total s)."""
    os.sync()
    with tempfile.TemporaryDirectory(dir=out) as d:
        d, per = Path(d), []
        t0 = time.perf_counter()
        for i in range(N):
            a = time.perf_counter()
            shards.write_shard(d / f"shard-{i:05d}.safetensors", t)
            per.append(time.perf_counter() - a)
            time.sleep(0.03)  # the GPU's forward between shards
        s = shards.sync_shards([d / f"shard-{i:05d}.safetensors" for i in range(N)], d)
        return per, s, time.perf_counter() - t0


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else str(ROOT / "runs")
    os.makedirs(out, exist_ok=True)
    t, real = shard_tensors(), shards.start_writeback
    for name in ("no-writeback", "writeback", "no-writeback", "writeback"):
        shards.start_writeback = real if name == "writeback" else (lambda fd: None)
        per, s, tot = one_pass(out, t)
        print(f"{name}: write_shard median {statistics.median(per) * 1e3:.0f} ms (max "
              f"{max(per) * 1e3:.0f}); final sync {s * 1e3:.0f} ms; total {tot * 1e3:.0f} ms",
              flush=True)


if __name__ == "__main__":
    from eagle3_runner.runner.errors import exit_code
    sys.exit(exit_code(main))
