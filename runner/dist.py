"""Data-parallel helpers for the stages that run with several ranks on one node (extract, train).

The process group is set up by the launcher (runner/launch.py: local spawn, torchrun, or srun
tasks of one Slurm job); a stage only reads ctx.rank / ctx.world_size and calls these helpers.
With one rank (no process group) every helper is a no-op, so the single-process path is unchanged.

Backend: "cpu:gloo,cuda:nccl" when CUDA is present (NCCL for device tensors, gloo for Python
objects and CPU tensors), plain gloo otherwise (the CPU tests run 2 gloo ranks).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from eagle3_runner.runner.errors import StageError


def active() -> bool:
    """A process group with more than one rank is initialised."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def check(ctx) -> tuple[int, int]:
    """(rank, world_size) of ctx, checked against the process group.

    Raises StageError when ctx asks for several ranks but no matching process group exists (the
    stage was called directly instead of through the launcher)."""
    if ctx.world_size <= 1:
        return 0, 1
    if not active() or dist.get_world_size() != ctx.world_size or dist.get_rank() != ctx.rank:
        raise StageError(f"stage {ctx.stage}: rank {ctx.rank} of {ctx.world_size}, but no matching "
                         "torch.distributed process group is initialised; launch it with "
                         "`python -m eagle3_runner.runner.launch --nproc N JOBFILE` (or torchrun / srun).")
    return ctx.rank, ctx.world_size


def barrier() -> None:
    if active():
        dist.barrier()


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum `t` over ranks in place (a device tensor under NCCL) and return it."""
    if active():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_gather_object(obj: Any) -> list:
    """[obj of rank 0, obj of rank 1, ...] (picklable objects; [obj] with one rank)."""
    if not active():
        return [obj]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def rank0_first(rank: int, fn: Callable[[], Any]) -> Any:
    """Run fn on rank 0, then (after a barrier) on the other ranks: for work that writes a
    shared cache file once (the draft vocab, a converted target) which the others then read."""
    if rank == 0:
        out = fn()
        barrier()
        return out
    barrier()
    return fn()


def ddp(module: torch.nn.Module, device: torch.device):
    """DistributedDataParallel over `module` without per-forward buffer broadcasts (the
    drafter's d2t, t2d and frozen target embedding, 4.7 GB in float32 for Kimi, are equal on
    every rank). Newer torch names the option `forward_sync_buffers`, older `broadcast_buffers`."""
    import inspect
    from torch.nn.parallel import DistributedDataParallel as DDP
    kw = ({"forward_sync_buffers": False} if "forward_sync_buffers" in
          inspect.signature(DDP.__init__).parameters else {"broadcast_buffers": False})
    return DDP(module, device_ids=[device.index] if device.type == "cuda" else None, **kw)
