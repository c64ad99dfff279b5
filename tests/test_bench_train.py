"""scripts/bench/bench_train.py at tiny sizes on the CPU: the reference step, the fast step and online
training measured in one run, on the same weights and batch (so the same first-step loss for the
first two), tables written; a row past its time box is reported, not lost."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts" / "bench"))
import bench_train as bt  # noqa: E402

TINY = ["--device", "cpu", "--geometry", "tiny", "--base", "2,24,64", "--ks", "2", "--seqs", "24",
        "--vocabs", "64", "--batches", "2", "--iters", "1"]


def test_baseline_fast_and_online_rows(tmp_path):
    bt.main(TINY + ["--specforge", "--online", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "bench_train.json").read_text())["rows"]
    by = {r["kind"]: r for r in rows}
    assert set(by) == {"baseline", "fast-torch", "online", "specforge"}
    assert "needs CUDA" in by["specforge"]["error"]
    base, fast, online = by["baseline"], by["fast-torch"], by["online"]
    assert fast["loss"] == pytest.approx(base["loss"], rel=1e-5) and base["loss"] > 1.0
    assert base["x_baseline"] == 1.0 and fast["x_baseline"] > 0
    assert online["x_offline"] == pytest.approx(online["tokens_per_s"] / fast["tokens_per_s"])
    assert online["loss"] > 0 and online["loss"] != pytest.approx(fast["loss"])  # real features
    md = (tmp_path / "bench_train.md").read_text()
    assert "| tiny | fast-torch | 2 | 24 | 64 | 2 |" in md
    assert "error: RuntimeError: the SpecForge" in md


def test_rows_are_time_boxed_and_the_issue_suite_is_exact(tmp_path):
    bt.main(TINY + ["--no-baseline", "--row-timeout", "0.01", "--out", str(tmp_path)])
    [row] = json.loads((tmp_path / "bench_train.json").read_text())["rows"]
    assert row["kind"] == "fast-torch" and row["error"].startswith("timed out after")
    rows = bt.SUITES["issue17"]["rows"]
    kinds = ("baseline", "fast-triton", "specforge", "online")
    assert sorted((r["geometry"], r["batch"], r["kind"]) for r in rows) == sorted(
        [("smollm2", b, k) for b in (1, 4) for k in kinds] + [("kimi-k2.5", 1, "fast-triton")])
    assert {(r["K"], r["seq"], r["vocab"]) for r in rows} == {(7, 2048, 32000)}
    kimi = bt.SUITES["issue37"]["rows"]  # issue 37: the Kimi-K2.5 drafter, ours and SpecForge's
    assert sorted((r["batch"], r["kind"]) for r in kimi) == sorted(
        [(b, k) for b in (1, 2) for k in ("fast-triton", "specforge")] + [(4, "fast-triton")])
    assert {(r["geometry"], r["K"], r["seq"], r["vocab"]) for r in kimi} == {
        ("kimi-k2.5", 7, 2048, 32000)}
    g = bt.GEOMETRIES["kimi-k2.5"]
    assert (g["hidden_size"], 3 * g["hidden_size"]) == (7168, 21504)  # fc 21504 -> 7168
