"""The regenerate stage's turns (jobs/regenerate.py regenerate() drives them): the work done on a
Generator, whichever engine runs it (engine/generate.py Generator.run, or engine/sglang_generate.py
SglangGenerator behind the same contract).

- `Conv`: one conversation in flight (its answered turns, what is left to answer, its record);
  `context_steps`, `turn_steps` and `real_conversations` make them from the training
  conversations; `later_turns`, `carried_later` and `continue_carried` make them from the
  records of a carried set that the data has later turns for (stages.regenerate.extend).
- `Budget`: the stage's time budget (stages.regenerate.max_minutes) and the share of it
  synthesis gets.
- `warm_up`: the decode step compiled before any budget starts.
- `synthesize`: the synthetic user turns (Magpie) the target writes, in one run of the engine.
- `answer`: every turn answered on the continuous batch, one record per conversation written
  through the stage's ShardWriter.

What these do for the stage as a whole (turn order, budget, drops and cuts): jobs/regenerate.py's
module docstring. Torch and the engine are imported inside the functions that use them.
"""

from __future__ import annotations

import math
import random
import time
import zlib
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional

from eagle3_runner.data.regen_store import BUDGET, ShardWriter
from eagle3_runner.data.synthetic import KEEP_RATE

if TYPE_CHECKING:
    from eagle3_runner.engine.generate import Generator


def seed_of(seed: int, *key) -> int:
    """A per-sequence sampling seed in [0, 2^31) from the stage seed and a key."""
    from eagle3_runner.engine.generate import M31
    return zlib.crc32(":".join(map(str, (seed,) + key)).encode()) & M31


@dataclass
class Conv:
    """One conversation in flight: its turns so far and what is left to answer."""

    id: str
    source: str
    index: int
    steps: list  # per answer to write: the turns before it (context_steps), in order
    messages: list  # the finished steps, each with the target's answer
    finish: list = field(default_factory=list)
    answer_tokens: list = field(default_factory=list)
    carried: Optional[dict] = None  # the carried record it continues (continue_carried)

    def prompt(self) -> list:
        """The messages of the next turn's prompt: the finished steps (with the target's
        answers), then the context of the next answer."""
        return self.messages + self.steps[len(self.finish)]

    def record(self, cut=None, dropped=None) -> dict:
        return {"id": self.id, "source": self.source, "index": self.index,
                "messages": self.messages, "finish": self.finish,
                "answer_tokens": self.answer_tokens, "cut": cut, "dropped": dropped}

    def stopped(self, reason: str) -> dict:
        """The record of a conversation ended early: cut after its answered turns, or dropped
        when it has none. A continued carried record always has answered turns: it keeps them,
        cut."""
        return self.record(cut=reason) if self.finish else self.record(dropped=reason)

    def unstarted(self) -> dict:
        """The record of a conversation the time budget never started: dropped (time_budget),
        or, continuing a carried record, that record as it was carried (its answers kept)."""
        return self.carried if self.carried is not None else self.record(dropped=BUDGET)


class Budget:
    """The stage's time budget: `over()` is True once `minutes` have passed since it was made
    (never when minutes is None). clock: seconds (time.monotonic; a test passes its own)."""

    def __init__(self, minutes: Optional[float], clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.end = None if minutes is None else clock() + 60.0 * minutes

    def over(self) -> bool:
        return self.end is not None and self.clock() >= self.end

    def share(self, fraction: float) -> "Budget":
        """A budget ending `fraction` of the way from now to this one's end (same clock)."""
        b = Budget(None, self.clock)
        if self.end is not None:
            now = self.clock()
            b.end = now + fraction * max(self.end - now, 0.0)
        return b


def warm_up(gen: Generator, tok, params) -> float:
    """Compile the decode step before any budget starts: one short request in each sampling mode
    the stage uses (the synthetic prompts' and the answers'; greedy and sampled share a graph,
    top-p has its own; on the H200 with torch 2.11 a bench engine of SmolLM2 took 55-165 s to
    build and warm, and the 2026-12-02 scale run's regeneration, both compiles inside its 3.5-minute
    budget, averaged 8.8k tok/s). Returns the seconds it took."""
    from eagle3_runner.data.prompts import render
    from eagle3_runner.engine.generate import Request
    t0 = time.perf_counter()
    ids = render(tok, [{"role": "user", "content": "Hello!"}])
    modes = [(params.temperature, params.top_p)]
    if params.synthetic_prompts:
        modes.append((params.synthetic_temperature, params.synthetic_top_p))
    for temperature, top_p in modes:
        gen.run([Request("warm-up", ids, min(8, gen.M))], lambda rs: None, temperature, top_p)
    return time.perf_counter() - t0


MAX_CANDIDATES = 80  # candidates per synthetic prompt wanted, at most (4 rounds x 20 before)


def synthesize(gen: Generator, tok, params, guard, stop_ids: tuple[int, ...], progress=True,
               budget: Optional[Budget] = None, first_index: int = 0,
               avoid: tuple[str, ...] = ()) -> tuple[list, dict]:
    """Magpie: params.synthetic_prompts user turns written by the target, in ONE run of the
    engine, so no round waits for its slowest candidate: candidates 0, 1, 2, ... are drawn while
    those in flight fall short of what the prompts still wanted need at the keep rate so far
    (distinct candidates passing data/synthetic.py verdict; KEEP_RATE before any finished),
    x 1.2 + 8; each finished candidate followed by the next while short, up to MAX_CANDIDATES per prompt
    wanted, none once the budget is over. data/synthetic.py select then keeps the lowest-indexed
    ones: the prompts any longer run would keep. A candidate ends at the end of its user turn
    (data/synthetic.py user_turn_prefix: stop_ids, the target's end-of-turn ids, and the
    template's end-of-turn token). Candidates are numbered from `first_index` (a grown carried set,
    jobs/regenerate.py: after its highest synthetic index, so their seeds, seed_of(seed,
    "syn-candidate", index), are new ones) and one equal (normalised) to a text of `avoid` (the
    carried prompts) is dropped as a duplicate.
    Returns (kept [(index, text)], report {candidates, kept, dropped {reason: n}, tokens, seconds,
    wait_s, row_steps (decode steps x rows: the token slots the steps ran), window (the SGLang
    engine's request window, engine/sglang_generate.py; None on the embedded engine)})."""
    budget = budget or Budget(None)
    from tqdm import tqdm
    from eagle3_runner.data.contamination import normalize
    from eagle3_runner.data.synthetic import select, user_turn_prefix, verdict
    from eagle3_runner.engine.generate import Request
    prefix, stop = user_turn_prefix(tok, stop_ids)
    want, cands, passing, drawn = params.synthetic_prompts, [], set(), [0]
    avoid = {normalize(t) for t in avoid}
    bar = tqdm(unit="tok", desc="synthetic prompts", disable=not progress, smoothing=0.1)

    def short() -> bool:  # another candidate is needed in flight
        rate = len(passing) / len(cands) if cands else KEEP_RATE
        need = math.ceil((want - len(passing)) / max(rate, 0.05) * 1.2) + 8
        return len(passing) < want and drawn[0] - len(cands) < need and \
            drawn[0] < MAX_CANDIDATES * want and not budget.over()

    def candidate():
        drawn[0] += 1
        i = first_index + drawn[0] - 1
        return Request(i, prefix, params.synthetic_max_tokens,
                       seed_of(params.seed, "syn-candidate", i))

    def first():
        while short():
            yield candidate()

    def done(results):  # one batched decode; each finished candidate followed while short
        texts = tok.batch_decode([r.tokens for r in results], skip_special_tokens=True)
        for r, t in zip(results, texts):
            cands.append((r.key, t.strip(), r.finish == "stop"))
            n = normalize(cands[-1][1])
            if verdict(*cands[-1][1:], guard) is None and n not in avoid:
                passing.add(n)
        return [candidate() if short() else None for _ in results]
    st = gen.run(first(), done, params.synthetic_temperature, params.synthetic_top_p, stop, bar)
    bar.close()
    kept, drops = select(cands, guard, want, avoid)
    return kept, {"candidates": len(cands), "kept": len(kept), "dropped": dict(drops),
                  "tokens": st["new_tokens"], "seconds": st["seconds"], "wait_s": st["wait_s"],
                  "row_steps": st["steps"] * gen.R, "window": st.get("window")}


def context_steps(conv: list[dict]) -> list[list[dict]]:
    """The turns before each assistant answer the target rewrites, in order. An assistant turn
    with plain content (no tool_calls) that follows other turns is rewritten; system, user and
    tool turns and assistant tool calls are kept as they are, as context of the next answer.
    Turns after the last rewritten answer are left out."""
    steps, pending = [], []
    for t in conv:
        if t["role"] == "assistant" and not t.get("tool_calls") and pending:
            steps.append(pending)
            pending = []
        else:
            pending.append(t)
    return steps


def real_id(index: int) -> str:
    """The id of the real conversation at `index` of the training split (data order:
    data/conversations.py load_conversations), in records and shards."""
    return f"real-{index:06d}"


def turn_steps(conv: list[dict], max_turns: Optional[int]) -> tuple[list, int]:
    """context_steps of `conv`, the first max_turns of them (None = all). Returns (steps, the
    answers cut by max_turns)."""
    steps = context_steps(conv)
    if max_turns is not None and len(steps) > max_turns:
        return steps[:max_turns], len(steps) - max_turns
    return steps, 0


def real_conversations(convs, params, guard) -> tuple[list, Counter]:
    """Conv jobs of the real training conversations (ids real_id: data order), without the
    contaminated ones. Returns (jobs, {"contaminated": n, "cut_max_turns": answers cut})."""
    jobs, rep = [], Counter()
    for i, c in enumerate(convs):
        if guard is not None and guard.conversation(c):
            rep["contaminated"] += 1
            continue
        steps, cut = turn_steps(c, params.max_turns)
        if cut:
            rep["cut_max_turns"] += cut
        if steps:
            jobs.append(Conv(real_id(i), "real", i, steps, []))
    return jobs, rep


# ----------------------------------------------------------------------------------------------
# a carried set's conversations continued with the data's later turns (stages.regenerate.extend)


def _turn(t: dict) -> tuple:
    """What of a turn must agree between a carried record and the data: role, text, tool calls
    (a record's turns may be ShareGPT's {"from", "value"}: data/regen_store.py)."""
    return t.get("role", t.get("from")), t.get("content", t.get("value")), t.get("tool_calls")


def _answers_fit(messages: list, steps: list, answered: int) -> bool:
    """Whether `messages` are steps[0], an answer, steps[1], an answer, ... for `answered`
    answers: the carried record's context turns are the data's (the target's answers between
    them are the record's own)."""
    at = 0
    for s in steps[:answered]:
        if [_turn(t) for t in messages[at:at + len(s)]] != [_turn(t) for t in s]:
            return False
        at += len(s)
        if at >= len(messages) or _turn(messages[at])[0] != "assistant":
            return False
        at += 1
    return at == len(messages)


def later_turns(record: dict, steps: Optional[list]) -> Optional[str]:
    """Why the carried `record` (a regenerate record: data/regen_store.py) is not continued with
    later turns of its conversation in this run's data, or None when it is.

    The conversation is the one the record's id names, real_id of its index in this run's
    training split: the key a grown set already tells its started conversations by
    (jobs/regenerate.py: a real conversation with a record is done), not the prompt text.
    steps: turn_steps of that conversation (max_turns applied), None when the data has no
    such index. Reasons: "synthetic" (a self-written prompt: no later turns), "ended" (dropped,
    or cut for another reason than the time budget: the turn it stopped at, a prompt over
    data.max_length, an empty answer, a template the tokenizer refuses, would stop it again),
    "not_in_data", "all_answered" (as many answers as the steps: max_turns reached, or the
    conversation has no more), "unlike_data" (its context turns are not the data's: the data
    is not the one the set was made from, or not in the same order: runner/carry.py warnings).
    A record cut by the time budget (cut_time_budget) is continued like an answered one; an
    answer that ended at max_new_tokens without EOS (finish "length") is kept and followed by
    the next turn, as in a fresh run (answer)."""
    if record["source"] != "real":
        return "synthetic"
    if record["dropped"] or record["cut"] not in (None, BUDGET) or not record["finish"]:
        return "ended"
    if steps is None or record["id"] != real_id(record["index"]):
        return "not_in_data"
    if len(steps) <= len(record["finish"]):
        return "all_answered"
    if not _answers_fit(record["messages"], steps, len(record["finish"])):
        return "unlike_data"
    return None


def carried_later(convs: list, params) -> Callable[[dict], Optional[str]]:
    """later_turns of a carried record against `convs` (the training conversations, data
    order) under params.max_turns: data/regen_store.py carry_into's `later`, which holds back
    the records it is None for (continue_carried continues them)."""
    steps = {real_id(i): turn_steps(c, params.max_turns)[0] for i, c in enumerate(convs)}
    return lambda r: later_turns(r, steps.get(r["id"]))


def continue_carried(jobs: list, held: tuple) -> tuple[list, list]:
    """`jobs` (real_conversations) with the job of every `held` carried record (later_turns
    None: data/regen_store.py Carried.held) replaced by a Conv that continues it: its finished
    steps are the record's messages, finish and answer tokens (the target's earlier answers,
    the context of the next), its steps its job's, so the next turn asked is steps[len(finish)],
    seeded as in a fresh run (seed_of(seed, id, turn)). Returns (jobs, the held records with no
    job: a conversation the bench guard now drops; written as they were carried)."""
    by_id = {r["id"]: r for r in held}
    out = []
    for j in jobs:
        r = by_id.pop(j.id, None)
        out.append(j if r is None else
                   Conv(j.id, j.source, j.index, j.steps, list(r["messages"]), list(r["finish"]),
                        list(r["answer_tokens"]), carried=r))
    return out, list(by_id.values())


def answer(gen: Generator, tok, jobs: list, params, max_length: int, writer: ShardWriter,
           stop_ids: tuple[int, ...], progress=True, budget: Optional[Budget] = None) -> dict:
    """Answer every turn of `jobs` (Conv) on the continuous batch, writing one record per
    conversation through `writer`; an answer ends at the first of `stop_ids` (the target's
    end-of-turn ids). Without a budget, jobs start longest first (most turns, longest first
    turn), so the multi-turn ones do not form the tail; with one, in a shuffled order seeded by
    params.seed, and none starts once it is over (jobs/regenerate.py's module docstring).
    Returns the Generator's stats and by_source {source: new answer tokens of this run}."""
    from tqdm import tqdm
    from eagle3_runner.data.chat import template_errors
    from eagle3_runner.data.prompts import render, render_batch
    from eagle3_runner.engine.generate import Request
    budget = budget or Budget(None)
    if budget.end is None:
        jobs = sorted(jobs, key=lambda j: (-len(j.steps),
                                           -sum(len(t["content"]) for t in j.steps[0])))
    else:
        jobs = sorted(jobs, key=lambda j: j.id)
        random.Random(params.seed).shuffle(jobs)
    started = 0  # jobs[:started] were started: first_turns takes them in order
    by_source: Counter = Counter()  # new answer tokens per source, this run
    bar = tqdm(unit="tok", desc="regenerate", disable=not progress, smoothing=0.1)
    finished = [0]
    refused = template_errors()

    def rendered(js: list) -> list:  # the jobs' next prompts in one tokenizer call
        try:
            return render_batch(tok, [j.prompt() for j in js])
        except refused:  # one by one: request() drops the refused ones
            return [None] * len(js)

    def request(job: Conv, ids=None):
        turn = len(job.finish)
        if ids is None:
            try:
                ids = render(tok, job.prompt())
            except refused:  # e.g. Llama 3.1 and two tool calls in one turn
                writer.add(job.stopped("template_error"))
                return None
        if len(ids) >= max_length:
            writer.add(job.stopped("prompt_too_long"))
            return None
        return Request(job, ids, params.max_new_tokens, seed_of(params.seed, job.id, turn))

    def first_turns():  # tokenised 256 at a time, in one batched call each
        nonlocal started
        for i in range(0, len(jobs), 256):
            if budget.over():
                return
            chunk = jobs[i:i + 256]
            for j, ids in zip(chunk, rendered(chunk)):
                if budget.over():
                    return
                started += 1
                if (r := request(j, ids)) is not None:
                    yield r

    def record_answer(job: Conv, r, text: str) -> bool:
        """Record the answer `text` of job's current turn; True when the job goes on."""
        by_source[job.source] += len(r.tokens)
        if not text:
            writer.add(job.stopped("empty_reply"))
            return False
        job.messages = job.prompt() + [{"role": "assistant", "content": text}]
        job.finish.append(r.finish)
        job.answer_tokens.append(len(r.tokens))
        if len(job.finish) == len(job.steps):
            writer.add(job.record())
            finished[0] += 1
            bar.set_postfix(conversations=finished[0], refresh=False)
            return False
        if budget.over():
            writer.add(job.record(cut=BUDGET))
            return False
        return True

    def done(results):  # the rows of one host sync: one batched decode and one tokenizer call
        texts = tok.batch_decode([r.tokens for r in results], skip_special_tokens=True)
        go = [k for k, (r, t) in enumerate(zip(results, texts))
              if record_answer(r.key, r, t.strip())]
        nxt = [None] * len(results)
        for k, ids in zip(go, rendered([results[k].key for k in go])):
            nxt[k] = request(results[k].key, ids)
        return nxt

    st = gen.run(first_turns(), done, params.temperature, params.top_p, stop_ids, bar)
    for j in jobs[started:]:  # never started (the budget was over): each ends in a record
        writer.add(j.unstarted())
    writer.flush()
    bar.close()
    return {**st, "by_source": dict(by_source)}
