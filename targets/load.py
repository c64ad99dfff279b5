"""Loading the target: an HF folder or a GGUF file, on CPU (float32) or CUDA (bf16), on one
device or split over several (target.device_map: accelerate dispatches the layers over this
rank's GPU group, CPU memory or disk; the device map itself and reading a dispatched model:
targets/split.py).

Public API (other stages rely on these signatures):

    load_target(target, device=None, dtype=None, split=None) -> (model, tokenizer, config: dict)
    load_tokenizer(target) -> tokenizer            # no weights; fast
    end_of_turn_ids(target, tok) -> tuple[int, ...] # the ids every generating stage stops at
    hf_config(target) -> load_target's config dict, no weights;  load_head(target, dtype)
    hf_folder(target) -> Path                      # HF folder (converted GGUF, cached)
    target_config(target) -> dict                  # HF config dict, `architectures` set
    resolve_device(device) / resolve_dtype(dtype, device)
    config_sha256(config) / tokenizer_sha256(tokenizer)
    target_option(target, name) -> a Target field (trust_remote_code, device_map, ...)

`target` is a Spec, a spec's Target (runner/spec/sections.py), or a path (str/Path) to an HF folder
(config.json + safetensors + tokenizer) or a .gguf file (or a folder holding exactly one).

GGUF files are converted once: transformers dequantizes the GGUF into a plain float32
LlamaForCausalLM (its `save_pretrained` refuses GGUF-loaded models, so we build the model from the
config ourselves and load the dequantized state dict, without `from_pretrained(gguf_file=...)`).
The result is cached as an HF folder under
`runner.files.cache_dir()/converted/<sha256[:16] of the GGUF>/` (float32 safetensors, tokenizer,
config.json with `architectures`), written to a temp dir and renamed, so concurrent converters
never expose a half-written folder. SmolLM2 on 2 CPU cores: ~12 s to convert, ~1.5 s afterwards.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Any

from eagle3_runner.runner.errors import StageError, TargetConfigError
from eagle3_runner.runner.files import atomic_path, converted_dir, expand_path, sha256_file
from eagle3_runner.runner.target_config import stop_token_ids

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


def target_option(target: Any, name: str, default=None):
    """A Target field (trust_remote_code, attn_implementation, device_map, max_memory) of a Spec
    or Target; `default` for a bare path."""
    return getattr(getattr(target, "target", target), name, default)


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


def _complete(folder: Path) -> bool:
    return (folder / "config.json").exists() and (folder / "model.safetensors").exists() and \
        (folder / "tokenizer_config.json").exists()


def ensurehf_folder(gguf: Path) -> Path:
    """Convert a GGUF file to a float32 HF folder once (atomic); return the folder.

    Raises StageError when transformers cannot read the GGUF (unsupported architecture)."""
    sha = sha256_file(gguf)
    dest = converted_dir(gguf, sha)
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


def hf_folder(target: Any) -> Path:
    """The HF folder of the target (a GGUF is converted once and its cached folder returned)."""
    folder, gguf = _find_model(_target_fields(target)[0])
    return ensurehf_folder(gguf) if gguf is not None else folder


# ----------------------------------------------------------------------------------------------
# public loaders


def load_tokenizer(target: Any):
    """The target's tokenizer (with its chat template). A GGUF is converted first (once)."""
    from transformers import AutoTokenizer
    trust = bool(target_option(target, "trust_remote_code"))
    return AutoTokenizer.from_pretrained(str(hf_folder(target)), trust_remote_code=trust)


def tokenizer_only(path: Path, trust_remote_code: bool = False):
    """The target's tokenizer (with its chat template) without its weights: an HF folder's
    tokenizer files, or the tokenizer a GGUF's header describes, read as transformers reads it
    when it converts the GGUF (no conversion, no dequantizing). Raises StageError naming
    target.path when transformers cannot build it."""
    from transformers import AutoTokenizer
    folder, gguf = _find_model(Path(path))
    try:
        if gguf is not None:
            return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        return AutoTokenizer.from_pretrained(str(folder), trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError, NotImplementedError, RuntimeError) as e:
        raise StageError(f"target.path: transformers cannot read the tokenizer of {path}: "
                         f"{str(e).splitlines()[0] if str(e) else type(e).__name__}")


def end_of_turn_ids(target: Any, tok) -> tuple[int, ...]:
    """The token ids a turn of the target ends at, for every stage that generates: the bench's
    engines and its SGLang requests, regenerate's answers on either engine, the synthetic
    prompts, the conformance lab. The rule is runner/target_config.py stop_token_ids (the
    generation config, a GGUF's header, config.json, and `tok.eos_token_id` only when none of
    them says); () when nothing says (generation runs to its token cap). Raises StageError
    naming target.path when a file it reads is unreadable or holds a bad eos_token_id."""
    try:
        return stop_token_ids(_target_fields(target)[0], tok.eos_token_id).ids
    except (OSError, TargetConfigError) as e:
        raise StageError(f"target.path: {e}")


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


def load_target(target: Any, device: str | None = None, dtype: Any = None,
                split: dict | None = None):
    """Load the target model for inference.

    target: Spec, Target or path (HF folder or .gguf). device/dtype override the spec's
    target.device/target.dtype ('auto': cuda if available; float32 on CPU, bfloat16 on CUDA).
    split: from_pretrained's device-map kwargs (targets/split.py split_plan) to spread the model
    over several devices with accelerate, or None for one device. target.trust_remote_code and
    target.attn_implementation apply either way.
    Returns (model in eval mode (on `device`, or dispatched), tokenizer, config dict). The model
    is a transformers *ForCausalLM (or the multimodal wrapper of one); targets/split.py
    decoder_parts finds its layers. Raises StageError for a missing/unloadable path, a CUDA
    request without CUDA, or a split that had to spill onto disk or CPU memory nobody asked
    for."""
    from transformers import AutoTokenizer
    _, spec_dtype, spec_device = _target_fields(target)
    dev = resolve_device(device if device is not None else spec_device)
    dt = resolve_dtype(dtype if dtype is not None else spec_dtype, dev)
    folder = hf_folder(target)
    trust = bool(target_option(target, "trust_remote_code"))
    kw: dict = {"dtype": dt, "trust_remote_code": trust, **(split or {})}
    if target_option(target, "attn_implementation", "auto") not in (None, "auto"):
        kw["attn_implementation"] = target_option(target, "attn_implementation")
    offload = (split or {}).get("offload_folder")
    try:
        model = _from_pretrained(folder, kw, trust, dev, split)
    except BaseException:  # no model holds the offload folder: it goes now
        if offload:
            shutil.rmtree(offload, ignore_errors=True)
        raise
    tok = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=trust)
    return model, tok, _config_dict(model.config, type(model).__name__)


def _from_pretrained(folder: Path, kw: dict, trust: bool, dev, split: dict | None):
    """load_target's model: from_pretrained (a multimodal wrapper's class when the causal-LM
    one refuses it), on `dev` or dispatched by `split`, eval, no grad."""
    from transformers import AutoModelForCausalLM
    try:
        try:
            model = AutoModelForCausalLM.from_pretrained(str(folder), **kw)
        except ValueError as e:  # a multimodal wrapper (e.g. Kimi-K2.5 in transformers >= 5.2x)
            if "Unrecognized configuration class" not in str(e):
                raise
            from transformers import AutoModelForImageTextToText
            model = AutoModelForImageTextToText.from_pretrained(str(folder), **kw)
    except (OSError, ValueError) as e:
        hint = "" if trust or "trust_remote_code" not in str(e) else \
            " (set target.trust_remote_code: true for a checkpoint that ships its code)"
        raise StageError(f"target.path: cannot load {folder}: {e}{hint}")
    if split is None:
        model.to(dev)
    else:
        if split.get("offload_folder"):  # offloaded weights go when the model does
            weakref.finalize(model, shutil.rmtree, split["offload_folder"], True)
        _check_spill(model, split)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def _check_spill(model, split: dict) -> None:
    """After a device_map "auto" load: modules on a device outside max_memory (accelerate puts
    what does not fit on disk) mean the group's GPUs were too small. Raises StageError naming
    the fix. An explicit map is taken as meant."""
    if split.get("device_map") != "auto":
        return
    allowed = set(split.get("max_memory", {}))
    spilled = sorted({str(d) for d in getattr(model, "hf_device_map", {}).values()} -
                     {str(d) for d in allowed})
    if spilled:
        raise StageError(f"target.device_map auto: the target does not fit this rank's GPUs "
                         f"(modules went to {', '.join(spilled)}); use fewer replicas "
                         "(nproc_per_node), more GPUs, target.max_memory: {cpu: GiB} to offload "
                         "to CPU memory, or a smaller batch (see `runner plan`'s memory lines)")


def _config_dict(config, arch: str | None = None) -> dict:
    """A transformers config as the dict the stages record (target_config.json, the manifest's
    config hash): the text model's geometry for a multimodal wrapper (as target_config), with
    `architectures` (`arch` when the config has none)."""
    cfg = config.to_dict()
    if "text_config" in cfg and "hidden_size" not in cfg:
        cfg = {**cfg["text_config"], "architectures": cfg.get("architectures"),
               "model_type": cfg.get("model_type")}
    if not cfg.get("architectures") and arch:
        cfg["architectures"] = [arch]
    return cfg


def hf_config(target: Any) -> dict:
    """The dict load_target returns as its config, without loading weights (transformers'
    AutoConfig of the HF folder): what a stage records when an SGLang server holds the model."""
    from transformers import AutoConfig
    folder = hf_folder(target)
    trust = bool(target_option(target, "trust_remote_code"))
    try:
        config = AutoConfig.from_pretrained(str(folder), trust_remote_code=trust)
    except (OSError, ValueError) as e:
        raise StageError(f"target.path: cannot read the config of {folder}: {e}")
    archs = json.loads((folder / "config.json").read_text()).get("architectures")
    return _config_dict(config, archs[0] if archs else None)


# the checkpoint names of the head parts (suffixes; Llama: model.embed_tokens.weight, Kimi-K2.5:
# language_model.model.embed_tokens.weight), in the order tried
HEAD_NAMES = {"embed_tokens": ("model.embed_tokens.weight", "embed_tokens.weight"),
              "norm": ("model.norm.weight",),
              "lm_head": ("lm_head.weight",)}


def load_head(target: Any, dtype=None) -> dict:
    """{embed_tokens [V, H], norm [H], lm_head [V, H]} read from the target's safetensors
    without building the model (an SGLang server holds it): each the shortest name ending in one
    of HEAD_NAMES' suffixes outside a vision tower, lm_head = the embedding when the checkpoint
    has none (tied). Cast to `dtype` when given. Raises StageError when a part is missing."""
    from safetensors import safe_open
    folder = hf_folder(target)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        where = json.loads(index.read_text())["weight_map"]
    else:
        where = {}
        for f in sorted(folder.glob("*.safetensors")):
            with safe_open(str(f), "pt") as h:
                where.update({k: f.name for k in h.keys()})

    def find(part: str) -> str | None:
        for suffix in HEAD_NAMES[part]:
            hits = sorted((k for k in where if k.endswith(suffix) and ".layers." not in k
                           and not any(v in k for v in ("vision", "visual", "mm_projector"))),
                          key=len)
            if hits:
                return hits[0]
        return None

    names = {part: find(part) for part in HEAD_NAMES}
    if names["embed_tokens"] is None or names["norm"] is None:
        raise StageError(f"target.path: {folder}'s safetensors hold no "
                         f"{'embed_tokens' if names['embed_tokens'] is None else 'final norm'} "
                         f"weight ({', '.join(HEAD_NAMES['embed_tokens'] + HEAD_NAMES['norm'])})")
    out = {}
    for part, name in names.items():
        if name is None:  # tied: the embedding is the head
            out[part] = out["embed_tokens"]
            continue
        with safe_open(str(folder / where[name]), "pt") as h:
            t = h.get_tensor(name)
        out[part] = t.to(dtype) if dtype is not None else t
    return out


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
