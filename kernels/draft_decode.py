"""The drafter's cached step (models/draft_model.Eagle3Draft.cached_step + logits) as fused Triton
kernels, behind the one `kernels` switch (kernels/switch.py).

    draft_forward(drafter, k_cache, v_cache, ids [B, T], input_pos [T] or [B, T], prefix_len [B],
                  tree_mask [T, T] or None, hidden=[B, T, H] | aux=[B, T, 3 Ht], rope=(cos, sin),
                  topk=1, kernels="auto") -> DraftOut

One EAGLE-3 step (models/draft_model.py): h = fc(aux) (step 0, `aux`) or the previous step's
pre-norm output (`hidden`); x = [input_layernorm(embed(ids)), hidden_norm(h)] (2H wide); q/k/v,
RoPE at input_pos, k/v written at slots prefix_len[b] + t; attention under the contract of
kernels/attention.py; h' = h + o_proj; out = h' + mlp(post_attention_layernorm(h')); logits =
lm_head(norm(out)) over the draft vocabulary; ids = its top-k mapped to TARGET ids through d2t
(offsets, clamped to the target vocabulary as engine/steps.py does).

Fused schedule: [fc split-K] -> norm_qkv_rope over both segments (the embedding gather and the
fc partials' sum happen inside it) -> attention -> o_proj split-K -> norm_gate_up -> down_proj
-> norm_head_topk (2 launches): 7 launches per chain step, 8 for step 0.
`rope`: the drafter's RoPE table (rope_table), built once per engine. The engine's chain steps
(engine/steps.py draft_extend, draft_step, draft_chain_greedy, draft_round_greedy) call
draft_forward, so one implementation serves both sides of the switch.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from eagle3_runner.models.draft_model import Eagle3Draft, rope_cos_sin
from eagle3_runner.kernels.switch import resolve_kernels
from eagle3_runner.kernels.llama_decode import even_splits


class DraftOut(NamedTuple):
    """out [B, T, H] (the next step's hidden: the pre-norm output, or its norm with the
    drafter's norm_output); logits [B, T, Vd] float32; ids [B, T, topk] int64 target ids (best
    first); logprobs [B, T, topk] float32."""
    out: torch.Tensor
    logits: torch.Tensor
    ids: torch.Tensor
    logprobs: torch.Tensor


def fused_problem(c) -> str | None:
    """Why the fused step cannot run drafter config `c` (models/draft_model.DraftConfig), or None:
    it implements the plain EAGLE-3 step only, not EAGLE 3.1's fc_norm (a norm per aux chunk
    before the fc split-K) or norm_output (the normed output recycled; norm_head_topk keeps the
    norm inside the head kernel)."""
    on = [f for f in ("fc_norm", "norm_output") if getattr(c, f)]
    if on:
        return (f"the fused draft step (kernels/draft_decode.py) does not implement the "
                f"drafter's {' and '.join(on)} (EAGLE 3.1)")
    return None


def rope_table(drafter: Eagle3Draft, max_seq: int, device=None) -> tuple:
    """(cos, sin) [max_seq, hd] float32 at positions 0..max_seq-1
    (models/draft_model.rope_cos_sin)."""
    c = drafter.config
    dev = device or drafter.fc.weight.device
    return rope_cos_sin(torch.arange(max_seq, device=dev), c.head_dim, c.rope_theta, c.rope_scaling)


def draft_forward(drafter: Eagle3Draft, k_cache, v_cache, ids, input_pos, prefix_len,
                  tree_mask=None, hidden=None, aux=None, rope=None, topk: int = 1,
                  kernels: str = "auto") -> DraftOut:
    """See the module docstring. Exactly one of hidden / aux. Raises ValueError otherwise, for
    an unknown `kernels`, for a missing `rope` on the triton path, and for B > 1 on the torch path
    (cached_step writes one set of slots for every batch row)."""
    if (hidden is None) == (aux is None):
        raise ValueError("draft_forward: pass exactly one of hidden (a chain step) or aux (step 0)")
    if resolve_kernels(kernels, ids.device) == "torch":
        return _forward_torch(drafter, k_cache, v_cache, ids, input_pos, prefix_len, tree_mask,
                              hidden, aux, topk)
    if rope is None:
        raise ValueError("draft_forward: the triton path needs rope = rope_table(drafter, S)")
    if (why := fused_problem(drafter.config)) is not None:
        raise ValueError(f"draft_forward: {why}; use kernels torch")
    return _forward_triton(drafter, k_cache, v_cache, ids, input_pos, prefix_len, tree_mask,
                           hidden, aux, rope, topk)


def _forward_torch(d: Eagle3Draft, kc, vc, ids, input_pos, prefix_len, tree_mask, hidden, aux,
                   topk) -> DraftOut:
    from eagle3_runner.kernels.mask import dense_mask
    from eagle3_runner.kernels.head import head_topk_ref
    B, T = ids.shape
    if B != 1:
        raise ValueError("draft_forward: the torch path (Eagle3Draft.cached_step) takes B == 1")
    h = d.project(aux.to(d.fc.weight.dtype)) if aux is not None else hidden
    slots = prefix_len.long()[0] + torch.arange(T, device=ids.device)
    pos = input_pos if input_pos.dim() == 2 else input_pos[None]
    out = d.cached_step(ids, h, pos, kc, vc, slots, dense_mask(prefix_len, tree_mask, T, kc.shape[2]))
    logits = d.logits(out).float()
    top, lp = head_topk_ref(logits.flatten(0, 1), topk, d.d2t, d.config.vocab_size)
    return DraftOut(out, logits, top.view(B, T, topk), lp.view(B, T, topk))


def _forward_triton(d: Eagle3Draft, kc, vc, ids, input_pos, prefix_len, tree_mask, hidden, aux,
                    rope, topk) -> DraftOut:
    from eagle3_runner.kernels.attention import attention_partials, attention_splits
    from eagle3_runner.kernels.head import norm_head_topk
    from eagle3_runner.kernels.linear import Rows, linear_splitk, norm_gate_up, norm_qkv_rope
    c, ml = d.config, d.midlayer
    B, T = ids.shape
    M, H, nh, hd = B * T, c.hidden_size, c.num_attention_heads, c.head_dim
    eps, dev, dt = c.rms_norm_eps, ids.device, d.fc.weight.dtype
    new = lambda *s: torch.empty(*s, device=dev, dtype=dt)  # noqa: E731
    pos = (input_pos if input_pos.dim() == 2 else input_pos[None].expand(B, T)).reshape(M)
    if aux is not None:  # step 0: h = fc(aux), summed and materialised inside norm_qkv_rope
        fc = d.fc.weight
        hb = new(M, H)
        hrows = Rows(parts=linear_splitk(aux.reshape(M, -1).to(dt), fc, M,
                                         even_splits(fc.shape[1] // 64, 4)), out=hb)
    else:
        hb = hidden.reshape(M, H)
        hrows = Rows(base=hb)
    at, mlp = ml.self_attn, ml.mlp
    q = new(B, T, nh, hd)
    norm_qkv_rope(Rows(base=d.embed_tokens, idx=ids.reshape(M)), ml.input_layernorm.weight,
                  at.q_proj.weight, at.k_proj.weight, at.v_proj.weight, rope[0], rope[1], pos, q,
                  kc, vc, prefix_len, eps, b=hrows, b_g=ml.hidden_norm.weight)
    splits = attention_splits(B, c.num_key_value_heads, kc.shape[2])
    att = attention_partials(q.transpose(1, 2), kc, vc, prefix_len, tree_mask, splits)
    if splits == 1:
        po = linear_splitk(att.transpose(1, 2).reshape(M, nh * hd), at.o_proj.weight, M,
                           even_splits(nh, 4), block_k=hd)
    else:
        po = linear_splitk(None, at.o_proj.weight, M, even_splits(nh, 4), att=att, block_k=hd)
    h2 = new(M, H)
    act = norm_gate_up(Rows(base=hb, parts=po, out=h2), ml.post_attention_layernorm.weight,
                       mlp.gate_proj.weight, mlp.up_proj.weight, eps, M)
    pd = linear_splitk(act, mlp.down_proj.weight, M, even_splits(c.intermediate_size // 64, 2))
    out = new(M, H)
    logits, top, lp = norm_head_topk(Rows(base=h2, parts=pd, out=out), d.norm.weight,
                                     d.lm_head.weight, M, eps, k=topk, d2t=d.d2t,
                                     vocab=c.vocab_size)
    return DraftOut(out.view(B, T, H), logits.view(B, T, -1), top.view(B, T, topk),
                    lp.view(B, T, topk))
