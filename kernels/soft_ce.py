"""Fused, chunked soft cross-entropy over the draft vocab (the TTT loss head), Liger-kernel style.

For trained rows m with weight w_m (the per-step decay / token count) and normed draft hidden
h_m [H]:
    z = h @ W^T (W = lm_head.weight [Vd, H]),  p = softmax(zt[t_m]) (the target's draft-vocab
    logits, row t_m),  loss = sum_m w_m * (logsumexp(z) - sum_v p_v z_v).
`fused_soft_ce` runs this chunk by chunk of rows and computes dL/dh and dL/dW in the same loop
(the gradient is known in closed form, w * (softmax(z) - p)), so a chunk's [rows, Vd] logits
exist once and are overwritten by their own gradient; backward only scales the stored dh/dW by
the incoming gradient. The target side is read as logits (bf16 on CUDA, one row per target
position, shared by every TTT step that reads it through t_m) plus their logsumexp, never as a
[tokens, Vd] float32 probability tensor per step.

The per-row part has two implementations with one contract: `soft_ce_rows` (PyTorch, the
reference) and kernels/soft_ce_triton.py (Triton).

The LK losses (arXiv 2602.23881; trainer/objective.py `position_losses` is the reference over a
whole step) add a term in the expected acceptance alpha = sum_v min(pa_v, q_v), q = softmax(z),
pa = exp(zt[t_m] - lse_all[t_m]) the target's TRUE probabilities on the draft vocab (lse_all:
the logsumexp of the target's full-vocab logits): per row
    loss_m = w_m * ce_m + wa_m * la_m,   la = 1 - alpha (TV, lk_lambda) or -log(max(alpha, eps))
    (lk_alpha),
with d alpha / d z_k = q_k (1[q_k < pa_k] - S), S = sum_v q_v 1[q_v < pa_v] (a tie's
subgradient is taken as 0). `lk_rows` (PyTorch) and kernels/soft_ce_triton.py `lk_rows_triton`
compute it row by row (three passes: logsumexp and ce, alpha and S, the gradient), `fused_lk`
is `fused_soft_ce` with that term.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import torch

ALPHA_EPS = 1e-8  # -log(max(alpha, ALPHA_EPS)): trainer/objective.py's floor, TorchSpec's clamp


class LK(NamedTuple):
    """The LK term of `fused_lk`: lse_all [R] float32 (logsumexp of the target's full-vocab
    logits per target row), wa [M] float32 (the term's weight per row), log: la = -log(alpha)
    (True, lk_alpha) or 1 - alpha (False, the TV part of lk_lambda)."""
    lse_all: torch.Tensor
    wa: torch.Tensor
    log: bool


def soft_ce_rows(z, zt, lse_t, tidx, w):
    """Per-row soft CE and its logit gradient, the reference. z [M, Vd] draft logits (any float
    dtype; OVERWRITTEN in place with w * (softmax(z) - p)), zt [R, Vd] target logits, lse_t [R]
    float32 (logsumexp of zt rows), tidx [M] int64 (target row of each row), w [M] float32.
    Returns ce [M] float32 = logsumexp(z) - sum_v p_v z_v (unweighted; p = exp(zt - lse_t)) and
    argmax [M] int64 (first maximum, as torch.argmax)."""
    zf = z.float()
    lse = torch.logsumexp(zf, dim=-1)
    p = torch.exp(zt[tidx].float() - lse_t[tidx, None])
    ce = lse - (p * zf).sum(-1)
    amax = zf.argmax(-1)
    z.copy_((torch.exp(zf - lse[:, None]) - p) * w[:, None])
    return ce, amax


def lk_rows(z, zt, lse_t, tidx, w, lk: LK):
    """`soft_ce_rows` plus the LK term (module docstring), the reference: z [M, Vd] OVERWRITTEN
    with w (q - p) + wa * d la / d z, zt/lse_t/tidx/w as soft_ce_rows, lk: LK (lse_all [R], wa
    [M], log). Returns ce [M], argmax [M] (as soft_ce_rows) and la [M] float32 (unweighted)."""
    zf = z.float()
    lse = torch.logsumexp(zf, dim=-1)
    q = torch.exp(zf - lse[:, None])
    zr = zt[tidx].float()
    p = torch.exp(zr - lse_t[tidx, None])
    pa = torch.exp(zr - lk.lse_all[tidx, None])
    ce = lse - (p * zf).sum(-1)
    amax = zf.argmax(-1)
    below = q < pa
    alpha = torch.where(below, q, pa).sum(-1)
    S = (q * below).sum(-1)
    if lk.log:
        la = -alpha.clamp_min(ALPHA_EPS).log()
        ca = torch.where(alpha > ALPHA_EPS, -lk.wa / alpha.clamp_min(ALPHA_EPS), 0.0)
    else:
        la, ca = 1 - alpha, -lk.wa
    z.copy_(w[:, None] * (q - p) + ca[:, None] * q * (below.float() - S[:, None]))
    return ce, amax, la


def _rows_fn(impl: str, lk: bool = False):
    if impl == "torch":
        return lk_rows if lk else soft_ce_rows
    if impl == "triton":
        from eagle3_runner.kernels.soft_ce_triton import lk_rows_triton, soft_ce_rows_triton
        return partial(lk_rows_triton, eps=ALPHA_EPS) if lk else soft_ce_rows_triton
    raise ValueError(f"soft CE impl {impl!r}: choose 'torch' or 'triton'")


def default_chunk_rows(vocab: int, itemsize: int, budget_bytes: int = 1 << 27) -> int:
    """Rows per chunk so that one chunk's [rows, vocab] logits take about budget_bytes
    (128 MiB by default: 2048 rows of a 32000-token bf16 draft vocab), a multiple of 128 (whole
    GEMM tiles), at least 128."""
    return max(128, budget_bytes // (vocab * itemsize) // 128 * 128)


class _FusedSoftCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, zt, lse_t, tidx, w, dtype, chunk_rows, impl, grad, lk):
        rows = _rows_fn(impl, lk is not None)
        with torch.autocast(h.device.type, enabled=False):
            Wc = weight.detach().to(dtype)
            dh = torch.empty_like(h) if grad else h.new_zeros(0)
            dW = torch.zeros(weight.shape if grad else 0, device=weight.device,
                             dtype=torch.float32)
            ce = torch.empty(h.shape[0], device=h.device, dtype=torch.float32)
            amax = torch.empty(h.shape[0], device=h.device, dtype=torch.int64)
            la = torch.zeros(h.shape[0] if lk is not None else 0, device=h.device,
                             dtype=torch.float32)
            for a in range(0, h.shape[0], chunk_rows):
                b = min(a + chunk_rows, h.shape[0])
                hc = h[a:b].detach().to(dtype)
                z = hc @ Wc.T  # [rows, Vd]: becomes its own gradient below
                if lk is None:
                    ce[a:b], amax[a:b] = rows(z, zt, lse_t, tidx[a:b], w[a:b])
                else:
                    ce[a:b], amax[a:b], la[a:b] = rows(z, zt, lse_t, tidx[a:b], w[a:b],
                                                       lk._replace(wa=lk.wa[a:b]))
                if grad:
                    dh[a:b] = z @ Wc
                    dW.add_(z.T @ hc)
        ctx.save_for_backward(dh, dW.to(weight.dtype))
        ctx.mark_non_differentiable(ce, amax, la)
        loss = (ce * w).sum() + ((la * lk.wa).sum() if lk is not None else 0.0)
        return loss, ce, amax, la

    @staticmethod
    def backward(ctx, g, _ce, _amax, _la):
        dh, dW = ctx.saved_tensors
        return dh * g, dW * g, None, None, None, None, None, None, None, None, None


def fused_soft_ce(h, weight, zt, lse_t, tidx, w, dtype=None, chunk_rows=None, impl="torch"):
    """Weighted soft cross-entropy of the draft head against the target's logits.

    h [M, H] normed draft hidden (requires grad); weight [Vd, H] (lm_head.weight); zt [R, Vd]
    target logits over the draft vocab; lse_t [R] float32 their logsumexp; tidx [M] int64: the
    zt row of each h row; w [M] float32 (0 = not trained). dtype: the GEMM dtype (default
    h's; bf16 under CUDA autocast is the caller's choice); chunk_rows: rows per chunk
    (default `default_chunk_rows`); impl: "torch" or "triton" (the per-row part).
    Returns (loss = sum_m w_m ce_m, a differentiable scalar; ce [M] float32; argmax [M] int64
    draft ids of the draft's top-1, for accuracy). Gradients flow to h and weight only; under
    torch.no_grad (evaluation) the dh/dW GEMMs are skipped."""
    return _fused(h, weight, zt, lse_t, tidx, w, dtype, chunk_rows, impl, None)[:3]


def fused_lk(h, weight, zt, lse_t, tidx, w, lk: LK, dtype=None, chunk_rows=None, impl="torch"):
    """`fused_soft_ce` with the LK term (module docstring): loss = sum_m w_m ce_m + wa_m la_m.
    lk: LK(lse_all [R], wa [M], log). Returns (loss, ce [M], argmax [M], la [M] float32, the
    unweighted LK term: 1 - alpha or -log(max(alpha, eps)))."""
    return _fused(h, weight, zt, lse_t, tidx, w, dtype, chunk_rows, impl, lk)


def _fused(h, weight, zt, lse_t, tidx, w, dtype, chunk_rows, impl, lk):
    dtype = dtype or h.dtype
    chunk_rows = chunk_rows or default_chunk_rows(zt.shape[1], torch.finfo(dtype).bits // 8)
    grad = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    return _FusedSoftCE.apply(h, weight, zt, lse_t, tidx, w, dtype, chunk_rows, impl, grad, lk)
