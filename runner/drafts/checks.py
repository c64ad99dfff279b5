"""The checks of a drafter against SGLang's rules, each checked once, with the messages each
caller shows (docs/eagle3-format.md states every fact with its version and file): the spec's
drafter.sglang_version and forward options, draft_vocab_size null, the aux layer ids (range,
order, what SGLang captures per target family and version, `default_aux_ids(cfg or L, family)`)
and the draft-token bound. The rows they check against: runner/drafts/rules.py (`RULES`,
`rules_for`, `RuleSet`).

Callers: the spec (runner/spec/schema.py, runner/spec/stage_blocks.py SpecParams), `runner inspect`
(runner/inspect_checks.py), `runner convert`, the extract stage (the loaded target), the export
stage (draft_config.json) and the embedded engine's loader (models/draft_model.py). Server-line
rules: runner/drafts/server.py. Target families: runner/drafts/families.py. No torch, no numpy.
"""

from __future__ import annotations

from dataclasses import dataclass

from eagle3_runner.runner.drafts.families import DEEPSEEK, FAMILY_NAMES, STANDARD, family_evidence
from eagle3_runner.runner.drafts.forward import FORWARD_FLAGS
from eagle3_runner.runner.drafts.layout import AUX_COUNT, to_hf_indices
from eagle3_runner.runner.drafts.rules import RULES, RuleSet, rules_for, versions_label


# ----------------------------------------------------------------------------------------------
# the drafter's forward options (spec fields drafter.<flag> = the config.json flags SGLang reads)

SPEC_FLAGS = ("fc_norm", "norm_output")  # drafter.<flag>: exported as config.json <flag>: true


def spec_version_problems(version: str | None, flags: dict[str, bool]) -> list[str]:
    """Spec messages for drafter.sglang_version and the drafter's forward options: flags maps a
    SPEC_FLAGS name to whether the spec turns it on. Each option that is on must be read by every
    row `rules_for(version)` checks (version None: every row of the table, so 0.5.6, which reads
    none of them, refuses them all). An unparsable or unsupported version is a problem too."""
    out, label = [], "drafter.sglang_version"
    try:
        rs = rules_for(version)
    except ValueError:
        return [f"{label} = {version!r}: not an SGLang version; write one such as 0.5.14 "
                f"(the table covers {versions_label(RULES)[len('SGLang '):]})."]
    if not rs.supported:
        out.append(f"{label} = {version!r}: {rs.note}")
    for flag in SPEC_FLAGS:
        ignoring = [r for r in rs.rows if flag not in r.reads_flags]
        if not flags.get(flag) or not ignoring:
            continue
        readers = [r.read for r in RULES if flag in r.reads_flags]
        why = (f"{label} = {version!r}" + (f"; {rs.note}" if rs.note else "")
               if version is not None else
               f"{label} is not set, so the spec must hold on every version the table covers")
        out.append(
            f"drafter.{flag} = true ({FORWARD_FLAGS[flag]}): {versions_label(ignoring)} never "
            f"reads config.json {flag} (llama_eagle3.py) and would serve the drafter without "
            f"what it was trained with ({why}). Set drafter.sglang_version to the version that "
            f"serves it ({readers[0]} or newer reads {flag}), or {flag}: false.")
    return out


# ----------------------------------------------------------------------------------------------
# draft_vocab_size


def draft_vocab_null_problem(where: str, vocab_size: int | None = None) -> str:
    """The message for draft_vocab_size null (spec validation, `runner inspect`). SGLang 0.5.14's
    llama_eagle3.py then builds lm_head over all vocab_size rows and marks it to be replaced by
    the target's head; a trained head of fewer rows (a reduced draft vocab) does not fit that
    parameter, and the server refuses to start while loading it (lab, H100, SGLang 0.5.14,
    2026-12-07: draft_vocab_null refused at load; it did not serve a collapsed draft)."""
    rows = f"{vocab_size} rows" if vocab_size else "rows"
    return (f"{where} = null: SGLang then builds lm_head over all vocab_size {rows}, so a trained "
            "head over a reduced draft vocab does not fit it and the server refuses to start "
            "(the load fails); a head over the full vocab would load and be replaced by the "
            "target's. Set draft_vocab_size to the rows of lm_head.weight (e.g. 32000).")


# ----------------------------------------------------------------------------------------------
# aux layer ids


def _num_layers(target) -> int | None:
    if isinstance(target, dict):
        L = target.get("num_hidden_layers")
        if not isinstance(L, int) and isinstance(target.get("text_config"), dict):
            L = target["text_config"].get("num_hidden_layers")
        return L if isinstance(L, int) and not isinstance(L, bool) else None
    return target


def default_aux_ids(target, family: str | None = None, rules: RuleSet | None = None) -> list[int]:
    """SGLang's default eagle_config ids (what it captures when the config names none), as
    eagle_config ids: [1, L//2-1, L-4] for every family, [2, L//2, L-3] for MiniMax-M3-VL on
    0.5.23. target: L (int) or the target's config dict (then family defaults to its own).
    rules: the rows (default every row; the newest row of the set decides)."""
    L = _num_layers(target)
    if family is None:
        family = family_evidence(target)[0] if isinstance(target, dict) else STANDARD
    row = (rules or rules_for()).rows[-1]
    return [c - 1 for c in row.default_capture(family, L)]


def aux_shift_note(ids, num_layers: int, family: str = STANDARD) -> str | None:
    """A warning when drafter.aux_layer_ids is SGLang's default for the target plus one each
    ([2, 15, 27] for a 30-layer Llama): HF hidden_states indices written where eagle_config ids
    belong (HF index k + 1 = the output of layer k = eagle_config id k). Valid ids, so not an
    error: a drafter may mean them; None otherwise."""
    d = default_aux_ids(num_layers, family)
    if ids is None or list(ids) != [i + 1 for i in d]:
        return None
    return (f"drafter.aux_layer_ids = {list(ids)} is SGLang's default {d} for this "
            f"{num_layers}-layer target plus one each: HF hidden_states indices? The ids are "
            "SGLang eagle_config ids (id k = the output of layer k = HF hidden_states[k + 1]); "
            f"write {d} (or leave the field out) for SGLang's default layers.")


@dataclass(frozen=True)
class AuxIdCheck:
    """The facts about SGLang aux ids for a target of `num_layers` layers, over the rows of a
    RuleSet."""

    ids: list
    num_layers: int | None
    family: str
    valid: tuple[int, int] | None  # the strictest (lo, hi) over the rows; None: L unknown
    out_of_range: list  # ids outside `valid`
    ordered: bool  # distinct and ascending
    count_ok: bool  # exactly AUX_COUNT ids
    trained: list  # HF indices training captured (provenance, else eagle_config's meaning)
    captured: dict  # row.read -> HF indices SGLang captures (in-range lists only)
    wrong: tuple  # rows whose capture differs from `trained`

    @property
    def ok(self) -> bool:
        return self.ordered and self.count_ok and not self.out_of_range and not self.wrong


def check_aux_ids(ids, num_layers: int | None, rules: RuleSet | None = None,
                  family: str = STANDARD, trained=None) -> AuxIdCheck:
    """Check eagle_config ids against the target's layer count (None: range and capture not
    checked), its family and the rows. trained: HF indices training captured (provenance), else
    the eagle_config meaning (id k = HF k + 1)."""
    ids = list(ids)
    rows = (rules or rules_for()).rows
    L = num_layers
    trained = list(trained) if trained is not None else to_hf_indices(ids)
    if L is None:
        return AuxIdCheck(ids, None, family, None, [], ids == sorted(set(ids)),
                          len(ids) == AUX_COUNT, trained, {}, ())
    ranges = [r.aux_id_range(family, L) for r in rows]
    valid = (max(a for a, _ in ranges), min(b for _, b in ranges))
    bad = [k for k in ids if not valid[0] <= k <= valid[1]]
    captured = {r.read: r.capture(family, ids, L) for r in rows} if not bad else {}
    wrong = tuple(r for r in rows if r.read in captured and captured[r.read] != trained)
    return AuxIdCheck(ids, L, family, valid, bad, ids == sorted(set(ids)), len(ids) == AUX_COUNT,
                      trained, captured, wrong)


def _portable_ids_for(hf, L, family) -> list | None:
    """eagle_config ids that capture HF indices `hf` on every row, or None."""
    for cand in ([k - 1 for k in hf], list(hf)):
        c = check_aux_ids(cand, L, family=family, trained=hf)
        if not c.out_of_range and not c.wrong:
            return cand
    return None


def _hf_hint(c: AuxIdCheck) -> str:
    """' If these are HF hidden_states indices, subtract 1: [...].' where that is right."""
    cand = _portable_ids_for(c.ids, c.num_layers, c.family) if c.num_layers else None
    if cand is None or cand == c.ids:
        return ""
    return f" If these are HF hidden_states indices, subtract 1: {cand}."


def _outputs(hf) -> str:
    """'outputs of layers [1, 29, 57]' for HF indices (index 0 is the embedding output)."""
    return "outputs of layers [" + ", ".join("the embedding" if x == 0 else str(x - 1)
                                             for x in hf) + "]"


def _capture_text(c: AuxIdCheck, rows) -> str:
    groups: dict[tuple, list] = {}
    for r in rows:
        groups.setdefault(tuple(c.captured[r.read]), []).append(r)
    return "; ".join(f"on {versions_label(rs)} the target captures HF hidden_states {list(k)} "
                     f"({_outputs(k)})" for k, rs in groups.items())


def _family_why(c: AuxIdCheck, where: str, why: str | None) -> str:
    """The message for ids SGLang reads differently from training (the DeepSeek rule above all)."""
    base = (f"{where} = {c.ids}: {FAMILY_NAMES[c.family]}" + (f" ({why})" if why else "") + ". ")
    if c.family == DEEPSEEK:
        base += ("SGLang 0.5.6 adds 1 to every eagle_config id; 0.5.14 and later add 1 only when "
                 "the first id is 1 and otherwise use the ids as HF hidden_states indices "
                 "(srt/models/deepseek_v2.py set_eagle3_layers_to_capture). ")
    cap = _capture_text(c, c.wrong)
    base += (f"{cap[0].upper() + cap[1:]}, but training captures HF {c.trained} "
             f"({_outputs(c.trained)}).")
    if c.family == DEEPSEEK:
        dflt = default_aux_ids(c.num_layers, DEEPSEEK)
        fix = _portable_ids_for(c.trained, c.num_layers, c.family)
        base += (" The first id must be 1: only such lists mean the same layers on every version"
                 f" (SGLang's default for this target: {dflt}).")
        base += (f" Write {fix}." if fix and fix != c.ids else
                 " No eagle_config list captures those layers on every version: re-extract and "
                 "retrain with ids starting at 1.")
    return base + _hf_hint(c)


def spec_aux_problems(ids, num_layers: int, family: str = STANDARD) -> list[str]:
    """Spec messages for drafter.aux_layer_ids (None = SGLang's default for the target), checked
    against every row (the serving version is not known yet)."""
    L = num_layers
    if ids is None:
        d = default_aux_ids(L, family)
        if check_aux_ids(d, L, family=family).ok:
            return []
        return [f"drafter.aux_layer_ids: not set, and SGLang's default {d} is not 3 distinct "
                f"ascending ids in range for a {L}-layer target. Declare 3 distinct ascending ids "
                "in 0..L-2."]
    c, out = check_aux_ids(ids, L, family=family), []
    if not (c.count_ok and c.ordered):
        out.append(f"drafter.aux_layer_ids = {c.ids}: must be 3 distinct integers in ascending "
                   "order (SGLang concatenates in ascending layer order whatever the config says, "
                   "so any other order trains on a different feature layout).")
    if c.out_of_range:
        lo, hi = c.valid
        out.append(f"drafter.aux_layer_ids = {c.ids}: {c.out_of_range} out of range for a "
                   f"{L}-layer target; ids are SGLang eagle_config ids (id k = output of layer k), "
                   f"valid {lo}..{hi}. SGLang captures at the input of layer k+1 inside its layer "
                   f"loop, so k = {hi + 1} is never captured.{_hf_hint(c)}")
    elif c.wrong:
        out.append(_family_why(c, "drafter.aux_layer_ids", "target.family"))
    return out


def config_aux_findings(ids, num_layers: int | None, rules: RuleSet | None = None,
                        family: str = STANDARD, why: str | None = None,
                        trained=None) -> list[tuple[str, str, str]]:
    """`runner inspect` findings (severity, code, message) for
    eagle_config.eagle_aux_hidden_state_layer_ids. trained: the HF indices provenance.json says
    training captured (None: the eagle_config meaning, id k = HF k + 1)."""
    rs = rules or rules_for()
    c, out = check_aux_ids(ids, num_layers, rs, family, trained), []
    where = "eagle_config.eagle_aux_hidden_state_layer_ids"
    if not c.ordered:
        out.append(("error", "E_AUX_IDS_ORDER", f"{where} = {ids}: must be distinct and ascending "
                    "(SGLang concatenates in ascending layer order whatever the config says). "
                    f"Write {sorted(set(ids))} and check the fc column order matches."))
    if c.out_of_range:
        lo, hi = c.valid
        out.append(("error", "E_AUX_IDS_RANGE", f"{where} = {ids}: {c.out_of_range} out of range "
                    f"for a {num_layers}-layer target on {rs.label} (SGLang id k = output of layer "
                    f"k, valid {lo}..{hi}).{_hf_hint(c)}"))
        return out
    if c.wrong and trained is not None:
        fix = _portable_ids_for(trained, num_layers, family)
        code = "E_AUX_IDS_OFF_BY_ONE" if list(ids) == list(trained) else "E_AUX_IDS_PROVENANCE"
        extra = (" These are the HF indices themselves; SGLang ids are one lower (id k = output of"
                 " layer k = HF index k+1)." if code == "E_AUX_IDS_OFF_BY_ONE" else "")
        out.append(("error", code, f"{where} = {list(ids)}: provenance.json says training "
                    f"captured HF hidden_states {list(trained)}, but {_capture_text(c, c.wrong)}."
                    f"{extra} " + (f"Set eagle_config.eagle_aux_hidden_state_layer_ids to {fix}."
                                   if fix else "No eagle_config list captures those layers on "
                                   "every version; retrain with ids starting at 1.")))
    elif c.wrong:
        out.append(("error", "E_AUX_IDS_FAMILY", _family_why(c, where, why)))
    elif num_layers is not None and rs.others:
        o = check_aux_ids(ids, num_layers, RuleSet(rs.others, None), family, c.trained)
        if o.out_of_range or o.wrong:
            what = (_capture_text(o, o.wrong) if o.wrong else
                    f"{o.out_of_range} are out of range on {versions_label(rs.others)}")
            out.append(("warning", "W_AUX_IDS_NOT_PORTABLE", f"{where} = {list(ids)}: right for "
                        f"{rs.label}, but {what}. Ids that mean the same on every version: "
                        f"{_portable_ids_for(c.trained, num_layers, family) or 'none'}."))
    if len(ids) != AUX_COUNT:
        fixed = [r for r in rs.rows if not r.multi_layer]  # 0.5.6: fc is 3 x target hidden, fixed
        sev = "error" if fixed else "warning"
        out.append((sev, "E_AUX_IDS_COUNT" if fixed else "W_AUX_IDS_COUNT",
                    f"{where} = {ids}: {len(ids)} ids; "
                    + (f"{versions_label(fixed)} builds fc over exactly 3 aux states. Give 3 ids."
                       if fixed else f"{rs.label} builds fc over {len(ids)} aux states, SGLang "
                       "0.5.6 over exactly 3, and this project's spec over 3.")))
    return out


def model_aux_problem(ids, num_layers: int, family: str = STANDARD) -> str | None:
    """The extract stage's message when the spec's ids do not fit the LOADED target (its layer
    count and family), else None."""
    c = check_aux_ids(ids, num_layers, family=family)
    if c.ordered and not c.out_of_range and not c.wrong:
        return None
    if c.wrong:
        return _family_why(c, "drafter.aux_layer_ids", "the loaded target's config")
    return (f"drafter.aux_layer_ids = {c.ids}: the loaded target has {num_layers} decoder layers, "
            f"so ids (SGLang convention, id k = output of layer k) must be distinct, ascending "
            f"and in {c.valid[0]}..{c.valid[1]}.")


def export_aux_problem(ids, num_layers: int, family: str = STANDARD) -> str | None:
    """The export stage's message when draft_config.json's ids do not fit the target, else None."""
    c = check_aux_ids(ids, num_layers, family=family)
    if c.out_of_range:
        return (f"draft_config.json aux_layer_ids {ids}: {c.out_of_range} outside "
                f"{c.valid[0]}..{c.valid[1]} for the {num_layers}-layer target (SGLang ids).")
    if c.wrong:
        return _family_why(c, "draft_config.json aux_layer_ids", "target_config.json")
    return None


# ----------------------------------------------------------------------------------------------
# the draft-token bound


@dataclass(frozen=True)
class DraftTokenCheck:
    """The facts about (num_steps, eagle_topk, num_draft_tokens); None = not given."""

    chain_tokens: int | None  # what SGLang forces for a chain (topk 1), when num_steps is known
    bound: int | None  # 1 + topk + (num_steps - 1) * topk^2, when num_steps and topk are known
    chain_mismatch: bool  # topk 1 and num_draft_tokens != chain_tokens
    missing: bool  # topk > 1 without num_draft_tokens
    too_many: bool  # num_draft_tokens > bound
    partial: bool  # one or two of the three given (SGLang asserts all or none)


def check_draft_tokens(num_steps: int | None, topk: int | None, n: int | None,
                       rules: RuleSet | None = None) -> DraftTokenCheck:
    rows = (rules or rules_for()).rows
    chain = rows[0].chain_draft_tokens(num_steps) if num_steps is not None else None
    bound = (min(r.max_draft_tokens(num_steps, topk) for r in rows)
             if None not in (num_steps, topk) else None)
    return DraftTokenCheck(chain, bound,
                           topk == 1 and chain is not None and n is not None and n != chain,
                           topk is not None and topk > 1 and n is None,
                           bound is not None and n is not None and n > bound,
                           sum(v is not None for v in (num_steps, topk, n)) in (1, 2))


def chain_draft_tokens(num_steps: int) -> int:
    """num_draft_tokens of a chain (topk 1): num_steps + 1 on every row."""
    return check_draft_tokens(num_steps, 1, None).chain_tokens


_BOUND = ("1 + topk + (num_steps - 1) x topk^2 = {b} (SGLang's candidate list before the final "
          "top-(num_draft_tokens - 1) selection, speculative/eagle_utils.py)")


def spec_draft_tokens_problem(num_steps: int, topk: int, n: int | None) -> str | None:
    """The spec's message for one stages.bench.configs[] entry (the first problem), or None."""
    c = check_draft_tokens(num_steps, topk, n)
    if c.chain_mismatch:
        return (f"num_draft_tokens = {n}: with eagle_topk 1 it must equal num_steps+1 = "
                f"{c.chain_tokens} (SGLang silently overrides it, so the run would not be what "
                "the spec says)")
    if c.missing:
        return "num_draft_tokens: required when eagle_topk > 1"
    if c.too_many:
        return f"num_draft_tokens = {n}: must not exceed " + _BOUND.format(b=c.bound)
    return None


def server_draft_tokens_problem(num_steps: int | None, topk: int | None,
                                n: int | None) -> str | None:
    """`runner inspect --server-args` message (E_SERVER_DRAFT_TOKENS) for the speculative
    flags of a server line, or None."""
    c = check_draft_tokens(num_steps, topk, n)
    if c.chain_mismatch:
        return (f"--speculative-num-draft-tokens {n} with --speculative-eagle-topk 1 and "
                f"--speculative-num-steps {num_steps}: SGLang resets it to num_steps+1 = "
                f"{c.chain_tokens} (a log warning only). Pass --speculative-num-draft-tokens "
                f"{c.chain_tokens}.")
    if c.too_many:
        return f"--speculative-num-draft-tokens {n} exceeds " + _BOUND.format(b=c.bound) + "."
    return None
