"""targets/capture_embedded.py (stages.train.online_capture: embedded): the batch packed into one
row on our own Llama gives targets/capture.py `capture`'s features per sample; one compiled graph
serves every layer and every batch length; targets it cannot run are refused with the field's
name. The `gpu` tests repeat it compiled on CUDA in bf16 and check that the online step, capture
included, makes no host sync."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts" / "bench"))
from engine_helpers import tiny_hf_llama  # noqa: E402
from kernel_helpers import gpu_test as gpu  # noqa: E402

from eagle3_runner.runner.errors import StageError  # noqa: E402
from eagle3_runner.targets.capture import capture  # noqa: E402
from eagle3_runner.targets.capture_embedded import EmbeddedCapture  # noqa: E402

AUX = [0, 1, 2]
BATCH = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], [5] * 12, [3]]


def _same_features(model, ec, batch, atol):
    aux, last = capture(model, batch, AUX)
    a2, l2, offs = ec(batch)
    assert offs == [0, *torch.tensor([len(x) for x in batch]).cumsum(0).tolist()]
    assert a2.shape == (offs[-1], len(AUX) * model.config.hidden_size)
    for i, x in enumerate(batch):
        torch.testing.assert_close(a2[offs[i]:offs[i + 1]], aux[i, :len(x)], atol=atol, rtol=0)
        torch.testing.assert_close(l2[offs[i]:offs[i + 1]], last[i, :len(x)], atol=atol, rtol=0)


@pytest.mark.parametrize("attn", ["torch", "triton"])
def test_packed_capture_equals_the_hf_capture(attn):
    """Per sample, the packed row's aux and last hidden equal the padded HF forward's (float32:
    summation order only), with the reference attention and with the Triton kernel."""
    torch.manual_seed(0)
    m = tiny_hf_llama(vocab=64, hidden=64, layers=4, heads=4, kv=2)
    _same_features(m, EmbeddedCapture(m, AUX, attn=attn), BATCH, 1e-5)
    with pytest.raises(ValueError, match="at least one token"):
        EmbeddedCapture(m, AUX)([[1, 2], []])


def test_one_graph_serves_every_layer_and_length():
    """Regional compilation: the layers share one graph (their parameters are its inputs), and
    it is symbolic in the packed length from the first batch (no recompile)."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    m = tiny_hf_llama(vocab=64, hidden=64, layers=4, heads=4, kv=2)
    ec = EmbeddedCapture(m, AUX, compile="aot_eager", attn="torch")
    for batch in (BATCH, BATCH[:2], [[3] * 20, [4] * 5]):
        ec(batch)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["recompiles"]
    _same_features(m, ec, BATCH, 1e-5)


def test_targets_it_cannot_run_are_refused():
    m = tiny_hf_llama(vocab=64, hidden=64, layers=4, heads=4, kv=2)
    up = m.model.layers[2].mlp.up_proj
    up.weight = torch.nn.Parameter(torch.empty_like(up.weight, device="meta"))  # offloaded
    with pytest.raises(StageError, match="online_capture = embedded needs the whole target on "
                                         "one device"):
        EmbeddedCapture(m, AUX)
    from transformers import LlamaConfig, LlamaForCausalLM
    biased = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, intermediate_size=128,
                                          attention_bias=True))
    with pytest.raises(StageError, match="a plain Llama, and this one is not.*capture: hf"):
        EmbeddedCapture(biased, [0])


@gpu
def test_gpu_compiled_capture_equals_the_hf_capture():
    """SmolLM2's layer geometry (9 heads, 3 KV heads, head_dim 64) in bf16 on CUDA, inductor and
    the Triton attention: the HF forward's features within bf16 rounding."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1000, hidden_size=576, num_hidden_layers=6,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                      intermediate_size=1536, rope_theta=100000.0)
    m = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    batch = [torch.randint(0, 1000, (n,)).tolist() for n in (700, 31, 1200, 5, 300)]
    ec = EmbeddedCapture(m, AUX)
    aux, last = capture(m, batch, AUX)
    a2, l2, offs = ec(batch)
    for i, x in enumerate(batch):
        for got, ref in ((a2[offs[i]:offs[i + 1]], aux[i, :len(x)]),
                         (l2[offs[i]:offs[i + 1]], last[i, :len(x)])):
            err = (got.float() - ref.float()).abs().max() / ref.float().abs().max()
            assert err < 5e-2, (i, float(err))  # bf16: fused vs eager rounding


@gpu
def test_gpu_online_step_makes_no_host_sync():
    """After a warm-up, the online step (embedded capture, prefetch, pinned copies, the fast
    step) runs with torch.cuda.set_sync_debug_mode("error"): no call in it waits for the GPU."""
    import bench_train as bt
    from eagle3_runner.targets.capture import TargetData
    from eagle3_runner.trainer.recipe import train_step
    from eagle3_runner.trainer.sources import Online, Prefetch
    from transformers import LlamaConfig, LlamaForCausalLM
    g = bt.GEOMETRIES["smollm2"]
    cfg = LlamaConfig(**{k: g[k] for k in ("hidden_size", "num_attention_heads",
                                           "num_key_value_heads", "head_dim",
                                           "intermediate_size", "vocab_size")},
                      num_hidden_layers=4, tie_word_embeddings=True)
    target = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval().requires_grad_(False)
    toks = [(torch.randint(0, g["vocab_size"], (n,)).tolist(), [1] * n)
            for n in (300, 40, 900, 120) * 2]
    src = Online(TargetData(target, None, cfg.to_dict(), toks, {}, {}, 0), AUX, "t", "embedded")
    feed = Prefetch(src, "cuda")
    s = bt._setup(dict(device="cuda", geometry="smollm2", vocab=32000, seq=2, batch=1, K=7))
    learner = bt._learner(s, bt._impl(s, "triton"))
    batches = [[0, 1, 2, 3], [4, 5, 6, 7]]
    for k in range(4):  # compiles, autotunes, allocator warm-up
        train_step(learner, feed.batch(batches[k % 2], batches[(k + 1) % 2]))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for k in range(4):
            out = train_step(learner, feed.batch(batches[k % 2], batches[(k + 1) % 2]))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(out.loss)
