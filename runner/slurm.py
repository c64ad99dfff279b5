"""The `slurm` executor: one submitit job per stage, afterok dependencies, arrays for sweeps.

Mapping (spec -> sbatch, through submitit.SlurmExecutor):
  executor.partition -> --partition     gpus_per_node -> --gpus-per-node (omitted when 0)
  cpus_per_task      -> --cpus-per-task mem_gb        -> --mem=<N>GB
  timeout_min        -> --time          account/qos/constraint -> --account/--qos/--constraint
  extra_sbatch       -> allowlisted options (runner/spec.py SBATCH_ALLOWLIST), verbatim
  executor.stages.<stage> overrides gpus_per_node/cpus_per_task/mem_gb/timeout_min per stage.
  nproc_per_node     -> --ntasks-per-node for extract/train (1 for the other stages): ONE job
                        whose srun starts one task per rank (srun --kill-on-bad-exit=1, so a
                        failed rank stops its peers); each task joins the process group
                        (runner/launch.py run_rank: SLURM_PROCID, SLURM_LOCALID -> GPU) and
                        rank 0 finalizes. cpus_per_task is per task.

Scheduling: jobs are submitted in plan order. Jobs of the same stage with the same resources and
the same topological depth (e.g. `bench` for every variant of a sweep) go out as ONE job array.
A job waits for its upstream jobs with Slurm `afterok` (`aftercorr` when the upstream is an
array in the same task order). When an upstream fails, its dependents are scancelled and
reported as skipped (Slurm would otherwise leave them pending forever).

Following: a job is finished when submitit's result pickle exists or when Slurm reports a
terminal state (`squeue -t all`, then `sacct`), so a cluster without accounting still works.
Failures bring back the remote traceback (submitit FailedJobError) and the job's stderr log.

Checkpointing: every stage runs through `StageTask`, a submitit checkpointable callable. On
timeout or preemption (Slurm sends USR2 `signal_delay_s` before the limit), a `train` stage is
requeued with the same StageJob and resumes from the checkpoints in its partial dir; other
stages are not requeued (they fail with submitit's "not requeued" message).

Submitted job ids are appended to <log_dir>/jobs.jsonl (default work_dir/slurm/) for
`runner cancel SPEC` and `runner status`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from runner.executors import StageJob, StageOutcome, run_stage, stage_nproc
from runner.spec import Spec, expand_path
from runner.store import Store, host, now

CHECKPOINTABLE = ("train",)  # stages that resume from their partial dir after a requeue
TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
            "BOOT_FAIL", "DEADLINE", "REVOKED", "SPECIAL_EXIT")
PROBE_S = 10  # timeout of every squeue/sinfo/sacct/scancel call (they hang with no controller)
POLL_S = 1.0  # seconds between polls while following jobs
# sbatch error keywords -> the spec field that most likely caused the rejection
CULPRITS = (("gres", "gpus_per_node (--gpus-per-node) / extra_sbatch.gres"),
            ("generic resource", "gpus_per_node (--gpus-per-node)"),
            ("partition", "partition (--partition)"),
            ("account", "account (--account)"),
            ("qos", "qos (--qos)"),
            ("feature", "constraint (--constraint)"),
            ("constraint", "constraint (--constraint)"),
            ("memory", "mem_gb (--mem)"),
            ("node configuration", "gpus_per_node / cpus_per_task / mem_gb"),
            ("time limit", "timeout_min (--time)"))


class SlurmError(Exception):
    """A Slurm problem the user can fix (printed without a traceback by runner/cli.py)."""


# ----------------------------------------------------------------------------------------------
# resources -> sbatch parameters


def stage_resources(spec: Spec, stage: str) -> dict:
    """{gpus_per_node, cpus_per_task, mem_gb, timeout_min, nproc_per_node} for `stage`: the
    executor's values with executor.stages.<stage> overrides applied (nproc_per_node is 1 for
    the stages that do not run data-parallel)."""
    ex = spec.executor
    res = {k: getattr(ex, k) for k in ("gpus_per_node", "cpus_per_task", "mem_gb", "timeout_min")}
    over = ex.stages.get(stage)
    if over is not None:
        res.update({k: v for k, v in over.model_dump().items()
                    if v is not None and k != "nproc_per_node"})
    res["nproc_per_node"] = stage_nproc(spec, stage)
    return res


def sbatch_params(spec: Spec, stage: str) -> dict:
    """submitit.SlurmExecutor parameters (sbatch names) for one stage of `spec`.

    mem is written as "<N>GB" (SlurmExecutor.update_parameters does not convert). extra_sbatch keys that
    submitit knows are passed as parameters, the rest as `additional_parameters` (verbatim)."""
    from submitit.slurm.slurm import _convert_mem, _get_default_parameters
    ex, res = spec.executor, stage_resources(spec, stage)
    p: dict = dict(job_name=f"eagle3-{spec.name}-{stage}", time=res["timeout_min"], nodes=1,
                   ntasks_per_node=res["nproc_per_node"], cpus_per_task=res["cpus_per_task"],
                   mem=_convert_mem(res["mem_gb"]),
                   setup=[f"export OMP_NUM_THREADS={res['cpus_per_task']}"])
    if res["nproc_per_node"] > 1:  # one failed rank ends the step instead of hanging its peers
        p["srun_args"] = ["--kill-on-bad-exit=1"]
        p["setup"].append("export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}")
    if res["gpus_per_node"]:
        p["gpus_per_node"] = res["gpus_per_node"]
    for k in ("partition", "account", "qos", "constraint"):
        if getattr(ex, k):
            p[k] = getattr(ex, k)
    known = set(_get_default_parameters())
    extra = {}
    for k, v in ex.extra_sbatch.items():
        if k in known:
            p[k] = v
        else:
            extra[k.replace("_", "-")] = v
    if extra:
        p["additional_parameters"] = extra
    return p


def sbatch_script(spec: Spec, stage: str, folder: str | Path | None = None) -> str:
    """The sbatch script submitit would submit for `stage`, generated WITHOUT submitting (no
    Slurm needed). Used by tests and for `--dry-run`-style inspection."""
    from submitit.slurm.slurm import _make_sbatch_string
    p = sbatch_params(spec, stage)
    folder = Path(folder or log_dir(spec) / "<run_id>")
    cmd = f"{sys.executable} -u -m submitit.core._submit {folder}"
    return _make_sbatch_string(command=cmd, folder=folder, **p)


def log_dir(spec: Spec) -> Path:
    """executor.log_dir, default <work_dir>/slurm. Each run submits into a subfolder named
    after its run id (a restarted cluster reuses job ids; one folder would mix results)."""
    ld = spec.executor.log_dir
    return (expand_path(ld) if ld else spec.resolved_work_dir() / "slurm").absolute()


# ----------------------------------------------------------------------------------------------
# cluster probes


def _run(cmd: list[str], timeout: float = PROBE_S) -> subprocess.CompletedProcess | None:
    """Run a Slurm client command with a timeout; None when it is missing or hangs."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None


def require_sbatch() -> None:
    """Raise SlurmError when the Slurm client tools are not on PATH."""
    missing = [b for b in ("sbatch", "srun") if shutil.which(b) is None]
    if missing:
        raise SlurmError(
            f"executor.kind = slurm, but `{missing[0]}` is not on PATH: this machine is not a Slurm "
            "login node (or the Slurm client is not installed). Run from a Slurm login node, or "
            "run here with the local executor: set `executor: {kind: local}` in the spec or pass "
            "-o 'executor={kind: local}'.")


def partitions() -> dict[str, dict] | None:
    """{partition: {default, gres: [..], cpus, mem_mb}} from sinfo; None when sinfo fails."""
    r = _run(["sinfo", "-h", "-o", "%R|%P|%G|%c|%m"])
    if r is None or r.returncode != 0:
        return None
    out: dict[str, dict] = {}
    for line in r.stdout.splitlines():
        name, pname, gres, cpus, mem = (line.split("|") + [""] * 5)[:5]
        d = out.setdefault(name, {"default": pname.endswith("*"), "gres": [], "cpus": 0,
                                  "mem_mb": 0})
        if gres and gres != "(null)":
            d["gres"] += gres.split(",")
        d["cpus"] = max(d["cpus"], _int(cpus))
        d["mem_mb"] = max(d["mem_mb"], _int(mem))
    return out


def _int(s: str) -> int:
    m = re.match(r"\d+", s or "")
    return int(m.group()) if m else 0


def _gpus_in(gres: list[str]) -> int:
    """Most GPUs per node in sinfo gres strings like 'gpu:8', 'gpu:h100:8(S:0-1)'."""
    best = 0
    for g in gres:
        parts = g.split("(")[0].split(":")
        if parts[0] == "gpu":
            best = max(best, _int(parts[-1]) if len(parts) > 1 else 1)
    return best


def preflight(spec: Spec, stages: list[str]) -> None:
    """Checks before anything is submitted: sbatch present, partition exists, GPUs exist.

    Raises SlurmError naming the spec field. Checks that need sinfo are skipped when sinfo does
    not answer (Slurm's own rejection is then surfaced by `submit`)."""
    require_sbatch()
    parts = partitions()
    if not parts:
        return
    ex = spec.executor
    if ex.partition and ex.partition not in parts:
        raise SlurmError(
            f"executor.partition = {ex.partition!r}: no such partition on this cluster (sinfo "
            f"lists: {', '.join(sorted(parts))}). Set executor.partition to one of them, or "
            "leave it out to use the cluster's default partition.")
    name = ex.partition or next((n for n, d in parts.items() if d["default"]), None)
    if name is None:
        return
    have = _gpus_in(parts[name]["gres"])
    for stage in dict.fromkeys(stages):
        res = stage_resources(spec, stage)
        cpus = res["nproc_per_node"] * res["cpus_per_task"]
        if parts[name]["cpus"] and cpus > parts[name]["cpus"]:
            raise SlurmError(
                f"stage {stage}: nproc_per_node {res['nproc_per_node']} x cpus_per_task "
                f"{res['cpus_per_task']} = {cpus} CPUs, but partition {name!r} nodes have "
                f"{parts[name]['cpus']}. Lower executor.cpus_per_task (it is per rank) or "
                "nproc_per_node.")
        want = res["gpus_per_node"]
        if want and want > have:
            where = (f"executor.stages.{stage}.gpus_per_node" if ex.stages.get(stage) and
                     ex.stages[stage].gpus_per_node is not None else "executor.gpus_per_node")
            what = "has no GPUs" if have == 0 else f"has at most {have} GPUs per node"
            raise SlurmError(
                f"{where} = {want} (stage {stage}): partition {name!r} {what} (sinfo gres: "
                f"{','.join(parts[name]['gres']) or 'none'}). Choose a GPU partition "
                f"(executor.partition) or set {where}: {have} for this cluster.")


def _state_query(job_ids: list[str]) -> dict[str, str]:
    if not job_ids:
        return {}
    base = sorted({j.split("_")[0] for j in job_ids})
    out: dict[str, str] = {}
    r = _run(["squeue", "-h", "-r", "-t", "all", "-j", ",".join(base), "-o", "%A|%i|%T"])
    if r is not None and r.returncode == 0:
        for line in r.stdout.splitlines():
            raw, jid, state = (line.split("|") + ["", ""])[:3]
            out[raw.strip()] = out[jid.strip()] = state.strip()
    missing = [j for j in job_ids if j not in out]
    if missing and shutil.which("sacct"):  # finished long ago: accounting, when the cluster has it
        r = _run(["sacct", "-n", "-X", "-P", "-o", "JobIDRaw,JobID,State",
                  *[a for j in missing for a in ("-j", j.split("_")[0])]])
        if r is not None and r.returncode == 0:
            for line in r.stdout.splitlines():
                raw, jid, state = (line.split("|") + ["", ""])[:3]
                state = state.split()[0] if state.strip() else ""
                if state:
                    out.setdefault(raw, state)
                    out.setdefault(jid, state)
    return out


def live_states(job_ids: list[str]) -> dict[str, str]:
    """{job_id: Slurm state} for the ids Slurm still knows (squeue -t all, then sacct).

    Accepts plain ids ("12"), array task ids ("12_3") and raw ids of array tasks. Ids Slurm does
    not know are left out; returns {} when Slurm is absent or does not answer within 10 s."""
    if shutil.which("squeue") is None:
        return {}
    ids = [str(j) for j in job_ids if j and re.fullmatch(r"\d+(_\d+)?", str(j))]
    states = _state_query(ids)
    return {j: states[j] for j in ids if j in states}


# ----------------------------------------------------------------------------------------------
# the job function


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

    submitit calls `checkpoint()` when Slurm signals a timeout or preemption: for CHECKPOINTABLE
    stages it returns the same task, so the job is requeued and the stage resumes from its
    partial dir (train reloads its latest checkpoint there)."""

    job: StageJob

    def __call__(self) -> dict:
        import submitit
        harden_requeue()
        env = submitit.JobEnvironment()
        job = replace(self.job, log_path=str(env.paths.stderr))  # the job's own stderr log
        if env.num_tasks > 1:  # one srun task per rank (data-parallel stage)
            from runner.launch import run_rank, slurm_env
            slurm_env()
            return run_rank(job, env.global_rank, env.num_tasks, env.local_rank)
        return run_stage(job)

    def checkpoint(self, *args, **kwargs):
        if self.job.stage not in CHECKPOINTABLE:
            return None  # submitit: not requeued
        from submitit.core.utils import DelayedSubmission
        os.environ["EAGLE3_STAGE_REQUEUED"] = "1"  # run_stage records "requeued", not "failed"
        return DelayedSubmission(self)


# ----------------------------------------------------------------------------------------------
# the executor


@dataclass
class _Sub:
    """One submitted job as the coordinator follows it."""

    index: int
    sjob: object  # submitit Job
    job_id: str
    t0: float
    done: bool = False
    missing_since: float | None = None
    extra: dict = field(default_factory=dict)


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
            raise self._rejection(e, spec, first.stage, ex.parameters) from None
        t = time.time()
        for i, sj in zip(group, sjobs):
            subs[i] = _Sub(i, sj, str(sj.job_id), t)
            jobs[i].log_path = str(sj.paths.stderr)
        self._record([(jobs[i], subs[i].job_id) for i in group])

    def _rejection(self, e: Exception, spec: Spec, stage: str, params: dict) -> SlurmError:
        """sbatch's own message, verbatim, with the spec field it most likely points at."""
        text = str(e).strip() or type(e).__name__
        if "srun" in text and "detect" in text:
            require_sbatch()
        low = text.lower()
        culprit = next((c for k, c in CULPRITS if k in low), None)
        opts = " ".join(f"--{k.replace('_', '-')}={v}" for k, v in sorted(params.items())
                        if k in ("partition", "gpus_per_node", "cpus_per_task", "mem", "time",
                                 "account", "qos", "constraint", "dependency", "gres"))
        hint = f"\n  caused by executor.{culprit}" if culprit else ""
        return SlurmError(f"sbatch rejected stage {stage}:\n  {text}{hint}\n  sbatch options: "
                          f"{opts}")

    def _record(self, entries: list[tuple[StageJob, str]]) -> None:
        path = log_dir(self.spec) / "jobs.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            for j, jid in entries:
                f.write(json.dumps({"run_id": j.run_id, "id": j.id, "job_id": jid,
                                    "submitted_at": now(), "log": j.log_path}) + "\n")

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
        Store(job.db_path).emit("stages", dict(
            run_id=job.run_id, variant=job.variant, stage=job.stage, cache_key=job.key,
            reason=job.reason, status="failed", started_at=now(), finished_at=now(),
            duration_s=dur, host=host(), job_id=s.job_id, executor="slurm",
            artifact=job.artifact, log_path=job.log_path, error=err[:4000]))

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
                if i not in outcomes and any(a in failed for a in j.after):
                    scancel([subs[i].job_id])
                    failed.add(i)
                    outcomes[i] = StageOutcome(j, "skipped", error="upstream stage failed",
                                               job_id=subs[i].job_id)
                    if on_event:
                        on_event("end", outcomes[i])
            if time.time() - last_probe > 3 * POLL_S:
                states = _state_query([s.job_id for i, s in subs.items() if i not in outcomes])
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


def scancel(job_ids: list[str]) -> None:
    """scancel these jobs (ignores ids Slurm no longer knows)."""
    ids = [j for j in job_ids if j]
    if ids and shutil.which("scancel"):
        _run(["scancel", *ids])


# ----------------------------------------------------------------------------------------------
# runner cancel


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
