"""Files and places: the atomic write, content hashes, the cache folder, spec path expansion.

`atomic_path` is the one temp-then-rename primitive of the project: whatever a caller writes
(text, a torch checkpoint, safetensors, a PNG, a whole folder) goes to a hidden temporary sibling
that is renamed over the destination only when the writer finished without an exception, so a
reader sees the old file or the whole new one, and a crash leaves no half-written file under the
final name. Temporary names start with `.tmp-`, which the artifact manifest never hashes
(runner/stage.py). No torch here.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


@contextmanager
def atomic_path(path: str | Path, tmp: str | Path | None = None) -> Iterator[Path]:
    """Yield a temporary sibling of `path` (default `.tmp-<name>-<pid>`) to write; when the block
    ends without an exception, rename it over `path` (os.replace: atomic on one filesystem).
    On any exception the temporary file or folder is removed and the exception propagates."""
    path = Path(path)
    tmp = Path(tmp) if tmp is not None else path.with_name(f".tmp-{path.name}-{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        _remove(tmp)


def _remove(p: Path) -> None:
    """Remove a leftover temporary file or folder; a missing one (or parent) is fine."""
    try:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    except OSError:
        pass


def atomic_write(path: str | Path, data: str | bytes) -> None:
    """Write text (str) or bytes to `path` atomically (atomic_path). Raises OSError."""
    with atomic_path(path) as tmp:
        if isinstance(data, str):
            tmp.write_text(data)
        else:
            tmp.write_bytes(data)


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    """sha256 hex digest of a file, read in `chunk`-byte pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


def cache_dir() -> Path:
    """Where fetched models and datasets live: $EAGLE3_CACHE, default ~/.cache/eagle3-runner."""
    return Path(os.environ.get("EAGLE3_CACHE") or Path.home() / ".cache" / "eagle3-runner")


def expand_path(p: str) -> Path:
    """Expand `~` and `$VARS` in a spec path. $EAGLE3_CACHE defaults to cache_dir()."""
    env = dict(os.environ)
    env.setdefault("EAGLE3_CACHE", str(cache_dir()))
    out = p
    for k in sorted(env, key=len, reverse=True):
        out = out.replace("${" + k + "}", env[k]).replace("$" + k, env[k])
    return Path(os.path.expanduser(out))
