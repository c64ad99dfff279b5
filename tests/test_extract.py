"""Extraction on the real SmolLM2 (CPU, float32) and a few real ShareGPT conversations."""

from __future__ import annotations

import errno
import json

import pytest
import torch

import eagle3_runner.jobs.extract as ex
from eagle3_runner.targets.capture import check_aux_ids
import eagle3_runner.targets.shards as shards
from eagle3_runner.targets.features import MANIFEST, open_features
from eagle3_runner.runner.errors import StageError
from eagle3_runner.runner.stage import StageContext

AUX = [1, 14, 26]  # SGLang ids = HF hidden_states [2, 15, 27]


def make_spec(smollm2_path, tmp_path, **extract):
    from eagle3_runner.runner.spec.load import load_spec
    return load_spec(data={
        "name": "t", "work_dir": str(tmp_path / "work"),
        "target": {"path": str(smollm2_path), "device": "cpu", "chat_template": "auto"},
        "drafter": {"aux_layer_ids": AUX, "draft_vocab_size": 1024},
        "data": {"source": "sharegpt", "max_samples": 3, "max_length": 128, "holdout": 0,
                 "seed": 0},
        "stages": {"extract": {"batch_tokens": 128, "shard_samples": 2, **extract}}})


def run_extract(spec, out, model=None):
    """Run the stage into `out`; `model` = (model, tok, cfg) stands in for targets.load.load_target
    (the loader itself is exercised by the smollm2 fixture) to keep the suite fast on 2 cores."""
    if model is not None:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr("eagle3_runner.targets.load.load_target", lambda *a, **k: model)
            return run_extract(spec, out)
    ctx = StageContext(spec=spec, stage="extract", variant="base", run_id="test", inputs={},
                       out_dir=out, db_path=out.parent / "r.duckdb")
    out.mkdir(parents=True, exist_ok=True)
    return ctx, ex.run(ctx)


@pytest.fixture(scope="module")
def extracted(smollm2, smollm2_path, tmp_path_factory):
    from eagle3_runner.runner.assets import asset_path
    from eagle3_runner.runner.errors import FetchError
    try:
        asset_path("sharegpt")
    except FetchError as e:
        pytest.skip(str(e))
    tmp = tmp_path_factory.mktemp("extract")
    spec = make_spec(smollm2_path, tmp)
    ctx, metrics = run_extract(spec, tmp / "clean", smollm2)
    return spec, tmp / "clean", ctx, metrics


def test_forward_features_equal_hf_hidden_states(smollm2):
    """Captured aux = HF hidden_states[k+1] exactly, on the same padded batch."""
    model, tok, _ = smollm2
    conv = [{"role": "user", "content": "Name three primes."},
            {"role": "assistant", "content": "2, 3 and 5."}]
    ids = tok.apply_chat_template(conv, tokenize=True, return_dict=True)["input_ids"]
    batch = [ids, ids[:-7]]
    feats = ex.forward_features(model, batch, AUX, pad_id=tok.pad_token_id)
    att = torch.tensor([[1] * len(ids), [1] * (len(ids) - 7) + [0] * 7])
    x = torch.tensor([ids, ids[:-7] + [tok.pad_token_id] * 7])
    with torch.inference_mode():
        hs = model(input_ids=x, attention_mask=att, output_hidden_states=True).hidden_states
        # pre-norm reference: the same forward with the final norm replaced by identity
        norm = model.model.norm
        model.model.norm = torch.nn.Identity()
        try:
            pre = model(input_ids=x, attention_mask=att, output_hidden_states=True).hidden_states
        finally:
            model.model.norm = norm
    L = model.config.num_hidden_layers
    for i, seq in enumerate(batch):
        T = len(seq)
        aux, last = feats[i]
        assert aux.shape == (T, 3 * model.config.hidden_size)
        ref = torch.cat([hs[k + 1][i, :T] for k in AUX], dim=-1)
        assert torch.equal(aux, ref)
        assert torch.equal(last, pre[L][i, :T])  # pre-norm output of the last layer
        assert torch.equal(norm(last), hs[L][i, :T])  # HF's last element is post-norm
        assert not torch.allclose(last, hs[L][i, :T])
    # the padded sample matches its own unpadded forward up to float noise
    with torch.inference_mode():
        solo = model(input_ids=torch.tensor([batch[1]]), output_hidden_states=True).hidden_states
    torch.testing.assert_close(feats[1][0], torch.cat([solo[k + 1][0] for k in AUX], -1),
                               atol=1e-3, rtol=1e-3)


def test_aux_id_out_of_range_for_real_model(smollm2):
    model = smollm2[0]
    with pytest.raises(StageError, match=r"30 decoder layers.*0\.\.28"):
        check_aux_ids(model, [1, 14, 29])


def test_shard_writer_is_valid_safetensors(tmp_path):
    from safetensors.torch import load_file
    tensors = {"b": torch.randn(7, 3).to(torch.bfloat16), "m": torch.tensor([1, 0, 1], dtype=torch.uint8),
               "a": torch.randn(5, 2), "i": torch.arange(3, dtype=torch.int64),
               "e": torch.zeros(0, 4)}
    sha = ex.write_shard(tmp_path / "x.safetensors", tensors)
    from eagle3_runner.runner.files import sha256_file
    assert sha == sha256_file(tmp_path / "x.safetensors")
    back = load_file(str(tmp_path / "x.safetensors"))
    assert set(back) == set(tensors)
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v)


def test_plan_batches_respects_budget():
    lengths = [5, 100, 30, 100, 7, 64]
    batches = ex.plan_batches(lengths, 200)
    assert sorted(i for b in batches for i in b) == list(range(6))
    assert all(len(b) * max(lengths[i] for i in b) <= 200 or len(b) == 1 for b in batches)
    assert ex.plan_batches([300], 100) == [[0]]


def test_stage_writes_documented_format(extracted, smollm2):
    spec, out, ctx, metrics = extracted
    model, tok, cfg = smollm2
    m = json.loads((out / "features.json").read_text())
    assert m["aux_layer_ids"] == AUX and m["hf_hidden_indices"] == [2, 15, 27]
    assert m["feature_width"] == 3 * 576 and m["dtype"] == "float32"
    assert m["num_samples"] == metrics["samples"] == sum(s["num_samples"] for s in m["shards"])
    assert len(m["shards"]) == metrics["shards"] >= 2
    for s in m["shards"]:
        assert ctx.file_hashes[s["file"]] == s["sha256"]
        from eagle3_runner.runner.files import sha256_file
        assert sha256_file(out / s["file"]) == s["sha256"]
    assert m["data_report"]["records_read"] > 17000
    assert not list(out.glob(".tmp-*")) and not list(out.glob(".*.sha256"))
    feats = open_features(out, spec.aux_ids, spec.feature_width)
    head = feats.head()
    assert torch.equal(head["embed_tokens"], model.model.embed_tokens.weight)
    assert torch.equal(head["lm_head"], model.lm_head.weight)
    assert torch.equal(head["norm"], model.model.norm.weight)
    assert feats.target_config["num_hidden_layers"] == 30
    # batch_tokens = max_length: each sample runs alone, so it must equal a fresh HF forward of
    # that sample exactly (padded batches are checked in test_forward_features_...)
    for i in range(len(feats)):
        s = feats.sample(i)
        assert s.loss_mask.sum() > 0 and s.aux_hidden.shape == (len(s.input_ids), 1728)
        with torch.inference_mode():
            hs = model(input_ids=s.input_ids[None], output_hidden_states=True).hidden_states
        ref = torch.cat([hs[k + 1][0] for k in AUX], -1)
        assert torch.equal(s.aux_hidden, ref)
        assert torch.equal(model.model.norm(s.last_hidden), hs[-1][0])
        n = int(s.loss_mask.sum())
        assert n == int(torch.tensor(list(s.loss_mask)).sum()) and 0 < n < len(s.loss_mask)


def test_mismatched_drafter_is_refused(extracted):
    _, out, _, _ = extracted
    with pytest.raises(StageError, match=r"\[1, 14, 26\].*\[2, 15, 27\]"):
        open_features(out, [2, 15, 27], 1728)
    with pytest.raises(StageError, match=r"1728 wide.*expects 576"):
        open_features(out, AUX, 576)


def kill_at_second_shard(spec, out, smollm2, monkeypatch) -> None:
    """Run the stage into `out`, killed while shard 1 is pending: shard 0 alone is written."""
    real, calls = ex.write_shard, []

    def dies_on_second(path, tensors, ready=None):
        calls.append(path.name)
        if len(calls) == 2:
            raise KeyboardInterrupt  # the job is killed while shard 1 is pending
        return real(path, tensors, ready)

    monkeypatch.setattr(ex, "write_shard", dies_on_second)
    with pytest.raises(KeyboardInterrupt):
        run_extract(spec, out, smollm2)
    monkeypatch.setattr(ex, "write_shard", real)


def test_interrupted_run_resumes_byte_identical(extracted, smollm2, tmp_path, monkeypatch):
    spec, clean, _, _ = extracted
    out = tmp_path / "partial"
    kill_at_second_shard(spec, out, smollm2, monkeypatch)
    assert (out / "shard-00000.safetensors").exists()
    assert not (out / "shard-00001.safetensors").exists() and not (out / "features.json").exists()
    _, metrics = run_extract(spec, out, smollm2)
    assert metrics["resumed_shards"] == 1
    names = sorted(p.name for p in clean.glob("shard-*"))
    assert names == sorted(p.name for p in out.glob("shard-*"))
    for n in names:
        assert (out / n).read_bytes() == (clean / n).read_bytes()


def test_disk_full_leaves_no_partial_shard(extracted, smollm2, tmp_path, monkeypatch):
    spec, clean, _, _ = extracted
    out = tmp_path / "full"
    real, calls = shards._write_chunks, []

    def enospc_on_second(path, chunks):
        calls.append(path.name)
        if len(calls) == 2:
            path.write_bytes(b"".join(bytes(c) for c in chunks[:2]))  # header, 1st tensor; then full
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, chunks)

    monkeypatch.setattr(shards, "_write_chunks", enospc_on_second)
    with pytest.raises(StageError, match="disk full while writing shard-00001"):
        run_extract(spec, out, smollm2)
    assert sorted(p.name for p in out.iterdir()) == [".shard-00000.safetensors.sha256",
                                                      "shard-00000.safetensors"]
    monkeypatch.setattr(shards, "_write_chunks", real)
    _, metrics = run_extract(spec, out, smollm2)
    assert metrics["resumed_shards"] == 1
    for p in clean.glob("shard-*"):
        assert (out / p.name).read_bytes() == p.read_bytes()


@pytest.fixture(scope="module")
def tiny():
    """A tiny random Llama and 6 samples (3 shards of 2): the shard I/O paths in milliseconds."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)).eval()
    g = torch.Generator().manual_seed(0)
    samples = [(torch.randint(1, 97, (n,), generator=g).tolist(), [0] * 8 + [1] * (n - 8))
               for n in (64, 40, 72, 33, 50, 64)]
    return model, samples


def tiny_extract(tiny, out, **kw) -> dict:
    """extract_samples of the tiny model: aux ids [0, 1], 2 samples per shard."""
    out.mkdir(parents=True, exist_ok=True)
    model, samples = tiny
    return ex.extract_samples(model, samples, [0, 1], out, 2, 256, progress=False, **kw)


def test_shards_are_length_sorted_and_samples_keep_dataset_order(tiny, tmp_path):
    """Shards hold the samples longest first (little padding, small last write), with their
    dataset indices; Features serves sample i = the i-th input sample, for the new format and
    for format 1 (no sample_ids, dataset order); a manifest whose ids are not a permutation is
    refused."""
    from eagle3_runner.targets.features import Features, sample_index
    model, samples = tiny
    out = tmp_path / "sorted"
    res = tiny_extract(tiny, out)
    assert [sh["sample_ids"] for sh in res["shards"]] == [[2, 0], [5, 4], [1, 3]]  # 72,64,64,50..
    m = {"shards": res["shards"]}
    feats = Features(out, m)
    for i, (ids, mask) in enumerate(samples):
        got = feats.get(i, ("input_ids", "loss_mask"))
        assert got["input_ids"].tolist() == ids and got["loss_mask"].tolist() == mask
    old = tmp_path / "format1"  # dataset order, no ids
    res1 = tiny_extract(tiny, old, length_sorted=False)
    feats1 = Features(old, {"shards": [{k: v for k, v in sh.items() if k != "sample_ids"}
                                       for sh in res1["shards"]]})
    for i in range(len(samples)):  # other batch mates, other padding: equal up to rounding
        a, b = feats1.get(i), feats.get(i)
        assert torch.equal(a["input_ids"], b["input_ids"])
        torch.testing.assert_close(a["aux_hidden"], b["aux_hidden"], rtol=1e-5, atol=1e-5)
    bad = [dict(sh, sample_ids=[0, 0]) if j == 0 else sh for j, sh in enumerate(res["shards"])]
    with pytest.raises(StageError, match="sample id 0, which is out of 0..5 or listed twice"):
        sample_index(bad)  # the manifest alone (Features checks the shard files first)
    with pytest.raises(StageError, match=r"lists sample ids \[0, 0\], but the shard file"):
        Features(out, {"shards": bad})
    for ids in ([2], [2, "0"], None):  # too short, not an int, not a list
        bad = [dict(sh, sample_ids=ids) if j == 0 else sh for j, sh in enumerate(res["shards"])]
        with pytest.raises(StageError, match="shard shard-00000.safetensors"):
            Features(out, {"shards": bad})
    with pytest.raises(StageError, match="malformed .KeyError: 'num_samples'"):
        Features(out, {"shards": [{"file": "shard-00000.safetensors"}]})
    # ids stripped (read as format 1) or permuted still form a permutation: the shard files'
    # own sample_ids catch both, naming the shard
    stripped = [{k: v for k, v in sh.items() if k != "sample_ids"} for sh in res["shards"]]
    swapped = [dict(sh, sample_ids=sh["sample_ids"][::-1]) for sh in res["shards"]]
    for shards in (stripped, swapped):
        with pytest.raises(StageError, match="shard shard-00000.safetensors lists sample ids "
                                             r".*but the shard file holds \[2, 0\]"):
            Features(out, {"shards": shards})


@pytest.mark.parametrize("damage", ["truncated", "zero-filled"])
def test_damaged_shard_is_rewritten_on_resume(tiny, tmp_path, damage):
    """A shard under its final name whose bytes were lost (e.g. a power loss before the final
    fsync: cut short, or full length with a zero-filled page) is recomputed, not reused. The
    zero-filled page lies inside aux_hidden, where the index tensors (shard_ok) look fine."""
    clean = tmp_path / "clean"
    ref = tiny_extract(tiny, clean)
    out = tmp_path / damage
    out.mkdir()
    name = "shard-00001.safetensors"
    for f in (name, f".{name}.sha256"):  # left by an earlier run, record included
        (out / f).write_bytes((clean / f).read_bytes())
    data = (out / name).read_bytes()
    mid = len(data) // 2
    (out / name).write_bytes(data[:mid] if damage == "truncated"
                             else data[:mid] + bytes(4096) + data[mid + 4096:])
    if damage == "zero-filled":
        S = tiny[1]  # shard 1 = positions 2:4 of the length-sorted order
        ids = sorted(range(len(S)), key=lambda i: (-len(S[i][0]), i))[2:4]
        assert shards.shard_ok(out / name, [S[i] for i in ids], ids, 128)  # only sha256 sees it
    res = tiny_extract(tiny, out)
    assert res["resumed_shards"] == 0 and res["shards"] == ref["shards"]
    for p in clean.glob("shard-*"):
        assert (out / p.name).read_bytes() == p.read_bytes()
    (out / name).unlink()  # an intact shard with its record is reused
    tiny_extract(tiny, out)
    assert tiny_extract(tiny, out)["resumed_shards"] == 3


def test_resume_after_the_manifest_reuses_shards_by_its_hashes(tiny, tmp_path):
    """A retry after features.json was written (its records are then gone, e.g. a crash before
    the runner's rename) reuses the shards whose bytes match the manifest's sha256, and
    recomputes one that does not."""
    out = tmp_path / "m"
    ref = tiny_extract(tiny, out)
    (out / MANIFEST).write_text(json.dumps({"shards": ref["shards"]}))
    for rec in out.glob(".*.sha256"):
        rec.unlink()
    assert tiny_extract(tiny, out)["resumed_shards"] == 3
    for rec in out.glob(".*.sha256"):
        rec.unlink()
    bad = [dict(sh, sha256="0" * 64) if sh["file"] == "shard-00001.safetensors" else sh
           for sh in ref["shards"]]
    (out / MANIFEST).write_text(json.dumps({"shards": bad}))
    res = tiny_extract(tiny, out)
    assert res["resumed_shards"] == 2 and res["shards"] == ref["shards"]


def test_shards_are_fsynced_once_at_the_end(tiny, tmp_path, monkeypatch):
    """No fsync while shards are written; every shard, then the directory, once at the end. A
    deferred write error there drops that shard (StageError) and a re-run recomputes it."""
    clean = tmp_path / "clean"
    tiny_extract(tiny, clean)
    out = tmp_path / "sync"
    real, synced, fail = shards.fsync_path, [], ["shard-00001.safetensors"]

    def record(path):
        synced.append(path.name)
        if path.name in fail:
            fail.remove(path.name)
            raise OSError(errno.EIO, "Input/output error")
        return real(path)

    monkeypatch.setattr(shards, "fsync_path", record)
    with pytest.raises(StageError, match="could not flush shard-00001"):
        tiny_extract(tiny, out)
    assert synced == ["shard-00000.safetensors", "shard-00001.safetensors"]
    assert sorted(p.name for p in out.glob("*shard-00001*")) == []
    synced.clear()
    res = tiny_extract(tiny, out)
    assert res["resumed_shards"] == 2 and res["sync_seconds"] <= res["seconds"]
    names = sorted(p.name for p in clean.glob("shard-*"))
    assert synced == names + [out.name]
    for n in names:
        assert (out / n).read_bytes() == (clean / n).read_bytes()


def test_target_loader_caches_gguf_as_hf_folder(smollm2, smollm2_path, tmp_path):
    from eagle3_runner.targets.load import (converted_dir, end_of_turn_ids, load_tokenizer,
                                            resolve_dtype, target_config)
    from eagle3_runner.runner.spec.sections import Target
    folder = converted_dir(smollm2_path)
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in cfg
    assert json.loads((folder / "source.json").read_text())["sha256"].startswith(folder.name)
    t = Target(path=str(smollm2_path))
    assert target_config(t)["num_hidden_layers"] == 30
    # the end of a turn comes from the model (GGUF header / generation config), not the converted
    # tokenizer's eos_token: transformers 5.17 makes that `<|im_start|>` (issue 43)
    tok = load_tokenizer(t)
    assert [tok.convert_ids_to_tokens(i) for i in end_of_turn_ids(t, tok)] == ["<|im_end|>"]
    model, _, c = smollm2
    assert next(model.parameters()).dtype == torch.float32 and c["hidden_size"] == 576
    assert resolve_dtype("auto", "cuda") == torch.bfloat16
    with pytest.raises(StageError, match="does not exist"):
        target_config(tmp_path / "missing.gguf")


def test_regenerate_then_extract_reads_it(smollm2, tmp_path):
    """Every assistant turn becomes the target's own greedy reply, each turn conditioned on its
    OWN earlier answers (user turns kept); extract consumes the shards."""
    from eagle3_runner.data.regen_store import read_records
    from eagle3_runner.jobs.regenerate import run as regen_run
    from eagle3_runner.runner.spec.load import load_spec
    model, tok, _ = smollm2
    data = tmp_path / "chat.jsonl"
    convs = [[{"from": "human", "value": "What is 2+2?"}, {"from": "gpt", "value": "five"},
              {"from": "human", "value": "And 3+3?"}, {"from": "gpt", "value": "seven"}],
             [{"from": "human", "value": "Name a color."}, {"from": "gpt", "value": "cat"}]]
    data.write_text("".join(json.dumps({"conversations": c}) + "\n{broken\n" for c in convs))
    spec = load_spec(data={
        "name": "r", "work_dir": str(tmp_path / "w"),
        "target": {"path": str(smollm2[0].config.name_or_path or "x"), "device": "cpu",
                   "num_hidden_layers": 30, "hidden_size": 576, "vocab_size": 49152},
        "drafter": {"aux_layer_ids": AUX, "draft_vocab_size": 1024},
        "data": {"source": "jsonl", "path": str(data), "max_length": 128,
                 "max_bad_fraction": 0.5},
        "stages": {"regenerate": {"max_new_tokens": 6, "batch_size": 1},
                   "extract": {"batch_tokens": 512, "shard_samples": 8}}}, check_target=False)
    rdir = tmp_path / "regen"
    rdir.mkdir()
    ctx = StageContext(spec=spec, stage="regenerate", variant="base", run_id="t", inputs={},
                       out_dir=rdir, db_path=tmp_path / "r.duckdb")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("eagle3_runner.targets.load.load_target", lambda *a, **k: smollm2)
        m = regen_run(ctx)
    got = [r["messages"] for r in read_records(rdir)]
    assert m["conversations"] == 2 and m["turns"] == 3 and m["conversations_real"] == 2
    assert [t["content"] for t in got[0] if t["role"] == "user"] == ["What is 2+2?", "And 3+3?"]

    def hf_reply(msgs):
        enc = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt",
                                      return_dict=True)
        with torch.inference_mode():
            ref = model.generate(**enc, max_new_tokens=6, do_sample=False, temperature=None,
                                 top_p=None, top_k=None)[0, enc["input_ids"].shape[1]:]
        return tok.decode(ref, skip_special_tokens=True).strip()
    # each reply is exactly the target's greedy continuation of the conversation so far
    assert got[1][1]["content"] == hf_reply(got[1][:1]) != "cat"
    assert got[0][3]["content"] == hf_reply(got[0][:3]) != "seven"
    ectx = StageContext(spec=spec, stage="extract", variant="base", run_id="t",
                        inputs={"regenerate": rdir}, out_dir=tmp_path / "feat",
                        db_path=tmp_path / "r.duckdb")
    ectx.out_dir.mkdir()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("eagle3_runner.targets.load.load_target", lambda *a, **k: smollm2)
        em = ex.run(ectx)
    assert em["samples"] == 2
    # the drop report of both stages lands in the metrics (dropped/<reason>, bad_fraction)
    from eagle3_runner.runner.store import Store
    st = Store(tmp_path / "r.duckdb")
    rows = {(r[0], r[1]) for r in st.query("SELECT stage, name FROM metrics")[1]}
    assert {("regenerate", "bad_fraction"), ("extract", "bad_fraction"),
            ("regenerate", "dropped/malformed")} <= rows
    feats = open_features(ectx.out_dir, AUX, 1728)
    s = feats.sample(1)
    ids = s.input_ids[s.loss_mask.bool()].tolist()
    assert tok.decode(ids) == got[1][1]["content"] + "<|im_end|>"


def test_regenerate_max_turns_keeps_first_turns(smollm2, smollm2_path, tmp_path):
    """max_turns 1: one regenerated exchange per conversation, later user turns dropped and
    counted (first-turn regeneration is EAGLE-3's cheap variant of the recipe)."""
    from eagle3_runner.models.llama import from_hf_model
    from eagle3_runner.data.regen_store import read_records
    from eagle3_runner.jobs.regenerate import regenerate
    from eagle3_runner.runner.spec.stage_blocks import RegenerateStage
    from eagle3_runner.targets.load import end_of_turn_ids
    model, tok, _ = smollm2
    convs = [[{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "5"},
              {"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": "7"}],
             [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "x"}]]
    p = RegenerateStage(max_new_tokens=4, batch_size=2, max_turns=1)
    m = regenerate(from_hf_model(model), tok, convs, p, 128, tmp_path, progress=False,
                   stop_ids=end_of_turn_ids(smollm2_path, tok))
    out = [r["messages"] for r in read_records(tmp_path)]
    assert [[t["role"] for t in c] for c in out] == [["user", "assistant"]] * 2
    assert [c[0]["content"] for c in out] == ["What is 2+2?", "Name a color."]
    assert m["cut_max_turns"] == 1 and m["turns"] == 2
    with pytest.raises(ValueError, match="max_turns"):
        RegenerateStage(max_turns=0)


def test_regenerate_pads_without_a_pad_token(smollm2, smollm2_path):
    """transformers 5.17 (the H200's) loads the GGUF tokenizer with no pad token; batched
    regeneration must still pad (with EOS, masked out), give each prompt the reply it gets alone,
    and leave the tokenizer as it was."""
    import copy
    from eagle3_runner.jobs.regenerate import generate_batch
    from eagle3_runner.targets.load import end_of_turn_ids
    model, tok, _ = smollm2
    stop = end_of_turn_ids(smollm2_path, tok)
    tok = copy.deepcopy(tok)
    tok.pad_token = None
    prompts = [[{"role": "user", "content": "Hi"}],
               [{"role": "user", "content": "Name three colours of the rainbow, please."}]]
    texts, _ = generate_batch(model, tok, prompts, 4, 0.0, 1.0, stop_ids=stop)
    assert tok.pad_token is None
    assert texts == [generate_batch(model, tok, [p], 4, 0.0, 1.0, stop_ids=stop)[0][0]
                     for p in prompts]

