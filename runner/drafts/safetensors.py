"""safetensors files without torch: each file's JSON header, single tensors' values (numpy, read
from the byte offsets in the header, so a multi-GB draft is checked without loading it), and a
writer that copies tensor bytes verbatim (`runner convert`).

Format (the safetensors spec): an 8-byte little-endian header length n, n bytes of JSON
({name: {dtype, shape, data_offsets}}, optional "__metadata__"), then the raw data; offsets are
relative to byte 8 + n. The writer pads the header to 8 bytes.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from runner.errors import InspectError

DTYPES = {"BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "I16": np.int16, "I32": np.int32,
          "I64": np.int64, "U16": np.uint16, "U32": np.uint32, "U64": np.uint64,
          "F16": np.float16, "BF16": np.uint16, "F32": np.float32, "F64": np.float64}
INT_DTYPES = ("I64", "I32", "I16", "I8", "U8", "U16", "U32", "U64")


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


def encode_header(header: dict) -> bytes:
    """The bytes before the data of a safetensors file: u64 little-endian length, then the JSON
    header (compact) padded with spaces to a multiple of 8 bytes (safetensors spec)."""
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    return len(h).to_bytes(8, "little") + h


def write_safetensors(path: Path, items: list[tuple[str, str, list[int], object]]) -> None:
    """Write a safetensors file from (name, dtype, shape, source) where source is a numpy array or
    (file, start byte, end byte) to copy verbatim. Header padded to 8 bytes (safetensors spec)."""
    header, off = {}, 0
    for name, dt, shape, src in items:
        size = src.nbytes if isinstance(src, np.ndarray) else src[2] - src[1]
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + size]}
        off += size
    with open(path, "wb") as f:
        f.write(encode_header(header))
        for _, _, _, src in items:
            if isinstance(src, np.ndarray):
                f.write(np.ascontiguousarray(src).tobytes())
            else:
                with open(src[0], "rb") as g:
                    g.seek(src[1])
                    left = src[2] - src[1]
                    while left:
                        chunk = g.read(min(left, 1 << 24))
                        f.write(chunk)
                        left -= len(chunk)
