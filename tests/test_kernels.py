"""kernels/: each Triton kernel against its PyTorch reference (Triton's interpreter on CPU, the
real kernel on CUDA), at tiny shapes that still cross every tile, split and mask boundary."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from kernel_helpers import DEV, needs_triton, patch_interpreter_bf16_dot  # noqa: E402

from eagle3_runner.models.draft_model import rope_cos_sin  # noqa: E402
from eagle3_runner.kernels.attention import attention_splits, decode_attention, decode_attention_ref  # noqa: E402
from eagle3_runner.kernels.mask import dense_mask  # noqa: E402
from eagle3_runner.kernels.head import norm_head_topk, norm_head_topk_ref  # noqa: E402
from eagle3_runner.kernels.linear import (Rows, linear_splitk, linear_splitk_ref, norm_gate_up,  # noqa: E402
                            norm_gate_up_ref, norm_qkv_rope, norm_qkv_rope_ref)

BF = torch.bfloat16
pytestmark = needs_triton


@pytest.fixture(autouse=True)
def _interp():
    patch_interpreter_bf16_dot()
    torch.manual_seed(0)


def _r(*s, scale=1.0):
    return (torch.randn(*s) * scale).to(device=DEV, dtype=BF)


def test_dense_mask_is_the_llama_causal_mask_and_the_tree_rule():
    """prefix n, causal: row w attends slots <= n + w (models/llama.py's default mask); a tree row
    attends the prefix plus exactly its tree_mask row among the new slots."""
    n, W, S = torch.tensor([5, 2]), 3, 12
    got = dense_mask(n, None, W, S)
    for b in range(2):
        pos = n[b] + torch.arange(W)
        assert torch.equal(got[b, 0], torch.arange(S)[None, :] <= pos[:, None])
    tm = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    t = dense_mask(n, tm, W, S)
    assert torch.equal(t[0, 0, :, 5:8], tm) and t[0, 0, :, :5].all() and not t[0, 0, :, 8:].any()
    # the drafter's tree steps: Q = 2 frontier rows over R = 4 tree slots after the prefix
    an = torch.tensor([[1, 0, 1, 0], [0, 1, 0, 1]], dtype=torch.bool)
    a = dense_mask(n, an, W, S)
    assert a.shape == (2, 1, 2, S) and torch.equal(a[1, 0, :, 2:6], an)
    assert a[1, 0, :, :2].all() and not a[1, 0, :, 6:].any()


@pytest.mark.parametrize("B,nh,nkv,W,tree,splits", [
    (3, 4, 2, 1, False, 1),  # batched decode, each row its own length
    (1, 6, 2, 5, False, 4),  # chain verify, GQA 3, flash-decoding splits (incl. empty ones)
    (2, 4, 4, 6, True, 2),  # tree verify, MHA
])
def test_decode_attention_matches_sdpa_and_reads_only_live_slots(B, nh, nkv, W, tree, splits):
    S, hd = 64, 16
    q, k, v = _r(B, nh, W, hd), _r(B, nkv, S, hd), _r(B, nkv, S, hd)
    plen = torch.tensor([0, 37, 20][:B], device=DEV)
    tm = None
    if tree:  # a random tree over W nodes in topological order: each node's ancestors + itself
        par = [-1] + [int(torch.randint(0, i, ())) for i in range(1, W)]
        tm = torch.eye(W, dtype=torch.bool)
        for i in range(1, W):
            tm[i] |= tm[par[i]]
        tm = tm.to(DEV)
    want = decode_attention_ref(q.float(), k.float(), v.float(), plen, tm)
    for b in range(B):  # slots past prefix_len + W must never be read: poison them
        k[b, :, int(plen[b]) + W:] = float("nan")
        v[b, :, int(plen[b]) + W:] = float("nan")
    got = decode_attention(q, k, v, plen, tm, splits=splits, block_n=16)
    assert got.shape == (B, nh, W, hd) and torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


def test_attention_splits_cover_the_sms_and_stop_at_one_for_big_batches():
    assert attention_splits(1, 3, 4096, sms=132) == 16
    assert attention_splits(1, 3, 128, sms=132) == 2  # never a split shorter than a key block
    assert attention_splits(1024, 3, 4096, sms=132) == 1


@pytest.mark.parametrize("two", [False, True], ids=["target", "draft_2H"])
def test_norm_qkv_rope_matches_reference(two):
    """Target: rows = residual + 2 split-K partials, written out; drafter: [embedding gather,
    hidden from partials] with their own norms. q, the cache writes and the written rows."""
    B, W, nh, nkv, hd, H, S = 2, 3, 4, 2, 32, 64, 32
    M, KW = B * W, H * (2 if two else 1)
    wq, wk, wv = _r(nh * hd, KW, scale=.1), _r(nkv * hd, KW, scale=.1), _r(nkv * hd, KW, scale=.1)
    emb, base, parts = _r(50, H), _r(M, H), torch.randn(2, M, H, device=DEV)
    idx = torch.randint(0, 50, (M,), device=DEV)
    g1, g2 = _r(H), _r(H)
    cos, sin = (t.to(device=DEV, dtype=BF) for t in rope_cos_sin(torch.arange(S), hd, 1e4))
    pos, plen = torch.randint(0, S, (M,), device=DEV), torch.tensor([3, 9], device=DEV)
    outs = []
    for fn in (norm_qkv_rope, norm_qkv_rope_ref):
        q = torch.zeros(B, W, nh, hd, device=DEV, dtype=BF)
        kc = torch.zeros(B, nkv, S, hd, device=DEV, dtype=BF)
        vc = torch.zeros_like(kc)
        xo = torch.zeros(M, H, device=DEV, dtype=BF)
        a, b = ((Rows(base=emb, idx=idx), Rows(parts=parts, out=xo)) if two else
                (Rows(base=base, parts=parts, out=xo), None))
        fn(a, g1, wq, wk, wv, cos, sin, pos, q, kc, vc, plen, 1e-5, b=b, b_g=g2)
        outs.append((q, kc, vc, xo))
    for got, want in zip(*outs):
        torch.testing.assert_close(got.float(), want.float(), atol=6e-2, rtol=2e-2)
    assert outs[0][1][0, :, 3:6].abs().sum() > 0 and outs[0][1][0, :, 6:].abs().sum() == 0


def test_norm_gate_up_and_splitk_linear_match_reference():
    M, H, I = 5, 64, 96
    base, parts, g = _r(M, H), torch.randn(3, M, H, device=DEV), _r(H)
    wg, wu, wd = _r(I, H, scale=.1), _r(I, H, scale=.1), _r(H, I, scale=.1)
    res = []
    for fn in (norm_gate_up, norm_gate_up_ref):
        xo = torch.zeros(M, H, device=DEV, dtype=BF)
        res.append((fn(Rows(base=base, parts=parts, out=xo), g, wg, wu, 1e-5, M), xo))
    for got, want in zip(*res):
        torch.testing.assert_close(got.float(), want.float(), atol=6e-2, rtol=2e-2)
    x = _r(M, I)
    p = linear_splitk(x, wd, M, 3, block_n=16, block_k=32)  # 3 chunks of 32: one each
    assert p.shape == (3, M, H) and p[2].abs().sum() > 0
    torch.testing.assert_close(p.sum(0), linear_splitk_ref(x, wd)[0], atol=3e-2, rtol=1e-2)


def test_o_proj_combines_attention_partials():
    """linear_splitk over the attention's flash-decoding partials == o_proj(attention)."""
    from eagle3_runner.kernels.attention import attention_partials
    B, W, nh, nkv, hd, S, H = 2, 3, 4, 2, 16, 48, 32
    q, k, v = _r(B, nh, W, hd), _r(B, nkv, S, hd), _r(B, nkv, S, hd)
    plen = torch.tensor([4, 30], device=DEV)
    wo = _r(H, nh * hd, scale=.2)
    att = attention_partials(q, k, v, plen, None, 4, block_n=16)
    got = linear_splitk(None, wo, B * W, 2, att=att, block_n=16, block_k=hd).sum(0)
    o = decode_attention_ref(q.float(), k.float(), v.float(), plen).transpose(1, 2)
    want = o.reshape(B * W, nh * hd) @ wo.float().T
    torch.testing.assert_close(got, want, atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("k", [1, 3])
def test_norm_head_topk_matches_reference_and_breaks_ties_low(k):
    M, H, V = 4, 64, 300
    base, parts, g = _r(M, H), torch.randn(1, M, H, device=DEV), _r(H).abs() + 0.5
    w = _r(V, H, scale=.2)
    w[250] = w[7]  # an exact tie across head blocks: the lower id wins, as torch.argmax
    w[9] = w[7]  # and within a block
    base[0] = w[7].float().sign().to(BF) * 3  # row 0's best is the tied 7 / 9 / 250
    parts[0, 0] = 0
    d2t = torch.randint(0, 5, (V,), device=DEV) if k > 1 else None
    got = norm_head_topk(Rows(base=base, parts=parts), g, w, M, 1e-5, k=k, d2t=d2t, vocab=290,
                         block_n=64)
    want = norm_head_topk_ref(Rows(base=base, parts=parts), g, w, M, 1e-5, k=k, d2t=d2t, vocab=290)
    torch.testing.assert_close(got[0], want[0], atol=5e-2, rtol=2e-2)
    torch.testing.assert_close(got[2], want[2], atol=5e-2, rtol=2e-2)
    if k == 1:
        assert int(got[1][0, 0]) == 7
        assert torch.equal(got[1], got[0].argmax(-1, keepdim=True))  # argmax of its own logits
    else:
        assert torch.equal(got[1][0, :3], torch.tensor([7, 9, 250], device=DEV) + d2t[[7, 9, 250]])
