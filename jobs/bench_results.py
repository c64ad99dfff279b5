"""What the bench stage records, for every backend (jobs/bench.py embedded, jobs/sglang_backend.py):
the `bench` row per (configuration, prompt), the `bench_summary` row per configuration, the speed
model behind the summaries, and `train_samples`. Columns: runner/store.py SCHEMA. No torch.

Metric definitions (docs/eagle3-format.md): tau = tokens per target verify pass INCLUDING the
bonus token; mean_accepted = tau - 1; accept_rate = tau / num_draft_tokens (the seed's logs);
accept_per_pos[j] = fraction of verify rounds in which draft j+1 was accepted; speedup =
spec tok/s / baseline tok/s; base_ms_per_token = 1000 / baseline tok/s.
train_samples = the samples the drafter was actually trained on, read from the export's
provenance.json (the train stage's summary), the same for every backend, so data-scaling plots
(runner/report.py) never mix definitions.
"""

from __future__ import annotations

import json
from pathlib import Path

from runner.files import atomic_write


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


def flags_for(tau: float, speedup: float | None, lossless: bool | None) -> list[str]:
    out = []
    if tau == tau and tau < 1.05:
        out.append("drafter broken")
    if speedup is not None and speedup < 1:
        out.append("slower than baseline")
    if lossless is False:
        out.append("not lossless")
    return out


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
              lossless: bool | None) -> dict:
    speedup = spec_tok_s / base_tok_s
    return dict(tau=tau, mean_accepted=tau - 1, accept_rate=tau / cfg["num_draft_tokens"],
                spec_tok_s=spec_tok_s, base_tok_s=base_tok_s, speedup=speedup, lossless=lossless,
                flags=", ".join(flags_for(tau, speedup, lossless)))


def prompt_row(cfg: dict, prompt_id: str, tau: float, new_tokens: int, verify_ct: int,
               spec_tok_s: float, base_tok_s: float, lossless: bool | None, **extra) -> dict:
    """One `bench` row: one prompt under configuration `cfg` (config_fields). extra: more
    columns (accept_per_pos, draft_s, verify_s, other_s) and `_private` keys a backend keeps
    for its summary (save_results drops them)."""
    return {**cfg, "prompt_id": prompt_id, "new_tokens": new_tokens, "verify_ct": verify_ct,
            **_measured(cfg, tau, spec_tok_s, base_tok_s, lossless), **extra}


def summary_row(cfg: dict, n_prompts: int, tau: float, spec_tok_s: float, base_tok_s: float,
                lossless: bool | None, break_even_tau: float, explanation: str, **extra) -> dict:
    """One `bench_summary` row: configuration `cfg` over n_prompts prompts (sums, not means of
    ratios). extra: more columns (accept_per_pos, draft/verify/other_ms_per_round)."""
    return {**cfg, "n_prompts": n_prompts, **_measured(cfg, tau, spec_tok_s, base_tok_s, lossless),
            "base_ms_per_token": 1000 / base_tok_s, "break_even_tau": break_even_tau,
            "explanation": explanation, **extra}


def save_results(ctx, rows: list[dict], summaries: list[dict]) -> None:
    """Emit the rows to the `bench` and `bench_summary` tables and write bench.json into the
    stage's output (private `_keys` of the rows dropped)."""
    rows = [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]
    ctx.emit("bench", rows)
    ctx.emit("bench_summary", summaries)
    atomic_write(Path(ctx.out_dir) / "bench.json",
                 json.dumps({"summary": summaries, "rows": rows}, indent=1, default=str))
