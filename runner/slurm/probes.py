"""Asking Slurm: squeue/sinfo/sacct/scancel, each with a timeout (they hang when no controller
answers), and what their answers mean. No submitit here."""

from __future__ import annotations

import re
import shutil
import subprocess

from eagle3_runner.runner.errors import SlurmError

TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
            "BOOT_FAIL", "DEADLINE", "REVOKED", "SPECIAL_EXIT")
PROBE_S = 10  # timeout of every squeue/sinfo/sacct/scancel call (they hang with no controller)


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


def gpus_in(gres: list[str]) -> int:
    """Most GPUs per node in sinfo gres strings like 'gpu:8', 'gpu:h100:8(S:0-1)'."""
    best = 0
    for g in gres:
        parts = g.split("(")[0].split(":")
        if parts[0] == "gpu":
            best = max(best, _int(parts[-1]) if len(parts) > 1 else 1)
    return best


def state_query(job_ids: list[str]) -> dict[str, str]:
    """{job id: Slurm state} from squeue -t all, then sacct for the ids squeue no longer knows
    (plain, array-task and raw ids). Slurm must be present (live_states checks)."""
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
    states = state_query(ids)
    return {j: states[j] for j in ids if j in states}


def scancel(job_ids: list[str]) -> None:
    """scancel these jobs (ignores ids Slurm no longer knows)."""
    ids = [j for j in job_ids if j]
    if ids and shutil.which("scancel"):
        _run(["scancel", *ids])
