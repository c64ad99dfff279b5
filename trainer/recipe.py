"""The training recipe of the EAGLE-3 drafter (stage `train`, jobs/train.py), top to bottom:
`setup` (sample source, draft vocab, drafter, AdamW), `train_step`, the loop (`train`), `finish`
(the outputs); the loop evaluates (trainer/evaluation.py `evaluate`, `record_eval`, `pick`) and
checkpoints (trainer/checkpoint.py `checkpoint`, `resume`, the drafter's files). A run's state
lives in one place, `TrainRun` (its `Learner` holds what a step uses). The objective: the fast
step of trainer/fast_step.py (packed rows, Triton kernels on CUDA) by default; the reference of
trainer/objective.py (its alignment and loss, which the fast step equals: tests/test_ttt.py) when
Learner.impl is None (tests, the bench baseline).

Inputs (trainer/sources.py): ctx.inputs["extract"] (targets/features.py format), or with
stages.train.features: online the target itself, run on each batch (ctx.inputs["regenerate"]
or the spec's data give the conversations). Outputs in ctx.out_dir:
  draft.safetensors   Eagle3Draft.state_dict(): fc.weight, midlayer.*, norm.weight,
                      lm_head.weight, d2t (int64 offsets), t2d (bool) -- float32
  draft_config.json   DraftConfig.as_dict() (load with DraftConfig(**json))
  train_metrics.json  summary, eval history, vocab stats
  vocab/vocab-<key>.pt  the cached draft-vocab mapping (trainer/vocab.py)
  ckpt.pt             the resumable checkpoint (removed when training completes)
  features.json, target_config.json  online only: the capture manifest and the target's config
                      (export reads them here instead of from an extract artifact)

Host syncs: a step queues its work and returns device tensors; the loop reads them once every
SYNC_EVERY steps (and before each evaluation, checkpoint and the end). There it fails with a
StageError at the first non-finite loss or gradient norm, naming that step and its batch's
sample ids, before any checkpoint could keep the broken weights. Host-to-device copies go
through pinned memory (targets/capture.py h2d), so nothing else in a step waits for the GPU;
with stages.train.prefetch the next step's batch (online: its target forward) is enqueued on a
second CUDA stream before this step's training (trainer/sources.py Prefetch).

Data parallel (ctx.world_size > 1, launched by runner/launch.py; DDP over NCCL/gloo): batch_size
stays the GLOBAL batch. Rank r takes samples r::world of each step's batch; the per-step token
counts are all-reduced before the loss, so each rank's loss is its share of the global token
mean and DDP's gradient average (x world) is exactly the single-rank gradient (up to float
summation order). Eval batches are spread round-robin and their sums all-reduced. Rank 0 alone
writes the vocab cache (first), checkpoints and outputs; every rank resumes from the same ckpt.pt.
Online, each rank runs its own copy of the target on its own slice of each batch.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path
from functools import partial
from typing import Any, Callable, NamedTuple

import torch

from eagle3_runner.runner import dist as D
from eagle3_runner.trainer import fast_step as F
from eagle3_runner.trainer import vocab as V
from eagle3_runner.models.draft_model import DraftConfig, Eagle3Draft
from eagle3_runner.trainer.checkpoint import (CKPT, checkpoint, checkpoint_due, completed, resume,
                                              save_drafter, snapshot_path)
from eagle3_runner.trainer.evaluation import pick, record_eval, seen_samples
from eagle3_runner.trainer.sources import Prefetch, batch_indices, open_source, split_samples
from eagle3_runner.trainer.objective import (Loss, TTTObjective, aux_noise, loss_counts, make_batch,
                                             target_dist, to_device, ttt_loss)
from eagle3_runner.runner.errors import StageError
from eagle3_runner.runner.files import atomic_write
from eagle3_runner.runner.stage import StageContext
from eagle3_runner.runner.stages import CHECKPOINT_FIELDS
from eagle3_runner.runner.train_counts import optimizer_steps

SYNC_EVERY = 32  # optimizer steps between host reads of the step results (module docstring)


# ---------------------------------------------------------------------------------------------
# the run's state: what a step uses, and the run around it


@dataclass
class Learner:
    """What one optimizer step uses: the drafter (and its DDP wrapper when data parallel), AdamW,
    the TTT settings p (stages.train: ttt_steps, step_decay, grad_clip, batch_size, loss, lk_eta,
    noise_std), the target's
    head and the draft vocab (used [Vd] target ids, t2d [V] bool) on `device`, the target's
    RMSNorm eps, and impl: the fast step's paths (trainer/fast_step.py Impl; head = its split_head)
    or None for the reference objective (trainer/objective.py; head = {norm [Ht], lm_head [V, Ht]})."""

    model: Eagle3Draft
    opt: torch.optim.Optimizer
    p: Any
    head: dict
    used: torch.Tensor
    t2d: torch.Tensor
    eps: float
    device: torch.device
    ddp: Any = None  # DDP(TTTObjective(model)) when world > 1
    rank: int = 0
    world: int = 1
    impl: Any = None  # trainer/fast_step.py Impl; None = the reference objective

    def objective(self) -> TTTObjective:
        """The drafter and its loss as one module (what DDP wraps)."""
        kind = Loss.of(self.p)
        loss = (partial(ttt_loss, loss=kind) if self.impl is None else
                partial(F.fast_ttt_loss, impl=self.impl, loss=kind))
        return TTTObjective(self.model, self.p.ttt_steps, self.p.step_decay, loss)

    def prepare(self, samples: list[dict]) -> tuple[dict, Any]:
        """Samples -> (batch on the device, the target's side): the fast path's packed rows and
        TargetLogits, or the reference's padded batch and target_dist."""
        K = self.p.ttt_steps
        if self.impl is not None:
            return F.prepare(samples, K, self.head, self.eps, self.device)
        batch = to_device(make_batch(samples, K), self.device)
        return batch, target_dist(batch["tgt_hidden"], self.head, self.used, self.t2d, self.eps)

    def counts(self, batch: dict, tgt) -> torch.Tensor:
        """Trained positions per TTT step [K] int64 (the loss denominators)."""
        fn = loss_counts if self.impl is None else F.fast_loss_counts
        return fn(batch, tgt, self.p.ttt_steps)

    def autocast(self):
        """bf16 autocast on CUDA; a no-op context on the CPU (float32)."""
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return torch.autocast("cpu", enabled=False)


@dataclass
class TrainRun:
    """One run of the train stage: its inputs and settings, the learner, and its progress
    (step .. history: what `checkpoint` saves and `resume` restores)."""

    ctx: StageContext
    source: Any  # trainer/sources.py Offline | Online
    cfg: DraftConfig
    train_ids: list[int]
    eval_ids: list[int]
    vstats: dict  # draft vocab statistics (trainer/vocab.py)
    fp: str  # fingerprint of the settings; checkpoints and finished outputs carry it
    total: int  # optimizer steps of the whole run
    learner: Learner
    sched: Any  # LambdaLR over learner.opt
    step: int = 0
    tokens: int = 0  # sequence tokens trained on
    train_s: float = 0.0  # seconds in optimizer steps (eval and checkpoints excluded)
    history: list = field(default_factory=list)  # evaluations, oldest first
    pending: list = field(default_factory=list)  # (step, StepOut) not yet read on the host
    budgeted: bool = False  # total already shrunk to stages.train.max_minutes (fit_budget)
    budget_s: list = field(default_factory=list)  # (step, train_s, tokens) at the host reads

    @property
    def out(self) -> Path:
        return Path(self.ctx.out_dir)

    @property
    def eval_split(self) -> tuple[list[int], str]:
        """(samples, name) evaluated: the held-out ones, else the training set."""
        return (self.eval_ids, "eval") if self.eval_ids else (self.train_ids, "trainset")

# ---------------------------------------------------------------------------------------------
# setup


def _device(ctx) -> torch.device:
    want = ctx.spec.target.device
    if want == "cuda" and not torch.cuda.is_available():
        raise StageError("target.device = 'cuda', but no CUDA device is visible to the train job.")
    if want != "cpu" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())  # the launcher set it per rank
    return torch.device("cpu")


def target_head_init(head: dict, used: torch.Tensor, device: torch.device
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafter's lm_head and final norm under stages.train.init_head: target. head: the
    target's {lm_head [V, H], norm [H], ...} (source.head()); used [Vd]: the draft vocab's target
    ids (V.used_ids(d2t), target_id = i + d2t[i]). Returns (lm_head [Vd, H] = head["lm_head"]
    [used], norm [H] = head["norm"]), float32 copies on `device`. The drafter applies its norm
    right before lm_head (`lm_head(norm(out))`) as the target does, so both start as the target's
    own head restricted to the draft vocab. Convention: vLLM speculators Eagle3DraftModel: draft
    lm_head = verifier lm_head[t2d]."""
    W = head["lm_head"]
    rows = W[used.to(W.device)].to(device=device, dtype=torch.float32, copy=True)
    return rows, head["norm"].to(device=device, dtype=torch.float32, copy=True)


def lr_lambda(step: int, warmup: int, total: int) -> float:
    """Linear warmup over `warmup` steps, then cosine decay to 0 at `total`."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))


def setup(ctx: StageContext, impl: Any = "spec") -> TrainRun:
    """Open the sample source (trainer/sources.py), build (or load) the draft vocab, initialise
    the drafter (seeded by stages.train.seed; its lm_head and final norm from the target's with
    stages.train.init_head: target), AdamW and its schedule. impl: the fast step's
    paths ("spec" = stages.train.kernels through trainer/fast_step.py Impl.named; "best" =
    Impl.best(device)) or None (the reference objective).
    Raises StageError for unusable inputs."""
    p, spec, out = ctx.params, ctx.spec, Path(ctx.out_dir)
    rank, world = D.check(ctx)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    source = open_source(ctx)
    t_source = time.perf_counter()
    tcfg = source.target_config
    cfg = DraftConfig.from_spec(spec, tcfg)
    if cfg.hidden_size != cfg.target_hidden_size:
        raise StageError(f"drafter.hidden_size = {cfg.hidden_size} differs from the target's "
                         f"{cfg.target_hidden_size}: the drafter reuses the target's frozen "
                         "embedding, so this trainer needs equal sizes. Remove drafter.hidden_size.")
    train_ids, eval_ids = split_samples(len(source), p)
    eps = float(tcfg.get("rms_norm_eps") or 1e-5)
    device = _device(ctx)

    # draft vocab (cached under a content hash that includes both sizes)
    key = V.cache_key(source.identity, train_ids, cfg.draft_vocab_size, cfg.vocab_size)
    d2t, t2d, vstats = D.rank0_first(rank, lambda: V.build_or_load(
        out / "vocab", key, lambda: source.token_masks(train_ids),
        cfg.draft_vocab_size, cfg.vocab_size))
    if vstats["supervised_tokens"] == 0:
        raise StageError(f"{source.where}: the loss mask of the {len(train_ids)} training "
                         "samples is all zero (no assistant tokens found), so there is nothing "
                         "to train. Check target.chat_template and the data.")

    t_vocab = time.perf_counter()
    head = {k: v.to(device) for k, v in source.head().items()}
    if head["lm_head"].shape[0] != cfg.vocab_size:
        raise StageError(f"{source.where}: the target's lm_head has {head['lm_head'].shape[0]} "
                         f"rows, its config's vocab_size is {cfg.vocab_size}. Re-run extract.")
    torch.manual_seed(p.seed)
    random.seed(p.seed)
    model = Eagle3Draft(cfg, head.pop("embed_tokens").to(torch.float32, copy=True))
    model.d2t.copy_(d2t)
    model.t2d.copy_(t2d)
    model.to(device).train()
    if impl == "spec":
        impl = F.Impl.named(p.kernels, device)
    elif impl == "best":
        impl = F.Impl.best(device)
    used = V.used_ids(d2t).to(device)
    if p.init_head == "target":  # before the optimizer; resume() loads a checkpoint over it
        lm_head, norm = target_head_init(head, used, device)
        with torch.no_grad():
            model.lm_head.weight.copy_(lm_head)
            model.norm.weight.copy_(norm)
    if impl is not None:
        head = F.split_head(head, used)
    opt = torch.optim.AdamW(model.parameters(), lr=p.lr, weight_decay=p.weight_decay)
    total = optimizer_steps(p, len(train_ids))  # the plan's count too (runner/stages.py)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_lambda(s, p.warmup_steps, total))
    fp = hashlib.sha256(json.dumps({"train": p.model_dump(exclude=set(CHECKPOINT_FIELDS)),
                                    "draft": cfg.as_dict(), "vocab": key,
                                    "device": device.type, "impl": impl}, sort_keys=True,
                                   default=str).encode()).hexdigest()[:16]
    learner = Learner(model, opt, p, head, used, t2d.to(device), eps, device, None, rank, world,
                      impl)
    if world > 1:
        learner.ddp = D.ddp(learner.objective(), device)
    if rank == 0:  # where a time-boxed call's minutes go before the box (max_minutes) starts
        t = time.perf_counter()
        print(f"train: set-up {t - t0:.1f} s: samples {t_source - t0:.1f} s (read, tokenise), "
              f"draft vocab {t_vocab - t_source:.1f} s, drafter and optimizer {t - t_vocab:.1f} s",
              flush=True)
    return TrainRun(ctx, source, cfg, train_ids, eval_ids, vstats, fp, total, learner, sched)

# ---------------------------------------------------------------------------------------------
# one optimizer step (the objective: trainer/objective.py; the fast step: trainer/fast_step.py)


class StepOut(NamedTuple):
    """What a step returns, without a host sync: loss and grad norm (before clipping) as device
    scalars, tokens an int (one rank) or a device scalar (data parallel, all-reduced)."""
    loss: torch.Tensor
    gnorm: torch.Tensor
    tokens: Any


def train_step(learner: Learner, samples: list[dict], empty: bool = False,
               mark: Callable[[str], None] | None = None) -> StepOut:
    """One optimizer step on `samples` (no LR-scheduler step): batch, target distribution, the
    aux noise (p.noise_std: training steps only, never `evaluate`), TTT loss, backward, grad
    clipping (p.grad_clip), AdamW. No host sync on the fast path.

    Data parallel (learner.ddp set): `samples` = this rank's slice of the global batch. The
    per-step counts are summed over ranks first and the backward loss is scaled by the world
    size, so DDP's gradient AVERAGE equals the gradient of the global loss. empty = this rank has no
    sample this step: `samples` is a stand-in whose mask is cleared (it adds exactly 0 but joins
    the all-reduce). mark (profiles, scripts/bench/profile_train.py): called with the name of
    each phase as it is enqueued: "prepare", "forward", "backward", "optimizer".
    Returns StepOut(global loss, grad norm before clipping, global sequence tokens)."""
    p = learner.p
    mark = mark or (lambda _name: None)
    batch, tgt = learner.prepare(samples)
    if p.noise_std:
        batch["aux"] = aux_noise(batch["aux"], p.noise_std)
    mark("prepare")
    if empty:
        batch["pmask"].zero_()
        batch["tokens"] = 0
    learner.opt.zero_grad(set_to_none=True)
    if learner.ddp is None:
        with learner.autocast():
            loss, _ = learner.objective()(batch, tgt)
        mark("forward")
        loss.backward()
        ntok = batch["tokens"]
    else:
        denom = D.all_reduce_sum(learner.counts(batch, tgt))
        with learner.autocast():
            loss, _ = learner.ddp(batch, tgt, denom)
        mark("forward")
        (loss * learner.world).backward()
        ntok = torch.tensor(float(batch["tokens"]), device=learner.device, dtype=torch.float64)
        red = D.all_reduce_sum(torch.stack([loss.detach().double(), ntok]))
        loss, ntok = red[0], red[1]
    mark("backward")
    gnorm = torch.nn.utils.clip_grad_norm_(learner.model.parameters(), p.grad_clip)
    learner.opt.step()
    mark("optimizer")
    return StepOut(loss.detach(), gnorm.detach(), ntok)


def step_ids(run: TrainRun, step: int) -> tuple[list[int], bool]:
    """This rank's sample ids of optimizer step `step` (its slice of the global batch, or the
    batch's first sample as a stand-in when the slice is empty) and whether it is empty."""
    p, learner = run.ctx.params, run.learner
    idx = batch_indices(step, len(run.train_ids), p.batch_size, p.seed)
    mine = idx[learner.rank::learner.world]
    return [run.train_ids[i] for i in (mine or idx[:1])], not mine


def drain(run: TrainRun) -> tuple[float, int]:
    """Read the pending steps' results on the host (one sync) and add their tokens.
    Returns (their mean loss, their count). Raises StageError at the first step whose loss or
    gradient norm is not finite, naming the step and its global batch's sample ids."""
    if not run.pending:
        return 0.0, 0
    vals = torch.stack([torch.stack([o.loss.double(), o.gnorm.double()])
                        for _, o in run.pending]).cpu()
    bad = (~torch.isfinite(vals)).any(1).nonzero()
    if bad.numel():
        step, i = run.pending[int(bad[0])][0], int(bad[0])
        p = run.ctx.params
        ids = [run.train_ids[j] for j in batch_indices(step - 1, len(run.train_ids),
                                                        p.batch_size, p.seed)]
        raise StageError(
            f"train: non-finite {'loss' if not torch.isfinite(vals[i, 0]) else 'gradient norm'} "
            f"at step {step} (loss {float(vals[i, 0])}, grad norm {float(vals[i, 1])}); that "
            f"step's batch holds samples {ids} (dataset order, as extract and data number "
            "them). Lower stages.train.lr or raise warmup_steps, or check those samples.")
    run.tokens += sum(int(o.tokens) for _, o in run.pending)
    n = len(run.pending)
    run.pending.clear()
    return float(vals[:, 0].sum()), n

# ---------------------------------------------------------------------------------------------
# the loop


def fit_budget(run: TrainRun, budget_s: float) -> None:
    """Shrink run.total to the steps that fit `budget_s` seconds of optimizer steps, from the
    step time measured since the first host read (the first SYNC_EVERY steps hold the compile).
    Deterministic for a given measured time; decided once (a resumed run keeps the decision)."""
    first = next((st for st in run.budget_s if st[0] >= SYNC_EVERY), None)
    if first is None or run.step <= first[0]:
        return
    per_step = (run.train_s - first[1]) / (run.step - first[0])
    fit = run.step + int(max(0.0, budget_s - run.train_s) / max(per_step, 1e-9))
    run.total, run.budgeted = max(run.step, min(run.total, fit)), True
    print(f"train: stages.train.max_minutes = {budget_s / 60:g}: {per_step * 1000:.1f} ms per "
          f"step -> {run.total} steps", flush=True)


def steady_rate(run: TrainRun) -> float:
    """Sequence tokens per second of optimizer steps after the first host read at or past
    SYNC_EVERY steps (of this process: a resumed run counts from its own), i.e. without the
    first steps' compilation, which tokens_per_s includes; 0.0 when there is no later read."""
    first = next((st for st in run.budget_s if st[0] >= SYNC_EVERY), None)
    if first is None or run.train_s <= first[1]:
        return 0.0
    return (run.tokens - first[2]) / (run.train_s - first[1])


def train(ctx: StageContext, stop_at: int | None = None, impl: Any = "spec") -> dict:
    """Train the drafter of ctx.spec on its sample source (trainer/sources.py); resume from
    ctx.out_dir/ckpt.pt. impl: as `setup`.

    stop_at (tests only): return None after that many optimizer steps, as if the job had been
    killed there (no checkpoint is written at that point).
    Data parallel when ctx.world_size > 1 (see the module docstring); every rank returns the
    same summary, rank 0 writes the files.
    Raises StageError for unusable inputs (no samples, no supervised tokens, hidden mismatch)
    and at the first non-finite loss or gradient norm (`drain`)."""
    from tqdm import tqdm
    run = setup(ctx, impl)
    done = completed(run.out, run.fp)
    D.barrier()  # every rank has looked before rank 0 may write anything below
    if done is not None:  # finished before, but the runner never finalized the artifact
        return done
    run.sched.lr_lambdas[0] = lambda s: lr_lambda(s, ctx.params.warmup_steps, run.total)
    resume(run)
    learner, p = run.learner, ctx.params
    if learner.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(learner.device)
    bar = tqdm(total=run.total, initial=run.step, desc="train", unit="step",
               disable=learner.rank != 0)
    feed = Prefetch(run.source, learner.device) if p.prefetch else None
    run_loss, run_n, t0 = 0.0, 0, time.perf_counter()
    saved = time.monotonic()  # of the last checkpoint (stages.train.checkpoint_minutes)
    while run.step < run.total:
        if stop_at is not None and run.step >= stop_at:
            bar.close()
            return None  # type: ignore[return-value]
        ids, empty = step_ids(run, run.step)
        if feed is None:
            samples = run.source.batch(ids)
        else:
            samples = feed.batch(ids, step_ids(run, run.step + 1)[0]
                                 if run.step + 1 < run.total else None)
        out = train_step(learner, samples, empty=empty)
        run.sched.step()
        run.step += 1
        run.pending.append((run.step, out))
        bar.update(1)
        log = run.step % p.eval_every == 0 or run.step == run.total
        ckpt = run.step % p.checkpoint_every == 0
        sync = log or ckpt or run.step % SYNC_EVERY == 0
        ckpt = (ckpt or checkpoint_due(run, saved, sync)) and run.step < run.total
        if sync or ckpt:
            loss_sum, n = drain(run)  # the host sync: the steps so far are done
            run.train_s += time.perf_counter() - t0
            run.budget_s.append((run.step, run.train_s, run.tokens))
            run_loss, run_n = run_loss + loss_sum, run_n + n
            bar.set_postfix(loss=f"{loss_sum / max(n, 1):.3f}", gnorm=f"{float(out.gnorm):.2f}")
            if p.max_minutes and not run.budgeted and run.step >= 2 * SYNC_EVERY:
                fit_budget(run, p.max_minutes * 60)
                bar.total = run.total
                log = log or run.step == run.total
            if log:
                ctx.metric("train_loss", run_loss / run_n, "nats", step=run.step)
                ctx.metric("lr", run.sched.get_last_lr()[0], "", step=run.step)
                run_loss, run_n = 0.0, 0
                record_eval(run)
            if ckpt:
                checkpoint(run)
                saved = time.monotonic()
            t0 = time.perf_counter()  # eval and checkpoint time excluded
    bar.close()
    if not run.history or run.history[-1]["step"] != run.step:
        record_eval(run)
    return finish(run)

# ---------------------------------------------------------------------------------------------
# finish


def _peak_mem_mib(device: torch.device) -> tuple[float, str]:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, "cuda_max_allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "cpu_process_max_rss"


def finish(run: TrainRun) -> dict:
    """The run's summary {name: (value, unit)}; rank 0 writes draft.safetensors,
    draft_config.json and train_metrics.json and removes ckpt.pt."""
    learner, out = run.learner, run.out
    peak, peak_kind = _peak_mem_mib(learner.device)
    last = pick(run)
    if last["step"] != run.step:  # select: tau picked an earlier evaluation's drafter
        from safetensors.torch import load_file
        learner.model.load_state_dict(load_file(str(snapshot_path(out, last["step"]))))
    summary = {"final_loss": (last["loss"], "nats"), "train_steps": (last["step"], "steps"),
               "train_samples": (seen_samples(run, last["step"]), "samples"),  # < all:
               # max_steps/budget, or an earlier step picked
               "steps_run": (run.step, "steps"),
               "tokens_per_s": (run.tokens / run.train_s if run.train_s else 0.0, "tok/s"),
               "peak_mem_mib": (peak, "MiB"),
               "draft_vocab_coverage": (run.vstats["coverage"], "fraction"),
               "draft_vocab_padded": (run.vstats["padded"], "tokens")}
    if steady := steady_rate(run):  # absent, not 0, when no host read came after SYNC_EVERY
        summary["steady_tokens_per_s"] = (steady, "tok/s")
    for j, a in enumerate(last["acc_step"]):
        summary[f"acc_{j}"] = (a, "fraction")
    for n, c in last.get("chain", {}).items():
        summary[f"chain_tau_{n}"] = (c["tau"], "tokens/round")
    if learner.rank != 0:
        D.barrier()  # rank 0 writes the outputs
        return summary
    save_drafter(run, out / "draft.safetensors")
    atomic_write(out / "draft_config.json", json.dumps(run.cfg.as_dict(), indent=1))
    atomic_write(out / "train_metrics.json", json.dumps(
        {"summary": {k: v[0] for k, v in summary.items()},
         "summary_units": {k: v[1] for k, v in summary.items()}, "peak_mem_kind": peak_kind,
         "eval_split": run.eval_split[1], "history": run.history, "vocab": run.vstats,
         "selected": {"step": last["step"], "by": run.ctx.params.select,
                      "num_steps": run.ctx.params.select_num_steps},
         "device": learner.device.type,
         "tokens_note": "tokens/s = sequence tokens per second of optimizer steps (each token "
                        "passes through all TTT steps); eval and checkpoint time excluded",
         "fingerprint": run.fp}, indent=1))
    (out / CKPT).unlink(missing_ok=True)  # complete: the artifact is the drafter, not the optimizer
    D.barrier()
    return summary
