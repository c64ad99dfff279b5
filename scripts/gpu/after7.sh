#!/usr/bin/env bash
# On the device machine (issue7.sh ends by calling it; call it again on the same warm machine to
# go on): run or finish the spec time-boxed (apply resumes what a time box cut), then any of: the
# GPU tests, the one-run decode table with the trained drafter, the extraction benchmark.
# Results go to $OUT/r.
#   bash scripts/gpu/after7.sh APPLY_SECONDS [tests] [engine] [extract]
source scripts/gpu/setup.sh
mkdir -p "$OUT/r"
SPEC=${SPEC:-specs/smollm2-sharegpt-gpu.yaml}   # any GPU spec; work_dir runs/<name>
# copy whatever exists to $OUT even when a stage fails or the time box ends
W=runs/$(basename "$SPEC" .yaml)
trap 'cp runs/*.duckdb "$OUT/r/" 2>/dev/null; tar czf "$OUT/r/state.tgz" runs/*.duckdb.spool $W/logs $W/bench $W/train/*/train_metrics.json 2>/dev/null; for d in $W/regenerate/*/shards; do [ -d "$d" ] && cat "$d"/part-*.jsonl.gz > "$OUT/r/regenerated.jsonl.gz"; done' EXIT
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
if [ "${1:-0}" -gt 0 ]; then
  timeout --signal=INT "$1" python3 -m runner apply $SPEC 2>&1 | tr '\r' '\n' | grep -v "it/s\]$\|tok/s\]$\|prompt/s\]$" | tail -30
  python3 -m runner query "SELECT variant, prompt_set, num_steps, round(tau,3) tau, round(spec_tok_s,1) spec, round(base_tok_s,1) base, round(speedup,3) x, lossless, flags FROM bench_summary ORDER BY 1,2,3" --results $(python3 -c "import yaml,sys; print(yaml.safe_load(open('$SPEC'))['results']['path'])")
fi
shift
for part in "$@"; do
  case $part in
    tests) timeout 150 python3 -m pytest tests/test_engine.py -m gpu -q -p no:cacheprovider 2>&1 | tail -5 ;;
    engine)
      KEY=$(python3 -c "import json; print(json.load(open('$W/state/base.export.json'))['key'][:16])")
      timeout 330 python3 scripts/bench_engine.py --draft "$W/export/$KEY" --mtbench 8 --new 256 \
        --steps 4 --cuda-graph --repeats 1 --out "$OUT/r/bench_engine" 2>&1 | grep -v Warning | tail -20 ;;
    extract)
      timeout 150 python3 scripts/bench_extract.py --device cuda --batch 8 --seq 2048 --batches 32 \
        --random-init --out "$OUT/r/bex" 2>&1 | tail -15 ;;
  esac
done
