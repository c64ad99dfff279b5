"""The target's decode / verify forward (models/llama.Llama) as fused Triton kernels, behind the
one `kernels` switch (kernels/switch.py).

    target_forward(target, ids [B, W], input_pos [W] or [B, W], prefix_len [B], tree_mask [W, W]
                   or None, last_only=False, topk=1, kernels="auto") -> Out

The mask comes in the attention contract's form (kernels/attention.py): the W new tokens are
written at cache slots prefix_len[b] .. prefix_len[b] + W - 1 and row w attends every slot <
prefix_len[b] plus new slot j iff tree_mask[w, j] (None = causal: decode and chain verify).
input_pos gives the RoPE positions (a tree's: prefix + depth). "torch" runs Llama.forward with
the equivalent slots and dense mask, so both paths compute the same function.

Fused schedule, per layer (5 launches instead of ~10 under inductor; ~150 per token instead of
~300 for a 30-layer model):
    1. norm_qkv_rope: residual rows (the previous layer's h + its down_proj partials) -> RMSNorm
       -> q/k/v -> RoPE -> q, and k/v straight into this layer's static cache
    2. attention over the cache (flash-decoding partials when B * nkv leaves SMs idle)
    3. o_proj, split-K, combining the attention partials on the fly
    4. norm_gate_up: h = x + o_proj partials -> RMSNorm -> silu(gate) * up
    5. down_proj, split-K (its partials are added to h by the next layer's step 1)
then norm_head_topk (final norm + lm_head + top-k partials, and the merge): 2 launches.
The embedding gather happens inside layer 0's step 1. Every launch size depends on (B, W, the
cache size) only, never on prefix_len's values: one CUDA graph per shape, and the same rows give
the same bits (what the engine's losslessness needs: engine/speculative.py `width`).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from eagle3_runner.models.llama import Llama
from eagle3_runner.kernels.switch import resolve_kernels


class Out(NamedTuple):
    """logits [B, T, V] float32 (T = W, or 1 with last_only); aux [B, W, len(aux_ids) * H] (the
    outputs of the aux layers, SGLang ids) or None; ids [B, T, topk] int64 (best first; topk 1 =
    the argmax); logprobs [B, T, topk] float32 (log_softmax at ids)."""
    logits: torch.Tensor
    aux: Optional[torch.Tensor]
    ids: torch.Tensor
    logprobs: torch.Tensor


def even_splits(chunks: int, most: int) -> int:
    """Split-K count for `chunks` reduction chunks: at most `most`, none left empty."""
    chunks = max(1, chunks)
    per = -(-chunks // min(most, chunks))
    return -(-chunks // per)


def target_forward(target: Llama, ids, input_pos, prefix_len, tree_mask=None,
                   last_only: bool = False, topk: int = 1, kernels: str = "auto") -> Out:
    """See the module docstring. prefix_len [B] int32/int64 device tensor. Raises ValueError
    for an unknown `kernels` (kernels.switch.resolve_kernels) or a cache too small for the rows."""
    k = resolve_kernels(kernels, ids.device)
    if k == "torch":
        return forward_torch(target, ids, input_pos, prefix_len, tree_mask, last_only, topk)
    return forward_triton(target, ids, input_pos, prefix_len, tree_mask, last_only, topk)


def forward_torch(target: Llama, ids, input_pos, prefix_len, tree_mask=None,
                  last_only: bool = False, topk: int = 1) -> Out:
    """The reference: Llama.forward with slots = prefix_len + arange(W) and the dense mask."""
    from eagle3_runner.kernels.mask import dense_mask
    from eagle3_runner.kernels.head import head_topk_ref
    B, W = ids.shape
    slots = prefix_len.long()[:, None] + torch.arange(W, device=ids.device)  # [B, W]
    pos = input_pos if input_pos.dim() == 2 else input_pos[None].expand(B, W)
    mask = dense_mask(prefix_len, tree_mask, W, target.max_seq)
    logits, aux = target(ids, pos, last_only, slots, mask)
    top, lp = head_topk_ref(logits.flatten(0, 1), topk)
    T = logits.shape[1]
    return Out(logits, aux, top.view(B, T, topk), lp.view(B, T, topk))


def forward_triton(target: Llama, ids, input_pos, prefix_len, tree_mask=None,
                   last_only: bool = False, topk: int = 1) -> Out:
    """The fused schedule of the module docstring (the caches must be [B, nkv, S, hd] with
    B == ids.shape[0])."""
    from eagle3_runner.kernels.attention import attention_partials, attention_splits
    from eagle3_runner.kernels.head import norm_head_topk
    from eagle3_runner.kernels.linear import Rows, linear_splitk, norm_gate_up, norm_qkv_rope
    c = target.config
    B, W = ids.shape
    M, H, nh, nkv, hd = B * W, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    a0 = target.layers[0].self_attn
    if a0.k_cache is None or a0.k_cache.shape[0] != B or W > target.max_seq:
        got = None if a0.k_cache is None else tuple(a0.k_cache.shape)
        raise ValueError(f"target_forward: cache for {B} rows of up to {target.max_seq} slots "
                         f"needed (setup_cache); got {got}")
    eps, dev, dt = c.rms_norm_eps, ids.device, target.lm_head.weight.dtype
    pos = (input_pos if input_pos.dim() == 2 else input_pos[None].expand(B, W)).reshape(M)
    q = torch.empty(B, W, nh, hd, device=dev, dtype=dt)
    na = len(target.aux_ids)
    aux = torch.empty(M, na * H, device=dev, dtype=dt) if na else None
    x, h = torch.empty(M, H, device=dev, dtype=dt), torch.empty(M, H, device=dev, dtype=dt)
    splits = attention_splits(B, nkv, target.max_seq)
    o_split = even_splits(nh, 4)  # o_proj: K = nh chunks of head_dim
    d_split = even_splits(c.intermediate_size // 64, 4)

    def layer_out(i):  # where layer i's output (= layer i+1's input) is materialised
        if i in target.aux_ids:
            j = target.aux_ids.index(i)
            return aux[:, j * H:(j + 1) * H]
        return x if i < c.num_hidden_layers - 1 else None

    rows = Rows(base=target.embed_tokens.weight, idx=ids.reshape(M), out=x)
    for i, layer in enumerate(target.layers):
        at, mlp = layer.self_attn, layer.mlp
        norm_qkv_rope(rows, layer.input_layernorm.weight, at.q_proj.weight, at.k_proj.weight,
                      at.v_proj.weight, target.rope_cos, target.rope_sin, pos, q, at.k_cache,
                      at.v_cache, prefix_len, eps)
        xi = rows.out
        att = attention_partials(q.transpose(1, 2), at.k_cache, at.v_cache, prefix_len, tree_mask,
                                 splits)
        if splits == 1:
            po = linear_splitk(att.transpose(1, 2).reshape(M, nh * hd), at.o_proj.weight, M,
                               o_split, block_k=hd)
        else:
            po = linear_splitk(None, at.o_proj.weight, M, o_split, att=att, block_k=hd)
        act = norm_gate_up(Rows(base=xi, parts=po, out=h), layer.post_attention_layernorm.weight,
                           mlp.gate_proj.weight, mlp.up_proj.weight, eps, M)
        last = i == c.num_hidden_layers - 1
        pd = linear_splitk(act, mlp.down_proj.weight, M, 1 if last else d_split)
        rows = Rows(base=h, parts=pd, out=layer_out(i))
    logits, top, lp = norm_head_topk(rows, target.norm.weight, target.lm_head.weight, M, eps,
                                     k=topk, block_n=256)
    logits, top, lp = logits.view(B, W, -1), top.view(B, W, topk), lp.view(B, W, topk)
    if last_only:
        logits, top, lp = logits[:, -1:], top[:, -1:], lp[:, -1:]
    return Out(logits, None if aux is None else aux.view(B, W, -1), top, lp)
