"""The draft vocabulary: which target tokens the drafter's reduced lm_head can emit.

Convention (SpecForge preprocessing.generate_vocab_mapping_file; SGLang llama_eagle3.py):
- count token frequencies over SUPERVISED tokens only (loss_mask == 1);
- keep the draft_vocab_size most frequent (ties: lower id first), then sort the ids ascending;
- when fewer distinct tokens than draft_vocab_size were seen, pad with the lowest unused ids (as
  SpecForge does) and say so in one stderr line, naming both numbers and the field to set
  (`runner init --data` sizes the vocab from the data's distinct tokens in the first place);
- d2t int64 [Vd] holds OFFSETS: d2t[i] = used[i] - i, so target_id = i + d2t[i];
- t2d bool [V]: t2d[j] = j is in the draft vocab.

The mapping is cached under a content hash of (the features' identity, the training samples,
draft_vocab_size, vocab_size, format): a mapping of another size is never reused.
"""

from __future__ import annotations

import hashlib
import json
import sys
from array import array
from itertools import compress
from pathlib import Path
from typing import Iterable

import torch

from eagle3_runner.runner.files import atomic_path

FORMAT = "draft-vocab/1"


COUNT_CHUNK = 1 << 20  # supervised tokens per bincount


def count_tokens(samples: Iterable[tuple], vocab_size: int) -> torch.Tensor:
    """Frequencies of supervised tokens. samples: (input_ids [T], loss_mask [T]) pairs, either
    tensors (offline features) or lists of ints (the online source's tokenised samples).
    Returns counts int64 [vocab_size]. Raises ValueError for an id outside [0, vocab_size).
    One bincount per COUNT_CHUNK tokens, not per sample: a bincount costs O(vocab_size), so per
    sample it was O(samples x vocab) (83,708 samples x 49,152 ids: most of a minute). Lists are
    gathered without a tensor per sample (itertools.compress into one int64 array: a tensor per
    sample of a list was most of the online draft vocab's 5-11 s on 110k samples)."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    tensors: list[torch.Tensor] = []
    ints = array("q")  # supervised ids of list samples, as int64
    n = 0

    def add() -> None:
        parts = tensors + ([torch.frombuffer(ints, dtype=torch.int64)] if len(ints) else [])
        sup = torch.cat(parts)  # [n]
        if sup.min() < 0 or sup.max() >= vocab_size:
            bad = int(sup.min()) if sup.min() < 0 else int(sup.max())
            raise ValueError(f"token id {bad} outside the target vocab [0, {vocab_size})")
        counts.add_(torch.bincount(sup, minlength=vocab_size))

    for ids, mask in samples:
        if isinstance(ids, torch.Tensor):
            sup = ids[mask.bool()].long()
            if sup.numel():
                tensors.append(sup)
                n += sup.numel()
        else:
            before = len(ints)
            ints.extend(compress(ids, mask))
            n += len(ints) - before
        if n >= COUNT_CHUNK:
            add()
            tensors, ints, n = [], array("q"), 0
    if n:
        add()
    return counts


def select_vocab(counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, dict]:
    """counts int64 [V] -> used ids int64 [Vd] (ascending) and stats.

    Top draft_vocab_size by count (ties broken by lower id); padded with the lowest unseen ids
    when fewer distinct tokens were seen (SpecForge pads the same way), said on stderr in one
    line. Raises ValueError when draft_vocab_size > V."""
    V = counts.numel()
    if draft_vocab_size > V:
        raise ValueError(f"draft_vocab_size {draft_vocab_size} is larger than the target vocab {V}")
    ids = torch.arange(V)
    # sort by (-count, id): stable sort on ids already ascending keeps lower ids first on ties
    order = torch.sort(-counts, stable=True).indices
    distinct = int((counts > 0).sum())
    if distinct < draft_vocab_size:
        print(f"train: draft vocab: {distinct} distinct supervised tokens in the training "
              f"samples, drafter.draft_vocab_size {draft_vocab_size}: {draft_vocab_size - distinct}"
              " padded with unseen ids (as SpecForge does; no sample targets them). Set "
              f"drafter.draft_vocab_size: {distinct}, or train on more data.", file=sys.stderr,
              flush=True)
    used = ids[order[:draft_vocab_size]].sort().values
    total = int(counts.sum())
    covered = int(counts[used].sum())
    stats = {"distinct_tokens": distinct, "supervised_tokens": total,
             "padded": max(0, draft_vocab_size - distinct),
             "coverage": covered / total if total else 0.0}
    return used, stats


def mappings(used: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """used ids [Vd] ascending -> d2t int64 [Vd] (offsets: used[i] - i), t2d bool [V]."""
    used = used.long()
    if used.numel() > 1 and not bool((used[1:] > used[:-1]).all()):
        raise ValueError("draft vocab ids must be strictly ascending")
    d2t = used - torch.arange(used.numel(), dtype=torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[used] = True
    return d2t, t2d


def used_ids(d2t: torch.Tensor) -> torch.Tensor:
    """Inverse of the offset convention: d2t [Vd] -> target ids [Vd]."""
    return d2t.long() + torch.arange(d2t.numel(), dtype=torch.int64)


def cache_key(features_id: str, sample_ids: list[int] | range, draft_vocab_size: int,
              vocab_size: int) -> str:
    """Content hash naming a mapping: features identity, which samples, both sizes, format."""
    sample_ids = list(sample_ids)
    blob = json.dumps({"format": FORMAT, "features": features_id, "samples": sample_ids,
                       "draft_vocab_size": int(draft_vocab_size), "vocab_size": int(vocab_size)},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def features_identity(root: Path) -> str:
    """Identity of an extract artifact: sha256 of its features.json (+ artifact.json when the
    runner finalized it, whose file hashes cover every shard)."""
    h = hashlib.sha256()
    for name in ("features.json", "artifact.json"):
        p = Path(root) / name
        if p.exists():
            text = p.read_text()
            if name == "artifact.json":  # its run-specific fields are not content
                m = json.loads(text)
                text = json.dumps(m.get("files", {}), sort_keys=True)
            h.update(name.encode() + b"\0" + text.encode())
    return h.hexdigest()


def build_or_load(cache_dir: Path, key: str, samples_fn, draft_vocab_size: int,
                  vocab_size: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The (d2t, t2d, stats) for `key`, built from samples_fn() on a miss and written atomically
    to cache_dir/vocab-<key>.pt. A cached file is checked against both sizes before use."""
    cache_dir = Path(cache_dir)
    path = cache_dir / f"vocab-{key}.pt"
    if path.exists():
        try:
            obj = torch.load(path, weights_only=True)
            if (obj["d2t"].numel() == draft_vocab_size and obj["t2d"].numel() == vocab_size
                    and obj["d2t"].dtype == torch.int64 and obj["t2d"].dtype == torch.bool):
                return obj["d2t"], obj["t2d"], json.loads(obj["stats"])
        except Exception:  # noqa: BLE001 - a corrupt cache is rebuilt
            pass
    used, stats = select_vocab(count_tokens(samples_fn(), vocab_size), draft_vocab_size)
    d2t, t2d = mappings(used, vocab_size)
    stats = {**stats, "key": key}
    cache_dir.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        torch.save({"d2t": d2t, "t2d": t2d, "stats": json.dumps(stats)}, tmp)
    return d2t, t2d, stats
