#!/usr/bin/env bash
# On the device machine (one H200): extraction throughput (issue 3). Records the disk under the
# repo (df, lsblk, dd direct and buffered+fdatasync) and the kernel's dirty-page settings, then
# runs scripts/bench/bench_extract.py (args passed through). Needs the small wheels in .stage/w
# (pydantic & co.); results go to $OUT/r.
# Usage: TAG=long bash scripts/gpu/extract_probe.sh --batches 128 --rounds 4
set -uo pipefail
R=${OUT:-/tmp/out}/r; mkdir -p "$R"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .stage/w/*.whl
# the repository root is the package eagle3_runner: import it through a link of that name
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/eagle3_runner
export PYTHONPATH=/tmp/site:/tmp/pkg
{
  date; nproc; free -g; df -hT . /dev/shm 2>&1; lsblk 2>&1 | head -20
  for f in dirty_ratio dirty_background_ratio dirty_bytes dirty_background_bytes; do
    echo "$f $(cat /proc/sys/vm/$f)"; done
  dd if=/dev/zero of=./ddtest bs=64M count=64 oflag=direct 2>&1 | tail -1; rm -f ./ddtest
  dd if=/dev/zero of=./ddtest bs=64M count=64 conv=fdatasync 2>&1 | tail -1; rm -f ./ddtest
} > "$R/disk.txt" 2>&1
cat "$R/disk.txt"
O=runs/bench-extract-${TAG:-run}
python3 scripts/bench/bench_extract.py --device cuda --batch 8 --seq 2048 --random-init --out "$O" "$@" \
  2>&1 | grep -v Warning
mkdir -p "$R/${TAG:-run}"; cp "$O"/bench_extract.json "$O"/bench_extract.md "$R/${TAG:-run}/"
