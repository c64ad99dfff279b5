#!/usr/bin/env python
"""The draft vocab's token count (trainer/vocab.py count_tokens) against a bincount per sample
(how it counted before 2026-12-07), and the online source's sample hash (trainer/sources.py
Online.identity) against a tensor per sample, on random samples of the pays spec's shape:
83,708 samples x ~250 tokens, SmolLM2's 49,152 ids. Same counts and hash asserted; prints the
seconds and the ratio of one run.

    python scripts/bench/bench_vocab_count.py [--samples 20000] [--tokens 250]
"""

from __future__ import annotations

import argparse
import hashlib
import time
from array import array


def per_sample(samples, vocab_size: int):
    """The reference: one bincount per sample (O(samples x vocab))."""
    import torch
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for ids, mask in samples:
        counts += torch.bincount(ids[mask.bool()].long(), minlength=vocab_size)
    return counts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=83_708)
    ap.add_argument("--tokens", type=int, default=250)
    ap.add_argument("--vocab", type=int, default=49_152)
    a = ap.parse_args(argv)
    import torch

    from eagle3_runner.trainer.vocab import count_tokens
    g = torch.Generator().manual_seed(0)
    samples = [(torch.randint(0, a.vocab, (a.tokens,), generator=g),
                (torch.rand(a.tokens, generator=g) > 0.3).to(torch.uint8))
               for _ in range(a.samples)]
    t = time.perf_counter()
    ref = per_sample(samples, a.vocab)
    t_ref = time.perf_counter() - t
    t = time.perf_counter()
    got = count_tokens(samples, a.vocab)
    t_new = time.perf_counter() - t
    assert torch.equal(ref, got)
    print(f"count {a.samples:,} samples x {a.tokens}: per sample {t_ref:.2f} s, count_tokens "
          f"{t_new:.2f} s ({t_ref / t_new:.1f}x)")
    lists = [ids.tolist() for ids, _ in samples]
    h_ref, h_new = hashlib.sha256(), hashlib.sha256()
    t = time.perf_counter()
    for x in lists:
        h_ref.update(torch.tensor(x, dtype=torch.int64).numpy().tobytes())
    t_ref = time.perf_counter() - t
    t = time.perf_counter()
    for x in lists:
        h_new.update(array("q", x).tobytes())
    t_new = time.perf_counter() - t
    assert h_ref.hexdigest() == h_new.hexdigest()
    print(f"sample hash: a tensor per sample {t_ref:.2f} s, array {t_new:.2f} s "
          f"({t_ref / t_new:.1f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
