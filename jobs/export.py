"""Export stage: the trained drafter -> an SGLang draft directory (docs/eagle3-format.md; the
layout is stated once in runner/drafts/layout.py).

Inputs: ctx.inputs["train"] (draft.safetensors = Eagle3Draft.state_dict(), draft_config.json =
DraftConfig.as_dict(), train_metrics.json) and ctx.inputs["extract"] (features.json, the capture
manifest; target_config.json), or, with stages.train.features: online (no extract), the same two
files from the train artifact. Writes into ctx.out_dir:
  config.json        DraftConfig.to_sglang(): LlamaForCausalLMEagle3, draft_vocab_size, eagle_config
                     nested (SGLang ids: k = output of layer k), tie_word_embeddings false,
                     fc_norm / norm_output: true when the drafter has them (EAGLE 3.1),
                     rope_theta/rope_scaling at the top level equal to the target's,
                     max_position_embeddings >= the target's (and the bench context).
  model.safetensors  the state dict itself (names unchanged, fc_norm.{i}.weight with fc_norm):
                     float weights in bf16, d2t int64 offsets [Vd], t2d bool [V].
  provenance.json    resolved spec, capture layers in both conventions, features/artifact hashes,
                     training metrics, the target's config (inspect uses it when no --target).
  speculators/       optional (stages.export.speculators): config with `transformer_layer_config`
                     and top-level HF-index layer ids, tensors `layers.0.*` (vLLM speculators).
Then `runner inspect` runs on the result, for drafter.sglang_version (null: the installed
sglang's, else the newest the table knows); any error fails the stage.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from eagle3_runner.models.draft_model import DraftConfig
from eagle3_runner.runner.bench_curve import SNAPSHOTS, snapshot_name, snapshot_step
from eagle3_runner.runner.drafts.checks import export_aux_problem
from eagle3_runner.runner.drafts.families import target_family
from eagle3_runner.runner.drafts.layout import (AUX_IDS_KEY, config_aux_ids, expected_shapes, fc_norm_shapes,
                                  speculators_name, target_rope, to_hf_indices)
from eagle3_runner.runner.errors import StageError
from eagle3_runner.runner.files import atomic_path, atomic_write, sha256_file
from eagle3_runner.runner.inspect import inspect_draft
from eagle3_runner.runner.stage import StageContext

PROVENANCE_FORMAT = "eagle3-runner-provenance/1"


def _read_json(path: Path, what: str) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise StageError(f"{path}: cannot read the {what} ({e}); re-run the upstream stage.")


def _save_atomic(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})


def sglang_config(dc: DraftConfig, target_cfg: dict, context_length: int | None = None) -> dict:
    """config.json for SGLang. Refuses (StageError) a drafter whose RoPE differs from the target's:
    the draft was trained with dc's RoPE, and SGLang serves it with the config's.
    max_position_embeddings is raised to cover the target's context and the bench context."""
    cfg = dc.to_sglang()
    t_theta, t_scal = target_rope(target_cfg)
    if t_theta is not None and (float(dc.rope_theta) != t_theta or (dc.rope_scaling or None) != t_scal):
        raise StageError(
            f"draft_config.json rope_theta/rope_scaling = {dc.rope_theta}/{dc.rope_scaling}, but the "
            f"target's are {t_theta}/{t_scal}: the drafter was trained with a different RoPE than "
            "the target. Re-run train (DraftConfig.from_spec must read the target's rope fields).")
    need = max(target_cfg.get("max_position_embeddings") or 0, context_length or 0)
    cfg["max_position_embeddings"] = max(cfg["max_position_embeddings"] or 0, need) or 8192
    if target_cfg.get("num_hidden_layers"):
        problem = export_aux_problem(dc.aux_layer_ids, target_cfg["num_hidden_layers"],
                                     target_family(target_cfg))
        if problem:
            raise StageError(problem)
    return cfg


def sglang_tensors(sd: dict[str, torch.Tensor], cfg: dict) -> dict[str, torch.Tensor]:
    """The state dict as SGLang stores it: weights bf16, d2t int64, t2d bool. Names and shapes
    must be exactly expected_shapes(cfg), plus fc_norm.{i}.weight with fc_norm (SGLang drops
    unknown names silently), else StageError."""
    exp = expected_shapes(cfg)
    if cfg.get("fc_norm"):
        exp.update(fc_norm_shapes(cfg, len(config_aux_ids(cfg))))
    if set(sd) != set(exp):
        raise StageError(f"draft.safetensors tensors differ from SGLang's names: missing "
                         f"{sorted(set(exp) - set(sd))}, unexpected {sorted(set(sd) - set(exp))}. "
                         "The train stage must save Eagle3Draft.state_dict() unchanged.")
    bad = {k: (list(v.shape), exp[k]) for k, v in sd.items() if list(v.shape) != exp[k]}
    if bad:
        raise StageError(f"draft.safetensors shapes disagree with draft_config.json: "
                         f"{ {k: f'{a} vs {b}' for k, (a, b) in bad.items()} }.")
    if sd["d2t"].is_floating_point():
        raise StageError("draft.safetensors d2t is a float tensor; it must be int64 offsets.")
    weights = {k: v for k, v in sd.items() if k not in ("d2t", "t2d")}
    nonfloat = sorted(k for k, v in weights.items() if not v.is_floating_point())
    if nonfloat:
        raise StageError(f"draft.safetensors weights {nonfloat[:5]} are not floating point "
                         f"({sd[nonfloat[0]].dtype}); the train stage must save float weights.")
    bad = sorted(k for k, v in weights.items() if not bool(torch.isfinite(v).all()))
    if bad:
        raise StageError(f"draft.safetensors has NaN/Inf weights in {bad[:5]}"
                         f"{' ...' if len(bad) > 5 else ''}: training diverged (a non-finite loss)."
                         " Re-run train (lower lr, check the extracted features).")
    out = {}
    for k, v in sd.items():
        if k == "d2t":
            out[k] = v.to(torch.int64)
        elif k == "t2d":
            out[k] = v.to(torch.bool)
        else:
            out[k] = v.to(torch.bfloat16)
    return {k: v.contiguous() for k, v in out.items()}


def speculators_copy(cfg: dict, tensors: dict[str, torch.Tensor], out: Path,
                     target_path: str, num_steps: int) -> None:
    """vLLM speculators layout: `layers.0.*` names and a top-level layer-id list in the HF
    convention (= SGLang id + 1; notes "three index conventions"). Best effort: checked by
    round-tripping through `runner convert`, not against vLLM itself."""
    keep = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "intermediate_size", "hidden_act", "rms_norm_eps", "rope_theta", "rope_scaling",
            "max_position_embeddings", "vocab_size", "model_type", "num_hidden_layers", "bias")
    ids = config_aux_ids(cfg)
    scfg = {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
        "transformer_layer_config": {k: cfg[k] for k in keep if k in cfg},
        "draft_vocab_size": cfg["draft_vocab_size"], "norm_before_residual": False,
        "target_hidden_size": cfg.get("target_hidden_size"),
        AUX_IDS_KEY: to_hf_indices(ids),
        "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                               "proposal_methods": [{"proposal_type": "greedy",
                                                     "speculative_tokens": num_steps}],
                               "verifier": {"name_or_path": target_path,
                                            "architectures": ["LlamaForCausalLM"]}},
    }
    scfg.update({k: True for k in ("fc_norm", "norm_output") if cfg.get(k)})  # same keys there
    out.mkdir(exist_ok=True)
    _save_atomic({speculators_name(k): v for k, v in tensors.items()}, out / "model.safetensors")
    atomic_write(out / "config.json", json.dumps(scfg, indent=2))


def provenance(ctx: StageContext, manifest: dict, feats_sha: str, dc: DraftConfig,
               target_cfg: dict, metrics: dict) -> dict:
    """What produced this drafter: resolved spec, capture layers (both conventions), hashes."""
    def art(name):
        m = _read_json_opt(Path(ctx.inputs[name]) / "artifact.json")
        return {"dir": str(ctx.inputs[name]), "cache_key": m.get("cache_key"),
                "files": m.get("files", {})}
    return {
        "format": PROVENANCE_FORMAT, "run_id": ctx.run_id, "variant": ctx.variant,
        "spec": ctx.spec.model_dump(mode="json"),
        "features": {
            "aux_layer_ids": manifest.get("aux_layer_ids"),
            "hf_hidden_indices": manifest.get("hf_hidden_indices"),
            "feature_width": manifest.get("feature_width"),
            "num_hidden_layers": manifest.get("num_hidden_layers"),
            "features_json_sha256": feats_sha,
            "target_config_sha256": manifest.get("target_config_sha256"),
            "tokenizer_sha256": manifest.get("tokenizer_sha256"),
            "shards": [{"file": s.get("file"), "sha256": s.get("sha256")}
                       for s in manifest.get("shards", [])],
            "num_samples": manifest.get("num_samples"), "num_tokens": manifest.get("num_tokens")},
        "artifacts": {n: art(n) for n in ("train", "extract") if n in ctx.inputs},
        "draft_config": dc.as_dict(), "train_metrics": metrics, "target_config": target_cfg,
    }


def export_snapshots(tr: Path, out: Path, cfg: dict, metrics: dict) -> int:
    """The train stage's kept drafters (stages.train.snapshots: snapshots/step-NNNNNN.safetensors)
    as SGLang draft directories out/snapshots/step-NNNNNN/ (config.json = `cfg`, the final
    drafter's; model.safetensors; provenance.json with that evaluation's history entry: step,
    samples, tokens, held-out accuracies and simulated chains, and train_metrics.summary's
    train_samples / train_steps at that step, what the bench rows read). Returns how many."""
    from safetensors.torch import load_file
    hist = {h["step"]: h for h in metrics.get("history", [])}
    files = sorted((tr / SNAPSHOTS).glob("step-*.safetensors"))
    selected = (metrics.get("selected") or {}).get("step")
    for f in files:
        step = snapshot_step(f.stem)
        d = out / SNAPSHOTS / snapshot_name(step)
        d.mkdir(parents=True, exist_ok=True)
        _save_atomic(sglang_tensors(load_file(str(f)), cfg), d / "model.safetensors")
        atomic_write(d / "config.json", json.dumps(cfg, indent=2))
        h = hist.get(step, {"step": step})
        atomic_write(d / "provenance.json", json.dumps(
            {"format": PROVENANCE_FORMAT, "snapshot": h, "selected": step == selected,
             "train_metrics": {"summary": {"train_samples": h.get("samples"),
                                           "train_steps": step}}}, indent=1, default=str))
    return len(files)


def _read_json_opt(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def run(ctx: StageContext) -> dict:
    """Stage entry point. Returns {draft_params, model_mb, inspect_warnings}."""
    from safetensors.torch import load_file
    tr, out = Path(ctx.inputs["train"]), Path(ctx.out_dir)
    ex = Path(ctx.inputs["extract"]) if "extract" in ctx.inputs else tr  # online: train has them
    out.mkdir(parents=True, exist_ok=True)
    try:
        sd = load_file(str(tr / "draft.safetensors"))
    except Exception as e:  # noqa: BLE001 - missing or corrupt file: a user-facing error
        raise StageError(f"{tr}/draft.safetensors: cannot read ({e}); re-run train.")
    dcd = _read_json(tr / "draft_config.json", "draft config")
    try:
        dc = DraftConfig(**dcd)
    except TypeError as e:
        raise StageError(f"{tr}/draft_config.json: not a DraftConfig ({e}); re-run train.")
    metrics = _read_json_opt(tr / "train_metrics.json")
    manifest = _read_json(ex / "features.json", "features manifest")
    target_cfg = _read_json(ex / "target_config.json", "target config")
    if list(manifest.get("aux_layer_ids") or []) != list(dc.aux_layer_ids):
        raise StageError(
            f"draft_config.json aux_layer_ids {dc.aux_layer_ids} differ from the layers the "
            f"features were captured at ({manifest.get('aux_layer_ids')}, SGLang convention; HF "
            f"{manifest.get('hf_hidden_indices')}): the exported eagle_config would be wrong. "
            "Re-run train on these features.")
    bench = ctx.spec.stages.bench
    cfg = sglang_config(dc, target_cfg, bench.context_length if bench else None)
    tensors = sglang_tensors(sd, cfg)

    _save_atomic(tensors, out / "model.safetensors")
    atomic_write(out / "config.json", json.dumps(cfg, indent=2))
    prov = provenance(ctx, manifest, sha256_file(ex / "features.json"), dc, target_cfg, metrics)
    prov["export"] = {"model_safetensors_sha256": sha256_file(out / "model.safetensors"),
                      "config_sha256": hashlib.sha256((out / "config.json").read_bytes()).hexdigest()}
    atomic_write(out / "provenance.json", json.dumps(prov, indent=1, default=str))
    if ctx.params is not None and ctx.params.speculators:
        steps = bench.configs[0].num_steps if bench and bench.configs else 3
        speculators_copy(cfg, tensors, out / "speculators", ctx.spec.target.path, steps)
    snaps = export_snapshots(tr, out, cfg, metrics)

    findings = inspect_draft(out, target=ex / "target_config.json",
                             sglang_version=ctx.spec.drafter.sglang_version)
    errors = [f for f in findings if f.severity == "error"]
    if errors:
        raise StageError("the exported drafter fails `runner inspect`:\n" + "\n".join(
            f"  {f.code}: {f.message}" for f in errors))
    for f in findings:
        print(f"export: inspect {f.severity} {f.code}: {f.message}")
    n = sum(v.numel() for k, v in tensors.items() if k not in ("d2t", "t2d"))
    return {"draft_params": (n, "params"), "snapshots": (snaps, "drafters"),
            "model_mb": (os.path.getsize(out / "model.safetensors") / 1e6, "MB"),
            "inspect_warnings": sum(f.severity == "warning" for f in findings)}
