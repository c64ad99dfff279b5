"""The checks of `runner inspect` (runner/inspect.py runs them): an sglang.launch_server line,
config.json alone and against the target's config and the training provenance, and the tensors
(names SGLang knows or drops silently, shapes, fc width, draft vocab sizes, d2t/t2d values).

What SGLang expects is stated once in runner/drafts/: the layout (layout.py) and the rules with
their messages (rules.py). Each check returns Findings; E_* codes are errors, W_* warnings.
Numpy only, no torch.
"""

from __future__ import annotations

import shlex
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from runner.drafts.layout import (ALGORITHM, ARCH, AUX_COUNT, AUX_IDS_KEY, KNOWN, LAYER0,
                                  MIDLAYER, MODEL_PREFIX, TRAINING_PREFIXES, config_aux_ids,
                                  default_aux_ids, expected_shapes, from_hf_indices,
                                  is_second_layer, sglang_name, target_rope)
from runner.drafts.rules import config_aux_findings, server_draft_tokens_problem
from runner.drafts.safetensors import DTYPES, INT_DTYPES, tensor_values


@dataclass(frozen=True)
class Finding:
    severity: str  # "error" | "warning"
    code: str  # stable, e.g. "E_D2T_ABSOLUTE"
    message: str  # names the field and the fix

    def as_dict(self) -> dict:
        return asdict(self)


class Findings(list):
    """The findings of one check, in order: `.error(code, message)` / `.warning(code, message)`
    append one."""

    def error(self, code: str, message: str) -> None:
        self.append(Finding("error", code, message))

    def warning(self, code: str, message: str) -> None:
        self.append(Finding("warning", code, message))


# ----------------------------------------------------------------------------------------------
# checks


def _find_key(obj, names: tuple[str, ...]):
    """First value of any key in `names` found anywhere in a nested dict (provenance files)."""
    if isinstance(obj, dict):
        for n in names:
            if isinstance(obj.get(n), list):
                return obj[n]
        for v in obj.values():
            r = _find_key(v, names)
            if r is not None:
                return r
    return None


_HF_KEYS = ("hf_hidden_indices", "captured_hf_indices", "hf_indices")
_SG_KEYS = ("aux_layer_ids", "eagle_aux_hidden_state_layer_ids")


def check_server_args(args: str, draft_dir: Path, cfg: dict) -> list[Finding]:
    """Checks of an `sglang.launch_server` command line (parsed with shlex)."""
    out = Findings()
    E, W = out.error, out.warning
    toks, flags = shlex.split(args), {}
    for i, t in enumerate(toks):
        if t.startswith("--"):
            k, eq, v = t.partition("=")
            nxt = toks[i + 1] if i + 1 < len(toks) else "--"
            flags[k] = v if eq else ("" if nxt.startswith("--") else nxt)
    alg = flags.get("--speculative-algorithm")
    if alg is None:
        E("E_SERVER_NO_ALGORITHM", "--speculative-algorithm is missing: the server runs without "
          "speculative decoding. Add `--speculative-algorithm EAGLE3`.")
    elif alg != ALGORITHM:
        E("E_ALGORITHM_NOT_EAGLE3", f"--speculative-algorithm {alg}: an EAGLE-3 draft needs exactly "
          "`--speculative-algorithm EAGLE3`. SGLang's is_eagle3() matches only that string; with "
          f"{alg!r} the draft loads but the target captures no aux hidden states, so accept length "
          "is 1.00.")
    path = flags.get("--speculative-draft-model-path") or flags.get("--speculative-draft-model")
    if not path:
        E("E_SERVER_NO_DRAFT_PATH", "--speculative-draft-model-path is missing. Add "
          f"`--speculative-draft-model-path {draft_dir}`.")
    elif Path(path).exists() and Path(path).resolve() != Path(draft_dir).resolve():
        W("W_SERVER_DRAFT_PATH", f"--speculative-draft-model-path {path} is not the inspected "
          f"directory {draft_dir}; the server will load another draft.")
    nums = {k: flags.get(f"--speculative-{k}") for k in ("num-steps", "eagle-topk", "num-draft-tokens")}
    try:
        s, k, n = (int(v) if v not in (None, "") else None for v in nums.values())
    except ValueError:
        E("E_SERVER_SPEC_PARAMS", f"speculative flags must be integers, got {nums}.")
        return out
    if sum(v is not None for v in (s, k, n)) in (1, 2):
        W("W_SERVER_SPEC_PARAMS", "set all of --speculative-num-steps, --speculative-eagle-topk "
          "and --speculative-num-draft-tokens, or none (SGLang fills the others with its own "
          f"defaults); got {({f'--speculative-{a}': b for a, b in nums.items() if b is not None})}.")
    problem = server_draft_tokens_problem(s, k, n)
    if problem:
        E("E_SERVER_DRAFT_TOKENS", problem)
    if "--speculative-token-map" in flags:
        W("W_SERVER_TOKEN_MAP", "--speculative-token-map is ignored for EAGLE3 (the draft's own "
          "d2t is used); drop it.")
    ctx = flags.get("--context-length")
    mpe = cfg.get("max_position_embeddings")
    if ctx and ctx.isdigit() and mpe and int(ctx) > mpe:
        E("E_MAX_POSITION_EMBEDDINGS", f"config.json max_position_embeddings = {mpe} is below the "
          f"serving --context-length {ctx}; older SGLang breaks past {mpe} tokens. Set "
          f"max_position_embeddings to at least {ctx}.")
    return out


def check_config(cfg: dict, tgt: dict | None, prov: dict | None) -> list[Finding]:
    """Checks of config.json alone and against the target's config (tgt may be None)."""
    out = Findings()
    E, W = out.error, out.warning
    arch = cfg.get("architectures")
    if "speculators_model_type" in cfg or "transformer_layer_config" in cfg:
        E("E_SPECULATORS_FORMAT", f"config.json is in speculators format (architectures {arch}); "
          "SGLang needs LlamaForCausalLMEagle3 with eagle_config nested. Run `runner convert SRC DST "
          "--to sglang`.")
    elif arch != [ARCH]:
        E("E_ARCHITECTURE", f"config.json architectures = {arch}: must be [{ARCH!r}] for an EAGLE-3 "
          "draft (LlamaForCausalLMEagle is EAGLE-1/2 and has no aux-state fc).")
    if cfg.get("num_hidden_layers", 1) != 1:
        E("E_NUM_LAYERS", f"config.json num_hidden_layers = {cfg.get('num_hidden_layers')}: an "
          "EAGLE-3 draft has one decoder layer (older SGLang builds only `midlayer` and drops the "
          "rest silently). Set num_hidden_layers: 1 and train a one-layer draft.")
    if cfg.get("tie_word_embeddings"):
        E("E_TIED_EMBEDDINGS", "config.json tie_word_embeddings = true: SGLang then uses the target "
          "embedding as lm_head and discards the trained draft head. Set tie_word_embeddings: false.")
    V = cfg.get("vocab_size")
    if "draft_vocab_size" not in cfg:
        E("E_DRAFT_VOCAB_MISSING", "config.json has no draft_vocab_size: SGLang then uses the "
          "target vocab and discards the trained lm_head. Set draft_vocab_size to the rows of "
          "lm_head.weight.")
    elif cfg["draft_vocab_size"] is None:
        E("E_DRAFT_VOCAB_NULL", "config.json draft_vocab_size = null: SGLang treats null as 'use the "
          "target vocab' and discards the trained lm_head. Set draft_vocab_size to the rows of "
          "lm_head.weight.")
    elif V and cfg["draft_vocab_size"] > V:
        E("E_DRAFT_VOCAB_SIZE", f"config.json draft_vocab_size = {cfg['draft_vocab_size']} exceeds "
          f"vocab_size = {V}.")
    H, ec = cfg.get("hidden_size"), cfg.get("eagle_config")
    ids = config_aux_ids(cfg)
    top = cfg.get(AUX_IDS_KEY)
    L = (tgt or {}).get("num_hidden_layers")
    if ec is not None and ec.get("use_aux_hidden_state") is False:
        E("E_AUX_DISABLED", "config.json eagle_config.use_aux_hidden_state = false: the target "
          "captures no aux hidden states. Set it to true.")
    if ids is None and top is not None:
        E("E_AUX_IDS_TOP_LEVEL", f"config.json has eagle_aux_hidden_state_layer_ids = {top} at the "
          "top level; SGLang reads only eagle_config.eagle_aux_hidden_state_layer_ids and silently "
          f"captures its default layers. Nest them under eagle_config (speculators' top-level ids "
          f"are HF hidden_states indices, so the SGLang ids are {from_hf_indices(top)}); "
          "`runner convert` does this.")
    elif ids is None:
        dflt = f" {default_aux_ids(L)} for this {L}-layer target" if L else ""
        W("W_AUX_IDS_DEFAULT", "config.json has no eagle_config.eagle_aux_hidden_state_layer_ids: "
          f"SGLang captures its default layers{dflt}. Write the ids training used.")
    if ids is not None:
        for code, msg in config_aux_findings(ids, L):
            E(code, msg)
    eff = ids if ids is not None else (default_aux_ids(L) if L and top is None else None)
    if prov is not None and eff is not None:
        feats = prov.get("features") if isinstance(prov.get("features"), dict) else {}
        hf = _find_key(feats, _HF_KEYS) or _find_key(prov, _HF_KEYS)
        sg = _find_key(feats, _SG_KEYS) or _find_key(prov, _SG_KEYS)
        where = "eagle_config.eagle_aux_hidden_state_layer_ids" + (
            "" if ids is not None else " (absent: SGLang default)")
        if hf is not None and list(eff) == list(hf):
            E("E_AUX_IDS_OFF_BY_ONE", f"{where} = {list(eff)} equals the HF hidden_states indices "
              f"{list(hf)} that provenance.json says training captured; SGLang ids are one lower "
              f"(id k = output of layer k = HF index k+1), so SGLang would feed layers shifted by "
              f"one. Set eagle_config.eagle_aux_hidden_state_layer_ids to {from_hf_indices(hf)}.")
        elif hf is not None and list(eff) != from_hf_indices(hf):
            E("E_AUX_IDS_PROVENANCE", f"{where} = {list(eff)}, but provenance.json says training "
              f"captured HF hidden_states {list(hf)} = SGLang ids {from_hf_indices(hf)}. Set the "
              "ids training used.")
        elif hf is None and sg is not None and list(eff) != list(sg):
            E("E_AUX_IDS_PROVENANCE", f"{where} = {list(eff)}, but provenance.json says training "
              f"used SGLang ids {list(sg)}. Set the ids training used.")
    if tgt is None:
        return out
    Vt, Ht = tgt.get("vocab_size"), tgt.get("hidden_size")
    if V and Vt and V != Vt:
        E("E_VOCAB_SIZE", f"config.json vocab_size = {V}, but the target vocab is {Vt}: vocab_size "
          "must be the TARGET vocab (t2d length; draft ids map into it). Set vocab_size: "
          f"{Vt}.")
    th = cfg.get("target_hidden_size")
    if H and Ht and H != Ht and th is None:
        E("E_TARGET_HIDDEN_SIZE", f"config.json hidden_size = {H} differs from the target hidden "
          f"{Ht}, and target_hidden_size is not set: SGLang sizes fc for 3 x {H} = {3 * H} inputs "
          f"and swaps in the target's {Ht}-wide embedding. Set target_hidden_size: {Ht}.")
    elif th is not None and Ht and th != Ht:
        E("E_TARGET_HIDDEN_SIZE", f"config.json target_hidden_size = {th}, but the target hidden "
          f"is {Ht}. Set target_hidden_size: {Ht}.")
    mpe, tmpe = cfg.get("max_position_embeddings"), tgt.get("max_position_embeddings")
    if mpe and tmpe and mpe < tmpe:
        E("E_MAX_POSITION_EMBEDDINGS", f"config.json max_position_embeddings = {mpe} is below the "
          f"target's {tmpe}: older SGLang breaks past {mpe} tokens when serving at {tmpe}. Set "
          f"max_position_embeddings: {tmpe}.")
    d_theta, d_scal = target_rope(cfg)
    t_theta, t_scal = target_rope(tgt)
    if cfg.get("rope_theta") is None and "rope_parameters" in cfg:
        W("W_ROPE_FORM", "config.json has rope_parameters but no top-level rope_theta; older "
          "SGLang reads only rope_theta/rope_scaling and would use rope_theta 10000. Write "
          f"rope_theta: {d_theta} at the top level.")
    if (t_theta is not None and d_theta != t_theta) or (t_scal or None) != (d_scal or None):
        W("W_ROPE_DIFFERS", f"config.json rope_theta/rope_scaling = {d_theta}/{d_scal} differ from "
          f"the target's {t_theta}/{t_scal}; the draft must be trained and served with the same "
          "RoPE as written here.")
    return out


def check_tensors(cfg: dict, tensors: dict, tgt: dict | None) -> list[Finding]:
    """Checks of tensor names, shapes and the d2t/t2d values against config.json and the target."""
    out = Findings()
    E, W = out.error, out.warning
    names = set(tensors)
    known = set(KNOWN)
    layer0 = sorted(n for n in names if n.startswith(LAYER0))
    deeper = sorted(n for n in names if is_second_layer(n))
    pref = sorted(n for n in names if n.startswith(TRAINING_PREFIXES))
    modelp = sorted(n for n in names if n.startswith(MODEL_PREFIX))
    if layer0:
        E("E_KEY_LAYERS0", f"{len(layer0)} tensors are named `layers.0.*` (e.g. {layer0[0]}); SGLang "
          "loads only `midlayer.*` and drops these silently, leaving the layer random (accept "
          "length ~1.00). Rename layers.0. -> midlayer. with `runner convert`.")
    if deeper:
        E("E_NUM_LAYERS", f"tensors of a second decoder layer ({deeper[0]}, ...): an EAGLE-3 draft "
          "has one layer; SGLang drops these silently.")
    if pref:
        E("E_KEY_PREFIX", f"{len(pref)} tensors carry a training prefix (e.g. {pref[0]}); SGLang "
          "drops them silently. Strip the prefix (`runner convert`).")
    bad_model = [n for n in modelp if n[6:] not in known and not n[6:].startswith(MIDLAYER)
                 or n[6:] == "lm_head.weight"]
    if bad_model:
        E("E_KEY_PREFIX", f"{bad_model[0]}: SGLang retries unknown names only as `model.<name>`, so "
          "this tensor is dropped silently. Strip the `model.` prefix (`runner convert`).")
    elif modelp:
        W("W_KEY_MODEL_PREFIX", f"{len(modelp)} tensors carry a `model.` prefix (e.g. {modelp[0]}); "
          "SGLang retries them as model.<name> and loads them, other loaders do not. Strip it "
          "(`runner convert`).")
    flagged = set(layer0) | set(deeper) | set(pref) | set(modelp)
    try:
        exp = expected_shapes(cfg) if isinstance(cfg.get("hidden_size"), int) else {}
    except (KeyError, TypeError, ZeroDivisionError) as e:
        E("E_CONFIG_FIELD", f"config.json lacks a Llama geometry field ({e}); add it.")
        exp = {}
    sglang_names = set(exp) or {n for n in names if n.startswith(MIDLAYER)}
    extra = sorted(names - flagged - known - sglang_names)
    if extra:
        E("E_KEY_UNKNOWN", f"tensors SGLang does not know: {extra[:5]}{' ...' if len(extra) > 5 else ''}; "
          "they are dropped silently. Rename them to SGLang's names (midlayer.*, fc, norm, "
          "lm_head, d2t, t2d) or remove them.")
    # which names to compare: SGLang's own, or the layers.0 / model. variants they would map to
    alias = {}
    for n in names:
        alias.setdefault(sglang_name(n), n)
    H = cfg.get("hidden_size")
    nh, hd = cfg.get("num_attention_heads"), cfg.get("head_dim")
    hd_eff = hd or (H // nh if H and nh else None)
    for name, shape in exp.items():
        have = tensors.get(alias.get(name, name))
        if have is None:
            if name not in ("t2d", "d2t", "lm_head.weight"):
                E("E_KEY_MISSING", f"{name} is missing from model.safetensors; SGLang keeps that "
                  "module at its random init. Export the trained tensor under this name.")
            continue
        got = list(have["shape"])
        if got == shape or name in ("d2t", "t2d", "lm_head.weight", "fc.weight"):
            continue
        if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")) and got[1:] == shape[1:]:
            heads = nh if "q_proj" in name else (cfg.get("num_key_value_heads") or nh)
            fix = (f"head_dim would be {got[0] // heads}; set head_dim: {got[0] // heads}"
                   if got[0] % heads == 0 else "fix num_attention_heads/num_key_value_heads/head_dim")
            field = "num_attention_heads" if "q_proj" in name else "num_key_value_heads"
            E("E_HEAD_DIM", f"{name} has {got[0]} rows, but {field} x head_dim = {heads} x "
              f"{hd_eff} = {heads * hd_eff} (config head_dim "
              f"{hd if hd is not None else 'unset = hidden_size/heads'}); {fix} in config.json.")
        elif name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
            E("E_QKV_SHAPE", f"{name} is {got}, expected {shape} ([heads x head_dim, 2 x hidden_size]: "
              "attention takes the normalised embedding and hidden concatenated).")
        else:
            E("E_SHAPE", f"{name} is {got}, but config.json implies {shape}; fix config.json "
              "(hidden_size, intermediate_size, heads, head_dim) or the tensor.")
    # fc width
    fc = tensors.get(alias.get("fc.weight", "fc.weight"))
    Ht = (tgt or {}).get("hidden_size")
    if fc is not None and H:
        rows, cols = fc["shape"]
        n_aux = len(config_aux_ids(cfg) or [0] * AUX_COUNT)
        want_in = cfg.get("target_hidden_size") or Ht or H
        if rows != H:
            E("E_FC_SHAPE", f"fc.weight has {rows} rows, but hidden_size = {H}.")
        if cols != n_aux * want_in:
            L = (tgt or {}).get("num_hidden_layers")
            why = (f" That is all {L + 1} hidden states ({L + 1} x {want_in}) concatenated; capture "
                   "only the 3 aux layers." if L and cols == (L + 1) * want_in else "")
            E("E_FC_WIDTH", f"fc.weight is [{rows}, {cols}], but its input width must be 3 x target "
              f"hidden = {n_aux} x {want_in} = {n_aux * want_in}.{why}")
    # draft vocab: lm_head rows, draft_vocab_size, len(d2t)
    lm = tensors.get(alias.get("lm_head.weight", "lm_head.weight"))
    d2t = tensors.get(alias.get("d2t", "d2t"))
    t2d = tensors.get(alias.get("t2d", "t2d"))
    V = cfg.get("vocab_size") or (tgt or {}).get("vocab_size")
    dvs = cfg.get("draft_vocab_size")
    rows = lm["shape"][0] if lm is not None else None
    if lm is None:
        E("E_KEY_MISSING", "lm_head.weight is missing: SGLang would keep a random head. Export the "
          "trained head as lm_head.weight [draft_vocab_size, hidden_size].")
    elif H and lm["shape"][1] != H:
        E("E_SHAPE", f"lm_head.weight is {lm['shape']}, expected [draft_vocab_size, {H}].")
    n_d2t = d2t["shape"][0] if d2t is not None else None
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
    else:
        out += _check_d2t(d2t, t2d, V)
    if t2d is None:
        if d2t is not None:
            W("W_T2D_MISSING", "no t2d tensor: SGLang ignores it, but training and vLLM use it. "
              "Export t2d bool [vocab_size].")
    else:
        if t2d["dtype"] != "BOOL":
            W("W_T2D_DTYPE", f"t2d has dtype {t2d['dtype']}; it should be bool.")
        if V and t2d["shape"] != [V]:
            W("W_T2D_SHAPE", f"t2d has shape {t2d['shape']}; it should be [vocab_size] = [{V}].")
    if cfg.get("bias") and "fc.bias" not in names:
        E("E_KEY_MISSING", "config.json bias = true but fc.bias is missing; SGLang keeps a random "
          "bias. Set bias: false or export fc.bias.")
    if "fc.bias" in names and not cfg.get("bias"):
        E("E_KEY_UNKNOWN", "fc.bias is present but config.json bias is not true: SGLang builds fc "
          "without a bias and drops it silently. Set bias: true.")
    return out


def _check_d2t(d2t: dict, t2d: dict | None, V: int | None) -> list[Finding]:
    out = Findings()
    E, W = out.error, out.warning
    if d2t["dtype"] not in INT_DTYPES:
        E("E_D2T_DTYPE", f"d2t has dtype {d2t['dtype']}: it must be int64 (a float cannot hold "
          "every token id exactly; bf16 is exact only up to 256). Rebuild d2t as int64 offsets "
          "(`runner convert` rebuilds it from t2d).")
    elif d2t["dtype"] != "I64":
        W("W_D2T_DTYPE", f"d2t has dtype {d2t['dtype']}; SGLang and vLLM expect int64.")
    if d2t["dtype"] not in DTYPES:
        return out
    vals = tensor_values(d2t).astype(np.float64).reshape(-1)
    n = len(vals)
    if n == 0:
        return out
    tid = vals + np.arange(n)
    used = (np.flatnonzero(tensor_values(t2d).reshape(-1))
            if t2d is not None and t2d["dtype"] in DTYPES else None)
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
