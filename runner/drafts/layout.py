"""What an EAGLE-3 draft directory looks like to SGLang (docs/eagle3-format.md; SGLang
srt/models/llama_eagle3.py and llama.py).

- config.json: architectures [LlamaForCausalLMEagle3], one decoder layer, draft_vocab_size = the
  rows of lm_head, and the aux layer ids NESTED as eagle_config.eagle_aux_hidden_state_layer_ids
  (SGLang reads only that place).
- Tensor names: `midlayer.*` for the one decoder layer, `fc`, `norm`, `lm_head`, `d2t` (int64
  OFFSETS: target_id = i + d2t[i]), `t2d` (bool [vocab]). load_weights tries a name as-is and with
  a `model.` prefix; anything else is dropped without a word.
- Aux layer ids: SGLang eagle_config id k = the OUTPUT of 0-based decoder layer k = HF
  `hidden_states[k + 1]`; SGLang captures at the input of layer k + 1 inside its layer loop and
  concatenates in ascending layer order. speculators writes HF indices at the top level.
No torch, no numpy.
"""

from __future__ import annotations

ARCH = "LlamaForCausalLMEagle3"
ALGORITHM = "EAGLE3"  # SGLang's is_eagle3() matches exactly this string
AUX_COUNT = 3  # SGLang builds fc over exactly 3 aux hidden states
AUX_IDS_KEY = "eagle_aux_hidden_state_layer_ids"

# tensor names
OPTIONAL = ("embed_tokens.weight", "fc.bias")
KNOWN = ("fc.weight", "lm_head.weight", "norm.weight", "d2t", "t2d", *OPTIONAL)  # besides midlayer.*
TRAINING_PREFIXES = ("draft_model.", "module.")  # SGLang drops these names
MODEL_PREFIX = "model."  # SGLang retries an unknown name as model.<name>
LAYER0, MIDLAYER = "layers.0.", "midlayer."
LAYER_LISTS = ("layers", "midlayers")  # decoder-layer lists of other trainers (SGLang has one layer)


def sglang_name(name: str) -> str:
    """Trainer / speculators tensor name -> SGLang name: the `draft_model.`, `module.` and
    `model.` prefixes stripped (in that order), then `layers.0.x` -> `midlayer.x`."""
    for p in (*TRAINING_PREFIXES, MODEL_PREFIX):
        if name.startswith(p):
            name = name[len(p):]
    if name.startswith(LAYER0):
        name = MIDLAYER + name[len(LAYER0):]
    return name


def speculators_name(name: str) -> str:
    """SGLang tensor name -> vLLM speculators name (`midlayer.x` -> `layers.0.x`)."""
    return LAYER0 + name[len(MIDLAYER):] if name.startswith(MIDLAYER) else name


def is_second_layer(name: str) -> bool:
    """A tensor of a decoder layer other than the first (`layers.1.*`, `midlayers.2.*`):
    an EAGLE-3 draft has one layer and SGLang drops the rest silently."""
    parts = name.split(".")
    return parts[0] in LAYER_LISTS and len(parts) > 1 and parts[1] != "0"


def expected_shapes(cfg: dict) -> dict[str, list[int]]:
    """SGLang tensor names -> shapes for a draft config.json (eagle_config nested form).

    fc [H, n_aux * Ht]; q [nh*hd, 2H]; k/v [nkv*hd, 2H]; o [H, nh*hd]; gate/up [I, H];
    down [H, I]; norms [H]; lm_head [Vd, H]; d2t [Vd]; t2d [V]."""
    H, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    nkv = cfg.get("num_key_value_heads") or nh
    hd = cfg.get("head_dim") or H // nh
    Ht = cfg.get("target_hidden_size") or H
    ids = config_aux_ids(cfg) or [0] * AUX_COUNT
    I, Vd = cfg["intermediate_size"], cfg.get("draft_vocab_size") or cfg["vocab_size"]
    m, a = MIDLAYER + "mlp.", MIDLAYER + "self_attn."
    return {
        "fc.weight": [H, len(ids) * Ht],
        a + "q_proj.weight": [nh * hd, 2 * H], a + "k_proj.weight": [nkv * hd, 2 * H],
        a + "v_proj.weight": [nkv * hd, 2 * H], a + "o_proj.weight": [H, nh * hd],
        m + "gate_proj.weight": [I, H], m + "up_proj.weight": [I, H], m + "down_proj.weight": [H, I],
        "midlayer.input_layernorm.weight": [H], "midlayer.hidden_norm.weight": [H],
        "midlayer.post_attention_layernorm.weight": [H], "norm.weight": [H],
        "lm_head.weight": [Vd, H], "d2t": [Vd], "t2d": [cfg["vocab_size"]],
    }


def layer_shapes(cfg: dict, i: int) -> dict[str, list[int]]:
    """Shapes of decoder layer i >= 1 of an N-layer draft (`layers.{i}.*`; SGLang 0.5.14+
    llama_eagle3.py: only layer 0 takes the 2H concatenation, later layers take H and fuse the
    residual into hidden_norm; input_layernorm is built but unused)."""
    H, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    nkv = cfg.get("num_key_value_heads") or nh
    hd = cfg.get("head_dim") or H // nh
    I, p = cfg["intermediate_size"], f"layers.{i}."
    return {p + "self_attn.q_proj.weight": [nh * hd, H], p + "self_attn.k_proj.weight": [nkv * hd, H],
            p + "self_attn.v_proj.weight": [nkv * hd, H], p + "self_attn.o_proj.weight": [H, nh * hd],
            p + "mlp.gate_proj.weight": [I, H], p + "mlp.up_proj.weight": [I, H],
            p + "mlp.down_proj.weight": [H, I], p + "hidden_norm.weight": [H],
            p + "post_attention_layernorm.weight": [H]}


# tensors of the forward-changing config flags (SGLang 0.5.14+ / 0.5.23 llama_eagle3.py)
FC_NORM = "fc_norm."  # fc_norm.{i}.weight [Ht], one RMSNorm per aux chunk (fc_norm / use_aux_norm)
FC_NORM_LEGACY = {"aux_norm_low": "fc_norm.0", "aux_norm_mid": "fc_norm.1",
                  "aux_norm_high": "fc_norm.2"}  # renamed by 0.5.14+ load_weights
INPUT_NORM = "input_norm.weight"  # [n_aux * Ht], one RMSNorm over the concat (norm_before_fc)


def fc_norm_shapes(cfg: dict, n_aux: int) -> dict[str, list[int]]:
    """fc_norm.{i}.weight -> [Ht] for i < n_aux: the per-aux RMSNorms of fc_norm (SGLang 0.5.14+
    llama_eagle3.py builds one per aux state when config.json sets fc_norm or use_aux_norm)."""
    Ht = cfg.get("target_hidden_size") or cfg["hidden_size"]
    return {f"{FC_NORM}{i}.weight": [Ht] for i in range(n_aux)}
EMBED = "embed_tokens.weight"  # [V, H]: used only when target_hidden_size != hidden_size
O_BIAS = MIDLAYER + "self_attn.o_proj.bias"  # [H]: built when `bias` or `attention_bias`


# ----------------------------------------------------------------------------------------------
# config.json fields

# field -> kind: the typed view every checker reads (config_view); "pos" = int >= 1
CONFIG_FIELDS = {
    **{k: "pos" for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                          "intermediate_size", "vocab_size", "max_position_embeddings",
                          "num_hidden_layers", "target_hidden_size", "num_aux_hidden_states")},
    "draft_vocab_size": "pos_or_null", "rms_norm_eps": "num", "rope_theta": "num",
    "tie_word_embeddings": "bool", "bias": "bool", "attention_bias": "bool", "fc_norm": "bool",
    "use_aux_norm": "bool", "norm_output": "bool", "norm_before_fc": "bool",
    "norm_before_residual": "bool", "rope_scaling": "dict_or_null", "eagle_config": "dict",
    "architectures": "strs", "model_type": "str", "torch_dtype": "str", "dtype": "str",
    "hidden_act": "str",
}
MAX_DIM = 1 << 31  # larger "sizes" are not a model: refused as implausible


def _kind_ok(v, kind: str) -> bool:
    isint = isinstance(v, int) and not isinstance(v, bool)
    return {"pos": isint and 1 <= v < MAX_DIM,
            "pos_or_null": v is None or (isint and 1 <= v < MAX_DIM),
            "num": isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < 1e30,
            "bool": isinstance(v, bool) or v is None, "dict_or_null": v is None or isinstance(v, dict),
            "dict": isinstance(v, dict), "str": isinstance(v, str) or v is None,
            "strs": v is None or isinstance(v, list) and all(isinstance(x, str) for x in v)}[kind]


_KIND_TEXT = {"pos": "a positive integer below 2^31", "pos_or_null": "a positive integer",
              "num": "a positive number", "bool": "true or false", "dict_or_null": "an object or null",
              "dict": "a JSON object", "str": "a string", "strs": "a list of strings"}
_WHY = {"target_hidden_size": " (SGLang reads it with hasattr, so null builds fc from None: a "
                              "TypeError at start; remove the key when the hidden sizes match)"}


def config_view(cfg: dict) -> tuple[dict, list[tuple[str, str]]]:
    """(view, problems): config.json with every CONFIG_FIELDS field of the wrong type removed
    from `view` (so later checks see only well-typed values) and one (field, message) problem
    for each; eagle_config's id list must be a list of ints. Never raises."""
    view, problems = dict(cfg), []
    for k, kind in CONFIG_FIELDS.items():
        if k in view and not _kind_ok(view[k], kind):
            problems.append((k, f"config.json {k} = {_short(view.pop(k))}: must be "
                                f"{_KIND_TEXT[kind]}{_WHY.get(k, '')}."))
    ec = view.get("eagle_config")
    if isinstance(ec, dict) and AUX_IDS_KEY in ec:
        ids = ec[AUX_IDS_KEY]
        if not (isinstance(ids, list) and ids and all(
                isinstance(x, int) and not isinstance(x, bool) and -MAX_DIM < x < MAX_DIM
                for x in ids)):
            problems.append((f"eagle_config.{AUX_IDS_KEY}", f"config.json eagle_config."
                             f"{AUX_IDS_KEY} = {_short(ids)}: must be a non-empty list of "
                             "integers (SGLang eagle_config ids)."))
            view["eagle_config"] = {k: v for k, v in ec.items() if k != AUX_IDS_KEY}
    top = view.get(AUX_IDS_KEY)
    if top is not None and not (isinstance(top, list) and all(
            isinstance(x, int) and not isinstance(x, bool) and 0 <= x < MAX_DIM for x in top)):
        problems.append((AUX_IDS_KEY, f"config.json {AUX_IDS_KEY} = {_short(top)}: must be a "
                         "list of non-negative integers."))
        view.pop(AUX_IDS_KEY)
    return view, problems


def _short(v) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def eagle_config(aux_ids) -> dict:
    """The nested eagle_config block of config.json for these SGLang aux ids."""
    return {AUX_IDS_KEY: list(aux_ids), "use_aux_hidden_state": True}


def config_aux_ids(cfg: dict):
    """eagle_config.eagle_aux_hidden_state_layer_ids of a config.json, or None when absent."""
    return (cfg.get("eagle_config") or {}).get(AUX_IDS_KEY)


def target_rope(cfg: dict) -> tuple:
    """(rope_theta, rope_scaling) of an HF config in either form: top-level `rope_theta` /
    `rope_scaling` (what SGLang reads) or transformers-5 `rope_parameters`."""
    rp = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    theta = cfg.get("rope_theta") or rp.get("rope_theta")
    scaling = cfg.get("rope_scaling")
    if not scaling and (rp.get("rope_type") or rp.get("type")) not in (None, "default"):
        scaling = {k: v for k, v in rp.items() if k != "rope_theta"}
    try:
        theta = float(theta) if theta is not None else None
    except (TypeError, ValueError, OverflowError):
        theta = None
    return theta, (scaling or None)


# ----------------------------------------------------------------------------------------------
# aux layer id conventions


def to_hf_indices(aux_ids) -> list[int]:
    """SGLang ids -> HF hidden_states indices (id k = hidden_states[k + 1])."""
    return [int(k) + 1 for k in aux_ids]


def from_hf_indices(hf_indices) -> list[int]:
    """HF hidden_states indices (speculators' top-level ids) -> SGLang ids."""
    return [int(x) - 1 for x in hf_indices]
