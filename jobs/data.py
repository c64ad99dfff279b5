"""Training conversations: reading, cleaning, sampling, and tokenising with the target's own
chat template (loss mask = assistant tokens only).

Public API (the bench's `sharegpt` prompt set and the extract/regenerate stages use these):

    load_conversations(data_spec) -> (train, holdout, report)
        train/holdout: list[list[{"role": "system"|"user"|"assistant", "content": str}]]
    tokenize_conversation(tokenizer, conv, template, max_length) -> (input_ids, loss_mask)
    tokenize_dataset(tokenizer, convs, template, max_length) -> (samples, report)
    detect_template(tokenizer, template="auto") -> "chatml" | "llama3" | "qwen" | "kimi"

Sources: the fetched ShareGPT JSON (truncated upstream: decoded record by record with
json.JSONDecoder.raw_decode, stopping at the first undecodable record), or a local file: JSONL
(one record per line) or a JSON array, each record either {"conversations"|"messages": [turns]}
or a bare list of turns, turns in ShareGPT form {"from", "value"} or chat form {"role", "content"}.

Cleaning (each step counted in report["dropped"] / report["trimmed"], keyed by reason):
- roles: human/user -> user; gpt/chatgpt/bard/bing/assistant/model -> assistant; system.
  A record with any other role is dropped ("unknown_role"; report["unknown_roles"] counts names).
- contents are stripped; empty turns are removed; consecutive turns of one role are merged.
- a system turn is kept only as the first turn ("system_not_first" drops the record).
- leading assistant turns (split continuations) are trimmed; trailing user turns are trimmed.
- records with no turns ("empty"), no assistant turn ("no_assistant"), or bad structure
  ("malformed") are dropped; exact duplicates are dropped ("duplicate").
Sampling: the cleaned records are shuffled with random.Random(data.seed); the first
`data.holdout` are held out (never trained on), the next `data.max_samples` are the training set.
The holdout does not depend on max_samples, so data-scaling variants share it.
"""

from __future__ import annotations

import codecs
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

from runner.errors import StageError

ROLE_MAP = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
            "bard": "assistant", "bing": "assistant", "assistant": "assistant",
            "model": "assistant", "system": "system"}

# Assistant spans in the rendered chat text: (header regex, end-of-turn marker). The span starts
# after the header and ends after the end marker (the target generates the marker, so it is
# supervised), or at the end of the text when the marker is missing (truncated render).
TEMPLATES = {
    "chatml": (r"<\|im_start\|>assistant\n", "<|im_end|>"),
    "qwen": (r"<\|im_start\|>assistant\n", "<|im_end|>"),  # Qwen2/3: ChatML (+ <think> blocks)
    "llama3": (r"<\|start_header_id\|>assistant<\|end_header_id\|>\n\n", "<|eot_id|>"),
    "kimi": (r"<\|im_assistant\|>assistant<\|im_middle\|>", "<|im_end|>"),
}


# ----------------------------------------------------------------------------------------------
# reading


def read_json_records(path: Path) -> tuple[list[Any], dict]:
    """Records of a JSON array that may be truncated: decode one record at a time and stop at
    the first error. Returns (records, {"records_read", "truncated", "stopped_at_byte"})."""
    text = path.read_text(encoding="utf-8-sig", errors="replace")
    dec = json.JSONDecoder()
    i = _skip_ws(text, 0)
    if i >= len(text) or text[i] != "[":
        raise StageError(f"{path}: expected a JSON array ('[' at the start)")
    i = _skip_ws(text, i + 1)
    records, truncated = [], False
    while i < len(text) and text[i] != "]":
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            truncated = True
            break
        records.append(obj)
        i = _skip_ws(text, i)
        if i < len(text) and text[i] == ",":
            i = _skip_ws(text, i + 1)
    if i >= len(text):
        truncated = True
    return records, {"records_read": len(records), "truncated": truncated,
                     "stopped_at_byte": len(text[:i].encode()) if truncated else None}


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def read_jsonl_records(path: Path) -> tuple[list[Any], dict]:
    """One JSON record per line. A broken LAST line (a truncated file) is skipped and reported;
    a broken line elsewhere is a StageError naming the line."""
    # only \n ends a record (str.splitlines also splits at U+2028, \x1c, ... inside strings);
    # utf-8-sig drops a byte-order mark
    lines = path.read_text(encoding="utf-8-sig", errors="replace").split("\n")
    last = max((n for n, line in enumerate(lines, 1) if line.strip()), default=0)
    records, truncated = [], False
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            if n == last:
                truncated = True
                print(f"data: {path}:{n}: the last line is not valid JSON ({e.msg}); skipped as "
                      "a truncated record", file=sys.stderr)
                break
            raise StageError(f"{path}:{n}: not valid JSON ({e.msg}). Fix or remove the line.")
    return records, {"records_read": len(records), "truncated": truncated,
                     "stopped_at_byte": None}


def read_records(path: Path) -> tuple[list[Any], dict]:
    """Raw records of a JSON array (possibly truncated) or a JSONL file.
    Raises StageError when the file is missing."""
    path = Path(path)
    if not path.is_file():
        what = "is a folder, not a file" if path.is_dir() else "does not exist"
        raise StageError(f"data.path: {path} {what}. Run `runner fetch sharegpt` for "
                         "ShareGPT, or point data.path at a JSONL file.")
    with open(path, "rb") as f:
        head = f.read(64).removeprefix(codecs.BOM_UTF8).lstrip()
    return read_json_records(path) if head.startswith(b"[") else read_jsonl_records(path)


# ----------------------------------------------------------------------------------------------
# cleaning


def normalize_record(rec: Any) -> tuple[list[dict] | None, str | None, list[str]]:
    """One raw record -> (conversation or None, drop reason or None, trim notes).

    conversation: [{"role", "content"}], roles in {system, user, assistant}, starting with
    system or user, alternating user/assistant, ending with assistant."""
    turns = rec.get("conversations", rec.get("messages", rec.get("conversation"))) \
        if isinstance(rec, dict) else rec
    if not isinstance(turns, list):
        return None, "malformed", []
    conv, notes = [], []
    for t in turns:
        if not isinstance(t, dict):
            return None, "malformed", []
        role = t.get("from", t.get("role"))
        content = t.get("value", t.get("content"))
        if not isinstance(role, str) or not (isinstance(content, str) or content is None):
            return None, "malformed", []
        mapped = ROLE_MAP.get(role.strip().lower())
        if mapped is None:
            return None, "unknown_role:" + role.strip().lower()[:40], []
        content = (content or "").strip()
        if not content:
            notes.append("empty_turn")
            continue
        if conv and conv[-1]["role"] == mapped:
            conv[-1]["content"] += "\n\n" + content
            notes.append("merged_turn")
            continue
        conv.append({"role": mapped, "content": content})
    if not conv:
        return None, "empty", notes
    if any(t["role"] == "system" for t in conv[1:]):
        return None, "system_not_first", notes
    head = conv[:1] if conv[0]["role"] == "system" else []
    body = conv[len(head):]
    if body and body[0]["role"] == "assistant":
        body = body[1:]
        notes.append("leading_assistant")
    while body and body[-1]["role"] != "assistant":
        body = body[:-1]
        notes.append("trailing_user")
    if not any(t["role"] == "assistant" for t in body):
        return None, ("starts_with_assistant" if "leading_assistant" in notes else
                      "no_assistant"), notes
    return head + body, None, notes


def clean_records(records: list[Any]) -> tuple[list[list[dict]], dict]:
    """Normalise, drop and deduplicate. Returns (conversations, report)."""
    out, seen = [], set()
    dropped, trimmed, unknown = Counter(), Counter(), Counter()
    for rec in records:
        conv, why, notes = normalize_record(rec)
        trimmed.update(notes)
        if why is not None:
            if why.startswith("unknown_role:"):
                unknown[why.split(":", 1)[1]] += 1
                why = "unknown_role"
            dropped[why] += 1
            continue
        key = hashlib.sha1(json.dumps(conv, ensure_ascii=False).encode()).digest()
        if key in seen:
            dropped["duplicate"] += 1
            continue
        seen.add(key)
        out.append(conv)
    return out, {"dropped": dict(sorted(dropped.items())),
                 "trimmed": dict(sorted(trimmed.items())),
                 "unknown_roles": dict(unknown.most_common(20))}


def _load_clean(path: Path) -> tuple[list[list[dict]], dict, dict]:
    """(clean conversations, read info, clean report), cached per file version. Callers must
    not mutate the returned conversations (load_conversations hands out copies)."""
    path = Path(path)
    if not path.is_file():
        read_records(path)  # raises the StageError naming the file
    st = path.stat()
    return _clean_cached(str(path.resolve()), st.st_size, st.st_mtime)


@lru_cache(maxsize=4)
def _clean_cached(path: str, size: int, mtime: float):
    records, info = read_records(Path(path))
    convs, rep = clean_records(records)
    return convs, info, rep


def load_conversations(data) -> tuple[list[list[dict]], list[list[dict]], dict]:
    """Read, clean and sample the spec's conversations.

    data: runner.spec.Data (source, path, max_samples, holdout, seed).
    Returns (train, holdout, report). report: source, path, records_read, truncated, dropped
    {reason: n}, trimmed {note: n}, unknown_roles {name: n}, clean, train, holdout.
    Raises StageError for a missing file or when nothing usable remains."""
    from runner.files import expand_path
    if data.path:
        path = expand_path(data.path)
    elif data.source == "sharegpt":
        from runner.assets import FetchError, asset_path
        try:
            path = asset_path("sharegpt")
        except FetchError as e:
            raise StageError(f"data.source = sharegpt: {e}")
    else:
        raise StageError("data.path: required when data.source is jsonl")
    convs, info, rep = _load_clean(path)
    info, rep = copy.deepcopy(info), copy.deepcopy(rep)
    if not convs:
        skipped = "; its last record was not valid JSON and was skipped" if info["truncated"] else ""
        raise StageError(f"data: {path} has no usable conversation ({info['records_read']} "
                         f"records read{skipped}; dropped {rep['dropped']}). Records need user "
                         "and assistant turns (from/value or role/content).")
    order = list(range(len(convs)))
    random.Random(data.seed).shuffle(order)
    hold = copy.deepcopy([convs[i] for i in order[:data.holdout]])
    rest = order[data.holdout:]
    if data.max_samples is not None:
        rest = rest[:data.max_samples]
    train = copy.deepcopy([convs[i] for i in rest])
    if not train:
        raise StageError(f"data.holdout = {data.holdout}: leaves no training conversation "
                         f"({len(convs)} usable). Lower data.holdout.")
    report = {"source": data.source, "path": str(path), **info, **rep, "clean": len(convs),
              "train": len(train), "holdout": len(hold)}
    return train, hold, report


# ----------------------------------------------------------------------------------------------
# tokenising with the target's own chat template


def _render(tokenizer, conv: list[dict]) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise StageError("the target tokenizer has no chat template, so assistant turns cannot "
                         "be found. Use a chat (instruct) model, or add chat_template to its "
                         "tokenizer_config.json.")
    return tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=False)


def detect_template(tokenizer, template: str = "auto") -> str:
    """The assistant-span convention of the tokenizer's chat template.

    'auto' renders a probe conversation and looks for each template's assistant header; a named
    template is checked the same way. Raises StageError naming the template when it does not
    match (the loss mask would be all zero)."""
    probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    text = _render(tokenizer, probe)
    found = [n for n, (hdr, end) in TEMPLATES.items() if re.search(hdr, text) and end in text]
    if template == "auto":
        if not found:
            raise StageError(f"target.chat_template = auto: the tokenizer's chat template renders "
                             f"{text[:200]!r}, which matches none of {list(TEMPLATES)}. Set "
                             "target.chat_template, or use a model with a supported template.")
        return found[0]
    if template not in TEMPLATES:
        raise StageError(f"target.chat_template = {template!r}: unknown; use auto or one of "
                         f"{list(TEMPLATES)}")
    if template not in found:
        raise StageError(f"target.chat_template = {template}: the tokenizer's template renders "
                         f"{text[:200]!r}, without the {template} assistant header "
                         f"{TEMPLATES[template][0]!r}. Set chat_template to auto"
                         + (f" (detected {found[0]})." if found else "."))
    return template


def assistant_char_spans(text: str, template: str) -> list[tuple[int, int]]:
    """[start, end) character spans of assistant content (+ end-of-turn marker) in `text`."""
    hdr, end = TEMPLATES[template]
    spans = []
    for m in re.finditer(hdr, text):
        a = m.end()
        b = text.find(end, a)
        spans.append((a, len(text) if b < 0 else b + len(end)))
    return spans


def tokenize_conversation(tokenizer, conv: list[dict], template: str,
                          max_length: int) -> tuple[list[int], list[int]]:
    """Render `conv` with the tokenizer's own chat template and tokenise it.

    Returns (input_ids [T], loss_mask [T]) with T <= max_length (longer samples are truncated);
    loss_mask[t] = 1 when token t lies inside an assistant turn's content or its end-of-turn
    marker (e.g. `<|im_end|>`), found with `template` (see TEMPLATES). Tokens are assigned by
    their character offsets, so the template's own BOS/system prompt stay unsupervised.
    Raises StageError when the tokenizer has no chat template."""
    text = _render(tokenizer, conv)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    spans = assistant_char_spans(text, template)
    mask, j = [], 0
    for (a, b) in offsets:
        while j < len(spans) and spans[j][1] <= a:
            j += 1
        mask.append(int(j < len(spans) and spans[j][0] <= a < spans[j][1] and b > a))
    return ids[:max_length], mask[:max_length]


def tokenize_dataset(tokenizer, convs: list[list[dict]], template: str,
                     max_length: int) -> tuple[list[tuple[list[int], list[int]]], dict]:
    """Tokenise every conversation; drop (and count) samples whose mask is all zero.

    Returns (samples [(input_ids, loss_mask)], report {"tokenized", "truncated",
    "mask_all_zero", "mask_all_zero_examples", "tokens", "supervised_tokens", "template"}).
    Raises StageError naming the template when every sample's mask is all zero."""
    template = detect_template(tokenizer, template)
    samples, truncated, zero, zero_idx = [], 0, 0, []
    for i, conv in enumerate(convs):
        ids, mask = tokenize_conversation(tokenizer, conv, template, 10**9)
        if len(ids) > max_length:
            truncated += 1
            ids, mask = ids[:max_length], mask[:max_length]
        if not any(mask):
            zero += 1
            zero_idx.append(i)
            continue
        samples.append((ids, mask))
    if convs and not samples:
        raise StageError(f"every sample's loss mask is all zero with chat template {template!r} "
                         f"(data.max_length = {max_length}): no assistant tokens were found. Set "
                         "target.chat_template to the target's template, or raise max_length.")
    report = {"template": template, "tokenized": len(convs), "truncated": truncated,
              "mask_all_zero": zero, "mask_all_zero_examples": zero_idx[:10],
              "tokens": sum(len(s[0]) for s in samples),
              "supervised_tokens": sum(sum(s[1]) for s in samples)}
    return samples, report
