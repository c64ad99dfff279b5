"""Targets larger than one GPU (issue 24): the ranks' GPU groups, the memory estimate and the
plan's verdict, trust_remote_code, a Kimi-K2.5-shaped config, and on the CPU a tiny Llama and a
tiny DeepSeek-V3 (transformers' own classes, random weights, saved as HF folders) split by an
accelerate device map (half the layers offloaded to disk: accelerate's hooks load them and
move the tensors per forward) capturing exactly what the one-device run captures. The GPU test
(cuda:0 + CPU memory) is at the end; scripts/bench/bench_split.py measures its throughput."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from eagle3_runner.runner.errors import PlanError, SpecError
from eagle3_runner.runner.placement import layer_devices, layout_problem, replica_gpus
from eagle3_runner.runner.spec.load import load_spec
from eagle3_runner.runner.target_config import native_causal_lm_types, read_target_config
from eagle3_runner.runner.target_size import activation_bytes, weight_bytes

ROOT = Path(__file__).resolve().parent.parent
KIMI = ROOT / "tests" / "data" / "kimi-k25-config.json"


# ----------------------------------------------------------------------------------------------
# layout: rank -> GPU group, a pure function


def test_replica_gpus_groups_the_node():
    assert replica_gpus(0, 1, 8) == list(range(8))
    assert [replica_gpus(r, 2, 8) for r in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [replica_gpus(r, 8, 8) for r in range(8)] == [[r] for r in range(8)]
    assert replica_gpus(3, 4, 8, split=False) == [3]  # unsplit: GPU = local rank
    with pytest.raises(PlanError, match="nproc_per_node 1 or 2 or 4 or 8"):
        replica_gpus(0, 3, 8)
    assert "each rank needs its own GPU" in layout_problem(4, 8, split=False)
    assert layout_problem(8, 8, split=False) is None


def test_layer_map_must_cover_every_layer_once():
    assert layer_devices({"0-1": 0, "2": "cpu", "3": "disk"}, 4) == {0: 0, 1: 0, 2: "cpu",
                                                                    3: "disk"}
    for bad, msg in (({"0-1": 0}, "layers 2..3"), ({"0-2": 0, "2-3": 1}, "mapped twice"),
                     ({"x": 0, "0-3": 1}, "a decoder layer"), ({"0-4": 0}, "run 0..3")):
        with pytest.raises(ValueError, match=msg):
            layer_devices(bad, 4)


# ----------------------------------------------------------------------------------------------
# the memory estimate


def test_kimi_k25_size_from_its_config():
    """Kimi-K2.5's config (tests/data): ~1.03T parameters; routed experts int4 (group 32, bf16
    scales: 4.5 bits), the rest bf16 = ~594 GB, its checkpoint's size; at bf16 ~2 TB."""
    cfg = read_target_config(KIMI)
    w = weight_bytes(cfg, 16)
    assert w["parameters"] == pytest.approx(1.0264e12, rel=1e-3)
    assert w["groups"]["experts"][1] == 4.5 and w["groups"]["attention"][1] == 16
    assert w["bytes"] == pytest.approx(594.2e9, rel=1e-3)
    plain = weight_bytes({k: v for k, v in cfg.items() if k != "quantization_config"}
                         | {"text_config": {}}, 16)
    assert plain["bytes"] == pytest.approx(2.053e12, rel=1e-3)
    # the spec's declared totals are this estimate
    spec = load_spec(ROOT / "specs" / "drafter-v2.yaml")
    assert spec.target.num_parameters_b * 1e9 == pytest.approx(w["parameters"], rel=1e-3)
    assert spec.target.num_parameters_b * 1e9 * spec.target.weight_bits / 8 == \
        pytest.approx(w["bytes"], rel=2e-3)


def test_dense_llama_size_and_eager_scores():
    llama8b = {"vocab_size": 128256, "hidden_size": 4096, "num_hidden_layers": 32,
               "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336}
    assert weight_bytes(llama8b, 16)["parameters"] == pytest.approx(8.03e9, rel=2e-3)
    eager = activation_bytes(llama8b, 8192, 2048, 2)
    sdpa = activation_bytes(llama8b, 8192, 2048, 2, "sdpa")
    assert eager - sdpa == 8192 * 2048 * 32 * 8  # the eager score matrices


# drafter-v2 through transformers (its extract split by device_map auto): the spec runs its target
# on SGLang (target.engine auto), and regenerate has no transformers path
HF = ["target.engine=hf", "stages.regenerate=null"]


def plan_of(*overrides, spec="drafter-v2.yaml"):
    from eagle3_runner.runner.plan import build_plan
    return build_plan(load_spec(ROOT / "specs" / spec, overrides=HF + list(overrides)))


def test_drafter_v2_plan_fits_one_replica_over_8_gpus(capsys):
    from eagle3_runner.runner.cli import _render_plan
    plan = plan_of()
    (m,) = [m for m in plan.memory["stages"] if m["stage"] == "extract"]
    assert m["fits"] is True and m["replicas"] == 1 and m["gpus_per_replica"] == 8
    assert 60 < m["per_gpu_gib"] < m["usable_gib"] < 139
    text = _render_plan(plan)
    assert "layout 1 replica(s) x 8 GPUs (target.device_map auto" in text
    assert "GiB per GPU" in text and ": fits;" in text
    assert json.loads(plan.to_json())["memory"]["stages"][0]["fits"] is True


@pytest.mark.parametrize("override, fix", [
    ("executor.stages.extract.nproc_per_node=2", "fewer replicas (executor.stages.extract."
                                                  "nproc_per_node: 1, 8 GPUs each)"),
    ("target.device_map=null", "set target.device_map: auto"),
    ("executor.gpu_memory_gb=60", "use more GPUs"),
])
def test_plans_that_cannot_fit_are_refused_naming_the_fix(override, fix):
    with pytest.raises(PlanError, match="the target needs") as e:
        plan_of(override)
    assert fix in str(e.value)


def test_online_training_keeps_the_drafter_on_the_first_gpu_of_the_replica():
    """Kimi-K2.5 online (no extract): one replica over 8 GPUs, the drafter's state on GPU 0;
    batch 4 x 4096 tokens fits, 16 (eager scores of 64k tokens per forward) does not."""
    from eagle3_runner.runner.plan import build_plan
    from eagle3_runner.runner.spec.load import read_yaml
    d = read_yaml(ROOT / "specs" / "drafter-v2.yaml")
    d["target"]["engine"] = "hf"
    del d["stages"]["extract"], d["stages"]["regenerate"]
    d["stages"]["train"].update(features="online", batch_size=4)
    d["executor"]["stages"]["train"] = {"nproc_per_node": 1}
    (m,) = build_plan(load_spec(data=d)).memory["stages"]
    assert m["fits"] and m["drafter_gib"] > 10
    assert m["weights_first_gpu_gib"] < m["weights_per_gpu_gib"]
    d["stages"]["train"]["batch_size"] = 16
    with pytest.raises(PlanError, match="drafter state on the first.*smaller batch"):
        build_plan(load_spec(data=d))


def test_undeclared_gpu_memory_is_not_checked_and_says_so():
    (m,) = [m for m in plan_of("executor.gpu_memory_gb=null").memory["stages"]
            if m["stage"] == "extract"]
    assert m["fits"] is None and "executor.gpu_memory_gb" in m["why"]


# ----------------------------------------------------------------------------------------------
# trust_remote_code and a Kimi-K2.5-shaped config


def kimi_shaped(folder: Path, layers: int = 8) -> Path:
    """Kimi-K2.5's config with tiny sizes: nested text_config, architectures
    KimiK25ForConditionalGeneration, auto_map."""
    cfg = json.loads(KIMI.read_text())
    cfg["text_config"].update(num_hidden_layers=layers, hidden_size=64, vocab_size=512,
                              intermediate_size=128, moe_intermediate_size=16, n_routed_experts=8,
                              num_attention_heads=4, num_key_value_heads=4,
                              max_position_embeddings=4096)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def kimi_spec(folder: Path, **target):
    return load_spec(data={"name": "kimi", "target": {"path": str(folder), **target},
                           "drafter": {"draft_vocab_size": 64},
                           "stages": {"extract": {}}})


def test_kimi_shaped_config_resolves_family_layers_and_ids(tmp_path):
    spec = kimi_spec(kimi_shaped(tmp_path / "k"), trust_remote_code=True)
    assert spec.target.family == "deepseek"
    assert (spec.num_layers, spec.target.hidden_size, spec.target.vocab_size) == (8, 64, 512)
    assert spec.aux_ids == [1, 3, 4]  # SGLang's default [1, L//2-1, L-4]
    assert spec.feature_width == 3 * 64


@pytest.mark.skipif(native_causal_lm_types()[1] is None, reason="no transformers to read")
def test_remote_code_target_needs_trust_remote_code(tmp_path):
    with pytest.raises(SpecError) as e:
        kimi_spec(kimi_shaped(tmp_path / "k"))
    msg = str(e.value)
    assert "target.trust_remote_code" in msg and "KimiK25ForConditionalGeneration" in msg
    # a native architecture with an auto_map does not need it
    cfg = json.loads((tmp_path / "k" / "config.json").read_text())["text_config"]
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "config.json").write_text(json.dumps(
        {**cfg, "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"],
         "auto_map": {"AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
         "quantization_config": None}))
    assert kimi_spec(tmp_path / "d").target.family == "deepseek"


# ----------------------------------------------------------------------------------------------
# the split itself, on the CPU


def tiny_deepseek_v3(layers: int = 4):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    torch.manual_seed(0)
    cfg = DeepseekV3Config(vocab_size=96, hidden_size=32, intermediate_size=64,
                           moe_intermediate_size=16, num_hidden_layers=layers,
                           num_attention_heads=4,
                           num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
                           n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=16,
                           kv_lora_rank=8, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                           n_group=1, topk_group=1, max_position_embeddings=256,
                           tie_word_embeddings=False)
    return DeepseekV3ForCausalLM(cfg).eval()


@pytest.fixture(scope="module", params=["llama", "deepseek_v3"])
def folder(request, tmp_path_factory):
    from engine_helpers import tiny_hf_llama
    model = tiny_hf_llama(vocab=96, hidden=32, layers=4) if request.param == "llama" else \
        tiny_deepseek_v3()
    d = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(d)
    bench_split().stub_tokenizer(d, 96)  # the loader loads a tokenizer with the model
    return d


def bench_split():
    """scripts/bench/bench_split.py's functions (its random SmolLM2-like target, stub tokenizer)."""
    import runpy
    from types import SimpleNamespace
    return SimpleNamespace(**runpy.run_path(str(ROOT / "scripts" / "bench" / "bench_split.py"),
                                            run_name="bench_split"))


def target(folder, **kw):
    from eagle3_runner.runner.spec.sections import Target
    return Target(path=str(folder), device="cpu", dtype="float32", **kw)


def load(folder, device_map=None):
    from eagle3_runner.targets.load import load_target
    from eagle3_runner.targets.split import split_plan
    t = target(folder, device_map=device_map)
    return load_target(t, split=split_plan(t, []) if device_map else None)[0]


BATCH = [[5, 9, 17, 3, 44, 2, 8], [7, 1, 90, 33], [12, 60, 4, 4, 4, 71, 19, 23, 50]]


@pytest.mark.parametrize("device_map", [{"0-1": "cpu", "2-3": "disk"}, "auto"])
def test_split_target_captures_what_one_device_does(folder, device_map):
    if device_map == "auto" and "deepseek" in folder.name:
        pytest.skip("auto on a CPU machine maps everything to the CPU: the Llama case says it")
    from eagle3_runner.targets.capture import capture, target_head
    one = load(folder)
    split = load(folder, device_map)
    if device_map != "auto":  # layers 2-3 and the head live on disk, run on the CPU
        assert split.hf_device_map["model.layers.3"] == "disk"
        assert split.hf_device_map["lm_head"] == "disk"
        assert split.model.layers[3].self_attn.o_proj.weight.device.type == "meta"
    a1, l1 = capture(one, BATCH, [0, 1, 2], pad_id=0)
    a2, l2 = capture(split, BATCH, [0, 1, 2], pad_id=0)
    assert torch.equal(a1, a2) and torch.equal(l1, l2)
    assert not torch.equal(a1[..., :32], a1[..., 32:64])  # two layers, not one copied
    h1, h2 = target_head(one), target_head(split)
    for k in h1:
        assert h2[k].device.type == "cpu" and torch.equal(h1[k], h2[k]), k


def test_capture_gathers_on_the_consumer_device(folder):
    """The hooks copy each captured layer output to `device` as it is produced (here the meta
    device stands in for another GPU: the CPU machine has no second device)."""
    from eagle3_runner.targets.capture import capture
    aux, last = capture(load(folder, {"0-1": "cpu", "2-3": "disk"}), BATCH, [0, 1, 2],
                        device="meta")
    assert aux.device.type == last.device.type == "meta" and aux.shape == (3, 9, 96)


def test_native_kimi_k25_wrapper_loads_splits_and_captures(tmp_path):
    """transformers' own Kimi-K2.5 class (a multimodal wrapper with no causal-LM mapping),
    tiny and random: the loader falls back to its image-text-to-text class, finds the DeepSeek-V3
    language model's layers inside, and split or not captures its hidden states."""
    kimi = pytest.importorskip("transformers.models.kimi_k25")
    from eagle3_runner.targets.capture import capture
    from eagle3_runner.targets.split import decoder_parts
    torch.manual_seed(0)
    text = tiny_deepseek_v3(layers=8).config.to_dict()
    cfg = kimi.Kimi_K25Config(text_config=text, vision_config=dict(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32))
    ref = kimi.Kimi_K25ForConditionalGeneration(cfg).eval()
    ref.save_pretrained(tmp_path)
    bench_split().stub_tokenizer(tmp_path, 96)
    spec = kimi_spec(tmp_path)
    assert spec.target.family == "deepseek" and spec.num_layers == 8 and spec.aux_ids == [1, 3, 4]
    with torch.inference_mode():
        hs = ref.model.language_model(input_ids=torch.tensor([BATCH[0]]),
                                      output_hidden_states=True).hidden_states
    for device_map in (None, {"0-3": "cpu", "4-7": "disk"}):
        m = load(tmp_path, device_map)
        assert len(decoder_parts(m)[1]) == 8
        aux, _ = capture(m, BATCH[:1], [1, 3, 4])
        torch.testing.assert_close(aux, torch.cat([hs[2], hs[4], hs[5]], -1), rtol=1e-5,
                                   atol=1e-5)


def test_gpu_index_outside_the_group_or_without_cuda_is_refused(folder):
    from eagle3_runner.targets.split import split_plan
    from eagle3_runner.runner.errors import StageError
    with pytest.raises(StageError, match="CUDA is not available|group, which has"):
        split_plan(target(folder, device_map={"0-1": 0, "2-3": 1}), [])


def test_offload_folders_go_with_the_model_a_refused_plan_or_a_failed_load(folder, tmp_path,
                                                                          monkeypatch):
    """split_plan's offload folder (/tmp/eagle3-offload-*, issue 48: the test suite left them
    behind): none for a refused plan, removed when the load fails and when the model goes."""
    import gc
    import tempfile

    import transformers
    from eagle3_runner.runner.errors import StageError
    from eagle3_runner.targets.load import load_target
    from eagle3_runner.targets.split import split_plan
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def offload_folders():
        return list(tmp_path.glob("eagle3-offload-*"))
    with pytest.raises(StageError):
        split_plan(target(folder, device_map={"0-1": 0, "2-3": 1}), [])
    assert offload_folders() == []
    t = target(folder, device_map={"0-1": "cpu", "2-3": "disk"})
    model = load_target(t, split=split_plan(t, []))[0]
    assert len(offload_folders()) == 1
    del model
    gc.collect()
    assert offload_folders() == []

    def refuse(*a, **k):
        raise OSError("no weights here")
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    with pytest.raises(StageError, match="no weights here"):
        load_target(t, split=split_plan(t, []))
    assert offload_folders() == []


# ----------------------------------------------------------------------------------------------
# on the GPU: a SmolLM2-like random Llama over cuda:0 and CPU memory


@pytest.mark.gpu
def test_smollm2_like_split_over_gpu_and_cpu_equals_gpu_alone(tmp_path):
    """Layers 15-29 in CPU memory, streamed to cuda:0 per forward by accelerate; and device_map
    auto over GPU [0]: the GPU-alone features, bit for bit. Throughput: scripts/bench/bench_split.py
    (scripts/gpu/split.sh)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from eagle3_runner.targets.capture import capture
    bs = bench_split()
    folder = bs.random_llama(tmp_path / "smol", torch.bfloat16)
    one = bs.load(folder, "cuda", "bfloat16")
    batch = [list(range(100, 612)), list(range(2000, 2300))]
    a1, l1 = capture(one, batch, [1, 14, 26])
    for device_map in ({"0-14": 0, "15-29": "cpu"}, "auto"):
        split = bs.load(folder, "cuda", "bfloat16", device_map)
        if device_map != "auto":
            assert split.hf_device_map["model.layers.20"] == "cpu"
        a2, l2 = capture(split, batch, [1, 14, 26])
        assert a2.device == torch.device("cuda:0")
        assert torch.equal(a1, a2) and torch.equal(l1, l2), device_map
