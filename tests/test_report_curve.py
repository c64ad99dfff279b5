"""`runner report`'s learning curve (runner/report_curve.py): tau of the kept drafters against
steps and samples, each engine's break-even tau, the fit and what more data or steps would buy.

Rows go in the way the bench stage writes them (Store.emit + ingest) into a temporary DuckDB; the
curve is synthetic: tau = 1.2 + 0.12*log2(samples/1000) + 0.05*log2(steps/10), 8,192 training
samples at 16 a step (one epoch = 512 steps), snapshots over four epochs."""

import math
import re
import subprocess
import sys

import pytest
from test_report import ROOT, assert_png, make_spec, summary_row

from eagle3_runner.runner import report, report_curve
from eagle3_runner.runner.report_curve import (advice, curve_advice, curve_rows, fit, plot_curve,
                                               predict)
from eagle3_runner.runner.store import Store

A, B, N, BATCH = 0.12, 0.05, 8192, 16
C = 1.2 - A * math.log2(1000) - B * math.log2(10)
STEPS = (64, 128, 256, 512, 1024, 1536, 2048)  # the first four in the first epoch
BREAK_EVEN = {"embedded": 1.5, "sglang": 2.5}
OFFSET = {"embedded": 0.0, "sglang": -0.03}  # SGLang measures a little below the simulation


def tau_at(steps, offset=0.0):
    samples = min(N, steps * BATCH)
    return 1.2 + A * math.log2(samples / 1000) + B * math.log2(steps / 10) + offset


def curve_row(run_id, backend, steps, offset=0.0, selected=False):
    return dict(run_id=run_id, variant="base", backend=backend,
                how="simulated" if backend == "embedded" else "measured", prompt_set="mtbench",
                num_steps=3, eagle_topk=1, num_draft_tokens=4, cuda_graph=False,
                max_new_tokens=64, temperature=0.0, snapshot_step=steps,
                train_samples=min(N, steps * BATCH), train_tokens=steps * BATCH * 300,
                selected=selected, n_prompts=6, rounds=900, tau=tau_at(steps, offset),
                accept_per_pos="[]", heldout_tau=tau_at(steps) + 0.05)


def fill_curve(db, steps=STEPS):
    """Two runs of spec "rep": an old one (a curve far off, which must not be drawn) and the new
    one, each engine's curve with bench_summary rows carrying its break-even tau."""
    store = Store(db)
    for run_id, started in (("old", "2025-01-01 10:00:00"), ("new", "2025-01-02 10:00:00")):
        store.emit("runs", dict(run_id=run_id, spec_name="rep", started_at=started,
                                status="done"))
    summaries, curve = [], []
    for be in BREAK_EVEN:
        summaries.append({**summary_row("new", "base", 3, N, tau_at(steps[-1], OFFSET[be]), 50.0),
                          "backend": be, "break_even_tau": BREAK_EVEN[be]})
        curve += [curve_row("new", be, s, OFFSET[be], s == steps[-1]) for s in steps]
    curve.append(curve_row("old", "embedded", 64, offset=5.0))
    store.emit("bench_summary", summaries)
    store.emit("bench_curve", curve)
    store.ingest()
    return store


def numbers(text):
    return [float(x.replace(",", "")) for x in re.findall(r"~([\d,.e+]+) ", text)]


def test_fit_recovers_the_coefficients_and_falls_back_when_collinear():
    pts = [(min(N, s * BATCH), s, tau_at(s)) for s in STEPS]
    f = fit(pts)
    assert f["kind"] == "data+steps" and f["n"] == 7
    assert f["a"] == pytest.approx(A, abs=1e-9) and f["b"] == pytest.approx(B, abs=1e-9)
    assert f["c"] == pytest.approx(C, abs=1e-9)
    assert predict(f, N, 4096) == pytest.approx(tau_at(4096), abs=1e-9)
    # the first epoch only: samples = 16 x steps, so only their sum of slopes is known
    first = fit(pts[:4])
    assert first["kind"] == "steps" and "first epoch" in first["why"]
    assert first["s"] == pytest.approx(A + B, abs=1e-9)
    # past the first epoch only: samples constant, the steps slope alone
    late = fit(pts[3:])
    assert late["kind"] == "steps" and "same samples" in late["why"]
    assert late["s"] == pytest.approx(B, abs=1e-9)
    two = fit(pts[3:5])
    assert two["kind"] == "steps" and "2 points" in two["why"]


def test_advice_names_the_doublings_and_the_samples_to_break_even(tmp_path):
    spec = make_spec(tmp_path)
    fill_curve(tmp_path / "r.duckdb")
    rows = curve_rows(spec)
    assert {r["run_id"] for r in rows} == {"new"} and len(rows) == 2 * len(STEPS)
    text = curve_advice(rows, report.bench_rows(spec))
    assert len(text) == 3 and text[-1] == report_curve.CAVEAT
    assert "high learning rate" in text[-1] and "extrapolates" in text[-1]
    emb, sgl = text[0], text[1]
    assert emb.startswith("embedded (simulated): the exported (selected) drafter (step 2,048, "
                          "8,192 samples) has tau 1.95, which pays: 0.45 above")
    assert "Break-even takes" not in emb
    ref = tau_at(2048, OFFSET["sglang"])
    gap = BREAK_EVEN["sglang"] - ref
    assert sgl.startswith("sglang (measured): the exported (selected) drafter (step 2,048, "
                          f"8,192 samples) has tau {ref:.2f}, short of this engine's break-even "
                          f"tau 2.50 by {gap:.2f}.")
    assert "doubling the data (to 16,384 samples) buys +0.120 tau" in sgl
    assert "doubling the steps (to 4,096) buys +0.050" in sgl
    assert f"{gap / A:.1f} doublings of data alone" in sgl
    assert f"{gap / B:.1f} doublings of steps alone" in sgl
    samples, steps = numbers(sgl)
    assert samples == pytest.approx(N * 2 ** (gap / A), rel=1e-3)
    assert steps == pytest.approx(2048 * 2 ** (gap / B), rel=1e-3)
    # no break-even known for the engine: said so, no doublings
    alone = advice(rows, {})
    assert "no bench_summary row" in alone[1] and "Break-even takes" not in alone[1]


def test_a_flat_or_falling_fit_does_not_reach_break_even():
    """More steps that lower tau (over-fitting) never reach break-even; data that adds next to
    nothing would take more than 30 doublings: out of reach, not a number of samples."""
    def rows(a, b):
        return [{**r, "tau": 1.2 + a * math.log2(r["train_samples"]) + b * math.log2(s)}
                for s in STEPS for r in [curve_row("a", "sglang", s)]]
    text = advice(rows(0.12, -0.02), {"sglang": 3.0})[0]
    assert "more steps alone does not reach it (the fit's slope is -0.020 <= 0)" in text
    assert re.search(r"[\d.]+ doublings of data alone \(~[\d,]+ samples\)", text)
    text = advice(rows(0.0, -0.01), {"sglang": 3.0})[0]
    assert "more data alone does not reach it" in text and "more steps alone does not" in text
    text = advice(rows(1e-4, 0.0), {"sglang": 3.0})[0]
    assert "more than 30 doublings of data alone (a billion times as many samples): out of " \
        "reach" in text


def test_first_epoch_only_says_data_and_steps_were_not_separable(tmp_path):
    spec = make_spec(tmp_path)
    fill_curve(tmp_path / "r.duckdb", steps=STEPS[:4])
    text = curve_advice(curve_rows(spec), report.bench_rows(spec))[1]
    assert "Data and steps were not separable (every point is in the first epoch" in text
    assert "doubling the steps (to 1,024, with the samples they bring) buys +0.170" in text
    gap = BREAK_EVEN["sglang"] - tau_at(512, OFFSET["sglang"])
    assert f"{gap / (A + B):.1f} doublings of steps alone" in text
    steps, samples = numbers(text)
    assert steps == pytest.approx(512 * 2 ** (gap / (A + B)), rel=1e-3)
    assert samples == pytest.approx(steps * BATCH, rel=1e-3) and "at 16 samples a step" in text
    assert "doublings of data" not in text
    # a single snapshot: no slope at all, and the advice says how to get one
    one = advice([curve_row("new", "sglang", 64)], {"sglang": 2.5})[0]
    assert "not separable (1 point" in one and "no slope can be fitted" in one
    assert "stages.bench.curve" in one and "nan" not in one


def test_plot_is_written_atomically_with_everything_inside(tmp_path, monkeypatch):
    spec = make_spec(tmp_path)
    fill_curve(tmp_path / "r.duckdb")
    from eagle3_runner.runner import report_curve
    figs, save = [], report_curve.save_png
    monkeypatch.setattr(report_curve, "save_png",
                        lambda fig, path: figs.append(fig) or save(fig, path))
    out = tmp_path / "out"
    p = plot_curve(curve_rows(spec), report.bench_rows(spec), "rep", out / "rep_curve.png")
    assert p == out / "rep_curve.png"
    assert_png(p)
    assert [q.name for q in out.iterdir()] == ["rep_curve.png"]  # no temp file left
    (fig,) = figs
    steps_ax, samples_ax = fig.axes[:2]
    assert steps_ax.get_xscale() == samples_ax.get_xscale() == "log"
    assert "learning curve" in fig.get_suptitle()
    for ax in (steps_ax, samples_ax):
        by_label = {ln.get_label(): ln for ln in ax.lines}
        for be, tau in BREAK_EVEN.items():
            dash = by_label[f"{be} break-even {tau:.2f}"]
            assert dash.get_linestyle() == "--" and list(dash.get_ydata()) == [tau, tau]
            how = "simulated" if be == "embedded" else "measured"
            assert dash.get_color() == by_label[f"{be} ({how})"].get_color()
            ring = by_label[f"{be} selected (exported)"]
            assert list(ring.get_xdata()) == [2048 if ax is steps_ax else N]
        lo, hi = ax.get_ylim()
        assert lo < 1.3 and hi > 2.5  # the break-even lines are in view
    advice_text = "".join(t.get_text() for t in fig.axes[2].texts)
    assert "doublings of data alone" in advice_text and "high learning rate" in advice_text
    r, box = fig.canvas.get_renderer(), fig.bbox
    texts = list(fig.texts) + [fig._suptitle]
    for ax in fig.axes:
        texts += [ax.title, ax.xaxis.label, ax.yaxis.label, *ax.texts]
        if ax.get_legend():
            texts += list(ax.get_legend().get_texts())
    for t in texts:
        if t.get_visible() and t.get_text().strip():
            e = t.get_window_extent(r)
            assert box.x0 - 1 <= e.x0 and e.x1 <= box.x1 + 1 and box.y0 - 1 <= e.y0 \
                and e.y1 <= box.y1 + 1, (t.get_text()[:60], e, box)


def test_no_curve_rows_no_plot_and_no_error(tmp_path, capsys):
    spec = make_spec(tmp_path)
    assert curve_rows(spec) == []  # no results file at all
    store = Store(tmp_path / "r.duckdb")
    store.emit("runs", dict(run_id="a", spec_name="rep", started_at="2025-01-01 10:00:00"))
    store.emit("bench_summary", summary_row("a", "base", 3, 64, 2.0, 50.0))
    store.ingest()
    assert curve_rows(spec) == [] and advice([], {}) == []
    assert plot_curve([], [], "rep", tmp_path / "x.png") is None
    assert not (tmp_path / "x.png").exists()
    assert report.report_cli(spec, tmp_path / "out") == 0
    cap = capsys.readouterr()
    assert "skipped curve: no bench_curve rows" in cap.err
    assert not (tmp_path / "out" / "rep_curve.png").exists()
    assert all(line.endswith(".png") for line in cap.out.split())  # paths only, no advice


def test_runner_report_cli_draws_the_curve_and_prints_the_advice(tmp_path):
    import yaml
    spec = make_spec(tmp_path)
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    fill_curve(tmp_path / "r.duckdb")
    r = subprocess.run([sys.executable, "-m", "eagle3_runner.runner", "report",
                        str(tmp_path / "spec.yaml"), "--out", str(tmp_path / "o")],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    assert str(tmp_path / "o" / "rep_curve.png") in out
    assert_png(tmp_path / "o" / "rep_curve.png")
    assert any(x.startswith("sglang (measured): ") and "doublings of data alone" in x
               for x in out)
    assert out[-1] == report_curve.CAVEAT
    assert "skipped curve" not in r.stderr
