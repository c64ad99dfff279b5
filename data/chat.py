"""Tokenising conversations with the target's OWN chat template, and the loss mask (1 = a token
the target generates in an assistant turn).

    chat_convention(tokenizer, template="auto") -> Convention(name, header, end, framing)
    detect_template(tokenizer, template="auto") -> name ("chatml" | "qwen" | "llama3" | "kimi" |
                                                         "custom")
    tokenize_conversation(tokenizer, conv, template, max_length) -> (input_ids, loss_mask)
    token_mask(offsets, spans) -> loss_mask   (token_mask_reference: the same, one token at a time)
    token_masks([offsets], [spans]) -> [loss_mask]   (many texts, one vectorised pass)
    tokenize_dataset(tokenizer, convs, template, max_length, workers=1) -> (samples, report)
    tokenize_workers(n_convs) -> the worker processes the stages tokenise n_convs with

One mechanism for every template: the text is `tokenizer.apply_chat_template(conv)`; an assistant
span starts after the assistant HEADER and ends after the END-OF-TURN marker (the target
generates the marker, so it is supervised), or at the end of the text when the marker is
missing. Header and marker are DERIVED from the tokenizer's template by rendering probe
conversations (`derive_convention`): the header is what `add_generation_prompt=True` adds to a
one-user-turn chat; the marker is what the template writes after both assistant contents of a
two-exchange chat (their common prefix, trailing blanks removed). Text that the template puts
between the header and the content on some turns only, not taken from the message (Qwen3's
empty `<think>\\n\\n</think>\\n\\n` on the last turn), is FRAMING: it is what the non-thinking
generation prompt itself contains, so it is never supervised. Everything else after the header
is: a non-empty `<think>` block that the template renders (Qwen3 keeps the reasoning of the turns
after the last user message and strips it from earlier ones) is text the target generates in
thinking mode, so it is trained on; a reasoning block the template stripped is not in the text,
so it is not. Tool calls rendered inside an assistant turn are supervised (the target writes
them); system, developer, user and tool turns never are (they are outside assistant spans).
`target.chat_template` names a known convention (runner/chat.py); a named one must match the
derived header and marker, so a wrong tokenizer fails before any compute. No torch.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import sys
from collections import deque
from dataclasses import dataclass
from itertools import chain
from typing import Any, NamedTuple

from eagle3_runner.runner.chat import KNOWN, THINK_OPEN
from eagle3_runner.runner.errors import StageError

# probe contents: distinctive, no blanks (Llama 3 trims), no template syntax
_PROBE = ("xq1probe", "xa1probe", "xq2probe", "xa2probe")


@dataclass(frozen=True)
class Convention:
    """How assistant turns look in this template's output (module docstring)."""

    name: str  # a runner/chat.py KNOWN name, or "custom"
    header: str  # e.g. "<|im_start|>assistant\n"
    end: str  # e.g. "<|im_end|>"
    framing: str = ""  # e.g. "<think>\n\n</think>\n\n" (never supervised)


def template_errors():
    """The exception types a chat template raises for a conversation it refuses (jinja2's
    TemplateError for raise_exception, TypeError for None + str, ...)."""
    from jinja2 import TemplateError
    return (TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError)


def render(tokenizer, conv: list[dict], generation_prompt: bool = False) -> str:
    """The chat text of `conv` rendered by the tokenizer's own template.
    Raises StageError when the tokenizer has no chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise StageError("the target tokenizer has no chat template, so assistant turns cannot "
                         "be found. Use a chat (instruct) model, or add chat_template to its "
                         "tokenizer_config.json (or chat_template.jinja).")
    return tokenizer.apply_chat_template(conv, tokenize=False,
                                         add_generation_prompt=generation_prompt)


def _common_prefix(a: str, b: str) -> str:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def derive_convention(tokenizer) -> Convention:
    """Header, end-of-turn marker and framing of the tokenizer's template, from probe renders.
    Raises StageError saying which step failed (no generation prompt, content rewritten, no
    end marker) and that target.chat_template can name a known convention instead."""
    u1, a1, u2, a2 = _PROBE
    user = lambda c: {"role": "user", "content": c}  # noqa: E731
    bot = lambda c: {"role": "assistant", "content": c}  # noqa: E731
    fix = (" Name the convention with target.chat_template (one of "
           f"{', '.join(KNOWN)}) if the template is one of those.")
    try:
        plain, gen = render(tokenizer, [user(u1)]), render(tokenizer, [user(u1)], True)
        full = render(tokenizer, [user(u1), bot(a1), user(u2), bot(a2)])
    except template_errors() as e:
        raise StageError(f"the target's chat template fails on a plain user/assistant chat "
                         f"({type(e).__name__}: {e}).{fix}")
    header = gen[len(plain):] if gen.startswith(plain) else ""
    if not header.strip():
        raise StageError("the target's chat template adds no assistant header with "
                         f"add_generation_prompt=True (renders {gen[-120:]!r}), so assistant "
                         f"turns cannot be found.{fix}")
    h1 = full.find(header)
    c1 = full.find(a1, h1 + len(header)) if h1 >= 0 else -1
    h2 = full.find(header, c1 + len(a1)) if c1 >= 0 else -1
    c2 = full.find(a2, h2 + len(header)) if h2 >= 0 else -1
    if c2 < 0:
        raise StageError(f"the target's chat template does not render assistant turns after its "
                         f"generation header {header!r} (renders {full[:300]!r}).{fix}")
    framings = {full[h1 + len(header):c1], full[h2 + len(header):c2]} - {""}
    end = _common_prefix(full[c1 + len(a1):], full[c2 + len(a2):]).rstrip()
    if len(framings) > 1 or not end:
        what = "no end-of-turn marker" if not end else f"differing text {sorted(framings)}"
        raise StageError(f"the target's chat template writes {what} around assistant contents "
                         f"(renders {full[:300]!r}).{fix}")
    framing = framings.pop() if framings else ""
    name = next((n for n, pair in KNOWN.items() if pair == (header, end)), "custom")
    if name in ("chatml", "qwen"):
        name = "qwen" if THINK_OPEN in framing else "chatml"
    return Convention(name, header, end, framing)


_CACHE: dict[tuple, Convention] = {}


def chat_convention(tokenizer, template: str = "auto") -> Convention:
    """The convention to find assistant spans with: derived from the tokenizer's template
    (cached per template text and special tokens). `template` = auto, or a runner/chat.py name
    that the derived header and marker must match (chatml and qwen share theirs). When the
    template cannot be probed, a named convention is used as declared.
    Raises StageError naming target.chat_template when they disagree, or when auto cannot
    derive one."""
    if template != "auto" and template not in KNOWN:
        raise StageError(f"target.chat_template = {template!r}: unknown; use auto or one of "
                         f"{list(KNOWN)}")
    key = (getattr(tokenizer, "chat_template", None), repr(getattr(tokenizer,
                                                                   "special_tokens_map", None)))
    try:
        conv = _CACHE.get(key) or _CACHE.setdefault(key, derive_convention(tokenizer))
    except StageError as e:
        if template == "auto" or not key[0]:
            raise StageError(f"target.chat_template = {template}: {e}") from None
        header, end = KNOWN[template]
        return Convention(template, header, end, "<think>\n\n</think>\n\n" if template == "qwen"
                          else "")
    if template == "auto":
        return conv
    if KNOWN[template] != (conv.header, conv.end):
        raise StageError(f"target.chat_template = {template}: the tokenizer's template opens "
                         f"assistant turns with {conv.header!r} and ends them with {conv.end!r}, "
                         f"not {KNOWN[template][0]!r} ... {KNOWN[template][1]!r}. Set "
                         f"chat_template to auto (detected {conv.name}).")
    return Convention(template, conv.header, conv.end, conv.framing)


def detect_template(tokenizer, template: str = "auto") -> str:
    """The name of the tokenizer's convention (chat_convention(...).name). Raises StageError."""
    return chat_convention(tokenizer, template).name


def assistant_char_spans(text: str, conv: Convention) -> list[tuple[int, int]]:
    """[start, end) character spans of assistant content (+ end-of-turn marker) in `text`:
    from each header (skipping framing) to the end marker included, or to the end of text."""
    spans, i = [], 0
    while (h := text.find(conv.header, i)) >= 0:
        a = h + len(conv.header)
        if conv.framing and text.startswith(conv.framing, a):
            a += len(conv.framing)
        b = text.find(conv.end, a)
        b = len(text) if b < 0 else b + len(conv.end)
        spans.append((a, b))
        i = b
    return spans


def token_mask(offsets, spans: list[tuple[int, int]]) -> list[int]:
    """Loss mask [T] from token character offsets [T x (start, end)] and sorted, disjoint
    assistant spans [(start, end)] (assistant_char_spans): 1 when token t starts inside a span
    and is not empty. Vectorised: one text of token_masks."""
    return token_masks([offsets], [spans])[0]


def token_masks(offsets: list, spans: list[list[tuple[int, int]]]) -> list[list[int]]:
    """token_mask of many texts: offsets[k] = text k's token offsets [T_k x (start, end)],
    spans[k] = its spans. Returns [loss_mask [T_k] of 0/1 ints] per text (_masks_flat)."""
    flat, lens = _masks_flat(offsets, spans)
    flat, ends = flat.tolist(), _ends(lens)
    return [flat[e - t:e] for e, t in zip(ends, lens)]


def _ends(lens: list[int]) -> list[int]:
    """Where each of texts of `lens` tokens ends when they are laid end to end."""
    out, e = [], 0
    for t in lens:
        e += t
        out.append(e)
    return out


def _masks_flat(offsets: list, spans: list[list[tuple[int, int]]]):
    """The loss masks of many texts in one vectorised pass, end to end: (int8 [sum T_k], [T_k]).
    offsets[k]: text k's token offsets [T_k x (start, end)] (characters, < 2**32); spans[k]: its
    sorted, disjoint assistant spans. A position is keyed (k << 32) + character, so one numpy
    searchsorted over every span end serves every token and a token only meets its own text's
    spans (one call per chunk of texts: per text, numpy's overhead cost more than the work)."""
    import numpy as np
    lens = [len(o) for o in offsets]
    n = sum(lens)
    off = np.fromiter(chain.from_iterable(chain.from_iterable(offsets)), dtype=np.int64,
                      count=2 * n).reshape(n, 2)  # [n, 2]
    text = np.repeat(np.arange(len(lens), dtype=np.int64) << 32, lens)  # [n]
    a, b = off[:, 0] + text, off[:, 1] + text
    sp = np.array([((k << 32) + s, (k << 32) + e) for k, text_spans in enumerate(spans)
                   for s, e in text_spans], dtype=np.int64).reshape(-1, 2)  # [S, 2]
    if not len(sp):
        return np.zeros(n, dtype=np.int8), lens
    j = np.searchsorted(sp[:, 1], a, side="right")  # the first span ending after a
    jj = np.minimum(j, len(sp) - 1)
    return ((j < len(sp)) & (sp[jj, 0] <= a) & (b > a)).astype(np.int8), lens


def token_mask_reference(offsets, spans: list[tuple[int, int]]) -> list[int]:
    """token_mask one token at a time (the form it had before it was vectorised): the reference
    tests/test_data.py holds it to and scripts/bench/bench_tokenize.py times it against."""
    mask, j = [], 0
    for (a, b) in offsets:
        while j < len(spans) and spans[j][1] <= a:
            j += 1
        mask.append(int(j < len(spans) and spans[j][0] <= a < spans[j][1] and b > a))
    return mask


def tokenize_conversation(tokenizer, conv: list[dict], template,
                          max_length: int) -> tuple[list[int], list[int]]:
    """Render `conv` with the tokenizer's own chat template and tokenise it.

    template: auto, a runner/chat.py name, or a Convention. Returns (input_ids [T], loss_mask
    [T]), T <= max_length (longer samples are truncated); loss_mask[t] = 1 when token t starts
    inside an assistant span (assistant_char_spans, token_mask). Tokens are assigned by their
    character offsets, so the template's BOS, system prompt, headers and framing stay
    unsupervised. Raises StageError when the tokenizer has no chat template; the template's own
    errors (a conversation it refuses) propagate (tokenize_dataset counts them)."""
    cv = template if isinstance(template, Convention) else chat_convention(tokenizer, template)
    _, ids, mask = _encode_texts(tokenizer, [render(tokenizer, conv)], cv)
    return ids[:max_length].tolist(), mask[:max_length].tolist()


ENCODE_BATCH = 512  # conversations per tokenizer call (and per task of a worker process)
PARALLEL_MIN = 16 * ENCODE_BATCH  # conversations from which worker processes pay (their start)
MAX_WORKERS = 32


class Encoded(NamedTuple):
    """A chunk of conversations tokenised (_encode_chunk), its texts end to end: index [n] (the
    conversations the template rendered), lengths [n] (their token counts), ids int64 [sum of
    lengths], mask int8 [sum of lengths], refused [(index, message)] (the template's errors)."""
    index: list[int]
    lengths: list[int]
    ids: Any
    mask: Any
    refused: list[tuple[int, str]]


def _encode_texts(tokenizer, texts: list[str], cv: Convention):
    """One tokenizer call over `texts` (a fast tokenizer encodes them on all its threads) and
    their loss masks: (lengths [n], ids int64 [sum], mask int8 [sum]), the texts end to end."""
    import numpy as np
    enc = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
    mask, lens = _masks_flat(enc["offset_mapping"], [assistant_char_spans(t, cv) for t in texts])
    ids = np.fromiter(chain.from_iterable(enc["input_ids"]), dtype=np.int64, count=len(mask))
    return lens, ids, mask


def _encode_chunk(tokenizer, cv: Convention, chunk: list[tuple[int, list[dict]]]) -> Encoded:
    """Render (the template's errors counted, not raised) and tokenise the chunk's (index,
    conversation) pairs: what one worker process does per task, or this process per chunk."""
    import numpy as np
    errors = template_errors()
    index, texts, refused = [], [], []
    for i, conv in chunk:
        try:
            texts.append(render(tokenizer, conv))
            index.append(i)
        except errors as e:
            refused.append((i, f"{type(e).__name__}: {str(e)[:200]}"))
    if not texts:
        return Encoded([], [], np.zeros(0, np.int64), np.zeros(0, np.int8), refused)
    return Encoded(index, *_encode_texts(tokenizer, texts, cv), refused)


_WORKER: tuple | None = None  # (tokenizer, Convention) of a worker process (_start_worker)


def _start_worker(tokenizer_file: str, cv: Convention) -> None:
    """A worker process's set-up: its tokenizer (the parent's, pickled into a file), one thread
    each (the processes are the parallelism; a fast tokenizer starts a thread per core)."""
    global _WORKER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    with open(tokenizer_file, "rb") as f:
        _WORKER = (pickle.load(f), cv)


def _work(chunk: list[tuple[int, list[dict]]]) -> Encoded:
    return _encode_chunk(*_WORKER, chunk)


def tokenize_workers(n_convs: int) -> int:
    """Worker processes to tokenise n_convs conversations with: the logical CPUs this process
    gets (runner/cpu.py cores: affinity, cgroup quota, shared by the node's ranks); 1 (this
    process alone) below PARALLEL_MIN conversations, on one CPU, or in a daemon process (which
    may not start children); at most MAX_WORKERS (each holds a tokenizer and a chunk's
    encodings: a few hundred MB)."""
    from eagle3_runner.runner.cpu import cores
    if n_convs < PARALLEL_MIN or multiprocessing.current_process().daemon:
        return 1
    return min(cores(physical=False), MAX_WORKERS)


def _encoded(tokenizer, cv: Convention, convs: list[list[dict]], pool_args: tuple | None):
    """Yield Encoded per ENCODE_BATCH conversations, in order: in this process (pool_args None),
    or spread over (workers, the tokenizer pickled) spawned processes, at most 2 tasks each in
    flight, whose samples are this process's (the same code on the same tokenizer)."""
    chunks = (list(enumerate(convs[a:a + ENCODE_BATCH], a))
              for a in range(0, len(convs), ENCODE_BATCH))
    if pool_args is None:
        yield from (_encode_chunk(tokenizer, cv, c) for c in chunks)
        return
    import tempfile
    from concurrent.futures import ProcessPoolExecutor
    workers, tokenizer_pickle = pool_args
    # the tokenizer goes by file: a spawned process that dies before reading its start-up
    # arguments (a main module without its __main__ guard) hangs a parent writing more than a
    # pipe's buffer to it (CPython's spawn holds the pipe's read end until the write is done)
    fd, path = tempfile.mkstemp(prefix="eagle3-tokenizer-", suffix=".pkl")
    with os.fdopen(fd, "wb") as f:
        f.write(tokenizer_pickle)
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_start_worker, initargs=(path, cv))
    try:
        pending: deque = deque()
        for c in chunks:
            pending.append(pool.submit(_work, c))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        pool.shutdown(cancel_futures=True)
        os.unlink(path)


def _tokenize(tokenizer, cv: Convention, convs: list[list[dict]], max_length: int,
              pool_args: tuple | None) -> tuple[list, dict]:
    """tokenize_dataset's samples and counts: (samples, {"truncated", "zero" [indices],
    "refused" [(index, message)], "tokens", "supervised_tokens"})."""
    import numpy as np
    samples, zero, refused = [], [], []
    truncated = tokens = supervised = 0
    for e in _encoded(tokenizer, cv, convs, pool_args):
        refused += e.refused
        ids, mask, ends = e.ids.tolist(), e.mask.tolist(), _ends(e.lengths)
        lengths = np.asarray(e.lengths, dtype=np.int64)  # [n]
        kept, start = np.minimum(lengths, max_length), np.asarray(ends, dtype=np.int64) - lengths
        cum = np.concatenate([[0], np.cumsum(e.mask, dtype=np.int64)])  # [sum + 1]
        sup = (cum[start + kept] - cum[start]).tolist()  # supervised tokens kept, per text
        for i, n, k, end, s in zip(e.index, e.lengths, kept.tolist(), ends, sup):
            truncated += n > max_length
            if not s:
                zero.append(i)
                continue
            samples.append((ids[end - n:end - n + k], mask[end - n:end - n + k]))
            tokens, supervised = tokens + k, supervised + s
    return samples, {"truncated": int(truncated), "zero": zero, "refused": refused,
                     "tokens": tokens, "supervised_tokens": supervised}


def _in_process(workers: int, e: Exception) -> None:
    print(f"data: tokenising in this process: {workers} worker processes could not "
          f"({type(e).__name__}: {str(e)[:200]})", file=sys.stderr, flush=True)


def tokenize_dataset(tokenizer, convs: list[list[dict]], template: str, max_length: int,
                     workers: int = 1) -> tuple[list[tuple[list[int], list[int]]], dict]:
    """Tokenise every conversation; drop (and count) samples whose mask is all zero and
    conversations the template refuses. workers: 1 = this process only, more = spawned worker
    processes that tokenise the chunks (the stages pass tokenize_workers); the samples are the
    same either way. A caller run as a script must then guard its main (`if __name__ ==
    "__main__"`: spawned processes import the main module). Where the workers cannot start (a
    tokenizer that does not pickle, a broken pool) it says so on stderr and tokenises here.

    Returns (samples [(input_ids, loss_mask)] in conversation order, lists of ints, report
    {"template", "tokenized", "truncated", "mask_all_zero", "mask_all_zero_examples",
    "template_error", "template_error_examples", "tokens", "supervised_tokens"}). Raises
    StageError naming the template when no sample is left."""
    from concurrent.futures.process import BrokenProcessPool
    cv = chat_convention(tokenizer, template)
    pool_args = None
    if workers > 1:
        try:
            pool_args = (workers, pickle.dumps(tokenizer))
        except Exception as e:  # noqa: BLE001 - whatever does not pickle is tokenised here
            _in_process(workers, e)
    try:
        samples, c = _tokenize(tokenizer, cv, convs, max_length, pool_args)
    except BrokenProcessPool as e:  # a worker died or could not load the tokenizer
        _in_process(workers, e)
        samples, c = _tokenize(tokenizer, cv, convs, max_length, None)
    bad, bad_msgs = len(c["refused"]), [f"conversation {i}: {m}" for i, m in c["refused"][:3]]
    if convs and not samples:
        if bad == len(convs):
            raise StageError(f"the chat template refused all {bad} conversations ({bad_msgs[0]}). "
                             "Check the data's turns (roles, string contents) against what the "
                             "target's template accepts, or use other data.")
        raise StageError(f"every sample's loss mask is all zero with chat template {cv.name!r} "
                         f"(data.max_length = {max_length}): no assistant tokens were found. Set "
                         "target.chat_template to the target's template, or raise "
                         "data.max_length.")
    report = {"template": cv.name, "tokenized": len(convs), "truncated": c["truncated"],
              "mask_all_zero": len(c["zero"]), "mask_all_zero_examples": c["zero"][:10],
              "template_error": bad, "template_error_examples": bad_msgs,
              "tokens": c["tokens"], "supervised_tokens": c["supervised_tokens"]}
    return samples, report
