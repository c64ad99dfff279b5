"""Data: reading every format (JSON arrays, JSONL, gzip, zstd), counting every record the reader
cannot use, cleaning and roles, sampling, the drop report, and tokenisation with SmolLM2's
template. The published Llama-3.1 / Qwen2.5 / Qwen3 templates: tests/test_chat_templates.py."""

from __future__ import annotations

import gzip
import json
import sys
import types

import pytest

from eagle3_runner.data.conversations import (clean_records, detect_template, load_conversations, read_records,
                       show_data_report, tokenize_conversation, tokenize_dataset)
from eagle3_runner.runner.chat import KNOWN
from eagle3_runner.runner.errors import StageError
from eagle3_runner.runner.spec.sections import Data


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


def rec(i, q="q", a="a"):
    return {"id": i, "conversations": [{"from": "human", "value": f"{q}{i}"},
                                       {"from": "gpt", "value": f"{a}{i}"}]}


def jsonl(path, fraction=0.01):
    return Data(source="jsonl", path=str(path), max_bad_fraction=fraction)


class Ctx:
    """The slice of StageContext that show_data_report uses."""

    rank = 0

    def __init__(self):
        self.rows = {}

    def metric(self, name, value, unit="", step=None):
        self.rows[name] = value


# ---- reading: every record the reader cannot use is counted ------------------------------------


def test_truncated_json_recovers_complete_records(tmp_path):
    recs = [rec(i) for i in range(3)]
    text = json.dumps(recs, indent=2)
    p = tmp_path / "t.json"
    p.write_text(text[: text.rindex('"q2"')])  # stop inside the third record
    got, info = read_records(p)
    assert [r["id"] for r in got] == [0, 1]
    assert info["truncated"] and info["records_read"] == 2 and info["unusable"] == {"truncated": 1}
    p.write_text(text)
    got, info = read_records(p)
    assert len(got) == 3 and not info["truncated"] and info["unusable"] == {}
    p.write_text(text.rstrip().removesuffix("]"))  # complete records, no closing bracket
    got, info = read_records(p)
    assert len(got) == 3 and info["unusable"] == {"truncated": 1}
    p.write_text(text + "\n[" + json.dumps(rec(9)) + "]")  # two arrays concatenated
    assert read_records(p)[1]["unusable"] == {"trailing_data": 1}


def test_one_malformed_record_costs_one_record(tmp_path, capsys):
    """Issue 21: a 40-record JSON array with one malformed record gave 5 samples and
    dropped_records 0. Now: 39 records, malformed 1 with its line, and above
    data.max_bad_fraction (2.5% > 1%) the load fails naming the field, counts and fix."""
    text = json.dumps([rec(i) for i in range(40)], indent=2)
    bad = text.replace('"value": "a5"', '"value": a5,,')
    assert bad != text
    p = tmp_path / "d.json"
    p.write_text(bad)
    got, info = read_records(p)
    assert len(got) == 39 and 5 not in [r["id"] for r in got]
    assert info["unusable"] == {"malformed": 1} and not info["truncated"]
    line = bad[:bad.index('"id": 5,')].count("\n")  # the record's "{" line
    with pytest.raises(StageError, match=r"data.max_bad_fraction = 0.01: 1 of 40 records .*"
                                         rf"\(2.50%\) cannot be used: malformed 1 \(first at "
                                         rf"d.json:{line}\).*raise data.max_bad_fraction"):
        load_conversations(jsonl(p, 0.01))
    train, _, rep = load_conversations(jsonl(p, 0.05))
    assert len(train) == 39 and rep["dropped"] == {"malformed": 1}
    assert rep["records_seen"] == 40 and rep["bad_fraction"] == 1 / 40
    # a malformed element that is not an object, and one with brackets inside strings
    p.write_text("[" + ", ".join([json.dumps(rec(0)), "nope", '{"x": "]}", oops}',
                                  json.dumps(rec(1))]) + "]")
    got, info = read_records(p)
    assert [r["id"] for r in got] == [0, 1] and info["unusable"] == {"malformed": 2}


def test_bad_utf8_is_counted_per_record_not_replaced(tmp_path):
    """Issue 21: latin-1 bytes became U+FFFD silently. Now the record is dropped as
    bad_encoding (JSONL and JSON arrays), the others are kept, and the error says how to
    convert the file."""
    good = [json.dumps(rec(i)).encode() for i in range(3)]
    latin = json.dumps(rec(7, q="caf\u00e9 ")).encode().replace(b"\\u00e9",
                                                             "\u00e9".encode("latin-1"))
    assert b"\xe9" in latin
    for name, data, line in (("d.jsonl", b"\n".join(good + [latin]) + b"\n", 4),
                             ("d.json", b"[" + b",\n".join(good + [latin]) + b"]", 4)):
        p = tmp_path / name
        p.write_bytes(data)
        convs, rep = clean_records(read_records(p)[0])
        assert len(convs) == 3 and rep["dropped"] == {"bad_encoding": 1}
        assert not any("\ufffd" in t["content"] for c in convs for t in c)
        with pytest.raises(StageError, match=rf"bad_encoding 1 \(first at {name}:{line}\).*iconv"):
            load_conversations(jsonl(p))
    p.write_bytes("\ufeff".encode("utf-16") + b"x")
    with pytest.raises(StageError, match="is UTF-16; .*iconv -f UTF-16 -t UTF-8"):
        read_records(p)


def test_compressed_files(tmp_path, monkeypatch):
    """gzip (whole and cut short) is read by magic bytes, whatever the suffix; zstd through
    compression.zstd / zstandard when importable, else an error naming the fix."""
    lines = "".join(json.dumps(rec(i)) + "\n" for i in range(50)).encode()
    p = tmp_path / "d.jsonl.gz"
    p.write_bytes(gzip.compress(lines))
    got, info = read_records(p)
    assert len(got) == 50 and info["compression"] == "gzip" and info["unusable"] == {}
    p.write_bytes(gzip.compress(lines)[:-40])
    got, info = read_records(p)
    assert 0 < len(got) < 50 and info["truncated"] and info["unusable"] == {"truncated": 1}
    p.write_bytes(b"\x1f\x8b" + b"junk" * 10)
    with pytest.raises(StageError, match="corrupt gzip stream"):
        read_records(p)
    z = tmp_path / "d.json.zst"
    z.write_bytes(b"\x28\xb5\x2f\xfd" + b"frame")
    monkeypatch.setitem(sys.modules, "compression", None)
    monkeypatch.setitem(sys.modules, "zstandard", None)
    with pytest.raises(StageError, match="zstd-compressed.*pip install zstandard.*zstd -d"):
        read_records(z)

    class Reader:  # a stand-in for zstandard's stream reader: returns the JSON text
        def __init__(self, raw):
            assert raw.startswith(b"\x28\xb5\x2f\xfd")

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

        def read(self):
            return json.dumps([rec(1), rec(2)]).encode()

    fake = types.SimpleNamespace(ZstdError=ValueError, ZstdDecompressor=lambda: types.
                                 SimpleNamespace(stream_reader=Reader))
    monkeypatch.setitem(sys.modules, "zstandard", fake)
    got, info = read_records(z)
    assert [r["id"] for r in got] == [1, 2] and info["compression"] == "zstd"
    assert info["format"] == "json"


def test_real_sharegpt_is_recovered_and_cleaned(sharegpt_path):
    """The package's truncation costs 1 unusable record of 17,672 (below the default 1%); its
    records that start with a gpt turn are trimmed or dropped by policy, not counted as bad."""
    train, hold, rep = load_conversations(Data(max_samples=20, holdout=5, seed=3))
    assert rep["truncated"] and rep["records_read"] > 17000
    assert rep["unusable"] == {"truncated": 1} and rep["records_seen"] == rep["records_read"] + 1
    assert rep["bad_fraction"] < 1e-4
    assert rep["dropped"]["empty"] > 0 and rep["trimmed"]["leading_assistant"] > 1000
    assert rep["clean"] == rep["records_seen"] - sum(rep["dropped"].values())
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
    with pytest.raises(StageError, match="data.max_bad_fraction = 0: 1 of 17"):
        load_conversations(Data(max_samples=7, max_bad_fraction=0))


# ---- cleaning and roles ------------------------------------------------------------------------


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
        {"conversations": [{"from": "gpt", "value": "a continuation"}]},
    ]
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    convs, rep = clean_records(read_records(p)[0])
    assert convs[0] == [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert convs[1] == [{"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]
    assert convs[2] == [{"role": "system", "content": "s"}, {"role": "user", "content": "u\n\nv"},
                        {"role": "assistant", "content": "w"}]
    assert len(convs) == 3
    assert rep["dropped"] == {"duplicate": 1, "empty": 1, "no_assistant": 1, "unknown_role": 1,
                              "starts_with_assistant": 1}
    assert rep["unknown_roles"] == {"narrator": 1}
    assert rep["trimmed"]["leading_assistant"] == 2 and rep["trimmed"]["trailing_user"] == 2


def test_openai_and_tool_roles(tmp_path):
    """OpenAI messages: developer -> system, tool turns and mid-conversation system turns kept
    as context, content given as text parts, assistant tool_calls kept (content may be empty);
    ShareGPT tool datasets' function_call/observation; image parts and unknown roles dropped."""
    records = [
        {"messages": [{"role": "developer", "content": "rules"},
                      {"role": "user", "content": [{"type": "text", "text": "a"}, "b"]},
                      {"role": "assistant", "content": "",
                       "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]},
                      {"role": "tool", "content": "r1"}, {"role": "tool", "content": "r2"},
                      {"role": "system", "content": "late note"},
                      {"role": "assistant", "content": "done"},
                      {"role": "tool", "content": "dangling"}]},
        {"conversations": [{"from": "human", "value": "q"}, {"from": "function_call",
                                                            "value": "{\"name\": \"g\"}"},
                           {"from": "observation", "value": "42"},
                           {"from": "gpt", "value": "42!"}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]},
                      {"role": "assistant", "content": "a cat"}]},
        {"messages": [{"role": "user", "content": "q"}, {"role": "bot", "content": "a"}]},
        {"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "a"}]},
    ]
    convs, rep = clean_records(records)
    assert [t["role"] for t in convs[0]] == ["system", "user", "assistant", "tool", "tool",
                                             "system", "assistant"]
    assert convs[0][1]["content"] == "a\nb" and convs[0][2]["tool_calls"]
    assert [t["role"] for t in convs[1]] == ["user", "assistant", "tool", "assistant"]
    assert rep["dropped"] == {"non_text_content": 1, "unknown_role": 1, "malformed": 1}
    assert rep["trimmed"] == {"trailing_tool": 1}
    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in records))
    with pytest.raises(StageError, match=r"2 of 5 records .*unknown_role 1.*unknown roles "
                                         r"\{'bot': 1\}"):
        load_conversations(jsonl(p))
    _, _, rep = load_conversations(jsonl(p, 0.5))
    assert rep["unusable"] == {"malformed": 1, "unknown_role": 1}
    assert rep["dropped"]["non_text_content"] == 1  # policy: not in the fraction


def test_drop_report_is_printed_and_recorded(tmp_path, capsys):
    p = tmp_path / "d.json"
    text = json.dumps([rec(i) for i in range(200)] + [rec(0)] + [{"messages": []}])
    p.write_text(text.replace('"value": "a5"', '"value": a5'))
    train, _, rep = load_conversations(jsonl(p))
    ctx = Ctx()
    show_data_report(ctx, rep, {"template": "chatml", "tokenized": 199, "template_error": 2,
                                "mask_all_zero": 1, "truncated": 0})
    assert ctx.rows == {"dropped/duplicate": 1, "dropped/empty": 1, "dropped/malformed": 1,
                        "dropped/template_error": 2, "dropped/mask_all_zero": 1,
                        "bad_fraction": 1 / 202}
    err = capsys.readouterr().err
    assert "202 records, 199 conversations kept, 3 dropped" in err
    assert "unusable: 1 = 0.495% (data.max_bad_fraction 1%): malformed 1 (first at d.json:1)" in err
    assert "cleaned away (policy): " in err and "template_error 2" in err


def test_bad_files_give_clear_errors(tmp_path):
    with pytest.raises(StageError, match="does not exist"):
        load_conversations(Data(source="jsonl", path=str(tmp_path / "nope.jsonl")))
    with pytest.raises(StageError, match="is a folder, not a file"):
        load_conversations(Data(source="jsonl", path=str(tmp_path)))
    with pytest.raises(StageError, match="/dev/null is not a regular file"):
        load_conversations(Data(source="jsonl", path="/dev/null"))
    # an empty file: no record, nothing dropped, and the message lists no empty reasons
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(StageError, match=r"has no usable conversation \(0 records read\)\. "
                                         "Records need"):
        load_conversations(jsonl(tmp_path / "empty.jsonl"))
    p = tmp_path / "bad.jsonl"
    good = json.dumps({"messages": [{"role": "user", "content": "a"},
                                    {"role": "assistant", "content": "b"}]})
    p.write_text(good + "\n{not json\n" + good + "\n")
    recs, info = read_records(p)
    assert len(recs) == 2 and info["unusable"] == {"malformed": 1}
    with pytest.raises(StageError, match=r"malformed 1 \(first at bad.jsonl:2\)"):
        load_conversations(jsonl(p))
    p.write_text(good + '\n{"messages": [{"role": "us')  # truncated last line: skipped
    recs, info = read_records(p)
    assert len(recs) == 1 and info["truncated"] and info["unusable"] == {"truncated": 1}
    p.write_text(json.dumps({"messages": [{"role": "alien", "content": "a"}]}) + "\n")
    with pytest.raises(StageError, match="no usable conversation.*unknown_role 1"):
        load_conversations(jsonl(p))
    p.write_text(json.dumps({"data": [rec(1)]}, indent=2))
    with pytest.raises(StageError, match="holds one JSON object \\(keys: data\\)"):
        read_records(p)


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


def test_batched_tokenising_equals_one_at_a_time(smollm2_tokenizer, sharegpt_path, monkeypatch):
    """tokenize_dataset encodes ENCODE_BATCH texts per tokenizer call: on real ShareGPT
    conversations (3 chunks, the last partial) its samples are exactly tokenize_conversation's,
    and the vectorised mask equals the per-token loop on every conversation."""
    import eagle3_runner.data.chat as C
    tok = smollm2_tokenizer
    train, _, _ = load_conversations(Data(max_samples=40, holdout=0, seed=0))
    monkeypatch.setattr(C, "ENCODE_BATCH", 16)
    samples, rep = tokenize_dataset(tok, train, "auto", 512)
    want = [tokenize_conversation(tok, c, "auto", 512) for c in train]
    assert samples == [w for w in want if any(w[1])] and rep["truncated"] >= 1
    cv = C.chat_convention(tok)
    for conv in train:
        text = C.render(tok, conv)
        off = tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        spans = C.assistant_char_spans(text, cv)
        assert C.token_mask(off, spans) == C.token_mask_reference(off, spans)
    assert C.token_mask([(0, 1), (1, 1), (2, 5)], [(1, 3)]) == [0, 0, 1] == \
        C.token_mask_reference([(0, 1), (1, 1), (2, 5)], [(1, 3)])
    assert C.token_mask([], [(0, 1)]) == [] and C.token_mask([(0, 2)], []) == [0]


def test_template_errors(smollm2_tokenizer):
    import copy
    tok = smollm2_tokenizer
    with pytest.raises(StageError, match="llama3"):
        detect_template(tok, "llama3")
    bare = copy.deepcopy(tok)
    bare.chat_template = None
    with pytest.raises(StageError, match="no chat template"):
        tokenize_conversation(bare, [{"role": "user", "content": "a"}], "chatml", 64)


KIMI = ("{% for m in messages %}{{ '<|im_' + m['role'] + '|>' + m['role'] + '<|im_middle|>' + "
        "m['content'] + '<|im_end|>' }}{% endfor %}{% if add_generation_prompt %}"
        "{{ '<|im_assistant|>assistant<|im_middle|>' }}{% endif %}")


def test_other_templates(smollm2_tokenizer):
    """A Kimi-style template on SmolLM2's tokenizer (the published Llama-3.1, Qwen2.5 and Qwen3
    templates: tests/test_chat_templates.py)."""
    import copy
    tok = copy.deepcopy(smollm2_tokenizer)
    tok.chat_template = KIMI
    tok.add_special_tokens({"additional_special_tokens": [
        "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>"]})
    assert detect_template(tok) == "kimi"
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello! How can I help?"},
            {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4."}]
    ids, mask = tokenize_conversation(tok, conv, "kimi", 10**6)
    assert [tok.decode(ids[a:b]) for a, b in mask_spans(mask)] == \
        ["Hello! How can I help?<|im_end|>", "4.<|im_end|>"]
    assert set(KNOWN) == {"chatml", "qwen", "llama3", "kimi"}


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


def test_count_file_is_the_stages_report_streamed_and_cached(tmp_path, monkeypatch):
    """Issue 48: validate and plan hold the data file to the stages' own verdicts. count_file
    streams the file through the same reader and cleaner and gives conversations_from_file's
    report, keeping none of the conversations; it is cached by path, size and mtime (in the
    process and as JSON under memo_dir()/data-counts/), and a changed file is counted again."""
    import os

    from eagle3_runner.data import conversations as C
    from eagle3_runner.data import records as R
    monkeypatch.setenv("EAGLE3_MEMO", str(tmp_path / "cache"))
    C._count_cached.cache_clear()
    good = [json.dumps(rec(i)) for i in range(30)]
    files = {  # every kind of drop, in JSONL, JSON arrays and gzip
        "mixed.jsonl": "\n".join(good[:10] + ["{oops", json.dumps(rec(3)), "[1, 2]",
                                               json.dumps({"messages": [{"role": "alien",
                                                                         "content": "x"}]}),
                                               json.dumps({"messages": []})] + good[10:]
                                 + ['{"cut": [']) + "\n",
        "arr.json": "[" + ",\n".join(good[:5] + ["nope", json.dumps(rec(1))] + good[5:9]) + "]",
        "cut.json": ("[" + ",\n".join(good[:6]))[:-9],
        "two.json": json.dumps([rec(1)]) + "\n" + json.dumps([rec(2)]),
        "blank.jsonl": "\n\n" + good[0] + "\n\n{x\n\n" + good[1] + "\n\n",
    }
    for name, text in files.items():
        p = tmp_path / name
        p.write_text(text)
        assert C.count_file(p) == C.conversations_from_file(p)[1], name
    gz = tmp_path / "d.jsonl.gz"
    gz.write_bytes(gzip.compress(("\n".join(good) + "\n").encode())[:-40])  # cut short
    rep = C.count_file(gz)
    assert rep == C.conversations_from_file(gz)[1] and rep["unusable"] == {"truncated": 1}
    p = tmp_path / "mixed.jsonl"
    rep = C.count_file(p)
    assert (rep["records_seen"], rep["unusable_records"], rep["clean"]) == (36, 4, 30)
    assert rep["unusable"] == {"malformed": 2, "truncated": 1, "unknown_role": 1}
    # cached: another process (an empty lru) reads the JSON, not the file
    memos = list((tmp_path / "cache" / "data-counts").glob("*.json"))
    assert len(memos) == len(files) + 1
    C._count_cached.cache_clear()

    def no_reading(*a, **k):
        raise AssertionError("read the file again")
    monkeypatch.setattr(R, "iter_records", no_reading)
    assert C.count_file(p) == rep
    # a changed file (size, mtime) is a new count
    p.write_text("\n".join(good) + "\n")
    os.utime(p, ns=(1, 1))
    with pytest.raises(AssertionError, match="read the file again"):
        C.count_file(p)
    monkeypatch.undo()
    monkeypatch.setenv("EAGLE3_CACHE", str(tmp_path / "cache"))
    assert C.count_file(p)["clean"] == 30 and C.count_file(p)["unusable_records"] == 0
    C._count_cached.cache_clear()


def test_data_problems_are_the_stages_verdicts(tmp_path, monkeypatch):
    """The issue's file: 4 of 34 records unusable. data_problems gives exactly the StageError
    that load_conversations (extract, regenerate, online train) raises on it, for
    data.max_bad_fraction, a data.holdout that leaves nothing to train on and a file with no
    usable conversation; nothing when the stages would pass."""
    from eagle3_runner.data.conversations import data_problems
    monkeypatch.setenv("EAGLE3_CACHE", str(tmp_path / "cache"))
    p = tmp_path / "chats.jsonl"
    p.write_text("\n".join([json.dumps(rec(i)) for i in range(30)] + ["{oops"] * 3
                           + [json.dumps(rec(40))[:-5] + "x"]) + "\n")

    def stage_error(data):
        with pytest.raises(StageError) as e:
            load_conversations(data)
        return [str(e.value)]
    data = jsonl(p)
    assert data_problems(data) == stage_error(data)
    assert data_problems(data)[0].startswith("data.max_bad_fraction = 0.01: 4 of 34 records")
    looser = Data(source="jsonl", path=str(p), max_bad_fraction=0.2)
    assert data_problems(looser) == [] and load_conversations(looser)[0]
    held = Data(source="jsonl", path=str(p), max_bad_fraction=0.2, holdout=30)
    assert data_problems(held) == stage_error(held)
    assert "data.holdout = 30: leaves no training conversation (30 usable)" in data_problems(held)[0]
    assert data_problems(Data(source="jsonl", path=str(p), max_bad_fraction=0.2, holdout=29,
                              max_samples=1)) == []
    p.write_text(json.dumps({"messages": [{"role": "user", "content": "no answer"}]}) + "\n")
    assert data_problems(data) == stage_error(data) and "no usable conversation" in \
        data_problems(data)[0]


def test_bench_tokenize_script(sharegpt_path, smollm2_path, capsys, tmp_path):
    """scripts/bench/bench_tokenize.py checks both paths' samples equal and reports their ratio; a
    bad count is a usage error naming the flag."""
    import importlib.util
    import json as J
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "scripts" / "bench" / "bench_tokenize.py"
    sp = importlib.util.spec_from_file_location("bench_tokenize", path)
    m = importlib.util.module_from_spec(sp)
    sp.loader.exec_module(m)
    spec = str(Path(__file__).resolve().parents[1] / "specs" / "smollm2-sharegpt.yaml")
    assert m.main([spec, "--conversations", "12", "--repeats", "1", "--json"]) == 0
    res = J.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["conversations"] == 12 and res["tokens"] > 0 and res["ratio"] > 0
    with pytest.raises(SystemExit):
        m.main([spec, "--conversations", "0"])
    assert "--conversations" in capsys.readouterr().err
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(SystemExit):  # refused before any timing, not a traceback at the end
        m.main([spec, "--conversations", "4", "--out", str(afile)])
    assert "a file is in the way" in capsys.readouterr().err
    assert m.main([spec, "--conversations", "4", "--repeats", "1",
                   "--out", str(tmp_path / "o")]) == 0
    assert (tmp_path / "o" / "bench_tokenize.json").exists()
