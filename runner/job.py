"""The executor core: one stage job, its outcome, and `run_stage`, which every executor calls.

`StageJob` is plain data (submitit pickles it; runner/launch.py reads it as JSON). `run_stage`
takes the stage's lock, builds its StageContext, calls the stage's code through the registry
(runner/stages.py `stage_module`), finalizes the artifact (runner/stage.py) and records the
`stages` row. Executors stack on this module and never on each other: runner/local.py (this
machine), runner/launch.py (the ranks of a data-parallel stage), runner/slurm/ (one Slurm job per
stage); runner/executors.py chooses between them.
"""

from __future__ import annotations

import fcntl
import os
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from eagle3_runner.runner.cpu import stage_threads
from eagle3_runner.runner.errors import StageError
from eagle3_runner.runner.spec.schema import Spec
from eagle3_runner.runner.stage import StageContext, finalize, read_manifest
from eagle3_runner.runner.stages import stage_kind, stage_module, stage_nproc  # noqa: F401 (re-export)
from eagle3_runner.runner.store import Store, now, stage_row
from eagle3_runner.runner.verify import verify_artifact


@dataclass
class StageJob:
    """One stage to execute. Everything is plain data so submitit can pickle it."""

    spec_json: str  # the resolved (variant) spec
    variant: str
    stage: str
    key: str
    parts: dict
    artifact: str
    partial: str
    inputs: dict[str, str]
    run_id: str
    db_path: str
    reason: str
    executor: str = "local"
    log_path: str = ""
    after: list[int] = field(default_factory=list)  # indices (in the job list) it waits for

    @property
    def id(self) -> str:
        return self.stage if self.variant == "base" else f"{self.stage}@{self.variant}"


@dataclass
class StageOutcome:
    job: StageJob
    status: str  # "done" | "failed" | "skipped" | "cancelled"
    metrics: dict = field(default_factory=dict)
    error: str = ""
    job_id: str = ""
    duration_s: float = 0.0


def job_row(job: StageJob, status: str, **fields) -> dict:
    """The `stages` row of `job` with this status (runner.store.stage_row)."""
    return stage_row(run_id=job.run_id, variant=job.variant, stage=job.stage, cache_key=job.key,
                     reason=job.reason, status=status, executor=job.executor,
                     artifact=job.artifact, log_path=job.log_path, **fields)


def error_text(e: BaseException) -> str:
    """What a failed stage reports: a StageError's own message, else `Type: message`."""
    return str(e) if isinstance(e, StageError) else f"{type(e).__name__}: {e}"


def interrupted_text(job: StageJob) -> str:
    """What a stage stopped by Ctrl-C (SIGINT) reports: it was cancelled, not broken."""
    return (f"{job.id} interrupted (Ctrl-C); the next `runner apply` runs it again (regenerate "
            "and extract resume after their last shard, train from its last checkpoint, bench "
            "from the parts it measured on this machine), unless an earlier complete result of "
            "the same settings is there: then it is up to date, and --force starts it over")


def make_context(job: StageJob, rank: int = 0, world_size: int = 1) -> StageContext:
    spec = Spec.model_validate_json(job.spec_json)
    Path(job.partial).mkdir(parents=True, exist_ok=True)
    return StageContext(spec=spec, stage=job.stage, variant=job.variant, run_id=job.run_id,
                        inputs={k: Path(v) for k, v in job.inputs.items()},
                        out_dir=Path(job.partial), db_path=Path(job.db_path), rank=rank,
                        world_size=world_size, reason=job.reason)


def lock_stage(job: StageJob):
    """Take the stage's lock file (work_dir/.locks/<stage>-<key[:16]>.lock, out of the stage
    folders, which hold artifacts only) for as long as the returned file object stays open. Two
    runner processes (say two `runner apply --variant ...`, one per GPU) must never write one
    partial dir at once. Raises
    StageError naming the lock when another process holds it (POSIX flock: local disks; on NFS
    it depends on the mount)."""
    path = Path(job.partial).parent.parent / ".locks" / f"{job.stage}-{job.key[:16]}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    f = open(path, "a")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise StageError(f"{job.id}: another runner process is computing this stage right now "
                         f"(lock {path}). Wait for it to finish, or apply a --variant that does "
                         "not need it.") from None
    return f


def check_inputs(job: StageJob) -> None:
    """Before the stage reads anything: every input artifact matches its artifact.json
    (runner/verify.py), and the stage's registry check accepts those inputs (e.g. train's
    num_samples against the extract). Raises StageError naming the file or field."""
    manifests = {}
    for name, path in job.inputs.items():
        m = read_manifest(Path(path))
        if m is None:
            raise StageError(f"{job.id}: its input {name} ({path}) has no artifact.json: it is "
                             f"not a completed artifact. Rebuild it: runner apply SPEC --force "
                             f"{name}")
        verify_artifact(Path(path), m, name)
        manifests[name] = m
    check = stage_kind(job.stage).check
    problem = check(Spec.model_validate_json(job.spec_json), manifests) if check else None
    if problem:
        raise StageError(problem)


def run_stage(job: StageJob, rank: int = 0, world_size: int = 1) -> dict:
    """Run one stage to completion and finalize its artifact. Returns its summary metrics.

    Records a `running` row when it starts (after taking the lock, before check_inputs), then
    its `stages` row (done or failed, with host, job id and duration). Raises whatever the
    stage raised after recording it. With world_size > 1 (called by runner/launch.py in every
    rank, the process group already joined): every rank runs the stage; after a barrier rank 0
    alone finalizes the artifact and records rows; other ranks record nothing. Torch's threads
    are sized to the cores this process gets (_load_stage)."""
    if rank != 0:
        check_inputs(job)
        ctx = make_context(job, rank, world_size)
        _load_stage(job.stage).run(ctx)
        _barrier(world_size)
        return {}
    store = Store(job.db_path)
    started, t0 = now(), time.time()
    job_id = os.environ.get("SLURM_JOB_ID", str(os.getpid()))
    lock = None
    try:
        lock = lock_stage(job)  # before any write: a second process fails here, untouched
        # the stage in progress, for `runner status` (which checks that this pid/job lives)
        store.emit("stages", job_row(job, "running", started_at=started, finished_at=None,
                                     job_id=job_id))
        check_inputs(job)
        ctx = make_context(job, rank, world_size)
        metrics = _load_stage(job.stage).run(ctx) or {}
        _barrier(world_size)  # every rank finished writing before the partial dir is renamed
        finalize(ctx, job.key, job.parts, Path(job.artifact), metrics)
        for name, v in metrics.items():
            value, unit = (v if isinstance(v, (tuple, list)) else (v, ""))
            if isinstance(value, (int, float)):
                store.metric(job.run_id, job.variant, job.stage, name, value, unit)
    except BaseException as e:
        if job.log_path:
            Path(job.log_path).parent.mkdir(parents=True, exist_ok=True)
            with open(job.log_path, "a") as f:
                f.write(traceback.format_exc())
        # a Slurm timeout/preemption that requeued the job (runner/slurm/task.py StageTask)
        # exits with SystemExit: the stage resumes in the requeued job, it did not fail
        requeued = isinstance(e, SystemExit) and os.environ.get("EAGLE3_STAGE_REQUEUED") == "1"
        status, error = (("requeued", "timed out or preempted; requeued") if requeued else
                         ("cancelled", interrupted_text(job)) if isinstance(e, KeyboardInterrupt)
                         else ("failed", error_text(e)))
        store.emit("stages", job_row(job, status, started_at=started, job_id=job_id,
                                     duration_s=time.time() - t0, error=error))
        raise
    finally:
        if lock is not None:
            lock.close()
    store.emit("stages", job_row(job, "done", started_at=started, job_id=job_id,
                                 duration_s=time.time() - t0))
    return {k: (v[0] if isinstance(v, (tuple, list)) else v) for k, v in metrics.items()}


def _load_stage(stage: str):
    """The stage's module, with torch's threads sized to the cores this process gets and
    waiting without spinning: set before the module loads torch, sized once it has (runner/cpu.py
    stage_threads; on a shared CPU, spinning threads made the bench 30-50x slower). Raises
    StageError for a bad EAGLE3_THREADS, before the stage runs."""
    stage_threads()
    module = stage_module(stage)
    stage_threads()
    return module


def _barrier(world_size: int) -> None:
    if world_size > 1:
        import torch.distributed as dist
        dist.barrier()
