"""`runner report`'s learning curve (<name>_curve.png and the advice it prints): the tau of the
train stage's kept drafters (table bench_curve, runner/bench_curve.py) against optimizer steps
and distinct samples, each engine's break-even tau (bench_summary.break_even_tau of the same run
and configuration: a round's cost in plain tokens, the tau at which a drafter pays), a fit, and
what more data or more steps would buy. No torch; numpy and matplotlib are imported inside.

Before any snapshot is benched (no bench_curve rows: stages.bench.curve 0, or no bench yet), the
curve is the train stage's own evaluations (`heldout_rows`): the simulated chain tau of
select_num_steps draft steps on its held-out samples at every evaluated step, one line, with the
break-even tau of the same chain where a bench measured one.

The fit (`fit`), over one line's points (a backend; variant and prompt set too when they vary):
tau = c + a*log2(samples) + b*log2(steps). In the first epoch samples = steps x batch, so the
two regressors move together; only points past it (samples fixed at N, steps growing) tell them
apart. Without such points (or with fewer than 3) the fit is tau = c + s*log2(steps), and the
advice says data and steps were not separable.
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

from eagle3_runner.runner.plots import legend, ok, runs_title, save_png
from eagle3_runner.runner.files import expand_path
from eagle3_runner.runner.spec.schema import Spec
from eagle3_runner.runner.store import Store

MAX_DOUBLINGS = 30  # past this many doublings (x1e9) the advice says "out of reach"
SEP_TOL = 0.1  # log2(samples) must leave a line in log2(steps) by this much to be separable
MATCH = ("run_id", "variant", "prompt_set", "backend", "num_steps", "eagle_topk",
         "num_draft_tokens")  # a curve row's bench_summary row (its engine's break-even tau)
CAVEAT = ("Caveat: a mid-run snapshot was taken at a high learning rate (the cosine schedule had "
          "not annealed), so the curve understates what a shorter run would reach; and the fit "
          "extrapolates beyond the points measured.")


def curve_rows(spec: Spec) -> list[dict]:
    """The bench_curve rows (with tau) of the latest run of `spec.name` that has any, oldest
    snapshot first, as dicts; [] when there are none or no results file (the other plots still
    draw)."""
    db = expand_path(spec.results.path)
    store = Store(db)
    if not db.exists() and not store.spool.exists():
        return []
    cols, rows = store.query(  # spec.name matches ^[A-Za-z0-9_.-]+$ (schema): safe to inline
        "SELECT c.* FROM bench_curve c JOIN runs r USING (run_id) "
        f"WHERE r.spec_name = '{spec.name}' AND c.tau IS NOT NULL "
        "ORDER BY r.started_at, c.run_id, c.snapshot_step")
    rows = [dict(zip(cols, r)) for r in rows]
    return [r for r in rows if r["run_id"] == rows[-1]["run_id"]] if rows else []


HELD_OUT = "held-out"  # the backend label of the train stage's own evaluations
SPLITS = {"eval": "simulated on held-out samples", "trainset": "simulated on training samples"}


def heldout_rows(spec: Spec) -> list[dict]:
    """The train stage's evaluations of the latest run of `spec.name` that has them, as curve
    rows: backend HELD_OUT, snapshot_step = the step, tau = its `<split>_chain_tau_<n>` step
    metric (n = stages.train.select_num_steps; trainer/evaluation.py record_eval), train_samples
    = its `<split>_samples` (None in results older than that metric), selected = the step the
    stage exported (stages.train.select: the highest tau, ties the later; or the last). The
    runs of the same train cache key count together (a resumed run re-evaluates from its
    checkpoint: its rows win). [] when there are none."""
    db = expand_path(spec.results.path)
    store = Store(db)
    if spec.stages.train is None or (not db.exists() and not store.spool.exists()):
        return []
    p = spec.stages.train
    _, keyed = store.query(  # spec.name matches ^[A-Za-z0-9_.-]+$ (schema): safe to inline
        "SELECT s.run_id, s.cache_key FROM stages s JOIN runs r USING (run_id) WHERE "
        f"r.spec_name = '{spec.name}' AND s.stage = 'train' AND s.variant = 'base' AND "
        "s.cache_key IS NOT NULL AND s.status IN ('running', 'done', 'cancelled', 'failed') "
        "ORDER BY s.started_at")
    if not keyed:
        return []
    runs = [r for r, k in keyed if k == keyed[-1][1]]
    names = [f"{sp}_{w}" for sp in SPLITS for w in (f"chain_tau_{p.select_num_steps}", "samples")]
    ids, want = ", ".join(f"'{r}'" for r in runs), ", ".join(f"'{n}'" for n in names)
    _, vals = store.query(f"SELECT run_id, step, name, value FROM metrics WHERE run_id IN ({ids}) "
                          f"AND step IS NOT NULL AND name IN ({want})")
    order = {r: i for i, r in enumerate(runs)}
    by_step: dict[int, dict] = {}
    for run, step, name, value in sorted(vals, key=lambda v: order[v[0]]):  # later runs win
        split, what = name.split("_", 1)
        row = by_step.setdefault(step, {"run_id": run, "variant": "base", "prompt_set": None,
                                        "backend": HELD_OUT, "how": SPLITS[split],
                                        "snapshot_step": step, "train_samples": None,
                                        "num_steps": p.select_num_steps, "eagle_topk": 1,
                                        "num_draft_tokens": p.select_num_steps + 1})
        row["run_id"] = run
        row["tau" if what.startswith("chain_tau") else "train_samples"] = value
    rows = [by_step[s] for s in sorted(by_step) if ok(by_step[s].get("tau"))]
    if rows:
        pick = rows[-1] if p.select == "last" else max(rows, key=lambda r: (r["tau"],
                                                                           r["snapshot_step"]))
        for r in rows:
            r["selected"] = r is pick
    return rows


def lines(rows: list[dict]) -> dict[str, list[dict]]:
    """{label: rows sorted by snapshot step}: one line per backend, and per variant and prompt
    set where those differ between the rows; the label is the backend (+ those)."""
    vary = [f for f in ("variant", "prompt_set") if len({r.get(f) for r in rows}) > 1]
    out: dict[str, list[dict]] = {}
    for r in rows:
        out.setdefault(", ".join(str(r.get(f)) for f in ("backend", *vary)), []).append(r)
    return {k: sorted(v, key=lambda r: r["snapshot_step"]) for k, v in out.items()}


def _points(rs: list[dict]) -> list[tuple]:
    return [(r.get("train_samples"), r["snapshot_step"], r["tau"]) for r in rs
            if ok(r.get("tau")) and (r.get("snapshot_step") or 0) > 0]


def _not_separable(points: list[tuple]) -> str | None:
    """Why data and steps cannot be told apart in `points`, or None when they can."""
    import numpy as np
    if len(points) < 3:
        return f"{len(points)} point{'s' * (len(points) != 1)}, the fit of both takes 3 or more"
    if any(not s or s <= 0 for s, _, _ in points):
        return "the points do not say how many samples they had seen"
    ls, lt = (np.log2([p[i] for p in points]) for i in (0, 1))
    if np.ptp(ls) < SEP_TOL:
        return "every point had seen the same samples"
    x = np.column_stack([np.ones_like(lt), lt])
    res = ls - x @ np.linalg.lstsq(x, ls, rcond=None)[0]
    if np.abs(res).max() < SEP_TOL:
        return "every point is in the first epoch, where samples = steps x batch"
    return None


def fit(points: list[tuple]) -> dict:
    """Least squares over (samples, steps, tau) points of one line. Separable: {"kind":
    "data+steps", c, a (per doubling of samples), b (per doubling of steps)}; else {"kind":
    "steps", c, s (per doubling of steps), why}; n = the number of points."""
    import numpy as np
    why = _not_separable(points)
    lt = np.log2([p[1] for p in points])
    tau = np.array([p[2] for p in points], dtype=float)
    if why is None:
        x = np.column_stack([np.ones_like(lt), np.log2([p[0] for p in points]), lt])
        c, a, b = np.linalg.lstsq(x, tau, rcond=None)[0]
        return {"kind": "data+steps", "c": float(c), "a": float(a), "b": float(b),
                "n": len(points)}
    if len(points) >= 2 and np.ptp(lt) > 0:
        c, s = np.linalg.lstsq(np.column_stack([np.ones_like(lt), lt]), tau, rcond=None)[0]
    else:  # one point (or one step): no slope to fit
        c, s = float(tau.mean()) if len(tau) else math.nan, math.nan
    return {"kind": "steps", "c": float(c), "s": float(s), "why": why, "n": len(points)}


def predict(f: dict, samples, steps) -> float:
    """The fit's tau at (samples, steps)."""
    if f["kind"] == "steps":
        return f["c"] + f["s"] * math.log2(steps)
    return f["c"] + f["a"] * math.log2(samples) + f["b"] * math.log2(steps)


def break_evens(rows: list[dict], summaries: list[dict]) -> dict[str, float]:
    """{line label: break-even tau}: each line's engine's round cost from the bench_summary row
    of the same run and configuration (MATCH); lines without one are left out."""
    out = {}
    for label, rs in lines(rows).items():
        # the held-out line: the same chain as any engine served it, SGLang's last (kept: the
        # engine users serve with); the stable sort keeps each engine's latest run last
        held = rs[-1].get("backend") == HELD_OUT
        fields = MATCH[-3:] if held else MATCH
        key = tuple(rs[-1].get(f) for f in fields)
        be = [s for s in summaries if tuple(s.get(f) for f in fields) == key
              and ok(s.get("break_even_tau"))]
        if held:
            be.sort(key=lambda s: s.get("backend") == "sglang")
        if be:
            out[label] = be[-1]["break_even_tau"]
    return out


def _reference(rs: list[dict]) -> dict:
    """The point the advice speaks of: the selected (exported) snapshot, else the latest."""
    return next((r for r in reversed(rs) if r.get("selected")), rs[-1])


def _n(x) -> str:
    """A count in words: 12,345, or 1.2e+13 past a billion."""
    return "?" if x is None else f"{x:,.0f}" if x < 1e9 else f"{x:.1e}"


def _break_even(gap: float, options: list[tuple[float, object, str]], more: str = "") -> str:
    """The sentence on what closes `gap`: "Break-even takes A, or B." over the options (slope
    per doubling, the count now, 'data' or 'steps') whose slope is positive (`more` follows the
    last), then "more WHAT alone does not reach it (...)" for each whose slope is not."""
    up = [_reach(gap, sl, now, what) for sl, now, what in options if ok(sl) and sl > 1e-9]
    flat = [f"more {what} alone does not reach it (the fit's slope is {sl:+.3f} <= 0)"
            for sl, _, what in options if not (ok(sl) and sl > 1e-9)]
    head = f"Break-even takes {', or '.join(up)}{more}" if up else "Break-even is out of reach"
    return head + ("; " + "; ".join(flat) if flat else "") + "."


def _reach(gap: float, slope: float, now, what: str) -> str:
    """"N doublings of WHAT alone (~X WHAT)" to close `gap` at `slope` (> 0) per doubling."""
    k = gap / slope
    if k > MAX_DOUBLINGS:
        return (f"more than {MAX_DOUBLINGS} doublings of {what} alone (a billion times as "
                f"{'many samples' if what == 'data' else 'many steps'}): out of reach")
    return (f"{k:.1f} doublings of {what} alone (~{_n(now * 2 ** k) if now else '?'} "
            f"{'samples' if what == 'data' else 'steps'})")


def _line_advice(label: str, rs: list[dict], be: float | None) -> str:
    """A few sentences on one line: where its reference point stands against the engine's
    break-even tau, what the next doubling of data and of steps buys, and how many doublings of
    each reach break-even."""
    ref = _reference(rs)
    f = fit(_points(rs))
    S, T, tau = ref.get("train_samples"), ref["snapshot_step"], ref["tau"]
    which = "exported (selected)" if ref.get("selected") else "latest"
    out = [f"{label} ({ref.get('how')}): the {which} drafter (step {_n(T)}, {_n(S)} samples) has "
           f"tau {tau:.2f}"]
    if be is None and ref.get("backend") == HELD_OUT:
        out[0] += "; no bench has measured this chain's break-even tau yet."
    elif be is None:
        out[0] += "; no bench_summary row of this engine and configuration has a break-even tau."
    elif tau >= be:
        out[0] += f", which pays: {tau - be:.2f} above this engine's break-even tau {be:.2f}."
    else:
        out[0] += f", short of this engine's break-even tau {be:.2f} by {be - tau:.2f}."
    gap = None if be is None or tau >= be else be - tau
    if f["kind"] == "data+steps":
        out.append(f"Fit over {f['n']} points: tau = {f['c']:.2f} {f['a']:+.3f} log2(samples) "
                   f"{f['b']:+.3f} log2(steps); doubling the data (to {_n(2 * S)} samples) buys "
                   f"{f['a']:+.3f} tau, doubling the steps (to {_n(2 * T)}) buys {f['b']:+.3f}.")
        if gap is not None:
            out.append(_break_even(gap, [(f["a"], S, "data"), (f["b"], T, "steps")]))
        return " ".join(out)
    if not ok(f["s"]):
        out.append(f"Data and steps were not separable ({f['why']}) and no slope can be fitted: "
                   "bench more snapshots (stages.bench.curve: 3 or more) to learn what more data "
                   "or steps buy.")
        return " ".join(out)
    first_epoch = "first epoch" in f["why"]
    out.append(f"Data and steps were not separable ({f['why']}), so the fit is tau = "
               f"{f['c']:.2f} {f['s']:+.3f} log2(steps): doubling the steps (to {_n(2 * T)}"
               f"{', with the samples they bring' if first_epoch else ''}) buys {f['s']:+.3f}.")
    if gap is not None:
        more = ""
        if first_epoch and f["s"] > 0:
            more = (f", which at {S / T:.0f} samples a step needs "
                    f"~{_n(S * 2 ** (gap / f['s']))} distinct samples")
        out.append(_break_even(gap, [(f["s"], T, "steps")], more))
    return " ".join(out)


def advice(rows: list[dict], break_even: dict[str, float]) -> list[str]:
    """One paragraph per line (`lines`) of curve rows, then the caveat (CAVEAT); [] when no
    rows. break_even: {line label: tau} (`break_evens`)."""
    if not rows:
        return []
    return [_line_advice(k, rs, break_even.get(k)) for k, rs in lines(rows).items()] + [CAVEAT]


def curve_advice(rows: list[dict], summaries: list[dict]) -> list[str]:
    """`advice` with each line's break-even tau looked up in `summaries` (bench_summary rows)."""
    return advice(rows, break_evens(rows, summaries))


def _log2_axis(ax) -> None:
    """A log2 x axis with plain-number tick labels."""
    from matplotlib.ticker import FuncFormatter
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
    ax.tick_params(axis="x", labelsize=7, labelrotation=30)
    ax.grid(True, alpha=0.3)


def plot_curve(rows: list[dict], summaries: list[dict], spec_name: str, path: Path) -> Path | None:
    """Two panels, tau against optimizer steps and against distinct samples (log2 x axes), one
    line per `lines` entry with markers and the selected snapshot ringed, the fit thin, each
    engine's break-even tau dashed in the line's colour ("<backend> break-even x.xx"); the
    advice wrapped below the panels. None when there are no rows."""
    if not rows:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    bes = break_evens(rows, summaries)
    text = "\n".join(textwrap.fill(p, 170) for p in advice(rows, bes))
    n_text = text.count("\n") + 1
    fig = Figure(figsize=(11, 4.6 + 0.15 * n_text), dpi=110)
    FigureCanvasAgg(fig)
    gs = fig.add_gridspec(2, 2, height_ratios=[4.2, 0.15 * n_text + 0.1])
    axes = [fig.add_subplot(gs[0, i]) for i in range(2)]
    fig.suptitle(f"{spec_name}: learning curve ({runs_title(rows)}; dashed: each engine's "
                 "break-even tau, thin: the fit)", fontsize=10)
    for i, (label, rs) in enumerate(lines(rows).items()):
        color, f = f"C{i}", fit(_points(rs))
        pts = [r for r in rs if (r.get("snapshot_step") or 0) > 0]
        for ax, key in zip(axes, ("snapshot_step", "train_samples")):
            ps = [r for r in pts if (r.get(key) or 0) > 0]
            ax.plot([r[key] for r in ps], [r["tau"] for r in ps], "o-", color=color,
                    label=f"{label} ({rs[0].get('how')})")
            sel = [r for r in ps if r.get("selected")]
            ax.plot([r[key] for r in sel], [r["tau"] for r in sel], "o", ms=13, mfc="none",
                    mew=1.6, color=color, label=f"{label} selected (exported)" if sel else None)
            fitted = [(r[key], predict(f, r.get("train_samples"), r["snapshot_step"]))
                      for r in ps if f["kind"] == "steps" or r.get("train_samples")]
            if fitted and all(ok(y) for _, y in fitted):
                ax.plot(*zip(*fitted), "-", lw=0.8, alpha=0.7, color=color)
            if label in bes:
                ax.axhline(bes[label], color=color, ls="--", lw=1.2,
                           label=f"{label} break-even {bes[label]:.2f}")
    for ax, title, xlabel in zip(axes, ("tau vs optimizer steps", "tau vs distinct samples"),
                                 ("optimizer steps (log2)", "distinct training samples (log2)")):
        _log2_axis(ax)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("tau = tokens per verify pass (incl. bonus)")
        ax.margins(y=0.12)
    if not any(r.get("train_samples") for r in rows):
        axes[1].text(0.5, 0.5, "these rows do not say how many\nsamples they had seen", ha="center",
                     va="center", fontsize=9, transform=axes[1].transAxes)
    legend(axes[1])  # both panels have the same lines
    tx = fig.add_subplot(gs[1, :])
    tx.axis("off")
    tx.text(0.0, 1.0, text, va="top", ha="left", fontsize=7.5, transform=tx.transAxes)
    return save_png(fig, path)
