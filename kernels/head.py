"""Final RMSNorm + lm_head + argmax / top-k (Triton), with the PyTorch reference.

norm_head_topk(rows, g, w [V, H]) -> logits [M, V] float32 (kept for sampling), the top-k
token ids [M, k] (greedy verify: k = 1 is the argmax; tree drafting: up to eagle_topk = 8) and
their log-probabilities [M, k]. Two launches: the head kernel (one program per BN vocabulary
columns and 16 rows: the rows' logits, the block's top k and its logsumexp partial), then one
program per row merging the blocks. Ties go to the lower token id (torch.argmax's first maximum).
An optional `d2t` maps draft ids to target ids (SGLang offsets: target = i + d2t[i]), clamped to
[0, vocab) as engine/steps.py does.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from eagle3_runner.kernels.linear import BM, Rows, norm_chunk, rms_ref, rows_ref


@triton.jit
def _head_kernel(a_base, a_bs, a_idx, a_part, a_out, a_os, g_ptr, w_ptr, logit_ptr, tv_ptr,
                 ti_ptr, bm_ptr, bs_ptr, M, V, H, NB, eps,
                 BN: tl.constexpr, BK: tl.constexpr, BMc: tl.constexpr, TOPK: tl.constexpr,
                 A_BASE: tl.constexpr, A_GATHER: tl.constexpr, A_PARTS: tl.constexpr,
                 A_WRITE: tl.constexpr):
    """Grid (NB = cdiv(V, BN), cdiv(M, BMc)). Writes logits, tv/ti [M, NB, TOPK] (the block's
    top values / ids) and bm/bs [M, NB] (block max, sum of exp(logit - max))."""
    pid = tl.program_id(0)
    rows = tl.program_id(1) * BMc + tl.arange(0, BMc)
    rmask = rows < M
    n = pid * BN + tl.arange(0, BN)
    nmask = n < V
    DT = w_ptr.dtype.element_ty
    acc = tl.zeros([BMc, BN], tl.float32)
    ss = tl.zeros([BMc], tl.float32)
    for k0 in range(0, H, BK):
        kk = k0 + tl.arange(0, BK)
        xg, sq = norm_chunk(a_base, a_bs, a_idx, a_part, a_out, a_os, g_ptr, M, H, rows, kk,
                            pid == 0, BMc, BK, A_BASE, A_GATHER, A_PARTS, A_WRITE, DT)
        ss += sq
        w = tl.load(w_ptr + n[:, None].to(tl.int64) * H + kk[None, :],
                    mask=nmask[:, None] & (kk < H)[None, :], other=0.0)
        acc += tl.dot(xg, tl.trans(w))
    y = acc * tl.rsqrt(ss / H + eps)[:, None]
    m2 = rmask[:, None] & nmask[None, :]
    tl.store(logit_ptr + rows[:, None].to(tl.int64) * V + n[None, :], y, mask=m2)
    y = tl.where(nmask[None, :], y, float("-inf"))
    bmax = tl.max(y, 1)
    tl.store(bm_ptr + rows * NB + pid, bmax, mask=rmask)
    tl.store(bs_ptr + rows * NB + pid, tl.sum(tl.exp(y - bmax[:, None]), 1), mask=rmask)
    for t in tl.static_range(TOPK):
        i = tl.argmax(y, 1, tie_break_left=True)  # [BMc], within the block
        tl.store(tv_ptr + (rows * NB + pid) * TOPK + t, tl.max(y, 1), mask=rmask)
        tl.store(ti_ptr + (rows * NB + pid) * TOPK + t, pid * BN + i, mask=rmask)
        y = tl.where(tl.arange(0, BN)[None, :] == i[:, None], float("-inf"), y)


@triton.jit
def _merge_kernel(tv_ptr, ti_ptr, bm_ptr, bs_ptr, d2t_ptr, ov_ptr, oi_ptr, NB, VT,
                  TOPK: tl.constexpr, NC: tl.constexpr, NBP: tl.constexpr,
                  HAS_D2T: tl.constexpr):
    """Grid (M,): row m's top TOPK over its NB blocks' candidates (NC >= NB * TOPK, NBP >= NB,
    powers of 2) -> ov [M, TOPK] log-probabilities, oi [M, TOPK] int64 ids."""
    m = tl.program_id(0)
    c = tl.arange(0, NC)
    cm = c < NB * TOPK
    vals = tl.load(tv_ptr + m * NB * TOPK + c, mask=cm, other=float("-inf"))
    ids = tl.load(ti_ptr + m * NB * TOPK + c, mask=cm, other=0)
    nb = tl.arange(0, NBP)
    bmax = tl.load(bm_ptr + m * NB + nb, mask=nb < NB, other=float("-inf"))
    bsum = tl.load(bs_ptr + m * NB + nb, mask=nb < NB, other=0.0)
    mx = tl.max(bmax, 0)
    lse = mx + tl.log(tl.sum(bsum * tl.exp(bmax - mx), 0))
    for t in tl.static_range(TOPK):
        j = tl.argmax(vals, 0, tie_break_left=True)
        v = tl.max(vals, 0)
        tok = tl.sum(tl.where(c == j, ids, 0), 0).to(tl.int64)
        if HAS_D2T:
            tok = tl.minimum(tl.maximum(tok + tl.load(d2t_ptr + tok), 0), VT - 1)
        tl.store(ov_ptr + m * TOPK + t, v - lse)
        tl.store(oi_ptr + m * TOPK + t, tok)
        vals = tl.where(c == j, float("-inf"), vals)


def norm_head_topk(a: Rows, g: torch.Tensor, w: torch.Tensor, M: int, eps: float, k: int = 1,
                   d2t: Optional[torch.Tensor] = None, vocab: Optional[int] = None,
                   block_n: int = 128, block_k: int = 64):
    """rows a [M, H], RMSNorm weight g [H], w [V, H] contiguous -> (logits [M, V] float32,
    ids [M, k] int64 (mapped through d2t and clamped to [0, vocab) when d2t is given),
    logprobs [M, k] float32 (log_softmax of the logits at those ids)), best first."""
    V, H = w.shape
    nb = triton.cdiv(V, block_n)
    f32 = dict(device=w.device, dtype=torch.float32)
    logits = torch.empty(M, V, **f32)
    tv, bm, bs = torch.empty(M, nb, k, **f32), torch.empty(M, nb, **f32), torch.empty(M, nb, **f32)
    ti = torch.empty(M, nb, k, device=w.device, dtype=torch.int32)
    h, gt, p, wr = a.flags()
    _head_kernel[(nb, triton.cdiv(M, BM))](*a.args(w), g, w, logits, tv, ti, bm, bs, M, V, H, nb,
                                           eps, BN=block_n, BK=block_k, BMc=BM, TOPK=k,
                                           A_BASE=h, A_GATHER=gt, A_PARTS=p, A_WRITE=wr)
    ov = torch.empty(M, k, **f32)
    oi = torch.empty(M, k, device=w.device, dtype=torch.int64)
    _merge_kernel[(M,)](tv, ti, bm, bs, w if d2t is None else d2t, ov, oi, nb, vocab or V, TOPK=k,
                        NC=triton.next_power_of_2(nb * k), NBP=triton.next_power_of_2(nb),
                        HAS_D2T=d2t is not None)
    return logits, oi, ov


def head_topk_ref(logits: torch.Tensor, k: int = 1, d2t: Optional[torch.Tensor] = None,
                  vocab: Optional[int] = None):
    """Reference of the top-k half: logits [M, V] -> (ids [M, k], logprobs [M, k]); k = 1 is
    torch.argmax (first maximum)."""
    lp = torch.log_softmax(logits.float(), -1)
    if k == 1:
        ids = logits.argmax(-1, keepdim=True)
        vals = lp.gather(-1, ids)
    else:
        vals, ids = lp.topk(k, -1)
    if d2t is not None:
        ids = (ids + d2t[ids]).clamp(0, (vocab or logits.shape[-1]) - 1)
    return ids, vals


def norm_head_topk_ref(a: Rows, g, w, M: int, eps: float, k: int = 1, d2t=None, vocab=None, **_):
    """Reference of norm_head_topk (the models' lm_head(norm(x)).float(), then head_topk_ref)."""
    logits = (rms_ref(rows_ref(a, w.dtype), g, eps) @ w.T).float()
    return (logits, *head_topk_ref(logits, k, d2t, vocab))
