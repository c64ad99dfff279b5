"""stages.train.features: online on the CPU: a tiny random Llama target saved as an HF folder
(with SmolLM2's tokenizer), a few conversations. Online training gives the losses and weights of
offline training (extract, then train) on the same data and seed; it resumes exactly after a
kill; it writes no features; export reads its capture manifest; `runner plan` has no extract
stage for it; two ranks train what one does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagle3_runner.trainer.recipe import train
from eagle3_runner.runner.errors import SpecError, StageError
from eagle3_runner.runner.spec.load import load_spec
from eagle3_runner.runner.stage import StageContext

TRAIN = dict(ttt_steps=3, batch_size=2, lr=3e-3, warmup_steps=1, eval_every=1, eval_samples=2,
             checkpoint_every=2, max_steps=4, epochs=4.0, seed=0)
WORDS = ("the cat sat on a mat while dogs ran far away from home at night under bright stars "
         "and quiet hills near old rivers with green trees").split()


@pytest.fixture(scope="module", autouse=True)
def _threads():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def target(tmp_path_factory, smollm2_tokenizer):
    """(HF folder of a random 4-layer Llama with SmolLM2's vocab, conversations JSONL). Only
    the lm_head rows of the answers' tokens are non-zero, so the target's argmax usually lies
    in the draft vocab (trained positions exist)."""
    from engine_helpers import tiny_hf_llama
    d, tok = tmp_path_factory.mktemp("online"), smollm2_tokenizer
    model = tiny_hf_llama(vocab=len(tok), hidden=32, layers=4, heads=4, kv=2)
    answers, seen = [], set()
    with open(d / "convs.jsonl", "w") as f:
        for i in range(8):
            q = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(3 + i))
            a = " ".join(WORDS[(3 * i + j) % len(WORDS)] for j in range(6 + 2 * i))
            seen.update(tok(a)["input_ids"])
            f.write(json.dumps({"messages": [{"role": "user", "content": q},
                                             {"role": "assistant", "content": a}]}) + "\n")
    keep = torch.zeros(len(tok), dtype=torch.bool)
    keep[sorted(seen)] = True
    with torch.no_grad():
        model.lm_head.weight[~keep] = 0
    model.save_pretrained(d / "target")
    tok.save_pretrained(d / "target")
    return d / "target", d / "convs.jsonl"


def make_spec(target, features="online", stages=None, device_map=None, **train):
    folder, data = target
    st = stages or ({"train": {**TRAIN, **train, "features": features}} if features == "online"
                    else {"extract": {"batch_tokens": 256}, "train": {**TRAIN, **train}})
    split = {"device_map": device_map} if device_map else {}
    return load_spec(data={
        "name": "online", "target": {"path": str(folder), "device": "cpu", "dtype": "float32",
                                     "chat_template": "chatml", **split},
        "drafter": {"aux_layer_ids": [0, 1, 2], "draft_vocab_size": 32},
        "data": {"source": "jsonl", "path": str(data), "max_length": 64, "holdout": 0},
        "stages": st})


def ctx_for(spec, stage, out: Path, inputs=None, rank=0, world=1) -> StageContext:
    out.mkdir(parents=True, exist_ok=True)
    return StageContext(spec=spec, stage=stage, variant="base", run_id=out.name,
                        inputs=inputs or {}, out_dir=out, db_path=out.parent / f"{out.name}.duckdb",
                        rank=rank, world_size=world)


def train_losses(ctx) -> list[float]:
    return [r[0] for r in ctx.store.query("SELECT value FROM metrics WHERE name = 'train_loss' "
                                          "ORDER BY step")[1]]


@pytest.fixture(scope="module")
def offline(target, tmp_path_factory):
    import eagle3_runner.jobs.extract as ex
    tmp = tmp_path_factory.mktemp("offline")
    spec = make_spec(target, "offline")
    ex.run(ctx_for(spec, "extract", tmp / "extract"))
    ctx = ctx_for(spec, "train", tmp / "train", {"extract": tmp / "extract"})
    train(ctx)
    return ctx


@pytest.fixture(scope="module")
def online(target, tmp_path_factory):
    ctx = ctx_for(make_spec(target), "train", tmp_path_factory.mktemp("on") / "train")
    train(ctx)
    return ctx


def _history(ctx):
    return json.loads((Path(ctx.out_dir) / "train_metrics.json").read_text())["history"]


def test_online_equals_offline(offline, online):
    """Same data, seed and steps: the same train and held-out losses, the same drafter."""
    a, b = train_losses(offline), train_losses(online)
    assert len(a) == len(b) == TRAIN["max_steps"] and a[0] > 1.0
    assert b == pytest.approx(a, rel=1e-4)
    ha, hb = _history(offline), _history(online)
    assert [h["split"] for h in hb] == ["eval"] * 4
    for x, y in zip(ha, hb):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-4)
        assert y["acc_step"] == pytest.approx(x["acc_step"], abs=1e-6)
    wa, wb = (load_file(str(Path(c.out_dir) / "draft.safetensors")) for c in (offline, online))
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=1e-5, rtol=1e-4, msg=k)
    assert not torch.equal(wa["fc.weight"], torch.zeros_like(wa["fc.weight"]))


def test_online_writes_no_features_and_export_reads_its_manifest(online, target, tmp_path):
    from eagle3_runner.jobs.export import run as export
    from eagle3_runner.targets.features import ONLINE_FORMAT
    out = Path(online.out_dir)
    m = json.loads((out / "features.json").read_text())
    assert m["format"] == ONLINE_FORMAT and m["aux_layer_ids"] == [0, 1, 2]
    assert m["hf_hidden_indices"] == [1, 2, 3] and m["shards"] == [] and m["num_samples"] == 8
    assert (out / "target_config.json").exists()
    assert not list(out.rglob("*shard*")) and not (out / "target_head.safetensors").exists()
    spec = make_spec(target, stages={"train": {**TRAIN, "features": "online"}, "export": {}})
    export(ctx_for(spec, "export", tmp_path / "export", {"train": out}))
    cfg = json.loads((tmp_path / "export" / "config.json").read_text())
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    prov = json.loads((tmp_path / "export" / "provenance.json").read_text())
    assert set(prov["artifacts"]) == {"train"} and prov["features"]["num_samples"] == 8


def test_online_resume_gives_the_uninterrupted_run(online, target, tmp_path):
    """Killed after step 3 (checkpoint at step 2), re-run: the same batches, hence the same
    weights and evaluations as the uninterrupted online run."""
    ctx = ctx_for(make_spec(target), "train", tmp_path / "train")
    assert train(ctx, stop_at=3) is None
    assert torch.load(tmp_path / "train" / "ckpt.pt", weights_only=False)["step"] == 2
    train(ctx)
    wa, wb = (load_file(str(Path(c.out_dir) / "draft.safetensors")) for c in (online, ctx))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert _history(ctx) == _history(online)


def test_plan_has_no_extract_stage_and_the_key_covers_the_data(target, tmp_path):
    from eagle3_runner.runner.plan import build_plan
    from eagle3_runner.runner.stages import stage_needs, stage_slice
    spec = make_spec(target, stages={"train": {**TRAIN, "features": "online"}, "export": {},
                                     "regenerate": {}})
    spec = load_spec(data={**spec.model_dump(mode="json", exclude_none=True),
                           "work_dir": str(tmp_path / "w")})
    plan = build_plan(spec)
    assert [s.stage for s in plan.stages] == ["regenerate", "train", "export"]
    assert stage_needs(spec, "train") == ("regenerate",)
    assert stage_needs(spec, "export") == ("train",)
    tr = next(s for s in plan.stages if s.stage == "train")
    assert set(tr.parts["inputs"]["files"]) == {"target", "data"}
    assert stage_slice(spec, "train")["data"]["path"] == spec.data.path
    other = load_spec(data={**spec.model_dump(mode="json", exclude_none=True),
                            "data": {**spec.data.model_dump(mode="json"), "max_length": 32}})
    assert next(s for s in build_plan(other).stages if s.stage == "train").key != tr.key
    with pytest.raises(SpecError, match="stages.extract: set, but stages.train.features"):
        make_spec(target, stages={"extract": {}, "train": {**TRAIN, "features": "online"}})


def test_offline_without_extract_is_refused(target, tmp_path):
    """Offline without stages.extract fails at validation; a context without the extract input
    (not one the executor builds) fails in the stage, naming features: online."""
    with pytest.raises(SpecError, match="stages.extract is not set"):
        make_spec(target, stages={"train": TRAIN})
    spec = make_spec(target, stages={"extract": {}, "train": TRAIN})
    with pytest.raises(StageError, match="features: online"):
        train(ctx_for(spec, "train", tmp_path / "t"))


def _rank(rank, world, spec_json, out):
    from eagle3_runner.runner.spec.schema import Spec
    ctx = ctx_for(Spec.model_validate_json(spec_json), "train", Path(out), rank=rank, world=world)
    train(ctx)


def test_two_online_ranks_train_what_one_does(online, target, tmp_path):
    """Each rank its own target copy and half of each global batch: one rank's drafter."""
    from test_distributed import spawn
    spawn(_rank, 2, make_spec(target).model_dump_json(), str(tmp_path / "t2"))
    wa, wb = (load_file(str(p / "draft.safetensors")) for p in (Path(online.out_dir),
                                                                 tmp_path / "t2"))
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=2e-5, rtol=1e-4, msg=k)


SPLIT = {"0-1": "cpu", "2-3": "disk"}  # accelerate offloads layers 2-3 (and the head) to disk


def test_split_target_extracts_and_trains_online_as_one_device_does(offline, online, target,
                                                                    tmp_path, monkeypatch):
    """target.device_map through the stages (targets/capture.py load_target_data): the extract
    stage writes the one-device run's shards, online training gives its losses."""
    import eagle3_runner.jobs.extract as ex
    import eagle3_runner.targets.load as T
    from safetensors.torch import load_file as load
    maps, real = [], T.load_target

    def spy(*a, **kw):
        model, tok, cfg = real(*a, **kw)
        maps.append(getattr(model, "hf_device_map", None))
        return model, tok, cfg
    monkeypatch.setattr(T, "load_target", spy)
    spec = make_spec(target, "offline", device_map=SPLIT)
    ex.run(ctx_for(spec, "extract", tmp_path / "extract"))
    ref = Path(offline.inputs["extract"])
    shards = sorted(p.name for p in ref.glob("shard-*.safetensors"))
    assert shards and shards == sorted(p.name for p in (tmp_path / "extract").glob("shard-*"))
    for name in shards:
        a, b = load(str(ref / name)), load(str(tmp_path / "extract" / name))
        assert all(torch.equal(a[k], b[k]) for k in a), name
    ctx = ctx_for(make_spec(target, device_map=SPLIT), "train", tmp_path / "train")
    train(ctx)
    assert train_losses(ctx) == pytest.approx(train_losses(online), rel=1e-6)
    assert len(maps) == 2 and all(m["model.layers.3"] == m["lm_head"] == "disk" for m in maps)


def test_length_groups_cut_padding_and_keep_every_sample():
    """The online capture's groups: every sample exactly once, contiguous in length order, no
    more padded tokens (+ the per-group cost) than one batch, and a split when lengths differ."""
    from eagle3_runner.trainer.sources import length_groups

    def cost(L, groups, c):
        return sum(len(g) * max(L[i] for i in g) + c for g in groups)

    for L in ([300] * 8, [1000, 990, 40, 35, 30, 20, 20, 10], [5], list(range(1, 65))):
        g = length_groups(L, 64)
        assert sorted(i for x in g for i in x) == list(range(len(L)))
        flat = [L[i] for x in g for i in x]
        assert flat == sorted(L, reverse=True)  # contiguous runs of the sorted batch
        assert cost(L, g, 64) <= cost(L, [list(range(len(L)))], 64)
    assert len(length_groups([300] * 8, 64)) == 1  # equal lengths: one forward
    assert [len(x) for x in length_groups([1000, 990, 40, 35, 30, 20, 20, 10], 64)] == [2, 6]


def test_embedded_capture_and_prefetch_train_what_hf_does(online, target, tmp_path):
    """stages.train.online_capture: embedded (the batch packed into one row on our Llama) and
    prefetch (the next batch captured one step ahead): the hf run's losses and drafter; prefetch
    alone changes nothing at all."""
    ctx = ctx_for(make_spec(target, prefetch=True), "train", tmp_path / "prefetch")
    train(ctx)
    assert train_losses(ctx) == train_losses(online) and _history(ctx) == _history(online)
    ctx = ctx_for(make_spec(target, online_capture="embedded", prefetch=True), "train",
                  tmp_path / "embedded")
    train(ctx)
    assert train_losses(ctx) == pytest.approx(train_losses(online), rel=1e-5)
    wa, wb = (load_file(str(Path(c.out_dir) / "draft.safetensors")) for c in (online, ctx))
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=1e-5, rtol=1e-4, msg=k)
    with pytest.raises(SpecError, match="stages.train.online_capture: set, but it applies to "
                                        "features: online only"):
        make_spec(target, "offline", online_capture="embedded")


def test_prefetch_serves_each_batch_once_and_in_order():
    """Prefetch.batch(ids, next): the source computes `next` right away (on the CPU: no side
    stream) and the next call with those ids takes it; other ids are computed afresh."""
    from eagle3_runner.trainer.sources import Prefetch

    class Counting:  # a source: batch(ids) -> samples (the interface, recorded)
        def __init__(self):
            self.calls = []

        def batch(self, ids):
            self.calls.append(list(ids))
            return [{"id": i} for i in ids]

    src = Counting()
    feed = Prefetch(src, "cpu")
    assert feed.batch([0, 1], [2, 3]) == [{"id": 0}, {"id": 1}]
    assert feed.batch([2, 3], [4]) == [{"id": 2}, {"id": 3}]
    assert feed.batch([5]) == [{"id": 5}]  # not the prefetched [4]
    assert src.calls == [[0, 1], [2, 3], [4], [5]]
    assert feed.batch([4]) == [{"id": 4}] and src.calls[-1] == [4] and feed.ahead is None
