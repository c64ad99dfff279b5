"""SGLang's rules for a drafter, keyed by SGLang version: the version table and its lookups
(docs/eagle3-format.md states every fact with its version and file).

`RULES` is the table: one `SglangRules` row per SGLang release whose source was read (0.5.6 =
SpecForge v0.2.0's pin, 0.5.14 = SpecForge's newest trainer pin, 0.5.23 = the newest release; the
released wheels, 2026-12). `rules_for(version)` picks what to check a version against, honestly:
- a version that has a row: that row;
- a version between two rows (e.g. 0.5.10): BOTH neighbours, since nobody read its source; a
  drafter passes only if it passes both (`RuleSet.note` says so);
- newer than the last row: the last row, with a note; older than the first: the first, flagged
  unsupported (the `sglang` extra in pyproject.toml is pinned to the table's range);
- None (spec validation, export: the serving version is not known yet): EVERY row, so what is
  accepted means the same thing on every version the table covers.
`by_rows` runs a per-row check on every row and merges the findings (W_NOT_PORTABLE).

The checks that read the rows, with the messages each caller shows (the spec's forward options,
draft_vocab_size, aux layer ids, the draft-token bound): runner/drafts/checks.py. Server-line
rules: runner/drafts/server.py. Target families: runner/drafts/families.py. No torch, no numpy.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from eagle3_runner.runner.drafts.families import DEEPSEEK, GPT_OSS, MINIMAX_M3_VL


@dataclass(frozen=True)
class SglangRules:
    """What one SGLang release does with a drafter (sources: that release's
    sglang/srt/models/llama_eagle3.py, the target families' set_eagle3_layers_to_capture,
    model_executor/model_runner.py, server_args.py or arg_groups/)."""

    versions: str  # PEP 440 specifier of the releases this row describes (the one read)
    read: str  # the release whose source was read
    multi_layer: bool  # `layers.N` native and N > 1 layers built (else midlayer only, 1 layer)
    # what serving does with a decoder layer num_hidden_layers builds and the file has no tensors
    # for (its linear weights are torch.empty): "uninitialised" (read in the source; refused,
    # E_NUM_LAYERS), "served" (the lab served such a draft as well as the one-layer export; a
    # warning, W_NUM_LAYERS); None where N > 1 is refused outright (multi_layer False)
    unloaded_layer: str | None
    reads_flags: frozenset  # forward-changing config flags llama_eagle3.py reads
    o_proj_bias_absent: str  # what an o_proj bias the config creates holds when the file lacks it
    # eagle_config.use_aux_hidden_state false turns the aux capture off: the draft then reads the
    # target's last hidden state and skips fc (accept length lower, not 1.00: lab, see RULES)
    reads_use_aux_hidden_state: bool
    uppercases_algorithm: bool  # `eagle3` accepted (else argparse refuses anything but EAGLE3...)
    deepseek_first_id_rule: bool  # DeepSeek family: +1 only when ids[0] == 1, else as-is
    gpt_oss_final_capture: bool  # GPT-OSS: ids with max == L as-is; capture index L exists
    minimax_m3_vl_default: bool  # MiniMax-M3-VL's default ids are shifted by one more
    server_flags: frozenset  # the version-dependent launch_server flags that exist

    # -- aux layer ids (eagle_config id k = output of 0-based layer k = HF hidden_states[k+1]) --
    def capture(self, family: str, ids, num_layers: int) -> list[int]:
        """HF hidden_states indices SGLang captures for eagle_config `ids` on an L-layer target
        (srt/models/llama.py and family files: layers_to_capture = [k + 1 ...], except as noted).
        What ids one too high cost is not shown by a weak drafter's accept length (lab, H100,
        SGLang 0.5.14, 2026-12-07: aux_ids_off_by_one served at 1.387 against the good export's
        1.409, within the lab's tolerance): the rule stands on the source, and ids that capture
        other layers than training did stay an error (E_AUX_IDS_OFF_BY_ONE) on every version."""
        ids = list(ids)
        if family == DEEPSEEK and self.deepseek_first_id_rule and not (ids and ids[0] == 1):
            return ids
        if family == GPT_OSS and self.gpt_oss_final_capture and ids and max(ids) == num_layers:
            return ids
        return [k + 1 for k in ids]

    def default_capture(self, family: str, num_layers: int) -> list[int]:
        """HF indices captured when eagle_config gives no ids: [2, L//2, L-3] in every family,
        except MiniMax-M3-VL in 0.5.23 (minimax_m3_vl.py adds 1 to that default as well)."""
        L = num_layers
        if family == MINIMAX_M3_VL and self.minimax_m3_vl_default:
            return [3, L // 2 + 1, L - 2]
        return [2, L // 2, L - 3]

    def aux_id_range(self, family: str, num_layers: int) -> tuple[int, int]:
        """Valid eagle_config ids for an L-layer target, inclusive: 0..L-2 (the capture runs at
        the input of layer k+1 inside `for i in range(L)`, so k = L-1 is never captured); GPT-OSS
        on 0.5.23 also captures the last layer's output at the final norm (gpt_oss.py): 0..L-1."""
        return 0, num_layers - (1 if family == GPT_OSS and self.gpt_oss_final_capture else 2)

    # -- the draft-token bound (speculative/eagle_utils.py organize_draft_results: the candidate
    # list holds topk scores of the first step and topk^2 of each later one, and the final
    # selection takes num_draft_tokens - 1 of them; server_args: topk 1 forces steps + 1) --
    def chain_draft_tokens(self, num_steps: int) -> int:
        return num_steps + 1

    def max_draft_tokens(self, num_steps: int, topk: int) -> int:
        return 1 + topk + (num_steps - 1) * topk * topk


# Lab evidence (runner/drafts/lab.py cases on a real server: H100, SGLang 0.5.14, main 9160d1e,
# `scripts/gpu/sglang34.sh lab 360`, 2026-12-07), good export at accept length 1.409:
# - num_hidden_layers 2 with one trained layer (num_layers_2): served at 1.409, the good export's,
#   so 0.5.14's unloaded_layer is "served" (a warning). Reading 0.5.14's llama_eagle3.py, layer 1
#   adds nothing when its torch.empty weights hold zeros (fresh GPU memory): nothing guarantees
#   that, hence a warning and not silence. 0.5.23 builds the same layers but was not served: it
#   keeps "uninitialised" (an error) until a lab on it says otherwise.
# - use_aux_hidden_state false (use_aux_false): 1.141, lower, not 1.00 (reads_use_aux_hidden_state).
# - eagle_config ids one too high (aux_ids_off_by_one): 1.387, see SglangRules.capture.
_LATER = dict(multi_layer=True,
              o_proj_bias_absent="zeros", reads_use_aux_hidden_state=True,
              uppercases_algorithm=True, deepseek_first_id_rule=True)
RULES: tuple[SglangRules, ...] = (
    SglangRules("==0.5.6", "0.5.6", multi_layer=False, unloaded_layer=None,
                reads_flags=frozenset(), o_proj_bias_absent="uninitialised",
                reads_use_aux_hidden_state=False, uppercases_algorithm=False,
                deepseek_first_id_rule=False, gpt_oss_final_capture=False,
                minimax_m3_vl_default=False, server_flags=frozenset()),
    SglangRules("==0.5.14", "0.5.14", **_LATER, unloaded_layer="served",
                reads_flags=frozenset({"fc_norm", "use_aux_norm", "norm_output",
                                       "num_aux_hidden_states"}),
                gpt_oss_final_capture=False, minimax_m3_vl_default=False,
                server_flags=frozenset({"--speculative-draft-model-quantization",
                                        "--speculative-draft-window-size",
                                        "--speculative-adaptive"})),
    SglangRules("==0.5.23", "0.5.23", **_LATER, unloaded_layer="uninitialised",
                reads_flags=frozenset({"fc_norm", "use_aux_norm", "norm_output",
                                       "num_aux_hidden_states", "norm_before_fc"}),
                gpt_oss_final_capture=True, minimax_m3_vl_default=True,
                server_flags=frozenset({"--speculative-draft-model-quantization",
                                        "--speculative-draft-window-size",
                                        "--speculative-adaptive",
                                        "--speculative-draft-kv-cache-dtype"})),
)


def _next_micro(v: str) -> str:
    a, b, c = v.split(".")
    return f"{a}.{b}.{int(c) + 1}"


SUPPORTED = f">={RULES[0].read},<{_next_micro(RULES[-1].read)}"  # pyproject's `sglang` extra


def parse_version(v) -> tuple[int, int, int] | None:
    """'0.5.14', 'v0.5.14', '0.5.14.post1', '0.5.14rc0', '0.5.14+cu128' -> (0, 5, 14); None when
    not a version. Pre-releases and post-releases count as their release (0.5.14rc0 is checked as
    0.5.14)."""
    m = re.fullmatch(r"v?(\d+)\.(\d+)(?:\.(\d+))?(?:[.\-+]?[A-Za-z0-9.+\-]*)?", str(v).strip())
    return (int(m[1]), int(m[2]), int(m[3] or 0)) if m else None


def versions_label(rows) -> str:
    """'SGLang 0.5.6' / 'SGLang 0.5.14 and 0.5.23' / 'SGLang 0.5.6, 0.5.14 and 0.5.23'."""
    vs = [r.read for r in rows]
    return "SGLang " + (vs[0] if len(vs) == 1 else ", ".join(vs[:-1]) + " and " + vs[-1])


@dataclass(frozen=True)
class RuleSet:
    """The rows one check runs against (all must pass) and what was asked for."""

    rows: tuple[SglangRules, ...]
    asked: str | None  # the version asked for; None = every row (portable)
    note: str | None = None  # how a version without its own row is checked
    supported: bool = True  # False: outside the table's range

    @property
    def label(self) -> str:
        return versions_label(self.rows)

    @property
    def others(self) -> tuple[SglangRules, ...]:
        """The table's rows NOT checked (for portability warnings)."""
        return tuple(r for r in RULES if r not in self.rows)


def rules_for(version: str | None = None) -> RuleSet:
    """The rows to check SGLang `version` against (see the module docstring). Raises ValueError
    for a string that is not a version."""
    if version is None:
        return RuleSet(RULES, None)
    v = parse_version(version)
    if v is None:
        raise ValueError(f"{version!r} is not an SGLang version (e.g. 0.5.14)")
    keys = [parse_version(r.read) for r in RULES]
    for r, k in zip(RULES, keys):
        if k == v:
            return RuleSet((r,), version)
    if v < keys[0]:
        return RuleSet((RULES[0],), version, f"SGLang {version} is older than the table's first "
                       f"row ({RULES[0].read}); checked as {RULES[0].read}. Supported: sglang"
                       f"{SUPPORTED}.", supported=False)
    if v > keys[-1]:
        return RuleSet((RULES[-1],), version, f"SGLang {version} is newer than any version whose "
                       f"source was read; checked as {RULES[-1].read}.")
    i = next(i for i, k in enumerate(keys) if k > v)
    return RuleSet((RULES[i - 1], RULES[i]), version, f"SGLang {version} lies between "
                   f"{RULES[i - 1].read} and {RULES[i].read}, whose sources were read; checked "
                   "against both.")


def default_version() -> tuple[str, str]:
    """(version, source) for `runner inspect` without --sglang-version: the installed sglang's
    version (importlib.metadata; sglang itself is never imported), else the newest row."""
    from importlib import metadata
    try:
        return metadata.version("sglang"), "installed sglang"
    except metadata.PackageNotFoundError:
        return RULES[-1].read, "newest version the table knows (sglang is not installed here)"
    except Exception:  # noqa: BLE001 - a broken install's metadata: fall back, never raise
        return RULES[-1].read, "newest version the table knows (sglang's metadata is unreadable)"


def by_rows(rules: RuleSet | None, fn) -> list[tuple[str, str, str]]:
    """Run fn(row) -> [(severity, code, key, message(label))] on every row of the table and merge
    the rows: a finding of the checked rows is reported once, at its severity, with their label
    ("SGLang 0.5.14 and 0.5.23"); an error only rows NOT checked have becomes a W_NOT_PORTABLE
    warning (right for the version checked, wrong on another the table knows)."""
    rs = rules or rules_for()
    seen: dict[tuple, tuple] = {}
    for r in RULES:
        for sev, code, key, make in fn(r):
            seen.setdefault((sev, code, key), (make, []))[1].append(r)
    out = []
    for (sev, code, _), (make, rows) in seen.items():
        mine = [r for r in rows if r in rs.rows]
        if mine:
            out.append((sev, code, make(versions_label(mine))))
        elif sev == "error":
            out.append(("warning", "W_NOT_PORTABLE", f"right for {rs.label}, but: "
                        + make(versions_label(rows))))
    return out
