"""The `local` executor: stage jobs one after another on this machine, in plan order.

A data-parallel stage (a registry row with data_parallel, e.g. extract and train) with
executor.nproc_per_node > 1 runs in a child process, `python -m eagle3_runner.runner.launch`, that spawns the
ranks (runner/launch.py), so this process never initialises CUDA or a process group.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from eagle3_runner.runner.errors import StageError
from eagle3_runner.runner.job import (StageJob, StageOutcome, error_text, interrupted_text,
                                      run_stage, stage_nproc)
from eagle3_runner.runner.spec.schema import Spec


def launch_local(job: StageJob, nproc: int) -> dict:
    """Run `job` with nproc ranks through `python -m eagle3_runner.runner.launch` (a child process, so this
    one never initialises CUDA or a process group). Returns rank 0's metrics; raises StageError
    (the stage's own message) or RuntimeError with the failing rank's error."""
    with tempfile.TemporaryDirectory(prefix="eagle3-job-") as d:
        jf, rf = Path(d) / "job.json", Path(d) / "result.json"
        jf.write_text(json.dumps(job.__dict__, default=str))
        r = subprocess.run([sys.executable, "-m", "eagle3_runner.runner.launch", "--nproc", str(nproc),
                            "--result", str(rf), str(jf)])
        res = json.loads(rf.read_text()) if rf.exists() else {}
    if r.returncode == 0 and res.get("status") == "done":
        return res["metrics"]
    msg = res.get("error") or f"eagle3_runner.runner.launch exited with status {r.returncode}"
    if res.get("rank", 0) > 0:
        msg = f"rank {res['rank']}: {msg}"
    raise (StageError if res.get("stage_error") else RuntimeError)(msg)


class LocalExecutor:
    """Runs jobs one after another in this process (data-parallel stages with nproc_per_node > 1
    in a launcher child process, runner/launch.py); stops dependents of a failed job."""

    name = "local"

    def __init__(self, spec: Spec):
        self.spec = spec

    def run_jobs(self, jobs: list[StageJob], on_event=None) -> list[StageOutcome]:
        outcomes: list[StageOutcome] = []
        failed: set[int] = set()
        for i, job in enumerate(jobs):
            up = next((a for a in job.after if a in failed), None)
            if up is not None:
                failed.add(i)
                outcomes.append(StageOutcome(job, "skipped",
                                             error=f"upstream stage {jobs[up].id} failed"))
                continue
            if on_event:
                on_event("start", job)
            t0 = time.time()
            try:
                n = stage_nproc(Spec.model_validate_json(job.spec_json), job.stage)
                metrics = run_stage(job) if n == 1 else launch_local(job, n)
                outcomes.append(StageOutcome(job, "done", metrics, duration_s=time.time() - t0,
                                             job_id=str(os.getpid())))
            except KeyboardInterrupt:  # run_stage recorded the stage as cancelled
                outcomes.append(StageOutcome(job, "cancelled", error=interrupted_text(job)))
                raise
            except Exception as e:  # noqa: BLE001 - reported, not swallowed
                failed.add(i)
                outcomes.append(StageOutcome(job, "failed", error=error_text(e),
                                             duration_s=time.time() - t0))
            if on_event:
                on_event("end", outcomes[-1])
        return outcomes
