"""Tokenising conversations with the target's OWN chat template, and the loss mask (1 = a token
the target generates in an assistant turn).

    chat_convention(tokenizer, template="auto") -> Convention(name, header, end, framing)
    detect_template(tokenizer, template="auto") -> name ("chatml" | "qwen" | "llama3" | "kimi" |
                                                         "custom")
    tokenize_conversation(tokenizer, conv, template, max_length) -> (input_ids, loss_mask)
    token_mask(offsets, spans) -> loss_mask   (token_mask_reference: the same, one token at a time)
    tokenize_dataset(tokenizer, convs, template, max_length) -> (samples, report)

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

from dataclasses import dataclass

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
    and is not empty. Vectorised (numpy searchsorted over the span ends)."""
    import numpy as np
    if not len(offsets) or not spans:
        return [0] * len(offsets)
    off = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    sp = np.asarray(spans, dtype=np.int64)
    a, b = off[:, 0], off[:, 1]
    j = np.searchsorted(sp[:, 1], a, side="right")  # the first span ending after a
    inside = j < len(sp)
    jj = np.minimum(j, len(sp) - 1)
    return (inside & (sp[jj, 0] <= a) & (b > a)).astype(np.int8).tolist()


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
    ((_, ids, mask),) = _encode(tokenizer, [(0, render(tokenizer, conv))], cv)
    return ids[:max_length], mask[:max_length]


ENCODE_BATCH = 512  # texts per tokenizer call (a fast tokenizer encodes a batch on all cores)


def _rendered(tokenizer, convs: list[list[dict]], refused: list[tuple[int, str]]):
    """Yield (index, chat text) of each conversation the template renders; the indices of those
    it refuses (template_errors) are appended to `refused` with the error."""
    errors = template_errors()
    for i, conv in enumerate(convs):
        try:
            yield i, render(tokenizer, conv)
        except errors as e:
            refused.append((i, f"{type(e).__name__}: {str(e)[:200]}"))


def _encode_batches(tokenizer, texts, cv: Convention):
    """Yield (conversation index, input_ids [T], loss_mask [T]) for an iterable of (index, chat
    text), ENCODE_BATCH texts per tokenizer call: the ids and masks of one text at a time
    (tests/test_data.py), several times faster where a fast tokenizer has many cores."""
    chunk = []
    for item in texts:
        chunk.append(item)
        if len(chunk) == ENCODE_BATCH:
            yield from _encode(tokenizer, chunk, cv)
            chunk = []
    yield from _encode(tokenizer, chunk, cv)


def _encode(tokenizer, chunk: list[tuple[int, str]], cv: Convention):
    """One tokenizer call over the chunk's texts: (index, input_ids, loss_mask) per text."""
    if not chunk:
        return
    enc = tokenizer([t for _, t in chunk], add_special_tokens=False, return_offsets_mapping=True)
    for (i, text), ids, off in zip(chunk, enc["input_ids"], enc["offset_mapping"]):
        yield i, ids, token_mask(off, assistant_char_spans(text, cv))


def tokenize_dataset(tokenizer, convs: list[list[dict]], template: str,
                     max_length: int) -> tuple[list[tuple[list[int], list[int]]], dict]:
    """Tokenise every conversation; drop (and count) samples whose mask is all zero and
    conversations the template refuses.

    Returns (samples [(input_ids, loss_mask)], report {"template", "tokenized", "truncated",
    "mask_all_zero", "mask_all_zero_examples", "template_error", "template_error_examples",
    "tokens", "supervised_tokens"}). Raises StageError naming the template when no sample is
    left."""
    cv = chat_convention(tokenizer, template)
    samples, truncated, zero, zero_idx, refused = [], 0, 0, [], []
    for i, ids, mask in _encode_batches(tokenizer, _rendered(tokenizer, convs, refused), cv):
        if len(ids) > max_length:
            truncated += 1
            ids, mask = ids[:max_length], mask[:max_length]
        if not any(mask):
            zero += 1
            zero_idx.append(i)
            continue
        samples.append((ids, mask))
    bad, bad_msgs = len(refused), [f"conversation {i}: {m}" for i, m in refused[:3]]
    if convs and not samples:
        if bad == len(convs):
            raise StageError(f"the chat template refused all {bad} conversations ({bad_msgs[0]}). "
                             "Check the data's turns (roles, string contents) against what the "
                             "target's template accepts, or use other data.")
        raise StageError(f"every sample's loss mask is all zero with chat template {cv.name!r} "
                         f"(data.max_length = {max_length}): no assistant tokens were found. Set "
                         "target.chat_template to the target's template, or raise "
                         "data.max_length.")
    report = {"template": cv.name, "tokenized": len(convs), "truncated": truncated,
              "mask_all_zero": zero, "mask_all_zero_examples": zero_idx[:10],
              "template_error": bad, "template_error_examples": bad_msgs,
              "tokens": sum(len(s[0]) for s in samples),
              "supervised_tokens": sum(sum(s[1]) for s in samples)}
    return samples, report
