"""Plot helpers shared by runner/report.py and runner/report_curve.py: finite-number checks,
the run-naming title part, the legend placement and the atomic PNG write. matplotlib is never
imported here (the figures come from the callers)."""

from __future__ import annotations

import math
from pathlib import Path

from eagle3_runner.runner.errors import ReportError
from eagle3_runner.runner.files import atomic_path


def runs_title(rows: list[dict]) -> str:
    """Title part naming the run(s) the rows come from."""
    ids = list(dict.fromkeys(r["run_id"] for r in rows))
    return f"run {ids[0]}" if len(ids) == 1 else f"latest row per config from {len(ids)} runs"


def ok(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def legend(ax, **kw) -> None:
    """Legend inside the axes when short, to the right of them when it would cover the data."""
    n = len(ax.get_legend_handles_labels()[0])
    if n > 4:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), **kw)
    else:
        ax.legend(fontsize=8, **kw)


def save_png(fig, path: Path) -> Path:
    """Write the figure as PNG atomically (runner.files.atomic_path)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.tight_layout()
        with atomic_path(path) as tmp:
            fig.savefig(tmp, format="png")
    except OSError as e:  # --out is a file, unwritable, or the disk is full
        why = "a file is in the way" if any(q.is_file() for q in (path.parent, *path.parents)) \
            else e.strerror or str(e)
        raise ReportError(f"--out {path.parent}: cannot write {path.name} ({why}); pass --out a "
                          "writable folder")
    return path
