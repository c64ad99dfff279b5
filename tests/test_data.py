"""Data: ShareGPT recovery, cleaning, sampling, chat-template tokenisation and loss masks."""

from __future__ import annotations

import json

import pytest

from jobs.data import (TEMPLATES, clean_records, detect_template, load_conversations,
                       read_json_records, read_records, tokenize_conversation, tokenize_dataset)
from runner.spec.schema import Data
from runner.errors import StageError


def mask_spans(mask):
    """[start, end) runs of 1s."""
    spans, cur = [], None
    for i, m in enumerate(list(mask) + [0]):
        if m and cur is None:
            cur = i
        elif not m and cur is not None:
            spans.append((cur, i))
            cur = None
    return spans


# ---- reading -----------------------------------------------------------------------------------


def test_truncated_json_recovers_complete_records(tmp_path):
    recs = [{"id": i, "conversations": [{"from": "human", "value": f"q{i}"}]} for i in range(3)]
    text = json.dumps(recs, indent=2)
    cut = text[: text.rindex('"q2"')]  # stop inside the third record
    p = tmp_path / "t.json"
    p.write_text(cut)
    got, info = read_json_records(p)
    assert [r["id"] for r in got] == [0, 1]
    assert info["truncated"] and info["records_read"] == 2
    p.write_text(text)
    got, info = read_json_records(p)
    assert len(got) == 3 and not info["truncated"]


def test_real_sharegpt_is_recovered_and_cleaned(sharegpt_path):
    train, hold, rep = load_conversations(Data(max_samples=20, holdout=5, seed=3))
    assert rep["truncated"] and rep["records_read"] > 17000
    assert rep["dropped"]["empty"] > 0 and rep["trimmed"]["leading_assistant"] > 1000
    assert rep["clean"] == rep["records_read"] - sum(rep["dropped"].values())
    assert len(train) == 20 and len(hold) == 5
    assert not any(c in train for c in hold)
    for conv in train + hold:
        roles = [t["role"] for t in conv if t["role"] != "system"]
        assert roles[0] == "user" and roles[-1] == "assistant"
        assert all(a != b for a, b in zip(roles, roles[1:]))
        assert all(t["content"] for t in conv)
    # deterministic, and the holdout does not depend on max_samples
    train2, hold2, _ = load_conversations(Data(max_samples=7, holdout=5, seed=3))
    assert hold2 == hold and train2 == train[:7]
    _, hold3, _ = load_conversations(Data(max_samples=7, holdout=5, seed=4))
    assert hold3 != hold


def test_local_jsonl_both_forms_and_cleaning(tmp_path):
    lines = [
        {"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]},
        {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
        {"conversations": [{"from": "gpt", "value": "x"}, {"from": "human", "value": "c"},
                           {"from": "chatgpt", "value": "d"}, {"from": "human", "value": "e"}]},
        {"conversations": [{"from": "narrator", "value": "?"}, {"from": "gpt", "value": "b"}]},
        {"conversations": []},
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                      {"role": "user", "content": "v"}, {"role": "assistant", "content": " "},
                      {"role": "bard", "content": "w"}]},
        [{"role": "user", "content": "only a question"}],
    ]
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    convs, rep = clean_records(read_records(p)[0])
    assert convs[0] == [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert convs[1] == [{"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]
    assert convs[2] == [{"role": "system", "content": "s"}, {"role": "user", "content": "u\n\nv"},
                        {"role": "assistant", "content": "w"}]
    assert len(convs) == 3
    assert rep["dropped"] == {"duplicate": 1, "empty": 1, "no_assistant": 1, "unknown_role": 1}
    assert rep["unknown_roles"] == {"narrator": 1}
    assert rep["trimmed"]["leading_assistant"] == 1 and rep["trimmed"]["trailing_user"] == 2


def test_bad_files_give_clear_errors(tmp_path):
    with pytest.raises(StageError, match="does not exist"):
        load_conversations(Data(source="jsonl", path=str(tmp_path / "nope.jsonl")))
    with pytest.raises(StageError, match="is a folder, not a file"):
        load_conversations(Data(source="jsonl", path=str(tmp_path)))
    p = tmp_path / "bad.jsonl"
    good = json.dumps({"messages": [{"role": "user", "content": "a"},
                                    {"role": "assistant", "content": "b"}]})
    p.write_text(good + "\n{not json\n" + good + "\n")
    with pytest.raises(StageError, match=r"bad.jsonl:2"):
        read_records(p)
    p.write_text(good + '\n{"messages": [{"role": "us')  # truncated last line: skipped
    recs, info = read_records(p)
    assert len(recs) == 1 and info["truncated"]
    p.write_text(json.dumps({"messages": [{"role": "alien", "content": "a"}]}) + "\n")
    with pytest.raises(StageError, match="no usable conversation"):
        load_conversations(Data(source="jsonl", path=str(p)))


# ---- tokenising --------------------------------------------------------------------------------


def test_mask_spans_decode_to_exactly_the_assistant_text(smollm2_tokenizer, sharegpt_path):
    tok = smollm2_tokenizer
    train, _, _ = load_conversations(Data(max_samples=6, holdout=0, seed=0))
    assert detect_template(tok) == "chatml"
    checked = 0
    for conv in train:
        ids, mask = tokenize_conversation(tok, conv, "chatml", 10**6)
        got = [tok.decode(ids[a:b]) for a, b in mask_spans(mask)]
        want = [t["content"] + "<|im_end|>" for t in conv if t["role"] == "assistant"]
        assert got == want
        assert ids == tok.apply_chat_template(conv, tokenize=True, return_dict=True)["input_ids"]
        checked += len(want)
    assert checked >= 6


def test_truncation_and_all_zero_masks(smollm2_tokenizer, sharegpt_path):
    tok = smollm2_tokenizer
    train, _, _ = load_conversations(Data(max_samples=6, holdout=0, seed=0))
    samples, rep = tokenize_dataset(tok, train, "auto", 64)
    assert all(len(ids) == len(m) <= 64 for ids, m in samples)
    assert rep["truncated"] + rep["mask_all_zero"] >= 1
    assert len(samples) == 6 - rep["mask_all_zero"]
    # the default system prompt + first user turn exceed 16 tokens: nothing is supervised
    with pytest.raises(StageError, match="all zero with chat template 'chatml'"):
        tokenize_dataset(tok, train, "chatml", 16)


def test_template_errors(smollm2_tokenizer):
    import copy
    tok = smollm2_tokenizer
    with pytest.raises(StageError, match="llama3"):
        detect_template(tok, "llama3")
    bare = copy.deepcopy(tok)
    bare.chat_template = None
    with pytest.raises(StageError, match="no chat template"):
        tokenize_conversation(bare, [{"role": "user", "content": "a"}], "chatml", 64)


LLAMA3 = ("{{ '<|begin_of_text|>' }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + "
          "'<|end_header_id|>\n\n' + m['content'] + '<|eot_id|>' }}{% endfor %}")
KIMI = ("{% for m in messages %}{{ '<|im_' + m['role'] + '|>' + m['role'] + '<|im_middle|>' + "
        "m['content'] + '<|im_end|>' }}{% endfor %}")


@pytest.mark.parametrize("name,template,end", [("llama3", LLAMA3, "<|eot_id|>"),
                                                ("kimi", KIMI, "<|im_end|>")])
def test_other_templates(smollm2_tokenizer, name, template, end):
    import copy
    tok = copy.deepcopy(smollm2_tokenizer)
    tok.chat_template = template
    tok.add_special_tokens({"additional_special_tokens": [
        "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
        "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>"]})
    assert detect_template(tok) == name
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello! How can I help?"},
            {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4."}]
    ids, mask = tokenize_conversation(tok, conv, name, 10**6)
    assert [tok.decode(ids[a:b]) for a, b in mask_spans(mask)] == \
        ["Hello! How can I help?" + end, "4." + end]
    assert set(TEMPLATES) == {"chatml", "qwen", "llama3", "kimi"}


def test_jsonl_records_may_hold_unicode_line_separators(tmp_path):
    """Only \\n ends a JSONL record: a reply with U+2028 or \\x1c written with ensure_ascii=False
    (as the regenerate stage writes them) is one record, not a 'broken line' (H200 run, line 3379)."""
    recs = [{"messages": [{"role": "user", "content": "a\u2028b\x1cc\x85d"},
                          {"role": "assistant", "content": "e\u2029f"}]},
            {"messages": [{"role": "user", "content": "g"}, {"role": "assistant", "content": "h"}]}]
    p = tmp_path / "c.jsonl"
    p.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs), encoding="utf-8")
    assert read_records(p)[0] == recs


def test_jsonl_edge_files(tmp_path, capsys):
    """A truncated last line is skipped (with a message) also when a newline follows it; a UTF-8
    byte-order mark is dropped for JSONL and JSON arrays; a file whose only line is broken says
    so in the 'no usable conversation' error."""
    good = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps(good) + '\n{"messages": [{"role": "us\n\n')
    recs, info = read_records(p)
    assert recs == [good] and info["truncated"]
    assert "d.jsonl:2: the last line is not valid JSON" in capsys.readouterr().err
    p.write_bytes(b"\xef\xbb\xbf" + (json.dumps(good) + "\n").encode())
    assert read_records(p)[0] == [good]
    p.write_bytes(b"\xef\xbb\xbf" + json.dumps([good, good]).encode())
    assert read_records(p)[0] == [good, good]
    p.write_text('{"messages": [{"role": "us')
    with pytest.raises(StageError, match="last record was not valid JSON"):
        load_conversations(Data(source="jsonl", path=str(p)))
