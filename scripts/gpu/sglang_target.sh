#!/usr/bin/env bash
# On the device machine (one H200), issue 35: SGLang as the target, against our own paths, on
# the fetched SmolLM2-135M. Needs the staging chain (stage.sh a, b, c: the GGUF, gguf/pydantic,
# ShareGPT) and the SGLang 0.5.14 install of issue 34: an interpreter $SGLANG_PYTHON (default
# ~/sglang-python) that imports sglang and, through PYTHONPATH /tmp/site, eagle3_runner.
# Everything lands in $OUT/r (results JSON/MD, pytest output, raw recordings, the fixtures
# converted from them, server logs as logs.tgz), whatever step fails.
#   regen    bench_sglang_target.py regen: 2,048 ShareGPT first turns x <= 256 new tokens through
#            the SGLang server (1,024 in flight, calls of 64, CUDA graphs to 512) and through our
#            Generator (1,024 rows, CUDA graphs), same answer lengths; regenerate() through SGLang
#            on the same 2,048 prompts (`stage_same`: issue 45's ratio to the raw rate, >= 0.9
#            wanted, and both passes' request windows); regenerate() end to end through SGLang
#            for 1 minute (10k real + 90k synthetic asked); a recorded small run           ~245 s
#   capture  bench_sglang_target.py capture: 512 ShareGPT samples (max_length 2048) through
#            transformers, our packed Llama capture (online training's embedded path) and one
#            SGLang capture server (json and file transports), 20 s boxes; a recorded capture of
#            short prompts                                                                     ~220 s
#   equal    tests/test_sglang_target_gpu.py -m gpu: the runner's capture server (file, json)
#            equals the HF features within bf16 tolerance, same manifest                       ~170 s
#   stage    regenerate() through SGLang for 4.5 minutes (the 100k-conversations target; no
#            embedded run)                                                                     ~380 s
# Usage: bash scripts/gpu/sglang_target.sh [regen] [capture] [equal] [stage]   (default: regen)
set -uo pipefail
if [ -d ~/stage ]; then source "$(dirname "$0")/setup.sh" > /dev/null 2>&1; fi
source "$(dirname "$0")/prelude.sh"
export EAGLE3_CACHE=${EAGLE3_CACHE:-$HOME/eagle3-cache}
export EAGLE3_SGLANG_PYTHON=${SGLANG_PYTHON:-$HOME/sglang-python}
mkdir -p "$R/logs" "$R/raw" "$R/fixtures"
"$EAGLE3_SGLANG_PYTHON" -c "import sglang; print('sglang', sglang.__version__)" >> "$R/machine.txt" 2>&1
# the ShareGPT subset of the SGLang staging chain (scripts/gpu/sglang_wheels.sh) when the full
# dataset was not fetched
SUB=$(ls "$EAGLE3_CACHE"/sharegpt/sharegpt-*.jsonl.gz 2>/dev/null | head -1)
B="python3 scripts/bench/bench_sglang_target.py --sglang-python $EAGLE3_SGLANG_PYTHON ${SUB:+--data $SUB}"
for step in ${@:-regen}; do
  t0=$(date +%s)
  case $step in
    regen) timeout 310 $B regen --prompts 2048 --new 256 --in-flight 1024 --per-call 64 \
             --rows 1024 --e2e-minutes 1 --box 40 --record "$R/raw" --out "$R/regen" \
             > "$R/regen.log" 2>&1; tail -25 "$R/regen.log" ;;
    capture) timeout 270 $B capture --samples 512 --max-length 2048 --box 20 --record "$R/raw" \
               --out "$R/capture" > "$R/capture.log" 2>&1; tail -25 "$R/capture.log" ;;
    equal) timeout 300 python3 -m pytest tests/test_sglang_target_gpu.py -m gpu -q -s \
             -p no:cacheprovider -rfEs > "$R/equal.txt" 2>&1; tail -20 "$R/equal.txt" ;;
    stage) timeout 420 $B regen --prompts 64 --new 256 --in-flight 1024 --per-call 64 \
             --e2e-minutes 4.5 --e2e-real 10000 --e2e-synthetic 90000 --skip-embedded \
             --out "$R/stage" > "$R/stage.log" 2>&1; tail -25 "$R/stage.log" ;;
    *) echo "sglang_target.sh: unknown step $step (regen, capture, equal, stage)" ;;
  esac
  echo "== $step: $(( $(date +%s) - t0 )) s" | tee -a "$R/steps.txt"
done
# the CPU tests' fixtures from what was recorded (copy them to tests/data/sglang_target/)
for kind in generate capture; do
  if [ -s "$R/raw/$kind.jsonl" ]; then
    python3 scripts/bench/sglang_record.py convert "$R/raw/$kind.jsonl" \
      "$R/fixtures/smollm2-0.5.14-$kind.json" --meta "$R/raw/$kind.meta.json" >> "$R/steps.txt" 2>&1
  fi
done
tar czf "$R/logs.tgz" -C "$R" logs raw 2>/dev/null && rm -rf "$R/logs" "$R/raw"
ls -laR "$R"
# one call brings back at most 8 files: everything in one archive, the step summary beside it
cp "$R/steps.txt" "$OUT/sglang_target-steps.txt" 2>/dev/null
tar czf "$OUT/sglang_target.tgz" -C "$(dirname "$R")" "$(basename "$R")" && rm -rf "$R"
