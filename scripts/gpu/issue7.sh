#!/usr/bin/env bash
# On the device machine (after stage.sh a/b/c): run the GPU spec, time-boxed, resumable.
#   bash scripts/gpu/issue7.sh SECONDS
# Re-running continues where the last call stopped (extract resumes by shard, train from its
# last checkpoint). Copies the results (DuckDB spool + db, bench JSON, logs) to $OUT.
source scripts/gpu/setup.sh
mkdir -p "$OUT/r"
# copy whatever exists to $OUT even when a stage fails or the time box ends
SPEC=${SPEC:-specs/smollm2-sharegpt-gpu.yaml}   # any GPU spec; work_dir runs/<name>
W=runs/$(basename "$SPEC" .yaml)
trap 'cp runs/*.duckdb "$OUT/r/" 2>/dev/null; tar czf "$OUT/r/state.tgz" runs/*.duckdb.spool $W/logs $W/bench $W/train/*/train_metrics.json 2>/dev/null; for c in $W/regenerate/*/conversations.jsonl; do [ -f "$c" ] && gzip -c "$c" > "$OUT/r/regenerated.jsonl.gz"; done' EXIT
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
timeout --signal=INT "${1:-500}" python3 -m runner apply $SPEC 2>&1 | tr '\r' '\n' | grep -v "it/s\]$\|tok/s\]$" | tail -60
python3 -m runner query "SELECT variant, prompt_set, num_steps, round(tau,3) tau, round(spec_tok_s,1) spec, round(base_tok_s,1) base, round(speedup,3) x, lossless, flags FROM bench_summary ORDER BY 1,2,3" --results $(python3 -c "import yaml,sys; print(yaml.safe_load(open('$SPEC'))['results']['path'])")
