#!/usr/bin/env python3
r"""Pack files into as few device-call batches as fit (each at most --max-mb; a device call
carries 64 MiB with the working tree, DEVELOPERS.md).

    python3 scripts/gpu/pack_stage.py --out .stage/sgl --max-mb 58 \
        sgl=.whl/sglang/a.whl ... .=.whl/runner/b.whl ... --split .=path/to/big.gguf

Each argument DEST=FILE puts FILE under DEST/ of the device's ~/stage (`.` = ~/stage itself,
`sgl` = ~/stage/sgl). Whole files go first-fit by size (largest first); the --split file is cut
into part00, part01, ... (under its DEST) that fill the room left, in batch order, then new
batches. Writes OUT/1, OUT/2, ... (hard links where possible) and OUT/MANIFEST.txt (dest path,
bytes, sha256 of every file and part; the split file's whole sha256 too). The device copies
each batch into ~/stage with `bash scripts/gpu/stage.sh <OUT without .stage/>/<n>`.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
from pathlib import Path

MIN_PART = 1 << 20


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def plan(files: list[tuple[str, Path]], split: tuple[str, Path] | None, cap: int) -> list[list]:
    """Batches of (dest, source, offset, length, name); whole files have offset None."""
    batches: list[list] = []
    room: list[int] = []
    for dest, f in sorted(files, key=lambda x: -x[1].stat().st_size):
        size = f.stat().st_size
        if size > cap:
            raise SystemExit(f"{f}: {size / 1e6:.1f} MB does not fit a {cap / 1e6:.0f} MB batch; "
                             "pass it with --split or repack it")
        i = next((i for i, r in enumerate(room) if r >= size), None)
        if i is None:
            batches.append([])
            room.append(cap)
            i = len(batches) - 1
        batches[i].append((dest, f, None, size, f.name))
        room[i] -= size
    if split is not None:
        dest, f = split
        left, off, n, i = f.stat().st_size, 0, 0, 0
        while left:
            if i == len(batches):
                batches.append([])
                room.append(cap)
            take = min(left, room[i])
            if take >= min(MIN_PART, left):  # no crumbs: a part under 1 MB waits for the next batch
                batches[i].append((dest, f, off, take, f"part{n:02d}"))
                room[i] -= take
                off, left, n = off + take, left - take, n + 1
            i += 1
    return batches


def write(batches: list[list], out: Path) -> list[str]:
    """Materialise the batches under out/1, out/2, ...; returns the manifest lines."""
    if out.exists():
        shutil.rmtree(out)
    lines = []
    for b, items in enumerate(batches, 1):
        for dest, src, off, length, name in items:
            d = out / str(b) / dest
            d.mkdir(parents=True, exist_ok=True)
            if off is None:
                try:
                    os.link(src, d / name)
                except OSError:
                    shutil.copy(src, d / name)
            else:
                with open(src, "rb") as fi, open(d / name, "wb") as fo:
                    fi.seek(off)
                    left = length
                    while left:
                        chunk = fi.read(min(left, 1 << 24))
                        fo.write(chunk)
                        left -= len(chunk)
            lines.append(f"{b} {os.path.normpath(os.path.join(dest, name))} {length} "
                         f"{sha256(d / name)}")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--max-mb", type=float, default=58)
    ap.add_argument("--split", help="DEST=FILE cut into parts")
    ap.add_argument("files", nargs="+", help="DEST=FILE")
    a = ap.parse_args(argv)

    def pair(s: str) -> tuple[str, Path]:
        dest, _, f = s.partition("=")
        if not f or not Path(f).is_file():
            raise SystemExit(f"{s!r}: expected DEST=FILE with an existing file")
        return dest, Path(f)
    files = [pair(s) for s in a.files]
    split = pair(a.split) if a.split else None
    batches = plan(files, split, int(a.max_mb * 1e6))
    lines = write(batches, a.out)
    if split is not None:
        lines.append(f"- {split[1].name} {split[1].stat().st_size} {sha256(split[1])}")
    (a.out / "MANIFEST.txt").write_text("\n".join(lines) + "\n")
    for b, items in enumerate(batches, 1):
        print(f"{a.out}/{b}: {sum(x[3] for x in items) / 1e6:.1f} MB, {len(items)} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
