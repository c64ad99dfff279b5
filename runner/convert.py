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
It refuses, saying why, when it cannot decide safely (a second decoder layer, unknown tensors,
d2t that could be either form, sizes that disagree). Tensor bytes are copied unchanged (no torch);
the result is inspected and then moved into place atomically.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np

from runner.drafts.layout import (ARCH, AUX_IDS_KEY, LAYER_LISTS, OPTIONAL, config_aux_ids,
                                  eagle_config, expected_shapes, from_hf_indices, sglang_name)
from runner.drafts.safetensors import draft_tensors, tensor_values, write_safetensors
from runner.errors import ConvertError, InspectError, TargetConfigError
from runner.files import atomic_path
from runner.inspect import inspect_draft
from runner.target_config import read_target_config

SPECULATORS_ONLY = ("speculators_model_type", "speculators_config", "speculators_version",
                    "transformer_layer_config", "eagle_aux_hidden_state_layer_ids",
                    "norm_before_residual", "embed_requires_grad", "enable_sp_ulysses", "auto_map",
                    "has_no_defaults_at_init")


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


def convert(src, dst, target=None) -> list[str]:
    """Convert SRC (speculators or layers.0 style) into an SGLang draft at DST (must not exist).

    target: HF folder / config.json / GGUF (checks vocab and widths) or None.
    Returns notes on what changed. Raises ConvertError (nothing written) when unsafe."""
    src, dst = Path(src), Path(dst)
    if dst.exists():
        raise ConvertError(f"{dst} exists; choose a new destination (convert never overwrites).")
    if dst.resolve().is_relative_to(src.resolve()):
        raise ConvertError(f"{dst} is inside the source {src}; choose a destination outside it.")
    try:
        scfg = json.loads((src / "config.json").read_text(encoding="utf-8"))
        tensors = draft_tensors(src)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError, InspectError) as e:
        raise ConvertError(f"{src}: needs config.json and *.safetensors ({e})")
    if not isinstance(scfg, dict):
        raise ConvertError(f"{src}/config.json: must be a JSON object, got a {type(scfg).__name__}")
    tgt = None
    if target:
        try:
            tgt = read_target_config(Path(target).expanduser())
        except (FileNotFoundError, TargetConfigError) as e:
            raise ConvertError(f"--target {target}: cannot read its config ({e})")
    renamed: dict[str, dict] = {}
    for name, t in tensors.items():
        new = sglang_name(name)
        if new.split(".")[0] in LAYER_LISTS:
            raise ConvertError(f"tensor {name}: a second decoder layer; SGLang's EAGLE-3 draft has one.")
        if new in renamed:
            raise ConvertError(f"tensors {name} and another both map to {new}.")
        renamed[new] = t
    if "lm_head.weight" not in renamed:
        raise ConvertError("no lm_head.weight (or prefixed variant): nothing to take the draft "
                           "vocab from.")
    rows = renamed["lm_head.weight"]["shape"][0]
    cfg, notes = convert_config(scfg, rows, tgt)
    notes += [f"rename: {a} -> {sglang_name(a)}" for a in sorted(tensors) if sglang_name(a) != a][:3]
    exp = expected_shapes(cfg)
    unknown = sorted(set(renamed) - set(exp) - set(OPTIONAL))
    if unknown:
        raise ConvertError(f"tensors with no SGLang name: {unknown[:5]}; cannot tell what they are.")
    V = cfg["vocab_size"]
    get = lambda k: tensor_values(renamed[k]) if k in renamed else None  # noqa: E731
    t2d = get("t2d")
    t2d = t2d.reshape(-1).astype(bool) if t2d is not None else None
    if t2d is not None and len(t2d) != V:
        raise ConvertError(f"t2d has {len(t2d)} entries but vocab_size is {V}.")
    d2t_raw = get("d2t")
    if d2t_raw is not None and d2t_raw.reshape(-1).shape[0] != rows:
        raise ConvertError(f"len(d2t) = {d2t_raw.size} but lm_head.weight has {rows} rows.")
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
            errs = [f for f in inspect_draft(tmp, tgt) if f.severity == "error"]
            if errs:
                raise ConvertError("the converted draft still fails inspection:\n" +
                                   "\n".join(f"  {f.code}: {f.message}" for f in errs))
    except OSError as e:  # e.g. a full disk: nothing is left at dst
        raise ConvertError(f"writing {dst} failed: {e.strerror or e}; nothing was written there.")
    return notes


def convert_cli(src, dst, to="sglang", target=None) -> int:
    """`runner convert SRC DST --to sglang [--target T]`: exit 0 on success, 1 with the reason."""
    if to != "sglang":
        print(f"error: --to {to}: only sglang is supported", file=sys.stderr)
        return 1
    try:
        notes = convert(src, dst, target)
    except ConvertError as e:
        print(f"error: cannot convert {src}: {e}", file=sys.stderr)
        return 1
    for n in notes:
        print(f"  {n}")
    print(f"wrote {dst} (SGLang LlamaForCausalLMEagle3); check it with `runner inspect {dst}"
          f"{' --target ' + str(target) if target else ''}`")
    return 0
