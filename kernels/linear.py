"""Fused RMSNorm + projection kernels (Triton) for decode/verify with few rows, with references.

Rows M = B * W (<= ~64): every matmul here is a GEMV-like stream over the weights, bound by
latency and bandwidth, never by FLOPs. So each kernel spreads the output columns (and, for the
split-K kernel, the reduction) over many programs, each multiplying a [16, BK] tile of the rows by
a [BN, BK] tile of the weight (tl.dot, float32 accumulation). 16 rows per program whatever M:
a row's bits never depend on how many rows run, nor on the values of the others.

The residual stream never makes a round trip through a separate add/norm kernel. A kernel's input
rows are `Rows`: base[m] (or base[idx[m]], an embedding gather) + the sum of P float32 partials
[P, M, K] that a split-K producer left behind, rounded to the weight dtype as the reference rounds
its residual adds; the program with column block 0 also writes those rows out (`Rows.out`) for
the next consumer. RMSNorm is folded in a single pass: y = rstd * ((x * g) @ W^T), with rstd from
the same loop (every program recomputes it: M * K reads, trivial), since rstd is one scalar per
row. Rounding therefore differs from the reference (which rounds x * rstd and then * g to bf16);
the tests bound the difference, the engine's losslessness needs only determinism per row count.

Kernels: norm_qkv_rope (RMSNorm [+ a second RMSNorm'd segment: the drafter's 2H input] -> q, k, v
projections -> RoPE -> q buffer, k/v written into the static cache at prefix_len + w),
norm_gate_up (RMSNorm -> gate/up -> silu(gate) * up), linear_splitk (x @ W^T into float32
partials; x may be the attention partials, combined on the fly: o_proj, down_proj, the drafter's
fc). The lm_head is in kernels/head.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Optional

import torch
import triton
import triton.language as tl

from eagle3_runner.models.draft_model import RMSNorm, apply_rope
from eagle3_runner.models.llama import write_cache
from eagle3_runner.kernels.attention import BLOCK_M, combine_splits

BM = BLOCK_M  # rows per program (see the module docstring)


@dataclass
class Rows:
    """A kernel's input rows, value base[idx[m] or m] + sum_s parts[s, m] (see module doc).
    base [N0, K] (unit column stride); idx [M] int64 (gather) or None; parts [P, M, K] float32
    contiguous or None; out [M, K] (unit column stride) to write the rows to, or None."""
    base: Optional[torch.Tensor] = None
    idx: Optional[torch.Tensor] = None
    parts: Optional[torch.Tensor] = None
    out: Optional[torch.Tensor] = None

    def value(self, dtype=None) -> torch.Tensor:
        """Reference: the rows [M, K] (rounded to `dtype` when there are parts)."""
        x = None if self.base is None else (self.base if self.idx is None else self.base[self.idx])
        if self.parts is not None:
            s = self.parts.sum(0)
            x = (s if x is None else x.float() + s).to(dtype or s.dtype)
        return x

    def args(self, dummy: torch.Tensor) -> tuple:
        """(base, base row stride, idx, parts, out, out row stride) with `dummy` for None."""
        b, o = self.base, self.out
        return (dummy if b is None else b, 0 if b is None else b.stride(0),
                dummy if self.idx is None else self.idx, dummy if self.parts is None else self.parts,
                dummy if o is None else o, 0 if o is None else o.stride(0))

    def flags(self) -> tuple:
        """(HAS_BASE, GATHER, PARTS, WRITE) constexprs."""
        return (self.base is not None, self.idx is not None,
                0 if self.parts is None else self.parts.shape[0], self.out is not None)


def rms_ref(x: torch.Tensor, g: torch.Tensor, eps: float) -> torch.Tensor:
    """The models' own RMSNorm (models/draft_model.py) as a function of its weight g."""
    return RMSNorm.forward(SimpleNamespace(weight=g, eps=eps), x)


def rows_ref(r: "Rows", dtype) -> torch.Tensor:
    """Rows.value in `dtype`, also written to Rows.out, as the kernels do."""
    x = r.value(dtype).to(dtype)
    if r.out is not None:
        r.out.copy_(x)
    return x


@triton.jit
def load_rows(base_ptr, base_stride, idx_ptr, part_ptr, out_ptr, out_stride, M, K, rows, cols,
              write, BMc: tl.constexpr, BKc: tl.constexpr, HAS_BASE: tl.constexpr,
              GATHER: tl.constexpr, PARTS: tl.constexpr, WRITE: tl.constexpr,
              DT: tl.constexpr):
    """x [BMc, BKc] float32 = Rows value at (rows, cols), zero outside M x K; written to out when
    WRITE and `write` (the program chosen to materialise them)."""
    rmask = rows < M
    mask = rmask[:, None] & (cols < K)[None, :]
    x = tl.zeros([BMc, BKc], tl.float32)
    if HAS_BASE:
        if GATHER:
            r = tl.load(idx_ptr + rows, mask=rmask, other=0).to(tl.int64)
        else:
            r = rows.to(tl.int64)
        x += tl.load(base_ptr + r[:, None] * base_stride + cols[None, :], mask=mask,
                     other=0.0).to(tl.float32)
    for s in tl.static_range(PARTS):
        x += tl.load(part_ptr + (s * M + rows[:, None]) * K + cols[None, :], mask=mask, other=0.0)
    if PARTS > 0:
        x = x.to(DT).to(tl.float32)
    if WRITE:
        if write:
            tl.store(out_ptr + rows[:, None].to(tl.int64) * out_stride + cols[None, :],
                     x.to(out_ptr.dtype.element_ty), mask=mask)
    return x


@triton.jit
def norm_chunk(base_ptr, base_stride, idx_ptr, part_ptr, out_ptr, out_stride, g_ptr, M, K, rows,
               cols, write, BMc: tl.constexpr, BKc: tl.constexpr, HAS_BASE: tl.constexpr,
               GATHER: tl.constexpr, PARTS: tl.constexpr, WRITE: tl.constexpr,
               DT: tl.constexpr):
    """One K-chunk of the single-pass RMSNorm: (x * g in DT [BMc, BKc], sum of x^2 [BMc])."""
    x = load_rows(base_ptr, base_stride, idx_ptr, part_ptr, out_ptr, out_stride, M, K, rows, cols,
                  write, BMc, BKc, HAS_BASE, GATHER, PARTS, WRITE, DT)
    g = tl.load(g_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
    return (x * g[None, :]).to(DT), tl.sum(x * x, 1)


@triton.jit
def _qkv_kernel(a_base, a_bs, a_idx, a_part, a_out, a_os, a_g,
                b_base, b_bs, b_idx, b_part, b_out, b_os, b_g,
                wq, wk, wv, cos_ptr, sin_ptr, pos_ptr, cs_stride,
                q_ptr, sqb, sqw, sqh, kc_ptr, skb, skh, sks, vc_ptr, svb, svh, svs, plen_ptr,
                M, W, H, eps, NH, NKV,
                HD: tl.constexpr, BD: tl.constexpr, BK: tl.constexpr, BMc: tl.constexpr,
                A_BASE: tl.constexpr, A_GATHER: tl.constexpr, A_PARTS: tl.constexpr,
                A_WRITE: tl.constexpr, NSEG: tl.constexpr, B_BASE: tl.constexpr,
                B_GATHER: tl.constexpr, B_PARTS: tl.constexpr, B_WRITE: tl.constexpr):
    """Grid (NH + 2 NKV, HD // 2 // BD, cdiv(M, BMc)): program (head, c) computes columns
    c*BD.. and HD/2 + c*BD.. of one q/k/v head (the two halves RoPE pairs)."""
    head = tl.program_id(0)
    c = tl.program_id(1)
    rows = tl.program_id(2) * BMc + tl.arange(0, BMc)
    KW = H * NSEG  # weight row length
    if head < NH:
        w_ptr = wq + head * HD * KW
    elif head < NH + NKV:
        w_ptr = wk + (head - NH) * HD * KW
    else:
        w_ptr = wv + (head - NH - NKV) * HD * KW
    DT = wq.dtype.element_ty
    c1 = c * BD + tl.arange(0, BD)
    c2 = c1 + HD // 2
    write = (head == 0) & (c == 0)
    y1 = tl.zeros([BMc, BD], tl.float32)
    y2 = tl.zeros([BMc, BD], tl.float32)
    for seg in tl.static_range(NSEG):
        acc1 = tl.zeros([BMc, BD], tl.float32)
        acc2 = tl.zeros([BMc, BD], tl.float32)
        ss = tl.zeros([BMc], tl.float32)
        for k0 in range(0, H, BK):
            kk = k0 + tl.arange(0, BK)
            if seg == 0:
                xg, sq = norm_chunk(a_base, a_bs, a_idx, a_part, a_out, a_os, a_g, M, H, rows, kk,
                                    write, BMc, BK, A_BASE, A_GATHER, A_PARTS, A_WRITE, DT)
            else:
                xg, sq = norm_chunk(b_base, b_bs, b_idx, b_part, b_out, b_os, b_g, M, H, rows, kk,
                                    write, BMc, BK, B_BASE, B_GATHER, B_PARTS, B_WRITE, DT)
            ss += sq
            kmask = (kk < H)[None, :]
            w1 = tl.load(w_ptr + c1[:, None] * KW + seg * H + kk[None, :], mask=kmask, other=0.0)
            w2 = tl.load(w_ptr + c2[:, None] * KW + seg * H + kk[None, :], mask=kmask, other=0.0)
            acc1 += tl.dot(xg, tl.trans(w1))
            acc2 += tl.dot(xg, tl.trans(w2))
        rstd = tl.rsqrt(ss / H + eps)
        y1 += acc1 * rstd[:, None]
        y2 += acc2 * rstd[:, None]
    y1 = y1.to(DT).to(tl.float32)  # the projection's output dtype, as in the reference
    y2 = y2.to(DT).to(tl.float32)
    rmask = (rows < M)[:, None]
    b = (rows // W).to(tl.int64)
    w = rows % W
    if head < NH + NKV:  # RoPE (HF rotate_half: x * cos + cat(-x2, x1) * sin)
        p = tl.load(pos_ptr + rows, mask=rows < M, other=0).to(tl.int64)
        cb = p[:, None] * cs_stride
        cos1 = tl.load(cos_ptr + cb + c1[None, :], mask=rmask, other=0.0).to(tl.float32)
        cos2 = tl.load(cos_ptr + cb + c2[None, :], mask=rmask, other=0.0).to(tl.float32)
        sin1 = tl.load(sin_ptr + cb + c1[None, :], mask=rmask, other=0.0).to(tl.float32)
        sin2 = tl.load(sin_ptr + cb + c2[None, :], mask=rmask, other=0.0).to(tl.float32)
        o1 = y1 * cos1 - y2 * sin1
        o2 = y2 * cos2 + y1 * sin2
    else:
        o1 = y1
        o2 = y2
    if head < NH:
        dst = q_ptr + b[:, None] * sqb + w[:, None] * sqw + head * sqh
    else:
        slot = (tl.load(plen_ptr + b, mask=rows < M, other=0).to(tl.int64) + w)[:, None]
        if head < NH + NKV:
            dst = kc_ptr + b[:, None] * skb + (head - NH) * skh + slot * sks
        else:
            dst = vc_ptr + b[:, None] * svb + (head - NH - NKV) * svh + slot * svs
    tl.store(dst + c1[None, :], o1.to(q_ptr.dtype.element_ty), mask=rmask)
    tl.store(dst + c2[None, :], o2.to(q_ptr.dtype.element_ty), mask=rmask)


def norm_qkv_rope(a: Rows, a_g, wq, wk, wv, cos, sin, pos, q, k_cache, v_cache, prefix_len,
                  eps: float, b: Optional[Rows] = None, b_g=None, block_d: int = 16,
                  block_k: int = 64) -> None:
    """q/k/v of M = B*W rows. a: the rows [M, H] (RMSNorm weight a_g [H]); b, b_g: an optional
    second segment (the weights then take [a_norm, b_norm], 2H wide: the drafter's layer).
    wq [nh*hd, KW], wk/wv [nkv*hd, KW]; cos/sin [P, hd] tables indexed by pos [M] int64;
    writes q [B, W, nh, hd] (any strides, hd contiguous) and k/v into the caches [B, nkv, S, hd]
    at slot prefix_len[b] + w. Raises ValueError on a geometry the kernel does not tile."""
    B, W, nh, hd = q.shape
    M, H = B * W, a_g.shape[0]
    nkv = k_cache.shape[1]
    if hd % (2 * block_d) or wq.shape[1] != H * (1 if b is None else 2):
        raise ValueError(f"norm_qkv_rope: head_dim {hd} not a multiple of 2 * {block_d}, or "
                         f"weights {tuple(wq.shape)} do not take {'2H' if b else 'H'} = {H} inputs")
    for t in (wq, wk, wv, cos, sin):
        if t.stride(-1) != 1:
            raise ValueError("norm_qkv_rope: weights and RoPE tables need unit column stride")
    b = b or Rows()
    grid = (nh + 2 * nkv, hd // 2 // block_d, triton.cdiv(M, BM))
    _qkv_kernel[grid](*a.args(wq), a_g, *b.args(wq), a_g if b_g is None else b_g, wq, wk, wv,
                      cos, sin, pos, cos.stride(0), q, q.stride(0), q.stride(1), q.stride(2),
                      k_cache, *k_cache.stride()[:3], v_cache, *v_cache.stride()[:3], prefix_len,
                      M, W, H, eps, nh, nkv, HD=hd, BD=block_d, BK=block_k, BMc=BM,
                      A_BASE=a.flags()[0], A_GATHER=a.flags()[1], A_PARTS=a.flags()[2],
                      A_WRITE=a.flags()[3], NSEG=1 if b.base is None and b.parts is None else 2,
                      B_BASE=b.flags()[0], B_GATHER=b.flags()[1], B_PARTS=b.flags()[2],
                      B_WRITE=b.flags()[3])


def norm_qkv_rope_ref(a: Rows, a_g, wq, wk, wv, cos, sin, pos, q, k_cache, v_cache, prefix_len,
                      eps: float, b: Optional[Rows] = None, b_g=None, **_) -> None:
    """Reference of norm_qkv_rope (same arguments and effects), as models/llama.py computes it."""
    B, W, nh, hd = q.shape
    x = rms_ref(rows_ref(a, wq.dtype), a_g, eps)
    if b is not None:
        x = torch.cat([x, rms_ref(rows_ref(b, wq.dtype), b_g, eps)], -1)
    x = x.view(B, W, -1)
    cs, sn = cos[pos].view(B, W, hd), sin[pos].view(B, W, hd)
    heads = lambda w: (x @ w.T).view(B, W, -1, hd).transpose(1, 2)  # noqa: E731
    q.copy_(apply_rope(heads(wq), cs, sn).transpose(1, 2))
    slots = prefix_len.long()[:, None] + torch.arange(W, device=q.device)
    write_cache(k_cache, apply_rope(heads(wk), cs, sn), slots)
    write_cache(v_cache, heads(wv), slots)


@triton.jit
def _gate_up_kernel(a_base, a_bs, a_idx, a_part, a_out, a_os, g_ptr, wg, wu, act_ptr, M, H, I,
                    eps, BN: tl.constexpr, BK: tl.constexpr, BMc: tl.constexpr,
                    A_BASE: tl.constexpr, A_GATHER: tl.constexpr, A_PARTS: tl.constexpr,
                    A_WRITE: tl.constexpr):
    """Grid (cdiv(I, BN), cdiv(M, BMc)): act[:, n] = silu(gate) * up of the RMSNorm'd rows."""
    pid = tl.program_id(0)
    rows = tl.program_id(1) * BMc + tl.arange(0, BMc)
    n = pid * BN + tl.arange(0, BN)
    nmask = n < I
    DT = wg.dtype.element_ty
    accg = tl.zeros([BMc, BN], tl.float32)
    accu = tl.zeros([BMc, BN], tl.float32)
    ss = tl.zeros([BMc], tl.float32)
    for k0 in range(0, H, BK):
        kk = k0 + tl.arange(0, BK)
        xg, sq = norm_chunk(a_base, a_bs, a_idx, a_part, a_out, a_os, g_ptr, M, H, rows, kk,
                            pid == 0, BMc, BK, A_BASE, A_GATHER, A_PARTS, A_WRITE, DT)
        ss += sq
        wm = nmask[:, None] & (kk < H)[None, :]
        accg += tl.dot(xg, tl.trans(tl.load(wg + n[:, None] * H + kk[None, :], mask=wm, other=0.0)))
        accu += tl.dot(xg, tl.trans(tl.load(wu + n[:, None] * H + kk[None, :], mask=wm, other=0.0)))
    rstd = tl.rsqrt(ss / H + eps)[:, None]
    gate = (accg * rstd).to(DT).to(tl.float32)
    up = (accu * rstd).to(DT).to(tl.float32)
    act = gate * tl.sigmoid(gate) * up
    tl.store(act_ptr + rows[:, None] * I + n[None, :], act.to(DT),
             mask=(rows < M)[:, None] & nmask[None, :])


def norm_gate_up(a: Rows, g, w_gate, w_up, eps: float, M: int, block_n: int = 16,
                 block_k: int = 64) -> torch.Tensor:
    """The gated MLP's first half: rows a [M, H], RMSNorm weight g [H], w_gate/w_up [I, H]
    (contiguous) -> act [M, I] = silu(norm(a) @ w_gate^T) * (norm(a) @ w_up^T), weight dtype."""
    I, H = w_gate.shape
    act = torch.empty(M, I, device=w_gate.device, dtype=w_gate.dtype)
    grid = (triton.cdiv(I, block_n), triton.cdiv(M, BM))
    h, gt, p, wr = a.flags()
    _gate_up_kernel[grid](*a.args(w_gate), g, w_gate, w_up, act, M, H, I, eps, BN=block_n,
                          BK=block_k, BMc=BM, A_BASE=h, A_GATHER=gt, A_PARTS=p, A_WRITE=wr)
    return act


def norm_gate_up_ref(a: Rows, g, w_gate, w_up, eps: float, M: int, **_) -> torch.Tensor:
    """Reference of norm_gate_up (models/draft_model.py MLP's first half)."""
    x = rms_ref(rows_ref(a, w_gate.dtype), g, eps)
    return torch.nn.functional.silu(x @ w_gate.T) * (x @ w_up.T)


@triton.jit
def _linear_kernel(x_ptr, x_stride, pacc, pm, pl, w_ptr, out_ptr, M, N, K, NH,
                   BN: tl.constexpr, BK: tl.constexpr, BMc: tl.constexpr, SPLITK: tl.constexpr,
                   ATT_SPLITS: tl.constexpr):
    """Grid (cdiv(N, BN), SPLITK, cdiv(M, BMc)): out[s, m, n] = x[m, ks] . w[n, ks] over split
    s's share of the BK-chunks of K. ATT_SPLITS > 0: x = the attention partials combined
    (BK = head_dim: chunk k0 is head k0 // BK)."""
    pid = tl.program_id(0)
    s = tl.program_id(1)
    rows = tl.program_id(2) * BMc + tl.arange(0, BMc)
    rmask = rows < M
    n = pid * BN + tl.arange(0, BN)
    nmask = n < N
    DT = w_ptr.dtype.element_ty
    per = tl.cdiv(tl.cdiv(K, BK), SPLITK) * BK
    acc = tl.zeros([BMc, BN], tl.float32)
    for k0 in range(s * per, tl.minimum(s * per + per, K), BK):
        kk = k0 + tl.arange(0, BK)
        kmask = kk < K
        if ATT_SPLITS > 0:
            x = combine_splits(pacc, pm, pl, rows, rmask, k0 // BK, M, NH, BK, ATT_SPLITS).to(DT)
        else:
            x = tl.load(x_ptr + rows[:, None] * x_stride + kk[None, :],
                        mask=rmask[:, None] & kmask[None, :], other=0.0).to(DT)
        w = tl.load(w_ptr + n[:, None] * K + kk[None, :], mask=nmask[:, None] & kmask[None, :],
                    other=0.0)
        acc += tl.dot(x, tl.trans(w))
    tl.store(out_ptr + (s * M + rows[:, None]) * N + n[None, :], acc,
             mask=rmask[:, None] & nmask[None, :])


def linear_splitk(x: Optional[torch.Tensor], w: torch.Tensor, M: int, splitk: int,
                  att: Optional[tuple] = None, block_n: int = 16,
                  block_k: int = 64) -> torch.Tensor:
    """x [M, K] (unit column stride) @ w[N, K]^T (contiguous) -> float32 partials [splitk, M, N]
    (their sum is the product; a Rows.parts for the consumer). att = (acc, m, l) attention
    partials (kernels/attention.py) instead of x: then block_k must be head_dim."""
    N, K = w.shape
    out = torch.empty(splitk, M, N, device=w.device, dtype=torch.float32)
    if att is not None:
        nh = att[1].shape[2]
        if K != nh * block_k:
            raise ValueError(f"linear_splitk: attention input needs block_k = head_dim "
                             f"({K // nh}), got {block_k}")
        args = (w, 0, *att)
    else:
        args = (x, x.stride(0), w, w, w)
        nh = 1
    grid = (triton.cdiv(N, block_n), splitk, triton.cdiv(M, BM))
    _linear_kernel[grid](*args, w, out, M, N, K, nh, BN=block_n, BK=block_k, BMc=BM,
                         SPLITK=splitk, ATT_SPLITS=0 if att is None else att[0].shape[0])
    return out


def linear_splitk_ref(x: torch.Tensor, w: torch.Tensor, **_) -> torch.Tensor:
    """Reference of linear_splitk: [1, M, N] float32 partials (one split)."""
    return (x @ w.T).float()[None]
