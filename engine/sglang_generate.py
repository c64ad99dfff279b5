"""Batched generation through an SGLang server: the regenerate stage's other engine, behind the
embedded Generator's contract (engine/generate.py `Generator.run`: Requests in, Results handed to
on_done in groups, follow-up turns back; the same stats), so jobs/regen_turns.py's synthesis and
answering, shards, resume and counters run unchanged on either.

Requests go out as batched, streamed /generate calls of token ids (targets/sglang_target.py
stream_call: our chat template renders them, the server's answers come back as output_ids, each
request as soon as it finishes; SGLang 0.5.14 tokenizer_manager.py _handle_batch_request sends a
batch of input_ids to its scheduler at once and streams each request's result tagged with its
index). At most `rows` requests are in flight (the window).

The window is refilled by the call thread that received a finished request, at once (`_Window`:
one lock), from requests made ready before they are needed: follow-up turns first, then the next
requests of the iterable, which the caller's thread draws (renders, tokenises, checks) up to
LOOKAHEAD_CALLS calls' worth ahead of the free slots. So the caller's host work (on_done: decoding
answers, rendering and tokenising the next turns, writing records; drawing requests) runs while
the server's batch stays full, and never holds a slot empty: the caller's thread waits only in
`run`'s one blocking get (wait_s), then hands everything that finished meanwhile to ONE on_done
call. A call leaves as soon as `per_call` slots are free (or with what is left once the iterable is
exhausted), so calls stay batched and the window stays within per_call of full. With a server
that runs fewer requests than the window (--max-running-requests), the surplus waits in its queue,
and a dip of the window smaller than that surplus never reaches its batch.

What the window did (stats "window", sums over the run, for the stage's metrics:
`window_metrics`): in_flight_s (requests in flight integrated over time: / seconds = the mean
window), host_s (the caller's thread in on_done and drawing requests), short_s (a call's worth of
slots free, nothing ready and more requests to come: the host was behind the server), tail_s
(after the last call left: the window draining).
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

LOOKAHEAD_CALLS = 2  # requests drawn ahead of the free slots, in calls of per_call


class _Window:
    """The requests in flight of one run, shared by the caller's thread and the call threads under
    one lock: ready requests ((Request, sampling params); follow-ups first), the live count, the
    done queue (a finished request, or a call's exception) and the window's time sums (module
    docstring). call(batch, finished) makes one call of the batch (in a thread of its own: HTTP
    waits release the GIL), handing each finished request, or its exception, to `finished`."""

    def __init__(self, rows: int, per_call: int, call: Callable[[list, Callable], None]):
        self.lock = threading.Lock()
        self.follow: deque = deque()
        self.fresh: deque = deque()
        self.done: queue.Queue = queue.Queue()
        self.R, self.per_call, self.call = rows, per_call, call
        self.live, self.calls = 0, 0
        self.drawn_all = False  # the iterable is exhausted
        self.stopped = False  # the run ended or failed: no call leaves any more
        self.t = self.last_call = time.perf_counter()
        self.sums = dict(in_flight_s=0.0, short_s=0.0)

    def ready(self) -> int:
        return len(self.follow) + len(self.fresh)

    def _tick(self) -> None:
        """Under the lock: integrate the state since the last change up to now."""
        now = time.perf_counter()
        dt, self.t = now - self.t, now
        self.sums["in_flight_s"] += self.live * dt
        if self.R - self.live >= self.per_call and not self.ready() and not self.drawn_all:
            self.sums["short_s"] += dt

    def add(self, follow: list = (), fresh: list = (), drawn_all: bool = False) -> None:
        """Requests made ready by the caller's thread; calls leave at once where there is room."""
        with self.lock:
            self._tick()
            self.follow.extend(follow)
            self.fresh.extend(fresh)
            self.drawn_all = self.drawn_all or drawn_all
            self._pump()

    def finished(self, item) -> None:
        """A call thread's finished request (or its call's exception): its slot is refilled."""
        with self.lock:
            self._tick()
            self.done.put(item)
            if isinstance(item, BaseException):
                self.stopped = True
                return
            self.live -= 1
            self._pump()

    def _pump(self) -> None:
        """Under the lock: launch calls while per_call slots are free and requests are ready (any
        free slot once the iterable is exhausted or nothing is in flight)."""
        while not self.stopped and (n := min(self.R - self.live, self.ready(), self.per_call)):
            if self.R - self.live < self.per_call and self.live and not self.drawn_all:
                return
            batch = [(self.follow or self.fresh).popleft() for _ in range(n)]
            self.live += n
            self.calls += 1
            self.last_call = self.t
            threading.Thread(target=self.call, args=(batch, self.finished), daemon=True).start()

    def room(self, ahead: int) -> int:
        """Fresh requests to draw: the free slots plus `ahead`, less what is ready."""
        with self.lock:
            return 0 if self.drawn_all else self.R - self.live + ahead - self.ready()

    def idle(self) -> bool:
        """Nothing in flight, ready or finished-unhandled, and nothing more to draw."""
        with self.lock:
            return not self.live and not self.ready() and self.drawn_all and self.done.empty()

    def stop(self) -> dict:
        """End the run (no call leaves any more); the window's time sums, tail_s included."""
        with self.lock:
            self._tick()
            self.stopped = True
            return {**self.sums, "tail_s": self.t - self.last_call}


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

    def _call(self, batch: list, finished: Callable) -> None:
        """One streamed call of batch [(Request, params)]: finished((Request, ids, finish, meta))
        per request as it finishes, finished(exception) when the call fails."""
        try:
            stream_call(self.srv, [r.ids for r, _ in batch], [p for _, p in batch],
                        lambda i, ids, fin, meta: finished((batch[i][0], ids, fin, meta)))
        except BaseException as e:  # noqa: BLE001 - raised in run's thread
            finished(e)

    def run(self, requests: Iterable[Request], on_done: Callable[[list], Optional[list]],
            temperature: float = 0.0, top_p: float = 1.0, stop_ids=(), bar=None) -> dict:
        """engine/generate.py Generator.run's contract: every request (drawn lazily, up to
        LOOKAHEAD_CALLS x per_call ahead of the free slots) and the follow-ups on_done returns
        (one Request-or-None per Result, one call per group of results that finished while the
        last one ran). Stats {new_tokens, prefill_tokens (prompt tokens the server computed),
        reused_tokens (its radix cache's hits), steps (0: the server's), prefills (calls made),
        seconds, wait_s (this thread blocked on the server), kv_lens ([]), window (module
        docstring)}. Raises StageError when a call fails, ValueError as the Generator's checks."""
        it = iter(requests)

        def ready(r: Request) -> tuple:
            return r, self._params(r, temperature, top_p, stop_ids)
        w = _Window(self.R, self.per_call, self._call)
        ahead = LOOKAHEAD_CALLS * self.per_call
        st = dict(new_tokens=0, prefill_tokens=0, reused_tokens=0, steps=0, wait_s=0.0)
        host = 0.0
        t0 = time.perf_counter()
        try:
            while True:
                th = time.perf_counter()
                need = w.room(ahead)  # drawn ahead a call at a time; then the finished ones
                while need > 0:
                    k = min(need, self.per_call)
                    fresh = [ready(r) for r in _take(it, k)]
                    w.add(fresh=fresh, drawn_all=len(fresh) < k)
                    need = need - k if len(fresh) == k else 0
                host += time.perf_counter() - th
                if w.idle():
                    break
                tw = time.perf_counter()
                got = [w.done.get()]
                st["wait_s"] += time.perf_counter() - tw
                while not w.done.empty():  # everything that finished meanwhile: one on_done
                    got.append(w.done.get_nowait())
                errors = [g for g in got if isinstance(g, BaseException)]
                if errors:
                    raise errors[0] if isinstance(errors[0], StageError) else \
                        StageError(f"SGLang {self.srv.url}: {errors[0]}")
                th = time.perf_counter()
                results = [self._result(st, *g) for g in got]
                if bar is not None:
                    bar.update(sum(len(r.tokens) for r in results))
                nxts = on_done(results)
                if nxts is not None:
                    if len(nxts) != len(results):
                        raise ValueError(f"on_done returned {len(nxts)} follow-ups for "
                                         f"{len(results)} results; it must return one (a Request "
                                         "or None) per result")
                    w.add(follow=[ready(n) for n in nxts if n is not None])
                host += time.perf_counter() - th
        finally:
            window = w.stop()
        st.update(seconds=time.perf_counter() - t0, kv_lens=[], prefills=w.calls,
                  window={**window, "host_s": host})
        return st

    @staticmethod
    def _result(st: dict, req: Request, ids: list, fin: str, meta: dict) -> Result:
        """A finished request as a Result, counted into the stats."""
        cached = int(meta.get("cached_tokens") or 0)
        st["new_tokens"] += len(ids)
        st["prefill_tokens"] += int(meta.get("prompt_tokens", len(req.ids))) - cached
        st["reused_tokens"] += cached
        return Result(req.key, ids, fin, len(req.ids))


def _take(it, k: int) -> list:
    """Up to k items of the iterator `it` (fewer: it is exhausted)."""
    out = []
    while len(out) < k and (r := next(it, None)) is not None:
        out.append(r)
    return out


def window_metrics(phases: list, seconds: float) -> dict:
    """The stage metrics of the request windows of its SGLang runs (each run's stats "window",
    summed; phases without one are skipped), over `seconds` of generation: sglang_in_flight_mean
    (requests, time-weighted), sglang_host_share (the caller's thread in on_done and drawing
    requests), sglang_short_share (the window had a call's worth of free slots and nothing ready:
    the host behind the server), sglang_tail_seconds (the windows draining after their last call).
    {} when no phase ran through SGLang."""
    ws = [p["window"] for p in phases if p and p.get("window")]
    if not ws:
        return {}
    tot = {k: sum(w[k] for w in ws) for k in ws[0]}
    s = max(seconds, 1e-9)
    return {"sglang_in_flight_mean": (tot["in_flight_s"] / s, "requests"),
            "sglang_host_share": (tot["host_s"] / s, "fraction"),
            "sglang_short_share": (tot["short_s"] / s, "fraction"),
            "sglang_tail_seconds": (tot["tail_s"], "s")}
