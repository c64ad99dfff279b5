"""Disk honesty for `runner plan`: the bytes an offline extract will write, estimated without a
tokenizer, next to the free space of the work_dir's filesystem.

Bytes per token = (len(aux ids) + 1 last) x target hidden x dtype bytes + 9 (int64 id + uint8
mask; targets/features.py): 4,617 B for SmolLM2 in bf16. Tokens are ESTIMATED from the head of
the data file (the first READ_BYTES): each record's turn texts at CHARS_PER_TOKEN characters
per token plus TURN_TOKENS chat-template tokens per turn, capped at data.max_length; with
stages.regenerate, only the first max_turns exchanges and at most max_new_tokens per answer,
plus its synthetic_prompts at their token caps (an upper bound: as many as its time allows), or
the carried regenerated set (stages.regenerate.reuse) itself when it is there (grown, extend:
its records plus the synthetic_prompts on top; the real conversations it regenerates are not
counted).
The record count is the file size over the mean record size of that head (exact when the
whole file was read), then holdout and max_samples apply. A gzip or zstd file (recognised by
its magic bytes, as data/records.py reads it) is read through its decompressor, its text size
taken from gzip's size trailer (zstd: the head's compression ratio). Cleaning (data/conversations.py)
may drop records, so the estimate errs high. `runner plan` prints it, and `runner init`
writes it into the spec's comments. No torch, no jobs/ (runner/ never imports them).
"""

from __future__ import annotations

import json
import shutil
import zlib
from pathlib import Path

from eagle3_runner.runner import carry
from eagle3_runner.runner.files import GZIP_MAGIC, ZSTD_MAGIC, expand_path
from eagle3_runner.runner.train_counts import train_samples

READ_BYTES = 4 << 20
CHARS_PER_TOKEN = 4.0  # English text under a BPE tokenizer, a rule of thumb
TURN_TOKENS = 5  # chatml: <|im_start|>role\n ... <|im_end|>\n
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def bytes_per_token(spec) -> int:
    """Feature bytes one token costs on disk (module docstring)."""
    dt = spec.target.dtype
    if dt == "auto":
        dt = "float32" if spec.target.device == "cpu" else "bfloat16"
    return (len(spec.aux_ids) + 1) * spec.target.hidden_size * DTYPE_BYTES[dt] + 9


def _records(head: bytes, whole: bool) -> tuple[list, int]:
    """(the complete JSON records at the start of a JSON array or JSONL file, how many records
    there were not valid JSON). A record cut off by the end of `head` is left out; a JSON array
    stops at its first bad record (data/records.py reads past it)."""
    text = head.decode("utf-8", errors="ignore").removeprefix("\ufeff")
    dec, out = json.JSONDecoder(), []
    i = len(text) - len(text.lstrip())
    if text[i:i + 1] == "[":
        i += 1
        while True:
            while i < len(text) and text[i] in " \t\r\n,":
                i += 1
            try:
                rec, i = dec.raw_decode(text, i)
            except (json.JSONDecodeError, RecursionError):  # the `]`, the cut, or a bad one
                return out, int(whole and text[i:].strip() not in ("", "]"))
            out.append(rec)
    lines = text.split("\n")  # only \n ends a JSONL line (data/records.py)
    bad = 0
    for ln in lines if whole else lines[:-1]:
        if not ln.strip():
            continue
        try:
            out.append(json.loads(ln))
        except (json.JSONDecodeError, RecursionError):
            bad += 1
    return out, bad


def _tokens(rec, max_length: int, regen) -> int:
    """Estimated tokens of one record (module docstring)."""
    turns = rec.get("conversations", rec.get("messages", rec.get("conversation"))) \
        if isinstance(rec, dict) else rec
    if not isinstance(turns, list):
        return 0
    n, users = 0, 0
    for t in turns:
        if not isinstance(t, dict):
            continue
        role = str(t.get("from", t.get("role", ""))).lower()
        est = len(str(t.get("value", t.get("content")) or "")) / CHARS_PER_TOKEN
        if role in ("human", "user"):
            users += 1
            if regen is not None and regen.max_turns and users > regen.max_turns:
                break
        elif role in ("gpt", "assistant", "chatgpt", "bing", "bard") and regen is not None:
            est = min(est, regen.max_new_tokens)
        n += int(est) + TURN_TOKENS
    return min(n, max_length)


def data_file(spec) -> Path:
    """The file the stages after regenerate read: a carried regenerated set
    (stages.regenerate.reuse) when it is there, else data.path, else the fetched ShareGPT
    asset. Raises FetchError."""
    carried = carry.present(spec)
    if carried is not None:
        return carried
    if spec.data.path:
        return expand_path(spec.data.path)
    from eagle3_runner.runner.assets import asset_path
    return asset_path("sharegpt")


def _zstd_stream(f):
    try:
        from compression import zstd  # Python 3.14+
        return zstd.ZstdFile(f)
    except ImportError:
        pass
    try:
        import zstandard
    except ImportError:
        raise OSError("a zstd file needs Python 3.14's compression.zstd or `pip install "
                      "zstandard`") from None
    return zstandard.ZstdDecompressor().stream_reader(f)


def read_head(path: Path, n: int = READ_BYTES) -> tuple[bytes, int, bool, str]:
    """(the first n bytes (default READ_BYTES) of the file's text, decompressed; the text's size
    in bytes: exact, or for a compressed file read in part gzip's size trailer (mod 2^32, placed
    by the head's compression ratio) or, zstd, that ratio; whether the head is the whole text;
    "plain" / "gzip" / "zstd")."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        magic = f.read(4)
        f.seek(0)
        if not magic.startswith((GZIP_MAGIC, ZSTD_MAGIC)):
            head = f.read(n)
            return head, size, len(head) >= size, "plain"
        kind = "gzip" if magic.startswith(GZIP_MAGIC) else "zstd"
        members = 1
        if kind == "gzip":
            head, whole, members, got = _gzip_head(f, n)
        else:
            head, whole = _read_stream(_zstd_stream(f), n)
            got = len(head)
        est = round(size * got / max(f.tell(), 1))  # the ratio of what was read (zstd: rough)
        # ISIZE, the text size mod 2^32 (the one nearest est), is the LAST member's: the whole
        # text's only in a one-member file (a regenerated set's shards joined are many members)
        if kind == "gzip" and not whole and members == 1:
            f.seek(-4, 2)
            isize = int.from_bytes(f.read(4), "little")
            est = isize + max(0, round((est - isize) / 2**32)) * 2**32
    return head, len(head) if whole else est, whole, kind


def _read_stream(stream, n: int) -> tuple[bytes, bool]:
    """(up to n decompressed bytes of a zstd stream, whether it ended there)."""
    head = stream.read(n)
    return head, not stream.read(1)


def _gzip_head(f, n: int) -> tuple[bytes, bool, int, int]:
    """(up to n decompressed bytes of the gzip file `f`, whether the file ended there, the
    members begun, what the compressed bytes read so far decompress to in bytes), member after
    member (`gzip -c a b > ab.gz`). A file cut short ends where it was cut, with what
    decompresses before the cut, as data/records.py reads it (it keeps the complete records
    and counts the cut). Raises zlib.error for a corrupt stream."""
    parts, got, d, members, ended = [], 0, zlib.decompressobj(wbits=31), 1, False
    while got <= n:
        raw = f.read(1 << 16)
        if not raw:
            return b"".join(parts)[:n], True, members, got
        while raw:
            if ended:  # bytes after a member's end: the next member
                members, ended = members + 1, False
            b = d.decompress(raw)
            parts.append(b)
            got += len(b)
            if d.eof:
                raw, d, ended = d.unused_data, zlib.decompressobj(wbits=31), True
            else:
                raw = b""
    return b"".join(parts)[:n], False, members, got


def estimate(spec) -> dict:
    """The offline features of `spec`: {"tokens", "samples", "bytes_per_token", "bytes",
    "method"} (all estimates), or {"error": why, "bytes_per_token"} when the data cannot be
    read."""
    bpt = bytes_per_token(spec)
    try:
        path = data_file(spec)
        head, size, whole, kind = read_head(path)
    except Exception as e:  # noqa: BLE001 - no estimate is not a planning error
        return {"error": f"cannot read the data ({e})", "bytes_per_token": bpt}
    recs, bad = _records(head, whole)
    if not recs:
        return {"error": f"no complete record in the first {len(head):,} bytes of {path}",
                "bytes_per_token": bpt}
    regen = spec.stages.regenerate
    carried = path == carry.present(spec)
    per = [_tokens(r, spec.data.max_length, None if carried else regen) for r in recs]
    n_file = len(recs) if whole else round(size * len(recs) / len(head))
    n = max(0, n_file - spec.data.holdout)
    n = min(n, spec.data.max_samples) if spec.data.max_samples else n
    tokens = round(n * sum(per) / len(per))
    # a set grown (stages.regenerate.extend) gets up to synthetic_prompts new ones on top
    synth = 0 if regen is None or (carried and not regen.extend) else regen.synthetic_prompts
    if synth:  # self-written prompts, as many as the stage's time allows: at their token caps
        n += synth
        tokens += synth * min(spec.data.max_length, regen.synthetic_max_tokens
                              + regen.max_new_tokens + 2 * TURN_TOKENS)
    return {"tokens": tokens, "samples": n, "bytes_per_token": bpt, "bytes": tokens * bpt,
            "method": f"estimate: {len(recs):,} of {'' if whole else '~'}{n_file:,} records read"
                      f"{' (the carried regenerated set)' if carried else ''}"
                      f"{'' if kind == 'plain' else ' (' + kind + ')'}"
                      + (f", {bad:,} not readable as JSON (not counted; the stages count "
                         "them against data.max_bad_fraction)" if bad else "")
                      + f", {CHARS_PER_TOKEN:g} characters per token"
                      + (f", + up to {synth:,} self-written prompts "
                         "(stages.regenerate.synthetic_prompts) at their token caps"
                         if synth else "")}


def train_share(spec, e: dict) -> dict:
    """An online train stage's part of `estimate` e: its training samples (the held-out
    stages.train.eval_samples left out, at most stages.train.num_samples) with their tokens and
    what those would take as offline features. Epochs repeat the same samples: no more bytes."""
    n = train_samples(spec.stages.train, e["samples"])
    tokens = round(e["tokens"] * n / e["samples"]) if e["samples"] else 0
    return {**e, "samples": n, "tokens": tokens, "bytes": tokens * e["bytes_per_token"]}


def free_bytes(work_dir: Path) -> tuple[int, str]:
    """(free bytes, the existing folder measured) of the filesystem work_dir is (or will be) on."""
    p = Path(work_dir).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free, str(p)


def report(extracts: list[tuple[str, object]], online: list[tuple[str, object]],
           work_dir: Path) -> dict:
    """The plan's disk section. extracts: (stage id, spec) of each extract the plan runs;
    online: (stage id, spec) of each online train. Returns {"free_bytes", "filesystem",
    "extract": [{"stage", **estimate}], "online": [...], "extract_bytes", "fits", "advice"}."""
    free, where = free_bytes(work_dir)
    ex = [{"stage": sid, **estimate(s)} for sid, s in extracts]
    on = []
    for sid, s in online:
        e = estimate(s)
        on.append({"stage": sid, **(train_share(s, e) if "bytes" in e else e)})
    total = sum(e.get("bytes", 0) for e in ex)
    fits = total <= free
    advice = None if fits else (
        f"the extract estimate ({total / 1e9:,.1f} GB) exceeds the {free / 1e9:,.1f} GB free on "
        f"{where}: set stages.train.features: online (and remove stages.extract) to train "
        "without writing features, or move work_dir.")
    return {"free_bytes": free, "filesystem": where, "extract": ex, "online": on,
            "extract_bytes": total, "fits": fits, "advice": advice}


def gb(b: float) -> str:
    """Bytes as the plan prints them: 1,234.5 GB."""
    return f"{b / 1e9:,.1f} GB"


def render(d: dict) -> list[str]:
    """The plan text's disk lines."""
    out = []
    for e in d["extract"]:
        out.append(f"disk: {e['stage']} writes ~{gb(e['bytes'])} of features (~{e['tokens']:,} "
                   f"tokens x {e['bytes_per_token']:,} B; {e['method']})" if "bytes" in e else
                   f"disk: {e['stage']}: {e['error']}")
    for e in d["online"]:
        if "bytes" not in e:
            out.append(f"disk: {e['stage']} runs the target online: no features written")
            continue
        more = (f": {e['bytes'] / max(d['free_bytes'], 1):.1f}x the {gb(d['free_bytes'])} free on "
                f"{d['filesystem']}, more than an extract could write there"
                if e["bytes"] > d["free_bytes"] else "")
        out.append(f"disk: {e['stage']} runs the target online: no features written; it trains "
                   f"on ~{e['tokens']:,} tokens ({e['samples']:,} samples), ~{gb(e['bytes'])} as "
                   f"offline features{more}")
    out.append(f"disk: {gb(d['free_bytes'])} free on {d['filesystem']}")
    if d["advice"]:
        out.append(f"disk: NOT ENOUGH SPACE: {d['advice']}")
    return out
