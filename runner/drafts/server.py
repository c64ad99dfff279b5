"""SGLang's rules for an `sglang.launch_server` line serving an EAGLE-3 drafter, per version row of
runner/drafts/rules.py, with their messages (docs/eagle3-format.md, section 4).

Read in 0.5.6 (server_args.py, managers/scheduler.py, speculative/spec_utils.py), 0.5.14
(server_args.py) and 0.5.23 (arg_groups/fields/spec.py, arg_groups/serving_hook.py,
arg_groups/speculative_hook.py, model_executor/model_runner.py):
- `--speculative-algorithm`: 0.5.6's argparse accepts only EAGLE, EAGLE3, NEXTN, STANDALONE,
  NGRAM; 0.5.14+ upper-case the name. Only EAGLE3 captures aux hidden states.
- steps / topk / draft tokens: all three or none (an assert, or a None comparison, at start).
- `--quantization X` is inherited by the draft: 0.5.6 has no way out; 0.5.14+ unless
  `--speculative-draft-model-quantization` is given (`unquant` = none).
- the draft's KV cache follows `--kv-cache-dtype`; only 0.5.23 has
  `--speculative-draft-kv-cache-dtype`.
- `--speculative-draft-load-format` (else `--load-format`) `dummy` = random draft weights.
- `--speculative-draft-window-size` and `--speculative-adaptive` exist from 0.5.14.
- `--speculative-accept-threshold-single` / `-acc` below 1 accept tokens the target would not
  sample (lossy, temperature > 0).
- the environment variable SGLANG_SIMULATE_ACC_LEN > 0 replaces the measured acceptance with a
  simulated one (every version); SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1 turns the refusal of
  a --context-length above the draft's max_position_embeddings into a silent stretch.
- no steps / topk / draft tokens at all: SGLang picks them from the target's
  `architectures[0]` (`auto_speculative_params`; read in 0.5.6 server_args.py
  auto_choose_speculative_params).

The environment: a server line may start with `VAR=value` words, or `env VAR=value ...`, as a
shell would run it; those are the server's environment here (the inspecting process's own
environment is not the server's and is never read). No torch, no numpy.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from eagle3_runner.runner.drafts.checks import check_draft_tokens, server_draft_tokens_problem
from eagle3_runner.runner.drafts.layout import ALGORITHM
from eagle3_runner.runner.drafts.rules import RuleSet, by_rows

_ENV_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=.*", re.S)
VERSIONED_FLAGS = ("--speculative-draft-model-quantization", "--speculative-draft-window-size",
                   "--speculative-adaptive", "--speculative-draft-kv-cache-dtype")
SIMULATE = "SGLANG_SIMULATE_ACC_LEN"
STRETCH = "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"

# auto_choose_speculative_params (0.5.6 server_args.py): (3, 1, 4) for these architectures[0],
# (5, 4, 8) for LlamaForCausalLM and every other one. A GGUF header has no architectures: its
# general.architecture (runner/target_config.py's model_type) names the same graphs.
AUTO_CHAIN_ARCHS = ("DeepseekV32ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM",
                    "GptOssForCausalLM", "BailingMoeForCausalLM", "BailingMoeV2ForCausalLM")
_AUTO_CHAIN_GGUF = ("deepseek2", "gpt-oss", "bailingmoe", "bailingmoe2")
AUTO_CHAIN, AUTO_TREE = (3, 1, 4), (5, 4, 8)


@dataclass
class ServerLine:
    env: dict = field(default_factory=dict)  # leading VAR=value words
    flags: dict = field(default_factory=dict)  # --flag -> value ("" for a bare flag); last wins
    error: str | None = None  # why the line cannot be read


def auto_speculative_params(cfg) -> tuple[int, int, int]:
    """(num_steps, eagle_topk, num_draft_tokens) SGLang chooses for a server line that gives none,
    from the target's config dict (config.json, or runner.target_config's view of a GGUF header):
    AUTO_CHAIN when architectures[0] is in AUTO_CHAIN_ARCHS (Kimi-K2 is a DeepseekV3ForCausalLM),
    else AUTO_TREE. Source: 0.5.6 server_args.py auto_choose_speculative_params. Never raises."""
    cfg = cfg if isinstance(cfg, dict) else {}
    archs = cfg.get("architectures")
    if isinstance(archs, list) and archs and isinstance(archs[0], str):
        return AUTO_CHAIN if archs[0] in AUTO_CHAIN_ARCHS else AUTO_TREE
    return AUTO_CHAIN if cfg.get("model_type") in _AUTO_CHAIN_GGUF else AUTO_TREE


def parse_server_line(line) -> ServerLine:
    """Split a launch_server line like a shell (shlex) without raising: leading `VAR=value` words
    (optionally after `env`) are the environment; `--flag value` / `--flag=value` the flags."""
    if not isinstance(line, str):
        return ServerLine(error=f"--server-args must be a string, got {type(line).__name__}")
    try:
        toks = shlex.split(line)
    except ValueError as e:
        return ServerLine(error=f"--server-args cannot be split like a shell line ({e}); check "
                                "its quotes.")
    out, i = ServerLine(), 0
    while i < len(toks) and (toks[i] == "env" or _ENV_WORD.fullmatch(toks[i])):
        if toks[i] != "env":
            k, _, v = toks[i].partition("=")
            out.env[k] = v
        i += 1
    toks = toks[i:]
    for j, t in enumerate(toks):
        if t.startswith("--"):
            k, eq, v = t.partition("=")
            nxt = toks[j + 1] if j + 1 < len(toks) else "--"
            out.flags[k] = v if eq else ("" if nxt.startswith("--") else nxt)
    return out


def simulate_acc_len_problem(env: dict) -> str | None:
    """The message when SGLANG_SIMULATE_ACC_LEN is on in `env` (a float > 0; spec_utils.py:
    'turn off if < 0'), else None."""
    v = env.get(SIMULATE)
    if v is None or str(v).strip() == "":
        return None
    try:
        on = float(v) > 0
    except ValueError:
        return f"{SIMULATE}={v!r} is not a number: SGLang fails reading it. Unset it."
    return (f"{SIMULATE}={v}: SGLang replaces the measured acceptance with a simulated accept "
            "length (speculative/spec_utils.py, every version), so tau measures nothing. Unset "
            "it.") if on else None


def _int(v):
    try:
        return int(v) if v not in (None, "") else None
    except (TypeError, ValueError):
        return "bad"


def server_findings(line, draft_dir, cfg: dict, rules: RuleSet) -> list[tuple[str, str, str]]:
    """(severity, code, message) for a launch_server line serving `draft_dir` (config `cfg`,
    a typed view), checked against `rules`. Never raises."""
    s = parse_server_line(line)
    if s.error:
        return [("error", "E_SERVER_ARGS_PARSE", s.error)]
    out, f = [], s.flags
    E = lambda c, m: out.append(("error", c, m))  # noqa: E731
    W = lambda c, m: out.append(("warning", c, m))  # noqa: E731
    alg = f.get("--speculative-algorithm")
    if alg is None:
        E("E_SERVER_NO_ALGORITHM", "--speculative-algorithm is missing: the server runs without "
          "speculative decoding. Add `--speculative-algorithm EAGLE3`.")
    elif alg != ALGORITHM and alg.upper() != ALGORITHM:
        E("E_ALGORITHM_NOT_EAGLE3", f"--speculative-algorithm {alg}: an EAGLE-3 draft needs exactly "
          "`--speculative-algorithm EAGLE3`. SGLang's is_eagle3() matches only that algorithm; "
          f"with {alg!r} the draft loads but the target captures no aux hidden states, so accept "
          "length is 1.00.")
    path = f.get("--speculative-draft-model-path") or f.get("--speculative-draft-model")
    if not path:
        E("E_SERVER_NO_DRAFT_PATH", "--speculative-draft-model-path is missing. Add "
          f"`--speculative-draft-model-path {draft_dir}`.")
    else:
        try:
            other = Path(path).exists() and Path(path).resolve() != Path(draft_dir).resolve()
        except (OSError, RuntimeError, ValueError):
            other = False
        if other:
            W("W_SERVER_DRAFT_PATH", f"--speculative-draft-model-path {path} is not the inspected "
              f"directory {draft_dir}; the server will load another draft.")
    names = ("num-steps", "eagle-topk", "num-draft-tokens")
    given = {f"--speculative-{k}": f.get(f"--speculative-{k}") for k in names}
    vals = [_int(v) for v in given.values()]
    if "bad" in vals or any(isinstance(v, int) and v < 1 for v in vals):
        E("E_SERVER_SPEC_PARAMS", f"speculative flags must be positive integers, got "
          f"{ {k: v for k, v in given.items() if v is not None} }.")
    else:
        st, k, n = vals
        if check_draft_tokens(st, k, n).partial:
            E("E_SERVER_SPEC_PARAMS", "set all of --speculative-num-steps, --speculative-eagle-"
              "topk and --speculative-num-draft-tokens, or none: SGLang asserts all or none at "
              "start (server_args), so the server does not start; got "
              f"{ {a: b for a, b in given.items() if b is not None} }.")
        problem = server_draft_tokens_problem(st, k, n)
        if problem:
            E("E_SERVER_DRAFT_TOKENS", problem)
    if "--speculative-token-map" in f:
        W("W_SERVER_TOKEN_MAP", "--speculative-token-map is ignored for EAGLE3 (the draft's own "
          "d2t is used); drop it.")
    ctx, mpe = _int(f.get("--context-length")), cfg.get("max_position_embeddings")
    if isinstance(ctx, int) and isinstance(mpe, int) and ctx > mpe:
        stretch = s.env.get(STRETCH, "").strip().lower() in ("1", "true", "yes")
        E("E_MAX_POSITION_EMBEDDINGS", f"config.json max_position_embeddings = {mpe} is below "
          f"--context-length {ctx}: " + (
              f"with {STRETCH}=1 SGLang overwrites the draft's max_position_embeddings with "
              f"{ctx} silently, past the positions it was trained for. " if stretch else
              "SGLang refuses to start (ValueError in configs/model_config.py). ")
          + f"Set max_position_embeddings to at least {ctx} (and train for that context).")
    sim = simulate_acc_len_problem(s.env)
    if sim:
        E("E_SIMULATE_ACC_LEN", sim)
    for k in ("--speculative-accept-threshold-single", "--speculative-accept-threshold-acc"):
        if k in f:
            try:
                t = float(f[k])
            except ValueError:
                E("E_ACCEPT_THRESHOLD", f"{k} {f[k]!r} is not a number.")
                continue
            if t < 1:
                E("E_ACCEPT_THRESHOLD", f"{k} {f[k]}: below 1, SGLang accepts draft tokens the "
                  "target would not sample (temperature > 0): the output is no longer the "
                  "target's and tau is inflated. Remove it (default 1.0).")
    lf = f.get("--speculative-draft-load-format")
    if lf == "dummy" or (lf is None and f.get("--load-format") == "dummy"):
        E("E_DRAFT_DUMMY", ("--speculative-draft-load-format dummy" if lf else
                            "--load-format dummy (the draft follows it: no "
                            "--speculative-draft-load-format)") +
          ": SGLang fills the draft with random weights; tau measures nothing. Remove it.")
    out += by_rows(rules, lambda r: _row_findings(r, f))
    return out


def _row_findings(row, f: dict) -> list[tuple]:
    """The version-dependent findings of one row (runner/drafts/rules.by_rows merges them)."""
    out = []
    for k in VERSIONED_FLAGS:
        if k in f and k not in row.server_flags:
            out.append(("error", "E_SERVER_FLAG_VERSION", k, lambda v, k=k: (
                f"{k}: {v} has no such flag (argparse refuses the line). Remove it or serve with "
                "a version that has it.")))
    alg = f.get("--speculative-algorithm")
    if alg and alg != ALGORITHM and alg.upper() == ALGORITHM and not row.uppercases_algorithm:
        out.append(("error", "E_ALGORITHM_CASE", "alg", lambda v: (
            f"--speculative-algorithm {alg}: {v} accepts only the upper-case names (argparse "
            "choices); the server does not start. Write `--speculative-algorithm EAGLE3`.")))
    q, dq = f.get("--quantization"), f.get("--speculative-draft-model-quantization")
    has_dq = "--speculative-draft-model-quantization" in row.server_flags
    if q not in (None, "", "unquant") and (dq is None or not has_dq):
        if has_dq:
            out.append(("error", "E_DRAFT_QUANTIZED", "q", lambda v: (
                f"--quantization {q} without --speculative-draft-model-quantization: {v} "
                f"quantizes the draft with {q} too (the draft inherits --quantization), so it "
                "runs other numbers than it was trained with. Add --speculative-draft-model-"
                f"quantization unquant (or {q} to mean it).")))
        else:
            out.append(("warning", "W_DRAFT_QUANTIZED", "q", lambda v: (
                f"--quantization {q}: {v} quantizes the draft with it too and has no flag to "
                "stop it. Serve a pre-quantized target checkpoint without --quantization, or "
                f"accept a {q} draft.")))
    elif dq not in (None, "", "unquant") and has_dq:
        out.append(("warning", "W_DRAFT_QUANTIZED", "dq", lambda v: (
            f"--speculative-draft-model-quantization {dq}: the draft runs quantized ({v}), not "
            "as trained.")))
    kv, dkv = f.get("--kv-cache-dtype") or "", f.get("--speculative-draft-kv-cache-dtype")
    has_dkv = "--speculative-draft-kv-cache-dtype" in row.server_flags
    if (dkv is None or not has_dkv) and kv.startswith("fp8"):
        out.append(("warning", "W_DRAFT_KV_FP8", "kv", lambda v: (
            f"--kv-cache-dtype {kv}: {v} keeps the draft's KV cache in {kv} too; it was trained "
            "in bf16. " + ("Add --speculative-draft-kv-cache-dtype bfloat16 to keep it in bf16."
                           if has_dkv else "This version has no flag to exempt the draft."))))
    elif has_dkv and (dkv or "").startswith("fp8"):
        out.append(("warning", "W_DRAFT_KV_FP8", "dkv", lambda v: (
            f"--speculative-draft-kv-cache-dtype {dkv}: the draft's KV cache is fp8 on {v}; it "
            "was trained in bf16.")))
    if "--speculative-draft-window-size" in f and "--speculative-draft-window-size" in \
            row.server_flags:
        w = f["--speculative-draft-window-size"]
        out.append(("warning", "W_DRAFT_WINDOW", "w", lambda v: (
            f"--speculative-draft-window-size {w}: on {v} the draft attends to the last {w} keys "
            "only; it was trained with full attention, so acceptance drops on long contexts.")))
    if "--speculative-adaptive" in f and "--speculative-adaptive" in row.server_flags:
        out.append(("warning", "W_SPEC_ADAPTIVE", "a", lambda v: (
            f"--speculative-adaptive: {v} changes num_steps at run time from the acceptance, so "
            "the steps/topk/draft tokens given are not what runs and tau and tok/s belong to no "
            "one configuration. Remove it to benchmark a configuration.")))
    return out
