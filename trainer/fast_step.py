"""The fast TTT training step: packed rows, the target's draft-vocab logits once per batch, the
drafter unrolled over K steps with a TTT attention that has no T x T score matrix
(kernels/ttt_attention*.py), a fused chunked soft cross-entropy (kernels/soft_ce*.py), and no
host sync (statistics stay on the device until the caller reads them).

Same alignment and loss as the reference objective, trainer/objective.py `ttt_loss` (its docstring):
position i of a sample, step j, feeds token i+1+j and RoPE position i+j, predicts token i+2+j
against the target's softmax over the draft vocab at position i+1+j, trained when token i+2+j is
an assistant token and the target's full-vocab argmax is in the draft vocab; loss = sum_j
decay^j * mean over trained positions of the per-position loss (objective.py `Loss`: kl, or the
LK losses through kernels/soft_ce.py `fused_lk`). `fast_ttt_loss` equals `ttt_loss` on the same
samples (tests/test_ttt.py).

Packed batch (`pack_samples`), R rows of T positions, E = T + K - 1 (step j reads columns
j..j+T-1 of the extended tensors):
    aux [R, T, 3*Ht]   aux features of each position
    pos [R, T] int64   position within its sample (RoPE)
    ids [R, E] int64   ids[o + r] = token r+1 of the sample at offset o
    tgt_hidden [R, E, Ht]  last_hidden at token r+1
    pmask [R, E] bool  token r+2 is an assistant token
    rem [R, T] int64   positions left in the sample after this one (-1 = padding): step j reads
                       column i+j only while j <= rem, so the TTT shift never crosses a sample
    start, end [R, T] int32  the sample's first / one-past-last position (attention segments)
    tokens int         sequence tokens of the samples (as make_batch counts them)
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from eagle3_runner.kernels.soft_ce import LK, fused_lk, fused_soft_ce
from eagle3_runner.kernels.ttt_attention import Segments, attend
from eagle3_runner.targets.capture import h2d, pin_for
from eagle3_runner.trainer.objective import Loss


# ---------------------------------------------------------------------------------------------
# packing


def _rows_for(lengths: list[int], T: int, pack: bool) -> list[list[int]]:
    """Sample indices per row: first-fit decreasing when packing, one sample per row otherwise."""
    if not pack:
        return [[i] for i in range(len(lengths))]
    rows, free = [], []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        r = next((r for r, f in enumerate(free) if f >= lengths[i]), None)
        if r is None:
            rows.append([])
            free.append(T)
            r = len(rows) - 1
        rows[r].append(i)
        free[r] -= lengths[i]
    return rows


def pack_samples(samples: list[dict], K: int, seq_len: int | None = None,
                 pack: bool = True, pin: bool = False) -> dict:
    """Pack samples (input_ids [L], loss_mask [L], aux_hidden [L, 3*Ht], last_hidden [L, Ht])
    into rows of seq_len draft positions (a sample of L tokens has L-1; default seq_len = the
    longest sample's). A longer sample is truncated to seq_len + 1 tokens. pack=False: one
    sample per row (make_batch's layout). Returns the batch dict of the module docstring: aux
    and tgt_hidden on the device of the samples' hidden states (the CPU offline, the target's
    device online), the other tensors on the CPU (pin: in pinned memory, for a copy to CUDA).
    Raises ValueError when no sample has 2 tokens or seq_len < 1."""
    n = [int(s["input_ids"].numel()) - 1 for s in samples]
    if max(n, default=0) < 1:
        raise ValueError("pack_samples: every sample has fewer than 2 tokens")
    T = seq_len or max(n)
    if T < 1:
        raise ValueError(f"pack_samples: seq_len = {seq_len}; it must be >= 1")
    n = [min(x, T) for x in n]
    rows = _rows_for([max(x, 0) for x in n], T, pack)
    R, E, s0 = len(rows), T + K - 1, samples[0]
    fdev = s0["aux_hidden"].device  # online features are on the target's device already
    host = {"pin_memory": pin}
    feat = {"device": fdev, "pin_memory": pin and fdev.type == "cpu"}
    b = {"aux": torch.zeros(R, T, s0["aux_hidden"].shape[-1], dtype=s0["aux_hidden"].dtype,
                            **feat),
         "ids": torch.zeros(R, E, dtype=torch.int64, **host),
         "tgt_hidden": torch.zeros(R, E, s0["last_hidden"].shape[-1],
                                   dtype=s0["last_hidden"].dtype, **feat),
         "pmask": torch.zeros(R, E, dtype=torch.bool, **host),
         "pos": torch.zeros(R, T, dtype=torch.int64, **host),
         "rem": torch.full((R, T), -1, dtype=torch.int64, **host),
         "start": torch.zeros(R, T, dtype=torch.int32, **host),
         "end": torch.zeros(R, T, dtype=torch.int32, **host)}
    for r, members in enumerate(rows):
        o = 0
        for i in members:
            s, k = samples[i], n[i]
            if k < 1:
                continue
            ar = torch.arange(k)
            b["aux"][r, o:o + k] = s["aux_hidden"][:k]
            b["ids"][r, o:o + k] = s["input_ids"][1:k + 1].long()
            b["tgt_hidden"][r, o:o + k] = s["last_hidden"][1:k + 1]
            b["pmask"][r, o:o + k - 1] = s["loss_mask"][2:k + 1].bool()
            b["pos"][r, o:o + k] = ar
            b["rem"][r, o:o + k] = k - 1 - ar
            b["start"][r, o:o + k], b["end"][r, o:o + k] = o, o + k
            o += k
        b["start"][r, o:], b["end"][r, o:] = o, T  # the padding tail: a segment of its own
        b["pos"][r, o:] = torch.arange(T - o)
    b["tokens"] = sum(min(int(s["input_ids"].numel()), k + 1) for s, k in zip(samples, n))
    return b


# ---------------------------------------------------------------------------------------------
# the target side


class TargetLogits(NamedTuple):
    """The target's next-token side of a packed batch, one row per (row, column) of the E-long
    extended tensors (row index r * E + c):
    logits [R*E, Vd] (the head's dtype: bf16 on CUDA) over the draft vocab, lse [R*E] float32
    (their logsumexp), draft_id [R*E] int64 = the target's FULL-vocab argmax as a draft id, or -1
    when it is outside the draft vocab (such rows get no loss; accuracy counts them as misses),
    lse_all [R*E] float32 the logsumexp of the FULL-vocab logits (exp(logits - lse_all) = the
    target's true probabilities on the draft vocab, what the LK losses' alpha reads).
    Why logits in the head's dtype and not float32 probabilities (trainer/objective.py target_dist): on CUDA
    the head is bf16 and its GEMM output is already bf16-rounded, so storing it loses nothing;
    it is half of float32 p's bytes, one copy serves all K steps (rows are shared through
    the CE's row index), and p = exp(logits - lse) costs nothing in the CE kernel, which reads
    the row anyway."""
    logits: torch.Tensor
    lse: torch.Tensor
    draft_id: torch.Tensor
    lse_all: torch.Tensor | None = None


def split_head(head: dict, used: torch.Tensor) -> dict:
    """head {norm [Ht], lm_head [V, Ht]}, used [Vd] ascending target ids -> {norm, used: the
    draft-vocab rows [Vd, Ht], rest: the other rows [V-Vd, Ht], used_ids, rest_ids}. Done once per
    run; the caller may drop `head` afterwards (the split holds the same bytes)."""
    W = head["lm_head"]
    keep = torch.zeros(W.shape[0], dtype=torch.bool, device=W.device)
    keep[used.to(W.device)] = True
    rest = (~keep).nonzero().flatten()
    return {"norm": head["norm"], "used": W[used.to(W.device)], "rest": W[rest],
            "used_ids": used.to(W.device), "rest_ids": rest}


@torch.no_grad()
def target_logits(tgt_hidden: torch.Tensor, head: dict, eps: float,
                  chunk_elems: int = 1 << 26) -> TargetLogits:
    """The target's logits over the draft vocab: tgt_hidden [R, E, Ht] (pre-norm last hidden),
    head from `split_head`, eps the target's rms_norm_eps. Chunked over rows so the full-vocab
    logits stay under chunk_elems. Numerics as trainer/objective.py target_dist (float32 RMSNorm, GEMM
    in the head's dtype); ties between the best draft and non-draft logit go to the lower
    target id, as torch.argmax over the full vocab does."""
    R, E, Ht = tgt_hidden.shape
    x = tgt_hidden.reshape(R * E, Ht)
    Wu, Wr, w = head["used"], head["rest"], head["norm"].float()
    out = torch.empty(R * E, Wu.shape[0], device=x.device, dtype=Wu.dtype)
    draft_id = torch.empty(R * E, device=x.device, dtype=torch.int64)
    lse_rest = torch.full((R * E,), -float("inf"), device=x.device, dtype=torch.float32)
    rows = max(1, chunk_elems // (Wu.shape[0] + Wr.shape[0]))
    for a in range(0, R * E, rows):
        h = x[a:a + rows].float()
        h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * w).to(Wu.dtype)
        zu = torch.mm(h, Wu.T, out=out[a:a + rows])
        mu, au = zu.max(-1)
        inside = torch.ones_like(au, dtype=torch.bool)
        if Wr.shape[0]:
            zr = h @ Wr.T
            mr, ar = zr.max(-1)
            inside = (mu > mr) | ((mu == mr) & (head["used_ids"][au] < head["rest_ids"][ar]))
            lse_rest[a:a + rows] = torch.logsumexp(zr.float(), dim=-1)
        draft_id[a:a + rows] = torch.where(inside, au, -1)
    lse = torch.logsumexp(out.float(), dim=-1)
    return TargetLogits(out, lse, draft_id, torch.logaddexp(lse, lse_rest))


def prepare(samples: list[dict], K: int, head: dict, eps: float, device,
            seq_len: int | None = None, pack: bool = True) -> tuple[dict, TargetLogits]:
    """Samples -> (packed batch on `device` without tgt_hidden, TargetLogits): pack_samples +
    target_logits, the data side of one fast step (head from `split_head`, on `device`). The
    host tensors go through pinned memory (targets/capture.py h2d): no host sync."""
    b = {k: (h2d(v, device) if torch.is_tensor(v) else v)
         for k, v in pack_samples(samples, K, seq_len, pack, pin_for(device)).items()}
    return b, target_logits(b.pop("tgt_hidden"), head, eps)


# ---------------------------------------------------------------------------------------------
# the loss


class Impl(NamedTuple):
    """Which paths the fast step takes: attn "torch" | "flex" | "triton" (kernels/
    ttt_attention.py), ce "torch" | "triton" (kernels/soft_ce.py), compile: the torch.compile
    backend of the layer pieces of `unroll` ("inductor" on CUDA; None = eager, as the CPU tests
    run; "aot_eager" traces them on the CPU without code generation)."""
    attn: str = "torch"
    ce: str = "torch"
    compile: str | None = None

    @classmethod
    def named(cls, name: str, device) -> "Impl | None":
        """The paths of stages.train.kernels: "auto" = best(device), "triton" / "flex" (Triton
        CE, compiled on CUDA), "torch" (PyTorch references, compiled on CUDA), "reference" =
        None (trainer/objective.py's plain objective). Raises ValueError for another name."""
        cuda = torch.device(device).type == "cuda"
        comp = "inductor" if cuda else None
        paths = {"auto": None, "triton": cls("triton", "triton", comp),
                 "flex": cls("flex", "triton", comp), "torch": cls("torch", "torch", comp),
                 "reference": None}
        if name not in paths:
            raise ValueError(f"stages.train.kernels = {name!r}: expected one of {list(paths)}")
        return cls.best(device) if name == "auto" else paths[name]

    @classmethod
    def best(cls, device) -> "Impl":
        """Triton attention and CE, compiled, on CUDA; the PyTorch references on the CPU."""
        if torch.device(device).type == "cuda":
            return cls("triton", "triton", "inductor")
        return cls()


def step_masks(batch: dict, tgt: TargetLogits, K: int):
    """Per-step views of a packed batch. Returns ids [K, R, T] (0 where the shift would leave the
    sample), sup [K, R, T] bool (the predicted token is an assistant token), trained [K, R, T]
    bool (sup AND the target's argmax is in the draft vocab) and tidx [K, R, T] int64 (row of
    tgt.logits)."""
    R, T = batch["pos"].shape
    E = batch["ids"].shape[1]
    j = torch.arange(K, device=batch["pos"].device)
    col = torch.arange(T, device=j.device)[None] + j[:, None]  # [K, T]
    valid = j[:, None, None] <= batch["rem"][None]  # [K, R, T]
    ids = torch.where(valid, batch["ids"][:, col].transpose(0, 1), 0)
    sup = batch["pmask"][:, col].transpose(0, 1) & valid
    tidx = torch.arange(R, device=j.device)[None, :, None] * E + col[:, None, :]
    return ids, sup, sup & (tgt.draft_id[tidx] >= 0), tidx


def fast_loss_counts(batch: dict, tgt: TargetLogits, K: int) -> torch.Tensor:
    """Trained positions per TTT step [K] int64: the denominators of fast_ttt_loss (data
    parallel all-reduces them, as trainer/objective.py loss_counts)."""
    return step_masks(batch, tgt, K)[2].sum((1, 2))


def _out_norm(model, hidden, o):
    """The layer after attention: (the next step's hidden, the normed output lm_head reads);
    with norm_output they are the same tensor (Eagle3Draft.recycle)."""
    h = model.ttt_out(hidden, o)
    n = model.norm(h)
    return (n if model.config.norm_output else h), n


_COMPILED: dict = {}


def _compiled(fn, backend: str | None, dynamic: bool | None = True):
    """fn under torch.compile(backend), built once per (fn, backend); fn itself when None.
    dynamic True (the layer pieces): ONE symbolic graph for every batch shape from the first
    step (dynamo still specialises a dimension of size 1). Packed batches change their rows and
    length every step; with dynamic=False each new shape was a recompile, and past dynamo's
    recompile_limit (8) the pieces ran eager: the H200 scale run of 2026-12-02 trained at 0.4 s
    per step. Automatic dynamic shapes (None) compiled a static graph first and the symbolic one
    at the second shape: two compiles where one does (the H200 profile's 40 warm-up steps took
    50 s). Flex attention stays static (dynamic=False, one graph per step's key count)."""
    if backend is None:
        return fn
    if (fn, backend) not in _COMPILED:
        _COMPILED[fn, backend] = torch.compile(fn, backend=backend, dynamic=dynamic)
    return _COMPILED[fn, backend]


def unroll(model, aux, ids, pos, seg: Segments, impl: "Impl") -> torch.Tensor:
    """K draft steps (Eagle3Draft.ttt_step's recurrence) over packed rows. aux [R, T, 3*Ht],
    ids [K, R, T], pos [R, T], seg Segments [R, T]. Returns the normed hidden of every step
    [K, R, T, H]. Compiled, the layer before and after attention are one graph each, reused by
    every step (one compilation, not K); flex attention is compiled on its own."""
    qkv = _compiled(type(model).ttt_qkv, impl.compile)
    out = _compiled(_out_norm, impl.compile)
    att = attend(impl.attn)
    if impl.attn == "flex" and impl.compile:  # one graph per step (its key count differs)
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit,
                                                   2 * ids.shape[0])
        att = _compiled(att, impl.compile, dynamic=False)
    h, ks, vs, hn = model.project(aux), [], [], []
    for j in range(ids.shape[0]):
        q, k, v = qkv(model, ids[j], h, pos + j)
        ks.append(k)
        vs.append(v)
        h, n = out(model, h, att(q, ks, vs, seg))
        hn.append(n)
    return torch.stack(hn)


def _gemm_dtype(x: torch.Tensor) -> torch.dtype:
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


def _lk_weights(loss: Loss, la0: torch.Tensor | None, trained: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(c_ce [K], c_la [K], log) of an LK loss's per-position loss c_ce ce + c_la la at each
    step (objective.py position_losses): lk_alpha (0, 1, la = -log alpha), lk_lambda (lambda_j,
    1 - lambda_j, la = 1 - alpha), lambda_j = exp(-eta x the mean alpha of step j's trained
    positions), alpha = 1 - la0 (la0 [K, R, T]: a first pass's 1 - alpha)."""
    K, dev = trained.shape[0], trained.device
    one, zero = torch.ones(K, device=dev), torch.zeros(K, device=dev)
    if loss.name == "lk_alpha":
        return zero, one, True
    if loss.name != "lk_lambda":
        raise ValueError(f"stages.train.loss = {loss.name!r}: expected kl, lk_lambda or lk_alpha")
    mean = ((1 - la0) * trained).sum((1, 2)) / trained.sum((1, 2)).clamp_min(1)
    lam = torch.exp(-loss.eta * mean).float()
    return lam, 1 - lam, False


def fast_ttt_loss(model, batch: dict, tgt: TargetLogits, K: int, decay: float,
                  denom: torch.Tensor | None = None, impl: Impl = Impl(), loss: Loss = Loss()):
    """trainer/objective.py `ttt_loss` on a packed batch (`prepare`): unroll K draft steps, the
    weighted per-position `loss` against tgt (kl: the fused soft CE; LK: `fused_lk`, lk_lambda
    with a first no-grad pass over the head for its lambdas: one more [rows, Vd] GEMM).
    denom [K] int64: the per-step token counts to divide by (None = this batch's own,
    fast_loss_counts; data parallel passes the counts summed over ranks).
    Returns (loss scalar, stats {loss [K], correct [K], count [K]}): float64 tensors ON THE
    DEVICE (no host sync here; the caller syncs once when it logs). correct/count: top-1 hits /
    positions whose predicted token is an assistant token, per step; hit [K, R, T] bool and sup0
    [R, T] bool: those hits per position and step 0's supervision (trainer/acceptance.py)."""
    ids, sup, trained, tidx = step_masks(batch, tgt, K)
    den = (trained.sum((1, 2)) if denom is None else denom.to(trained.device)).clamp_min(1)
    w_step = decay ** torch.arange(K, device=den.device, dtype=torch.float64) / den
    w = (trained * w_step[:, None, None]).float()  # [K, R, T]
    seg = Segments(batch["start"], batch["end"])
    hn = unroll(model, batch["aux"], ids, batch["pos"], seg, impl)  # [K, R, T, H]
    head = (hn.flatten(0, 2), model.lm_head.weight, tgt.logits, tgt.lse, tidx.flatten())
    if loss.name == "kl":
        total, ce, amax = fused_soft_ce(*head, w.flatten(), _gemm_dtype(hn), impl=impl.ce)
        la = torch.zeros_like(ce)
        c_ce, c_la = torch.ones(K, device=w.device), torch.zeros(K, device=w.device)
    else:
        la0 = None
        if loss.name == "lk_lambda":  # lambda_j needs alpha of the whole step first
            with torch.no_grad():
                la0 = fused_lk(*head, w.flatten(), LK(tgt.lse_all, w.flatten(), False),
                               _gemm_dtype(hn), impl=impl.ce)[3].view_as(w)
        c_ce, c_la, log = _lk_weights(loss, la0, trained)
        total, ce, amax, la = fused_lk(
            *head, (w * c_ce[:, None, None]).flatten(),
            LK(tgt.lse_all, (w * c_la[:, None, None]).flatten(), log), _gemm_dtype(hn),
            impl=impl.ce)
    with torch.no_grad():
        ce, amax = ce.view_as(w), amax.view_as(tidx)
        per_pos = c_ce[:, None, None] * ce + c_la[:, None, None] * la.view_as(w)
        step_loss = (per_pos * trained).sum((1, 2)).double() / den
        hit = (amax == tgt.draft_id[tidx]) & sup
        st = torch.stack([step_loss, hit.sum((1, 2)).double(), sup.sum((1, 2)).double()])
    return total, {"loss": st[0], "correct": st[1], "count": st[2], "hit": hit, "sup0": sup[0]}
