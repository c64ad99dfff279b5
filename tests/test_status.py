"""Issue 21 item 6: `runner status` tells the truth: it reads the spool (the first apply), shows
the stage in progress, marks runs whose process is gone as dead, and a process that lost a race
for a stage's lock does not hide the run computing it. Through the CLI, as a user runs it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_plan import fake_stages, make_spec  # noqa: F401 - fixture

from eagle3_runner.runner.apply import apply
from eagle3_runner.runner.cli import main
from eagle3_runner.runner.plan import build_plan
from eagle3_runner.runner.store import Store, host


def _gone_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _status(db: Path, capsys, *extra) -> dict:
    capsys.readouterr()
    assert main(["status", "--results", str(db), "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def _run(store, run_id, started, status="running", pid=None, finished=None):
    row = dict(run_id=run_id, spec_name="s", status=status, started_at=started, host=host(),
               executor="local", finished_at=finished)
    if pid is not None:
        row["pid"] = pid
    store.emit("runs", row)


def _stage(store, run_id, stage, status, started, pid, error=None):
    store.emit("stages", dict(run_id=run_id, variant="base", stage=stage, status=status,
                              started_at=started, job_id=str(pid), host=host(),
                              executor="local", error=error, reason="missing output"))


def test_status_during_the_first_apply_reads_the_spool_and_shows_the_running_stage(
        tmp_path, fake_stages, capsys):
    spec = make_spec(tmp_path)
    seen = {}

    def train(ctx):  # look at `runner status` while train runs
        seen.update(_status(Path(spec.results.path), capsys))
        return {}

    fake_stages.setattr(sys.modules["eagle3_runner.jobs.train"], "run", train)
    assert not Path(spec.results.path).exists()
    apply(spec, build_plan(spec), quiet=True)
    assert seen["status"] == "running"
    by = {s["stage"]: s["status"] for s in seen["stages"]}
    assert by == {"extract": "done", "train": "running"}
    done = _status(Path(spec.results.path), capsys)  # afterwards: one row per stage, done
    assert done["status"] == "done"
    assert [s["status"] for s in done["stages"]] == ["done"] * 4


def test_a_killed_run_is_dead_not_running_forever(tmp_path, capsys):
    db = tmp_path / "r.duckdb"
    store = Store(db)
    dead = _gone_pid()
    _run(store, "r1", "2026-01-01 00:00:00", pid=dead)
    _stage(store, "r1", "extract", "done", "2026-01-01 00:00:01", dead)
    _stage(store, "r1", "train", "running", "2026-01-01 00:00:02", dead)
    got = _status(db, capsys)
    assert got["status"].startswith("dead")
    assert {s["stage"]: s["status"] for s in got["stages"]} == {
        "extract": "done", "train": f"dead (pid {dead} is gone)"}
    # the text form says it too
    assert main(["status", "--results", str(db)]) == 0
    out = capsys.readouterr().out
    assert "run r1: dead" in out and f"dead (pid {dead} is gone)" in out
    assert "ran because" in out.splitlines()[1]  # why a stage ran, not a failure reason
    # a live pid on this host is running; another host's pid is not guessed at
    _stage(store, "r1", "export", "running", "2026-01-01 00:00:03", os.getpid())
    by = {s["stage"]: s["status"] for s in _status(db, capsys)["stages"]}
    assert by["export"] == "running"


def test_the_loser_of_a_race_is_not_shown_as_the_latest_run(tmp_path, capsys):
    db = tmp_path / "r.duckdb"
    store = Store(db)
    _run(store, "winner", "2026-01-01 00:00:00", pid=os.getpid())
    _stage(store, "winner", "extract", "running", "2026-01-01 00:00:01", os.getpid())
    _run(store, "loser", "2026-01-01 00:00:05", status="failed", pid=_gone_pid(),
         finished="2026-01-01 00:00:06")
    _stage(store, "loser", "extract", "failed", "2026-01-01 00:00:05", 1,
           error="extract: another runner process is computing this stage right now")
    got = _status(db, capsys)
    assert got["run_id"] == "winner" and got["status"] == "running"
    # once the winner is done, the run that finished last is the latest
    _stage(store, "winner", "extract", "done", "2026-01-01 00:00:01", os.getpid())
    _run(store, "winner", "2026-01-01 00:00:00", status="done", pid=os.getpid(),
         finished="2026-01-01 00:10:00")
    got = _status(db, capsys)
    assert got["run_id"] == "winner" and got["status"] == "done"


def test_an_old_results_file_gets_the_new_columns(tmp_path, capsys):
    import duckdb
    db = tmp_path / "old.duckdb"
    con = duckdb.connect(str(db))
    con.execute("CREATE TABLE runs (run_id VARCHAR, spec_name VARCHAR, spec_hash VARCHAR, "
                "code_version VARCHAR, host VARCHAR, executor VARCHAR, started_at TIMESTAMP, "
                "finished_at TIMESTAMP, status VARCHAR, spec_json VARCHAR)")
    con.close()
    _run(Store(db), "r1", "2026-01-01 00:00:00", status="done", pid=1,
         finished="2026-01-01 00:01:00")
    assert _status(db, capsys)["run_id"] == "r1"


def test_no_results_yet_is_a_clean_error(tmp_path, capsys):
    args = ["status", "--results", str(tmp_path / "none.duckdb")]
    assert main(args) == 1
    assert capsys.readouterr().err.startswith("error: no results at")


@pytest.mark.parametrize("verb", [["status"], ["results"], ["query", "SELECT 1"]])
def test_no_results_at_a_relative_path_names_the_folder_looked_in(tmp_path, capsys,
                                                                  monkeypatch, verb):
    """The default --results is relative to the current folder: the error says which."""
    monkeypatch.chdir(tmp_path)
    assert main(verb + ["--results", "runs/results.duckdb"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: no results at runs/results.duckdb (in {tmp_path}); ")
    assert "--results with the spec's results.path" in err


def test_a_slurm_stage_whose_job_ended_is_dead(tmp_path, capsys, monkeypatch):
    import eagle3_runner.runner.slurm.probes as probes
    db = tmp_path / "r.duckdb"
    store = Store(db)
    _run(store, "r1", "2026-01-01 00:00:00", pid=_gone_pid())
    for stage, job in (("extract", "17"), ("train", "18")):
        store.emit("stages", dict(run_id="r1", variant="base", stage=stage, status="running",
                                  started_at="2026-01-01 00:00:01", job_id=job, host="node9",
                                  executor="slurm"))
    monkeypatch.setattr(probes, "live_states",
                        lambda ids: {"17": "CANCELLED by 0", "18": "RUNNING"})
    got = _status(db, capsys)
    assert {s["stage"]: s["status"] for s in got["stages"]} == {
        "extract": "dead (Slurm CANCELLED by 0)", "train": "running"}
    assert got["status"] == "running (runner apply is gone; its Slurm jobs go on)"


def test_ctrl_c_in_a_stage_is_cancelled_not_failed(tmp_path, fake_stages, capsys):
    """Ctrl-C (SIGINT = KeyboardInterrupt) during train: the stage row and the run say
    `cancelled` with what the next apply does, never `failed ... KeyboardInterrupt:`."""
    spec = make_spec(tmp_path)

    def train(ctx):
        raise KeyboardInterrupt

    fake_stages.setattr(sys.modules["eagle3_runner.jobs.train"], "run", train)
    import pytest
    with pytest.raises(KeyboardInterrupt):
        apply(spec, build_plan(spec), quiet=True)
    st = _status(Path(spec.results.path), capsys)
    assert st["status"] == "cancelled"
    by = {s["stage"]: s for s in st["stages"]}
    assert by["extract"]["status"] == "done" and by["train"]["status"] == "cancelled"
    assert "KeyboardInterrupt" not in str(by["train"]["error"])
    assert "interrupted (Ctrl-C)" in by["train"]["error"] and "checkpoint" in by["train"]["error"]


def test_a_stage_skipped_after_a_failure_names_the_upstream_and_no_log(tmp_path, fake_stages):
    """The error lines of `runner apply`: a failed stage points to its log; the stages skipped
    after it name the stage that failed and point to no log file (they never ran)."""
    from eagle3_runner.runner.cli import outcome_line
    from eagle3_runner.runner.errors import StageError
    spec = make_spec(tmp_path)

    def train(ctx):
        raise StageError("train: broken on purpose")

    fake_stages.setattr(sys.modules["eagle3_runner.jobs.train"], "run", train)
    _, outcomes = apply(spec, build_plan(spec), quiet=True)
    lines = {o.job.stage: outcome_line(o) for o in outcomes if o.status != "done"}
    assert lines["train"].startswith("error: stage train failed: train: broken on purpose")
    assert "(log: " in lines["train"] and Path(lines["train"].split("(log: ")[1][:-1]).is_file()
    for s in ("export", "bench"):
        assert lines[s] == f"error: stage {s} skipped: upstream stage " \
            f"{'train' if s == 'export' else 'export'} failed"
