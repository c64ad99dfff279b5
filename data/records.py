"""Reading raw records from a data file: JSON arrays and JSONL, plain, gzip or zstd, with every
record the reader cannot use counted by reason (never dropped or altered silently).

    read_records(path) -> (records, info)
    iter_records(path, info) -> (record, line), one at a time; info filled once exhausted

info: {"records_read": n parsed, "format": "json" | "jsonl", "compression": None | "gzip" |
"zstd", "truncated": bool, "lines": [the line each record starts on], "stopped_at_byte": int |
None (JSON arrays, in the decompressed text), "unusable": {reason: n} for records that never
became a record, "examples": {reason: ["file:line", ...]} (first 3 each)}.

Reasons counted here (all count toward data.max_bad_fraction, see data/conversations.py):
- "malformed": a JSONL line, or a JSON array element, that is not valid JSON. A bad element of
  an array is skipped to its matching close bracket (strings and escapes respected) and reading
  goes on with the next element, so one broken record costs one record.
- "truncated": the file ends inside a record, or a JSON array has no closing `]`, or a gzip
  stream ends early (the complete records before the cut are kept); one count.
- "trailing_data": non-blank text after a JSON array's closing `]` (e.g. two arrays
  concatenated); one count.
- "too_deep": a record nested deeper than Python's JSON parser goes (about 1,000 levels of
  lists or objects; no conversation is); it is skipped like a malformed one.
Bytes that are not UTF-8 are NOT replaced: they are decoded with `surrogateescape`, so they
reach the record as lone surrogates (U+DC80..U+DCFF), and cleaning drops that record as
"bad_encoding" (data/conversations.py), one count per record. A UTF-8 byte-order mark is dropped; a UTF-16
file is refused with the iconv command that converts it.

zstd: Python 3.14's `compression.zstd` when present, else the `zstandard` package when
importable, else a StageError naming both fixes (no new dependency). No torch.
"""

from __future__ import annotations

import codecs
import gzip
import json
import sys
import zlib
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

from eagle3_runner.runner.errors import StageError
from eagle3_runner.runner.files import GZIP_MAGIC, ZSTD_MAGIC

N_EXAMPLES = 3


class _Tally:
    """Counts of unusable records by reason, with the first few locations of each."""

    def __init__(self, path: Path):
        self.path, self.counts, self.examples = path, Counter(), {}

    def add(self, reason: str, where: str) -> None:
        self.counts[reason] += 1
        ex = self.examples.setdefault(reason, [])
        if len(ex) < N_EXAMPLES:
            ex.append(f"{self.path.name}:{where}")


# ----------------------------------------------------------------------------------------------
# bytes -> text


def _zstd_decompress(raw: bytes, path: Path) -> bytes:
    try:
        from compression import zstd  # Python 3.14+
        return zstd.decompress(raw)
    except ImportError:
        pass
    try:
        import zstandard
    except ImportError:
        raise StageError(f"data.path: {path} is zstd-compressed, and neither Python 3.14's "
                         "compression.zstd nor the `zstandard` package is available. Run `pip "
                         f"install zstandard`, or decompress it first (`zstd -d {path.name}`).")
    try:
        with zstandard.ZstdDecompressor().stream_reader(raw) as r:
            return r.read()
    except zstandard.ZstdError as e:
        raise StageError(f"data.path: {path}: corrupt zstd stream ({e}). Re-create the file.")


def _gunzip(raw: bytes, path: Path) -> tuple[bytes, bool]:
    """(decompressed bytes, whether the stream ended early). A cut gzip file keeps what was
    decompressed before the cut (reported as truncated); a corrupt one is a StageError."""
    try:
        return gzip.decompress(raw), False
    except EOFError:  # cut short: keep what decompresses
        d = zlib.decompressobj(wbits=31)
        try:
            return d.decompress(raw), True
        except zlib.error as e:
            raise StageError(f"data.path: {path}: corrupt gzip stream ({e}). Re-create the file.")
    except (OSError, zlib.error) as e:
        raise StageError(f"data.path: {path}: corrupt gzip stream ({e}). Re-create the file.")


def read_text(path: Path) -> tuple[str, str | None, bool]:
    """(text, compression, stream_truncated) of a data file: gzip/zstd by their magic bytes,
    UTF-8 with undecodable bytes kept as lone surrogates (surrogateescape), BOM dropped.
    Raises StageError for a missing file, a folder, a UTF-16 file or a corrupt stream."""
    path = Path(path)
    if not path.is_file():
        what = ("is a folder, not a file" if path.is_dir() else
                "is not a regular file (a device, pipe or socket)" if path.exists() else
                "does not exist")
        raise StageError(f"data.path: {path} {what}. Run `runner fetch sharegpt` for "
                         "ShareGPT, or point data.path at a JSONL or JSON file.")
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise StageError(f"data.path: {path}: cannot read ({e.strerror}).")
    comp, cut = None, False
    if raw.startswith(GZIP_MAGIC):
        comp = "gzip"
        raw, cut = _gunzip(raw, path)
    elif raw.startswith(ZSTD_MAGIC):
        comp = "zstd"
        raw = _zstd_decompress(raw, path)
    return _decode(raw, path), comp, cut


def _decode(raw: bytes, path: Path) -> str:
    """UTF-8 text, undecodable bytes kept as lone surrogates, BOM dropped; UTF-16 refused."""
    if raw.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        raise StageError(f"data.path: {path} is UTF-16; the reader wants UTF-8. Convert it: "
                         f"iconv -f UTF-16 -t UTF-8 {path.name} > {path.stem}.utf8{path.suffix}")
    return raw.removeprefix(codecs.BOM_UTF8).decode("utf-8", "surrogateescape")


# ----------------------------------------------------------------------------------------------
# text -> records


def _skip_ws(text: str, i: int) -> int:
    n = len(text)
    while i < n and text[i] in " \t\r\n":
        i += 1
    return i


def _value_end(text: str, i: int) -> int | None:
    """End (exclusive) of the JSON value starting at text[i], by bracket depth outside strings
    (escapes respected), or None when the text ends first. Used to step over a malformed array
    element: a value that is not an object/array ends at the next top-level ',' or ']'."""
    depth, in_str, esc, n = 0, False, False, len(text)
    j = i
    while j < n:
        c = text[j]
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
        elif c in "[{":
            depth += 1
        elif c in "]}":
            depth -= 1
            if depth == 0:
                return j + 1
            if depth < 0:  # the array's own close: a bare bad scalar ended before it
                return j
        elif c == "," and depth == 0:
            return j
        j += 1
    return None


def _line_of(text: str, i: int) -> int:
    return text.count("\n", 0, i) + 1


def _iter_json_array(text: str, tally: _Tally, info: dict) -> Iterator[tuple[Any, int]]:
    """(record, line) of a JSON array (text starts with '[' after blanks), one at a time; sets
    info["truncated"] and info["stopped_at_byte"] once exhausted. See the module docstring."""
    dec = json.JSONDecoder()
    i = _skip_ws(text, 0) + 1
    truncated, n = False, len(text)
    line, at = 1, 0  # line number of text[at]
    while True:
        i = _skip_ws(text, i)
        if i >= n:
            truncated = True
            break
        if text[i] == "]":
            i += 1
            break
        line, at = line + text.count("\n", at, i), i
        try:
            obj, j = dec.raw_decode(text, i)
        except (json.JSONDecodeError, RecursionError) as e:
            j = _value_end(text, i)
            if j is None:
                truncated = True
                break
            tally.add("too_deep" if isinstance(e, RecursionError) else "malformed", f"{line}")
        else:
            yield obj, line
        i = _skip_ws(text, j)
        if i < n and text[i] == ",":
            i += 1
    if truncated:
        tally.add("truncated", f"{_line_of(text, n)} (end of file)")
    elif _skip_ws(text, i) < n:
        tally.add("trailing_data", f"{_line_of(text, _skip_ws(text, i))}")
    info.update(truncated=truncated, stopped_at_byte=(
        len(text[:i].encode("utf-8", "surrogateescape")) if truncated else None))


def _iter_jsonl(text: str, tally: _Tally, path: Path, info: dict) -> Iterator[tuple[Any, int]]:
    """(record, line) of JSONL text, one at a time (only \\n ends a line: U+2028 and friends may
    sit inside strings). A bad last line is "truncated", any other bad line "malformed"; sets
    info["truncated"] and info["stopped_at_byte"] (None) once exhausted."""
    pending = None  # (line number, error) of a bad line: malformed, or truncated if the last
    start, k, n = 0, 0, len(text)
    while start <= n:
        end = text.find("\n", start)
        end = n if end < 0 else end
        line, start, k = text[start:end], end + 1, k + 1
        if not line.strip():
            continue
        if pending is not None:  # a non-blank line follows it: not the last
            tally.add("malformed", f"{pending[0]}")
            pending = None
        try:
            rec = json.loads(line)
        except RecursionError:
            tally.add("too_deep", f"{k}")
        except json.JSONDecodeError as e:
            pending = (k, e)
        else:
            yield rec, k
    if pending is not None:
        k, e = pending
        tally.add("truncated", f"{k}")
        print(f"data: {path}:{k}: the last line is not valid JSON ({e.msg}); skipped as "
              "a truncated record", file=sys.stderr)
    info.update(truncated=pending is not None, stopped_at_byte=None)


def _collect(pairs: Iterator[tuple[Any, int]]) -> tuple[list[Any], list[int]]:
    records, lines = [], []
    for rec, line in pairs:
        records.append(rec)
        lines.append(line)
    return records, lines


def read_records(path: Path) -> tuple[list[Any], dict]:
    """Raw records of a JSON array or JSONL file (plain, gzip or zstd) and the read info (module
    docstring). Raises StageError for a missing/unreadable file, UTF-16, a corrupt stream, or a
    single JSON object that is neither (pretty-printed) JSONL nor an array."""
    path = Path(path)
    text, comp, cut = read_text(path)
    return _parse(path, text, comp, cut)


def read_records_head(path: Path, max_bytes: int) -> tuple[list[Any], dict]:
    """read_records over the first `max_bytes` of the file's text (decompressed, streamed: a
    large file is not read whole): the records that end inside them, counted by the same rules;
    the cut itself is not a truncated record. info["whole"] says whether the head was the whole
    file. `runner init` surveys data this way. Raises as read_records."""
    from eagle3_runner.runner.disk import read_head
    path = Path(path)
    if not path.is_file():
        read_text(path)  # raises the StageError naming the file
    try:
        raw, _size, whole, kind = read_head(path, max_bytes)
    except (OSError, zlib.error) as e:
        raise StageError(f"data.path: {path}: cannot read ({e}). Re-create the file.")
    text = _decode(raw, path)
    if not whole:  # up to the last record that ends inside the head
        text = text[:text.rfind("\n") + 1] if not text.lstrip().startswith("[") else text
    records, info = _parse(path, text, None if kind == "plain" else kind, False)
    if not whole and info["format"] == "json" and info["truncated"]:  # the cut, not the file
        info["truncated"] = False
        info["unusable"].pop("truncated", None)
        info["examples"].pop("truncated", None)
    return records, {**info, "whole": whole}


def iter_records(path: Path, info: dict) -> Iterator[tuple[Any, int]]:
    """read_records one record at a time: (record, the line it starts on), by the same rules,
    without holding the records (a count over a large file: data/conversations.py count_file).
    Once exhausted, info holds read_records' info but "lines". Raises as read_records."""
    path = Path(path)
    text, comp, cut = read_text(path)
    return _iter_parse(path, text, comp, cut, info)


def _parse(path: Path, text: str, comp: str | None, cut: bool) -> tuple[list[Any], dict]:
    """Records of the text of `path` and the read info (read_records)."""
    info: dict = {}
    records, lines = _collect(_iter_parse(path, text, comp, cut, info))
    return records, {**info, "lines": lines}


def _iter_parse(path: Path, text: str, comp: str | None, cut: bool, info: dict
                ) -> Iterator[tuple[Any, int]]:
    """(record, line) of the text of `path`, one at a time; once exhausted, info holds the read
    info (read_records' but "lines"). Raises StageError for a single JSON object."""
    tally, n_read = _Tally(path), 0
    i = _skip_ws(text, 0)
    fmt = "json" if text.startswith("[", i) else "jsonl"
    pairs = (_iter_json_array(text, tally, info) if fmt == "json"
             else _iter_jsonl(text, tally, path, info))
    for pair in pairs:
        n_read += 1
        yield pair
    if fmt == "jsonl" and not n_read and tally.counts["malformed"] and text.startswith("{", i):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError:
            obj = None
        if isinstance(obj, dict):
            keys = ", ".join(list(obj)[:5])
            raise StageError(f"data.path: {path} holds one JSON object (keys: {keys}); "
                             "the reader wants JSONL (one record per line) or a JSON array "
                             "of records. Write its list of records out as either.")
    if cut and not info["truncated"]:
        info["truncated"] = True
        tally.add("truncated", "end of the gzip stream")
    truncated, stopped = info.pop("truncated"), info.pop("stopped_at_byte")
    info.update({"records_read": n_read, "format": fmt, "compression": comp,
                 "truncated": truncated, "stopped_at_byte": stopped,
                 "unusable": dict(sorted(tally.counts.items())), "examples": tally.examples})
