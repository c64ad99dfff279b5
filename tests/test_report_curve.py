"""`runner report`'s learning curve (runner/report_curve.py): tau of the kept drafters against
steps and samples, each engine's break-even tau, the fit and what more data or steps would buy.

Rows go in the way the bench stage writes them (Store.emit + ingest) into a temporary DuckDB; the
curve is synthetic: tau = 1.2 + 0.12*log2(samples/1000) + 0.05*log2(steps/10), 8,192 training
samples at 16 a step (one epoch = 512 steps), snapshots over four epochs."""

import json
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
    assert re.search(r"Break-even takes [\d.]+ doublings of data alone \(~[\d,]+ samples\); "
                     r"more steps alone does not reach it", text), text
    text = advice(rows(0.0, -0.01), {"sglang": 3.0})[0]
    assert "Break-even is out of reach; more data alone does not reach it" in text
    assert "more steps alone does not" in text and "Break-even takes" not in text
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


RECORDED = ROOT / "benchmarks" / "2026-12-07-smollm2-pays-gpu-3.json"


def fill_recorded(db, samples: bool = False, summaries=()):
    """The third window of 2026-12-07 as the runner stored it (benchmarks/...-3.json: its stage
    rows and the train stage's step rows, a run cut at step 996 and its resume), under spec
    "rep"; samples: also the `eval_samples` step rows trainer/evaluation.py records since (the
    distinct samples the steps had read: step x 64, one epoch = 83,452)."""
    rec = json.loads(RECORDED.read_text())
    store = Store(db)
    for run_id in dict.fromkeys(s["run_id"] for s in rec["stages"]):
        store.emit("runs", dict(run_id=run_id, spec_name="rep", status="done", started_at=min(
            s["started_at"] for s in rec["stages"] if s["run_id"] == run_id)))
    store.emit("stages", [{k: v for k, v in s.items()} for s in rec["stages"]])
    for h in rec["history"]:
        for name, value in h.items():
            if name.startswith("eval_"):
                store.metric(h["run_id"], "base", "train", name, value, step=h["step"])
        if samples:
            store.metric(h["run_id"], "base", "train", "eval_samples",
                         min(83452, 64 * h["step"]), step=h["step"])
    if summaries:
        store.emit("bench_summary", list(summaries))
    store.ingest()
    return rec


def pays_spec(tmp_path, **train):
    spec = make_spec(tmp_path).model_dump(mode="json")
    spec["stages"]["train"] = {"eval_every": 200, "select": "tau", "select_num_steps": 3,
                               "snapshots": True, "features": "online", **train}
    from eagle3_runner.runner.spec.load import load_spec
    return load_spec(data=spec)


def test_without_a_benched_snapshot_the_curve_is_the_train_stages_evaluations(tmp_path, capsys):
    """No bench_curve rows (stages.bench.curve 0, or no bench yet): the curve is the train
    stage's held-out chain tau of select_num_steps at each evaluated step, from the recorded
    GPU run (a resumed run's re-evaluations win), the exported step selected; `runner report`
    draws it alone and says what more steps buy, with the break-even of the same chain where a
    bench measured one (SGLang's before ours)."""
    from eagle3_runner.runner.report_curve import HELD_OUT, heldout_rows
    spec = pays_spec(tmp_path)
    rec = fill_recorded(tmp_path / "r.duckdb")
    rows = heldout_rows(spec)
    want = {h["step"]: h["eval_chain_tau_3"] for h in rec["history"]}
    assert [r["snapshot_step"] for r in rows] == sorted(want) == [200, 400, 600, 800, 1000, 1017]
    assert [r["tau"] for r in rows] == [want[s] for s in sorted(want)]
    resumed = rec["history"][-1]["run_id"]
    assert {r["snapshot_step"]: r["run_id"] for r in rows}[600] == resumed
    assert [r["snapshot_step"] for r in rows if r["selected"]] == [1000]  # the highest tau
    assert all(r["backend"] == HELD_OUT and r["train_samples"] is None for r in rows)
    assert report.report_cli(spec, tmp_path / "out") == 0
    cap = capsys.readouterr()
    assert_png(tmp_path / "out" / "rep_curve.png")
    line = next(x for x in cap.out.splitlines() if x.startswith("held-out ("))
    assert "(step 1,000, ? samples) has tau 2.23" in line
    assert "no bench has measured this chain's break-even tau yet" in line
    assert "do not say how many samples" in line and "doubling the steps (to 2,000) buys" in line
    assert "skipped configs" in cap.err and "skipped curve" not in cap.err
    # with the samples recorded, and a bench of the same chain by both engines
    db2 = tmp_path / "b" / "r.duckdb"
    db2.parent.mkdir()
    be = [{**summary_row(resumed, "base", 3, 65088, 2.3, 50.0), "backend": b,
           "break_even_tau": t} for b, t in (("sglang", 2.0), ("embedded", 1.7))]
    fill_recorded(db2, samples=True, summaries=be)
    spec2 = pays_spec(tmp_path / "b")
    rows = heldout_rows(spec2)
    assert [r["train_samples"] for r in rows] == [12800, 25600, 38400, 51200, 64000, 65088]
    text = " ".join(curve_advice(rows, be))
    assert "which pays: 0.23 above this engine's break-even tau 2.00" in text
    assert "every point is in the first epoch" in text
    # select: last picks the last step; another train key (a changed spec) starts a new curve
    assert [r["snapshot_step"] for r in heldout_rows(pays_spec(tmp_path, select="last"))
            if r["selected"]] == [1017]
    Store(tmp_path / "r.duckdb").emit("runs", dict(run_id="z", spec_name="rep",
                                                   started_at="2026-12-08 10:00:00"))
    Store(tmp_path / "r.duckdb").emit("stages", dict(run_id="z", variant="base", stage="train",
                                                     cache_key="other", status="running",
                                                     started_at="2026-12-08 10:00:00"))
    Store(tmp_path / "r.duckdb").metric("z", "base", "train", "eval_chain_tau_3", 1.5, step=200)
    Store(tmp_path / "r.duckdb").ingest()
    assert [(r["snapshot_step"], r["tau"]) for r in heldout_rows(spec)] == [(200, 1.5)]
