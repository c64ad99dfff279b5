#!/usr/bin/env bash
# On the device machine (one H200): issue 24's split target. No model and no staging chain:
# carry .stage/w (pydantic & co., DEVELOPERS.md) for the spec schema; the image has torch,
# transformers and accelerate. Results (logs, bench_split.json/.md) go to $OUT/r.
#   tests  tests/test_split.py -m gpu: a SmolLM2-like random Llama split over cuda:0 and CPU
#          memory (and device_map auto on GPU 0) captures the GPU-alone features bit for bit  ~40 s
#   bench  scripts/bench/bench_split.py: tokens/s of the same capture on one GPU, auto, and half the
#          layers in CPU memory, same call, 16 x 512 tokens x 16 batches x 3 rounds            ~60 s
# Usage: bash scripts/gpu/split.sh [tests] [bench]
set -uo pipefail
source "$(dirname "$0")/prelude.sh"
for step in ${@:-tests bench}; do
  t0=$(date +%s)
  case $step in
    tests) timeout 200 python3 -m pytest tests/test_split.py -m gpu -q -p no:cacheprovider -rfEs \
             > "$R/tests.txt" 2>&1; tail -20 "$R/tests.txt" ;;
    bench) timeout 300 python3 scripts/bench/bench_split.py --out "$R/bench_split" > "$R/bench.log" 2>&1
           grep -v -i "warn" "$R/bench.log" | tail -12 ;;
    *) echo "split.sh: unknown step $step (tests, bench)" ;;
  esac
  echo "== $step: $(( $(date +%s) - t0 )) s"
done
