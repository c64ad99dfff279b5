"""The TTT (training-time test) objective of the EAGLE-3 drafter: batches, the target's soft
labels, and the unrolled K-step loss (jobs/train.py trains with it; the engine tests and
scripts/bench/diag_roots.py check the engine against it).

Alignment (SpecForge OnlineEagle3Model / SGLang draft extend): a sample of T tokens gives
N = T-1 draft positions. At TTT step j, position i takes token i+1+j (and, at j = 0, the aux
feature at i; later, the draft's own pre-norm output of step j-1 at i), RoPE position i + j,
and predicts token i+2+j, whose soft target is softmax over the draft vocab of the target's
logits at position i+1+j = lm_head(norm(last_hidden[i+1+j])). A position is trained only when
token i+2+j is an assistant token AND the target's argmax there is inside the draft vocab.
Loss = sum_j decay^j * mean over trained positions of the per-position loss (stages.train.loss,
`Loss`; docs/training-options.md), with q = the draft's softmax over the draft vocab,
p~ = the target's softmax over the draft vocab, p = the target's full-vocab probabilities on the
draft vocab (p = p~ x cover, cover = the target's mass on the draft vocab) and
alpha = sum_v min(p_v, q_v), the expected acceptance of the draft token (out-of-vocab mass
counts as rejected; LK paper, arXiv 2602.23881, section 4.4):
  kl         H(p~, q) = -sum_v p~_v log q_v (the soft cross-entropy: KL(p~ || q) + a constant)
  lk_alpha   -log(max(alpha, ALPHA_EPS))
  lk_lambda  lambda_j H(p~, q) + (1 - lambda_j)(1 - alpha), lambda_j = exp(-eta x the mean alpha
             of the step's trained positions, no gradient through it): once per TTT step from
             the batch mean, as the paper (and SpecForge 0.2.0, TorchSpec) schedule it.
Accuracy at step j = P(draft argmax (mapped through d2t) == target argmax) over assistant
positions (a target argmax outside the draft vocab counts as a miss, as in SpecForge).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from eagle3_runner.kernels.soft_ce import ALPHA_EPS  # lk_alpha's floor under alpha
from eagle3_runner.models.draft_model import Eagle3Draft


class Loss(NamedTuple):
    """The per-position loss of stages.train.loss (module docstring): name "kl" | "lk_lambda" |
    "lk_alpha"; eta: lk_lambda's lambda = exp(-eta x mean alpha) (stages.train.lk_eta)."""
    name: str = "kl"
    eta: float = 3.0

    @classmethod
    def of(cls, p) -> "Loss":
        """The loss of a stages.train block."""
        return cls(p.loss, p.lk_eta)


class TargetDist(NamedTuple):
    """The target side of a make_batch batch (target_dist): p [B, E, Vd] float32 softmax over
    the draft columns, target_ids [B, E] int64 full-vocab argmax, in_vocab [B, E] bool
    (t2d[target_ids]), cover [B, E] float32 the full-vocab probability mass on the draft vocab
    (so p x cover = the target's true probabilities there)."""
    p: torch.Tensor
    target_ids: torch.Tensor
    in_vocab: torch.Tensor
    cover: torch.Tensor


def aux_noise(aux: torch.Tensor, std: float) -> torch.Tensor:
    """aux + uniform noise in [-std, +std) elementwise (stages.train.noise_std; vLLM speculators
    AddUniformNoise: t + 2 (rand - 0.5) std on the concatenated aux states, training only),
    drawn in float32 from the device's default generator, returned in aux's dtype."""
    return (aux.float() + (torch.rand_like(aux, dtype=torch.float32) * 2 - 1) * std).to(aux.dtype)


def position_losses(logits: torch.Tensor, p: torch.Tensor, cover: torch.Tensor,
                    trained: torch.Tensor, loss: Loss = Loss()) -> torch.Tensor:
    """One TTT step's per-position loss (module docstring): logits [B, N, Vd] float32 draft
    logits, p [B, N, Vd] the target's softmax over the draft vocab, cover [B, N] its full-vocab
    mass there, trained [B, N] bool (lk_lambda's lambda is the mean alpha over these).
    Returns [B, N] float32 (positions outside `trained` hold values the caller masks)."""
    logq = F.log_softmax(logits, -1)
    ce = -(p * logq).sum(-1)
    if loss.name == "kl":
        return ce
    alpha = torch.minimum(p * cover[..., None], logq.exp()).sum(-1)
    if loss.name == "lk_alpha":
        return -alpha.clamp_min(ALPHA_EPS).log()
    if loss.name != "lk_lambda":
        raise ValueError(f"stages.train.loss = {loss.name!r}: expected kl, lk_lambda or lk_alpha")
    mean = (alpha.detach() * trained).sum() / trained.sum().clamp_min(1)
    lam = torch.exp(-loss.eta * mean)
    return lam * ce + (1 - lam) * (1 - alpha)


def make_batch(samples: list[dict], K: int) -> dict[str, torch.Tensor]:
    """Right-padded TTT batch of B samples; N = max(T) - 1 positions, E = N + K - 1 rows so
    step j reads rows j..j+N-1 of the extended tensors.
    Returns aux [B, N, 3*Ht], ids [B, E] (ids[b, r] = token r+1), tgt_hidden [B, E, Ht]
    (last_hidden at r+1), pmask [B, E] bool (token r+2 is an assistant token), tokens (int)."""
    N = max(int(s["input_ids"].numel()) for s in samples) - 1
    if N < 1:
        raise ValueError("every sample in the batch has fewer than 2 tokens")
    B, E = len(samples), N + K - 1
    s0 = samples[0]
    aux = torch.zeros(B, N, s0["aux_hidden"].shape[-1], dtype=s0["aux_hidden"].dtype)
    ids = torch.zeros(B, E, dtype=torch.int64)
    tgt = torch.zeros(B, E, s0["last_hidden"].shape[-1], dtype=s0["last_hidden"].dtype)
    pm = torch.zeros(B, E, dtype=torch.bool)
    for b, s in enumerate(samples):
        n = s["input_ids"].numel() - 1
        if n < 1:
            continue
        aux[b, :n] = s["aux_hidden"][:n]
        ids[b, :n] = s["input_ids"][1:].long()
        tgt[b, :n] = s["last_hidden"][1:]
        pm[b, :n - 1] = s["loss_mask"][2:].bool()
    return {"aux": aux, "ids": ids, "tgt_hidden": tgt, "pmask": pm,
            "tokens": sum(int(s["input_ids"].numel()) for s in samples)}


@torch.no_grad()
def target_dist(tgt_hidden, head: dict, used: torch.Tensor, t2d: torch.Tensor, eps: float,
                chunk_elems: int = 1 << 26):
    """The target's next-token distribution restricted to the draft vocab.
    tgt_hidden [B, E, Ht] (pre-norm last hidden); head: norm [Ht], lm_head [V, Ht]; used [Vd].
    Returns a TargetDist: p [B, E, Vd] float32 (softmax over the draft columns), target_ids
    [B, E] int64 (argmax over the FULL vocab), in_vocab [B, E] bool (t2d[target_ids]), cover
    [B, E] (the full-vocab probability mass on the draft columns).
    Chunked over rows so the [rows, V] logits stay under chunk_elems floats."""
    B, E, Ht = tgt_hidden.shape
    x = tgt_hidden.reshape(B * E, Ht)
    W, w = head["lm_head"], head["norm"]
    rows = max(1, chunk_elems // W.shape[0])
    ps, ids, cov = [], [], []
    for a in range(0, x.shape[0], rows):
        h = x[a:a + rows].float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * w.float()
        logits = (h.to(W.dtype) @ W.T).float()  # [rows, V]
        ids.append(logits.argmax(-1))
        ps.append(torch.softmax(logits[:, used], dim=-1))
        cov.append(torch.exp(torch.logsumexp(logits[:, used], -1) - torch.logsumexp(logits, -1)))
    target_ids = torch.cat(ids).view(B, E)
    return TargetDist(torch.cat(ps).view(B, E, -1), target_ids, t2d[target_ids],
                      torch.cat(cov).view(B, E))


def loss_counts(batch: dict, tgt: tuple, K: int) -> torch.Tensor:
    """Trained positions per TTT step: [K] int64 (assistant token AND target argmax in the draft
    vocab), the denominators of ttt_loss."""
    N, pm, in_vocab = batch["aux"].shape[1], batch["pmask"], tgt[2]
    return torch.stack([(pm[:, j:j + N] & in_vocab[:, j:j + N]).sum() for j in range(K)])


def ttt_loss(model: Eagle3Draft, batch: dict, tgt: TargetDist, K: int, decay: float,
             denom: torch.Tensor | None = None, loss: Loss = Loss()):
    """Unroll K draft steps (Eagle3Draft.ttt_step keeps the KV of earlier steps) under `loss`
    (position_losses). denom [K] int64: the per-step token counts to divide by; None = this
    batch's own counts (loss_counts). Data parallel passes the counts summed over ranks, so the
    loss of each rank is its share of the global mean (lk_lambda's lambda stays each rank's own
    batch mean).
    Returns (loss scalar, stats {loss [K], correct [K], count [K]} float64 CPU tensors, hit
    [K, B, N] bool and sup0 [B, N] bool on the batch's device: step j's draft equals the
    target's argmax at position i (and that token is an assistant token), step 0's token is an
    assistant token; trainer/acceptance.py turns them into the chain rounds)."""
    aux, ids, pm = batch["aux"], batch["ids"], batch["pmask"]
    p, target_ids, in_vocab, cover = tgt
    B, N, _ = aux.shape
    pos = torch.arange(N, device=aux.device)[None].expand(B, N)
    causal = torch.ones(N, N, dtype=torch.bool, device=aux.device).tril()[None, None]
    used = model.d2t + torch.arange(model.d2t.numel(), device=model.d2t.device)
    h, cache, total, st, hits = model.project(aux), [], 0.0, [], []
    for j in range(K):
        h = model.ttt_step(ids[:, j:j + N], h, pos, cache, causal)  # [B, N, H]
        logits = model.logits(h).float()  # [B, N, Vd]
        sup = pm[:, j:j + N]  # predicted token is an assistant token
        m = sup & in_vocab[:, j:j + N]
        lp = position_losses(logits, p[:, j:j + N], cover[:, j:j + N], m, loss)  # [B, N]
        lj = (lp * m).sum() / (m.sum() if denom is None else denom[j]).clamp_min(1)
        total = total + decay ** j * lj
        with torch.no_grad():
            hits.append((used[logits.argmax(-1)] == target_ids[:, j:j + N]) & sup)
            st.append(torch.stack([lj.detach(), hits[-1].sum(), sup.sum()]).double())
    st = torch.stack(st, dim=1).cpu()  # one device sync per call, not 3 per step
    return total, {"loss": st[0], "correct": st[1], "count": st[2], "hit": torch.stack(hits),
                   "sup0": pm[:, :N]}


class TTTObjective(torch.nn.Module):
    """The drafter plus its TTT loss as one module, so that DDP sees a forward call:
    forward(batch, tgt, denom) = loss(draft, batch, tgt, K, decay, denom); loss = ttt_loss or
    a function of the same signature (trainer/fast_step.py fast_ttt_loss with its impl bound;
    either with its `loss` (Loss) bound)."""

    def __init__(self, draft: Eagle3Draft, K: int, decay: float, loss=None):
        super().__init__()
        self.draft, self.K, self.decay, self.loss = draft, K, decay, loss or ttt_loss

    def forward(self, batch: dict, tgt, denom: torch.Tensor | None = None):
        return self.loss(self.draft, batch, tgt, self.K, self.decay, denom)


def to_device(batch: dict, device) -> dict:
    """A make_batch batch with its tensors moved to `device` (non-blocking)."""
    return {k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v)
            for k, v in batch.items()}
