"""Files and places: the atomic write, content hashes, the cache folder, spec path expansion,
the magic bytes of compressed data files.

`atomic_path` is the one temp-then-rename primitive of the project: whatever a caller writes
(text, a torch checkpoint, safetensors, a PNG, a whole folder) goes to a hidden temporary sibling
that is renamed over the destination only when the writer finished without an exception, so a
reader sees the old file or the whole new one, and a crash leaves no half-written file under the
final name. Temporary names start with `.tmp-`, which the artifact manifest never hashes
(runner/stage.py). What is renamed into place gets the modes a plain `open` would have given it
under the process's umask (`umask_modes`): writers that go through mkstemp (safetensors, torch,
transformers' save_pretrained) leave 0600, which an SGLang server running as another user on a
shared filesystem cannot read. No torch here.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Iterator

from eagle3_runner.runner.errors import EnvVarError

# compressed data files are recognised by these first bytes, whatever their names
# (data/records.py reads them, runner/disk.py estimates their size)
GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


@contextmanager
def atomic_path(path: str | Path, tmp: str | Path | None = None) -> Iterator[Path]:
    """Yield a temporary sibling of `path` (default `.tmp-<name>-<pid>`) to write; when the block
    ends without an exception, rename it over `path` (os.replace: atomic on one filesystem).
    On any exception the temporary file or folder is removed and the exception propagates."""
    path = Path(path)
    tmp = Path(tmp) if tmp is not None else path.with_name(f".tmp-{path.name}-{os.getpid()}")
    try:
        yield tmp
        umask_modes(tmp)
        os.replace(tmp, path)
    finally:
        _remove(tmp)


def umask() -> int:
    """The process's umask (Linux: /proc/self/status; elsewhere set and restored at once)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


def umask_modes(path: str | Path) -> None:
    """Give a file, or a folder and everything in it, the modes `open`/`mkdir` give under the
    umask (0666 / 0777 minus the umask, e.g. 0644 / 0755), whatever its writer chose. Links are
    left alone. Raises OSError."""
    path, mask = Path(path), umask()
    for p in [path, *(path.rglob("*") if path.is_dir() and not path.is_symlink() else ())]:
        if not p.is_symlink():
            os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~mask)


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


def emit_result(res: dict, out_dir: Path | None, name: str, as_json: bool, text) -> None:
    """A bench script's result: written as out_dir/name (indented JSON, atomic_write; out_dir
    made) when out_dir is given, then printed as one JSON line (as_json) or as text(res), a
    callable that prints the human form."""
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        atomic_write(Path(out_dir) / name, json.dumps(res, indent=1))
    if as_json:
        print(json.dumps(res))
    else:
        text(res)


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    """sha256 hex digest of a file, read in `chunk`-byte pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


# `runner plan` hashes an input file smaller than this whole (file_identity below)
HASHED_BELOW = 1 << 30


def sha256_memo(path: str | Path) -> str:
    """sha256_file, memoised in this process and on disk (memo_dir()/file-hashes/, keyed by
    path, size, mtime and inode, like git's index) so that `runner plan` does not re-read a
    large target on every call. The key uses the content hash; the memo only skips re-reading."""
    st = os.stat(path)
    return _sha256_memo(os.path.abspath(path), st.st_size, st.st_mtime_ns, st.st_ino)


@lru_cache(maxsize=64)
def _sha256_memo(path: str, size: int, mtime_ns: int, inode: int) -> str:
    key = hashlib.sha256(json.dumps([path, size, mtime_ns, inode]).encode()).hexdigest()[:32]
    memo = memo_dir() / "file-hashes" / f"{key}.txt"
    try:
        digest = memo.read_text().strip()
        if len(digest) == 64:
            return digest
    except OSError:
        pass
    digest = sha256_file(path)
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(memo, digest)
    except OSError:  # a read-only cache only costs time
        pass
    return digest


def cache_dir() -> Path:
    """Where fetched models and datasets live: $EAGLE3_CACHE, default ~/.cache/eagle3-runner."""
    return Path(os.environ.get("EAGLE3_CACHE") or Path.home() / ".cache" / "eagle3-runner")


def memo_dir() -> Path:
    """Where the small memo files live (file-hashes/ of sha256_memo, data-counts/ of
    data/conversations.py count_file): $EAGLE3_MEMO, default cache_dir(). Losing them only
    costs time; the test suite points it at its own temporary folder (tests/conftest.py)."""
    return Path(os.environ.get("EAGLE3_MEMO") or cache_dir())


def converted_dir(gguf: str | Path, sha256: str | None = None) -> Path:
    """Where the HF copy of the GGUF file `gguf` lives (targets/load.py ensurehf_folder writes
    it once): cache_dir()/converted/<the file's sha256[:16]>. sha256: its digest when the caller
    has it (hashing SmolLM2's 94 MiB takes ~0.2 s)."""
    return cache_dir() / "converted" / (sha256 or sha256_file(gguf))[:16]


_VAR = re.compile(r"\$(?:\{(?P<braced>[^}]*)\}|(?P<plain>[A-Za-z_][A-Za-z0-9_]*))")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def expand_vars(p: str) -> str:
    """Expand `${VAR}` and `$VAR` like a shell, each name exactly (`${USERNAME}` is USERNAME,
    never `${USER}` + "NAME"; `$VAR` takes the longest name). `$EAGLE3_CACHE` defaults to
    cache_dir(). A `$` not followed by a name or `{` stays as it is. Raises EnvVarError naming
    the variable when it is not set, or when a `${...}` is unclosed or not a name."""
    env = dict(os.environ)
    env.setdefault("EAGLE3_CACHE", str(cache_dir()))

    def one(m: re.Match) -> str:
        name = m.group("plain") if m.group("plain") is not None else m.group("braced")
        if not _NAME.fullmatch(name):
            raise EnvVarError(name, f"${{{name}}} is not a variable name (letters, digits, _)")
        if name not in env:
            raise EnvVarError(name, f"environment variable {name} is not set; export it, or "
                                    "write the path out")
        return env[name]

    out = _VAR.sub(one, p)
    tail = p[p.rfind("${"):] if "${" in p else ""
    if tail and "}" not in tail:
        raise EnvVarError(tail, f"unclosed {tail!r}: write ${{NAME}}")
    return out


def expand_path(p: str) -> Path:
    """A spec path as a Path: `~` and `${VAR}` / `$VAR` expanded (expand_vars; an unset variable
    raises EnvVarError). Relative paths stay relative to the current directory here: load_spec
    has already made a spec file's relative paths absolute against the spec's folder
    (runner/spec/load.py resolve_spec_paths)."""
    return Path(os.path.expanduser(expand_vars(p)))


def json_hash(obj) -> str:
    """sha256 hex of obj as sorted-key JSON (str() for what JSON cannot hold): the cache keys' hash
    (runner/plan.py)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def file_identity(path: Path) -> str:
    """Content identity of an input file or folder. Files under HASHED_BELOW (1 GiB) are hashed
    whole (sha256_memo); larger files and folders use names, sizes and any config.json (hashing
    a 1 TB target is not practical). Missing paths hash as 'missing'."""
    p = Path(path)
    if not p.exists():
        return "missing"
    if p.is_file():
        if p.stat().st_size < HASHED_BELOW:
            return sha256_memo(p)
        return f"size:{p.stat().st_size}"
    items = []
    for q in sorted(p.rglob("*")):
        if q.is_file():
            items.append((str(q.relative_to(p)), q.stat().st_size,  # (a binary one: replaced)
                          q.read_text(errors="replace") if q.name == "config.json" else None))
    return json_hash(items)
