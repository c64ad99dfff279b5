"""The regenerate stage on the embedded engine: resume after a kill, synthetic prompts, no
contamination, metrics, and its validation."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import regen_helpers
from eagle3_runner.data.contamination import BenchGuard, bench_guard, normalize
from eagle3_runner.data.regen_store import SHARDS, SYNTHETIC, read_conversations, read_records
from eagle3_runner.runner.errors import SpecError
from eagle3_runner.runner.spec.load import load_spec
from eagle3_runner.runner.spec.stage_blocks import RegenerateStage

HELPER = Path(__file__).with_name("regen_helpers.py")


def test_kill_mid_way_then_resume_equals_an_uninterrupted_run(tmp_path):
    """A run SIGKILLed after its third shard resumes to exactly the records of a run that was
    never interrupted: every conversation once (no duplicates, no losses), same answers."""
    ref = regen_helpers.run(tmp_path / "ref")
    out = tmp_path / "killed"
    p = subprocess.run([sys.executable, str(HELPER), str(out), "2"], capture_output=True)
    assert p.returncode == -9, p.stderr.decode()[-2000:]
    shards = sorted(x.name for x in (out / SHARDS).iterdir())
    assert shards[:3] == ["part-00000.jsonl.gz", "part-00001.jsonl.gz", "part-00002.jsonl.gz"]
    assert len(shards) < len(list((tmp_path / "ref" / SHARDS).iterdir()))  # killed mid-way
    assert (out / SYNTHETIC).is_file()  # the synthetic prompts survive the kill
    m = regen_helpers.run(out)
    assert m["resumed_conversations"] == 12
    assert read_records(out) == read_records(tmp_path / "ref")
    ids = [r["id"] for r in read_records(out)]
    assert len(ids) == len(set(ids)) == 35  # 30 real + 5 synthetic
    assert {k: m[k] for k in ref if k.startswith(("conversations", "turns", "answer", "cut_",
                                                   "dropped", "eos", "length"))} == \
        {k: ref[k] for k in ref if k.startswith(("conversations", "turns", "answer", "cut_",
                                                 "dropped", "eos", "length"))}
    assert ref["conversations_synthetic"] == 5 and ref["conversations_real"] > 0
    assert ref["length_cap_fraction"] + ref["eos_fraction"] == pytest.approx(1.0)
    assert ref["tokens_per_s"][1] == "tok/s" and ref["tokens_per_s"][0] > 0
    keep, info = read_conversations(out)  # the extract stage's reader
    assert len(keep) == info["records"] - info["dropped"] and all("messages" in k for k in keep)


def test_synthesis_gets_the_share_of_the_budget_its_prompts_cost():
    """The synthetic prompts get the budget share they cost of all the work (their writing over
    it plus every answer, an answer token at ANSWER_COST prompt tokens of time), not a fixed half:
    with the 2026-12-02 H200 run's sizes (85,000 prompts of up to 128 tokens, ~44,000 real
    turns, 256-token answers) about a twelfth (a fifth if time followed tokens); more real turns
    shrink it; never above half, never zero."""
    from types import SimpleNamespace
    from eagle3_runner.data.synthetic import synthesis_share
    p = SimpleNamespace(synthetic_max_tokens=128, max_new_tokens=256)
    f = synthesis_share(85_000, 44_000, p)
    assert 0.06 < f < 0.11
    assert synthesis_share(85_000, 200_000, p) < f < synthesis_share(85_000, 0, p) < 0.5
    assert synthesis_share(1, 10**9, p) == 0.02
    assert synthesis_share(10**6, 0, SimpleNamespace(synthetic_max_tokens=4096,
                                                     max_new_tokens=16)) == 0.5


def test_time_budget_keeps_what_fits_and_accounts_for_the_rest(tmp_path):
    """max_minutes on a clock that advances 1 s per reading: generation stops starting
    requests once the budget is over; every conversation still ends in exactly one record
    (answered, cut or dropped by time_budget), and without a budget nothing is dropped so."""
    ticks = iter(range(10**6))
    m = regen_helpers.run(tmp_path / "b", clock=lambda: float(next(ticks)), max_minutes=20 / 60)
    recs = read_records(tmp_path / "b")
    syn = sum(r["source"] == "synthetic" for r in recs)  # those written in synthesis's share
    assert len({r["id"] for r in recs}) == len(recs) == 30 + syn and syn <= 5
    assert 0.02 <= m["synthetic_budget_share"] < 0.5
    assert m["dropped_time_budget"] > 0 and m["conversations"] > 0
    assert m["conversations"] + m["dropped_time_budget"] <= 35
    assert sum(r["dropped"] == "time_budget" for r in recs) == m["dropped_time_budget"]
    full = regen_helpers.run(tmp_path / "full")
    assert not any(k.endswith("time_budget") for k in full) and full["conversations"] == 35


def test_synthesis_is_one_stream_and_keeps_the_same_prompts_whatever_is_in_flight(monkeypatch):
    """The synthetic candidates are written in ONE run of the engine (no round waits for its
    slowest): at a keep rate far below the first estimate's, each finished candidate is followed
    by the next until enough are kept, past the first estimate's 17, without a second run. What
    is kept does not depend on how many were in flight (select keeps the lowest-indexed passing
    ones): 2 rows and 8 rows keep the same prompts (seeded per candidate, on a random target)."""
    import zlib
    import eagle3_runner.data.synthetic as syn
    from engine_helpers import tiny_hf_llama
    from eagle3_runner.jobs.regen_turns import synthesize
    from eagle3_runner.jobs.regenerate import make_generator
    from eagle3_runner.models.llama import from_hf_model
    from eagle3_runner.runner.assets import asset_path
    from eagle3_runner.targets.load import end_of_turn_ids, load_tokenizer
    tok = load_tokenizer(asset_path("smollm2"))
    stop = end_of_turn_ids(asset_path("smollm2"), tok)
    # one non-empty candidate in four passes (by its text): a rate of ~0.25 against the 0.8 assumed
    monkeypatch.setattr(syn, "degenerate", lambda text, ended: None if text and zlib.crc32(
        text.encode()) % 4 == 0 else "too_short")
    target = from_hf_model(tiny_hf_llama(vocab=49152, hidden=32, layers=2, heads=4, kv=2))
    kept = {}
    for rows in (2, 8):
        p = regen_helpers.params(batch_size=rows, synthetic_prompts=6)
        gen = make_generator(target, p, 64)
        runs, run = [], gen.run
        monkeypatch.setattr(gen, "run", lambda *a, **k: runs.append(1) or run(*a, **k))
        kept[rows], rep = synthesize(gen, tok, p, None, stop, progress=False)
        assert len(runs) == 1 and len(kept[rows]) == 6 and rep["candidates"] > 17, rep
        assert rep["window"] is None  # the embedded engine has no request window
    assert kept[2] == kept[8]


def test_render_batch_equals_render(smollm2_tokenizer):
    """The batched prompt tokenisation of the regenerate stage gives render()'s ids."""
    from eagle3_runner.data.prompts import render, render_batch
    convs = [[{"role": "user", "content": c}] for c in ("Hi", "  spaces  and\nnewlines ",
                                                        "Unicode: naïve café — 東京")]
    convs.append([{"role": "system", "content": "Be brief."}, *convs[0],
                  {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"}])
    assert render_batch(smollm2_tokenizer, convs) == [render(smollm2_tokenizer, c) for c in convs]
    assert render_batch(smollm2_tokenizer, []) == []


def test_user_turn_prefix_and_filters(smollm2_tokenizer, smollm2_path):
    """The Magpie prefix is rendered from the tokenizer's own template (ChatML: the default
    system turn + the user header), the turn stops at <|im_end|>; the filters drop by reason
    and keep the lowest index of duplicates."""
    from eagle3_runner.data.synthetic import degenerate, select, user_turn_prefix
    from eagle3_runner.targets.load import end_of_turn_ids
    ids, stop = user_turn_prefix(smollm2_tokenizer,
                                 end_of_turn_ids(smollm2_path, smollm2_tokenizer))
    text = smollm2_tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>user\n")
    assert stop == [smollm2_tokenizer.convert_tokens_to_ids("<|im_end|>")]
    assert degenerate("How do I bake bread at home?", False) == "no_eos"
    assert degenerate("", True) == "empty"
    assert degenerate("Hi there", True) == "too_short"
    assert degenerate("buy now " * 10, True) == "repetitive"
    assert degenerate("How do I bake bread at home?", True) is None
    guard = BenchGuard(["Compose an engaging travel blog post about a recent trip to Hawaii."])
    cands = [(3, "How do I bake bread at home?", True), (1, "how do I bake  bread at home", True),
             (2, "Compose an engaging travel blog post about a recent trip to Hawaii!", True),
             (0, "Explain recursion to a child, please.", True), (4, "", True)]
    kept, drops = select(cands, guard, want=5)
    assert kept == [(0, "Explain recursion to a child, please."),
                    (1, "how do I bake  bread at home")]
    assert drops == {"contaminated": 1, "duplicate": 1, "empty": 1}


def test_no_bench_prompt_enters_training_data(tmp_path, sharegpt_path):
    """MT-bench, HumanEval and holdout prompts (exact, re-cased, or pasted into a longer turn)
    never reach the regenerated data, nor the extract stage's real data."""
    from eagle3_runner.data.conversations import load_conversations
    from eagle3_runner.data.prompts import humaneval, mtbench
    from eagle3_runner.jobs.regen_turns import real_conversations
    spec = load_spec(data={
        "name": "c", "work_dir": str(tmp_path), "target": {"path": "x", "num_hidden_layers": 30,
                                                            "hidden_size": 576, "vocab_size": 49152},
        "drafter": {"draft_vocab_size": 64}, "data": {"max_samples": 40, "holdout": 4}},
        check_target=False)
    guard = bench_guard(spec)
    train, hold, _ = load_conversations(spec.data)
    mt, he = mtbench()[5]["messages"][0]["content"], humaneval()[7]["messages"][0]["content"]
    first_hold = next(t["content"] for t in hold[0] if t["role"] == "user")
    a = [{"role": "assistant", "content": "ok"}]
    bad = [[{"role": "user", "content": mt.upper()}] + a,
           [{"role": "user", "content": "Hello!"}] + a +
           [{"role": "user", "content": "Please help: " + he + " Thanks."}] + a,
           [{"role": "user", "content": first_hold}] + a]
    clean = [[{"role": "user", "content": "What is the tallest mountain in Europe?"}] + a]
    jobs, rep = real_conversations(bad + clean + train, RegenerateStage(), guard)
    assert rep["contaminated"] >= 3
    assert "real-000003" in {j.id for j in jobs}  # the clean one stays
    assert not {"real-000000", "real-000001", "real-000002"} & {j.id for j in jobs}
    for j in jobs:  # nothing of a bench set survives, by the guard's own normalised test
        assert not any(guard.contaminated(t["content"]) for step in j.steps for t in step)
    assert normalize(mt) in guard.exact and guard.size > 80 + 164


def test_tool_and_system_turns_stay_as_context():
    """Only plain assistant answers are rewritten; system turns (first or later), tool calls and
    tool results stay in the prompt of the next answer; max_turns counts answers."""
    from eagle3_runner.jobs.regen_turns import context_steps, real_conversations
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "weather", "arguments": {"city": "Oslo"}}}]}
    conv = [{"role": "system", "content": "S"}, {"role": "user", "content": "u1"}, call,
            {"role": "tool", "content": "12 C"}, {"role": "assistant", "content": "a1"},
            {"role": "system", "content": "S2"}, {"role": "user", "content": "u2"},
            {"role": "assistant", "content": "a2"}, {"role": "assistant", "content": "left",
                                                      "reasoning_content": "r"}]
    assert context_steps(conv) == [conv[:4], conv[5:7]]
    jobs, rep = real_conversations([conv], RegenerateStage(), None)
    assert jobs[0].steps == [conv[:4], conv[5:7]] and jobs[0].messages == []
    jobs, rep = real_conversations([conv], RegenerateStage(max_turns=1), None)
    assert jobs[0].steps == [conv[:4]] and rep["cut_max_turns"] == 1


def _spec_dir(tmp_path, template: bool) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "model_type": "llama", "num_hidden_layers": 8, "hidden_size": 64, "vocab_size": 128,
        "max_position_embeddings": 512, "num_attention_heads": 4, "intermediate_size": 128}))
    cfg = {"chat_template": "{{ messages }}"} if template else {}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


def test_validation_needs_a_chat_template_and_suggests_names(tmp_path):
    """No chat template: `runner validate` fails on target.chat_template (read from
    tokenizer_config.json, no model loaded); a misspelt name gets a did-you-mean."""
    d = _spec_dir(tmp_path, template=False)
    data = {"name": "v", "target": {"path": str(d)}, "drafter": {"draft_vocab_size": 64},
            "stages": {"regenerate": {}}}
    with pytest.raises(SpecError) as e:
        load_spec(data=data)
    assert e.value.problems[0][0] == "target.chat_template"
    load_spec(data={**data, "stages": {}})  # no regenerate stage: no template needed
    (d / "chat_template.jinja").write_text("{{ messages }}")
    load_spec(data=data)
    with pytest.raises(SpecError, match="Did you mean 'sharegpt'"):
        load_spec(data={**data, "data": {"source": "sharegtp"}})
    with pytest.raises(SpecError, match="Did you mean 'humaneval'"):
        load_spec(data={**data, "stages": {"bench": {"prompt_sets": ["human_eval"]}}})
