#!/usr/bin/env python
"""The regenerate stage's host work per follow-up turn (jobs/regen_turns.py answer's on_done): the
answer decoded, the conversation so far re-rendered by the chat template and tokenised. Per host
sync the Generator hands on_done the rows finished since (engine/generate.py), so the stage decodes
them in one batch_decode and tokenises their next prompts in ONE fast-tokenizer call
(data/prompts.py render_batch); before, each row was decoded and rendered by itself
(data/prompts.py render: one tokenizer call per turn). Both paths run here on the same real
multi-turn ShareGPT conversations, the answers stand-ins of `--answer-tokens` random token ids,
and their prompt ids are checked equal.

    python scripts/bench/bench_regen_host.py specs/smollm2-scale-gpu.yaml
    python scripts/bench/bench_regen_host.py specs/smollm2-sharegpt.yaml --turns 400 --per-sync 16 --json

Prints ms per turn for both paths and their ratio (with --out, writes bench_regen_host.json
there). --per-sync: rows finished per host sync (default 37: the 2026-12-03 H200 run answered
48.2k turns in ~10.4k decode steps of 8 per sync). The ratio grows with the cores a fast
tokenizer can encode on; on the GPU the sync's 8 decode steps (~40 ms at 1024 rows) are what
the host work has to fit under.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path



def turns_of(convs, n: int, answer_tokens: int, vocab: int, seed: int = 0) -> list:
    """Up to n follow-up turns [(answer token ids, the messages of the next prompt without the
    answer, the answer's slot)] from multi-turn conversations, answers random ids."""
    from eagle3_runner.jobs.regen_turns import context_steps
    rng, out = random.Random(seed), []
    for c in convs:
        steps = context_steps(c)
        done = []
        for k in range(len(steps) - 1):
            ans = [rng.randrange(100, vocab) for _ in range(answer_tokens)]
            out.append((ans, done + steps[k], steps[k + 1]))
            done = done + steps[k] + [{"role": "assistant", "content": f"answer {k}"}]
            if len(out) >= n:
                return out
    return out


def per_turn(tok, turns):
    """The path before: one decode and one render (tokenizer call) per finished row."""
    from eagle3_runner.data.prompts import render
    out = []
    for ans, before, nxt in turns:
        text = tok.decode(ans, skip_special_tokens=True).strip()
        out.append(render(tok, before + [{"role": "assistant", "content": text}] + nxt))
    return out


def per_sync(tok, turns, group: int):
    """The stage's path: the rows of one sync decoded in one batch_decode, their next prompts
    tokenised in one render_batch call."""
    from eagle3_runner.data.prompts import render_batch
    out = []
    for i in range(0, len(turns), group):
        chunk = turns[i:i + group]
        texts = tok.batch_decode([a for a, _, _ in chunk], skip_special_tokens=True)
        out += render_batch(tok, [b + [{"role": "assistant", "content": t.strip()}] + n
                                  for (_, b, n), t in zip(chunk, texts)])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="examples:\n" + __doc__[__doc__.index("    python"):])
    ap.add_argument("spec", help="a spec whose data and target to use")
    ap.add_argument("--turns", type=int, default=1000, help="follow-up turns (default 1000)")
    ap.add_argument("--per-sync", type=int, default=37,
                    help="rows finished per host sync (default 37)")
    ap.add_argument("--answer-tokens", type=int, default=200,
                    help="tokens per stand-in answer (default 200; the run's mean was 199)")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats per path, median")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    ap.add_argument("--out", type=Path, help="folder for bench_regen_host.json")
    a = ap.parse_args(argv)
    if min(a.turns, a.per_sync, a.answer_tokens, a.repeats) < 1:
        ap.error("--turns, --per-sync, --answer-tokens and --repeats must be >= 1")
    if a.out is not None and a.out.exists() and not a.out.is_dir():
        ap.error(f"--out {a.out}: a file is in the way; pass a folder (it is created if missing)")
    from eagle3_runner.data.conversations import load_conversations
    from eagle3_runner.targets.load import load_tokenizer
    from eagle3_runner.runner.errors import RunnerError
    from eagle3_runner.runner.spec.load import load_spec
    try:
        spec = load_spec(a.spec, ["data.holdout=0"])
        tok = load_tokenizer(spec.target)
        convs, _, _ = load_conversations(spec.data)
        if a.out is not None:
            a.out.mkdir(parents=True, exist_ok=True)
    except (RunnerError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    turns = turns_of(convs, a.turns, a.answer_tokens, len(tok))
    if not turns:
        print(f"error: {a.spec}: no conversation of its data has two answers to rewrite",
              file=sys.stderr)
        return 1
    if len(turns) < a.turns:
        print(f"note: the data holds {len(turns)} follow-up turns, not {a.turns}", file=sys.stderr)
    times = {"per_turn": [], "per_sync": []}
    for _ in range(a.repeats):
        t = time.perf_counter()
        ref = per_turn(tok, turns)
        times["per_turn"].append(time.perf_counter() - t)
        t = time.perf_counter()
        got = per_sync(tok, turns, a.per_sync)
        times["per_sync"].append(time.perf_counter() - t)
        if got != ref:
            print("error: the batched path's prompt ids differ from the per-turn path's",
                  file=sys.stderr)
            return 1
    ms = {k: 1e3 * statistics.median(v) / len(turns) for k, v in times.items()}
    res = {"spec": a.spec, "turns": len(turns), "per_sync": a.per_sync,
           "answer_tokens": a.answer_tokens, "mean_prompt_tokens": sum(map(len, ref)) / len(ref),
           "ms_per_turn": ms, "ratio": ms["per_turn"] / ms["per_sync"]}
    if a.out is not None:
        (a.out / "bench_regen_host.json").write_text(json.dumps(res, indent=1))
    if a.json:
        print(json.dumps(res, indent=1))
    else:
        print(f"{len(turns)} follow-up turns ({res['mean_prompt_tokens']:.0f} prompt tokens on "
              f"average), {a.per_sync} per sync: per turn {ms['per_turn']:.3f} ms, per sync "
              f"{ms['per_sync']:.3f} ms per turn: {res['ratio']:.2f}x")
    return 0


if __name__ == "__main__":
    from eagle3_runner.runner.errors import exit_code
    sys.exit(exit_code(main))
