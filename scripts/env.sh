# Sourced by scripts/demo.sh and scripts/test.sh: a venv with the CPU build of torch, the project
# (editable, its dependencies at the versions of constraints.txt: what CI tested) and the pinned
# demo assets. Idempotent: re-running installs nothing new, unless pyproject.toml or
# constraints.txt changed since this venv was made (then it installs again).
# EAGLE3_UNPINNED=1 resolves against today's registry instead (within pyproject.toml's bounds).
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
PIN=(-c "$ROOT/constraints.txt")
[ "${EAGLE3_UNPINNED:-0}" = 1 ] && PIN=()
STAMP="$(cat "$ROOT/pyproject.toml" "$ROOT/constraints.txt" | sha256sum | cut -c1-16)${PIN[*]:+-pinned}"
if [ "$(cat "$VENV/.eagle3-installed" 2>/dev/null)" != "$STAMP" ] \
    || ! python -c "import eagle3_runner, duckdb, pydantic, transformers, gguf, submitit" 2>/dev/null; then
  pip install -q "${PIN[@]}" -e "$ROOT[test]"
  echo "$STAMP" > "$VENV/.eagle3-installed"
fi
runner fetch all
