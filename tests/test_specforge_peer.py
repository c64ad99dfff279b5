"""scripts/bench/specforge_peer.py on the CPU: its pieces on a tiny extract artifact (SpecForge's
drafter built by its own code, its Eagle3TrainStrategy step and BF16Optimizer, its exporter,
then `runner inspect` and our loader), with SpecForge's CUDA-only Triton loss swapped for its own
PyTorch reference (`_compute_loss`, the same math) and the sdpa backend; the same on CUDA with
SpecForge's own Triton loss and flex_attention (-m gpu); the script refusing to run without CUDA;
its import check covering every SpecForge import; and (issue 44, without SpecForge) the peer's
inputs equal to what our train stage trained on: a spec like specs/smollm2-recipe-gpu.yaml
(online, a `specforge` variant with only a bench drafter, a `bs16` variant), our train stage run
by `apply`, then the script's own peer_context + setup. The real run is on the GPU
(scripts/gpu/recipe.sh peer)."""

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


def _round_trip(tmp_path, spec, dtype, backend, hidden=32):
    """The peer's steps on a tiny extract: build, train every sample once, evaluate, export
    with SpecForge's exporter, inspect, load into ours."""
    from eagle3_runner.models.draft_model import load_exported
    from eagle3_runner.runner.inspect import inspect_draft
    from eagle3_runner.trainer.recipe import setup
    peer = _peer()
    torch.set_num_threads(2)
    ex = tiny_extract(tmp_path / "extract", n_samples=8, hidden=hidden)
    run = setup(train_ctx(spec, ex, tmp_path / "setup", tmp_path / "db.duckdb"), impl=None)
    steps = peer.order(run.train_ids, 1.0, 1)
    assert sorted(i for s in steps for i in s) == sorted(run.train_ids)  # each sample once
    out = tmp_path / "peer"
    out.mkdir()
    draft, strategy, opt, cfg_path = peer.build_specforge(run, out, run.learner.device,
                                                          dtype, backend, len(steps))
    assert torch.equal(draft.d2t.cpu(), run.learner.model.d2t.cpu())  # our draft vocab
    assert not draft.embed_tokens.weight.requires_grad
    before = {k: v.clone() for k, v in draft.state_dict().items()}
    res = peer.train_specforge(run, strategy, opt, steps, run.learner.device, dtype,
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
    # the bench loads SpecForge's weights (compared on the CPU: the export loads there, the
    # draft trained on CUDA in the gpu case; 2026-12-07 H100: "Expected all tensors to be on
    # the same device")
    assert all(torch.allclose(v.float().cpu(), sd[k].float().cpu(), atol=1e-2)
               for k, v in m.state_dict().items())
    from eagle3_runner.runner.bench_rows import train_samples
    assert train_samples(dest) == len(run.train_ids)


def test_peer_trains_exports_and_the_export_passes_inspect(tmp_path, specforge_on_cpu):
    _round_trip(tmp_path, train_spec(epochs=1.0), torch.float32, "sdpa")


@pytest.mark.gpu
def test_gpu_peer_with_specforges_own_loss_and_flex_attention(tmp_path):
    """What the GPU run calls (scripts/gpu/recipe.sh check gpu): SpecForge's Triton
    LogSoftmaxLoss, flex_attention (compiled), bfloat16, on CUDA."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    try:
        import specforge.algorithms.eagle3.model  # noqa: F401
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"specforge is not importable ({type(e).__name__}: {e})")
    _round_trip(tmp_path, train_spec(epochs=1.0, hidden=64, device="cuda"), torch.bfloat16,
                "flex_attention", hidden=64)  # head_dim 16: flex_attention's smallest


def test_peer_refuses_without_cuda(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _peer().main(["spec.yaml", "--out", str(tmp_path)]) == 2
    assert "needs CUDA" in capsys.readouterr().out
    assert "needs CUDA" in (tmp_path / "peer.log").read_text()


def test_check_imports_covers_every_specforge_import():
    """--check-imports (the device's first call) imports SPECFORGE_MODULES: exactly the SpecForge
    modules the script imports anywhere."""
    import ast
    tree = ast.parse((ROOT / "scripts/bench/specforge_peer.py").read_text())
    used = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
            and (n.module or "").split(".")[0] == "specforge"}
    used |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
             if a.name.split(".")[0] == "specforge"}
    assert used == set(_peer().SPECFORGE_MODULES)


def test_check_imports_reports_a_missing_module(monkeypatch, capsys):
    peer = _peer()
    monkeypatch.setattr(peer, "SPECFORGE_MODULES", ("json", "no_such_module_xyz"))
    assert peer.main(["--check-imports"]) == 1
    out = capsys.readouterr().out
    assert "import json: ok" in out and "import no_such_module_xyz: FAILED" in out


# -- issue 44: the peer's inputs are what our train stage trained on ------------------------------

WORDS = ("the cat sat on a mat while dogs ran far away from home at night under bright stars "
         "and quiet hills near old rivers with green trees").split()


@pytest.fixture
def recipe_like(tmp_path, smollm2_tokenizer):
    """A spec file shaped like specs/smollm2-recipe-gpu.yaml on a tiny random Llama (HF folder,
    SmolLM2's tokenizer) and 12 conversations: online features, data.max_samples, held-out
    samples, a `bs16` variant and a `specforge` variant that overrides only the bench drafter."""
    import yaml
    from engine_helpers import tiny_hf_llama
    tok = smollm2_tokenizer
    model = tiny_hf_llama(vocab=len(tok), hidden=32, layers=4, heads=4, kv=2)
    model.save_pretrained(tmp_path / "target")
    tok.save_pretrained(tmp_path / "target")
    with open(tmp_path / "convs.jsonl", "w") as f:
        for i in range(12):
            q = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(3 + i))
            a = " ".join(WORDS[(3 * i + j) % len(WORDS)] for j in range(6 + i))
            f.write(json.dumps({"messages": [{"role": "user", "content": q},
                                             {"role": "assistant", "content": a}]}) + "\n")
    (tmp_path / "peer-drafter").mkdir()
    spec = {
        "name": "recipe-like", "work_dir": str(tmp_path / "w"),
        "target": {"path": str(tmp_path / "target"), "device": "cpu", "dtype": "float32",
                   "chat_template": "chatml"},
        "drafter": {"aux_layer_ids": [0, 1, 2], "draft_vocab_size": 32},
        "data": {"source": "jsonl", "path": str(tmp_path / "convs.jsonl"), "max_samples": 10,
                 "max_length": 64, "holdout": 0, "seed": 0},
        "stages": {"train": {"features": "online", "num_samples": 6, "ttt_steps": 3,
                             "epochs": 1, "batch_size": 2, "lr": 3e-3, "warmup_steps": 1,
                             "eval_every": 2, "eval_samples": 2, "kernels": "torch"},
                   "export": {},
                   "bench": {"prompt_sets": ["mtbench"], "num_prompts": 1,
                             "max_new_tokens": [8], "configs": [{"num_steps": 2}]}},
        "variants": [{"name": "bs16", "overrides": {"stages.train.batch_size": 4}},
                     {"name": "specforge", "overrides": {
                         "stages.bench.drafter": str(tmp_path / "peer-drafter")}}],
        "results": {"path": str(tmp_path / "results.duckdb")}}
    path = tmp_path / "recipe-like.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_peer_inputs_equal_what_our_train_stage_trained_on(recipe_like, tmp_path):
    """Issue 44's "done when": the `specforge` variant's train stage IS base's (one key, one
    artifact), and the samples the peer script sets up are the ones our train stage trained on:
    the same draft-vocab key (it hashes every sample's token ids and loss mask, which samples
    and both vocab sizes), the same count, the same train parameters; peer.json's same_inputs
    says so. Controls: other data gives another key (same_inputs False); bs16's train stage
    (another key, not run) has no artifact of ours (None)."""
    from eagle3_runner.runner.apply import apply
    from eagle3_runner.runner.plan import build_plan
    from eagle3_runner.runner.spec.load import load_spec, variant_spec
    from eagle3_runner.trainer.recipe import setup
    torch.set_num_threads(2)
    peer = _peer()
    spec = load_spec(recipe_like)
    plan = build_plan(spec, only=("train",), variants=("base",))
    _, outcomes = apply(spec, plan, quiet=True)
    assert [o.status for o in outcomes] == ["done"], [o.error for o in outcomes]
    base_train = next(p for p in plan.stages if (p.variant, p.stage) == ("base", "train"))

    vspec, ctx, ours_dir = peer.peer_context(str(recipe_like), "specforge", [], tmp_path / "p")
    assert ours_dir == Path(base_train.artifact)
    assert ctx.params == spec.stages.train and vspec.data == spec.data
    assert vspec.stages.bench.drafter == str(tmp_path / "peer-drafter")
    run = setup(ctx, impl=None)
    ours = peer._ours(ours_dir)
    same = peer.same_inputs(run, ours)
    assert same["equal"] is True, same
    assert same["train_samples"] == 6 and len(run.eval_ids) == 2
    steps = peer.order(run.train_ids, ctx.params.epochs, 1)  # SpecForge's batches of 1
    assert sorted(i for s in steps for i in s) == sorted(run.train_ids)  # each sample once

    other = load_spec(recipe_like, ["data.seed=1"])  # another draw of 10 conversations
    _, octx, _ = peer.peer_context(str(recipe_like), "specforge", ["data.seed=1"],
                                   tmp_path / "o")
    assert octx.spec.data.seed == other.data.seed == 1
    assert peer.same_inputs(setup(octx, impl=None), ours)["equal"] is False
    _, _, bs16_ours = peer.peer_context(str(recipe_like), "bs16", [], tmp_path / "b")
    assert bs16_ours is None and variant_spec(spec, "bs16").stages.train.batch_size == 4
    assert peer.same_inputs(run, None)["equal"] is None
