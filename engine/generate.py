"""Batched generation on the embedded target (our Llama, models/llama.py), gpt-fast style: many
sequences at once over a static KV cache, continuous batching, one fixed-shape decode step that
torch.compile / CUDA graphs capture. Used by the regenerate stage (jobs/regenerate.py).

Layout (R = rows in flight, S = max_seq, M = max new tokens of any request):
  cache  k/v [R, nkv, S + 1, hd] per layer; row r holds one sequence at a time, cache slot =
         position; slots < pos[r] hold its valid tokens, later slots are stale and never read.
  state  device tensors updated in place by the decode step: cur [R] (the last token, not yet in
         the cache), pos [R] (its position = the cached length), n_gen [R] (tokens generated),
         limit [R] (its cap: min(max_new, S - prompt)), done [R] bool, seed [R], out [R, M].

Decode step [R, 1] (decode_step): one forward of every row at its own position, the next token
picked in the graph (greedy argmax, or Gumbel-max sampling at temperature / top-p), written to
out; a row stops at a stop token or its limit. Finished and empty rows still run (static shape)
but change nothing: they rewrite the slot just past their valid tokens. Attention reads only
slots < kv_len (the live maximum rounded up to `kv_bucket`), so its cost follows the real
lengths, not S; kv_len is a dynamic dimension of the ONE compiled graph (mark_dynamic), and CUDA
graphs record one graph per bucket value. GQA decode attention runs SDPA with the g = nh/nkv
query heads of a KV group as g query rows (no repeated K/V); `kernels="triton"` switches to
kernels.attention.decode_attention(q, k_cache, v_cache, prefix_len, None) (the contract:
row b's new key sits at slot prefix_len[b] = pos[b]).

Host loop (Generator.run): `sync_every` decode steps, then ONE device->host copy of (done,
n_gen, pos); the next `sync_every` steps are launched at once, and while they run the host
handles the rows finished since: their tokens (copied back) are handed to on_done in one
call, which may return each conversation's next turn: it continues in the SAME row, reusing
the cached prefix (the longest common prefix of the cached ids and the new prompt's ids), so
only the new user turn is prefilled. Free rows take the next queued requests. Prefills are batched
(right-padded, per-row positions, slots and cache rows, logits at each row's last token) and run
eagerly (variable shapes), attention through `sdpa_prefill` (K/V repeated to the query heads).

Sampling: each request carries a seed; step t of a sequence draws its Gumbel noise from a
counter-based hash of (seed, t, token id). So a sequence's tokens do not depend on its row or on
which sequences run beside it, up to floating point: the logits themselves can round differently
with the kv_len bucket (on CPU float32 they did not in the tests; bf16 kernels may).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

import torch
import torch.nn.functional as F

from eagle3_runner.engine.compile import compile_options, compile_steps, graph_counts
from eagle3_runner.models.llama import Llama
from eagle3_runner.kernels.switch import resolve_kernels

M31 = 0x7FFFFFFF  # hash values live in [0, 2^31): products stay below 2^63 in int64
MAX_STOP = 4  # stop-id slots of the step (padded with -1: one graph for any stop set)


@dataclass
class Request:
    """One sequence to generate. key: the caller's handle; ids: prompt token ids (len < S);
    max_new: new tokens at most (<= the Generator's max_new); seed: sampling seed."""

    key: Any
    ids: list
    max_new: int
    seed: int = 0


@dataclass
class Result:
    """A finished sequence: tokens (the stop token included when it ended on one), finish
    "stop" | "length" (its max_new or the cache end)."""

    key: Any
    tokens: list
    finish: str
    prompt_len: int


# ----------------------------------------------------------------------------------------------
# picking the next token (inside the compiled step)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """An integer hash on int64 tensors with values in [0, 2^31) (no overflow)."""
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & M31
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & M31
    return x ^ (x >> 16)


def gumbel(seed: torch.Tensor, step: torch.Tensor, vhash: torch.Tensor) -> torch.Tensor:
    """Gumbel noise [R, V] float32 from a counter-based hash: seed [R], step [R] int64 in
    [0, 2^31), vhash [V] = _mix(arange(V)). Row r's noise depends on (seed[r], step[r]) only."""
    h = _mix(seed ^ _mix(step))  # [R]
    u = ((_mix(h[:, None] ^ vhash[None]) >> 7).float() + 0.5) / float(1 << 24)  # (0, 1)
    return -torch.log(-torch.log(u))


def pick(logits: torch.Tensor, mode: str, temperature: torch.Tensor, top_p: torch.Tensor,
         seed: torch.Tensor, step: torch.Tensor, vhash: torch.Tensor) -> torch.Tensor:
    """logits [R, V] float32 -> tokens [R]. mode "sample": softmax at temperature [1], and the
    plain argmax when temperature is 0 (greedy and sampled runs share ONE compiled graph: on the
    H200 a sampled step cost the same as a greedy one, 9.04 vs 9.11 ms at 512 rows, and each
    graph ~40 s to compile); "top_p" (temperature > 0; nucleus: the smallest set of tokens whose
    mass reaches top_p [1], as HF's TopPLogitsWarper); "greedy": the argmax alone (the
    Generator's eager runs at temperature 0: eager, "sample" computes the Gumbel noise of every
    row and token anyway, 81% of a CPU regeneration's time). Sampling is Gumbel-max:
    argmax(logits / T + G). Raises ValueError for another mode."""
    if mode == "greedy":
        return logits.argmax(-1)
    z = logits / temperature.clamp_min(1e-6)
    if mode == "sample":
        return torch.where(temperature > 0, (z + gumbel(seed, step, vhash)).argmax(-1),
                           logits.argmax(-1))
    if mode != "top_p":
        raise ValueError(f"pick: mode {mode!r}; expected 'greedy', 'sample' or 'top_p'")
    srt, idx = z.sort(-1, descending=True)
    p = srt.softmax(-1)
    drop = (p.cumsum(-1) - p) >= top_p  # the mass before this token already reaches top_p
    z = z.masked_fill(torch.zeros_like(drop).scatter(-1, idx, drop), float("-inf"))
    return (z + gumbel(seed, step, vhash)).argmax(-1)


# ----------------------------------------------------------------------------------------------
# attention and the decode step


def sdpa_decode(q, k, v, mask):
    """Decode attention through SDPA. q [R, nh, 1, hd]; k/v [R, nkv, S', hd]; mask [R, 1, 1, S']
    bool -> [R, nh, 1, hd]. Query head h uses KV head h // g (g = nh / nkv, as HF's
    repeat_kv): the g heads of a group become g query rows of that group, so K/V are read once,
    never repeated."""
    R, nh, T, hd = q.shape
    nkv = k.shape[1]
    assert T == 1, "sdpa_decode: one query position per row"
    o = F.scaled_dot_product_attention(q.reshape(R, nkv, nh // nkv, hd), k, v, attn_mask=mask)
    return o.reshape(R, nh, T, hd)


def sdpa_prefill(q, k, v, mask):
    """Prefill attention through SDPA. q [n, nh, T, hd]; k/v [n, nkv, S', hd]; mask [n, 1, T, S']
    bool -> [n, nh, T, hd]. K/V are repeated to the nh query heads first (HF's repeat_kv):
    PyTorch's fused SDPA kernels take either GQA (flash) or a mask (memory-efficient), and
    with both SDPA falls back to its math path ([n, nh, T, S'] scores per layer). On the H200
    that prefill held the host in ~80% of a regenerate stage's generation time (py-spy,
    BENCHMARKS.md). The copy costs n x nh x S' x hd per layer."""
    g = q.shape[1] // k.shape[1]
    if g > 1:
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def decode_step(target: Llama, cur, pos, n_gen, limit, done, seed, out, kv_slots, stop_ids,
                temperature, top_p, vhash, mode: str, kernel: Optional[Callable] = None):
    """One token for every row, in place on the state (see the module docstring for the
    tensors). kv_slots [kv_len] = arange(kv_len): attention reads slots < kv_len (kv_len > every
    live pos). stop_ids [MAX_STOP] (-1 = unused). kernel: kernels.attention.decode_attention or
    None (SDPA with a mask). No host sync."""
    live = ~done
    mask = (kv_slots[None, :] <= pos[:, None])[:, None, None, :]  # [R, 1, 1, kv_len]
    if kernel is None:
        attn = sdpa_decode
    else:  # the contract: the new key of row b is at slot pos[b], causal (tree_mask None)
        attn = lambda q, k, v, m: kernel(q, k, v, pos, None)  # noqa: E731
    logits, _ = target(cur[:, None], pos[:, None], mask=mask, kv_len=kv_slots.shape[0], attn=attn)
    nxt = pick(logits[:, 0], mode, temperature, top_p, seed, n_gen, vhash)  # [R]
    col = n_gen.clamp(max=out.shape[1] - 1)[:, None]  # [R, 1]
    out.scatter_(1, col, torch.where(live, nxt, out.gather(1, col)[:, 0])[:, None])
    n_new = n_gen + live.long()
    stop = (nxt[:, None] == stop_ids[None, :]).any(-1)
    done.copy_(done | (live & (stop | (n_new >= limit))))
    cur.copy_(torch.where(live, nxt, cur))
    pos.add_(live.long())
    n_gen.copy_(n_new)


# ----------------------------------------------------------------------------------------------
# the generator


class Generator:
    """Continuous batching over `rows` rows of the target's static cache.

    target: our Llama (models.llama.from_hf_model), whose cache this allocates
    ([rows, .., max_seq]).
    max_new: the widest request (out buffer width). cuda_graph (CUDA only): compile the decode
    step with mode="reduce-overhead" (inductor + CUDA graphs; state and caches are static
    addresses); compile_backend ("eager", "aot_eager", "inductor"): compile on any device
    without CUDA graphs (tests); neither: eager. kv_bucket: kv_len granularity (one CUDA graph
    per value used). sync_every: decode steps between host syncs (a row that finishes idles at
    most that many steps). refill_min: prefill new requests only once this many rows are free
    (an eager prefill costs a fixed launch overhead on CUDA); default rows // 16 on CUDA, 1 on
    CPU. prefill_tokens: padded tokens per prefill forward. kernels (the project's switch,
    kernels/switch.py): "triton" = the decode step's attention through
    kernels.attention.decode_attention (reads only each row's own slots, so its cost follows
    every row's length, not the bucket's), "torch" = SDPA, "auto" = torch (kernels/switch.py). The
    matmuls stay cuBLAS: the fused forward (kernels/llama_decode.py) is built for <= ~64 rows.
    Raises ValueError for bad sizes or kernels and, from run, for a prompt that does not fit."""

    def __init__(self, target: Llama, rows: int, max_seq: int, max_new: int,
                 cuda_graph: bool = False, compile_backend: Optional[str] = None,
                 kv_bucket: int = 128, sync_every: int = 8, refill_min: Optional[int] = None,
                 prefill_tokens: int = 16384, kernels: str = "torch"):
        if rows < 1 or max_new < 1 or max_seq < 2:
            raise ValueError(f"Generator: rows ({rows}), max_new ({max_new}) >= 1 and max_seq "
                             f"({max_seq}) >= 2 needed")
        p = target.lm_head.weight
        self.target, self.device = target, p.device
        self.R, self.S, self.M = rows, max_seq, max_new
        self.kv_bucket, self.sync_every = max(16, kv_bucket), max(1, sync_every)
        self.refill_min = refill_min or (max(1, rows // 16) if p.device.type == "cuda" else 1)
        self.prefill_tokens = max(prefill_tokens, max_seq)
        # one slot more than max_seq: kv_len (<= max_seq) never equals the cache length, so the
        # slice k_cache[:, :, :kv_len] is one symbolic case for dynamo, not two
        target.setup_cache(rows, max_seq + 1)
        dev, R = self.device, rows
        z = lambda dt=torch.long: torch.zeros(R, dtype=dt, device=dev)  # noqa: E731
        self.cur, self.pos, self.n_gen, self.limit, self.seed = z(), z(), z(), z(), z()
        self.done = torch.ones(R, dtype=torch.bool, device=dev)
        self.out = torch.zeros(R, max_new, dtype=torch.long, device=dev)
        self.slots = torch.arange(max_seq + 1, device=dev)
        self.vhash = _mix(torch.arange(target.config.vocab_size, device=dev))
        self.stop_ids = torch.full((MAX_STOP,), -1, dtype=torch.long, device=dev)
        self.temperature = torch.ones(1, device=dev)
        self.top_p = torch.ones(1, device=dev)
        kn = resolve_kernels(kernels, dev)
        self.kernel = None  # decode attention: SDPA over the kv_len slice (torch) or the kernel
        if kn == "triton":
            from eagle3_runner.kernels.attention import decode_attention
            self.kernel = decode_attention
        self.state = (self.cur, self.pos, self.n_gen, self.limit, self.done, self.seed, self.out)
        kw = compile_options(dev, cuda_graph, compile_backend, kn)
        self.compiled = kw is not None
        self.steps = {"decode": decode_step}
        if self.compiled:  # dynamic=None: kv_len is marked dynamic (one graph for every bucket)
            compile_steps(self.steps, ["decode"], dict(kw, dynamic=None),
                          target.caches() + list(self.state))
        self.step = self.steps["decode"]

    def graph_counts(self) -> int:
        """Compiled graphs of the decode step (dynamo cache entries): 1 for greedy and sampled
        runs together, 1 more once a top-p run is made,
        whatever the kv_len buckets; 0 when not compiled."""
        return graph_counts(self.steps, ["decode"])["decode"] if self.compiled else 0

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    # -- prefill (eager: variable shapes) --
    def _prefill(self, entries: list, mode: str) -> int:
        """entries: (row, Request, reuse) with reuse = cached prefix slots kept. Prefills
        ids[reuse:] at positions reuse.. into each row, picks its first token, sets its state.
        Returns the tokens prefilled."""
        done_tokens = 0
        entries = sorted(entries, key=lambda e: len(e[1].ids) - e[2])
        i = 0
        while i < len(entries):
            j = i + 1  # grow the chunk while the padded size stays within prefill_tokens
            while j < len(entries) and (j + 1 - i) * (len(entries[j][1].ids) - entries[j][2]) \
                    <= self.prefill_tokens:
                j += 1
            chunk, i = entries[i:j], j
            T = max(len(r.ids) - s for _, r, s in chunk)
            done_tokens += self._prefill_chunk(chunk, T, mode)
        return done_tokens

    def _h2d(self, x) -> torch.Tensor:
        """A host list or CPU tensor on the Generator's device. On CUDA through pinned memory and a
        non-blocking copy: a plain copy from pageable memory synchronises the stream, so the host
        would wait for every decode step already launched before it could enqueue the prefill,
        and the GPU would then idle while the host prepares the next one."""
        t = x if isinstance(x, torch.Tensor) else torch.tensor(x)
        if self.device.type != "cuda":
            return t.to(self.device)
        return t.pin_memory().to(self.device, non_blocking=True)

    def _prefill_chunk(self, chunk, T: int, mode: str) -> int:
        S = self.S
        n = len(chunk)
        ids = torch.zeros(n, T, dtype=torch.long)
        start = torch.tensor([s for _, _, s in chunk])
        lens = torch.tensor([len(r.ids) - s for _, r, s in chunk])
        for k, (_, r, s) in enumerate(chunk):
            ids[k, :len(r.ids) - s] = torch.tensor(r.ids[s:])
        pos = (start[:, None] + torch.arange(T)[None]).clamp(max=S)  # padding -> the spare slot S
        total = [len(r.ids) for _, r, _ in chunk]
        top = int((start + lens).max())
        kv_len = min(S, -(-top // 64) * 64)
        rows = self._h2d([row for row, _, _ in chunk])
        seed = self._h2d([r.seed & M31 for _, r, _ in chunk])
        limit = self._h2d([min(r.max_new, S - t) for (_, r, _), t in zip(chunk, total)])
        logits, _ = self.target(self._h2d(ids), self._h2d(pos), rows=rows,
                                select=self._h2d(lens - 1), kv_len=kv_len, attn=sdpa_prefill)
        first = pick(logits[:, 0], mode, self.temperature, self.top_p, seed,
                     torch.zeros_like(seed), self.vhash)  # [n]
        # the rows' state through index_copy_/index_fill_ (device indices and values: no host
        # round trip; the indexed assignments before, `self.pos[rows] = ...`, synchronised the
        # stream on the H200 under set_sync_debug_mode, at which one was not found)
        for buf, val in ((self.cur, first), (self.pos, self._h2d(total)), (self.limit, limit),
                         (self.seed, seed), (self.out[:, 0], first)):
            buf.index_copy_(0, rows, val)
        self.n_gen.index_fill_(0, rows, 1)
        self.done.index_copy_(0, rows, (first[:, None] == self.stop_ids[None]).any(-1) |
                              (limit <= 1))
        return int(lens.sum())

    # -- the loop --
    @torch.inference_mode()
    def run(self, requests: Iterable[Request],
            on_done: Callable[[list], Optional[list]],
            temperature: float = 0.0, top_p: float = 1.0, stop_ids=(), bar=None) -> dict:
        """Generate every request (in the order given, as rows free up; the iterable is consumed
        lazily, `rows` ahead, while launched steps run) and the follow-ups that on_done returns
        (each continues in its parent's row). on_done gets the Results of the rows finished at
        one host sync, as a list, and returns None (no follow-ups) or one Request-or-None per
        Result: one call per sync, so a caller can decode and tokenise the follow-up turns in one
        batched tokenizer call (per turn, the chat template render and tokenisation of a ShareGPT
        conversation cost ~3.3 ms on one core, which the GPU's 8 decode steps do not cover).
        bar: a tqdm to update with tokens.
        Returns stats {new_tokens, prefill_tokens, reused_tokens, steps, prefills, seconds,
        wait_s (seconds the host waited for the GPU at its syncs: near `seconds` = GPU-bound,
        near 0 = the GPU waited for the host), kv_lens (the kv_len buckets the decode step ran
        at)}.
        Raises ValueError for a prompt that leaves no room in max_seq, max_new > the
        Generator's, more than MAX_STOP stop ids, or on_done returning a list of another length."""
        if len(stop_ids) > MAX_STOP:
            raise ValueError(f"stop_ids: at most {MAX_STOP}, got {list(stop_ids)}")
        if temperature > 0:
            mode = "top_p" if top_p < 1 else "sample"
        else:  # compiled: the graph greedy shares with sampling; eager: the bare argmax
            mode = "sample" if self.compiled else "greedy"
        self.stop_ids.fill_(-1)
        self.stop_ids[:len(stop_ids)] = torch.tensor(list(stop_ids), dtype=torch.long)
        self.temperature.fill_(max(temperature, 0.0))
        self.top_p.fill_(top_p)
        self.done.fill_(True)
        self.pos.zero_()
        it, queue = iter(requests), deque()  # requests are drawn lazily (tokenised on demand)

        def top_up():  # keep `rows` requests ready; runs while the GPU works on launched steps
            while len(queue) < self.R and (r := next(it, None)) is not None:
                queue.append(self._check(r))

        top_up()
        row_req: list = [None] * self.R
        row_cached: list = [None] * self.R  # token ids in the row's cache when it finished
        free = list(range(self.R - 1, -1, -1))
        pending: list = []  # (row, request, reuse)
        st = dict(new_tokens=0, prefill_tokens=0, reused_tokens=0, steps=0, prefills=0,
                  wait_s=0.0)
        kv_lens = set()
        host_pos = [0] * self.R  # positions at the last sync (+ prompt lengths of new rows)
        self._sync()
        t0 = time.perf_counter()
        launched = False  # a batch of decode steps is enqueued and not yet synced

        def launch():
            top = max(p for p, r in zip(host_pos, row_req) if r is not None) + self.sync_every + 1
            kv_len = min(self.S, -(-top // self.kv_bucket) * self.kv_bucket)
            if self.kernel is not None:  # it bounds each row itself: the whole cache, static
                kv_len = self.S + 1
            kv_lens.add(kv_len)
            kv_slots = self.slots[:kv_len]
            if self.compiled and self.kernel is None:
                torch._dynamo.mark_dynamic(kv_slots, 0, min=2, max=self.S)
            for _ in range(self.sync_every):
                self.step(self.target, *self.state, kv_slots, self.stop_ids, self.temperature,
                          self.top_p, self.vhash, mode, self.kernel)
            st["steps"] += self.sync_every

        while True:
            active = any(r is not None for r in row_req)
            if queue and (len(free) >= min(self.refill_min, len(queue)) or not active):
                while free and queue:
                    pending.append((free.pop(), queue.popleft(), 0))
            if pending:  # enqueued after any launched steps: those never touch these rows
                for row, req, reuse in pending:
                    row_req[row] = req
                    host_pos[row] = len(req.ids)
                    st["reused_tokens"] += reuse
                st["prefill_tokens"] += self._prefill(pending, mode)
                st["prefills"] += 1
                pending = []
            if not launched:
                if not any(r is not None for r in row_req):
                    break
                launch()
            top_up()  # host work while the GPU runs the launched steps
            tw = time.perf_counter()
            done, n_gen, pos = torch.stack([self.done.long(), self.n_gen, self.pos]).tolist()
            st["wait_s"] += time.perf_counter() - tw  # the host idle: the GPU was behind
            host_pos = pos
            fin = [r for r in range(self.R) if row_req[r] is not None and done[r]]
            outs = self.out[fin].tolist() if fin else []  # one copy for every finished row
            reqs = [row_req[r] for r in fin]
            for r in fin:
                row_req[r] = None
            launched = any(r is not None for r in row_req)
            if launched:  # keep the GPU busy while the host handles the finished rows
                launch()
            results = []
            for r, req, toks in zip(fin, reqs, outs):
                toks = toks[:n_gen[r]]
                stop = toks[-1] in stop_ids
                st["new_tokens"] += len(toks)
                row_cached[r] = list(req.ids) + toks[:-1]  # the last token never entered it
                results.append(Result(req.key, toks, "stop" if stop else "length", len(req.ids)))
            if bar is not None and results:
                bar.update(sum(len(x.tokens) for x in results))
            nxts = on_done(results) if results else None  # ONE call for the rows of this sync
            if nxts is None:
                nxts = [None] * len(results)
            elif len(nxts) != len(results):
                raise ValueError(f"on_done returned {len(nxts)} follow-ups for {len(results)} "
                                 "results; it must return one (a Request or None) per result")
            for r, nxt in zip(fin, nxts):
                if nxt is None:
                    free.append(r)
                    continue
                nxt = self._check(nxt)
                pending.append((r, nxt, _common_prefix(row_cached[r], nxt.ids)))
        self._sync()
        st["seconds"] = time.perf_counter() - t0
        st["kv_lens"] = sorted(kv_lens)
        return st

    def _check(self, req: Request) -> Request:
        if not req.ids or len(req.ids) >= self.S:
            raise ValueError(f"request {req.key!r}: prompt of {len(req.ids)} tokens; it needs "
                             f"1..{self.S - 1} (max_seq {self.S}). Drop longer prompts first.")
        if not 1 <= req.max_new <= self.M:
            raise ValueError(f"request {req.key!r}: max_new {req.max_new} outside 1..{self.M}")
        return req


def _common_prefix(a: list, b: list) -> int:
    """Cached slots a new prompt `b` can keep from a row holding `a`: their longest common
    prefix, at most len(b) - 1 (the last prompt token is always prefilled: it gives the logits)."""
    n = min(len(a), len(b) - 1)
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
