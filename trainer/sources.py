"""Where the train stage's samples come from (stages.train.features):

- offline (default): the extract artifact's features on disk (targets/features.py), read sample by
  sample from the memory-mapped shards.
- online: the target itself, loaded by the train stage (each data-parallel rank its own copy), or
  the stage's SGLang capture server (target.engine; jobs/train.py opens it around the stage with
  targets/capture.py capture_engine). Each batch of token lists (this rank's slice of a global
  batch) runs through the target with targets/capture.py `TargetData.capture_batch`, the code
  extract writes to disk with, and the features live in memory only for that step. Nothing is written but checkpoints and the outputs: the train
  artifact records the capture manifest (features.json, format ONLINE_FORMAT) and
  target_config.json that export reads from extract's artifact otherwise.

Both serve sample i as the i-th tokenised sample of the training data (extract's features
keep that order through their sample ids), so the held-out split, num_samples, the draft vocab
and the batch order (jobs/train.py batch_indices) are the same under either source, and so are
the losses, up to float summation order (tests/test_train_online.py).

A source: len(src) samples; src.batch(ids) -> [{input_ids [T] int64, loss_mask [T] uint8,
aux_hidden [T, 3*Ht], last_hidden [T, Ht]}] (online: the hidden states on the target's
device, in its dtype); src.token_masks(ids) -> (input_ids, loss_mask) per sample (the draft
vocab counts them; online no target runs: lists of ints, offline tensors); src.identity (names
the vocab cache); src.head() {embed_tokens, norm, lm_head}; src.target_config (HF config
dict); src.where (for messages).
"""

from __future__ import annotations

import hashlib
import math
import random
from array import array
from pathlib import Path
from typing import Any

import torch

from eagle3_runner.trainer import vocab as V
from eagle3_runner.targets.capture import TargetData, capture_manifest, load_target_data, write_json
from eagle3_runner.targets.capture_embedded import EmbeddedCapture
from eagle3_runner.targets.features import MANIFEST, ONLINE_FORMAT, Features, open_features
from eagle3_runner.runner.errors import StageError
from eagle3_runner.runner.stage import StageContext
from eagle3_runner.runner.train_counts import train_samples


class Offline:
    """The extract artifact's features (targets/features.py)."""

    def __init__(self, feats: Features):
        self.feats, self.where = feats, str(feats.root)
        self.identity = V.features_identity(feats.root)
        self.target_config = feats.target_config

    def __len__(self) -> int:
        return len(self.feats)

    def batch(self, ids: list[int]) -> list[dict]:
        return [self.feats.get(i) for i in ids]

    def token_masks(self, ids):
        return ((s["input_ids"], s["loss_mask"])
                for s in (self.feats.get(i, ("input_ids", "loss_mask")) for i in ids))

    def head(self) -> dict:
        return self.feats.head()


class Online:
    """The target run on each batch (module docstring). td: targets/capture.py TargetData;
    capture (stages.train.online_capture): "hf" = targets/capture.py `capture` over right-padded
    length groups, "embedded" = targets/capture_embedded.py (our Llama, the batch packed into
    one row, compiled on CUDA). Raises StageError (embedded) for a target it cannot run."""

    def __init__(self, td: TargetData, aux_ids: list[int], where: str, capture: str = "hf"):
        if capture not in ("hf", "embedded"):
            raise ValueError(f"stages.train.online_capture = {capture!r}: hf or embedded")
        self.td, self.aux_ids, self.where, self.capture = td, list(aux_ids), where, capture
        self._embedded = EmbeddedCapture(td.model, aux_ids) if capture == "embedded" else None
        self.target_config = td.cfg
        h = hashlib.sha256(b"online-samples/1")
        for ids, mask in td.samples:
            h.update(array("q", ids).tobytes())  # the int64 bytes, without a tensor per sample
            h.update(bytes(mask) + b"\0")
        self.identity = h.hexdigest()

    def __len__(self) -> int:
        return len(self.td.samples)

    def batch(self, ids: list[int]) -> list[dict]:
        """The samples `ids` with their features: hf (or an SGLang server) captures in length
        groups (`length_groups`: the target runs fewer padded tokens than one batch padded to
        its longest sample; a server pads nothing: one call), embedded the whole batch as one
        packed row."""
        toks = [self.td.samples[i][0] for i in ids]
        if self._embedded is not None:
            aux, last, offs = self._embedded(toks)
            feats = [(aux[a:b], last[a:b]) for a, b in zip(offs, offs[1:])]
        else:
            feats = [None] * len(ids)
            groups = [list(range(len(ids)))] if self.td.server is not None else \
                length_groups([len(t) for t in toks])
            for group in groups:
                aux, last = self.td.capture_batch([toks[j] for j in group], self.aux_ids)
                for g, j in enumerate(group):
                    feats[j] = (aux[g, :len(toks[j])], last[g, :len(toks[j])])
        return [{"input_ids": torch.tensor(toks[j], dtype=torch.int64),
                 "loss_mask": torch.tensor(self.td.samples[i][1], dtype=torch.uint8),
                 "aux_hidden": feats[j][0], "last_hidden": feats[j][1]}
                for j, i in enumerate(ids)]

    def token_masks(self, ids):
        return (self.td.samples[i] for i in ids)  # lists of ints, counted as they are

    def head(self) -> dict:
        return self.td.head()


class Prefetch:
    """A source's batches one step ahead (stages.train.prefetch): batch(ids, next_ids) returns
    source.batch(ids) and enqueues source.batch(next_ids) on a second CUDA stream, so the next
    step's target forward runs while this step trains; the next call with exactly those ids
    takes that result (the caller's stream waits for it first). Same samples, same values as
    source.batch. Without CUDA the next batch is computed at once (the same bookkeeping, no
    overlap: what the CPU tests check)."""

    def __init__(self, source, device):
        self.source = source
        self.stream = torch.cuda.Stream(device) if torch.device(device).type == "cuda" else None
        self.ahead: tuple | None = None  # (ids, samples, event of their side-stream work)

    def batch(self, ids: list[int], next_ids: list[int] | None = None) -> list[dict]:
        if self.ahead is not None and self.ahead[0] == tuple(ids):
            _, samples, done = self.ahead
            if done is not None:
                torch.cuda.current_stream().wait_event(done)
        else:
            samples = self.source.batch(ids)
        self.ahead = (tuple(next_ids), *self._enqueue(next_ids)) if next_ids else None
        return samples

    def _enqueue(self, ids: list[int]) -> tuple[list[dict], Any]:
        """source.batch(ids) on the side stream, and the event that marks its end. Its feature
        tensors are used (and freed) on the caller's stream: record_stream keeps the caching
        allocator (whose free blocks are reused by the stream that allocated them) from handing
        their memory to the side stream's next batch before the caller's kernels read it."""
        if self.stream is None:
            return self.source.batch(ids), None
        main = torch.cuda.current_stream()
        with torch.cuda.stream(self.stream):
            samples = self.source.batch(ids)
            done = torch.cuda.Event()
            done.record(self.stream)
        for x in samples:
            for k in ("aux_hidden", "last_hidden"):
                if x[k].is_cuda:
                    x[k].record_stream(main)
        return samples, done


GROUP_COST = 2048  # padded tokens one more target forward is worth (its launches, on CUDA)


def length_groups(lengths: list[int], group_cost: int = GROUP_COST) -> list[list[int]]:
    """Split one batch's samples (their token counts) into groups, each run as one right-padded
    target forward: the sorted (longest first) samples cut into contiguous groups that minimise
    sum(len(group) x its longest) + group_cost per group (dynamic programming, O(n^2)). A
    batch of 16 ShareGPT samples ran 15.5k padded tokens for 5.9k real ones as one group (the
    H200 profile, BENCHMARKS.md). Returns indices into `lengths`, every one exactly once."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    n = len(order)
    best, cut = [0] + [None] * n, [0] * (n + 1)  # best[k]: cost of the first k sorted samples
    for k in range(1, n + 1):
        for a in range(k):  # the last group = sorted[a:k]; its longest is sorted[a]
            c = best[a] + (k - a) * lengths[order[a]] + group_cost
            if best[k] is None or c < best[k]:
                best[k], cut[k] = c, a
    groups, k = [], n
    while k > 0:
        groups.append(order[cut[k]:k])
        k = cut[k]
    return groups[::-1]


def open_source(ctx: StageContext):
    """The sample source of ctx's train stage (stages.train.features). Online, rank 0 writes the
    capture manifest (features.json) and target_config.json into ctx.out_dir.
    Raises StageError for a missing extract input (offline) or unusable data/target (online)."""
    spec = ctx.spec
    if ctx.params.features == "online":
        td = load_target_data(ctx)
        src = Online(td, spec.aux_ids, f"the target {spec.target.path} (features: online)",
                     ctx.params.online_capture)
        if ctx.rank == 0:
            out = Path(ctx.out_dir)
            write_json(out / "target_config.json", td.cfg)
            write_json(out / MANIFEST, {**capture_manifest(spec, td), "format": ONLINE_FORMAT,
                                        "shards": [], "data_report": {
                                            **td.data_report, "tokenize": td.tok_report}})
        return src
    if "extract" not in ctx.inputs:
        raise StageError("stage train needs the extract stage's artifact (stages.extract), or "
                         "stages.train.features: online to run the target itself.")
    return Offline(open_features(ctx.inputs["extract"], spec.aux_ids, spec.feature_width))


def batch_indices(step: int, n: int, bs: int, seed: int) -> list[int]:
    """Training-sample indices of optimizer step `step`: a fresh permutation per epoch, a pure
    function of (step, seed), so a resumed run sees exactly the uninterrupted run's batches."""
    spe = math.ceil(n / bs)
    epoch, b = divmod(step, spe)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
    return perm[b * bs:(b + 1) * bs].tolist()


def split_samples(n_total: int, p) -> tuple[list[int], list[int]]:
    """(train ids, held-out eval ids) of n_total samples, both ascending. Held-out = eval_samples
    samples drawn at random (seeded by stages.train.seed), so they are a uniform sample of the
    data: a regenerate artifact lists conversations in the order they finished, and its last
    ones are the longest answers (the H100 run of 2026-12-07: 255 tokens on average against
    199). Train = the first num_samples of the rest. Raises StageError when nothing is left."""
    n_avail = n_total - p.eval_samples
    if n_avail < 1:
        raise StageError(f"train.eval_samples = {p.eval_samples} leaves no training samples: the "
                         f"training data holds {n_total}. Lower train.eval_samples or use more "
                         "data (data.max_samples).")
    held = set(random.Random(p.seed).sample(range(n_total), p.eval_samples))
    rest = [i for i in range(n_total) if i not in held]
    return rest[:train_samples(p, n_total)], sorted(held)
