#!/usr/bin/env bash
# On the device machine (after stage.sh a/b/c): print the machine's versions, then run the GPU
# spec time-boxed and resumable, copying the results to $OUT/r (after7.sh does both).
#   [SPEC=specs/...yaml] bash scripts/gpu/issue7.sh SECONDS
# Re-running continues where the last call stopped (extract resumes by shard, train from its
# last checkpoint).
source scripts/gpu/setup.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
exec bash scripts/gpu/after7.sh "${1:-500}"
