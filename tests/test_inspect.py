"""`runner inspect`: the issue's handed cases (1-7, 9-13; case 8 is the vocab builder's) and the
other silent failures, on synthetic drafters with the issue's real shapes (sparse files)."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from draft_fixtures import (LLAMA8B, TINY, codes, errors, geometry, make_draft, msg,
                            target_config, used_ids)
from eagle3_runner.runner.cli import main as cli_main
from eagle3_runner.runner.inspect import inspect_draft

ROOT = Path(__file__).resolve().parent.parent


def run(d, server_args=None, target="default", v=None):
    t = d.parent / "target" if target == "default" else target
    return inspect_draft(d, target=t, server_args=server_args, sglang_version=v)


GOOD_ARGS = ("python -m sglang.launch_server --model-path meta-llama/Llama-3.1-8B-Instruct "
             "--speculative-algorithm EAGLE3 --speculative-draft-model-path {d} "
             "--speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4")


def test_clean_llama8b_draft_has_no_findings(tmp_path):
    d = make_draft(tmp_path)
    f = run(d, GOOD_ARGS.format(d=d))
    assert f == [], f


def test_no_target_is_a_warning_only(tmp_path):
    f = inspect_draft(make_draft(tmp_path), target=None)
    assert codes(f) == ["W_NO_TARGET"]


# --- handed cases ------------------------------------------------------------------------------


def test_case01_algorithm_eagle_instead_of_eagle3(tmp_path):
    d = make_draft(tmp_path)
    f = run(d, GOOD_ARGS.format(d=d).replace("EAGLE3", "EAGLE"))
    assert errors(f) == ["E_ALGORITHM_NOT_EAGLE3"]
    assert "--speculative-algorithm EAGLE3" in msg(f, "E_ALGORITHM_NOT_EAGLE3")


def test_case02_draft_vocab_size_null(tmp_path):
    d = make_draft(tmp_path, cfg_edit=lambda c: c.update(draft_vocab_size=None))
    f = run(d)
    assert "E_DRAFT_VOCAB_NULL" in errors(f)
    # SGLang 0.5.14 refuses a reduced-vocab head at load (the lab, H100, 2026-12-07); it does
    # not serve a collapsed draft
    assert "refuses to start" in msg(f, "E_DRAFT_VOCAB_NULL")
    assert "collapse" not in msg(f, "E_DRAFT_VOCAB_NULL")


def test_case03_layers0_keys(tmp_path):
    def edit(ts):
        for k in [k for k in ts if k.startswith("midlayer.")]:
            ts["layers.0." + k[len("midlayer."):]] = ts.pop(k)
    d = make_draft(tmp_path, tensor_edit=edit)
    f = run(d, v="0.5.6")  # 0.5.6 knows only midlayer.*
    assert errors(f) == ["E_KEY_LAYERS0"]
    assert "midlayer" in msg(f, "E_KEY_LAYERS0") and "runner convert" in msg(f, "E_KEY_LAYERS0")
    assert "0.5.6" in msg(f, "E_KEY_LAYERS0")
    for v in ("0.5.14", "0.5.23", "0.5.30"):  # loaded natively; portability warning only
        f = run(d, v=v)
        assert errors(f) == [] and "0.5.6" in msg(f, "W_NOT_PORTABLE"), (v, f)
    assert errors(run(d, v="0.5.10")) == ["E_KEY_LAYERS0"]  # between rows: both apply


def test_case04_off_by_one_against_provenance(tmp_path):
    prov = {"features": {"hf_hidden_indices": [2, 16, 29]}}
    d = make_draft(tmp_path, geometry(ids=[2, 16, 29]), provenance=prov)
    f = run(d)
    assert errors(f) == ["E_AUX_IDS_OFF_BY_ONE"]
    assert "[1, 15, 28]" in msg(f, "E_AUX_IDS_OFF_BY_ONE")
    # the same provenance with the right SGLang ids is clean
    ok = make_draft(tmp_path, geometry(ids=[1, 15, 28]), provenance=prov, name="ok")
    assert run(ok) == []


def test_case05_fc_over_all_hidden_states(tmp_path):
    d = make_draft(tmp_path, tensor_edit=lambda ts: ts.update(
        {"fc.weight": ("BF16", [4096, 135168], None)}))
    f = run(d)
    assert errors(f) == ["E_FC_WIDTH"]
    m = msg(f, "E_FC_WIDTH")
    assert "3 x 4096 = 12288" in m and "33" in m and "135168" in m


def test_case06_reduced_head_without_d2t(tmp_path):
    d = make_draft(tmp_path, tensor_edit=lambda ts: ts.pop("d2t"))
    f = run(d)
    assert "E_D2T_MISSING" in errors(f)
    assert "32000" in msg(f, "E_D2T_MISSING")


def _absolute_d2t(ts):
    dt, shape, _ = ts["d2t"]
    ts["d2t"] = (dt, shape, used_ids(shape[0], LLAMA8B["V"]))


def test_case07_d2t_absolute_ids(tmp_path):
    f = run(make_draft(tmp_path, tensor_edit=_absolute_d2t))
    assert errors(f) == ["E_D2T_ABSOLUTE"]
    assert "offsets" in msg(f, "E_D2T_ABSOLUTE")


def test_case07_absolute_ids_inside_vocab_caught_through_t2d(tmp_path):
    # Every i + d2t[i] stays < vocab (small draft vocab) but d2t's values are t2d's ids.
    g = geometry(Vd=2000)
    f = run(make_draft(tmp_path, g, tensor_edit=_absolute_d2t))
    assert errors(f) == ["E_D2T_ABSOLUTE"]


def test_case09_max_position_embeddings_below_serving_context(tmp_path):
    d = make_draft(tmp_path, cfg_edit=lambda c: c.update(max_position_embeddings=2048))
    m = msg(run(d), "E_MAX_POSITION_EMBEDDINGS")
    assert "2048" in m and "8192" in m
    # also from the server's --context-length when the target says less
    d2 = make_draft(tmp_path / "b", geometry(ctx=2048))
    f = run(d2, GOOD_ARGS.format(d=d2) + " --context-length 8192")
    assert errors(f) == ["E_MAX_POSITION_EMBEDDINGS"]


def test_case10_draft_hidden_differs_without_target_hidden_size(tmp_path):
    g = geometry(H=8192, hd=256)
    fc = lambda ts: ts.update({"fc.weight": ("BF16", [8192, 3 * 4096], None)})  # noqa: E731
    d = make_draft(tmp_path, g, tensor_edit=fc)
    (tmp_path / "target" / "config.json").write_text(json.dumps(target_config(LLAMA8B)))
    f = run(d)
    assert "E_TARGET_HIDDEN_SIZE" in errors(f)
    m = msg(f, "E_TARGET_HIDDEN_SIZE")
    assert "target_hidden_size: 4096" in m and "8192" in m
    # declaring target_hidden_size fixes it
    # declaring target_hidden_size switches off the embedding swap: the draft's own embedding
    # must be in the file (SGLang llama.py set_embed)
    no_emb = make_draft(tmp_path, g, name="no_emb", tensor_edit=fc,
                        cfg_edit=lambda c: c.update(target_hidden_size=4096))
    f = run(no_emb)
    assert errors(f) == ["E_KEY_MISSING"] and "embed_tokens.weight" in msg(f, "E_KEY_MISSING")
    ok = make_draft(tmp_path, g, name="ok", tensor_edit=lambda ts: (fc(ts), ts.update(
        {"embed_tokens.weight": ("BF16", [128256, 8192], None)})),
                    cfg_edit=lambda c: c.update(target_hidden_size=4096))
    assert codes(run(ok)) == ["W_ENGINE_UNSUPPORTED"]  # our engine swaps in the target's


def test_case11_head_dim_mismatch(tmp_path):
    g = geometry(H=2560, heads=32, kv=8, hd=128)
    d = make_draft(tmp_path, g, tensor_edit=lambda ts: ts.update(
        {"midlayer.self_attn.q_proj.weight": ("BF16", [5120, 2 * 2560], None)}))
    f = run(d)
    assert "E_HEAD_DIM" in errors(f)
    m = msg(f, "E_HEAD_DIM")
    assert "head_dim" in m and "32 x 128 = 4096" in m and "5120" in m and "160" in m


def test_case12_no_draft_vocab_size_key(tmp_path):
    d = make_draft(tmp_path, cfg_edit=lambda c: c.pop("draft_vocab_size"))
    assert "E_DRAFT_VOCAB_MISSING" in errors(run(d))


def test_case13_eagle3_without_draft_path(tmp_path):
    d = make_draft(tmp_path)
    args = "python -m sglang.launch_server --model-path X --speculative-algorithm EAGLE3"
    f = run(d, args)
    assert errors(f) == ["E_SERVER_NO_DRAFT_PATH"]


# --- the rest of the list --------------------------------------------------------------


def test_topk1_num_draft_tokens_not_steps_plus_one(tmp_path):
    d = make_draft(tmp_path)
    f = run(d, GOOD_ARGS.format(d=d).replace("num-draft-tokens 4", "num-draft-tokens=8"))
    assert errors(f) == ["E_SERVER_DRAFT_TOKENS"]
    assert "num_steps+1 = 4" in msg(f, "E_SERVER_DRAFT_TOKENS")


@pytest.mark.parametrize("prefix", ["draft_model.", "module."])
def test_training_prefix(tmp_path, prefix):
    f = run(make_draft(tmp_path, tensor_edit=lambda ts: ts.update(
        {prefix + k: ts.pop(k) for k in list(ts)})))
    assert errors(f) == ["E_KEY_PREFIX"]


def test_model_prefix_lm_head_is_dropped_but_midlayer_loads(tmp_path):
    f = run(make_draft(tmp_path, tensor_edit=lambda ts: ts.update(
        {"model." + k: ts.pop(k) for k in list(ts)})))
    assert errors(f) == ["E_KEY_PREFIX"] and "model.lm_head.weight" in msg(f, "E_KEY_PREFIX")
    f = run(make_draft(tmp_path, name="b", tensor_edit=lambda ts: ts.update(
        {"model." + k: ts.pop(k) for k in list(ts) if k.startswith("midlayer.")})))
    assert codes(f) == ["W_KEY_MODEL_PREFIX"]


def test_extra_tensor_and_missing_tensor(tmp_path):
    def edit(ts):
        ts["midlayer.self_attn.rotary_emb.inv_freq"] = ("F32", [64], None)
        ts.pop("midlayer.hidden_norm.weight")
    f = run(make_draft(tmp_path, tensor_edit=edit))
    assert sorted(errors(f)) == ["E_KEY_MISSING", "E_KEY_UNKNOWN"]
    assert "midlayer.hidden_norm.weight" in msg(f, "E_KEY_MISSING")


def test_vocab_sizes_disagree(tmp_path):
    f = run(make_draft(tmp_path, tensor_edit=lambda ts: ts.update(
        {"lm_head.weight": ("BF16", [16000, 4096], None)})))
    assert "E_VOCAB_MISMATCH" in errors(f)
    assert "16000" in msg(f, "E_VOCAB_MISMATCH") and "32000" in msg(f, "E_VOCAB_MISMATCH")


def test_d2t_float_dtype(tmp_path):
    def edit(ts):
        _, shape, v = ts["d2t"]
        ts["d2t"] = ("F32", shape, v.astype(np.float32))
    assert errors(run(make_draft(tmp_path, tensor_edit=edit))) == ["E_D2T_DTYPE"]


def test_aux_ids_top_level_unsorted_out_of_range(tmp_path):
    def top(c):
        c.pop("eagle_config")
        c["eagle_aux_hidden_state_layer_ids"] = [2, 16, 29]
    f = run(make_draft(tmp_path, cfg_edit=top))
    assert errors(f) == ["E_AUX_IDS_TOP_LEVEL"] and "[1, 15, 28]" in msg(f, "E_AUX_IDS_TOP_LEVEL")
    assert errors(run(make_draft(tmp_path, geometry(ids=[15, 1, 28]), name="u"))) == ["E_AUX_IDS_ORDER"]
    f = run(make_draft(tmp_path, geometry(ids=[1, 15, 31]), name="r"))
    assert errors(f) == ["E_AUX_IDS_RANGE"] and "0..30" in msg(f, "E_AUX_IDS_RANGE")


def test_more_than_one_layer_and_tied_embeddings(tmp_path):
    d = make_draft(tmp_path, cfg_edit=lambda c: c.update(num_hidden_layers=2,
                                                         tie_word_embeddings=True))
    assert sorted(errors(run(d, v="0.5.6"))) == ["E_NUM_LAYERS", "E_TIED_EMBEDDINGS"]
    f = run(d, v="0.5.23")  # builds two layers: the config is named as the cause, once
    assert sorted(errors(f)) == ["E_NUM_LAYERS", "E_TIED_EMBEDDINGS"]
    m = msg(f, "E_NUM_LAYERS")
    assert "num_hidden_layers = 2" in m and "layers.1." in m and "set num_hidden_layers: 1" in m
    assert "E_KEY_MISSING" not in codes(f)
    # 0.5.14 served such a draft as well as the one-layer export (the lab, H100, 2026-12-07):
    # a warning there, still an error for 0.5.6 and 0.5.23 (portability warnings on 0.5.14)
    f = run(d, v="0.5.14")
    assert errors(f) == ["E_TIED_EMBEDDINGS"] and "W_NUM_LAYERS" in codes(f)
    assert "set num_hidden_layers: 1" in msg(f, "W_NUM_LAYERS") and "0.5.14" in msg(f, "W_NUM_LAYERS")
    assert any("0.5.23" in x.message and "num_hidden_layers = 2" in x.message
               for x in f if x.code == "W_NOT_PORTABLE")
    assert sorted(errors(run(d, v="0.5.20"))) == ["E_NUM_LAYERS", "E_TIED_EMBEDDINGS"]  # 0.5.23 too
    # a second layer's tensors present but incomplete: those are missing keys, not the config
    two = make_draft(tmp_path, cfg_edit=lambda c: c.update(num_hidden_layers=2), name="two",
                     tensor_edit=lambda ts: ts.update({
                         k.replace("midlayer.", "layers.1."): v for k, v in ts.items()
                         if k.startswith("midlayer.mlp.")}))
    f = run(two, v="0.5.23")
    assert "E_KEY_MISSING" in errors(f) and "E_NUM_LAYERS" not in errors(f)
    assert "layers.1.self_attn" in msg(f, "E_KEY_MISSING")


def test_overlapping_tensor_byte_ranges_are_not_clean(tmp_path):
    """Tensors whose byte ranges overlap (or leave bytes no tensor covers): every entry reads
    fine alone, but the safetensors library (SGLang's loader) refuses the file."""
    from safetensors import safe_open
    from bad_drafts import _overlap
    d = make_draft(tmp_path, TINY, dense=True)
    _overlap(d / "model.safetensors")
    with pytest.raises(Exception, match="invalid offset"):  # the library's own verdict
        safe_open(str(d / "model.safetensors"), "np")
    f = run(d)
    assert "E_SAFETENSORS" in errors(f)
    assert "overlaps the tensor before it" in msg(f, "E_SAFETENSORS")
    d2 = make_draft(tmp_path, TINY, dense=True, name="trailing")
    with open(d2 / "model.safetensors", "ab") as fh:
        fh.write(bytes(8))
    with pytest.raises(Exception, match="incomplete metadata"):
        safe_open(str(d2 / "model.safetensors"), "np")
    assert "incomplete metadata" in msg(run(d2), "E_SAFETENSORS")


def test_architecture_and_speculators_format(tmp_path):
    f = run(make_draft(tmp_path, cfg_edit=lambda c: c.update(architectures=["LlamaForCausalLMEagle"])))
    assert errors(f) == ["E_ARCHITECTURE"]


def test_truncated_file_and_missing_dir(tmp_path):
    d = make_draft(tmp_path, TINY, dense=True)
    p = d / "model.safetensors"
    p.write_bytes(p.read_bytes()[:-100])
    assert "E_TRUNCATED" in errors(run(d))
    assert errors(inspect_draft(tmp_path / "nope")) == ["E_NO_DRAFT_DIR"]
    p.write_bytes(p.read_bytes()[:len(p.read_bytes()) // 2])  # one cut, many tensors past it
    f = run(d)
    assert errors(f) == ["E_TRUNCATED"], errors(f)  # one line for the one cause
    assert "the file is truncated:" in msg(f, "E_TRUNCATED") and " tensors end past the end" \
        in msg(f, "E_TRUNCATED")


def test_the_export_stage_folder_points_to_its_drafts(tmp_path):
    """`runner inspect runs/x/export` (the stage's folder, not one artifact): the finding names
    the subfolders that hold drafts."""
    d = make_draft(tmp_path / "export", TINY, name="ab12cd34")
    f = inspect_draft(tmp_path / "export")
    assert errors(f) == ["E_NO_CONFIG"] and str(d) in msg(f, "E_NO_CONFIG")


def test_gguf_target(tmp_path, smollm2_path):
    """TARGET as a GGUF file: only the header is read (SmolLM2: L=30, H=576, V=49152)."""
    g = dict(H=576, heads=9, kv=3, hd=64, I=1536, V=49152, Vd=1024, ids=[1, 14, 26], L=30, ctx=8192)
    d = make_draft(tmp_path, g, cfg_edit=lambda c: c.update(rope_theta=100000.0))
    assert run(d, target=smollm2_path) == []
    bad = make_draft(tmp_path, geometry(**{**g, "ids": [1, 14, 29]}), name="bad",
                     cfg_edit=lambda c: c.update(rope_theta=100000.0))
    assert errors(run(bad, target=smollm2_path)) == ["E_AUX_IDS_RANGE"]


# --- CLI ---------------------------------------------------------------------------------------


def test_cli_exit_codes_and_json(tmp_path, capsys):
    good = make_draft(tmp_path, TINY)
    bad = make_draft(tmp_path, TINY, name="bad", cfg_edit=lambda c: c.update(draft_vocab_size=None))
    t = str(tmp_path / "target" / "config.json")
    assert cli_main(["inspect", str(good), "--target", t]) == 0
    assert "clean" in capsys.readouterr().out
    assert cli_main(["inspect", str(bad), "--target", t, "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is False and set(out) == {"ok", "sglang", "notes", "findings"}
    assert out["sglang"]["rules"] and out["sglang"]["source"]
    assert all(set(f) == {"severity", "code", "message"} for f in out["findings"])
    assert {"severity": "error", "code": "E_DRAFT_VOCAB_NULL"}.items() <= out["findings"][0].items()
    assert cli_main(["inspect", str(good), "--target", t, "--json",
                     "--server-args", f"--speculative-algorithm EAGLE --speculative-draft-model-path {good}"]) == 1
    assert json.loads(capsys.readouterr().out)["findings"][0]["code"] == "E_ALGORITHM_NOT_EAGLE3"


def test_inspect_never_imports_torch(tmp_path):
    d = make_draft(tmp_path, TINY)
    code = ("import sys; from eagle3_runner.runner.cli import main; rc = main(['inspect', sys.argv[1]]); "
            "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)")
    r = subprocess.run([sys.executable, "-c", code, str(d)], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def _header_file(p: Path, header) -> None:
    import struct
    b = json.dumps(header).encode()
    p.write_bytes(struct.pack("<Q", len(b)) + b + b"\0" * 64)


@pytest.mark.parametrize("header,why", [
    ([12], "not a JSON object"),
    ({"d2t": {"dtype": "I64", "shape": [8], "data_offsets": [0, "x"]}}, "corrupt"),
    ({"d2t": {"dtype": "I64", "shape": [-8], "data_offsets": [0, 64]}}, "corrupt"),
    ({"d2t": {"dtype": "I64", "shape": [8], "data_offsets": [64, 0]}}, "corrupt"),
    ({"d2t": "x"}, "corrupt")])
def test_corrupt_safetensors_header_is_a_finding(tmp_path, header, why):
    d = make_draft(tmp_path, TINY)
    _header_file(d / "model.safetensors", header)
    f = run(d)
    assert "E_SAFETENSORS" in errors(f) and why in msg(f, "E_SAFETENSORS")


@pytest.mark.parametrize("content", [b"[1]", b"\xff\xfe", b'"str"'])
def test_config_json_garbage_is_a_finding(tmp_path, capsys, content):
    d = make_draft(tmp_path, TINY)
    (d / "config.json").write_bytes(content)
    assert errors(run(d)) == ["E_NO_CONFIG"]
    assert cli_main(["inspect", str(d), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["ok"] is False


def test_provenance_not_an_object_is_ignored(tmp_path):
    d = make_draft(tmp_path, TINY)
    (d / "provenance.json").write_text("[1, 2]")
    assert "W_PROVENANCE" in codes(run(d)) and errors(run(d)) == []


FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def test_a_quantization_config_over_float_weights_is_refused(tmp_path):
    """A draft config.json that carries the target's quantization_config (an FP8 target's,
    copied over by a converter) over bf16 weights: SGLang builds the draft's layers with that
    quant_method (configs/model_config.py 0.5.6-0.5.23), so the weights load without scales.
    Quantized weights with it are a warning, not the float-dtype error."""
    f = run(make_draft(tmp_path, cfg_edit=lambda c: c.update(quantization_config=FP8)))
    assert errors(f) == ["E_DRAFT_QUANTIZED"]
    m = msg(f, "E_DRAFT_QUANTIZED")
    assert "'fp8'" in m and "BF16" in m and "--speculative-draft-model-quantization unquant" in m
    assert "Remove quantization_config" in m

    def to_fp8(ts):
        for k, (dt, shape, v) in list(ts.items()):
            if k.startswith(("midlayer.", "fc.")) and k.endswith("weight") and dt == "BF16":
                ts[k] = ("U8", shape, None)  # 8-bit packed weights (an int8 or fp8 draft)
    f = run(make_draft(tmp_path, name="q", cfg_edit=lambda c: c.update(quantization_config=FP8),
                       tensor_edit=to_fp8))
    assert "W_DRAFT_QUANTIZED" in codes(f) and "E_WEIGHT_DTYPE" not in codes(f)
    assert "E_DRAFT_QUANTIZED" not in codes(f)
    # without the config, the same quantized weights are the float-dtype error
    f = run(make_draft(tmp_path, name="nq", tensor_edit=to_fp8))
    assert "E_WEIGHT_DTYPE" in errors(f)
