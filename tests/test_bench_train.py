"""scripts/bench_train.py at tiny sizes on the CPU: today's step and the fast step measured in one
run, on the same weights and batch (so the same first-step loss), tables written."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def bt():
    spec = importlib.util.spec_from_file_location("bench_train", ROOT / "scripts" / "bench_train.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_baseline_and_fast_rows_share_the_loss(bt, tmp_path):
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
