"""The per-row part of the fused soft cross-entropy as one Triton kernel, beside its reference
kernels/soft_ce.py `soft_ce_rows` (same contract): one program per row, two passes over the
draft vocab (online max/sum-exp, argmax and sum_v p_v z_v; then the gradient, written over the
logits in place). Reads the logits and the target logits twice, writes the gradient once.
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
