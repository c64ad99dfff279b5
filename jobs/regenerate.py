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
regenerates. Grown (stages.regenerate.extend): the set's records are written as the first
shards (data/regen_store.py carry_into; its never-started conversations left out) and the run
goes on as a resumed one on top of them: the real conversations without a record are
generated, and synthetic_prompts new prompts numbered after the set's highest synthetic index
(new seeds; none equal to a carried prompt). The output is the union. A carried real
conversation whose conversation in the data has more answers to write than the record holds (up
to max_turns) is continued: it is held back from the first shards (carry_into `later`,
jobs/regen_turns.py later_turns: the record and the conversation are matched by id, real-NNNNNN,
the index in the training split, and its context turns must be the data's) and answered turn by
turn from its next one, the record's messages (the target's own earlier answers) as the context,
like any conversation in flight: a turn stopped early keeps the carried answers (cut), one the
time budget never starts is written as it was carried. The metrics say how many carried
conversations got later turns (`carried_continued`, of `carried_to_continue`) and how many
answers that added (`carried_answers_added`); `carried_unlike_data` counts real records whose
turns are not the data's (kept as they are).

This module is the stage: `run` (a carried set, or the stage's engine), `regenerate` (the turns in
order, the resume check, the report) and `generate_batch`, the HF generate baseline. The turns
themselves, on either engine (conversations in flight, the time budget, the warm-up, synthesis,
answering): jobs/regen_turns.py.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from eagle3_runner.data.regen_store import (SYNTHETIC, Carried, ShardWriter, carry_into,
                                            read_gz_jsonl, read_records, reuse_set, summarize,
                                            write_gz_jsonl)
from eagle3_runner.data.synthetic import synthesis_share
from eagle3_runner.jobs.regen_turns import (Budget, Conv, answer, carried_later, continue_carried,
                                            real_conversations, synthesize, warm_up)
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
# the stage: its Generator, the turns (jobs/regen_turns.py) in order, the report


def make_generator(target, params, max_length: int, compile_backend=None) -> Generator:
    """The Generator of the stage: params.batch_size rows, max_seq = data.max_length +
    max_new_tokens (a prompt below max_length always gets its whole answer budget)."""
    from eagle3_runner.engine.generate import Generator
    width = max(params.max_new_tokens, params.synthetic_max_tokens if params.synthetic_prompts
                else 1)
    return Generator(target, rows=params.batch_size, max_seq=max_length + width, max_new=width,
                     cuda_graph=params.cuda_graph, compile_backend=compile_backend,
                     kernels=params.kernels)


def regenerate(target, tok, convs: list, params, max_length: int, out_dir: Path, guard=None,
               progress: bool = True, compile_backend=None,
               clock: Callable[[], float] = time.monotonic, gen=None, *,
               stop_ids: tuple[int, ...], carried: Carried | None = None) -> dict:
    """Regenerate `convs` (+ params.synthetic_prompts synthetic ones) into out_dir's shards,
    resuming what an earlier run left there, within params.max_minutes (None = no budget;
    clock: seconds, for the budget). target: our Llama (models.llama.from_hf_model), for the
    embedded Generator (make_generator); gen: another engine with the Generator's run() contract
    instead (engine/sglang_generate.py SglangGenerator; target is then unused). stop_ids: the
    target's end-of-turn ids (targets/load.py end_of_turn_ids), where every answer and synthetic
    prompt ends (the SGLang engine sends them as stop_token_ids). carried: a carried set already
    written into out_dir's shards (data/regen_store.py carry_into; stages.regenerate.extend):
    its conversations are done, as a resumed run's, but for carried.held (jobs/regen_turns.py
    continue_carried: continued with their later turns in `convs`), and the synthetic prompts
    are new ones (numbered from carried.next_synthetic, none equal to a carried one).
    Returns the report: metrics (see summarize; with `carried`, over the union, plus
    carried_conversations, carried_unstarted, new_conversations, carried_to_continue,
    carried_continued, carried_answers_added and carried_unlike_data), generation tokens/s and
    sizes."""
    if not getattr(tok, "chat_template", None):
        raise StageError("target.chat_template: the target tokenizer has no chat template; "
                         "regenerate needs one")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    gen = gen if gen is not None else make_generator(target, params, max_length, compile_backend)
    warm_s = warm_up(gen, tok, params)
    budget = Budget(params.max_minutes, clock)  # generation time: the compile is not in it
    jobs, pre = real_conversations(convs, params, guard)
    writer = ShardWriter(out_dir, params.shard_conversations)
    done_ids = {r["id"] for r in writer.done}
    carried_ids = carried.ids if carried is not None else frozenset()
    jobs, orphans = continue_carried(jobs, carried.held) if carried is not None else (jobs, [])
    for r in orphans:  # held, but the bench guard now drops its conversation: as it was carried
        if r["id"] not in done_ids:
            writer.add(r)
    writer.flush()
    syn, kept, syn_path = None, [], out_dir / SYNTHETIC
    if params.synthetic_prompts:
        if syn_path.is_file():  # a resumed run: the prompts were written before answering
            recs = read_gz_jsonl(syn_path)
            syn = {**recs[0]["meta"], "tokens": 0, "seconds": 0.0, "wait_s": 0.0, "row_steps": 0,
                   "window": None, "resumed": True}
            kept = [(r["index"], r["content"]) for r in recs[1:]]
        else:
            share = synthesis_share(params.synthetic_prompts,
                                    sum(len(j.steps) - len(j.finish) for j in jobs
                                        if j.id not in done_ids),
                                    params)
            kept, syn = synthesize(gen, tok, params, guard, stop_ids, progress,
                                   budget.share(share),
                                   first_index=carried.next_synthetic if carried else 0,
                                   avoid=carried.prompts if carried else ())
            syn["budget_share"] = share
            write_gz_jsonl(syn_path, [{"meta": syn}] +
                           [{"index": i, "content": t} for i, t in kept])
    jobs += [Conv(f"syn-{i:06d}", "synthetic", i, [[{"role": "user", "content": t}]], [])
             for i, t in kept]
    todo = [j for j in jobs if j.id not in done_ids]
    st = answer(gen, tok, todo, params, max_length, writer, stop_ids, progress, budget) \
        if todo else {"new_tokens": 0, "seconds": 0.0, "prefill_tokens": 0, "reused_tokens": 0,
                      "wait_s": 0.0, "steps": 0, "by_source": {}}
    records = read_records(out_dir)
    ids = [r["id"] for r in records]
    want = {j.id for j in jobs} | carried_ids
    if len(ids) != len(set(ids)) or set(ids) != want:
        raise StageError(f"regenerate: {out_dir} holds {len(ids)} records for {len(want)} "
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
    m["resumed_conversations"] = len(done_ids - carried_ids)  # this stage's own, earlier run
    if carried is not None:
        m["carried_conversations"] = carried.kept
        m["carried_unstarted"] = carried.unstarted  # generated again here (or dropped again)
        m["new_conversations"] = m["conversations"] - carried.kept
        m.update(_later_metrics(records, carried))
    m["prefill_tokens"] = (st["prefill_tokens"], "tok")
    m["reused_prefix_tokens"] = (st["reused_tokens"], "tok")
    m["output_bytes"] = (writer.bytes, "B")
    if syn:
        m["synthetic_candidates"] = syn["candidates"]
        m["synthetic_budget_share"] = syn.get("budget_share", 0.5)
        m["synthetic_prompt_tokens"] = (syn.get("tokens", 0), "tok")
    return m


def _later_metrics(records: list, carried: Carried) -> dict:
    """What the data's later turns added to the carried records held back for them (out of the
    union `records`): carried_to_continue (held), carried_continued (those with more answers
    now), carried_answers_added (the answers they gained), carried_unlike_data (real records
    whose turns are not the data's, kept as they are: jobs/regen_turns.py later_turns). Said on
    stderr too."""
    before = {r["id"]: len(r["finish"]) for r in carried.held}
    added = [len(r["finish"]) - before[r["id"]] for r in records
             if r["id"] in before and len(r["finish"]) > before[r["id"]]]
    m = {"carried_to_continue": len(before), "carried_continued": len(added),
         "carried_answers_added": sum(added),
         "carried_unlike_data": carried.not_continued.get("unlike_data", 0)}
    print(f"regenerate: later turns: {m['carried_continued']} of {len(before)} carried "
          f"conversations continued, {m['carried_answers_added']} answers added",
          file=sys.stderr, flush=True)
    return m


def run(ctx: StageContext) -> dict:
    """Regenerate the spec's training conversations (+ synthetic ones) into ctx.out_dir/shards,
    on the stage's engine (runner/engines.py stage_engine: embedded or sglang); or, when the
    carried set of stages.regenerate.reuse is there, write its records instead (`reuse`), or
    write them and regenerate what it does not hold on top (stages.regenerate.extend)."""
    from eagle3_runner.runner import carry
    if (why := carry.problem(ctx.spec)) is not None:
        raise StageError(why)
    if (path := carry.reuses(ctx.spec)) is not None:
        return reuse_set(path, Path(ctx.out_dir), ctx.params.shard_conversations)
    from eagle3_runner.data.contamination import bench_guard
    from eagle3_runner.data.conversations import load_conversations, show_data_report
    from eagle3_runner.runner.engines import SGLANG, stage_engine
    spec, out = ctx.spec, Path(ctx.out_dir)
    try:
        engine = stage_engine(spec, "regenerate")
    except ValueError as e:
        raise StageError(str(e))
    train, _holdout, data_report = load_conversations(spec.data)
    show_data_report(ctx, data_report)  # what the data lost, before any compute
    guard = bench_guard(spec)
    grown = carry.extends(spec)  # written before the target loads: a bad set fails fast
    carried = carry_into(grown, out, ctx.params.shard_conversations,
                         later=carried_later(train, ctx.params)) if grown else None
    if engine.engine == SGLANG:
        m, info = _regenerate_sglang(ctx, train, guard, carried)
    else:
        m, info = _regenerate_embedded(ctx, train, guard, carried), {}
    if not m["conversations"]:
        raise StageError(f"regenerate: no conversation kept ({m}); raise data.max_length "
                         "(prompts longer than it are cut) or check the target")
    atomic_write(out / "report.json", json.dumps(
        {"data": data_report, "bench_prompts_guarded": guard.size,
         "engine": {"engine": engine.engine, "why": engine.why, **info},
         **({"extended": carried.info} if carried else {}),
         "regenerate": {k: (v[0] if isinstance(v, tuple) else v) for k, v in m.items()}},
        indent=1, default=str))
    return m


def _regenerate_embedded(ctx: StageContext, train: list, guard,
                         carried: Carried | None = None) -> dict:
    """regenerate() on the embedded Generator: the target loaded as our Llama (on top of a
    carried set's records when `carried`)."""
    from eagle3_runner.models.llama import from_hf_model
    from eagle3_runner.targets.load import end_of_turn_ids, load_target
    hf, tok, _cfg = load_target(ctx.spec)
    target = from_hf_model(hf)
    del hf
    return regenerate(target, tok, train, ctx.params, ctx.spec.data.max_length,
                      Path(ctx.out_dir), guard, stop_ids=end_of_turn_ids(ctx.spec, tok),
                      carried=carried)


def _regenerate_sglang(ctx: StageContext, train: list, guard,
                       carried: Carried | None = None) -> tuple[dict, dict]:
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
                       gen=gen, stop_ids=stop, carried=carried)
    return m, {"sglang_version": srv.info.get("version"), "url": srv.url,
               "tp": srv.info.get("tp_size"), "dp": srv.info.get("dp_size")}
