"""The fast TTT step (trainer/fast_step.py) against the reference (trainer/objective.py make_batch +
target_dist + ttt_loss) on the same samples, float32 on the CPU: loss, every parameter's gradient and the
per-step statistics must agree, packed or not, for every stages.train.loss and with the EAGLE 3.1
options (drafter.fc_norm, drafter.norm_output). This is what protects the trained drafters."""

import pytest
import torch

from eagle3_runner.trainer import objective as TR
from eagle3_runner.trainer import fast_step as FT
from eagle3_runner.models.draft_model import DraftConfig, Eagle3Draft
from eagle3_runner.kernels import _triton
from eagle3_runner.kernels.ttt_attention import Segments

torch.set_num_threads(2)
V, VD, H, K = 30, 12, 32, 3
LENGTHS = (9, 14, 5, 2, 17)


def _setup(seed=0, **cfg):
    g = torch.Generator().manual_seed(seed)
    c = DraftConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    intermediate_size=48, vocab_size=V, draft_vocab_size=VD,
                    target_hidden_size=H, aux_layer_ids=[0, 1, 2], **cfg)
    torch.manual_seed(seed)
    m = Eagle3Draft(c, torch.randn(V, H, generator=g))
    with torch.no_grad():
        for p in m.parameters():  # non-trivial norms, so a norm mix-up shows
            if p.dim() == 1:
                p.add_(torch.rand(p.shape, generator=g) - 0.5)
    used = torch.randperm(V, generator=g)[:VD].sort().values
    m.d2t.copy_(used - torch.arange(VD))
    m.t2d[used] = True
    head = {"norm": torch.rand(H, generator=g) + 0.5, "lm_head": torch.randn(V, H, generator=g)}
    samples = [{"input_ids": torch.randint(0, V, (L,), generator=g),
                "loss_mask": (torch.rand(L, generator=g) > 0.25).to(torch.uint8),
                "aux_hidden": torch.randn(L, 3 * H, generator=g),
                "last_hidden": torch.randn(L, H, generator=g)} for L in LENGTHS]
    return m, used, head, samples


def _reference(m, used, head, samples, loss=TR.Loss()):
    b = TR.make_batch(samples, K)
    tgt = TR.target_dist(b["tgt_hidden"], head, used, m.t2d, 1e-5)
    total, st = TR.ttt_loss(m, b, tgt, K, 0.8, loss=loss)
    return total, st, torch.autograd.grad(total, list(m.parameters()))


def _fast(m, used, head, samples, impl=FT.Impl(), loss=TR.Loss(), **kw):
    b, tgt = FT.prepare(samples, K, FT.split_head(head, used), 1e-5, "cpu", **kw)
    total, st = FT.fast_ttt_loss(m, b, tgt, K, 0.8, impl=impl, loss=loss)
    return total, st, torch.autograd.grad(total, list(m.parameters())), b


def _assert_same(ref, fast, names):
    (l0, s0, g0), (l1, s1, g1) = ref, fast[:3]
    assert float(l1.detach()) == pytest.approx(float(l0.detach()), rel=1e-5, abs=1e-6)
    for k in ("loss", "correct", "count"):
        assert torch.allclose(s1[k], s0[k], rtol=1e-5, atol=1e-6), (k, s1[k], s0[k])
    for n, a, b in zip(names, g0, g1):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6), (n, (a - b).abs().max())


OPTIONS = {"kl": (TR.Loss(), {}), "lk_lambda": (TR.Loss("lk_lambda", 3.0), {}),
           "lk_alpha": (TR.Loss("lk_alpha"), {}),
           "eagle31": (TR.Loss(), dict(fc_norm=True, norm_output=True)),
           "lk_lambda-eagle31": (TR.Loss("lk_lambda", 1.5), dict(fc_norm=True, norm_output=True))}


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("kw", [dict(pack=False), dict(seq_len=24), dict(seq_len=40)],
                         ids=["unpacked", "packed-24", "packed-40"])
def test_fast_loss_equals_ttt_loss(kw, option):
    loss, cfg = OPTIONS[option]
    m, used, head, samples = _setup(**cfg)
    ref = _reference(m, used, head, samples, loss)
    fast = _fast(m, used, head, samples, loss=loss, **kw)
    _assert_same(ref, fast, [n for n, _ in m.named_parameters()])
    assert fast[3]["tokens"] == sum(LENGTHS)
    assert ref[1]["count"].min() > 0  # the stats mean something
    assert ref[1]["correct"].sum() > 0 or option != "kl"
    if "seq_len" in kw:
        assert fast[3]["pos"].shape[0] < len(LENGTHS)  # really packed: fewer rows than samples


@pytest.mark.skipif(not _triton.interpreting(), reason="needs triton and TRITON_INTERPRET=1")
@pytest.mark.parametrize("option", ["kl", "lk_lambda-eagle31"])
def test_fast_loss_with_the_triton_kernels_compiled_equals_ttt_loss(option):
    """The GPU configuration on the CPU: Triton attention and CE (interpreter), the K-step unroll
    under torch.compile (aot_eager: dynamo + AOT autograd with the attention custom op, no code
    generation); plain and with an LK loss and the EAGLE 3.1 options."""
    loss, cfg = OPTIONS[option]
    m, used, head, samples = _setup(seed=1, **cfg)
    samples = samples[:2]
    ref = _reference(m, used, head, samples, loss)
    torch._dynamo.reset()
    fast = _fast(m, used, head, samples, FT.Impl("triton", "triton", "aot_eager"), loss,
                 seq_len=16)
    _assert_same(ref, fast, [n for n, _ in m.named_parameters()])


def test_compiled_step_does_not_recompile_per_batch_shape():
    """Packed batches change shape every step (rows and length): the compiled layer pieces of the
    unroll build ONE symbolic graph each at the first shape, reused by every later one (no
    static graph first, as automatic dynamic shapes built: 2 then 4 graphs; and not one per
    shape, as dynamic=False did, which past dynamo's recompile limit ran eager on the H200)."""
    from torch._dynamo.utils import counters
    m, used, head, samples = _setup(seed=2)
    torch._dynamo.reset()
    counters.clear()
    impl = FT.Impl("torch", "torch", "aot_eager")
    graphs = []
    for n, seq_len in [(5, 24), (4, 20), (3, 31), (5, 40), (2, 18), (5, 27)]:
        _fast(m, used, head, samples[:n], impl, seq_len=seq_len)  # rows 2, 2, 1, 2, 2, 2
        graphs.append(counters["stats"]["unique_graphs"])
    # (qkv, out) symbolic from the first shape, the same for the second; + dynamo's own
    # specialisation of the size-1 rows dim at the third; then no new graph
    # (automatic dynamic made [2, 4, 6, ...]; dynamic=False 2 per shape: 2, 4, ... 12)
    assert graphs[:2] == [2, 2] and graphs[2] <= 4 and graphs[3:] == [graphs[2]] * 3, graphs
    torch._dynamo.reset()


def test_packing_without_sample_boundaries_changes_the_loss():
    """Negative control: the same packed rows attended as ONE sample per row give another loss."""
    m, used, head, samples = _setup()
    b, tgt = FT.prepare(samples, K, FT.split_head(head, used), 1e-5, "cpu", seq_len=24)
    good = FT.fast_ttt_loss(m, b, tgt, K, 0.8)[0].detach()
    R, T = b["pos"].shape
    b["start"], b["end"] = Segments.single(R, T)
    bad = FT.fast_ttt_loss(m, b, tgt, K, 0.8)[0].detach()
    assert abs(float(bad) - float(good)) > 1e-3


def test_pack_layout_positions_and_the_ttt_shift():
    s = [{"input_ids": torch.arange(100, 100 + L), "loss_mask": torch.ones(L, dtype=torch.uint8),
          "aux_hidden": torch.zeros(L, 3), "last_hidden": torch.arange(L).float()[:, None]}
         for L in (4, 6, 12)]
    b = FT.pack_samples(s, K=3, seq_len=8)
    # first-fit decreasing: the 12-token sample is cut to 9 tokens (8 positions) and fills row 0;
    # row 1 holds 6 tokens (5 positions) then 4 (3 positions)
    assert b["pos"].tolist() == [list(range(8)), [0, 1, 2, 3, 4, 0, 1, 2]]
    assert b["ids"][1].tolist() == [101, 102, 103, 104, 105, 101, 102, 103, 0, 0]
    assert b["rem"][1].tolist() == [4, 3, 2, 1, 0, 2, 1, 0]
    assert b["start"][1].tolist() == [0] * 5 + [5] * 3 and b["end"][1].tolist() == [5] * 5 + [8] * 3
    assert b["pmask"][1].tolist() == [True] * 4 + [False] + [True] * 2 + [False] * 3
    assert b["tgt_hidden"][1, :, 0].tolist() == [1, 2, 3, 4, 5, 1, 2, 3, 0, 0]
    assert b["tokens"] == 9 + 6 + 4
    tgt = FT.TargetLogits(torch.zeros(20, 2), torch.zeros(20), torch.zeros(20, dtype=torch.int64))
    ids, sup, _, tidx = FT.step_masks(b, tgt, 3)
    # step 2 of row 1: position i reads token i+3 of its own sample, 0 once past its end
    assert ids[2, 1].tolist() == [103, 104, 105, 0, 0, 103, 0, 0]
    assert sup[2, 1].tolist() == [True, True] + [False] * 6
    assert tidx[2, 1, 0] == 10 + 2  # row 1 of E = 10 columns, column 0 + step 2
    # a row with padding: the tail is a segment of its own, rem -1 (never read)
    b = FT.pack_samples(s[:1], K=3, seq_len=6)
    assert b["rem"][0].tolist() == [2, 1, 0, -1, -1, -1] and b["start"][0].tolist()[3:] == [3] * 3


def test_target_logits_match_target_dist_and_break_ties_as_argmax():
    m, used, head, samples = _setup()
    b = TR.make_batch(samples, K)
    p, tid, inv, cover = TR.target_dist(b["tgt_hidden"], head, used, m.t2d, 1e-5)
    t = FT.target_logits(b["tgt_hidden"], FT.split_head(head, used), 1e-5, chunk_elems=V * 7)
    assert torch.allclose(torch.softmax(t.logits.float(), -1), p.flatten(0, 1), atol=1e-6)
    assert torch.allclose(torch.exp(t.lse - t.lse_all), cover.flatten(), atol=1e-6)
    assert 0.05 < float(cover.median()) < 0.95  # a real, partial coverage
    assert torch.equal(t.draft_id >= 0, inv.flatten())
    assert torch.equal(used[t.draft_id[inv.flatten()]], tid.flatten()[inv.flatten()])
    assert 0 < int(inv.sum()) < inv.numel()  # both kinds of rows occur
    # a tie between a draft and a non-draft id: the lower target id wins, as torch.argmax
    lo_rest = int((~m.t2d).nonzero()[0])
    hi_used, lo_used = int(used[used > lo_rest][0]), int(used[used < lo_rest][0]) \
        if (used < lo_rest).any() else None
    W = torch.zeros(V, H)
    W[lo_rest, 0] = W[hi_used, 0] = 1.0
    tie = FT.target_logits(torch.ones(1, 1, H), FT.split_head({"norm": torch.ones(H),
                                                               "lm_head": W}, used), 1e-5)
    assert int(tie.draft_id) == -1  # the non-draft id is lower
    if lo_used is not None:
        W[lo_used, 0] = 1.0
        tie = FT.target_logits(torch.ones(1, 1, H), FT.split_head({"norm": torch.ones(H),
                                                                   "lm_head": W}, used), 1e-5)
        assert int(used[tie.draft_id]) == lo_used


def test_pack_rejects_empty_batches():
    s = {"input_ids": torch.tensor([5]), "loss_mask": torch.ones(1, dtype=torch.uint8),
         "aux_hidden": torch.zeros(1, 3), "last_hidden": torch.zeros(1, 1)}
    with pytest.raises(ValueError, match="fewer than 2 tokens"):
        FT.pack_samples([s], K=2)


# ---------------------------------------------------------------------------------------------
# on the GPU: the configuration the train stage runs (Triton kernels, compiled layer pieces)


def _gpu_case(seed=0, **cfg):
    """SmolLM2's drafter geometry, samples of mixed lengths packed into 512-position rows."""
    g = torch.Generator().manual_seed(seed)
    c = DraftConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                    intermediate_size=1536, vocab_size=4096, draft_vocab_size=2048,
                    target_hidden_size=576, aux_layer_ids=[1, 2, 3], **cfg)
    torch.manual_seed(seed)
    m = Eagle3Draft(c, torch.randn(4096, 576, generator=g) * 0.02).cuda()
    used = torch.randperm(4096, generator=g)[:2048].sort().values
    m.d2t.copy_(used - torch.arange(2048))
    m.t2d[used.cuda()] = True
    head = {"norm": torch.ones(576).cuda(), "lm_head": (torch.randn(4096, 576) * 0.05).cuda()}
    samples = [{"input_ids": torch.randint(0, 4096, (L,), generator=g),
                "loss_mask": (torch.rand(L, generator=g) > 0.3).to(torch.uint8),
                "aux_hidden": torch.randn(L, 3 * 576, generator=g),
                "last_hidden": torch.randn(L, 576, generator=g)} for L in (300, 513, 120, 90)]
    return m, used.cuda(), head, samples


def _cuda(samples):
    return [{k: v.cuda() for k, v in s.items()} for s in samples]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("attn,option", [("triton", "kl"), ("flex", "kl"),
                                         ("triton", "lk_lambda-eagle31"), ("triton", "lk_alpha")])
def test_gpu_fast_loss_matches_ttt_loss(attn, option):
    """float32: the compiled fast step against ttt_loss (tf32 in the Triton dots: 1e-3), with
    the LK losses and EAGLE 3.1 too."""
    kind, cfg = OPTIONS[option]
    m, used, head, samples = _gpu_case(**cfg)
    b = TR.to_device(TR.make_batch(_cuda(samples), 4), "cuda")
    ref, st = TR.ttt_loss(m, b, TR.target_dist(b["tgt_hidden"], head, used, m.t2d, 1e-5), 4, 0.8,
                          loss=kind)
    g_ref = torch.autograd.grad(ref, list(m.parameters()))
    fb, ft = FT.prepare(samples, 4, FT.split_head(head, used), 1e-5, "cuda", seq_len=512)
    loss, fs = FT.fast_ttt_loss(m, fb, ft, 4, 0.8, impl=FT.Impl(attn, "triton", "inductor"),
                                loss=kind)
    g = torch.autograd.grad(loss, list(m.parameters()))
    assert fb["pos"].shape[0] == 2  # 512 positions fill a row; 299 + 119 + 89 share the other
    assert float(loss.detach()) == pytest.approx(float(ref.detach()), rel=1e-3)
    # ttt_loss brings its stats to the host (one sync per call); the fast step leaves them on
    # the GPU (the recipe syncs once per log interval)
    assert torch.allclose(fs["count"].cpu(), st["count"])
    assert (fs["correct"].cpu() - st["correct"]).abs().max() <= 2  # tf32 near-ties
    for (n, _), a, c in zip(m.named_parameters(), g_ref, g):
        assert (a - c).abs().max() <= 1e-2 * a.abs().max(), n


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("option", ["kl", "lk_lambda-eagle31"])
def test_gpu_fast_step_has_no_host_sync_and_bf16_loss_is_close(option):
    kind, cfg = OPTIONS[option]
    m, used, head, samples = _gpu_case(seed=1, **cfg)
    impl = FT.Impl.best("cuda")
    fb, ft = FT.prepare([{k: v.bfloat16() if v.is_floating_point() else v for k, v in s.items()}
                         for s in samples], 4, FT.split_head(head, used), 1e-5, "cuda",
                        seq_len=512)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss, _ = FT.fast_ttt_loss(m, fb, ft, 4, 0.8, impl=impl, loss=kind)  # compiles
    loss.backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss2, st = FT.fast_ttt_loss(m, fb, ft, 4, 0.8, impl=impl, loss=kind)
        loss2.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert st["loss"].device.type == "cuda"
    b = TR.to_device(TR.make_batch(_cuda(samples), 4), "cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        ref, _ = TR.ttt_loss(m, b, TR.target_dist(b["tgt_hidden"], head, used, m.t2d, 1e-5), 4,
                             0.8, loss=kind)
    assert float(loss2.detach()) == pytest.approx(float(ref), rel=2e-2)


def test_train_kernels_setting_names_the_step():
    """stages.train.kernels -> the step's paths: reference = the plain objective (None), auto =
    the best paths of the device, the others as named; a bad name is refused."""
    assert FT.Impl.named("reference", "cpu") is None
    assert FT.Impl.named("auto", "cpu") == FT.Impl.best("cpu") == FT.Impl()
    assert FT.Impl.named("flex", "cpu") == FT.Impl("flex", "triton", None)
    assert FT.Impl.named("torch", "cpu") == FT.Impl("torch", "torch", None)
    with pytest.raises(ValueError, match="stages.train.kernels"):
        FT.Impl.named("cuda", "cpu")
