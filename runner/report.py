"""`runner report SPEC [--out DIR]`: PNG plots of a spec's bench results from the DuckDB store.

Six plots, five from `bench_summary` rows (one per bench configuration, written by the bench
stage), one from `bench_curve` rows:
  <name>_tau_vs_samples.png   tau against train_samples, one line per prompt set; each variant of a
                              data-scaling sweep gives one point (its latest row, by
                              runs.started_at, over all runs of the spec); skipped, with a
                              note, when every row has the same train_samples.
  <name>_accept_per_pos.png   acceptance rate at draft position 1..num_steps, one line per
                              variant x bench config.
  <name>_tok_s.png            spec tok/s against num_steps, one line per tree shape (chains one
                              line, each eagle_topk / num_draft_tokens of trees its own), with the
                              target-only baseline tok/s as a dashed horizontal reference (same
                              run), speedup written at each point.
  <name>_configs.png          tau and tok/s per configuration, chains and trees side by side
                              (bars labelled "chain K" / "tree K/k/N"; speedup and break-even tau
                              ("pays at tau X") written on them, each bar's same-run baseline
                              dashed across it).
  <name>_variants.png         tau per variant (a recipe sweep: one factor per variant), one panel
                              per prompt set x bench config, bars sorted by tau, each labelled with
                              its difference to base's; drawn when the rows hold 2+ variants.
  <name>_curve.png            the learning curve of the latest run with bench_curve rows
                              (stages.bench.curve): tau against optimizer steps and distinct
                              samples, each engine's break-even tau dashed, a fit, and below it
                              (and on stdout) what more data or more steps would buy
                              (runner/report_curve.py).
Every plot takes the latest row of each variant x bench config over all runs of the spec, so a
sweep split over several applies (`runner apply --variant ...`, one per GPU) plots as one.
Metric terms follow docs/eagle3-format.md: tau = tokens per target verify pass
INCLUDING the bonus token; accept_per_pos[j] = fraction of rounds in which draft j+1 was
accepted (sums to tau - 1).

Lines are told apart by whichever of (variant, prompt_set, backend, the tree shape, max_new_tokens,
cuda_graph, temperature, kernels) differ between the plotted rows; the shape reads "chain K" for
eagle_topk 1 (num_draft_tokens = K + 1 there) and "tree K/k/N" (num_steps / eagle_topk /
num_draft_tokens) otherwise. matplotlib is imported
inside the plotting functions (Agg canvas, no pyplot state): runner/ stays importable without it.
Each PNG is written to a temp file and renamed into place (runner.files.atomic_path).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from eagle3_runner.runner.errors import ReportError
from eagle3_runner.runner.plots import legend, ok, runs_title, save_png
from eagle3_runner.runner.files import expand_path
from eagle3_runner.runner.spec.schema import Spec
from eagle3_runner.runner.store import Store

# fields that distinguish two bench_summary rows of one run (besides num_steps)
CONFIG_FIELDS = ("variant", "prompt_set", "backend", "num_steps", "eagle_topk", "num_draft_tokens",
                 "max_new_tokens", "cuda_graph", "temperature", "kernels")
SHAPE = ("num_steps", "eagle_topk", "num_draft_tokens")
SHORT = {"prompt_set": "", "max_new_tokens": "new", "cuda_graph": "graph", "temperature": "T"}


# ----------------------------------------------------------------------------------------------
# rows


def bench_rows(spec: Spec) -> list[dict]:
    """Every bench_summary row of runs of `spec.name`, as dicts with the run's started_at, sorted
    oldest first. Raises ReportError when there are none (or no results file)."""
    db = expand_path(spec.results.path)
    hint = (f"run `runner apply SPEC` with a bench stage first (spec {spec.name!r}, results "
            f"{db})")
    store = Store(db)
    if not db.exists() and not store.spool.exists():  # spooled rows not yet ingested count too
        raise ReportError(f"no results file at {db}: {hint}")
    # spec.name matches ^[A-Za-z0-9_.-]+$ (schema), so inlining it is safe
    cols, rows = store.query(
        "SELECT b.*, r.started_at AS run_started_at FROM bench_summary b JOIN runs r USING (run_id) "
        f"WHERE r.spec_name = '{spec.name}' AND b.tau IS NOT NULL "  # failed servers: no tau
        "ORDER BY r.started_at, b.run_id")
    if not rows:
        raise ReportError(f"no bench rows yet: {hint}")
    return [dict(zip(cols, r)) for r in rows]


def latest_per_config(rows: list[dict]) -> list[dict]:
    """The latest row (by run start, rows sorted oldest first) of each variant x bench config."""
    out: dict[tuple, dict] = {}
    for r in rows:
        out[tuple(r.get(f) for f in CONFIG_FIELDS)] = r
    return list(out.values())


def _varying(rows: list[dict], fields) -> list[str]:
    return [f for f in fields if len({repr(r.get(f)) for r in rows}) > 1]


def _tree(r: dict) -> bool:
    """A tree configuration (eagle_topk > 1; a row without it is a chain)."""
    return (r.get("eagle_topk") or 1) > 1


def _shape(r: dict, fields: list[str]) -> str:
    """The tree-shape part of a label, from the SHAPE fields among `fields`: "chain 4" /
    "tree 5/4/8" with num_steps, else "chain" / "tree topk=4[, ndt=8]"."""
    tree = _tree(r)
    if "num_steps" in fields:
        return (f"tree {r['num_steps']}/{r['eagle_topk']}/{r.get('num_draft_tokens')}" if tree
                else f"chain {r['num_steps']}")
    if not tree:
        return "chain"
    return "tree" + "".join(f" {k}={r.get(f)}" for f, k in (("eagle_topk", "topk"),
                                                          ("num_draft_tokens", "ndt"))
                            if f in fields)


def _label(r: dict, fields: list[str]) -> str:
    parts = []
    for f in fields:
        if f in SHAPE:
            if not parts or parts[-1] != ("shape",):
                parts.append(("shape",))
            continue
        v = r.get(f)
        k = SHORT.get(f, f)
        parts.append(f"{v}" if k == "" else f"{k}={v}")
    return ", ".join(_shape(r, fields) if p == ("shape",) else p for p in parts)


def group(rows: list[dict], always: tuple[str, ...], exclude: tuple[str, ...]) -> dict[str, list]:
    """{legend label: rows}: one line per distinct value of `always` plus every CONFIG_FIELD that
    varies between rows (minus `exclude`; num_draft_tokens too when every row is a chain, topk 1,
    where SGLang fixes it to num_steps + 1). Labels keep first-seen order."""
    if all(r.get("eagle_topk") in (1, None) for r in rows):  # chains: ndt = num_steps + 1
        exclude = (*exclude, "num_draft_tokens")
    fields = [f for f in CONFIG_FIELDS if f in always or f in _varying(rows, CONFIG_FIELDS)]
    fields = [f for f in fields if f not in exclude]
    out: dict[str, list] = {}
    for r in rows:
        out.setdefault(_label(r, fields) or str(r.get("prompt_set")), []).append(r)
    return out


def _per_pos(r: dict) -> list[float] | None:
    """accept_per_pos as floats (stored as a JSON list); None when missing or unreadable."""
    v = r.get("accept_per_pos")
    try:
        v = json.loads(v) if isinstance(v, str) else v
        return [float(x) for x in v] if isinstance(v, list) and v else None
    except (ValueError, TypeError):
        return None


# ----------------------------------------------------------------------------------------------
# plots (matplotlib imported here only)


def _figure(title: str, xlabel: str, ylabel: str):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(8, 4.5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    return fig, ax


# marker shapes and sizes per line, largest first and hollow: lines that coincide (a starved
# drafter gives chains 3 and 5 the same tau) stay visible as nested markers
MARKERS = (("o", 11), ("s", 8), ("^", 6), ("D", 4.5), ("v", 3.5), ("P", 3))


def plot_tau_vs_samples(rows: list[dict], spec_name: str, path: Path) -> Path | None:
    """tau (incl. bonus token) against train_samples; rows = latest per variant x config.
    One line per prompt set (and per config field that varies), each with its own hollow marker
    (MARKERS). None when no row has both, or when every row has the same train_samples (one
    point per line says nothing about data: it takes a data-scaling sweep)."""
    rows = [r for r in rows if ok(r.get("train_samples")) and ok(r.get("tau"))]
    if len({r["train_samples"] for r in rows}) < 2:
        return None
    fig, ax = _figure(f"{spec_name}: accept length vs training data\n(latest row per variant)",
                      "training samples", "tau = tokens per verify pass (incl. bonus)")
    for i, (label, rs) in enumerate(group(rows, ("prompt_set",), ("variant",)).items()):
        rs = sorted(rs, key=lambda r: r["train_samples"])
        m, size = MARKERS[i % len(MARKERS)]
        ax.plot([r["train_samples"] for r in rs], [r["tau"] for r in rs], marker=m, ms=size,
                mfc="none", mew=1.4, label=label)
    top: dict[tuple, float] = {}  # name each variant once, above its highest point
    for r in rows:
        k = (r["variant"], r["train_samples"])
        top[k] = max(top.get(k, -math.inf), r["tau"])
    for (v, x), y in top.items():
        ax.annotate(v, (x, y), fontsize=7, textcoords="offset points", xytext=(0, 6), ha="center")
    xs = sorted({r["train_samples"] for r in rows})
    if xs[0] > 0 and xs[-1] / xs[0] >= 10:
        ax.set_xscale("log")
        ax.minorticks_off()
    ax.set_xticks(xs, [f"{x:,}" for x in xs])
    ax.margins(x=0.08, y=0.12)
    ax.axhline(1.0, color="grey", lw=0.8, ls=":", label="tau 1.0 = nothing accepted")
    legend(ax)
    return save_png(fig, path)


def plot_accept_per_pos(rows: list[dict], spec_name: str, path: Path) -> Path | None:
    """Acceptance rate at draft position 1..num_steps, one line per num_steps config (and per
    whatever else differs between the rows). None when no row has accept_per_pos."""
    rows = [r for r in rows if _per_pos(r)]
    if not rows:
        return None
    fig, ax = _figure(f"{spec_name}: acceptance per draft position\n({runs_title(rows)})",
                      "draft position", "acceptance rate (fraction of rounds)")
    kmax = 1
    for label, rs in group(rows, ("num_steps",), ()).items():
        p = _per_pos(rs[-1])
        kmax = max(kmax, len(p))
        tau = rs[-1].get("tau")
        ax.plot(range(1, len(p) + 1), p, "o-",
                label=label + (f"  (tau {tau:.2f})" if ok(tau) else ""))
    ax.set_xticks(range(1, kmax + 1))
    ax.set_ylim(0, 1.02)
    legend(ax)
    return save_png(fig, path)


def plot_tok_s(rows: list[dict], spec_name: str, path: Path) -> Path | None:
    """Speculative tok/s against num_steps, one line per config group; each group's baseline
    (target-only, measured in the same run as its row) tok/s is a dashed horizontal line. None
    when no row has spec_tok_s."""
    rows = [r for r in rows if ok(r.get("spec_tok_s")) and r.get("num_steps") is not None]
    if not rows:
        return None
    fig, ax = _figure(f"{spec_name}: decode speed vs num_steps\n({runs_title(rows)}; "
                      "label = speedup over the baseline)", "num_steps", "tokens / s")
    # one line per tree shape: a chain's num_draft_tokens (K + 1) follows num_steps, a tree's not
    rows = [r if _tree(r) else {**r, "num_draft_tokens": None} for r in rows]
    groups = group(rows, (), ("num_steps",))
    bases = {label: [r["base_tok_s"] for r in rs if ok(r.get("base_tok_s"))]
             for label, rs in groups.items()}
    means = {k: sum(v) / len(v) for k, v in bases.items() if v}
    shared = bool(means) and max(means.values()) - min(means.values()) <= 0.01 * max(means.values())
    for label, rs in groups.items():
        rs = sorted(rs, key=lambda r: (r["num_steps"], r.get("num_draft_tokens") or 0))
        (line,) = ax.plot([r["num_steps"] for r in rs], [r["spec_tok_s"] for r in rs], "o-",
                          label=f"EAGLE-3 ({label})")
        for r in rs:
            if ok(r.get("speedup")):
                ax.annotate(f"{r['speedup']:.2f}x", (r["num_steps"], r["spec_tok_s"]), fontsize=7,
                            textcoords="offset points", xytext=(4, 4))
        if label in means and not shared:
            ax.axhline(means[label], color=line.get_color(), ls="--", lw=1,
                       label=f"baseline, target only ({label})")
    if shared:
        m = sum(means.values()) / len(means)
        ax.axhline(m, color="black", ls="--", lw=1, label=f"baseline, target only ({m:.1f} tok/s)")
    ax.set_xticks(sorted({r["num_steps"] for r in rows}))
    ax.margins(x=0.12)
    ax.set_ylim(bottom=0)
    legend(ax)
    return save_png(fig, path)


def plot_configs(rows: list[dict], spec_name: str, path: Path) -> Path | None:
    """tau and spec tok/s per configuration, side by side (chains blue, trees orange), each bar
    labelled by its configuration (shape + whatever else differs); speedup and break-even tau
    written on the tok/s bars, each bar's same-run baseline tok/s dashed across it. None when no
    row has tau."""
    rows = [r for r in rows if ok(r.get("tau"))]
    if not rows:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    rows = sorted(rows, key=lambda r: tuple(str(r.get(f)) for f in CONFIG_FIELDS[:3])
                  + (_tree(r), r.get("num_steps") or 0,
                     r.get("eagle_topk") or 1, r.get("num_draft_tokens") or 0))
    fields = [f for f in CONFIG_FIELDS if f in SHAPE or f in _varying(rows, CONFIG_FIELDS)]
    labels = [_label(r, fields) for r in rows]
    colors = ["tab:orange" if _tree(r) else "tab:blue" for r in rows]
    fig = Figure(figsize=(max(8, 0.9 * len(rows) + 3), 4.5), dpi=110)
    FigureCanvasAgg(fig)
    a1, a2 = fig.subplots(1, 2)
    fig.suptitle(f"{spec_name}: tau and decode speed per configuration ({runs_title(rows)})",
                 fontsize=10)
    x = range(len(rows))
    a1.bar(x, [r["tau"] for r in rows], color=colors)
    a1.axhline(1.0, color="grey", lw=0.8, ls=":")
    a1.set_ylabel("tau = tokens per verify pass (incl. bonus)")
    tok = [r.get("spec_tok_s") if ok(r.get("spec_tok_s")) else 0.0 for r in rows]
    a2.bar(x, tok, color=colors)
    a2.set_ylabel("tokens / s")
    for i, r in enumerate(rows):
        note = [f"{r['speedup']:.2f}x" if ok(r.get("speedup")) else "",
                f"pays at\ntau {r['break_even_tau']:.2f}" if ok(r.get("break_even_tau"))
                else ""]
        top = max(tok[i], r["base_tok_s"] if ok(r.get("base_tok_s")) else 0.0)
        a2.annotate("\n".join(n for n in note if n), (i, top), fontsize=7, ha="center",
                    textcoords="offset points", xytext=(0, 3))
    base = [(i, r["base_tok_s"]) for i, r in enumerate(rows) if ok(r.get("base_tok_s"))]
    if base:  # each bar's own same-run baseline: runs differ (machine, load), so no average
        a2.hlines([b for _, b in base], [i - 0.45 for i, _ in base], [i + 0.45 for i, _ in base],
                  colors="black", linestyles="--", lw=1)
        a2.set_title("dashed: each bar's same-run baseline (target only)\nabove a bar: its "
                     "speedup and break-even tau\n(the tau at which it would match the baseline)",
                     fontsize=8)
    for ax in (a1, a2):
        ax.set_xticks(list(x), labels, rotation=30, ha="right", fontsize=7)
        ax.grid(True, axis="y", alpha=0.3)
        ax.margins(y=0.15)
    return save_png(fig, path)


def plot_variants(rows: list[dict], spec_name: str, path: Path) -> Path | None:
    """tau per variant, one horizontal-bar panel per (prompt set, bench config and whatever
    else varies but the variant), bars sorted by tau (highest on top), base dark, each bar
    annotated with tau and its difference to base's tau in the same panel. None when fewer than
    two variants have tau."""
    rows = [r for r in rows if ok(r.get("tau"))]
    if len({r.get("variant") for r in rows}) < 2:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    panels = group(rows, ("prompt_set",), ("variant",))
    n = max(len(rs) for rs in panels.values())
    fig = Figure(figsize=(5.5 * len(panels), max(3.0, 0.35 * n + 1.5)), dpi=110)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    fig.suptitle(f"{spec_name}: accept length per variant ({runs_title(rows)})", fontsize=10)
    for ax, (label, rs) in zip(axes, panels.items()):
        rs = sorted(rs, key=lambda r: r["tau"])
        base = next((r["tau"] for r in rs if r.get("variant") == "base"), None)
        ax.barh(range(len(rs)), [r["tau"] for r in rs],
                color=["tab:gray" if r.get("variant") == "base" else "tab:blue" for r in rs])
        for i, r in enumerate(rs):
            d = "" if base is None or r.get("variant") == "base" else f" ({r['tau'] - base:+.3f})"
            ax.annotate(f"{r['tau']:.3f}{d}", (r["tau"], i), fontsize=7, va="center",
                        textcoords="offset points", xytext=(3, 0))
        ax.set_yticks(range(len(rs)), [str(r.get("variant")) for r in rs], fontsize=8)
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("tau = tokens per verify pass (incl. bonus)")
        lo = min(r["tau"] for r in rs)
        ax.set_xlim(max(0.0, lo - 0.1 * (max(r["tau"] for r in rs) - lo + 0.5)),
                    max(r["tau"] for r in rs) * 1.08)
        ax.grid(True, axis="x", alpha=0.3)
    return save_png(fig, path)


# ----------------------------------------------------------------------------------------------
# entry points


def write_report(spec: Spec, out_dir) -> tuple[list[Path], list[str], list[str]]:
    """Draw the six plots into out_dir as <spec name>_<plot>.png.

    Returns (written paths, notes about plots skipped for lack of data, the learning curve's
    advice). Without bench rows, the learning curve alone, from the train stage's evaluations
    (runner/report_curve.py heldout_rows). Raises ReportError when the spec has neither."""
    from eagle3_runner.runner.report_curve import (curve_advice, curve_rows, heldout_rows,
                                                   plot_curve)
    held = None  # heldout_rows, asked for once
    try:
        rows = bench_rows(spec)
    except ReportError:
        if not (held := heldout_rows(spec)):
            raise
        rows = []
    curve = curve_rows(spec) or (heldout_rows(spec) if held is None else held)
    out = expand_path(str(out_dir))
    written, notes = [], []
    for name, fn, what in (
            ("tau_vs_samples", lambda p: plot_tau_vs_samples(latest_per_config(rows), spec.name, p),
             "it needs rows trained on different numbers of samples (a data-scaling sweep: "
             "variants that set data.max_samples or stages.train.num_samples); these have one"),
            ("accept_per_pos", lambda p: plot_accept_per_pos(latest_per_config(rows), spec.name, p),
             "no bench_summary row has accept_per_pos"),
            ("tok_s", lambda p: plot_tok_s(latest_per_config(rows), spec.name, p),
             "no bench_summary row has spec_tok_s"),
            ("configs", lambda p: plot_configs(latest_per_config(rows), spec.name, p),
             "no bench_summary row has tau"),
            ("variants", lambda p: plot_variants(latest_per_config(rows), spec.name, p),
             "fewer than two variants have tau"),
            ("curve", lambda p: plot_curve(curve, rows, spec.name, p),
             "no bench_curve rows (stages.bench.curve with stages.train.snapshots draws it) "
             "and no evaluations of the train stage (stages.train.eval_every)")):
        p = fn(out / f"{spec.name}_{name}.png")
        if p is None:
            notes.append(f"skipped {name}: {what}")
        else:
            written.append(p)
    return written, notes, curve_advice(curve, rows)


def report_cli(spec: Spec, out_dir=None) -> int:
    """`runner report`: write the PNGs into out_dir (default: the spec's work_dir/reports, next
    to its artifacts, not the current folder), print their paths, then the learning curve's
    advice (runner/report_curve.py); exit 0. Exit 1 with
    `error: ...` on stderr when there is nothing to plot."""
    out_dir = out_dir or spec.resolved_work_dir() / "reports"
    try:
        written, notes, advice = write_report(spec, out_dir)
    except ReportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for n in notes:
        print(f"note: {n}", file=sys.stderr)
    for p in written:
        print(p)
    for a in advice:  # the learning curve's: what more data or more steps would buy
        print(a)
    if not written:
        print("error: nothing to plot (see notes above)", file=sys.stderr)
        return 1
    return 0
