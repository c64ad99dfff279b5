"""What the bench stage records, for every backend (jobs/bench.py embedded, targets/sglang.py):
the `bench` row per (configuration, prompt), the `bench_summary` row per configuration, the speed
model behind the summaries, and `train_samples`. Columns: runner/store.py SCHEMA. No torch.

Metric definitions (docs/eagle3-format.md): tau = tokens per target verify pass INCLUDING the
bonus token; mean_accepted = tau - 1; accept_rate = tau / num_draft_tokens (the seed's logs);
accept_per_pos[j] = fraction of verify rounds in which draft j+1 was accepted; speedup =
spec tok/s / baseline tok/s; base_ms_per_token = 1000 / baseline tok/s.
Losslessness (temperature 0): lossless = the speculative tokens equal the baseline's; where they
do not, diverge_at / diverge_margin / diverge_runner_up say where and how close the target's own
choice was there (the embedded backend's jobs.bench.divergence), and the summary tells near-ties
(margin < NEAR_TIE) from bugs (lossless_verdict). Without margins (backend sglang alone: no target
forward) a difference is left unjudged (UNJUDGED), never called a bug.
train_samples = the samples the drafter was actually trained on, read from the export's
provenance.json (the train stage's summary), the same for every backend, so data-scaling plots
(runner/report.py) never mix definitions.
Backend sglang adds server_accept_length (SGLang's own spec_accept_length, the prefill's token
counted) and, when the embedded engine ran in the same stage, ref_* = SGLang's plain greedy decode
against the embedded engine's (targets/sglang_bench.py). Speed model calibrated to SGLang: a
round-cost profile measured by the sglang backend (speed_profile, written as
sglang_profile.json; stages.bench.speed_profile reads one) gives the embedded rows the speedup and
break-even tau SGLang would give (predicted_speedup, predicted_break_even_tau).
The machine's load next to the timings (the embedded backend): cores, threads, other_load (cores'
worth of CPU other processes used on this process's cores while the row was measured), load_1m;
a row measured on a busy machine is flagged `busy machine` (runner/cpu.py busy, BUSY_CORES), so
a slow row is never taken for a slow drafter.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from eagle3_runner.runner.cpu import busy, busy_text
from eagle3_runner.runner.files import atomic_write


def train_samples(export_dir: Path) -> int | None:
    """Samples the drafter was trained on: provenance.json's train_metrics.summary.train_samples
    (jobs/export.py copies the train stage's summary there); None when the export has none."""
    try:
        prov = json.loads((Path(export_dir) / "provenance.json").read_text())
        return int(prov["train_metrics"]["summary"]["train_samples"])
    except (OSError, KeyError, TypeError, ValueError):
        return None


def config_id(c, cuda_graph: bool, max_new: int) -> str:
    return f"s{c.num_steps}-k{c.eagle_topk}-n{c.draft_tokens}-cg{int(cuda_graph)}-m{max_new}"


NEAR_TIE = 0.5
"""Target logits (float32 units of lm_head's output): a first divergence where the target's own
top1 - top2 gap is below this is a bf16 near-tie, at or above it a bug. bf16 keeps 8 significant
bits, so a logit of magnitude ~20 (in [16, 32): spacing 2^4 / 2^7 = 0.125) carries up to ~0.06
of rounding from its last operation alone, and a tree verify accumulates the layers' sums in
another order than a decode does: a few such steps flip an argmax whose gap is below ~0.5."""


def first_divergence(spec: list[int], base: list[int]) -> int | None:
    """0-based index into the new tokens of the first token where spec differs from base (the
    shorter one's length when one is a prefix of the other); None when they are equal."""
    if spec == base:
        return None
    return next((i for i, (a, b) in enumerate(zip(spec, base)) if a != b),
                min(len(spec), len(base)))


UNJUDGED = "unjudged: no target margins"
"""What the flag of a row whose outputs differ from the baseline's with no divergence margin says
(backend sglang alone: no target forward runs, so nothing tells a bf16 near-tie from a bug):
"differs from plain on 60/80 prompts (unjudged: no target margins)". Not "not lossless": on the
H100 (BENCHMARKS.md, session of 2026-12-07, fourth window) SGLang 0.5.14's speculative servers
with the trained SmolLM2-135M drafter gave greedy output_ids unlike its own plain server's on 60,
63 and 64 of 80 MT-bench prompts (256 new tokens; first difference at new token 1-250, medians
31.5-37.5), as the H200 recordings (tests/data/sglang/h200-0.5.14) do on all 3 of theirs; flagged
"not lossless", that read as a broken drafter or SGLang when nothing said so. Backend both
measures the margins (the embedded target's forward) and judges such rows."""


def flags_for(tau: float, speedup: float | None, lossless: bool | None,
              margin: float | None = None, busy_machine: bool = False,
              differ: tuple[int, int] | None = None) -> list[str]:
    """margin: the (worst) first-divergence logit margin of a row that is not lossless: below
    NEAR_TIE "not lossless (near-ties)", at or above it "not lossless" (a bug); None = unknown
    (no target forward: backend sglang alone): "differs from plain (unjudged: ...)" (UNJUDGED),
    with differ = (prompts that differ, prompts) of a summary row: "differs from plain on 60/80
    prompts (unjudged: ...)". busy_machine: other processes used the cores while it was
    measured (runner/cpu.py busy): its times and speedup say more about the machine than about
    the drafter."""
    out = ["busy machine"] if busy_machine else []
    if tau == tau and tau < 1.05:
        out.append("drafter broken")
    if speedup is not None and speedup < 1:
        out.append("slower than baseline")
    if lossless is False and margin is None:
        on = f" on {differ[0]}/{differ[1]} prompts" if differ else ""
        out.append(f"differs from plain{on} ({UNJUDGED})")
    elif lossless is False:
        out.append("not lossless (near-ties)" if margin < NEAR_TIE else "not lossless")
    return out


def lossless_verdict(rows: list[dict]) -> tuple[bool | None, int | None, float | None, str]:
    """Over one configuration's `bench` rows (prompt_row): (lossless, lossless_prompts, the
    largest first-divergence margin in logits (None when all are lossless or any margin is
    unknown), a sentence for the explanation ("" when lossless or at temperature > 0)). E.g.
    "17/30 prompts differ from the baseline; first divergences at target logit margins median
    0.031 (max 0.12), ...: near-ties (< 0.5 logits)." Without margins (backend sglang alone) the
    sentence says the difference is unjudged and how to judge it, not that it is a bug (UNJUDGED:
    SGLang 0.5.14's speculative servers differ from its plain server on most prompts).
    """
    if not rows or rows[0]["lossless"] is None:
        return None, None, None, ""
    bad = [r for r in rows if not r["lossless"]]
    n = len(rows) - len(bad)
    if not bad:
        return True, n, None, ""
    text = f" {len(bad)}/{len(rows)} prompts differ from the baseline"
    margins = [r["diverge_margin"] for r in bad]
    if None in margins:
        return False, n, None, text + (
            f", unjudged: no target margins on this backend (backend sglang alone runs no "
            f"target forward), so nothing tells a bf16 near-tie (margin < {NEAR_TIE} logits) "
            f"from a bug; backend both measures them. A difference alone does not show a broken "
            f"drafter or server: SGLang 0.5.14's speculative servers with a trained drafter "
            f"differed from its own plain server on 60-64 of 80 MT-bench prompts (H100, "
            f"2026-12-07).")
    worst = max(bad, key=lambda r: r["diverge_margin"])
    m = worst["diverge_margin"]
    up = sum(bool(r["diverge_runner_up"]) for r in bad)
    text += (f"; first divergences at target logit margins median {statistics.median(margins):.3g}"
             f" (max {m:.3g}), the speculative token the target's runner-up in {up}/{len(bad)}")
    if m < NEAR_TIE:
        return False, n, m, text + f": near-ties (< {NEAR_TIE} logits)."
    return False, n, m, (text + f"; margin {m:.3g} at prompt {worst['prompt_id']} (new token "
                         f"{worst['diverge_at']}): not a near-tie, a bug.")


def explain(tau: float, num_steps: int, draft_ms: float, verify_ms: float, other_ms: float,
            base_ms: float) -> tuple[float, float, str]:
    """Per-round cost model in numbers: a round costs draft + verify + other ms and yields tau
    tokens, so speedup = tau * base_ms_per_token / round_ms and break-even tau = round_ms /
    base_ms_per_token. All times in ms (per round; base per token).
    Returns (speedup, break_even_tau, explanation). Example, the seed's case: tau 2.1 at 53
    tok/s against 90 tok/s means a round cost 2.1/53 s = 39.6 ms vs 11.1 ms per baseline token,
    so break-even tau was 3.57."""
    round_ms = draft_ms + verify_ms + other_ms
    speedup = tau * base_ms / round_ms if round_ms > 0 else float("nan")
    be = round_ms / base_ms if base_ms > 0 else float("nan")
    text = (f"tau {tau:.2f} tokens per round; one round = {num_steps} draft steps x "
            f"{draft_ms / max(num_steps, 1):.2f} ms + verify {verify_ms:.2f} ms + other "
            f"{other_ms:.2f} ms = {round_ms:.2f} ms -> {round_ms / tau:.2f} ms/token "
            f"({1000 * tau / round_ms:.1f} tok/s) vs baseline {base_ms:.2f} ms/token "
            f"({1000 / base_ms:.1f} tok/s): decode speedup {speedup:.2f}x. Break-even tau = round cost / "
            f"baseline token cost = {round_ms:.2f}/{base_ms:.2f} = {be:.2f}"
            + (f"; tau is {be - tau:.2f} short of it." if tau < be else "."))
    return speedup, be, text


# ----------------------------------------------------------------------------------------------
# rows


def config_fields(c, cuda_graph: bool, max_new: int, temperature: float, backend: str,
                  prompt_set: str, train_samples: int | None, kernels: str | None = None) -> dict:
    """The columns naming one measured configuration (c: a SpecParams: the tree shape
    num_steps / eagle_topk / num_draft_tokens), shared by its `bench` rows and its
    `bench_summary` row. kernels: the embedded engine's resolved decode path ("triton" = the
    fused kernels, "torch"); None for a backend without the switch (sglang)."""
    return dict(config_id=config_id(c, cuda_graph, max_new), backend=backend,
                prompt_set=prompt_set, num_steps=c.num_steps, eagle_topk=c.eagle_topk,
                num_draft_tokens=c.draft_tokens, cuda_graph=cuda_graph, max_new_tokens=max_new,
                temperature=temperature, train_samples=train_samples, kernels=kernels)


def _measured(cfg: dict, tau: float, spec_tok_s: float, base_tok_s: float,
              lossless: bool | None, margin: float | None, load: dict | None,
              differ: tuple[int, int] | None = None) -> dict:
    speedup = spec_tok_s / base_tok_s
    return dict(tau=tau, mean_accepted=tau - 1, accept_rate=tau / cfg["num_draft_tokens"],
                spec_tok_s=spec_tok_s, base_tok_s=base_tok_s, speedup=speedup, lossless=lossless,
                flags=", ".join(flags_for(tau, speedup, lossless, margin, busy(load), differ)),
                **(load or {}))


NO_DIVERGENCE = dict(diverge_at=None, diverge_margin=None, diverge_runner_up=None)


def prompt_row(cfg: dict, prompt_id: str, tau: float, new_tokens: int, verify_ct: int,
               spec_tok_s: float, base_tok_s: float, lossless: bool | None,
               divergence: dict | None = None, load: dict | None = None, **extra) -> dict:
    """One `bench` row: one prompt under configuration `cfg` (config_fields). divergence: the
    NO_DIVERGENCE keys of a temperature-0 row that is not lossless (jobs.bench.divergence);
    None = NULLs (lossless, temperature > 0, or no target forward: sglang). load: the machine's
    load while it was measured (runner/cpu.py load_columns; None = NULLs, no flag). extra: more
    columns (accept_per_pos, draft_s, verify_s, other_s) and `_private` keys a backend keeps
    for its summary (save_results drops them)."""
    div = {**NO_DIVERGENCE, **(divergence or {})}
    return {**cfg, "prompt_id": prompt_id, "new_tokens": new_tokens, "verify_ct": verify_ct,
            **_measured(cfg, tau, spec_tok_s, base_tok_s, lossless, div["diverge_margin"], load),
            **div, **extra}


def summary_row(cfg: dict, rows: list[dict], tau: float, spec_tok_s: float, base_tok_s: float,
                break_even_tau: float, explanation: str, load: dict | None = None,
                **extra) -> dict:
    """One `bench_summary` row: configuration `cfg` over its `bench` rows (prompt_row; sums, not
    means of ratios). lossless, lossless_prompts and the near-tie / bug / unjudged flag come
    from the rows (lossless_verdict), whose sentence ends the explanation. load: the machine's
    load over the whole measurement (baseline and speculative decodes; runner/cpu.py
    load_columns): on a busy machine, flag `busy machine` and a sentence with the numbers.
    extra: more columns (accept_per_pos, draft/verify/other_ms_per_round)."""
    lossless, n_lossless, margin, why = lossless_verdict(rows)
    if busy(load):
        n = sum("busy machine" in r["flags"] for r in rows)
        why += busy_text(load) + f" {n}/{len(rows)} prompt rows flagged `busy machine`."
    differ = (len(rows) - n_lossless, len(rows)) if lossless is False else None
    return {**cfg, "n_prompts": len(rows),
            **_measured(cfg, tau, spec_tok_s, base_tok_s, lossless, margin, load, differ),
            "lossless_prompts": n_lossless, "base_ms_per_token": 1000 / base_tok_s,
            "break_even_tau": break_even_tau, "explanation": explanation + why, **extra}


def failed_summary_row(cfg: dict, why: str) -> dict:
    """The `bench_summary` row of a configuration that produced no measurement (an SGLang server
    that did not start or died): n_prompts 0, every measured column NULL, flags "sglang server
    failed", the reason (with the server's log tail) as the explanation."""
    return {**cfg, "n_prompts": 0, "flags": "sglang server failed", "explanation": why}


def round_cost(spec_s: float, rounds: int, base_s: float, base_tokens: int) -> tuple[float, float,
                                                                                       float]:
    """(round ms, baseline ms per token, round cost in baseline tokens = break-even tau) from
    end-to-end times: a round is spec_s / rounds (prefill and first token spread over the
    rounds), a baseline token base_s / base_tokens. NaN where a count is 0."""
    nan = float("nan")
    rms = 1000 * spec_s / rounds if rounds else nan
    bms = 1000 * base_s / base_tokens if base_tokens else nan
    return rms, bms, (rms / bms if bms == bms and bms > 0 else nan)


# ----------------------------------------------------------------------------------------------
# the speed model calibrated to the serving engine

PROFILE_FORMAT = "eagle3-runner-sglang-profile/1"
_SHAPE = ("num_steps", "eagle_topk", "num_draft_tokens", "cuda_graph")


def speed_profile(summaries: list[dict], version: str | None, target: str) -> dict:
    """SGLang's round-cost profile from the sglang backend's summaries of one bench stage (the
    failed ones skipped): per configuration its round ms, the plain server's ms per token and
    their ratio, the round cost in plain tokens (= break-even tau); the JSON
    sglang_profile.json holds, which stages.bench.speed_profile reads back."""
    configs = [{**{k: s[k] for k in (*_SHAPE, "prompt_set", "max_new_tokens", "n_prompts", "tau")},
                "round_ms": s["break_even_tau"] * s["base_ms_per_token"],
                "base_ms_per_token": s["base_ms_per_token"],
                "round_cost_tokens": s["break_even_tau"]}
               for s in summaries if s.get("backend") == "sglang" and s.get("n_prompts")]
    return {"format": PROFILE_FORMAT, "sglang_version": version, "target": target,
            "configs": configs}


def read_profile(path) -> dict:
    """A speed profile written by speed_profile (sglang_profile.json). Raises ValueError naming
    the file when it is not one."""
    try:
        prof = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read the SGLang speed profile ({e})")
    if not isinstance(prof, dict) or prof.get("format") != PROFILE_FORMAT or \
            not isinstance(prof.get("configs"), list):
        raise ValueError(f"{path}: not an SGLang speed profile (format {PROFILE_FORMAT}: the "
                         "sglang_profile.json a bench stage with backend sglang or both writes)")
    return prof


def profile_entry(profile: dict, cfg: dict) -> dict | None:
    """The profile's measurement of cfg's configuration (num_steps, eagle_topk,
    num_draft_tokens, cuda_graph), preferring one of the same prompt set and max_new_tokens;
    None when the profile has no such configuration."""
    same = [c for c in profile["configs"] if all(c.get(k) == cfg[k] for k in _SHAPE)]
    best = [c for c in same if (c.get("prompt_set"), c.get("max_new_tokens")) ==
            (cfg["prompt_set"], cfg["max_new_tokens"])]
    return (best or same or [None])[0]


def predict(summary: dict, profile: dict, source: str) -> dict:
    """Add to an embedded `bench_summary` row the speed SGLang would give at its tau: a round
    costs the profile's round_cost_tokens plain tokens there, so predicted_speedup = tau /
    round_cost_tokens and predicted_break_even_tau = round_cost_tokens (both NULL when the
    profile lacks the configuration). Updates and returns `summary`; source names the profile
    in the explanation."""
    e = profile_entry(profile, summary)
    v = profile.get("sglang_version") or "?"
    if e is None:
        summary["explanation"] += (f" Predicted for SGLang {v}: the profile ({source}) has no "
                                   "round cost for this configuration.")
        return summary
    cost, tau = e["round_cost_tokens"], summary["tau"]
    summary["predicted_break_even_tau"] = cost
    summary["predicted_speedup"] = tau / cost
    summary["explanation"] += (
        f" Predicted for SGLang {v} ({source}): a round there costs {e['round_ms']:.2f} ms = "
        f"{cost:.2f} plain tokens of {e['base_ms_per_token']:.2f} ms, so tau {tau:.2f} would "
        f"give {tau / cost:.2f}x (predicted; break-even tau {cost:.2f}).")
    return summary


def save_results(ctx, rows: list[dict], summaries: list[dict], curve: list[dict] = ()) -> None:
    """Emit the rows to the `bench`, `bench_summary` and `bench_curve` tables and write
    bench.json into the stage's output (private `_keys` of the rows dropped)."""
    rows = [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]
    ctx.emit("bench", rows)
    ctx.emit("bench_summary", summaries)
    if curve:
        ctx.emit("bench_curve", list(curve))
    atomic_write(Path(ctx.out_dir) / "bench.json",
                 json.dumps({"summary": summaries, "rows": rows, "curve": list(curve)}, indent=1,
                            default=str))


# ----------------------------------------------------------------------------------------------
# a bench that resumes: the parts it measured, kept as they complete


PARTS = "parts"  # the bench stage's folder of completed parts (embedded baselines and configs)


def machine() -> str:
    """This machine as it is booted now: /proc/sys/kernel/random/boot_id (another machine, or
    the same one rebooted, gives another), else the host name. A resumed bench keeps only the
    parts measured under the same value, so no speed ratio mixes two machines."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        import socket
        return socket.gethostname()


def save_part(out_dir: Path, name: str, obj: dict) -> None:
    """Keep one completed part of the bench (JSON, atomic) with this machine's `machine()`."""
    (Path(out_dir) / PARTS).mkdir(parents=True, exist_ok=True)
    atomic_write(Path(out_dir) / PARTS / f"{name}.json",
                 json.dumps({"machine": machine(), **obj}, default=str))


def load_part(out_dir: Path, name: str) -> dict | None:
    """A part `save_part` kept on this machine, else None (missing, unreadable, or measured on
    another machine or boot)."""
    try:
        got = json.loads((Path(out_dir) / PARTS / f"{name}.json").read_text())
    except (OSError, ValueError):
        return None
    return got if got.get("machine") == machine() else None

