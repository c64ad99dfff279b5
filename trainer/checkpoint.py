"""What a train run keeps on disk and reads back (trainer/recipe.py runs it): the resumable
checkpoint ckpt.pt (`checkpoint`, `resume`, `checkpoint_due`: stages.train.checkpoint_every and
checkpoint_minutes), the drafter's safetensors (`save_drafter`: draft.safetensors and, with
stages.train.snapshots, one per evaluation under snapshots/, `snapshot_path`), and the summary
of a run that finished before (`completed`).

Every file carries the run's fingerprint (TrainRun.fp: the settings without the checkpoint
fields, the drafter's config, the draft vocab, the device, the step's kernels), so a file written
for other settings is never resumed from (ckpt.pt) nor taken as done (train_metrics.json). Data
parallel: rank 0 writes, every rank reads the same ckpt.pt.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from eagle3_runner.runner import dist as D
from eagle3_runner.runner.bench_curve import SNAPSHOTS, snapshot_name
from eagle3_runner.runner.files import atomic_path
from eagle3_runner.runner.stages import stage_kind

if TYPE_CHECKING:
    from eagle3_runner.trainer.recipe import TrainRun

CKPT = stage_kind("train").resume_file  # ckpt.pt; the plan looks for it (runner/stages.py)


def completed(out: Path, fp: str) -> dict | None:
    """The summary of a finished run with this fingerprint in `out`, else None."""
    try:
        m = json.loads((out / "train_metrics.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if m.get("fingerprint") != fp or not (out / "draft.safetensors").exists() or (out / CKPT).exists():
        return None
    return {k: (v, m.get("summary_units", {}).get(k, "")) for k, v in m["summary"].items()}


def snapshot_path(out: Path, step: int) -> Path:
    """Where the drafter of optimizer step `step` is kept (stages.train.snapshots):
    snapshots/step-NNNNNN.safetensors (runner/bench_curve.py, the layout export reads too)."""
    return Path(out) / SNAPSHOTS / f"{snapshot_name(step)}.safetensors"


def save_drafter(run: TrainRun, path: Path, **meta) -> None:
    """The drafter's state dict (Eagle3Draft.state_dict(), on the CPU) as safetensors at `path`,
    written atomically, with the format and the run's fingerprint (and `meta`) in its header:
    draft.safetensors and every kept snapshot."""
    from safetensors.torch import save_file
    sd = {k: v.detach().to("cpu").contiguous() for k, v in run.learner.model.state_dict().items()}
    with atomic_path(path) as tmp:
        save_file(sd, str(tmp), metadata={"format": "eagle3-draft/1", "fingerprint": run.fp,
                                          **meta})


def save_snapshot(run: TrainRun) -> None:
    """Keep the drafter of the current step (rank 0; the ranks hold the same weights)."""
    if run.learner.rank != 0:
        return
    path = snapshot_path(run.out, run.step)
    path.parent.mkdir(exist_ok=True)
    save_drafter(run, path, step=str(run.step))

def _rng_state() -> dict:
    import numpy as np
    st = {"torch": torch.get_rng_state(), "python": random.getstate(),
          "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def _set_rng_state(st: dict) -> None:
    import numpy as np
    torch.set_rng_state(st["torch"])
    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


def checkpoint_due(run: TrainRun, since: float, at_sync: bool) -> bool:
    """Whether stages.train.checkpoint_minutes have passed since `since` (time.monotonic() of the
    last checkpoint, or of the loop's start): checked at every step on one rank; data parallel,
    only at a host sync (`at_sync`), where the ranks agree through one all-reduce (any rank
    late = all checkpoint), so that they all reach checkpoint()'s barrier together."""
    minutes = run.ctx.params.checkpoint_minutes
    if minutes is None:
        return False
    late = time.monotonic() - since >= minutes * 60
    if run.learner.world == 1:
        return late
    if not at_sync:
        return False
    flag = torch.tensor([float(late)], device=run.learner.device)
    return bool(D.all_reduce_sum(flag).item() > 0)


def checkpoint(run: TrainRun) -> None:
    """Save ckpt.pt atomically (rank 0: the ranks hold identical weights and optimizer state
    under DDP), with the resolved spec inside; every rank waits for it. Call `drain` first."""
    if run.learner.rank == 0:
        with atomic_path(run.out / CKPT) as tmp:
            torch.save({"model": run.learner.model.state_dict(),
                        "opt": run.learner.opt.state_dict(), "sched": run.sched.state_dict(),
                        "rng": _rng_state(), "step": run.step, "tokens": run.tokens,
                        "train_s": run.train_s, "history": run.history, "fingerprint": run.fp,
                        "total": run.total, "budgeted": run.budgeted,
                        "spec": run.ctx.spec.model_dump(mode="json")}, tmp)
    D.barrier()


def resume(run: TrainRun) -> None:
    """Restore model, optimizer, schedule, RNG and progress from ckpt.pt when it was written
    for these settings (its fingerprint); otherwise start from step 0."""
    ck = run.out / CKPT
    if not ck.exists():
        return
    st = torch.load(ck, map_location="cpu", weights_only=False)
    if st.get("fingerprint") != run.fp:
        print(f"train: ignoring {ck}: written for other settings (fingerprint mismatch)")
        return
    run.learner.model.load_state_dict(st["model"])
    run.learner.opt.load_state_dict(st["opt"])
    run.sched.load_state_dict(st["sched"])
    _set_rng_state(st["rng"])
    run.step, run.tokens, run.train_s, run.history = (st["step"], st["tokens"], st["train_s"],
                                                      st["history"])
    run.total, run.budgeted = st.get("total", run.total), st.get("budgeted", False)
