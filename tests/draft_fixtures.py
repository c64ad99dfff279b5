"""Synthetic SGLang draft directories for the inspect/convert tests (no torch).

Large weights are written SPARSE: the safetensors header declares the real shapes (e.g. Llama-3.1-8B
fc [4096, 12288]) and the file is truncated to its full length without writing the zeros, so a
draft with the issue's real numbers costs no disk and no time. d2t/t2d values are written for real.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np

from eagle3_runner.runner.drafts.layout import expected_shapes

ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4, "I64": 8, "I32": 4, "BOOL": 1, "U8": 1}
NP = {"F32": np.float32, "I64": np.int64, "I32": np.int32, "BOOL": np.bool_, "U8": np.uint8,
      "F16": np.float16}

# Llama-3.1-8B target + a 32000-token draft vocab (the notes' worked shapes)
LLAMA8B = dict(H=4096, heads=32, kv=8, hd=128, I=14336, V=128256, Vd=32000, ids=[1, 15, 28], L=32,
               ctx=8192)
TINY = dict(H=64, heads=4, kv=2, hd=16, I=128, V=1000, Vd=200, ids=[1, 3, 5], L=8, ctx=512)


def used_ids(Vd: int, V: int) -> np.ndarray:
    """A realistic sorted draft vocab: a dense block of low ids, then every 3rd id."""
    half = Vd // 2
    u = np.concatenate([np.arange(half), half + 3 * np.arange(Vd - half)])
    assert u[-1] < V
    return u.astype(np.int64)


def sglang_config(g: dict) -> dict:
    return {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
        "hidden_size": g["H"], "num_attention_heads": g["heads"], "num_key_value_heads": g["kv"],
        "head_dim": g["hd"], "intermediate_size": g["I"], "hidden_act": "silu",
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "rope_scaling": None,
        "max_position_embeddings": g["ctx"], "vocab_size": g["V"], "draft_vocab_size": g["Vd"],
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bias": False,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(g["ids"]),
                         "use_aux_hidden_state": True}}


def target_config(g: dict) -> dict:
    return {"model_type": "llama", "num_hidden_layers": g["L"], "hidden_size": g["H"],
            "vocab_size": g["V"], "max_position_embeddings": g["ctx"],
            "num_attention_heads": g["heads"], "num_key_value_heads": g["kv"],
            "head_dim": g["hd"], "intermediate_size": g["I"], "rope_theta": 500000.0,
            "rms_norm_eps": 1e-5}


def tensors(cfg: dict, dense: bool = False, seed: int = 0) -> dict:
    """{name: (dtype, shape, values or None)}; weights BF16 (sparse unless dense), d2t offsets."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in expected_shapes(cfg).items():
        if name == "d2t":
            u = used_ids(shape[0], cfg["vocab_size"])
            out[name] = ("I64", shape, u - np.arange(len(u)))
        elif name == "t2d":
            t = np.zeros(shape[0], bool)
            t[used_ids(cfg["draft_vocab_size"], cfg["vocab_size"])] = True
            out[name] = ("BOOL", shape, t)
        elif dense:
            x = rng.standard_normal(shape).astype(np.float32)
            out[name] = ("BF16", shape, (x.view(np.uint32) >> 16).astype(np.uint16))
        else:
            out[name] = ("BF16", shape, None)
    return out


def write_st(path: Path, items: dict) -> None:
    """Write a (possibly sparse) safetensors file from {name: (dtype, shape, values or None)}."""
    header, off, starts = {}, 0, {}
    for name, (dt, shape, _) in items.items():
        size = int(np.prod(shape, dtype=np.int64)) * ITEMSIZE[dt]
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + size]}
        starts[name] = off
        off += size
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    base = 8 + len(h)
    with open(path, "wb") as f:
        f.write(len(h).to_bytes(8, "little"))
        f.write(h)
        f.truncate(base + off)
        for name, (dt, shape, vals) in items.items():
            if vals is not None:
                f.seek(base + starts[name])
                f.write(np.ascontiguousarray(vals).tobytes())


def make_draft(root: Path, g: dict = LLAMA8B, cfg_edit=None, tensor_edit=None, provenance=None,
               dense: bool = False, name: str = "draft") -> Path:
    """A draft dir (config.json + model.safetensors [+ provenance.json]) and a target config.json
    at root/target/config.json. cfg_edit(cfg) / tensor_edit(tensors) mutate in place."""
    root = Path(root)
    d = root / name
    d.mkdir(parents=True)
    cfg = sglang_config(g)
    ts = tensors(cfg, dense=dense)
    if cfg_edit:
        cfg_edit(cfg)
    if tensor_edit:
        tensor_edit(ts)
    write_st(d / "model.safetensors", ts)
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    if provenance is not None:
        (d / "provenance.json").write_text(json.dumps(provenance))
    t = root / "target"
    if not t.exists():
        t.mkdir()
        (t / "config.json").write_text(json.dumps(target_config(g)))
    return d


def geometry(**kw) -> dict:
    g = copy.deepcopy(LLAMA8B)
    g.update(kw)
    return g


# reading findings (runner.inspect_checks.Finding lists)
def codes(findings, severity=None) -> list[str]:
    return [f.code for f in findings if severity is None or f.severity == severity]


def errors(findings) -> list[str]:
    return codes(findings, "error")


def msg(findings, code) -> str:
    return next(f.message for f in findings if f.code == code)
