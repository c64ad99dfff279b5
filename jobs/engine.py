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
root r feeds the previous step's pre-norm output as hidden, the previous draft as token, RoPE
position r+j, cache slot r+j (it attends to the prefix slots <= r and chain slots r+1..r+j, the
same keys as TTT step j). Draft ids map to target ids through d2t OFFSETS (target = i + d2t[i]).

Trees (eagle_topk > 1, num_draft_tokens N): jobs/tree.py builds the tree as SGLang 0.5.23 does,
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

Metrics: tau = tokens per verify pass including the bonus token; accept_per_pos[j] = fraction of
rounds in which draft j+1 was accepted (sums to tau - 1).
"""

from __future__ import annotations

import contextlib
import time
import types
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from jobs.draft_model import Eagle3Draft
from jobs.engine_steps import (accept_greedy, accept_sample, decode,
                               draft_chain_greedy, draft_extend, draft_probs_target,
                               draft_round_greedy, draft_step, prefill, probs, sample, verify)
from jobs.llama import Llama
from jobs.tree import check_shape, draft_tree, draft_tree_round, verify_tree


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


def default_width(target: Llama, num_steps: int, num_draft_tokens: int = 0) -> Optional[int]:
    """The Engine `width` to share between a baseline and engines of up to `num_steps` and up to
    `num_draft_tokens` tree rows: max(num_steps + 1, num_draft_tokens) for a bf16/fp16 target
    (its 1-row and multi-row forwards round differently), None (1-row decode) for float32."""
    low = target.lm_head.weight.dtype in (torch.bfloat16, torch.float16)
    return max(num_steps + 1, num_draft_tokens) if low else None


def slots_needed(prompt_tokens: int, max_new: int, num_steps: int, rows: int,
                 eagle_topk: int = 1) -> int:
    """Cache slots (Engine max_seq) a generation needs: prompt + max_new, a round's overrun and
    the root's offset (2 * num_steps + 2), then the larger of the verify's `rows` (W) and the
    drafter's tree slots past its root ((num_steps - 1) * eagle_topk)."""
    return prompt_tokens + max_new + 2 * num_steps + 2 + max(rows, (num_steps - 1) * eagle_topk)


def _private(fn: Callable) -> Callable:
    """A copy of `fn` with its own code object. Dynamo keys its graph cache and its recompile
    limit (8) on the code object, so without this every Engine of a bench sweep (each num_steps
    a new static shape) would add graphs to one shared, capped cache."""
    g = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__,
                           fn.__closure__)
    g.__doc__ = fn.__doc__
    return g


class Engine:
    """Batch-1 engine over our Llama target and an exported EAGLE-3 drafter (or none = baseline).

    Chains (eagle_topk 1): greedy rounds run draft_round_greedy (step 0 over the verified rows +
    the K-step chain) and verify, whose greedy tokens come back with the drafts in one copy;
    sampling rounds (`sampling=True`) draft step by step (draft_extend / draft_step).
    Trees (jobs/tree.py check_shape): draft_tree_round and verify_tree at any temperature;
    sampling=True adds the sampling verify graph.

    Compiled mode compiles the fixed-shape steps (module docstring: static shapes) with
    torch.compile(fullgraph=True, dynamic=False). `cuda_graph=True` on CUDA uses
    mode="reduce-overhead" (inductor + CUDA graphs) and is ignored on CPU; `compile_backend`
    ("eager", "aot_eager", "inductor") compiles on any device without CUDA graphs (tests: the
    dynamo guards are the same). No silent fallback: the steps are compiled once at
    construction, then every generate runs under torch.compiler stance "fail_on_recompile", so
    a new shape raises instead of recompiling (or, past dynamo's recompile limit, falling back);
    a graph break raises (fullgraph); dynamo's suppress_errors (compile errors -> eager) is
    refused.

    `width` W (>= N): every target forward after the prefill runs W rows, the verify and the
    baseline's decode alike. In bf16 a 1-row and a (K+1)-row forward round differently, so a
    plain decode baseline and the speculative output drift apart after a few dozen tokens
    (measured on the H200: 24 of 80 MT-bench prompts identical over 256 tokens); with one W for
    both, every row is computed by the same kernels and chain outputs are identical
    (tests/test_engine.py, bf16 on CPU). A tree row attends its ancestors at other slots than a
    decode row does, which can reorder the attention's reductions: in bf16 trees are identical
    but for near-ties. None: verify runs N rows, decode 1.
    Raises ValueError for an inconsistent eagle_topk / num_draft_tokens (SGLang's rules), for
    width < N, and from generate for temperature > 0 on a compiled engine built without
    sampling=True."""

    def __init__(self, target: Llama, drafter: Optional[Eagle3Draft] = None, num_steps: int = 3,
                 eagle_topk: int = 1, max_seq: int = 4096, cuda_graph: bool = False,
                 compile_backend: Optional[str] = None, sampling: bool = False,
                 width: Optional[int] = None, num_draft_tokens: Optional[int] = None):
        N = check_shape(num_steps, eagle_topk, num_draft_tokens, width)
        self.target, self.drafter, self.K, self.sampling = target, drafter, num_steps, sampling
        self.topk, self.N = eagle_topk, N
        self.D = min(num_steps, N - 1)  # the most drafts a round can accept (the tree's depth)
        self.W = width or N  # rows of every verify forward
        self.decode_rows = width or 1  # rows of every baseline decode forward
        self.V = target.config.vocab_size
        p = target.lm_head.weight
        self.device, self.dtype = p.device, p.dtype
        if target.max_seq != max_seq:  # engines over one target share its cache
            target.setup_cache(1, max_seq)
        self.max_seq = max_seq
        if drafter is not None:
            c = drafter.config
            if tuple(sorted(c.aux_layer_ids)) != target.aux_ids:
                raise ValueError(f"drafter aux layer ids {c.aux_layer_ids} != target capture "
                                 f"{list(target.aux_ids)}")
            self.dk = torch.zeros(1, c.num_key_value_heads, max_seq, c.head_dim, device=self.device,
                                  dtype=drafter.fc.weight.dtype)
            self.dv = torch.zeros_like(self.dk)
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
        if compile_backend is not None:
            kw = dict(backend=compile_backend)
        elif cuda_graph and self.device.type == "cuda":
            kw = dict(mode="reduce-overhead")
        else:
            kw = None
        self.compiled = kw is not None
        if self.compiled:
            if torch._dynamo.config.suppress_errors:
                raise ValueError("torch._dynamo.config.suppress_errors is set: a compile failure "
                                 "would silently run eagerly; unset it or use cuda_graph: false")
            if kw.get("mode") == "reduce-overhead":
                for t in target.caches() + ([self.dk, self.dv] if drafter is not None else []):
                    torch._dynamo.mark_static_address(t)
            kw.update(fullgraph=True, dynamic=False)
            self.steps.update({k: torch.compile(_private(self.steps[k]), **kw) for k in self.hot})
            self._warm_up()

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    @torch.inference_mode()
    def _warm_up(self):
        """Compile each step once, with inputs built exactly as generate builds them. Writes junk
        into cache rows 1..W+K, which a prefill or a later step rewrites before any query reads."""
        K, dev, V, S = self.K, self.device, self.V, self.steps
        tok = torch.zeros(1, dtype=torch.long, device=dev)
        S["decode"](self.target, tok.view(1, 1), self.slots[1:1 + self.decode_rows])
        if self.topk > 1:
            if self.drafter is not None:
                self._warm_up_tree(tok)
            return
        toks = torch.zeros(1, K + 1, dtype=torch.long, device=dev)
        _, vaux, best = S["verify"](self.target, toks, self.slots[1:1 + self.W])
        vaux, best = vaux.clone(), best.clone()  # CUDA graphs: the next replay reuses the buffers
        d = self.drafter
        if d is None:
            return
        if self.sampling:
            root, rlog = S["extend"](d, self.dk, self.dv, vaux, toks, self.slots[1:K + 2],
                                     self.slots, self.slots[1:2])
            if K > 1:
                tid = d.to_target_ids(rlog.argmax(-1)).clamp(0, V - 1)
                S["step"](d, self.dk, self.dv, tid.view(1, 1), root.clone(), self.slots[2:3],
                          self.slots)
            return
        # the prompt's first chain: its root comes from the eager step 0 over the prompt
        root, rlog = draft_extend(d, self.dk, self.dv, vaux, toks, self.slots[1:K + 2], self.slots,
                                  self.slots[K:K + 1])
        S["chain"](d, self.dk, self.dv, best[:1].clone(), root, rlog, self.slots[K:K + 1],
                   self.slots, K, V)
        S["round"](d, self.dk, self.dv, vaux, best, self.slots[1:K + 2], self.slots,
                   self.slots[1:2], K, V)

    def _warm_up_tree(self, tok):
        """The tree steps, from a zero root (the shapes and strides of draft_extend's output)."""
        d, S, sl = self.drafter, self.steps, self.slots
        root = torch.zeros(1, 1, d.config.hidden_size, device=self.device, dtype=d.fc.weight.dtype)
        rlog = torch.zeros(1, d.config.draft_vocab_size, device=self.device)
        tree = self._clone(S["tree"](d, self.dk, self.dv, tok, root, rlog, sl[1:2], sl, self.K,
                                     self.topk, self.N, self.V))
        for name in ["tree_verify"] + (["tree_verify_sample"] if self.sampling else []):
            paux, nxt, m, _ = self._clone(S[name](self.target, *tree, sl[2:3], sl[:self.W], sl,
                                                  self.D, *self._uniforms(name, 1.0, None)))
        S["tree_round"](d, self.dk, self.dv, paux, nxt, sl[2:self.D + 3], sl, m, self.K,
                        self.topk, self.N, self.V)

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

    @contextlib.contextmanager
    def _sealed(self):
        """While generating: a compiled step that meets a new input shape/stride raises."""
        if not self.compiled:
            yield
            return
        try:
            with torch.compiler.set_stance("fail_on_recompile"):
                yield
        except RuntimeError as e:
            if "fail_on_recompile" not in str(e):
                raise
            raise RuntimeError("engine: a compiled step saw a new input shape/stride after "
                               "warm-up (a bug in jobs/engine.py; results would be timed on a "
                               f"recompiled graph). Bench with cuda_graph: false. {e}") from e

    def graph_counts(self) -> dict[str, int]:
        """Compiled graphs per step (dynamo cache entries); 1 each after any number of generates
        when shapes are static; {} when not compiled."""
        if not self.compiled:
            return {}
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
        return {k: len(_debug_get_cache_entry_list(self.steps[k]._torchdynamo_orig_callable.__code__))
                for k in self.hot}

    # -- baseline: the same target, no drafter --
    @torch.inference_mode()
    def generate_baseline(self, ids: torch.Tensor, max_new: int, temperature: float = 0.0,
                          gen: Optional[torch.Generator] = None, stop_ids=()) -> tuple[list, Stats]:
        """ids [1, T] -> (new token ids, Stats). One decode step per token."""
        self._check_len(ids, max_new)
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
                                                       self.slots[n:n + self.decode_rows])
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
        Returns (first [1], root out [1, 1, H], root logits [1, Vd]); no root without a drafter."""
        logits, aux = prefill(self.target, ids)
        first = sample(logits[:, -1], temperature, gen)  # [1]
        self._sync()
        st.prefill_s = time.perf_counter() - t0
        if self.drafter is None:
            return first, None, None
        n, sl = ids.shape[1], self.slots
        nxt = torch.cat([ids[:, 1:], first.view(1, 1)], dim=1)
        return (first, *draft_extend(self.drafter, self.dk, self.dv, aux, nxt, sl[:n], sl,
                                     sl[n - 1:n]))

    def _greedy_loop(self, ids, max_new, stop_ids, draft_fn, st, t0) -> list:
        """Greedy rounds; returns the raw token list (may overrun max_new / stops). Per round: one
        verify graph, one host copy of (drafts, target argmax), one drafter graph."""
        K, V, dev, d, S = self.K, self.V, self.device, self.drafter, self.steps
        first, root, rlog = self._start(ids, 0.0, None, st, t0)
        out, n = [int(first)], ids.shape[1]  # out[-1] sits at position n, not yet in the cache
        toks = None  # the next verify input [1, K+1] = [t_n, d_1..d_K]
        if d is not None:
            toks = S["chain"](d, self.dk, self.dv, first, root, rlog, self.slots[n - 1:n],
                              self.slots, K, V).clone()
            self._sync()
            st.draft_s += time.perf_counter() - t0 - st.prefill_s
        while len(out) < max_new and out[-1] not in stop_ids:
            if draft_fn is not None:
                toks = torch.tensor([[out[-1]] + self._forced(draft_fn, out)], device=dev)
            t2 = time.perf_counter()
            _, vaux, best = S["verify"](self.target, toks, self.slots[n:n + self.W])
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
                                  self.slots, self.slots[m:m + 1], K, V).clone()
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
        first, root, rlog = self._start(ids, temperature, gen, st, t0)
        out, n = [int(first)], ids.shape[1]  # out[-1] sits at position n, not yet in the cache
        tree = self._clone(S["tree"](d, self.dk, self.dv, first, root, rlog, sl[n - 1:n], sl,
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
                                                       sl[:self.W], sl, D,
                                                       *self._uniforms(name, temperature, gen)))
            host = host.tolist()  # the round's one device->host sync
            m, new = host[0], host[1:host[0] + 2]  # accepted drafts + bonus
            t3 = time.perf_counter()
            st.verify_s += t3 - t2
            if self._record(st, m, new, out, stop_ids):
                break
            if len(out) < max_new:
                tree = self._clone(S["tree_round"](d, self.dk, self.dv, paux, nxt,
                                                   sl[n:n + D + 1], sl, m_t, *tree_args))
                self._sync()
                st.draft_s += time.perf_counter() - t3
            n += m + 1
        return out

    def _sampling_loop(self, ids, max_new, temperature, gen, stop_ids, draft_fn, st, t0) -> list:
        """Rounds drafted step by step (sampling, or greedy on an engine built with
        sampling=True); returns the raw token list (may overrun max_new / stops)."""
        K, V, dev, d, S = self.K, self.V, self.device, self.drafter, self.steps
        tok, root_out, root_logits = self._start(ids, temperature, gen, st, t0)
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
            vlogits, vaux, _ = S["verify"](self.target, toks, self.slots[n:n + self.W])
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
                root_out, root_logits = S["extend"](d, self.dk, self.dv, vaux, nxt,
                                                    self.slots[n:n + K + 1], self.slots,
                                                    self.slots[m:m + 1])
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
                                            self.slots)
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
