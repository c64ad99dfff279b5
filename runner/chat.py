"""The chat-template conventions the project knows by name, once (torch-free, no jinja).

An assistant turn in a rendered chat is found by its HEADER (the text the template's generation
prompt adds, e.g. `<|im_start|>assistant\\n`) and the END-OF-TURN marker the target generates
after the content (`<|im_end|>`). data/chat.py derives both from the tokenizer's own template by
rendering probe conversations; the names below are what `target.chat_template` may say, and
when set, the derived pair must match the named one (a guard against the wrong tokenizer).

| name | header | end | seen in |
|---|---|---|---|
| chatml | `<|im_start|>assistant\\n` | `<|im_end|>` | SmolLM2, Qwen2.5, many fine-tunes |
| qwen | the same | the same | Qwen3 (ChatML with `<think>` blocks) |
| llama3 | `<|start_header_id|>assistant<|end_header_id|>\\n\\n` | `<|eot_id|>` | Llama 3.x |
| kimi | `<|im_assistant|>assistant<|im_middle|>` | `<|im_end|>` | Kimi-K2 / K2.5 |
"""

from __future__ import annotations

# name -> (assistant header, end-of-turn marker)
KNOWN: dict[str, tuple[str, str]] = {
    "chatml": ("<|im_start|>assistant\n", "<|im_end|>"),
    "qwen": ("<|im_start|>assistant\n", "<|im_end|>"),
    "llama3": ("<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>"),
    "kimi": ("<|im_assistant|>assistant<|im_middle|>", "<|im_end|>"),
}
THINK_OPEN = "<think>"  # Qwen3's reasoning block marker (in the template source and the render)


def template_family(source: str | None) -> str | None:
    """The KNOWN name whose markers the template SOURCE (jinja text) uses, or None.

    A cheap look at the literal special tokens, for `runner init` (no rendering): llama3 when it
    writes `<|start_header_id|>` and `<|eot_id|>`; kimi for `<|im_assistant|>`; qwen for ChatML
    with `<think>`; chatml for `<|im_start|>` and `<|im_end|>`. The stages render the template
    itself and check the result (data/chat.py)."""
    if not source:
        return None
    if "<|start_header_id|>" in source and "<|eot_id|>" in source:
        return "llama3"
    if "<|im_assistant|>" in source:
        return "kimi"
    if "<|im_start|>" in source and "<|im_end|>" in source:
        return "qwen" if THINK_OPEN in source else "chatml"
    return None
