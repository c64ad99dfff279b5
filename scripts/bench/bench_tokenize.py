#!/usr/bin/env python
"""Tokenising a stage's conversations (data/chat.py tokenize_dataset, the set-up of extract and
online training): batched encoding (ENCODE_BATCH texts per fast-tokenizer call, vectorised loss
masks) against the one-at-a-time path it replaced (one tokenizer call and a per-token Python
mask loop per conversation), same conversations, same run, samples checked equal.

    python scripts/bench/bench_tokenize.py specs/smollm2-sharegpt.yaml --conversations 3000
    python scripts/bench/bench_tokenize.py specs/smollm2-sharegpt.yaml --conversations 500 --repeats 1 \\
        --json

Prints ms per conversation for both paths and their ratio (and, with --out, writes
bench_tokenize.json there). The ratio grows with the cores a fast tokenizer can encode on.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path



def one_at_a_time(tok, convs, cv, max_length):
    """The path before batching: per conversation, render, one tokenizer call, a per-token mask
    loop; samples [(input_ids, loss_mask)] with all-zero masks dropped."""
    from eagle3_runner.data.chat import assistant_char_spans, render, token_mask_reference
    out = []
    for conv in convs:
        text = render(tok, conv)
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        mask = token_mask_reference(enc["offset_mapping"], assistant_char_spans(text, cv))
        ids, mask = enc["input_ids"][:max_length], mask[:max_length]
        if any(mask):
            out.append((ids, mask))
    return out


def show(res: dict) -> None:
    """The human form of main's result."""
    ms = res["ms_per_conversation"]
    print(f"{res['conversations']} conversations, {res['tokens']:,} tokens, {res['cpus']} CPUs: "
          f"one at a time {ms['one_at_a_time']:.2f} ms/conv, batched {ms['batched']:.2f} "
          f"ms/conv: {res['ratio']:.2f}x")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="examples:\n" + __doc__[__doc__.index("    python"):])
    ap.add_argument("spec", help="a spec whose data and target to use")
    ap.add_argument("--conversations", type=int, default=2000,
                    help="conversations to tokenise (default 2000; fewer if the data holds fewer)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="timed repeats per path, median (default 3)")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    ap.add_argument("--out", type=Path, help="folder for bench_tokenize.json")
    a = ap.parse_args(argv)
    if a.conversations < 1 or a.repeats < 1:
        ap.error("--conversations and --repeats must be >= 1")
    if a.out is not None and a.out.exists() and not a.out.is_dir():
        ap.error(f"--out {a.out}: a file is in the way; pass a folder (it is created if missing)")
    from eagle3_runner.data.chat import chat_convention, tokenize_dataset
    from eagle3_runner.data.conversations import load_conversations
    from eagle3_runner.targets.load import load_tokenizer
    from eagle3_runner.runner.errors import RunnerError
    from eagle3_runner.runner.spec.load import load_spec
    try:
        spec = load_spec(a.spec, [f"data.max_samples={a.conversations}", "data.holdout=0"])
        tok = load_tokenizer(spec.target)
        convs, _, _ = load_conversations(spec.data)
        cv, L = chat_convention(tok, spec.target.chat_template), spec.data.max_length
        if a.out is not None:
            a.out.mkdir(parents=True, exist_ok=True)
    except (RunnerError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if len(convs) < a.conversations:
        print(f"note: the data holds {len(convs)} usable conversations, not {a.conversations}",
              file=sys.stderr)
    times = {"one_at_a_time": [], "batched": []}
    for _ in range(a.repeats):
        t = time.perf_counter()
        try:  # first: a dataset it refuses (no supervised token left) fails before any timing
            got, rep = tokenize_dataset(tok, convs, spec.target.chat_template, L)
        except RunnerError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        times["batched"].append(time.perf_counter() - t)
        t = time.perf_counter()
        ref = one_at_a_time(tok, convs, cv, L)
        times["one_at_a_time"].append(time.perf_counter() - t)
        if got != ref:
            print("error: batched samples differ from the one-at-a-time path", file=sys.stderr)
            return 1
    ms = {k: 1e3 * statistics.median(v) / len(convs) for k, v in times.items()}
    res = {"conversations": len(convs), "tokens": rep["tokens"], "cpus": os.cpu_count(),
           "ms_per_conversation": ms, "ratio": ms["one_at_a_time"] / ms["batched"],
           "repeats": a.repeats}
    from eagle3_runner.runner.files import emit_result
    emit_result(res, a.out, "bench_tokenize.json", a.json, show)
    return 0


if __name__ == "__main__":
    from eagle3_runner.runner.errors import exit_code
    sys.exit(exit_code(main))
