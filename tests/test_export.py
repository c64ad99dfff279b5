"""Export stage: a drafter saved the way train saves it -> SGLang directory that inspects clean,
with provenance, and an optional speculators copy that `runner convert` turns back into the same
SGLang directory. Bad train artifacts fail the stage with a StageError naming the problem."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from draft_fixtures import used_ids
from eagle3_runner.models.draft_model import DraftConfig, Eagle3Draft, load_exported
from eagle3_runner.jobs.export import run
from eagle3_runner.runner.convert import convert
from eagle3_runner.runner.drafts.safetensors import draft_tensors, tensor_values
from eagle3_runner.runner.inspect import inspect_draft
from eagle3_runner.runner.spec.load import load_spec
from eagle3_runner.runner.errors import StageError
from eagle3_runner.runner.stage import StageContext

torch.set_num_threads(2)


def tiny_target_config(**kw) -> dict:
    """An HF config dict as transformers 5 writes it (rope_theta nested in rope_parameters)."""
    from transformers import LlamaConfig
    base = dict(vocab_size=1000, hidden_size=64, num_hidden_layers=8, num_attention_heads=4,
                num_key_value_heads=2, intermediate_size=128, max_position_embeddings=512,
                rope_theta=100000.0)
    base.update(kw)
    return LlamaConfig(**base).to_dict()


def make_inputs(tmp_path, tcfg, draft_vocab=200, aux=(1, 3, 5), edit=None, speculators=True,
                dc_edit=None, manifest_aux=None):
    """(StageContext, model) with train/ and extract/ artifacts laid out as the real stages do."""
    L, H, V = tcfg["num_hidden_layers"], tcfg["hidden_size"], tcfg["vocab_size"]
    spec = load_spec(data={
        "name": "exp", "work_dir": str(tmp_path / "work"),
        "target": {"path": str(tmp_path / "none.gguf"), "num_hidden_layers": L, "hidden_size": H,
                   "vocab_size": V, "max_position_embeddings": tcfg["max_position_embeddings"]},
        "drafter": {"aux_layer_ids": list(aux), "draft_vocab_size": draft_vocab},
        "stages": {"extract": {}, "train": {}, "export": {"speculators": speculators},
                   "bench": {"configs": [{"num_steps": 3}]}}}, check_target=False)
    dc = DraftConfig.from_spec(spec, tcfg)
    if dc_edit:
        dc_edit(dc)
    g = torch.Generator().manual_seed(0)
    model = Eagle3Draft(dc)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
        u = torch.from_numpy(used_ids(draft_vocab, V))
        model.d2t.copy_(u - torch.arange(draft_vocab))
        model.t2d.zero_()
        model.t2d[u] = True
    if edit:
        edit(model)
    tr, ex = tmp_path / "train", tmp_path / "extract"
    tr.mkdir()
    ex.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tr / "draft.safetensors"))
    (tr / "draft_config.json").write_text(json.dumps(dc.as_dict()))
    (tr / "train_metrics.json").write_text(json.dumps({"final_loss": 1.25, "steps": 10}))
    ma = list(manifest_aux or aux)
    (ex / "features.json").write_text(json.dumps({
        "format": "eagle3-features/1", "aux_layer_ids": ma, "hf_hidden_indices": [k + 1 for k in ma],
        "feature_width": 3 * H, "num_hidden_layers": L,
        "shards": [{"file": "shard-00000.safetensors", "num_samples": 2, "sha256": "ab" * 32}]}))
    (ex / "target_config.json").write_text(json.dumps(tcfg))
    for d in (tr, ex):
        (d / "artifact.json").write_text(json.dumps({"cache_key": d.name + "-key", "files": {}}))
    ctx = StageContext(spec=spec, stage="export", variant="base", run_id="r1",
                       inputs={"train": tr, "extract": ex}, out_dir=tmp_path / "export.partial",
                       db_path=tmp_path / "results.duckdb")
    return ctx, model


def test_export_is_sglang_format_and_inspects_clean(tmp_path):
    tcfg = tiny_target_config()
    ctx, model = make_inputs(tmp_path, tcfg)
    metrics = run(ctx)
    out = ctx.out_dir
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert cfg["draft_vocab_size"] == 200 and cfg["vocab_size"] == 1000
    assert cfg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 3, 5],
                                   "use_aux_hidden_state": True}
    assert cfg["tie_word_embeddings"] is False and "target_hidden_size" not in cfg
    assert cfg["rope_theta"] == 100000.0 and cfg["rope_scaling"] is None  # the target's, top level
    assert cfg["max_position_embeddings"] >= 512
    # model.safetensors: the state dict itself; weights bf16, d2t int64, t2d bool
    ts = draft_tensors(out)
    sd = model.state_dict()
    assert set(ts) == set(sd)
    assert {k: t["dtype"] for k, t in ts.items() if k not in ("d2t", "t2d")} == \
        {k: "BF16" for k in sd if k not in ("d2t", "t2d")}
    assert ts["d2t"]["dtype"] == "I64" and ts["t2d"]["dtype"] == "BOOL"
    np.testing.assert_array_equal(tensor_values(ts["d2t"]), sd["d2t"].numpy())
    loaded = load_file(str(out / "model.safetensors"))
    for k, v in sd.items():
        want = v if k in ("d2t", "t2d") else v.to(torch.bfloat16)
        assert torch.equal(loaded[k], want), k
    # our own loader reads it back (strict names)
    load_exported(out, torch.zeros(1000, 64))
    # inspect: clean with the target given, and clean through provenance's target_config
    assert inspect_draft(out, target=ctx.inputs["extract"] / "target_config.json") == []
    assert inspect_draft(out) == []
    prov = json.loads((out / "provenance.json").read_text())
    assert prov["features"]["aux_layer_ids"] == [1, 3, 5]
    assert prov["features"]["hf_hidden_indices"] == [2, 4, 6]
    assert len(prov["features"]["features_json_sha256"]) == 64
    assert prov["train_metrics"]["final_loss"] == 1.25
    assert prov["spec"]["drafter"]["draft_vocab_size"] == 200
    assert prov["artifacts"]["train"]["cache_key"] == "train-key"
    assert metrics["inspect_warnings"] == 0 and metrics["draft_params"][0] > 0


def test_speculators_copy_converts_back_to_the_same_drafter(tmp_path):
    ctx, _ = make_inputs(tmp_path, tiny_target_config())
    run(ctx)
    spec_dir = ctx.out_dir / "speculators"
    scfg = json.loads((spec_dir / "config.json").read_text())
    assert scfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 6]  # HF indices
    assert any(k.startswith("layers.0.") for k in draft_tensors(spec_dir))
    back = tmp_path / "back"
    convert(spec_dir, back, ctx.inputs["extract"] / "target_config.json")
    a, b = draft_tensors(ctx.out_dir), draft_tensors(back)
    assert set(a) == set(b)
    for k in a:
        np.testing.assert_array_equal(tensor_values(a[k]), tensor_values(b[k]), err_msg=k)
    cb = json.loads((back / "config.json").read_text())
    assert cb["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]
    assert cb["torch_dtype"] == "bfloat16"  # written explicitly (--dtype auto: float16 else)
    notes = json.loads((back / "convert.json").read_text())["notes"]
    assert any("norm_before_residual: false dropped" in n for n in notes)


def _absolute(model):
    model.d2t.copy_(model.d2t + torch.arange(len(model.d2t)))


@pytest.mark.parametrize("kw,match", [
    (dict(edit=_absolute), "E_D2T_ABSOLUTE"),
    (dict(manifest_aux=(1, 3, 6)), "captured"),
    (dict(dc_edit=lambda dc: setattr(dc, "rope_theta", 10000.0)), "RoPE"),
    (dict(edit=lambda m: m.midlayer.mlp.up_proj.weight.data.__setitem__((0, 0), float("nan"))),
     "NaN/Inf weights"),  # a diverged training (issue 21)
    (dict(aux=(2, 3, 5), deepseek=True), "first id must be 1"),  # the DeepSeek rule (issue 20)
])
def test_bad_train_artifact_fails_the_stage(tmp_path, kw, match):
    tcfg = tiny_target_config()
    if kw.pop("deepseek", False):
        tcfg.update(architectures=["DeepseekV3ForCausalLM"], model_type="kimi_k2")
    ctx, _ = make_inputs(tmp_path, tcfg, speculators=False, **kw)
    with pytest.raises(StageError, match=match):
        run(ctx)


def test_missing_train_file_is_a_stage_error(tmp_path):
    ctx, _ = make_inputs(tmp_path, tiny_target_config(), speculators=False)
    (ctx.inputs["train"] / "draft.safetensors").unlink()
    with pytest.raises(StageError, match="re-run train"):
        run(ctx)


def test_smollm2_geometry_export_inspects_clean_against_the_gguf(tmp_path, smollm2_path):
    """SmolLM2 (L=30, H=576, 9 heads, 3 kv, V=49152): target read from the real GGUF header."""
    from eagle3_runner.runner.target_config import read_target_config
    tcfg = read_target_config(smollm2_path)
    ctx, _ = make_inputs(tmp_path, tcfg, draft_vocab=1024, aux=(1, 14, 26), speculators=False)
    run(ctx)
    cfg = json.loads((ctx.out_dir / "config.json").read_text())
    assert cfg["hidden_size"] == 576 and cfg["head_dim"] == 64 and cfg["num_key_value_heads"] == 3
    assert cfg["rope_theta"] == tcfg["rope_theta"]
    assert cfg["max_position_embeddings"] >= tcfg["max_position_embeddings"]
    assert inspect_draft(ctx.out_dir, target=smollm2_path) == []


def test_export_writes_each_kept_drafter_as_an_sglang_draft(tmp_path):
    """stages.train.snapshots: every snapshots/step-N.safetensors of the train artifact becomes
    snapshots/step-N/ (config.json, bf16 model.safetensors our loader reads back, provenance with
    that evaluation's step, samples and chains, and whether it is the selected one)."""
    tcfg = tiny_target_config()
    ctx, model = make_inputs(tmp_path, tcfg)
    tr = ctx.inputs["train"]
    (tr / "snapshots").mkdir()
    sd = model.state_dict()
    for step in (10, 20):
        save_file({k: (v * step if v.is_floating_point() else v).contiguous()
                   for k, v in sd.items()}, str(tr / "snapshots" / f"step-{step:06d}.safetensors"))
    chain = {"3": {"tau": 1.4, "accept_per_pos": [0.3, 0.08, 0.02], "rounds": 99}}
    (tr / "train_metrics.json").write_text(json.dumps({
        "history": [{"step": 10, "samples": 40, "tokens": 4000, "chain": chain},
                    {"step": 20, "samples": 80, "tokens": 8000, "chain": chain}],
        "selected": {"step": 20, "by": "tau", "num_steps": 3}}))
    assert run(ctx)["snapshots"] == (2, "drafters")
    for step, sel in ((10, False), (20, True)):
        d = ctx.out_dir / "snapshots" / f"step-{step:06d}"
        assert json.loads((d / "config.json").read_text()) == \
            json.loads((ctx.out_dir / "config.json").read_text())
        got = load_exported(d, torch.zeros(1000, 64))
        assert torch.equal(got.fc.weight, (sd["fc.weight"] * step).to(torch.bfloat16).float())
        prov = json.loads((d / "provenance.json").read_text())
        assert prov["selected"] is sel and prov["snapshot"]["samples"] == 4 * step
        assert prov["train_metrics"]["summary"]["train_samples"] == 4 * step
        assert inspect_draft(d, target=ctx.inputs["extract"] / "target_config.json") == []
