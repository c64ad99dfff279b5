"""Decode / verify attention over a static KV cache (Triton), with its PyTorch reference.

The contract (shared by the fused target forward, the fused draft step and the batched
regeneration engine): W new query rows per batch row, whose keys/values were already written at
cache slots prefix_len[b] .. prefix_len[b]+W-1.

    decode_attention(q [B, nh, W, hd], k_cache [B, nkv, S, hd], v_cache, prefix_len [B] int,
                     tree_mask [W, W] bool or None) -> [B, nh, W, hd]

Query row w of batch row b attends every slot < prefix_len[b], plus new slot prefix_len[b] + j iff
tree_mask[w, j] (None = causal, j <= w: plain decode and chain verify). GQA: nh % nkv == 0, query
head h reads kv head h // (nh // nkv) (HF repeat_interleave). Scores are scaled by hd ** -0.5.
The same rule as a dense SDPA mask: kernels/mask.py dense_mask. Each row must attend at least
one slot (a row attending none returns zeros; SDPA returns NaN).

The kernel reads only slots < prefix_len + W: its loop bound comes from the device tensor, so one
CUDA graph serves every length. Work split: one program per (batch row, kv head, block of 16
query rows, split of the sequence); the query rows of the nh // nkv heads that share a kv head
are stacked, so each key block is loaded once for all of them. With splits > 1 (flash-decoding:
B * nkv alone would leave most SMs idle) each split writes an unnormalised partial (acc, running
max m, denominator l, scores in log2 units) and a second pass combines them; the fused layer
(kernels/llama_decode.py) does that combine inside its o_proj instead of a separate launch.
Splits depend on (B, nkv, S) only, and key blocks sit at absolute slots (block i in split
i % splits), so a query row meets the same blocks, in the same order, whatever W is and wherever
the prefix ends (blocks it may not attend are exact no-ops): with the fixed 16-row tiles of every
kernel, a row at position p gets the same bits from a 1-row decode at p and from row j of a
W-row verify at p - j (the engine's losslessness, engine/speculative.py `width`).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from eagle3_runner.kernels.mask import dense_mask

BLOCK_M = 16  # query rows per program: fixed, so a row's numerics never depend on W
NEG = tl.constexpr(-1.0e30)  # finite "minus infinity" for running maxima: exp2(NEG - NEG) != NaN


def decode_attention_ref(q, k_cache, v_cache, prefix_len, tree_mask=None) -> torch.Tensor:
    """PyTorch reference of decode_attention (SDPA over the dense mask; same shapes)."""
    W, S = q.shape[2], k_cache.shape[2]
    mask = dense_mask(prefix_len, tree_mask, W, S)
    rep = q.shape[1] // k_cache.shape[1]
    k = k_cache.repeat_interleave(rep, 1) if rep > 1 else k_cache
    v = v_cache.repeat_interleave(rep, 1) if rep > 1 else v_cache
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@torch.compiler.assume_constant_result
def sm_count() -> int:
    """This GPU's SM count (132 without CUDA: an H100/H200). A constant to torch.compile."""
    return (torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
            if torch.cuda.is_available() else 132)


def attention_splits(B: int, nkv: int, S: int, block_n: int = 64,
                     sms: Optional[int] = None) -> int:
    """Sequence splits (a power of 2, 1..16) for B * nkv (batch row, kv head) pairs over a cache
    of S slots: enough programs to cover the SMs (`sms`, default sm_count()), never a split
    shorter than one key block."""
    sms = sm_count() if sms is None else sms
    s = 1
    while s < 16 and B * nkv * s * 2 <= sms and s * 2 * block_n <= S:
        s *= 2
    return s


@triton.jit
def _attn_block(q, kb, vb, sks, svs, tm_ptr, start, total, plen, W, w, rmask, m_i, l_i, acc,
                qk_scale, HD: tl.constexpr, BN: tl.constexpr, TREE: tl.constexpr):
    """One online-softmax step over key slots start .. start+BN-1 (< total = plen + W): prefix
    slots always, new slot plen + j by the tree / causal rule. A block a row may not attend is
    an exact no-op for it (alpha = 1, p = 0)."""
    n = start + tl.arange(0, BN)
    nmask = n < total
    d = tl.arange(0, HD)
    k = tl.load(kb + n[:, None] * sks + d[None, :], mask=nmask[:, None], other=0.0)
    s = (tl.dot(q, tl.trans(k)) * qk_scale).to(tl.float32)  # [BM, BN], log2 units; fp32 always
    j = n - plen  # >= 0: new slot j
    if TREE:
        jj = tl.minimum(tl.maximum(j, 0), W - 1)
        hit = tl.load(tm_ptr + w[:, None] * W + jj[None, :], mask=rmask[:, None], other=0)
        newok = hit != 0
    else:
        newok = j[None, :] <= w[:, None]
    ok = ((j < 0)[None, :] | newok) & nmask[None, :] & rmask[:, None]
    s = tl.where(ok, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    v = tl.load(vb + n[:, None] * svs + d[None, :], mask=nmask[:, None], other=0.0)
    return m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)


@triton.jit
def _attn_kernel(q_ptr, k_ptr, v_ptr, plen_ptr, tm_ptr, o_ptr, pacc_ptr, pm_ptr, pl_ptr,
                 sqb, sqh, sqw, skb, skh, sks, svb, svh, svs, sob, soh, sow,
                 W, NKV, NH, qk_scale,
                 REP: tl.constexpr, HD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                 SPLITS: tl.constexpr, TREE: tl.constexpr):
    """Grid (B * NKV, cdiv(REP * W, BM), SPLITS). Row r of a program's block = query head
    kvh * REP + r // W, new row w = r % W. SPLITS == 1: writes the normalised output o;
    else the partials pacc [SPLITS, B*W, NH*HD], pm/pl [SPLITS, B*W, NH] (float32)."""
    pid = tl.program_id(0)
    b = (pid // NKV).to(tl.int64)
    kvh = pid % NKV
    split = tl.program_id(2)
    r = tl.program_id(1) * BM + tl.arange(0, BM)
    rmask = r < REP * W
    head = kvh * REP + r // W
    w = r % W
    d = tl.arange(0, HD)
    q = tl.load(q_ptr + b * sqb + head[:, None] * sqh + w[:, None] * sqw + d[None, :],
                mask=rmask[:, None], other=0.0)
    plen = tl.load(plen_ptr + b).to(tl.int32)
    total = plen + W
    m_i = tl.full([BM], NEG, tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, HD], tl.float32)
    kb = k_ptr + b * skb + kvh * skh
    vb = v_ptr + b * svb + kvh * svh
    # key blocks at absolute slots [i*BN, (i+1)*BN), block i in split i % SPLITS: what a row meets
    # depends on its own keys only, not on W or where the prefix ends (see the module docstring)
    for blk in range(split, tl.cdiv(total, BN), SPLITS):
        m_i, l_i, acc = _attn_block(q, kb, vb, sks, svs, tm_ptr, blk * BN, total, plen, W, w,
                                    rmask, m_i, l_i, acc, qk_scale, HD, BN, TREE)
    if SPLITS == 1:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(o_ptr + b * sob + head[:, None] * soh + w[:, None] * sow + d[None, :],
                 o.to(o_ptr.dtype.element_ty), mask=rmask[:, None])
    else:
        row = b * W + w  # [BM] row of the [B*W, ...] partial layout
        M = tl.num_programs(0) // NKV * W
        pa = pacc_ptr + (split * M + row[:, None]) * (NH * HD) + head[:, None] * HD + d[None, :]
        tl.store(pa, acc, mask=rmask[:, None])
        tl.store(pm_ptr + (split * M + row) * NH + head, m_i, mask=rmask)
        tl.store(pl_ptr + (split * M + row) * NH + head, l_i, mask=rmask)


@triton.jit
def combine_splits(pacc_ptr, pm_ptr, pl_ptr, rows, rmask, head, M, NH,
                   HD: tl.constexpr, SPLITS: tl.constexpr):
    """Combine SPLITS attention partials of query rows `rows` [BM] (of M = B*W) and one head:
    -> [BM, HD] float32 normalised output (zeros where no slot was attended)."""
    d = tl.arange(0, HD)
    mx = tl.full(rows.shape, NEG, tl.float32)
    for s in tl.static_range(SPLITS):
        mx = tl.maximum(mx, tl.load(pm_ptr + (s * M + rows) * NH + head, mask=rmask, other=NEG))
    num = tl.zeros([rows.shape[0], HD], tl.float32)
    den = tl.zeros(rows.shape, tl.float32)
    for s in tl.static_range(SPLITS):
        a = tl.exp2(tl.load(pm_ptr + (s * M + rows) * NH + head, mask=rmask, other=NEG) - mx)
        den += a * tl.load(pl_ptr + (s * M + rows) * NH + head, mask=rmask, other=0.0)
        part = tl.load(pacc_ptr + (s * M + rows[:, None]) * (NH * HD) + head * HD + d[None, :],
                       mask=rmask[:, None], other=0.0)
        num += a[:, None] * part
    return num / tl.where(den > 0, den, 1.0)[:, None]


@triton.jit
def _combine_kernel(pacc_ptr, pm_ptr, pl_ptr, o_ptr, M, NH, W, sob, soh, sow,
                    HD: tl.constexpr, SPLITS: tl.constexpr, BM: tl.constexpr):
    """Grid (cdiv(M, BM), NH): o[b, h, w] from the partials (standalone decode_attention)."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    rmask = rows < M
    head = tl.program_id(1)
    o = combine_splits(pacc_ptr, pm_ptr, pl_ptr, rows, rmask, head, M, NH, HD, SPLITS)
    d = tl.arange(0, HD)
    b = (rows // W).to(tl.int64)
    ptr = o_ptr + b[:, None] * sob + head * soh + (rows % W)[:, None] * sow + d[None, :]
    tl.store(ptr, o.to(o_ptr.dtype.element_ty), mask=rmask[:, None])


def attention_partials(q, k_cache, v_cache, prefix_len, tree_mask, splits: int,
                       out: Optional[torch.Tensor] = None, block_n: int = 64):
    """Launch the attention kernel. q [B, nh, W, hd] (any strides, hd contiguous); out: the
    normalised output [B, nh, W, hd] view to write when splits == 1 (default a fresh
    [B, W, nh, hd] buffer seen as [B, nh, W, hd]). Returns out (splits == 1) or the partials
    (acc [splits, B*W, nh*hd], m, l [splits, B*W, nh], float32) for combine_splits.
    Raises ValueError for nh % nkv != 0, hd not a power of 2, or a tree_mask not [W, W]."""
    B, nh, W, hd = q.shape
    nkv, S = k_cache.shape[1], k_cache.shape[2]
    if nh % nkv or hd & (hd - 1) or hd < 16:
        raise ValueError(f"decode_attention: nh {nh} % nkv {nkv} != 0 or head_dim {hd} not a "
                         "power of 2 >= 16")
    if tree_mask is not None and tuple(tree_mask.shape) != (W, W):
        raise ValueError(f"decode_attention: tree_mask {tuple(tree_mask.shape)} != ({W}, {W})")
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1 or q.stride(3) != 1:
        raise ValueError("decode_attention: head_dim must be the contiguous dimension")
    rep = nh // nkv
    tm = tree_mask if tree_mask is not None else prefix_len  # any pointer when causal
    if splits == 1:
        o = out if out is not None else q.new_empty(B, W, nh, hd).transpose(1, 2)
        parts = (q, q, q)  # unused: read-only stand-ins (never alias the written output)
    else:
        o = q  # unused
        f = dict(device=q.device, dtype=torch.float32)
        parts = (torch.empty(splits, B * W, nh * hd, **f), torch.empty(splits, B * W, nh, **f),
                 torch.empty(splits, B * W, nh, **f))
    grid = (B * nkv, triton.cdiv(rep * W, BLOCK_M), splits)
    _attn_kernel[grid](q, k_cache, v_cache, prefix_len, tm, o, *parts,
                       q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1),
                       k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
                       o.stride(0), o.stride(1), o.stride(2), W, nkv, nh,
                       math.log2(math.e) / math.sqrt(hd), REP=rep, HD=hd, BM=BLOCK_M, BN=block_n,
                       SPLITS=splits, TREE=tree_mask is not None)
    return o if splits == 1 else parts


def decode_attention(q, k_cache, v_cache, prefix_len, tree_mask=None, splits: Optional[int] = None,
                     block_n: int = 64) -> torch.Tensor:
    """The contract above, in Triton: -> [B, nh, W, hd] (a [B, W, nh, hd] buffer transposed, so
    `.transpose(1, 2).reshape(B, W, nh * hd)` is free). splits: default attention_splits(B, nkv,
    S); 1 = one launch, else two (attention, combine). Errors: see attention_partials."""
    B, nh, W, hd = q.shape
    if splits is None:
        splits = attention_splits(B, k_cache.shape[1], k_cache.shape[2], block_n)
    res = attention_partials(q, k_cache, v_cache, prefix_len, tree_mask, splits, block_n=block_n)
    if splits == 1:
        return res
    o = q.new_empty(B, W, nh, hd).transpose(1, 2)
    _combine_kernel[(triton.cdiv(B * W, BLOCK_M), nh)](*res, o, B * W, nh, W, o.stride(0),
                                                      o.stride(1), o.stride(2), HD=hd,
                                                      SPLITS=splits, BM=BLOCK_M)
    return o
