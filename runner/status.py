"""`runner status`: the stages of the latest run, as they are now.

Reads the spool as well as the database (the first apply has only a spool until it ends: the
query ingests it). Each stage shows its latest row: a terminal row (done, failed, ...) wins over
the `running` row written when the stage started (runner/job.py). A `running` stage whose
process is gone is shown as dead: a local stage records its pid and host (checked when the host
is this one), a Slurm stage its job id (checked with squeue/sacct). The run itself records the
pid of its `runner apply`. "The latest run" is the latest one still running, else the one that
finished last, so a process that lost a race for a stage's lock (and failed at once) does not
hide the run that is computing it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from eagle3_runner.runner.results import _table
from eagle3_runner.runner.store import Store, host, no_results

SLURM_LIVE = {"RUNNING", "PENDING", "REQUEUED", "CONFIGURING", "COMPLETING", "SUSPENDED",
              "RESIZING", "REQUEUE_HOLD", "REQUEUE_FED", "STAGE_OUT", "SIGNALING"}
STAGE_COLS = ["variant", "stage", "status", "reason", "job_id", "host", "seconds", "error",
              "executor"]


def pid_alive(pid) -> bool:
    """Whether process `pid` exists on this machine and is not a zombie."""
    try:
        pid = int(pid)
        os.kill(pid, 0)
    except PermissionError:
        return True
    except (ValueError, TypeError, OverflowError, ProcessLookupError, OSError):
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _slurm_states(ids: list[str]) -> dict[str, str]:
    try:
        from eagle3_runner.runner.slurm.probes import live_states
        return live_states(ids) if ids else {}
    except Exception:  # noqa: BLE001 - no Slurm here: states from the store only
        return {}


def _latest_rows(rows: list[dict]) -> list[dict]:
    """One row per (variant, stage): the last terminal row, else the running row; in the order
    the stages started."""
    out: dict[tuple, dict] = {}
    for r in rows:  # ordered by started_at
        k = (r["variant"], r["stage"])
        old = out.get(k)
        if old is None or old["status"] == "running" or r["status"] != "running":
            out[k] = {**r, "first": old["first"] if old else r["started_at"]}
    return sorted(out.values(), key=lambda r: str(r["first"]))


def _liveness(r: dict, states: dict[str, str]) -> str:
    """A running row's status now: running, running (on HOST, not checked) or dead (why)."""
    if r["executor"] == "slurm" and r["job_id"]:
        st = states.get(r["job_id"])
        if st is None:
            return "running (Slurm state unknown)"
        return "running" if st.split()[0] in SLURM_LIVE else f"dead (Slurm {st})"
    if r["host"] and r["host"] != host():
        return f"running (on {r['host']}, not checked)"
    return "running" if pid_alive(r["job_id"]) else f"dead (pid {r['job_id']} is gone)"


def _run_view(run: dict, rows: list[dict], states: dict[str, str]) -> tuple[str, list[dict]]:
    """(the run's status now, its stage rows with statuses now)."""
    rows = _latest_rows(rows)
    for r in rows:
        if r["status"] == "running":
            r["status"] = _liveness(r, states)
        elif r["executor"] == "slurm" and r["job_id"] in states:
            r["status"] = f"{r['status']} ({states[r['job_id']]})"
    status = run["status"]
    if status == "running":
        live = any(r["status"].startswith("running") for r in rows)
        gone = run.get("pid") is not None and (run.get("host") or host()) == host() \
            and not pid_alive(run["pid"])
        if gone and not live:
            status = f"dead (runner apply pid {run['pid']} is gone)"
        elif gone:
            status = "running (runner apply is gone; its Slurm jobs go on)"
        elif not live and any(r["status"].startswith("dead") for r in rows):
            status = "dead (its running stage is gone)"
    return status, rows


def status(db: Path, as_json: bool = False, spec_name: str | None = None) -> int:
    """Print the stages of the latest run (of `spec_name` when given) as they are now."""
    store = Store(db)
    if not Path(db).exists() and not store.spool.exists():
        raise no_results(db)
    where = f"WHERE spec_name = '{spec_name}'" if spec_name else ""
    cols, runs = store.query("SELECT * FROM runs " + where + " ORDER BY started_at DESC LIMIT 20")
    if not runs:
        print("no runs yet")
        return 0
    runs = [dict(zip(cols, r)) for r in runs]
    ids = ", ".join(f"'{r['run_id']}'" for r in runs)
    cols, rows = store.query(
        "SELECT run_id, variant, stage, status, reason, job_id, host, round(duration_s, 1) AS "
        f"seconds, error, executor, started_at FROM stages WHERE run_id IN ({ids}) "
        "ORDER BY started_at, finished_at NULLS FIRST")
    rows = [dict(zip(cols, r)) for r in rows]
    states = _slurm_states(sorted({r["job_id"] for r in rows
                                   if r["job_id"] and r["executor"] == "slurm"}))
    views = []
    for run in runs:
        st, stage_rows = _run_view(run, [r for r in rows if r["run_id"] == run["run_id"]], states)
        views.append((run, st, stage_rows))
    live = [v for v in views if v[1].startswith("running")]
    run, st, stage_rows = live[0] if live else max(
        views, key=lambda v: str(v[0].get("finished_at") or v[0]["started_at"]))
    table = [[r[c] for c in STAGE_COLS] for r in stage_rows]
    if as_json:
        print(json.dumps({"run_id": run["run_id"], "status": st,
                          "stages": [dict(zip(STAGE_COLS, r)) for r in table]},
                         default=str, indent=1))
    else:
        print(f"run {run['run_id']}: {st}")
        # "reason" is why a stage ran (plan's word for it), not an error: say so in the header
        print(_table(["ran because" if c == "reason" else c for c in STAGE_COLS], table))
    return 0
