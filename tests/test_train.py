"""Draft vocab, TTT batching/alignment, the train stage end to end, and resume determinism (CPU)."""

import json
import warnings

import pytest
import torch
from safetensors.torch import load_file

from eagle3_runner.trainer import vocab as V
from eagle3_runner.models.draft_model import DraftConfig, Eagle3Draft
from eagle3_runner.trainer.recipe import lr_lambda, train
from eagle3_runner.trainer.sources import batch_indices
from eagle3_runner.trainer.objective import make_batch, target_dist, ttt_loss
from eagle3_runner.runner.errors import StageError
from train_helpers import tiny_extract, train_ctx, train_spec

torch.set_num_threads(2)


# ---------------------------------------------------------------------------------------------
# draft vocab


def test_vocab_counts_only_supervised_tokens():
    ids = torch.tensor([5, 5, 7, 9, 9, 9])
    mask = torch.tensor([1, 1, 0, 0, 1, 1], dtype=torch.uint8)
    c = V.count_tokens([(ids, mask)], 12)
    assert c[5] == 2 and c[7] == 0 and c[9] == 2 and int(c.sum()) == 4


def test_vocab_counts_in_chunks_equal_the_per_sample_counts(monkeypatch):
    """count_tokens bincounts COUNT_CHUNK tokens at a time: across chunk boundaries (a chunk of
    7 tokens over samples of 1-9) the counts are the per-sample sum, for tensors, lists of ints
    (the online source's) or both; an id out of range in any chunk, negative or too large, is
    refused."""
    monkeypatch.setattr(V, "COUNT_CHUNK", 7)
    g = torch.Generator().manual_seed(0)
    samples = [(torch.randint(0, 50, (t,), generator=g),
                torch.randint(0, 2, (t,), generator=g, dtype=torch.uint8))
               for t in [1, 9, 3, 0, 7, 2, 8, 5]]
    want = sum(torch.bincount(i[m.bool()], minlength=50) for i, m in samples)
    assert torch.equal(V.count_tokens(samples, 50), want)
    lists = [(i.tolist(), m.tolist()) for i, m in samples]  # the online source's samples
    assert torch.equal(V.count_tokens(lists, 50), want)
    assert torch.equal(V.count_tokens([x for pair in zip(samples, lists) for x in pair], 50),
                       2 * want)
    for bad in (50, -1):
        ids = torch.tensor([1, 2, bad])
        with pytest.raises(ValueError, match=f"token id {bad} outside the target vocab"):
            V.count_tokens(samples + [(ids, torch.ones(3, dtype=torch.uint8))], 50)
        with pytest.raises(ValueError, match=f"token id {bad} outside the target vocab"):
            V.count_tokens(lists + [([1, 2, bad], [0, 1, 1])], 50)


def test_vocab_top_k_sorted_ascending_ties_by_lower_id():
    counts = torch.zeros(20, dtype=torch.int64)
    counts[[17, 3, 11, 8]] = torch.tensor([9, 5, 5, 1])  # 3 and 11 tie
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # 4 distinct >= 3: no padding, no warning
        used, st = V.select_vocab(counts, 3)
    assert used.tolist() == [3, 11, 17]
    counts[11] = 5
    counts[2] = 5  # tie between 2, 3, 11 for two places -> lower ids win
    used, _ = V.select_vocab(counts, 3)
    assert used.tolist() == [2, 3, 17]
    assert st["coverage"] == pytest.approx(19 / 20)


def test_vocab_pads_and_warns_naming_both_numbers(capsys):
    """Handed case 8: 1,700 distinct supervised tokens, draft_vocab_size 32000: one stderr line
    naming both numbers and the value to set (no Python warning with its source line)."""
    import warnings
    V_, Vd = 49152, 32000
    g = torch.Generator().manual_seed(0)
    seen = torch.randperm(V_, generator=g)[:1700]
    counts = torch.zeros(V_, dtype=torch.int64)
    counts[seen] = torch.randint(1, 100, (1700,), generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warnings.warn (a two-line message with source)
        used, st = V.select_vocab(counts, Vd)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "1700 distinct" in err[0] and "draft_vocab_size 32000" in err[0]
    assert "drafter.draft_vocab_size: 1700" in err[0]
    assert used.numel() == Vd and st["padded"] == Vd - 1700 and st["distinct_tokens"] == 1700
    assert bool((used[1:] > used[:-1]).all())  # sorted, distinct
    assert set(seen.tolist()) <= set(used.tolist())  # every seen token kept
    d2t, t2d = V.mappings(used, V_)
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    assert int(t2d.sum()) == Vd


def test_vocab_offsets_convention():
    used = torch.tensor([0, 4, 5, 30, 99])
    d2t, t2d = V.mappings(used, 100)
    assert d2t.tolist() == [0, 3, 3, 27, 95]  # d2t[i] = used[i] - i (SGLang offsets)
    assert torch.equal(torch.arange(5) + d2t, used)
    assert torch.equal(V.used_ids(d2t), used)
    assert t2d.nonzero().flatten().tolist() == used.tolist()
    with pytest.raises(ValueError, match="ascending"):
        V.mappings(torch.tensor([3, 1]), 10)


def test_vocab_cache_key_includes_sizes_and_stale_mapping_never_reused(tmp_path):
    k40 = V.cache_key("feat", range(4), 40, 96)
    assert k40 != V.cache_key("feat", range(4), 30, 96)
    assert k40 != V.cache_key("feat", range(4), 40, 97)
    assert k40 != V.cache_key("feat2", range(4), 40, 96)
    assert k40 != V.cache_key("feat", range(3), 40, 96)
    samples = [(torch.arange(3, 60), torch.ones(57, dtype=torch.uint8))]
    d40, t40, _ = V.build_or_load(tmp_path, k40, lambda: samples, 40, 96)
    k30 = V.cache_key("feat", range(4), 30, 96)
    d30, t30, _ = V.build_or_load(tmp_path, k30, lambda: samples, 30, 96)
    assert d40.numel() == 40 and d30.numel() == 30 and int(t30.sum()) == 30
    # even a file of another size under the same name (a collision or a hand copy) is rebuilt
    (tmp_path / f"vocab-{k30}.pt").write_bytes((tmp_path / f"vocab-{k40}.pt").read_bytes())
    d, t, _ = V.build_or_load(tmp_path, k30, lambda: samples, 30, 96)
    assert d.numel() == 30 and int(t.sum()) == 30
    # a hit does not recount
    d, _, _ = V.build_or_load(tmp_path, k30, lambda: pytest.fail("recounted"), 30, 96)
    assert d.numel() == 30


# ---------------------------------------------------------------------------------------------
# TTT batching, target distribution, shapes


def _sample(T, Ht=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.arange(10, 10 + T), "loss_mask": torch.tensor([0, 0] + [1] * (T - 2),
                                                                              dtype=torch.uint8),
            "aux_hidden": torch.randn(T, 3 * Ht, generator=g),
            "last_hidden": torch.arange(T).float()[:, None].expand(T, Ht).clone()}


def test_make_batch_alignment():
    """Position i, step j: token i+1+j in, target logits at i+1+j, predicted token i+2+j."""
    K = 3
    b = make_batch([_sample(6), _sample(4, seed=1)], K)
    N = 5
    assert b["aux"].shape == (2, N, 12) and b["ids"].shape == (2, N + K - 1)
    assert b["ids"][0].tolist() == [11, 12, 13, 14, 15, 0, 0]  # ids[r] = token r+1
    assert b["tgt_hidden"][0, :, 0].tolist() == [1, 2, 3, 4, 5, 0, 0]  # last_hidden at r+1
    # pmask[r] = loss_mask[r+2]: sample 0 mask [0,0,1,1,1,1] -> rows 0..3 True, row 4 (token 6) no
    assert b["pmask"][0].tolist() == [True, True, True, True, False, False, False]
    assert b["pmask"][1].tolist() == [True, True, False, False, False, False, False]  # padded
    assert torch.equal(b["aux"][1, 3:], torch.zeros(2, 12))
    assert b["tokens"] == 10


def test_target_dist_matches_the_target_model(tmp_path):
    """lm_head(norm(last_hidden)) from the extract artifact == the HF target's own logits."""
    from engine_helpers import tiny_hf_llama
    from eagle3_runner.targets.features import open_features
    root = tiny_extract(tmp_path / "x", n_samples=2)
    feats = open_features(root, [0, 1, 2], 96)
    s = feats.get(1)
    model = tiny_hf_llama(vocab=96, hidden=32, layers=4, heads=4, kv=2, seed=0)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # as tiny_extract does
    with torch.no_grad():
        ref = model(s["input_ids"][None]).logits.float()  # [1, T, V]
    used = torch.tensor([1, 5, 9, 20, 50, 95])
    t2d = torch.zeros(96, dtype=torch.bool)
    t2d[used] = True
    p, tid, inv, _ = target_dist(s["last_hidden"][None], feats.head(), used, t2d,
                                 feats.target_config["rms_norm_eps"], chunk_elems=96 * 5)
    assert torch.equal(tid, ref.argmax(-1))
    assert torch.allclose(p, torch.softmax(ref[..., used], -1), atol=1e-5)
    assert torch.equal(inv, t2d[tid])


def _tiny_draft(V_=96, Vd=40, H=32, seed=0):
    c = DraftConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                    intermediate_size=64, vocab_size=V_, draft_vocab_size=Vd, target_hidden_size=H,
                    aux_layer_ids=[0, 1, 2])
    torch.manual_seed(seed)
    m = Eagle3Draft(c, torch.randn(V_, H))
    used = torch.arange(0, 2 * Vd, 2)
    m.d2t.copy_(used - torch.arange(Vd))
    m.t2d[used] = True
    return m, used


def test_ttt_loss_shapes_and_gradients():
    m, used = _tiny_draft()
    K, H = 4, 32
    samples = [{"input_ids": torch.randint(0, 96, (T,)), "loss_mask": torch.ones(T, dtype=torch.uint8),
                "aux_hidden": torch.randn(T, 3 * H), "last_hidden": torch.randn(T, H)}
               for T in (9, 13)]
    b = make_batch(samples, K)
    head = {"norm": torch.ones(H), "lm_head": torch.randn(96, H)}
    tgt = target_dist(b["tgt_hidden"], head, used, m.t2d, 1e-5)
    assert tgt[0].shape == (2, 12 + K - 1, 40)
    loss, st = ttt_loss(m, b, tgt, K, 0.8)
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert all(st[k].shape == (K,) for k in ("loss", "correct", "count"))
    assert st["hit"].shape == (K, 2, 12) and st["sup0"].shape == (2, 12)
    assert st["hit"].sum((1, 2)).double().tolist() == st["correct"].tolist()
    # step j has 12-1-j supervised rows in sample 1 (T=13) and 8-1-j in sample 0 (T=9)
    assert st["count"].tolist() == [(11 - j) + (7 - j) for j in range(K)]
    w = sum(0.8 ** j * st["loss"][j] for j in range(K))
    assert float(loss) == pytest.approx(float(w), rel=1e-5)
    loss.backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert m.embed_tokens.requires_grad is False


def test_lr_schedule_and_data_order():
    assert lr_lambda(0, 4, 20) == pytest.approx(0.2)
    assert lr_lambda(4, 4, 20) == pytest.approx(1.0)
    assert lr_lambda(20, 4, 20) == pytest.approx(0.0)
    seen = sorted(i for s in range(3) for i in batch_indices(s, 7, 3, seed=1))
    assert seen == list(range(7))  # one epoch covers every sample once


# ---------------------------------------------------------------------------------------------
# the stage


@pytest.fixture(scope="module")
def extract_dir(tmp_path_factory):
    return tiny_extract(tmp_path_factory.mktemp("extract") / "x", n_samples=8)


def test_train_stage_outputs(extract_dir, tmp_path):
    spec = train_spec(max_steps=4, eval_every=2)
    ctx = train_ctx(spec, extract_dir, tmp_path / "out", tmp_path / "r.duckdb")
    summary = train(ctx)
    out = tmp_path / "out"
    sd = load_file(str(out / "draft.safetensors"))
    cfg = DraftConfig(**json.loads((out / "draft_config.json").read_text()))
    ref = Eagle3Draft(cfg).state_dict()
    assert set(sd) == set(ref)  # exactly: fc, midlayer.*, norm, lm_head, d2t, t2d
    assert not any(k.startswith(("layers.", "model.", "draft_model.", "embed")) for k in sd)
    assert all(sd[k].shape == ref[k].shape for k in sd)
    assert sd["d2t"].dtype == torch.int64 and sd["t2d"].dtype == torch.bool
    used = sd["d2t"] + torch.arange(40)
    assert bool((used[1:] > used[:-1]).all()) and int(used.max()) < 96
    assert torch.equal(sd["t2d"].nonzero().flatten(), used)
    assert cfg.draft_vocab_size == 40 and cfg.aux_layer_ids == [0, 1, 2] and cfg.vocab_size == 96
    m = json.loads((out / "train_metrics.json").read_text())
    assert m["eval_split"] == "eval" and [h["step"] for h in m["history"]] == [2, 4]
    assert not (out / "ckpt.pt").exists()
    assert summary["train_steps"][0] == 4 and len([k for k in summary if k.startswith("acc_")]) == 3
    assert summary["tokens_per_s"][0] > 0 and summary["peak_mem_mib"][0] > 0
    assert "steady_tokens_per_s" not in summary  # no host read past SYNC_EVERY: absent, not 0
    # per-step eval metrics reach DuckDB
    cols, rows = ctx.store.query("SELECT name, step FROM metrics WHERE name LIKE 'eval_acc_%' "
                                 "ORDER BY step, name")
    assert rows == [(f"eval_acc_{j}", s) for s in (2, 4) for j in range(3)]


@pytest.fixture(scope="module")
def extract_norm_dir(tmp_path_factory):
    """A tiny extract whose target's final norm is not all ones (an HF init's), so that copying
    it is visible."""
    def edit(model):
        g = torch.Generator().manual_seed(3)
        model.model.norm.weight.copy_(0.5 + torch.rand(model.model.norm.weight.shape, generator=g))
    return tiny_extract(tmp_path_factory.mktemp("extract_norm") / "x", n_samples=8, edit=edit)


def test_init_head_target_copies_the_targets_draft_vocab_rows_and_norm(extract_norm_dir, tmp_path):
    """init_head: target = vLLM speculators' init: the drafter's lm_head row i is
    the target's lm_head row of target id i + d2t[i], its norm the target's final norm, at step
    0; init_head: random (the default) leaves nn.Linear's init and a unit norm. Both consume the same RNG
    draws, and each has its own fingerprint (a checkpoint of one never resumes the other)."""
    from eagle3_runner.trainer.recipe import setup
    runs = {}
    for init in ("target", "random"):
        ctx = train_ctx(train_spec(init_head=init), extract_norm_dir, tmp_path / init,
                        tmp_path / "r.duckdb")
        runs[init] = setup(ctx, impl=None)
    assert train_spec().stages.train.init_head == "random"
    head = runs["target"].source.head()
    assert not torch.allclose(head["norm"], torch.ones_like(head["norm"]))
    for init, run in runs.items():
        m = run.learner.model
        used = V.used_ids(m.d2t)
        assert torch.equal(used, m.t2d.nonzero().flatten())
        rows = head["lm_head"][used].float()
        assert m.lm_head.weight.dtype == m.norm.weight.dtype == torch.float32
        if init == "target":
            assert torch.equal(m.lm_head.weight, rows)
            assert torch.equal(m.norm.weight, head["norm"].float())
            assert m.lm_head.weight.data_ptr() != head["lm_head"].data_ptr()  # a copy
        else:
            assert not torch.allclose(m.lm_head.weight, rows)
            assert torch.equal(m.norm.weight, torch.ones_like(m.norm.weight))
    t, r = runs["target"].learner.model, runs["random"].learner.model
    assert torch.equal(t.fc.weight, r.fc.weight)  # same seed, same draws: only the head differs
    assert runs["target"].fp != runs["random"].fp


def test_training_reduces_loss(extract_dir, tmp_path):
    spec = train_spec(max_steps=30, eval_every=10, eval_samples=0, num_samples=2, lr=1e-2,
                      warmup_steps=2, epochs=100.0)
    train(train_ctx(spec, extract_dir, tmp_path / "o", tmp_path / "r.duckdb"))
    h = json.loads((tmp_path / "o" / "train_metrics.json").read_text())["history"]
    assert h[0]["split"] == "trainset"
    assert h[-1]["loss"] < 0.85 * h[0]["loss"], [x["loss"] for x in h]
    assert h[-1]["acc_step"][0] >= h[0]["acc_step"][0]


def test_resume_is_bit_exact(extract_dir, tmp_path):
    """Killed after step 3 (last checkpoint at step 2), re-run: same weights and eval history as
    an uninterrupted run with the same seed."""
    spec = train_spec(max_steps=6, eval_every=2, checkpoint_every=2)
    a = train_ctx(spec, extract_dir, tmp_path / "a", tmp_path / "r.duckdb")
    b = train_ctx(spec, extract_dir, tmp_path / "b", tmp_path / "r.duckdb")
    first = train(a)
    mtime = (tmp_path / "a" / "draft.safetensors").stat().st_mtime_ns
    again = train(a)  # finished but not finalized by the runner: not retrained
    assert again == first and (tmp_path / "a" / "draft.safetensors").stat().st_mtime_ns == mtime
    assert train(b, stop_at=3) is None
    ck = torch.load(tmp_path / "b" / "ckpt.pt", weights_only=False)
    assert ck["step"] == 2
    train(b)
    sa, sb = (load_file(str(tmp_path / d / "draft.safetensors")) for d in "ab")
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    ha, hb = (json.loads((tmp_path / d / "train_metrics.json").read_text())["history"] for d in "ab")
    assert ha == hb
    # and a different seed gives different weights (the comparison can fail)
    c = train_ctx(train_spec(max_steps=6, seed=1), extract_dir, tmp_path / "c", tmp_path / "r.duckdb")
    train(c)
    sc = load_file(str(tmp_path / "c" / "draft.safetensors"))
    assert not torch.equal(sa["fc.weight"], sc["fc.weight"])


def test_checkpoints_by_time_as_well_as_steps(extract_dir, tmp_path):
    """stages.train.checkpoint_minutes: with checkpoint_every far away, a run killed after step 3
    still left a checkpoint (here every step is past a tiny time limit), and the resumed run
    ends with the uninterrupted run's weights. The limit is not part of the run's fingerprint:
    another value keeps the checkpoint. With null, only steps count (nothing saved)."""
    db = tmp_path / "r.duckdb"
    spec = train_spec(max_steps=5, eval_every=50, checkpoint_every=1000, checkpoint_minutes=1e-9)
    b = train_ctx(spec, extract_dir, tmp_path / "b", db)
    assert train(b, stop_at=3) is None
    assert torch.load(tmp_path / "b" / "ckpt.pt", weights_only=False)["step"] == 3
    later = train_spec(max_steps=5, eval_every=50, checkpoint_every=1000, checkpoint_minutes=60)
    train(train_ctx(later, extract_dir, tmp_path / "b", db))
    train(train_ctx(later, extract_dir, tmp_path / "a", db))  # uninterrupted
    sa, sb = (load_file(str(tmp_path / d / "draft.safetensors")) for d in "ab")
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    steps_only = train_spec(max_steps=5, eval_every=50, checkpoint_every=1000,
                            checkpoint_minutes=None)
    assert train(train_ctx(steps_only, extract_dir, tmp_path / "c", db), stop_at=3) is None
    assert not (tmp_path / "c" / "ckpt.pt").exists()


def test_refusals(extract_dir, tmp_path):
    db = tmp_path / "r.duckdb"
    with pytest.raises(StageError, match="aux layer ids"):  # features captured at [0, 1, 2]
        train(train_ctx(train_spec(layers=5, aux_ids=(1, 2, 3)), extract_dir, tmp_path / "o1", db))
    with pytest.raises(StageError, match="eval_samples"):
        train(train_ctx(train_spec(eval_samples=8), extract_dir, tmp_path / "o2", db))
    zero = tiny_extract(tmp_path / "z", n_samples=3, lengths=(2, 2))  # T=2: mask [0, 1]...
    # ...make every mask zero by hand
    from safetensors.torch import load_file as lf, save_file
    for f in zero.glob("shard-*.safetensors"):
        t = lf(str(f))
        t["loss_mask"].zero_()
        save_file(t, str(f))
    with pytest.raises(StageError, match="all zero"):
        train(train_ctx(train_spec(eval_samples=0), zero, tmp_path / "o3", db))


def test_non_finite_loss_fails_naming_the_step_and_its_samples(tmp_path):
    """One sample's features poisoned with inf: the stage stops at the first step whose batch
    holds it, names the step and the batch's sample ids, and leaves no checkpoint behind."""
    from safetensors.torch import save_file
    from eagle3_runner.targets.features import open_features
    from eagle3_runner.trainer.sources import batch_indices, split_samples
    ex = tiny_extract(tmp_path / "x", n_samples=6, shard_samples=6)
    spec = train_spec(max_steps=100, eval_every=50, checkpoint_every=100)
    train_ids, _ = split_samples(len(open_features(ex)), spec.stages.train)
    bad = train_ids[1]  # a training sample (the held-out ones are a seeded draw)
    f = next(ex.glob("shard-*.safetensors"))
    t = load_file(str(f))
    j = t["sample_ids"].tolist().index(bad)
    t["aux_hidden"][t["offsets"][j]:t["offsets"][j + 1]] = float("inf")
    save_file(t, str(f))
    n_train = len(train_ids)
    step = next(s for s in range(100) if 1 in batch_indices(s, n_train, 2, 0))
    ids = [train_ids[i] for i in batch_indices(step, n_train, 2, 0)]
    spec = train_spec(max_steps=step + 3, eval_every=50, checkpoint_every=step + 1)
    with pytest.raises(StageError, match=rf"non-finite loss at step {step + 1} .*samples "
                                         rf"\[{ids[0]}, {ids[1]}\]"):
        train(train_ctx(spec, ex, tmp_path / "o", tmp_path / "r.duckdb"))
    assert not (tmp_path / "o" / "ckpt.pt").exists()


def test_time_budget_shrinks_the_run_and_counts_the_samples_trained_on(extract_dir, tmp_path):
    """stages.train.max_minutes: after the first 64 steps the step time is measured and the run
    stops where the budget ends (a budget of ~0 s: right there), the schedule and the summary
    follow; train_samples counts the samples trained on, not the whole set."""
    spec = train_spec(epochs=100.0, batch_size=1, eval_every=1000, checkpoint_every=1000,
                      max_minutes=1e-6)
    summary = train(train_ctx(spec, extract_dir, tmp_path / "a", tmp_path / "r.duckdb"))
    steps = summary["train_steps"][0]
    assert 2 * 32 <= steps < 100 * 4  # stopped at the budget, far before 100 epochs
    assert summary["steady_tokens_per_s"][0] > 0  # the steps after the first host read
    whole = train(train_ctx(train_spec(epochs=1.0, batch_size=1), extract_dir, tmp_path / "b",
                            tmp_path / "r.duckdb"))["train_samples"][0]  # one epoch: all of them
    assert summary["train_samples"][0] == min(whole, steps) and whole > 3
    cut = train(train_ctx(train_spec(max_steps=3, batch_size=1), extract_dir, tmp_path / "c",
                          tmp_path / "r.duckdb"))
    assert cut["train_steps"][0] == 3 and cut["train_samples"][0] == 3
