#!/usr/bin/env bash
# On the device machine: keep one carried batch (.stage/<name>) in ~/stage, which survives between
# back-to-back calls while the machine is warm. See DEVELOPERS.md "Running on the lent H200".
# A drafter carried from an earlier window (`stage.sh drafter`: drafter-<spec>.tgz.NN, the parts
# pays.sh's train phase brought back) is joined, tested (gzip's CRC) and unpacked into
# ~/stage/drafter-<spec>/, where pays.sh's bench phase finds it.
set -euo pipefail
mkdir -p ~/stage
cp -rf ".stage/$1"/* ~/stage/
for first in ~/stage/drafter-*.tgz.00; do
  [ -f "$first" ] || continue
  base=${first%.00}; dir=${base%.tgz}
  cat "$base".?? > "$base"
  gzip -t "$base" || { echo "stage.sh: $base does not test whole: bring its parts back again"; exit 1; }
  rm -rf "$dir" && mkdir -p "$dir" && tar xzf "$base" -C "$dir" && rm -f "$base" "$base".??
  echo "stage.sh: drafter unpacked into $dir ($(du -sh "$dir" | cut -f1))"
done
ls -la ~/stage
