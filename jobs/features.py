"""The extracted-features format: what the extract stage writes and train/export read.

Artifact layout (one extract artifact dir):
  features.json            manifest (FORMAT below), written by extract when all shards exist
  shard-00000.safetensors  one shard: samples concatenated along tokens
      input_ids   int64 [T]            token ids
      loss_mask   uint8 [T]            1 = assistant token (supervised)
      aux_hidden  dtype [T, 3*Ht]      aux hidden states, ascending layer order (SGLang ids)
      last_hidden dtype [T, Ht]        the target's last PRE-norm hidden (soft labels come from
                                       norm + lm_head restricted to the draft vocab at train time)
      offsets     int64 [n+1]          sample i = rows offsets[i]:offsets[i+1]
  target_head.safetensors  embed_tokens [V, Ht], norm [Ht], lm_head [V, Ht] (frozen target parts)
  target_config.json       the target's HF config (dict)

Disk per token: (3+1) * Ht * bytes(dtype) + 9 bytes; SmolLM2 (Ht 576) = 4,617 B in bf16,
9,225 B in float32; Kimi (Ht 7168) = 57,353 B in bf16.

The manifest records the layer ids ACTUALLY captured (SGLang convention and HF indices) and the
width; `open_features` refuses features that do not match the spec's drafter, naming both values.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from runner.stage import StageError

FORMAT = "eagle3-features/1"
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
        self._index: list[tuple[int, int]] = []  # sample -> (shard, local index)
        for s, shard in enumerate(manifest["shards"]):
            self._index += [(s, i) for i in range(shard["num_samples"])]
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


def open_features(root: Path, aux_layer_ids: list[int] | None = None,
                  feature_width: int | None = None) -> Features:
    """Open an extract artifact, refusing features captured at other layers or widths.

    Raises StageError naming the recorded and expected values (e.g. width 7168 vs 21504)."""
    root = Path(root)
    try:
        m = json.loads((root / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError):
        raise StageError(f"{root}: no readable {MANIFEST}; the extract stage did not complete")
    if m.get("format") != FORMAT:
        raise StageError(f"{root}/{MANIFEST}: format {m.get('format')!r}, expected {FORMAT!r}")
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
