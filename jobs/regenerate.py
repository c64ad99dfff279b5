"""The optional regenerate stage: replace assistant turns with the target's own responses, and
answer prompts the target writes itself.

EAGLE-3's recipe: a drafter trained on what the target itself says is accepted more often than
one trained on another model's answers. Generation runs on the stage's engine (runner/engines.py
choose_engine, as `runner plan` prints it): the embedded engine (engine/generate.py: our Llama,
static KV cache, continuous batching, a CUDA-graphed decode step) or an SGLang server
(engine/sglang_generate.py: the same contract over the server's native /generate with our
rendered token ids; targets/sglang_target.py launches it with target.sglang's tp/ep/dp, or
connects to target.sglang.server). Everything below is the same on both.

Real conversations (data.conversations.load_conversations's training split; the holdout is never
touched): every assistant answer (or the first `max_turns`) is rewritten in order, each prompt
being the conversation so far with the target's OWN earlier answers, rendered by the tokenizer's
chat template with the generation prompt. The turns between answers stay as they are, as context:
user turns, system turns (the first or later ones), tool results and assistant tool calls
(`context_steps`); a conversation the template refuses is dropped (`template_error`). A
conversation keeps its cache row across turns (its next turn is prefilled on top of the cached
prefix as soon as its answer finished; the next turns of the rows finished at one host sync are
rendered and tokenised in one batched tokenizer call), so the turns of many conversations
interleave. Synthetic conversations (`synthetic_prompts: N`, data/synthetic.py): the target writes
N user turns from the template's user-turn prefix (sampled at synthetic_temperature/top_p),
degenerate and duplicate ones are dropped (counted by reason), and the rest are answered like real
turns. No contamination (data/contamination.py): a conversation with a user turn of a bench set
(MT-bench, HumanEval, the data.holdout first turns) is dropped before generation, a synthetic
prompt likewise.

Answers are greedy at temperature 0, else sampled (temperature/top-p), seeded per conversation
and turn. A conversation stops at the turn whose prompt alone reaches data.max_length (dropped
when that is its first turn), or where the target answers with nothing; counted. Output
(data/regen_store.py): gzip JSONL shards, atomic, resumed after a kill without duplicates or
losses; the extract stage reads them with regen_store.read_conversations.

A time budget (`max_minutes`, over synthesis and answering together; it starts after the decode
step is compiled, `warmup_seconds`): synthesis gets the share of it that its prompts cost
(data/synthetic.py synthesis_share: the estimated time of writing them over that of writing them
and answering every turn, real and synthetic; at most half), so it never writes prompts the answers
cannot reach; once the budget has passed, no new generation request starts; a conversation in
flight keeps the turns answered (the rest cut, `cut_time_budget`) and one never started ends as a
dropped record (`dropped_time_budget`). With a budget the conversations start in a seeded shuffled
order (real and synthetic mixed), so what fits is a uniform sample of the data; without one, the
longest start first (no long tail).

A set carried from an earlier GPU window (stages.regenerate.reuse, runner/carry.py: the shards
of a run concatenated into one gzip JSONL file with its sha256 sidecar): when the file is there
and its checksum right, the stage loads no target (nor torch: imported only where generation
starts) and writes the set's records as its shards (`reuse`); when it is not there, the stage
regenerates.
"""

from __future__ import annotations

import json
import math
import random
import time
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

from eagle3_runner.data.regen_store import (SYNTHETIC, ShardWriter, read_gz_jsonl, read_records,
                                            reuse_set, summarize, write_gz_jsonl)
from eagle3_runner.data.synthetic import KEEP_RATE, synthesis_share
from eagle3_runner.runner.errors import StageError
from eagle3_runner.runner.files import atomic_write
from eagle3_runner.runner.stage import StageContext

if TYPE_CHECKING:
    from eagle3_runner.engine.generate import Generator

# torch and the engine (engine/generate.py) are imported where generation starts: a stage that
# reuses a carried set (stages.regenerate.reuse) never imports them


def generate_batch(model, tok, prompts: list[list[dict]], max_new_tokens: int,
                   temperature: float, top_p: float, counts: list | None = None, *,
                   stop_ids: tuple[int, ...]) -> tuple[list[str], int]:
    """HF generate (the stage's path before engine/generate.py; scripts/bench/bench_generate.py
    measures against it). One reply per prompt conversation, ended at the first of `stop_ids`
    (the target's end-of-turn ids, targets/load.py end_of_turn_ids) or max_new_tokens.
    Returns (texts, generated token count); `counts`, when given, gets each reply's token count
    appended."""
    import torch
    with torch.inference_mode():
        return _generate_batch(model, tok, prompts, max_new_tokens, temperature, top_p, counts,
                               stop_ids)


def _generate_batch(model, tok, prompts, max_new_tokens, temperature, top_p, counts, stop_ids):
    texts = [tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True)
             for p in prompts]
    side, pad = tok.padding_side, tok.pad_token
    tok.padding_side = "left"
    if pad is None:  # e.g. a GGUF tokenizer: pad with EOS (masked out by the attention mask)
        tok.pad_token = tok.eos_token
    try:
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        pad_id = tok.pad_token_id
    finally:
        tok.padding_side, tok.pad_token = side, pad
    dev = next(model.parameters()).device
    enc = {k: v.to(dev) for k, v in enc.items()}
    kw = dict(do_sample=temperature > 0, max_new_tokens=max_new_tokens, pad_token_id=pad_id,
              eos_token_id=list(stop_ids) or None)
    if temperature > 0:
        kw.update(temperature=temperature, top_p=top_p)
    else:
        kw.update(temperature=None, top_p=None, top_k=None)
    out = model.generate(**enc, **kw)[:, enc["input_ids"].shape[1]:]  # [B, new]
    replies, n = [], 0
    for row in out.tolist():
        ends = [k for k, t in enumerate(row) if t in stop_ids]
        if ends:
            row = row[:ends[0] + 1]
        n += len(row)
        if counts is not None:
            counts.append(len(row))
        replies.append(tok.decode(row, skip_special_tokens=True).strip())
    return replies, n


# ----------------------------------------------------------------------------------------------
# the embedded path


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
        when it has none."""
        return self.record(cut=reason) if self.finish else self.record(dropped=reason)


def make_generator(target, params, max_length: int, compile_backend=None) -> Generator:
    """The Generator of the stage: params.batch_size rows, max_seq = data.max_length +
    max_new_tokens (a prompt below max_length always gets its whole answer budget)."""
    from eagle3_runner.engine.generate import Generator
    width = max(params.max_new_tokens, params.synthetic_max_tokens if params.synthetic_prompts
                else 1)
    return Generator(target, rows=params.batch_size, max_seq=max_length + width, max_new=width,
                     cuda_graph=params.cuda_graph, compile_backend=compile_backend,
                     kernels=params.kernels)


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
               budget: Optional[Budget] = None) -> tuple[list, dict]:
    """Magpie: params.synthetic_prompts user turns written by the target, in ONE run of the
    engine, so no round waits for its slowest candidate: candidates 0, 1, 2, ... are drawn while
    those in flight fall short of what the prompts still wanted need at the keep rate so far
    (distinct candidates passing data/synthetic.py verdict; KEEP_RATE before any finished),
    x 1.2 + 8; each finished candidate followed by the next while short, up to MAX_CANDIDATES per prompt
    wanted, none once the budget is over. data/synthetic.py select then keeps the lowest-indexed
    ones: the prompts any longer run would keep. A candidate ends at the end of its user turn
    (data/synthetic.py user_turn_prefix: stop_ids, the target's end-of-turn ids, and the
    template's end-of-turn token).
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
    bar = tqdm(unit="tok", desc="synthetic prompts", disable=not progress, smoothing=0.1)

    def short() -> bool:  # another candidate is needed in flight
        rate = len(passing) / len(cands) if cands else KEEP_RATE
        need = math.ceil((want - len(passing)) / max(rate, 0.05) * 1.2) + 8
        return len(passing) < want and drawn[0] - len(cands) < need and \
            drawn[0] < MAX_CANDIDATES * want and not budget.over()

    def candidate():
        drawn[0] += 1
        i = drawn[0] - 1
        return Request(i, prefix, params.synthetic_max_tokens,
                       seed_of(params.seed, "syn-candidate", i))

    def first():
        while short():
            yield candidate()

    def done(results):  # one batched decode; each finished candidate followed while short
        texts = tok.batch_decode([r.tokens for r in results], skip_special_tokens=True)
        for r, t in zip(results, texts):
            cands.append((r.key, t.strip(), r.finish == "stop"))
            if verdict(*cands[-1][1:], guard) is None:
                passing.add(normalize(cands[-1][1]))
        return [candidate() if short() else None for _ in results]
    st = gen.run(first(), done, params.synthetic_temperature, params.synthetic_top_p, stop, bar)
    bar.close()
    kept, drops = select(cands, guard, want)
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


def real_conversations(convs, params, guard) -> tuple[list, Counter]:
    """Conv jobs of the real training conversations (ids real-NNNNNN by data order), without the
    contaminated ones. Returns (jobs, {"contaminated": n, "cut_max_turns": answers cut})."""
    jobs, rep = [], Counter()
    for i, c in enumerate(convs):
        if guard is not None and guard.conversation(c):
            rep["contaminated"] += 1
            continue
        steps = context_steps(c)
        if params.max_turns is not None and len(steps) > params.max_turns:
            rep["cut_max_turns"] += len(steps) - params.max_turns
            steps = steps[:params.max_turns]
        if steps:
            jobs.append(Conv(f"real-{i:06d}", "real", i, steps, []))
    return jobs, rep


def answer(gen: Generator, tok, jobs: list, params, max_length: int, writer: ShardWriter,
           stop_ids: tuple[int, ...], progress=True, budget: Optional[Budget] = None) -> dict:
    """Answer every turn of `jobs` (Conv) on the continuous batch, writing one record per
    conversation through `writer`; an answer ends at the first of `stop_ids` (the target's
    end-of-turn ids). Without a budget, jobs start longest first (most turns, longest first
    turn), so the multi-turn ones do not form the tail; with one, in a shuffled order seeded by
    params.seed, and none starts once it is over (see the module docstring).
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
            writer.add(job.record(cut="time_budget"))
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
        writer.add(j.record(dropped="time_budget"))
    writer.flush()
    bar.close()
    return {**st, "by_source": dict(by_source)}


def regenerate(target, tok, convs: list, params, max_length: int, out_dir: Path, guard=None,
               progress: bool = True, compile_backend=None,
               clock: Callable[[], float] = time.monotonic, gen=None, *,
               stop_ids: tuple[int, ...]) -> dict:
    """Regenerate `convs` (+ params.synthetic_prompts synthetic ones) into out_dir's shards,
    resuming what an earlier run left there, within params.max_minutes (None = no budget;
    clock: seconds, for the budget). target: our Llama (models.llama.from_hf_model), for the
    embedded Generator (make_generator); gen: another engine with the Generator's run() contract
    instead (engine/sglang_generate.py SglangGenerator; target is then unused). stop_ids: the
    target's end-of-turn ids (targets/load.py end_of_turn_ids), where every answer and synthetic
    prompt ends (the SGLang engine sends them as stop_token_ids).
    Returns the report: metrics (see summarize), generation tokens/s and sizes."""
    if not getattr(tok, "chat_template", None):
        raise StageError("target.chat_template: the target tokenizer has no chat template; "
                         "regenerate needs one")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    gen = gen if gen is not None else make_generator(target, params, max_length, compile_backend)
    warm_s = warm_up(gen, tok, params)
    budget = Budget(params.max_minutes, clock)  # generation time: the compile is not in it
    jobs, pre = real_conversations(convs, params, guard)
    syn, kept, syn_path = None, [], out_dir / SYNTHETIC
    if params.synthetic_prompts:
        if syn_path.is_file():  # a resumed run: the prompts were written before answering
            recs = read_gz_jsonl(syn_path)
            syn = {**recs[0]["meta"], "tokens": 0, "seconds": 0.0, "wait_s": 0.0, "row_steps": 0,
                   "window": None, "resumed": True}
            kept = [(r["index"], r["content"]) for r in recs[1:]]
        else:
            share = synthesis_share(params.synthetic_prompts, sum(len(j.steps) for j in jobs),
                                    params)
            kept, syn = synthesize(gen, tok, params, guard, stop_ids, progress,
                                   budget.share(share))
            syn["budget_share"] = share
            write_gz_jsonl(syn_path, [{"meta": syn}] +
                           [{"index": i, "content": t} for i, t in kept])
    jobs += [Conv(f"syn-{i:06d}", "synthetic", i, [[{"role": "user", "content": t}]], [])
             for i, t in kept]
    writer = ShardWriter(out_dir, params.shard_conversations)
    done_ids = {r["id"] for r in writer.done}
    todo = [j for j in jobs if j.id not in done_ids]
    st = answer(gen, tok, todo, params, max_length, writer, stop_ids, progress, budget) \
        if todo else {"new_tokens": 0, "seconds": 0.0, "prefill_tokens": 0, "reused_tokens": 0,
                      "wait_s": 0.0, "steps": 0, "by_source": {}}
    records = read_records(out_dir)
    ids = [r["id"] for r in records]
    if len(ids) != len(set(ids)) or set(ids) != {j.id for j in jobs}:
        raise StageError(f"regenerate: {out_dir} holds {len(ids)} records for {len(jobs)} "
                         "conversations (duplicates or losses); remove the partial directory "
                         "and run again")
    m = summarize(records, pre, syn)
    gen_tokens = st["new_tokens"] + (syn or {}).get("tokens", 0)
    gen_secs = st["seconds"] + (syn or {}).get("seconds", 0.0)
    m["tokens_generated"] = (gen_tokens, "tok")
    m["tokens_per_s"] = (gen_tokens / max(gen_secs, 1e-9), "tok/s")
    m["generation_seconds"] = (gen_secs, "s")
    # where the time went: the share of it the host sat waiting for the GPU (near 1 = GPU-bound,
    # near 0 = the GPU waited for the host), and the decode slots that made a token
    wait = st["wait_s"] + (syn or {}).get("wait_s", 0.0)
    slots = st["steps"] * gen.R + (syn or {}).get("row_steps", 0)
    m["host_wait_share"] = (wait / max(gen_secs, 1e-9), "fraction")
    if slots:  # the embedded engine's decode steps (a server's are its own)
        m["decode_slot_use"] = (gen_tokens / slots, "fraction")
    if st.get("window") or (syn or {}).get("window"):  # the SGLang engine's request window
        from eagle3_runner.engine.sglang_generate import window_metrics
        m.update(window_metrics([st, syn], gen_secs))
    # generation speed per source: the answers (real and synthetic conversations share the
    # answer phase's seconds) and the synthetic prompts written before them
    for src, n in st["by_source"].items():
        m[f"tokens_per_s_answers_{src}"] = (n / max(st["seconds"], 1e-9), "tok/s")
    m["tokens_per_s_answers"] = (st["new_tokens"] / max(st["seconds"], 1e-9), "tok/s")
    if syn and syn.get("seconds"):
        m["tokens_per_s_synthesis"] = (syn["tokens"] / syn["seconds"], "tok/s")
    m["warmup_seconds"] = (warm_s, "s")
    m["resumed_conversations"] = writer.resumed
    m["prefill_tokens"] = (st["prefill_tokens"], "tok")
    m["reused_prefix_tokens"] = (st["reused_tokens"], "tok")
    m["output_bytes"] = (writer.bytes, "B")
    if syn:
        m["synthetic_candidates"] = syn["candidates"]
        m["synthetic_budget_share"] = syn.get("budget_share", 0.5)
        m["synthetic_prompt_tokens"] = (syn.get("tokens", 0), "tok")
    return m


def run(ctx: StageContext) -> dict:
    """Regenerate the spec's training conversations (+ synthetic ones) into ctx.out_dir/shards,
    on the stage's engine (runner/engines.py stage_engine: embedded or sglang); or, when the
    carried set of stages.regenerate.reuse is there, write its records instead (`reuse`)."""
    from eagle3_runner.runner import carry
    if (why := carry.problem(ctx.spec)) is not None:
        raise StageError(why)
    if (path := carry.present(ctx.spec)) is not None:
        return reuse_set(path, Path(ctx.out_dir), ctx.params.shard_conversations)
    from eagle3_runner.data.contamination import bench_guard
    from eagle3_runner.data.conversations import load_conversations, show_data_report
    from eagle3_runner.runner.engines import SGLANG, stage_engine
    spec, p, out = ctx.spec, ctx.params, Path(ctx.out_dir)
    try:
        engine = stage_engine(spec, "regenerate")
    except ValueError as e:
        raise StageError(str(e))
    train, _holdout, data_report = load_conversations(spec.data)
    show_data_report(ctx, data_report)  # what the data lost, before any compute
    guard = bench_guard(spec)
    if engine.engine == SGLANG:
        m, info = _regenerate_sglang(ctx, train, guard)
    else:
        m, info = _regenerate_embedded(ctx, train, guard), {}
    if not m["conversations"]:
        raise StageError(f"regenerate: no conversation kept ({m}); raise data.max_length "
                         "(prompts longer than it are cut) or check the target")
    atomic_write(out / "report.json", json.dumps(
        {"data": data_report, "bench_prompts_guarded": guard.size,
         "engine": {"engine": engine.engine, "why": engine.why, **info},
         "regenerate": {k: (v[0] if isinstance(v, tuple) else v) for k, v in m.items()}},
        indent=1, default=str))
    return m


def _regenerate_embedded(ctx: StageContext, train: list, guard) -> dict:
    """regenerate() on the embedded Generator: the target loaded as our Llama."""
    from eagle3_runner.models.llama import from_hf_model
    from eagle3_runner.targets.load import end_of_turn_ids, load_target
    hf, tok, _cfg = load_target(ctx.spec)
    target = from_hf_model(hf)
    del hf
    return regenerate(target, tok, train, ctx.params, ctx.spec.data.max_length,
                      Path(ctx.out_dir), guard, stop_ids=end_of_turn_ids(ctx.spec, tok))


def _regenerate_sglang(ctx: StageContext, train: list, guard) -> tuple[dict, dict]:
    """regenerate() through the stage's SGLang server (targets/sglang_target.py stage_server, its
    log in out_dir/logs). Returns (metrics, {sglang_version, url})."""
    from eagle3_runner.engine.sglang_generate import SglangGenerator
    from eagle3_runner.runner.engines import GENERATE
    from eagle3_runner.targets.load import end_of_turn_ids, load_tokenizer, target_config
    from eagle3_runner.targets.sglang_target import stage_server
    spec, p = ctx.spec, ctx.params
    tok = load_tokenizer(spec)
    stop = end_of_turn_ids(spec, tok)
    width = max(p.max_new_tokens, p.synthetic_max_tokens if p.synthetic_prompts else 1)
    with stage_server(spec, GENERATE, target_config(spec), Path(ctx.out_dir) / "logs") as srv:
        gen = SglangGenerator(srv, p.batch_size, width)
        m = regenerate(None, tok, train, p, spec.data.max_length, Path(ctx.out_dir), guard,
                       gen=gen, stop_ids=stop)
    return m, {"sglang_version": srv.info.get("version"), "url": srv.url,
               "tp": srv.info.get("tp_size"), "dp": srv.info.get("dp_size")}
