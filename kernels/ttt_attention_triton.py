"""TTT attention as a Triton flash kernel (forward + backward), beside its reference
kernels/ttt_attention.py `ttt_attention` (the mask is described there).

Per (row, head, block of BM queries) the forward walks the step-0 keys block by block from the
first block of the earliest sample start in the block up to the diagonal (online softmax, no
score matrix), then folds in the j diagonal keys of steps 1..j row by row, and stores the output
and the log-sum-exp. The backward is FlashAttention-2's: one kernel per block of step-0 keys
(dK, dV, looping over the queries of its sample and over the query heads of its KV group), one
per block of queries (dQ, and the per-head gradients of the diagonal keys/values, summed over
the group afterwards). Wrapped as the custom op eagle3::ttt_attention so that torch.compile
treats it as one opaque node with a registered backward. Block sizes: 64 on CUDA, 16 in the
interpreter (tiny test shapes, kernels/_triton.py); head_dim must be a power of two >= 16.
"""

import math

import torch
import triton
import triton.language as tl

from eagle3_runner.kernels._triton import check_device


@triton.jit
def _query_block(Q, START, sqb, sqh, sqt, T, H: tl.constexpr, G: tl.constexpr,
                 D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """A query-block program (grid: query blocks x B*H): its row b, head h (and KV head hk),
    query rows rm [BM], their validity mm, their samples' starts st, the step-0 key range
    [lo, hi) it walks (from the earliest start to the diagonal), the head-dim lanes rd [D], the
    queries' offsets qo [BM, D] (in q's layout) and the queries q [BM, D]."""
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    rm = pid_m * BM + tl.arange(0, BM)
    mm = rm < T
    st = tl.load(START + b * T + rm, mask=mm, other=T)
    lo = (tl.min(st, 0) // BN) * BN
    rd = tl.arange(0, D)
    qo = b * sqb + h * sqh + rm[:, None] * sqt + rd[None, :]
    q = tl.load(Q + qo, mask=mm[:, None], other=0.0)
    return bh, b, h, h // G, rm, mm, st, lo, tl.minimum((pid_m + 1) * BM, T), rd, qo, q


@triton.jit
def _sees(rm, rn, st):
    """[BM, BN]: query rm attends step-0 key rn (causal, same sample)."""
    return (rn[None, :] <= rm[:, None]) & (rn[None, :] >= st[:, None])


@triton.jit
def _key_block(kb, n, T, skt, rd, BN: tl.constexpr):
    """Step-0 keys n..n+BN of one (row, KV head) at kb: rows rn [BN], validity nm, k [BN, D]."""
    rn = n + tl.arange(0, BN)
    nm = rn < T
    return rn, nm, tl.load(kb + rn[:, None] * skt + rd[None, :], mask=nm[:, None], other=0.0)


@triton.jit
def _fwd_kernel(Q, K0, V0, KX, VX, START, O, LSE,
                sqb, sqh, sqt, skb, skh, skt, sxx, sxb, sxh, sxt, sob, soh, sot,
                T, NX, scale,
                H: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr):
    bh, b, h, hk, rm, mm, st, lo, hi, rd, _qo, q = _query_block(Q, START, sqb, sqh, sqt, T,
                                                                H, G, D, BM, BN)
    m_i = tl.full([BM], -1.0e30, tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    kb, vb = K0 + b * skb + hk * skh, V0 + b * skb + hk * skh
    for n in range(lo, hi, BN):
        rn, nm, k = _key_block(kb, n, T, skt, rd, BN)
        s = tl.dot(q, tl.trans(k)) * scale  # [BM, BN] float32
        s = tl.where(_sees(rm, rn, st), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(vb + rn[:, None] * skt + rd[None, :], mask=nm[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    qf = q.to(tl.float32)
    for x in range(NX):  # the diagonal keys of steps 1..j
        xo = x * sxx + b * sxb + hk * sxh + rm[:, None] * sxt + rd[None, :]
        kx = tl.load(KX + xo, mask=mm[:, None], other=0.0).to(tl.float32)
        vx = tl.load(VX + xo, mask=mm[:, None], other=0.0).to(tl.float32)
        s1 = tl.sum(qf * kx, 1) * scale
        m_new = tl.maximum(m_i, s1)
        alpha = tl.exp(m_i - m_new)
        p1 = tl.exp(s1 - m_new)
        l_i = l_i * alpha + p1
        acc = acc * alpha[:, None] + p1[:, None] * vx
        m_i = m_new
    l_i = tl.where(mm, l_i, 1.0)  # rows past T: nothing attended, nothing stored
    o = acc / l_i[:, None]
    tl.store(O + b * sob + h * soh + rm[:, None] * sot + rd[None, :], o.to(O.dtype.element_ty),
             mask=mm[:, None])
    tl.store(LSE + bh * T + rm, m_i + tl.log(l_i), mask=mm)


@triton.jit
def _bwd_kv_kernel(Q, K0, V0, DO, LSE, DELTA, END, DK, DV,
                   sqb, sqh, sqt, skb, skh, skt, sob, soh, sot,
                   T, scale,
                   H: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr):
    pid_n, bk = tl.program_id(0), tl.program_id(1)
    b, hk = bk // (H // G), bk % (H // G)
    rn = pid_n * BN + tl.arange(0, BN)
    rd = tl.arange(0, D)
    nm = rn < T
    ko = b * skb + hk * skh + rn[:, None] * skt + rd[None, :]
    k = tl.load(K0 + ko, mask=nm[:, None], other=0.0)
    v = tl.load(V0 + ko, mask=nm[:, None], other=0.0)
    en = tl.load(END + b * T + rn, mask=nm, other=0)
    lo = (pid_n * BN // BM) * BM
    hi = tl.max(en, 0)  # queries of key p: p <= i < end[p] (the rest of p's sample)
    dk = tl.zeros([BN, D], tl.float32)
    dv = tl.zeros([BN, D], tl.float32)
    for g in range(G):
        h = hk * G + g
        for m in range(lo, hi, BM):
            rm = m + tl.arange(0, BM)
            mm = rm < T
            q = tl.load(Q + b * sqb + h * sqh + rm[:, None] * sqt + rd[None, :],
                        mask=mm[:, None], other=0.0)
            do = tl.load(DO + b * sob + h * soh + rm[:, None] * sot + rd[None, :],
                         mask=mm[:, None], other=0.0)
            lse = tl.load(LSE + (b * H + h) * T + rm, mask=mm, other=0.0)
            dl = tl.load(DELTA + (b * H + h) * T + rm, mask=mm, other=0.0)
            s_t = tl.dot(k, tl.trans(q)) * scale  # [BN, BM]
            ok = (rm[None, :] >= rn[:, None]) & (rm[None, :] < en[:, None]) & mm[None, :]
            p_t = tl.where(ok, tl.exp(s_t - lse[None, :]), 0.0)
            dv += tl.dot(p_t.to(do.dtype), do)
            dp_t = tl.dot(v, tl.trans(do))
            ds_t = p_t * (dp_t - dl[None, :])
            dk += tl.dot(ds_t.to(q.dtype), q)
    tl.store(DK + ko, (dk * scale).to(DK.dtype.element_ty), mask=nm[:, None])
    tl.store(DV + ko, dv.to(DV.dtype.element_ty), mask=nm[:, None])


@triton.jit
def _bwd_q_kernel(Q, K0, V0, KX, VX, DO, LSE, DELTA, START, DQ, DKX, DVX,
                  sqb, sqh, sqt, skb, skh, skt, sxx, sxb, sxh, sxt, sob, soh, sot,
                  T, NX, scale,
                  H: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                  BM: tl.constexpr, BN: tl.constexpr):
    bh, b, h, hk, rm, mm, st, lo, hi, rd, qo, q = _query_block(Q, START, sqb, sqh, sqt, T, H, G,
                                                               D, BM, BN)
    do = tl.load(DO + b * sob + h * soh + rm[:, None] * sot + rd[None, :], mask=mm[:, None],
                 other=0.0)
    lse = tl.load(LSE + bh * T + rm, mask=mm, other=0.0)
    dl = tl.load(DELTA + bh * T + rm, mask=mm, other=0.0)
    dq = tl.zeros([BM, D], tl.float32)
    kb, vb = K0 + b * skb + hk * skh, V0 + b * skb + hk * skh
    for n in range(lo, hi, BN):
        rn, nm, k = _key_block(kb, n, T, skt, rd, BN)
        v = tl.load(vb + rn[:, None] * skt + rd[None, :], mask=nm[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale
        p = tl.where(_sees(rm, rn, st), tl.exp(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - dl[:, None])
        dq += tl.dot(ds.to(k.dtype), k)
    qf, dof = q.to(tl.float32), do.to(tl.float32)
    for x in range(NX):
        xo = x * sxx + b * sxb + hk * sxh + rm[:, None] * sxt + rd[None, :]
        kx = tl.load(KX + xo, mask=mm[:, None], other=0.0).to(tl.float32)
        vx = tl.load(VX + xo, mask=mm[:, None], other=0.0).to(tl.float32)
        p1 = tl.exp(tl.sum(qf * kx, 1) * scale - lse)
        ds1 = p1 * (tl.sum(dof * vx, 1) - dl)
        dq += ds1[:, None] * kx
        go = ((x * tl.num_programs(1) + bh) * T + rm[:, None]) * D + rd[None, :]  # [NX, B, H, T, D]
        tl.store(DKX + go, scale * ds1[:, None] * qf, mask=mm[:, None])
        tl.store(DVX + go, p1[:, None] * dof, mask=mm[:, None])
    tl.store(DQ + qo, (dq * scale).to(DQ.dtype.element_ty), mask=mm[:, None])


def _blocks(device) -> tuple[int, int]:
    return (64, 64) if device.type == "cuda" else (16, 16)


def _geometry(q, k0):
    B, H, T, D = q.shape
    if D < 16 or D & (D - 1):
        raise ValueError(f"head_dim {D}: the Triton TTT attention needs a power of two >= 16; "
                         "use attention impl 'flex' or 'torch'")
    return B, H, H // k0.shape[1], T, D


def _strides(x):
    if x.stride(-1) != 1:
        raise ValueError("the last dimension of q/k/v/grad must be contiguous")
    return x.stride(0), x.stride(1), x.stride(2)


def _empty_like_q(q):
    """[B, H, T, D] stored as [B, T, H, D], so the o_proj input needs no copy."""
    B, H, T, D = q.shape
    return q.new_empty(B, T, H, D).transpose(1, 2)


@torch.library.custom_op("eagle3::ttt_attention_fwd", mutates_args=())
def _fwd(q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, kx: torch.Tensor,
         vx: torch.Tensor, start: torch.Tensor,
         end: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    B, H, G, T, D = _geometry(q, k0)
    BM, BN = _blocks(q.device)
    k0, v0 = k0.contiguous(), v0.contiguous()
    o = _empty_like_q(q)
    lse = torch.empty(B, H, T, device=q.device, dtype=torch.float32)
    check_device(q.device)
    _fwd_kernel[(triton.cdiv(T, BM), B * H)](
        q, k0, v0, kx, vx, start, o, lse, *_strides(q), *_strides(k0), *kx.stride()[:4],
        *_strides(o), T, kx.shape[0], 1.0 / math.sqrt(D), H=H, G=G, D=D, BM=BM, BN=BN)
    return o, lse


@_fwd.register_fake
def _(q, k0, v0, kx, vx, start, end):
    B, H, T, _ = q.shape
    return _empty_like_q(q), q.new_empty(B, H, T, dtype=torch.float32)


@torch.library.custom_op("eagle3::ttt_attention_bwd", mutates_args=())
def _bwd(do: torch.Tensor, q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor,
         kx: torch.Tensor, vx: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
         start: torch.Tensor, end: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                          torch.Tensor, torch.Tensor]:
    B, H, G, T, D = _geometry(q, k0)
    BM, BN = _blocks(q.device)
    k0, v0 = k0.contiguous(), v0.contiguous()
    if do.stride(-1) != 1:
        do = do.contiguous()
    delta = (o.float() * do.float()).sum(-1).contiguous()  # [B, H, T]
    dq, dk0, dv0 = torch.empty_like(q), torch.empty_like(k0), torch.empty_like(v0)
    NX = kx.shape[0]
    dkx = torch.empty(NX, B, H, T, D, device=q.device, dtype=torch.float32)
    dvx = torch.empty_like(dkx)
    scale = 1.0 / math.sqrt(D)
    check_device(q.device)
    _bwd_kv_kernel[(triton.cdiv(T, BN), B * (H // G))](
        q, k0, v0, do, lse, delta, end, dk0, dv0, *_strides(q), *_strides(k0), *_strides(do),
        T, scale, H=H, G=G, D=D, BM=BM, BN=BN)
    _bwd_q_kernel[(triton.cdiv(T, BM), B * H)](
        q, k0, v0, kx, vx, do, lse, delta, start, dq, dkx, dvx, *_strides(q), *_strides(k0),
        *kx.stride()[:4], *_strides(do), T, NX, scale, H=H, G=G, D=D, BM=BM, BN=BN)

    def group_sum(d):  # per query head -> per KV head
        return d.view(NX, B, H // G, G, T, D).sum(3).to(kx.dtype)
    return dq, dk0, dv0, group_sum(dkx), group_sum(dvx)


@_bwd.register_fake
def _(do, q, k0, v0, kx, vx, o, lse, start, end):
    # as the real op: dq in q's layout, the rest contiguous
    return (torch.empty_like(q), k0.new_empty(k0.shape), v0.new_empty(v0.shape),
            kx.new_empty(kx.shape), vx.new_empty(vx.shape))


def _setup(ctx, inputs, output):
    q, k0, v0, kx, vx, start, end = inputs
    o, lse = output
    ctx.save_for_backward(q, k0, v0, kx, vx, o, lse, start, end)


def _backward(ctx, do, _dlse):
    q, k0, v0, kx, vx, o, lse, start, end = ctx.saved_tensors
    dq, dk0, dv0, dkx, dvx = _bwd(do, q, k0, v0, kx, vx, o, lse, start, end)
    return dq, dk0, dv0, dkx, dvx, None, None


_fwd.register_autograd(_backward, setup_context=_setup)


def ttt_attention_triton(q, ks: list, vs: list, seg) -> torch.Tensor:
    """TTT attention through the Triton kernels; shapes as kernels/ttt_attention.py
    `ttt_attention` (q [B, nh, T, hd]; ks/vs [B, nkv, T, hd] per step, step 0 first; seg: its
    Segments, start/end [B, T] int32). CUDA tensors run compiled, CPU tensors through the
    interpreter.
    The lse gradient is not propagated (nothing downstream uses the lse). -> [B, nh, T, hd]"""
    if len(ks) > 1:
        kx, vx = torch.stack(ks[1:]), torch.stack(vs[1:])  # [j, B, nkv, T, hd]
    else:
        kx = vx = ks[0].new_empty(0, *ks[0].shape)
    return _fwd(q, ks[0], vs[0], kx, vx, seg.start.contiguous(), seg.end.contiguous())[0]
