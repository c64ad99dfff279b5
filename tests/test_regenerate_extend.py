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
