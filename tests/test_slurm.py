"""The slurm executor against a REAL one-node Slurm (scripts/slurm-up.sh starts it; .ci/run does).

Tests marked `slurm` skip with a reason when no controller answers. The sbatch-script test
needs no cluster. Jobs here run on the CPU node; the real SmolLM2 end to end at tiny sizes.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eagle3_runner.runner.spec.load import load_spec

ROOT = Path(__file__).resolve().parent.parent
SHIM = ROOT / "scripts" / "sacct-shim"
TINY_EXECUTOR = {"kind": "slurm", "cpus_per_task": 1, "mem_gb": 1, "timeout_min": 10}


def _controller_answers() -> str:
    """'' when a Slurm controller answers with an idle/mixed/allocated node, else why not."""
    if shutil.which("sbatch") is None:
        return "sbatch not on PATH (start a cluster: sudo bash scripts/slurm-up.sh)"
    try:
        r = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=5)
    except subprocess.TimeoutExpired:
        return "sinfo timed out: no Slurm controller answers"
    states = r.stdout.split()
    if r.returncode or not any(s.rstrip("*~#") in ("idle", "mixed", "allocated") for s in states):
        return f"no usable Slurm node (sinfo: {r.stderr.strip() or states})"
    return ""


@pytest.fixture(scope="session")
def slurm():
    """A live cluster. Puts the sacct stand-in first on PATH when the cluster has no
    accounting (submitit reads job states through sacct)."""
    why = _controller_answers()
    if why:
        pytest.skip(why)
    old = os.environ["PATH"]
    r = subprocess.run(["sacct", "-n", "-X", "-j", "1"], capture_output=True, text=True,
                       timeout=10)
    if r.returncode != 0:
        os.environ["PATH"] = f"{SHIM}{os.pathsep}{old}"
    yield
    os.environ["PATH"] = old


def test_slurm_down_stops_the_daemons_and_removes_the_state_folder(tmp_path):
    """scripts/slurm-down.sh (no cluster needed): the daemons named by the pid files stop, and
    the state folder slurm-up.sh made (/tmp/eagle3-slurm.*) goes; a `current` naming any other
    folder keeps it (issue 48: the suite left the state folder behind)."""
    run = tmp_path / "run"
    run.mkdir()
    env = {**os.environ, "EAGLE3_SLURM_RUN": str(run)}
    state = tmp_path / "eagle3-slurm.abc123"
    (state / "ctld").mkdir(parents=True)
    (state / "slurmctld.log").write_text("log\n")
    daemon = subprocess.Popen(["sleep", "300"])
    try:
        (state / "slurmd.pid").write_text(f"{daemon.pid}\n")
        (run / "current").write_text(f"{state}\n")
        r = subprocess.run(["bash", str(ROOT / "scripts" / "slurm-down.sh")], env=env,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert daemon.wait(timeout=10) is not None
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()
    assert not state.exists() and not (run / "current").exists()
    assert f"removed {state}" in r.stderr
    other = tmp_path / "not-ours"
    other.mkdir()
    (run / "current").write_text(f"{other}\n")
    r = subprocess.run(["bash", str(ROOT / "scripts" / "slurm-down.sh")], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and other.is_dir() and not (run / "current").exists()


def _pickle_by_value():
    import cloudpickle
    cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _executor(folder, **params):
    import submitit
    ex = submitit.SlurmExecutor(folder=folder)
    ex.update_parameters(**{"time": 5, "cpus_per_task": 1, "mem": "1GB", **params})
    return ex


def _spec(tmp_path, executor=None, overrides=(), variants=None, **top):
    from eagle3_runner.runner.spec.load import read_yaml
    data = read_yaml(ROOT / "specs" / "smollm2-sharegpt.yaml")
    data.update(work_dir=str(tmp_path / "work"), results={"path": str(tmp_path / "r.duckdb")},
                executor=executor or TINY_EXECUTOR, **top)
    if variants:
        data["variants"] = variants
    return load_spec(data=data, overrides=list(overrides))


def _rows(db, sql):
    from eagle3_runner.runner.store import Store
    return Store(db).query(sql)[1]


# ----------------------------------------------------------------------------------------------
# (b) the generated sbatch script (no cluster needed)


def test_drafter_v2_sbatch_script_has_8_gpus_time_partition():
    from eagle3_runner.runner.slurm.sbatch import sbatch_script
    spec = load_spec(ROOT / "specs" / "drafter-v2.yaml")
    train = sbatch_script(spec, "train")
    assert "#SBATCH --gpus-per-node=8\n" in train
    assert "#SBATCH --time=1440\n" in train
    assert "#SBATCH --partition=gpu\n" in train
    assert "#SBATCH --nodes=1\n" in train and "#SBATCH --mem=900GB\n" in train
    assert "--signal=USR2@" in train  # submitit's timeout/preemption signal -> checkpoint
    export = sbatch_script(spec, "export")  # per-stage override: no GPUs, 30 min
    assert "gpus" not in export and "#SBATCH --time=30\n" in export
    assert "#SBATCH --time=120\n" in sbatch_script(spec, "bench")


def test_extra_sbatch_allowlisted_and_passed_verbatim(tmp_path):
    from eagle3_runner.runner.slurm.sbatch import sbatch_script
    from eagle3_runner.runner.errors import SpecError
    spec = _spec(tmp_path, executor={**TINY_EXECUTOR, "extra_sbatch": {"reservation": "r1",
                                                                       "exclusive": "user"}})
    text = sbatch_script(spec, "train")
    assert "#SBATCH --reservation=r1\n" in text and "#SBATCH --exclusive=user\n" in text
    with pytest.raises(SpecError, match="not allowed"):
        _spec(tmp_path, executor={**TINY_EXECUTOR, "extra_sbatch": {"wrap": "rm -rf /"}})


def test_checkpoint_requeues_train_only(tmp_path):
    from eagle3_runner.runner.job import StageJob
    from eagle3_runner.runner.slurm.task import StageTask
    mk = lambda s: StageJob("{}", "base", s, "k", {}, "a", "p", {}, "r", "db", "new")  # noqa: E731
    assert StageTask(mk("bench")).checkpoint() is None
    delayed = StageTask(mk("train")).checkpoint()
    assert delayed.function.job.stage == "train"
    os.environ.pop("EAGLE3_STAGE_REQUEUED", None)


# ----------------------------------------------------------------------------------------------
# (d) bad input


def test_sbatch_missing_names_slurm_and_suggests_local(tmp_path, monkeypatch, capsys):
    from eagle3_runner.runner.cli import main
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch here
    spec = tmp_path / "s.yaml"
    import yaml
    spec.write_text(yaml.safe_dump(_spec(tmp_path).model_dump(mode="json", exclude_none=True)))
    monkeypatch.chdir(tmp_path)
    rc = main(["apply", str(spec), "--only", "extract"])
    err = capsys.readouterr().err
    assert rc == 1
    assert "executor.kind = slurm" in err and "sbatch" in err and "kind: local" in err
    assert "Traceback" not in err


@pytest.mark.slurm
def test_gpu_request_on_gpuless_node_is_refused_before_submission(slurm, tmp_path):
    from eagle3_runner.runner.apply import apply
    from eagle3_runner.runner.plan import build_plan
    from eagle3_runner.runner.errors import SlurmError
    spec = _spec(tmp_path, executor={**TINY_EXECUTOR, "stages": {"extract": {"gpus_per_node": 1}}})
    with pytest.raises(SlurmError) as e:
        apply(spec, build_plan(spec, only=("extract",)), quiet=True)
    msg = str(e.value)
    assert "executor.stages.extract.gpus_per_node = 1" in msg and "no GPUs" in msg
    assert not (tmp_path / "work" / "slurm" / "jobs.jsonl").exists()  # nothing submitted


@pytest.mark.slurm
def test_gpu_rejection_by_slurm_is_surfaced_verbatim(slurm, tmp_path):
    """Without the sinfo pre-check, Slurm's own rejection comes back with the culprit option."""
    from eagle3_runner.runner.apply import jobs_for
    from eagle3_runner.runner.plan import build_plan
    from eagle3_runner.runner.errors import SlurmError
    from eagle3_runner.runner.slurm.executor import SlurmExecutor
    spec = _spec(tmp_path, executor={**TINY_EXECUTOR, "gpus_per_node": 2})
    jobs = jobs_for(spec, build_plan(spec, only=("extract",)), "run-x")
    with pytest.raises(SlurmError) as e:
        SlurmExecutor(spec, check=False).run_jobs(jobs)
    msg = str(e.value)
    assert "sbatch: error:" in msg  # verbatim
    assert "gpus_per_node" in msg and "--gpus-per-node=2" in msg


@pytest.mark.slurm
def test_unknown_partition_is_a_clear_error(slurm, tmp_path):
    from eagle3_runner.runner.apply import apply, jobs_for
    from eagle3_runner.runner.plan import build_plan
    from eagle3_runner.runner.errors import SlurmError
    from eagle3_runner.runner.slurm.executor import SlurmExecutor
    spec = _spec(tmp_path, executor={**TINY_EXECUTOR, "partition": "gpu-h100"})
    plan = build_plan(spec, only=("extract",))
    with pytest.raises(SlurmError, match=r"executor.partition = 'gpu-h100': no such partition "
                                         r"on this cluster \(sinfo lists: \w+"):
        apply(spec, plan, quiet=True)
    with pytest.raises(SlurmError, match=r"(?s)invalid partition.*executor.partition"):
        SlurmExecutor(spec, check=False).run_jobs(jobs_for(spec, plan, "run-y"))


# ----------------------------------------------------------------------------------------------
# (c) a raising job: its error and log path come back, into the stages table; arrays


@pytest.mark.slurm
def test_raising_jobs_bring_back_error_and_log_path(slurm, tmp_path):
    """Two variants whose extract fails (missing target file) go out as one job array; each
    brings back the remote error and its own log; their dependents are skipped, not left pending."""
    from eagle3_runner.runner.apply import apply
    from eagle3_runner.runner.plan import build_plan
    missing = tmp_path / "no-such-model.gguf"
    spec = _spec(tmp_path, overrides=[f"target.path={missing}", "target.num_hidden_layers=30",
                                      "target.hidden_size=576", "target.vocab_size=49152"],
                 variants=[{"name": "s1", "overrides": {"data.seed": 1}}])
    plan = build_plan(spec)
    run_id, outcomes = apply(spec, plan, quiet=True)
    by = {o.job.id: o for o in outcomes}
    assert by["extract"].status == by["extract@s1"].status == "failed"
    ids = {by["extract"].job_id, by["extract@s1"].job_id}
    assert {i.split("_")[0] for i in ids} == {by["extract"].job_id.split("_")[0]}  # one array
    for o in (by["extract"], by["extract@s1"]):
        assert "no-such-model" in o.error or "Error" in o.error
        log = Path(o.job.log_path)
        assert log.exists() and str(log).endswith("_log.err")
        assert "Traceback" in log.read_text()
    assert all(o.status == "skipped" for o in outcomes if o.job.stage != "extract")
    rows = _rows(spec.results.path, "SELECT variant, status, error, log_path, job_id FROM stages "
                 f"WHERE run_id = '{run_id}' AND stage = 'extract' ORDER BY variant")
    assert [r[1] for r in rows] == ["failed", "failed"]
    for _, _, error, log_path, job_id in rows:
        assert error and Path(log_path).exists() and job_id
    from eagle3_runner.runner.slurm.probes import live_states
    assert set(live_states(list(ids))) == ids  # `runner status` can show their Slurm states
    assert _rows(spec.results.path, f"SELECT status FROM runs WHERE run_id = '{run_id}'") == \
        [("failed",)]


# ----------------------------------------------------------------------------------------------
# (e) many jobs finishing at once lose no DuckDB rows


def emit_rows(db: str, task: int, batches: int, per: int) -> int:
    from eagle3_runner.runner.store import Store
    store = Store(db)
    for b in range(batches):
        store.emit("metrics", [dict(run_id="many", variant=f"t{task}", stage="bench",
                                    name=f"b{b}", value=float(i), unit="", step=i, ts=None)
                               for i in range(per)])
    return batches * per


@pytest.mark.slurm
def test_many_concurrent_jobs_lose_no_rows(slurm, tmp_path):
    from eagle3_runner.runner.store import Store
    _pickle_by_value()
    db = str(tmp_path / "many.duckdb")
    n, batches, per = 12, 25, 8
    ex = _executor(tmp_path / "sub", array_parallelism=n)
    jobs = ex.map_array(emit_rows, [db] * n, range(n), [batches] * n, [per] * n)
    store = Store(db)
    while not all(j.done() for j in jobs):  # ingest WHILE the jobs write
        store.ingest()
        time.sleep(0.2)
    assert sum(j.result() for j in jobs) == n * batches * per
    store.ingest()
    (total, distinct), = store.query("SELECT count(*), count(DISTINCT (variant, name, step)) "
                                     "FROM metrics WHERE run_id = 'many'")[1]
    assert total == distinct == n * batches * per
    assert not list(Path(db + ".spool").glob("*.json"))


# ----------------------------------------------------------------------------------------------
# (f) timeout -> requeue -> resume


class Counter:
    """Counts to n, one step per 0.3 s, keeping its progress in a file; checkpointable."""

    def __call__(self, state: str, n: int) -> int:
        from eagle3_runner.runner.slurm.task import harden_requeue
        harden_requeue()  # as StageTask does
        p = Path(state)
        start = int(p.read_text()) if p.exists() else 0
        with open(p.with_suffix(".starts"), "a") as f:
            f.write(f"{start}\n")
        for i in range(start, n):
            time.sleep(0.3)
            tmp = p.with_suffix(".tmp")
            tmp.write_text(str(i + 1))
            os.replace(tmp, p)
        return n

    def checkpoint(self, *args, **kwargs):
        from submitit.core.utils import DelayedSubmission
        return DelayedSubmission(self, *args, **kwargs)


def _expedite_requeued(job_id: str, timeout: float = 60) -> None:
    """Slurm holds a requeued batch job for ~2 min (Reason=BeginTime); start it in 5 s instead
    (at once, slurmd still holds the old run's revoked credential and kills the new launch)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        r = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T|%r"], capture_output=True,
                           text=True, timeout=10)
        if r.stdout.strip() == "PENDING|BeginTime":
            subprocess.run(["scontrol", "update", f"jobid={job_id}", "StartTime=now+5"],
                           check=True, timeout=10)
            return
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} was not requeued: {r.stdout.strip()}")


@pytest.mark.slurm
def test_timeout_requeues_and_resumes(slurm, tmp_path):
    """Slurm's timeout signal (USR2, what --signal=USR2@90 sends before the limit) makes
    submitit checkpoint, `scontrol requeue` the job, and the requeued job resumes."""
    _pickle_by_value()
    state, n = tmp_path / "count", 30
    # time=5: Slurm itself signals 90 s before the limit; a 1-min job would get it at a random
    # moment of its first minute. Here the test sends that same signal at a known point.
    job = _executor(tmp_path / "sub", time=5).submit(Counter(), str(state), n)
    try:
        deadline = time.time() + 120
        while not (state.exists() and int(state.read_text()) >= 3):
            assert time.time() < deadline, "job never started"
            time.sleep(0.2)
        job._interrupt(timeout=True)  # scancel --signal USR2: as at the time limit
        _expedite_requeued(job.job_id)
        assert job.result() == n
    finally:
        job.cancel(check=False)
    starts = [int(x) for x in state.with_suffix(".starts").read_text().split()]
    assert len(starts) == 2 and starts[0] == 0 and 3 <= starts[1] < n  # resumed, not restarted
    assert int(state.read_text()) == n
    log = job.stderr() or ""
    assert "this job is timed-out" in log and "DUE TO JOB REQUEUE" in log


# ----------------------------------------------------------------------------------------------
# status / cancel


@pytest.mark.slurm
def test_live_states_and_cancel(slurm, tmp_path, capsys):
    """A job waiting (afterok) on a running one is PENDING; `runner cancel` scancels it."""
    from eagle3_runner.runner.job import StageJob
    from eagle3_runner.runner.slurm.cancel import cancel_cli
    from eagle3_runner.runner.slurm.executor import SlurmExecutor, _Sub
    from eagle3_runner.runner.slurm.probes import live_states
    spec = _spec(tmp_path)
    blocker = _executor(tmp_path / "blk").submit(time.sleep, 60)
    ex = SlurmExecutor(spec)
    ex.folder = tmp_path / "sub"
    up = StageJob(spec.model_dump_json(), "base", "extract", "k0", {}, str(tmp_path / "a0"),
                  str(tmp_path / "p0"), {}, "run-c", str(tmp_path / "r.duckdb"), "new")
    down = StageJob(**{**up.__dict__, "stage": "train", "key": "k1", "after": [0]})
    subs = {0: _Sub(0, blocker, str(blocker.job_id), time.time())}
    ex.submit_group([1], [up, down], subs)
    jid = subs[1].job_id
    try:
        assert live_states([jid, "424242"]) == {jid: "PENDING"}
        assert cancel_cli(spec) == 0
        assert f"cancelled train (Slurm job {jid}" in capsys.readouterr().out
        deadline = time.time() + 30
        while live_states([jid]).get(jid) != "CANCELLED":
            assert time.time() < deadline, live_states([jid])
            time.sleep(0.5)
    finally:
        blocker.cancel()


# ----------------------------------------------------------------------------------------------
# (a) the demo spec, tiny, end to end through Slurm


STAGES = ("extract", "train", "export", "bench")


@pytest.mark.slurm
@pytest.mark.slow
def test_apply_tiny_spec_end_to_end_on_slurm(slurm, tmp_path):
    """`runner apply` with the slurm executor: real SmolLM2 + ShareGPT at tiny sizes; a variant
    makes train/export/bench job arrays (aftercorr), sharing one extract job."""
    import json
    import yaml
    from eagle3_runner.runner.assets import ASSETS
    from eagle3_runner.runner.slurm.probes import live_states
    missing = [s for s in STAGES if not (ROOT / "jobs" / f"{s}.py").exists()]
    if missing:
        pytest.skip(f"stage modules not written yet: {missing}")
    if not ASSETS["smollm2"].path().exists():
        pytest.skip("run `runner fetch all` first")
    spec = {
        "name": "slurm-tiny", "work_dir": str(tmp_path / "work"),
        "target": {"path": str(ASSETS["smollm2"].path()), "chat_template": "chatml"},
        "drafter": {"algorithm": "EAGLE3", "aux_layer_ids": [1, 14, 26], "draft_vocab_size": 1024},
        "data": {"max_samples": 6, "max_length": 96, "holdout": 2},
        "stages": {"extract": {"batch_tokens": 512, "shard_samples": 4},
                   "train": {"ttt_steps": 3, "epochs": 1, "batch_size": 2, "eval_every": 2,
                             "eval_samples": 1, "checkpoint_every": 2, "warmup_steps": 1},
                   "export": {},
                   "bench": {"prompt_sets": ["mtbench"], "num_prompts": 2,
                             "max_new_tokens": [12], "configs": [{"num_steps": 2}]}},
        "executor": {"kind": "slurm", "cpus_per_task": 1, "mem_gb": 3, "timeout_min": 20,
                     "stages": {"extract": {"cpus_per_task": 2}}},
        "variants": [{"name": "lr2", "overrides": {"stages.train.lr": 3e-4}}],
        "results": {"path": str(tmp_path / "r.duckdb")},
    }
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(spec))
    r = subprocess.run([sys.executable, "-m", "eagle3_runner.runner", "apply", str(path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "Slurm job" in r.stderr
    db = str(tmp_path / "r.duckdb")
    rows = _rows(db, "SELECT variant, stage, status, job_id, executor, host FROM stages "
                 "WHERE status = 'done'")
    done = {(v, s) for v, s, *_ in rows}
    assert done == {("base", s) for s in STAGES} | {("lr2", s) for s in STAGES[1:]}
    assert all(e == "slurm" and j and j != str(os.getpid()) for *_, j, e, _h in rows)
    jobs = [json.loads(x) for x in (tmp_path / "work" / "slurm" / "jobs.jsonl").read_text()
            .splitlines()]
    by = {j["id"]: j["job_id"] for j in jobs}
    assert "_" not in by["extract"] and by["train"].split("_")[0] == by["train@lr2"].split("_")[0]
    states = live_states(list(by.values()))  # a job may still be exiting after its result
    assert set(states) == set(by.values()) and \
        set(states.values()) <= {"COMPLETED", "COMPLETING", "RUNNING"}
    summ = _rows(db, "SELECT variant, tau, lossless FROM bench_summary ORDER BY variant")
    assert [s[0] for s in summ] == ["base", "lr2"]
    assert all(t >= 1.0 and lossless for _, t, lossless in summ)
    # status shows the Slurm states next to the stored ones
    st = subprocess.run([sys.executable, "-m", "eagle3_runner.runner", "status", str(path),
                         "--json"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert st.returncode == 0, st.stderr
    assert "(COMPLETED)" in st.stdout
