"""Training conversations: roles, cleaning, sampling, the drop report, and (re-exported) reading
(data/records.py) and tokenising with the target's own chat template (data/chat.py).
The user's view of all of this: docs/data.md.

Public API (extract, regenerate, online training and the bench's `sharegpt` prompt set use it):

    load_conversations(data_spec) -> (train, holdout, report)
    conversations_from_file(path) -> (conversations, report)     # no sampling, no fraction check
    conversations_from_records(records, info) -> the same, for records read elsewhere
    count_file(path) -> report                  # the same report, streamed, none kept, cached
    check_conversations(report, data_spec)      # the stages' verdicts on a report (StageError)
    data_problems(data_spec) -> [message]       # those verdicts before any stage (validate/plan)
    read_records(path) -> (records, info); clean_records(records) -> (conversations, report)
    check_bad_fraction(report, max_bad_fraction)                  # raises StageError above it
    show_data_report(ctx, report, tokenize_report=None)  # printed; dropped/<reason> metrics
    tokenize_conversation / tokenize_dataset / detect_template / chat_convention (data/chat.py)

A conversation is a list of turns {"role": "system"|"user"|"assistant"|"tool", "content": str},
an assistant turn optionally with "tool_calls" (list) and "reasoning_content" (str), passed to
the chat template as they are.

Records: {"conversations"|"messages"|"conversation": [turns]} or a bare list of turns; a turn is
ShareGPT {"from", "value"} or OpenAI {"role", "content"}, content a string or a list of parts
({"type": "text", "text": ...} or strings; joined with "\\n").
Roles (case-insensitive): human/user -> user; gpt/chatgpt/bard/bing/assistant/model/
function_call -> assistant; system/developer -> system; tool/function/observation/ipython/
tool_response -> tool. Tool and system turns stay in the context (anywhere in the conversation)
and are never trained on (the loss mask covers assistant spans only).

Cleaning (counted in report["dropped"] / report["trimmed"], keyed by reason):
- contents are stripped; empty turns are removed (an assistant turn with tool_calls is kept);
  consecutive user, assistant or system turns are merged (not tool turns, not turns with
  tool_calls or reasoning_content).
- leading assistant/tool turns after the system turns are trimmed (split continuations);
  trailing non-assistant turns are trimmed.
- dropped records, UNUSABLE (count toward data.max_bad_fraction: the file or the reader is
  wrong): "malformed" (not JSON, or not the shape above), "truncated", "trailing_data",
  "too_deep" (from data/records.py), "bad_encoding" (bytes that are not UTF-8 in a role or content),
  "unknown_role" (report["unknown_roles"] counts the names).
- dropped records, POLICY (do not count: the data is fine, the record just has nothing to train
  on): "empty", "no_assistant", "starts_with_assistant" (only an assistant continuation),
  "non_text_content" (image/audio parts), "duplicate" (exact duplicates after cleaning).
The fraction = unusable / records seen (parsed records + the unusable ones the reader could not
parse). The fetched ShareGPT JSON loses 1 of 17,672 records to its upstream truncation and has no
other unusable record; its ~6,400 records that start with a gpt turn are trimmed, not dropped.
Sampling: the cleaned records are shuffled with random.Random(data.seed); the first
`data.holdout` are held out (never trained on), the next `data.max_samples` are the training set.
The holdout does not depend on max_samples, so data-scaling variants share it.
"""

from __future__ import annotations

import copy
import hashlib
import json
import random
import re
import sys
from collections import Counter
from functools import lru_cache
from pathlib import Path
from typing import Any

from eagle3_runner.data.chat import (chat_convention, detect_template,  # noqa: F401 (API)
                       tokenize_conversation, tokenize_dataset)
from eagle3_runner.data.records import read_records  # noqa: F401 (API)
from eagle3_runner.runner.errors import StageError

ROLE_MAP = {"human": "user", "user": "user",
            "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant", "bing": "assistant",
            "assistant": "assistant", "model": "assistant", "function_call": "assistant",
            "system": "system", "developer": "system",
            "tool": "tool", "function": "tool", "observation": "tool", "ipython": "tool",
            "tool_response": "tool"}
UNUSABLE = ("malformed", "truncated", "trailing_data", "too_deep", "bad_encoding", "unknown_role")
POLICY = ("empty", "no_assistant", "starts_with_assistant", "non_text_content", "duplicate")
_SURROGATE = re.compile("[\ud800-\udfff]")  # undecodable bytes (surrogateescape) or bad escapes
_MERGEABLE = ("user", "assistant", "system")
# validate and plan count a data file up to this size (once per file version, ~16 s per GB on
# one core; the text is held while it is read); a larger one is checked by the stage alone
COUNT_MAX_BYTES = 2 << 30


# ----------------------------------------------------------------------------------------------
# one record


def _text(content: Any) -> tuple[str | None, str | None]:
    """(text, None) of a turn's content (str, None, or a list of text parts), or (None, why)."""
    if content is None or isinstance(content, str):
        return (content or ""), None
    if not isinstance(content, list):
        return None, "malformed"
    parts = []
    for p in content:
        if isinstance(p, str):
            parts.append(p)
        elif isinstance(p, dict) and p.get("type", "text") == "text" and \
                isinstance(p.get("text"), str):
            parts.append(p["text"])
        elif isinstance(p, dict) and isinstance(p.get("type"), str):
            return None, "non_text_content"
        else:
            return None, "malformed"
    return "\n".join(parts), None


def normalize_record(rec: Any) -> tuple[list[dict] | None, str | None, list[str]]:
    """One raw record -> (conversation or None, drop reason or None, trim notes).

    conversation: turns as in the module docstring, starting with system turns or a user turn,
    ending with an assistant turn. A reason "unknown_role:<name>" names the role."""
    turns = rec.get("conversations", rec.get("messages", rec.get("conversation"))) \
        if isinstance(rec, dict) else rec
    if not isinstance(turns, list):
        return None, "malformed", []
    conv: list[dict] = []
    notes: list[str] = []
    for t in turns:
        if not isinstance(t, dict):
            return None, "malformed", []
        role = t.get("from", t.get("role"))
        if not isinstance(role, str):
            return None, "malformed", []
        content, why = _text(t.get("value", t.get("content")))
        if why:
            return None, why, []
        reasoning = t.get("reasoning_content")
        if _SURROGATE.search(role) or _SURROGATE.search(content) or \
                (isinstance(reasoning, str) and _SURROGATE.search(reasoning)):
            return None, "bad_encoding", []
        mapped = ROLE_MAP.get(role.strip().lower())
        if mapped is None:
            return None, "unknown_role:" + role.strip().lower()[:40], []
        turn = {"role": mapped, "content": content.strip()}
        if mapped == "assistant":
            if isinstance(t.get("tool_calls"), list) and t["tool_calls"]:
                turn["tool_calls"] = t["tool_calls"]
            if isinstance(reasoning, str) and reasoning.strip():
                turn["reasoning_content"] = reasoning.strip()
        if not turn["content"] and len(turn) == 2:
            notes.append("empty_turn")
            continue
        last = conv[-1] if conv else None
        if last and last["role"] == mapped and mapped in _MERGEABLE and len(last) == 2 \
                and len(turn) == 2:
            last["content"] += "\n\n" + turn["content"]
            notes.append("merged_turn")
            continue
        conv.append(turn)
    if not conv:
        return None, "empty", notes
    n_head = 0
    while n_head < len(conv) and conv[n_head]["role"] == "system":
        n_head += 1
    head, body = conv[:n_head], conv[n_head:]
    while body and body[0]["role"] in ("assistant", "tool"):
        notes.append("leading_" + body[0]["role"])
        body = body[1:]
    while body and body[-1]["role"] != "assistant":
        notes.append("trailing_" + body[-1]["role"])
        body = body[:-1]
    if not body:
        return None, ("starts_with_assistant" if "leading_assistant" in notes else
                      "no_assistant"), notes
    return head + body, None, notes


class Cleaner:
    """clean_records one record at a time: add(record, where) -> the conversation or None (dropped,
    counted); report() -> clean_records' report of the records added so far. Keeps a 20-byte
    digest per kept conversation (the duplicate check), never the conversations."""

    def __init__(self):
        self.seen: set[bytes] = set()
        self.dropped, self.trimmed, self.unknown = Counter(), Counter(), Counter()
        self.examples: dict[str, list[str]] = {}

    def add(self, rec: Any, where: str) -> list[dict] | None:
        conv, why, notes = normalize_record(rec)
        self.trimmed.update(notes)
        if why is None:
            key = hashlib.sha1(json.dumps(conv, ensure_ascii=False).encode()).digest()
            if key not in self.seen:
                self.seen.add(key)
                return conv
            why = "duplicate"
        if why.startswith("unknown_role:"):
            self.unknown[why.split(":", 1)[1]] += 1
            why = "unknown_role"
        self.dropped[why] += 1
        if why in UNUSABLE and len(self.examples.setdefault(why, [])) < 3:
            self.examples[why].append(where)
        return None

    def report(self) -> dict:
        return {"dropped": dict(sorted(self.dropped.items())),
                "trimmed": dict(sorted(self.trimmed.items())),
                "unknown_roles": dict(self.unknown.most_common(20)), "examples": self.examples}


def clean_records(records: list[Any], where: list[str] | None = None
                  ) -> tuple[list[list[dict]], dict]:
    """Normalise, drop and deduplicate. where[i] names record i in messages (e.g. "d.jsonl:12";
    default "record i", 0-based). Returns (conversations, report {"dropped": {reason: n},
    "trimmed": {note: n}, "unknown_roles": {name: n}, "examples": {reason: [where, ...]}})."""
    cleaner = Cleaner()
    out = [conv for i, rec in enumerate(records)
           if (conv := cleaner.add(rec, where[i] if where else f"record {i}")) is not None]
    return out, cleaner.report()


# ----------------------------------------------------------------------------------------------
# one file


def conversations_from_file(path: Path) -> tuple[list[list[dict]], dict]:
    """Read and clean a data file (cached per file version; callers must not mutate the
    conversations). report: path, format, compression, records_read, records_seen, truncated,
    stopped_at_byte, dropped {every reason, reader's included}, unusable {reason: n},
    unusable_records, bad_fraction, examples {reason: [where]}, trimmed, unknown_roles, clean.
    Raises StageError for a missing or unreadable file."""
    path = Path(path)
    if not path.is_file():
        read_records(path)  # raises the StageError naming the file
    st = path.stat()
    convs, rep = _clean_cached(str(path.resolve()), st.st_size, st.st_mtime)
    return convs, copy.deepcopy(rep)


@lru_cache(maxsize=4)
def _clean_cached(path: str, size: int, mtime: float):
    records, info = read_records(Path(path))
    return conversations_from_records(records, {"path": path, **info})


def conversations_from_records(records: list[Any], info: dict) -> tuple[list[list[dict]], dict]:
    """Clean records a reader returned and count them: info = {"path", "records_read", format,
    compression, ...} plus, from data/records.py read_records, "lines" (where each record
    starts), "unusable" and "examples" (the records it could not parse). Returns
    conversations_from_file's (conversations, report). The regenerate artifact's records
    (targets/capture.py) go through here too."""
    info = dict(info)
    name = Path(info["path"]).name
    lines = info.pop("lines", None)
    convs, rep = clean_records(records, [f"{name}:{k}" for k in lines] if lines else None)
    return convs, _file_report(info, rep, len(convs))


def _file_report(info: dict, rep: dict, clean: int) -> dict:
    """conversations_from_file's report: the reader's info (its own unusable records and
    examples included) merged with the cleaner's report (clean_records) of `clean` kept."""
    info = dict(info)
    lost = info.pop("unusable", {})  # records the reader could not parse
    dropped = Counter(lost) + Counter(rep["dropped"])
    ex_read, ex_clean = info.pop("examples", {}), rep["examples"]
    examples = {r: (ex_read.get(r, []) + ex_clean.get(r, []))[:3] for r in {*ex_read, *ex_clean}}
    seen = info["records_read"] + sum(lost.values())
    unusable = {r: n for r, n in sorted(dropped.items()) if r in UNUSABLE}
    bad = sum(unusable.values())
    return {**info, "records_seen": seen,
            "dropped": dict(sorted(dropped.items())), "unusable": unusable,
            "unusable_records": bad, "bad_fraction": bad / seen if seen else 0.0,
            "examples": examples, "trimmed": rep["trimmed"],
            "unknown_roles": rep["unknown_roles"], "clean": clean}


def count_file(path: Path) -> dict:
    """conversations_from_file's report without the conversations: the file streamed through
    the same reader and cleaner (data/records.py iter_records, Cleaner), record by record, none
    kept. Cached by the file's path, size and mtime (and the reader's and cleaner's source): in
    this process and as a small JSON file under memo_dir()/data-counts/, so that `runner
    validate` and `runner plan` count a large file once. Raises as conversations_from_file."""
    path = Path(path)
    if not path.is_file():
        read_records(path)  # raises the StageError naming the file
    st = path.stat()
    return copy.deepcopy(_count_cached(str(path.resolve()), st.st_size, st.st_mtime_ns))


@lru_cache(maxsize=16)
def _count_cached(path: str, size: int, mtime_ns: int) -> dict:
    from eagle3_runner.data import records as records_mod
    from eagle3_runner.runner.files import atomic_write, memo_dir
    h = hashlib.sha256(json.dumps([path, size, mtime_ns]).encode())
    for code in (records_mod.__file__, __file__):  # a changed rule is a new count
        h.update(Path(code).read_bytes())
    memo = memo_dir() / "data-counts" / f"{h.hexdigest()[:32]}.json"
    try:
        return json.loads(memo.read_text())
    except (OSError, ValueError):
        pass
    info: dict = {"path": path}
    cleaner, name, clean = Cleaner(), Path(path).name, 0
    for rec, line in records_mod.iter_records(Path(path), info):
        clean += cleaner.add(rec, f"{name}:{line}") is not None
    rep = _file_report(info, cleaner.report(), clean)
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(memo, json.dumps(rep))
    except OSError:  # a read-only cache only costs time
        pass
    return rep


def _reasons(counts: dict, examples: dict | None = None) -> str:
    ex = examples or {}
    return ", ".join(f"{r} {n}" + (f" (first at {ex[r][0]})" if ex.get(r) else "")
                     for r, n in sorted(counts.items(), key=lambda kv: -kv[1]))


def _hints(report: dict) -> str:
    out = []
    if report["unusable"].get("bad_encoding"):
        out.append("bad_encoding = bytes that are not UTF-8: convert the file, e.g. `iconv -f "
                   "latin1 -t utf-8 IN > OUT`")
    if report["unknown_roles"]:
        out.append(f"unknown roles {report['unknown_roles']} (known: {', '.join(ROLE_MAP)})")
    return ("; " + "; ".join(out)) if out else ""


def check_bad_fraction(report: dict, max_bad_fraction: float) -> None:
    """Raise StageError when report["bad_fraction"] exceeds data.max_bad_fraction, naming the
    field, the counts, where the first bad records are, and the fix."""
    if report["bad_fraction"] <= max_bad_fraction:
        return
    raise StageError(
        f"data.max_bad_fraction = {max_bad_fraction:g}: {report['unusable_records']} of "
        f"{report['records_seen']} records of {report['path']} "
        f"({100 * report['bad_fraction']:.2f}%) cannot be used: "
        f"{_reasons(report['unusable'], report['examples'])}{_hints(report)}. Fix the file, or "
        "raise data.max_bad_fraction to accept the loss (docs/data.md).")


def data_file(data) -> Path:
    """The file the spec's data block names: data.path, else (source sharegpt) the fetched
    ShareGPT. Raises StageError when there is none."""
    from eagle3_runner.runner.files import expand_path
    if data.path:
        return expand_path(data.path)
    if data.source == "sharegpt":
        from eagle3_runner.runner.assets import FetchError, asset_path
        try:
            return asset_path("sharegpt")
        except FetchError as e:
            raise StageError(f"data.source = sharegpt: {e}")
    raise StageError("data.path: required when data.source is jsonl")


def check_conversations(report: dict, data) -> None:
    """The verdicts on a data file's report (conversations_from_file's, or count_file's), the
    stages' and the plan's alike: no usable conversation; above data.max_bad_fraction
    (check_bad_fraction); a data.holdout that leaves no conversation to train on. Raises
    StageError naming the field, the counts and the fix."""
    rep = report
    if not rep["clean"]:
        skipped = ("; its last record was not valid JSON and was skipped" if rep["truncated"]
                   else "")
        reasons = _reasons(rep["dropped"], rep["examples"])
        raise StageError(f"data: {rep['path']} has no usable conversation ({rep['records_read']} "
                         f"records read{skipped}{'; dropped ' + reasons if reasons else ''}"
                         f"{_hints(rep)}). Records need user and assistant turns (from/value or "
                         "role/content; docs/data.md).")
    check_bad_fraction(rep, data.max_bad_fraction)
    if rep["clean"] <= data.holdout:  # data.max_samples >= 1: train gets what holdout leaves
        raise StageError(f"data.holdout = {data.holdout}: leaves no training conversation "
                         f"({rep['clean']} usable). Lower data.holdout.")


def data_problems(data) -> list[str]:
    """What check_conversations would refuse in the spec's data file, said before any stage
    runs (`runner validate` and `runner plan`, through runner/stages.py): the file counted by
    count_file (streamed, cached), held to the stages' own verdicts. [] when it passes, and for
    a file over COUNT_MAX_BYTES (not counted before the run: the stage checks it)."""
    try:
        path = data_file(data)
        if path.is_file() and path.stat().st_size > COUNT_MAX_BYTES:
            return []
        check_conversations(count_file(path), data)
    except StageError as e:
        return [str(e)]
    return []


def train_conversations(data) -> int | None:
    """How many conversations load_conversations gives the stages to train on (the usable ones
    after data.holdout, at most data.max_samples), from count_file's count, before any stage
    runs: an upper bound of the training samples (the bench-prompt guard and the tokenizer may
    drop some more). None when the file is not counted before the run (over COUNT_MAX_BYTES)
    or cannot be read (data_problems says why). Raises nothing."""
    try:
        path = data_file(data)
        if not path.is_file() or path.stat().st_size > COUNT_MAX_BYTES:
            return None
        clean = count_file(path)["clean"]
    except (StageError, OSError):
        return None
    n = max(0, clean - data.holdout)
    return n if data.max_samples is None else min(n, data.max_samples)


def load_conversations(data) -> tuple[list[list[dict]], list[list[dict]], dict]:
    """Read, clean, check and sample the spec's conversations.

    data: runner.spec.sections.Data (source, path, max_samples, holdout, seed, max_bad_fraction).
    Returns (train, holdout, report): conversations_from_file's report + source,
    max_bad_fraction, train, holdout. Raises StageError for a missing file, when nothing usable
    remains, above data.max_bad_fraction or when data.holdout leaves nothing to train on
    (check_conversations)."""
    convs, rep = conversations_from_file(data_file(data))
    check_conversations(rep, data)
    order = list(range(len(convs)))
    random.Random(data.seed).shuffle(order)
    hold = copy.deepcopy([convs[i] for i in order[:data.holdout]])
    rest = order[data.holdout:]
    if data.max_samples is not None:
        rest = rest[:data.max_samples]
    train = copy.deepcopy([convs[i] for i in rest])
    report = {"source": data.source, **rep, "max_bad_fraction": data.max_bad_fraction,
              "train": len(train), "holdout": len(hold)}
    return train, hold, report


# ----------------------------------------------------------------------------------------------
# showing what was dropped


def show_data_report(ctx, report: dict, tokenize_report: dict | None = None) -> None:
    """Print the drop summary (stderr) and record one metric row `dropped/<reason>` per reason
    (reader, cleaning, the bench-prompt guard (`contaminated`, targets/capture.py) and, when given,
    tokenising: template_error, mask_all_zero) plus `bad_fraction`, through ctx.metric. Rank 0
    only."""
    if getattr(ctx, "rank", 0) != 0:
        return
    dropped = dict(report.get("dropped", {}))
    tok = tokenize_report or {}
    for r in ("template_error", "mask_all_zero"):
        if tok.get(r):
            dropped[r] = tok[r]
    if report.get("dropped_contaminated"):
        dropped["contaminated"] = report["dropped_contaminated"]
    for r, n in sorted(dropped.items()):
        ctx.metric(f"dropped/{r}", n)
    ctx.metric("bad_fraction", report.get("bad_fraction", 0.0))
    fmt = ", ".join(x for x in (report.get("format"), report.get("compression")) if x)
    unusable = report.get("unusable", {})
    policy = {r: n for r, n in report.get("dropped", {}).items() if r not in unusable}
    lines = [f"data: {report.get('path')} ({fmt}): {report.get('records_seen', '?')} records, "
             f"{report.get('clean', '?')} conversations kept, "
             f"{sum(report.get('dropped', {}).values())} dropped"]
    limit = report.get("max_bad_fraction")
    lines.append(f"  unusable: {report.get('unusable_records', 0)} = "
                 f"{100 * report.get('bad_fraction', 0.0):.3f}%"
                 + (f" (data.max_bad_fraction {100 * limit:g}%)" if limit is not None else "")
                 + (f": {_reasons(unusable, report.get('examples'))}" if unusable else ""))
    if policy:
        lines.append(f"  cleaned away (policy): {_reasons(policy)}")
    if report.get("trimmed"):
        lines.append(f"  turns trimmed: {_reasons(report['trimmed'])}")
    if report.get("dropped_contaminated"):
        lines.append(f"  holding a bench prompt (left out of training): "
                     f"{report['dropped_contaminated']}")
    if tok:
        lines.append(f"  tokenized {tok.get('tokenized')} with chat template "
                     f"{tok.get('template')}: template_error {tok.get('template_error', 0)}, "
                     f"mask_all_zero {tok.get('mask_all_zero', 0)}, truncated to "
                     f"data.max_length {tok.get('truncated', 0)}"
                     + (f" ({tok['template_error_examples'][0]})"
                        if tok.get("template_error_examples") else ""))
    print("\n".join(lines), file=sys.stderr, flush=True)
