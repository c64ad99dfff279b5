"""Planning and applying: cache keys, rerun reasons, --force/--only, atomic artifacts.

Stages here are tiny stand-ins installed as `jobs.<stage>` in sys.modules for the duration of a
test, so the real plan -> apply -> run_stage -> finalize -> store path runs in milliseconds. The
real end-to-end apply on SmolLM2 is tests/test_e2e.py."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import pytest

import eagle3_runner.runner.plan as plan_mod
import eagle3_runner.runner.plan_checks as plan_checks
from eagle3_runner.runner.apply import apply
from eagle3_runner.runner.errors import PlanError
from eagle3_runner.runner.plan import _incomplete, build_plan
from eagle3_runner.runner.spec.load import load_spec
from eagle3_runner.runner.stage import MANIFEST, read_manifest
from eagle3_runner.runner.store import Store

ROOT = Path(__file__).resolve().parent.parent
STAGES = ("extract", "train", "export", "bench")


def make_spec(tmp: Path, overrides=(), variants=None):
    data_file = tmp / "data.jsonl"
    if not data_file.exists():
        data_file.write_text('{"conversations": [{"from": "human", "value": "hi"}, '
                             '{"from": "gpt", "value": "hello"}]}\n')
    target = tmp / "target"  # plan refuses a missing input file; no weights are ever loaded
    if not target.exists():
        target.mkdir()
        (target / "config.json").write_text(json.dumps(
            {"num_hidden_layers": 30, "hidden_size": 576, "vocab_size": 49152,
             "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536}))
    data = {
        "name": "p", "work_dir": str(tmp / "work"),
        "target": {"path": str(target), "num_hidden_layers": 30,
                   "hidden_size": 576, "vocab_size": 49152},
        "drafter": {"aux_layer_ids": [1, 14, 26], "draft_vocab_size": 4096},
        "data": {"source": "jsonl", "path": str(data_file)},
        "stages": {"extract": {}, "train": {"lr": 1e-4}, "export": {},
                   "bench": {"configs": [{"num_steps": 3}]}},
        "results": {"path": str(tmp / "r.duckdb")},
        "variants": variants or [],
    }
    return load_spec(data=data, overrides=list(overrides))


def _fake_run(ctx):
    """A stage: one output file naming its inputs; fails when told to by the environment."""
    (ctx.out_dir / "out.txt").write_text(json.dumps(
        {"stage": ctx.stage, "inputs": {k: str(v) for k, v in sorted(ctx.inputs.items())}}))
    for k, v in ctx.inputs.items():  # inputs are complete artifacts
        assert (v / MANIFEST).exists(), v
    if os.environ.get("FAIL_STAGE") == ctx.stage:
        raise RuntimeError(f"{ctx.stage} failed on purpose")
    ctx.metric("curve", 1.0, step=1)
    return {"rows": (len(ctx.inputs) + 1, "items")}


@pytest.fixture
def fake_stages(monkeypatch):
    for s in ("regenerate",) + STAGES:
        m = types.ModuleType(f"eagle3_runner.jobs.{s}")
        m.run = _fake_run
        monkeypatch.setitem(sys.modules, f"eagle3_runner.jobs.{s}", m)
    return monkeypatch


def reasons(plan) -> dict:
    return {p.id: (p.action, p.reason) for p in plan.stages}


def test_fresh_plan_is_missing_output_in_order(tmp_path, monkeypatch):
    plan = build_plan(make_spec(tmp_path))
    assert [p.stage for p in plan.stages] == list(STAGES)
    assert all(p.action == "run" and p.reason == "missing output" for p in plan.stages)
    assert len({p.key for p in plan.stages}) == 4 and all(len(p.key) == 64 for p in plan.stages)
    # a pure value of the spec and the files: same spec -> same stages, keys and reasons, and the
    # same sorted JSON for them, whatever else writes to the disk in between (the free bytes of
    # the plan's disk report are a reading of the machine, not of the spec)
    import eagle3_runner.runner.disk as disk
    monkeypatch.setattr(disk, "free_bytes", lambda p: (12345, str(p)))
    again = build_plan(make_spec(tmp_path))
    assert again.disk["free_bytes"] != plan.disk["free_bytes"]
    assert again.stages == plan.stages
    assert json.loads(again.to_json())["stages"] == json.loads(plan.to_json())["stages"]
    d = json.loads(plan.to_json())
    assert [s["reason"] for s in d["stages"]] == ["missing output"] * 4


def test_apply_then_up_to_date(tmp_path, fake_stages):
    spec = make_spec(tmp_path)
    plan = build_plan(spec)
    run_id, outcomes = apply(spec, plan, quiet=True)
    assert [o.status for o in outcomes] == ["done"] * 4
    for p in plan.stages:
        m = read_manifest(Path(p.artifact))
        assert m["cache_key"] == p.key and "out.txt" in m["files"]
        assert not Path(p.partial).exists()
    # the train stage saw extract's completed artifact
    train = next(p for p in plan.stages if p.stage == "train")
    extract = next(p for p in plan.stages if p.stage == "extract")
    got = json.loads((Path(train.artifact) / "out.txt").read_text())
    assert got["inputs"] == {"extract": extract.artifact}
    again = build_plan(make_spec(tmp_path))
    assert reasons(again) == {s: ("skip", "up to date") for s in STAGES}
    # rows landed in DuckDB
    store = Store(plan.results)
    _, rows = store.query("SELECT stage, status FROM stages WHERE run_id = ? ORDER BY stage"
                          .replace("?", f"'{run_id}'"))
    assert rows == sorted((s, "done") for s in STAGES)
    _, rows = store.query(f"SELECT stage, value, unit FROM metrics WHERE run_id = '{run_id}' "
                          "AND name = 'rows' ORDER BY stage")
    assert ("train", 2.0, "items") in rows and ("extract", 1.0, "items") in rows
    _, rows = store.query(f"SELECT status FROM runs WHERE run_id = '{run_id}'")
    assert rows == [("done",)]
    # applying the up-to-date plan runs nothing and records skipped rows
    run2, outcomes = apply(make_spec(tmp_path), again, quiet=True)
    assert outcomes == []
    _, rows = store.query(f"SELECT count(*) FROM stages WHERE run_id = '{run2}' "
                          "AND status = 'skipped'")
    assert rows == [(4,)]


def test_spec_change_names_the_field_and_cascades(tmp_path, fake_stages):
    spec = make_spec(tmp_path)
    apply(spec, build_plan(spec), quiet=True)
    r = reasons(build_plan(make_spec(tmp_path, ["stages.train.lr=3e-4"])))
    assert r["extract"] == ("skip", "up to date")
    assert r["train"] == ("run", "spec changed: train.lr")
    assert r["export"] == ("run", "input changed")  # its upstream key changed
    assert r["bench"] == ("run", "input changed")
    r = reasons(build_plan(make_spec(tmp_path, ["stages.bench.num_prompts=2"])))
    assert r["bench"] == ("run", "spec changed: bench.num_prompts")
    assert {r[s][0] for s in ("extract", "train", "export")} == {"skip"}
    r = reasons(build_plan(make_spec(tmp_path, ["drafter.aux_layer_ids=[2, 15, 27]"])))
    assert r["extract"] == ("run", "spec changed: aux_layer_ids")
    # when checkpoints are written changes no weight: the trained drafter stays (it retrained)
    r = reasons(build_plan(make_spec(tmp_path, ["stages.train.checkpoint_every=7",
                                                "stages.train.checkpoint_minutes=1"])))
    assert {r[s][0] for s in r} == {"skip"}, r
    # stages.bench.sglang.curve_parallel: out of the key while null (a spec written before the
    # field keeps its key: the whole bench block as it was), in it once set
    from eagle3_runner.runner.stages import stage_slice
    bench = stage_slice(spec, "bench")["bench"]
    assert bench == {**spec.stages.bench.model_dump(mode="json"),
                     "sglang": {k: v for k, v in spec.stages.bench.sglang.model_dump(
                         mode="json").items() if k != "curve_parallel"}}
    r = reasons(build_plan(make_spec(tmp_path, ["stages.bench.sglang.curve_parallel=4"])))
    assert r["bench"] == ("run", "spec changed: bench.sglang.curve_parallel")
    assert {r[s][0] for s in ("extract", "train", "export")} == {"skip"}


def test_input_file_change(tmp_path, fake_stages):
    spec = make_spec(tmp_path)
    apply(spec, build_plan(spec), quiet=True)
    (tmp_path / "data.jsonl").write_text('{"conversations": [{"from": "human", "value": "a"}, '
                                         '{"from": "gpt", "value": "b"}]}\n')
    r = reasons(build_plan(make_spec(tmp_path)))
    assert r["extract"] == ("run", "input changed")
    assert r["train"] == ("run", "input changed")


def test_code_change(tmp_path, fake_stages):
    spec = make_spec(tmp_path)
    apply(spec, build_plan(spec), quiet=True)
    real = plan_mod.code_hash
    fake_stages.setattr(plan_mod, "code_hash",
                        lambda s: "edited" if s == "export" else real(s))
    r = reasons(build_plan(make_spec(tmp_path)))
    assert r["export"] == ("run", "code changed")
    assert r["bench"] == ("run", "input changed")
    assert r["train"] == ("skip", "up to date")


def test_code_hash_follows_project_imports(tmp_path, monkeypatch):
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    (jobs / "helper.py").write_text("X = 1\n")
    (jobs / "train.py").write_text("import os\nfrom eagle3_runner.jobs.helper import X\n")
    monkeypatch.setattr(plan_mod, "ROOT", tmp_path)
    plan_mod.code_hash.cache_clear()
    try:
        h1 = plan_mod.code_hash("train")
        (jobs / "helper.py").write_text("X = 2\n")
        plan_mod.code_hash.cache_clear()
        assert plan_mod.code_hash("train") != h1
    finally:
        plan_mod.code_hash.cache_clear()


UP, CODE = ("skip", "up to date"), ("run", "code changed")


@pytest.mark.parametrize("edited, expect", [
    # (the bench inspects an external stages.bench.drafter itself: its code too)
    ("runner/inspect.py", {"extract": UP, "train": UP, "export": CODE, "bench": CODE}),
    # the SGLang rules: extract and online train (targets/capture.py) check the aux ids against
    # the loaded target, export inspects, the sglang bench backend checks its environment
    # (runner/drafts/server.py)
    ("runner/drafts/rules.py", {"extract": CODE, "train": CODE, "export": CODE, "bench": CODE}),
])
def test_editing_a_runner_module_export_uses_reruns_export_and_downstream(tmp_path, fake_stages,
                                                                          edited, expect):
    """The cache key covers runner/ modules too: export runs `runner inspect` and the SGLang
    rules, so editing them must rerun export (and bench after it), not say `up to date`."""
    import shutil
    root = tmp_path / "project"
    from test_imports import FLOORS
    for pkg in FLOORS:
        shutil.copytree(ROOT / pkg, root / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    fake_stages.setattr(plan_mod, "ROOT", root)
    plan_mod.code_hash.cache_clear()
    try:
        spec = make_spec(tmp_path)
        apply(spec, build_plan(spec), quiet=True)
        assert set(reasons(build_plan(spec)).values()) == {("skip", "up to date")}
        with open(root / edited, "a") as f:
            f.write("\n# a rule changed here\n")
        plan_mod.code_hash.cache_clear()
        assert reasons(build_plan(make_spec(tmp_path))) == expect  # input: an upstream key
    finally:
        plan_mod.code_hash.cache_clear()


def test_force_and_only(tmp_path, fake_stages):
    spec = make_spec(tmp_path)
    apply(spec, build_plan(spec), quiet=True)
    r = reasons(build_plan(spec, force=("train",)))
    assert r["train"] == ("run", "forced") and r["extract"] == ("skip", "up to date")
    r = reasons(build_plan(make_spec(tmp_path, ["stages.train.lr=5e-4"]), only=("train",)))
    assert r["train"][0] == "run"
    assert r["export"] == ("skip", "not selected (--only)")
    with pytest.raises(PlanError, match="unknown stage \\(did you mean 'train'\\?\\)"):
        build_plan(spec, force=("trian",))
    with pytest.raises(PlanError, match="no such stage"):  # a variant that does not exist
        build_plan(spec, only=("train@nope",))
    with pytest.raises(PlanError, match="no such stage"):  # a stage the spec does not enable
        build_plan(spec, force=("regenerate",))


def test_force_of_a_stage_outside_only_is_an_error_naming_both_flags(tmp_path, fake_stages):
    """`--force bench --only extract` ran bench and skipped the up-to-date extract without a
    word: a --force outside --only is refused, naming both flags and the fix (plan and apply
    build the same plan); --force inside --only (bench --only bench, train --only train@v) still runs
    exactly the selected stage."""
    spec = make_spec(tmp_path, variants=[{"name": "v", "overrides": {"stages.train.lr": 3e-4}}])
    apply(spec, build_plan(spec), quiet=True)
    for force, only in ((("bench",), ("extract",)), (("train",), ("bench@v",)),
                        (("extract",), ("train", "export"))):
        with pytest.raises(PlanError) as e:
            build_plan(spec, force=force, only=only)
        assert str(e.value) == (
            f"--force {force[0]} with --only {' '.join(only)}: {force[0]} is not a stage --only "
            f"runs, and --force reruns only what --only selects. Add --only {force[0]} to rerun "
            f"it too (e.g. --force {force[0]} --only {force[0]}), or drop --force {force[0]}.")
    r = reasons(build_plan(spec, force=("bench",), only=("bench",)))
    assert {k: v for k, v in r.items() if v[0] == "run"} == {"bench": ("run", "forced"),
                                                             "bench@v": ("run", "forced")}
    r = reasons(build_plan(spec, force=("train",), only=("train@v",)))
    assert [k for k, v in r.items() if v[0] == "run"] == ["train@v"]
    r = reasons(build_plan(spec, force=("extract",), only=("extract", "train")))
    assert r["extract"] == ("run", "forced") and r["train"][0] == "run"


def test_only_with_missing_upstream_is_a_clear_error(tmp_path):
    spec = make_spec(tmp_path)
    with pytest.raises(PlanError) as ei:
        build_plan(spec, only=("train",))
    msg = str(ei.value)
    assert "train needs extract" in msg and "--only extract" in msg
    r = subprocess.run([sys.executable, "-m", "eagle3_runner.runner.cli", "plan", "specs/smollm2-sharegpt.yaml",
                        "--only", "bench", "-o", f"work_dir={tmp_path}/w"], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 1 and "needs export" in r.stderr and "Traceback" not in r.stderr


def test_failed_stage_leaves_no_complete_artifact(tmp_path, fake_stages):
    fake_stages.setenv("FAIL_STAGE", "train")
    spec = make_spec(tmp_path)
    plan = build_plan(spec)
    run_id, outcomes = apply(spec, plan, quiet=True)
    assert [o.status for o in outcomes] == ["done", "failed", "skipped", "skipped"]
    assert "failed on purpose" in outcomes[1].error
    train = next(p for p in plan.stages if p.stage == "train")
    assert not Path(train.artifact).exists()
    assert Path(train.partial).exists() and not (Path(train.partial) / MANIFEST).exists()
    r = reasons(build_plan(make_spec(tmp_path)))
    assert r["extract"] == ("skip", "up to date")
    # no checkpoint in the partial dir: the plan says the run restarts (not "resuming")
    assert r["train"] == ("run", "incomplete: no ckpt.pt yet, restarts from the beginning")
    (Path(train.partial) / "ckpt.pt").write_bytes(b"")
    r = reasons(build_plan(make_spec(tmp_path)))
    assert r["train"] == ("run", "incomplete: resuming partial output")
    _, rows = Store(plan.results).query(
        f"SELECT stage, status, error FROM stages WHERE run_id = '{run_id}' ORDER BY started_at")
    assert ("train", "failed") in [(s, st) for s, st, _ in rows]
    _, rows = Store(plan.results).query(f"SELECT status FROM runs WHERE run_id = '{run_id}'")
    assert rows == [("failed",)]
    # it resumes and completes
    fake_stages.delenv("FAIL_STAGE")
    _, outcomes = apply(spec, build_plan(make_spec(tmp_path)), quiet=True)
    assert [o.status for o in outcomes] == ["done"] * 3


def test_dir_without_manifest_is_never_up_to_date(tmp_path):
    spec = make_spec(tmp_path)
    plan = build_plan(spec)
    extract = plan.stages[0]
    Path(extract.artifact).mkdir(parents=True)
    (Path(extract.artifact) / "data.bin").write_bytes(b"x" * 100)  # looks like output
    assert reasons(build_plan(spec))["extract"][0] == "run"
    (Path(extract.artifact) / MANIFEST).write_text("{truncated")  # a torn manifest
    assert reasons(build_plan(spec))["extract"][0] == "run"


KILLED_STAGE = textwrap.dedent("""
    import sys, time, types
    sys.path.insert(0, {root!r})
    from eagle3_runner.runner.spec.load import load_spec
    from eagle3_runner.runner.plan import build_plan
    from eagle3_runner.runner.apply import apply
    import yaml

    def run(ctx):
        (ctx.out_dir / "big.bin").write_bytes(b"x" * 1000)
        (ctx.out_dir / "started").write_text("1")
        time.sleep(120)
        return {{}}

    for s in ("extract", "train", "export", "bench"):
        m = types.ModuleType("eagle3_runner.jobs." + s); m.run = run; sys.modules["eagle3_runner.jobs." + s] = m
    spec = load_spec({spec!r})
    apply(spec, build_plan(spec), quiet=True)
""")


def test_stage_killed_midway_never_looks_complete(tmp_path):
    import yaml
    spec = make_spec(tmp_path)
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    script = tmp_path / "kill_me.py"
    script.write_text(KILLED_STAGE.format(root=str(ROOT), spec=str(spec_file)))
    plan = build_plan(spec)
    extract = plan.stages[0]
    proc = subprocess.Popen([sys.executable, str(script)], cwd=ROOT)
    try:
        deadline = time.time() + 60
        while not (Path(extract.partial) / "started").exists():
            assert proc.poll() is None, "stage process died early"
            assert time.time() < deadline, "stage never started"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    assert not Path(extract.artifact).exists()
    assert read_manifest(Path(extract.partial)) is None
    r = reasons(build_plan(make_spec(tmp_path)))
    assert r["extract"] == ("run", "incomplete: resuming partial output")
    assert all(a == "run" for a, _ in r.values())


def test_variants_share_identical_stages(tmp_path):
    spec = make_spec(tmp_path, variants=[
        {"name": "more", "overrides": {"stages.bench.num_prompts": 3}},
        {"name": "lr", "overrides": {"stages.train.lr": 1e-3}}])
    r = reasons(build_plan(spec))
    assert r["extract@more"] == ("skip", "same as extract")
    assert r["export@more"] == ("skip", "same as export")
    assert r["bench@more"] == ("run", "missing output")
    assert r["extract@lr"] == ("skip", "same as extract")
    assert r["train@lr"] == ("run", "missing output")


def test_plan_cli_json_and_no_torch(tmp_path):
    code = ("import sys, runner.cli as c\n"
            f"rc = c.main(['plan', 'specs/drafter-v2.yaml', '--json'])\n"
            "assert rc == 0\n"
            "heavy = sorted(m for m in ('torch', 'transformers', 'safetensors') if m in sys.modules)\n"
            "print('HEAVY', heavy, file=sys.stderr)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "HEAVY []" in r.stderr
    d = json.loads(r.stdout)
    assert [s["stage"] for s in d["stages"]] == ["regenerate", "extract", "train", "export",
                                                 "bench"]
    assert d["executor"] == "slurm"
    # the memory check, torch-free: the SGLang server of each stage that runs the target
    assert [(m["stage"], m["fits"]) for m in d["memory"]["stages"]] == \
        [("regenerate", True), ("extract", True)]
    assert [(e[0], e[1]) for e in d["engines"]] == [("regenerate", "sglang"),
                                                    ("extract", "sglang")]


def test_forced_or_selected_shared_stage_runs_once(tmp_path):
    # variants sharing a key must never run it twice (they would share one partial dir)
    spec = make_spec(tmp_path, variants=[{"name": "v", "overrides": {"stages.bench.num_prompts": 3}}])
    for force in (("train",), ("train@v",)):
        plan = build_plan(spec, force=force)
        r = reasons(plan)
        assert r["train"] == ("run", "forced") and r["train@v"] == ("skip", "same as train")
        keys = [p.key for p in plan.stages if p.action == "run"]
        assert len(keys) == len(set(keys))
    r = reasons(build_plan(spec, only=("extract@v",)))
    assert r["extract"] == ("run", "missing output")
    assert r["extract@v"] == ("skip", "same as extract")


def test_work_dir_or_results_in_the_way_is_a_plan_error(tmp_path):
    f = tmp_path / "a-file"
    f.write_text("x")
    for over, field in ((f"work_dir={f}", "work_dir"), (f"work_dir={f}/sub", "work_dir"),
                        (f"results.path={f}/r.duckdb", "results.path"),
                        (f"results.path={tmp_path}", "results.path")):
        with pytest.raises(PlanError, match=field):
            build_plan(make_spec(tmp_path, [over]))
    assert not (f.is_dir())  # nothing created in the way


def test_variant_selection_runs_that_variant_and_the_shared_stages_it_needs(tmp_path, fake_stages):
    spec = make_spec(tmp_path, variants=[
        {"name": "small", "overrides": {"stages.train.num_samples": 10}},
        {"name": "he", "overrides": {"stages.bench.num_prompts": 3}}])
    plan = build_plan(spec, variants=("small",))
    act = {p.id: (p.action, p.reason) for p in plan.stages}
    # extract is computed by base (shared key) and must run, because "small" needs it
    assert act["extract"][0] == "run"
    assert [act[f"{s}@small"][0] for s in ("train", "export", "bench")] == ["run"] * 3
    assert act["train"] == ("skip", "not selected (--variant)")
    assert act["bench@he"] == ("skip", "not selected (--variant)")
    apply(spec, plan, quiet=True)
    act = {p.id: p.action for p in build_plan(spec, variants=("he",)).stages}
    # he shares base's train/export: those run (under base), and he's own bench
    assert act["extract"] == "skip" and act["train"] == "run" and act["bench@he"] == "run"
    assert act["bench"] == "skip" and act["bench@small"] == "skip"
    with pytest.raises(PlanError, match="no such variant; this spec has base, small, he"):
        build_plan(spec, variants=("smal",))
    # --force follows --variant: forcing train under --variant he reruns the train he uses
    # (base's, shared) and not small's
    act = {p.id: p.action for p in build_plan(spec, force=("train",), variants=("he",)).stages}
    assert act["train"] == "run" and act["train@small"] == "skip"
    with pytest.raises(PlanError, match="'bench@small': variant 'small' is not selected"):
        build_plan(spec, force=("bench@small",), variants=("he",))


def test_a_stage_another_process_is_computing_fails_clearly_and_untouched(tmp_path, fake_stages):
    """Two applies (say one per GPU, --variant) must never write one partial dir at once."""
    import fcntl
    spec = make_spec(tmp_path)
    plan = build_plan(spec)
    train = next(p for p in plan.stages if p.stage == "train")
    lock = Path(spec.resolved_work_dir()) / ".locks" / f"train-{train.key[:16]}.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as held:  # what the other runner process holds
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        _, outcomes = apply(spec, plan, quiet=True)
    st = {o.job.stage: (o.status, o.error) for o in outcomes}
    assert st["extract"][0] == "done" and st["train"][0] == "failed"
    assert "another runner process is computing this stage" in st["train"][1]
    assert str(lock) in st["train"][1]
    assert not Path(train.partial).exists() and not Path(train.artifact).exists()
    # once the other process is gone, the stage runs; stage folders hold artifacts only
    _, outcomes = apply(spec, build_plan(spec), quiet=True)
    assert {o.job.stage: o.status for o in outcomes}["train"] == "done"
    assert [p.name for p in Path(train.artifact).parent.iterdir()] == [Path(train.artifact).name]


def test_a_stage_is_one_registry_row(tmp_path, monkeypatch):
    """The spec's stage blocks, the plan's order and the Slurm per-stage keys all come from the
    registry; what a stage needs is a function of the spec, so one edited row (say, a train that
    reads no extract artifact) changes the plan."""
    import dataclasses
    import typing
    import eagle3_runner.runner.stages as S
    from eagle3_runner.runner.spec.sections import SlurmExecutor
    assert tuple(S.Stages.model_fields) == S.STAGE_ORDER == tuple(k.name for k in S.REGISTRY)
    keys = typing.get_args(SlurmExecutor.model_fields["stages"].annotation)[0]
    assert typing.get_args(keys) == S.STAGE_ORDER
    plan = build_plan(make_spec(tmp_path))
    assert next(p for p in plan.stages if p.stage == "train").needs == (("base", "extract"),)
    monkeypatch.setattr(S, "REGISTRY", tuple(
        dataclasses.replace(k, needs=lambda spec: ()) if k.name == "train" else k
        for k in S.REGISTRY))
    plan = build_plan(make_spec(tmp_path))
    assert next(p for p in plan.stages if p.stage == "train").needs == ()


def test_every_registry_preflight_is_a_function_of_its_stage_module():
    from eagle3_runner.runner.stages import REGISTRY, stage_module
    for k in REGISTRY:
        if k.preflight is not None:
            assert callable(getattr(stage_module(k.name), k.preflight, None)), k


def test_bench_backend_sglang_without_sglang_is_refused_before_any_compute(tmp_path):
    """backend sglang on a machine whose stages.bench.sglang.python cannot import sglang: plan
    and validate refuse it on the local executor, naming the three fixes (it used to fail
    after extract, train and export); on Slurm it is a warning (the plan cannot see a node)."""
    from eagle3_runner.runner.errors import PlanError
    from eagle3_runner.runner.plan_checks import input_problems
    bad = ["stages.bench.backend=sglang", "stages.bench.sglang.python=/nonexistent/python3"]
    spec = make_spec(tmp_path, bad)
    with pytest.raises(PlanError, match=r"sglang is not importable by '/nonexistent/python3'.*"
                                        r"eagle3-runner\[sglang\].*stages.bench.sglang.python.*"
                                        r"backend: embedded"):
        build_plan(spec)
    errors, warnings = input_problems(spec)
    assert len(errors) == 1 and not warnings
    assert errors[0].startswith("stages.bench.backend = sglang")
    slurm = make_spec(tmp_path, bad + ["executor={kind: slurm, partition: gpu}"])
    plan = build_plan(slurm)
    assert any("sglang is not importable" in w and "compute nodes" in w for w in plan.warnings)
    assert input_problems(slurm)[0] == []
    assert input_problems(make_spec(tmp_path))[0] == []  # embedded: nothing to import


def test_validate_sees_what_plan_sees(tmp_path):
    """`runner validate` checks the files the stages read (a data file that does not exist) and
    the stages a stage needs (a bench without an export: nothing to bench), as plan does."""
    from eagle3_runner.runner.errors import PlanError
    from eagle3_runner.runner.plan_checks import input_problems
    spec = make_spec(tmp_path, ["data.path=" + str(tmp_path / "missing.jsonl")])
    errors, _ = input_problems(spec)
    assert len(errors) == 1 and errors[0].startswith("data.path = ")
    assert "does not exist" in errors[0]
    r = subprocess.run([sys.executable, "-m", "eagle3_runner.runner", "validate",
                        str(_write_spec(tmp_path, spec))], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 1 and r.stderr.startswith("error: data.path = "), r.stderr
    no_export = make_spec(tmp_path, ["stages.export=null"])
    errors, _ = input_problems(no_export)
    assert errors == [e for e in errors if e.startswith("stages.bench: set, but the spec has no "
                                                        "stages.export")] and errors
    with pytest.raises(PlanError, match="stages.bench: set, but the spec has no stages.export"):
        build_plan(no_export)


def test_validate_and_plan_give_the_stages_data_verdict(tmp_path):
    """Issue 48: `runner init` on a file with 4 of 34 records unusable said the first apply
    would stop; validate and plan said ok, and apply stopped on data.max_bad_fraction. Now
    validate and plan (torch-free) count the file with the stages' own reader and cleaner
    (cached) and refuse it with the message the extract stage gives, and likewise a
    data.holdout that leaves nothing to train on; a regenerate stage reads the data in place
    of extract, and a stage that is not run checks nothing."""
    from eagle3_runner.data.conversations import load_conversations
    from eagle3_runner.runner.errors import StageError
    cache = tmp_path / "cache"
    env = {**os.environ, "EAGLE3_MEMO": str(cache)}
    good = [json.dumps({"conversations": [{"from": "human", "value": f"q{i}"},
                                          {"from": "gpt", "value": f"a{i}"}]}) for i in range(30)]
    (tmp_path / "data.jsonl").write_text("\n".join(good[:12] + ["{oops"] * 3 + good[12:]
                                                   + ['{"cut']) + "\n")
    spec = make_spec(tmp_path)
    with pytest.raises(StageError) as e:
        load_conversations(spec.data)  # what the extract stage says
    said = str(e.value)
    assert said.startswith("data.max_bad_fraction = 0.01: 4 of 34 records")
    code = ("import sys\nfrom eagle3_runner.runner.cli import main\n"
            "rc = main(sys.argv[1:])\n"
            "heavy = sorted(m for m in ('torch', 'transformers', 'safetensors') if m in sys.modules)\n"
            "print('HEAVY', heavy, file=sys.stderr)\nsys.exit(rc)\n")
    path = _write_spec(tmp_path, spec)
    for cmd in ("validate", "plan"):
        r = subprocess.run([sys.executable, "-c", code, cmd, str(path)], cwd=ROOT, env=env,
                           capture_output=True, text=True)
        assert r.returncode == 1 and f"error: {said}" in r.stderr, r.stderr
        assert "HEAVY []" in r.stderr
    assert list((cache / "data-counts").glob("*.json"))  # counted once, then read back
    # a looser tolerance passes; a holdout that leaves nothing to train on does not
    loose = make_spec(tmp_path, ["data.max_bad_fraction=0.2"])
    assert build_plan(loose).stages
    held = make_spec(tmp_path, ["data.max_bad_fraction=0.2", "data.holdout=30"])
    with pytest.raises(StageError) as e:
        load_conversations(held.data)
    with pytest.raises(PlanError) as p:
        build_plan(held)
    assert str(p.value) == str(e.value) and "data.holdout = 30: leaves no training" in str(e.value)
    assert plan_checks.input_problems(held)[0] == [str(e.value)]
    # with a regenerate stage, regenerate reads the data (once said), extract reads its output
    regen = make_spec(tmp_path, ["stages.regenerate={}"])
    assert plan_checks.input_problems(regen)[0] == [said]
    assert plan_checks.stage_problems(regen, "extract") == []
    # a stage that is not run reads nothing: an up-to-date extract is not checked
    assert plan_checks.stage_problems(make_spec(tmp_path, ["stages.extract=null",
                                                           "stages.train.features=online"]),
                                      "export") == []


def test_a_failed_apply_prints_the_error_not_an_empty_table(tmp_path, fake_stages, capsys):
    """Issue 48: a failed `runner apply` printed an empty metrics table (its header) before the
    error. Now a run that stored nothing prints only the error; one whose earlier stages
    finished prints what they stored (this run's, never an older run's), then the error."""
    from eagle3_runner.runner.cli import main
    path = _write_spec(tmp_path, make_spec(tmp_path))
    fake_stages.setenv("FAIL_STAGE", "extract")
    assert main(["apply", str(path)]) == 1
    out, err = capsys.readouterr()
    assert out == "" and "error: stage extract failed: RuntimeError: extract failed on purpose" \
        in err, (out, err)
    fake_stages.setenv("FAIL_STAGE", "train")
    assert main(["apply", str(path)]) == 1
    out, err = capsys.readouterr()
    rows = [ln.split() for ln in out.splitlines()[2:]]
    assert out.startswith("run_id") and [r[2:4] for r in rows] == [["extract", "rows"]], out
    assert [ln.split(":")[1].strip() for ln in err.splitlines() if ln.startswith("error:")] == \
        ["stage train failed", "stage export skipped", "stage bench skipped"]
    fake_stages.delenv("FAIL_STAGE")
    assert main(["apply", str(path)]) == 0
    assert "train" in capsys.readouterr().out


def _write_spec(tmp_path: Path, spec) -> Path:
    import yaml
    p = tmp_path / "spec.yaml"
    p.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    return p


def test_a_cuda_target_on_a_machine_without_a_gpu_is_said_before_any_compute(tmp_path,
                                                                          monkeypatch):
    """target.device: cuda (a GPU spec copied to a laptop): the stages that load the target
    would fail after the earlier ones ran; plan refuses it locally (a warning on Slurm) when no
    GPU shows (runner/placement.py gpu_visible: the driver's entries, no torch)."""
    from eagle3_runner.runner import placement
    from eagle3_runner.runner.errors import PlanError
    from eagle3_runner.runner.plan_checks import input_problems
    monkeypatch.setattr(placement, "GPU_SIGNS", (str(tmp_path / "no-such-driver"),))
    spec = make_spec(tmp_path, ["target.device=cuda"])
    with pytest.raises(PlanError, match="target.device = 'cuda': this machine shows no GPU .* "
                                        "extract would fail"):
        build_plan(spec)
    errors, _ = input_problems(spec)
    assert [e.split(", so ")[1].split(" ")[0] for e in errors] == ["extract", "bench"]
    assert not input_problems(make_spec(tmp_path))[0]  # device auto: the CPU here
    (tmp_path / "gpus").mkdir()
    (tmp_path / "gpus" / "0000:01:00.0").mkdir()
    monkeypatch.setattr(placement, "GPU_SIGNS", (str(tmp_path / "gpus"),))
    assert not input_problems(spec)[0]


def test_aux_ids_of_sglangs_default_plus_one_are_a_warning(tmp_path):
    """[2, 15, 27] on a 30-layer target: valid ids, but SGLang's default [1, 14, 26] + 1, the
    HF hidden_states indices people write by mistake: validate and plan warn, naming the fix."""
    from eagle3_runner.runner.plan_checks import input_problems
    spec = make_spec(tmp_path, ["drafter.aux_layer_ids=[2, 15, 27]"])
    errors, warnings = input_problems(spec)
    assert not errors and len(warnings) == 1 and "write [1, 14, 26]" in warnings[0]
    assert warnings[0] in build_plan(spec).warnings
    for ok in ([1, 14, 26], [3, 16, 28], [2, 15, 26]):  # the default, a shift of 2, not all +1
        assert input_problems(make_spec(tmp_path, [f"drafter.aux_layer_ids={ok}"]))[1] == []


def test_num_prompts_above_a_prompt_sets_size_is_a_warning(tmp_path):
    """num_prompts 4000 with MT-bench (80 prompts) passed silently (first-hour trial of
    2026-12-04): validate and plan say the bench takes 80; a variant that changes it says so."""
    from eagle3_runner.runner.plan_checks import input_problems
    spec = make_spec(tmp_path, ["stages.bench.num_prompts=4000"])
    errors, warnings = input_problems(spec)
    assert not errors and len(warnings) == 1
    assert "num_prompts = 4000: mtbench has 80 prompts" in warnings[0]
    assert warnings[0] in build_plan(spec).warnings
    both = make_spec(tmp_path, ["stages.bench.num_prompts=100",
                                "stages.bench.prompt_sets=[mtbench, humaneval]"])
    assert [w.split(";")[0] for w in input_problems(both)[1]] == [
        "stages.bench.num_prompts = 100: mtbench has 80 prompts"]
    assert input_problems(make_spec(tmp_path, ["stages.bench.num_prompts=80"]))[1] == []
    var = make_spec(tmp_path, ["stages.bench.num_prompts=8"],
                    variants=[{"name": "all", "overrides": {"stages.bench.num_prompts": 500}}])
    assert [w.split(":")[0] for w in input_problems(var)[1]] == [
        "variants[all].stages.bench.num_prompts = 500"]


def test_outputs_under_proc_are_refused_by_validate_and_plan(tmp_path):
    """results.path or work_dir under /proc passed validate and plan as root (the permission
    bits say writable) and failed at apply (first-hour trial of 2026-12-04): both now try to
    make a file there and name the field."""
    from eagle3_runner.runner.plan_checks import input_problems
    for field in ("results.path=/proc/r.duckdb", "work_dir=/proc/eagle3-work"):
        spec = make_spec(tmp_path, [field])
        errors = input_problems(spec)[0]
        assert len(errors) == 1 and errors[0].startswith(field.split("=")[0] + " = "), errors
        assert "/proc is not writable" in errors[0]
        with pytest.raises(PlanError, match="not writable"):
            build_plan(spec)
    assert input_problems(make_spec(tmp_path))[0] == []


def test_auto_device_without_a_gpu_plans_the_cpu(tmp_path, monkeypatch):
    """target.device auto under the local executor on a machine without a GPU runs on the CPU
    in float32: the plan said "1 GPU" and "16-bit weights" there (first-hour trial of
    2026-12-04). With a GPU, or under Slurm (another machine), it plans the GPU."""
    from eagle3_runner.runner import placement
    monkeypatch.setattr(placement, "GPU_SIGNS", (str(tmp_path / "gpus"),))
    spec = make_spec(tmp_path)
    assert placement.on_cpu(spec) and placement._dtype_bits(spec) == 32
    m = placement.stage_memory(spec, "extract", None)
    assert "on the CPU (target.device auto, and this machine shows no GPU)" in m["layout"]
    (tmp_path / "gpus" / "0000:01:00.0").mkdir(parents=True)
    assert not placement.on_cpu(spec) and placement._dtype_bits(spec) == 16
    assert "x 1 GPU" in placement.stage_memory(spec, "extract", None)["layout"]


def test_an_interrupted_bench_resumes_what_it_kept_and_export_starts_over(tmp_path, fake_stages):
    """A bench cut short (Ctrl-C, a call's time limit) keeps each part it measured and resumes
    (jobs/bench.py: the SGLang servers' recordings and the embedded parts, on the same machine
    only); the plan says so, and the stage sees the reason (StageContext.resuming). Export never
    resumes: its plan says it starts over, as its own message does (first-hour trial of
    2026-12-04)."""
    fake_stages.setenv("FAIL_STAGE", "bench")
    spec = make_spec(tmp_path)
    plan = build_plan(spec)
    apply(spec, plan, quiet=True)
    bench = next(p for p in plan.stages if p.stage == "bench")
    assert Path(bench.partial).exists()
    r = reasons(build_plan(make_spec(tmp_path)))
    assert r["bench"] == ("run", "incomplete: resuming partial output")
    from eagle3_runner.runner.stage import StageContext
    ctx = StageContext(spec=spec, stage="bench", variant="base", run_id="r", inputs={},
                       out_dir=tmp_path, db_path=tmp_path / "r.duckdb", reason=r["bench"][1])
    assert ctx.resuming and not StageContext(**{**ctx.__dict__, "reason": "forced"}).resuming
    from eagle3_runner.runner.stages import REGISTRY
    assert [k.name for k in REGISTRY if k.resumes] == ["regenerate", "extract", "train", "bench"]
    assert "it runs again from the beginning" in _incomplete("export", Path(bench.partial))


def test_a_slurm_job_without_gpus_plans_the_cpu(tmp_path):
    """target.device auto in a Slurm job with executor.gpus_per_node 0 (the default) runs on the
    node's CPU in float32: the plan said "1 GPU" and "16-bit weights" (newcomer trial of
    2026-12-05). A stage given GPUs plans them."""
    from eagle3_runner.runner import placement
    spec = make_spec(tmp_path, ["executor.kind=slurm"])
    assert placement.on_cpu(spec, "extract") and placement._dtype_bits(spec) == 32
    assert "executor.gpus_per_node 0" in placement.stage_memory(spec, "extract", None)["layout"]
    gpu = make_spec(tmp_path, ["executor.kind=slurm", "executor.gpus_per_node=1"])
    assert not placement.on_cpu(gpu, "extract") and placement._dtype_bits(gpu) == 16


def test_an_empty_partial_dir_is_not_planned_as_resuming(tmp_path):
    """An extract that stopped before writing anything (a failed data check) left an empty
    partial dir, and the plan said "resuming partial output" (newcomer trial of 2026-12-05)."""
    spec = make_spec(tmp_path)
    extract = build_plan(spec).stages[0]
    Path(extract.partial).mkdir(parents=True)
    r = reasons(build_plan(make_spec(tmp_path)))
    assert r["extract"] == ("run", "incomplete: nothing kept, runs again from the beginning")
    (Path(extract.partial) / "shard-00000.safetensors").write_bytes(b"")
    assert reasons(build_plan(make_spec(tmp_path)))["extract"] == (
        "run", "incomplete: resuming partial output")
