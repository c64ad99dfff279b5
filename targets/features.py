"""The extracted-features format: what the extract stage writes and train/export read.

Artifact layout (one extract artifact dir):
  features.json            manifest (FORMAT below), written by extract when all shards exist
  shard-00000.safetensors  one shard: samples concatenated along tokens
      input_ids   int64 [T]            token ids
      loss_mask   uint8 [T]            1 = assistant token (supervised)
      aux_hidden  dtype [T, 3*Ht]      aux hidden states, ascending layer order (SGLang ids)
      last_hidden dtype [T, Ht]        the target's last PRE-norm hidden (soft labels come from
                                       norm + lm_head restricted to the draft vocab at train time)
      offsets     int64 [n+1]          local sample j = rows offsets[j]:offsets[j+1]
      sample_ids  int64 [n]            local sample j = sample sample_ids[j] of the dataset
  target_head.safetensors  embed_tokens [V, Ht], norm [Ht], lm_head [V, Ht] (frozen target parts)
  target_config.json       the target's HF config (dict)

Shards hold the samples sorted by length, longest first (jobs/extract.py says why); each shard's
sample_ids (also in the manifest's shard entries) map them back, and Features serves sample i as
the i-th tokenised sample, so train's held-out split and num_samples keep meaning the dataset's
last / first samples. Format 1 (no sample_ids) kept the dataset order in the shards and is still
read.

Disk per token: (3+1) * Ht * bytes(dtype) + 9 bytes; SmolLM2 (Ht 576) = 4,617 B in bf16,
9,225 B in float32; Kimi (Ht 7168) = 57,353 B in bf16.

An online train stage (stages.train.features: online; trainer/sources.py) writes the same
manifest, with format ONLINE_FORMAT and no shards, and target_config.json into its own artifact:
export reads them from there. open_features refuses it (there are no features to read).

The manifest records the layer ids ACTUALLY captured (SGLang convention and HF indices) and the
width; `open_features` refuses features that do not match the spec's drafter, naming both values.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from eagle3_runner.runner.errors import StageError

FORMAT = "eagle3-features/2"
READABLE = ("eagle3-features/1", FORMAT)
# the capture manifest of an online train artifact: the same fields, no shards (nothing to read)
ONLINE_FORMAT = "eagle3-features/online"
MANIFEST = "features.json"


@dataclass
class Sample:
    input_ids: torch.Tensor  # [T] int64
    loss_mask: torch.Tensor  # [T] uint8
    aux_hidden: torch.Tensor  # [T, 3*Ht]
    last_hidden: torch.Tensor  # [T, Ht]


KEYS = ("input_ids", "loss_mask", "aux_hidden", "last_hidden")


class Features:
    """Random access to the samples of an extract artifact. Reads one sample by slicing the
    memory-mapped shard (never loads a whole shard: a 256-sample SmolLM2 shard is ~2.4 GB)."""

    def __init__(self, root: Path, manifest: dict):
        self.root = Path(root)
        self.manifest = manifest
        check_shard_ids(self.root, manifest["shards"])
        self._index = sample_index(manifest["shards"])  # sample -> (shard, local index)
        self._offsets: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self._index)

    def get(self, i: int, keys=KEYS) -> dict[str, torch.Tensor]:
        """Sample i -> {input_ids [T], loss_mask [T], aux_hidden [T, 3*Ht], last_hidden [T, Ht]}
        (only `keys`)."""
        s, j = self._index[i]
        with safe_open(str(self.root / self.manifest["shards"][s]["file"]), framework="pt") as f:
            if s not in self._offsets:
                self._offsets[s] = f.get_tensor("offsets").tolist()
            a, b = self._offsets[s][j], self._offsets[s][j + 1]
            return {k: f.get_slice(k)[a:b] for k in keys}

    def sample(self, i: int) -> Sample:
        return Sample(**self.get(i))

    def head(self) -> dict[str, torch.Tensor]:
        """embed_tokens [V, Ht], norm [Ht], lm_head [V, Ht] of the target."""
        from safetensors.torch import load_file
        return load_file(str(self.root / "target_head.safetensors"))

    @property
    def target_config(self) -> dict:
        return json.loads((self.root / "target_config.json").read_text())


def entry_ids(shards: list[dict]) -> list[list[int]]:
    """The dataset sample ids of each manifest shard entry: its sample_ids, or (format 1) its
    place in shard order. Raises StageError naming the shard when an entry is malformed (a field
    missing, sample_ids not a list of num_samples ints)."""
    out, k = [], 0
    for sh in shards:
        try:
            n = sh["num_samples"]
            ids = sh.get("sample_ids", list(range(k, k + n)))
            name = sh["file"]
        except (KeyError, TypeError) as e:
            raise StageError(f"features manifest: a shard entry is malformed "
                             f"({type(e).__name__}: {e}); re-run extract.") from None
        if type(n) is not int or not isinstance(ids, list) or len(ids) != n \
                or any(type(i) is not int for i in ids):
            raise StageError(f"features manifest: shard {name} has num_samples {n} but "
                             f"sample_ids {str(ids)[:60]}; re-run extract.")
        out.append(ids)
        k += n
    return out


def check_shard_ids(root: Path, shards: list[dict]) -> None:
    """Each shard entry's sample ids (entry_ids) must equal the sample_ids stored in the shard
    file itself, where it has them: a manifest edited or downgraded by hand would otherwise map
    every sample to another one, silently.

    Raises StageError naming the shard; a missing or unreadable shard is left to the read."""
    for sh, listed in zip(shards, entry_ids(shards)):
        try:
            with safe_open(str(Path(root) / sh["file"]), framework="pt") as f:
                stored = f.get_tensor("sample_ids").tolist() if "sample_ids" in f.keys() else None
        except Exception:  # noqa: BLE001 - a missing/corrupt file fails at read, naming it
            stored = None
        if stored is not None and listed != stored:
            raise StageError(f"features manifest: shard {sh['file']} lists sample ids "
                             f"{str(listed)[:40]}, but the shard file holds {str(stored)[:40]}; "
                             "the manifest was changed: re-run extract.")


def sample_index(shards: list[dict]) -> list[tuple[int, int]]:
    """(shard, local index) of every dataset sample, from the manifest's shard entries
    (entry_ids). Raises StageError when the ids are not a permutation of 0..n-1 or an entry is
    malformed (a corrupt manifest)."""
    ids = entry_ids(shards)
    n = sum(len(x) for x in ids)
    index: list = [None] * n
    for s, (sh, listed) in enumerate(zip(shards, ids)):
        for j, i in enumerate(listed):
            if not 0 <= i < n or index[i] is not None:
                raise StageError(f"features manifest: shard {sh['file']} lists sample id {i}, "
                                 f"which is out of 0..{n - 1} or listed twice; re-run extract.")
            index[i] = (s, j)
    if None in index:
        raise StageError(f"features manifest: sample {index.index(None)} is in no shard; "
                         "re-run extract.")
    return index


def open_features(root: Path, aux_layer_ids: list[int] | None = None,
                  feature_width: int | None = None) -> Features:
    """Open an extract artifact, refusing features captured at other layers or widths.

    Raises StageError naming the recorded and expected values (e.g. width 7168 vs 21504)."""
    root = Path(root)
    try:
        m = json.loads((root / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError):
        raise StageError(f"{root}: no readable {MANIFEST}; the extract stage did not complete")
    if m.get("format") not in READABLE:
        raise StageError(f"{root}/{MANIFEST}: format {m.get('format')!r}, expected one of "
                         f"{READABLE}; re-run extract with this version.")
    if aux_layer_ids is not None and list(m["aux_layer_ids"]) != list(aux_layer_ids):
        raise StageError(
            f"features at {root} were captured at aux layer ids {m['aux_layer_ids']} (SGLang "
            f"convention; HF hidden_states {m.get('hf_hidden_indices')}), but the spec's "
            f"drafter.aux_layer_ids are {list(aux_layer_ids)}. Re-run extract or fix the spec.")
    if feature_width is not None and int(m["feature_width"]) != int(feature_width):
        raise StageError(
            f"features at {root} are {m['feature_width']} wide, but the drafter's fc expects "
            f"{feature_width} (= len(aux_layer_ids) x target hidden). Re-run extract or fix the spec.")
    return Features(root, m)
