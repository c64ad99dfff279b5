#!/usr/bin/env bash
# On the device machine (one H200): the training step (issues 17 and 37). Installs the small
# wheels of .stage/w unless setup.sh already did, then runs the steps named (default: tests
# bench), each time-boxed, going on after a failure. Results (logs, tables) go to $OUT/r.
#   tests  the fast step and its kernels against the references on CUDA (-m gpu)       ~90 s
#   bench  scripts/bench/bench_train.py --suite issue17: SmolLM2 geometry K=7 T=2048 Vd=32000 at
#          batch 1 and 4 (fast-triton, online, baseline, SpecForge) + Kimi-K2.5 fast at
#          batch 1; every row in its own process, time-boxed, all within 240 s            ~250 s
#   profile  issue 37: scripts/bench/profile_train.py --random smollm2: the online step's phases
#          (target forward ... optimizer, host) before/after the speed switches, draft vocab
#          32000 and 16000, batch 1 x 2048 and 64 packed samples; cases left after 90 s
#          are skipped                                                                   ~110 s
#   kimi   issue 37: bench_train.py --suite issue37: the Kimi-K2.5 drafter's step, ours and
#          SpecForge's, batch 1, 2 (and ours at 4); rows left after 95 s skipped              ~100 s
#   gputests  issue 37's GPU tests: the compiled embedded capture vs HF, no host sync       ~60 s
# Usage: bash scripts/gpu/train.sh [tests] [bench] [profile] [kimi] [gputests]
set -uo pipefail
source "$(dirname "$0")/prelude.sh"
for step in ${@:-tests bench}; do
  t0=$(date +%s)
  case $step in
    tests) timeout 200 python3 -m pytest tests/test_ttt.py tests/test_ttt_kernels.py -m gpu -q \
             -p no:cacheprovider -rfEs --durations=8 > "$R/tests.txt" 2>&1; tail -30 "$R/tests.txt" ;;
    bench) timeout 300 python3 scripts/bench/bench_train.py --suite issue17 --out "$R/bench_train" \
             > "$R/bench.log" 2>&1; grep -v Warning "$R/bench.log" | tail -30 ;;
    profile) timeout 125 python3 scripts/bench/profile_train.py --random smollm2 --warm 2 \
               --steps 6 --budget 90 --out "$R/profile" > "$R/profile.log" 2>&1
             grep -v Warning "$R/profile.log" | tail -45 ;;
    kimi) timeout 110 python3 scripts/bench/bench_train.py --suite issue37 --budget 95 \
            --out "$R/kimi" > "$R/kimi.log" 2>&1; grep -v Warning "$R/kimi.log" | tail -12 ;;
    gputests) timeout 150 python3 -m pytest tests/test_capture_embedded.py -m gpu -q \
                -p no:cacheprovider -rfEs > "$R/gputests.txt" 2>&1; tail -15 "$R/gputests.txt" ;;
    *) echo "train.sh: unknown step $step (tests, bench, profile, kimi, gputests)" ;;
  esac
  echo "== $step: $(( $(date +%s) - t0 )) s"
done
