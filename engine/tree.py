"""Tree drafting for the embedded engine (SGLang's eagle_topk > 1), gpt-fast style: small pure
functions with fixed shapes per engine, so that torch.compile / CUDA graphs capture each once.

Tree building follows SGLang 0.5.23 (speculative/spec_utils.py select_top_k_tokens,
eagle_utils.py organize_draft_results, eagle_worker_v2.py draft_forward), with k = eagle_topk,
K = num_steps, N = num_draft_tokens:
    step 0: the root's draft distribution (softmax of the draft logits, temperature 1) gives k
            candidates (its top-k), score = their probability; they are the first frontier
    step i = 1..K-1: each of the k frontier nodes runs one drafter forward and proposes its top-k
            children, score = parent score x child probability (a cumulative draft probability):
            k*k candidates; the k best become the next frontier (not after the last step)
    tree:   the N-1 best of all k + (K-1)*k^2 candidates by score, in candidate order (SGLang sorts
            the selected indices), form the tree under the root (node 0 = the last round's bonus
            token). Hence SGLang's bound N <= 1 + k + (K-1)*k^2 (runner/drafts/rules.py).
Candidate c < k has the root as parent; a candidate of step i >= 1 has the frontier node that
expanded it. A parent's score is >= its child's, so the parent of a selected node is selected too,
except on exact score ties; such an orphan gets parent -1 and is never reached by acceptance.

Drafter attention: frontier node b of step i (RoPE position root + i) writes drafter cache slot
root + 1 + (i-1)*k + b and attends the prefix (slots <= root) plus its own ancestors' slots, the
keys TTT step i sees along that path (SpecForge training). SGLang 0.5.23 instead lets row b attend
the slots written by row b at earlier steps (spec_utils.py generate_draft_decode_kv_indices), which
after a re-selection are not always its ancestors; that changes only the drafts, never the output.

Verify: ONE target forward over the W >= N tree rows; node j sits at cache slot n + j, at RoPE
position n + depth(j), and attends every slot < n plus the tree slots of its ancestors and itself.
Both masks (target verify, drafter tree steps) are kernels/mask.py dense_mask: prefix + a [Q, R]
tree mask, the contract of the fused decode kernels. The verify goes through
kernels.llama_decode.target_forward (the engine's `kernels` switch: Llama.forward or the fused
Triton forward, tree mask included); the drafter's frontier steps stay on SDPA (cached_step): their
[k, (K-1)*k] ancestor mask over slots written by earlier steps does not fit the kernels' square
[W, W] contract over the W slots the call writes. Their step 0 (draft_extend) is switched.

Acceptance (accept_path), one rule for both modes: x_j = the target's token after node j (argmax
at temperature 0; one sample from p_j = softmax(logits_j / T) otherwise); from the root, descend to
the child whose token is x_cur while there is one; the emitted tokens are the x's along the path,
the last one being the bonus token. Greedy: the longest path that agrees with the target. Sampling:
this is recursive rejection sampling (SpecInfer; SGLang's tree_speculative_sampling_target_only)
for drafts that are deterministic given the context (top-k, point-mass draft distributions):
child c_i is accepted with probability p(c_i) after the earlier siblings' rejections, and after all
of them the bonus comes from p with the children removed, renormalised. Drawing x ~ p and
descending when x is a child is the same law. Lossless: every emitted token is a draw from the
target's distribution given everything before it (at the root, x_0 ~ p_0; at an accepted child c
the context is the prefix + path, exactly what row c's tree mask and positions computed).

KV commit: the accepted path's target cache rows move to the contiguous slots n..n+m (the rest
are stale past the new length); the drafter needs no move: its step 0 re-runs over the accepted
positions (draft_extend), rewriting those slots, and its tree slots are rewritten before use.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from eagle3_runner.models.draft_model import Eagle3Draft
from eagle3_runner.engine.steps import draft_extend
from eagle3_runner.models.llama import Llama
from eagle3_runner.kernels.llama_decode import target_forward
from eagle3_runner.kernels.mask import dense_mask
from eagle3_runner.runner.drafts.checks import chain_draft_tokens, spec_draft_tokens_problem


def check_shape(num_steps: int, eagle_topk: int, num_draft_tokens: Optional[int],
                width: Optional[int] = None) -> int:
    """A speculative shape -> num_draft_tokens N (None: num_steps + 1 for a chain). SGLang's rules
    are runner/drafts/checks.py's (spec_draft_tokens_problem, every SGLang version row: a tree
    needs N, a chain's N is num_steps + 1, N <= 1 + k + (K-1)*k^2); this adds the engine's own:
    N >= 2 and a verify `width` >= N. Raises ValueError naming the field."""
    problem = spec_draft_tokens_problem(num_steps, eagle_topk, num_draft_tokens)
    if problem:
        raise ValueError(problem)
    N = num_draft_tokens or chain_draft_tokens(num_steps)
    if N < 2:
        raise ValueError(f"num_draft_tokens = {N}: the verify forward needs at least 2 rows")
    if width is not None and width < N:
        raise ValueError(f"width = {width}: the verify forward needs at least num_draft_tokens "
                         f"= {N} rows")
    return N


def topk_probs(drafter: Eagle3Draft, dlogits: torch.Tensor, k: int, vocab: int):
    """Draft logits [Q, Vd] -> (top-k probabilities [Q, k] float32 (softmax at temperature 1, as
    SGLang 0.5.23 drafts trees at any sampling temperature), their target ids [Q, k])."""
    p, i = torch.softmax(dlogits.float(), dim=-1).topk(k, dim=-1)
    return p, drafter.to_target_ids(i).clamp(0, vocab - 1)


def select_tree(scores, toks, parent_cand, first, N: int):
    """The final selection (SGLang organize_draft_results + the parent lookup of its
    build_tree_kernel_efficient). scores, toks, parent_cand [C]: every candidate's cumulative
    probability, target id and parent candidate (-1 = the root); first [1] = the root token.
    Returns (toks [N], parent [N]): node 0 is the root (parent -1), nodes 1..N-1 the N-1 best
    candidates in candidate order; parent = node index, -1 for the root and for orphans."""
    sel = scores.topk(N - 1).indices.sort().values  # [N-1]
    nodes = torch.arange(1, N, device=sel.device)
    node_of = torch.full_like(parent_cand, -1).index_copy(0, sel, nodes)  # [C] -> node or -1
    pc = parent_cand.index_select(0, sel)  # [N-1]
    parent = torch.where(pc < 0, 0, node_of.index_select(0, pc.clamp(min=0)))
    return torch.cat([first, toks.index_select(0, sel)]), torch.cat([parent.new_full((1,), -1),
                                                                    parent])


def ancestors(parent: torch.Tensor, max_depth: int):
    """parent [N] (node index, -1 = none; parent < child) -> (tree mask [N, N] bool: node j
    attends node i iff i is j or an ancestor of j, depth [N] int64 (root 0, orphans 0))."""
    ar = torch.arange(parent.shape[0], device=parent.device)
    mask, cur = ar[:, None] == ar[None, :], parent
    for _ in range(max_depth):
        mask = mask | (cur[:, None] == ar[None, :])  # cur = -1 matches nothing
        cur = torch.where(cur >= 0, parent.index_select(0, cur.clamp(min=0)), cur)
    return mask, mask.sum(1) - 1


def draft_tree(drafter: Eagle3Draft, kc, vc, first, root_out, root_logits, root_pos, K: int,
               k: int, N: int, vocab: int):
    """Build one draft tree from a root, in ONE graph (module docstring). first [1] = the root
    token (the next verify's first token), root_out [1, 1, H] / root_logits [1, Vd] = drafter
    step 0 at position root_pos [1]; kc/vc [1, nkv, S, hd] the drafter's cache (writes slots
    root_pos+1 .. root_pos+(K-1)*k). Returns (toks [1, N] target ids, parent [N], tree mask
    [N, N] bool, depth [N])."""
    dev = first.device
    ar_k = torch.arange(k, device=dev)
    R = (K - 1) * k  # drafter cache slots of the frontier nodes after the root
    ar_r = torch.arange(R, device=dev)
    p, ids = topk_probs(drafter, root_logits, k, vocab)  # [1, k]
    f_score, f_tok, f_cand = p[0], ids[0], ar_k  # the frontier: scores, tokens, candidate ids
    scores, toks, parents = [f_score], [f_tok], [torch.full_like(ar_k, -1)]
    hidden = root_out.expand(1, k, root_out.shape[-1])  # [1, k, H]
    anc = ar_k[:, None] == ar_r[None, :]  # [k, R]: frontier b of step 1 writes tree slot b
    for i in range(1, K):
        mask = dense_mask(root_pos + 1, anc, k, kc.shape[2])  # [1, 1, k, S]
        hidden = drafter.cached_step(f_tok.view(1, k), hidden, (root_pos + i).expand(k)[None],
                                     kc, vc, root_pos + 1 + (i - 1) * k + ar_k, mask)
        p, ids = topk_probs(drafter, drafter.logits(hidden)[0], k, vocab)  # [k, k]
        s = (f_score[:, None] * p).flatten()  # [k*k]: cumulative draft probabilities
        scores.append(s)
        toks.append(ids.flatten())
        parents.append(f_cand.repeat_interleave(k))
        if i < K - 1:  # the k best expansions become the next frontier
            f_score, sel = s.topk(k)
            a = sel // k  # the frontier row each comes from
            f_tok, f_cand = ids.flatten().index_select(0, sel), k + (i - 1) * k * k + sel
            hidden = hidden.index_select(1, a)
            anc = anc.index_select(0, a) | (ar_r[None, :] == (i * k + ar_k)[:, None])
    tok, parent = select_tree(torch.cat(scores), torch.cat(toks), torch.cat(parents), first, N)
    tmask, depth = ancestors(parent, K)
    return tok.view(1, N), parent, tmask, depth


def draft_tree_round(drafter: Eagle3Draft, kc, vc, aux, nxt, pos, sel, K: int, k: int, N: int,
                     vocab: int, rope=None, kernels: str = "torch"):
    """Everything the drafter does between two tree verifies, in ONE graph: step 0 over the
    accepted path (draft_extend over a fixed D+1 rows, padding past m), then draft_tree from its
    last row. aux [1, D+1, 3Ht] and nxt [D+1] (the target's token after each path node) come from
    verify_tree at positions pos [D+1]; sel [1] = m; rope/kernels: draft_extend's (the
    frontier steps stay on SDPA, module docstring). Returns draft_tree's outputs."""
    root_out, root_logits, _ = draft_extend(drafter, kc, vc, aux, nxt.view(1, -1), pos, sel, rope,
                                            kernels)
    return draft_tree(drafter, kc, vc, nxt.index_select(0, sel), root_out, root_logits,
                      pos.index_select(0, sel), K, k, N, vocab)


def pick(logits: torch.Tensor, temp: Optional[torch.Tensor], u: Optional[torch.Tensor]):
    """The target's token after each node: logits [N, V] -> [N]. temp None: argmax; else temp [1]
    (> 0) and u [N] uniforms in [0, 1): inverse-CDF draws from softmax(logits / temp) (a token of
    probability 0 is never drawn: the count of cumulative sums <= u * total stops before it)."""
    if temp is None:
        return logits.argmax(-1)
    c = torch.softmax(logits.float() / temp, dim=-1).cumsum(-1)  # [N, V]
    x = (c <= u[:, None] * c[:, -1:]).sum(-1)
    return x.clamp(max=logits.shape[-1] - 1)


def accept_path(toks: torch.Tensor, parent: torch.Tensor, x: torch.Tensor, D: int):
    """toks [N], parent [N] (the tree), x [N] (pick). From the root, descend to the first child
    whose token is x[cur], at most D times. Returns (path [D+1] node indices, padded past m by
    repeating the last node, m [1] = accepted drafts). A node without such a child stays put, so
    no alive flag is needed."""
    N = toks.shape[0]
    ar = torch.arange(N, device=toks.device)
    cur = torch.zeros(1, dtype=torch.long, device=toks.device)
    path, m = [cur], torch.zeros_like(cur)
    for _ in range(D):
        match = (parent == cur) & (toks == x.index_select(0, cur))  # [N]
        child = torch.where(match, ar, N).min().view(1)
        found = child < N
        cur = torch.where(found, child, cur)
        m = m + found
        path.append(cur)
    return torch.cat(path), m


def commit_path(caches: list, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Move cache rows src [D+1] to dst [D+1] in every [B, nkv, S, hd] cache (read first, so
    overlapping rows are safe). In place."""
    for c in caches:
        c.index_copy_(2, dst, c.index_select(2, src))


def verify_tree(target: Llama, toks, parent, tmask, depth, base, rows, D: int,
                kernels: str = "torch", temp: Optional[torch.Tensor] = None,
                u: Optional[torch.Tensor] = None):
    """One target forward over the tree, acceptance and the KV commit, in ONE graph.
    toks [1, N], parent [N], tmask [N, N], depth [N] (draft_tree); base [1] = n, the cache
    length (the root token sits at position n); rows [W] = arange(W), W >= N (padding rows:
    token 0, position n, attend themselves; no real row attends them); kernels: the forward
    (target_forward(target, toks, base + depth, base, tree mask)); temp/u: see pick (greedy:
    the forward's own argmax).
    Returns (aux [1, D+1, 3H] and nxt [D+1] at the accepted path, m [1],
    host [D+2] = [m, accepted drafts..., bonus, padding]: the round's one device->host copy)."""
    N, pad = toks.shape[1], rows.shape[0] - toks.shape[1]
    tm = F.pad(tmask, (0, pad, 0, pad)) | (rows[:, None] == rows[None, :])  # [W, W]
    o = target_forward(target, F.pad(toks, (0, pad)), base + F.pad(depth, (0, pad)), base, tm,
                       kernels=kernels)  # node j at slot n + j, position n + depth(j)
    x = o.ids[0, :N, 0] if temp is None else pick(o.logits[0, :N], temp, u)  # [N]
    path, m = accept_path(toks[0], parent, x, D)
    commit_path(target.caches(), base + path, base + rows[:D + 1])
    nxt = x.index_select(0, path)
    return o.aux.index_select(1, path), nxt, m, torch.cat([m, nxt])
