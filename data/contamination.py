"""No bench prompt in the training data: the guard the regenerate stage (real and synthetic
prompts) and the extract stage apply.

The bench sets are the prompts data/prompts.py serves: MT-bench, HumanEval (as the chat request
the bench sends) and the first user turn of the data.holdout conversations. A training user turn
is contaminated when its normalised text equals a bench prompt's, or when it shares a run of
NGRAM consecutive normalised words with a bench prompt of at least NGRAM words (the 13-gram
overlap test of the GPT-3 paper's contamination study: it catches a bench question pasted into
a longer turn, or one with a changed greeting). Normalised = lowercase, every run of characters
other than letters and digits one space, stripped.
"""

from __future__ import annotations

import re
from typing import Iterable

NGRAM = 13
_NON_WORD = re.compile(r"[\W_]+", re.UNICODE)


def normalize(text: str) -> str:
    """Lowercase, non-alphanumeric runs -> one space, stripped ('What is 2+2?' -> 'what is 2 2')."""
    return _NON_WORD.sub(" ", text.lower()).strip()


def _ngrams(words: list) -> Iterable[tuple]:
    return zip(*(words[i:] for i in range(NGRAM)))


class BenchGuard:
    """Normalised bench prompts and their NGRAM-word runs. `contaminated(text)` -> bool."""

    def __init__(self, prompts: Iterable[str]):
        self.exact: set[str] = set()
        self.grams: set[tuple] = set()
        for p in prompts:
            n = normalize(p)
            if n:
                self.exact.add(n)
                self.grams.update(_ngrams(n.split()))
        self.size = len(self.exact)

    def contaminated(self, text: str) -> bool:
        n = normalize(text)
        if n in self.exact:
            return True
        return bool(self.grams) and not self.grams.isdisjoint(_ngrams(n.split()))

    def conversation(self, conv: list[dict]) -> bool:
        """True when any user or system turn of `conv` is contaminated."""
        return any(t["role"] != "assistant" and self.contaminated(t["content"]) for t in conv)


def bench_guard(spec) -> BenchGuard:
    """The guard over every bench prompt set (MT-bench, HumanEval, and the holdout's first user
    turns when data.holdout > 0). Raises StageError when a bench asset is not fetched."""
    from eagle3_runner.data.prompts import humaneval, mtbench, sharegpt_holdout
    sets = [mtbench(), humaneval()] + ([sharegpt_holdout(spec.data)] if spec.data.holdout else [])
    return BenchGuard(m["content"] for s in sets for p in s for m in p["messages"]
                      if m["role"] == "user")
