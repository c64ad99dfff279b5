#!/usr/bin/env bash
# On the device machine (one H200): issues 18/19, the fused decode kernels in the engine. Sources
# prelude.sh (the small wheels, PYTHONPATH, machine.txt), then runs the steps named, each
# time-boxed, going on after a failure, and prints a compact summary
# (scripts/gpu/kernels_summary.py) at the end. Results (logs, *.json, *.md) go to
# $OUT/r; each step's exit status to $OUT/r/rc.txt (124 = its time limit).
#   engine   the engine's GPU tests: fused engine under CUDA graphs (chains, trees) lossless vs its
#            own 1-row decode, 1-row == W-row bit identity, compiled fused steps       <= 110 s
#   kernels  the kernel tests on CUDA + the gpu ones (SmolLM2 geometry)                ~90 s
#   bench    scripts/bench/bench_engine.py --random-target --random-draft, configs 4/1/5, 3/4/16,
#            5/4/8, --verify-cost 4/1/5,3/4/16, once with --kernels triton (+ HF static row),
#            once with --kernels torch (width none: 1-row decode, verify at own width) <= 2 x 80 s
#   auto     the same bench configs with the default --kernels auto (must resolve to torch:
#            kernels/switch.py), width auto, no HF rows; the quick check            <= 80 s
#   profile  scripts/bench/profile_engine.py: torch vs fused per step, kernel splits, ratios <= 70 s
#   summary  the compact table (always last; also runs alone on earlier results)
# Usage: bash scripts/gpu/kernels.sh [engine] [kernels] [bench] [auto] [profile]
# (default: engine bench profile; ~5 min on an H200, at most ~6)
set -uo pipefail
source "$(dirname "$0")/prelude.sh"
BENCH="scripts/bench/bench_engine.py --random-target --random-draft --new 96 --repeats 1 --cuda-graph \
  --configs 4/1/5,3/4/16,5/4/8 --verify-cost 4/1/5,3/4/16"
PYTEST="python3 -m pytest -q -p no:cacheprovider -rfEs --durations=8"
run() {  # name limit command...: time-boxed, output to $R/name.log, status to rc.txt
  local name=$1 limit=$2; shift 2
  local t0; t0=$(date +%s)
  timeout "$limit" "$@" > "$R/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $(( $(date +%s) - t0 ))s (limit ${limit}s)" | tee -a "$R/rc.txt"
  grep -v Warning "$R/$name.log" | tail -12
}
for step in ${@:-engine bench profile}; do
  case $step in
    engine) run engine 110 $PYTEST -m gpu tests/test_engine.py tests/test_engine_tree.py \
              tests/test_engine_fused.py tests/test_fused_decode.py ;;
    kernels) run kernels 100 $PYTEST tests/test_kernels.py tests/test_fused_decode.py \
               tests/test_profile_engine.py ;;
    bench) run bench_triton 80 python3 $BENCH --kernels triton --skip hf,hf_lookup \
             --out "$R/bench_triton"
           run bench_torch 80 python3 $BENCH --kernels torch --width none \
             --skip hf,hf_static,hf_lookup --out "$R/bench_torch" ;;
    auto) run bench_auto 80 python3 $BENCH --skip hf,hf_static,hf_lookup --out "$R/bench_auto" ;;
    profile) run profile 70 python3 scripts/bench/profile_engine.py --skip hf --budget 50 \
               --out "$R/profile_engine" ;;
    summary) ;;
    *) echo "kernels.sh: unknown step $step (engine, kernels, bench, auto, profile)" ;;
  esac
done
python3 scripts/gpu/kernels_summary.py "$R" | tee "$R/summary.md"
