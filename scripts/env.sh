# Sourced by scripts/demo.sh and scripts/test.sh: a venv with the CPU build of torch, the project
# (editable) and the pinned demo assets. Idempotent; re-running installs nothing new.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"
export PIP_DISABLE_PIP_VERSION_CHECK=1
python -c "import torch" 2>/dev/null || {
  # Install the CPU build explicitly FIRST: an open range would pull a multi-GB CUDA build.
  # Set TORCH_SPEC to use another build, e.g. TORCH_SPEC="torch==2.11.0" on a GPU box.
  # shellcheck disable=SC2086  (TORCH_SPEC may carry pip options)
  pip install -q ${TORCH_SPEC:-torch==2.13.0}
}
python -c "import runner, duckdb, pydantic, transformers, gguf, submitit" 2>/dev/null \
  || pip install -q -e "$ROOT[test]"
runner fetch all
