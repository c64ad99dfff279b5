"""The step functions of the embedded engine (engine/speculative.py), gpt-fast style: small pure
functions over our Llama target and the exported drafter, each with ONE input shape per engine so
that torch.compile / CUDA graphs capture it once. Also the sampling and acceptance rules.
The `kernels` argument ("torch" or "triton", resolved once by the Engine) picks the forward inside
kernels.llama_decode.target_forward / kernels.draft_decode.draft_forward; each step has ONE
implementation for both. Conventions (positions, cache slots, d2t offsets, padding rows): see engine/speculative.py.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from eagle3_runner.models.draft_model import Eagle3Draft
from eagle3_runner.models.llama import Llama
from eagle3_runner.kernels.draft_decode import draft_forward
from eagle3_runner.kernels.llama_decode import target_forward


# ----------------------------------------------------------------------------------------------
# sampling helpers


def probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits [..., V] -> probabilities [..., V] float32 at `temperature` (> 0)."""
    return torch.softmax(logits.float() / temperature, dim=-1)


def sample(logits: torch.Tensor, temperature: float, gen: Optional[torch.Generator]) -> torch.Tensor:
    """logits [N, V] -> token ids [N]; argmax at temperature 0."""
    if temperature <= 0:
        return logits.argmax(-1)
    return torch.multinomial(probs(logits, temperature), 1, generator=gen)[:, 0]


# ----------------------------------------------------------------------------------------------
# target steps


def prefill(target: Llama, ids: torch.Tensor):
    """ids [1, T] -> (logits [1, 1, V] at the last position, aux [1, T, 3H]). Writes slots 0..T-1.
    Always Llama.forward (eager: T varies per prompt; the fused kernels are for few rows)."""
    pos = torch.arange(ids.shape[1], device=ids.device)
    return target(ids, pos, last_only=True)


def verify(target: Llama, toks: torch.Tensor, pos: torch.Tensor, kernels: str = "torch"):
    """toks [1, k] = [t_n, d_1..d_K] (k = K+1), pos [W] = n..n+W-1 with W >= k: the target runs
    W rows, toks right-padded with token 0 (padding rows write cache slots past n+K, which are
    rewritten before any query attends them). kernels: "torch" (Llama.forward) or "triton" (the
    fused forward), both through kernels.llama_decode.target_forward. Returns (logits [1, k, V],
    aux [1, k, 3H], best [k] = the target's greedy token after each of toks); logits[:, j] is the
    target's prediction for the token after toks[:, j].

    A fixed W makes every row's numerics independent of how many rows are real: a bf16 matmul
    over 1 row and over K+1 rows can round differently (another kernel), which flips near-tied
    argmaxes, so a greedy decode over W-row forwards is the reference that speculative rounds
    of the same W reproduce bit for bit (see Engine, `width`). The fused path computes each row
    the same way whatever W is (kernels/attention.py), so there any W gives the same bits."""
    k = toks.shape[1]
    assert k <= pos.shape[0], "verify: more tokens than rows"
    o = target_forward(target, F.pad(toks, (0, pos.shape[0] - k)), pos, pos[:1],
                       kernels=kernels)
    return o.logits[:, :k], o.aux[:, :k], o.ids[0, :k, 0]


def decode(target: Llama, tok: torch.Tensor, pos: torch.Tensor, kernels: str = "torch"):
    """One decode step through the verify-shaped forward: tok [1, 1], pos [R] (R = 1, or the
    engine's `width`) -> (logits [1, 1, V], aux [1, 1, 3H], greedy next token [1]). Writes slot
    pos[0] (and padding slots after it). The argmax runs inside the compiled graph."""
    return verify(target, tok, pos, kernels)


# ----------------------------------------------------------------------------------------------
# draft steps (chains; the tree's frontier steps are in engine/tree.py). Every one goes through
# kernels.draft_decode.draft_forward: kernels "torch" = Eagle3Draft.cached_step + logits, "triton"
# = the fused step (`rope` = kernels.draft_decode.rope_table, built once per engine)


def draft_step(drafter: Eagle3Draft, kc, vc, ids, hidden, pos, rope=None, kernels: str = "torch"):
    """One cached draft forward. ids [1, T], hidden [1, T, H], pos [T] (RoPE position = cache
    slot, contiguous); kc/vc [1, nkv, S, hd]. Returns (the next step's hidden [1, T, H]: the
    pre-norm output, normed with norm_output; draft logits
    [1, T, Vd] float32). Query at position p attends to slots <= p. The engine compiles it for
    the sampling chain (T = 1)."""
    o = draft_forward(drafter, kc, vc, ids, pos, pos[:1], hidden=hidden, rope=rope,
                      kernels=kernels)
    return o.out, o.logits


def draft_extend(drafter: Eagle3Draft, kc, vc, aux, next_toks, pos, sel, rope=None,
                 kernels: str = "torch"):
    """Step 0 over new positions: aux [1, T, 3Ht] (target aux at pos), next_toks [1, T] (the token
    AFTER each position), pos [T] (contiguous), sel [1] (index in 0..T-1 of the root row, a
    tensor so that it is no guard). Writes cache rows pos. Returns (root out [1, 1, H], root
    logits [1, Vd] float32, root greedy draft [1] as a target id), fresh tensors with canonical
    strides (a sliced view would carry a T-dependent stride into the compiled chain step, and
    dynamo guards strides: one recompile per prompt length).

    After a verify the engine runs it over a FIXED T = K+1 (positions n..n+K): rows past the
    accepted prefix m are padding. They cannot leak: the accepted rows 0..m attend only slots
    <= their position (causal), and the padded cache rows n+m+1..n+K are rewritten (by the next
    chain steps and the next extend) before any query attends them."""
    o = draft_forward(drafter, kc, vc, next_toks, pos, pos[:1], aux=aux, rope=rope,
                      kernels=kernels)
    return (o.out.index_select(1, sel), o.logits.index_select(1, sel)[:, 0],
            o.ids[0, :, 0].index_select(0, sel))


def draft_chain_greedy(drafter: Eagle3Draft, kc, vc, first, root_out, root_ids, root_pos, K: int,
                       rope=None, kernels: str = "torch"):
    """Greedy chain of K drafts from a root, in ONE graph (no host round trip between draft
    steps). first [1] = t_n (the token the verify starts with), root_out [1, 1, H] and root_ids
    [1] (its greedy draft, a target id) = step 0 at position root_pos [1]. Chain step j = 1..K-1
    feeds the previous step's hidden (DraftOut.out) and the previous draft at RoPE position / cache slot
    root_pos + j (the same keys as TTT step j). Returns the verify input [1, K+1] =
    [t_n, d_1..d_K] as target ids (SGLang llama_eagle3.py: d2t holds offsets, target = i +
    d2t[i], clamped to the target vocabulary)."""
    toks, hidden, tid = [first, root_ids], root_out, root_ids
    for j in range(1, K):
        p = root_pos + j  # [1]: the step's position, slot, and the cache length before it
        o = draft_forward(drafter, kc, vc, tid.view(1, 1), p, p, hidden=hidden, rope=rope,
                          kernels=kernels)
        hidden, tid = o.out, o.ids[0, :, 0]
        toks.append(tid)
    return torch.cat(toks).view(1, K + 1)


def draft_round_greedy(drafter: Eagle3Draft, kc, vc, aux, best, pos, sel, K: int, rope=None,
                       kernels: str = "torch"):
    """Everything the drafter does between two verifies, in ONE graph: step 0 over the verified
    positions (draft_extend over a fixed K+1 rows), then the greedy chain from the root row.
    aux [1, K+1, 3Ht] and best [K+1] come from the last verify at positions pos [K+1]; sel [1] =
    m, the accepted-draft count. Under greedy acceptance the accepted tokens equal the target's
    own argmax, so the token after position pos[i] is best[i] for every i <= m (rows past m are
    padding, see draft_extend) and the bonus token t_{n+m+1} is best[m].
    Returns the next verify input [1, K+1] = [bonus, d_1..d_K]."""
    root_out, _, root_ids = draft_extend(drafter, kc, vc, aux, best.view(1, K + 1), pos, sel,
                                         rope, kernels)
    return draft_chain_greedy(drafter, kc, vc, best.index_select(0, sel), root_out, root_ids,
                              pos.index_select(0, sel), K, rope, kernels)


def draft_probs_target(drafter: Eagle3Draft, dlogits: torch.Tensor, temperature: float,
                       vocab: int) -> torch.Tensor:
    """Draft logits [N, Vd] -> distribution over the TARGET vocab [N, V] (zero outside the draft
    vocab; d2t offsets, SGLang llama_eagle3.py)."""
    q = probs(dlogits, temperature)
    idx = (torch.arange(q.shape[-1], device=q.device) + drafter.d2t).clamp(0, vocab - 1)
    return torch.zeros(q.shape[0], vocab, device=q.device).index_add_(1, idx, q)


# ----------------------------------------------------------------------------------------------
# accept


def accept_greedy(drafts: torch.Tensor, logits: torch.Tensor) -> tuple[int, int]:
    """drafts [K] target ids; logits [K+1, V] target verify logits.
    Returns (number of accepted drafts m, bonus token = target argmax after the accepted prefix)."""
    best = logits.argmax(-1)  # [K+1]
    ok = (best[:-1] == drafts).int()
    m = int(ok.cumprod(0).sum())
    return m, int(best[m])


def accept_sample(drafts: torch.Tensor, q: torch.Tensor, p: torch.Tensor,
                  gen: Optional[torch.Generator]) -> tuple[int, int]:
    """Speculative sampling (Leviathan et al. 2023, Alg. 1). drafts [K]; q [K, V] draft
    distributions the drafts were sampled from; p [K+1, V] target distributions.
    Accept d_j with prob min(1, p_j(d_j)/q_j(d_j)); at the first rejection sample the bonus from
    norm(max(p_j - q_j, 0)); if all K pass, sample it from p_{K+1}. The output is distributed
    exactly as the target's. Returns (m accepted, bonus token)."""
    K = drafts.shape[0]
    ar = torch.arange(K, device=p.device)
    pd, qd = p[ar, drafts], q[ar, drafts]
    u = torch.rand(K, generator=gen, device=p.device)
    ok = (u * qd <= pd).int()  # u < p/q without dividing by q
    m = int(ok.cumprod(0).sum())
    if m == K:
        dist = p[K]
    else:
        dist = (p[m] - q[m]).clamp_min(0)
        s = dist.sum()
        dist = dist / s if s > 0 else p[m]
    return m, int(torch.multinomial(dist, 1, generator=gen))
