"""End to end: `runner apply` of a tiny real spec (SmolLM2 + ShareGPT), then DuckDB rows.

This is the demo at small size: every stage runs for real on CPU."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3_runner.runner.assets import ASSETS

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent


def tiny_spec(tmp: Path) -> Path:
    spec = f"""
name: e2e-tiny
work_dir: {tmp}/work
target:
  path: {ASSETS['smollm2'].path()}
  chat_template: chatml
drafter:
  algorithm: EAGLE3
  aux_layer_ids: [1, 14, 26]
  draft_vocab_size: 1024
data:
  max_samples: 6
  max_length: 96
  holdout: 2
stages:
  extract: {{batch_tokens: 512, shard_samples: 4}}
  train: {{ttt_steps: 3, epochs: 1, batch_size: 2, eval_every: 2, eval_samples: 1,
          checkpoint_every: 2, warmup_steps: 1}}
  export: {{}}
  bench:
    prompt_sets: [mtbench]
    num_prompts: 2
    max_new_tokens: [12]
    configs: [{{num_steps: 2}}]
results:
  path: {tmp}/results.duckdb
"""
    p = tmp / "tiny.yaml"
    p.write_text(spec)
    return p


def runner(*args, check=True):
    r = subprocess.run([sys.executable, "-m", "eagle3_runner.runner", *args], cwd=ROOT,
                       capture_output=True, text=True)
    if check and r.returncode:
        raise AssertionError(f"runner {args} exit {r.returncode}\n{r.stdout}\n{r.stderr}")
    return r


def test_apply_end_to_end_then_cached(tmp_path):
    if not ASSETS["smollm2"].path().exists():
        pytest.skip("run `runner fetch all` first")
    spec = tiny_spec(tmp_path)
    r = runner("apply", str(spec))
    assert "bench" in r.stderr
    rows = json.loads(runner("query", "SELECT stage, status FROM stages ORDER BY started_at",
                             "--results", str(tmp_path / "results.duckdb"), "--json").stdout)
    assert {(x["stage"], x["status"]) for x in rows} >= {
        ("extract", "done"), ("train", "done"), ("export", "done"), ("bench", "done")}
    summ = json.loads(runner("query", "SELECT tau, spec_tok_s, base_tok_s, lossless FROM "
                             "bench_summary", "--results", str(tmp_path / "results.duckdb"),
                             "--json").stdout)
    assert len(summ) == 1 and summ[0]["tau"] >= 1.0 and summ[0]["lossless"] is True
    # the exported drafter inspects clean
    exp = next((tmp_path / "work" / "export").iterdir())
    assert runner("inspect", str(exp), "--target", str(ASSETS["smollm2"].path())).returncode == 0
    # second apply: everything up to date, nothing runs
    plan = runner("plan", str(spec)).stdout
    assert plan.count("up to date") == 4, plan
    # a changed train field reruns train, export and bench but not extract
    plan = runner("plan", str(spec), "-o", "stages.train.lr=0.001").stdout
    assert "spec changed: train.lr" in plan and plan.count("up to date") == 1, plan
