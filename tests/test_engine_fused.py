"""The embedded engine on the fused Triton path (Engine kernels="triton", kernels/): greedy chains
and trees are token-identical to the engine's own greedy decode with the same setting, at a
1-row baseline (default_width is None there: a row's bits do not depend on the row count,
tests/test_fused_decode.py). On CPU through Triton's interpreter, eagerly (dynamo cannot trace the
interpreter: refused); on the H200 compiled under CUDA graphs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from engine_helpers import export_drafter, tiny_hf_llama  # noqa: E402
from kernel_helpers import DEV, gpu_test, needs_triton, patch_interpreter_bf16_dot  # noqa: E402
from test_engine_tree import _sharpen, tree_oracle  # noqa: E402

import eagle3_runner.kernels.draft_decode as KD  # noqa: E402
import eagle3_runner.kernels.llama_decode as KL  # noqa: E402
from eagle3_runner.models.draft_model import load_exported  # noqa: E402
from eagle3_runner.engine.speculative import Engine, default_width, engine_kernels  # noqa: E402
from eagle3_runner.models.llama import from_hf_model  # noqa: E402

AUX = (0, 1)
SHAPES = [(3, 1, None), (3, 2, 6)]  # a chain and a tree: num_steps / eagle_topk / draft tokens


@pytest.fixture(autouse=True)
def _setup():
    torch.set_num_threads(min(2, torch.get_num_threads()))
    patch_interpreter_bf16_dot()


def _tiny(tmp_path, dev, dtype=torch.bfloat16):
    """A 2-layer random target with head_dim 32 (the fused kernels' smallest) and a sharpened
    random drafter over its 2 layers."""
    hf = tiny_hf_llama(vocab=64, hidden=64, layers=2, heads=2, kv=1, seed=2)
    t = from_hf_model(hf, AUX, dtype=dtype, device=dev)
    d = load_exported(export_drafter(tmp_path / "d", hf.config, AUX, edit=_sharpen),
                      t.embed_tokens.weight, dev, dtype=dtype)
    return t, d


def _chain_oracle(base):
    """draft_fn for chains: the known continuation with a varying corrupted position (or none)."""
    calls = [0]

    def fn(out, k):
        calls[0] += 1
        dr = [base[len(out) + j] if len(out) + j < len(base) else 0 for j in range(k)]
        if calls[0] % (k + 2) < k:
            dr[calls[0] % (k + 2)] = (dr[calls[0] % (k + 2)] + 1) % 64
        return dr
    return fn


def _counting(monkeypatch) -> dict:
    """Count the fused target forwards and draft steps (proof that the switch routes there)."""
    n = {"target": 0, "draft": 0}
    ft, fd = KL.forward_triton, KD._forward_triton

    def target(*a, **k):
        n["target"] += 1
        return ft(*a, **k)

    def draft(*a, **k):
        n["draft"] += 1
        return fd(*a, **k)
    monkeypatch.setattr(KL, "forward_triton", target)
    monkeypatch.setattr(KD, "_forward_triton", draft)
    return n


def _lossless(t, d, dev, new: int, prompts: int, **kw) -> tuple[set, list]:
    """Every SHAPES engine (own drafts, oracle drafts) == the 1-row fused greedy decode, per
    prompt. Returns (the accept lengths seen, each engine's graph_counts())."""
    base_e = Engine(t, None, num_steps=3, max_seq=96, kernels="triton", **kw)
    engines = [Engine(t, d, num_steps=K, eagle_topk=k, num_draft_tokens=N, max_seq=96,
                      kernels="triton", **kw) for K, k, N in SHAPES]
    assert base_e.decode_rows == 1 and all(e.W == e.N for e in engines)
    g, accepted = torch.Generator().manual_seed(1), set()
    for p in range(prompts):
        ids = torch.randint(0, 64, (1, 5 + p), generator=g).to(dev)
        base, _ = base_e.generate_baseline(ids, new)
        for e in engines:
            fn = _chain_oracle(base) if e.topk == 1 else tree_oracle(base, [p], 64, e.D + 1)
            own, _ = e.generate(ids, new)
            orc, st = e.generate(ids, new, draft_fn=fn)
            assert own == orc == base, (p, e.K, e.topk)
            assert st.tau > 1.5, st.accepted
            accepted |= set(st.accepted)
    return accepted, [e.graph_counts() for e in [base_e] + engines]


@needs_triton
def test_fused_engine_chain_and_tree_equal_their_own_1row_greedy_decode(tmp_path, monkeypatch):
    """bf16, the fused path through the interpreter (CPU) or eagerly on CUDA: the verify of K+1
    or N rows and the 1-row decode give the same tokens; the fused forwards really run."""
    t, d = _tiny(tmp_path, DEV)
    assert default_width(t, 5, 8, "triton") is None
    assert default_width(t, 5, 8, "torch") == 8  # bf16 on the torch path: a shared width
    n = _counting(monkeypatch)
    accepted, counts = _lossless(t, d, DEV, 14, 1)
    assert all(set(c.values()) <= {1} for c in counts)
    assert n["target"] > 0 and n["draft"] > 0, n
    assert 0 in accepted and max(accepted) >= 2


def test_kernels_switch_resolution_and_refusals(tmp_path):
    """auto is torch (on any geometry and device); an explicit triton names a geometry the fused
    kernels cannot tile; a compiled triton engine on CPU is refused."""
    hf = tiny_hf_llama(layers=2)  # head_dim 16
    t = from_hf_model(hf, AUX)
    assert engine_kernels("auto", t) == "torch"
    with pytest.raises(ValueError, match="head_dim 16"):
        engine_kernels("triton", t)
    t32, _ = _tiny(tmp_path, "cpu", torch.float32)
    with pytest.raises(ValueError, match="interpreter"):
        Engine(t32, None, num_steps=2, max_seq=32, kernels="triton", compile_backend="eager")
    assert Engine(t32, None, num_steps=2, max_seq=32).kernels == "torch"


@gpu_test
def test_gpu_fused_engine_under_cuda_graphs_is_lossless_and_static(tmp_path):
    """The compiled fused engine (mode="reduce-overhead"): chain and tree == its own 1-row
    decode over 3 prompt lengths, every accept length, one graph per step throughout.
    On the H200 (2026-12-05, torch 2.11) the lossless part held and the one-graph part did not
    (kernels: triton is opt-in; BENCHMARKS.md): an expected failure that names the counts."""
    t, d = _tiny(tmp_path, "cuda")
    accepted, counts = _lossless(t, d, "cuda", 30, 3, cuda_graph=True)
    assert 0 in accepted and max(accepted) >= 2
    if not all(set(c.values()) <= {1} for c in counts):
        pytest.xfail(f"more than one CUDA graph per fused engine step: {counts}")
    e = Engine(t, d, num_steps=3, eagle_topk=2, num_draft_tokens=6, max_seq=96, kernels="triton",
               cuda_graph=True, sampling=True)
    e.generate(torch.tensor([[1, 2, 3, 4]], device="cuda"), 12, temperature=0.8,
               gen=torch.Generator("cuda").manual_seed(0))
    counts = e.graph_counts()
    assert counts.pop("decode") == 0 and set(counts.values()) == {1}  # no baseline run
