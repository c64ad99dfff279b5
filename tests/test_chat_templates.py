"""Loss masks under the published chat templates of Llama-3.1, Qwen2.5, Qwen3 and ChatML
(tests/data/templates/), rendered by transformers' apply_chat_template with tiny byte-level
tokenizers (tests/chat_helpers.py): the supervised text is exactly each assistant turn's content
(+ its end-of-turn marker); system, developer, user and tool turns, headers and Qwen3's empty
think framing never are."""

from __future__ import annotations

import pytest

from chat_helpers import FAMILIES, load_tokenizer, make_target, template_text
from eagle3_runner.data.chat import chat_convention, derive_convention, tokenize_conversation, tokenize_dataset
from eagle3_runner.data.conversations import clean_records
from eagle3_runner.runner.chat import template_family
from eagle3_runner.runner.errors import StageError

END = {"llama3.1-8b": "<|eot_id|>", "qwen3-8b": "<|im_end|>", "qwen2.5-7b": "<|im_end|>",
       "chatml-smollm2": "<|im_end|>"}
NAME = {"llama3.1-8b": "llama3", "qwen3-8b": "qwen", "qwen2.5-7b": "chatml",
        "chatml-smollm2": "chatml"}


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    root = tmp_path_factory.mktemp("targets")
    return {f: load_tokenizer(make_target(root / f, f)) for f in FAMILIES}


def supervised(tok, conv, template="auto"):
    """(full decoded text, [decoded text of each run of supervised tokens])."""
    ids, mask = tokenize_conversation(tok, conv, template, 10**6)
    runs, cur = [], []
    for i, m in zip(ids, list(mask)):
        if m:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return tok.decode(ids), [tok.decode(r) for r in runs]


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4."}]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_plain_chat_supervises_exactly_the_assistant_turns(toks, family):
    tok = toks[family]
    cv = derive_convention(tok)
    assert cv.name == NAME[family] == template_family(template_text(family))
    assert cv.end == END[family]
    text, runs = supervised(tok, CHAT)
    assert runs == ["Hello! How can I help?" + END[family], "4." + END[family]]
    assert "Be brief." in text and "2+2?" in text
    # the named convention is accepted; a wrong name is refused before any compute
    assert chat_convention(tok, NAME[family]).name == NAME[family]
    wrong = "kimi" if family != "llama3.1-8b" else "chatml"
    with pytest.raises(StageError, match=f"target.chat_template = {wrong}: .*Set chat_template "
                                         "to auto"):
        chat_convention(tok, wrong)


def test_qwen3_thinking_and_non_thinking(toks):
    """Qwen3's template strips the reasoning of assistant turns before the last user message and
    renders `<think>` blocks on the turns after it. Trained: what the template renders inside an
    assistant turn, reasoning included; never the EMPTY block it adds to the last turn (the
    non-thinking generation prompt itself holds that block)."""
    tok = toks["qwen3-8b"]
    assert derive_convention(tok).framing == "<think>\n\n</think>\n\n"
    text, runs = supervised(tok, CHAT)
    assert "<think>\n\n</think>\n\n4." in text  # rendered, not trained
    assert runs == ["Hello! How can I help?<|im_end|>", "4.<|im_end|>"]
    thinking = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "<think>\nGreet back.\n</think>\n\nHello!"},
                {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\n4."}]
    text, runs = supervised(tok, thinking)
    assert "Greet back." not in text  # the template drops earlier reasoning
    assert runs == ["Hello!<|im_end|>", "<think>\nAdd them.\n</think>\n\n4.<|im_end|>"]
    # the same through reasoning_content (OpenAI-style field), kept by cleaning
    rec = {"messages": [{"role": "user", "content": "2+2?"},
                        {"role": "assistant", "content": "4.", "reasoning_content": "Add them."}]}
    convs, _ = clean_records([rec])
    assert supervised(tok, convs[0])[1] == ["<think>\nAdd them.\n</think>\n\n4.<|im_end|>"]


TOOL_RECORD = {"messages": [
    {"role": "developer", "content": "DEVELOPER-RULES"},
    {"role": "user", "content": [{"type": "text", "text": "Weather in"},
                                 {"type": "text", "text": "Paris?"}]},
    {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "id": "c1",
         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "TOOL-RESULT-18C"},
    {"role": "assistant", "content": "It is 18C in Paris."}]}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tool_and_developer_turns_are_context_never_trained(toks, family):
    convs, rep = clean_records([TOOL_RECORD])
    assert rep["dropped"] == {} and [t["role"] for t in convs[0]] == \
        ["system", "user", "assistant", "tool", "assistant"]
    assert convs[0][1]["content"] == "Weather in\nParis?"
    text, runs = supervised(toks[family], convs[0])
    assert "DEVELOPER-RULES" in text and "TOOL-RESULT-18C" in text and "Paris?" in text
    assert not any(s in r for r in runs for s in ("DEVELOPER-RULES", "TOOL-RESULT", "Paris?"))
    assert runs[-1] == "It is 18C in Paris." + END[family]
    if family != "chatml-smollm2":  # SmolLM2's template ignores tool_calls
        assert "get_weather" in runs[0] and len(runs) == 2


def test_template_refusals_are_counted_not_fatal(toks):
    """Llama-3.1's template raises for two tool calls in one turn: that conversation is dropped
    and counted (template_error); the others are tokenised."""
    tok = toks["llama3.1-8b"]
    call = {"function": {"name": "f", "arguments": {}}}
    bad = [{"role": "user", "content": "x"},
           {"role": "assistant", "content": "", "tool_calls": [call, call]}]
    samples, rep = tokenize_dataset(tok, [CHAT, bad, CHAT[1:3]], "auto", 4096)
    assert len(samples) == 2 and rep["template_error"] == 1
    assert "single tool-calls" in rep["template_error_examples"][0]
    with pytest.raises(StageError, match="chat template refused all 1"):
        tokenize_dataset(tok, [bad], "auto", 4096)


def test_templates_that_cannot_be_probed(tmp_path):
    """No generation header (a template without add_generation_prompt): auto fails naming
    target.chat_template; a named convention is then used as declared."""
    t = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
         "'<|im_end|>\n' }}{% endfor %}")
    tok = load_tokenizer(make_target(tmp_path / "t", "chatml-smollm2", chat_template=t))
    with pytest.raises(StageError, match="target.chat_template = auto: .*adds no assistant header"):
        chat_convention(tok)
    assert supervised(tok, CHAT, "chatml")[1] == ["Hello! How can I help?<|im_end|>",
                                                  "4.<|im_end|>"]
    bare = load_tokenizer(make_target(tmp_path / "b", "chatml-smollm2", chat_template=None))
    with pytest.raises(StageError, match="no chat template"):
        chat_convention(bare, "chatml")


def test_smollm2_template_file_is_the_published_one(smollm2_path):
    from eagle3_runner.runner.target_config import read_gguf_metadata
    assert read_gguf_metadata(smollm2_path)["tokenizer.chat_template"] == \
        template_text("chatml-smollm2")



def test_a_declared_template_that_is_not_the_targets_is_refused_at_validation(tmp_path):
    """target.chat_template: llama3 on a ChatML target: validate says so, naming the target's
    own convention (extract would otherwise load the target, find no assistant turn and stop);
    qwen on ChatML is the same markers, so it passes, and so does a template no name matches."""
    from eagle3_runner.runner.errors import SpecError
    from eagle3_runner.runner.spec.load import load_spec
    target = make_target(tmp_path / "t", "chatml-smollm2")
    data = {"name": "t", "target": {"path": str(target)}, "drafter": {"draft_vocab_size": 64}}
    with pytest.raises(SpecError, match=r"target.chat_template.*'llama3'.*uses chatml's.*Set "
                                        r"target.chat_template: chatml"):
        load_spec(data={**data, "target": {"path": str(target), "chat_template": "llama3"}})
    for ok in ("qwen", "chatml", "auto"):
        load_spec(data={**data, "target": {"path": str(target), "chat_template": ok}})
