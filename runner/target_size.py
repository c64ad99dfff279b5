"""How big a target is in memory, from its config alone: parameters per group, the bits each
group is held in (dtype or quantization_config), and the activation working set of one forward
of `batch_tokens` tokens. No torch, no weights: `runner plan` calls it (runner/placement.py) and
so does the loader (targets/load.py sizes accelerate's max_memory with `activation_bytes`).

Parameters (HF names; a nested `text_config`, e.g. Kimi-K2.5, is read as runner/target_config.py
flattens it), per decoder layer unless said:
- embed: vocab x hidden; lm_head: the same, 0 when tie_word_embeddings.
- attention: GQA (Llama, Qwen, ...): hidden x (heads + 2 kv_heads) x head_dim + heads x head_dim
  x hidden. MLA (DeepSeek-V2/V3, Kimi-K2/K2.5: kv_lora_rank set): q = hidden x q_lora_rank +
  q_lora_rank x heads x (qk_nope + qk_rope) (or hidden x heads x (qk_nope + qk_rope) without
  q_lora_rank), kv_a = hidden x (kv_lora_rank + qk_rope), kv_b = kv_lora_rank x heads x
  (qk_nope + v_head), o = heads x v_head x hidden, plus the two lora norms.
- mlp: gated, 3 x hidden x intermediate. MoE layers instead hold routed experts (experts x 3 x
  hidden x moe_intermediate), shared experts (DeepSeek: n_shared_experts x 3 x hidden x
  moe_intermediate; Qwen2-MoE: shared_expert_intermediate_size) and a router (experts x hidden).
  Which layers are MoE: DeepSeek/GLM (n_routed_experts) from first_k_dense_replace and every
  moe_layer_freq-th; Qwen-MoE (num_experts) every decoder_sparse_step-th outside mlp_only_layers;
  Mixtral/GPT-OSS (num_local_experts, intermediate_size per expert) every layer.
- norms: 2 x hidden per layer + the final one.
Not counted: biases, multi-token-prediction layers (num_nextn_predict_layers: transformers does
not load them), vision towers of multimodal wrappers (Kimi-K2.5's MoonViT, ~0.4B, ~1 GB bf16).
Kimi-K2.5 by these rules: 1,026B parameters, 1,015B of them routed experts.

Bits per group: the compute dtype's (16 for bf16/fp16, 32 for float32) unless quantization_config
says otherwise for Linear layers, which it does per method as STORED (assuming the loader keeps
them quantized, e.g. compressed-tensors' run_compressed):
- compressed-tensors: each config group's num_bits + 16 / group_size for its bf16 scales
  (+ 16 / group_size more when asymmetric); modules matching `ignore` (exact names or `re:`
  patterns) stay at dtype bits. Kimi-K2.5: int4, group 32, symmetric, on the routed experts only
  = 4.5 bits; 594 GB in all (its checkpoint is ~595 GB).
- fp8: 8 bits (+ an fp32 scale per weight_block_size block); modules_to_not_convert excepted.
- gptq / awq: bits + (16 + bits) / group_size; bitsandbytes: 4.5 (4-bit) or 8 bits;
  mxfp4: 4.25 bits on the experts.
- any other method: dtype bits, said as an upper bound.
Representative module names decide which groups a rule touches (REPRESENTATIVE): the embedding,
the router and the norms are never quantized Linear layers.

Activations (per forward of batch_tokens tokens, in the compute dtype), `activation_bytes`:
per token 8 x hidden (residual, norm, attention and MLP outputs, and the aux + last hidden
states the capture keeps) + the attention projections (3 x heads x qk_head + heads x v_head)
+ 3 x max(intermediate, experts_per_token x moe_intermediate) + 2 x experts_per_token x hidden
for MoE dispatch; plus, unless attention is sdpa / flash_attention_2, the eager score matrices:
batch_tokens x max_length x heads x 8 bytes (bf16 scores, fp32 softmax, bf16 probabilities).
Approximate by design: the plan states it next to its result.
"""

from __future__ import annotations

import math
import re
from typing import Any

DTYPE_BITS = {"float32": 32, "bfloat16": 16, "float16": 16}
# one module name per group, in the HF naming, for matching quantization ignore lists
REPRESENTATIVE = {"attention": "model.layers.1.self_attn.o_proj",
                  "dense_mlp": "model.layers.0.mlp.down_proj",
                  "experts": "model.layers.1.mlp.experts.0.down_proj",
                  "shared_experts": "model.layers.1.mlp.shared_experts.down_proj",
                  "lm_head": "lm_head"}
NEVER_QUANTIZED = ("embed", "router", "norms")
SCORE_BYTES = 8  # eager attention: bf16 scores + fp32 softmax + bf16 probabilities
FUSED_ATTENTION = ("sdpa", "flash_attention_2", "flash_attention_3")


def _i(cfg: dict, *keys: str, default: int = 0) -> int:
    for k in keys:
        v = cfg.get(k)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return default


def _heads(cfg: dict) -> tuple[int, int, int, int]:
    """(heads, kv heads, qk head dim, v head dim)."""
    H = _i(cfg, "hidden_size")
    nh = _i(cfg, "num_attention_heads", default=1) or 1
    nkv = _i(cfg, "num_key_value_heads", default=nh) or nh
    if cfg.get("kv_lora_rank"):
        return nh, nh, _i(cfg, "qk_nope_head_dim") + _i(cfg, "qk_rope_head_dim"), \
            _i(cfg, "v_head_dim", default=_i(cfg, "qk_nope_head_dim"))
    hd = _i(cfg, "head_dim") or H // nh
    return nh, nkv, hd, hd


def _moe(cfg: dict) -> tuple[int, int, int, int, list[bool]]:
    """(routed experts, their intermediate size, shared-experts intermediate, experts per
    token, [layer i is MoE])."""
    L, inter = _i(cfg, "num_hidden_layers"), _i(cfg, "intermediate_size")
    if _i(cfg, "n_routed_experts"):  # DeepSeek-V2/V3, Kimi-K2/K2.5, GLM-4.5+
        E, mi = _i(cfg, "n_routed_experts"), _i(cfg, "moe_intermediate_size", default=inter)
        first, freq = _i(cfg, "first_k_dense_replace"), _i(cfg, "moe_layer_freq", default=1) or 1
        moe = [i >= first and i % freq == 0 for i in range(L)]
        shared = _i(cfg, "n_shared_experts") * mi
    elif _i(cfg, "num_experts"):  # Qwen2/3-MoE
        E, mi = _i(cfg, "num_experts"), _i(cfg, "moe_intermediate_size", default=inter)
        step = _i(cfg, "decoder_sparse_step", default=1) or 1
        dense = set(cfg.get("mlp_only_layers") or [])
        moe = [i not in dense and (i + 1) % step == 0 for i in range(L)]
        shared = _i(cfg, "shared_expert_intermediate_size")
    elif _i(cfg, "num_local_experts"):  # Mixtral, GPT-OSS
        E, mi, moe, shared = _i(cfg, "num_local_experts"), inter, [True] * L, 0
    else:
        return 0, 0, 0, 0, [False] * L
    return E, mi, shared, _i(cfg, "num_experts_per_tok", default=2), moe


def parameter_groups(cfg: dict) -> dict[str, int]:
    """Parameters per group (embed, lm_head, attention, dense_mlp, experts, shared_experts,
    router, norms) of an HF config dict (module docstring). Raises ValueError when hidden_size,
    num_hidden_layers or vocab_size is missing."""
    H, L, V = _i(cfg, "hidden_size"), _i(cfg, "num_hidden_layers"), _i(cfg, "vocab_size")
    if not (H and L and V):
        raise ValueError("the config lacks hidden_size, num_hidden_layers or vocab_size")
    nh, nkv, qk, vd = _heads(cfg)
    if cfg.get("kv_lora_rank"):
        r, qr, rope = _i(cfg, "kv_lora_rank"), _i(cfg, "q_lora_rank"), _i(cfg, "qk_rope_head_dim")
        q = H * qr + qr + qr * nh * qk if qr else H * nh * qk
        attn = q + H * (r + rope) + r + r * nh * (qk - rope + vd) + nh * vd * H
    else:
        attn = H * (nh + 2 * nkv) * qk + nh * vd * H
    E, mi, shared, _k, moe = _moe(cfg)
    inter = _i(cfg, "intermediate_size")
    n_moe = sum(moe)
    return {"embed": V * H, "lm_head": 0 if cfg.get("tie_word_embeddings") else V * H,
            "attention": L * attn, "dense_mlp": (L - n_moe) * 3 * H * inter,
            "experts": n_moe * E * 3 * H * mi, "shared_experts": n_moe * 3 * H * shared,
            "router": n_moe * E * H, "norms": (2 * L + 1) * H}


def quantization_config(cfg: dict) -> dict | None:
    """The config's quantization_config (top level or in text_config), or None."""
    for c in (cfg, cfg.get("text_config")):
        if isinstance(c, dict) and isinstance(c.get("quantization_config"), dict):
            return c["quantization_config"]
    return None


def _matches(name: str, patterns) -> bool:
    """compressed-tensors/transformers module matching: `re:` regex (re.match), else an exact
    name, a dotted suffix, or (transformers' modules_to_not_convert) a substring."""
    for p in patterns or []:
        if not isinstance(p, str):
            continue
        if p.startswith("re:"):
            try:
                if re.match(p[3:], name):
                    return True
            except re.error:
                continue
        elif name == p or name.endswith("." + p) or p in name:
            return True
    return False


def group_bits(cfg: dict, dtype_bits: int) -> tuple[dict[str, float], str]:
    """(bits per parameter group, a description) under the config's quantization_config
    (module docstring); without one every group is at dtype_bits."""
    groups = dict.fromkeys(("embed", "lm_head", "attention", "dense_mlp", "experts",
                            "shared_experts", "router", "norms"), float(dtype_bits))
    q = quantization_config(cfg)
    if q is None:
        return groups, f"{dtype_bits}-bit weights"
    method = str(q.get("quant_method", "?")).lower()
    linear = [g for g in groups if g not in NEVER_QUANTIZED]

    def apply(bits: float, skip, only=None) -> list[str]:
        hit = []
        for g in linear:
            name = REPRESENTATIVE[g]
            if _matches(name, skip) or (only is not None and not _matches(name, only)):
                continue
            groups[g] = min(groups[g], bits)
            hit.append(g)
        return hit

    if method == "compressed-tensors":
        hit = []
        for grp in (q.get("config_groups") or {}).values():
            w = (grp or {}).get("weights") or {}
            nb = w.get("num_bits")
            if not isinstance(nb, (int, float)):
                continue
            gs = w.get("group_size") if w.get("strategy") in ("group", "tensor_group") else None
            extra = (16 / gs) * (1 if w.get("symmetric", True) else 2) if gs else 0.0
            targets = [t for t in grp.get("targets") or [] if t != "Linear"]
            hit += apply(nb + extra, q.get("ignore"), targets if "Linear" not in
                         (grp.get("targets") or []) else None)
    elif method == "fp8":
        blk = q.get("weight_block_size") or []
        extra = 32 / math.prod(blk) if blk else 0.0
        hit = apply(8 + extra, q.get("modules_to_not_convert"))
    elif method in ("gptq", "awq"):
        bits, gs = q.get("bits", 4), q.get("group_size", 128) or 128
        gs = gs if gs > 0 else 4096
        hit = apply(bits + (16 + bits) / gs, list(q.get("modules_to_not_convert") or [])
                    + ([] if q.get("lm_head") else ["lm_head"]))
    elif method == "bitsandbytes":
        bits = 4.5 if q.get("load_in_4bit") else 8.0
        hit = apply(bits, list(q.get("llm_int8_skip_modules") or []) + ["lm_head"])
    elif method == "mxfp4":
        hit = apply(4.25, q.get("modules_to_not_convert"), ["re:.*experts.*"])
    else:
        return groups, (f"unknown quantization method {method!r}: counted at {dtype_bits} bits "
                        "(an upper bound)")
    q_bits = sorted({groups[g] for g in hit})
    what = ", ".join(hit) or "no group"
    return groups, (f"{method} {'/'.join(f'{b:g}' for b in q_bits)}-bit on {what}, the rest "
                    f"{dtype_bits}-bit")


def weight_bytes(cfg: dict, dtype_bits: int) -> dict[str, Any]:
    """{"parameters", "bytes", "groups": {group: (parameters, bits)}, "layer_bytes" (the
    largest decoder layer), "edge_bytes" (max of embedding, lm_head + final norm: what the first
    and last GPU hold besides layers), "how"}. Raises ValueError (parameter_groups)."""
    params = parameter_groups(cfg)
    bits, how = group_bits(cfg, dtype_bits)
    byts = {g: params[g] * bits[g] / 8 for g in params}
    L = _i(cfg, "num_hidden_layers")
    E, _mi, _sh, _k, moe = _moe(cfg)
    n_moe = sum(moe)
    per_attn = byts["attention"] / L
    dense = byts["dense_mlp"] / (L - n_moe) if L - n_moe else 0.0
    sparse = (byts["experts"] + byts["shared_experts"] + byts["router"]) / n_moe if n_moe else 0.0
    norms = byts["norms"] / (2 * L + 1)
    layer = per_attn + max(dense, sparse) + 2 * norms
    return {"parameters": sum(params.values()), "bytes": sum(byts.values()),
            "groups": {g: (params[g], bits[g]) for g in params}, "layer_bytes": layer,
            "edge_bytes": max(byts["embed"], byts["lm_head"] + norms), "how": how}


def activation_bytes(cfg: dict, batch_tokens: int, max_length: int, act_bytes: int,
                     attn_implementation: str = "auto") -> int:
    """Working set of one captured forward of batch_tokens padded tokens (module docstring).
    cfg needs hidden_size; missing head or MLP fields count as 0."""
    H = _i(cfg, "hidden_size")
    nh, _nkv, qk, vd = _heads(cfg) if cfg.get("num_attention_heads") else (0, 0, 0, 0)
    E, mi, _sh, k, moe = _moe(cfg)
    mlp = 3 * max(_i(cfg, "intermediate_size"), k * mi if E else 0)
    per_token = 8 * H + 3 * nh * qk + nh * vd + mlp + (2 * k * H if E else 0)
    scores = 0 if attn_implementation in FUSED_ATTENTION else \
        batch_tokens * min(max_length, batch_tokens) * nh * SCORE_BYTES
    return int(batch_tokens * per_token * act_bytes + scores)
