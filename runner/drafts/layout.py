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


# ----------------------------------------------------------------------------------------------
# config.json fields


def eagle_config(aux_ids) -> dict:
    """The nested eagle_config block of config.json for these SGLang aux ids."""
    return {AUX_IDS_KEY: list(aux_ids), "use_aux_hidden_state": True}


def config_aux_ids(cfg: dict):
    """eagle_config.eagle_aux_hidden_state_layer_ids of a config.json, or None when absent."""
    return (cfg.get("eagle_config") or {}).get(AUX_IDS_KEY)


def target_rope(cfg: dict) -> tuple:
    """(rope_theta, rope_scaling) of an HF config in either form: top-level `rope_theta` /
    `rope_scaling` (what SGLang reads) or transformers-5 `rope_parameters`."""
    rp = cfg.get("rope_parameters") or {}
    theta = cfg.get("rope_theta") or rp.get("rope_theta")
    scaling = cfg.get("rope_scaling")
    if not scaling and (rp.get("rope_type") or rp.get("type")) not in (None, "default"):
        scaling = {k: v for k, v in rp.items() if k != "rope_theta"}
    return (float(theta) if theta is not None else None), (scaling or None)


# ----------------------------------------------------------------------------------------------
# aux layer id conventions


def default_aux_ids(num_layers: int) -> list[int]:
    """SGLang's default when eagle_config has no ids: outputs of [1, L//2-1, L-4]."""
    return [1, num_layers // 2 - 1, num_layers - 4]


def to_hf_indices(aux_ids) -> list[int]:
    """SGLang ids -> HF hidden_states indices (id k = hidden_states[k + 1])."""
    return [int(k) + 1 for k in aux_ids]


def from_hf_indices(hf_indices) -> list[int]:
    """HF hidden_states indices (speculators' top-level ids) -> SGLang ids."""
    return [int(x) - 1 for x in hf_indices]
