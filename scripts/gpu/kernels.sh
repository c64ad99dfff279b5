#!/usr/bin/env bash
# On the device machine (one H200): issue 19's fused decode kernels. Installs the small wheels
# of .stage/w (pydantic & co.: jobs/llama.py imports runner.spec) unless setup.sh already did,
# then runs the steps named (default: tests profile), each time-boxed, going on after a failure.
# Results (logs, profile_engine.json/.md, bench_engine.json/.md) go to $OUT/r.
#   tests    the kernel tests on CUDA + the gpu ones (SmolLM2 geometry, CUDA graphs)   ~90 s
#   profile  scripts/profile_engine.py: torch vs fused, kernel splits, the issue's ratios ~150 s
#   bench    scripts/bench_engine.py --random-target --random-draft (the torch path today) ~250 s
# Usage: bash scripts/gpu/kernels.sh [tests] [profile] [bench]
set -uo pipefail
source "$(dirname "$0")/prelude.sh"
for step in ${@:-tests profile}; do
  t0=$(date +%s)
  case $step in
    tests) timeout 240 python3 -m pytest tests/test_kernels.py tests/test_fused_decode.py \
             tests/test_profile_engine.py -q -p no:cacheprovider -rfEs --durations=12 \
             > "$R/tests.txt" 2>&1; tail -40 "$R/tests.txt" ;;
    profile) timeout 420 python3 scripts/profile_engine.py --budget 330 --out "$R/profile_engine" \
               > "$R/profile.log" 2>&1; grep -v Warning "$R/profile.log" | tail -45 ;;
    bench) timeout 330 python3 scripts/bench_engine.py --random-target --random-draft --new 256 \
             --repeats 3 --cuda-graph --steps 4 --out "$R/bench_engine" 2>&1 | grep -v Warning \
             | tail -20 ;;
    *) echo "kernels.sh: unknown step $step (tests, profile, bench)" ;;
  esac
  echo "== $step: $(( $(date +%s) - t0 )) s"
done
