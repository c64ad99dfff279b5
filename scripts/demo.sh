#!/usr/bin/env bash
# The main job on a fresh machine: set up, then run the demo spec end to end on real data
# (SmolLM2-135M-Instruct + ShareGPT, 4-7 min on 2 idle CPU cores), then query its rows.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
runner apply specs/smollm2-sharegpt.yaml "$@"
runner query "SELECT variant, prompt_set, num_steps, eagle_topk, num_draft_tokens, round(tau, 3) AS tau, round(speedup, 3) AS speedup, round(break_even_tau, 2) AS break_even_tau, flags FROM bench_summary ORDER BY run_id DESC, num_steps, eagle_topk LIMIT 10"
