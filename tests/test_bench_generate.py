"""scripts/bench/bench_generate.py at tiny sizes on CPU: both modes run and report what BENCHMARKS.md
needs (tok/s of each path, the ratio, the e2e time and output size)."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "bench"))


def test_bench_generate_tiny_cpu(tmp_path, sharegpt_path, smollm2_path):
    import bench_generate
    out = tmp_path / "bg"
    res = bench_generate.main([
        "--random-target", "--geometry", "tiny", "--device", "cpu", "--prompts", "3",
        "--new", "6", "--rows", "2", "--hf-batch", "2", "--mode", "both", "--synthetic", "2",
        "--synthetic-tokens", "6", "--real", "2", "--max-turns", "1", "--max-length", "256",
        "--quiet", "--out", str(out)])
    c, e = res["compare"], res["e2e"]
    assert c["hf"]["tokens"] == c["engine"]["tokens"] > 0  # the same work on both paths
    assert c["ratio"] > 0 and c["engine"]["tok_s"] > 0
    assert e["conversations"] >= 2 and e["seconds"] > 0 and e["mb_per_1k_conversations"] > 0
    assert json.loads(out.with_suffix(".json").read_text())["compare"]["prompts"] == 3
    assert "ratio engine / HF" in out.with_suffix(".md").read_text()


def test_step_mode_refuses_an_unknown_sampling_mode(capsys):
    """--modes with a typo is a usage error naming the flag (it was a KeyError traceback after
    the model was built)."""
    import pytest

    import bench_generate
    with pytest.raises(SystemExit) as e:
        bench_generate.main(["--mode", "step", "--random-target", "--modes", "greedy,fast"])
    assert e.value.code == 2 and "--modes: unknown ['fast']" in capsys.readouterr().err
