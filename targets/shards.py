"""Shard files of the extract stage: written atomically and durably, checked on resume.

Atomicity, durability and resume: a writer thread serialises each shard, hashes it (sha256,
in the same pass) while writing it to `.tmp-<name>`, and renames it to its final name, so a
crashed process never leaves a partial file under a final name. Then it records the sha256 in
`.<name>.sha256` (sha256sum format). There is no fsync per shard (it made the GPU wait on the
disk): once all of a rank's shards are written, sync_shards fsyncs each of them and then the
directory, before features.json (written last) marks the artifact complete. A re-run in the same
partial dir (ctx.out_dir) reuses a shard under its final name only if its bytes hash to the
recorded sha256 (a file truncated or zero-filled by a power loss before the final fsync, or one
without a record, is recomputed) and it holds exactly the re-tokenised samples (shard_ok); only
the other shards are computed, so the final shards are byte-identical to an uninterrupted run.
The records are removed once features.json lists the hashes. A full disk (ENOSPC) removes the
temp file and raises StageError.

Format of a shard: targets/features.py. Used by jobs/extract.py (writer threads, resume).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import time
from pathlib import Path

import torch

from eagle3_runner.targets.features import FORMAT, MANIFEST
from eagle3_runner.runner.drafts.safetensors import encode_header
from eagle3_runner.runner.errors import StageError
from eagle3_runner.runner.files import atomic_path, sha256_file

# safetensors written straight from (pinned) tensor memory, hashed while written


_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
              torch.int64: "I64", torch.uint8: "U8"}


def safetensors_chunks(tensors: dict[str, torch.Tensor], metadata: dict | None = None) -> list:
    """The safetensors file for `tensors` as a list of buffers (header, then each tensor's
    bytes, no copy). Layout per the safetensors spec: u64 header length, JSON header padded
    with spaces to 8 bytes, data ordered by element size (largest first) then name, so every
    tensor stays aligned. Readable by safetensors.safe_open."""
    header, off, bufs = {}, 0, []
    if metadata:
        header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    for name in sorted(tensors, key=lambda k: (-tensors[k].element_size(), k)):
        t = tensors[name].contiguous()
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [off, off + nbytes]}
        off += nbytes
        bufs.append(memoryview(t.reshape(-1).view(torch.uint8).numpy()) if nbytes else b"")
    return [encode_header(header)] + bufs


def _write_chunks(path: Path, chunks: list) -> str:
    """Write and hash (sha256) in one pass, no fsync (sync_shards does that once per rank); the
    only place feature bytes hit the disk (tests inject ENOSPC here). Returns the sha256 of what
    was written."""
    h = hashlib.sha256()
    step = 1 << 24
    with open(path, "wb") as f:
        for c in chunks:
            for i in range(0, len(c), step):
                piece = c[i:i + step]
                f.write(piece)
                h.update(piece)
        f.flush()
        start_writeback(f.fileno())
    return h.hexdigest()


def start_writeback(fd: int) -> None:
    """Ask the kernel to start writing the file's dirty pages to disk now, without waiting
    (Linux: posix_fadvise DONTNEED starts asynchronous writeback of the range; pages still dirty
    stay cached). The disk then works while the GPU computes the next shards, and the final
    fsync pass (sync_shards) has little left to flush. A no-op where unsupported."""
    if hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass


def fsync_path(path: Path) -> None:
    """fsync a file or a directory by path. Linux writes back all of the inode's dirty pages,
    whichever descriptor wrote them. Raises OSError (e.g. EIO, ENOSPC) as os.fsync does."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_error(path: Path, e: OSError, nbytes: int) -> BaseException:
    """StageError for a full disk, naming the file and the fix; other OSErrors unchanged."""
    if e.errno != errno.ENOSPC:
        return e
    return StageError(f"disk full while writing {path.name} in {path.parent} "
                      f"({nbytes / 2**20:.1f} MiB): free space and re-run; completed "
                      "shards are kept and extraction resumes after them.")


def write_atomic(path: Path, chunks: list, sync: bool = True) -> str:
    """Write `chunks` to `.tmp-<name>` and rename it to `path`; sync=True fsyncs the file before
    the rename and the directory after it. Returns the sha256 of the bytes.

    Raises StageError on ENOSPC (disk full) after removing the temp file."""
    try:
        with atomic_path(path, path.with_name(f".tmp-{path.name}")) as tmp:
            sha = _write_chunks(tmp, chunks)
            if sync:
                fsync_path(tmp)
        if sync:
            fsync_path(path.parent)
    except OSError as e:
        raise _write_error(path, e, sum(len(c) for c in chunks))
    return sha


def sha_record(path: Path) -> Path:
    """Where a shard's sha256 is recorded until features.json lists it: `.<name>.sha256`."""
    return path.with_name(f".{path.name}.sha256")


def write_shard(path: Path, tensors: dict[str, torch.Tensor], ready=None) -> str:
    """Atomically write one shard (format: targets/features.py) without fsync, then record its
    sha256 (sha_record); `ready` is a CUDA event to wait for (the asynchronous device-to-host
    copies into the tensors). Returns the sha256. Raises StageError on a full disk."""
    if ready is not None:
        ready.synchronize()
    chunks = safetensors_chunks(tensors, {"format": FORMAT})
    sha = write_atomic(path, chunks, sync=False)
    try:
        sha_record(path).write_text(f"{sha}  {path.name}\n")
    except OSError as e:  # no record = not reusable: drop the shard too
        drop_shard(path)
        raise _write_error(path, e, sum(len(c) for c in chunks))
    return sha


def drop_shard(path: Path) -> None:
    """Remove a shard and its sha256 record (it will be recomputed)."""
    path.unlink(missing_ok=True)
    sha_record(path).unlink(missing_ok=True)


def sync_shards(paths: list[Path], out_dir: Path) -> float:
    """fsync every shard in `paths`, then `out_dir` once (the renames): after this the shards
    are as durable as the per-shard fsync used to make them. Returns the seconds spent.

    Raises StageError when the disk reports a deferred write error (e.g. EIO, ENOSPC on
    writeback), after removing that shard so that a re-run recomputes it."""
    t0 = time.perf_counter()
    for p in paths:
        try:
            fsync_path(p)
        except OSError as e:
            drop_shard(p)
            raise StageError(f"could not flush {p.name} in {out_dir} to disk ({e}): check the "
                             "disk and re-run; the other shards are kept.") from e
    fsync_path(out_dir)
    return time.perf_counter() - t0


def shard_index(samples: list[tuple[list[int], list[int]]],
                sample_ids: list[int]) -> dict[str, torch.Tensor]:
    """input_ids int64 [T], loss_mask uint8 [T], offsets int64 [n+1], sample_ids int64 [n] (each
    sample's index in the tokenised dataset) of a shard's samples."""
    lens = [len(s[0]) for s in samples]
    offsets = torch.zeros(len(lens) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int64), 0)
    return {"input_ids": torch.tensor([t for s in samples for t in s[0]], dtype=torch.int64),
            "loss_mask": torch.tensor([m for s in samples for m in s[1]], dtype=torch.uint8),
            "offsets": offsets, "sample_ids": torch.tensor(sample_ids, dtype=torch.int64)}


def shard_ok(path: Path, samples: list[tuple[list[int], list[int]]], sample_ids: list[int],
             width: int) -> bool:
    """A complete shard holding exactly these samples (input_ids, mask, offsets, sample ids,
    widths)? Checks the structure only; reusable_sha also checks the bytes."""
    from safetensors import safe_open
    want = shard_index(samples, sample_ids)
    try:
        with safe_open(str(path), framework="pt") as f:
            t = {k: f.get_tensor(k) for k in want}
            aux_shape = f.get_slice("aux_hidden").get_shape()
    except Exception:  # noqa: BLE001 - unreadable or an older layout = not complete
        return False
    return (all(torch.equal(t[k], want[k]) for k in t)
            and list(aux_shape) == [len(want["input_ids"]), width])


def reusable_sha(path: Path, samples: list[tuple[list[int], list[int]]], sample_ids: list[int],
                 width: int) -> str | None:
    """The sha256 of the shard at `path` when a resume may reuse it, else None: its bytes hash
    to the sha256 recorded when it was written (recorded_sha; catches a truncated or zero-filled
    file, e.g. after a power loss before sync_shards) and it holds exactly `samples` (shard_ok).
    A shard with no recorded sha256 (a crash between rename and record) is not reused."""
    want = recorded_sha(path)
    if want is None:
        return None
    try:
        sha = sha256_file(path)
    except OSError:
        return None
    return sha if sha == want and shard_ok(path, samples, sample_ids, width) else None


def recorded_sha(path: Path) -> str | None:
    """The sha256 recorded for a shard: its `.<name>.sha256` record, or else the entry of an
    existing features.json in the same dir (written only after the final fsync pass, and the
    records are removed after it: a crash between the manifest and the runner's rename must not
    force a full recompute). None when neither has it."""
    try:
        return sha_record(path).read_text().split()[0]
    except (OSError, IndexError):
        pass
    try:
        shards = json.loads((path.parent / MANIFEST).read_text())["shards"]
        return next((sh["sha256"] for sh in shards if sh["file"] == path.name), None)
    except (OSError, ValueError, KeyError, TypeError):
        return None
