"""We ship a top-level package named `kernels`; transformers probes for a (hub) package of that
name and, when it believes it is there, runs `from kernels import kernelize, ...`. Prove that with
this project installed (and imported from the repo root, where `kernels/` is on sys.path)
transformers does not mistake ours for the hub library and still loads models.

Each check runs in a fresh interpreter started from the repo root: the probe is lru-cached per
process, so only a clean process shows what a user would get."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

PROBE = """
import json, sys
import kernels
import transformers
from transformers.utils import import_utils as iu
import transformers.integrations.hub_kernels  # imports `kernels` at module level if it looks real
out = {"kernels_file": kernels.__file__, "has_version": hasattr(kernels, "__version__"),
       "available": iu.is_kernels_available(),
       "found": list(iu._is_package_available("kernels", return_version=True))}
"""

TINY = PROBE + """
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
src = LlamaForCausalLM(cfg).eval()
src.save_pretrained(sys.argv[1])
m = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()
ids = torch.arange(10)[None]
with torch.no_grad():
    out["max_diff"] = (m(ids).logits - src(ids).logits).abs().max().item()
out["class"] = type(m).__name__
print("RESULT" + json.dumps(out))
"""

REAL = PROBE + """
import torch
torch.set_num_threads(2)
from transformers.integrations.gguf.kernels import kernelize_ggml_layers
from jobs.target import load_target
model, tok, cfg = load_target(sys.argv[1], device="cpu", dtype="float32")
kernelize_ggml_layers(model)  # the GGUF path's kernel hook: must be a no-op, not an ImportError
ids = tok("The capital of France is", return_tensors="pt").input_ids
with torch.no_grad():
    nxt = model(ids).logits[0, -1].argmax().item()
out["class"] = type(model).__name__
out["layers"] = model.config.num_hidden_layers
out["next"] = tok.decode([nxt])
print("RESULT" + json.dumps(out))
"""


def _run(code: str, *args) -> dict:
    r = subprocess.run([sys.executable, "-c", code, *map(str, args)], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("RESULT"))
    return json.loads(line[len("RESULT"):])


def _check_probe(out: dict) -> None:
    # the collision is real: `import kernels` resolves to this project's package ...
    assert Path(out["kernels_file"]).resolve() == (ROOT / "kernels" / "__init__.py").resolve()
    # ... which transformers finds, but does not accept as the hub library
    assert out["found"][0] is True
    assert out["available"] is False
    assert out["has_version"] is False


def test_transformers_loads_a_model_with_our_kernels_package(tmp_path):
    out = _run(TINY, tmp_path / "tiny")
    _check_probe(out)
    assert out["class"] == "LlamaForCausalLM"
    assert out["max_diff"] < 1e-5


def test_transformers_loads_real_smollm2_gguf(smollm2_path):
    out = _run(REAL, smollm2_path)
    _check_probe(out)
    assert out["class"] == "LlamaForCausalLM" and out["layers"] == 30
    assert out["next"].strip() == "Paris"
