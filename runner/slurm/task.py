"""The callable every Slurm job runs: one StageJob, checkpointable through submitit (a
checkpointable stage is requeued on timeout or preemption and resumes from its partial dir)."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass, replace

from eagle3_runner.runner.job import StageJob, run_stage
from eagle3_runner.runner.stages import stage_kind


def _requeue_immune(env, countdown: int) -> None:
    """submitit's SlurmJobEnvironment._requeue, but `scontrol requeue` ignores SIGTERM.

    Requeueing makes slurmd SIGTERM every process of the job, scontrol included; when that
    lands before scontrol exits (a fast local slurmd), submitit sees CalledProcessError, writes an
    error result and the coordinator reports a failure although the job was requeued. SIG_IGN is
    inherited across exec, so scontrol finishes; the job is then stopped as Slurm intends."""
    import signal
    subprocess.check_call(["scontrol", "requeue", env.job_id], timeout=60,
                          preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_IGN))


def harden_requeue() -> None:
    """Install `_requeue_immune` in this (job) process. Call at the start of a checkpointable
    submitit callable."""
    from submitit.slurm.slurm import SlurmJobEnvironment
    SlurmJobEnvironment._requeue = _requeue_immune


@dataclass
class StageTask:
    """Picklable, checkpointable callable that runs one StageJob inside a Slurm job.

    submitit calls `checkpoint()` when Slurm signals a timeout or preemption: for checkpointable
    stages (runner/stages.py) it returns the same task, so the job is requeued and the stage resumes from its
    partial dir (train reloads its latest checkpoint there)."""

    job: StageJob

    def __call__(self) -> dict:
        import submitit
        harden_requeue()
        env = submitit.JobEnvironment()
        job = replace(self.job, log_path=str(env.paths.stderr))  # the job's own stderr log
        if env.num_tasks > 1:  # one srun task per rank (data-parallel stage)
            from eagle3_runner.runner.launch import run_rank, slurm_env
            slurm_env()
            return run_rank(job, env.global_rank, env.num_tasks, env.local_rank)
        return run_stage(job)

    def checkpoint(self, *args, **kwargs):
        if not stage_kind(self.job.stage).checkpointable:
            return None  # submitit: not requeued
        from submitit.core.utils import DelayedSubmission
        os.environ["EAGLE3_STAGE_REQUEUED"] = "1"  # run_stage records "requeued", not "failed"
        return DelayedSubmission(self)
