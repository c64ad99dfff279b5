"""The train stage's counts, known before it runs: the samples it trains on and its optimizer
steps. A leaf module (no imports of the project), so that the plan's disk estimate
(runner/disk.py), the stage registry's checks (runner/stages.py), the trainer (trainer/recipe.py,
trainer/sources.py) all count alike without importing one another."""

from __future__ import annotations

import math


def train_samples(p, n: int) -> int:
    """The samples the train stage trains on when its input holds `n` (p: stages.train;
    trainer/sources.py split_samples): n less eval_samples held out, at most num_samples."""
    avail = max(0, n - p.eval_samples)
    return avail if p.num_samples is None else min(avail, p.num_samples)


def optimizer_steps(p, n_train: int) -> int:
    """The train stage's optimizer steps over n_train samples, its schedule's total
    (trainer/recipe.py setup): epochs x ceil(n_train / batch_size) rounded up, at least 1, at
    most max_steps (stages.train.max_minutes may stop the run sooner still)."""
    total = max(1, math.ceil(p.epochs * math.ceil(n_train / p.batch_size)))
    return min(total, p.max_steps) if p.max_steps else total
