"""SGLang conformance, version by version (issue 20): the rules table, target families and the
DeepSeek layer-id rule, the forward flags, biases, dtype, d2t rank, several safetensors files,
the server line, on tiny generated drafters and targets (Kimi-like DeepSeek-V3 configs included)
and on an export-like Kimi-K2.5 drafter with its real header shapes (a sparse file)."""

import json
import shlex
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from draft_fixtures import (TINY, codes, errors, geometry, make_draft, msg, target_config,
                            tensors, write_st)
from eagle3_runner.runner.drafts.checks import (check_aux_ids, default_aux_ids, model_aux_problem,
                                                export_aux_problem, spec_aux_problems)
from eagle3_runner.runner.drafts.families import DEEPSEEK, GPT_OSS, MINIMAX_M3_VL, STANDARD, target_family
from eagle3_runner.runner.drafts.rules import RULES, SUPPORTED, rules_for
from eagle3_runner.runner.inspect import inspect_draft
from eagle3_runner.runner.target_config import read_target_config

ROOT = Path(__file__).resolve().parent.parent
VERSIONS = ("0.5.6", "0.5.14", "0.5.23")


def kimi_k25(L=61, **text) -> dict:
    """A Kimi-K2.5-shaped config.json: the multimodal wrapper with a DeepSeek-V3 text_config."""
    tc = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2",
          "num_hidden_layers": L, "hidden_size": 7168, "vocab_size": 163840,
          "max_position_embeddings": 262144, "num_attention_heads": 64, "num_key_value_heads": 64,
          "intermediate_size": 18432, "rms_norm_eps": 1e-6, "rope_theta": 50000.0,
          "rope_scaling": {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096},
          "hidden_act": "silu", **text}
    return {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
            "text_config": tc}


def tiny_target(root: Path, arch="LlamaForCausalLM", model_type="llama", g=TINY) -> Path:
    """A tiny target config.json of the given architecture (TINY geometry, L = 8)."""
    t = root / f"target-{arch}"
    t.mkdir(parents=True, exist_ok=True)
    (t / "config.json").write_text(json.dumps({**target_config(g), "architectures": [arch],
                                               "model_type": model_type}))
    return t


# --- the table ----------------------------------------------------------------------------------


def test_rules_table_rows_ranges_and_pyproject_pin():
    assert [r.read for r in RULES] == list(VERSIONS)
    assert [r.read for r in rules_for("0.5.14").rows] == ["0.5.14"]
    assert [r.read for r in rules_for("0.5.14.post2").rows] == ["0.5.14"]
    between = rules_for("0.5.10")
    assert [r.read for r in between.rows] == ["0.5.6", "0.5.14"] and "between" in between.note
    assert [r.read for r in rules_for("0.5.20rc1").rows] == ["0.5.14", "0.5.23"]
    newer = rules_for("0.6.0")
    assert [r.read for r in newer.rows] == ["0.5.23"] and "newer" in newer.note and newer.supported
    older = rules_for("0.4.6")
    assert not older.supported and "older" in older.note
    assert [r.read for r in rules_for(None).rows] == list(VERSIONS)
    with pytest.raises(ValueError):
        rules_for("latest")
    # a layer num_hidden_layers builds without tensors: refused with N > 1 (0.5.6), served like
    # the one-layer export (0.5.14, the lab), uninitialised as read in the source (0.5.23)
    assert [r.unloaded_layer for r in RULES] == [None, "served", "uninitialised"]
    text = (ROOT / "pyproject.toml").read_text()
    assert f'sglang = ["sglang{SUPPORTED}"]' in text and SUPPORTED == ">=0.5.6,<0.5.24"


def test_draft_token_bound_is_sglangs():
    from eagle3_runner.runner.drafts.checks import check_draft_tokens
    for s, k in [(1, 1), (3, 1), (3, 2), (3, 4), (5, 8), (2, 3)]:
        bound = check_draft_tokens(s, k, None).bound
        assert bound == 1 + k + (s - 1) * k * k
        assert not check_draft_tokens(s, k, bound).too_many
        assert check_draft_tokens(s, k, bound + 1).too_many
    assert not check_draft_tokens(3, 4, 16).too_many  # the notes' legal example


# --- families -----------------------------------------------------------------------------------


@pytest.mark.parametrize("cfg, fam", [
    (kimi_k25(), DEEPSEEK),
    ({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2"}, DEEPSEEK),  # Kimi-K2
    ({"model_type": "deepseek_v3"}, DEEPSEEK),
    ({"architectures": ["DeepseekV32ForCausalLM"]}, DEEPSEEK),
    ({"architectures": ["Glm4MoeLiteForCausalLM"], "model_type": "glm4_moe_lite"}, DEEPSEEK),
    ({"architectures": ["GlmMoeDsaForCausalLM"]}, DEEPSEEK),
    ({"architectures": ["MistralLarge3ForCausalLM"]}, DEEPSEEK),
    ({"model_type": "deepseek2"}, DEEPSEEK),  # GGUF general.architecture
    ({"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss"}, GPT_OSS),
    ({"architectures": ["MiniMaxM3SparseForConditionalGeneration"]}, MINIMAX_M3_VL),
    ({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}, STANDARD),
    ({"architectures": ["Qwen3MoeForCausalLM"]}, STANDARD),
    ({"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe"}, STANDARD),
    ({"architectures": "DeepseekV3ForCausalLM"}, DEEPSEEK),  # a string, not a list
    ({"architectures": [1, None]}, STANDARD), ([1], STANDARD), (None, STANDARD),
    ({"text_config": {"model_type": "deepseek_v3"}}, DEEPSEEK),
])
def test_target_family(cfg, fam):
    assert target_family(cfg) == fam


def test_family_survives_target_config_flattening(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(kimi_k25()))
    cfg = read_target_config(tmp_path)
    assert cfg["num_hidden_layers"] == 61 and cfg["architectures"] == ["KimiK25ForConditionalGeneration"]
    assert target_family(cfg) == DEEPSEEK


def _gguf(path: Path, arch: str, L: int) -> None:
    """A header-only GGUF v3 file: general.architecture and the geometry keys."""
    def s(x):
        b = x.encode()
        return struct.pack("<Q", len(b)) + b
    kv = [("general.architecture", 8, s(arch))] + [
        (f"{arch}.{k}", 4, struct.pack("<I", v)) for k, v in
        (("block_count", L), ("embedding_length", 64), ("attention.head_count", 4),
         ("attention.head_count_kv", 2), ("context_length", 512), ("vocab_size", 1000),
         ("feed_forward_length", 128))]
    body = b"".join(s(k) + struct.pack("<I", t) + v for k, t, v in kv)
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, len(kv)) + body)


def test_gguf_arch_decides_the_family(tmp_path):
    _gguf(tmp_path / "kimi.gguf", "deepseek2", 8)
    _gguf(tmp_path / "llama.gguf", "llama", 8)
    assert target_family(read_target_config(tmp_path / "kimi.gguf")) == DEEPSEEK
    assert target_family(read_target_config(tmp_path / "llama.gguf")) == STANDARD
    d = make_draft(tmp_path, TINY, cfg_edit=lambda c: c["eagle_config"].update(
        eagle_aux_hidden_state_layer_ids=[2, 3, 5]))
    assert "E_AUX_IDS_FAMILY" in errors(inspect_draft(d, tmp_path / "kimi.gguf",
                                                      sglang_version="0.5.14"))
    assert "E_AUX_IDS_FAMILY" not in errors(inspect_draft(d, tmp_path / "llama.gguf",
                                                          sglang_version="0.5.14"))


# --- the layer-id rule per family and version -------------------------------------------------


def test_default_ids_per_family_equal_sglangs():
    for L in (8, 30, 32, 61, 64):
        for fam in (STANDARD, DEEPSEEK, GPT_OSS):
            assert default_aux_ids(L, fam) == [1, L // 2 - 1, L - 4]
            for r in RULES:  # SGLang's default capture [2, L//2, L-3] = our ids + 1
                assert r.default_capture(fam, L) == [k + 1 for k in default_aux_ids(L, fam)]
        assert default_aux_ids(L, MINIMAX_M3_VL) == [2, L // 2, L - 3]  # 0.5.23 minimax_m3_vl.py
        assert default_aux_ids(L, MINIMAX_M3_VL, rules_for("0.5.14")) == [1, L // 2 - 1, L - 4]
    assert default_aux_ids(kimi_k25()) == [1, 29, 57]  # a config: its family and L


def test_deepseek_ids_by_version_property():
    """Over many id lists: for a DeepSeek-family target, 0.5.6 always adds 1; 0.5.14 and 0.5.23
    add 1 only when the first id is 1; only lists starting at 1 pass every version, and the
    standard family is +1 everywhere."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        L = int(rng.integers(8, 100))
        ids = sorted(set(int(x) for x in rng.integers(0, L - 1, 3)))
        if len(ids) != 3:
            continue
        if rng.random() < 0.3:
            ids[0] = 1 if ids[1] > 1 else ids[0]
        ds = check_aux_ids(ids, L, family=DEEPSEEK)
        assert ds.captured["0.5.6"] == [k + 1 for k in ids]
        for v in ("0.5.14", "0.5.23"):
            assert ds.captured[v] == ([k + 1 for k in ids] if ids[0] == 1 else ids)
        assert (not ds.wrong) == (ids[0] == 1)
        assert not check_aux_ids(ids, L, family=STANDARD).wrong
        p = spec_aux_problems(ids, L, DEEPSEEK)
        assert bool(p) == (ids[0] != 1) and all("first id must be 1" in m for m in p)
        assert (model_aux_problem(ids, L, DEEPSEEK) is None) == (ids[0] == 1)
        assert (export_aux_problem(ids, L, DEEPSEEK) is None) == (ids[0] == 1)


def test_gpt_oss_final_layer_capture_only_on_0523():
    L = 24
    assert rules_for("0.5.23").rows[0].aux_id_range(GPT_OSS, L) == (0, L - 1)
    assert rules_for("0.5.14").rows[0].aux_id_range(GPT_OSS, L) == (0, L - 2)
    assert rules_for("0.5.23").rows[0].capture(GPT_OSS, [2, 12, L], L) == [2, 12, L]  # as-is
    assert rules_for("0.5.14").rows[0].capture(GPT_OSS, [2, 12, L], L) == [3, 13, L + 1]
    assert spec_aux_problems([1, 11, L - 1], L, GPT_OSS)  # out of range on 0.5.6/0.5.14


def _ds_draft(tmp_path, ids, name="draft", prov=None):
    t = tiny_target(tmp_path, "DeepseekV3ForCausalLM", "kimi_k2")
    d = make_draft(tmp_path, geometry(**{**TINY, "ids": ids}), name=name, provenance=prov)
    return d, t


def test_deepseek_first_id_rule_in_inspect_per_version(tmp_path):
    d, t = _ds_draft(tmp_path, [2, 3, 5])
    for v in ("0.5.14", "0.5.23", "0.5.10"):
        f = inspect_draft(d, t, sglang_version=v)
        assert errors(f) == ["E_AUX_IDS_FAMILY"], (v, f)
        m = msg(f, "E_AUX_IDS_FAMILY")
        assert "first id must be 1" in m and "DeepSeek" in m and "architectures" in m
        assert "subtract 1: [1, 2, 4]" in m  # [2, 3, 5] as HF indices -> [1, 2, 4] starts at 1
    f = inspect_draft(d, t, sglang_version="0.5.6")  # +1 as everywhere: right, not portable
    assert errors(f) == [] and "W_AUX_IDS_NOT_PORTABLE" in codes(f)
    d0, _ = _ds_draft(tmp_path, [0, 3, 5], name="zero")
    m = msg(inspect_draft(d0, t, sglang_version="0.5.23"), "E_AUX_IDS_FAMILY")
    assert "subtract 1" not in m and "embedding" in m  # [-1, ...] is no list: no HF hint
    ok, _ = _ds_draft(tmp_path, [1, 3, 5], name="ok")
    for v in VERSIONS:
        assert inspect_draft(ok, t, sglang_version=v) == []
    # the same ids on a standard target are fine everywhere
    std = tiny_target(tmp_path)
    for v in VERSIONS:
        assert errors(inspect_draft(d, std, sglang_version=v)) == []


def test_provenance_decides_what_training_captured(tmp_path):
    """HF [2, 3, 5] trained, ids written as HF indices: right on 0.5.14+ for DeepSeek (as-is),
    off by one on 0.5.6; for a standard target off by one everywhere."""
    prov = {"features": {"hf_hidden_indices": [2, 3, 5]}}
    d, t = _ds_draft(tmp_path, [2, 3, 5], prov=prov)
    f = inspect_draft(d, t, sglang_version="0.5.6")
    assert errors(f) == ["E_AUX_IDS_OFF_BY_ONE"] and "[1, 2, 4]" in msg(f, "E_AUX_IDS_OFF_BY_ONE")
    f = inspect_draft(d, t, sglang_version="0.5.23")
    assert errors(f) == [] and "W_AUX_IDS_NOT_PORTABLE" in codes(f)
    assert "[1, 2, 4]" in msg(f, "W_AUX_IDS_NOT_PORTABLE")
    f = inspect_draft(d, tiny_target(tmp_path), sglang_version="0.5.23")
    assert errors(f) == ["E_AUX_IDS_OFF_BY_ONE"]


def test_spec_family_declared_detected_and_conflicting(tmp_path):
    from eagle3_runner.runner.errors import SpecError
    from eagle3_runner.runner.spec.load import load_spec
    base = {"name": "k", "target": {"path": "/nonexistent/Kimi", "num_hidden_layers": 61,
                                    "hidden_size": 7168, "vocab_size": 163840},
            "drafter": {"draft_vocab_size": 32000, "aux_layer_ids": [2, 30, 57]}}
    assert load_spec(data=base).aux_ids == [2, 30, 57]  # family unknown: standard
    with pytest.raises(SpecError, match="first id must be 1"):
        load_spec(data={**base, "target": {**base["target"], "family": "deepseek"}})
    (tmp_path / "config.json").write_text(json.dumps(kimi_k25()))
    real = {**base, "target": {"path": str(tmp_path)}}
    with pytest.raises(SpecError, match="first id must be 1"):
        load_spec(data=real)  # detected from config.json
    with pytest.raises(SpecError, match="target.family"):
        load_spec(data={**real, "target": {"path": str(tmp_path), "family": "standard"}})
    spec = load_spec(data={**real, "drafter": {"draft_vocab_size": 32000}})
    assert spec.target.family == DEEPSEEK and spec.aux_ids == [1, 29, 57]


def test_extract_rule_reads_the_loaded_targets_family():
    assert model_aux_problem([2, 3, 5], 8, DEEPSEEK) and model_aux_problem([2, 3, 5], 8) is None


# --- forward flags per version ------------------------------------------------------------------


def _fc_norm(ts, legacy=False):
    names = ("aux_norm_low", "aux_norm_mid", "aux_norm_high") if legacy else \
        [f"fc_norm.{i}" for i in range(3)]
    for n in names:
        ts[f"{n}.weight"] = ("BF16", [TINY["H"]], None)


@pytest.mark.parametrize("legacy", [False, True])
def test_fc_norm_read_from_0514(tmp_path, legacy):
    d = make_draft(tmp_path, TINY, cfg_edit=lambda c: c.update(fc_norm=True),
                   tensor_edit=lambda ts: _fc_norm(ts, legacy))
    t = d.parent / "target"
    f = inspect_draft(d, t, sglang_version="0.5.6")
    assert errors(f) == ["E_FLAG_IGNORED"] and "0.5.6 never reads it" in msg(f, "E_FLAG_IGNORED")
    for v in ("0.5.14", "0.5.23"):
        f = inspect_draft(d, t, sglang_version=v)
        assert errors(f) == [] and "W_NOT_PORTABLE" in codes(f)
        assert "W_ENGINE_UNSUPPORTED" not in codes(f)  # the embedded engine runs fc_norm
    no_t = make_draft(tmp_path, TINY, name="nt", cfg_edit=lambda c: c.update(use_aux_norm=True))
    f = inspect_draft(no_t, t, sglang_version="0.5.14")
    assert errors(f) == ["E_KEY_MISSING"] and "fc_norm.0.weight" in msg(f, "E_KEY_MISSING")
    off = make_draft(tmp_path, TINY, name="off", tensor_edit=_fc_norm)
    for v in VERSIONS:  # tensors without the flag: dropped everywhere
        assert errors(inspect_draft(off, t, sglang_version=v)) == ["E_FLAG_TENSORS"]


def test_norm_before_fc_read_only_by_0523(tmp_path):
    def tens(ts):
        ts["input_norm.weight"] = ("BF16", [3 * TINY["H"]], None)
    for where in ("top", "eagle_config"):
        edit = (lambda c: c.update(norm_before_fc=True)) if where == "top" else \
            (lambda c: c["eagle_config"].update(norm_before_fc=True))
        d = make_draft(tmp_path, TINY, name=where, cfg_edit=edit, tensor_edit=tens)
        t = d.parent / "target"
        for v in ("0.5.6", "0.5.14"):
            assert errors(inspect_draft(d, t, sglang_version=v)) == ["E_FLAG_IGNORED"]
        assert errors(inspect_draft(d, t, sglang_version="0.5.23")) == []
    miss = make_draft(tmp_path, TINY, name="miss", cfg_edit=lambda c: c.update(norm_before_fc=True))
    f = inspect_draft(miss, miss.parent / "target", sglang_version="0.5.23")
    assert errors(f) == ["E_KEY_MISSING"] and "input_norm.weight" in msg(f, "E_KEY_MISSING")


def test_norm_output_residual_and_num_aux(tmp_path):
    t = tmp_path / "target"
    d = make_draft(tmp_path, TINY, cfg_edit=lambda c: c.update(norm_output=True))
    assert errors(inspect_draft(d, t, sglang_version="0.5.6")) == ["E_FLAG_IGNORED"]
    assert errors(inspect_draft(d, t, sglang_version="0.5.14")) == []
    d = make_draft(tmp_path, TINY, name="nbr", cfg_edit=lambda c: c.update(norm_before_residual=True))
    for v in VERSIONS:
        assert errors(inspect_draft(d, t, sglang_version=v)) == ["E_FLAG_NEVER_READ"]
    d = make_draft(tmp_path, TINY, name="na", cfg_edit=lambda c: c.update(num_aux_hidden_states=4))
    for v in VERSIONS:
        assert "E_FLAG_NUM_AUX" in errors(inspect_draft(d, t, sglang_version=v))
    d = make_draft(tmp_path, TINY, name="aux", cfg_edit=lambda c: c["eagle_config"].update(
        use_aux_hidden_state=False))
    assert errors(inspect_draft(d, t, sglang_version="0.5.6")) == []  # 0.5.6 never reads it
    f = inspect_draft(d, t, sglang_version="0.5.14")
    assert errors(f) == ["E_AUX_DISABLED"]
    # the draft accepts less, not nothing (the lab, H100, 0.5.14, 2026-12-07: 1.141 vs 1.409)
    assert "last hidden state" in msg(f, "E_AUX_DISABLED") and "not nothing" in msg(f, "E_AUX_DISABLED")


def test_biases_per_version(tmp_path):
    t = tmp_path / "target"
    H = TINY["H"]
    d = make_draft(tmp_path, TINY, cfg_edit=lambda c: c.update(attention_bias=True))
    f = inspect_draft(d, t, sglang_version="0.5.6")
    assert errors(f) == ["E_O_PROJ_BIAS"] and "uninitialised" in msg(f, "E_O_PROJ_BIAS")
    f = inspect_draft(d, t, sglang_version="0.5.23")
    assert errors(f) == [] and "W_O_PROJ_BIAS" in codes(f)
    ok = make_draft(tmp_path, TINY, name="ok", cfg_edit=lambda c: c.update(attention_bias=True),
                    tensor_edit=lambda ts: ts.update({"midlayer.self_attn.o_proj.bias": ("BF16", [H], None)}))
    assert all(errors(inspect_draft(ok, t, sglang_version=v)) == [] for v in VERSIONS)
    fcb = make_draft(tmp_path, TINY, name="fcb", cfg_edit=lambda c: c.update(bias=True),
                     tensor_edit=lambda ts: ts.update({"fc.bias": ("BF16", [H], None)}))
    assert errors(inspect_draft(fcb, t, sglang_version="0.5.6")) == ["E_O_PROJ_BIAS"]
    qb = make_draft(tmp_path, TINY, name="qb", tensor_edit=lambda ts: ts.update(
        {"midlayer.self_attn.q_proj.bias": ("BF16", [64], None)}))
    for v in VERSIONS:
        f = inspect_draft(qb, t, sglang_version=v)
        assert errors(f) == ["E_KEY_UNKNOWN"] and "q/k/v_proj never" in msg(f, "E_KEY_UNKNOWN")
    ob = make_draft(tmp_path, TINY, name="ob", tensor_edit=lambda ts: ts.update(
        {"midlayer.self_attn.o_proj.bias": ("BF16", [H], None)}))
    assert errors(inspect_draft(ob, t)) == ["E_KEY_UNKNOWN"]


@pytest.mark.parametrize("dtype, ok", [(None, False), ("float32", False), ("float", False),
                                       ("int8", False), ("bfloat16", True), ("float16", True)])
def test_draft_dtype_under_dtype_auto(tmp_path, dtype, ok):
    def edit(c):
        c.pop("torch_dtype")
        if dtype:
            c["dtype"] = dtype
    f = inspect_draft(make_draft(tmp_path, TINY, cfg_edit=edit), tmp_path / "target")
    assert ("E_DRAFT_DTYPE" not in errors(f)) == ok
    if not ok:
        assert "float16" in msg(f, "E_DRAFT_DTYPE") and "torch_dtype: bfloat16" in msg(f, "E_DRAFT_DTYPE")


@pytest.mark.parametrize("shape", [[1, TINY["Vd"]], [TINY["Vd"], 1], []])
def test_d2t_of_the_wrong_rank(tmp_path, shape):
    def edit(ts):
        _, _, v = ts["d2t"]
        ts["d2t"] = ("I64", shape, v.reshape(shape) if shape else v[:1].reshape(()))
    f = inspect_draft(make_draft(tmp_path, TINY, tensor_edit=edit), tmp_path / "target")
    assert "E_D2T_RANK" in errors(f)


# --- several files, an index --------------------------------------------------------------------


def _split(d: Path, dup: bool = False) -> None:
    """Move lm_head into a second file (copied too when dup)."""
    cfg = json.loads((d / "config.json").read_text())
    ts = tensors(cfg, dense=True)
    head = {"lm_head.weight": ts["lm_head.weight"]}
    if not dup:
        ts.pop("lm_head.weight")
    write_st(d / "model-00001.safetensors", ts)
    write_st(d / "model-00002.safetensors", head)
    (d / "model.safetensors").unlink()


def test_tensor_in_two_files_and_index(tmp_path):
    t = tmp_path / "target"
    d = make_draft(tmp_path, TINY)
    _split(d)
    assert errors(inspect_draft(d, t)) == []
    d2 = make_draft(tmp_path, TINY, name="dup")
    _split(d2, dup=True)
    f = inspect_draft(d2, t)
    assert errors(f) == ["E_DUPLICATE_TENSOR"] and "later" in msg(f, "E_DUPLICATE_TENSOR")
    # an index naming only the first file: the second is not loaded
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"fc.weight": "model-00001.safetensors"}}))
    f = inspect_draft(d, t)
    assert "W_INDEX_EXCLUDES" in codes(f) and "E_KEY_MISSING" in errors(f)
    (d / "model.safetensors.index.json").write_text("{not json")
    assert "E_INDEX" in errors(inspect_draft(d, t))
    both = make_draft(tmp_path, TINY, name="both", tensor_edit=lambda ts: ts.update(
        {"layers.0.norm_x": ts["midlayer.hidden_norm.weight"]}))  # unknown name: dropped
    assert "E_KEY_UNKNOWN" in errors(inspect_draft(both, t))


def test_midlayer_and_layers0_both_present_load_twice_on_0514(tmp_path):
    def edit(ts):
        ts["layers.0.hidden_norm.weight"] = ts["midlayer.hidden_norm.weight"]
    d = make_draft(tmp_path, TINY, tensor_edit=edit)
    f = inspect_draft(d, tmp_path / "target", sglang_version="0.5.14")
    assert errors(f) == ["E_DUPLICATE_TENSOR"]
    assert errors(inspect_draft(d, tmp_path / "target", sglang_version="0.5.6")) == ["E_KEY_LAYERS0"]


# --- weights: dtype and NaN (issue 21 item 1) --------------------------------------------------


def test_nonfinite_and_nonfloat_weights(tmp_path):
    t = tmp_path / "target"

    def nan(ts):
        _, shape, v = ts["midlayer.mlp.up_proj.weight"]
        v = v.copy()
        v.reshape(-1)[5] = 0x7FC0  # bf16 NaN
        ts["midlayer.mlp.up_proj.weight"] = ("BF16", shape, v)
    f = inspect_draft(make_draft(tmp_path, TINY, dense=True, tensor_edit=nan), t)
    assert errors(f) == ["E_NONFINITE"] and "up_proj" in msg(f, "E_NONFINITE")
    big = make_draft(tmp_path / "b", tensor_edit=lambda ts: ts.update(  # Llama-8B sparse
        {"fc.weight": ("F32", [4096, 12288], np.full(16, np.inf, np.float32))}))
    f = inspect_draft(big, tmp_path / "b" / "target")
    assert errors(f) == ["E_NONFINITE"] and "sampled" in msg(f, "E_NONFINITE")
    assert any("sampled" in n for n in f.notes)
    i8 = make_draft(tmp_path, TINY, name="i8", tensor_edit=lambda ts: ts.update(
        {"norm.weight": ("U8", [TINY["H"]], None)}))
    assert errors(inspect_draft(i8, t)) == ["E_WEIGHT_DTYPE"]


def test_unknown_weight_dtype(tmp_path):
    d = make_draft(tmp_path, TINY)
    p = d / "model.safetensors"
    raw = p.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    h = json.loads(raw[8:8 + n])
    h["norm.weight"]["dtype"] = "Q4_K"
    hb = json.dumps(h).encode()
    hb += b" " * (n - len(hb)) if len(hb) <= n else b""
    assert len(hb) == n
    p.write_bytes(raw[:8] + hb + raw[8 + n:])
    assert "E_WEIGHT_DTYPE" in errors(inspect_draft(d, tmp_path / "target"))


# --- the server line per version ----------------------------------------------------------------


def _line(d, extra="", env=""):
    return (f"{env} python -m sglang.launch_server --model-path m --speculative-algorithm EAGLE3 "
            f"--speculative-draft-model-path {d} --speculative-num-steps 3 "
            f"--speculative-eagle-topk 1 --speculative-num-draft-tokens 4 {extra}").strip()


@pytest.mark.parametrize("extra, env, expect", [
    ("--quantization fp8", "", {"0.5.6": ["W_DRAFT_QUANTIZED", "W_NOT_PORTABLE"],
                                "0.5.14": ["E_DRAFT_QUANTIZED"],
                                "0.5.23": ["E_DRAFT_QUANTIZED"]}),
    ("--quantization fp8 --speculative-draft-model-quantization unquant", "",
     {"0.5.6": ["E_SERVER_FLAG_VERSION", "W_DRAFT_QUANTIZED"], "0.5.14": ["W_NOT_PORTABLE"],
      "0.5.23": ["W_NOT_PORTABLE"]}),
    ("--quantization unquant", "", {v: [] for v in VERSIONS}),
    ("--speculative-draft-load-format dummy", "", {v: ["E_DRAFT_DUMMY"] for v in VERSIONS}),
    ("--load-format dummy", "", {v: ["E_DRAFT_DUMMY"] for v in VERSIONS}),
    ("--speculative-draft-window-size 512", "",
     {"0.5.6": ["E_SERVER_FLAG_VERSION"], "0.5.14": ["W_DRAFT_WINDOW", "W_NOT_PORTABLE"],
      "0.5.23": ["W_DRAFT_WINDOW", "W_NOT_PORTABLE"]}),
    ("--kv-cache-dtype fp8_e4m3", "", {v: ["W_DRAFT_KV_FP8"] for v in VERSIONS}),
    ("--kv-cache-dtype fp8_e4m3 --speculative-draft-kv-cache-dtype bfloat16", "",
     {"0.5.6": ["E_SERVER_FLAG_VERSION", "W_DRAFT_KV_FP8"],
      "0.5.14": ["E_SERVER_FLAG_VERSION", "W_DRAFT_KV_FP8"], "0.5.23": ["W_NOT_PORTABLE"]}),
    ("--speculative-accept-threshold-single 0.5", "", {v: ["E_ACCEPT_THRESHOLD"] for v in VERSIONS}),
    ("--speculative-accept-threshold-acc=0.9", "", {v: ["E_ACCEPT_THRESHOLD"] for v in VERSIONS}),
    ("--speculative-accept-threshold-single 1.0", "", {v: [] for v in VERSIONS}),
    ("--speculative-adaptive", "", {"0.5.6": ["E_SERVER_FLAG_VERSION"],
                                    "0.5.14": ["W_SPEC_ADAPTIVE", "W_NOT_PORTABLE"],
                                    "0.5.23": ["W_SPEC_ADAPTIVE", "W_NOT_PORTABLE"]}),
    ("", "SGLANG_SIMULATE_ACC_LEN=3.5", {v: ["E_SIMULATE_ACC_LEN"] for v in VERSIONS}),
    ("", "env SGLANG_SIMULATE_ACC_LEN=2", {v: ["E_SIMULATE_ACC_LEN"] for v in VERSIONS}),
    ("", "SGLANG_SIMULATE_ACC_LEN=-1", {v: [] for v in VERSIONS}),
    ("--context-length 4096", "", {v: ["E_MAX_POSITION_EMBEDDINGS"] for v in VERSIONS}),
])
def test_server_line_checks_per_version(tmp_path, extra, env, expect):
    d = make_draft(tmp_path, TINY)
    for v, want in expect.items():
        f = inspect_draft(d, tmp_path / "target", _line(d, extra, env), sglang_version=v)
        assert sorted(codes(f)) == sorted(want), (v, f)


def test_server_line_messages_are_true_for_the_version(tmp_path):
    d = make_draft(tmp_path, TINY)
    t = tmp_path / "target"
    f = inspect_draft(d, t, _line(d, "--context-length 4096"), sglang_version="0.5.14")
    assert "refuses to start" in msg(f, "E_MAX_POSITION_EMBEDDINGS")
    f = inspect_draft(d, t, _line(d, "--context-length 4096",
                                  "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1"))
    assert "silently" in msg(f, "E_MAX_POSITION_EMBEDDINGS")
    low = _line(d).replace("EAGLE3", "eagle3")
    f = inspect_draft(d, t, low, sglang_version="0.5.6")
    assert errors(f) == ["E_ALGORITHM_CASE"]
    f = inspect_draft(d, t, low, sglang_version="0.5.23")
    assert errors(f) == [] and codes(f) == ["W_NOT_PORTABLE"]
    partial = _line(d).replace("--speculative-num-draft-tokens 4", "")
    f = inspect_draft(d, t, partial)
    assert errors(f) == ["E_SERVER_SPEC_PARAMS"] and "asserts" in msg(f, "E_SERVER_SPEC_PARAMS")
    tree = _line(d).replace("topk 1", "topk 4").replace("draft-tokens 4", "draft-tokens 16")
    assert inspect_draft(d, t, tree) == []
    assert inspect_draft(d, t, tree.replace("draft-tokens 16", "draft-tokens 37")) == []
    f = inspect_draft(d, t, tree.replace("draft-tokens 16", "draft-tokens 38"))  # 1+4+2*16 = 37
    assert errors(f) == ["E_SERVER_DRAFT_TOKENS"] and "= 37" in msg(f, "E_SERVER_DRAFT_TOKENS")
    f = inspect_draft(d, t, _line(d, "--foo 'unbalanced"))
    assert errors(f) == ["E_SERVER_ARGS_PARSE"] and "quotes" in msg(f, "E_SERVER_ARGS_PARSE")


def test_bench_backend_refuses_simulated_acceptance():
    from eagle3_runner.runner.drafts.server import simulate_acc_len_problem
    assert simulate_acc_len_problem({"SGLANG_SIMULATE_ACC_LEN": "2.5"})
    assert simulate_acc_len_problem({"SGLANG_SIMULATE_ACC_LEN": "x"})
    assert not simulate_acc_len_problem({"SGLANG_SIMULATE_ACC_LEN": "-1"})
    assert not simulate_acc_len_problem({})


# --- the version reported; the installed sglang's version ---------------------------------------


def test_cli_reports_the_version_and_reads_installed_metadata(tmp_path):
    d = make_draft(tmp_path, TINY)
    site = tmp_path / "site"
    (site / "sglang-0.5.14.dist-info").mkdir(parents=True)
    (site / "sglang-0.5.14.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.14\n")
    code = ("import sys, json; from eagle3_runner.runner.cli import main; "
            "sys.exit(main(['inspect', sys.argv[1], '--json'] + sys.argv[2:]))")
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "-c", code, str(d)], cwd=ROOT, capture_output=True,
                       text=True, env=env)
    out = json.loads(r.stdout)
    assert out["sglang"]["asked"] == "0.5.14" and out["sglang"]["source"] == "installed sglang"
    assert "sglang" not in r.stderr.lower() or "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "-c", code, str(d), "--sglang-version", "0.5.8"],
                       cwd=ROOT, capture_output=True, text=True, env=env)
    out = json.loads(r.stdout)
    assert out["sglang"]["rules"] == ["0.5.6", "0.5.14"] and "between" in out["sglang"]["note"]
    r = subprocess.run([sys.executable, "-m", "eagle3_runner.runner", "inspect", str(d),
                        "--sglang-version", "nope"], cwd=ROOT, capture_output=True, text=True,
                       env=env)
    assert r.returncode == 1 and "E_SGLANG_VERSION" in r.stdout and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "eagle3_runner.runner", "inspect", str(d)], cwd=ROOT,
                       capture_output=True, text=True, env={**env, "PYTHONPATH": ""})
    assert "sglang 0.5.23 (newest version the table knows" in r.stdout


# --- the embedded engine refuses what it does not implement -----------------------------------


@pytest.mark.parametrize("edit", [
    {"norm_before_residual": True},
    {"attention_bias": True}, {"bias": True}, {"num_hidden_layers": 2},
    {"num_aux_hidden_states": 4}, {"target_hidden_size": 32},
    {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 5], "norm_before_fc": True}}])
def test_embedded_engine_refuses_unimplemented_forward(edit):
    from draft_fixtures import sglang_config
    from eagle3_runner.models.draft_model import DraftConfig
    from eagle3_runner.runner.errors import UnsupportedDraftError
    cfg = sglang_config(TINY)
    assert DraftConfig.from_sglang(cfg).hidden_size == TINY["H"]
    with pytest.raises(UnsupportedDraftError, match=next(iter(edit)) if "eagle_config" not in edit
                       else "norm_before_fc"):
        DraftConfig.from_sglang({**cfg, **edit})


@pytest.mark.parametrize("edit,fc_norm,norm_output", [
    ({"fc_norm": True}, True, False), ({"use_aux_norm": True}, True, False),
    ({"norm_output": True}, False, True), ({"fc_norm": False, "norm_output": False}, False, False)])
def test_embedded_engine_runs_eagle31_flags(edit, fc_norm, norm_output):
    """fc_norm (or the legacy use_aux_norm) and norm_output are SGLang 0.5.14's EAGLE 3.1 forward,
    which models/draft_model.py implements: read, not refused."""
    from draft_fixtures import sglang_config
    from eagle3_runner.models.draft_model import DraftConfig
    c = DraftConfig.from_sglang({**sglang_config(TINY), **edit})
    assert (c.fc_norm, c.norm_output) == (fc_norm, norm_output)


# --- the seed deployment: specs/drafter-v2.yaml and an export-like Kimi-K2.5 drafter ---------


def test_drafter_v2_spec_and_export_like_kimi_drafter_pass_every_version(tmp_path):
    """The spec validates; its drafter, built as export builds it (DraftConfig.from_spec ->
    jobs/export.sglang_config) with the real Kimi-K2.5 shapes (a sparse file: the header
    declares them, no data is written), and its bench server lines pass inspect on 0.5.6,
    0.5.14 and 0.5.23 against a Kimi-K2.5 target config."""
    from eagle3_runner.models.draft_model import DraftConfig
    from eagle3_runner.jobs.export import sglang_config
    from eagle3_runner.targets.sglang import server_argv
    from eagle3_runner.runner.spec.load import load_spec
    spec = load_spec(ROOT / "specs/drafter-v2.yaml")
    assert spec.target.family == DEEPSEEK and spec.aux_ids == [1, 29, 57]
    tdir = tmp_path / "Kimi-K2.5"
    tdir.mkdir()
    (tdir / "config.json").write_text(json.dumps(kimi_k25()))
    tcfg = read_target_config(tdir)
    cfg = sglang_config(DraftConfig.from_spec(spec, tcfg), tcfg, spec.stages.bench.context_length)
    assert cfg["torch_dtype"] == "bfloat16"
    d = tmp_path / "export"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    write_st(d / "model.safetensors", tensors(cfg))
    assert (d / "model.safetensors").stat().st_size > 2 << 30  # the real sizes, sparse
    for v in VERSIONS:
        for c in spec.stages.bench.configs:
            argv = server_argv("python3", str(tdir), 30000, tp=8, draft_path=str(d),
                               num_steps=c.num_steps, eagle_topk=c.eagle_topk,
                               num_draft_tokens=c.draft_tokens, cuda_graph_max_bs=8,
                               context_length=spec.stages.bench.context_length)
            f = inspect_draft(d, tdir, shlex.join(argv), sglang_version=v)
            assert f == [], (v, f)
    # the seed run's HF-form ids would fail on the versions that read them differently
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 30, 58]
    (d / "config.json").write_text(json.dumps(cfg))
    assert errors(inspect_draft(d, tdir, sglang_version="0.5.23")) == ["E_AUX_IDS_FAMILY"]
