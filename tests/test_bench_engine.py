"""scripts/bench/bench_engine.py, the hf_static row: one StaticCache for all prompts, so generate's
auto-compiled decode forward is built once (in the warm-up) and the timed pass compiles nothing.

A tiny random Llama (float32) with 2 prompts of different lengths. On CPU HF compiles only when
CompileConfig._compile_all_devices is set, so the CPU compile test forces it with a counting
dynamo backend; the GPU test uses HF's own default (inductor, reduce-overhead)."""

import importlib.util
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
N = 8  # new tokens per prompt


@pytest.fixture(scope="module")
def be():
    spec = importlib.util.spec_from_file_location("bench_engine", ROOT / "scripts" / "bench" / "bench_engine.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def tiny_llama(device="cpu"):
    """A 2-layer random LlamaForCausalLM (vocab 256, hidden 64, GQA 4/2 heads), float32."""
    from transformers import LlamaConfig, LlamaForCausalLM
    c = LlamaConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, intermediate_size=128,
                    max_position_embeddings=256)
    torch.manual_seed(0)
    return LlamaForCausalLM(c).to(device).eval()


def prompts(device="cpu", lengths=(7, 13)):
    """[1, L] random prompts; the SHORT one first: the order that recompiled before the fix
    (the warm-up sees prompts[0] only)."""
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (1, L), generator=g).to(device) for L in lengths]


def counting_compile_config(graphs: list):
    """HF CompileConfig whose dynamo backend appends to `graphs` once per graph it is given (and
    runs it eagerly), with _compile_all_devices so generate auto-compiles on CPU too."""
    from transformers.generation.configuration_utils import CompileConfig

    def backend(gm, example_inputs, **kw):
        graphs.append(len(gm.graph.nodes))
        return gm.forward
    cc = CompileConfig(backend=backend)
    cc._compile_all_devices = True
    return cc


def test_hf_static_tokens_equal_plain_generate(be):
    m, ps = tiny_llama(), prompts()
    ref = [be.hf_generate(m, p, N) for p in ps]
    fn = be.hf_static_generate(m, ps, N)
    got = [fn(p) for p in ps + ps[::-1]]  # short, long, long, short: the shared cache is reset
    assert all(len(t) == N for t in got)
    assert got == ref + ref[::-1]


def test_hf_static_compiles_once_for_all_prompt_lengths(be):
    graphs = []
    m, ps = tiny_llama(), prompts()
    ref = [be.hf_generate(m, p, N) for p in ps]  # dynamic cache: nothing compiled
    assert graphs == []
    fn = be.hf_static_generate(m, ps, N, compile_config=counting_compile_config(graphs))
    s, outs, nc = be.timed(fn, ps, torch.device("cpu"), repeats=2)
    if not graphs:
        pytest.skip("this transformers does not auto-compile on CPU (no _compile_all_devices)")
    built = len(graphs)
    assert nc == 0, f"{nc} graph(s) compiled in the timed pass (warm-up built {built})"
    assert len(graphs) == built
    assert outs == ref
    # the counter is sensitive: a cache of another size (a longer prompt) does recompile
    ps2 = prompts(lengths=(7, 30))
    fn2 = be.hf_static_generate(m, ps2, N, compile_config=counting_compile_config(graphs))
    g0 = be.dynamo_graphs()
    fn2(ps2[0])
    assert be.dynamo_graphs() > g0 and len(graphs) > built


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_hf_static_no_recompile_in_timed_pass_cuda(be):
    """HF's own auto-compile on CUDA (inductor, reduce-overhead): built in the warm-up only."""
    m, ps = tiny_llama("cuda"), prompts("cuda")
    g0 = be.dynamo_graphs()
    s, outs, nc = be.timed(be.hf_static_generate(m, ps, N), ps, torch.device("cuda"), repeats=2)
    assert be.dynamo_graphs() > g0, "generate did not auto-compile the decode forward on CUDA"
    assert nc == 0
    assert [len(t) for t in outs] == [N, N]
