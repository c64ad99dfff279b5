"""Disk honesty for `runner plan`: the bytes an offline extract will write, estimated without a
tokenizer, next to the free space of the work_dir's filesystem.

Bytes per token = (len(aux ids) + 1 last) x target hidden x dtype bytes + 9 (int64 id + uint8
mask; jobs/features.py): 4,617 B for SmolLM2 in bf16. Tokens are ESTIMATED from the head of
the data file (the first READ_BYTES): each record's turn texts at CHARS_PER_TOKEN characters
per token plus TURN_TOKENS chat-template tokens per turn, capped at data.max_length; with
stages.regenerate, only the first max_turns exchanges and at most max_new_tokens per answer.
The record count is the file size over the mean record size of that head (exact when the
whole file was read), then holdout and max_samples apply. Cleaning (jobs/data.py) may drop
records, so the estimate errs high. No torch, no jobs/ (runner/ never imports them).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from runner.files import expand_path

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


def _records(head: bytes, whole: bool) -> list:
    """The complete JSON records at the start of a JSON array or JSONL file (a record cut off by
    the end of `head` is left out)."""
    text = head.decode("utf-8", errors="ignore")
    dec, out = json.JSONDecoder(), []
    i = len(text) - len(text.lstrip())
    if text[i:i + 1] == "[":
        i += 1
        while True:
            while i < len(text) and text[i] in " \t\r\n,":
                i += 1
            try:
                rec, i = dec.raw_decode(text, i)
            except json.JSONDecodeError:
                return out
            out.append(rec)
    lines = text.splitlines()
    for ln in lines if whole else lines[:-1]:
        try:
            out.append(json.loads(ln))
        except json.JSONDecodeError:
            pass
    return out


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
    """The spec's data file: data.path, else the fetched ShareGPT asset. Raises FetchError."""
    if spec.data.path:
        return expand_path(spec.data.path)
    from runner.assets import asset_path
    return asset_path("sharegpt")


def estimate(spec) -> dict:
    """The offline features of `spec`: {"tokens", "samples", "bytes_per_token", "bytes",
    "method"} (all estimates), or {"error": why} when the data cannot be read."""
    try:
        path = data_file(spec)
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(READ_BYTES)
    except Exception as e:  # noqa: BLE001 - no estimate is not a planning error
        return {"error": f"cannot read the data ({e})"}
    whole = len(head) >= size
    recs = _records(head, whole)
    if not recs:
        return {"error": f"no complete record in the first {len(head):,} bytes of {path}"}
    per = [_tokens(r, spec.data.max_length, spec.stages.regenerate) for r in recs]
    n_file = len(recs) if whole else round(size * len(recs) / len(head))
    n = max(0, n_file - spec.data.holdout)
    n = min(n, spec.data.max_samples) if spec.data.max_samples else n
    tokens = round(n * sum(per) / len(per))
    bpt = bytes_per_token(spec)
    return {"tokens": tokens, "samples": n, "bytes_per_token": bpt, "bytes": tokens * bpt,
            "method": f"estimate: {len(recs):,} of {'' if whole else '~'}{n_file:,} records read, "
                      f"{CHARS_PER_TOKEN:g} characters per token"}


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
    on = [{"stage": sid, **estimate(s)} for sid, s in online]
    total = sum(e.get("bytes", 0) for e in ex)
    fits = total <= free
    advice = None if fits else (
        f"the extract estimate ({total / 1e9:,.1f} GB) exceeds the {free / 1e9:,.1f} GB free on "
        f"{where}: set stages.train.features: online (and remove stages.extract) to train "
        "without writing features, or move work_dir.")
    return {"free_bytes": free, "filesystem": where, "extract": ex, "online": on,
            "extract_bytes": total, "fits": fits, "advice": advice}


def render(d: dict) -> list[str]:
    """The plan text's disk lines."""
    gb = lambda b: f"{b / 1e9:,.1f} GB"  # noqa: E731
    out = []
    for e in d["extract"]:
        out.append(f"disk: {e['stage']} writes ~{gb(e['bytes'])} of features (~{e['tokens']:,} "
                   f"tokens x {e['bytes_per_token']:,} B; {e['method']})" if "bytes" in e else
                   f"disk: {e['stage']}: {e['error']}")
    for e in d["online"]:
        offline = f" (offline: ~{gb(e['bytes'])}, ~{e['tokens']:,} tokens)" if "bytes" in e else ""
        out.append(f"disk: {e['stage']} runs the target online: no features written{offline}")
    out.append(f"disk: {gb(d['free_bytes'])} free on {d['filesystem']}")
    if d["advice"]:
        out.append(f"disk: NOT ENOUGH SPACE: {d['advice']}")
    return out
