"""Run one stage with N ranks on this node (data parallel: extract, train).

    python -m eagle3_runner.runner.launch --nproc N [--result OUT.json] JOBFILE

JOBFILE is a StageJob as JSON (runner/job.py). Three ways to get the ranks:
- plain (the local executor): this process spawns N ranks (torch.multiprocessing, 'spawn') that
  meet through a FileStore in a temp dir (no ports);
- torchrun --nproc-per-node N -m eagle3_runner.runner.launch JOBFILE: RANK/WORLD_SIZE/LOCAL_RANK/MASTER_* set;
- srun / Slurm tasks (runner/slurm/task.py StageTask calls `run_rank` in each task).
Each rank runs `run_stage(job, rank, world)`: every rank runs the stage; rank 0 alone finalizes the
artifact and records the `stages` row. Rank r uses GPU r (LOCAL_RANK), or, when the stage holds a
target split with target.device_map, the group of GPUs r*g.. (runner/placement.py); backend
"cpu:gloo,cuda:nccl" with CUDA, gloo without. NCCL_NVLS_ENABLE defaults to 0 (NVLink multicast off).

--result gets rank 0's outcome: {"status": "done"|"failed", "metrics", "error", "stage_error",
"rank"}; the exit code is 0 only when every rank succeeded.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path

from eagle3_runner.runner.cpu import stage_threads
from eagle3_runner.runner.errors import StageError
from eagle3_runner.runner.files import atomic_write
from eagle3_runner.runner.job import StageJob, error_text, job_row, run_stage
from eagle3_runner.runner.placement import layout_problem, replica_gpus, splits
from eagle3_runner.runner.spec.schema import Spec
from eagle3_runner.runner.store import Store

TIMEOUT_MIN = float(os.environ.get("EAGLE3_DIST_TIMEOUT_MIN", "60"))  # barrier / collective limit


def _backend() -> str:
    import torch
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


def init_rank(rank: int, world: int, local_rank: int, init_method: str | None = None,
              split: bool = False) -> None:
    """Join the process group (env:// unless init_method) and pin this rank's GPU and threads.
    split: each rank holds a target split over a group of GPUs (runner/placement.py
    replica_gpus); its current device is the group's first.

    Raises StageError when the visible GPUs cannot serve the local ranks that way."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(_local_world(world)))  # cores/memory shares
    stage_threads()  # idle threads sleep: set before this rank first imports torch
    import torch
    import torch.distributed as dist
    stage_threads()  # this rank's share of the cores
    if torch.cuda.is_available():
        n, local = torch.cuda.device_count(), _local_world(world)
        problem = layout_problem(n, local, split, f"rank {rank}")
        if problem:
            raise StageError(problem + " (the GPUs this job sees)")
        torch.cuda.set_device(replica_gpus(local_rank, local, n, split)[0])
    dist.init_process_group(_backend(), init_method=init_method or "env://", rank=rank,
                            world_size=world, timeout=datetime.timedelta(minutes=TIMEOUT_MIN))


def _local_world(world: int) -> int:
    """Ranks on this node: torchrun's LOCAL_WORLD_SIZE, Slurm's SLURM_NTASKS_PER_NODE ("8" or
    "8(x2)"), else all ranks (one node)."""
    v = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("SLURM_NTASKS_PER_NODE") or world
    return max(1, int(str(v).split("(")[0]))


def _outcome(fn, rank: int) -> dict:
    try:
        return {"status": "done", "metrics": fn(), "rank": rank}
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        if not isinstance(e, (StageError, KeyboardInterrupt)):
            traceback.print_exc()
        return {"status": "failed", "rank": rank, "stage_error": isinstance(e, StageError),
                "error": error_text(e),
                "interrupt": isinstance(e, (KeyboardInterrupt, SystemExit))}


def run_rank(job: StageJob, rank: int, world: int, local_rank: int,
             init_method: str | None = None) -> dict:
    """One rank: join the group, run_stage(job, rank, world), leave. Returns its metrics; raises
    what the stage raised."""
    import torch.distributed as dist
    split = splits(Spec.model_validate_json(job.spec_json), job.stage)
    init_rank(rank, world, local_rank, init_method, split)
    try:
        return run_stage(job, rank=rank, world_size=world)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _spawned(local_rank: int, job_json: str, world: int, store: str, outdir: str) -> None:
    job = StageJob(**json.loads(job_json))
    out = _outcome(lambda: run_rank(job, local_rank, world, local_rank, f"file://{store}"),
                   local_rank)
    Path(outdir, f"rank-{local_rank}.json").write_text(json.dumps(out, default=str))
    if out["status"] != "done":
        sys.exit(1)


def spawn_ranks(job: StageJob, nproc: int) -> dict:
    """Run `job` with nproc local ranks (child processes). Returns rank 0's outcome dict, or the
    first failed rank's when rank 0 left none (killed after another rank failed)."""
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory(prefix="eagle3-launch-") as d:
        try:
            mp.start_processes(_spawned, args=(json.dumps(job.__dict__, default=str), nproc,
                                               os.path.join(d, "store"), d),
                               nprocs=nproc, join=True, start_method="spawn")
        except (mp.ProcessExitedException, mp.ProcessRaisedException):
            pass  # a rank failed and spawn stopped the others: the rank files say why
        res = [json.loads(p.read_text()) if p.exists() else None
               for p in (Path(d) / f"rank-{r}.json" for r in range(nproc))]
    failed = [r for r in res if r and r["status"] != "done"]
    if res[0] and res[0]["status"] == "done" and not failed:
        return res[0]
    real = [r for r in failed if not r["interrupt"]] or failed  # a cause, not a casualty
    first = real[0] if real else {"status": "failed", "rank": -1, "stage_error": False,
                                  "interrupt": False, "error": "ranks exited without a result"}
    if res[0] is None or res[0]["status"] == "done":  # rank 0 recorded no failed row: do it here
        _record_failure(job, f"rank {first['rank']}: {first['error']}")
    return first


def _record_failure(job: StageJob, error: str) -> None:
    Store(job.db_path).emit("stages", job_row(job, "failed", duration_s=0.0,
                                              job_id=str(os.getpid()), error=error))


def env_ranks() -> tuple[int, int, int] | None:
    """(rank, world, local_rank) from torchrun (RANK/WORLD_SIZE/LOCAL_RANK) or srun
    (SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID); None when this process was not launched as a rank."""
    e = os.environ
    if "RANK" in e and "WORLD_SIZE" in e:
        return int(e["RANK"]), int(e["WORLD_SIZE"]), int(e.get("LOCAL_RANK", e["RANK"]))
    if int(e.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in e:
        return int(e["SLURM_PROCID"]), int(e["SLURM_NTASKS"]), int(e.get("SLURM_LOCALID", "0"))
    return None


def slurm_env() -> None:
    """MASTER_ADDR/MASTER_PORT for env:// inside a Slurm job (first node of the job, a port
    derived from the job id; kept when already set)."""
    e = os.environ
    if "MASTER_ADDR" not in e:
        nodes = e.get("SLURM_JOB_NODELIST", "") or "127.0.0.1"
        first = nodes.split(",")[0]
        if "[" in first:  # node[01-04] -> node01
            base, rng = first.split("[", 1)
            first = base + rng.split("-")[0].split(",")[0].rstrip("]")
        e["MASTER_ADDR"] = first
    e.setdefault("MASTER_PORT", str(20000 + int(e.get("SLURM_JOB_ID", "0")) % 40000))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eagle3_runner.runner.launch", description=__doc__.split("\n")[0])
    ap.add_argument("--nproc", type=int, default=1, help="local ranks to spawn (ignored under "
                    "torchrun/srun, which start the ranks themselves)")
    ap.add_argument("--result", type=Path, help="write rank 0's outcome here (JSON)")
    ap.add_argument("jobfile", type=Path)
    a = ap.parse_args(argv)
    job = StageJob(**json.loads(a.jobfile.read_text()))
    try:
        stage_threads()  # before torch loads here: spawned ranks inherit OMP_WAIT_POLICY
    except StageError:
        pass  # a bad EAGLE3_THREADS: each rank's init_rank reports it
    ranks = env_ranks()
    if ranks is not None:
        if "SLURM_PROCID" in os.environ and "RANK" not in os.environ:
            slurm_env()
        rank, world, local = ranks
        out = _outcome(lambda: run_rank(job, rank, world, local), rank)
    elif a.nproc > 1:
        out = spawn_ranks(job, a.nproc)
    else:
        out = _outcome(lambda: run_stage(job), 0)
    if a.result and (ranks is None or ranks[0] == 0):
        atomic_write(a.result, json.dumps(out, default=str))
    if out["status"] != "done":
        print(f"error: {job.id}: {out['error']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
