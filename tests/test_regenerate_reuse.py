"""stages.regenerate.reuse (runner/carry.py, data/regen_store.py `reuse_set`): a regenerated set
carried from one GPU window into the next. The carried file is made as scripts/gpu/pays.sh makes
it: a real (tiny-target) regenerate artifact's shards concatenated, with a sha256sum sidecar."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

import regen_helpers
from eagle3_runner.data.regen_store import SHARDS, read_records
from eagle3_runner.runner import carry
from eagle3_runner.runner.errors import PlanError, StageError
from eagle3_runner.runner.plan import build_plan
from eagle3_runner.runner.plan_checks import input_problems
from eagle3_runner.runner.spec.load import load_spec
from eagle3_runner.runner.stage import StageContext
from eagle3_runner.runner.stages import stage_slice

NAME = "regen-r.jsonl.gz"


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory):
    """A real regenerate artifact (tiny random target, a time budget so that some records are
    dropped and some cut) and its metrics."""
    out = tmp_path_factory.mktemp("regen") / "artifact"
    ticks = iter(range(10**6))
    m = regen_helpers.run(out, clock=lambda: float(next(ticks)), max_minutes=20 / 60)
    recs = read_records(out)
    assert any(r["dropped"] for r in recs) and any(not r["dropped"] for r in recs)
    return out, m


def carry_set(artifact: Path, dest: Path, sidecar: bool = True) -> str:
    """pays.sh's regen phase: `cat shards/part-*.jsonl.gz > FILE` and `sha256sum FILE >
    FILE.sha256` (run in FILE's folder). Returns the sha256."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_bytes(b"".join(p.read_bytes()
                              for p in sorted((artifact / SHARDS).glob("part-*.jsonl.gz"))))
    digest = hashlib.sha256(dest.read_bytes()).hexdigest()
    if sidecar:
        carry.sidecar(dest).write_text(f"{digest}  {dest.name}\n")
    return digest


def write_spec(tmp: Path, reuse: str | None = "carried/" + NAME, stages=None, **regen_over) -> Path:
    """A spec file in tmp/spec/ (its relative paths resolve there): a Llama-shaped target folder
    (config and chat template only: nothing here loads weights), a small data file,
    regenerate -> extract -> train."""
    d = tmp / "spec"
    (d / "target").mkdir(parents=True, exist_ok=True)
    (d / "target" / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 8,
        "hidden_size": 64, "vocab_size": 49152, "max_position_embeddings": 512,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128}))
    (d / "target" / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": "{{ messages }}"}))
    convs = [{"messages": [{"role": "user", "content": f"question {i} about rivers?"},
                           {"role": "assistant", "content": "old answer"}]} for i in range(4)]
    (d / "data.jsonl").write_text("".join(json.dumps(c) + "\n" for c in convs))
    regen = {"max_new_tokens": 4, "batch_size": 2, "shard_conversations": 4, **regen_over}
    if reuse is not None:
        regen["reuse"] = reuse
    spec = {"name": "r", "work_dir": "work", "results": {"path": "r.duckdb"},
            "target": {"path": "target"}, "drafter": {"draft_vocab_size": 64},
            "data": {"source": "jsonl", "path": "data.jsonl", "max_length": 96},
            "stages": stages or {"regenerate": regen, "extract": {}, "train": {}}}
    path = d / "spec.yaml"
    path.write_text(json.dumps(spec))  # JSON is YAML
    return path


def ctx_of(spec, stage: str, out: Path, inputs=None) -> StageContext:
    return StageContext(spec=spec, stage=stage, variant="base", run_id="t", inputs=inputs or {},
                        out_dir=out, db_path=out.parent / "r.duckdb")


@pytest.fixture
def no_target(monkeypatch):
    """Loading the target, its tokenizer or the data, or building the engine, fails the test."""
    import eagle3_runner.data.conversations as conversations
    import eagle3_runner.targets.load as load

    def boom(*a, **k):
        raise AssertionError("a reusing regenerate stage loaded the target or the data")
    for mod, name in ((load, "load_target"), (load, "load_tokenizer"),
                      (conversations, "load_conversations")):
        monkeypatch.setattr(mod, name, boom)
    import eagle3_runner.jobs.regenerate as regen
    monkeypatch.setattr(regen, "make_generator", boom)
    return regen


def test_reuse_writes_the_carried_records_without_the_target(tmp_path, regenerated, no_target):
    """A carried set with a good checksum: the stage writes exactly its records as its shards
    (dropped and cut ones included), loads nothing, and reports the regenerating run's
    conversation metrics under the same names, with reused = 1."""
    art, ref = regenerated
    spec_path = write_spec(tmp_path)
    digest = carry_set(art, spec_path.parent / "carried" / NAME)
    spec = load_spec(spec_path)
    assert carry.present(spec) == spec_path.parent / "carried" / NAME  # relative to the spec
    out = tmp_path / "out"
    m = no_target.run(ctx_of(spec, "regenerate", out))
    assert read_records(out) == read_records(art)
    assert len(list((out / SHARDS).glob("part-*.jsonl.gz"))) == -(-len(read_records(art)) // 4)
    assert m["reused"] == 1 and "tokens_per_s" not in m
    same = [k for k in ref if k.startswith(("conversations", "turns", "answer_tokens", "eos",
                                            "length_cap", "mean_answer", "dropped_time",
                                            "cut_time"))]
    assert len(same) > 8 and {k: m[k] for k in same} == {k: ref[k] for k in same}
    rep = json.loads((out / "report.json").read_text())["reused"]
    recs = read_records(art)
    assert rep == {"file": str(spec_path.parent / "carried" / NAME), "sha256": digest,
                   "records": len(recs), "kept": sum(not r["dropped"] for r in recs),
                   "dropped": sum(bool(r["dropped"]) for r in recs)}
    # resumed: a shard lost mid-way is written again, the others are kept
    last = sorted((out / SHARDS).iterdir())[-1]
    last.unlink()
    m2 = no_target.run(ctx_of(spec, "regenerate", out))
    assert read_records(out) == read_records(art)
    assert 0 < m2["resumed_conversations"] < len(recs)


def test_a_reused_set_reads_downstream_as_the_regenerated_one(tmp_path, regenerated, no_target):
    """Extract and online training read a regenerate artifact through targets/capture.py
    conversations(): the reused artifact gives the same conversations and report counts."""
    from eagle3_runner.targets.capture import conversations
    art, _ = regenerated
    spec_path = write_spec(tmp_path)
    carry_set(art, spec_path.parent / "carried" / NAME)
    spec = load_spec(spec_path)
    no_target.run(ctx_of(spec, "regenerate", tmp_path / "reused"))
    a, rep_a = conversations(ctx_of(spec, "extract", tmp_path / "x1", {"regenerate": art}))
    b, rep_b = conversations(ctx_of(spec, "extract", tmp_path / "x2",
                                    {"regenerate": tmp_path / "reused"}))
    assert a == b and len(a) > 0
    drop = ("path", "shards")  # where and in how many shards: the rest is the same
    assert {k: v for k, v in rep_a.items() if k not in drop} == \
        {k: v for k, v in rep_b.items() if k not in drop}


def test_a_bad_checksum_or_no_sidecar_is_refused_everywhere(tmp_path, regenerated, no_target):
    """validate, plan and the stage refuse a carried set whose sha256 is not its sidecar's, or
    that has no sidecar, naming the field, the file, both hashes and the fix."""
    art, _ = regenerated
    spec_path = write_spec(tmp_path)
    f = spec_path.parent / "carried" / NAME
    digest = carry_set(art, f)
    spec = load_spec(spec_path)
    assert input_problems(spec)[0] == []
    build_plan(spec)
    wrong = "0" * 64
    carry.sidecar(f).write_text(f"{wrong}  {NAME}\n")
    for stage_error in (False, True):
        with pytest.raises(StageError if stage_error else PlanError) as e:
            no_target.run(ctx_of(spec, "regenerate", tmp_path / "o")) if stage_error \
                else build_plan(spec)
        msg = str(e.value)
        assert msg.startswith("stages.regenerate.reuse = ") and str(f) in msg
        assert digest in msg and wrong in msg and "Stage it again" in msg
        assert "remove stages.regenerate.reuse" in msg
    errors, _ = input_problems(spec)  # runner validate
    assert len(errors) == 1 and digest in errors[0] and wrong in errors[0]
    assert not (tmp_path / "o" / SHARDS).exists()  # refused before writing anything
    carry.sidecar(f).unlink()
    errors, _ = input_problems(spec)
    assert len(errors) == 1 and "no checksum file" in errors[0] and digest in errors[0]
    with pytest.raises(PlanError, match="no checksum file"):
        build_plan(spec)
    with pytest.raises(StageError, match="no checksum file"):
        no_target.run(ctx_of(spec, "regenerate", tmp_path / "o"))
    carry.sidecar(f).write_text("not a checksum\n")
    with pytest.raises(PlanError, match="holds no sha256sum line"):
        build_plan(spec)
    # a file changed after its sidecar was made (a partial copy) is refused the same way
    carry.sidecar(f).write_text(f"{digest}  {NAME}\n")
    f.write_bytes(f.read_bytes()[:-10])
    with pytest.raises(PlanError, match="staged incompletely"):
        build_plan(spec)


def test_a_file_that_is_not_gzip_is_refused_before_the_run(tmp_path):
    """validate and plan refuse a carried set that is not gzip (with a matching checksum) before
    anything runs, saying what the file should be."""
    spec_path = write_spec(tmp_path)
    f = spec_path.parent / "carried" / NAME
    f.parent.mkdir(parents=True)
    f.write_text('{"id": "real-000000"}\n')
    carry.sidecar(f).write_text(f"{hashlib.sha256(f.read_bytes()).hexdigest()}  {NAME}\n")
    spec = load_spec(spec_path)
    errors, _ = input_problems(spec)
    assert len(errors) == 1 and "is not a gzip file" in errors[0] and str(f) in errors[0]
    with pytest.raises(PlanError, match="is not a gzip file"):
        build_plan(spec)


def test_a_set_that_is_not_a_regenerated_one_is_refused_by_the_stage(tmp_path, no_target):
    """A right checksum over the wrong content: a truncated gzip stream, or records that are
    not regenerate records (the raw data file, say), fail the stage before any shard."""
    spec_path = write_spec(tmp_path)
    f = spec_path.parent / "carried" / NAME
    f.parent.mkdir(parents=True)
    spec = load_spec(spec_path)
    for content, why in ((gzip.compress(b'{"id": "real-000000"}\n' * 50)[:-12],
                          "not a complete gzip JSONL file"),
                         (gzip.compress((spec_path.parent / "data.jsonl").read_bytes()),
                          "not a regenerated set"),
                         (gzip.compress(b""), "holds no records")):
        f.write_bytes(content)
        carry.sidecar(f).write_text(f"{hashlib.sha256(content).hexdigest()}  {NAME}\n")
        with pytest.raises(StageError, match=why):
            no_target.run(ctx_of(spec, "regenerate", tmp_path / "o"))
        assert not (tmp_path / "o" / SHARDS).exists()


def test_the_key_is_the_carried_sets_sha256_and_reuse_alone_changes_nothing(tmp_path,
                                                                            regenerated):
    """Present: the key slice is the file's sha256 (and the shard size), no target or data
    identity; another set changes it, the same set elsewhere does not. Absent: the key is the
    one the spec has without the field."""
    art, _ = regenerated
    spec_path = write_spec(tmp_path)
    f = spec_path.parent / "carried" / NAME
    absent = build_plan(load_spec(spec_path))
    spec = load_spec(spec_path)
    no_field = load_spec(spec_path, overrides=["stages.regenerate.reuse=null"])
    assert stage_slice(spec, "regenerate") == stage_slice(no_field, "regenerate")
    assert [p.key for p in build_plan(no_field).stages] == [p.key for p in absent.stages]
    assert "target" in stage_slice(spec, "regenerate")
    digest = carry_set(art, f)
    spec = load_spec(spec_path)
    assert stage_slice(spec, "regenerate") == {"reuse": {"sha256": digest},
                                               "shard_conversations": 4}
    present = build_plan(spec)
    reg = present.stages[0]
    assert reg.parts["inputs"]["files"] == {}
    assert [p.key for p in present.stages] != [p.key for p in absent.stages]  # all downstream
    # the same set under another name and folder: the same key
    g = tmp_path / "elsewhere" / "other.jsonl.gz"
    g.parent.mkdir()
    g.write_bytes(f.read_bytes())
    carry.sidecar(g).write_text(f"{digest}  other.jsonl.gz\n")
    moved = build_plan(load_spec(spec_path, overrides=[f"stages.regenerate.reuse={g}"]))
    assert [p.key for p in moved.stages] == [p.key for p in present.stages]
    # generation settings do not change the output of a reused set
    other = build_plan(load_spec(spec_path, overrides=["stages.regenerate.max_new_tokens=9"]))
    assert other.stages[0].key == reg.key
    # another set: another key, downstream too
    recs = read_records(art)
    g.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in recs[:-1]).encode()))
    carry.sidecar(g).write_text(f"{hashlib.sha256(g.read_bytes()).hexdigest()}  x\n")
    another = build_plan(load_spec(spec_path, overrides=[f"stages.regenerate.reuse={g}"]))
    assert all(a.key != b.key for a, b in zip(another.stages, present.stages))


def _fake_stage(monkeypatch, stage: str):
    def run(ctx):
        (ctx.out_dir / "out.txt").write_text(stage)
        return {"rows": 1}
    m = types.ModuleType(f"eagle3_runner.jobs.{stage}")
    m.run = run
    monkeypatch.setitem(sys.modules, f"eagle3_runner.jobs.{stage}", m)


def test_declaring_a_missing_set_keeps_a_finished_regeneration_and_the_plan_says_which(
        tmp_path, regenerated, monkeypatch):
    """A regeneration finished without the field stays up to date once a set that is not there
    is declared (the plan notes that it regenerates); staging the set reruns it as a reuse and
    reruns what reads it."""
    from eagle3_runner.runner.apply import apply
    from eagle3_runner.runner.cli import _render_plan
    art, _ = regenerated
    spec_path = write_spec(tmp_path)
    _fake_stage(monkeypatch, "regenerate")
    plain = load_spec(spec_path, overrides=["stages.regenerate.reuse=null"])
    _, outcomes = apply(plain, build_plan(plain, only=("regenerate",)))
    assert [o.status for o in outcomes if o.job.stage == "regenerate"] == ["done"]
    spec = load_spec(spec_path)
    plan = build_plan(spec)
    reg = plan.stages[0]
    f = spec_path.parent / "carried" / NAME
    assert (reg.action, reg.reason) == ("skip", "up to date")
    assert reg.note == f"regenerates: {f} not found (stages.regenerate.reuse)"
    assert f"up to date; regenerates: {f} not found" in _render_plan(plan)
    from eagle3_runner.runner.plan_checks import spec_warnings  # validate says it too
    assert any(w.startswith(f"stages.regenerate.reuse = ") and f"{f} is not there, so "
               "regenerate runs the target" in w for w in spec_warnings(spec))
    assert plan.stages[1].note is None
    digest = carry_set(art, f)
    plan = build_plan(spec)
    reg, ext = plan.stages[0], plan.stages[1]
    assert (reg.action, reg.reason) == ("run", "spec changed: stages.regenerate.reuse (the "
                                               "carried set is there)")
    assert reg.note == f"reuses {f} (sha256 {digest[:12]}..., no target run)"
    assert ext.action == "run" and ext.reason == "missing output"
    text = _render_plan(plan)
    assert f"reuses {f} (sha256 {digest[:12]}..., no target run)" in text
    # the reusing stage runs no target: no engine line, no memory estimate for it
    assert [e[0] for e in plan.engines] == ["extract"]
    assert "regenerate" not in [m["stage"] for m in plan.memory.get("stages", [])]
    # reused, then another set staged under the same name: the reason says so
    apply(spec, build_plan(spec, only=("regenerate",)))
    recs = read_records(art)
    f.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in recs[1:]).encode()))
    carry.sidecar(f).write_text(f"{hashlib.sha256(f.read_bytes()).hexdigest()}  {NAME}\n")
    reg = build_plan(spec).stages[0]
    assert (reg.action, reg.reason) == ("run", "input changed: stages.regenerate.reuse holds "
                                               "another set")
    # the set gone again: back to the finished regeneration, up to date
    f.unlink()
    assert build_plan(spec).stages[0].reason == "up to date"


def test_a_missing_set_is_regenerated_by_the_stage(tmp_path, monkeypatch):
    """The file is not there: the stage takes its generating path (here the embedded engine on
    a tiny random target) and writes one record per conversation of the data."""
    import torch
    from engine_helpers import tiny_hf_llama
    import eagle3_runner.data.contamination as contamination
    import eagle3_runner.jobs.regenerate as regen
    from eagle3_runner.models.llama import from_hf_model
    from eagle3_runner.runner.assets import asset_path
    from eagle3_runner.runner.errors import FetchError
    from eagle3_runner.targets.load import load_tokenizer
    try:
        tok = load_tokenizer(asset_path("smollm2"))
    except FetchError as e:
        pytest.skip(str(e))
    spec = load_spec(write_spec(tmp_path))
    assert carry.present(spec) is None and carry.problem(spec) is None
    monkeypatch.setattr(contamination, "bench_guard", lambda spec: contamination.BenchGuard([]))
    target = from_hf_model(tiny_hf_llama(vocab=49152, hidden=32, layers=2, heads=4, kv=2))
    calls = []

    def embedded(ctx, train, guard, carried=None):
        calls.append(len(train))
        return regen.regenerate(target, tok, train, ctx.params, ctx.spec.data.max_length,
                                Path(ctx.out_dir), guard, progress=False, stop_ids=(2,),
                                carried=carried)
    monkeypatch.setattr(regen, "_regenerate_embedded", embedded)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        m = regen.run(ctx_of(spec, "regenerate", tmp_path / "o"))
    finally:
        torch.set_num_threads(threads)
    assert calls == [4] and "reused" not in m
    assert sorted(r["id"] for r in read_records(tmp_path / "o")) == \
        [f"real-{i:06d}" for i in range(4)]
    assert "reused" not in json.loads((tmp_path / "o" / "report.json").read_text())


def test_apply_reuses_a_set_without_importing_torch(tmp_path, regenerated):
    """`runner apply --only regenerate` on a spec whose relative, ${VAR}-named reuse path
    points at a staged set: the plan line says it reuses it, the artifact holds its records,
    and the process never imported torch."""
    art, _ = regenerated
    spec_path = write_spec(tmp_path, reuse="${CARRIED}/" + NAME)
    f = spec_path.parent / "carried" / NAME
    carry_set(art, f)
    code = textwrap.dedent(f"""
        import sys
        from eagle3_runner.runner.cli import main
        rc = main(['apply', {str(spec_path)!r}, '--only', 'regenerate'])
        print('RC', rc, 'TORCH', 'torch' in sys.modules, file=sys.stderr)
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                       env={**os.environ, "CARRIED": "carried"})
    assert "RC 0 TORCH False" in r.stderr, r.stderr[-3000:]
    assert f"reuses {f} (sha256" in r.stderr
    out = next((spec_path.parent / "work" / "regenerate").glob("[0-9a-f]*"))
    assert read_records(out) == read_records(art)


def provenance_of(tmp: Path, **regen) -> dict:
    """The regenerate state record the runner writes (runner/plan.py write_state) for write_spec's
    spec (the same target and data, in their own folder under tmp) without
    stages.regenerate.reuse and with `regen` settings over its own: what pays.sh copies next to
    a set it carries (runner/carry.py PROVENANCE)."""
    from eagle3_runner.runner.plan import write_state
    ps = next(p for p in build_plan(load_spec(write_spec(tmp, reuse=None, **regen))).stages
              if p.stage == "regenerate")
    write_state(tmp / "state-work", ps)
    return json.loads((tmp / "state-work/state/base.regenerate.json").read_text())


def test_a_set_another_target_made_is_refused_and_other_settings_are_said(tmp_path, regenerated,
                                                                         no_target):
    """The carried set's .json sidecar (the state record of the run that made it) names the
    target that generated it: a set from another target is refused by validate, plan and the
    stage, naming both targets and the fix; one made with other sampling settings is reused
    with a warning naming each; one without the sidecar is reused with a warning that says the
    target cannot be checked."""
    art, _ = regenerated
    spec_path = write_spec(tmp_path)
    f = spec_path.parent / "carried" / NAME
    carry_set(art, f)
    spec = load_spec(spec_path)
    side = f.with_name(f.name + carry.PROVENANCE)
    # no sidecar: reused, with a warning
    errors, warns = input_problems(spec)
    assert errors == [] and any("which target generated it cannot be checked" in w
                                for w in warns), warns
    # made by this spec's target, same settings: nothing said
    side.write_text(json.dumps(provenance_of(tmp_path / "same")))
    errors, warns = input_problems(spec)
    assert errors == [] and not any("stages.regenerate.reuse" in w for w in warns), warns
    build_plan(spec)
    # same target, another temperature and answer length: reused, each named
    side.write_text(json.dumps(provenance_of(tmp_path / "t", temperature=0.7,
                                             max_new_tokens=256)))
    errors, warns = input_problems(spec)
    (w,) = [w for w in warns if "stages.regenerate.reuse" in w]
    assert errors == [] and "temperature 0.7 (this spec: 0.0)" in w
    assert "max_new_tokens 256 (this spec: 4)" in w
    # another target (the record of the H100 run that made a real carried set): refused
    rec = json.loads((Path(__file__).parent / "data/regen/state-h100-2026-12-07.json").read_text())
    side.write_text(json.dumps(rec))
    errors, _ = input_problems(spec)
    assert len(errors) == 1 and "generated by another target" in errors[0], errors
    assert "SmolLM2-135M-Instruct.Q4_1.gguf" in errors[0], errors
    assert f"target.path = {str(spec_path.parent / 'target')!r}" in errors[0], errors
    assert rec["inputs"]["files"]["target"][:12] in errors[0]
    with pytest.raises(PlanError, match="generated by another target"):
        build_plan(spec)
    with pytest.raises(StageError, match="Remove stages.regenerate.reuse to regenerate"):
        no_target.run(ctx_of(spec, "regenerate", tmp_path / "o"))
    assert not (tmp_path / "o" / SHARDS).exists()
    # a sidecar that is not a regenerate state record: refused, said so, never a traceback
    from eagle3_runner.runner.plan import write_state
    ps = next(p for p in build_plan(load_spec(write_spec(tmp_path / "x", reuse=None))).stages
              if p.stage == "extract")
    write_state(tmp_path / "x-work", ps)  # another stage's real record (it names the target too)
    extract_rec = (tmp_path / "x-work/state/base.extract.json").read_text()
    assert '"target"' in extract_rec
    for bad in ('{"key": "x"}', '{"spec": {}, "inputs": "x"}', '{"spec": {}, "inputs": '
                '{"files": null}}', '{"spec": {"regenerate": {}}, "inputs": {"files": {"target": '
                '12345}}}', '{"spec": {"target": "qwen", "regenerate": {}}, "inputs": {"files": '
                '{"target": "abc"}}}', '{"spec": {"regenerate": ["temperature"]}, "inputs": '
                '{"files": {"target": "abc"}}}', '[1]', extract_rec):
        side.write_text(bad)
        errors, warns = input_problems(spec)
        assert len(errors) == 1 and "not a regenerate stage's state record" in errors[0], bad
        with pytest.raises(PlanError, match="not a regenerate stage's state record"):
            build_plan(spec)


def stage_records(f: Path, records: list) -> None:
    """Write `records` as a carried set at f with a right sha256 sidecar (the checksum passes:
    only the content can be wrong)."""
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in records).encode()))
    carry.sidecar(f).write_text(f"{hashlib.sha256(f.read_bytes()).hexdigest()}  {f.name}\n")


def refused(spec, out: Path, no_target) -> str:
    """The regenerate stage's error on the carried set; nothing written under out."""
    with pytest.raises(StageError) as e:
        no_target.run(ctx_of(spec, "regenerate", out))
    assert not (out / SHARDS).exists()
    return str(e.value)


@pytest.mark.parametrize("field, value, says", [
    ("answer_tokens", ["many"], "answer_tokens ['many'] is not a list of token counts"),
    ("answer_tokens", [True], "answer_tokens [True] is not a list of token counts"),
    ("answer_tokens", [-3], "answer_tokens [-3] is not a list of token counts"),
    ("finish", [7], "finish [7] is not a list of finish reasons"),
    ("finish", [], "finish has 0 entries and answer_tokens"),
    ("cut", 3, "cut 3 is not a reason (a string) or null"),
    ("dropped", ["x"], "dropped ['x'] is not a reason (a string) or null"),
])
def test_a_record_field_of_the_wrong_type_is_refused_naming_record_and_field(
        tmp_path, regenerated, no_target, field, value, says):
    """A carried set whose checksum is right but one of whose records has a field of another
    type than the stage's writer makes (answer_tokens ["many"] failed the stage with a
    TypeError in summarize) is refused before any shard, naming the field, the file, the
    record's id, the field and the fix."""
    art, _ = regenerated
    recs = read_records(art)
    bad = next(i for i, r in enumerate(recs) if not r["dropped"])
    recs[bad][field] = value
    spec_path = write_spec(tmp_path)
    f = spec_path.parent / "carried" / NAME
    stage_records(f, recs)
    msg = refused(load_spec(spec_path), tmp_path / "o", no_target)
    assert msg.startswith("stages.regenerate.reuse: ") and str(f) in msg, msg
    assert f"record {bad + 1} ({recs[bad]['id']!r}): {says}" in msg, msg
    assert "stage it again with its .sha256, or remove stages.regenerate.reuse to regenerate" \
        in msg
    assert "TypeError" not in msg


@pytest.mark.parametrize("messages, says", [
    (["hello", "world"], "messages[0] 'hello' is not a turn {\"role\": str, \"content\": str} "
                         "(or {\"from\": str, \"value\": str})"),
    ("hello", "messages 'hello' is not a list of turns"),
    ([{"role": "user", "content": 5}], "messages[0] {'role': 'user', 'content': 5} is not a "
                                       "turn"),
    ([{"role": "user"}], "messages[0] {'role': 'user'} is not a turn"),
    ([{"role": "narrator", "content": "hi"}], "messages[0] has role 'narrator'"),
])
def test_messages_that_are_not_turns_are_refused_by_the_regenerate_stage(
        tmp_path, regenerated, no_target, messages, says):
    """Records whose messages are not turns used to pass the regenerate stage (cached as a good
    artifact) and fail only in extract, with a message about the internal artifact folder and
    data.max_bad_fraction: the stage refuses them, naming stages.regenerate.reuse, the carried
    file, the record and the turn. ShareGPT turns {"from", "value"} pass."""
    art, _ = regenerated
    recs = read_records(art)
    bad = next(i for i, r in enumerate(recs) if not r["dropped"])
    spec_path = write_spec(tmp_path)
    f = spec_path.parent / "carried" / NAME
    spec = load_spec(spec_path)
    good = [dict(r) for r in recs]
    good[bad]["messages"] = [{"from": "human" if t["role"] == "user" else "gpt",
                              "value": t["content"]} for t in recs[bad]["messages"]]
    stage_records(f, good)
    no_target.run(ctx_of(spec, "regenerate", tmp_path / "sharegpt"))
    recs[bad]["messages"] = messages
    stage_records(f, recs)
    msg = refused(spec, tmp_path / "o", no_target)
    assert msg.startswith("stages.regenerate.reuse: ") and str(f) in msg, msg
    assert f"record {bad + 1} ({recs[bad]['id']!r}): {says}" in msg, msg
    assert "stage it again with its .sha256, or remove stages.regenerate.reuse to regenerate" \
        in msg
    assert "max_bad_fraction" not in msg
