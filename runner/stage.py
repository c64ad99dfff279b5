"""The stage contract: what a job function receives, and how its artifact becomes complete.

A stage kind (a row of runner/stages.py) is a plain function `jobs.<stage>.run(ctx: StageContext)
-> dict` returning summary metrics ({name: value} or {name: (value, unit)}). It writes only into
`ctx.out_dir`, a partial directory named after the cache key (so an interrupted stage can
resume), and raises runner.errors.StageError for a failure the user can fix. When it returns, the
runner writes `artifact.json` (content hashes of every file, written LAST) and renames the
partial directory to the final one. A directory without `artifact.json` is never complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle3_runner.runner.files import atomic_write, sha256_file, umask_modes
from eagle3_runner.runner.store import Store, now
from eagle3_runner.runner.verify import SAMPLE_MIN, remember, sampled_sha256

if TYPE_CHECKING:  # annotations only: a stage's code hash need not cover the schema
    from eagle3_runner.runner.spec.schema import Spec

MANIFEST = "artifact.json"


@dataclass
class StageContext:
    """Everything a stage needs. Picklable (submitit sends it to Slurm jobs)."""

    spec: Spec  # resolved: variant overrides applied, target geometry filled in
    stage: str  # "extract", "train", ...
    variant: str  # "base" or a variant name
    run_id: str
    inputs: dict[str, Path]  # upstream stage name -> its completed artifact dir
    out_dir: Path  # write here (partial dir; persists across retries of the same key)
    db_path: Path
    rank: int = 0
    world_size: int = 1
    file_hashes: dict[str, str] = field(default_factory=dict)  # optional precomputed sha256
    reason: str = ""  # the plan's reason to run it ("incomplete: resuming partial output", ...)

    @property
    def resuming(self) -> bool:
        """Whether the plan resumes this stage's partial output (a stage whose runs keep parts
        as they go uses it only then: --force, a changed spec or input starts afresh)."""
        return self.reason.startswith("incomplete")

    @property
    def params(self) -> Any:
        """This stage's own spec block, e.g. ctx.spec.stages.train."""
        return getattr(self.spec.stages, self.stage)

    @property
    def store(self) -> Store:
        return Store(self.db_path)

    def metric(self, name: str, value: float, unit: str = "", step: int | None = None) -> None:
        """Record one metric row (spooled; lands in DuckDB table `metrics`)."""
        if self.rank == 0:
            self.store.metric(self.run_id, self.variant, self.stage, name, value, unit, step)

    def emit(self, table: str, rows: list[dict] | dict) -> None:
        """Record rows for `bench`/`bench_summary` etc.; run_id and variant are filled in."""
        rows = [rows] if isinstance(rows, dict) else rows
        rows = [{"run_id": self.run_id, "variant": self.variant, **r} for r in rows]
        self.store.emit(table, rows)


def read_manifest(artifact: Path) -> dict | None:
    """The artifact's manifest, or None when the artifact is not complete."""
    try:
        return json.loads((Path(artifact) / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def artifact_identity(manifest: dict) -> str:
    """The content identity of a completed artifact: sha256 over its files' hashes. A stage's
    manifest records the identity of each input it read (`inputs`), so that `runner plan` sees
    when an upstream was rebuilt after it (runner/plan.py)."""
    files = json.dumps(manifest.get("files") or {}, sort_keys=True)
    return hashlib.sha256(files.encode()).hexdigest()


def finalize(ctx: StageContext, key: str, parts: dict, final: Path, metrics: dict) -> dict:
    """Hash every file, write artifact.json last, rename partial -> final, remember the files'
    stat as verified (runner/verify.py). Returns the manifest.

    artifact.json: stage, variant, run_id, cache_key, key_parts, files {rel: sha256}, sizes
    {rel: bytes}, sampled_sha256 {rel: digest} (files over verify.SAMPLE_MIN), inputs {upstream
    stage: artifact_identity}, metrics, finished_at."""
    out = Path(ctx.out_dir)
    files, sizes, sampled = {}, {}, {}
    for p in sorted(out.rglob("*")):
        if p.is_file() and p.name != MANIFEST and not p.name.startswith(".tmp"):
            rel = str(p.relative_to(out))
            files[rel] = ctx.file_hashes.get(rel) or sha256_file(p)
            sizes[rel] = p.stat().st_size
            if sizes[rel] > SAMPLE_MIN:
                sampled[rel] = sampled_sha256(p)
    inputs = {name: artifact_identity(read_manifest(path) or {})
              for name, path in sorted(ctx.inputs.items())}
    manifest = {"stage": ctx.stage, "variant": ctx.variant, "run_id": ctx.run_id,
                "cache_key": key, "key_parts": parts, "files": files, "sizes": sizes,
                "sampled_sha256": sampled, "inputs": inputs,
                "metrics": {k: (v[0] if isinstance(v, (tuple, list)) else v)
                            for k, v in (metrics or {}).items()},
                "finished_at": now()}
    atomic_write(out / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True, default=str))
    umask_modes(out)  # readable like any other file (runner/files.py)
    final = Path(final)
    if final.exists():  # a stale or concurrent copy: replace it whole
        trash = final.with_name(f".trash-{final.name}-{os.getpid()}")
        os.replace(final, trash)
        shutil.rmtree(trash, ignore_errors=True)
    os.replace(out, final)
    remember(final, files)
    return manifest
