#!/usr/bin/env bash
# The test suite on a fresh machine: set up, start a one-node Slurm when possible (root + apt),
# then pytest. GPU tests are skipped without CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
python -c "import specforge" 2>/dev/null || pip install -q --no-deps specforge==0.2.0 || true
if [ -f scripts/slurm-up.sh ] && [ "$(id -u)" = 0 ] && [ "${NO_SLURM:-0}" != 1 ]; then
  if up="$(bash scripts/slurm-up.sh 2>&1)"; then
    echo "$up" >&2
    # stop only a cluster this run started; leave someone else's running
    case "$up" in *"already running"*) ;; *) trap 'bash scripts/slurm-down.sh || true' EXIT ;; esac
  else
    echo "$up" >&2; echo "slurm-up failed: Slurm tests will be skipped" >&2
    bash scripts/slurm-down.sh || true  # what the failed start left (daemons, state folder)
    if [ "${CI:-}" = true ]; then echo "CI needs the real Slurm cluster" >&2; exit 1; fi
  fi
fi
python -m pytest -q --durations=15 "$@"  # no arguments: pyproject testpaths (tests/); or e.g. tests/test_spec.py -x
