"""The train run's evaluations (trainer/recipe.py calls them every stages.train.eval_every steps
and at the end): `evaluate` (loss, per-step top-1 accuracy and the simulated greedy chains of
trainer/acceptance.py on held-out samples), `record_eval` (one evaluation into the run's history
and metrics, and its drafter kept with stages.train.snapshots), `pick` (the evaluation whose
drafter the stage outputs, stages.train.select) and `seen_samples`.

An evaluation never trains: no grad, no aux noise, the drafter back in train mode after it.
Data parallel: the batches are spread round-robin over the ranks and their sums all-reduced, so
every rank gets the single-rank numbers.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from eagle3_runner.runner import dist as D
from eagle3_runner.trainer import acceptance as A
from eagle3_runner.trainer.checkpoint import save_snapshot

if TYPE_CHECKING:
    from eagle3_runner.trainer.recipe import Learner, TrainRun


def evaluate(learner: Learner, source, ids: list[int]) -> dict:
    """Loss, per-step top-1 accuracy and the simulated greedy chains of the drafter on samples
    `ids` of `source` (trainer/sources.py; no grad). chain {n: trainer/acceptance.py summarize}
    for n = 1..K draft steps: the tau and per-position acceptance greedy chain decoding of n
    steps would measure on this text (exact when it is the target's own greedy text, as
    regenerated conversations at temperature 0 are). Data parallel: batch k (of p.batch_size
    samples) runs on rank k % world and the sums are all-reduced, so every rank returns the
    single-rank numbers. One host read per batch (the chain rounds walk the hits on the CPU)."""
    p, model, K = learner.p, learner.model, learner.p.ttt_steps
    model.eval()
    obj = learner.objective()
    steps = list(range(1, K + 1))
    # [3 x K] sums of step loss, correct, count, the loss sum and the batch count, then the
    # rounds histograms of n = 1..K steps (n + 1 bins each)
    tot = torch.zeros(3 * K + 2 + sum(n + 1 for n in steps), dtype=torch.float64)
    with torch.no_grad():
        for k, a in enumerate(range(0, len(ids), p.batch_size)):
            if k % learner.world != learner.rank:
                continue
            batch, tgt = learner.prepare(source.batch(ids[a:a + p.batch_size]))
            with learner.autocast():
                loss, st = obj(batch, tgt)
            hists = A.chain_histograms(st["hit"], st["sup0"], steps)
            tot += torch.cat([torch.stack([st["loss"], st["correct"], st["count"]]).flatten()
                              .cpu(), torch.stack([loss.detach().double().cpu(),
                                                   torch.tensor(1.0, dtype=torch.float64)]),
                              *(torch.from_numpy(hists[n]).double() for n in steps)])
    red = D.all_reduce_sum(tot.to(learner.device)).cpu()
    loss_sum, nb = float(red[3 * K]), int(red[3 * K + 1])
    acc, o, chain = red[:3 * K].view(3, -1), 3 * K + 2, {}
    for n in steps:
        chain[str(n)] = A.summarize(red[o:o + n + 1].numpy())
        o += n + 1
    model.train()
    return {"loss": loss_sum / max(nb, 1), "loss_step": (acc[0] / max(nb, 1)).tolist(),
            "acc_step": (acc[1] / acc[2].clamp_min(1)).tolist(), "chain": chain}


def seen_samples(run: TrainRun, step: int) -> int:
    """Distinct training samples the first `step` optimizer steps have read (each epoch is a
    permutation of the training samples: trainer/sources.py batch_indices)."""
    return min(len(run.train_ids), step * run.ctx.params.batch_size)


def record_eval(run: TrainRun) -> None:
    """Evaluate at the current step; append it to the history (with the samples and sequence
    tokens trained on so far) and record its metrics; with stages.train.snapshots keep this
    step's drafter (`save_snapshot`)."""
    ids, split = run.eval_split
    r = evaluate(run.learner, run.source, ids)
    run.history.append({"step": run.step, "split": split, "samples": seen_samples(run, run.step),
                        "tokens": run.tokens, **r})
    run.ctx.metric(f"{split}_loss", r["loss"], "nats", step=run.step)
    # the learning curve's samples axis (runner/report_curve.py heldout_rows)
    run.ctx.metric(f"{split}_samples", seen_samples(run, run.step), "samples", step=run.step)
    for j, (a, lj) in enumerate(zip(r["acc_step"], r["loss_step"])):
        run.ctx.metric(f"{split}_acc_{j}", a, "fraction", step=run.step)
        run.ctx.metric(f"{split}_loss_{j}", lj, "nats", step=run.step)
    for n, c in r["chain"].items():
        run.ctx.metric(f"{split}_chain_tau_{n}", c["tau"], "tokens/round", step=run.step)
    if run.ctx.params.snapshots:
        save_snapshot(run)


def pick(run: TrainRun) -> dict:
    """The history entry whose drafter the stage outputs (stages.train.select): the last, or
    the highest simulated held-out tau of select_num_steps draft steps (ties: the later step;
    an evaluation with no round counts as the lowest)."""
    p = run.ctx.params
    if p.select == "last":
        return run.history[-1]
    n = str(p.select_num_steps)

    def tau(h):
        t = h.get("chain", {}).get(n, {}).get("tau", float("nan"))
        return -math.inf if t != t else t
    return max(run.history, key=lambda h: (tau(h), h["step"]))
