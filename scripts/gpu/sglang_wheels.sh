#!/usr/bin/env bash
# Here, once (a machine with PyPI and the fetched assets; DEVELOPERS.md "SGLang on the H200"):
# download the pinned wheels of scripts/gpu/sglang_pins.txt ([sgl] into .whl/sglang, [runner]
# into .whl/runner; files already there are reused), repack sglang-kernel without FA3, cut the
# training subset of ShareGPT, and pack everything with the SmolLM2 GGUF (split in parts) into
# the git-ignored batches .stage/sgl/1..N of at most MAX_MB each (scripts/gpu/pack_stage.py).
#   bash scripts/gpu/sglang_wheels.sh            # MAX_MB=58 N_CONV=4000 PY=.venv/bin/python
#   FIRST=1: also every ShareGPT conversation up to its first answer (sharegpt-first.jsonl.gz,
#   the prompts of specs/smollm2-pays-gpu.yaml's regenerate stage)
#   PEER_ONLY=1: only the batch .stage/peer (below), leaving .stage/sgl as it is
#   TURNS_ONLY=1: only the batch .stage/turns, leaving .stage/sgl as it is: every ShareGPT
#   conversation up to its fourth answer, the conversations of sharegpt-first.jsonl.gz in its
#   order (sharegpt_subset.py --keep-as 1: the same real-NNNNNN ids), with its sha256sum sidecar
#   (21.3 MB; `stage.sh turns` in a call of its own checks it, sglang_setup.sh puts it in
#   $EAGLE3_CACHE/sharegpt/): the later turns a grown carried set answers (DEVELOPERS.md item 20)
# It also writes .stage/peer: the [peer] pins (SpecForge 0.2.0, 0.4 MB, for
# scripts/bench/specforge_peer.py: issue 44's peer run) with their sha256 in peer.sha256. Carried
# beside .stage/sgl/4 (34 MB together) and staged with `stage.sh peer`, its wheel lands at the top
# of ~/stage, so setup.sh installs it into /tmp/site with the runner's wheels (the image's
# transformers 5.17 and torch 2.11: its code path needs nothing else, scripts/bench/specforge_peer.py
# SPECFORGE_MODULES); scripts/gpu/recipe.sh checks peer.sha256.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
PINS=scripts/gpu/sglang_pins.txt
W=.whl/sglang R=.whl/runner D=.whl/data P=.whl/peer
MAX_MB=${MAX_MB:-58} N_CONV=${N_CONV:-4000}
section() {  # the pins under "# [$1]"
  awk -v s="# [$1]" 'index($0, "# [") == 1 {on = index($0, s) == 1; next}
                     on && NF && $1 !~ /^#/ {print $1}' "$PINS"
}
download() {  # download DIR REQ...: cp312 manylinux or pure-Python wheels, no dependencies
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$@"  # pip matches N exactly
}
peer_batch() {  # .stage/peer: the [peer] wheels and their sha256 (peer.sha256)
  mkdir -p "$P"
  download "$P" $(section peer)
  rm -rf .stage/peer && mkdir -p .stage/peer
  for pin in $(section peer); do  # name==version -> its wheel (pip writes _ for - in names)
    n=${pin%%==*}; v=${pin##*==}
    f=$(ls "$P"/"${n//-/_}"-"$v"-*.whl 2>/dev/null | head -1)
    [ -n "$f" ] || { echo "sglang_wheels.sh: no wheel for $pin in $P" >&2; exit 1; }
    cp "$f" .stage/peer/
  done
  (cd .stage/peer && sha256sum *.whl > peer.sha256)
  du -sh .stage/peer
}
turns_batch() {  # .stage/turns: sharegpt-turns4.jsonl.gz and its sha256
  local f=.stage/turns/sharegpt-turns4.jsonl.gz
  mkdir -p .stage/turns
  [ -f "$f" ] || { "$PY" scripts/gpu/sharegpt_subset.py "$f.tmp" --n 1000000 --turns 4 \
                     --keep-as 1 && mv "$f.tmp" "$f"; }
  (cd .stage/turns && sha256sum "$(basename "$f")" > "$(basename "$f").sha256")
  du -sh .stage/turns
}
if [ "${PEER_ONLY:-0}" = 1 ]; then peer_batch; exit 0; fi
if [ "${TURNS_ONLY:-0}" = 1 ]; then turns_batch; exit 0; fi
mkdir -p "$W/repacked" "$R" "$D"
download "$W" $(section sgl)
download "$R" $(section runner)
KERNEL=$(ls "$W"/sglang_kernel-0.4.4-*.whl)
[ -f "$W/repacked/$(basename "$KERNEL")" ] || "$PY" scripts/gpu/repack_wheel.py "$KERNEL" "$W/repacked"
[ -f "$D/sharegpt-$N_CONV.jsonl.gz" ] || \
  "$PY" scripts/gpu/sharegpt_subset.py "$D/sharegpt-$N_CONV.jsonl.gz" --n "$N_CONV"
DATA=("$D/sharegpt-$N_CONV.jsonl.gz")
if [ "${FIRST:-0}" = 1 ]; then
  [ -f "$D/sharegpt-first.jsonl.gz" ] || \
    "$PY" scripts/gpu/sharegpt_subset.py "$D/sharegpt-first.jsonl.gz" --n 1000000 --turns 1
  DATA+=("$D/sharegpt-first.jsonl.gz")
fi
CACHE=${EAGLE3_CACHE:-$HOME/.cache/eagle3-runner}
cp -f "$CACHE/mtbench/question.jsonl" "$CACHE/humaneval/HumanEval.jsonl.gz" "$D/"  # the extract
# stage's contamination guard reads every bench set (data/contamination.py), HumanEval included
args=()
for f in "$W"/*.whl; do  # the original kernel stays here; its repacked copy travels
  [ "$f" = "$KERNEL" ] || args+=("sgl=$f")
done
args+=("sgl=$W/repacked/$(basename "$KERNEL")")
for f in "$R"/*.whl "${DATA[@]}" "$D/question.jsonl" "$D/HumanEval.jsonl.gz"; do
  args+=(".=$f")
done
"$PY" scripts/gpu/pack_stage.py --out .stage/sgl --max-mb "$MAX_MB" \
  --split ".=$CACHE/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" "${args[@]}"
n_sgl=$(section sgl | wc -l); n_run=$(section runner | wc -l)
got_sgl=$(awk '$2 ~ /^sgl\// && $2 ~ /\.whl$/' .stage/sgl/MANIFEST.txt | wc -l)
got_run=$(awk '$2 !~ /^sgl\// && $2 ~ /\.whl$/' .stage/sgl/MANIFEST.txt | wc -l)
if [ "$got_sgl" != "$n_sgl" ] || [ "$got_run" != "$n_run" ]; then
  echo "sglang_wheels.sh: packed $got_sgl/$n_sgl [sgl] and $got_run/$n_run [runner] wheels:" \
       "a pin matched no wheel, or a stale wheel is in $W or $R" >&2
  exit 1
fi
cp .stage/sgl/MANIFEST.txt ".stage/sgl/$(ls -d .stage/sgl/[0-9]* | wc -l)/"
du -sh .stage/sgl/[0-9]*
peer_batch
