"""From the spec to sbatch: per-stage resources, submitit.SlurmExecutor parameters, the sbatch
script (generated without a cluster), checks before submitting, and sbatch's rejections turned
into the spec field that caused them (mapping: runner/slurm/__init__.py)."""

from __future__ import annotations

import sys
from pathlib import Path

from eagle3_runner.runner.errors import SlurmError
from eagle3_runner.runner.files import expand_path
from eagle3_runner.runner.job import stage_nproc
from eagle3_runner.runner.slurm.probes import gpus_in, partitions, require_sbatch
from eagle3_runner.runner.spec.schema import Spec

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
    have = gpus_in(parts[name]["gres"])
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


def rejection(e: Exception, stage: str, params: dict) -> SlurmError:
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
