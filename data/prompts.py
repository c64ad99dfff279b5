"""Bench prompt sets: MT-bench (first turns), HumanEval (prompts as a chat request), held-out
ShareGPT (first user turn of data.holdout conversations, never trained on).

Each prompt is {"id": str, "messages": [{"role": "user", "content": ...}]}; the engine renders it
with the tokenizer's own chat template (add_generation_prompt=True), SGLang receives the same text.
"""

from __future__ import annotations

import gzip
import json

from eagle3_runner.runner.errors import StageError

HUMANEVAL_INSTRUCTION = "Complete the following Python function. Reply with the code only.\n\n"


def _asset(name: str):
    from eagle3_runner.runner.assets import FetchError, asset_path
    try:
        return asset_path(name)
    except FetchError as e:
        raise StageError(f"stages.bench.prompt_sets: {e}")


def mtbench(n: int | None = None) -> list[dict]:
    """MT-bench question.jsonl: 80 questions; the first turn of each."""
    out = []
    for line in _asset("mtbench").read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            out.append({"id": f"mtbench-{r['question_id']}",
                        "messages": [{"role": "user", "content": r["turns"][0]}]})
    return out[:n]


def humaneval(n: int | None = None) -> list[dict]:
    """HumanEval.jsonl.gz: 164 problems, the function prompt wrapped as a chat request."""
    out = []
    with gzip.open(_asset("humaneval"), "rt") as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                out.append({"id": r["task_id"], "messages": [
                    {"role": "user", "content": HUMANEVAL_INSTRUCTION + r["prompt"]}]})
    return out[:n]


def sharegpt_holdout(data, n: int | None = None) -> list[dict]:
    """First user turn of each held-out conversation (spec.data.holdout > 0 required)."""
    if not data.holdout:
        raise StageError("stages.bench.prompt_sets: 'sharegpt' needs data.holdout > 0 (held-out "
                         "conversations are never trained on). Set data.holdout, e.g. 16.")
    from eagle3_runner.data.conversations import load_conversations
    _, hold, _ = load_conversations(data)
    out = []
    for i, conv in enumerate(hold):
        msgs = [m for m in conv if m["role"] in ("system", "user")][:2]
        while msgs and msgs[-1]["role"] != "user":
            msgs.pop()
        if msgs:
            out.append({"id": f"sharegpt-holdout-{i}", "messages": msgs})
    return out[:n]


def load_prompt_set(name: str, spec, n: int | None = None) -> list[dict]:
    """Prompts of one set by name (mtbench | humaneval | sharegpt). Raises StageError."""
    if name == "mtbench":
        return mtbench(n)
    if name == "humaneval":
        return humaneval(n)
    if name == "sharegpt":
        return sharegpt_holdout(spec.data, n)
    import difflib
    close = difflib.get_close_matches(name, ["mtbench", "humaneval", "sharegpt"], n=1, cutoff=0.5)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise StageError(f"stages.bench.prompt_sets: unknown set {name!r} (mtbench, humaneval, "
                     f"sharegpt).{hint}")


def render(tokenizer, messages: list[dict]) -> list[int]:
    """Chat-template token ids with the assistant generation prompt."""
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(out, dict) or hasattr(out, "keys"):
        out = out["input_ids"]
    return list(out)


def render_batch(tokenizer, conversations: list[list[dict]]) -> list[list[int]]:
    """render() of many conversations: the templates rendered as text, then ONE batched
    tokenizer call (the fast tokenizer spreads it over the cores; the per-prompt calls cost
    ~0.3 ms each, which a GPU regenerating 100k conversations would wait for). Same ids as
    render (tests/test_regenerate.py)."""
    texts = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False)
             for m in conversations]
    return [list(x) for x in tokenizer(texts, add_special_tokens=False)["input_ids"]] \
        if texts else []
