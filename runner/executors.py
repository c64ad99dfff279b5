"""Choosing the executor: `local` (runner/local.py) runs the stage jobs on this machine in plan
order; `slurm` (runner/slurm/) submits one Slurm job per stage with afterok dependencies. Both
run the same picklable StageJob through the executor core (runner/job.py `run_stage`), so a
stage behaves the same under either."""

from __future__ import annotations

from eagle3_runner.runner.local import LocalExecutor
from eagle3_runner.runner.slurm.executor import SlurmExecutor
from eagle3_runner.runner.spec.schema import Spec


def get_executor(spec: Spec):
    """The executor named by spec.executor.kind."""
    if spec.executor.kind == "local":
        return LocalExecutor(spec)
    return SlurmExecutor(spec)
