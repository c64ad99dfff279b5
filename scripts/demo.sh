#!/usr/bin/env bash
# The main job on a fresh machine: set up, then run the demo spec end to end on real data
# (SmolLM2-135M-Instruct + ShareGPT, 5-16 min on 2 idle CPU cores), then query its rows.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
runner apply specs/smollm2-sharegpt.yaml "$@"
# the same rows (of the newest run that benched: a rerun with every stage up to date benches
# nothing), by the same column names, with the costs behind break_even_tau: a round costs
# draft + verify + other ms; break_even_tau = that cost / base_ms_per_token = the tau at which
# speculation pays for itself (a tau below it is slower than the target alone)
echo "why: break_even_tau = (draft + verify + other ms per round) / base_ms_per_token, the tau at which a round pays"
runner query "SELECT num_steps, eagle_topk, num_draft_tokens, round(tau, 3) AS tau, round(break_even_tau, 2) AS break_even_tau, round(draft_ms_per_round, 1) AS draft_ms_per_round, round(verify_ms_per_round, 1) AS verify_ms_per_round, round(other_ms_per_round, 1) AS other_ms_per_round, round(base_ms_per_token, 1) AS base_ms_per_token FROM bench_summary WHERE run_id = (SELECT b.run_id FROM bench_summary b JOIN runs r USING (run_id) WHERE r.spec_name = 'smollm2-sharegpt' ORDER BY r.started_at DESC LIMIT 1) ORDER BY eagle_topk, num_steps"
echo "results: runs/results.duckdb (the spec's results.path; read it with runner query, runner results, runner report)"
