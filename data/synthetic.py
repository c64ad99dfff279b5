"""Prompts the target writes itself (Magpie, Xu et al. 2024): given only the chat template's
user-turn prefix, an instruct model writes a user turn, which it then answers.

The prefix is derived from the tokenizer's own template, generically: render a probe
conversation with one user turn holding a marker, cut at the marker. For ChatML (SmolLM2) that is
its default system turn + `<|im_start|>user\\n`; for Llama 3 the header up to
`<|start_header_id|>user<|end_header_id|>\\n\\n`. The turn ends at the template's end-of-turn
token (the first token after the marker when it is a special token, e.g. `<|im_end|>`) or at the
target's end-of-turn ids (targets/load.py end_of_turn_ids: its generation config's eos ids, not
the tokenizer's eos_token, which can be wrong).

Filters (each drop counted by reason, in this order): no_eos (the turn hit the token cap),
empty, too_short (< MIN_WORDS words or < MIN_CHARS characters), repetitive (distinct word
3-grams < half of all, over turns of at least 8 words), contaminated (data/contamination.py),
duplicate (normalised text already kept by a lower candidate index).

How much of a time budget the writing gets (`synthesis_share`): the estimated cost of the prompts
over that of all the work, from measured token counts and speeds.
"""

from __future__ import annotations

from collections import Counter

from eagle3_runner.data.contamination import normalize
from eagle3_runner.runner.errors import StageError

MARK = "\x00EAGLE3-USER-TURN\x00"
MIN_WORDS, MIN_CHARS = 3, 12
REASONS = ("no_eos", "empty", "too_short", "repetitive", "contaminated", "duplicate")


def user_turn_prefix(tok, eos_ids) -> tuple[list[int], list[int]]:
    """(prefix token ids, stop ids) of a user turn in the tokenizer's chat template. The stop
    ids: `eos_ids` (the target's end-of-turn ids, targets/load.py end_of_turn_ids) and the
    special token the template puts right after a user turn's content, sorted.
    Raises StageError naming target.chat_template when the tokenizer has no template, the
    marker does not survive rendering, or there is no stop id at all."""
    if not getattr(tok, "chat_template", None):
        raise StageError("target.chat_template: the target tokenizer has no chat template; "
                         "synthetic prompts need one (use an instruct model)")
    text = tok.apply_chat_template([{"role": "user", "content": MARK}], tokenize=False,
                                   add_generation_prompt=False)
    if MARK not in text:
        raise StageError("target.chat_template: the template does not render the user turn's "
                         "content verbatim; set stages.regenerate.synthetic_prompts: 0")
    head, tail = text.split(MARK, 1)
    ids = tok(head, add_special_tokens=False)["input_ids"]
    stop = set(eos_ids)
    after = tok(tail, add_special_tokens=False)["input_ids"][:1]
    if after and after[0] in set(tok.all_special_ids):
        stop.add(after[0])
    if not stop:
        raise StageError("target.chat_template: no end-of-turn token found (no eos_token_id "
                         "in the target's generation config, config or tokenizer, and no special "
                         "token after the user turn); synthetic prompts cannot stop")
    return list(ids), sorted(stop)


def degenerate(text: str, ended: bool) -> str | None:
    """The drop reason of one candidate user turn (decoded, stripped), or None when kept
    (contamination and duplicates are checked by `select`)."""
    if not ended:
        return "no_eos"
    if not text:
        return "empty"
    words = normalize(text).split()
    if len(words) < MIN_WORDS or len(text) < MIN_CHARS:
        return "too_short"
    grams = list(zip(words, words[1:], words[2:]))
    if len(words) >= 8 and len(set(grams)) < 0.5 * len(grams):
        return "repetitive"
    return None


def verdict(text: str, ended: bool, guard) -> str | None:
    """The drop reason of one candidate before duplicates (degenerate, then contaminated by the
    bench guard, when there is one), or None."""
    why = degenerate(text, ended)
    if why is None and guard is not None and guard.contaminated(text):
        why = "contaminated"
    return why


def select(candidates: list[tuple[int, str, bool]], guard, want: int,
           seen: set[str] | frozenset = frozenset()) -> tuple[list, Counter]:
    """candidates (index, text, ended by a stop token) -> (kept [(index, text)] in index order,
    at most `want`; drops {reason: n}). Deterministic: a duplicate keeps the lowest index, so the
    kept ones are the same for any set of candidates first..first+n-1 holding `want` distinct
    passing ones (however many more were written). `seen`: normalised texts kept before (a
    grown carried set's prompts): a candidate equal to one is a duplicate."""
    kept, drops, seen = [], Counter(), set(seen)
    for i, text, ended in sorted(candidates):
        why = verdict(text, ended, guard)
        if why is None:
            n = normalize(text)
            why = "duplicate" if n in seen else None
            seen.add(n)
        if why is None and len(kept) < want:
            kept.append((i, text))
        elif why is not None:
            drops[why] += 1
    return kept, drops


# Estimates for synthesis_share (the 2026-12-02 H200 scale run, BENCHMARKS.md: answers averaged
# 199 of 256 tokens, synthetic candidates 56 of 128, and 79% of candidates were kept; the second
# 2026-12-03 run: synthesis wrote 117k tok/s, the answers 42.7k, so an answer token costs ~2.7x
# the time of a prompt token: long rows read more KV per step, and every turn needs a prefill)
ANSWER_FILL, CANDIDATE_FILL, KEEP_RATE, ANSWER_COST = 0.8, 0.45, 0.8, 2.7


def synthesis_share(n_prompts: int, real_turns: int, params) -> float:
    """The fraction of a time budget that synthesis gets: its estimated time
    (n_prompts / KEEP_RATE candidates of CANDIDATE_FILL * synthetic_max_tokens tokens) over that
    plus the answers' (ANSWER_COST x (real_turns + n_prompts) * ANSWER_FILL * max_new_tokens
    tokens: a token of an answer costs ANSWER_COST prompt tokens of time), within [0.02, 0.5]. So
    the synthetic prompts written are about the share of all the work that the budget reaches,
    and the answers reach them. (A fixed half first: on the H200 87,900 candidates were written
    for the 6,344 answered; then a token-count share (ANSWER_COST 1): 111k candidates written, 64k
    of the prompts never answered.)"""
    s = n_prompts / KEEP_RATE * CANDIDATE_FILL * params.synthetic_max_tokens
    a = ANSWER_COST * (real_turns + n_prompts) * ANSWER_FILL * params.max_new_tokens
    return min(0.5, max(0.02, s / max(s + a, 1.0)))
