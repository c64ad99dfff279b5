"""`runner apply`: execute exactly the plan that `runner plan` prints."""

from __future__ import annotations

import os
import secrets
import sys
import time
from datetime import datetime
from pathlib import Path

from eagle3_runner.runner.executors import get_executor
from eagle3_runner.runner.job import StageJob, StageOutcome, job_row
from eagle3_runner.runner.plan import Plan, source_entry, write_state
from eagle3_runner.runner.spec.load import variant_spec
from eagle3_runner.runner.spec.schema import Spec
from eagle3_runner.runner.store import Store, host, now, stage_row


def new_run_id(spec: Spec) -> str:
    return f"{spec.name}-{datetime.now():%Y%m%d-%H%M%S}-{secrets.token_hex(2)}"


def jobs_for(spec: Spec, plan: Plan, run_id: str) -> list[StageJob]:
    """The StageJobs of the plan's `run` entries, in order, with their dependencies."""
    specs = {"base": spec, **{v.name: variant_spec(spec, v.name) for v in spec.variants}}
    work = Path(plan.work_dir)
    jobs: list[StageJob] = []
    index: dict[tuple[str, str], int] = {}
    for p in plan.stages:
        if p.action != "run":
            continue
        inputs, after = {}, []
        for (v, s) in p.needs:
            up = source_entry(plan, next(q for q in plan.stages if (q.variant, q.stage) == (v, s)))
            inputs[s] = up.artifact
            if (up.variant, up.stage) in index:
                after.append(index[(up.variant, up.stage)])
        sid = p.stage if p.variant == "base" else f"{p.stage}@{p.variant}"
        jobs.append(StageJob(
            spec_json=specs[p.variant].model_dump_json(), variant=p.variant, stage=p.stage,
            key=p.key, parts=p.parts, artifact=p.artifact, partial=p.partial, inputs=inputs,
            run_id=run_id, db_path=plan.results, reason=p.reason, executor=plan.executor,
            log_path=str(work / "logs" / f"{run_id}.{sid}.log"), after=after))
        index[(p.variant, p.stage)] = len(jobs) - 1
    return jobs


def apply(spec: Spec, plan: Plan, quiet: bool = False) -> tuple[str, list[StageOutcome]]:
    """Run the plan; record runs/stages rows; ingest into DuckDB. Returns (run_id, outcomes)."""
    run_id = new_run_id(spec)
    store = Store(plan.results)
    started = now()
    run_row = dict(run_id=run_id, spec_name=spec.name, spec_hash=_spec_hash(spec),
                   code_version=code_version(), host=host(), executor=plan.executor,
                   started_at=started, spec_json=spec.model_dump_json(), pid=os.getpid())
    store.emit("runs", {**run_row, "status": "running"})
    for p in plan.stages:
        if p.action == "skip":
            store.emit("stages", stage_row(run_id=run_id, variant=p.variant, stage=p.stage,
                                           cache_key=p.key, reason=p.reason, status="skipped",
                                           executor=plan.executor, duration_s=0.0,
                                           artifact=p.artifact))
    jobs = jobs_for(spec, plan, run_id)
    n = len(jobs)
    t_start = time.time()

    def on_event(kind, obj):
        if kind == "end" and obj.status == "done":  # remember it now: a later kill keeps it
            write_state(Path(plan.work_dir), next(
                q for q in plan.stages if (q.variant, q.stage) == (obj.job.variant, obj.job.stage)))
        if quiet:
            return
        if kind == "start":
            i = jobs.index(obj) + 1
            print(f"[{i}/{n}] {obj.id}: running ({obj.reason})", file=sys.stderr, flush=True)
        else:
            o: StageOutcome = obj
            tail = f" - {o.error}" if o.error else ""
            print(f"      {o.job.id}: {o.status} in {o.duration_s:.1f}s{tail}", file=sys.stderr,
                  flush=True)

    executor = get_executor(spec)
    outcomes: list[StageOutcome] = []
    status = "failed"
    try:
        outcomes = executor.run_jobs(jobs, on_event)
        status = "done" if all(o.status == "done" for o in outcomes) else "failed"
    except KeyboardInterrupt:  # Ctrl-C: the run was cancelled, not broken
        status = "cancelled"
        raise
    finally:
        work = Path(plan.work_dir)
        for o in outcomes:
            if o.status == "done":
                p = next(q for q in plan.stages if (q.variant, q.stage) == (o.job.variant, o.job.stage))
                write_state(work, p)
            elif o.status in ("skipped", "cancelled"):
                store.emit("stages", job_row(o.job, o.status, error=o.error))
        store.emit("runs", {**run_row, "finished_at": now(), "status": status})
        store.ingest()
    if not quiet:
        print(f"run {run_id}: {status} in {time.time() - t_start:.1f}s", file=sys.stderr)
    return run_id, outcomes


def _spec_hash(spec: Spec) -> str:
    import hashlib
    return hashlib.sha256(spec.model_dump_json().encode()).hexdigest()[:16]


def code_version() -> str:
    """git SHA (+dirty) of the project checkout, or 'unknown' outside git."""
    import subprocess
    root = Path(__file__).resolve().parent.parent
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, text=True,
                             capture_output=True, timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               text=True, capture_output=True, timeout=5).stdout.strip()
        return (sha or "unknown") + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
