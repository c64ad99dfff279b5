"""The tensor checks of `runner inspect`: the safetensors files as SGLang loads them (the index,
a name in two files), each tensor name per SGLang version (loaded, or dropped silently), missing
parameters (what each version leaves in them), shapes and the fc width, the draft vocab sizes,
d2t/t2d values, weight dtypes and non-finite weights.

The facts are in runner/drafts/ (forward.py: which parameters a version builds and which names
load into them; safetensors.py: headers and bounded reads). Every read is bounded: d2t/t2d are
read whole only up to 256 MiB, weights in full up to 8 MiB each and otherwise sampled (16
windows), 512 MiB at most per draft; `Findings.notes` says what was read. Numpy only, no torch.
"""

from __future__ import annotations

import numpy as np

from eagle3_runner.runner.drafts.forward import draft_params, flag_on, optional_params, own_embedding, resolve
from eagle3_runner.runner.drafts.layout import (EMBED, FC_NORM, FC_NORM_LEGACY, INPUT_NORM, LAYER0, MODEL_PREFIX,
                                  TRAINING_PREFIXES, is_second_layer, sglang_name)
from eagle3_runner.runner.drafts.rules import RULES, RuleSet, by_rows
from eagle3_runner.runner.drafts.safetensors import (DTYPES, FLOAT_DTYPES, INDEX, INT_DTYPES, DraftScan,
                                       nonfinite, tensor_values)
from eagle3_runner.runner.errors import InspectError
from eagle3_runner.runner.inspect_checks import Findings

MAX_VALUES = 256 << 20  # d2t / t2d larger than this are not read
WEIGHT_BUDGET = 512 << 20  # bytes of weights read per draft for the non-finite check


def _category(n: str, view: dict, params: dict) -> str | None:
    """Why a dropped tensor name is dropped (for the message), None = already reported."""
    if n.startswith(TRAINING_PREFIXES):
        return "prefix"
    if n.startswith(MODEL_PREFIX):
        return "model"
    if n.startswith((FC_NORM, *FC_NORM_LEGACY)):
        return None if flag_on(view, "fc_norm") or flag_on(view, "use_aux_norm") else "flag"
    if n == INPUT_NORM:
        return None if flag_on(view, "norm_before_fc") else "flag"
    if is_second_layer(n):
        return "deeper"
    if n.startswith(LAYER0) and sglang_name(n) in params:
        return "layers0"
    if n.endswith(".bias"):
        return "bias"
    return "unknown"


def _dropped_message(cat: str, ns: list, v: str) -> tuple[str, str]:
    eg = f"{ns[:5]}{' ...' if len(ns) > 5 else ''}"
    return {
        "layers0": ("E_KEY_LAYERS0", f"{len(ns)} tensors are named `layers.0.*` (e.g. {ns[0]}); "
                    f"{v} loads only `midlayer.*` and drops these silently, leaving the layer "
                    "random (accept length ~1.00). Rename layers.0. -> midlayer. with `runner "
                    "convert` (every version loads midlayer.*)."),
        "deeper": ("E_NUM_LAYERS", f"tensors of a decoder layer beyond num_hidden_layers ({ns[0]}"
                   f", ...): {v} drops them silently. An EAGLE-3 draft has one layer here; set "
                   "num_hidden_layers to match or train a one-layer draft."),
        "prefix": ("E_KEY_PREFIX", f"{len(ns)} tensors carry a training prefix (e.g. {ns[0]}); "
                   f"{v} drops them silently. Strip the prefix (`runner convert`)."),
        "model": ("E_KEY_PREFIX", f"{ns[0]}: SGLang retries unknown names only as "
                  f"`model.<name>`, so {v} drops this tensor silently. Strip the `model.` prefix "
                  "(`runner convert`)."),
        "flag": ("E_FLAG_TENSORS", f"{eg}: norm tensors of fc_norm / norm_before_fc, but config."
                 f"json does not turn that flag on, so {v} builds no such norm and drops them: the "
                 "draft runs without norms it was trained with. Set the flag (fc_norm: read from "
                 "0.5.14, norm_before_fc: from 0.5.23) or remove the tensors."),
        "bias": ("E_KEY_UNKNOWN", f"{eg}: biases {v} does not build (q/k/v_proj never have one in "
                 "llama_eagle3.py; o_proj needs `attention_bias` or `bias`, fc needs `bias`), so "
                 "they are dropped silently and the draft runs without them. Set the config flag "
                 "or retrain without these biases."),
        "unknown": ("E_KEY_UNKNOWN", f"tensors SGLang does not know: {eg}; {v} drops them "
                    "silently. Rename them to SGLang's names (midlayer.*, fc, norm, lm_head, d2t, "
                    "t2d) or remove them."),
    }[cat]


def _unloaded_layers(row, N, p: str) -> tuple:
    """The finding for num_hidden_layers N > 1 over a file of one layer (p: a parameter of layer
    1 with no tensor), at the severity row.unloaded_layer gives (runner/drafts/rules.py: an error
    where those layers stay uninitialised, a warning where a lab served such a draft as well as
    the one-layer export)."""
    def what(v: str) -> str:
        return (f"config.json num_hidden_layers = {N}: {v} builds {N} decoder layers, but the "
                f"safetensors hold one (no {p.split('.')[0]}.1.* tensor, e.g. {p}), so layers "
                f"1..{N - 1} keep their initial weights (torch.empty). ")
    fix = "An EAGLE-3 draft has one layer: set num_hidden_layers: 1."
    if row.unloaded_layer == "served":
        return ("warning", "W_NUM_LAYERS", "num_hidden_layers", lambda v: what(v) + (
            f"The conformance lab served such a draft on {v} as well as the one-layer export "
            "(the extra layer's memory held zeros, which nothing guarantees). ") + fix)
    return ("error", "E_NUM_LAYERS", "num_hidden_layers", lambda v: what(v) + fix)


def _row_names(row, view, tensors, params) -> list[tuple]:
    """Names dropped, loaded twice or missing on one row (merged over rows by by_rows)."""
    out, into = [], {}
    res = {n: resolve(row, n, params) for n in tensors}
    cats: dict[str, list] = {}
    for n in sorted(tensors):
        if res[n] is None:
            c = _category(n, view, params)
            if c:
                cats.setdefault(c, []).append(n)
        else:
            into.setdefault(res[n], []).append(n)
    for c, ns in cats.items():
        code, _ = _dropped_message(c, ns, "")
        out.append(("error", code, c, lambda v, c=c, ns=ns: _dropped_message(c, ns, v)[1]))
    for p, ns in into.items():
        if len(ns) > 1:
            out.append(("error", "E_DUPLICATE_TENSOR", p, lambda v, p=p, ns=ns: (
                f"{ns} all load into {p} on {v}; the later one wins silently. Keep one.")))
    told = {sglang_name(n) for ns in cats.values() for n in ns}  # dropped, said why above
    missing = [p for p in params if p not in into and p not in told
               and p not in optional_params(row, view)]
    deeper = [p for p in missing if is_second_layer(p)]
    if deeper and not any(is_second_layer(p) for p in into):  # the config is the cause
        out.append(_unloaded_layers(row, view.get("num_hidden_layers"), deeper[0]))
        missing = [p for p in missing if p not in deeper]
    plain = []
    for p in missing:
        if p.endswith("o_proj.bias"):
            flag = "bias" if view.get("bias") else "attention_bias"
            if row.o_proj_bias_absent == "uninitialised":
                out.append(("error", "E_O_PROJ_BIAS", p, lambda v, p=p, f=flag: (
                    f"config.json {f} = true makes {v} build an o_proj bias, and {p} is not in "
                    f"the file: it stays uninitialised (torch.empty). Export {p} or set {f} "
                    "false.")))
            else:
                out.append(("warning", "W_O_PROJ_BIAS", p, lambda v, p=p, f=flag: (
                    f"config.json {f} = true makes {v} build an o_proj bias; {p} is not in the "
                    "file, so it is zeros: right only if training had no o_proj bias.")))
        elif p == "lm_head.weight":
            out.append(("error", "E_KEY_MISSING", p, lambda v: (
                "lm_head.weight is missing: SGLang would keep a random head. Export the trained "
                "head as lm_head.weight [draft_vocab_size, hidden_size].")))
        elif p == EMBED:
            out.append(("error", "E_KEY_MISSING", p, lambda v: (
                f"{EMBED} is missing: with target_hidden_size {view.get('target_hidden_size')} != "
                f"hidden_size {view.get('hidden_size')} {v} uses the draft's own embedding (no "
                "swap from the target, llama.py set_embed), which then stays uninitialised. "
                "Export the trained embedding.")))
        elif p == "fc.bias":
            out.append(("error", "E_KEY_MISSING", p, lambda v: (
                "config.json bias = true but fc.bias is missing; SGLang keeps fc's bias at its "
                "initial value. Set bias: false or export fc.bias.")))
        else:
            plain.append(p)
    if plain:
        out.append(("error", "E_KEY_MISSING", "plain", lambda v, ps=plain: (
            f"{ps[0]}{' and ' + str(len(ps) - 1) + ' more' if len(ps) > 1 else ''} missing from "
            f"the safetensors files; {v} keeps these modules at their initial values (linear "
            "layers uninitialised, norms ones). Export the trained tensors under these names.")))
    out += _row_shapes(row, view, tensors, res, params)
    return out


def _row_shapes(row, view, tensors, res, params) -> list[tuple]:
    out = []
    loaded = {p: tensors[n] for n, p in res.items() if p is not None and p in params}
    H, nh, hd = view.get("hidden_size"), view.get("num_attention_heads"), view.get("head_dim")
    hd_eff = hd or (H // nh if H and nh else None)
    for p, want in params.items():
        t = loaded.get(p)
        if t is None or list(t["shape"]) == want or p == "lm_head.weight":
            continue
        got = list(t["shape"])
        if p == "fc.weight":
            if len(got) != 2 or got[0] != want[0]:
                out.append(("error", "E_FC_SHAPE", p, lambda v, g=got, want=want: (
                    f"fc.weight is {g}, but {v} builds fc as {want} ([hidden_size, n_aux x "
                    "target hidden]).")))
            else:
                L, Ht = view.get("_target_layers"), view.get("target_hidden_size") or H
                why = (f" That is all {L + 1} hidden states ({L + 1} x {Ht}) concatenated; "
                       "capture only the aux layers." if L and got[1] == (L + 1) * Ht else "")
                out.append(("error", "E_FC_WIDTH", p, lambda v, g=got, why=why, w=want[1], Ht=Ht: (
                    f"fc.weight is {g}, but {v} builds fc with input width n_aux x target "
                    f"hidden = {w // Ht} x {Ht} = {w}.{why}")))
        elif p.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")) and \
                len(got) == 2 and got[1:] == want[1:]:
            heads = nh if "q_proj" in p else (view.get("num_key_value_heads") or nh)
            fix = (f"head_dim would be {got[0] // heads}; set head_dim: {got[0] // heads}"
                   if got[0] % heads == 0 else "fix num_attention_heads/num_key_value_heads/head_dim")
            field = "num_attention_heads" if "q_proj" in p else "num_key_value_heads"
            out.append(("error", "E_HEAD_DIM", p, lambda v, p=p, got=got, heads=heads, fix=fix,
                        field=field: (
                f"{p} has {got[0]} rows, but {field} x head_dim = {heads} x {hd_eff} = "
                f"{heads * hd_eff} (config head_dim "
                f"{hd if hd is not None else 'unset = hidden_size/heads'}); {fix} in config.json.")))
        elif p.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
            out.append(("error", "E_QKV_SHAPE", p, lambda v, p=p, got=got, want=want: (
                f"{p} is {got}, expected {want} on {v} ([heads x head_dim, 2 x hidden_size] for "
                "layer 0: attention takes the normalised embedding and hidden concatenated).")))
        else:
            out.append(("error", "E_SHAPE", p, lambda v, p=p, got=got, want=want: (
                f"{p} is {got}, but config.json implies {want} on {v}; fix config.json "
                "(hidden_size, intermediate_size, heads, head_dim) or the tensor.")))
    return out


def check_tensors(view: dict, scan: DraftScan, tgt: dict | None, rules: RuleSet) -> Findings:
    """Checks of the tensors against config.json (a typed view), the target and `rules`."""
    out = Findings()
    E, W = out.error, out.warning
    for p in scan.problems:
        E("E_TRUNCATED" if "truncated" in p else "E_INDEX" if INDEX in p else "E_SAFETENSORS", p)
    if scan.problems:
        return out
    if scan.excluded:
        W("W_INDEX_EXCLUDES", f"{INDEX} names none of {[p.name for p in scan.excluded]}: SGLang "
          "loads only the files the index names, so their tensors are not loaded.")
    for k, fs in scan.duplicates.items():
        E("E_DUPLICATE_TENSOR", f"tensor {k!r} is in {[f.name for f in fs]}: SGLang loads every "
          "file and the later load wins silently. Keep one copy.")
    tensors = scan.tensors
    if not tensors:
        E("E_NO_WEIGHTS", "no tensors in any *.safetensors file. Export model.safetensors (SGLang "
          "names: midlayer.*, fc, norm, lm_head, d2t, t2d).")
        return out
    view = {**view, "_target_layers": (tgt or {}).get("num_hidden_layers")}
    try:
        params = {r.read: draft_params(r, view) for r in RULES}
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        E("E_CONFIG_FIELD", f"config.json lacks a usable Llama geometry field ({e!r}); add "
          "hidden_size, num_attention_heads, intermediate_size and vocab_size.")
        params = None
    if params is not None:
        out.add(by_rows(rules, lambda r: _row_names(r, view, tensors, params[r.read])))
    modelp = sorted(n for n in tensors if n.startswith(MODEL_PREFIX)
                    and params and resolve(rules.rows[-1], n, params[rules.rows[-1].read]))
    if modelp:
        W("W_KEY_MODEL_PREFIX", f"{len(modelp)} tensors carry a `model.` prefix (e.g. {modelp[0]}); "
          "SGLang retries them as model.<name> and loads them, other loaders do not. Strip it "
          "(`runner convert`).")
    if EMBED in tensors and params and not own_embedding(view):
        W("W_EMBED_IGNORED", f"{EMBED} is in the file, but SGLang replaces it with the target's "
          "embedding (target_hidden_size equals hidden_size or is unset; llama.py set_embed), so "
          "it is never used. Drop it.")
    row = rules.rows[-1]
    p = params[row.read] if params else {}
    by = {}
    for n in tensors:
        by.setdefault(resolve(row, n, p) if p else n, n)
    out += _check_vocab(view, tensors, by, tgt)
    weights = [n for n in sorted(tensors) if p and resolve(row, n, p) not in (None, "d2t", "t2d")]
    out += _check_quantization(view, tensors, weights)
    out += _check_weights(tensors, weights, quantized=_quant_method(view) is not None)
    return out


def _check_vocab(view, tensors, by, tgt) -> Findings:
    out = Findings()
    E, W = out.error, out.warning
    lm = tensors.get(by.get("lm_head.weight", "lm_head.weight"))
    d2t = tensors.get(by.get("d2t", "d2t"))
    t2d = tensors.get(by.get("t2d", "t2d"))
    H, V = view.get("hidden_size"), view.get("vocab_size") or (tgt or {}).get("vocab_size")
    dvs = view.get("draft_vocab_size")
    rows = lm["shape"][0] if lm is not None and len(lm["shape"]) == 2 else None
    if lm is not None and (len(lm["shape"]) != 2 or (H and lm["shape"][1] != H)):
        E("E_SHAPE", f"lm_head.weight is {lm['shape']}, expected [draft_vocab_size, {H}].")
    n_d2t = None
    if d2t is not None:
        if len(d2t["shape"]) != 1:
            E("E_D2T_RANK", f"d2t has shape {d2t['shape']}: SGLang computes hot_token_id = d2t + "
              "arange(d2t.shape[0]) (llama_eagle3.py), which broadcasts any other rank into wrong "
              "ids silently. Store d2t as int64 [draft_vocab_size].")
        else:
            n_d2t = d2t["shape"][0]
    sizes = {k: v for k, v in (("lm_head.weight rows", rows), ("config draft_vocab_size", dvs),
                               ("len(d2t)", n_d2t)) if isinstance(v, int)}
    if len(set(sizes.values())) > 1:
        E("E_VOCAB_MISMATCH", f"draft vocab sizes disagree: {sizes}. They must be equal; set "
          f"draft_vocab_size to the lm_head rows ({rows}) and export d2t of that length.")
    if d2t is None:
        if rows is not None and V and rows < V:
            E("E_D2T_MISSING", f"lm_head.weight has {rows} rows (< target vocab {V}) but there is no "
              "d2t tensor: SGLang cannot map draft ids to target ids. Export d2t int64 "
              "[draft_vocab_size] with OFFSETS (target_id = i + d2t[i]).")
    elif n_d2t is not None:
        try:
            out += _check_d2t(d2t, t2d, V)
        except InspectError as e:
            E("E_SAFETENSORS", str(e))
    if t2d is None:
        if d2t is not None:
            W("W_T2D_MISSING", "no t2d tensor: SGLang ignores it, but training and vLLM use it. "
              "Export t2d bool [vocab_size].")
    else:
        if t2d["dtype"] != "BOOL":
            W("W_T2D_DTYPE", f"t2d has dtype {t2d['dtype']}; it should be bool.")
        if V and t2d["shape"] != [V]:
            W("W_T2D_SHAPE", f"t2d has shape {t2d['shape']}; it should be [vocab_size] = [{V}].")
    return out


def _nbytes(t: dict) -> int:
    return t["data_offsets"][1] - t["data_offsets"][0]


def _check_d2t(d2t: dict, t2d: dict | None, V: int | None) -> Findings:
    out = Findings()
    E, W = out.error, out.warning
    if d2t["dtype"] not in INT_DTYPES:
        E("E_D2T_DTYPE", f"d2t has dtype {d2t['dtype']}: it must be int64 (a float cannot hold "
          "every token id exactly; bf16 is exact only up to 256). Rebuild d2t as int64 offsets "
          "(`runner convert` rebuilds it from t2d).")
    elif d2t["dtype"] != "I64":
        W("W_D2T_DTYPE", f"d2t has dtype {d2t['dtype']}; SGLang and vLLM expect int64.")
    if d2t["dtype"] not in DTYPES or _nbytes(d2t) > MAX_VALUES:
        return out
    vals = tensor_values(d2t).astype(np.float64).reshape(-1)
    n = len(vals)
    if n == 0 or not np.all(np.isfinite(vals)):
        if n:
            E("E_D2T_RANGE", "d2t holds NaN or Inf values; rebuild it as int64 offsets.")
        return out
    tid = vals + np.arange(n)
    used = (np.flatnonzero(tensor_values(t2d).reshape(-1))
            if t2d is not None and t2d["dtype"] in DTYPES and _nbytes(t2d) <= MAX_VALUES else None)
    strictly = n > 1 and bool(np.all(np.diff(vals) > 0))
    in_range = bool(vals.min() >= 0) and (V is None or vals.max() < V)
    if V is not None and (tid.max() >= V or tid.min() < 0):
        i = int(np.argmax(tid >= V)) if tid.max() >= V else int(np.argmax(tid < 0))
        if in_range and strictly:
            E("E_D2T_ABSOLUTE", f"d2t holds absolute target ids, not offsets: i + d2t[i] = {i} + "
              f"{int(vals[i])} = {int(tid[i])} >= vocab {V} at i = {i}. SGLang reads OFFSETS "
              "(target_id = i + d2t[i]). Store d2t[i] = target_id - i (`runner convert` does it).")
        else:
            E("E_D2T_RANGE", f"d2t maps draft id {i} to target id {int(tid[i])}, outside [0, {V}). "
              "d2t must hold offsets: target_id = i + d2t[i].")
        return out
    if used is not None and len(used) == n and in_range and np.array_equal(np.sort(vals), used) \
            and not np.array_equal(tid, used):
        E("E_D2T_ABSOLUTE", "d2t holds absolute target ids (its values are exactly the ids marked "
          "in t2d), not offsets. SGLang reads target_id = i + d2t[i]. Store d2t[i] = target_id - i "
          "(`runner convert` does it).")
        return out
    if len(np.unique(tid)) != n:
        E("E_D2T_DUPLICATE", "d2t maps two draft ids to the same target id (i + d2t[i] repeats); "
          "rebuild d2t from the sorted draft vocab: d2t[i] = used[i] - i.")
    elif strictly and n >= 64 and used is None:
        W("W_D2T_LOOKS_ABSOLUTE", f"d2t is strictly increasing over all {n} entries, as absolute "
          "ids are; offsets (used[i] - i) of a frequency-chosen vocab normally repeat. Check that "
          "d2t holds offsets (target_id = i + d2t[i]).")
    elif not vals.any() and V is not None and n < V:
        W("W_D2T_ZERO", "d2t is all zeros: the draft vocab is target ids 0..draft_vocab_size-1, "
          "which usually means the vocab mapping was never written.")
    if used is not None and not np.array_equal(np.sort(tid), used):
        W("W_T2D_D2T_MISMATCH", f"t2d marks {len(used)} target ids, but they are not the "
          f"{n} ids i + d2t[i]; rebuild t2d[j] = (j in i + d2t).")
    return out


def _quant_method(view: dict) -> str | None:
    """config.json quantization_config's quant_method ("?" when it names none), or None."""
    q = view.get("quantization_config")
    if q is None:
        return None
    return str(q.get("quant_method") or "?") if isinstance(q, dict) else "?"


def _check_quantization(view: dict, tensors: dict, names: list) -> Findings:
    """A quantization_config in the draft's config.json. Every SGLang version of the rules table
    builds the draft's linear layers with that quant_method (SGLang 0.5.6 / 0.5.14 / 0.5.23
    configs/model_config.py _verify_quantization: the draft's own config wins over the target's
    method, 0.5.6 refuses one unlike the target's), so float weights without their scales load
    into quantized parameters: an error. Quantized weights (no float dtype) are a warning: what
    SGLang does with their scales is not checked here."""
    out, method = Findings(), _quant_method(view)
    if method is None:
        return out
    floats = [n for n in names if tensors[n]["dtype"] in FLOAT_DTYPES]
    if floats and len(floats) == len(names):
        out.error("E_DRAFT_QUANTIZED", f"config.json quantization_config (quant_method "
                  f"{method!r}) over float weights ({tensors[floats[0]]['dtype']}, e.g. "
                  f"{floats[0]}): SGLang builds the draft's layers with the draft config's own "
                  "quant_method (configs/model_config.py, 0.5.6-0.5.23), so these weights load "
                  "into quantized parameters without their scales (0.5.6 refuses a method unlike "
                  "the target's). A copy of the target's config carries it over. Remove "
                  "quantization_config from the draft's config.json (`runner convert` drops it), "
                  "or launch with --speculative-draft-model-quantization unquant.")
    else:
        out.warning("W_DRAFT_QUANTIZED", f"config.json quantization_config (quant_method "
                    f"{method!r}) with quantized weights: SGLang builds the draft's layers with "
                    "it; its scales and layout are not checked here, and the non-finite check "
                    "skips non-float weights.")
    return out


def _check_weights(tensors: dict, names: list, quantized: bool = False) -> Findings:
    """Weight dtypes (float only, unless the config declares a quantization: quantized) and
    non-finite values, with a bounded read (module docstring)."""
    out = Findings()
    bad_dtype = [f"{n} ({tensors[n]['dtype']})" for n in names
                 if tensors[n]["dtype"] not in FLOAT_DTYPES]
    if bad_dtype and not quantized:
        out.error("E_WEIGHT_DTYPE", f"weights with a non-float or unknown dtype: {bad_dtype[:5]}"
                  f"{' ...' if len(bad_dtype) > 5 else ''}. SGLang copies them into float "
                  "parameters as plain numbers (no quantization scales), so the draft computes "
                  "garbage. Export float weights (bf16).")
    left, full, sampled, skipped, read, total, nan = WEIGHT_BUDGET, 0, 0, 0, 0, 0, []
    for n in names:
        t = tensors[n]
        if t["dtype"] not in FLOAT_DTYPES or _nbytes(t) == 0:
            continue
        total += _nbytes(t)
        if left <= 0:
            skipped += 1
            continue
        try:
            k, got, size = nonfinite(t)
        except InspectError as e:
            out.error("E_SAFETENSORS", str(e))
            continue
        left -= got
        read += got
        full, sampled = (full + 1, sampled) if got == size else (full, sampled + 1)
        if k:
            nan.append(f"{n} ({k} in the {'whole tensor' if got == size else f'{got >> 20} MiB sampled'})")
    if nan:
        out.error("E_NONFINITE", f"NaN/Inf weights: {nan[:5]}{' ...' if len(nan) > 5 else ''}. "
                  "The drafter is broken (a NaN loss in training?); SGLang would serve it without "
                  "a word. Retrain it.")
    if total:
        out.notes.append(f"weights checked for NaN/Inf: {full} tensors read in full, {sampled} "
                         f"sampled (16 windows each), {skipped} not read (budget "
                         f"{WEIGHT_BUDGET >> 20} MiB); {read / 2**20:.1f} of "
                         f"{total / 2**20:.1f} MiB read")
    return out
