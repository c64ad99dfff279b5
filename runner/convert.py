"""`runner convert SRC DST --to sglang`: turn a speculators-style or `layers.0`-style EAGLE-3 draft
into the directory SGLang's LlamaForCausalLMEagle3 loads (docs/eagle3-format.md; the layout is
stated once in runner/drafts/layout.py).

What it changes, and why (each is a silent failure in SGLang otherwise):
- tensor names: `draft_model.` / `model.` prefixes stripped, `layers.0.*` -> `midlayer.*`;
- config: LlamaForCausalLMEagle3, one layer, tie_word_embeddings false, draft_vocab_size = lm_head
  rows, layer ids NESTED under eagle_config. speculators writes its ids at the top level as HF
  hidden_states indices (= SGLang id + 1), so they are shifted down by one;
- d2t: absolute target ids become offsets (target_id = i + d2t[i]); a float d2t is rebuilt from t2d;
  t2d is written as bool [vocab_size] (rebuilt from d2t when missing).
- forward-changing flags (runner/drafts/forward.py): the ones SGLang reads (fc_norm,
  use_aux_norm, norm_output, norm_before_fc, num_aux_hidden_states, bias, attention_bias) are kept
  as they are, with a note; speculators' norm_before_residual, which no SGLang version reads, is
  dropped when false (a note) and refused when true;
- torch_dtype is written explicitly (float32 or none would run the draft in float16 under
  SGLang's --dtype auto).
It refuses, saying why, when it cannot decide safely (a second decoder layer, unknown tensors,
d2t that could be either form, sizes that disagree). Tensor bytes are copied unchanged (no torch;
all-zero chunks stay sparse) and every read is bounded by the source files' sizes. The result is
written into a temporary sibling of DST (`.tmp-<name>-<pid>`), inspected for the SGLang version
asked for (default as `runner inspect`), and renamed into place; a convert killed by SIGKILL
leaves only that temporary folder, which the next convert into the same folder removes (its pid
is gone); SIGTERM and Ctrl-C remove it at once.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
from pathlib import Path

import numpy as np

from eagle3_runner.runner.drafts.forward import FORWARD_FLAGS, draft_params
from eagle3_runner.runner.drafts.layout import (ARCH, AUX_IDS_KEY, FC_NORM_LEGACY, LAYER_LISTS, config_aux_ids,
                                  config_view, eagle_config, from_hf_indices, sglang_name)
from eagle3_runner.runner.drafts.rules import RULES
from eagle3_runner.runner.drafts.safetensors import (FLOAT_DTYPES, draft_tensors, tensor_values,
                                                      write_safetensors)
from eagle3_runner.runner.errors import ConvertError, InspectError, TargetConfigError
from eagle3_runner.runner.files import atomic_path
from eagle3_runner.runner.inspect import inspect_draft, read_small_json
from eagle3_runner.runner.target_config import read_target_config

SPECULATORS_ONLY = ("speculators_model_type", "speculators_config", "speculators_version",
                    "transformer_layer_config", "eagle_aux_hidden_state_layer_ids",
                    "norm_before_residual", "embed_requires_grad", "enable_sp_ulysses", "auto_map",
                    "has_no_defaults_at_init")
SGLANG_FLAGS = ("fc_norm", "use_aux_norm", "norm_output", "norm_before_fc",
                "num_aux_hidden_states", "bias", "attention_bias")
_DTYPE_NAMES = {"BF16": "bfloat16", "F16": "float16"}


def _flags(src: dict, cfg: dict) -> list[str]:
    """Notes on the forward-changing flags (kept as they are), refusing norm_before_residual."""
    nested = src.get("transformer_layer_config") if isinstance(
        src.get("transformer_layer_config"), dict) else {}
    nbr = src.get("norm_before_residual", nested.get("norm_before_residual"))
    notes = []
    if nbr:
        raise ConvertError(f"norm_before_residual = {nbr!r}: the draft was trained with "
                           f"{FORWARD_FLAGS['norm_before_residual']}, which no SGLang version "
                           "implements (0.5.6-0.5.23 never read it); it cannot be served as "
                           "trained. Retrain with norm_before_residual false.")
    if nbr is not None:
        notes.append("norm_before_residual: false dropped (no SGLang version reads it; false is "
                     "SGLang's forward)")
    cfg.pop("norm_before_residual", None)
    ec = cfg.get("eagle_config") if isinstance(cfg.get("eagle_config"), dict) else {}
    for f in SGLANG_FLAGS:
        for where, d in (("", cfg), ("eagle_config.", ec)):
            if f in d:
                notes.append(f"kept {where}{f} = {d[f]!r} (read by SGLang: see runner inspect "
                             "for the versions that implement it)")
    return notes


def _torch_dtype(src_cfg: dict, tensors: dict) -> tuple[str, str]:
    """(torch_dtype to write, note): the source's bfloat16/float16, else the weights' uniform
    BF16/F16, else bfloat16 (SGLang --dtype auto runs float32 or no dtype as float16)."""
    named = src_cfg.get("torch_dtype") or src_cfg.get("dtype")
    if named in ("bfloat16", "float16"):
        return named, f"torch_dtype: {named} (from the source config)"
    kinds = {t["dtype"] for k, t in tensors.items() if "d2t" not in k and "t2d" not in k}
    if len(kinds) == 1 and next(iter(kinds)) in _DTYPE_NAMES:
        dt = _DTYPE_NAMES[next(iter(kinds))]
        return dt, f"torch_dtype: {dt} written (the weights' dtype; the source named {named!r})"
    return "bfloat16", (f"torch_dtype: bfloat16 written (weights {sorted(kinds)}, the source "
                        f"named {named!r}; float32 or none would run as float16 under --dtype "
                        "auto)")


def _drop_quantization(cfg: dict, tensors: dict) -> list[str]:
    """Drop a quantization_config over float weights (runner/inspect_tensors.py
    _check_quantization: SGLang would build the draft's layers with it, E_DRAFT_QUANTIZED);
    one over quantized weights is kept. Returns the note."""
    q = cfg.get("quantization_config")
    if q is None:
        return []
    kinds = {t["dtype"] for k, t in tensors.items() if "d2t" not in k and "t2d" not in k}
    if not kinds <= set(FLOAT_DTYPES):
        return [f"kept quantization_config (the weights are {sorted(kinds)})"]
    cfg.pop("quantization_config")
    method = q.get("quant_method") if isinstance(q, dict) else None
    return [f"quantization_config (quant_method {method!r}) dropped: the weights are "
            f"{sorted(kinds)}, and SGLang would build the draft's layers quantized from it"]


def _empty_dir(p: Path) -> bool:
    """Whether `p` is a folder with nothing in it (a real one, not a link to one)."""
    try:
        return p.is_dir() and not p.is_symlink() and next(p.iterdir(), None) is None
    except OSError:
        return False


def _clean_stale(dst: Path) -> list[str]:
    """Remove `.tmp-<dst.name>-<pid>` siblings left by converts that were killed (pid gone)."""
    notes = []
    for p in dst.parent.glob(f".tmp-{dst.name}-*") if dst.parent.is_dir() else []:
        pid = p.name.rsplit("-", 1)[-1]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # still running
        except ProcessLookupError:
            pass
        except (PermissionError, OverflowError):
            continue
        shutil.rmtree(p, ignore_errors=True)
        notes.append(f"removed {p.name}, left by a convert that was killed")
    return notes


def convert_config(src: dict, lm_rows: int, target: dict | None) -> tuple[dict, list[str]]:
    """speculators / SGLang-ish config -> SGLang config.json. Returns (config, notes)."""
    notes = []
    cfg = dict(src.get("transformer_layer_config") or {})
    cfg.update({k: v for k, v in src.items() if k not in SPECULATORS_ONLY})
    if src.get("transformer_layer_config"):
        notes.append("config: geometry taken from speculators transformer_layer_config")
    top = src.get(AUX_IDS_KEY)
    nested = config_aux_ids(src)
    if top is not None:
        shifted = from_hf_indices(top)
        if min(shifted) < 0:
            raise ConvertError(f"top-level eagle_aux_hidden_state_layer_ids {top} include HF index 0 "
                               "(the embedding output), which SGLang cannot capture.")
        if nested is not None and list(nested) != shifted:
            raise ConvertError(f"top-level eagle_aux_hidden_state_layer_ids {top} (HF indices = SGLang "
                               f"{shifted}) disagree with eagle_config ids {nested}; cannot tell "
                               "which one training used.")
        nested = shifted
        notes.append(f"aux ids: top-level HF indices {list(top)} -> eagle_config {shifted}")
    if nested is not None:
        if sorted(nested) != list(nested):
            notes.append(f"aux ids {nested} sorted: SGLang concatenates ascending; check fc order")
        cfg["eagle_config"] = eagle_config(nested)
    else:
        cfg.pop("eagle_config", None)
        notes.append("aux ids: none recorded; SGLang will capture its default layers")
    if int(cfg.get("num_hidden_layers", 1)) != 1:
        raise ConvertError(f"num_hidden_layers = {cfg['num_hidden_layers']}: only one-layer "
                           "EAGLE-3 drafts can be converted.")
    if src.get("draft_vocab_size") not in (None, lm_rows):
        raise ConvertError(f"draft_vocab_size = {src['draft_vocab_size']} but lm_head.weight has "
                           f"{lm_rows} rows; cannot tell which is right.")
    if target is not None:
        for f in ("vocab_size", "hidden_size"):
            want = target.get(f)
            key = "target_hidden_size" if f == "hidden_size" else f
            have = cfg.get(key) or (cfg.get("hidden_size") if f == "hidden_size" else None)
            if want and have and have != want:
                raise ConvertError(f"config {key} = {have}, but the target's {f} is {want}: this "
                                   "draft was not trained for this target.")
        if not cfg.get("vocab_size") and target.get("vocab_size"):
            cfg["vocab_size"] = target["vocab_size"]
    if not cfg.get("vocab_size"):
        raise ConvertError("config has no vocab_size (the TARGET vocab); pass --target.")
    if cfg.get("target_hidden_size") == cfg.get("hidden_size"):
        cfg.pop("target_hidden_size", None)
    cfg.update({"architectures": [ARCH], "model_type": "llama", "num_hidden_layers": 1,
                "tie_word_embeddings": False, "draft_vocab_size": lm_rows})
    return cfg, notes


def convert_d2t(d2t: np.ndarray | None, dtype: str | None, t2d: np.ndarray | None, n: int,
                V: int) -> tuple[np.ndarray, list[str]]:
    """d2t as int64 OFFSETS [n] (SGLang llama_eagle3.py: hot_token_id = d2t + arange).

    Absolute ids are detected by i + d2t[i] >= V, or by d2t's values being exactly t2d's ids.
    Raises ConvertError when the form cannot be decided."""
    ar = np.arange(n)
    used = np.flatnonzero(t2d) if t2d is not None else None
    if d2t is None or dtype not in ("I64", "I32", "I16", "U8", "I8"):
        if used is not None and len(used) == n:
            why = "missing" if d2t is None else f"{dtype} is not an integer dtype"
            return used - ar, [f"d2t: rebuilt from t2d ({why})"]
        if d2t is not None and dtype in ("F32", "F64") and np.all(np.abs(d2t) < 2 ** 24) \
                and np.array_equal(d2t, np.round(d2t)):
            d2t = d2t.astype(np.int64)
        elif d2t is None and n == V:
            return np.zeros(n, np.int64), ["d2t: full vocab head, identity d2t written"]
        else:
            raise ConvertError(f"d2t is {'missing' if d2t is None else dtype} and there is no t2d "
                               f"with {n} ids to rebuild it from; token ids cannot be recovered.")
    d = d2t.astype(np.int64).reshape(-1)
    tid = d + ar
    strictly = n > 1 and bool(np.all(np.diff(d) > 0))
    if d.min() >= 0 and d.max() < V and (tid.max() >= V or (used is not None and len(used) == n
                                                              and np.array_equal(np.sort(d), used)
                                                              and not np.array_equal(tid, used))):
        return d - ar, ["d2t: absolute target ids -> offsets (d2t[i] - i)"]
    if tid.min() < 0 or tid.max() >= V:
        raise ConvertError(f"d2t maps draft ids outside [0, {V}) as offsets and as absolute ids; "
                           "it belongs to another vocabulary.")
    if strictly and n >= 64 and used is None:
        raise ConvertError("d2t is strictly increasing (as absolute ids are) yet every i + d2t[i] "
                           "is inside the vocab, and there is no t2d to tell offsets from absolute "
                           "ids; cannot convert safely.")
    return d, []


def convert(src, dst, target=None, sglang_version: str | None = None) -> list[str]:
    """Convert SRC (speculators or layers.0 style) into an SGLang draft at DST (must not exist, or
    be an empty folder: people `mkdir` it first; the converted folder replaces it).

    target: HF folder / config.json / GGUF (checks vocab and widths) or None. sglang_version: the
    version the result is inspected for (None: as `runner inspect`). Returns notes on what
    changed. Raises ConvertError (nothing written at DST) when unsafe."""
    src, dst = Path(src), Path(dst)
    if dst.exists() and not _empty_dir(dst):
        what = "a file" if not dst.is_dir() else "a folder that is not empty"
        raise ConvertError(f"{dst} exists and is {what}; choose a new (or empty) destination "
                           "(convert never overwrites).")
    if dst.resolve().is_relative_to(src.resolve()):
        raise ConvertError(f"{dst} is inside the source {src}; choose a destination outside it.")
    scfg, why = read_small_json(src / "config.json")
    if why:
        raise ConvertError(f"{src}: needs a readable config.json ({why})")
    if not isinstance(scfg, dict):
        raise ConvertError(f"{src}/config.json: must be a JSON object, got a {type(scfg).__name__}")
    pre = []
    if "target_hidden_size" in scfg and scfg["target_hidden_size"] is None:  # speculators: same
        scfg = {k: v for k, v in scfg.items() if k != "target_hidden_size"}
        pre.append("target_hidden_size: null dropped (SGLang cannot read null; absent = the "
                   "draft's hidden size)")
    flat = {**(scfg.get("transformer_layer_config") if isinstance(
        scfg.get("transformer_layer_config"), dict) else {}), **scfg}
    bad = config_view(flat)[1]
    if bad:
        raise ConvertError(f"{src}/config.json: {bad[0][1]}")
    try:
        tensors = draft_tensors(src)
    except InspectError as e:
        raise ConvertError(f"{src}: needs readable *.safetensors ({e})")
    tgt = None
    if target:
        try:
            tgt = read_target_config(Path(target).expanduser())
        except (OSError, TargetConfigError) as e:
            raise ConvertError(f"--target {target}: cannot read its config ({e})")
    renamed: dict[str, dict] = {}
    for name, t in tensors.items():
        new = sglang_name(name)
        for old, canon in FC_NORM_LEGACY.items():
            new = new.replace(old, canon)
        if new.split(".")[0] in LAYER_LISTS:
            raise ConvertError(f"tensor {name}: a second decoder layer; SGLang's EAGLE-3 draft has one.")
        if new in renamed:
            raise ConvertError(f"tensors {name} and another both map to {new}.")
        renamed[new] = t
    lm = renamed.get("lm_head.weight")
    if lm is None or len(lm["shape"]) != 2:
        raise ConvertError("no lm_head.weight [rows, hidden] (or prefixed variant): nothing to "
                           "take the draft vocab from.")
    rows = lm["shape"][0]
    cfg, notes = convert_config(scfg, rows, tgt)
    notes += pre + _flags(scfg, cfg)
    cfg["torch_dtype"], n_dt = _torch_dtype(flat, tensors)
    cfg.pop("dtype", None)
    notes.append(n_dt)
    notes += _drop_quantization(cfg, tensors)
    notes += [f"rename: {a} -> {sglang_name(a)}" for a in sorted(tensors) if sglang_name(a) != a][:3]
    try:
        known = set().union(*(draft_params(r, config_view(cfg)[0]) for r in RULES))
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        raise ConvertError(f"config lacks a usable Llama geometry field ({e!r}).")
    unknown = sorted(set(renamed) - known - {"d2t", "t2d"})
    if unknown:
        raise ConvertError(f"tensors with no SGLang name: {unknown[:5]}; cannot tell what they are.")
    V = cfg["vocab_size"]
    for k in ("d2t", "t2d"):
        if k in renamed and (len(renamed[k]["shape"]) != 1 or renamed[k]["data_offsets"][1]
                             - renamed[k]["data_offsets"][0] > 1 << 28):
            raise ConvertError(f"{k} has shape {renamed[k]['shape']}; it must be one-dimensional.")
    try:
        get = lambda k: tensor_values(renamed[k]) if k in renamed else None  # noqa: E731
        t2d = get("t2d")
        d2t_raw = get("d2t")
    except InspectError as e:
        raise ConvertError(str(e))
    t2d = t2d.reshape(-1).astype(bool) if t2d is not None else None
    if t2d is not None and len(t2d) != V:
        raise ConvertError(f"t2d has {len(t2d)} entries but vocab_size is {V}.")
    if d2t_raw is not None and d2t_raw.reshape(-1).shape[0] != rows:
        raise ConvertError(f"len(d2t) = {d2t_raw.size} but lm_head.weight has {rows} rows.")
    if d2t_raw is not None and not np.all(np.isfinite(d2t_raw.astype(np.float64))):
        raise ConvertError("d2t holds NaN or Inf values; token ids cannot be recovered.")
    d2t, n2 = convert_d2t(d2t_raw, renamed.get("d2t", {}).get("dtype"), t2d, rows, V)
    notes += n2
    tid = d2t + np.arange(rows)
    if t2d is None:
        t2d = np.zeros(V, bool)
        t2d[tid] = True
        notes.append("t2d: rebuilt from d2t")
    items = []
    for name in sorted(renamed):
        if name in ("d2t", "t2d"):
            continue
        t = renamed[name]
        items.append((name, t["dtype"], t["shape"], (t["file"], t["start"] + t["data_offsets"][0],
                                                       t["start"] + t["data_offsets"][1])))
    items += [("d2t", "I64", [rows], d2t.astype(np.int64)), ("t2d", "BOOL", [V], t2d.astype(np.bool_))]
    notes += _clean_stale(dst)
    try:
        with atomic_path(dst) as tmp:
            shutil.rmtree(tmp, ignore_errors=True)  # a stale one from an earlier crash
            try:
                tmp.mkdir(parents=True)
            except OSError as e:
                raise ConvertError(f"cannot create {dst}: {e.strerror} ({e.filename}); choose a "
                                   "destination in a writable folder.")
            write_safetensors(tmp / "model.safetensors", items)
            (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
            (tmp / "convert.json").write_text(json.dumps({"source": str(src.resolve()),
                                                          "notes": notes}, indent=1))
            found = inspect_draft(tmp, tgt, sglang_version=sglang_version)
            errs = [f for f in found if f.severity == "error"]
            if errs:
                raise ConvertError(f"the converted draft still fails inspection for "
                                   f"{', '.join(found.sglang.get('rules') or ['?'])}:\n" +
                                   "\n".join(f"  {f.code}: {f.message}" for f in errs))
            notes.append(f"inspected for SGLang {', '.join(found.sglang['rules'])}: no errors")
    except InspectError as e:
        raise ConvertError(f"reading the source failed: {e}; nothing was written at {dst}.")
    except OSError as e:  # e.g. a full disk: nothing is left at dst
        raise ConvertError(f"writing {dst} failed: {e.strerror or e}; nothing was written there.")
    return notes


def _terminate(signum, frame):
    raise SystemExit(128 + signum)  # unwinds through atomic_path, which removes the temporary


def convert_cli(src, dst, to="sglang", target=None, sglang_version=None) -> int:
    """`runner convert SRC DST --to sglang [--target T] [--sglang-version V]`: exit 0 on
    success, 1 with the reason. SIGTERM is turned into an exit that removes the temporary."""
    if to != "sglang":
        print(f"error: --to {to}: only sglang is supported", file=sys.stderr)
        return 1
    old = signal.signal(signal.SIGTERM, _terminate)
    try:
        notes = convert(src, dst, target, sglang_version)
    except ConvertError as e:
        print(f"error: cannot convert {src}: {e}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, old)
    for n in notes:
        print(f"  {n}")
    print(f"wrote {dst} (SGLang LlamaForCausalLMEagle3); check it with `runner inspect {dst}"
          f"{' --target ' + str(target) if target else ''}`")
    return 0
