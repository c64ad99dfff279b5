"""Results store: one DuckDB file, written through a spool so parallel jobs lose no rows.

DuckDB allows one writer process at a time. Jobs (local or Slurm, any number at once) never open
the database: `emit()` writes each batch of rows as one JSON file, atomically (temp + rename),
into `<db>.spool/`. `ingest()` takes an exclusive file lock, inserts every spooled batch in one
transaction together with the batch's file name in `_ingested` (so a crash between commit and
unlink never duplicates rows), then removes the files. The coordinator ingests after each stage;
anyone may ingest at any time.

Schema (README "Results schema"): runs, stages, metrics (long form), bench (per prompt),
bench_summary (per configuration), bench_curve (the learning curve over the train stage's kept
drafters, runner/bench_curve.py); the view bench_parity (VIEWS). One row per run (the latest status wins) and one row per
stage execution: the `running` row a stage writes when it starts is replaced by its outcome.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import json
import os
import socket
import uuid
from contextlib import contextmanager
from pathlib import Path

from eagle3_runner.runner.errors import StoreError
from eagle3_runner.runner.files import atomic_write

SCHEMA = {
    "runs": """run_id VARCHAR, spec_name VARCHAR, spec_hash VARCHAR, code_version VARCHAR,
        host VARCHAR, executor VARCHAR, started_at TIMESTAMP, finished_at TIMESTAMP,
        status VARCHAR, spec_json VARCHAR, pid BIGINT""",
    "stages": """run_id VARCHAR, variant VARCHAR, stage VARCHAR, cache_key VARCHAR, reason VARCHAR,
        status VARCHAR, started_at TIMESTAMP, finished_at TIMESTAMP, duration_s DOUBLE,
        host VARCHAR, job_id VARCHAR, executor VARCHAR, artifact VARCHAR, log_path VARCHAR,
        error VARCHAR""",
    "metrics": """run_id VARCHAR, variant VARCHAR, stage VARCHAR, name VARCHAR, value DOUBLE,
        unit VARCHAR, step BIGINT, ts TIMESTAMP""",
    "bench": """run_id VARCHAR, variant VARCHAR, config_id VARCHAR, backend VARCHAR,
        prompt_set VARCHAR, prompt_id VARCHAR, num_steps INTEGER, eagle_topk INTEGER,
        num_draft_tokens INTEGER, cuda_graph BOOLEAN, max_new_tokens INTEGER, temperature DOUBLE,
        train_samples BIGINT, tau DOUBLE, mean_accepted DOUBLE, accept_rate DOUBLE,
        accept_per_pos VARCHAR, new_tokens BIGINT, verify_ct BIGINT, spec_tok_s DOUBLE,
        base_tok_s DOUBLE, speedup DOUBLE, draft_s DOUBLE, verify_s DOUBLE, other_s DOUBLE,
        lossless BOOLEAN, flags VARCHAR, kernels VARCHAR, diverge_at INTEGER,
        diverge_margin DOUBLE, diverge_runner_up BOOLEAN, server_accept_length DOUBLE,
        ref_same BOOLEAN, ref_diverge_at INTEGER, ref_diverge_margin DOUBLE, cores INTEGER,
        threads INTEGER, other_load DOUBLE, load_1m DOUBLE""",
    "bench_summary": """run_id VARCHAR, variant VARCHAR, config_id VARCHAR, backend VARCHAR,
        prompt_set VARCHAR, num_steps INTEGER, eagle_topk INTEGER, num_draft_tokens INTEGER,
        cuda_graph BOOLEAN, max_new_tokens INTEGER, temperature DOUBLE, train_samples BIGINT,
        n_prompts INTEGER, tau DOUBLE, mean_accepted DOUBLE, accept_rate DOUBLE,
        accept_per_pos VARCHAR, spec_tok_s DOUBLE, base_tok_s DOUBLE, speedup DOUBLE,
        draft_ms_per_round DOUBLE, verify_ms_per_round DOUBLE, other_ms_per_round DOUBLE,
        base_ms_per_token DOUBLE, break_even_tau DOUBLE, lossless BOOLEAN, flags VARCHAR,
        explanation VARCHAR, kernels VARCHAR, lossless_prompts INTEGER,
        server_accept_length DOUBLE, server_version VARCHAR, ref_same_prompts INTEGER,
        ref_max_margin DOUBLE, predicted_speedup DOUBLE, predicted_break_even_tau DOUBLE,
        sim_tau DOUBLE, sim_accept_per_pos VARCHAR, heldout_tau DOUBLE,
        heldout_accept_per_pos VARCHAR, cores INTEGER, threads INTEGER, other_load DOUBLE,
        load_1m DOUBLE""",
    "bench_curve": """run_id VARCHAR, variant VARCHAR, backend VARCHAR, how VARCHAR,
        prompt_set VARCHAR, num_steps INTEGER, eagle_topk INTEGER, num_draft_tokens INTEGER,
        cuda_graph BOOLEAN, max_new_tokens INTEGER, temperature DOUBLE, snapshot_step BIGINT,
        train_samples BIGINT, train_tokens BIGINT, selected BOOLEAN, n_prompts INTEGER,
        rounds BIGINT, tau DOUBLE, accept_per_pos VARCHAR, server_accept_length DOUBLE,
        heldout_tau DOUBLE""",
}

# Views, (re)created at every ingest after the tables. bench_parity: one row per configuration
# benched by both backends in one stage (stages.bench.backend: both): the embedded engine's tau
# next to SGLang's (same definition: 1 + accepted drafts / verify passes) and SGLang's own
# accept length (prefill token counted); plain decode tok/s and the round cost in plain tokens
# (break-even tau) of each engine; the speedups, SGLang's as measured and as the embedded
# bench predicted it from the SGLang round-cost profile; losslessness in each engine, and how
# many prompts SGLang's plain greedy decode equals the embedded engine's (ref_*).
VIEWS = {
    "bench_parity": """SELECT e.run_id, e.variant, e.prompt_set, e.num_steps, e.eagle_topk,
        e.num_draft_tokens, e.cuda_graph, e.max_new_tokens, e.n_prompts, s.server_version,
        e.tau AS tau_embedded, s.tau AS tau_sglang, s.tau / e.tau - 1 AS tau_rel_diff,
        s.server_accept_length AS sglang_accept_length,
        e.base_tok_s AS plain_tok_s_embedded, s.base_tok_s AS plain_tok_s_sglang,
        e.break_even_tau AS round_cost_embedded, s.break_even_tau AS round_cost_sglang,
        e.speedup AS speedup_embedded, s.speedup AS speedup_sglang,
        e.predicted_speedup AS speedup_sglang_predicted,
        e.predicted_speedup / s.speedup - 1 AS predicted_rel_err,
        e.lossless_prompts AS lossless_embedded, s.lossless_prompts AS lossless_sglang,
        s.ref_same_prompts AS plain_same_as_embedded, s.ref_max_margin AS plain_max_margin,
        s.flags AS sglang_flags
        FROM bench_summary e JOIN bench_summary s ON e.run_id = s.run_id
        AND e.variant = s.variant AND e.prompt_set = s.prompt_set
        AND e.num_steps = s.num_steps AND e.eagle_topk = s.eagle_topk
        AND e.num_draft_tokens = s.num_draft_tokens AND e.cuda_graph = s.cuda_graph
        AND e.max_new_tokens = s.max_new_tokens AND e.temperature = s.temperature
        WHERE e.backend = 'embedded' AND s.backend = 'sglang'""",
}


def now() -> str:
    return dt.datetime.now().isoformat(sep=" ", timespec="milliseconds")


def host() -> str:
    return socket.gethostname()


def stage_row(*, run_id: str, variant: str, stage: str, cache_key: str, reason: str, status: str,
              executor: str, **fields) -> dict:
    """One row of the `stages` table: done, failed, requeued, skipped or cancelled. started_at
    and finished_at default to now and host to this machine; `fields` sets the other columns
    (duration_s, job_id, artifact, log_path, error; an error is cut to 4000 characters)."""
    row = {"run_id": run_id, "variant": variant, "stage": stage, "cache_key": cache_key,
           "reason": reason, "status": status, "executor": executor, "host": host(),
           "started_at": now(), "finished_at": now(), **fields}
    if row.get("error"):
        row["error"] = row["error"][:4000]
    return row


def _cannot_open(db: Path, e: Exception) -> str:
    why = str(e).splitlines()[0].rstrip("!.")
    return (f"cannot open results file {db}: {why}. Point results.path (or `runner query "
            "--results`) at a DuckDB file or a new path.")


def _damaged(db: Path, e: Exception) -> str:
    """The error for a results file DuckDB opens but cannot read (its pages cut short)."""
    return (f"results file {db} is damaged: {str(e).splitlines()[0].rstrip('.!')}. It was "
            "probably cut short (a full disk, an interrupted copy). Restore it from a copy, or "
            "move it away: the next `runner apply` starts a new file (rows not yet ingested "
            f"wait in {db.name}.spool/).")


def _read_everything(con, db: Path) -> None:
    """Read every column of every table (a hash of each value: no statistic answers it), so a
    file cut short fails here, naming it damaged, and not in the middle of a later query.
    Raises StoreError."""
    import duckdb
    try:
        tables = con.execute("SELECT table_name, list(column_name) FROM information_schema.columns "
                             "WHERE table_schema = 'main' GROUP BY 1").fetchall()
        for t, cols in tables:
            con.execute(f'SELECT {", ".join(f"count(hash({_ident(c)}))" for c in cols)} '
                        f"FROM {_ident(t)}").fetchall()
    except duckdb.Error as e:
        raise StoreError(_damaged(db, e)) from None


def _ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def check_readable(db: Path) -> None:
    """`runner plan`'s check of an existing results file: DuckDB opens it and reads every value
    of it (`_read_everything`; ~0.05 s for a few MB), and a file with tables has the runner's
    (`_foreign`: `runner apply` would add its tables to another program's file; an empty
    database passes, the first ingest makes it a results file). Raises StoreError. Takes the
    writer lock, as a query does (`Store._checking_lock`: none is left next to a refused file)."""
    store = Store(db)
    with store._checking_lock():
        tables = store._open_and_read(full=True)
        if tables and "runs" not in tables:
            raise StoreError(_foreign(store.db_path))


DUCKDB_MAGIC = b"DUCK"  # bytes 8 to 12 of a DuckDB file


def not_duckdb(path: Path) -> str | None:
    """Why the existing file at `path` is not a DuckDB file (its header does not say DUCK at
    byte 8: "it is empty" or "its header is not DuckDB's"), or None when it is one or is not
    there. Raises OSError when it cannot be read."""
    try:
        with open(path, "rb") as f:
            head = f.read(12)
    except FileNotFoundError:
        return None
    if head[8:12] == DUCKDB_MAGIC:
        return None
    return "it is empty" if not head else "its header is not DuckDB's"


def no_results(db: Path) -> StoreError:
    """The error of a reading verb (query, results, status) whose results file is not there; a
    relative path names the folder it was looked for in (the default runs/results.duckdb is
    relative to the current folder, a spec's results.path to the spec's)."""
    where = "" if Path(db).is_absolute() else f" (in {Path.cwd()})"
    return StoreError(f"no results at {db}{where}; run `runner apply SPEC` first, or pass "
                      "--results with the spec's results.path")


def _foreign(db: Path) -> str:
    return (f"{db} is not a results file of this runner (no `runs` table): point --results (or "
            "results.path) at the runner's results file (runs/results.duckdb by default). "
            "Nothing was written to it.")


def _unwritable(db: Path, e: OSError) -> str:
    return (f"cannot write results next to {db}: {e.strerror or e} ({e.filename or db}). Set "
            "results.path (or `runner query --results`) to a file in a writable folder.")


class Store:
    """Spool writer + DuckDB ingester for one results file."""

    def __init__(self, db_path: str | Path):
        self.db_path = Path(db_path)
        self.spool = self.db_path.with_name(self.db_path.name + ".spool")
        self._ours = False  # check_results_file passed on this file: not checked again

    # -- writers (any process) --
    def emit(self, table: str, rows: list[dict] | dict) -> None:
        """Queue rows for `table`; atomic; never touches DuckDB."""
        if isinstance(rows, dict):
            rows = [rows]
        if table not in SCHEMA:
            raise StoreError(f"unknown table {table!r}")
        name = f"{dt.datetime.now():%Y%m%dT%H%M%S%f}-{os.getpid()}-{uuid.uuid4().hex[:8]}.json"
        try:  # a temp file has no .json suffix, so it is never ingested
            self.spool.mkdir(parents=True, exist_ok=True)
            atomic_write(self.spool / name, json.dumps({"table": table, "rows": rows}, default=str))
        except OSError as e:
            raise StoreError(_unwritable(self.db_path, e))

    def metric(self, run_id: str, variant: str, stage: str, name: str, value: float,
               unit: str = "", step: int | None = None) -> None:
        self.emit("metrics", dict(run_id=run_id, variant=variant, stage=stage, name=name,
                                  value=float(value), unit=unit, step=step, ts=now()))

    # -- the single writer --
    @property
    def lock_path(self) -> Path:
        return self.db_path.with_name(self.db_path.name + ".lock")

    @contextmanager
    def _lock(self):
        lock = self.lock_path
        try:
            self.db_path.parent.mkdir(parents=True, exist_ok=True)
            lf = open(lock, "w")
        except OSError as e:
            raise StoreError(_unwritable(self.db_path, e))
        with lf:
            fcntl.flock(lf, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lf, fcntl.LOCK_UN)

    @contextmanager
    def _checking_lock(self):
        """The writer lock, for a check of the file before anything writes it: when the check
        raises StoreError and this call made the lock file, the lock file is removed, so none is
        left next to a file that is not a results file. (Removing it is safe enough: a process
        that opened the lock file meanwhile is checking the same file, and is refused too.)"""
        made = not self.lock_path.exists()
        try:
            with self._lock():
                yield
        except StoreError:
            if made:
                self.lock_path.unlink(missing_ok=True)
            raise

    def _open_and_read(self, full: bool) -> set[str]:
        """The tables of the file, opened read-only (under the lock); full: every value read
        too (`_read_everything`). Raises StoreError when it cannot be opened or is damaged."""
        import duckdb
        try:
            con = duckdb.connect(str(self.db_path), read_only=True)
        except duckdb.Error as e:
            raise StoreError(_cannot_open(self.db_path, e)) from None
        try:
            try:
                tables = {r[0] for r in con.execute(
                    "SELECT table_name FROM information_schema.tables "
                    "WHERE table_schema = 'main'").fetchall()}
            except duckdb.Error as e:
                raise StoreError(_damaged(self.db_path, e)) from None
            if full:
                _read_everything(con, self.db_path)
            return tables
        except RuntimeError as e:
            _raise_interrupted(e)
        finally:
            con.close()

    def check_results_file(self) -> None:
        """What a reading verb (query, results, status, report) checks before the ingest, which
        creates the tables and adds new columns: an existing file must be a DuckDB file
        (`not_duckdb`, read without the lock) and a results file of this runner, one with the
        `runs` table every version made (an older file that lacks a newer table or column still
        is one: the ingest adds them, `_create`). The first time a file is used here (no lock
        file yet) every value is read too, so a damaged file leaves no lock file behind. A
        missing file passes: a spool waiting to be ingested makes it. Once a file passed, this
        Store does not check it again (a verb's several queries open it once for the check).
        Raises StoreError."""
        if self._ours or not self.db_path.is_file():
            return
        try:
            why = not_duckdb(self.db_path)
        except OSError as e:
            raise StoreError(_cannot_open(self.db_path, e)) from None
        if why is not None:
            raise StoreError(_cannot_open(self.db_path, ValueError(f"not a DuckDB file ({why})")))
        first = not self.lock_path.exists()
        with self._checking_lock():
            if "runs" not in self._open_and_read(full=first):
                raise StoreError(_foreign(self.db_path))
        self._ours = True

    def _create(self, con) -> None:
        """Create the tables, and add the columns a results file made by an older version
        lacks (a new column is appended to its table's SCHEMA entry)."""
        have = {}
        for t, c in con.execute("SELECT table_name, column_name FROM information_schema.columns "
                                "WHERE table_schema = 'main'").fetchall():
            have.setdefault(t, set()).add(c)
        for t, cols in SCHEMA.items():
            con.execute(f"CREATE TABLE IF NOT EXISTS {t} ({cols})")
            for col in (c.split() for c in cols.split(",")):
                if t in have and col[0] not in have[t]:
                    con.execute(f"ALTER TABLE {t} ADD COLUMN {col[0]} {col[1]}")
        con.execute("CREATE TABLE IF NOT EXISTS _ingested (file VARCHAR PRIMARY KEY, ts TIMESTAMP)")
        for v, sql in VIEWS.items():
            con.execute(f"CREATE OR REPLACE VIEW {v} AS {sql}")

    def ingest(self) -> int:
        """Move every spooled batch into DuckDB; returns the number of rows inserted.
        Raises StoreError when the results path is not a DuckDB file (or cannot be opened)."""
        import duckdb
        if self.db_path.is_dir():
            raise StoreError(f"results path {self.db_path} is a folder; point results.path (or "
                             "--results) at a .duckdb file")
        with self._lock():
            files = sorted(self.spool.glob("*.json")) if self.spool.exists() else []
            try:
                con = duckdb.connect(str(self.db_path))
            except duckdb.Error as e:
                raise StoreError(_cannot_open(self.db_path, e))
            try:
                try:
                    self._create(con)
                    done = {r[0] for r in con.execute("SELECT file FROM _ingested").fetchall()}
                except duckdb.Error as e:  # a file cut short (full disk, interrupted copy)
                    raise StoreError(_damaged(self.db_path, e)) from None
                n = 0
                for f in files:
                    if f.name in done:
                        f.unlink(missing_ok=True)
                        continue
                    try:
                        batch = json.loads(f.read_text())
                        if batch.get("table") not in SCHEMA:
                            raise StoreError(f"unknown table {batch.get('table')!r}")
                        con.execute("BEGIN")
                        for row in batch["rows"]:
                            if batch["table"] == "runs":  # one row per run: latest status wins
                                con.execute("DELETE FROM runs WHERE run_id = ?", [row["run_id"]])
                            elif batch["table"] == "stages" and row.get("status") != "running":
                                # a stage's outcome replaces the row that said it was running
                                con.execute("DELETE FROM stages WHERE run_id = ? AND variant = ? "
                                            "AND stage = ? AND status = 'running'",
                                            [row.get("run_id"), row.get("variant"),
                                             row.get("stage")])
                            cols = [c for c in row if row[c] is not None]
                            con.execute(
                                f"INSERT INTO {batch['table']} ({', '.join(cols)}) VALUES "
                                f"({', '.join('?' for _ in cols)})", [row[c] for c in cols])
                        con.execute("INSERT INTO _ingested VALUES (?, ?)", [f.name, now()])
                        con.execute("COMMIT")
                        n += len(batch["rows"])
                    except (duckdb.Error, StoreError, ValueError, KeyError, TypeError,
                            AttributeError) as e:
                        # one bad batch (e.g. a misspelled column) must not block every later
                        # ingest: roll it back and set it aside with the reason
                        try:
                            con.execute("ROLLBACK")
                        except duckdb.Error:  # no transaction was open
                            pass
                        self._reject(f, e)
                        continue
                    f.unlink(missing_ok=True)
            finally:
                con.close()
        return n

    def _reject(self, f: Path, err: Exception) -> None:
        """Move a batch that cannot be ingested to <spool>/rejected/ with a .why file."""
        import sys
        bad = self.spool / "rejected"
        bad.mkdir(exist_ok=True)
        (bad / (f.name + ".why")).write_text(f"{type(err).__name__}: {err}\n")
        os.replace(f, bad / f.name)
        print(f"warning: results batch {f.name} rejected ({str(err).splitlines()[0]}); kept in "
              f"{bad}", file=sys.stderr)

    def query(self, sql: str):
        """Run read-only SQL; returns (column names, rows). Ingests pending rows first, into a
        results file of this runner only (`check_results_file`: another DuckDB file is refused,
        never given the runner's tables).

        The read-only connection is opened under the writer lock: DuckDB refuses to open a file
        that another process holds open for writing. Raises StoreError (e.g. for DELETE)."""
        import duckdb
        self.check_results_file()
        self.ingest()
        with self._lock():
            try:  # no file access from SQL: COPY TO, EXPORT, ATTACH, read_csv('/etc/..') fail
                con = duckdb.connect(str(self.db_path), read_only=True,
                                     config={"enable_external_access": False})
            except duckdb.Error as e:
                raise StoreError(str(e).splitlines()[0])
            try:
                _check_read_only_sql(con, sql)
                cur = con.execute(sql)
                cols = [d[0] for d in cur.description] if cur.description else []
                return cols, cur.fetchall()
            except duckdb.CatalogException as e:  # an unknown table: say which ones exist
                names = [r[0] for r in con.execute(
                    "SELECT table_name FROM information_schema.tables ORDER BY 1").fetchall()
                         if not r[0].startswith("_")]  # _ingested: the store's own
                raise StoreError(f"{str(e).splitlines()[0]} Tables and views here: "
                                 f"{', '.join(names) or 'none'}.")
            except duckdb.Error as e:
                raise StoreError(str(e).splitlines()[0])
            except RuntimeError as e:
                _raise_interrupted(e)
            finally:
                con.close()


def _raise_interrupted(e: RuntimeError):
    """DuckDB turns Ctrl-C during a query into RuntimeError('Query interrupted'): raise it as
    KeyboardInterrupt (the CLI says `interrupted`), any other RuntimeError as it is."""
    if "interrupted" in str(e).lower():
        raise KeyboardInterrupt from None
    raise e


READ_ONLY_STATEMENTS = ("SELECT", "EXPLAIN")


def _check_read_only_sql(con, sql: str) -> None:
    """Refuse anything but exactly one SELECT/EXPLAIN statement (DESCRIBE, SHOW, SUMMARIZE,
    WITH and VALUES parse as SELECT). The connection is read-only already; this also refuses
    COPY ... TO, EXPORT DATABASE, SET, LOAD, and a write hidden after a `;`. Raises StoreError."""
    stmts = con.extract_statements(sql)
    if not stmts:
        raise StoreError("empty query: pass one SELECT statement")
    if len(stmts) > 1:
        raise StoreError(f"runner query is read-only and runs one statement; got {len(stmts)} "
                         "(separated by ';'). Run them one at a time.")
    kind = stmts[0].type.name
    if kind not in READ_ONLY_STATEMENTS:
        raise StoreError(f"runner query is read-only: only SELECT (or EXPLAIN, DESCRIBE, SHOW) "
                         f"is allowed, got {kind}. To save a result, use --csv or --json and "
                         "redirect stdout (runner query SQL --csv > out.csv).")
