#!/usr/bin/env bash
# On the device machine (one H200), no model staging needed (random weights; .stage/w carries the
# small wheels and specforge): every GPU-marked test, then the decode profile, then the training
# bench. Each step time-boxed; results under $OUT/r.
#   bash scripts/gpu/probe.sh [tests] [profile] [train]
set -uo pipefail
source "$(dirname "$0")/prelude.sh"
export PYTHONUNBUFFERED=1
for step in ${@:-tests profile}; do
  t0=$(date +%s)
  case $step in
    tests) timeout 300 python3 -m pytest tests -m gpu -q -p no:cacheprovider -rfEs --durations=15 \
             > "$R/gpu_tests.txt" 2>&1; tail -45 "$R/gpu_tests.txt" ;;
    profile) timeout 260 python3 scripts/profile_engine.py --budget 200 --out "$R/profile_engine" \
               > "$R/profile.log" 2>&1; grep -v Warning "$R/profile.log" | tail -40 ;;
    train) timeout 300 python3 scripts/bench_train.py --suite issue17 --out "$R/bench_train" \
             > "$R/bench_train.log" 2>&1; grep -v Warning "$R/bench_train.log" | tail -30 ;;
    *) echo "probe.sh: unknown step $step (tests, profile, train)" ;;
  esac
  echo "== $step: $(( $(date +%s) - t0 )) s"
done
