#!/usr/bin/env bash
# On the device machine (after stage.sh a/b/c, DEVELOPERS.md): issue 22's spec in phases, one
# per back-to-back device call; each phase is time-boxed and copies what exists to $OUT/r.
#   bash scripts/gpu/scale.sh regen SECONDS   # versions, the GPU training-kernel tests (they pick
#                                             # stages.train.kernels), then regenerate
#   bash scripts/gpu/scale.sh train SECONDS   # the base train stage alone
#   bash scripts/gpu/scale.sh apply SECONDS   # train, export, bench (base); call again to go on
#   bash scripts/gpu/scale.sh variant SECONDS NAME...   # e.g. humaneval, n5k
#   bash scripts/gpu/scale.sh sweep SECONDS NAME...     # the variants at once, one process each on
#                                             # the one GPU (training is host-bound: each has its own
#                                             # CPU cores); their tau is exact, their bench tok/s
#                                             # shares the GPU (report the sweep's tau, not its speedups)
#   bash scripts/gpu/scale.sh step SECONDS    # the Generator vs HF generate on random weights and
#                                             # prompts (bench_generate --mode step), greedy, with
#                                             # kernels torch then triton; the faster one's name goes
#                                             # to ~/stage/regen_kernels (the regen phase uses it)
#   bash scripts/gpu/scale.sh profile SECONDS # the train step's phases + kernels, and py-spy over regenerate
#   bash scripts/gpu/scale.sh gen SECONDS     # issue 16's ratio: HF generate vs the engine, same
#                                             # prompts and answer lengths (bench_generate compare)
# Overrides that enter cache keys (the kernels the tests picked, EXTRA_O) are kept in ~/stage so
# every phase passes the same ones: a stage computed in one call is up to date in the next.
source scripts/gpu/setup.sh
mkdir -p "$OUT/r"
if [ -f ~/stage/regenerated.jsonl.gz ] && [ ! -f "$EAGLE3_CACHE/regen/regenerated.jsonl.gz" ]; then
  mkdir -p "$EAGLE3_CACHE/regen" && cp ~/stage/regenerated.jsonl.gz "$EAGLE3_CACHE/regen/"  # the
fi  # brought-back conversations of specs/smollm2-scale-gpu-trained.yaml (DEVELOPERS.md)
SPEC=${SPEC:-specs/smollm2-scale-gpu.yaml}
W=runs/$(basename "$SPEC" .yaml)
RES=$(python3 -c "import yaml; print(yaml.safe_load(open('$SPEC'))['results']['path'].replace('../', ''))")
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
bring_back() {
  cp runs/*.duckdb "$OUT/r/" 2>/dev/null
  tar czf "$OUT/r/state.tgz" runs/*.duckdb.spool $W/logs $W/state $W/bench $W/regenerate/*/report.json \
    $W/train/*/train_metrics.json $W/export/*/inspect*.json 2>/dev/null
  for d in $W/regenerate/*/shards; do
    [ -d "$d" ] && cat "$d"/part-*.jsonl.gz | split -b 15M -d - "$OUT/r/regenerated.jsonl.gz."
  done
}
trap bring_back EXIT
apply() {  # apply [runner apply args...] within $LIMIT seconds; progress bars dropped
  # (none left: skipped, since `timeout 0` would not limit it at all)
  [ "$LIMIT" -gt 0 ] || { echo "runner apply $*: skipped, no time left of the phase"; return; }
  timeout --signal=INT "$LIMIT" python3 -m eagle3_runner.runner apply "$SPEC" -o "stages.train.kernels=$(cat ~/stage/train_kernels)" \
    $(cat ~/stage/extra_o 2>/dev/null) "$@" 2>&1 | tr '\r' '\n' | grep -v "it/s\]$\|tok/s\]$\|prompt/s\]$\|s/it\]$" | tail -40
}
phase=$1; LIMIT=$2; shift 2
T0=$SECONDS
case $phase in
  regen)
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
    python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
    git log -1 --format='commit %h %s' 2>/dev/null || true
    # the decode attention the step phase measured faster (stages.regenerate.kernels)
    RK=""; [ -f ~/stage/regen_kernels ] && RK="-o stages.regenerate.kernels=$(cat ~/stage/regen_kernels)"
    echo "${EXTRA_O:-} $RK" > ~/stage/extra_o
    cat ~/stage/extra_o
    if [ -n "${TRAIN_KERNELS:-}" ]; then  # chosen by an earlier run's GPU tests (BENCHMARKS.md)
      echo "$TRAIN_KERNELS" > ~/stage/train_kernels
    elif timeout 100 python3 -m pytest tests/test_ttt_kernels.py -m gpu -q -x -p no:cacheprovider 2>&1 | tail -4 | tee "$OUT/r/train_kernel_tests.txt" | grep -q " passed" \
       && ! grep -q "failed\|error" "$OUT/r/train_kernel_tests.txt"; then
      echo triton > ~/stage/train_kernels
    else
      echo torch > ~/stage/train_kernels
    fi
    echo "train kernels: $(cat ~/stage/train_kernels) (after $((SECONDS - T0)) s)"
    LIMIT=$((LIMIT - (SECONDS - T0)))
    apply --only regenerate ;;
  train) apply --variant base --only train ;;  # the train stage alone (its call's whole limit)
  apply) apply --variant base ;;
  gen) timeout "$LIMIT" python3 scripts/bench/bench_generate.py --mode compare --prompts 512 --new 256 \
         --rows 512 --hf-batch 512 --cuda-graph --quiet --out "$OUT/r/bench_generate" 2>&1 | tail -12 ;;
  step)
    for kn in torch triton; do  # HF generate once (with torch), the same prompts
      HF=512; [ $kn = triton ] && HF=0
      timeout $((LIMIT - (SECONDS - T0))) python3 scripts/bench/bench_generate.py --mode step --random-target \
        --modes greedy --prompts 1024 --rows 512 --prompt-len 128 --new 256 --hf-batch $HF \
        --cuda-graph --kernels $kn --out "$OUT/r/bench_step_$kn" 2>&1 | grep -v -i warn | tail -14
    done
    python3 - "$OUT/r" <<'PY' | tee ~/stage/regen_kernels
import json, sys
try:  # triton reads each row's own length (real data mixes them): it may be up to 5% slower here
    ms = {k: json.load(open(f"{sys.argv[1]}/bench_step_{k}.json"))["step"]["greedy"]["ms_per_step"]
          for k in ("torch", "triton")}
    print("triton" if ms["triton"] <= 1.05 * ms["torch"] else "torch")
except Exception:  # a failed run: the default path
    print("torch")
PY
    ;;
  profile)  # where the time goes: the train step's phases and kernels (scripts/bench/profile_train.py) on
    # the brought-back conversations, then 90 s of regeneration sampled by py-spy (host stacks)
    timeout $((LIMIT / 2)) python3 scripts/bench/profile_train.py specs/smollm2-scale-gpu-trained.yaml \
      -o stages.train.kernels=triton --steps 30 --warm 40 --out "$OUT/r" 2>&1 | grep -v Warn | tail -45
    PS=/tmp/site/bin/py-spy; LIMIT=$((LIMIT - (SECONDS - T0)))
    timeout --signal=INT $LIMIT $PS record -r 50 --format raw -o "$OUT/r/regen_spy.txt" -- \
      python3 -m eagle3_runner.runner apply specs/smollm2-scale-gpu.yaml --only regenerate \
      -o stages.regenerate.kernels=triton -o stages.regenerate.max_minutes=1.5 2>&1 \
      | tr '\r' '\n' | grep -v "it/s\]$\|tok/s\]$" | tail -15
    python3 -c "import json,glob; [print(f, {k: v for k, v in json.load(open(f))['regenerate'].items() if 'share' in k or 'use' in k or 'per_s' in k or 'seconds' in k}) for f in glob.glob('runs/smollm2-scale-gpu/regenerate/*/report.json')]" ;;
  variant) L0=$LIMIT; for v in "$@"; do LIMIT=$((L0 - (SECONDS - T0))); apply --variant "$v"; done ;;
  sweep)
    export OMP_NUM_THREADS=$(( $(nproc) / $# ))
    for v in "$@"; do apply --variant "$v" > "/tmp/sweep_$v.log" 2>&1 & done
    wait
    for v in "$@"; do echo "== $v"; tail -12 "/tmp/sweep_$v.log"; done ;;
esac
python3 -m eagle3_runner.runner query "SELECT variant, stage, round(duration_s,1) s FROM stages ORDER BY started_at" --results "$RES" 2>&1 | tail -20
python3 -m eagle3_runner.runner query "SELECT variant, train_samples, prompt_set, num_steps, eagle_topk k, num_draft_tokens n, round(tau,3) tau, round(spec_tok_s,1) spec, round(base_tok_s,1) base, round(speedup,3) x, lossless FROM bench_summary ORDER BY 1,3,4,5" --results "$RES" 2>&1 | tail -20
echo "phase $phase: $((SECONDS - T0)) s"
