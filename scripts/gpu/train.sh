#!/usr/bin/env bash
# On the device machine (one H200): issue 17's training step. Installs the small wheels of
# .stage/w unless setup.sh already did, then runs the steps named (default: tests bench), each
# time-boxed, going on after a failure. Results (logs, bench_train.json/.md) go to $OUT/r.
#   tests  the fast step and its kernels against the references on CUDA (-m gpu)       ~90 s
#   bench  scripts/bench/bench_train.py --suite issue17: SmolLM2 geometry K=7 T=2048 Vd=32000 at
#          batch 1 and 4 (fast-triton, online, baseline, SpecForge) + Kimi-K2.5 fast at
#          batch 1; every row in its own process, time-boxed, all within 240 s            ~250 s
# Usage: bash scripts/gpu/train.sh [tests] [bench]
set -uo pipefail
source "$(dirname "$0")/prelude.sh"
for step in ${@:-tests bench}; do
  t0=$(date +%s)
  case $step in
    tests) timeout 200 python3 -m pytest tests/test_ttt.py tests/test_ttt_kernels.py -m gpu -q \
             -p no:cacheprovider -rfEs --durations=8 > "$R/tests.txt" 2>&1; tail -30 "$R/tests.txt" ;;
    bench) timeout 300 python3 scripts/bench/bench_train.py --suite issue17 --out "$R/bench_train" \
             > "$R/bench.log" 2>&1; grep -v Warning "$R/bench.log" | tail -30 ;;
    *) echo "train.sh: unknown step $step (tests, bench)" ;;
  esac
  echo "== $step: $(( $(date +%s) - t0 )) s"
done
