"""The train stage's set-up samples against an independent reference, on SmolLM2's tokenizer and
real ShareGPT conversations (multi-turn among them) plus hand-made edge cases: data/chat.py
tokenize_dataset, in this process and over spawned worker processes (the chunked vectorised loss
mask), equals one conversation at a time (its own tokenizer call, the per-token mask loop
token_mask_reference), sample for sample, in order, with the same report; the online source's
draft vocab (trainer/sources.py Online over those lists, trainer/vocab.py count_tokens without a
tensor per sample) equals per-sample bincounts of tensors; a tokenizer that does not pickle is
tokenised in this process."""

from __future__ import annotations

import copy

import pytest
import torch

import eagle3_runner.data.chat as C
import eagle3_runner.trainer.vocab as V
from eagle3_runner.data.conversations import load_conversations
from eagle3_runner.runner.spec.sections import Data

MAX_LENGTH = 1024
CODE = ("Here:\n```python\ndef f(x):\n    if x:\n        return [x,   x]  \n\n\n"
        "    return None\n```\n  Indented   text\twith\ttabs.")
EXTRA = [
    # system turn, three exchanges, code (indentation runs), characters that the byte-level
    # BPE splits into several tokens sharing one character offset (emoji, combining marks)
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "code?"},
     {"role": "assistant", "content": CODE}, {"role": "user", "content": "again"},
     {"role": "assistant", "content": CODE + "\n\n  ok"}, {"role": "user", "content": "emoji"},
     {"role": "assistant", "content": "👍🏽 ok — naïve café, 漢字と かな, e\u0301"}],
    # a first user turn longer than MAX_LENGTH tokens: truncated, nothing supervised left
    [{"role": "user", "content": "word " * 800}, {"role": "assistant", "content": "fine"}],
    # a content the template cannot render (None + str): refused, counted
    [{"role": "user", "content": None}, {"role": "assistant", "content": "x"}],
]


def reference(tok, convs, max_length):
    """One conversation at a time: (samples, all-zero indices, refused indices, truncated,
    tokens inside assistant spans that share their start with the token before)."""
    cv = C.chat_convention(tok, "auto")
    samples, zero, refused, truncated, shared = [], [], [], 0, 0
    for i, conv in enumerate(convs):
        try:
            text = C.render(tok, conv)
        except C.template_errors():
            refused.append(i)
            continue
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        spans = C.assistant_char_spans(text, cv)
        mask = C.token_mask_reference(enc["offset_mapping"], spans)
        off = enc["offset_mapping"]
        shared += sum(a == p and any(s <= a < e for s, e in spans)
                      for (p, _), (a, _) in zip(off, off[1:]))
        truncated += len(enc["input_ids"]) > max_length
        ids, mask = enc["input_ids"][:max_length], mask[:max_length]
        (samples.append((ids, mask)) if any(mask) else zero.append(i))
    return samples, zero, refused, truncated, shared


@pytest.fixture(scope="module")
def data(smollm2_tokenizer, sharegpt_path):
    train, _, _ = load_conversations(Data(max_samples=240, holdout=0, seed=0))
    convs = train + EXTRA
    return convs, reference(smollm2_tokenizer, convs, MAX_LENGTH)


@pytest.mark.parametrize("workers", [1, 2])
def test_samples_equal_one_at_a_time(smollm2_tokenizer, data, workers, monkeypatch):
    convs, (want, zero, refused, truncated, shared) = data
    multi = sum(sum(t["role"] == "assistant" for t in c) >= 2 for c in convs)
    assert multi >= 30 and zero and refused and truncated >= 5 and shared >= 5
    monkeypatch.setattr(C, "ENCODE_BATCH", 32)  # 8 chunks: several tasks per worker
    got, rep = C.tokenize_dataset(smollm2_tokenizer, convs, "auto", MAX_LENGTH, workers=workers)
    assert len(got) == len(want) and got == want
    assert all(type(x) is int for ids, mask in got[:5] for x in ids + mask)
    assert rep == {"template": "chatml", "tokenized": len(convs), "truncated": truncated,
                   "mask_all_zero": len(zero), "mask_all_zero_examples": zero[:10],
                   "template_error": len(refused), "template_error_examples": rep[
                       "template_error_examples"],
                   "tokens": sum(len(s[0]) for s in want),
                   "supervised_tokens": sum(sum(s[1]) for s in want)}
    assert [m.split(":")[0] for m in rep["template_error_examples"]] == \
        [f"conversation {i}" for i in refused[:3]]


def test_chunked_masks_equal_the_per_token_loop():
    """token_masks (many texts keyed into one searchsorted) against token_mask_reference per
    text, on random texts: empty tokens, tokens sharing a start, spans at either end, texts
    without spans or tokens."""
    import random
    rng = random.Random(0)
    offsets, spans = [], []
    for _ in range(300):
        n, pos, off = rng.randint(0, 30), 0, []
        for _ in range(n):
            a = pos if rng.random() < 0.3 else pos + rng.randint(0, 2)
            b = a if rng.random() < 0.15 else a + rng.randint(1, 4)
            off.append((a, b))
            pos = a if rng.random() < 0.1 else b
        cuts = sorted(rng.sample(range(pos + 2), min(pos + 2, 2 * rng.randint(0, 3))))
        offsets.append(off)
        spans.append([(cuts[i], cuts[i + 1]) for i in range(0, len(cuts) - 1, 2)
                      if cuts[i] < cuts[i + 1]])
    got = C.token_masks(offsets, spans)
    assert got == [C.token_mask_reference(o, s) for o, s in zip(offsets, spans)]
    assert sum(map(sum, got)) > 500 and any(not o for o in offsets)


def test_online_draft_vocab_equals_tensor_counts(smollm2_tokenizer, data, tmp_path, monkeypatch):
    """The online source serves its lists to count_tokens as they are (COUNT_CHUNK small: many
    chunks); counts, vocab and mappings equal per-sample bincounts of tensors, and the vocab's
    cache key (the samples' identity) is the one of the reference samples."""
    from eagle3_runner.targets.capture import TargetData
    from eagle3_runner.trainer.sources import Online
    _, (want, *_) = data
    got, _ = C.tokenize_dataset(smollm2_tokenizer, data[0], "auto", MAX_LENGTH, workers=1)
    V_ = len(smollm2_tokenizer)
    src = Online(TargetData(None, smollm2_tokenizer, {}, got, {}, {}, 0), [0, 1, 2], "test")
    ref = Online(TargetData(None, smollm2_tokenizer, {}, want, {}, {}, 0), [0, 1, 2], "test")
    assert src.identity == ref.identity
    ids = list(range(0, len(got), 2))
    monkeypatch.setattr(V, "COUNT_CHUNK", 1000)
    counts = V.count_tokens(src.token_masks(ids), V_)
    expect = sum(torch.bincount(torch.tensor(want[i][0])[torch.tensor(want[i][1]).bool()],
                                minlength=V_) for i in ids)
    assert torch.equal(counts, expect) and int(counts.sum()) > 10_000
    key = V.cache_key(src.identity, ids, 2000, V_)
    d2t, t2d, stats = V.build_or_load(tmp_path, key, lambda: src.token_masks(ids), 2000, V_)
    used, _ = V.select_vocab(expect, 2000)
    assert torch.equal(d2t, V.mappings(used, V_)[0]) and torch.equal(t2d, V.mappings(used, V_)[1])
    assert stats["supervised_tokens"] == int(expect.sum())


def test_unpicklable_tokenizer_tokenises_in_this_process(smollm2_tokenizer, data, capsys):
    convs = data[0][:40]
    tok = copy.copy(smollm2_tokenizer)
    tok.hook = lambda: None  # a lambda does not pickle
    got, _ = C.tokenize_dataset(tok, convs, "auto", MAX_LENGTH, workers=2)
    assert got == reference(smollm2_tokenizer, convs, MAX_LENGTH)[0] and len(got) >= 30
    assert "tokenising in this process: 2 worker processes could not" in capsys.readouterr().err


def test_bench_setup_script(smollm2_path, tmp_path, capsys):
    """scripts/bench/bench_setup.py runs `setup` of this tree and of a baseline (here the same
    tree) on N records spread over a carried set (multi-turn ones included) and finds the same
    draft-vocab key in every run."""
    import gzip
    import importlib.util
    import json
    from pathlib import Path
    words = "the cat sat on a mat while dogs ran far away from home at night".split()
    with gzip.open(tmp_path / "set.jsonl.gz", "wt") as f:
        for i in range(60):
            msgs = []
            for t in range(1 + i % 3):
                msgs += [{"role": "user", "content": " ".join(words[(i + t) % 7:][:5])},
                         {"role": "assistant", "content": " ".join(words[t:][:4 + i % 9])}]
            f.write(json.dumps({"id": f"real-{i:06d}", "source": "real", "index": i,
                                "messages": msgs, "finish": ["stop"] * (len(msgs) // 2),
                                "answer_tokens": [4] * (len(msgs) // 2), "cut": None,
                                "dropped": None}) + "\n")
    spec = tmp_path / "spec.yaml"
    spec.write_text(json.dumps({
        "name": "bench-setup", "target": {"path": str(smollm2_path), "dtype": "float32",
                                          "device": "cpu", "chat_template": "chatml"},
        "drafter": {"aux_layer_ids": [1, 14, 26], "draft_vocab_size": 64},
        "data": {"source": "jsonl", "path": str(tmp_path / "set.jsonl.gz"), "max_length": 64,
                 "holdout": 0},
        "stages": {"regenerate": {"reuse": str(tmp_path / "set.jsonl.gz")},
                   "train": {"features": "online", "eval_samples": 4, "batch_size": 4}}}))
    path = Path(__file__).resolve().parents[1] / "scripts" / "bench" / "bench_setup.py"
    sp = importlib.util.spec_from_file_location("bench_setup", path)
    m = importlib.util.module_from_spec(sp)
    sp.loader.exec_module(m)
    assert m.main([str(spec), "--conversations", "30", "--baseline", str(path.parents[2]),
                   "--json", "--out", str(tmp_path / "o")]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["data"]["records"] == 30 and res["data"]["answers"] == 60 and res["same_vocab"]
    assert res["samples"] == 30 and set(res["ratio"]) == set(m.PHASES)
    assert (tmp_path / "o" / "bench_setup.json").exists()
