"""Read a target's geometry, chat template and end-of-turn token ids without loading weights or
importing torch.

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
from dataclasses import dataclass
from functools import lru_cache, wraps
from pathlib import Path

from eagle3_runner.runner.errors import TargetConfigError
from eagle3_runner.runner.files import HASHED_BELOW, cache_dir, converted_dir, sha256_memo


def read_target_config(path: Path) -> dict:
    """HF-style config dict of the target at `path`.

    Returns keys like num_hidden_layers, hidden_size, vocab_size, max_position_embeddings,
    num_attention_heads, num_key_value_heads, head_dim, intermediate_size, rope_theta,
    rope_scaling, rms_norm_eps, model_type.
    Raises FileNotFoundError when nothing is there, TargetConfigError when unreadable or when a
    folder without config.json holds several .gguf files (which one is meant?)."""
    cfg, gguf = _model_files(Path(path))
    return _read_json(cfg) if cfg is not None else read_gguf_config(gguf)


def _model_files(path: Path) -> tuple[Path | None, Path | None]:
    """(config.json, None) of an HF folder or a config.json path, or (None, the .gguf file) of a
    GGUF file or a folder holding exactly one (and no config.json). Raises FileNotFoundError
    when nothing is there, TargetConfigError for anything else (several .gguf files: which one
    is meant?)."""
    if path.is_dir():
        cfg = path / "config.json"
        if cfg.exists():
            return cfg, None
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return None, ggufs[0]
        if ggufs:  # the stages refuse it too (targets/load.py): never pick one silently
            names = ", ".join(g.name for g in ggufs[:3]) + (", ..." if len(ggufs) > 3 else "")
            raise TargetConfigError(f"{path} holds {len(ggufs)} .gguf files ({names}) and no "
                                    "config.json; point target.path at the one .gguf file to "
                                    f"use, e.g. {ggufs[0]}")
        raise TargetConfigError(f"{path} is a folder without config.json or a .gguf file")
    if not path.exists():
        raise FileNotFoundError(path)
    if path.suffix == ".gguf":
        return None, path
    if path.suffix == ".json":
        return path, None
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


def _gguf_header(path: Path) -> dict:
    """read_gguf_metadata, every way of failing a TargetConfigError naming the file and fix."""
    try:
        return read_gguf_metadata(path)
    except (struct.error, UnicodeDecodeError, OverflowError, MemoryError, ValueError,
            RecursionError) as e:  # random bytes give absurd lengths and counts
        raise TargetConfigError(f"{path}: truncated or corrupt GGUF header ({type(e).__name__}: "
                                f"{e}). Re-download it (runner fetch) or point target.path at "
                                "another file.")
    except OSError as e:
        raise TargetConfigError(f"{path}: cannot read ({e.strerror})")


def read_gguf_config(path: Path) -> dict:
    """HF-style config from a GGUF header (llama-family keys)."""
    meta = _gguf_header(path)
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


# ----------------------------------------------------------------------------------------------
# the end of a turn: the token ids generation stops at


@dataclass(frozen=True)
class StopIds:
    """A target's end-of-turn token ids (in the order found, no repeats) and where they were
    read: "<file> eos_token_id", "<gguf> tokenizer.ggml.eos_token_id", "the tokenizer's
    eos_token_id", or why there are none."""

    ids: tuple[int, ...]
    source: str


def stop_token_ids(path: Path, tokenizer_eos: int | None = None) -> StopIds:
    """The end-of-turn (stop) token ids of the target at `path` (an HF folder or its
    config.json, a GGUF file or a folder holding one): THE rule of every stage that generates
    (bench, regenerate, the synthetic prompts, the SGLang requests' stop_token_ids), through
    targets/load.py end_of_turn_ids. The first that says, of:

    1. the model's generation config: generation_config.json `eos_token_id`, all of them when it
       is a list (transformers' GenerationConfig.eos_token_id may be an int or a list; generate
       stops at any of them);
    2. a GGUF's header: `tokenizer.ggml.eos_token_id`, plus `tokenizer.ggml.eot_token_id` when
       present and different (llama.cpp's end of turn). transformers converts a GGUF's header
       ids into the converted folder's generation_config.json, so the header is read here,
       converted or not;
    3. config.json `eos_token_id` (an int or a list; a multimodal wrapper's text_config);
    4. `tokenizer_eos`, the tokenizer's eos_token_id, only as the last fallback: a tokenizer's
       eos_token is not always the end of a turn (transformers 5.17 converts SmolLM2's GGUF with
       eos_token <|im_start|>, id 1, while its header and generation config say 2, <|im_end|>).

    ids () when none says (generation then runs to its token cap). SGLang 0.5.14 stops at the
    union of config.json's and generation_config.json's eos ids, its tokenizer's eos_token_id
    and a request's stop_token_ids (model_config.py _get_hf_eos_token_id, schedule_batch.py
    Req._check_token_based_finish), so the stages send these ids as stop_token_ids.
    Raises FileNotFoundError / TargetConfigError as read_target_config, and TargetConfigError
    naming the file when an eos_token_id is not a token id or a list of them."""
    cfg, gguf = _model_files(Path(path))
    if gguf is not None:
        meta = _gguf_header(gguf)
        ids = _ids(meta.get("tokenizer.ggml.eos_token_id"), f"{gguf} tokenizer.ggml.eos_token_id")
        eot = _ids(meta.get("tokenizer.ggml.eot_token_id"), f"{gguf} tokenizer.ggml.eot_token_id")
        if ids:
            more = [i for i in eot if i not in ids]
            return StopIds(ids + tuple(more), f"{gguf} tokenizer.ggml.eos_token_id"
                           + (" + tokenizer.ggml.eot_token_id" if more else ""))
        if eot:
            return StopIds(eot, f"{gguf} tokenizer.ggml.eot_token_id")
    else:
        for f in (cfg.parent / "generation_config.json", cfg):
            if f.is_file():
                d = _read_json(f)
                value = d.get("eos_token_id")
                if value is None and isinstance(d.get("text_config"), dict):
                    value = d["text_config"].get("eos_token_id")
                if ids := _ids(value, f"{f} eos_token_id"):
                    return StopIds(ids, f"{f} eos_token_id")
    if tokenizer_eos is not None:
        return StopIds((int(tokenizer_eos),), "the tokenizer's eos_token_id")
    where = "its GGUF header" if gguf is not None else "generation_config.json or config.json"
    return StopIds((), f"no eos_token_id in {where} and none in the tokenizer")


def _ids(value, where: str) -> tuple[int, ...]:
    """eos_token_id (None, an int, or a list of ints) -> its ids in order, no repeats; () for
    None or []. Raises TargetConfigError naming `where` for anything else."""
    items = [value] if isinstance(value, int) and not isinstance(value, bool) else value
    if items is None:
        return ()
    if not isinstance(items, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in items):
        raise TargetConfigError(f"{where} = {value!r}: expected a token id or a list of token "
                                "ids; fix the file")
    return tuple(dict.fromkeys(items))


def tokenizer_eos(folder: Path) -> str | None:
    """The eos token the tokenizer of the HF folder `folder` names, read as transformers reads
    it but without it (`runner validate` and `runner plan` import no transformers):
    tokenizer_config.json `eos_token`, a string or {"content": ...}; its id: token_ids. None
    when there is no tokenizer_config.json or it names no eos_token. Raises TargetConfigError
    when the file is unreadable."""
    p = Path(folder) / "tokenizer_config.json"
    eos = _read_json(p).get("eos_token") if p.is_file() else None
    if isinstance(eos, dict):
        eos = eos.get("content")
    return eos if isinstance(eos, str) and eos else None


def token_ids(folder: Path) -> dict[str, int]:
    """{token text: id} of the HF folder's tokenizer files: tokenizer.json's model.vocab (a
    {token: id} dict, or a Unigram list of [token, score], where the id is the index), then its
    added_tokens and tokenizer_config.json's added_tokens_decoder ({"id": {"content": ...}}),
    which win. {} when there are none. Raises TargetConfigError when a file is unreadable."""
    folder, out = Path(folder), {}
    tj = folder / "tokenizer.json"
    if tj.is_file():
        try:  # not _read_json: its memo would deep-copy a vocabulary of 10^5 entries
            t = json.loads(tj.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise TargetConfigError(f"{tj}: not readable JSON ({e})")
        vocab = (t.get("model") or {}).get("vocab") if isinstance(t, dict) else None
        if isinstance(vocab, dict):
            out.update((k, v) for k, v in vocab.items() if isinstance(v, int))
        elif isinstance(vocab, list):
            out.update((v[0], i) for i, v in enumerate(vocab) if isinstance(v, list) and v)
        for a in (t.get("added_tokens") or []) if isinstance(t, dict) else []:
            if isinstance(a, dict) and isinstance(a.get("id"), int):
                out[a.get("content")] = a["id"]
    tc = folder / "tokenizer_config.json"
    if tc.is_file():
        decoder = _read_json(tc).get("added_tokens_decoder")
        for k, v in (decoder.items() if isinstance(decoder, dict) else []):
            if isinstance(v, dict) and str(k).isdigit():
                out[v.get("content")] = int(k)
    return out


def stop_ids_note(path: Path) -> str | None:
    """The warning of `runner validate` and `runner plan` when the tokenizer the stages load
    names an eos_token that is not among the model's end-of-turn ids (stop_token_ids without
    the tokenizer): both named (ids, and tokens where the tokenizer's files map them), and
    which the stages stop at. The tokenizer is the HF folder's; a GGUF's is its converted folder
    (runner/files.py converted_dir), looked at only when one exists (the first stage makes it;
    until then there is nothing to compare) and the file is under HASHED_BELOW (1 GiB; its
    sha256 names the folder). None when they agree, the model says nothing
    (the stages then use the tokenizer's eos), or a file cannot be read (the stages say so)."""
    try:
        cfg, gguf = _model_files(Path(path))
        stop = stop_token_ids(path)
        if not stop.ids:
            return None
        folder = cfg.parent if cfg is not None else _converted(gguf)
        eos = tokenizer_eos(folder) if folder is not None else None
        table = token_ids(folder) if eos is not None else {}
    except (OSError, TargetConfigError):
        return None
    eos_id = table.get(eos)
    if eos_id is None or eos_id in stop.ids:
        return None
    names = {i: t for t, i in table.items() if i in stop.ids}
    model = ("ids " if len(stop.ids) > 1 else "id ") + ", ".join(
        f"{i} {names[i]}" if i in names else str(i) for i in stop.ids)
    where = folder / "tokenizer_config.json"
    fix = names.get(stop.ids[0], f"the token of id {stop.ids[0]}")
    return (f"the tokenizer's eos_token is {eos} (id {eos_id}, {where}), but the model's end "
            f"of turn is {model} ({stop.source}): every stage stops at {model} (an SGLang "
            "server also stops at the tokenizer's eos). If the tokenizer is wrong (transformers "
            f"5.17 converts SmolLM2's GGUF with eos_token <|im_start|>), set eos_token in "
            f"{where} to {fix}.")


def _converted(gguf: Path) -> Path | None:
    """The converted HF folder of `gguf` when one exists. Found through its sha256, memoised on
    disk (runner/files.py sha256_memo: the plan's cache key hashes the file anyway), so only for
    a file under HASHED_BELOW: hashing a larger one would cost every plan minutes."""
    if gguf.stat().st_size >= HASHED_BELOW or not (cache_dir() / "converted").is_dir():
        return None
    folder = converted_dir(gguf, sha256_memo(gguf))
    return folder if (folder / "tokenizer_config.json").is_file() else None
