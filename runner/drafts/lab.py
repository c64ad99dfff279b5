"""The conformance lab's cases: deliberately broken copies of one good exported draft (its files,
config.json, the server line, the server's environment), each with what this project CLAIMS SGLang
0.5.14 does with it (runner/drafts/rules.py, the inspector's messages, runner/drafts/server.py),
so that a real server can confirm or correct every claim. scripts/gpu/sglang_lab.py writes the
variants, runs `runner inspect` on each before any server, serves each, and records what SGLang
did; `outcome` and `verdict` turn that into a row. No torch (numpy, via runner/drafts/safetensors).

Outcomes of one served variant, against the unbroken draft's tau (the `good` row, same prompts):
  refuses   the server exited (or never became ready) before answering: a loud failure
  hangs     not ready within the lab's timeout
  crashes   ready, then a request failed or the server died
  same      answered, tau within TOLERANCE of the good draft's
  lower     answered, tau below that but above the collapse line
  collapses answered, tau at most 1 + COLLAPSE x (good tau - 1): the drafter is as good as absent
  inflated  answered, tau above the good draft's: acceptance not measured honestly
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Callable

import numpy as np

from eagle3_runner.runner.drafts.layout import (AUX_IDS_KEY, EMBED, LAYER0, MIDLAYER,
                                                TRAINING_PREFIXES)
from eagle3_runner.runner.drafts.rules import SglangRules, rules_for
from eagle3_runner.runner.drafts.safetensors import draft_tensors, write_safetensors
from eagle3_runner.runner.drafts.server import SIMULATE, STRETCH

VERSION = "0.5.14"  # the release the claims are about (the rules table's row)
# The first lab on a real SGLang (H100, SGLang 0.5.14, main 9160d1e, `scripts/gpu/sglang34.sh lab
# 360`, 2026-12-07; good export at accept length 1.409) corrected four claims, now restated below
# and in runner/drafts/rules.py: num_layers_2 served as well as the good export
# (rules.unloaded_layer), use_aux_false was lower (1.141), not collapsed, draft_vocab_null was
# refused at load, not served collapsed, and aux_ids_off_by_one (1.387) was too close to the good
# export for tau to judge (Case.blind). tests/data/sglang/lab-h100-0.5.14.json holds its rows.
OUTCOMES = ("refuses", "hangs", "crashes", "same", "lower", "collapses", "inflated")
HARMFUL = ("refuses", "hangs", "crashes", "lower", "collapses", "inflated")
TOLERANCE = 0.05  # |tau - good| <= TOLERANCE x (good - 1) + 0.02: the same drafter
COLLAPSE = 0.25

Items = list  # [(name, dtype, shape, source)] as runner.drafts.safetensors.write_safetensors takes


@dataclass(frozen=True)
class Case:
    """One lab row. cfg(cfg, target) and tensors(items, cfg, target) edit a copy of the good
    draft (target: the target's config dict); server: launch overrides ("algorithm", "extra"
    flags, "shape" = (num_steps, eagle_topk, num_draft_tokens)); env: the server's extra
    environment. expect: the outcomes our claims predict; claims: what they are (CLAIMS keys);
    harm: a harm tau does not show (the server runs other settings than asked), which makes the
    row harmful whatever its outcome; blind: why a served outcome as good as the good draft's does
    not judge the claims (the lab's drafter is too weak to show the defect's cost), which makes
    such a row 'unknown', never 'corrected' nor a false alarm."""

    name: str
    what: str
    expect: tuple[str, ...]
    claims: tuple[str, ...]
    cfg: Callable | None = None
    tensors: Callable | None = None
    server: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)
    harm: str | None = None
    blind: str | None = None

    @property
    def harmful(self) -> bool:
        """Whether our checks should refuse the case: an expected outcome is harmful, or harm."""
        return bool(self.harm) or any(e in HARMFUL for e in self.expect)

    @property
    def same_files(self) -> bool:
        """Whether the case serves the good draft's files unchanged."""
        return self.cfg is None and self.tensors is None


# ----------------------------------------------------------------------------------------------
# edits


def _bf16(shape, seed: int) -> np.ndarray:
    """Random N(0, 0.02) weights as bf16 bits (uint16), shape `shape`."""
    x = (np.random.default_rng(seed).standard_normal(shape) * 0.02).astype(np.float32)
    return (x.view(np.uint32) >> 16).astype(np.uint16)


def _rename(items: Items, fn) -> Items:
    return [(fn(n), dt, sh, src) for n, dt, sh, src in items]


def _replace(items: Items, name: str, dtype: str, shape, value) -> Items:
    return [(n, dtype, list(shape), value) if n == name else (n, dt, sh, src)
            for n, dt, sh, src in items]


def _d2t_absolute(items: Items, cfg, tgt) -> Items:
    """d2t as the absolute target ids (i + d2t[i]) instead of offsets."""
    n, dt, sh, src = next(x for x in items if x[0] == "d2t")
    with open(src[0], "rb") as f:
        f.seek(src[1])
        off = np.frombuffer(f.read(src[2] - src[1]), dtype=np.int64)
    return _replace(items, "d2t", "I64", sh, off + np.arange(len(off), dtype=np.int64))


def _fc_width_h(items: Items, cfg, tgt) -> Items:
    H = cfg["hidden_size"]
    return _replace(items, "fc.weight", "BF16", [H, H], _bf16([H, H], 1))


def _with_embed(items: Items, cfg, tgt) -> Items:
    V, H = cfg["vocab_size"], cfg["hidden_size"]
    return items + [(EMBED, "BF16", [V, H], _bf16([V, H], 2))]


def _eagle(cfg, **kw):
    cfg["eagle_config"] = {**cfg.get("eagle_config", {}), **kw}


def _ids(cfg) -> list:
    return list(cfg["eagle_config"][AUX_IDS_KEY])


# ----------------------------------------------------------------------------------------------
# the claims (what this project says SGLang 0.5.14 does) and the cases that test them

_ROW = rules_for(VERSION).rows[0]
RULE_FIELDS = tuple(f.name for f in fields(SglangRules) if f.name not in ("versions", "read"))
CLAIMS = {
    # every field of the 0.5.14 row of runner/drafts/rules.py (tests/test_sglang_lab.py checks it)
    "rules.multi_layer": f"multi_layer = {_ROW.multi_layer}: `layers.N.*` load natively "
                         "(midlayer.* is renamed layers.0.*)",
    "rules.unloaded_layer": f"unloaded_layer = {_ROW.unloaded_layer!r}: num_hidden_layers 2 over "
                            "a one-layer file serves as well as the one-layer export (lab, H100, "
                            "2026-12-07: 1.409, the good export's)",
    "rules.reads_flags": f"reads_flags = {sorted(_ROW.reads_flags)}: fc_norm changes the forward",
    "rules.o_proj_bias_absent": f"o_proj_bias_absent = {_ROW.o_proj_bias_absent!r}: attention_bias "
                                "without the tensor leaves a zero bias",
    "rules.reads_use_aux_hidden_state": f"reads_use_aux_hidden_state = "
                                        f"{_ROW.reads_use_aux_hidden_state}: false turns capture "
                                        "off; the draft then reads the target's last hidden "
                                        "state without fc and accepts less, not nothing (lab, "
                                        "H100, 2026-12-07: 1.141 against 1.409)",
    "rules.uppercases_algorithm": f"uppercases_algorithm = {_ROW.uppercases_algorithm}: "
                                  "`eagle3` is accepted",
    "rules.deepseek_first_id_rule": f"deepseek_first_id_rule = {_ROW.deepseek_first_id_rule} "
                                    "(DeepSeek targets only)",
    "rules.gpt_oss_final_capture": f"gpt_oss_final_capture = {_ROW.gpt_oss_final_capture} "
                                   "(GPT-OSS targets only)",
    "rules.minimax_m3_vl_default": f"minimax_m3_vl_default = {_ROW.minimax_m3_vl_default} "
                                   "(MiniMax-M3-VL targets only)",
    "rules.server_flags": f"server_flags = {sorted(_ROW.server_flags)}: "
                          "--speculative-draft-kv-cache-dtype does not exist",
    "rules.capture": "capture(): eagle_config id k captures HF hidden_states[k+1], so ids one "
                     "too high feed fc the layers above those trained (what that costs, a weak "
                     "drafter's tau does not show: lab, H100, 2026-12-07: 1.387 against 1.409)",
    "rules.default_capture": "default_capture(): no eagle_config ids = HF [2, L//2, L-3]",
    "rules.aux_id_range": "aux_id_range(): ids above L-2 are never captured",
    "rules.chain_draft_tokens": "chain_draft_tokens(): topk 1 forces num_draft_tokens = "
                                "num_steps + 1",
    "rules.max_draft_tokens": "max_draft_tokens(): num_draft_tokens <= 1 + topk + "
                              "(num_steps - 1) x topk^2",
    # the inspector's and the server rules' claims about what SGLang does
    "E_ALGORITHM_NOT_EAGLE3": "--speculative-algorithm EAGLE loads the EAGLE-3 draft and "
                              "accepts ~nothing (accept length 1.00)",
    "E_KEY_PREFIX": "tensors under a training prefix (draft_model.) are dropped silently",
    "W_KEY_MODEL_PREFIX": "a `model.` prefix loads (SGLang retries names as model.<name>)",
    "E_D2T_ABSOLUTE": "d2t as absolute ids loads silently and drafts wrong tokens",
    "E_D2T_MISSING": "without d2t SGLang cannot map draft ids to target ids",
    "E_VOCAB_MISMATCH": "draft_vocab_size unequal to lm_head rows fails",
    "E_DRAFT_VOCAB_NULL": "draft_vocab_size null over a reduced draft vocab: SGLang builds a "
                          "full-vocab lm_head, the trained one does not fit, and it refuses to "
                          "start (lab, H100, 2026-12-07)",
    "E_FC_WIDTH": "fc of width H instead of 3H is refused",
    "E_MAX_POSITION_EMBEDDINGS": "max_position_embeddings below the context: SGLang refuses to "
                                 "start",
    "STRETCH": f"{STRETCH}=1 makes it start, stretching the draft silently",
    "W_EMBED_IGNORED": "an embed_tokens.weight in the file is replaced by the target's",
    "W_AUX_IDS_DEFAULT": "no eagle_config ids: SGLang captures its default layers",
    "SIMULATE": f"{SIMULATE} > 0 replaces the measured acceptance",
    "E_DRAFT_QUANTIZED": "a quantization_config in the draft's config.json over bf16 weights: "
                         "SGLang builds the draft's layers with its quant_method (configs/"
                         "model_config.py, source only, no lab row yet)",
}
NO_ROW = {  # claims a Llama target cannot test
    "rules.deepseek_first_id_rule": "needs a DeepSeek-family target",
    "rules.gpt_oss_final_capture": "needs a GPT-OSS target",
    "rules.minimax_m3_vl_default": "needs a MiniMax-M3-VL target",
}

CASES: tuple[Case, ...] = (
    Case("good", "the exported draft as it is (tensors under midlayer.*, no embed_tokens.weight)",
         ("same",), ()),
    Case("algorithm_eagle", "--speculative-algorithm EAGLE with the EAGLE-3 draft", ("collapses",),
         ("E_ALGORITHM_NOT_EAGLE3",), server={"algorithm": "EAGLE"}),
    Case("algorithm_lowercase", "--speculative-algorithm eagle3", ("same",),
         ("rules.uppercases_algorithm",), server={"algorithm": "eagle3"}),
    Case("keys_layers0", "tensors renamed midlayer.* -> layers.0.*", ("same",),
         ("rules.multi_layer",),
         tensors=lambda it, c, t: _rename(it, lambda n: LAYER0 + n[len(MIDLAYER):]
                                          if n.startswith(MIDLAYER) else n)),
    Case("keys_draft_model_prefix", "every tensor under `draft_model.`", ("collapses", "crashes"),
         ("E_KEY_PREFIX",), tensors=lambda it, c, t: _rename(
             it, lambda n: TRAINING_PREFIXES[0] + n)),
    Case("keys_model_prefix", "every tensor but lm_head under `model.` (an HF-style name)",
         ("same",), ("W_KEY_MODEL_PREFIX",),
         tensors=lambda it, c, t: _rename(it, lambda n: n if n == "lm_head.weight" else
                                          "model." + n)),
    Case("d2t_absolute", "d2t holds absolute target ids, not offsets", ("collapses", "crashes"),
         ("E_D2T_ABSOLUTE",), tensors=_d2t_absolute),
    Case("d2t_missing", "no d2t tensor (a reduced draft vocab)", ("refuses", "collapses"),
         ("E_D2T_MISSING",), tensors=lambda it, c, t: [x for x in it if x[0] != "d2t"]),
    Case("draft_vocab_wrong", "draft_vocab_size one below the lm_head rows", ("refuses",),
         ("E_VOCAB_MISMATCH",),
         cfg=lambda c, t: c.update(draft_vocab_size=c["draft_vocab_size"] - 1)),
    Case("draft_vocab_null", "draft_vocab_size null", ("refuses",), ("E_DRAFT_VOCAB_NULL",),
         cfg=lambda c, t: c.update(draft_vocab_size=None)),
    Case("aux_ids_off_by_one", "eagle_config ids written as the HF indices training captured "
         "(each one too high)", ("lower", "collapses"), ("rules.capture",),
         cfg=lambda c, t: _eagle(c, **{AUX_IDS_KEY: [k + 1 for k in _ids(c)]}),
         blind="fc reads the layers above those trained; a weak drafter (lab, H100, 2026-12-07: "
               "1.387 against 1.409) loses too little to the shift for tau to show it"),
    Case("aux_id_out_of_range", "the last eagle_config id is L-1 (never captured)",
         ("refuses", "crashes"), ("rules.aux_id_range",),
         cfg=lambda c, t: _eagle(c, **{AUX_IDS_KEY: _ids(c)[:-1] + [t["num_hidden_layers"] - 1]})),
    Case("no_eagle_config", "no eagle_config (SGLang's default ids, here those trained)",
         ("same",), ("rules.default_capture", "W_AUX_IDS_DEFAULT"),
         cfg=lambda c, t: c.pop("eagle_config")),
    Case("use_aux_false", "eagle_config.use_aux_hidden_state false", ("lower",),
         ("rules.reads_use_aux_hidden_state",),
         cfg=lambda c, t: _eagle(c, use_aux_hidden_state=False)),
    Case("fc_width_h", "fc.weight [H, H] instead of [H, 3H]", ("refuses",), ("E_FC_WIDTH",),
         tensors=_fc_width_h),
    Case("mpe_short", "max_position_embeddings a quarter of the target's (the serving context)",
         ("refuses",), ("E_MAX_POSITION_EMBEDDINGS",),
         cfg=lambda c, t: c.update(max_position_embeddings=t["max_position_embeddings"] // 4)),
    Case("mpe_short_stretch", f"the same with {STRETCH}=1", ("same",), ("STRETCH",),
         cfg=lambda c, t: c.update(max_position_embeddings=t["max_position_embeddings"] // 4),
         env={STRETCH: "1"}, harm="the draft runs at positions past those it was trained for"),
    Case("embed_present", "a random embed_tokens.weight [V, H] in the file", ("same",),
         ("W_EMBED_IGNORED",), tensors=_with_embed),
    Case("num_layers_2", "num_hidden_layers 2 with the one trained layer", ("same",),
         ("rules.unloaded_layer",), cfg=lambda c, t: c.update(num_hidden_layers=2)),
    Case("attention_bias", "attention_bias true without an o_proj bias tensor", ("same",),
         ("rules.o_proj_bias_absent",), cfg=lambda c, t: c.update(attention_bias=True)),
    Case("fc_norm_flag", "fc_norm true without fc_norm tensors", ("lower", "collapses"),
         ("rules.reads_flags",), cfg=lambda c, t: c.update(fc_norm=True)),
    Case("flag_draft_kv_dtype", "--speculative-draft-kv-cache-dtype bfloat16", ("refuses",),
         ("rules.server_flags",),
         server={"extra": ["--speculative-draft-kv-cache-dtype", "bfloat16"]}),
    Case("chain_draft_tokens", "num_steps 3, topk 1, num_draft_tokens 6 (SGLang forces 4)",
         ("same",), ("rules.chain_draft_tokens",), server={"shape": (3, 1, 6)},
         harm="the server verifies 4 tokens, not the 6 the line asks for"),
    Case("tree_over_bound", "num_steps 2, topk 2, num_draft_tokens 8 (bound 1 + 2 + 4 = 7)",
         ("refuses", "crashes"), ("rules.max_draft_tokens",), server={"shape": (2, 2, 8)}),
    Case("simulate_acc_len", f"{SIMULATE}=3 in the server's environment", ("inflated",),
         ("SIMULATE",), env={SIMULATE: "3"}),
    Case("quantization_config_fp8", "an FP8 target's quantization_config copied into the "
         "draft's config.json over its bf16 weights", ("refuses", "crashes", "collapses"),
         ("E_DRAFT_QUANTIZED",), cfg=lambda c, t: c.update(quantization_config={
             "quant_method": "fp8", "activation_scheme": "dynamic",
             "weight_block_size": [128, 128]})),
)
BY_NAME = {c.name: c for c in CASES}


def write_variant(case: Case, good: Path, dst: Path, target: dict) -> Path:
    """The case's draft directory: dst itself holding a broken copy of `good`, or `good` when
    the case changes only the server line or environment. Small files (config.json,
    provenance.json) are copied, tensors rewritten from the good file's bytes (sparse where
    zero). Returns the directory to serve."""
    if case.same_files:
        return Path(good)
    dst = Path(dst)
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    cfg = json.loads((Path(good) / "config.json").read_text())
    if case.cfg:
        case.cfg(cfg, target)
    items = [(n, e["dtype"], e["shape"], (e["file"], e["start"] + e["data_offsets"][0],
                                           e["start"] + e["data_offsets"][1]))
             for n, e in draft_tensors(Path(good)).items()]
    if case.tensors:
        items = case.tensors(items, cfg, target)
    write_safetensors(dst / "model.safetensors", items)
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    for f in Path(good).iterdir():
        if f.is_file() and f.suffix == ".json" and f.name != "config.json":
            shutil.copy(f, dst / f.name)
    return dst


# ----------------------------------------------------------------------------------------------
# judging a row


def outcome(ready: bool, error: str | None, answered: bool, tau: float | None,
            good_tau: float | None, hung: bool = False) -> str | None:
    """The OUTCOMES value of one served variant (None: tau known but the good row's is not)."""
    if hung:
        return "hangs"
    if not ready:
        return "refuses"
    if error or not answered or tau is None:
        return "crashes"
    if good_tau is None or good_tau != good_tau:
        return None
    gain = good_tau - 1
    if tau > good_tau + TOLERANCE * gain + 0.02:
        return "inflated"
    if tau >= good_tau - TOLERANCE * gain - 0.02:
        return "same"
    return "collapses" if tau <= 1 + COLLAPSE * gain or tau < 1.05 else "lower"


def verdict(case: Case, observed: str | None, we_said_error: bool) -> dict:
    """confirmed / corrected (the claims predicted another outcome) / unknown, and whether our
    checks before the server caught it: 'caught' (an error, and SGLang misbehaved or the case
    has a harm tau does not show), 'missed' (no error, and it did), 'false alarm' (an error, and
    it served as well as the good draft), 'clean' (neither). A blind case served as well as the
    good draft is 'unknown' / 'unjudged': tau cannot tell (Case.blind)."""
    if observed == "same" and case.blind:
        return {"verdict": "unknown", "caught": "unjudged"}
    harmful = observed in HARMFUL or bool(case.harm)
    caught = ("caught" if we_said_error and harmful else "missed" if harmful else
              "false alarm" if we_said_error and observed == "same" else "clean")
    return {"verdict": "unknown" if observed is None else
            "confirmed" if observed in case.expect else "corrected", "caught": caught}


def claims_map(rows: list[dict]) -> list[dict]:
    """Every claim (CLAIMS) with the lab rows that test it and what they found: 'confirmed' when
    every row confirmed it, 'corrected' when one did not, 'no row' (NO_ROW: why) or 'not run'."""
    out = []
    for key, text in CLAIMS.items():
        mine = [r for r in rows if key in BY_NAME[r["case"]].claims]
        if key in NO_ROW:
            status = f"no row: {NO_ROW[key]}"
        elif not mine:
            status = "not run"
        elif any(r["verdict"] == "corrected" for r in mine):
            status = "corrected"
        elif all(r["verdict"] == "confirmed" for r in mine):
            status = "confirmed"
        else:
            status = "unknown"
        out.append({"claim": key, "says": text, "rows": [r["case"] for r in mine],
                    "status": status,
                    "observed": [f"{r['case']}: {r['observed']}" for r in mine]})
    return out
