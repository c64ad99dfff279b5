"""kernels/llama_decode.py and kernels/draft_decode.py: the fused target forward and draft step
against the models' own forward (the torch side of the switch), and the property the engine's
losslessness rests on: with one row count W, a row's result does not depend on the other rows
(padding or drafts), so greedy decode over W-row forwards == a W-row verify, bit for bit."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from kernel_helpers import DEV, F32, gpu_test, needs_triton, patch_interpreter_bf16_dot  # noqa: E402

from eagle3_runner.models.draft_model import DraftConfig, Eagle3Draft  # noqa: E402
from eagle3_runner.models.llama import Llama, LlamaConfig  # noqa: E402
from eagle3_runner.kernels.switch import resolve_kernels  # noqa: E402
import eagle3_runner.kernels.head  # noqa: E402,F401  (jit-decorated now, while TRITON_INTERPRET is set)
from eagle3_runner.kernels.draft_decode import draft_forward, rope_table  # noqa: E402
from eagle3_runner.kernels.llama_decode import forward_torch, forward_triton, target_forward  # noqa: E402

TREE = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)


@pytest.fixture(autouse=True)
def _interp():
    patch_interpreter_bf16_dot()


def _target(dtype, layers=2, dev=DEV, std=0.2) -> Llama:
    torch.manual_seed(0)
    c = LlamaConfig(vocab_size=97, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=32, intermediate_size=128)
    m = Llama(c, (0, layers - 1)).eval().requires_grad_(False)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=std)
    return m.to(device=dev, dtype=dtype)


def _draft(dtype, dev=DEV) -> Eagle3Draft:
    torch.manual_seed(1)
    c = DraftConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                    intermediate_size=128, vocab_size=120, draft_vocab_size=80,
                    target_hidden_size=64, aux_layer_ids=[0, 1, 2])
    d = Eagle3Draft(c, torch.randn(120, 64)).eval().requires_grad_(False)
    for p in d.parameters():
        torch.nn.init.normal_(p, std=0.2)
    d.d2t.copy_(torch.randint(0, 30, (80,)))
    return d.to(device=dev, dtype=dtype)


def _both(fn_args, m: Llama, B: int):
    """Run the same calls through forward_torch and forward_triton from an empty cache each."""
    outs = []
    for fn in (forward_torch, forward_triton):
        m.setup_cache(B, 48)
        outs.append([fn(m, *a) for a in fn_args])
    return outs


@needs_triton
@pytest.mark.parametrize("dtype", [F32, torch.bfloat16])
def test_target_forward_triton_matches_llama_forward(dtype):
    """Two batch rows at different lengths: prefill-like W = 9 from 0 and 4, then a 4-node tree
    verify at depth positions. Logits, aux and top-2 ids/logprobs."""
    m = _target(dtype)
    g = torch.Generator().manual_seed(1)
    ids1, ids2 = (torch.randint(0, 97, (2, w), generator=g).to(DEV) for w in (9, 4))
    plen = torch.tensor([0, 4], device=DEV)
    pos2 = torch.tensor([[9, 10, 10, 11], [13, 14, 14, 15]], device=DEV)
    calls = [(ids1, torch.arange(9, device=DEV)[None] + plen[:, None], plen),
             (ids2, pos2, plen + 9, TREE.to(DEV), False, 2)]
    ref, got = _both(calls, m, 2)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    for r, o in zip(ref, got):
        torch.testing.assert_close(o.logits, r.logits, **tol)
        torch.testing.assert_close(o.aux.float(), r.aux.float(), **{**tol, "atol": 10 * tol["atol"]})
        torch.testing.assert_close(o.logprobs, r.logprobs, **tol)
    if dtype == torch.float32:
        assert torch.equal(got[1].ids, ref[1].ids)
    one = forward_triton(m, ids2[:, :2], pos2[:, :2], plen + 9, None, True)  # last_only
    assert one.logits.shape == (2, 1, 97) and one.ids.shape == (2, 1, 1)


def _greedy_vs_verify(m: Llama, W: int, P: int, dev, rows: int, S: int) -> None:
    """Greedy decode, each step one real token padded to `rows` rows (W, or 1: a plain decode),
    then ONE verify of [t_0, d_1..d_{W-1}] = those greedy tokens from the same cache state:
    identical argmaxes and identical logits bits, row by row (asserts). The prompt is prefilled
    by the torch path (both sides read the same prefix)."""
    V = m.config.vocab_size
    prompt = torch.randint(0, V, (1, P), generator=torch.Generator().manual_seed(2)).to(dev)
    m.setup_cache(1, S)
    first = forward_torch(m, prompt, torch.arange(P, device=dev), torch.tensor([0], device=dev))
    toks, got = [int(first.ids[0, -1, 0])], []
    for n in range(P, P + W):  # decode: row 0 real, rows 1.. padding (token 0)
        ids = torch.tensor([[toks[-1]] + [0] * (rows - 1)], device=dev)
        o = forward_triton(m, ids, torch.arange(n, n + rows, device=dev),
                           torch.tensor([n], device=dev))
        got.append(o.logits[0, 0])
        toks.append(int(o.ids[0, 0, 0]))
    v = forward_triton(m, torch.tensor([toks[:W]], device=dev), torch.arange(P, P + W, device=dev),
                       torch.tensor([P], device=dev))  # the same slots, rewritten
    assert v.ids[0, :, 0].tolist() == toks[1:W + 1]
    for j in range(W):
        assert torch.equal(v.logits[0, j], got[j]), j


@needs_triton
@pytest.mark.parametrize("rows,P,S", [(3, 5, 24), (1, 62, 256)], ids=["W_rows", "1_row_splits"])
def test_greedy_decode_equals_a_w_row_verify_bit_for_bit(rows, P, S):
    """The lossless rule (engine/speculative.py `width`) at a tiny geometry: decode over W rows (a
    shared width), and over 1 row with 4 attention splits and the verify's keys crossing a
    key-block boundary (slot 64): a row's bits do not depend on the row count, which is what
    lets default_width return None on the fused path (the engine's 1-row baseline)."""
    _greedy_vs_verify(_target(torch.bfloat16, std=0.3), 3, P, DEV, rows, S)


@needs_triton
@pytest.mark.parametrize("dtype", [F32, torch.bfloat16])
def test_draft_forward_triton_matches_cached_step(dtype):
    """Step 0 over 6 positions (fc of aux) then a chain step from its last output, top-3 target
    ids through d2t: out, logits, ids, logprobs."""
    d = _draft(dtype)
    S = 40
    rope = rope_table(d, S)
    g = torch.Generator().manual_seed(3)
    aux = torch.randn(1, 6, 192, generator=g).to(DEV, dtype)
    ids = torch.randint(0, 120, (1, 6), generator=g).to(DEV)
    res = []
    for k in ("torch", "triton"):
        kc = torch.zeros(1, 2, S, 32, device=DEV, dtype=dtype)
        vc = torch.zeros_like(kc)
        o0 = draft_forward(d, kc, vc, ids, torch.arange(6, device=DEV), torch.tensor([0], device=DEV),
                           aux=aux, rope=rope, topk=3, kernels=k)
        o1 = draft_forward(d, kc, vc, ids[:, :1], torch.tensor([6], device=DEV),
                           torch.tensor([6], device=DEV), hidden=o0.out[:, -1:].clone(),
                           rope=rope, topk=3, kernels=k)
        res.append((o0, o1))
    f32 = dtype == torch.float32
    for r, o in zip(*res):
        torch.testing.assert_close(o.out.float(), r.out.float(), atol=1e-4 if f32 else 0.25,
                                   rtol=1e-4 if f32 else 3e-2)
        torch.testing.assert_close(o.logits, r.logits, atol=1e-4 if f32 else 3e-2, rtol=3e-2)
        if f32:
            assert torch.equal(o.ids, r.ids)
    with pytest.raises(ValueError, match="exactly one"):
        draft_forward(d, kc, vc, ids, torch.arange(6), torch.tensor([0]), aux=aux, hidden=aux)


def test_switch_resolves_and_refuses(monkeypatch):
    assert resolve_kernels("auto", "cpu") == "torch" and resolve_kernels("torch", "cuda") == "torch"
    assert resolve_kernels("auto", "cuda") == "torch"  # triton is opt-in (measured slower)
    with pytest.raises(ValueError, match="expected one of"):
        resolve_kernels("fast", "cpu")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        resolve_kernels("triton", "cpu")
    m = _target(torch.float32, layers=1, dev="cpu")  # auto on CPU: Llama.forward itself
    m.setup_cache(1, 16)
    ids = torch.randint(0, 97, (1, 3))
    o = target_forward(m, ids, torch.arange(3), torch.tensor([0]))
    m.setup_cache(1, 16)
    assert torch.equal(o.logits, m(ids, torch.arange(3))[0])


# ---- on the H200: SmolLM2-135M geometry, real kernels, CUDA graphs ------------------------------


def _smollm2(layers=30) -> Llama:
    c = LlamaConfig(vocab_size=49152, hidden_size=576, num_hidden_layers=layers,
                    num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                    intermediate_size=1536, rope_theta=1e5, tie_word_embeddings=True)
    torch.manual_seed(0)
    with torch.device("cuda"):
        m = Llama(c, (1, 14, 26) if layers == 30 else (0, 1, layers - 1)).eval().requires_grad_(False)
    return m.to(torch.bfloat16)


@gpu_test
@pytest.mark.parametrize("W,tree", [(1, False), (5, False), (16, True)])
def test_gpu_smollm2_fused_forward_matches_and_is_deterministic(W, tree):
    m = _smollm2()
    P = 40
    prompt = torch.randint(0, 49152, (1, P), device="cuda")
    tm = None
    if tree:  # a binary tree in BFS order: node i's parent (i - 1) // 2
        tm = torch.eye(W, dtype=torch.bool, device="cuda")
        for i in range(1, W):
            tm[i] |= tm[(i - 1) // 2]
    ids = torch.randint(0, 49152, (1, W), device="cuda")
    outs = []
    for fn in (forward_torch, forward_triton, forward_triton):
        m.setup_cache(1, 256)
        fn(m, prompt, torch.arange(P, device="cuda"), torch.tensor([0], device="cuda"))
        outs.append(fn(m, ids, torch.arange(P, P + W, device="cuda"),
                       torch.tensor([P], device="cuda"), tm))
    ref, a, b = outs
    assert torch.equal(a.logits, b.logits) and torch.equal(a.aux, b.aux)  # deterministic
    scale = ref.logits.abs().max()
    assert (a.logits - ref.logits).abs().max() < 0.05 * scale
    # the fused argmax is the reference's best or a near-tie of it (bf16 rounds differently)
    gap = ref.logits.max(-1).values - ref.logits.gather(-1, a.ids[..., 0:1])[..., 0]
    assert gap.max() <= 0.02 * scale


@gpu_test
@pytest.mark.parametrize("W,rows", [(5, 5), (5, 1), (16, 1)])
def test_gpu_smollm2_greedy_decode_equals_verify_bit_for_bit(W, rows):
    """SmolLM2 geometry, 8 attention splits, keys crossing slot 64: a W-row verify against
    decode over W rows, and over 1 row (what default_width None relies on for the fused path:
    the engine's 1-row baseline vs a 5-row chain verify or a 16-row tree verify)."""
    _greedy_vs_verify(_smollm2(), W, 62, "cuda", rows, 512)


@gpu_test
def test_gpu_fused_forward_under_cuda_graphs_matches_eager():
    """torch.compile(mode="reduce-overhead", fullgraph) over the fused verify step: one graph
    for every prefix length, the same top ids as the eager fused forward and logits within
    1e-6 (on the H200, 2026-12-05, torch 2.11: at most 2.4e-7 apart at |logit| ~3, so not the
    same bits as this test once asked; the top ids equal at every prefix length)."""
    m = _smollm2(layers=4)
    W = 5

    def step(ids, pos, plen):
        o = forward_triton(m, ids, pos, plen)
        return o.logits, o.ids

    f = torch.compile(step, mode="reduce-overhead", fullgraph=True, dynamic=False)
    slots = torch.arange(256, device="cuda")
    m.setup_cache(1, 256)
    for t in m.caches():  # as engine/speculative.py does: CUDA graphs write the caches in place
        torch._dynamo.mark_static_address(t)
    for n in (10, 37, 100, 11):
        ids = torch.randint(0, 49152, (1, W), device="cuda")
        with torch.inference_mode():
            lg, top = (t.clone() for t in f(ids, slots[n:n + W], slots[n:n + 1]))
            want = step(ids, slots[n:n + W], slots[n:n + 1])
        assert torch.equal(top, want[1]), n
        torch.testing.assert_close(lg, want[0], rtol=0, atol=1e-6, msg=str(n))


@gpu_test
def test_gpu_decode_attention_batched_generation_contract():
    """B = 1024 rows at W = 1, each its own length (the batched regeneration engine's call), and
    W = 64 tree-free verify: against SDPA over the dense mask."""
    from eagle3_runner.kernels.attention import decode_attention, decode_attention_ref
    for B, W in ((1024, 1), (2, 64)):
        S = 512
        q = torch.randn(B, 9, W, 64, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(B, 3, S, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        plen = torch.randint(0, S - W, (B,), device="cuda", dtype=torch.int32)
        got = decode_attention(q, k, v, plen)
        want = decode_attention_ref(q, k, v, plen)
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


@gpu_test
def test_gpu_draft_step_under_cuda_graphs_matches_eager_and_reference():
    """SmolLM2-geometry drafter (draft vocab 2048): the fused chain step under
    torch.compile(mode="reduce-overhead") == eager fused bits == close to cached_step."""
    c = DraftConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                    intermediate_size=1536, vocab_size=49152, draft_vocab_size=2048,
                    target_hidden_size=576, aux_layer_ids=[1, 14, 26], rope_theta=1e5)
    torch.manual_seed(0)
    with torch.device("cuda"):
        d = Eagle3Draft(c, torch.randn(49152, 576)).eval().requires_grad_(False)
    d = d.to(torch.bfloat16)
    S = 256
    rope = rope_table(d, S)
    kc = torch.zeros(1, 3, S, 64, device="cuda", dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    torch._dynamo.mark_static_address(kc)
    torch._dynamo.mark_static_address(vc)
    aux = torch.randn(1, 30, 3 * 576, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, 49152, (1, 30), device="cuda")
    slots = torch.arange(S, device="cuda")
    with torch.inference_mode():
        h = draft_forward(d, kc, vc, ids, slots[:30], slots[:1], aux=aux, rope=rope,
                          kernels="triton").out[:, -1:].clone()

        def step(tok, hid, pos):
            o = draft_forward(d, kc, vc, tok, pos, pos, hidden=hid, rope=rope, topk=4,
                              kernels="triton")
            return o.out, o.ids

        f = torch.compile(step, mode="reduce-overhead", fullgraph=True, dynamic=False)
        for n in (30, 31, 32):
            tok = ids[:, n - 30:n - 29]
            got = [t.clone() for t in f(tok, h, slots[n:n + 1])]
            want = step(tok, h, slots[n:n + 1])
            ref = draft_forward(d, kc, vc, tok, slots[n:n + 1], slots[n:n + 1], hidden=h,
                                topk=4, kernels="torch")
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), n
            assert (got[0] - ref.out).abs().max() < 0.05 * ref.out.abs().max()
            h = got[0]


def _round_reference(d, kc, vc, aux, best, pos, sel: int, K: int) -> list[int]:
    """The drafter's greedy round written out over Eagle3Draft.cached_step (the engine's old
    torch-only draft_round_greedy): step 0 over pos with causal masks, then K-1 chain steps
    from row sel. -> [bonus, d_1..d_K] (target ids)."""
    S, V = kc.shape[2], d.config.vocab_size
    slots = torch.arange(S, device=kc.device)
    mask = lambda p: (slots[None, :] <= p[:, None])[None, None]  # noqa: E731
    out = d.cached_step(best.view(1, -1), d.project(aux), pos[None], kc, vc, pos, mask(pos))
    hidden, p = out[:, sel:sel + 1], pos[sel:sel + 1]
    tid = d.to_target_ids(d.logits(hidden)[:, -1].argmax(-1)).clamp(0, V - 1)
    toks = [int(best[sel]), int(tid)]
    for _ in range(1, K):
        p = p + 1
        hidden = d.cached_step(tid.view(1, 1), hidden, p[None], kc, vc, p, mask(p))
        tid = d.to_target_ids(d.logits(hidden)[:, -1].argmax(-1)).clamp(0, V - 1)
        toks.append(int(tid))
    return toks


@needs_triton
def test_draft_round_torch_and_triton_equal_the_cached_step_recurrence():
    """engine.steps.draft_round_greedy (the engine's one implementation) with kernels
    "torch" and "triton" drafts the tokens of the cached_step recurrence written out (float32:
    the triton side through the interpreter only, TF32 on CUDA), root m = 1 of K + 1 = 3 rows."""
    from eagle3_runner.engine.steps import draft_round_greedy
    d, K, S = _draft(torch.float32), 2, 32
    g = torch.Generator().manual_seed(5)
    aux = torch.randn(1, K + 1, 192, generator=g).to(DEV)
    best = torch.randint(0, 120, (K + 1,), generator=g).to(DEV)
    slots = torch.arange(S, device=DEV)
    pos, sel = slots[7:7 + K + 1], torch.tensor([1], device=DEV)
    outs = []
    for k in ("ref", "torch") + (("triton",) if DEV == "cpu" else ()):
        kc = torch.zeros(1, 2, S, 32, device=DEV)
        vc = torch.zeros_like(kc)
        kc[:, :, :7] = vc[:, :, :7] = 0.5  # a prefix
        outs.append(_round_reference(d, kc, vc, aux, best, pos, 1, K) if k == "ref" else
                    draft_round_greedy(d, kc, vc, aux, best, pos, sel, K, rope_table(d, S),
                                       kernels=k)[0].tolist())
    assert len(outs[0]) == K + 1 and outs[0][0] == int(best[1])
    assert all(o == outs[0] for o in outs[1:]), outs
