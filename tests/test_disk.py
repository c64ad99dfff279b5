"""runner/disk.py: the plan's estimate of offline feature bytes and the free space next to it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from eagle3_runner.runner import disk
from eagle3_runner.runner.spec.load import load_spec

ROOT = __import__("pathlib").Path(__file__).resolve().parent.parent


def _model_dir(tmp_path):
    """A target folder that exists (the plan checks input paths); the shape is declared."""
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({
        "model_type": "llama", "num_hidden_layers": 30, "hidden_size": 576, "vocab_size": 49152,
        "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3,
        "max_position_embeddings": 8192}))
    return d


def _spec(tmp_path, data_path, stages=None, **data):
    return load_spec(data={
        "name": "d", "work_dir": str(tmp_path / "work"),
        "target": {"path": str(_model_dir(tmp_path)), "num_hidden_layers": 30, "hidden_size": 576,
                   "vocab_size": 49152, "dtype": "bfloat16"},
        "drafter": {"draft_vocab_size": 1024, "aux_layer_ids": [1, 14, 26]},
        "data": {"source": "jsonl", "path": str(data_path), "max_length": 64, **data},
        "stages": stages or {"extract": {}, "train": {}}}, check_target=False)


def _write(path, answers_chars):
    with open(path, "w") as f:
        for n in answers_chars:
            f.write(json.dumps({"messages": [{"role": "user", "content": "q" * 40},
                                             {"role": "assistant", "content": "a" * n}]}) + "\n")


def test_estimate_counts_tokens_records_and_caps(tmp_path):
    _write(tmp_path / "d.jsonl", [80, 400])  # 10+5 + 20+5 = 40; 10+5 + 100+5 -> 64 (max_length)
    spec = _spec(tmp_path, tmp_path / "d.jsonl")
    assert disk.bytes_per_token(spec) == 4617  # SmolLM2 in bf16, as targets/features.py states
    e = disk.estimate(spec)
    assert (e["samples"], e["tokens"], e["bytes"]) == (2, 40 + 64, 104 * 4617)
    assert "estimate: 2 of 2 records read, 4 characters per token" == e["method"]
    assert disk.estimate(_spec(tmp_path, tmp_path / "d.jsonl", holdout=1))["tokens"] == 52
    regen = _spec(tmp_path, tmp_path / "d.jsonl", stages={"regenerate": {"max_new_tokens": 8},
                                                          "extract": {}})
    assert disk.estimate(regen)["tokens"] == 2 * (15 + 13)  # answers capped at 8 tokens
    # self-written prompts count at their caps (12 + 8 + 2 turns' 5 = 30 tokens each)
    synth = _spec(tmp_path, tmp_path / "d.jsonl", stages={"regenerate": {
        "max_new_tokens": 8, "synthetic_prompts": 3, "synthetic_max_tokens": 12}, "extract": {}})
    e = disk.estimate(synth)
    assert (e["samples"], e["tokens"]) == (2 + 3, 2 * (15 + 13) + 3 * 30)
    assert e["method"].endswith("+ up to 3 self-written prompts "
                                "(stages.regenerate.synthetic_prompts) at their token caps")
    # a carried regenerated set is what train reads: counted as it is, no synthetic bound
    _write(tmp_path / "carried.jsonl", [80] * 5)
    carried = _spec(tmp_path, tmp_path / "d.jsonl", stages={"regenerate": {
        "max_new_tokens": 8, "synthetic_prompts": 3, "reuse": str(tmp_path / "carried.jsonl")},
        "extract": {}})
    e = disk.estimate(carried)
    assert (e["samples"], e["tokens"]) == (5, 5 * 40)
    assert "(the carried regenerated set)" in e["method"]
    assert "error" in disk.estimate(_spec(tmp_path, tmp_path / "missing.jsonl"))


def test_estimate_says_how_many_records_were_not_json_and_survives_deep_nesting(tmp_path):
    """A malformed line is named in the estimate (it is not silently "30 of 30 records read");
    a record nested too deep for the JSON parser is skipped, not a RecursionError in the plan."""
    _write(tmp_path / "d.jsonl", [80, 80])
    with open(tmp_path / "d.jsonl", "a") as f:
        f.write('{"messages": [oops\n' + '{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    e = disk.estimate(_spec(tmp_path, tmp_path / "d.jsonl"))
    assert e["samples"] == 2
    assert e["method"].startswith("estimate: 2 of 2 records read, 2 not readable as JSON "
                                  "(not counted")
    deep = tmp_path / "deep.json"
    deep.write_text("[" + '{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}]")
    assert "no complete record" in disk.estimate(_spec(tmp_path, deep))["error"]


def test_a_gzip_file_cut_short_is_estimated_from_what_decompresses(tmp_path):
    """A .gz cut mid-stream: the stages keep its complete records (data/records.py), so the
    estimate (and runner init) reads them too instead of failing on the cut; two gzip members
    concatenated read as one text."""
    import gzip
    _write(tmp_path / "d.jsonl", [80] * 400)
    raw = gzip.compress((tmp_path / "d.jsonl").read_bytes())
    (tmp_path / "cut.jsonl.gz").write_bytes(raw[:len(raw) // 2])
    e = disk.estimate(_spec(tmp_path, tmp_path / "cut.jsonl.gz"))
    assert "error" not in e and 0 < e["samples"] < 400, e
    (tmp_path / "two.jsonl.gz").write_bytes(raw + raw)
    head, size, whole, kind = disk.read_head(tmp_path / "two.jsonl.gz", 1 << 30)
    assert whole and kind == "gzip" and head == (tmp_path / "d.jsonl").read_bytes() * 2


def test_a_set_of_gzip_members_is_sized_by_its_head_not_the_last_members_trailer(tmp_path):
    """A regenerated set is its shards' gzip members joined (scripts/gpu/pays.sh): gzip's size
    trailer is the last member's only, so a file read in part is sized from its head's
    compression ratio (2026-12-07: 83,708 conversations planned as 443 from a 117-record last
    shard). One member still uses the trailer."""
    import gzip
    import random
    rnd = random.Random(0)
    shard = lambda k: "".join(json.dumps({"messages": [  # noqa: E731 - one shard's text
        {"role": "user", "content": "".join(rnd.choices("abcdefgh ", k=60))},
        {"role": "assistant", "content": "".join(rnd.choices("abcdefgh ", k=300))}]}) + "\n"
        for _ in range(k)).encode()
    texts = [shard(200) for _ in range(30)] + [shard(3)]  # 6,003 records, a small last shard
    (tmp_path / "set.jsonl.gz").write_bytes(b"".join(gzip.compress(t) for t in texts))
    head, size, whole, kind = disk.read_head(tmp_path / "set.jsonl.gz", 200_000)
    total = sum(len(t) for t in texts)
    assert not whole and kind == "gzip" and 0.8 * total < size < 1.25 * total
    (tmp_path / "one.jsonl.gz").write_bytes(gzip.compress(b"".join(texts)))
    assert disk.read_head(tmp_path / "one.jsonl.gz", 200_000)[1] == total


def test_plan_says_when_extract_will_not_fit_and_suggests_online(tmp_path):
    """A sparse 4 TB data file (nothing written): the estimate exceeds the free space."""
    path = tmp_path / "big.jsonl"
    _write(path, [400] * 50)
    with open(path, "r+b") as f:
        f.truncate(4 << 40)
    spec = _spec(tmp_path, path)
    spec_file = tmp_path / "s.yaml"
    spec_file.write_text(json.dumps(spec.model_dump(mode="json", exclude_none=True)))
    def run(*a):
        return subprocess.run([sys.executable, "-m", "eagle3_runner.runner", "plan",
                               str(spec_file), *a],
                              capture_output=True, text=True, cwd=ROOT, check=True).stdout
    text = run()
    assert "disk: extract writes ~" in text and "free on" in text
    assert "NOT ENOUGH SPACE" in text and "stages.train.features: online" in text
    d = json.loads(run("--json"))["disk"]
    assert not d["fits"] and d["extract_bytes"] > d["free_bytes"] > 0
    assert d["extract"][0]["samples"] > 10**7 and "features: online" in d["advice"]
    online = _spec(tmp_path, path, max_samples=100,
                   stages={"train": {"features": "online"}})
    from eagle3_runner.runner.plan import build_plan
    p = build_plan(online)
    assert [s.stage for s in p.stages] == ["train"] and p.disk["fits"]
    assert p.disk["online"][0]["tokens"] == 92 * 64  # eval_samples (8) are not trained on
    text = "\n".join(disk.render(p.disk))
    assert "runs the target online: no features written; it trains on ~5,888 tokens (92 " \
           "samples), ~0.0 GB as offline features\n" in text
    few = _spec(tmp_path, path, max_samples=100,
                stages={"train": {"features": "online", "num_samples": 50, "eval_samples": 0}})
    assert disk.train_share(few, disk.estimate(few))["tokens"] == 50 * 64
    tight = {**p.disk, "free_bytes": 10**7}  # a disk smaller than the features (27.2 MB)
    assert ("~0.0 GB as offline features: 2.7x the 0.0 GB free on " in
            "\n".join(disk.render(tight)))


def test_estimate_reads_gzip_and_zstd_data(tmp_path):
    """A compressed data file (recognised by its magic bytes, as data/records.py reads it) is
    estimated from its decompressed head: the same figures as the plain file when read whole;
    its text size from the head's compression ratio when not."""
    import gzip
    _write(tmp_path / "d.jsonl", [80, 400] * 10)
    plain = disk.estimate(_spec(tmp_path, tmp_path / "d.jsonl"))
    gz = tmp_path / "d.data"  # any name
    gz.write_bytes(gzip.compress((tmp_path / "d.jsonl").read_bytes()))
    e = disk.estimate(_spec(tmp_path, gz))
    assert {k: e[k] for k in ("tokens", "samples", "bytes")} == \
        {k: plain[k] for k in ("tokens", "samples", "bytes")}
    assert "(gzip)" in e["method"]
    big = tmp_path / "big.jsonl"
    _write(big, [400] * 20_000)  # ~9 MB of text: more than READ_BYTES
    bgz = tmp_path / "big.jsonl.gz"
    bgz.write_bytes(gzip.compress(big.read_bytes()))
    head, size, whole, kind = disk.read_head(bgz)
    assert kind == "gzip" and not whole and len(head) == disk.READ_BYTES
    assert abs(size - big.stat().st_size) < 0.1 * big.stat().st_size
    assert disk.estimate(_spec(tmp_path, bgz))["samples"] == pytest.approx(20_000, rel=0.1)
    z = tmp_path / "d.jsonl.zst"
    z.write_bytes(b"\x28\xb5\x2f\xfd" + b"\0" * 16)
    try:
        import zstandard  # noqa: F401
    except ImportError:
        e = disk.estimate(_spec(tmp_path, z))
        assert "zstandard" in e["error"] and e["bytes_per_token"] == 4617
