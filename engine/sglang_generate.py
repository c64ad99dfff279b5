"""Batched generation through an SGLang server: the regenerate stage's other engine, behind the
embedded Generator's contract (engine/generate.py `Generator.run`: Requests in, Results handed to
on_done in groups, follow-up turns back; the same stats), so jobs/regenerate.py's synthesis and
answering, shards, resume and counters run unchanged on either.

Requests go out as batched, streamed /generate calls of token ids (targets/sglang_target.py
stream_call: our chat template renders them, the server's answers come back as output_ids, each
request as soon as it finishes), at most `rows` requests in flight over concurrent calls of up to
`per_call` prompts. A call leaves as soon as that many slots are free (or, at the end of the
work, with what is left), so the server's continuous batch stays full while the host renders the
next turns: it waits only in `run`'s one blocking get (wait_s). Results are handed to on_done
in groups (up to a call's worth, or what arrived within GATHER_S). Follow-up turns go first.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from typing import Callable, Iterable, Optional

from eagle3_runner.engine.generate import Request, Result
from eagle3_runner.runner.errors import StageError
from eagle3_runner.targets.sglang_target import TargetServer, sampling, stream_call

# seconds a group of results may wait for more before on_done: requests finish one by one, and
# on_done's batched decode and render cost ~ms per call (the embedded Generator calls it once per
# host sync)
GATHER_S = 0.02


class SglangGenerator:
    """Generator.run() over the SGLang server `srv` (targets/sglang_target.py TargetServer).

    rows: requests in flight (stages.regenerate.batch_size); max_new: the widest request;
    per_call: prompts per /generate call (default srv.per_call). R and M as the Generator's.
    A prompt whose length plus its max_new exceeds the server's context gets fewer new tokens
    (SGLang refuses the request otherwise)."""

    def __init__(self, srv: TargetServer, rows: int, max_new: int, per_call: int | None = None):
        if rows < 1 or max_new < 1:
            raise ValueError(f"SglangGenerator: rows ({rows}) and max_new ({max_new}) >= 1")
        self.srv, self.R, self.M = srv, rows, max_new
        self.per_call = max(1, min(per_call or srv.per_call, rows))

    def _params(self, req: Request, temperature: float, top_p: float, stop_ids) -> dict:
        if not req.ids or not 1 <= req.max_new <= self.M:
            raise ValueError(f"request {req.key!r}: prompt of {len(req.ids)} tokens, max_new "
                             f"{req.max_new} (1..{self.M})")
        n = req.max_new if not self.srv.context else min(req.max_new,
                                                         self.srv.context - len(req.ids))
        if n < 1:
            raise ValueError(f"request {req.key!r}: a {len(req.ids)}-token prompt leaves no room "
                             f"in the server's context of {self.srv.context}")
        return sampling(n, temperature, top_p, stop_ids, req.seed, stream=True)

    def run(self, requests: Iterable[Request], on_done: Callable[[list], Optional[list]],
            temperature: float = 0.0, top_p: float = 1.0, stop_ids=(), bar=None) -> dict:
        """engine/generate.py Generator.run's contract: every request (drawn lazily, as slots
        free up) and the follow-ups on_done returns (one Request-or-None per Result, one call per
        group of results that arrived together). Stats {new_tokens, prefill_tokens (prompt
        tokens the server computed), reused_tokens (its radix cache's hits), steps (0: the
        server's), prefills (calls made), seconds, wait_s (this thread blocked on the server),
        kv_lens ([])}. Raises StageError when a call fails, ValueError as the Generator's
        checks."""
        it, follow = iter(requests), deque()
        done_q: queue.Queue = queue.Queue()
        st = dict(new_tokens=0, prefill_tokens=0, reused_tokens=0, steps=0, prefills=0,
                  wait_s=0.0)
        live, exhausted = 0, False
        t0 = time.perf_counter()

        def call(batch: list[Request], params: list[dict]):
            try:
                stream_call(self.srv, [r.ids for r in batch], params,
                            lambda i, ids, fin, meta: done_q.put((batch[i], ids, fin, meta)))
            except BaseException as e:  # noqa: BLE001 - raised in run's thread
                done_q.put(e)

        while True:
            while live < self.R:  # launch: follow-ups first, then new requests
                room = self.R - live
                if room < self.per_call and not exhausted and live:
                    break  # wait for a full call's worth of free slots
                batch = []
                while len(batch) < min(room, self.per_call):
                    if follow:
                        batch.append(follow.popleft())
                    elif not exhausted and (r := next(it, None)) is not None:
                        batch.append(r)
                    else:
                        exhausted = True
                        break
                if not batch:
                    break
                params = [self._params(r, temperature, top_p, stop_ids) for r in batch]
                threading.Thread(target=call, args=(batch, params), daemon=True).start()
                live += len(batch)
                st["prefills"] += 1
            if not live:
                break
            tw = time.perf_counter()
            got = [done_q.get()]
            st["wait_s"] += time.perf_counter() - tw
            end = time.perf_counter() + GATHER_S  # what arrives meanwhile: one on_done call
            while len(got) < min(self.per_call, live) and (left := end - time.perf_counter()) > 0:
                try:
                    got.append(done_q.get(timeout=left))
                except queue.Empty:
                    break
            errors = [g for g in got if isinstance(g, BaseException)]
            if errors:
                raise errors[0] if isinstance(errors[0], StageError) else \
                    StageError(f"SGLang {self.srv.url}: {errors[0]}")
            live -= len(got)
            results = []
            for req, ids, fin, meta in got:
                cached = int(meta.get("cached_tokens") or 0)
                st["new_tokens"] += len(ids)
                st["prefill_tokens"] += int(meta.get("prompt_tokens", len(req.ids))) - cached
                st["reused_tokens"] += cached
                results.append(Result(req.key, ids, fin, len(req.ids)))
            if bar is not None:
                bar.update(sum(len(r.tokens) for r in results))
            nxts = on_done(results)
            if nxts is None:
                continue
            if len(nxts) != len(results):
                raise ValueError(f"on_done returned {len(nxts)} follow-ups for {len(results)} "
                                 "results; it must return one (a Request or None) per result")
            follow.extend(n for n in nxts if n is not None)
        st["seconds"] = time.perf_counter() - t0
        st["kv_lens"] = []
        return st
