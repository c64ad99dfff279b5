"""The per-row part of the fused soft cross-entropy as one Triton kernel, beside its reference
kernels/soft_ce.py `soft_ce_rows` (same contract): one program per row, two passes over the
draft vocab (online max/sum-exp, argmax and sum_v p_v z_v; then the gradient, written over the
logits in place). Reads the logits and the target logits twice, writes the gradient once.
`lk_rows_triton`: kernels/soft_ce.py `lk_rows` (the LK term) the same way, with a middle pass
for alpha = sum_v min(pa_v, q_v) and S = sum_v q_v [q_v < pa_v].
"""

import torch
import triton
import triton.language as tl

from eagle3_runner.kernels._triton import check_device


@triton.jit
def _rows_kernel(Z, ZT, LSE_T, TIDX, W, CE, AMAX, V, sz, szt, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(TIDX + row).to(tl.int64)
    w = tl.load(W + row)
    lse_t = tl.load(LSE_T + t)
    z_row, zt_row = Z + row * sz, ZT + t * szt
    m = -float("inf")
    s = 0.0
    pz = 0.0
    best = -float("inf")
    best_i = 0
    for a in range(0, V, BLOCK):
        cols = a + tl.arange(0, BLOCK)
        ok = cols < V
        z = tl.load(z_row + cols, mask=ok, other=-float("inf")).to(tl.float32)
        zt = tl.load(zt_row + cols, mask=ok, other=-float("inf")).to(tl.float32)
        bmax = tl.max(z, 0)
        bidx = tl.argmax(z, 0)  # first maximum within the block
        best_i = tl.where(bmax > best, a + bidx, best_i)  # strict: the first block wins ties
        best = tl.maximum(best, bmax)
        m_new = tl.maximum(m, bmax)
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), 0)
        pz += tl.sum(tl.exp(zt - lse_t) * tl.where(ok, z, 0.0), 0)  # p = 0 off the vocab
        m = m_new
    lse = m + tl.log(s)
    tl.store(CE + row, lse - pz)
    tl.store(AMAX + row, best_i.to(tl.int64))
    for a in range(0, V, BLOCK):
        cols = a + tl.arange(0, BLOCK)
        ok = cols < V
        z = tl.load(z_row + cols, mask=ok, other=0.0).to(tl.float32)
        zt = tl.load(zt_row + cols, mask=ok, other=-float("inf")).to(tl.float32)
        g = (tl.exp(z - lse) - tl.exp(zt - lse_t)) * w
        tl.store(z_row + cols, g.to(Z.dtype.element_ty), mask=ok)


def soft_ce_rows_triton(z, zt, lse_t, tidx, w):
    """kernels/soft_ce.py `soft_ce_rows` as a Triton kernel (CUDA: compiled; CPU: interpreter).
    z [M, Vd] (overwritten with the gradient), zt [R, Vd], lse_t [R] float32, tidx [M] int64,
    w [M] float32 -> (ce [M] float32, argmax [M] int64)."""
    check_device(z.device)
    M, V = z.shape
    if z.stride(1) != 1 or zt.stride(1) != 1:
        raise ValueError("soft_ce_rows_triton: the vocab dimension of z and zt must be contiguous")
    ce = torch.empty(M, device=z.device, dtype=torch.float32)
    amax = torch.empty(M, device=z.device, dtype=torch.int64)
    block = min(4096, triton.next_power_of_2(V)) if z.is_cuda else 16
    _rows_kernel[(M,)](z, zt, lse_t, tidx, w, ce, amax, V, z.stride(0), zt.stride(0),
                       BLOCK=block, num_warps=8 if z.is_cuda else 1)
    return ce, amax


@triton.jit
def _lk_rows_kernel(Z, ZT, LSE_T, LSE_A, TIDX, W, WA, CE, AMAX, LA, V, sz, szt, eps,
                    LOG: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(TIDX + row).to(tl.int64)
    w = tl.load(W + row)
    wa = tl.load(WA + row)
    lse_t = tl.load(LSE_T + t)
    lse_a = tl.load(LSE_A + t)
    z_row, zt_row = Z + row * sz, ZT + t * szt
    m = -float("inf")
    s = 0.0
    pz = 0.0
    best = -float("inf")
    best_i = 0
    for a in range(0, V, BLOCK):  # pass 1: logsumexp, sum_v p_v z_v, argmax
        cols = a + tl.arange(0, BLOCK)
        ok = cols < V
        z = tl.load(z_row + cols, mask=ok, other=-float("inf")).to(tl.float32)
        zt = tl.load(zt_row + cols, mask=ok, other=-float("inf")).to(tl.float32)
        bmax = tl.max(z, 0)
        bidx = tl.argmax(z, 0)
        best_i = tl.where(bmax > best, a + bidx, best_i)
        best = tl.maximum(best, bmax)
        m_new = tl.maximum(m, bmax)
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), 0)
        pz += tl.sum(tl.exp(zt - lse_t) * tl.where(ok, z, 0.0), 0)
        m = m_new
    lse = m + tl.log(s)
    tl.store(CE + row, lse - pz)
    tl.store(AMAX + row, best_i.to(tl.int64))
    alpha = 0.0
    S = 0.0
    for a in range(0, V, BLOCK):  # pass 2: alpha = sum min(pa, q), S = sum q [q < pa]
        cols = a + tl.arange(0, BLOCK)
        ok = cols < V
        z = tl.load(z_row + cols, mask=ok, other=-float("inf")).to(tl.float32)
        zt = tl.load(zt_row + cols, mask=ok, other=-float("inf")).to(tl.float32)
        q = tl.exp(z - lse)
        pa = tl.exp(zt - lse_a)
        below = q < pa
        alpha += tl.sum(tl.where(below, q, pa), 0)
        S += tl.sum(tl.where(below, q, 0.0), 0)
    if LOG:
        tl.store(LA + row, -tl.log(tl.maximum(alpha, eps)))
        ca = tl.where(alpha > eps, -wa / tl.maximum(alpha, eps), 0.0)
    else:
        tl.store(LA + row, 1.0 - alpha)
        ca = -wa
    for a in range(0, V, BLOCK):  # pass 3: the gradient, over the logits
        cols = a + tl.arange(0, BLOCK)
        ok = cols < V
        z = tl.load(z_row + cols, mask=ok, other=0.0).to(tl.float32)
        zt = tl.load(zt_row + cols, mask=ok, other=-float("inf")).to(tl.float32)
        q = tl.exp(z - lse)
        pa = tl.exp(zt - lse_a)
        g = w * (q - tl.exp(zt - lse_t)) + ca * q * (tl.where(q < pa, 1.0, 0.0) - S)
        tl.store(z_row + cols, g.to(Z.dtype.element_ty), mask=ok)


def lk_rows_triton(z, zt, lse_t, tidx, w, lk, eps: float):
    """kernels/soft_ce.py `lk_rows` as a Triton kernel (CUDA: compiled; CPU: interpreter).
    z [M, Vd] (overwritten with the gradient), zt [R, Vd], lse_t [R], tidx [M], w [M], lk:
    soft_ce.LK (lse_all [R] float32, wa [M] float32, log), eps: soft_ce.ALPHA_EPS ->
    (ce [M], argmax [M], la [M])."""
    check_device(z.device)
    M, V = z.shape
    if z.stride(1) != 1 or zt.stride(1) != 1:
        raise ValueError("lk_rows_triton: the vocab dimension of z and zt must be contiguous")
    ce = torch.empty(M, device=z.device, dtype=torch.float32)
    la = torch.empty(M, device=z.device, dtype=torch.float32)
    amax = torch.empty(M, device=z.device, dtype=torch.int64)
    block = min(4096, triton.next_power_of_2(V)) if z.is_cuda else 16
    _lk_rows_kernel[(M,)](z, zt, lse_t, lk.lse_all, tidx, w, lk.wa, ce, amax, la, V,
                          z.stride(0), zt.stride(0), eps, LOG=bool(lk.log),
                          BLOCK=block, num_warps=8 if z.is_cuda else 1)
    return ce, amax, la
