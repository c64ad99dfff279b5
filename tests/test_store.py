"""Results store: spool + single-writer ingest into DuckDB; read-only queries; `runner results`.

DuckDB allows one writer process at a time; jobs only ever write spool files, so any number of
parallel writers (and parallel ingesters) lose no rows and duplicate none."""

import csv
import io
import json
import multiprocessing as mp
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3_runner.runner.errors import StoreError
from eagle3_runner.runner.store import SCHEMA, Store

ROOT = Path(__file__).resolve().parent.parent


def _writer(db: str, proc: int, n: int) -> None:
    store = Store(db)
    for i in range(n):
        store.metric("run-a", "base", "train", f"p{proc}", float(i), "x", step=i)
        if i % 10 == 9:  # writers also ingest now and then, racing each other
            store.ingest()


def test_parallel_writers_lose_no_rows(tmp_path):
    db = str(tmp_path / "r.duckdb")
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(db, p, 50)) for p in range(8)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    store = Store(db)
    store.ingest()
    _, rows = store.query("SELECT count(*), count(DISTINCT (name, step)) FROM metrics")
    assert rows == [(400, 400)]
    _, rows = store.query("SELECT name, count(*), sum(value) FROM metrics GROUP BY 1 ORDER BY 1")
    assert rows == [(f"p{p}", 50, float(sum(range(50)))) for p in range(8)]
    assert not list(store.spool.glob("*.json"))


def test_ingest_is_idempotent_after_crash_between_commit_and_unlink(tmp_path):
    store = Store(tmp_path / "r.duckdb")
    store.emit("metrics", [dict(run_id="r", variant="base", stage="s", name="a", value=1.0)])
    (f,) = store.spool.glob("*.json")
    saved = f.read_bytes()
    assert store.ingest() == 1
    # simulate a crash after COMMIT but before the unlink: the batch file is still there
    f.write_bytes(saved)
    assert store.ingest() == 0
    assert not f.exists()
    _, rows = store.query("SELECT count(*) FROM metrics")
    assert rows == [(1,)]
    _, rows = store.query("SELECT file FROM _ingested")
    assert rows == [(f.name,)]


def test_half_written_spool_file_is_never_ingested(tmp_path):
    store = Store(tmp_path / "r.duckdb")
    store.spool.mkdir(parents=True)
    # a writer killed mid-write leaves only its dot-temp file; ingest ignores it
    (store.spool / ".x.json.tmp").write_text('{"table": "metrics", "rows": [{"run_')
    assert store.ingest() == 0
    _, rows = store.query("SELECT count(*) FROM metrics")
    assert rows == [(0,)]


def test_bad_batch_is_set_aside_and_does_not_block_others(tmp_path, capsys):
    store = Store(tmp_path / "r.duckdb")
    store.emit("metrics", dict(run_id="r", variant="base", stage="s", name="ok1", value=1.0))
    store.emit("metrics", dict(run_id="r", variant="base", stage="s", name="bad", valeu=2.0))
    store.emit("metrics", dict(run_id="r", variant="base", stage="s", name="ok2", value=3.0))
    assert store.ingest() == 2
    _, rows = store.query("SELECT name FROM metrics ORDER BY name")
    assert rows == [("ok1",), ("ok2",)]  # the bad batch left no partial rows
    rejected = list((store.spool / "rejected").glob("*.json"))
    assert len(rejected) == 1 and "valeu" in rejected[0].read_text()
    assert "rejected" in capsys.readouterr().err
    with pytest.raises(StoreError):
        store.emit("no_such_table", {"a": 1})


def test_runs_row_latest_status_wins(tmp_path):
    store = Store(tmp_path / "r.duckdb")
    row = dict(run_id="r1", spec_name="s", started_at="2024-01-01 00:00:00")
    store.emit("runs", {**row, "status": "running"})
    store.emit("runs", {**row, "status": "done", "finished_at": "2024-01-01 00:01:00"})
    _, rows = store.query("SELECT run_id, status FROM runs")
    assert rows == [("r1", "done")]


def test_schema_tables_exist(tmp_path):
    store = Store(tmp_path / "r.duckdb")
    store.ingest()
    _, rows = store.query("SELECT table_name FROM information_schema.tables")
    assert set(SCHEMA) <= {r[0] for r in rows}
    _, cols = store.query("SELECT column_name FROM information_schema.columns "
                          "WHERE table_name = 'stages'")
    names = {c[0] for c in cols}
    assert {"started_at", "finished_at", "status", "host", "job_id", "duration_s"} <= names


def test_a_results_file_of_an_older_schema_gains_the_new_columns(tmp_path):
    """A bench table made before the `kernels` column: ingest adds it, old rows read NULL and a
    new row with the column lands (it would otherwise be rejected)."""
    import duckdb
    db = tmp_path / "r.duckdb"
    con = duckdb.connect(str(db))
    con.execute("CREATE TABLE bench (run_id VARCHAR, tau DOUBLE)")
    con.execute("INSERT INTO bench VALUES ('old', 1.5)")
    con.close()
    store = Store(db)
    store.emit("bench", dict(run_id="new", tau=2.0, kernels="triton"))
    assert store.ingest() == 1
    _, rows = store.query("SELECT run_id, kernels FROM bench ORDER BY run_id")
    assert rows == [("new", "triton"), ("old", None)]


# -- runner query / results (CLI, in a subprocess: exit codes and stderr are part of the contract)


def runner(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "eagle3_runner.runner.cli", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture
def filled_db(tmp_path):
    db = tmp_path / "r.duckdb"
    store = Store(db)
    store.emit("runs", dict(run_id="run1", spec_name="s", started_at="2024-01-01 00:00:00",
                            status="done"))
    for name, value, unit in [("loss", 2.5, ""), ("tau", 2.25, "tokens"), ("acc", 0.5, "")]:
        store.metric("run1", "base", "train", name, value, unit)
    store.metric("run1", "base", "train", "loss", 9.0, "", step=3)  # a step row: not a summary
    store.emit("bench_summary", dict(run_id="run1", variant="base", config_id="c0",
                                     backend="embedded", prompt_set="mtbench", num_steps=3,
                                     eagle_topk=1, num_draft_tokens=4, max_new_tokens=64,
                                     tau=2.25, accept_rate=0.4, spec_tok_s=10.0, base_tok_s=8.0,
                                     speedup=1.25, flags=""))
    store.ingest()
    return db


@pytest.mark.parametrize("sql", ["DELETE FROM metrics", "INSERT INTO metrics (name) VALUES ('x')",
                                 "DROP TABLE runs", "UPDATE metrics SET value = 0",
                                 "CREATE TABLE x (a INT)"])
def test_query_is_read_only(filled_db, sql):
    r = runner("query", sql, "--results", str(filled_db))
    assert r.returncode == 1, r
    assert r.stderr.startswith("error:") and "read-only" in r.stderr
    assert "Traceback" not in r.stderr
    _, rows = Store(filled_db).query("SELECT count(*) FROM metrics")
    assert rows == [(4,)]


def test_query_of_an_unknown_table_lists_the_tables(filled_db):
    r = runner("query", "SELECT * FROM bench_sumary", "--results", str(filled_db))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.startswith("error:") and "bench_sumary" in r.stderr
    assert "Tables and views here:" in r.stderr and "bench_summary" in r.stderr


def test_query_output_shapes(filled_db):
    sql = "SELECT name, value, unit FROM metrics WHERE step IS NULL ORDER BY name"
    r = runner("query", sql, "--results", str(filled_db), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == [{"name": "acc", "value": 0.5, "unit": ""},
                                    {"name": "loss", "value": 2.5, "unit": ""},
                                    {"name": "tau", "value": 2.25, "unit": "tokens"}]
    r = runner("query", sql, "--results", str(filled_db), "--csv")
    assert r.returncode == 0
    assert list(csv.reader(io.StringIO(r.stdout))) == [
        ["name", "value", "unit"], ["acc", "0.5", ""], ["loss", "2.5", ""], ["tau", "2.25", "tokens"]]
    r = runner("query", sql, "--results", str(filled_db))
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["name", "value", "unit"] and set(lines[1]) <= {"-", " "}
    assert len(lines) == 5
    r = runner("query", "SELEC nonsense", "--results", str(filled_db))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    r = runner("query", "SELECT 1", "--results", str(filled_db), "--json", "--csv")
    assert r.returncode == 2  # argparse: mutually exclusive


def test_query_without_db_is_a_clean_error(tmp_path):
    r = runner("query", "SELECT 1", "--results", str(tmp_path / "none.duckdb"))
    assert r.returncode == 1 and "runner apply" in r.stderr and "Traceback" not in r.stderr
    r = runner("results", "--results", str(tmp_path / "none.duckdb"))
    assert r.returncode == 1 and "Traceback" not in r.stderr


def test_results_latest_summary_metrics(filled_db):
    r = runner("results", "--results", str(filled_db), "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    got = {(m["stage"], m["name"]): m["value"] for m in out["metrics"]}
    assert got == {("train", "acc"): 0.5, ("train", "loss"): 2.5, ("train", "tau"): 2.25}
    assert out["bench"][0]["tau"] == 2.25 and out["bench"][0]["speedup"] == 1.25
    # the step rows come as the run's history, one dict per step; summaries stay out of it
    assert out["history"] == [dict(run_id="run1", variant="base", stage="train", step=3,
                                   loss=9.0)]
    # a newer summary value of the same metric replaces the older one
    Store(filled_db).metric("run1", "base", "train", "loss", 1.5, "")
    out = json.loads(runner("results", "--results", str(filled_db), "--json").stdout)
    assert {m["name"]: m["value"] for m in out["metrics"]}["loss"] == 1.5
    r = runner("results", "--results", str(filled_db))
    assert r.returncode == 0 and "loss" in r.stdout and "mtbench" in r.stdout


def test_the_bench_tables_of_apply_and_the_demo_use_bench_summary_names(filled_db):
    """`runner apply`/`results` end with a bench table, and the demo queries the same rows: both
    headers are bench_summary's own column names (no topk/ndt next to eagle_topk/num_draft_tokens
    for the same rows)."""
    from eagle3_runner.runner.results import BENCH_SUMMARY
    names = {c.split()[0] for c in SCHEMA["bench_summary"].split(",")}
    cols, rows = Store(filled_db).query(BENCH_SUMMARY.format(where=""))
    assert rows and set(cols) <= names, set(cols) - names
    demo = (ROOT / "scripts" / "demo.sh").read_text()
    sql = demo[demo.index('runner query "') + len('runner query "'):].split('"')[0]
    qcols, qrows = Store(filled_db).query(sql.replace("'smollm2-sharegpt'", "'s'"))
    assert qrows and set(qcols) <= names, set(qcols) - names
    assert {"num_steps", "eagle_topk", "num_draft_tokens", "tau", "break_even_tau"} <= \
        set(cols) & set(qcols)


@pytest.mark.parametrize("sql,why", [
    ("COPY metrics TO '{out}'", "COPY"), ("SELECT 1; COPY metrics TO '{out}'", "one statement"),
    ("EXPORT DATABASE '{tmp}/exp'", "EXPORT"), ("SELECT * FROM read_csv('{csv}')", "Permission"),
    ("  ", "empty")])
def test_query_never_writes_or_reads_files(filled_db, tmp_path, sql, why):
    out, csv_file = tmp_path / "out.csv", tmp_path / "in.csv"
    csv_file.write_text("a\n1\n")
    r = runner("query", sql.format(out=out, tmp=tmp_path, csv=csv_file), "--results",
               str(filled_db))
    assert r.returncode == 1 and r.stderr.startswith("error:") and why in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert not out.exists() and not (tmp_path / "exp").exists()
    # SHOW / DESCRIBE are SELECTs and stay allowed
    assert runner("query", "DESCRIBE metrics", "--results", str(filled_db)).returncode == 0


def test_results_path_not_a_duckdb_file(tmp_path):
    junk = tmp_path / "junk.duckdb"
    junk.write_text("not a database")
    for path, why in ((junk, "cannot open results file"), (tmp_path, "is a folder")):
        for args in (["query", "SELECT 1"], ["results"], ["status"]):
            r = runner(*args, "--results", str(path))
            assert r.returncode == 1 and why in r.stderr and "Traceback" not in r.stderr, r.stderr
    with pytest.raises(StoreError, match="writable"):  # results under a file: emit refuses
        Store(junk / "r.duckdb").emit("metrics", {"name": "x"})


def test_a_results_file_cut_short_is_named_damaged_by_query_status_and_plan(filled_db, tmp_path):
    """A results file cut short (full disk, interrupted copy) opens in DuckDB and fails only when
    a query reaches a missing page: query, results and status say it is damaged and what to do,
    and the plan refuses it before any stage runs (tests/bad_inputs.py covers the plan)."""
    raw = filled_db.read_bytes()
    cut = tmp_path / "cut.duckdb"
    cut.write_bytes(raw[:len(raw) // 2])
    for args in (["query", "SELECT * FROM bench"], ["results"], ["status"]):
        r = runner(*args, "--results", str(cut))
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        assert "is damaged" in r.stderr and "move it away" in r.stderr, r.stderr
    from eagle3_runner.runner.store import check_readable
    check_readable(filled_db)  # a whole file passes
    with pytest.raises(StoreError, match="damaged"):
        check_readable(cut)


def test_ctrl_c_during_a_query_prints_interrupted(filled_db, monkeypatch, capsys):
    """DuckDB turns SIGINT during execute into RuntimeError('Query interrupted'), noticed when
    it next checks (for some plans only at the end): `runner query` must say 'interrupted' and
    exit 130, not print a traceback. The interrupt is injected into a real connection."""
    import duckdb
    from eagle3_runner.runner.cli import main
    real = duckdb.connect

    class Interrupted:
        def __init__(self, con):
            self.con = con

        def __getattr__(self, k):
            return getattr(self.con, k)

        def execute(self, sql, *a):
            raise RuntimeError("Query interrupted")

    monkeypatch.setattr(duckdb, "connect", lambda *a, **kw: Interrupted(real(*a, **kw))
                        if kw.get("read_only") else real(*a, **kw))
    assert main(["query", "SELECT 1", "--results", str(filled_db)]) == 130
    assert capsys.readouterr().err.strip() == "interrupted"


def test_status_asks_slurm_only_about_slurm_jobs(tmp_path, monkeypatch, capsys):
    """A local stage's job_id is a pid: querying squeue for it cost 10 s with no controller and
    could match an unrelated Slurm job."""
    import eagle3_runner.runner.slurm.probes as probes
    from eagle3_runner.runner.status import status
    db = tmp_path / "r.duckdb"
    s = Store(db)
    s.emit("runs", dict(run_id="r1", spec_name="x", status="done", started_at="2026-01-01 00:00:00"))
    s.emit("stages", [dict(run_id="r1", variant="base", stage="extract", status="done",
                           job_id="4242", executor="local", started_at="2026-01-01 00:00:01"),
                      dict(run_id="r1", variant="base", stage="train", status="done",
                           job_id="17", executor="slurm", started_at="2026-01-01 00:00:02")])
    s.ingest()
    asked = []
    monkeypatch.setattr(probes, "live_states",
                        lambda ids: asked.append(list(ids)) or {"17": "COMPLETED"})
    assert status(db) == 0
    assert asked == [["17"]]
    assert "done (COMPLETED)" in capsys.readouterr().out


def test_a_rerun_that_stored_nothing_shows_the_run_that_did(tmp_path, capsys):
    """`runner apply` of a spec whose stages are all up to date makes a run with no rows: its
    results table is the newest run of that spec that stored some (it printed empty tables)."""
    from eagle3_runner.runner.results import print_results
    db = tmp_path / "r.duckdb"
    store = Store(db)
    for rid, t in (("old", "2026-01-01 00:00:00"), ("new", "2026-01-02 00:00:00")):
        store.emit("runs", dict(run_id=rid, spec_name="s", started_at=t, status="done"))
    store.emit("runs", dict(run_id="other", spec_name="t", started_at="2026-01-03 00:00:00",
                            status="done"))
    store.metric("old", "base", "train", "final_loss", 2.5, "nats")
    store.metric("other", "base", "train", "final_loss", 9.0, "nats")
    store.ingest()
    print_results(db, run_id="new", spec_name="s")
    out, err = capsys.readouterr()
    assert "final_loss" in out and "2.5" in out and "9" not in out.split("final_loss")[1]
    assert "new stored no results" in err and "the results of old" in err
    print_results(db, run_id="old", spec_name="s")  # a run with rows: itself, nothing said
    out, err = capsys.readouterr()
    assert "old" in out and err == ""


# -- reading verbs on a file that is not a results file of this runner


def _tables(db: Path) -> set:
    import duckdb
    con = duckdb.connect(str(db), read_only=True)
    try:
        return {r[0] for r in con.execute("SELECT table_name FROM information_schema.tables")
                .fetchall()}
    finally:
        con.close()


@pytest.mark.parametrize("tables", [["CREATE TABLE t (a INT)", "INSERT INTO t VALUES (1)"], []],
                         ids=["another-programs-db", "empty-db"])
def test_reading_verbs_refuse_a_duckdb_file_that_is_not_a_results_file(tmp_path, tables):
    """`runner query "select 1" --results foreign.duckdb` (and results, status) used to create
    the runner's tables in any DuckDB file (the ingest before the query). Each refuses it,
    naming the file and the fix, and leaves it as it was, with no lock file next to it."""
    import duckdb
    db = tmp_path / "foreign.duckdb"
    con = duckdb.connect(str(db))
    for sql in tables:
        con.execute(sql)
    con.close()
    before, raw = _tables(db), db.read_bytes()
    for args in (["query", "select 1"], ["results"], ["status"]):
        r = runner(*args, "--results", str(db))
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        assert r.stderr.startswith(f"error: {db} is not a results file of this runner (no "
                                   "`runs` table): point --results"), r.stderr
        assert _tables(db) == before and db.read_bytes() == raw
        assert not Store(db).lock_path.exists()
    # runner plan refuses another program's file as results.path; an empty database passes
    # (the first ingest makes it a results file)
    from eagle3_runner.runner.store import check_readable
    if tables:
        with pytest.raises(StoreError, match="not a results file of this runner"):
            check_readable(db)
        assert not Store(db).lock_path.exists()
    else:
        check_readable(db)
    assert _tables(db) == before


def test_an_older_results_file_and_a_waiting_spool_still_work(tmp_path, capsys):
    """A results file of the first version of the runner (runs with its first columns, no
    bench_curve table) still answers the reading verbs, gaining the new tables and columns;
    a spool waiting next to it, or with no file yet, is ingested first."""
    import duckdb
    from eagle3_runner.runner.cli import main
    db = tmp_path / "old.duckdb"
    con = duckdb.connect(str(db))
    con.execute("CREATE TABLE runs (run_id VARCHAR, spec_name VARCHAR, spec_hash VARCHAR, "
                "code_version VARCHAR, host VARCHAR, executor VARCHAR, started_at TIMESTAMP, "
                "finished_at TIMESTAMP, status VARCHAR, spec_json VARCHAR)")
    con.execute("INSERT INTO runs (run_id, spec_name, started_at, status) VALUES "
                "('r0', 's', '2026-01-01 00:00:00', 'done')")
    con.close()
    Store(db).metric("r0", "base", "train", "final_loss", 2.5, "nats")
    assert main(["query", "SELECT count(*) AS n FROM bench_curve", "--results", str(db),
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == [{"n": 0}]
    assert main(["results", "--results", str(db)]) == 0
    assert "final_loss" in capsys.readouterr().out
    assert "pid" in {c[0] for c in Store(db).query("DESCRIBE runs")[1]}
    fresh = tmp_path / "new.duckdb"  # only a spool: status ingests it
    Store(fresh).emit("runs", dict(run_id="r1", spec_name="s", status="done",
                                   started_at="2026-01-01 00:00:00"))
    assert main(["status", "--results", str(fresh)]) == 0
    assert "run r1: done" in capsys.readouterr().out


def test_a_file_refused_by_a_reading_verb_leaves_no_lock_file(tmp_path, filled_db):
    """`runner results` on a garbage, empty or truncated file gives a clear error and leaves no
    `<file>.lock` next to it; next to a real results file the lock file stays."""
    raw = filled_db.read_bytes()
    for name, content, why in (("junk.duckdb", b"not a database", "not a DuckDB file"),
                               ("empty.duckdb", b"", "it is empty"),
                               ("cut.duckdb", raw[:len(raw) // 2], "is damaged")):
        f = tmp_path / name
        f.write_bytes(content)
        for args in (["results"], ["query", "SELECT 1"]):
            r = runner(*args, "--results", str(f))
            assert r.returncode == 1 and why in r.stderr and "Traceback" not in r.stderr, \
                r.stderr
            assert not Store(f).lock_path.exists(), (name, args)
            assert f.read_bytes() == content
    assert runner("results", "--results", str(filled_db)).returncode == 0
    assert Store(filled_db).lock_path.exists()
