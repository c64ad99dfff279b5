"""Embedded EAGLE-3 speculative decoding engine (batch 1, chains and trees), gpt-fast style.

One round (K = num_steps, chain, eagle_topk = 1):
    draft:   K draft tokens d_1..d_K from the drafter's recurrence over its own static KV cache
    verify:  ONE target forward over [t_n, d_1..d_K] at positions n..n+K    (num_draft_tokens = K+1)
    accept:  longest prefix of drafts matching the target (greedy) or passing the speculative-
             sampling rejection test (Leviathan et al. 2023), plus one bonus token from the target
    rollback: both caches are static; the new length is a pointer, stale slots are never attended
The target's aux hidden states at the accepted positions feed the next round: the drafter re-runs
its step 0 over those positions (filling its cache), then continues the chain.

Draft recurrence (SGLang llama_eagle3.py, SpecForge TTT): draft position i takes
(fc(aux at i), embed(token i+1)) at RoPE position i and predicts token i+2. Chain step j >= 1 from
root r feeds the previous step's output (pre-norm; normed with norm_output) as hidden, the
previous draft as token, RoPE
position r+j, cache slot r+j (it attends to the prefix slots <= r and chain slots r+1..r+j, the
same keys as TTT step j). Draft ids map to target ids through d2t OFFSETS (target = i + d2t[i]).

Trees (eagle_topk > 1, num_draft_tokens N): engine/tree.py builds the tree as SGLang 0.5.23 does,
verifies it in one target forward with a tree mask, accepts a path (greedy or tree sampling) and
commits its KV. Greedy chain rounds and all tree rounds are two graphs (the drafter's whole round,
then the target's verify) and ONE device-to-host copy: a 135M target on an H200 is launch-bound,
so host round trips between draft steps, not FLOPs, set the cost of a round.

Static shapes (torch.compile / CUDA graphs): every compiled step sees one input shape AND stride
per engine whatever the accept length m or the prompt length: verify always runs W >= N rows, the
drafter's step 0 after a verify always runs D+1 rows (D = the most drafts a round accepts, K for a
chain; padded past m, see draft_extend), the root row m is picked inside the graph by a tensor
index, and positions/slots are views of a device arange. Only prefill and the prompt's step 0
(length = prompt) run eagerly. See Engine for the guarantees.

Kernels (Engine `kernels`): every fixed-shape target forward (decode, chain verify, tree verify)
and every chain draft step run either the models' PyTorch forward or the fused Triton kernels
(kernels/), one implementation per step (engine/steps.py), the difference inside
kernels.llama_decode.target_forward / kernels.draft_decode.draft_forward. Compilation:
engine/compile.py.

Metrics: tau = tokens per verify pass including the bonus token; accept_per_pos[j] = fraction of
rounds in which draft j+1 was accepted (sums to tau - 1).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from eagle3_runner.models.draft_model import Eagle3Draft
from eagle3_runner.engine.compile import compile_options, compile_steps, graph_counts, sealed, warm_up
from eagle3_runner.engine.steps import (accept_greedy, accept_sample, decode, draft_chain_greedy,
                               draft_extend, draft_probs_target, draft_round_greedy, draft_step,
                               prefill, probs, sample, verify)
from eagle3_runner.models.llama import Llama
from eagle3_runner.engine.tree import check_shape, draft_tree, draft_tree_round, verify_tree
from eagle3_runner.kernels.draft_decode import fused_problem
from eagle3_runner.kernels.switch import geometry_problem, resolve_kernels


# ----------------------------------------------------------------------------------------------
# the engine


@dataclass
class Stats:
    """Per-generation counters. Times in seconds."""

    new_tokens: int = 0
    rounds: int = 0  # verify passes
    accepted: list = field(default_factory=list)  # drafts accepted per round
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0
    prefill_s: float = 0.0

    @property
    def tau(self) -> float:
        return (sum(self.accepted) + self.rounds) / self.rounds if self.rounds else float("nan")

    def accept_per_pos(self, K: int) -> list[float]:
        return [sum(a > j for a in self.accepted) / max(self.rounds, 1) for j in range(K)]


def engine_kernels(kernels: str, target: Llama, drafter: Optional[Eagle3Draft] = None) -> str:
    """The Engine `kernels` setting resolved for this target (and drafter): "triton" or "torch".
    kernels.switch.resolve_kernels ("auto" = torch on every device: the fused path measured
    slower on the H200); "triton" raises ValueError when the fused kernels cannot tile
    a head_dim (kernels.switch.geometry_problem) or run the drafter's EAGLE 3.1 options
    (kernels/draft_decode.py fused_problem). Engines whose outputs are compared (a bench's
    baseline and its speculative engines) must share one resolved value: resolve once, pass the
    result."""
    k = resolve_kernels(kernels, target.lm_head.weight.device)
    if k == "triton":
        dims = [target.config.head_dim] + ([] if drafter is None else [drafter.config.head_dim])
        why = next(filter(None, map(geometry_problem, dims)), None)
        why = why or (None if drafter is None else fused_problem(drafter.config))
        if why:
            raise ValueError(f"kernels = 'triton': {why}; use kernels: torch (or auto)")
    return k


def default_width(target: Llama, num_steps: int, num_draft_tokens: int = 0,
                  kernels: str = "torch") -> Optional[int]:
    """The Engine `width` to share between a baseline and engines of up to `num_steps` and up to
    `num_draft_tokens` tree rows: max(num_steps + 1, num_draft_tokens) for a bf16/fp16 target on
    the torch path (its 1-row and multi-row forwards round differently); None (1-row decode) for
    float32, and on the fused path (`kernels` resolves to "triton"): there a row's bits do not
    depend on the row count (kernels/attention.py; tests/test_fused_decode.py proves a 1-row
    decode == row j of a W-row verify, bit for bit)."""
    if engine_kernels(kernels, target) == "triton":
        return None
    low = target.lm_head.weight.dtype in (torch.bfloat16, torch.float16)
    return max(num_steps + 1, num_draft_tokens) if low else None


def slots_needed(prompt_tokens: int, max_new: int, num_steps: int, rows: int,
                 eagle_topk: int = 1) -> int:
    """Cache slots (Engine max_seq) a generation needs: prompt + max_new, a round's overrun and
    the root's offset (2 * num_steps + 2), then the larger of the verify's `rows` (W) and the
    drafter's tree slots past its root ((num_steps - 1) * eagle_topk)."""
    return prompt_tokens + max_new + 2 * num_steps + 2 + max(rows, (num_steps - 1) * eagle_topk)


class Engine:
    """Batch-1 engine over our Llama target and an exported EAGLE-3 drafter (or none = baseline).

    Chains (eagle_topk 1): greedy rounds run draft_round_greedy (step 0 over the verified rows +
    the K-step chain) and verify, whose greedy tokens come back with the drafts in one copy;
    sampling rounds (`sampling=True`) draft step by step (draft_extend / draft_step).
    Trees (engine/tree.py check_shape): draft_tree_round and verify_tree at any temperature;
    sampling=True adds the sampling verify graph.

    `kernels` ("auto", "triton", "torch"; engine_kernels, once): "triton" runs every
    target forward after the prefill (decode, chain verify, tree verify with its tree mask) through
    the fused kernels/llama_decode.py forward and every chain draft step (step 0, chain steps,
    the tree's step 0) through the fused kernels/draft_decode.py step; "torch" runs Llama.forward
    and Eagle3Draft.cached_step. The prefill (eager, any length) and the drafter's tree frontier
    steps (an ancestor mask outside the kernels' contract, engine/tree.py) are torch on both.
    "auto" = torch on every device (kernels/switch.py: on the H200 a 1-row decode call took
    1.79 ms fused vs 1.37 ms on the CUDA-graphed torch path); "triton" is an explicit opt-in.

    Compiled mode (engine/compile.py): the fixed-shape steps (module docstring: static
    shapes) under torch.compile(fullgraph=True, dynamic=False), compiled once per generate path on
    its first use (baseline decode; the speculative steps), before the seal;
    `cuda_graph=True` on CUDA uses mode="reduce-overhead" (inductor + CUDA graphs) and is ignored
    on CPU; `compile_backend` ("eager", "aot_eager", "inductor") compiles on any device without
    CUDA graphs (tests), kernels "torch" only on CPU. Every generate runs under torch.compiler
    stance "fail_on_recompile": a new shape raises instead of recompiling.

    `width` W (>= N): every target forward after the prefill runs W rows, the verify and the
    baseline's decode alike. On the torch path, in bf16 a 1-row and a (K+1)-row forward round
    differently, so a plain decode baseline and the speculative output drift apart after a few
    dozen tokens (measured on the H200: 24 of 80 MT-bench prompts identical over 256 tokens);
    with one W for both, every row is computed by the same kernels and chain outputs are
    identical (tests/test_engine.py, bf16 on CPU). The fused path computes a row the same way for
    any W, so None suffices there (default_width). A tree row attends its ancestors at other
    slots than a decode row does, which can reorder the attention's reductions: in bf16 trees are
    identical but for near-ties. None: verify runs N rows, decode 1.
    Raises ValueError for an inconsistent eagle_topk / num_draft_tokens (SGLang's rules), for
    width < N, for an unknown or unavailable `kernels` (engine_kernels; triton compiled on CPU),
    and from generate for temperature > 0 on a compiled engine built without sampling=True."""

    def __init__(self, target: Llama, drafter: Optional[Eagle3Draft] = None, num_steps: int = 3,
                 eagle_topk: int = 1, max_seq: int = 4096, cuda_graph: bool = False,
                 compile_backend: Optional[str] = None, sampling: bool = False,
                 width: Optional[int] = None, num_draft_tokens: Optional[int] = None,
                 kernels: str = "auto"):
        N = check_shape(num_steps, eagle_topk, num_draft_tokens, width)
        self.target, self.drafter, self.K, self.sampling = target, drafter, num_steps, sampling
        self.topk, self.N = eagle_topk, N
        self.D = min(num_steps, N - 1)  # the most drafts a round can accept (the tree's depth)
        self.W = width or N  # rows of every verify forward
        self.decode_rows = width or 1  # rows of every baseline decode forward
        self.V = target.config.vocab_size
        p = target.lm_head.weight
        self.device, self.dtype = p.device, p.dtype
        self.kernels = engine_kernels(kernels, target, drafter)
        kw = compile_options(self.device, cuda_graph, compile_backend, self.kernels)
        if target.max_seq != max_seq:  # engines over one target share its cache
            target.setup_cache(1, max_seq)
        self.max_seq = max_seq
        self.rope = None  # the drafter's RoPE table for the fused step
        if drafter is not None:
            c = drafter.config
            if tuple(sorted(c.aux_layer_ids)) != target.aux_ids:
                raise ValueError(f"drafter aux layer ids {c.aux_layer_ids} != target capture "
                                 f"{list(target.aux_ids)}")
            self.dk = torch.zeros(1, c.num_key_value_heads, max_seq, c.head_dim, device=self.device,
                                  dtype=drafter.fc.weight.dtype)
            self.dv = torch.zeros_like(self.dk)
            if self.kernels == "triton":
                from eagle3_runner.kernels.draft_decode import rope_table
                self.rope = rope_table(drafter, max_seq)
        self.slots = torch.arange(max_seq, device=self.device)
        self.steps = dict(decode=decode, verify=verify,
                          extend=draft_extend, step=draft_step,
                          chain=draft_chain_greedy, round=draft_round_greedy,
                          tree=draft_tree, tree_round=draft_tree_round, tree_verify=verify_tree,
                          tree_verify_sample=verify_tree)
        # the steps a compiled engine compiles (the others are never called by it)
        if eagle_topk > 1:
            self.hot = ["decode"] + ([] if drafter is None else ["tree", "tree_round", "tree_verify"]
                                     + (["tree_verify_sample"] if sampling else []))
        else:
            self.hot = ["decode", "verify"] + ([] if drafter is None else ["extend", "step"]
                                               if sampling else ["chain", "round"])
        self.compiled = kw is not None
        if self.compiled:
            static = target.caches() + [target.rope_cos, target.rope_sin]
            if drafter is not None:
                static += [self.dk, self.dv] + list(self.rope or ())
            compile_steps(self.steps, self.hot, kw, static)
        self._warm: set = set()  # the generate paths whose graphs are built (engine_compile)

    def _ready(self, path: str) -> None:
        """Build the graphs of generate path "baseline" or "spec" before its first (sealed) use."""
        if self.compiled and path not in self._warm:
            warm_up(self, path)
            self._warm.add(path)

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def _uniforms(self, name, temperature, gen) -> tuple:
        """The sampling verify's extra inputs: (temperature [1], uniforms [N]); () for greedy."""
        if name == "tree_verify":
            return ()
        return (torch.full((1,), temperature, device=self.device),
                torch.rand(self.N, generator=gen, device=self.device))

    @staticmethod
    def _clone(ts) -> list:
        """Copies of a compiled step's outputs (CUDA graphs reuse output buffers on replay)."""
        return [t.clone() for t in ts]

    def _sealed(self):
        """While generating: a compiled step that meets a new input shape/stride raises."""
        return sealed(self.compiled)

    def graph_counts(self) -> dict[str, int]:
        """Compiled graphs per step (dynamo cache entries): 0 until the step's generate path
        first runs (built then, `_ready`), 1 after any number of generates when shapes are
        static; {} when not compiled."""
        return graph_counts(self.steps, self.hot) if self.compiled else {}

    # -- baseline: the same target, no drafter --
    @torch.inference_mode()
    def generate_baseline(self, ids: torch.Tensor, max_new: int, temperature: float = 0.0,
                          gen: Optional[torch.Generator] = None, stop_ids=()) -> tuple[list, Stats]:
        """ids [1, T] -> (new token ids, Stats). One decode step per token."""
        self._check_len(ids, max_new)
        self._ready("baseline")
        st = Stats()
        self._sync()
        t0 = time.perf_counter()
        with self._sealed():
            logits, _ = prefill(self.target, ids)
            tok = sample(logits[:, -1], temperature, gen)  # [1]
            out = [int(tok)]
            n = ids.shape[1]
            while len(out) < max_new and out[-1] not in stop_ids:
                logits, _, best = self.steps["decode"](self.target, tok.view(1, 1),
                                                       self.slots[n:n + self.decode_rows],
                                                       self.kernels)
                tok = (best.clone() if temperature <= 0
                       else sample(logits[:, -1].clone(), temperature, gen))
                out.append(int(tok))
                n += 1
        self._sync()
        st.total_s = time.perf_counter() - t0
        st.new_tokens = len(out)
        return out, st

    # -- speculative --
    @torch.inference_mode()
    def generate(self, ids: torch.Tensor, max_new: int, temperature: float = 0.0,
                 gen: Optional[torch.Generator] = None, stop_ids=(),
                 draft_fn: Optional[Callable] = None) -> tuple[list, Stats]:
        """Speculative decoding. ids [1, T] -> (new token ids (at most max_new), Stats).
        `draft_fn` forces the drafts (tests only; signatures: _forced): without a drafter it
        replaces it (chains); with one, the drafter still runs (same compiled steps and cache
        traffic) but its drafts are replaced by the forced ones before the verify.
        Raises ValueError for temperature > 0 on a compiled engine built without sampling=True,
        and without a drafter for a tree (its shape comes from the drafter)."""
        if self.drafter is None and (draft_fn is None or self.topk > 1):
            raise ValueError("no drafter (a tree's shape needs one): use generate_baseline")
        if temperature > 0 and self.compiled and not self.sampling:
            raise ValueError("temperature > 0 needs Engine(..., sampling=True): this compiled "
                             "engine has only the greedy draft graphs")
        self._check_len(ids, max_new)
        self._ready("spec")
        st = Stats()
        self._sync()
        t0 = time.perf_counter()
        with self._sealed():
            if self.topk > 1:
                out = self._tree_loop(ids, max_new, temperature, gen, stop_ids, draft_fn, st, t0)
            elif temperature <= 0 and not self.sampling:
                out = self._greedy_loop(ids, max_new, stop_ids, draft_fn, st, t0)
            else:
                out = self._sampling_loop(ids, max_new, temperature, gen, stop_ids, draft_fn, st,
                                          t0)
        if stop_ids:
            for i, t in enumerate(out):
                if t in stop_ids:
                    out = out[:i + 1]
                    break
        out = out[:max_new]
        self._sync()
        st.total_s = time.perf_counter() - t0
        st.new_tokens = len(out)
        return out, st

    def _start(self, ids, temperature, gen, st, t0):
        """Prefill ids [1, T] (cache slots 0..T-1; st.prefill_s), the first token [1], then the
        drafter's step 0 over the prompt (eager: T varies), (aux_i, token i+1) at position i.
        Returns (first [1], root out [1, 1, H], root logits [1, Vd], root greedy draft [1]); no
        root without a drafter."""
        logits, aux = prefill(self.target, ids)
        first = sample(logits[:, -1], temperature, gen)  # [1]
        self._sync()
        st.prefill_s = time.perf_counter() - t0
        if self.drafter is None:
            return first, None, None, None
        n, sl = ids.shape[1], self.slots
        nxt = torch.cat([ids[:, 1:], first.view(1, 1)], dim=1)
        return (first, *draft_extend(self.drafter, self.dk, self.dv, aux, nxt, sl[:n],
                                     sl[n - 1:n], self.rope, self.kernels))

    def _greedy_loop(self, ids, max_new, stop_ids, draft_fn, st, t0) -> list:
        """Greedy rounds; returns the raw token list (may overrun max_new / stops). Per round: one
        verify graph, one host copy of (drafts, target argmax), one drafter graph."""
        K, V, dev, d, S = self.K, self.V, self.device, self.drafter, self.steps
        first, root, _, rid = self._start(ids, 0.0, None, st, t0)
        out, n = [int(first)], ids.shape[1]  # out[-1] sits at position n, not yet in the cache
        kn, rope = self.kernels, self.rope
        toks = None  # the next verify input [1, K+1] = [t_n, d_1..d_K]
        if d is not None:
            toks = S["chain"](d, self.dk, self.dv, first, root, rid, self.slots[n - 1:n], K,
                              rope, kn).clone()
            self._sync()
            st.draft_s += time.perf_counter() - t0 - st.prefill_s
        while len(out) < max_new and out[-1] not in stop_ids:
            if draft_fn is not None:
                toks = torch.tensor([[out[-1]] + self._forced(draft_fn, out)], device=dev)
            t2 = time.perf_counter()
            _, vaux, best = S["verify"](self.target, toks, self.slots[n:n + self.W], kn)
            vaux, best = vaux.clone(), best.clone()  # CUDA graphs: outputs are reused buffers
            host = torch.cat([toks[0, 1:], best]).tolist()  # the round's one device->host sync
            drafts, target_best = host[:K], host[K:]
            m = 0
            while m < K and drafts[m] == target_best[m]:
                m += 1
            t3 = time.perf_counter()
            st.verify_s += t3 - t2
            new = target_best[:m + 1]  # accepted drafts (= the target's argmax) + bonus
            if self._record(st, m, new, out, stop_ids):
                break
            if d is not None and len(out) < max_new:
                toks = S["round"](d, self.dk, self.dv, vaux, best, self.slots[n:n + K + 1],
                                  self.slots[m:m + 1], K, rope, kn).clone()
                self._sync()
                st.draft_s += time.perf_counter() - t3
            n += m + 1
        return out

    def _tree_loop(self, ids, max_new, temperature, gen, stop_ids, draft_fn, st, t0) -> list:
        """Tree rounds (greedy or sampling); returns the raw token list (may overrun max_new /
        stops). Per round: one verify_tree graph (forward, acceptance, KV commit), one host copy
        of [m, accepted tokens], one draft_tree_round graph."""
        D, dev, d, S, sl = self.D, self.device, self.drafter, self.steps, self.slots
        tree_args = (self.K, self.topk, self.N, self.V)
        first, root, rlog, _ = self._start(ids, temperature, gen, st, t0)
        out, n = [int(first)], ids.shape[1]  # out[-1] sits at position n, not yet in the cache
        tree = self._clone(S["tree"](d, self.dk, self.dv, first, root, rlog, sl[n - 1:n],
                                     *tree_args))
        self._sync()
        st.draft_s += time.perf_counter() - t0 - st.prefill_s
        name = "tree_verify" if temperature <= 0 else "tree_verify_sample"
        while len(out) < max_new and out[-1] not in stop_ids:
            if draft_fn is not None:  # forced tokens on the drafter's tree (tests)
                forced = self._forced(draft_fn, out, tree[1][1:].tolist())
                tree[0] = torch.tensor([[out[-1]] + forced], device=dev)
            t2 = time.perf_counter()
            paux, nxt, m_t, host = self._clone(S[name](self.target, *tree, sl[n:n + 1],
                                                       sl[:self.W], D, self.kernels,
                                                       *self._uniforms(name, temperature, gen)))
            host = host.tolist()  # the round's one device->host sync
            m, new = host[0], host[1:host[0] + 2]  # accepted drafts + bonus
            t3 = time.perf_counter()
            st.verify_s += t3 - t2
            if self._record(st, m, new, out, stop_ids):
                break
            if len(out) < max_new:
                tree = self._clone(S["tree_round"](d, self.dk, self.dv, paux, nxt,
                                                   sl[n:n + D + 1], m_t, *tree_args, self.rope,
                                                   self.kernels))
                self._sync()
                st.draft_s += time.perf_counter() - t3
            n += m + 1
        return out

    def _sampling_loop(self, ids, max_new, temperature, gen, stop_ids, draft_fn, st, t0) -> list:
        """Rounds drafted step by step (sampling, or greedy on an engine built with
        sampling=True); returns the raw token list (may overrun max_new / stops)."""
        K, V, dev, d, S = self.K, self.V, self.device, self.drafter, self.steps
        tok, root_out, root_logits, _ = self._start(ids, temperature, gen, st, t0)
        out, n = [int(tok)], ids.shape[1]  # out[-1] sits at position n, not yet in the cache
        while len(out) < max_new and out[-1] not in stop_ids:
            # draft K tokens
            self._sync()
            t1 = time.perf_counter()
            forced = self._forced(draft_fn, out) if draft_fn is not None else None
            if d is None:
                drafts, q = torch.tensor(forced, device=dev), None
            else:
                drafts, q = self._draft_chain(root_out, root_logits, n - 1, temperature, gen,
                                              forced)
            self._sync()
            t2 = time.perf_counter()
            # verify [t_n, d_1..d_K] in one target forward
            toks = torch.cat([torch.tensor([out[-1]], device=dev), drafts]).view(1, K + 1)
            vlogits, vaux, _ = S["verify"](self.target, toks, self.slots[n:n + self.W],
                                           self.kernels)
            vlogits, vaux = vlogits[0].clone(), vaux.clone()  # CUDA graphs reuse output buffers
            if temperature <= 0:
                m, bonus = accept_greedy(drafts, vlogits)
            else:
                if q is None:  # deterministic drafts: a point mass
                    q = torch.zeros(K, V, device=dev).scatter_(1, drafts[:, None], 1.0)
                m, bonus = accept_sample(drafts, q, probs(vlogits, temperature), gen)
            self._sync()
            t3 = time.perf_counter()
            st.draft_s += t2 - t1
            st.verify_s += t3 - t2
            new = [int(x) for x in drafts[:m]] + [bonus]
            if self._record(st, m, new, out, stop_ids):
                break
            # rollback = the new length; aux at accepted positions n..n+m feed the drafter, over
            # a fixed K+1 rows (padding past m); the root row m is selected by a tensor index
            if d is not None:
                nxt = torch.zeros(1, K + 1, dtype=torch.long, device=dev)
                nxt[0, :m + 1] = torch.tensor(new, device=dev)
                root_out, root_logits, _ = S["extend"](d, self.dk, self.dv, vaux, nxt,
                                                       self.slots[n:n + K + 1],
                                                       self.slots[m:m + 1], self.rope,
                                                       self.kernels)
                root_out, root_logits = root_out.clone(), root_logits.clone()
                st.draft_s += time.perf_counter() - t3
            n += m + 1
        return out

    def _draft_chain(self, root_out, root_logits, root: int, temperature, gen, forced=None):
        """root_out [1, 1, H] (step-0 output at position root), root_logits [1, Vd]; forced:
        optional K target ids to use instead of the drafter's choices (tests).
        Returns (drafts [K] target ids, q [K, V] draft distributions over the target vocab or
        None at temperature 0 or when forced)."""
        d, K, V = self.drafter, self.K, self.V
        hidden, dlog = root_out, root_logits
        drafts, qs = [], []
        for j in range(K):
            if forced is not None:
                tid = torch.tensor(forced[j:j + 1], device=self.device)
            elif temperature > 0:
                q = draft_probs_target(d, dlog, temperature, V)  # [1, V]
                tid = torch.multinomial(q, 1, generator=gen)[:, 0]
                qs.append(q)
            else:
                tid = d.to_target_ids(dlog.argmax(-1)).clamp(0, V - 1)  # [1]
            drafts.append(tid)
            if j == K - 1:
                break
            # chain step j+1 at RoPE position/slot root+j+1, token = the draft just made
            pos = self.slots[root + j + 1:root + j + 2]
            hidden, lg = self.steps["step"](d, self.dk, self.dv, tid.view(1, 1), hidden, pos,
                                            self.rope, self.kernels)
            hidden, dlog = hidden.clone(), lg[:, -1].clone()
        return torch.cat(drafts), (torch.cat(qs) if qs else None)

    @staticmethod
    def _record(st: Stats, m: int, new: list, out: list, stop_ids) -> bool:
        """Count a round that accepted m drafts and append its tokens `new` to out. True when one
        is a stop token (possibly mid-round): generation ends there."""
        st.rounds += 1
        st.accepted.append(m)
        out.extend(new)
        return any(t in stop_ids for t in new)

    def _forced(self, draft_fn, out, parents=None) -> list:
        """Forced drafts (tests): chains call draft_fn(out, K) -> K target ids; trees call
        draft_fn(out, parents) -> N-1 target ids for nodes 1..N-1, parents = their parent nodes
        (0 = the root) as the drafter built the tree. ValueError for another count."""
        want = self.K if parents is None else self.N - 1
        forced = list(draft_fn(list(out), self.K if parents is None else parents))
        if len(forced) != want:
            raise ValueError(f"draft_fn returned {len(forced)} drafts; the engine verifies "
                             f"{want} (num_steps {self.K}, num_draft_tokens {self.N})")
        return forced

    def _check_len(self, ids, max_new):
        need = slots_needed(ids.shape[1], max_new, self.K, self.W, self.topk)
        if need > self.max_seq:
            raise ValueError(f"prompt ({ids.shape[1]} tokens) + max_new_tokens ({max_new}) needs "
                             f"{need} cache slots; the engine has max_seq = {self.max_seq}")
