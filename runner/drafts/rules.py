"""SGLang's rules for a drafter and a server line, each checked once, with the messages each
caller shows (docs/eagle3-format.md).

Rules are looked up by SGLang version: `RULES` is a table of `SglangRules` rows, each holding for
a range of SGLang versions (a PEP 440 specifier string), and `rules_for(version)` picks the row.
Today one row covers every supported version. A rule that changes between versions becomes a
field (or a method reading fields) of SglangRules with a value per row; a rule that depends on the
target's family (e.g. which layer ids mean the same thing on every version) gets a `family`
argument in `check_aux_ids`. The checks return plain facts (`AuxIdCheck`, `DraftTokenCheck`); the
`*_problems` / `*_findings` functions below turn them into the messages of each caller: the spec
(runner/spec/schema.py, runner/stages.py), `runner inspect` (runner/inspect.py), the extract stage
(the loaded target) and the export stage (draft_config.json).
"""

from __future__ import annotations

from dataclasses import dataclass

from runner.drafts.layout import AUX_COUNT, default_aux_ids


@dataclass(frozen=True)
class SglangRules:
    """The rules of one range of SGLang versions."""

    versions: str  # PEP 440 specifier of the SGLang versions this row describes

    def aux_id_range(self, num_layers: int) -> tuple[int, int]:
        """Valid SGLang aux ids for an L-layer target: 0..L-2 (llama.py captures at the input of
        layer k+1 inside `for i in range(L)`, so k = L-1 is never captured)."""
        return 0, num_layers - 2

    def chain_draft_tokens(self, num_steps: int) -> int:
        """--speculative-num-draft-tokens of a chain (eagle_topk 1): SGLang forces num_steps+1."""
        return num_steps + 1

    def max_draft_tokens(self, num_steps: int, topk: int) -> int:
        """The most draft tokens the tree of num_steps x topk holds (num_steps*topk + 1)."""
        return num_steps * topk + 1


RULES: tuple[SglangRules, ...] = (SglangRules(">=0.4.6"),)


def rules_for(version: str | None = None) -> SglangRules:
    """The rules row for SGLang `version` (None: the newest row). One row today, so every
    version gets it; issue-20 style version ranges select among rows here."""
    return RULES[-1]


# ----------------------------------------------------------------------------------------------
# aux layer ids


@dataclass(frozen=True)
class AuxIdCheck:
    """The facts about a list of SGLang aux ids for a target of `num_layers` layers."""

    ids: list
    num_layers: int | None
    valid: tuple[int, int] | None  # (lo, hi) inclusive; None when num_layers is unknown
    out_of_range: list  # ids outside `valid` (empty when num_layers is unknown)
    ordered: bool  # distinct and ascending
    count_ok: bool  # exactly AUX_COUNT ids

    @property
    def ok(self) -> bool:
        return self.ordered and self.count_ok and not self.out_of_range


def check_aux_ids(ids, num_layers: int | None, rules: SglangRules | None = None) -> AuxIdCheck:
    """Check SGLang aux ids against the target's layer count (None: range not checked)."""
    ids = list(ids)
    r = rules or rules_for()
    valid = r.aux_id_range(num_layers) if num_layers is not None else None
    bad = [k for k in ids if not valid[0] <= k <= valid[1]] if valid else []
    return AuxIdCheck(ids, num_layers, valid, bad, ids == sorted(set(ids)), len(ids) == AUX_COUNT)


def spec_aux_problems(ids, num_layers: int) -> list[str]:
    """Spec messages for drafter.aux_layer_ids (None = SGLang's default for the target)."""
    L = num_layers
    if ids is None:
        if check_aux_ids(default_aux_ids(L), L).ok:
            return []
        return [f"drafter.aux_layer_ids: not set, and SGLang's default [1, L//2-1, L-4] = "
                f"{default_aux_ids(L)} is not 3 distinct ascending ids for a {L}-layer target. "
                "Declare 3 distinct ascending ids in 0..L-2."]
    c, out = check_aux_ids(ids, L), []
    if not (c.count_ok and c.ordered):
        out.append(f"drafter.aux_layer_ids = {c.ids}: must be 3 distinct integers in ascending "
                   "order (SGLang concatenates in ascending layer order whatever the config says, "
                   "so any other order trains on a different feature layout).")
    if c.out_of_range:
        lo, hi = c.valid
        out.append(f"drafter.aux_layer_ids = {c.ids}: {c.out_of_range} out of range for a "
                   f"{L}-layer target; ids are SGLang eagle_config ids (id k = output of layer k), "
                   f"valid {lo}..{hi}. SGLang captures at the input of layer k+1 inside its layer "
                   f"loop, so k = {L - 1} is never captured. If these are HF hidden_states "
                   "indices, subtract 1.")
    return out


def config_aux_findings(ids, num_layers: int | None) -> list[tuple[str, str]]:
    """`runner inspect` findings (code, message), all errors, for
    eagle_config.eagle_aux_hidden_state_layer_ids of a draft's config.json."""
    c, out = check_aux_ids(ids, num_layers), []
    where = "eagle_config.eagle_aux_hidden_state_layer_ids"
    if not c.ordered:
        out.append(("E_AUX_IDS_ORDER", f"{where} = {ids}: must be distinct and ascending (SGLang "
                    "concatenates in ascending layer order whatever the config says). Write "
                    f"{sorted(set(ids))} and check the fc column order matches."))
    if not c.count_ok:
        out.append(("E_AUX_IDS_COUNT", f"{where} = {ids}: SGLang builds fc over exactly 3 aux "
                    "states; give 3 ids."))
    if c.out_of_range:
        lo, hi = c.valid
        out.append(("E_AUX_IDS_RANGE", f"{where} = {ids}: {c.out_of_range} out of range for a "
                    f"{num_layers}-layer target (SGLang id k = output of layer k, valid "
                    f"{lo}..{hi}). If these are HF hidden_states indices, subtract 1."))
    return out


def model_aux_problem(ids, num_layers: int) -> str | None:
    """The extract stage's message when the spec's ids do not fit the LOADED target, else None."""
    c = check_aux_ids(ids, num_layers)
    if not c.out_of_range and c.ordered:
        return None
    return (f"drafter.aux_layer_ids = {c.ids}: the loaded target has {num_layers} decoder layers, "
            f"so ids (SGLang convention, id k = output of layer k) must be distinct, ascending "
            f"and in {c.valid[0]}..{c.valid[1]}.")


def export_aux_problem(ids, num_layers: int) -> str | None:
    """The export stage's message when draft_config.json's ids do not fit the target, else None."""
    c = check_aux_ids(ids, num_layers)
    if not c.out_of_range:
        return None
    return (f"draft_config.json aux_layer_ids {ids}: {c.out_of_range} outside "
            f"{c.valid[0]}..{c.valid[1]} for the {num_layers}-layer target (SGLang ids).")


# ----------------------------------------------------------------------------------------------
# the draft-token bound


@dataclass(frozen=True)
class DraftTokenCheck:
    """The facts about (num_steps, eagle_topk, num_draft_tokens); None = not given."""

    chain_tokens: int | None  # what SGLang forces for a chain (topk 1), when num_steps is known
    bound: int | None  # the most the tree holds, when num_steps and topk are known
    chain_mismatch: bool  # topk 1 and num_draft_tokens != chain_tokens
    missing: bool  # topk > 1 without num_draft_tokens
    too_many: bool  # num_draft_tokens > bound


def check_draft_tokens(num_steps: int | None, topk: int | None, n: int | None,
                       rules: SglangRules | None = None) -> DraftTokenCheck:
    r = rules or rules_for()
    chain = r.chain_draft_tokens(num_steps) if num_steps is not None else None
    bound = r.max_draft_tokens(num_steps, topk) if None not in (num_steps, topk) else None
    return DraftTokenCheck(chain, bound,
                           topk == 1 and chain is not None and n is not None and n != chain,
                           topk is not None and topk > 1 and n is None,
                           bound is not None and n is not None and n > bound)


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
        return (f"num_draft_tokens = {n}: must not exceed num_steps*eagle_topk+1 = {c.bound} "
                "(the draft tree has no more nodes)")
    return None


def server_draft_tokens_problem(num_steps: int | None, topk: int | None,
                                n: int | None) -> str | None:
    """`runner inspect --server-args` message (E_SERVER_DRAFT_TOKENS) for the speculative
    flags of a server line, or None."""
    c = check_draft_tokens(num_steps, topk, n)
    if c.chain_mismatch:
        return (f"--speculative-num-draft-tokens {n} with --speculative-eagle-topk 1 and "
                f"--speculative-num-steps {num_steps}: SGLang silently resets it to num_steps+1 = "
                f"{c.chain_tokens}. Pass --speculative-num-draft-tokens {c.chain_tokens}.")
    if c.too_many:
        return (f"--speculative-num-draft-tokens {n} exceeds num_steps x topk + 1 = {c.bound}: "
                "the draft tree has no more nodes.")
    return None
