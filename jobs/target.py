"""Loading the target: an HF folder or a GGUF file, on CPU (float32) or CUDA (bf16).

Public API (other stages rely on these signatures):

    load_target(target, device=None, dtype=None) -> (model, tokenizer, config: dict)
    load_tokenizer(target) -> tokenizer            # no weights; fast
    hf_folder(target) -> Path                      # HF folder (converted GGUF, cached)
    target_config(target) -> dict                  # HF config dict, `architectures` set
    resolve_device(device) / resolve_dtype(dtype, device)
    config_sha256(config) / tokenizer_sha256(tokenizer)

`target` is a Spec, a spec's Target (runner/spec/schema.py), or a path (str/Path) to an HF folder
(config.json + safetensors + tokenizer) or a .gguf file (or a folder holding exactly one).

GGUF files are converted once: transformers dequantizes the GGUF into a plain float32
LlamaForCausalLM (its `save_pretrained` refuses GGUF-loaded models, so we build the model from the
config ourselves and load the dequantized state dict; this path also avoids the `accelerate`
dependency of `from_pretrained(gguf_file=...)`). The result is cached as an HF folder under
`runner.files.cache_dir()/converted/<sha256[:16] of the GGUF>/` (float32 safetensors, tokenizer,
config.json with `architectures`), written to a temp dir and renamed, so concurrent converters
never expose a half-written folder. SmolLM2 on 2 CPU cores: ~12 s to convert, ~1.5 s afterwards.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from runner.errors import StageError
from runner.files import atomic_path, cache_dir, expand_path, sha256_file

_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16",
           "fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
_VOLATILE_CONFIG_KEYS = ("_name_or_path", "name_or_path", "transformers_version", "dtype",
                         "torch_dtype", "quantization_config", "_commit_hash")


# ----------------------------------------------------------------------------------------------
# resolving what the spec says


def _target_fields(target: Any) -> tuple[Path, str, str]:
    """(path, dtype, device) from a Spec (its .target), a Target (.path, .dtype, .device) or a
    path. Duck-typed, so this module's code hash does not cover the spec schema."""
    target = getattr(target, "target", target)
    if isinstance(target, (str, Path)):
        return expand_path(str(target)), "auto", "auto"
    return expand_path(target.path), target.dtype, target.device


def resolve_device(device: str | None = "auto") -> str:
    """'auto'/None -> 'cuda' when available else 'cpu'. Raises StageError for cuda without CUDA."""
    import torch
    if device in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise StageError(f"target.device = {device!r}, but CUDA is not available on this machine. "
                         "Use device: auto or cpu.")
    return str(device)


def resolve_dtype(dtype: str | None, device: str):
    """'auto'/None -> float32 on CPU, bfloat16 on CUDA. Returns a torch.dtype."""
    import torch
    if dtype in (None, "auto"):
        return torch.float32 if not str(device).startswith("cuda") else torch.bfloat16
    if isinstance(dtype, torch.dtype):
        return dtype
    name = _DTYPES.get(str(dtype).removeprefix("torch."))
    if name is None:
        raise StageError(f"target.dtype = {dtype!r}: use auto, float32, bfloat16 or float16")
    return getattr(torch, name)


def _find_model(path: Path) -> tuple[Path, Path | None]:
    """(folder, gguf file or None). Raises StageError naming target.path when nothing loadable."""
    if not path.exists():
        raise StageError(f"target.path: {path} does not exist. Run `runner fetch smollm2` for the "
                         "demo target, or point target.path at an HF folder or a .gguf file.")
    if path.is_file():
        if path.suffix != ".gguf":
            raise StageError(f"target.path: {path} is a file but not a .gguf; give an HF folder "
                             "(config.json + weights) or a .gguf file")
        return path.parent, path
    if (path / "config.json").exists():
        return path, None
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return path, ggufs[0]
    raise StageError(f"target.path: {path} has no config.json and "
                     f"{'several' if ggufs else 'no'} .gguf files; point it at one file")


# ----------------------------------------------------------------------------------------------
# GGUF -> cached HF folder


def converted_dir(gguf: Path) -> Path:
    """Where the HF copy of `gguf` lives: cache_dir()/converted/<sha256[:16]>."""
    return cache_dir() / "converted" / sha256_file(gguf)[:16]


def _complete(folder: Path) -> bool:
    return (folder / "config.json").exists() and (folder / "model.safetensors").exists() and \
        (folder / "tokenizer_config.json").exists()


def ensurehf_folder(gguf: Path) -> Path:
    """Convert a GGUF file to a float32 HF folder once (atomic); return the folder.

    Raises StageError when transformers cannot read the GGUF (unsupported architecture)."""
    sha = sha256_file(gguf)
    dest = cache_dir() / "converted" / sha[:16]
    if _complete(dest):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        with atomic_path(dest, tempfile.mkdtemp(prefix=f".tmp-{dest.name}-", dir=dest.parent)) \
                as tmp:
            _convert_gguf(gguf, sha, tmp)
    except OSError:  # the rename failed: another process finished first, keep theirs
        if not _complete(dest):
            raise
    return dest


def _convert_gguf(gguf: Path, sha: str, out: Path) -> None:
    """Dequantize `gguf` into the (existing, empty) folder `out`: float32 safetensors, tokenizer,
    config.json with `architectures`, source.json. Raises StageError when transformers cannot
    read it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    try:
        cfg = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        if hasattr(cfg, "quantization_config"):
            delattr(cfg, "quantization_config")
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model,
                                       torch_dtype=torch.float32)["tensors"]
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except (ValueError, KeyError, NotImplementedError, RuntimeError) as e:
        raise StageError(f"target.path: transformers cannot convert {gguf}: {e}")
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and cfg.tie_word_embeddings)]
    if missing or unexpected:
        raise StageError(f"target.path: {gguf} converted with missing {missing[:5]} / "
                         f"unexpected {unexpected[:5]} tensors")
    model.tie_weights()
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    (out / "source.json").write_text(json.dumps({"gguf": str(gguf), "sha256": sha}))
    os.chmod(out, 0o755)


def hf_folder(target: Any) -> Path:
    """The HF folder of the target (a GGUF is converted once and its cached folder returned)."""
    folder, gguf = _find_model(_target_fields(target)[0])
    return ensurehf_folder(gguf) if gguf is not None else folder


# ----------------------------------------------------------------------------------------------
# public loaders


def load_tokenizer(target: Any):
    """The target's tokenizer (with its chat template). A GGUF is converted first (once)."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(hf_folder(target)))


def target_config(target: Any) -> dict:
    """The target's HF config as a dict, with `architectures` set (no weights loaded)."""
    folder = hf_folder(target)
    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise StageError(f"target.path: {folder}/config.json unreadable: {e}")
    if "text_config" in cfg and "hidden_size" not in cfg:
        cfg = {**cfg["text_config"], "architectures": cfg.get("architectures")}
    return cfg


def load_target(target: Any, device: str | None = None, dtype: Any = None):
    """Load the target model for inference.

    target: Spec, Target or path (HF folder or .gguf). device/dtype override the spec's
    target.device/target.dtype ('auto': cuda if available; float32 on CPU, bfloat16 on CUDA).
    Returns (model in eval mode on `device`, tokenizer, config dict). The model is a
    transformers *ForCausalLM; `model.model.layers[k]` is decoder layer k (0-based).
    Raises StageError for a missing/unloadable path or a CUDA request without CUDA."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    _, spec_dtype, spec_device = _target_fields(target)
    dev = resolve_device(device if device is not None else spec_device)
    dt = resolve_dtype(dtype if dtype is not None else spec_dtype, dev)
    folder = hf_folder(target)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dt)
    except (OSError, ValueError) as e:
        raise StageError(f"target.path: cannot load {folder}: {e}")
    model.to(dev).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    tok = AutoTokenizer.from_pretrained(str(folder))
    cfg = model.config.to_dict()
    if not cfg.get("architectures"):
        cfg["architectures"] = [type(model).__name__]
    return model, tok, cfg


# ----------------------------------------------------------------------------------------------
# identity hashes (recorded in the features manifest)


def config_sha256(config: dict) -> str:
    """sha256 of the config's canonical JSON, minus keys that vary between loads (dtype, paths,
    transformers version)."""
    clean = {k: v for k, v in config.items() if k not in _VOLATILE_CONFIG_KEYS}
    return hashlib.sha256(json.dumps(clean, sort_keys=True, default=str).encode()).hexdigest()


def tokenizer_sha256(tok) -> str:
    """sha256 over the vocabulary, special tokens and chat template."""
    h = hashlib.sha256()
    h.update(json.dumps(sorted(tok.get_vocab().items()), ensure_ascii=False).encode())
    h.update(json.dumps(tok.all_special_tokens).encode())
    h.update(str(getattr(tok, "chat_template", None) or "").encode())
    return h.hexdigest()
