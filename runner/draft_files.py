"""An SGLang EAGLE-3 draft directory's files, read without torch (used by `runner inspect`,
`runner convert` and the export stage).

- safetensors: the JSON header of each file and single tensors' values (numpy, read from the byte
  offsets in the header), so a multi-GB draft is checked without loading it;
- the layout SGLang's LlamaForCausalLMEagle3 expects (../shared/notes/eagle3-format.md; SGLang
  llama_eagle3.py): tensor names and shapes for a config.json, RoPE fields, default aux layer ids.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from runner.spec import default_aux_ids  # noqa: F401  (re-exported for runner.inspect)

ARCH = "LlamaForCausalLMEagle3"
DTYPES = {"BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "I16": np.int16, "I32": np.int32,
          "I64": np.int64, "U16": np.uint16, "U32": np.uint32, "U64": np.uint64,
          "F16": np.float16, "BF16": np.uint16, "F32": np.float32, "F64": np.float64}
INT_DTYPES = ("I64", "I32", "I16", "I8", "U8", "U16", "U32", "U64")


class InspectError(Exception):
    """The inspector itself cannot run (e.g. the draft dir does not exist, a safetensors header is
    corrupt). Re-exported by runner.inspect; `runner` prints it as a one-line error."""


# ----------------------------------------------------------------------------------------------
# safetensors without torch


def read_header(path: Path) -> tuple[dict, int]:
    """Header of one safetensors file: ({name: {dtype, shape, data_offsets}}, data start byte).

    Format: 8-byte little-endian header length n, n bytes of JSON, then the raw data; offsets in
    the JSON are relative to byte 8 + n. Raises InspectError on a corrupt header."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > 100 << 20:
                raise InspectError(f"{path}: header length {n} is not plausible")
            header = json.loads(f.read(n))
    except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise InspectError(f"{path}: not a readable safetensors file ({e})")
    if not isinstance(header, dict):
        raise InspectError(f"{path}: not a safetensors file (header is not a JSON object)")
    header.pop("__metadata__", None)
    for name, e in header.items():
        if not _entry_ok(e):
            raise InspectError(f"{path}: corrupt safetensors header: tensor {name!r} needs "
                               "{dtype, shape: [ints >= 0], data_offsets: [begin <= end]}. "
                               "Re-export the file.")
    return header, 8 + n


def _entry_ok(e) -> bool:
    ints = lambda xs: isinstance(xs, list) and all(  # noqa: E731
        isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in xs)
    return (isinstance(e, dict) and isinstance(e.get("dtype"), str) and ints(e.get("shape"))
            and ints(e.get("data_offsets")) and len(e["data_offsets"]) == 2
            and e["data_offsets"][0] <= e["data_offsets"][1])


def read_array(path: Path, entry: dict, start: int) -> np.ndarray:
    """The values of one tensor as numpy (BF16 is widened to float32)."""
    a, b = entry["data_offsets"]
    with open(path, "rb") as f:
        f.seek(start + a)
        raw = f.read(b - a)
    arr = np.frombuffer(raw, dtype=DTYPES[entry["dtype"]]).reshape(entry["shape"])
    if entry["dtype"] == "BF16":
        arr = (arr.astype(np.uint32) << 16).view(np.float32)
    return arr


def draft_tensors(draft_dir: Path) -> dict[str, dict]:
    """{name: {dtype, shape, data_offsets, file, start}} over every *.safetensors in draft_dir
    (hidden files skipped; a name in two files keeps the later file's). Raises InspectError."""
    out = {}
    for p in sorted(q for q in Path(draft_dir).glob("*.safetensors") if not q.name.startswith(".")):
        header, start = read_header(p)
        for k, v in header.items():
            out[k] = {**v, "file": p, "start": start}
    return out


def tensor_values(t: dict) -> np.ndarray:
    """The values of one entry of draft_tensors(), shape t["shape"] (BF16 widened to float32)."""
    return read_array(t["file"], t, t["start"])


# ----------------------------------------------------------------------------------------------
# expected layout


def expected_shapes(cfg: dict) -> dict[str, list[int]]:
    """SGLang tensor names -> shapes for a draft config.json (eagle_config nested form).

    fc [H, n_aux * Ht]; q [nh*hd, 2H]; k/v [nkv*hd, 2H]; o [H, nh*hd]; gate/up [I, H];
    down [H, I]; norms [H]; lm_head [Vd, H]; d2t [Vd]; t2d [V]."""
    H, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    nkv = cfg.get("num_key_value_heads") or nh
    hd = cfg.get("head_dim") or H // nh
    Ht = cfg.get("target_hidden_size") or H
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or [0, 0, 0]
    I, Vd = cfg["intermediate_size"], cfg.get("draft_vocab_size") or cfg["vocab_size"]
    m, a = "midlayer.mlp.", "midlayer.self_attn."
    return {
        "fc.weight": [H, len(ids) * Ht],
        a + "q_proj.weight": [nh * hd, 2 * H], a + "k_proj.weight": [nkv * hd, 2 * H],
        a + "v_proj.weight": [nkv * hd, 2 * H], a + "o_proj.weight": [H, nh * hd],
        m + "gate_proj.weight": [I, H], m + "up_proj.weight": [I, H], m + "down_proj.weight": [H, I],
        "midlayer.input_layernorm.weight": [H], "midlayer.hidden_norm.weight": [H],
        "midlayer.post_attention_layernorm.weight": [H], "norm.weight": [H],
        "lm_head.weight": [Vd, H], "d2t": [Vd], "t2d": [cfg["vocab_size"]],
    }


OPTIONAL = ("embed_tokens.weight", "fc.bias")


def target_rope(cfg: dict) -> tuple:
    """(rope_theta, rope_scaling) of an HF config in either form: top-level `rope_theta` /
    `rope_scaling` (what SGLang reads) or transformers-5 `rope_parameters`."""
    rp = cfg.get("rope_parameters") or {}
    theta = cfg.get("rope_theta") or rp.get("rope_theta")
    scaling = cfg.get("rope_scaling")
    if not scaling and (rp.get("rope_type") or rp.get("type")) not in (None, "default"):
        scaling = {k: v for k, v in rp.items() if k != "rope_theta"}
    return (float(theta) if theta is not None else None), (scaling or None)


