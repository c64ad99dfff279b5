"""Submitting a plan's stage jobs to Slurm and following them to the end (runner/slurm/__init__.py
says how jobs, arrays, dependencies and failures map onto Slurm)."""

from __future__ import annotations

import json
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from eagle3_runner.runner.errors import SlurmError
from eagle3_runner.runner.job import StageJob, StageOutcome, job_row
from eagle3_runner.runner.slurm.cancel import record_submitted
from eagle3_runner.runner.slurm.probes import TERMINAL, state_query, require_sbatch, scancel
from eagle3_runner.runner.slurm.sbatch import log_dir, preflight, rejection, sbatch_params
from eagle3_runner.runner.slurm.task import StageTask
from eagle3_runner.runner.spec.schema import Spec
from eagle3_runner.runner.store import Store

POLL_S = 1.0  # seconds between polls while following jobs


@dataclass
class _Sub:
    """One submitted job as the coordinator follows it."""

    index: int
    sjob: object  # submitit Job
    job_id: str
    t0: float
    missing_since: float | None = None


def group_jobs(jobs: list[StageJob], spec_of) -> list[list[int]]:
    """Partition job indices into submission groups, in dependency order: jobs of the same
    stage, with the same resources and the same depth in the DAG, form one group (a job array)."""
    depth: dict[int, int] = {}
    for i, j in enumerate(jobs):
        depth[i] = 1 + max((depth[a] for a in j.after), default=-1)
    groups: dict[tuple, list[int]] = {}
    for i, j in enumerate(jobs):
        res = json.dumps(sbatch_params(spec_of(j), j.stage), sort_keys=True, default=str)
        groups.setdefault((depth[i], j.stage, res), []).append(i)
    return sorted(groups.values(), key=lambda g: (depth[g[0]], g[0]))


def dependency(group: list[int], jobs: list[StageJob], subs: dict[int, _Sub]) -> str | None:
    """Slurm --dependency for a group: aftercorr on an upstream array whose task i feeds this
    group's task i, afterok on everything else."""
    ups = [[a for a in jobs[i].after if a in subs] for i in group]
    if not any(ups):
        return None
    parts: list[str] = []
    if len(group) > 1 and all(len(u) == 1 for u in ups):
        ids = [subs[u[0]].job_id for u in ups]
        arrays = {i.split("_")[0] for i in ids}
        if len(arrays) == 1 and all("_" in i for i in ids) and \
                [int(i.split("_")[1]) for i in ids] == list(range(len(group))):
            return f"aftercorr:{arrays.pop()}"
    for u in ups:
        for a in u:
            jid = subs[a].job_id
            if jid not in parts:
                parts.append(jid)
    return "afterok:" + ":".join(parts)


class SlurmExecutor:
    """Runs a plan's StageJobs as Slurm jobs through submitit (see the module docstring)."""

    name = "slurm"

    def __init__(self, spec: Spec, check: bool = True):
        self.spec = spec
        self.check = check  # run preflight (sinfo) checks before submitting
        self.folder: Path | None = None

    # -- submission --
    def _executor(self, spec: Spec, stage: str, dep: str | None):
        import submitit
        ex = submitit.SlurmExecutor(folder=self.folder, max_num_timeout=3)
        p = sbatch_params(spec, stage)
        if dep:
            p["dependency"] = dep
        ex.update_parameters(**p)
        return ex

    def submit_group(self, group: list[int], jobs: list[StageJob], subs: dict[int, _Sub]) -> None:
        """Submit one group (one job, or one array) and record it in subs and jobs.jsonl."""
        first = jobs[group[0]]
        spec = Spec.model_validate_json(first.spec_json)
        ex = self._executor(spec, first.stage, dependency(group, jobs, subs))
        try:
            if len(group) == 1:
                sjobs = [ex.submit(StageTask(first))]
            else:
                sjobs = ex.submit_array([StageTask(jobs[i]) for i in group])
        except Exception as e:  # noqa: BLE001 - submitit wraps sbatch's stderr
            raise rejection(e, first.stage, ex.parameters) from None
        t = time.time()
        for i, sj in zip(group, sjobs):
            subs[i] = _Sub(i, sj, str(sj.job_id), t)
            jobs[i].log_path = str(sj.paths.stderr)
        record_submitted(self.spec, [(jobs[i], subs[i].job_id) for i in group])

    # -- following --
    def _outcome(self, s: _Sub, job: StageJob, state: str | None) -> StageOutcome:
        """Collect one finished job: result, remote traceback, or Slurm's terminal state."""
        from submitit.core.utils import FailedJobError, UncompletedJobError
        dur = time.time() - s.t0
        # one task per rank (one for most stages): the first rank with an error decides; rank 0's
        # result is the stage's (a peer killed by --kill-on-bad-exit leaves no result)
        tasks = [s.sjob.task(k) for k in range(s.sjob.num_tasks)]
        metrics = None
        for k, t in enumerate(tasks):
            if not t.paths.result_pickle.exists():
                continue
            try:
                r = t.result()
            except FailedJobError as e:
                msg = _short_error(str(e)) if k == 0 else f"rank {k}: {_short_error(str(e))}"
                if k and not tasks[0].paths.result_pickle.exists():
                    self._record_failed(job, s, msg, dur)  # rank 0 was stopped before its row
                return StageOutcome(job, "failed", error=msg, job_id=s.job_id, duration_s=dur)
            except UncompletedJobError as e:
                return self._lost(job, s, "FAILED", str(e), dur)
            metrics = r if k == 0 else metrics
        if tasks[0].paths.result_pickle.exists():
            return StageOutcome(job, "done", metrics or {}, job_id=s.job_id, duration_s=dur)
        return self._lost(job, s, state or "UNKNOWN", "", dur)

    def _lost(self, job: StageJob, s: _Sub, state: str, detail: str, dur: float) -> StageOutcome:
        """A job that ended without a result (cancelled, killed, node failure): record a stages
        row ourselves (the job could not)."""
        status = "cancelled" if state.startswith("CANCELLED") else "failed"
        tail = _tail(job.log_path)
        err = (f"Slurm job {s.job_id} ended {state} without a result"
               + (f": {detail.splitlines()[0]}" if detail else "")
               + (f"\n{tail}" if tail else "") + f"\nlog: {job.log_path}")
        if status == "failed":
            self._record_failed(job, s, err, dur)
        return StageOutcome(job, status, error=err, job_id=s.job_id, duration_s=dur)

    @staticmethod
    def _record_failed(job: StageJob, s: _Sub, err: str, dur: float) -> None:
        Store(job.db_path).emit("stages", job_row(job, "failed", duration_s=dur, job_id=s.job_id,
                                                  error=err))

    def run_jobs(self, jobs: list[StageJob], on_event=None) -> list[StageOutcome]:
        """Submit every job, follow them to the end, return one StageOutcome per job (in the
        order of `jobs`). Ctrl-C cancels the jobs still queued or running.

        Raises SlurmError before submitting anything when sbatch is missing, the partition is
        unknown or a GPU request cannot be met; and when sbatch rejects a job (its message
        verbatim, with the option that caused it)."""
        if not jobs:
            return []
        specs: dict[str, Spec] = {}

        def spec_of(j: StageJob) -> Spec:
            if j.variant not in specs:
                specs[j.variant] = Spec.model_validate_json(j.spec_json)
            return specs[j.variant]

        if self.check:
            preflight(self.spec, [j.stage for j in jobs])
        else:
            require_sbatch()
        self.folder = log_dir(self.spec) / jobs[0].run_id
        self.folder.mkdir(parents=True, exist_ok=True)
        subs: dict[int, _Sub] = {}
        outcomes: dict[int, StageOutcome] = {}
        try:
            for group in group_jobs(jobs, spec_of):
                self.submit_group(group, jobs, subs)
                for i in group:
                    if on_event:
                        on_event("start", jobs[i])
                    print(f"      {jobs[i].id}: Slurm job {subs[i].job_id}  log {jobs[i].log_path}",
                          file=sys.stderr, flush=True)
            self._follow(jobs, subs, outcomes, on_event)
        except KeyboardInterrupt:
            live = [s.job_id for i, s in subs.items() if i not in outcomes]
            scancel(live)
            for i in range(len(jobs)):
                outcomes.setdefault(i, StageOutcome(jobs[i], "cancelled", error="interrupted; "
                                                    f"scancelled {' '.join(live)}"))
            raise
        except SlurmError:
            scancel([s.job_id for i, s in subs.items() if i not in outcomes])
            raise
        return [outcomes[i] for i in range(len(jobs))]

    def _follow(self, jobs, subs, outcomes, on_event) -> None:
        failed: set[int] = set()
        last_probe = 0.0
        states: dict[str, str] = {}
        while len(outcomes) < len(jobs):
            # dependents of a failed job: Slurm keeps them pending forever; cancel and skip them
            for i, j in enumerate(jobs):
                up = next((a for a in j.after if a in failed), None)
                if i not in outcomes and up is not None:
                    scancel([subs[i].job_id])
                    failed.add(i)
                    outcomes[i] = StageOutcome(j, "skipped",
                                               error=f"upstream stage {jobs[up].id} failed",
                                               job_id=subs[i].job_id)
                    if on_event:
                        on_event("end", outcomes[i])
            if time.time() - last_probe > 3 * POLL_S:
                states = state_query([s.job_id for i, s in subs.items() if i not in outcomes])
                last_probe = time.time()
            for i, s in subs.items():
                if i in outcomes:
                    continue
                state = states.get(s.job_id, "")
                finished = s.sjob.paths.result_pickle.exists() or state.split()[:1] and \
                    state.split()[0] in TERMINAL
                if not finished and not state and s.sjob.paths.folder.exists() and \
                        time.time() - s.t0 > 60:  # Slurm forgot it and no result came
                    s.missing_since = s.missing_since or time.time()
                    finished = time.time() - s.missing_since > 30
                if not finished:
                    continue
                if not s.sjob.paths.result_pickle.exists():
                    time.sleep(2)  # a shared filesystem may show the result a moment later
                o = self._outcome(s, jobs[i], state)
                outcomes[i] = o
                if o.status != "done":
                    failed.add(i)
                if on_event:
                    on_event("end", o)
            if len(outcomes) < len(jobs):
                time.sleep(POLL_S)


def _short_error(text: str) -> str:
    """The remote exception line from submitit's FailedJobError text, then the full trace."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    last = next((ln for ln in reversed(lines) if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|"
                                                          r"Interrupt|Exit)\b", ln)), "")
    return (last + "\n" + text) if last else text


def _tail(path: str, n: int = 15) -> str:
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-n:])
