#!/usr/bin/env bash
# On a 2-GPU device machine (nvidia-h200-x2, after stage.sh a/b/c): one phase of a GPU spec as two
# processes at once, one per GPU. Each `runner apply --variant ...` runs its own variants (and the
# shared stages they need); the results store takes parallel writers through its spool. Results
# go to $OUT/r, also when the time box ends a stage.
#   SPEC=specs/smollm2-regen-gpu.yaml bash scripts/gpu/x2.sh train SECONDS
#       GPU0: base (regenerate, extract, train, export, bench); GPU1, once extract is complete:
#       the data-scaling variants ($SCALE, default "n500 n2000")
#   ... x2.sh bench SECONDS     GPU0: what base still misses; GPU1: what $SCALE still misses
#   ... x2.sh extras SECONDS    GPU1: the humaneval variant's bench; GPU0: the one-run decode
#       table (scripts/bench/bench_engine.py, trained drafter), the GPU tests, the root diagnostic
# Each time box is per process; the call ends when both are done. A stage that the other process
# is computing fails at once with a clear error (its lock file), so a wrong split costs a rerun,
# never a corrupted artifact. OMP_NUM_THREADS=8: without it two training processes ran at half
# speed each (1.8 instead of 3.7 steps/s, 2026-11-29).
source scripts/gpu/setup.sh
mkdir -p "$OUT/r"
SPEC=${SPEC:-specs/smollm2-regen-gpu.yaml}
SCALE=${SCALE:-n500 n2000}
W=runs/$(basename "$SPEC" .yaml)
DB=$(python3 -c "import yaml; print(yaml.safe_load(open('$SPEC'))['results']['path'])")
X=/tmp/xr; mkdir -p $X   # script outputs and logs: they come back inside state.tgz (8 files at most)
trap 'cp runs/*.duckdb "$OUT/r/" 2>/dev/null; cp /tmp/gpu*.log $X/ 2>/dev/null; tar czf "$OUT/r/state.tgz" runs/*.duckdb.spool $W/logs $W/bench $W/train/*/train_metrics.json $X 2>/dev/null; [ "$1" = train ] && for d in $W/regenerate/*/shards; do [ -d "$d" ] && cat "$d"/part-*.jsonl.gz > "$OUT/r/regenerated.jsonl.gz"; done' EXIT
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
T=${2:-500}
START=$(date +%s)

apply_on() {  # GPU SECONDS LOG variant...
  local gpu=$1 secs=$2 log=$3; shift 3
  local args=(); for v in "$@"; do args+=(--variant "$v"); done
  CUDA_VISIBLE_DEVICES=$gpu timeout --signal=INT "$secs" python3 -m eagle3_runner.runner apply "$SPEC" "${args[@]}" \
    > "$log" 2>&1
  echo "GPU$gpu apply ${*}: rc $? after $(( $(date +%s) - START )) s"
}

case $1 in
  train)
    apply_on 0 "$T" /tmp/gpu0.log base &
    ( while ! ls $W/extract/*/artifact.json >/dev/null 2>&1; do
        sleep 5; [ $(( $(date +%s) - START )) -ge "$T" ] && exit 0
      done
      echo "extract complete after $(( $(date +%s) - START )) s"
      apply_on 1 $(( T - ($(date +%s) - START) )) /tmp/gpu1.log $SCALE ) &
    wait ;;
  bench)
    apply_on 0 "$T" /tmp/gpu0.log base &
    apply_on 1 "$T" /tmp/gpu1.log $SCALE &
    wait ;;
  extras)
    apply_on 1 "$T" /tmp/gpu1.log humaneval &
    KEY=$(python3 -c "import json; print(json.load(open('$W/state/base.export.json'))['key'][:16])")
    ( export CUDA_VISIBLE_DEVICES=0
      timeout 270 python3 scripts/bench/bench_engine.py --draft "$W/export/$KEY" --mtbench 4 --new 256 \
        --steps 4 --cuda-graph --repeats 1 --out $X/bench_engine > /tmp/gpu0.log 2>&1
      timeout 120 python3 -m pytest tests/test_engine.py tests/test_bench_engine.py -m gpu -q \
        -p no:cacheprovider >> /tmp/gpu0.log 2>&1
      timeout 100 python3 scripts/bench/diag_roots.py --draft "$W/export/$KEY" --prompts 8 --new 256 \
        --steps 4 --device cuda --out $X/diag_roots.json >> /tmp/gpu0.log 2>&1 ) &
    wait ;;
  *) echo "usage: x2.sh train|bench|extras SECONDS" >&2; exit 2 ;;
esac
for f in /tmp/gpu0.log /tmp/gpu1.log; do
  echo "== $f"; tr '\r' '\n' < "$f" 2>/dev/null | grep -v "it/s\]$\|tok/s\]$\|prompt/s\]$\|Warning" | tail -25
done
python3 -m eagle3_runner.runner query "SELECT variant, prompt_set, num_steps, round(tau,3) tau, round(spec_tok_s,1) spec, round(base_tok_s,1) base, round(speedup,3) x, lossless, flags FROM bench_summary ORDER BY 1,2,3" --results "$DB"
