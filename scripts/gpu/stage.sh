#!/usr/bin/env bash
# On the device machine: keep one carried batch (.stage/<name>) in ~/stage, which survives between
# back-to-back calls while the machine is warm. See DEVELOPERS.md "Running on the lent H200".
# A drafter carried from an earlier window (`stage.sh drafter`: drafter-<spec>.tgz.NN, the parts
# pays.sh's train phase brought back) is joined, tested (gzip's CRC, then tar's listing) and
# unpacked into ~/stage/drafter-<spec>/, where pays.sh's bench phase finds it; a join that fails
# leaves nothing of it in ~/stage. A staged gzip JSONL with a sha256sum sidecar (`stage.sh turns`:
# sharegpt-turns4.jsonl.gz; `stage.sh regen`) is checked against it; one that differs is removed.
set -euo pipefail
[ $# -eq 1 ] || { echo "usage: stage.sh NAME   (copies .stage/NAME/* into ~/stage)" >&2; exit 2; }
src=".stage/$1"
[ -d "$src" ] || { echo "stage.sh: $src is not a folder here: carry it (run's carry [\"$src\"])" >&2; exit 1; }
[ -n "$(ls -A "$src")" ] || { echo "stage.sh: $src is empty: nothing to stage" >&2; exit 1; }
mkdir -p ~/stage
cp -rf "$src"/* ~/stage/
fail() {  # a join that cannot be used: said, and nothing of it left in ~/stage
  echo "stage.sh: $1" >&2; rm -rf "$2" "$2".??; exit 1
}
for sum in "$src"/*.jsonl.gz.sha256; do
  [ -e "$sum" ] || continue
  f=$(basename "$sum" .sha256)
  (cd ~/stage && sha256sum -c --quiet "$f.sha256") || fail "$f differs from its $f.sha256: carry .stage/$1 again" ~/stage/"$f"
done
for part in ~/stage/drafter-*.tgz.[0-9][0-9]; do
  [ -e "$part" ] || continue
  base=${part%.??}
  [ -e "$base.00" ] || fail "$(basename "$part") has no $(basename "$base").00 beside it: bring every part back" "$base"
done
for first in ~/stage/drafter-*.tgz.00; do
  [ -e "$first" ] || continue
  base=${first%.00}; dir=${base%.tgz}
  parts=$(cd ~/stage && ls -d "$(basename "$base")".?? | tr '\n' ' ')
  for p in "$base".??; do [ -f "$p" ] || fail "$p is not a file" "$base"; done
  cat "$base".?? > "$base"
  gzip -t "$base" 2>/dev/null || fail "the parts $parts do not join into a whole gzip: one is missing, cut, extra or from another set; bring the parts of one train phase back again" "$base"
  tar tzf "$base" >/dev/null 2>&1 || fail "$(basename "$base") is gzip but not a tar archive: not a drafter pays.sh brought back" "$base"
  rm -rf "$dir" && mkdir -p "$dir"
  tar xzf "$base" -C "$dir" || fail "$(basename "$base") did not unpack" "$base"
  [ -f "$dir/config.json" ] || { rm -rf "$dir"; fail "$(basename "$base") holds no config.json: not an exported drafter" "$base"; }
  rm -f "$base" "$base".??
  echo "stage.sh: drafter unpacked into $dir ($(du -sh "$dir" | cut -f1))"
done
ls -la ~/stage
