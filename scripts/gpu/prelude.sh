# Sourced by train.sh, split.sh and sglang_target.sh on the device machine: R=$OUT/r, the small wheels of
# .stage/w in /tmp/site (unless setup.sh installed them), PYTHONPATH, and the machine's GPU,
# driver, torch/triton versions and commit in $R/machine.txt.
R=${OUT:-/tmp/out}/r; mkdir -p "$R"
if [ ! -d /tmp/site/pydantic ] && [ -d .stage/w ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .stage/w/*.whl
elif [ ! -d /tmp/site/specforge ] && ls .stage/w/specforge-*.whl >/dev/null 2>&1; then
  # after an SGLang staging chain (its runner wheels are in): SpecForge alone, for the peer rows
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .stage/w/specforge-*.whl
fi
# the repository root is the package eagle3_runner: import it through a link of that name
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/eagle3_runner
export PYTHONPATH=/tmp/site:/tmp/pkg
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$R/machine.txt" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
  >> "$R/machine.txt" 2>&1
git rev-parse --short HEAD >> "$R/machine.txt" 2>&1
cat "$R/machine.txt"
