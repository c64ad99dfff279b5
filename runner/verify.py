"""Checking an input artifact against its artifact.json before a stage reads it.

artifact.json (runner/stage.py) lists every file with its sha256 and size, and, for files over
SAMPLE_MIN bytes, a sampled digest. Before a stage runs, `verify_artifact` checks each input
file, cheapest first:

1. it exists and has the recorded size;
2. its stat (size, mtime, ctime, inode) equals the one recorded when its content was last
   hashed and found right (`<work_dir>/.verified/<stage>-<key>.json`, written by finalize and
   by every full check, like git's index). ctime changes on every write and cannot be set back
   by `touch`, so a file written since is hashed again;
3. otherwise its sha256 is computed and compared: sha256 runs at about 0.87 GB/s on the CI
   machine (measured, one core), so when the files to hash exceed FULL_LIMIT (32 GiB, about 40 s;
   env EAGLE3_VERIFY_FULL_GB), files with a sampled digest get the sampled check instead (their
   size plus SAMPLE_BLOCKS blocks of 1 MiB spread over the file, first and last included),
   which catches truncation, replacement and most overwrites but not every changed byte.
   EAGLE3_VERIFY=full always hashes everything.

A mismatch is a StageError naming the file and the command that rebuilds it. No torch.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from eagle3_runner.runner.errors import StageError
from eagle3_runner.runner.files import atomic_write, sha256_file

SAMPLE_MIN = 64 << 20  # files above this get a sampled digest in artifact.json
SAMPLE_BLOCKS, BLOCK = 64, 1 << 20


def full_limit() -> int:
    """Bytes of unverified files hashed whole before sampling (EAGLE3_VERIFY_FULL_GB)."""
    try:
        return int(float(os.environ.get("EAGLE3_VERIFY_FULL_GB", "32")) * (1 << 30))
    except ValueError:
        return 32 << 30


def sampled_sha256(path: Path) -> str:
    """sha256 of the file's size and SAMPLE_BLOCKS blocks of BLOCK bytes at evenly spaced
    offsets (the first and the last block included)."""
    size = os.path.getsize(path)
    h = hashlib.sha256(str(size).encode())
    last = max(size - BLOCK, 0)
    with open(path, "rb") as f:
        for i in range(SAMPLE_BLOCKS):
            f.seek(last * i // (SAMPLE_BLOCKS - 1))
            h.update(f.read(BLOCK))
    return h.hexdigest()


def _stat(p: Path) -> list[int]:
    st = p.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def _memo_path(artifact: Path) -> Path:
    artifact = Path(artifact)
    return artifact.parent.parent / ".verified" / f"{artifact.parent.name}-{artifact.name}.json"


def _read_memo(artifact: Path) -> dict:
    try:
        memo = json.loads(_memo_path(artifact).read_text())
        return memo if isinstance(memo, dict) else {}
    except (OSError, ValueError):
        return {}


def remember(artifact: Path, files: dict[str, str]) -> None:
    """Record the stat of each of `files` ({rel: sha256}, content known right) for later
    checks. A folder we cannot write only costs a re-hash next time."""
    memo = _read_memo(artifact)
    for rel, sha in files.items():
        try:
            memo[rel] = [sha, *_stat(Path(artifact) / rel)]
        except OSError:
            memo.pop(rel, None)
    try:
        _memo_path(artifact).parent.mkdir(parents=True, exist_ok=True)
        atomic_write(_memo_path(artifact), json.dumps(memo, sort_keys=True))
    except OSError:
        pass


def verify_artifact(artifact: Path, manifest: dict, stage: str) -> dict:
    """Check every file of `artifact` (the completed output of `stage`) against `manifest`, its
    artifact.json (module docstring). Returns {"files", "hashed_bytes", "sampled",
    "trusted"} counts. Raises StageError naming the first file that does not match."""
    artifact = Path(artifact)
    files, sizes = manifest.get("files") or {}, manifest.get("sizes") or {}
    sampled = manifest.get("sampled_sha256") or {}
    force_full = os.environ.get("EAGLE3_VERIFY", "auto") == "full"
    memo = {} if force_full else _read_memo(artifact)

    def bad(rel: str, why: str) -> StageError:
        return StageError(
            f"input artifact {artifact} ({stage}): {rel} {why}; it changed on disk after the "
            f"{stage} stage finished, and reading it would give a silently wrong result. "
            f"Rebuild it: runner apply SPEC --force {stage}")

    stale: list[str] = []
    for rel, sha in sorted(files.items()):
        p = artifact / rel
        try:
            st = _stat(p)
        except OSError:
            raise bad(rel, "is missing") from None
        if rel in sizes and st[0] != sizes[rel]:
            raise bad(rel, f"has {st[0]} bytes, artifact.json says {sizes[rel]}")
        if memo.get(rel) != [sha, *st]:
            stale.append(rel)
    total = sum((artifact / rel).stat().st_size for rel in stale)
    sample = not force_full and total > full_limit()
    out = {"files": len(files), "hashed_bytes": 0, "sampled": 0,
           "trusted": len(files) - len(stale)}
    good = {}
    for rel in stale:
        p = artifact / rel
        if sample and rel in sampled:
            if sampled_sha256(p) != sampled[rel]:
                raise bad(rel, "does not match its sampled sha256 in artifact.json")
            out["sampled"] += 1
            continue
        if sha256_file(p) != files[rel]:
            raise bad(rel, "does not match its sha256 in artifact.json")
        out["hashed_bytes"] += p.stat().st_size
        good[rel] = files[rel]
    if good:
        remember(artifact, good)
    return out
