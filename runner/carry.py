"""A regenerated set carried from one GPU window into the next: `stages.regenerate.reuse`.

The carried set is the regenerate stage's shards (data/regen_store.py) concatenated into one file,
`regen-<spec name>.jsonl.gz` (gzip members end to end are one gzip stream), with a `sha256sum`
sidecar next to it, PATH + ".sha256" ("<hex>  <name>"), made where the set was written
(scripts/gpu/pays.sh regen). It is kept outside the repository (the git-ignored .stage/regen/)
and staged again with its sidecar.

- File there: its sha256 must be the sidecar's (`problem`: validate and plan, through the
  registry row's `file_check`, and the stage itself, say a missing sidecar or a mismatch, naming
  both hashes and the fix). The stage loads no target and generates nothing: it writes the
  set's records as its shards (data/regen_store.py `reuse_set`). Its cache key is the file's sha256
  (runner/stages.py), so another carried set reruns what reads it, and it runs no target
  (runner/engines.py stage_role: no engine, no memory estimate, no GPU check).
- File missing: the stage regenerates, with the key it has without the field (declaring a set
  that is not there yet never reruns a finished regeneration).
`note` is the plan's line about it. Torch-free.
"""

from __future__ import annotations

import os
import re
from functools import lru_cache
from pathlib import Path

from eagle3_runner.runner.errors import EnvVarError
from eagle3_runner.runner.files import expand_path, sha256_file

FIELD = "stages.regenerate.reuse"
SIDECAR = ".sha256"
_LINE = re.compile(r"^\\?([0-9a-fA-F]{64})(?:\s+\*?(.*))?$")  # sha256sum's "<hex>  <name>"


def declared(spec) -> Path | None:
    """stages.regenerate.reuse expanded, or None when the stage or the field is not set (or its
    variables do not expand: the spec's path check says so)."""
    p = getattr(spec.stages, "regenerate", None)
    if p is None or p.reuse is None:
        return None
    try:
        return expand_path(p.reuse)
    except (EnvVarError, ValueError):
        return None


def present(spec) -> Path | None:
    """The carried set's path when it is declared and there (a file): the stage reuses it."""
    p = declared(spec)
    return p if p is not None and p.is_file() else None


def sidecar(path: Path) -> Path:
    return path.with_name(path.name + SIDECAR)


@lru_cache(maxsize=16)
def _sha256(path: str, size: int, mtime_ns: int, inode: int) -> str:
    return sha256_file(path)


def file_sha256(path: Path) -> str:
    """The file's sha256, hashed once per process while its (size, mtime, inode) stay the same
    (the plan asks for it for the key, the check and the note; a new process hashes again)."""
    st = os.stat(path)
    return _sha256(str(Path(path).resolve()), st.st_size, st.st_mtime_ns, st.st_ino)


def sidecar_sha256(path: Path) -> str | None:
    """The sha256 the sidecar gives for `path` (lower case), or None when there is no sidecar.
    A sha256sum line "<hex>  <name>" (or "<hex> *<name>", or the hex alone); of several lines, the
    one naming the file. Raises ValueError when it holds no such line."""
    side = sidecar(path)
    try:
        text = side.read_text(errors="replace")
    except FileNotFoundError:
        return None
    found = [m for m in map(_LINE.match, (ln.strip() for ln in text.splitlines())) if m]
    if len(found) > 1:
        found = [m for m in found if m.group(2) and Path(m.group(2)).name == path.name]
    if len(found) != 1:
        raise ValueError(f"{side} holds no sha256sum line for {path.name} (\"<64 hex digits>  "
                         f"{path.name}\")")
    return found[0].group(1).lower()


def problem(spec) -> str | None:
    """Why the declared carried set cannot be reused, naming the field, the file, both hashes
    and the fix; None when it is fine or not there (the stage then regenerates)."""
    p = declared(spec)
    if p is None or not p.exists():
        return None
    head = f"{FIELD} = {spec.stages.regenerate.reuse!r}"
    fix = (f"Stage it again together with its {SIDECAR} (both as the window that made them "
           f"wrote them), or remove {FIELD} to regenerate.")
    if not p.is_file():
        return (f"{head}: {p} is a folder; point it at the carried gzip JSONL file "
                f"(regen-<spec name>.jsonl.gz), or remove {FIELD} to regenerate.")
    digest = file_sha256(p)
    try:
        want = sidecar_sha256(p)
    except (ValueError, OSError) as e:
        return f"{head}: the checksum file is unreadable ({e}); {p} has sha256 {digest}. {fix}"
    if want is None:
        return (f"{head}: {p} has no checksum file {sidecar(p)} (the file's sha256 is {digest}, "
                f"with nothing to check it against). {fix}")
    if want != digest:
        return (f"{head}: {p} has sha256 {digest}, but {sidecar(p).name} says {want}: the file "
                f"changed or was staged incompletely. {fix}")
    return None


def note(spec) -> str | None:
    """The plan's line about the carried set: `reuses PATH (sha256 ...)` or `regenerates: PATH not
    found`; None when the field is not set."""
    p = declared(spec)
    if p is None:
        return None
    if p.is_file():
        return f"reuses {p} (sha256 {file_sha256(p)[:12]}..., no target run)"
    return f"regenerates: {p} not found ({FIELD})"


def explain(old: dict, new: dict) -> str | None:
    """The plan's rerun reason when a stage's key slice went from generating to reusing or back,
    or to another carried set (runner/plan.py _explain); None for any other change."""
    was, now = "reuse" in old, "reuse" in new
    if was != now:
        what = "the carried set is there" if now else "no carried set: regenerates"
        return f"spec changed: {FIELD} ({what})"
    if now and old["reuse"] != new["reuse"]:
        return f"input changed: {FIELD} holds another set"
    return None
