"""`runner convert --to sglang`: fixes handed cases 3 (layers.0 names) and 7 (absolute d2t), turns a
speculators-style draft into SGLang form (HF-index ids shifted into eagle_config), and refuses the
cases it cannot convert safely."""

import json

import numpy as np
import pytest

from draft_fixtures import TINY, make_draft
from eagle3_runner.runner.cli import main as cli_main
from eagle3_runner.runner.convert import convert
from eagle3_runner.runner.errors import ConvertError
from eagle3_runner.runner.drafts.safetensors import draft_tensors, tensor_values
from eagle3_runner.runner.inspect import inspect_draft

V, VD = TINY["V"], TINY["Vd"]
SPREAD = np.concatenate([np.arange(100), 100 + 8 * np.arange(VD - 100)])  # i + used[i] >= V at the top


def _layers0(ts):
    for k in [k for k in ts if k.startswith("midlayer.")]:
        ts["layers.0." + k[len("midlayer."):]] = ts.pop(k)


def _absolute(ts, keep_t2d=True):
    ts["d2t"] = ("I64", [VD], SPREAD.copy())
    if keep_t2d:
        t = np.zeros(V, bool)
        t[SPREAD] = True
        ts["t2d"] = ("BOOL", [V], t)
    else:
        ts.pop("t2d")


def _values(d):
    ts = draft_tensors(d)
    return {k: tensor_values(t) for k, t in ts.items()}


def _target(tmp_path):
    return tmp_path / "target" / "config.json"


def _clean(d, tmp_path):
    f = inspect_draft(d, target=_target(tmp_path))
    assert f == [], f


def test_case03_convert_renames_layers0(tmp_path):
    src = make_draft(tmp_path, TINY, tensor_edit=_layers0, dense=True)
    assert "E_KEY_LAYERS0" in [f.code for f in inspect_draft(src, _target(tmp_path), sglang_version="0.5.6")]
    ref = make_draft(tmp_path, TINY, dense=True, name="ref")  # same seed: the intended result
    dst = tmp_path / "out"
    assert cli_main(["convert", str(src), str(dst), "--to", "sglang", "--target",
                     str(_target(tmp_path))]) == 0
    _clean(dst, tmp_path)
    got, want = _values(dst), _values(ref)
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


@pytest.mark.parametrize("keep_t2d", [True, False])
def test_case07_convert_absolute_d2t_to_offsets(tmp_path, keep_t2d):
    src = make_draft(tmp_path, TINY, dense=True, tensor_edit=lambda ts: _absolute(ts, keep_t2d))
    assert "E_D2T_ABSOLUTE" in [f.code for f in inspect_draft(src, _target(tmp_path))]
    dst = tmp_path / "out"
    notes = convert(src, dst, _target(tmp_path))
    assert any("absolute" in n for n in notes)
    _clean(dst, tmp_path)
    v = _values(dst)
    np.testing.assert_array_equal(v["d2t"] + np.arange(VD), SPREAD)
    assert v["d2t"].dtype == np.int64 and v["t2d"].dtype == np.bool_
    np.testing.assert_array_equal(np.flatnonzero(v["t2d"]), SPREAD)


def _speculators(src_cfg):
    """Reshape an SGLang config into speculators' form (HF-index ids at the top level)."""
    geo = {k: src_cfg.pop(k) for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                       "head_dim", "intermediate_size", "vocab_size", "rope_theta",
                                       "max_position_embeddings", "rms_norm_eps")}
    ids = src_cfg.pop("eagle_config")["eagle_aux_hidden_state_layer_ids"]
    src_cfg.update(architectures=["Eagle3Speculator"], speculators_model_type="eagle3",
                   transformer_layer_config={**geo, "model_type": "llama"},
                   eagle_aux_hidden_state_layer_ids=[k + 1 for k in ids],
                   speculators_config={"algorithm": "eagle3"})


def test_speculators_style_ids_shift_into_eagle_config(tmp_path):
    src = make_draft(tmp_path, TINY, dense=True, cfg_edit=_speculators, tensor_edit=_layers0)
    codes = [f.code for f in inspect_draft(src, _target(tmp_path), sglang_version="0.5.6")]
    assert {"E_SPECULATORS_FORMAT", "E_AUX_IDS_TOP_LEVEL", "E_KEY_LAYERS0"} <= set(codes)
    dst = tmp_path / "out"
    convert(src, dst, _target(tmp_path))
    cfg = json.loads((dst / "config.json").read_text())
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == TINY["ids"]
    assert "eagle_aux_hidden_state_layer_ids" not in cfg and "transformer_layer_config" not in cfg
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == VD
    _clean(dst, tmp_path)


def test_float_d2t_rebuilt_from_t2d(tmp_path):
    def edit(ts):
        _, shape, v = ts["d2t"]
        ts["d2t"] = ("F32", shape, v.astype(np.float32))
    src = make_draft(tmp_path, TINY, dense=True, tensor_edit=edit)
    dst = tmp_path / "out"
    convert(src, dst, _target(tmp_path))
    _clean(dst, tmp_path)


@pytest.mark.parametrize("case,edit,cfg_edit,why", [
    ("second layer", lambda ts: ts.update({"layers.1.mlp.up_proj.weight": ("BF16", [128, 64], None)}),
     None, "second decoder layer"),
    ("unknown tensor", lambda ts: ts.update({"medusa_head.weight": ("BF16", [4, 64], None)}),
     None, "no SGLang name"),
    ("ambiguous d2t", lambda ts: (ts.pop("t2d"), ts.update(
        {"d2t": ("I64", [VD], 2 * np.arange(VD))})), None, "cannot convert safely"),
    ("hf index 0", None, lambda c: (c.pop("eagle_config"),
                                    c.update(eagle_aux_hidden_state_layer_ids=[0, 3, 5])),
     "embedding output"),
    ("wrong fc width", lambda ts: ts.update({"fc.weight": ("BF16", [64, 64 * 5], None)}), None,
     "E_FC_WIDTH"),
])
def test_refuses_unsafe(tmp_path, case, edit, cfg_edit, why):
    src = make_draft(tmp_path, TINY, tensor_edit=edit, cfg_edit=cfg_edit)
    dst = tmp_path / "out"
    with pytest.raises(ConvertError, match=why):
        convert(src, dst, _target(tmp_path))
    assert not dst.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]


def test_refuses_existing_destination(tmp_path, capsys):
    src = make_draft(tmp_path, TINY)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    assert cli_main(["convert", str(src), str(tmp_path / "out")]) == 1
    assert "not empty" in capsys.readouterr().err
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"
    (tmp_path / "a-file").write_text("x")
    assert cli_main(["convert", str(src), str(tmp_path / "a-file")]) == 1
    assert "is a file" in capsys.readouterr().err


def test_converts_into_an_empty_folder_made_first(tmp_path, capsys):
    """People `mkdir DST` before converting into it: an empty folder is a destination."""
    src = make_draft(tmp_path, TINY, tensor_edit=_layers0, dense=True)
    dst = tmp_path / "out"
    dst.mkdir()
    assert cli_main(["convert", str(src), str(dst), "--target", str(_target(tmp_path))]) == 0
    assert (dst / "model.safetensors").is_file() and (dst / "config.json").is_file()
    _clean(dst, tmp_path)


def test_refuses_destination_inside_source_or_under_a_file(tmp_path, capsys):
    src = make_draft(tmp_path, TINY, tensor_edit=_layers0)
    assert cli_main(["convert", str(src), str(src / "sub")]) == 1
    assert "inside the source" in capsys.readouterr().err
    assert not (src / "sub").exists()
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    assert cli_main(["convert", str(src), str(blocker / "out")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: cannot convert") and "writable" in err
    (src / "config.json").write_bytes(b"\xff\xfe")
    assert cli_main(["convert", str(src), str(tmp_path / "out")]) == 1
    assert "config.json" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_convert_drops_a_quantization_config_over_float_weights(tmp_path, capsys):
    """E_DRAFT_QUANTIZED's fix: the converted draft has no quantization_config and passes."""
    q = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    src = make_draft(tmp_path, TINY, dense=True, cfg_edit=lambda c: c.update(quantization_config=q))
    assert "E_DRAFT_QUANTIZED" in [f.code for f in inspect_draft(src, _target(tmp_path))]
    dst = tmp_path / "out"
    assert cli_main(["convert", str(src), str(dst), "--to", "sglang", "--target",
                     str(_target(tmp_path))]) == 0
    assert "quantization_config (quant_method 'fp8') dropped" in capsys.readouterr().out
    assert "quantization_config" not in json.loads((dst / "config.json").read_text())
    _clean(dst, tmp_path)
