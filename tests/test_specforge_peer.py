"""scripts/bench/specforge_peer.py on the CPU: its pieces on a tiny extract artifact (SpecForge's
drafter built by its own code, its Eagle3TrainStrategy step and BF16Optimizer, its exporter,
then `runner inspect` and our loader), with SpecForge's CUDA-only Triton loss swapped for its own
PyTorch reference (`_compute_loss`, the same math) and the sdpa backend; and the script itself
refusing to run without CUDA. The real run is on the H200 (scripts/gpu/recipe.sh peer)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from train_helpers import tiny_extract, train_ctx, train_spec  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _peer():
    spec = importlib.util.spec_from_file_location("specforge_peer",
                                                  ROOT / "scripts/bench/specforge_peer.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def specforge_on_cpu(monkeypatch):
    """SpecForge importable, eager (no torch.compile), its Triton loss -> its reference."""
    try:
        import specforge.algorithms.eagle3.model as sfm
        from specforge.core.loss import _compute_loss
    except Exception as e:  # noqa: BLE001 - not installable here
        pytest.skip(f"specforge is not importable ({type(e).__name__}: {e})")
    import torch._dynamo

    class Reference:
        apply = staticmethod(_compute_loss)
    monkeypatch.setattr(sfm, "LogSoftmaxLoss", Reference)
    old = torch._dynamo.config.disable  # set and put back by hand: monkeypatch's undo would
    torch._dynamo.config.disable = True  # delete the config entry (it is not a plain attribute)
    yield
    torch._dynamo.config.disable = old


def test_peer_trains_exports_and_the_export_passes_inspect(tmp_path, specforge_on_cpu):
    from eagle3_runner.models.draft_model import load_exported
    from eagle3_runner.runner.inspect import inspect_draft
    from eagle3_runner.trainer.recipe import setup
    peer = _peer()
    torch.set_num_threads(2)
    ex = tiny_extract(tmp_path / "extract", n_samples=8)
    spec = train_spec(epochs=1.0)
    run = setup(train_ctx(spec, ex, tmp_path / "setup", tmp_path / "db.duckdb"), impl=None)
    steps = peer.order(run.train_ids, 1.0, 1)
    assert sorted(i for s in steps for i in s) == sorted(run.train_ids)  # each sample once
    out = tmp_path / "peer"
    out.mkdir()
    draft, strategy, opt, cfg_path = peer.build_specforge(run, out, run.learner.device,
                                                          torch.float32, "sdpa", len(steps))
    assert torch.equal(draft.d2t.cpu(), run.learner.model.d2t.cpu())  # our draft vocab
    assert not draft.embed_tokens.weight.requires_grad
    before = {k: v.clone() for k, v in draft.state_dict().items()}
    res = peer.train_specforge(run, strategy, opt, steps, run.learner.device, torch.float32,
                               None, print)
    assert res["steps"] == len(steps) and res["train_samples"] == len(run.train_ids)
    assert res["tokens"] > 0 and res["tokens_per_s"] > 0
    assert any(not torch.equal(before[k], v) for k, v in draft.state_dict().items()
               if k.startswith("midlayer"))  # it trained
    ev = peer.held_out(run, draft)
    assert len(ev["acc_step"]) == spec.stages.train.ttt_steps
    dest = tmp_path / "drafter"
    how = peer.export(draft, cfg_path, dest, out, {"train_metrics": {"summary": {
        "train_samples": res["train_samples"]}}})
    assert how.startswith("specforge"), how
    f = inspect_draft(dest, target=run.source.target_config, sglang_version="0.5.14")
    assert [x.code for x in f if x.severity == "error"] == [], [x.message for x in f]
    m = load_exported(dest, run.learner.model.embed_tokens)
    sd = draft.state_dict()
    assert all(torch.allclose(v.float(), sd[k].float(), atol=1e-2)
               for k, v in m.state_dict().items())  # the bench loads SpecForge's weights
    from eagle3_runner.runner.bench_rows import train_samples
    assert train_samples(dest) == len(run.train_ids)


def test_peer_refuses_without_cuda(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _peer().main(["spec.yaml", "--out", str(tmp_path)]) == 2
    assert "needs CUDA" in capsys.readouterr().out
    assert "needs CUDA" in (tmp_path / "peer.log").read_text()
