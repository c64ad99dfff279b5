"""Reading the results store: `runner results`, `runner query` (`runner status`: runner/status.py)."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

from eagle3_runner.runner.store import Store, no_results


def _table(cols, rows) -> str:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        return "" if v is None else str(v)
    cells = [[fmt(v) for v in r] for r in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(cols)]
    line = lambda r: "  ".join(x.ljust(w) for x, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([line(cols), line(["-" * w for w in widths])] + [line(r) for r in cells])


def run_query(db: Path, sql: str, fmt: str = "table") -> int:
    """Read-only SQL. fmt: table | csv | json."""
    if not Path(db).exists():
        raise no_results(db)
    cols, rows = Store(db).query(sql)
    if fmt == "json":
        print(json.dumps([dict(zip(cols, r)) for r in rows], default=str, indent=1))
    elif fmt == "csv":
        w = csv.writer(sys.stdout)
        w.writerow(cols)
        w.writerows(rows)
    else:
        print(_table(cols, rows))
    return 0


LATEST_METRICS = """
WITH latest AS (
  SELECT run_id, variant, stage, name, value, unit,
         row_number() OVER (PARTITION BY run_id, variant, stage, name ORDER BY ts DESC) AS rn
  FROM metrics WHERE step IS NULL)
SELECT l.run_id, l.variant, l.stage, l.name, l.value, l.unit
FROM latest l JOIN runs r USING (run_id)
WHERE rn = 1 {where}
ORDER BY r.started_at DESC, l.run_id, l.variant, l.stage, l.name
"""


# the bench table `runner apply` and `runner results` end with; its columns keep the names of
# bench_summary (README "Results schema"), so a `runner query` of the same rows reads the same
BENCH_SUMMARY = (
    "SELECT variant, prompt_set, num_steps, eagle_topk, num_draft_tokens, max_new_tokens, "
    "round(tau, 3) AS tau, round(accept_rate, 3) AS accept_rate, round(spec_tok_s, 1) AS "
    "spec_tok_s, round(base_tok_s, 1) AS base_tok_s, round(speedup, 3) AS speedup, "
    "round(break_even_tau, 2) AS break_even_tau, flags FROM bench_summary {where}"
    "ORDER BY run_id DESC, 1, 2, 3, 4, 5")

# the learning curve (table bench_curve, runner/bench_curve.py), every column
CURVE = ("SELECT * FROM bench_curve {where}ORDER BY run_id DESC, variant, prompt_set, backend, "
         "snapshot_step")


# the step rows (the train stage's history: loss, lr, each evaluation's accuracies and chain
# taus), one dict per (run, variant, stage, step)
STEP_METRICS = ("SELECT run_id, variant, stage, step, name, value FROM metrics WHERE step IS NOT "
                "NULL {where}ORDER BY run_id, variant, stage, step, name")

# every stage row of the run(s): what ran, for how long, how it ended
STAGE_ROWS = ("SELECT run_id, variant, stage, cache_key, status, reason, round(duration_s, 1) AS "
              "duration_s, started_at, left(error, 400) AS error FROM stages {where}ORDER BY "
              "started_at")


def step_history(store: Store, run_id: str | None) -> list[dict]:
    """The step rows of run_id (every run when None) as [{run_id, variant, stage, step,
    <metric name>: value, ...}] in step order: the learning curve a run's JSON carries."""
    where = f"AND run_id = '{run_id}' " if run_id else ""
    _, rows = store.query(STEP_METRICS.format(where=where))
    out: dict[tuple, dict] = {}
    for run, variant, stage, step, name, value in rows:
        row = out.setdefault((run, variant, stage, step), dict(
            run_id=run, variant=variant, stage=stage, step=step))
        row[name] = value
    return list(out.values())


def latest_run_with_results(store: Store, spec_name: str) -> str | None:
    """run_id of the newest run of spec_name that stored a summary metric (a rerun whose stages
    were all up to date stores none), or None."""
    name = spec_name.replace("'", "''")
    _, rows = store.query(
        f"SELECT r.run_id FROM runs r WHERE r.spec_name = '{name}' AND EXISTS (SELECT 1 FROM "
        "metrics m WHERE m.run_id = r.run_id AND m.step IS NULL) ORDER BY r.started_at DESC "
        "LIMIT 1")
    return rows[0][0] if rows else None


def print_results(db: Path, run_id: str | None = None, as_json: bool = False,
                  spec_name: str | None = None, skip_empty: bool = False) -> None:
    """The latest summary metric of each (run, variant, stage, name), and bench summaries: of
    run_id, or of every run. as_json adds every column of the summaries, the learning curve, the
    stage rows and the step rows (`step_history`): what benchmarks/<date>-<spec>.json keeps. With
    spec_name, a run_id that computed nothing (every stage up to date, or none finished) shows the
    newest run of that spec that stored some, said on stderr. skip_empty: print nothing when there
    is nothing to show (a failed apply: no bare header)."""
    if not Path(db).exists():
        raise no_results(db)
    store = Store(db)
    newest = latest_run_with_results(store, spec_name) if run_id and spec_name else None
    if newest not in (run_id, None):
        print(f"{run_id} stored no results (its stages were up to date, or none finished): the "
              f"results of {newest}, the newest run that stored some", file=sys.stderr)
        run_id = newest
    where = f"AND l.run_id = '{run_id}'" if run_id else ""
    only = f"WHERE run_id = '{run_id}' " if run_id else ""
    cols, rows = store.query(LATEST_METRICS.format(where=where))
    bcols, brows = store.query(BENCH_SUMMARY.format(where=only))
    if skip_empty and not rows and not brows:
        return
    ccols, crows = store.query(CURVE.format(where=only))
    if as_json:  # every column of the summaries (backend, per-position acceptance, ...)
        fcols, frows = store.query(f"SELECT * FROM bench_summary {only}ORDER BY run_id DESC, "
                                   "variant, prompt_set, backend, num_steps, eagle_topk")
        scols, srows = store.query(STAGE_ROWS.format(where=only))
        print(json.dumps({"metrics": [dict(zip(cols, r)) for r in rows],
                          "bench": [dict(zip(fcols, r)) for r in frows],
                          "curve": [dict(zip(ccols, r)) for r in crows],
                          "stages": [dict(zip(scols, r)) for r in srows],
                          "history": step_history(store, run_id)}, default=str, indent=1))
        return
    print(_table(cols, rows))
    for c, r in ((bcols, brows), (ccols, crows)):
        if r:
            print()
            print(_table(c, r))
