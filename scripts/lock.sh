#!/usr/bin/env bash
# Refresh constraints.txt, the versions a fresh install gets (scripts/env.sh installs with
# `-c constraints.txt`): resolve pyproject.toml's ranges against today's registry in a NEW venv,
# then pin every package of the closure except torch's own family (torch, triton, nvidia-*,
# cuda-*), which TORCH_SPEC chooses per machine. Afterwards run both README commands
# (bash scripts/demo.sh; bash scripts/test.sh) and commit constraints.txt with the result.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
python3 -m venv "$tmp/venv"
export PIP_DISABLE_PIP_VERSION_CHECK=1
# shellcheck disable=SC2086  (TORCH_SPEC may carry pip options)
"$tmp/venv/bin/pip" install -q ${TORCH_SPEC:-torch==2.13.0}
"$tmp/venv/bin/pip" install -q -e ".[test]"
{
  echo "# The versions CI tested (scripts/env.sh installs with -c constraints.txt)."
  echo "# Refresh: bash scripts/lock.sh (resolves pyproject.toml against today's registry), then"
  echo "# run both README commands and commit. torch, triton, nvidia-* and cuda-* are left to"
  echo "# TORCH_SPEC (scripts/env.sh). Written $(date -u +%F) with $("$tmp/venv/bin/python" -V)."
  "$tmp/venv/bin/pip" freeze --exclude-editable \
    | grep -viE '^(torch|triton|nvidia-|cuda-|eagle3-runner)' | grep -v '^-e ' | LC_ALL=C sort -f
} > constraints.txt.tmp
mv constraints.txt.tmp constraints.txt
echo "constraints.txt: $(grep -vc '^#' constraints.txt) pins"
