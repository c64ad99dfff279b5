"""safetensors files without torch: each file's JSON header, a draft directory's tensors as SGLang
would load them (several files, an index), single tensors' values (numpy, read from the byte
offsets in the header, so a multi-GB draft is checked without loading it), a bounded sample of a
tensor's values (the non-finite check), and a writer that copies tensor bytes verbatim
(`runner convert`).

Format (the safetensors spec): an 8-byte little-endian header length n, n bytes of JSON
({name: {dtype, shape, data_offsets}}, optional "__metadata__"), then the raw data; offsets are
relative to byte 8 + n. The writer pads the header to 8 bytes.

Every read is bounded by the file's size: a header length, an offset or a byte count past the
end is an InspectError, never a hang or a huge allocation. Several files: SGLang (0.5.6-0.5.23,
model_loader/weight_utils.py filter_duplicate_safetensors_files) loads every `*.safetensors` of
the folder, or, when `model.safetensors.index.json` exists, only the files its weight_map names;
a name in two loaded files is loaded twice and the later load wins, silently.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from eagle3_runner.runner.errors import InspectError

DTYPES = {"BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "I16": np.int16, "I32": np.int32,
          "I64": np.int64, "U16": np.uint16, "U32": np.uint32, "U64": np.uint64,
          "F16": np.float16, "BF16": np.uint16, "F32": np.float32, "F64": np.float64}
ITEMSIZE = {**{k: np.dtype(v).itemsize for k, v in DTYPES.items()},
            "F8_E4M3": 1, "F8_E5M2": 1}  # fp8: sized, but no numpy values
INT_DTYPES = ("I64", "I32", "I16", "I8", "U8", "U16", "U32", "U64")
FLOAT_DTYPES = ("BF16", "F16", "F32", "F64")
INDEX = "model.safetensors.index.json"
MAX_HEADER = 100 << 20
MAX_INDEX = 64 << 20


def read_header(path: Path) -> tuple[dict, int]:
    """Header of one safetensors file: ({name: {dtype, shape, data_offsets}}, data start byte).

    Raises InspectError on a corrupt header (a length past the end of the file included)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > min(MAX_HEADER, size - 8):
                raise InspectError(f"{path}: header length {n} is not plausible for a "
                                   f"{size}-byte file; re-export it.")
            header = json.loads(f.read(n))
    except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise InspectError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e})")
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
        isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 62 for x in xs)
    return (isinstance(e, dict) and isinstance(e.get("dtype"), str) and ints(e.get("shape"))
            and len(e["shape"]) <= 8 and ints(e.get("data_offsets"))
            and len(e["data_offsets"]) == 2 and e["data_offsets"][0] <= e["data_offsets"][1])


def numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def entry_problem(name: str, e: dict, start: int, file_size: int) -> str | None:
    """Why one header entry cannot be read (bytes past the end of the file, a byte count that
    does not match dtype x shape), or None."""
    a, b = e["data_offsets"]
    if start + b > file_size:
        return (f"tensor {name!r} ends at byte {start + b}, past the end of the {file_size}-byte "
                "file: the file is truncated")
    want = numel(e["shape"]) * ITEMSIZE[e["dtype"]] if e["dtype"] in ITEMSIZE else None
    if want is not None and want != b - a:
        return (f"tensor {name!r} holds {b - a} bytes, but {e['dtype']} x {e['shape']} needs "
                f"{want}")
    return None


def layout_problem(header: dict, start: int, file_size: int) -> str | None:
    """Why the tensors of one file do not tile its data, or None. The safetensors library (and
    so SGLang's loader) refuses a file whose byte ranges, in order, overlap or leave a gap
    ("invalid offset for tensor") or do not reach the end of the file ("incomplete metadata,
    file not fully covered"): the format indexes every data byte exactly once (safetensors
    0.4-0.7). Empty tensors take no bytes."""
    end = 0
    for name, e in sorted(header.items(), key=lambda kv: tuple(kv[1]["data_offsets"])):
        a, b = e["data_offsets"]
        if a != end:
            what = "overlaps the tensor before it" if a < end else \
                "leaves a gap after the one before"
            return (f"tensor {name!r} holds data bytes {a}..{b}, which {what} (it should start "
                    f"at {end}): the safetensors library, so SGLang, refuses the file ('invalid "
                    "offset')")
        end = b
    if start + end != file_size:
        return (f"the tensors cover {end} data bytes but the file holds {file_size - start}: "
                "the safetensors library, so SGLang, refuses the file ('incomplete metadata')")
    return None


@dataclass
class DraftScan:
    """A draft directory's safetensors as SGLang loads them."""

    tensors: dict = field(default_factory=dict)  # name -> {dtype, shape, data_offsets, file, start}
    duplicates: dict = field(default_factory=dict)  # name -> [files holding it], in load order
    excluded: list = field(default_factory=list)  # *.safetensors the index does not name
    problems: list = field(default_factory=list)  # unreadable files, bad entries, a bad index
    files: list = field(default_factory=list)  # the files loaded, in order


def scan_draft(draft_dir: Path) -> DraftScan:
    """Read every header of a draft directory without raising: which files load (the index), the
    tensors (a name in two files keeps the later file's, as SGLang's loader does), duplicates,
    and every problem as a one-line message."""
    d, out = Path(draft_dir), DraftScan()
    files = sorted(q for q in d.glob("*.safetensors") if not q.name.startswith("."))
    idx = d / INDEX
    if idx.exists():
        try:
            if idx.stat().st_size > MAX_INDEX:
                raise ValueError(f"{idx.stat().st_size} bytes")
            wm = json.loads(idx.read_text(encoding="utf-8")).get("weight_map")
            if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
                raise ValueError("no weight_map object of file names")
            named = set(wm.values())
            out.excluded = [p for p in files if p.name not in named]
            files = [p for p in files if p.name in named]
        except (OSError, ValueError, AttributeError, UnicodeDecodeError, RecursionError) as e:
            out.problems.append(f"{idx}: not a readable index ({e}); SGLang fails reading it "
                                "(json weight_map). Fix it or remove it.")
    for p in files:
        try:
            header, start = read_header(p)
            size = os.path.getsize(p)
        except (InspectError, OSError) as e:
            out.problems.append(str(e))
            continue
        out.files.append(p)
        whys = {k: entry_problem(k, v, start, size) for k, v in header.items()}
        if not any(whys.values()) and (why := layout_problem(header, start, size)):
            out.problems.append(f"{p}: {why}. Re-export it.")
        cut = [k for k, v in header.items() if start + v["data_offsets"][1] > size]
        grouped = set(cut) if len(cut) > 1 else set()  # one cause, one line, counting them
        if grouped:
            end = max(start + header[k]["data_offsets"][1] for k in cut)
            out.problems.append(f"{p}: the file is truncated: {len(cut)} of {len(header)} "
                                f"tensors end past the end of its {size} bytes (the last at "
                                f"byte {end}; first {cut[0]!r}). Re-export it.")
        for k, v in header.items():
            if whys[k]:
                if k not in grouped:
                    out.problems.append(f"{p}: {whys[k]}. Re-export it.")
                continue
            if k in out.tensors:
                out.duplicates.setdefault(k, [out.tensors[k]["file"]]).append(p)
            out.tensors[k] = {**v, "file": p, "start": start}
    return out


def draft_tensors(draft_dir: Path) -> dict[str, dict]:
    """{name: {dtype, shape, data_offsets, file, start}} of a draft directory, strictly: raises
    InspectError for any problem scan_draft finds, a name in two files included."""
    s = scan_draft(draft_dir)
    if s.problems:
        raise InspectError(s.problems[0])
    if s.duplicates:
        k, fs = next(iter(s.duplicates.items()))
        raise InspectError(f"tensor {k!r} is in {', '.join(str(f) for f in fs)}; SGLang loads "
                           "both and the later wins silently. Keep one copy.")
    return s.tensors


def _read(path: Path, offset: int, n: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        raw = f.read(n)
    if len(raw) != n:
        raise InspectError(f"{path}: {n} bytes at offset {offset} run past the end of the file "
                           "(truncated); re-export it.")
    return raw


def _decode(raw: bytes, dtype: str) -> np.ndarray:
    arr = np.frombuffer(raw, dtype=DTYPES[dtype])
    if dtype == "BF16":
        arr = (arr.astype(np.uint32) << 16).view(np.float32)
    return arr


def read_array(path: Path, entry: dict, start: int) -> np.ndarray:
    """The values of one tensor as numpy (BF16 is widened to float32). Raises InspectError for a
    dtype numpy cannot hold, a size mismatch or bytes past the end of the file."""
    if entry["dtype"] not in DTYPES:
        raise InspectError(f"{path}: dtype {entry['dtype']} cannot be read as numbers here")
    why = entry_problem("?", entry, start, os.path.getsize(path))
    if why:
        raise InspectError(f"{path}: {why}")
    a, b = entry["data_offsets"]
    return _decode(_read(path, start + a, b - a), entry["dtype"]).reshape(entry["shape"])


def tensor_values(t: dict) -> np.ndarray:
    """The values of one entry of draft_tensors(), shape t["shape"] (BF16 widened to float32)."""
    return read_array(t["file"], t, t["start"])


def nonfinite(t: dict, budget: int = 8 << 20, windows: int = 16) -> tuple[int, int, int]:
    """(non-finite values found, bytes read, bytes of the tensor) for a float tensor: the whole
    tensor when it is at most `budget` bytes, else `windows` evenly spaced windows of
    budget/windows bytes (a sample: a NaN outside them is not seen). Raises InspectError."""
    a, b = t["data_offsets"]
    total, item = b - a, ITEMSIZE[t["dtype"]]
    if total <= budget:
        spans = [(0, total)]
    else:
        w = max(item, budget // windows // item * item)
        step = (total - w) // (windows - 1) // item * item
        spans = [(i * step, w) for i in range(windows)]
    bad = got = 0
    for off, n in spans:
        vals = _decode(_read(t["file"], t["start"] + a + off, n), t["dtype"])
        bad += int(vals.size - np.count_nonzero(np.isfinite(vals)))
        got += n
    return bad, got, total


def encode_header(header: dict) -> bytes:
    """The bytes before the data of a safetensors file: u64 little-endian length, then the JSON
    header (compact) padded with spaces to a multiple of 8 bytes (safetensors spec)."""
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    return len(h).to_bytes(8, "little") + h


_CHUNK = 1 << 24
_ZEROS = bytes(_CHUNK)


def write_safetensors(path: Path, items: list[tuple[str, str, list[int], object]]) -> None:
    """Write a safetensors file from (name, dtype, shape, source) where source is a numpy array or
    (file, start byte, end byte) to copy verbatim (all-zero chunks are skipped over, so a sparse
    source stays sparse). Raises InspectError when a source ends early (never loops)."""
    header, off = {}, 0
    for name, dt, shape, src in items:
        size = src.nbytes if isinstance(src, np.ndarray) else src[2] - src[1]
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + size]}
        off += size
    head = encode_header(header)
    with open(path, "wb") as f:
        f.write(head)
        for _, _, _, src in items:
            if isinstance(src, np.ndarray):
                f.write(np.ascontiguousarray(src).tobytes())
                continue
            with open(src[0], "rb") as g:
                g.seek(src[1])
                left = src[2] - src[1]
                while left:
                    chunk = g.read(min(left, _CHUNK))
                    if not chunk:
                        raise InspectError(f"{src[0]} ends before byte {src[2]}: truncated.")
                    if chunk == _ZEROS[:len(chunk)]:
                        f.seek(len(chunk), 1)
                    else:
                        f.write(chunk)
                    left -= len(chunk)
        f.truncate(len(head) + off)
