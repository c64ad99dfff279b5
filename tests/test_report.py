"""`runner report`: PNG plots from synthetic bench rows in a temporary DuckDB (no model, no GPU).

Rows go in the way the bench stage writes them (Store.emit + ingest); the spec declares the target
geometry and points at a model file that does not exist, so nothing is read from disk."""

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3_runner.runner.errors import ReportError
from eagle3_runner.runner.report import bench_rows, latest_per_config, report_cli
from eagle3_runner.runner.spec.load import load_spec
from eagle3_runner.runner.store import Store

ROOT = Path(__file__).resolve().parent.parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def make_spec(tmp: Path, name: str = "rep"):
    return load_spec(data={
        "name": name, "work_dir": str(tmp / "work"),
        "target": {"path": str(tmp / "no-model.gguf"), "num_hidden_layers": 30,
                   "hidden_size": 576, "vocab_size": 49152},
        "drafter": {"aux_layer_ids": [1, 14, 26], "draft_vocab_size": 4096},
        "data": {"source": "sharegpt", "max_samples": 64},
        "stages": {"bench": {"configs": [{"num_steps": 3}, {"num_steps": 5}]}},
        "results": {"path": str(tmp / "r.duckdb")},
        "variants": [{"name": "n16", "overrides": {"data.max_samples": 16}}],
    })


def summary_row(run_id, variant, steps, samples, tau, spec_tok_s, prompt_set="mtbench"):
    # acceptance falls with depth and sums to tau - 1 (engine/speculative.py convention)
    per_pos = [(tau - 1) * (0.6 ** j) for j in range(steps)]
    s = sum(per_pos)
    per_pos = [p * (tau - 1) / s for p in per_pos]
    return dict(run_id=run_id, variant=variant, config_id=f"s{steps}", backend="embedded",
                prompt_set=prompt_set, num_steps=steps, eagle_topk=1, num_draft_tokens=steps + 1,
                cuda_graph=False, max_new_tokens=64, temperature=0.0, train_samples=samples,
                n_prompts=6, tau=tau, mean_accepted=tau - 1, accept_rate=tau / (steps + 1),
                accept_per_pos=json.dumps(per_pos), spec_tok_s=spec_tok_s, base_tok_s=40.0,
                speedup=spec_tok_s / 40.0)


def fill(db: Path, spec_name: str = "rep") -> Store:
    store = Store(db)
    for run_id, started in (("old", "2025-01-01 10:00:00"), ("new", "2025-01-02 10:00:00")):
        store.emit("runs", dict(run_id=run_id, spec_name=spec_name, started_at=started,
                                status="done"))
    store.emit("runs", dict(run_id="other", spec_name="someone-else",
                            started_at="2025-01-03 10:00:00", status="done"))
    rows = []
    for steps in (3, 5):
        # the old run: base trained on 64 samples, variant n16 on 16; the new run reruns base only
        rows += [summary_row("old", "base", steps, 64, 1.9, 50.0),
                 summary_row("old", "n16", steps, 16, 1.4, 38.0),
                 summary_row("new", "base", steps, 64, 2.2 + 0.1 * steps, 55.0 + steps)]
        rows.append(summary_row("other", "base", steps, 999, 9.0, 1.0))  # another spec
    store.emit("bench_summary", rows)
    store.emit("bench", [dict(run_id="new", variant="base", config_id="s3", prompt_id="0",
                              num_steps=3, tau=2.5)])
    store.ingest()
    return store


def assert_png(p: Path) -> tuple[int, int]:
    data = p.read_bytes()
    assert data[:8] == PNG_MAGIC, p
    assert data[12:16] == b"IHDR" and data.endswith(b"IEND\xaeB`\x82"), p
    w, h = struct.unpack(">II", data[16:24])
    assert w > 100 and h > 100
    from matplotlib.image import imread  # full decode: a truncated or corrupt file fails here
    img = imread(p)
    assert img.shape[:2] == (h, w) and img.std() > 0  # not a blank canvas
    return w, h


def test_row_selection(tmp_path):
    spec = make_spec(tmp_path)
    fill(tmp_path / "r.duckdb")
    rows = bench_rows(spec)
    assert {r["run_id"] for r in rows} == {"old", "new"}  # not the other spec's run
    latest = latest_per_config(rows)
    # base's newest row replaces the old run's; n16 only exists in the old run
    got = sorted((r["variant"], r["num_steps"], r["run_id"], r["train_samples"]) for r in latest)
    assert got == [("base", 3, "new", 64), ("base", 5, "new", 64),
                   ("n16", 3, "old", 16), ("n16", 5, "old", 16)]


def test_report_writes_five_pngs(tmp_path, capsys):
    spec = make_spec(tmp_path)
    fill(tmp_path / "r.duckdb")
    out = tmp_path / "reports"
    assert report_cli(spec, out) == 0
    printed = capsys.readouterr().out.split()
    names = {f"rep_{n}.png" for n in ("tau_vs_samples", "accept_per_pos", "tok_s", "configs",
                                       "variants")}
    assert {Path(p).name for p in printed} == names
    for n in names:
        assert str(out / n) in printed
        assert_png(out / n)
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temp files left
    # rerun overwrites in place
    before = (out / "rep_tok_s.png").stat().st_mtime_ns
    assert report_cli(spec, out) == 0
    assert (out / "rep_tok_s.png").stat().st_mtime_ns >= before
    assert sorted(p.name for p in out.iterdir()) == sorted(names)


def test_chains_and_trees_side_by_side(tmp_path, capsys):
    """Chains and trees of one run: every plot names the shape ("chain K", "tree K/k/N"), the
    tok/s plot keeps all chains on one line and gives each tree shape its own, and the configs
    plot has one bar per configuration."""
    from eagle3_runner.runner import report
    spec = make_spec(tmp_path)
    store = Store(tmp_path / "r.duckdb")
    store.emit("runs", dict(run_id="a", spec_name="rep", started_at="2025-01-01 10:00:00"))
    rows = [summary_row("a", "base", 3, 64, 1.6, 50.0), summary_row("a", "base", 5, 64, 1.7, 48.0)]
    for K, k, N, tau in ((5, 4, 8, 2.1), (3, 4, 16, 2.3)):
        rows.append({**summary_row("a", "base", K, 64, tau, 60.0), "eagle_topk": k,
                     "num_draft_tokens": N, "config_id": f"s{K}-k{k}-n{N}", "kernels": "triton",
                     "break_even_tau": 1.4})
    for r in rows[:2]:
        r["kernels"] = "triton"
    store.emit("bench_summary", rows)
    got = latest_per_config(bench_rows(spec))
    assert len(got) == 4
    assert list(report.group(got, ("num_steps",), ())) == ["chain 3", "chain 5", "tree 5/4/8",
                                                           "tree 3/4/16"]
    view = [r if r["eagle_topk"] > 1 else {**r, "num_draft_tokens": None} for r in got]
    lines = report.group(view, (), ("num_steps",))
    assert {k: len(v) for k, v in lines.items()} == {"chain": 2, "tree topk=4 ndt=8": 1,
                                                     "tree topk=4 ndt=16": 1}
    assert report_cli(spec, tmp_path / "out") == 0
    assert_png(tmp_path / "out" / "rep_configs.png")


def test_missing_data_skips_a_plot(tmp_path, capsys):
    spec = make_spec(tmp_path)
    store = Store(tmp_path / "r.duckdb")
    store.emit("runs", dict(run_id="a", spec_name="rep", started_at="2025-01-01 10:00:00"))
    row = summary_row("a", "base", 3, 64, 2.0, 50.0)
    row.pop("train_samples")
    store.emit("bench_summary", row)
    assert report_cli(spec, tmp_path / "out") == 0
    cap = capsys.readouterr()
    assert "skipped tau_vs_samples" in cap.err
    assert "skipped variants: fewer than two variants" in cap.err
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "rep_accept_per_pos.png", "rep_configs.png", "rep_tok_s.png"]


def test_one_run_has_no_tau_vs_samples_plot_and_the_labels_say_what_they_are(tmp_path, capsys,
                                                                            monkeypatch):
    """A single run (every row trained on the same samples) gets no one-point tau-vs-samples
    plot, but a note saying what draws it; the configs plot writes "pays at tau X" (the
    break-even tau) and its title says what that is; in a sweep, lines that coincide (chains 3
    and 5 with equal tau) keep distinct hollow markers, so neither hides the other."""
    from eagle3_runner.runner import report
    spec = make_spec(tmp_path)
    store = Store(tmp_path / "r.duckdb")
    store.emit("runs", dict(run_id="a", spec_name="rep", started_at="2025-01-01 10:00:00"))
    store.emit("bench_summary", [{**summary_row("a", "base", k, 54, 1.15, 30.0),
                                  "break_even_tau": 7.56} for k in (3, 5)])
    figs = []
    monkeypatch.setattr(report, "save_png", lambda fig, path: figs.append(fig) or path)
    assert report_cli(spec, tmp_path / "out") == 0
    err = capsys.readouterr().err
    assert "skipped tau_vs_samples" in err and "data-scaling sweep" in err
    texts = [t.get_text() for f in figs for ax in f.axes for t in ax.texts]
    titles = " ".join(ax.get_title() for f in figs for ax in f.axes)
    assert "0.75x\npays at\ntau 7.56" in texts and "break-even tau" in titles
    assert not any(t.startswith("be ") for t in texts)
    # a sweep whose two chains coincide: two lines, two different markers
    rows = [summary_row("a", v, k, n, 1.2 + n / 1000, 30.0) for k in (3, 5)
            for v, n in (("base", 54), ("n16", 16))]
    figs.clear()
    report.plot_tau_vs_samples(rows, "rep", tmp_path / "x.png")
    lines = [ln for ln in figs[0].axes[0].lines if "chain" in ln.get_label()]
    assert len(lines) == 2 and lines[0].get_marker() != lines[1].get_marker()
    assert lines[0].get_markersize() > lines[1].get_markersize()


def test_empty_db_is_a_clear_error(tmp_path, capsys):
    spec = make_spec(tmp_path)
    # no results file at all
    assert report_cli(spec, tmp_path / "out") == 1
    assert "runner apply SPEC" in capsys.readouterr().err
    # a results file whose bench tables are empty (only another spec's rows)
    fill(tmp_path / "r.duckdb", spec_name="someone-else-too")
    with pytest.raises(ReportError, match="no bench rows yet.*runner apply SPEC. with a bench stage"):
        bench_rows(spec)
    assert report_cli(spec, tmp_path / "out") == 1
    err = capsys.readouterr().err
    assert err.startswith("error: no bench rows yet") and "Traceback" not in err
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


def test_cli_report_command(tmp_path):
    """`runner report SPEC --out DIR` through the real CLI (spec YAML on disk)."""
    import yaml
    spec = make_spec(tmp_path)
    data = spec.model_dump(mode="json")
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(data))
    r = subprocess.run([sys.executable, "-m", "eagle3_runner.runner", "report",
                        str(tmp_path / "spec.yaml"), "--out", str(tmp_path / "o")],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 1 and "no results file" in r.stderr and "Traceback" not in r.stderr
    fill(tmp_path / "r.duckdb")
    r = subprocess.run([sys.executable, "-m", "eagle3_runner.runner", "report",
                        str(tmp_path / "spec.yaml"), "--out", str(tmp_path / "o")],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.split()) == 5


def test_import_needs_no_matplotlib_or_torch():
    code = ("import sys, runner.report; bad = [m for m in ('matplotlib', 'torch') if m in "
            "sys.modules]; assert not bad, bad")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr


def test_out_in_the_way_is_a_clear_error(tmp_path, capsys):
    spec = make_spec(tmp_path)
    fill(tmp_path / "r.duckdb")
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    for out in (blocker, blocker / "sub"):
        assert report_cli(spec, out) == 1
        err = capsys.readouterr().err
        assert err.startswith("error: --out") and "file is in the way" in err, err
    assert blocker.read_text() == "x"


def test_variants_plot_of_a_recipe_sweep(tmp_path, monkeypatch):
    """A sweep at fixed data (every variant trained on the same samples, so tau_vs_samples has
    one x): one panel per prompt set x config, bars sorted by tau, each labelled with its
    difference to base's tau."""
    from eagle3_runner.runner import report
    spec = make_spec(tmp_path)
    store = Store(tmp_path / "r.duckdb")
    store.emit("runs", dict(run_id="a", spec_name="rep", started_at="2025-01-01 10:00:00"))
    taus = {"base": 1.62, "ep2": 1.70, "lk_lambda": 1.66, "v16k": 1.58, "specforge": 1.55}
    store.emit("bench_summary", [summary_row("a", v, 4, 8000, t, 50.0) for v, t in taus.items()]
               + [summary_row("a", v, 4, 8000, t + 0.2, 50.0, "humaneval")
                  for v, t in taus.items()])
    seen = []
    orig = report.save_png
    monkeypatch.setattr(report, "save_png", lambda fig, path: seen.append(fig) or orig(fig, path))
    assert report_cli(spec, tmp_path / "out") == 0
    assert_png(tmp_path / "out" / "rep_variants.png")
    fig = next(f for f in seen if "per variant" in f.get_suptitle())
    axes = fig.get_axes()
    assert [a.get_title() for a in axes] == ["mtbench", "humaneval"]
    labels = [t.get_text() for t in axes[0].get_yticklabels()]
    assert labels == sorted(taus, key=taus.get)  # highest tau on top
    notes = [t.get_text() for t in axes[0].texts]
    assert "1.700 (+0.080)" in notes and "1.620" in notes and "1.550 (-0.070)" in notes


def test_report_goes_to_the_work_dir_by_default(tmp_path, monkeypatch, capsys):
    """Without --out the plots go to the spec's work_dir/reports, not into the folder the user
    stands in (the repository, in the first-hour trial of 2026-12-04)."""
    spec = make_spec(tmp_path)
    fill(tmp_path / "r.duckdb")
    here = tmp_path / "cwd"
    here.mkdir()
    monkeypatch.chdir(here)
    assert report_cli(spec) == 0
    printed = capsys.readouterr().out.split()
    assert printed and all(Path(p).parent == spec.resolved_work_dir() / "reports" for p in printed)
    assert not list(here.iterdir())


def test_no_text_runs_off_a_plot(tmp_path, monkeypatch):
    """Every title, label and note of the five plots lies inside its PNG (the configs plot's
    right-hand title was clipped in the first-hour trial of 2026-12-04)."""
    from eagle3_runner.runner import report
    figs, save = [], report.save_png
    monkeypatch.setattr(report, "save_png", lambda fig, path: figs.append(fig) or save(fig, path))
    fill(tmp_path / "r.duckdb")
    report.write_report(make_spec(tmp_path), tmp_path / "out")
    assert len(figs) == 5
    for fig in figs:
        r = fig.canvas.get_renderer()
        box = fig.bbox
        texts = list(fig.texts) + ([fig._suptitle] if fig._suptitle else [])
        for ax in fig.axes:  # titles, axis labels, notes (tick labels are matplotlib's to place)
            texts += [ax.title, ax._left_title, ax._right_title, ax.xaxis.label, ax.yaxis.label,
                      *ax.texts]
        for t in texts:
            if t.get_visible() and t.get_text().strip():
                e = t.get_window_extent(r)
                assert box.x0 - 1 <= e.x0 and e.x1 <= box.x1 + 1 and e.y1 <= box.y1 + 1, \
                    (t.get_text()[:60], e, box)
