"""Read a target's geometry and chat template without loading weights or importing torch.

Accepts an HF folder (config.json), a config.json path, or a GGUF file. For GGUF we parse only the
key/value header: `gguf.GGUFReader` maps every tensor and takes ~2 s for a 94 MiB file, which
would break the `runner validate` < 2 s budget.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import re
import struct
from functools import lru_cache, wraps
from pathlib import Path

from eagle3_runner.runner.errors import TargetConfigError


def read_target_config(path: Path) -> dict:
    """HF-style config dict of the target at `path`.

    Returns keys like num_hidden_layers, hidden_size, vocab_size, max_position_embeddings,
    num_attention_heads, num_key_value_heads, head_dim, intermediate_size, rope_theta,
    rope_scaling, rms_norm_eps, model_type.
    Raises FileNotFoundError when nothing is there, TargetConfigError when unreadable or when a
    folder without config.json holds several .gguf files (which one is meant?)."""
    path = Path(path)
    if path.is_dir():
        cfg = path / "config.json"
        if cfg.exists():
            return _read_json(cfg)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return read_gguf_config(ggufs[0])
        if ggufs:  # the stages refuse it too (targets/load.py): never pick one silently
            names = ", ".join(g.name for g in ggufs[:3]) + (", ..." if len(ggufs) > 3 else "")
            raise TargetConfigError(f"{path} holds {len(ggufs)} .gguf files ({names}) and no "
                                    "config.json; point target.path at the one .gguf file to "
                                    f"use, e.g. {ggufs[0]}")
        raise TargetConfigError(f"{path} is a folder without config.json or a .gguf file")
    if not path.exists():
        raise FileNotFoundError(path)
    if path.suffix == ".gguf":
        return read_gguf_config(path)
    if path.suffix == ".json":
        return _read_json(path)
    raise TargetConfigError(f"{path}: expected an HF folder, a config.json or a .gguf file")


def chat_template_source(path: Path) -> tuple[str | None, str]:
    """(the target's chat template text or None, where it was looked for / found), without
    weights or torch. Looks, in transformers' order, at chat_template.jinja, chat_template.json
    and tokenizer_config.json's chat_template (a string, or a list of {name, template}: the
    "default" one) of an HF folder (or a config.json's folder), or the GGUF key
    tokenizer.chat_template. Unreadable tokenizer files count as absent (the text says so)."""
    text, where, _known = _find_chat_template(Path(path))
    return text, where


def read_chat_template(path: Path) -> bool | None:
    """Whether the target at `path` ships a chat template (chat_template_source found one);
    None when it cannot tell (no tokenizer files at all, an unreadable file or GGUF header)."""
    text, _where, known = _find_chat_template(Path(path))
    return True if text else (False if known else None)


def _find_chat_template(path: Path) -> tuple[str | None, str, bool]:
    """(text or None, where, whether the tokenizer files were there and readable)."""
    if path.is_file() and path.suffix == ".json":
        path = path.parent
    if path.is_dir():
        if (path / "chat_template.jinja").is_file():
            p = path / "chat_template.jinja"
            try:
                return p.read_text(encoding="utf-8"), str(p), True
            except (OSError, UnicodeDecodeError) as e:
                return None, f"{p} (unreadable: {e})", False
        seen = False
        for name in ("chat_template.json", "tokenizer_config.json"):
            p = path / name
            if not p.is_file():
                continue
            try:
                t = json.loads(p.read_text(encoding="utf-8")).get("chat_template")
            except (OSError, ValueError, AttributeError) as e:
                return None, f"{p} (unreadable: {e})", False
            seen = True
            if isinstance(t, list):  # named templates: transformers uses "default"
                t = next((x.get("template") for x in t if isinstance(x, dict)
                          and x.get("name") == "default"), None)
            if isinstance(t, str) and t:
                return t, f"{p} chat_template", True
        ggufs = sorted(path.glob("*.gguf"))
        if not ggufs:
            return None, (f"{path}: no chat_template.jinja, chat_template.json or "
                          "tokenizer_config.json chat_template"), seen
        if len(ggufs) > 1:  # which one? (read_target_config refuses the folder)
            return None, f"{path}: {len(ggufs)} .gguf files", False
        path = ggufs[0]
    if path.is_file() and path.suffix == ".gguf":
        try:
            t = read_gguf_metadata(path).get("tokenizer.chat_template")
        except (TargetConfigError, struct.error, UnicodeDecodeError, OverflowError, MemoryError,
                ValueError, OSError) as e:
            return None, f"{path} (unreadable GGUF header: {e})", False
        return (t if isinstance(t, str) and t else None), f"{path} tokenizer.chat_template", True
    return None, f"{path}: not an HF folder or GGUF file", False


def _memo(fn):
    """`fn(path)` parsed once per process while the file is unchanged (keyed by path, size,
    mtime and inode, as runner/plan.py's file hashes are): `runner plan` reads the target in
    load_spec (geometry, chat template) and again for its memory check. Callers get a copy;
    errors are not kept."""
    done: dict = {}

    @wraps(fn)
    def read(path):
        try:
            st = os.stat(path)
        except OSError:
            return fn(path)  # it says why
        key = (os.path.abspath(path), st.st_size, st.st_mtime_ns, st.st_ino)
        if key not in done:
            if len(done) >= 16:
                done.clear()
            done[key] = fn(path)
        return copy.deepcopy(done[key])
    return read


@_memo
def _read_json(p: Path) -> dict:
    try:
        cfg = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise TargetConfigError(f"{p}: not readable JSON ({e}). Fix the file or point "
                                "target.path at the model's HF folder or GGUF file.")
    if not isinstance(cfg, dict):
        raise TargetConfigError(f"{p}: a model config must be a JSON object, got a "
                                f"{type(cfg).__name__}")
    # multimodal / nested configs (e.g. Kimi-K2.5 text_config): the text model's geometry, with
    # the wrapper's model_type, architectures and auto_map (what SGLang and transformers
    # dispatch on; the layer-id family
    # of runner/drafts/families.py reads both levels) and the nested block kept
    if "text_config" in cfg and "hidden_size" not in cfg:
        if not isinstance(cfg["text_config"], dict):
            raise TargetConfigError(f"{p}: text_config must be a JSON object")
        top = {k: cfg[k] for k in ("model_type", "architectures", "auto_map") if k in cfg}
        cfg = {**cfg["text_config"], **top, "text_config": cfg["text_config"]}
    return cfg


_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
           11: "<q", 12: "<d"}


def _read_bytes(f, n: int) -> bytes:
    """n bytes, refusing a length past the end of the file (corrupt header) before allocating."""
    if n > os.fstat(f.fileno()).st_size - f.tell():
        raise ValueError(f"length {n} runs past the end of the file")
    return f.read(n)


def _read_value(f, vtype: int):
    if vtype in _SCALAR:
        fmt = _SCALAR[vtype]
        return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]
    if vtype == 8:
        (n,) = struct.unpack("<Q", f.read(8))
        return _read_bytes(f, n).decode("utf-8", errors="replace")
    if vtype == 9:
        (itype,) = struct.unpack("<I", f.read(4))
        (count,) = struct.unpack("<Q", f.read(8))
        if itype in _SCALAR:
            size = struct.calcsize(_SCALAR[itype])
            f.seek(count * size, 1)
            return {"array_len": count}
        if itype == 8:
            for _ in range(count):
                (n,) = struct.unpack("<Q", f.read(8))
                f.seek(n, 1)
            return {"array_len": count}
        return {"array_len": count, "items": [_read_value(f, itype) for _ in range(count)]}
    raise TargetConfigError(f"unknown GGUF value type {vtype}")


@_memo
def read_gguf_metadata(path: Path) -> dict:
    """All GGUF header key/values; arrays are summarised as {"array_len": n}."""
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise TargetConfigError(f"{path}: not a GGUF file (bad magic)")
        version, _n_tensors, n_kv = struct.unpack("<IQQ", f.read(20))
        if version < 2:
            raise TargetConfigError(f"{path}: GGUF version {version} not supported")
        meta = {}
        for _ in range(n_kv):
            (n,) = struct.unpack("<Q", f.read(8))
            key = _read_bytes(f, n).decode()
            (vtype,) = struct.unpack("<I", f.read(4))
            meta[key] = _read_value(f, vtype)
    return meta


def read_gguf_config(path: Path) -> dict:
    """HF-style config from a GGUF header (llama-family keys)."""
    try:
        meta = read_gguf_metadata(path)
    except (struct.error, UnicodeDecodeError, OverflowError, MemoryError, ValueError,
            RecursionError) as e:  # random bytes give absurd lengths and counts
        raise TargetConfigError(f"{path}: truncated or corrupt GGUF header ({type(e).__name__}: "
                                f"{e}). Re-download it (runner fetch) or point target.path at "
                                "another file.")
    except OSError as e:
        raise TargetConfigError(f"{path}: cannot read ({e.strerror})")
    bad = [k for k in ("block_count", "embedding_length", "attention.head_count",
                       "attention.head_count_kv", "context_length", "vocab_size")
           if (v := meta.get(f"{meta.get('general.architecture', 'llama')}.{k}")) is not None
           and (not isinstance(v, int) or isinstance(v, bool) or v < 1)]
    if bad or not isinstance(meta.get("general.architecture", "llama"), str):
        what = ", ".join(bad) or "general.architecture"
        raise TargetConfigError(f"{path}: corrupt GGUF header (bad value for {what}). "
                                "Re-download it or point target.path at another file.")
    arch = meta.get("general.architecture", "llama")
    g = lambda k: meta.get(f"{arch}.{k}")  # noqa: E731
    heads = g("attention.head_count")
    hidden = g("embedding_length")
    vocab = g("vocab_size")
    if vocab is None and isinstance(meta.get("tokenizer.ggml.tokens"), dict):
        vocab = meta["tokenizer.ggml.tokens"]["array_len"]
    head_dim = g("attention.key_length") or g("rope.dimension_count") or (
        hidden // heads if hidden and heads else None)
    return {
        "model_type": arch,
        "num_hidden_layers": g("block_count"),
        "hidden_size": hidden,
        "vocab_size": vocab,
        "max_position_embeddings": g("context_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": g("attention.head_count_kv") or heads,
        "head_dim": head_dim,
        "intermediate_size": g("feed_forward_length"),
        "rope_theta": g("rope.freq_base") or 10000.0,
        "rope_scaling": None,
        "rms_norm_eps": g("attention.layer_norm_rms_epsilon") or 1e-5,
        "hidden_act": "silu",
        "tie_word_embeddings": None,
    }


@lru_cache(maxsize=1)
def native_causal_lm_types() -> tuple[str | None, frozenset[str] | None]:
    """(transformers version, the model_types its AutoModelForCausalLM builds without remote
    code), read from the installed transformers/models/auto/modeling_auto.py as text (importing
    transformers imports torch and takes seconds). (None, None) when it cannot tell."""
    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        return None, None
    root = Path(list(spec.submodule_search_locations)[0])
    try:
        text = (root / "models" / "auto" / "modeling_auto.py").read_text(encoding="utf-8")
        version = re.search(r'__version__\s*=\s*"([^"]+)"',
                            (root / "__init__.py").read_text(encoding="utf-8"))
    except OSError:
        return None, None
    m = re.search(r"^MODEL_FOR_CAUSAL_LM_MAPPING_NAMES = OrderedDict\((.*?)^\)", text, re.S | re.M)
    if m is None:
        return None, None
    return (version.group(1) if version else "?",
            frozenset(re.findall(r'\(\s*"([\w.-]+)"\s*,\s*"\w+"\s*\)', m.group(1))))


def remote_code_problem(cfg: dict, trust_remote_code: bool) -> str | None:
    """Why target.trust_remote_code must be true for the target of config `cfg`: its config.json
    has auto_map (modelling code shipped with the checkpoint) and its model_type is not one the
    installed transformers builds as a causal LM itself (e.g. Kimi-K2's kimi_k2, Kimi-K2.5's
    kimi_k25). None when it is set, not needed, or cannot be told (no transformers here)."""
    auto_map, mtype = cfg.get("auto_map"), cfg.get("model_type")
    if trust_remote_code or not isinstance(auto_map, dict) or not auto_map:
        return None
    version, native = native_causal_lm_types()
    if native is None or mtype in native:
        return None
    arch = ", ".join(a for a in cfg.get("architectures") or [] if isinstance(a, str)) or "?"
    return (f"the target ships its modelling code (config.json auto_map: {arch}) and "
            f"transformers {version} has no causal-LM class for model_type {mtype!r}: set "
            "target.trust_remote_code: true to run the checkpoint's code (trusted checkpoints "
            "only)")
