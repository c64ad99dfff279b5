"""scripts/bench/profile_engine.py off the GPU: the kernel classifier on known launch sequences, every
step of both paths run once (the fused one through Triton's interpreter) with matching output
shapes, and the ratio table from a synthetic result."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from kernel_helpers import needs_triton, patch_interpreter_bf16_dot  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pe():
    path = ROOT / "scripts" / "bench" / "profile_engine.py"
    spec = importlib.util.spec_from_file_location("profile_engine", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_classify_fused_and_torch_launch_sequences(pe):
    fused = ["_qkv_kernel", "_attn_kernel", "_linear_kernel", "_gate_up_kernel", "_linear_kernel",
             "_head_kernel", "_merge_kernel"]
    assert pe.classify(fused) == ["qkv", "attention", "o_proj", "mlp", "mlp", "lm_head", "lm_head"]
    torch_path = ["triton_red_fused__to_copy_mean_mul_pow_rsqrt_0", "nvjet_hsh_64x8_gemm",
                  "nvjet_hsh_64x8_gemm", "nvjet_hsh_64x8_gemm",
                  "triton_poi_fused_cat_index_put_mul_neg_1", "triton_poi_fused_cat_mul_neg_2",
                  "fmha_cutlassF_bf16_aligned_64x64", "sm90_xmma_gemm_bf16", 
                  "triton_red_fused_add_mean_mul_pow_rsqrt_3", "nvjet_gemm_a", "nvjet_gemm_b",
                  "triton_poi_fused_mul_silu_4", "nvjet_gemm_c",
                  "triton_red_fused_add_mean_mul_pow_rsqrt_5", "nvjet_gemm_lm",
                  "triton_red_fused_argmax_6", "Memcpy DtoD (Device -> Device)"]
    assert pe.classify(torch_path) == [
        "norm", "qkv", "qkv", "qkv", "kv_write", "rope", "attention", "o_proj", "norm", "mlp",
        "mlp", "mlp", "mlp", "norm", "lm_head", "lm_head", "copy"]


@needs_triton
def test_every_step_runs_on_both_paths_with_the_same_outputs(pe):
    """build_steps on a tiny bf16 target/drafter: each step of each path once, eagerly."""
    patch_interpreter_bf16_dot()
    from kernel_helpers import DEV
    from eagle3_runner.models.draft_model import DraftConfig, Eagle3Draft
    from eagle3_runner.models.llama import Llama, LlamaConfig
    torch.manual_seed(0)
    c = LlamaConfig(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=32, intermediate_size=128)
    t = Llama(c, (0, 1)).eval().requires_grad_(False).to(DEV, torch.bfloat16)
    S, K = 64, 2
    t.setup_cache(1, S)
    dc = DraftConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                     intermediate_size=128, vocab_size=97, draft_vocab_size=40,
                     target_hidden_size=64, aux_layer_ids=[0, 1])
    d = Eagle3Draft(dc, t.embed_tokens.weight).eval().requires_grad_(False).to(DEV, torch.bfloat16)
    d.fc = torch.nn.Linear(128, 64, bias=False).to(DEV, torch.bfloat16)  # 2 aux layers here
    dk = torch.zeros(1, 2, S, 32, device=DEV, dtype=torch.bfloat16)
    dv = torch.zeros_like(dk)
    shapes = {}
    with torch.inference_mode():
        for path in ("torch", "triton"):
            for name, (fn, args) in pe.build_steps(t, t, d, dk, dv, K, S, path).items():
                out = fn(*args)
                out = out if isinstance(out, tuple) else (out,)
                shapes.setdefault(name, []).append([tuple(o.shape) for o in out])
    for name, (a, b) in shapes.items():
        assert a == b, name
    assert shapes["draft_round"][0] == [(1, K + 1)]


def test_ratio_table_from_a_synthetic_result(pe):
    step = lambda ms: {"torch": {"ms": ms}}  # noqa: E731
    res = {"machine": "X", "layers": 30, "K": 4, "S": 512, "commit": "abc",
           "hf": {"ms_per_token": 3.0},
           "steps": {"decode1": step(1.6), "decode1_L2": step(0.2), "verify": step(2.0),
                     "tree16": step(2.4), "draft_step": step(0.2),
                     "draft_round": {"torch": {"error": "boom"}}},
           "loops": {"torch": {"token_ms": 1.5, "round_ms": 3.0}}}
    res["ratios"] = r = pe.ratios(res, 30)
    assert r["torch"]["decode_vs_hf"] == pytest.approx(2.0)
    assert r["torch"]["round_in_tokens"] == pytest.approx(2.0)
    assert r["torch"]["layer_ms"] == pytest.approx(0.05)
    assert r["torch"]["draft_over_layer"] == pytest.approx(4.0)
    assert r["torch"]["tree16_over_verify5"] == pytest.approx(1.2)
    md = pe.markdown(res)
    assert "| decode_vs_hf | 2.000 | >= 2.5 |" in md and "error: boom" in md
