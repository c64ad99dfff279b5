"""The config checks of `runner inspect` (runner/inspect.py runs them): config.json alone, against
the target's config and against the training provenance, for the SGLang version rows being
checked; and the one `Findings` helper every check returns (the tensor checks are in
runner/inspect_tensors.py, the server-line rules in runner/drafts/server.py).

What SGLang expects is stated once in runner/drafts/: the layout (layout.py), the version table
and the aux-id rules (rules.py), the forward flags (forward.py), target families (families.py).
E_* codes are errors, W_* warnings. Numpy only, no torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from eagle3_runner.runner.drafts.checks import (config_aux_findings, default_aux_ids,
                                                draft_vocab_null_problem)
from eagle3_runner.runner.drafts.families import family_evidence
from eagle3_runner.runner.drafts.forward import config_flag_findings, engine_unsupported
from eagle3_runner.runner.drafts.layout import (ARCH, AUX_IDS_KEY, config_aux_ids, config_view, from_hf_indices,
                                  target_rope, to_hf_indices)
from eagle3_runner.runner.drafts.rules import RuleSet, by_rows, versions_label


@dataclass(frozen=True)
class Finding:
    severity: str  # "error" | "warning"
    code: str  # stable, e.g. "E_D2T_ABSOLUTE"
    message: str  # names the field and the fix

    def as_dict(self) -> dict:
        return asdict(self)


class Findings(list):
    """The findings of one check, in order: `.error(code, message)` / `.warning(code, message)`
    append one, `.add([(severity, code, message), ...])` the tuples runner/drafts/ returns;
    `.notes` holds lines about how the check ran (e.g. which weights were sampled)."""

    def __init__(self, *a):
        super().__init__(*a)
        self.notes: list[str] = []

    def error(self, code: str, message: str) -> None:
        self.append(Finding("error", code, message))

    def warning(self, code: str, message: str) -> None:
        self.append(Finding("warning", code, message))

    def add(self, items) -> None:
        for sev, code, message in items:
            self.append(Finding(sev, code, message))

    def __iadd__(self, other):
        self.extend(other)
        self.notes += getattr(other, "notes", [])
        return self


def _ints(v) -> list | None:
    if isinstance(v, list) and v and all(isinstance(x, int) and not isinstance(x, bool)
                                         and 0 <= x < 1 << 31 for x in v):
        return list(v)
    return None


def _find_key(obj, names: tuple[str, ...], depth: int = 0):
    """First list of ints under any key in `names` anywhere in a nested dict (provenance)."""
    if isinstance(obj, dict) and depth < 32:
        for n in names:
            if _ints(obj.get(n)) is not None:
                return obj[n]
        for v in obj.values():
            r = _find_key(v, names, depth + 1)
            if r is not None:
                return r
    return None


_HF_KEYS = ("hf_hidden_indices", "captured_hf_indices", "hf_indices")
_SG_KEYS = ("aux_layer_ids", "eagle_aux_hidden_state_layer_ids")
_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "half": "float16", "float32": "float32",
           "float": "float32"}  # SGLang configs/model_config.py _STR_DTYPE_TO_TORCH_DTYPE


def typed_target(tgt: dict | None) -> tuple[dict | None, list]:
    """The target config with wrongly typed fields removed, and the names removed."""
    if not isinstance(tgt, dict):
        return None, []
    view, problems = config_view(tgt)
    return view, [k for k, _ in problems]


def trained_indices(prov: dict | None) -> list | None:
    """The HF hidden_states indices provenance.json says training captured, or None."""
    if not isinstance(prov, dict):
        return None
    feats = prov.get("features") if isinstance(prov.get("features"), dict) else {}
    hf = _find_key(feats, _HF_KEYS) or _find_key(prov, _HF_KEYS)
    if hf is not None:
        return list(hf)
    sg = _find_key(feats, _SG_KEYS) or _find_key(prov, _SG_KEYS)
    return to_hf_indices(sg) if sg is not None else None


def check_config(cfg: dict, tgt: dict | None, prov: dict | None, rules: RuleSet) -> Findings:
    """Checks of config.json alone, against the target's config (tgt may be None) and against
    provenance.json (prov may be None), for `rules`. cfg is the raw config.json object."""
    out = Findings()
    E, W = out.error, out.warning
    view, problems = config_view(cfg)
    bad = {k for k, _ in problems}
    for k, m in problems:
        E("E_CONFIG_FIELD", m)
    tgt, tbad = typed_target(tgt)
    for k in tbad:
        W("W_TARGET_CONFIG", f"the target config's {k} has the wrong type; it was not used.")
    arch = view.get("architectures")
    if "speculators_model_type" in view or "transformer_layer_config" in view:
        E("E_SPECULATORS_FORMAT", f"config.json is in speculators format (architectures {arch}); "
          "SGLang needs LlamaForCausalLMEagle3 with eagle_config nested. Run `runner convert SRC DST "
          "--to sglang`.")
    elif arch != [ARCH] and "architectures" not in bad:
        E("E_ARCHITECTURE", f"config.json architectures = {arch}: must be [{ARCH!r}] for an EAGLE-3 "
          "draft (LlamaForCausalLMEagle is EAGLE-1/2 and has no aux-state fc).")
    if view.get("tie_word_embeddings"):
        E("E_TIED_EMBEDDINGS", "config.json tie_word_embeddings = true: SGLang then uses the target "
          "embedding as lm_head and discards the trained draft head. Set tie_word_embeddings: false.")
    V = view.get("vocab_size")
    if "draft_vocab_size" in bad:
        pass
    elif "draft_vocab_size" not in view:
        E("E_DRAFT_VOCAB_MISSING", "config.json has no draft_vocab_size: SGLang fails reading it "
          "(AttributeError at start). Set draft_vocab_size to the rows of lm_head.weight.")
    elif view["draft_vocab_size"] is None:
        E("E_DRAFT_VOCAB_NULL", draft_vocab_null_problem("config.json draft_vocab_size", V))
    elif V and view["draft_vocab_size"] > V:
        E("E_DRAFT_VOCAB_SIZE", f"config.json draft_vocab_size = {view['draft_vocab_size']} exceeds "
          f"vocab_size = {V}.")
    dt = view.get("dtype") or view.get("torch_dtype")
    if "dtype" not in bad and "torch_dtype" not in bad and _DTYPES.get(dt) in (None, "float32"):
        E("E_DRAFT_DTYPE", f"config.json torch_dtype = {dt!r}: under --dtype auto SGLang runs the "
          "draft in float16 when its config names float32 or no known dtype (configs/model_config"
          ".py _get_and_verify_dtype), not in the bfloat16 it was trained in. Write torch_dtype: "
          "bfloat16.")
    family, why = family_evidence(tgt) if tgt is not None else ("standard", None)
    L = (tgt or {}).get("num_hidden_layers")
    out += _check_aux(view, L, family, why, trained_indices(prov), rules)
    out.add(by_rows(rules, lambda r: config_flag_findings(r, view)))
    engine = engine_unsupported(view)
    if engine:
        W("W_ENGINE_UNSUPPORTED", "the embedded bench engine (stages.bench.backend: embedded) "
          f"refuses this drafter: it does not implement {'; '.join(engine)}.")
    if tgt is not None:
        out += _check_against_target(view, tgt)
    return out


def _check_aux(view, L, family, why, trained, rules: RuleSet) -> Findings:
    out = Findings()
    ec = view.get("eagle_config")
    ids, top = config_aux_ids(view), view.get(AUX_IDS_KEY)
    if ids is None and top is not None:
        out.error("E_AUX_IDS_TOP_LEVEL", f"config.json has eagle_aux_hidden_state_layer_ids = {top} "
                  "at the top level; SGLang reads only eagle_config.eagle_aux_hidden_state_layer_"
                  "ids and silently captures its default layers. Nest them under eagle_config "
                  f"(speculators' top-level ids are HF hidden_states indices, so the SGLang ids "
                  f"are {from_hf_indices(top)}); `runner convert` does this.")
    elif ids is None and "eagle_config" in view and not isinstance(ec, dict):
        pass  # reported by config_view
    elif ids is None:
        dflt = f" {default_aux_ids(L, family, rules)} for this {L}-layer target" if L else ""
        out.warning("W_AUX_IDS_DEFAULT", "config.json has no eagle_config.eagle_aux_hidden_state_"
                    f"layer_ids: SGLang captures its default layers{dflt}. Write the ids training "
                    "used.")
        if L and trained is not None:
            wrong = [r for r in rules.rows if r.default_capture(family, L) != list(trained)]
            if wrong:
                out.error("E_AUX_IDS_PROVENANCE", "eagle_config.eagle_aux_hidden_state_layer_ids "
                          f"is absent, so {versions_label(wrong)} captures its default HF "
                          f"hidden_states {wrong[0].default_capture(family, L)}, but provenance."
                          f"json says training captured HF {list(trained)}. Write the ids "
                          f"training used: {from_hf_indices(trained)}.")
    if ids is not None:
        out.add(config_aux_findings(ids, L, rules, family, why, trained))
    return out


def _check_against_target(view: dict, tgt: dict) -> Findings:
    out = Findings()
    E, W = out.error, out.warning
    V, H = view.get("vocab_size"), view.get("hidden_size")
    Vt, Ht = tgt.get("vocab_size"), tgt.get("hidden_size")
    if V and Vt and V != Vt:
        E("E_VOCAB_SIZE", f"config.json vocab_size = {V}, but the target vocab is {Vt}: vocab_size "
          "must be the TARGET vocab (t2d length; draft ids map into it). Set vocab_size: "
          f"{Vt}.")
    th = view.get("target_hidden_size")
    if H and Ht and H != Ht and th is None:
        E("E_TARGET_HIDDEN_SIZE", f"config.json hidden_size = {H} differs from the target hidden "
          f"{Ht}, and target_hidden_size is not set: SGLang sizes fc for {H}-wide aux states "
          f"and swaps in the target's {Ht}-wide embedding. Set target_hidden_size: {Ht} (and "
          "export the draft's own embed_tokens.weight).")
    elif th is not None and Ht and th != Ht:
        E("E_TARGET_HIDDEN_SIZE", f"config.json target_hidden_size = {th}, but the target hidden "
          f"is {Ht}. Set target_hidden_size: {Ht}.")
    mpe, tmpe = view.get("max_position_embeddings"), tgt.get("max_position_embeddings")
    if mpe and tmpe and mpe < tmpe:
        E("E_MAX_POSITION_EMBEDDINGS", f"config.json max_position_embeddings = {mpe} is below the "
          f"target's {tmpe}: serving with --context-length above {mpe}, SGLang 0.5.x refuses to "
          "start (ValueError in configs/model_config.py) unless SGLANG_ALLOW_OVERWRITE_LONGER_"
          f"CONTEXT_LEN=1, which stretches the draft silently. Set max_position_embeddings: {tmpe}.")
    d_theta, d_scal = target_rope(view)
    t_theta, t_scal = target_rope(tgt)
    if view.get("rope_theta") is None and "rope_parameters" in view:
        W("W_ROPE_FORM", "config.json has rope_parameters but no top-level rope_theta; SGLang "
          "0.5.6 reads only rope_theta/rope_scaling (srt/models/llama.py) and would use rope_theta "
          "10000 (0.5.14+ read rope_parameters). Write "
          f"rope_theta: {d_theta} at the top level.")
    if (t_theta is not None and d_theta != t_theta) or (t_scal or None) != (d_scal or None):
        W("W_ROPE_DIFFERS", f"config.json rope_theta/rope_scaling = {d_theta}/{d_scal} differ from "
          f"the target's {t_theta}/{t_scal}; the draft must be trained and served with the same "
          "RoPE as written here.")
    return out
