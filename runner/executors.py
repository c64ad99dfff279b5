"""Executors: where stage jobs run. `local` runs them in this process, in plan order.
`slurm` (runner/slurm.py) submits one submitit job per stage with afterok dependencies.

Both execute the same picklable `StageJob` through `run_stage`, so a stage behaves the same
under either executor. A data-parallel stage (extract, train) with executor.nproc_per_node > 1
runs `run_stage(job, rank, world)` in every rank: locally through `python -m runner.launch`
(a child process that spawns the ranks), on Slurm as the srun tasks of one job.
"""

from __future__ import annotations

import fcntl
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from runner.spec import DATA_PARALLEL_STAGES, Spec
from runner.stage import StageContext, StageError, finalize
from runner.store import Store, host, now


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


def make_context(job: StageJob, rank: int = 0, world_size: int = 1) -> StageContext:
    spec = Spec.model_validate_json(job.spec_json)
    Path(job.partial).mkdir(parents=True, exist_ok=True)
    return StageContext(spec=spec, stage=job.stage, variant=job.variant, run_id=job.run_id,
                        inputs={k: Path(v) for k, v in job.inputs.items()},
                        out_dir=Path(job.partial), db_path=Path(job.db_path), rank=rank,
                        world_size=world_size)


def stage_nproc(spec: Spec, stage: str) -> int:
    """Ranks for `stage`: executor.nproc_per_node (or executor.stages.<stage>.nproc_per_node on
    Slurm) for the data-parallel stages, else 1."""
    if stage not in DATA_PARALLEL_STAGES:
        return 1
    ex = spec.executor
    over = getattr(ex, "stages", {}).get(stage)
    if over is not None and over.nproc_per_node is not None:
        return over.nproc_per_node
    return ex.nproc_per_node


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


def run_stage(job: StageJob, rank: int = 0, world_size: int = 1) -> dict:
    """Run one stage to completion and finalize its artifact. Returns its summary metrics.

    Records a `stages` row (done or failed, with host, job id and duration). Raises whatever the
    stage raised after recording it. With world_size > 1 (called by runner/launch.py in every
    rank, the process group already joined): every rank runs the stage; after a barrier rank 0
    alone finalizes the artifact and records rows; other ranks record nothing."""
    if rank != 0:
        ctx = make_context(job, rank, world_size)
        importlib.import_module(f"jobs.{job.stage}").run(ctx)
        _barrier(world_size)
        return {}
    store = Store(job.db_path)
    started, t0 = now(), time.time()
    job_id = os.environ.get("SLURM_JOB_ID", str(os.getpid()))
    row = dict(run_id=job.run_id, variant=job.variant, stage=job.stage, cache_key=job.key,
               reason=job.reason, started_at=started, host=host(), job_id=job_id,
               executor=job.executor, artifact=job.artifact, log_path=job.log_path)
    lock = None
    try:
        lock = lock_stage(job)  # before any write: a second process fails here, untouched
        ctx = make_context(job, rank, world_size)
        mod = importlib.import_module(f"jobs.{job.stage}")
        metrics = mod.run(ctx) or {}
        _barrier(world_size)  # every rank finished writing before the partial dir is renamed
        finalize(ctx, job.key, job.parts, Path(job.artifact), metrics)
        for name, v in metrics.items():
            value, unit = (v if isinstance(v, (tuple, list)) else (v, ""))
            if isinstance(value, (int, float)):
                store.metric(job.run_id, job.variant, job.stage, name, value, unit)
    except BaseException as e:
        msg = str(e) if isinstance(e, StageError) else f"{type(e).__name__}: {e}"
        if job.log_path:
            Path(job.log_path).parent.mkdir(parents=True, exist_ok=True)
            with open(job.log_path, "a") as f:
                f.write(traceback.format_exc())
        # a Slurm timeout/preemption that requeued the job (runner/slurm.py StageTask) exits
        # with SystemExit: the stage resumes in the requeued job, it did not fail
        requeued = isinstance(e, SystemExit) and os.environ.get("EAGLE3_STAGE_REQUEUED") == "1"
        store.emit("stages", {**row, "status": "requeued" if requeued else "failed",
                              "finished_at": now(), "duration_s": time.time() - t0,
                              "error": ("timed out or preempted; requeued" if requeued
                                        else msg[:4000])})
        raise
    finally:
        if lock is not None:
            lock.close()
    store.emit("stages", {**row, "status": "done", "finished_at": now(),
                          "duration_s": time.time() - t0})
    return {k: (v[0] if isinstance(v, (tuple, list)) else v) for k, v in metrics.items()}


def _barrier(world_size: int) -> None:
    if world_size > 1:
        import torch.distributed as dist
        dist.barrier()


def launch_local(job: StageJob, nproc: int) -> dict:
    """Run `job` with nproc ranks through `python -m runner.launch` (a child process, so this
    one never initialises CUDA or a process group). Returns rank 0's metrics; raises StageError
    (the stage's own message) or RuntimeError with the failing rank's error."""
    with tempfile.TemporaryDirectory(prefix="eagle3-job-") as d:
        jf, rf = Path(d) / "job.json", Path(d) / "result.json"
        jf.write_text(json.dumps(job.__dict__, default=str))
        r = subprocess.run([sys.executable, "-m", "runner.launch", "--nproc", str(nproc),
                            "--result", str(rf), str(jf)])
        res = json.loads(rf.read_text()) if rf.exists() else {}
    if r.returncode == 0 and res.get("status") == "done":
        return res["metrics"]
    msg = res.get("error") or f"runner.launch exited with status {r.returncode}"
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
            if any(a in failed for a in job.after):
                failed.add(i)
                outcomes.append(StageOutcome(job, "skipped", error="upstream stage failed"))
                continue
            if on_event:
                on_event("start", job)
            t0 = time.time()
            try:
                n = stage_nproc(Spec.model_validate_json(job.spec_json), job.stage)
                metrics = run_stage(job) if n == 1 else launch_local(job, n)
                outcomes.append(StageOutcome(job, "done", metrics, duration_s=time.time() - t0,
                                             job_id=str(os.getpid())))
            except KeyboardInterrupt:
                outcomes.append(StageOutcome(job, "cancelled", error="interrupted"))
                raise
            except Exception as e:  # noqa: BLE001 - reported, not swallowed
                failed.add(i)
                msg = str(e) if isinstance(e, StageError) else f"{type(e).__name__}: {e}"
                outcomes.append(StageOutcome(job, "failed", error=msg,
                                             duration_s=time.time() - t0))
            if on_event:
                on_event("end", outcomes[-1])
        return outcomes


def get_executor(spec: Spec):
    """The executor named by spec.executor.kind."""
    if spec.executor.kind == "local":
        return LocalExecutor(spec)
    from runner.slurm import SlurmExecutor
    return SlurmExecutor(spec)


def dump_jobs(jobs: list[StageJob]) -> str:
    return json.dumps([j.__dict__ for j in jobs], default=str)


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr)
