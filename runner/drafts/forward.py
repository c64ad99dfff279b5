"""The forward a draft config.json selects and the parameters SGLang builds and loads for it, per
version row of runner/drafts/rules.py (docs/eagle3-format.md, sections 1 and 2).

Read in sglang/srt/models/llama_eagle3.py of 0.5.6, 0.5.14 and 0.5.23:
- forward-changing flags: `fc_norm` / legacy `use_aux_norm` (an RMSNorm per aux chunk, tensors
  `fc_norm.{i}.weight`, legacy `aux_norm_low/mid/high`) and `norm_output` (recycle the normed
  output) are read from 0.5.14; `norm_before_fc` (one RMSNorm over the concatenation,
  `input_norm.weight`; eagle_config first, then the top level) from 0.5.23;
  `num_aux_hidden_states` (fc width) from 0.5.14; speculators' `norm_before_residual` by none.
  0.5.6 reads none of them.
- load_weights: a name containing `d2t` is the draft-to-target map, one containing `t2d` is
  skipped; 0.5.14+ first renames `midlayer` -> `layers.0` and `aux_norm_*` -> `fc_norm.*` by
  substring; then the name is looked up as-is and as `model.<name>` among the parameters; anything
  else is dropped without a word and the module keeps its initial value.
- parameters: fc (bias when `bias`), the decoder layer(s) (`midlayer` on 0.5.6, `layers.N` on
  0.5.14+; q/k/v never have a bias, o_proj has one when `bias` or `attention_bias`), norm,
  lm_head, embed_tokens (replaced by the target's unless target_hidden_size != hidden_size).
Names here are the project's canonical ones (layer 0 as `midlayer.*`); `row` is a
runner.drafts.rules.SglangRules row (not imported: the drafter model imports this module, and its
cache key should not follow the version table). No torch, no numpy.
"""

from __future__ import annotations

from eagle3_runner.runner.drafts.layout import (AUX_COUNT, EMBED, FC_NORM_LEGACY, INPUT_NORM, MIDLAYER,
                                  MODEL_PREFIX, O_BIAS, config_aux_ids, expected_shapes,
                                  fc_norm_shapes, layer_shapes)

FORWARD_FLAGS = {
    "fc_norm": "an RMSNorm per aux chunk before fc",
    "use_aux_norm": "an RMSNorm per aux chunk before fc (fc_norm's legacy name)",
    "norm_output": "the normed output recycled as the next step's hidden",
    "norm_before_fc": "one RMSNorm over the aux concatenation before fc",
    "norm_before_residual": "(speculators) hidden_norm taken before the residual",
}


def flag_on(cfg: dict, flag: str) -> bool:
    """Whether config.json turns `flag` on (SGLang tests truthiness; 0.5.23 reads norm_before_fc
    from eagle_config first, then the top level)."""
    ec = cfg.get("eagle_config") if isinstance(cfg.get("eagle_config"), dict) else {}
    if flag == "norm_before_fc" and "norm_before_fc" in ec:
        return bool(ec["norm_before_fc"])
    return bool(cfg.get(flag))


def reads(row, flag: str) -> bool:
    return flag in row.reads_flags


def n_aux(row, cfg: dict) -> int:
    """How many aux states fc is built for: 3 on 0.5.6; num_aux_hidden_states, else the number of
    eagle_config ids, else 3 on 0.5.14+."""
    if not reads(row, "num_aux_hidden_states"):
        return AUX_COUNT
    if isinstance(cfg.get("num_aux_hidden_states"), int):
        return cfg["num_aux_hidden_states"]
    ids = config_aux_ids(cfg)
    return len(ids) if isinstance(ids, list) and ids else AUX_COUNT


def own_embedding(cfg: dict) -> bool:
    """SGLang keeps the draft's own embed_tokens (no target swap) when target_hidden_size is
    set and differs from hidden_size (llama.py set_embed, all three versions)."""
    th = cfg.get("target_hidden_size")
    return th is not None and th != cfg.get("hidden_size")


def draft_params(row, cfg: dict) -> dict[str, list[int]]:
    """Canonical name -> shape of every parameter SGLang `row` builds for config `cfg` (a typed
    view: runner.drafts.layout.config_view), d2t/t2d excluded. Raises KeyError/TypeError when a
    geometry field is missing."""
    p = {k: v for k, v in expected_shapes(cfg).items() if k not in ("d2t", "t2d")}
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    Ht = cfg.get("target_hidden_size") or H
    n = n_aux(row, cfg)
    p["fc.weight"] = [H, n * Ht]
    p[EMBED] = [V, H]
    if cfg.get("bias"):
        p["fc.bias"] = [H]
    biased = bool(cfg.get("bias") or cfg.get("attention_bias"))
    if biased:
        p[O_BIAS] = [H]
    if (reads(row, "fc_norm") and (flag_on(cfg, "fc_norm") or flag_on(cfg, "use_aux_norm"))):
        p.update(fc_norm_shapes(cfg, n))
    if reads(row, "norm_before_fc") and flag_on(cfg, "norm_before_fc"):
        p[INPUT_NORM] = [n * Ht]
    N = cfg.get("num_hidden_layers") or 1
    if row.multi_layer and N > 1:
        for i in range(1, min(N, 64)):
            p.update(layer_shapes(cfg, i))
            if biased:
                p[f"layers.{i}.self_attn.o_proj.bias"] = [H]
    return p


def optional_params(row, cfg: dict) -> set[str]:
    """Parameters whose absence is not an error on `row`: the embedding when the target's is
    swapped in, an o_proj bias 0.5.14+ initialises to zeros (warned about separately)."""
    opt = set() if own_embedding(cfg) else {EMBED}
    return opt


def _sglang_name(row, canon: str) -> str:
    if canon == "lm_head.weight":
        return canon
    if row.multi_layer and canon.startswith(MIDLAYER):
        canon = "layers.0." + canon[len(MIDLAYER):]
    return MODEL_PREFIX + canon


def resolve(row, name: str, params: dict) -> str | None:
    """The canonical parameter tensor `name` loads into on `row` ("d2t"/"t2d" for the vocab maps),
    or None when load_weights drops it silently."""
    if "d2t" in name:
        return "d2t"
    if "t2d" in name:
        return "t2d"
    n = name
    if row.multi_layer:
        for old, new in {"midlayer": "layers.0", **FC_NORM_LEGACY}.items():
            n = n.replace(old, new)
    table = {_sglang_name(row, k): k for k in params}
    return table.get(n) or table.get(MODEL_PREFIX + n)


def config_flag_findings(row, cfg: dict) -> list[tuple]:
    """(severity, code, key, message(label)) of the forward flags on one row (runner/drafts/
    rules.by_rows merges them over the rows)."""
    out = []
    for flag in ("fc_norm", "use_aux_norm", "norm_output", "norm_before_fc"):
        if flag_on(cfg, flag) and not reads(row, flag):
            out.append(("error", "E_FLAG_IGNORED", flag, lambda v, f=flag: (
                f"config.json {f} = true ({FORWARD_FLAGS[f]}): {v} never reads it "
                "(llama_eagle3.py), so the draft runs without what it was trained with. Serve it "
                f"with a version that reads {f} (0.5.14+" + (", norm_before_fc: 0.5.23" if
                                                           f == "norm_before_fc" else "") +
                ") or retrain without it.")))
    if flag_on(cfg, "norm_before_residual"):
        out.append(("error", "E_FLAG_NEVER_READ", "norm_before_residual", lambda v: (
            f"config.json norm_before_residual = true ({FORWARD_FLAGS['norm_before_residual']}): "
            f"{v} never reads it; its layer takes the residual from the un-normed hidden, so a "
            "drafter trained with the flag runs a different forward. Retrain with "
            "norm_before_residual false.")))
    na = cfg.get("num_aux_hidden_states")
    ids = config_aux_ids(cfg)
    k = len(ids) if isinstance(ids, list) and ids else AUX_COUNT
    if isinstance(na, int) and na != (k if reads(row, "num_aux_hidden_states") else AUX_COUNT):
        out.append(("error", "E_FLAG_NUM_AUX", "num_aux_hidden_states", lambda v: (
            f"config.json num_aux_hidden_states = {na}: " +
            (f"{v} builds fc over {na} aux states but captures {k} (one per eagle_config id). "
             if reads(row, "num_aux_hidden_states") else
             f"{v} ignores it and builds fc over exactly 3 aux states. ") +
            f"Set num_aux_hidden_states: {k} or remove it.")))
    N = cfg.get("num_hidden_layers")
    if isinstance(N, int) and N != 1 and not row.multi_layer:
        out.append(("error", "E_NUM_LAYERS", "num_hidden_layers", lambda v: (
            f"config.json num_hidden_layers = {N}: {v} refuses anything but 1 (ValueError "
            "'EAGLE3 currently only supports 1 layer'). Set num_hidden_layers: 1 and train a "
            "one-layer draft.")))
    ec = cfg.get("eagle_config")
    if isinstance(ec, dict) and ec.get("use_aux_hidden_state") is False \
            and row.reads_use_aux_hidden_state:
        out.append(("error", "E_AUX_DISABLED", "use_aux_hidden_state", lambda v: (
            f"config.json eagle_config.use_aux_hidden_state = false: {v} then captures no aux "
            "hidden states; the draft reads the target's last hidden state and skips fc, "
            "features it was not trained on, so it accepts less (not nothing: the lab's 0.5.14 "
            "draft fell from 1.409 to 1.141). Set it to true.")))
    return out


ENGINE_FLAGS = ("fc_norm", "use_aux_norm", "norm_output")  # the flags models/draft_model.py runs


def engine_unsupported(cfg: dict) -> list[str]:
    """What the embedded engine (models/draft_model.py: one layer, no biases, the target's
    embedding, fc over one state per eagle_config id; fc_norm and norm_output as SGLang 0.5.14
    runs them) does not implement of this config, as 'field = value (what it does)' strings;
    empty when it runs the drafter as SGLang would."""
    out = [f"{f} = true ({d})" for f, d in FORWARD_FLAGS.items()
           if flag_on(cfg, f) and f not in ENGINE_FLAGS]
    out += [f"{f} = true (fc / o_proj biases)" for f in ("bias", "attention_bias") if cfg.get(f)]
    if cfg.get("num_hidden_layers", 1) != 1:
        out.append(f"num_hidden_layers = {cfg.get('num_hidden_layers')} (one layer only)")
    ids = config_aux_ids(cfg)
    na = cfg.get("num_aux_hidden_states")
    if na is not None and not (isinstance(ids, list) and na == len(ids)):
        out.append(f"num_aux_hidden_states = {na} (fc over one state per eagle_config id)")
    if own_embedding(cfg):
        out.append(f"target_hidden_size = {cfg.get('target_hidden_size')} != hidden_size "
                   f"{cfg.get('hidden_size')} (the draft's own embedding)")
    return out
