#!/usr/bin/env python3
"""A wheel without some of its members, RECORD kept consistent (so `pip install` accepts it).

    python3 scripts/gpu/repack_wheel.py IN.whl OUT_DIR [--drop MEMBER ...]

Default --drop: the members of sglang-kernel 0.4.4 that SGLang 0.5.14 needs only off the
`--attention-backend triton` path on an H200: FA3 (`sgl_kernel/flash_ops.abi3.so`, 1.76 GB of the
615 MB wheel's 1.8 GB unpacked), the sm100 build of common_ops and FlashMLA; what stays is
16.6 MB (DEVELOPERS.md "SGLang on the H200").
The output has the input's file name (pip installs it as the same version). Every kept member
is copied byte for byte with its compression and permissions; RECORD loses the dropped members'
lines, every kept member is checked against its RECORD hash and size, and the written wheel is
verified again. Exits with a message (SystemExit) on any mismatch.
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import io
import os
import sys
import zipfile

DROP = ("sgl_kernel/flash_ops.abi3.so", "sgl_kernel/sm100/common_ops.abi3.so",
        "sgl_kernel/flashmla_ops.abi3.so")


def record_hash(data: bytes) -> str:
    """The RECORD form of a sha256: sha256=<urlsafe base64, no padding> (PEP 376 / 427)."""
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def record_name(names) -> str:
    rec = [n for n in names if n.endswith(".dist-info/RECORD") and n.count("/") == 1]
    if len(rec) != 1:
        raise SystemExit(f"expected one top-level *.dist-info/RECORD, found {rec}")
    return rec[0]


def _check(row: list[str], data: bytes) -> None:
    if row[1] and row[1] != record_hash(data):
        raise SystemExit(f"{row[0]}: sha256 differs from RECORD")
    if row[2] and int(row[2]) != len(data):
        raise SystemExit(f"{row[0]}: size differs from RECORD")


def repack(src: str, out_dir: str, drop=DROP) -> str:
    """Write OUT_DIR/<name of src> without the `drop` members; returns its path."""
    drop = set(drop)
    dst = os.path.join(out_dir, os.path.basename(src))
    if os.path.abspath(dst) == os.path.abspath(src):
        raise SystemExit("OUT_DIR must differ from the input wheel's folder")
    os.makedirs(out_dir, exist_ok=True)
    with zipfile.ZipFile(src) as zin:
        missing = drop - set(zin.namelist())
        if missing:
            raise SystemExit(f"not in {src}: {sorted(missing)}")
        rec = record_name(zin.namelist())
        rows = [r for r in csv.reader(io.StringIO(zin.read(rec).decode())) if r]
        kept = [r for r in rows if r[0] not in drop]
        if len(rows) - len(kept) != len(drop):
            raise SystemExit("RECORD does not list every dropped member exactly once")
        text = io.StringIO()
        csv.writer(text, lineterminator="\n").writerows(kept)
        by_name = {r[0]: r for r in kept}
        tmp = dst + ".part"
        with zipfile.ZipFile(tmp, "w") as zout:
            for info in zin.infolist():
                if info.filename in drop:
                    continue
                if info.filename == rec:
                    data = text.getvalue().encode()
                else:
                    data = zin.read(info.filename)
                    if info.filename not in by_name:
                        raise SystemExit(f"{info.filename} is not in RECORD")
                    _check(by_name[info.filename], data)
                new = zipfile.ZipInfo(info.filename, date_time=info.date_time)
                new.external_attr, new.create_system = info.external_attr, info.create_system
                new.compress_type = info.compress_type
                zout.writestr(new, data)
        os.replace(tmp, dst)
    return dst


def verify(whl: str) -> None:
    """Every member listed in RECORD exactly, with its hash and size. SystemExit otherwise."""
    with zipfile.ZipFile(whl) as z:
        rec = record_name(z.namelist())
        listed = set()
        for row in csv.reader(io.StringIO(z.read(rec).decode())):
            if not row:
                continue
            listed.add(row[0])
            if row[0] != rec:
                _check(row, z.read(row[0]))
        if listed != set(z.namelist()):
            raise SystemExit(f"{whl}: RECORD and members differ: "
                             f"{sorted(listed ^ set(z.namelist()))}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("wheel")
    ap.add_argument("out_dir")
    ap.add_argument("--drop", action="append", help="a member to leave out (repeatable)")
    a = ap.parse_args(argv)
    dst = repack(a.wheel, a.out_dir, a.drop or DROP)
    verify(dst)
    print(f"{dst}: {os.path.getsize(dst) / 1e6:.1f} MB (was {os.path.getsize(a.wheel) / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
