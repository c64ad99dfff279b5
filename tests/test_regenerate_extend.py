"""stages.regenerate.extend (jobs/regenerate.py, data/regen_store.py carry_into): a carried set
grown window after window. Window 1 regenerates (the file is not there yet) with a time budget,
so some conversations never start; its shards are carried as scripts/gpu/pays.sh carries them;
window 2 extends the set on the same tiny random target: the union holds every carried record,
the never-started real conversations and new synthetic prompts."""

from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path

import pytest

from eagle3_runner.data.contamination import normalize
from eagle3_runner.data.conversations import load_conversations
from eagle3_runner.data.regen_store import read_records
from eagle3_runner.runner import carry
from eagle3_runner.runner.errors import SpecError
from eagle3_runner.runner.plan import build_plan, write_state
from eagle3_runner.runner.spec.load import load_spec
from eagle3_runner.runner.stages import stage_slice
from test_regenerate_reuse import NAME, carry_set, ctx_of, write_spec

N_REAL = 10


def spec_file(tmp: Path, **over) -> Path:
    """write_spec's spec with extend on (reuse: carried/NAME) and N_REAL conversations."""
    path = write_spec(tmp, extend=True, synthetic_prompts=3, synthetic_max_tokens=16, **over)
    (path.parent / "data.jsonl").write_text("".join(
        json.dumps({"messages": [{"role": "user", "content": f"how do rivers {i} bend?"},
                                 {"role": "assistant", "content": "old"}]}) + "\n"
        for i in range(N_REAL)))
    return path


@pytest.fixture
def stage(monkeypatch):
    """jobs/regenerate.py with the embedded engine on a tiny random target (SmolLM2's tokenizer)
    and a clock of one second per call, for a budget; every non-empty synthetic turn kept (a
    random target writes no sensible ones; the filters have their own tests)."""
    import torch
    from engine_helpers import tiny_hf_llama
    import eagle3_runner.data.contamination as contamination
    import eagle3_runner.data.synthetic as syn
    import eagle3_runner.jobs.regenerate as regen
    from eagle3_runner.models.llama import from_hf_model
    from eagle3_runner.runner.assets import asset_path
    from eagle3_runner.runner.errors import FetchError
    from eagle3_runner.targets.load import load_tokenizer
    try:
        tok = load_tokenizer(asset_path("smollm2"))
    except FetchError as e:
        pytest.skip(str(e))
    monkeypatch.setattr(contamination, "bench_guard", lambda spec: contamination.BenchGuard([]))
    monkeypatch.setattr(syn, "degenerate", lambda text, ended: None if text else "empty")
    torch.manual_seed(0)
    target = from_hf_model(tiny_hf_llama(vocab=49152, hidden=32, layers=2, heads=4, kv=2))
    ticks = iter(range(10**6))

    def embedded(ctx, train, guard, carried=None):
        return regen.regenerate(target, tok, train, ctx.params, ctx.spec.data.max_length,
                                Path(ctx.out_dir), guard, progress=False, stop_ids=(2,),
                                clock=lambda: float(next(ticks)), carried=carried)
    monkeypatch.setattr(regen, "_regenerate_embedded", embedded)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield regen
    torch.set_num_threads(threads)


def test_extend_grows_the_carried_set_with_new_conversations(tmp_path, stage):
    """Window 1 (extend declared, no file yet) regenerates within a budget; window 2 extends its
    carried set: every carried record that was not a never-started one is in the union
    unchanged, the never-started real conversations are answered, the new synthetic prompts have
    indices after the carried ones and texts unlike theirs, no id twice; the metrics count the
    carried and the new conversations, and a resumed extension changes nothing."""
    path = spec_file(tmp_path, max_minutes=20 / 60)
    first = load_spec(path)
    assert carry.present(first) is None and carry.extends(first) is None
    m1 = stage.run(ctx_of(first, "regenerate", tmp_path / "w1"))
    assert "carried_conversations" not in m1
    old = read_records(tmp_path / "w1")
    unstarted = {r["id"] for r in old if r["dropped"] == "time_budget"}
    # the budget cut window 1 short: a real conversation and a synthetic prompt never started
    assert {i[:4] for i in unstarted} == {"real", "syn-"} and any(not r["dropped"] for r in old)
    carry_set(tmp_path / "w1", path.parent / "carried" / NAME)

    grown = load_spec(path, overrides=["stages.regenerate.max_minutes=null"])  # all that is left
    assert carry.extends(grown) == path.parent / "carried" / NAME
    m2 = stage.run(ctx_of(grown, "regenerate", tmp_path / "w2"))
    union = read_records(tmp_path / "w2")
    ids = [r["id"] for r in union]
    assert len(ids) == len(set(ids))
    by_id = {r["id"]: r for r in union}
    kept = [r for r in old if r["id"] not in unstarted]
    assert all(by_id[r["id"]] == r for r in kept)  # carried records, unchanged
    # real: every conversation of the data has a record, the never-started ones answered now
    assert {i for i in ids if i.startswith("real-")} == {f"real-{i:06d}" for i in range(N_REAL)}
    assert all(not by_id[i]["dropped"] for i in unstarted if i.startswith("real-"))
    # a never-started synthetic prompt is lost (its record has no text); its index stays used
    assert not any(i in by_id for i in unstarted if i.startswith("syn-"))
    # synthetic: 3 new prompts numbered after every carried index, none equal to a carried one
    old_syn = [r for r in old if r["source"] == "synthetic"]
    new_syn = [r for r in union if r["source"] == "synthetic" and r["id"] not in
               {o["id"] for o in old_syn}]
    assert len(new_syn) == 3
    assert min(r["index"] for r in new_syn) > max(r["index"] for r in old_syn)
    said = {normalize(r["messages"][0]["content"]) for r in old_syn if r["messages"]}
    assert said and not said & {normalize(r["messages"][0]["content"]) for r in new_syn}
    # metrics: the union, its carried part and what is new
    carried_kept = sum(not r["dropped"] for r in kept)
    assert m2["carried_conversations"] == carried_kept
    assert m2["conversations"] == sum(not r["dropped"] for r in union)
    assert m2["new_conversations"] == m2["conversations"] - carried_kept > 0
    assert m2["carried_unstarted"] == len(unstarted) and m2["resumed_conversations"] == 0
    rep = json.loads((tmp_path / "w2" / "report.json").read_text())["extended"]
    assert rep["records"] == len(old) and rep["kept"] == carried_kept
    # resumed after the end: nothing generated again, nothing lost
    m3 = stage.run(ctx_of(grown, "regenerate", tmp_path / "w2"))
    assert read_records(tmp_path / "w2") == union
    assert m3["resumed_conversations"] == len(union) - len(kept)


def test_extend_keys_plan_and_provenance(tmp_path):
    """extend: false keeps the reuse key and extend absent keeps today's keys; with the file
    there extend gives a key of the set's sha256 and the generation's inputs (the target runs:
    an engine line, the target among its files), the plan says `extends`, flipping it is the
    rerun reason, and its state record is a provenance the next window accepts for the union."""
    path = spec_file(tmp_path)
    f = path.parent / "carried" / NAME
    off = ["stages.regenerate.extend=false"]
    plain = ["stages.regenerate.extend=false", "stages.regenerate.reuse=null"]
    # no file: extend changes nothing
    assert stage_slice(load_spec(path), "regenerate") == \
        stage_slice(load_spec(path, overrides=plain), "regenerate")
    recs = [{"id": f"real-{i:06d}", "source": "real", "index": i,
             "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
             "finish": ["stop"], "answer_tokens": [1], "cut": None, "dropped": None}
            for i in range(2)]
    f.parent.mkdir(parents=True)
    f.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in recs).encode()))
    digest = hashlib.sha256(f.read_bytes()).hexdigest()
    carry.sidecar(f).write_text(f"{digest}  {NAME}\n")
    reuse, grow = load_spec(path, overrides=off), load_spec(path)
    assert stage_slice(reuse, "regenerate") == {"reuse": {"sha256": digest},
                                                "shard_conversations": 4}
    s = stage_slice(grow, "regenerate")
    assert s["extend"] == {"sha256": digest} and "target" in s and "extend" not in s["regenerate"]
    assert {k: v for k, v in s.items() if k != "extend"} == \
        stage_slice(load_spec(path, overrides=plain), "regenerate")
    a, b = build_plan(reuse).stages[0], build_plan(grow).stages[0]
    assert a.key != b.key
    assert b.note.startswith(f"extends {f} (sha256 {digest[:12]}...")
    assert "target" in b.parts["inputs"]["files"] and a.parts["inputs"]["files"] == {}
    assert "regenerate" in [e[0] for e in build_plan(grow).engines]
    assert carry.explain(a.parts["spec"], b.parts["spec"]) == \
        "spec changed: stages.regenerate.extend (the carried set is there: grows it)"
    # the state record pays.sh copies next to the union: the next window accepts it
    write_state(tmp_path / "st", b)
    f.with_name(NAME + ".json").write_bytes((tmp_path / "st/state/base.regenerate.json")
                                            .read_bytes())
    assert carry.provenance(f)["inputs"]["files"]["target"] == b.parts["inputs"]["files"]["target"]
    assert carry.problem(grow) is None and carry.warnings(grow) == []
    # grown from other data: the real ids may not line up, said (extend only)
    w = carry.warnings(load_spec(path, overrides=["data.seed=5"]))
    assert len(w) == 1 and w[0].startswith("stages.regenerate.extend: the set was made from "
                                           "other data (data.seed 0 (this spec: 5))")
    # more (or fewer) samples of the same data: the ids still name the same conversations (the
    # training set is a prefix of one seeded order), so growing with more of them is not warned
    assert carry.warnings(load_spec(path, overrides=["data.max_samples=5"])) == []
    (path.parent / "data.jsonl").write_text(json.dumps({"messages": [
        {"role": "user", "content": "another question"}, {"role": "assistant", "content": "a"}]}))
    assert "the data file's content" in carry.warnings(load_spec(path))[0]
    assert carry.warnings(load_spec(path, overrides=off)) == []


def test_extend_without_reuse_is_refused_naming_both_fields(tmp_path):
    with pytest.raises(SpecError) as e:
        load_spec(write_spec(tmp_path, reuse=None, extend=True))
    assert "stages.regenerate.extend" in str(e.value) and "stages.regenerate.reuse" in str(e.value)


def test_a_new_synthetic_prompt_equal_to_a_carried_one_is_a_duplicate():
    """data/synthetic.py select with `seen` (the carried prompts, normalised): a candidate that
    repeats one is dropped as a duplicate, the others are kept in index order."""
    from eagle3_runner.data.synthetic import select
    cands = [(7, "Tell me how rivers bend, please.", True), (8, "Write a poem about stone.", True)]
    kept, drops = select(cands, None, 5, {normalize("tell me how rivers bend please")})
    assert kept == [(8, "Write a poem about stone.")] and drops == {"duplicate": 1}


# ----------------------------------------------------------------------------------------------
# later turns: carried conversations continued with the data's next human turns


def turns_data(path: Path, cut: int | None = None, unlike: int | None = None) -> list[list]:
    """Conversation i of 6 has 1 + i % 3 human turns (the old answers "old"), written to `path`
    as JSONL, each cut after its `cut`-th answer (None: whole; scripts/gpu/sharegpt_subset.py
    --turns); conversation `unlike`'s first question reworded (not the set's data). Returns the
    conversations written."""
    convs = []
    for i in range(6):
        conv = [m for t in range(1 + i % 3) for m in (
            {"role": "user", "content": f"how do rivers {i} bend, part {t}?"},
            {"role": "assistant", "content": "old"})]
        if i == unlike:
            conv[0] = {"role": "user", "content": "a question the set never saw?"}
        convs.append(conv[:2 * cut] if cut else conv)
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
    return convs


class Spy:
    """The stage's real Generator, watched: every request it is given is noted as (conversation
    id, turn, prompt ids) when its key is a conversation (jobs/regen_turns.py Conv)."""

    def __init__(self, gen):
        self.gen, self.asked = gen, []

    def __getattr__(self, name):
        return getattr(self.gen, name)

    def run(self, first, done, *args, **kw):
        def note(r):
            if r is not None and hasattr(r.key, "finish"):
                self.asked.append((r.key.id, len(r.key.finish), list(r.ids)))
            return r

        def then(results):  # the next requests (None: none, as in the warm-up)
            nxt = done(results)
            return nxt if nxt is None else [note(r) for r in nxt]
        return self.gen.run((note(r) for r in first), then, *args, **kw)


def test_extend_answers_the_later_turns_of_carried_conversations(tmp_path, stage, monkeypatch):
    """Window 1 answers the first turns (data cut after the first answer, max_turns 1: the
    carried set of issue 43); window 2 extends it with the whole conversations, max_turns 3 and
    no new synthetic prompts (specs/smollm2-pays-gpu.yaml's later-turns window):
    a carried record whose conversation has 3 human turns gets turns 2 and 3, each asked with
    the carried first answer (and the new second one) in its prompt; one whose conversation has
    no more turns, a synthetic one and one whose turns are not the data's stay as they were; every
    carried record survives; the counts say so; a resumed run and a third window at max_turns
    3 change nothing."""
    from eagle3_runner.data.prompts import render
    from eagle3_runner.targets.load import load_tokenizer
    from eagle3_runner.runner.assets import asset_path
    path = write_spec(tmp_path, extend=True, synthetic_prompts=2, synthetic_max_tokens=8,
                      max_turns=1)
    data = path.parent / "data.jsonl"
    turns_data(data, cut=1)
    stage.run(ctx_of(load_spec(path), "regenerate", tmp_path / "w1"))
    old = {r["id"]: r for r in read_records(tmp_path / "w1")}
    assert all(len(r["finish"]) == 1 for r in old.values()) and len(old) == 8
    carry_set(tmp_path / "w1", path.parent / "carried" / NAME)

    reworded = turns_data(data, unlike=5)[5]  # conversation 5 (3 turns) reworded
    make = stage.make_generator
    spies = []
    monkeypatch.setattr(stage, "make_generator", lambda *a, **k: spies.append(
        Spy(make(*a, **k))) or spies[-1])
    grown = load_spec(path, overrides=["stages.regenerate.max_turns=3",
                                       "stages.regenerate.synthetic_prompts=0"])
    m = stage.run(ctx_of(grown, "regenerate", tmp_path / "w2"))
    union = {r["id"]: r for r in read_records(tmp_path / "w2")}
    assert set(union) == set(old)  # every carried record, once; no conversation new
    train = load_conversations(grown.data)[0]  # real-NNNNNN: the index in the training split
    users = [[t for t in conv if t["role"] == "user"] for conv in train]
    later = {f"real-{i:06d}" for i, u in enumerate(users)
             if len(u) > 1 and u[0] != reworded[0]}  # 2, 3 and 2 human turns
    assert len(later) == 3
    for i, conv in enumerate(train):
        rid, r, c = f"real-{i:06d}", union[f"real-{i:06d}"], old[f"real-{i:06d}"]
        if rid not in later:  # 1 human turn, or not the data's turns: as carried
            assert r == c
            continue
        n = len(users[i])
        assert len(r["finish"]) == len(r["answer_tokens"]) == n and r["cut"] is None
        assert r["messages"][:2] == c["messages"]  # the carried first answer, kept
        assert [t for t in r["messages"] if t["role"] == "user"] == conv[::2]
        assert r["finish"][:1] == c["finish"] and r["answer_tokens"][:1] == c["answer_tokens"]
        # each later turn was asked on the record so far: the carried answer in its prompt
        asked = {turn: ids for cid, turn, ids in spies[0].asked if cid == rid}
        assert sorted(asked) == list(range(1, n))
        tok = load_tokenizer(asset_path("smollm2"))
        for turn, ids in asked.items():
            assert ids == render(tok, r["messages"][:2 * turn + 1])
    assert not any(cid not in later for cid, _, _ in spies[0].asked)
    assert all(union[k] == old[k] for k in old if k.startswith("syn-"))
    assert m["carried_to_continue"] == 3 and m["carried_continued"] == 3
    assert m["carried_answers_added"] == 1 + 2 + 1 and m["carried_unlike_data"] == 1
    assert m["new_conversations"] == 0 and m["carried_conversations"] == 8
    assert m["turns"] == 8 + 4
    rep = json.loads((tmp_path / "w2" / "report.json").read_text())
    assert rep["extended"]["held"] == 3
    assert rep["extended"]["not_continued"] == {"all_answered": 2, "synthetic": 2,
                                                "unlike_data": 1}
    assert rep["regenerate"]["carried_answers_added"] == 4
    # resumed after the end: nothing asked again, nothing lost, the same counts
    again = stage.run(ctx_of(grown, "regenerate", tmp_path / "w2"))
    assert {r["id"]: r for r in read_records(tmp_path / "w2")} == union
    assert not spies[-1].asked and again["carried_answers_added"] == 4
    # the union carried into a third window at max_turns 3: every record at its last turn
    carry_set(tmp_path / "w2", path.parent / "carried" / NAME)
    third = stage.run(ctx_of(grown, "regenerate", tmp_path / "w3"))
    assert {r["id"]: r for r in read_records(tmp_path / "w3")} == union
    assert third["carried_to_continue"] == third["carried_continued"] == 0
    assert not spies[-1].asked


def first_turns_carried(tmp_path: Path, stage) -> tuple[Path, Path, list[dict]]:
    """A first window: the spec (extend, max_turns 1) answers turns_data's first turns, and its
    records are carried. Returns (spec path, data path, the carried records)."""
    path = write_spec(tmp_path, extend=True, max_turns=1)
    data = path.parent / "data.jsonl"
    turns_data(data, cut=1)
    stage.run(ctx_of(load_spec(path), "regenerate", tmp_path / "w1"))
    old = read_records(tmp_path / "w1")
    carry_set(tmp_path / "w1", path.parent / "carried" / NAME)
    return path, data, old


def test_a_continued_conversation_the_budget_never_starts_keeps_its_carried_record(
        tmp_path, stage):
    """A time budget over before anything starts: the carried records held for their later
    turns are written as they were carried (not dropped), so the union still holds their
    answers; nothing is counted as continued."""
    path, data, old = first_turns_carried(tmp_path, stage)
    turns_data(data)
    grown = load_spec(path, overrides=["stages.regenerate.max_turns=3",
                                       "stages.regenerate.max_minutes=0.001"])
    m = stage.run(ctx_of(grown, "regenerate", tmp_path / "w2"))
    assert read_records(tmp_path / "w2") == old
    assert m["carried_to_continue"] == 4 and m["carried_continued"] == 0
    assert m["conversations"] == 6 and "dropped_time_budget" not in m


def test_a_carried_conversation_whose_later_turn_is_a_bench_prompt_stays_as_carried(
        tmp_path, stage, monkeypatch):
    """A conversation whose later human turn is a bench prompt is dropped by the bench guard
    (data/contamination.py) before generation; its carried record, held for the later turns,
    is written as it was carried (the ShareGPT 4-turn file has one such conversation)."""
    import eagle3_runner.data.contamination as contamination
    path, data, old = first_turns_carried(tmp_path, stage)
    bench = "how do rivers 2 bend, part 2?"  # conversation 2's third question
    monkeypatch.setattr(contamination, "bench_guard",
                        lambda spec: contamination.BenchGuard([bench]))
    turns_data(data)
    m = stage.run(ctx_of(load_spec(path, overrides=["stages.regenerate.max_turns=3"]),
                         "regenerate", tmp_path / "w2"))
    union = {r["id"]: r for r in read_records(tmp_path / "w2")}
    guarded = [r for r in old if r["messages"][0]["content"] == "how do rivers 2 bend, part 0?"]
    assert len(guarded) == 1 and union[guarded[0]["id"]] == guarded[0]
    assert set(union) == {r["id"] for r in old}
    assert m["carried_to_continue"] == 4 and m["carried_continued"] == 3


def test_later_turns_reasons():
    """jobs/regen_turns.py later_turns on hand-made records: what is continued and why not."""
    from eagle3_runner.jobs.regen_turns import later_turns
    q = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q1"}]
    steps = [q, [{"role": "user", "content": "q2"}], [{"role": "user", "content": "q3"}]]
    rec = {"id": "real-000007", "source": "real", "index": 7, "finish": ["length"],
           "answer_tokens": [4], "cut": None, "dropped": None,
           "messages": q + [{"role": "assistant", "content": "a1"}]}
    assert later_turns(rec, steps) is None  # an answer without EOS: the next turn follows
    assert later_turns({**rec, "cut": "time_budget"}, steps) is None
    assert later_turns(rec, steps[:1]) == "all_answered"
    assert later_turns(rec, None) == "not_in_data"
    assert later_turns({**rec, "cut": "prompt_too_long"}, steps) == "ended"
    assert later_turns({**rec, "source": "synthetic", "id": "syn-000007"}, steps) == "synthetic"
    assert later_turns({**rec, "messages": [q[1], rec["messages"][-1]]}, steps) == "unlike_data"
    assert later_turns({**rec, "messages": q + [{"role": "user", "content": "a1"}]},
                       steps) == "unlike_data"
