#!/usr/bin/env bash
# On the device machine: keep one carried batch (.stage/a|b|c) in ~/stage, which survives between
# back-to-back calls while the machine is warm. See DEVELOPERS.md "Running on the lent H200".
set -euo pipefail
mkdir -p ~/stage
cp -rf ".stage/$1"/* ~/stage/
ls -la ~/stage
