"""`runner cancel SPEC`, and the log it reads: every submitted job id is appended to
<log_dir>/jobs.jsonl (default work_dir/slurm/) for `runner cancel` and `runner status`."""

from __future__ import annotations

import json
import sys

from eagle3_runner.runner.job import StageJob
from eagle3_runner.runner.slurm.probes import TERMINAL, live_states, require_sbatch, scancel
from eagle3_runner.runner.slurm.sbatch import log_dir
from eagle3_runner.runner.spec.schema import Spec
from eagle3_runner.runner.store import now


def record_submitted(spec: Spec, entries: list[tuple[StageJob, str]]) -> None:
    """Append one line per (job, Slurm job id) to <log_dir>/jobs.jsonl."""
    path = log_dir(spec) / "jobs.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        for j, jid in entries:
            f.write(json.dumps({"run_id": j.run_id, "id": j.id, "job_id": jid,
                                "submitted_at": now(), "log": j.log_path}) + "\n")


def recorded_jobs(spec: Spec) -> list[dict]:
    """Entries of <log_dir>/jobs.jsonl (one per submitted job), oldest first."""
    path = log_dir(spec) / "jobs.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def cancel_cli(spec: Spec) -> int:
    """`runner cancel SPEC`: scancel the spec's jobs that are still pending or running.
    Returns the exit code (0; 1 when the spec does not use the slurm executor)."""
    if spec.executor.kind != "slurm":
        print(f"error: executor.kind = {spec.executor.kind}: nothing to cancel (only the slurm "
              "executor submits jobs; stop a local run with Ctrl-C)", file=sys.stderr)
        return 1
    require_sbatch()
    entries = recorded_jobs(spec)
    states = live_states([e["job_id"] for e in entries])
    live = [e for e in entries if states.get(e["job_id"], "").split()[:1]
            and states[e["job_id"]].split()[0] not in TERMINAL]
    if not live:
        print(f"{spec.name}: no pending or running Slurm jobs")
        return 0
    scancel([e["job_id"] for e in live])
    for e in live:
        print(f"cancelled {e['id']} (Slurm job {e['job_id']}, run {e['run_id']}, was "
              f"{states[e['job_id']]})")
    return 0
