"""A tiny regenerate run (random 2-layer target with SmolLM2's vocabulary and tokenizer) for the
kill/resume test, importable and runnable:

    python tests/regen_helpers.py OUT [KILL_AFTER_SHARDS]

KILL_AFTER_SHARDS: SIGKILL this process right after that many shards were written (a kill in
the middle of generation: rows in flight, a shard buffer half full)."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def conversations(n: int = 30) -> list:
    words = "alpha beta gamma delta river stone cloud paper seven orange window music".split()
    out = []
    for i in range(n):
        turns = []
        for t in range(1 + i % 3):
            q = " ".join(words[(i * 7 + t * 3 + k) % len(words)] for k in range(4 + i % 5))
            turns += [{"role": "user", "content": f"{q} {i}?"},
                      {"role": "assistant", "content": "old answer"}]
        out.append(turns)
    return out


def params(**kw):
    from eagle3_runner.runner.spec.stage_blocks import RegenerateStage
    return RegenerateStage(**{"max_new_tokens": 5, "batch_size": 3, "shard_conversations": 4,
                              "synthetic_prompts": 5, "synthetic_max_tokens": 4, "seed": 0, **kw})


def run(out: Path, kill_after: int | None = None, clock=None, **kw) -> dict:
    import torch
    import eagle3_runner.data.synthetic as syn
    from engine_helpers import tiny_hf_llama
    from eagle3_runner.models.llama import from_hf_model
    from eagle3_runner.data.regen_store import ShardWriter
    from eagle3_runner.jobs.regenerate import regenerate
    from eagle3_runner.targets.load import end_of_turn_ids, load_tokenizer
    from eagle3_runner.runner.assets import asset_path
    threads, degenerate = torch.get_num_threads(), syn.degenerate
    torch.set_num_threads(1)
    # a random target writes no sensible user turns: keep every non-empty one (the filters
    # have their own tests); what is tested here is the accounting across a kill
    syn.degenerate = lambda text, ended: None if text else "empty"
    if kill_after is not None:
        flush = ShardWriter.flush

        def flush_then_die(self):
            flush(self)
            if self.next - 1 >= kill_after:  # shards part-00000 .. part-{kill_after}
                os.kill(os.getpid(), signal.SIGKILL)
        ShardWriter.flush = flush_then_die
    target = from_hf_model(tiny_hf_llama(vocab=49152, hidden=32, layers=2, heads=4, kv=2))
    tok = load_tokenizer(asset_path("smollm2"))
    try:
        extra = {} if clock is None else {"clock": clock}
        return regenerate(target, tok, conversations(), params(**kw), 96, out, progress=False,
                          stop_ids=end_of_turn_ids(asset_path("smollm2"), tok), **extra)
    finally:  # in-process callers (tests) get the module and thread count back
        syn.degenerate = degenerate
        torch.set_num_threads(threads)


if __name__ == "__main__":
    run(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else None)
