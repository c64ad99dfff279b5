"""scripts/bench_train.py at tiny sizes on the CPU: today's step and the fast step measured in one
run, on the same weights and batch (so the same first-step loss), tables written."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import bench_train as bt  # noqa: E402


def test_baseline_and_fast_rows_share_the_loss(tmp_path):
    bt.main(["--device", "cpu", "--geometry", "tiny", "--base", "2,24,64", "--ks", "2",
             "--seqs", "24", "--vocabs", "64", "--batches", "2", "--iters", "1",
             "--specforge", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "bench_train.json").read_text())["rows"]
    by = {r["kind"]: r for r in rows}
    assert set(by) == {"baseline", "fast-torch", "specforge"}
    assert "needs CUDA" in by["specforge"]["error"]
    base, fast = by["baseline"], by["fast-torch"]
    assert fast["loss"] == pytest.approx(base["loss"], rel=1e-5) and base["loss"] > 1.0
    assert base["x_baseline"] == 1.0 and fast["x_baseline"] > 0
    md = (tmp_path / "bench_train.md").read_text()
    assert "| fast-torch | 2 | 24 | 64 | 2 |" in md and "error: RuntimeError: the SpecForge" in md
