"""Stage `train`: TTT training of the EAGLE-3 drafter. The recipe (setup, step, the loop, finish)
reads top to bottom in trainer/recipe.py, its evaluations in trainer/evaluation.py and its
checkpoints in trainer/checkpoint.py; its outputs are listed in trainer/recipe.py."""

from __future__ import annotations

from eagle3_runner.runner.stage import StageContext
from eagle3_runner.targets.capture import capture_engine
from eagle3_runner.trainer.recipe import train


def run(ctx: StageContext) -> dict:
    """Stage entry point: train, write draft.safetensors / draft_config.json / train_metrics.json.
    Online with target.engine sglang, the capture server runs for the whole stage."""
    if ctx.params.features != "online":
        return train(ctx)
    with capture_engine(ctx):
        return train(ctx)
