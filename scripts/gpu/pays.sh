#!/usr/bin/env bash
# On the device machine, after the .stage/sgl staging calls (DEVELOPERS.md "A drafter that pays"):
# specs/smollm2-pays-gpu.yaml in three phases, one device call each, each time-boxed (SIGINT at
# SECONDS); every phase brings what exists back to $OUT/r whatever happens (an EXIT trap).
#   bash scripts/gpu/pays.sh regen SECONDS  # setup, versions; the embedded capture's GPU tests in
#                                           # the background (their verdict picks
#                                           # stages.train.online_capture for the train phase);
#                                           # regenerate, then scripts/bench/warm_bench.py (the
#                                           # bench's compiles); the regenerated set comes back
#                                           # compressed with its sha256 (regen-*.jsonl.gz*)
#   bash scripts/gpu/pays.sh train SECONDS  # train + export (checkpoints every 2 minutes: a call
#                                           # cut short resumes in the next); the exported
#                                           # drafter comes back (drafter-<name>.tgz.NN)
# Every phase writes results.json (`runner results --json`) where $OUT's 8 files have room.
#   bash scripts/gpu/pays.sh bench SECONDS  # the bench (both engines, the curve; it resumes what
#                                           # an earlier call measured); results.json =
#                                           # `runner results --json` of the run. With no export
#                                           # on this machine and a drafter carried from an
#                                           # earlier window (stage.sh drafter), it benches that
#                                           # one (stages.bench.drafter, curve 0)
# apply gets SECONDS less RESERVE (45 s: the stop of SGLang's servers and the copy to $OUT); its
# output streams into $OUT/r/<phase>.log as it is written, each line after the call's seconds so
# far (where a window's minutes went), the phase's tables after it.
# WARM_AFTER=S moves warm_bench from the regen phase to the train phase, S seconds into it (after
# the train stage's set-up and compile, on half the cores): the compiles then cost the window no
# minutes of their own. GPU_TESTS=0 skips the capture GPU tests (the train phase then keeps the
# spec's online capture: they passed on the H100 on 2026-12-07).
# Overrides that enter cache keys (EXTRA_O, the online capture the tests picked) are kept in
# ~/stage so every phase passes the same ones: a stage computed in one call is up to date in the
# next. A call that sets EXTRA_O replaces the kept one; one that does not reuses it.
# A drafter carried from an earlier window (drafter-<name>.tgz.NN in .stage/drafter/ here, joined,
# tested and unpacked into ~/stage/drafter-<name>/ by `stage.sh drafter`) is benched when this
# machine has no export: a window cut between train and bench loses no training.
# A regenerated set carried from an earlier window (regen-<name>.jsonl.gz, its .sha256 and its
# .json, the state record of the run that made it: which target, in .stage/regen/ here, staged
# with `stage.sh regen`) goes where the spec's stages.regenerate.reuse
# looks for it: the regenerate stage then reuses it instead of generating, or, with
# stages.regenerate.extend, grows it (its records, then new conversations for the budget) and the
# regen phase brings the union back under the same name: the next window carries the bigger set.
source scripts/gpu/sglang_setup.sh
mkdir -p "$OUT/r" ~/stage
if [ -n "${EXTRA_O+set}" ]; then echo "$EXTRA_O" > ~/stage/pays_extra
else EXTRA_O=$(cat ~/stage/pays_extra 2>/dev/null); fi
echo "pays.sh: overrides: ${EXTRA_O:-none}"
SPEC=${SPEC:-specs/smollm2-pays-gpu.yaml}
NAME=$(basename "$SPEC" .yaml)
if [ -f ~/stage/regen-$NAME.jsonl.gz ] && [ ! -f "$EAGLE3_CACHE/regen/regen-$NAME.jsonl.gz" ]; then
  mkdir -p "$EAGLE3_CACHE/regen" && cp ~/stage/regen-$NAME.jsonl.gz ~/stage/regen-$NAME.jsonl.gz.sha256 "$EAGLE3_CACHE/regen/"
  cp ~/stage/regen-$NAME.jsonl.gz.json "$EAGLE3_CACHE/regen/" 2>/dev/null  # which target made it
fi
W=runs/$NAME
RES=runs/results-pays.duckdb
export PYTHONUNBUFFERED=1
phase=$1; LIMIT=$2; T0=$SECONDS
TXT="$OUT/r/$phase.log"  # the phase's tables go after its log: one file (8 come back a call)
q() { python3 -m eagle3_runner.runner query "$1" --results "$RES" 2>&1 | tail -40; }
left() { echo $((LIMIT - (SECONDS - T0))); }
overrides() {  # the cache-key overrides every phase passes alike
  echo "${EXTRA_O:-} $(cat ~/stage/pays_o 2>/dev/null)"
}
L=/tmp/pays-logs  # the phase's own output (apply's, the tests', warm_bench's): in state-<phase>.tgz
mkdir -p $L
RESERVE=${RESERVE:-45}  # seconds kept after apply for its stop (SGLang servers) and bring_back
apply() {  # runner apply within the phase's time less RESERVE; progress bars dropped; the whole
  # output streamed, line by line, into $OUT/r/<phase>.log: a call killed by the device's limit
  # still brings back how far it got (2026-12-07: a block-buffered grep lost a whole bench's log)
  timeout --signal=INT --kill-after=30 "$(( $(left) - RESERVE ))" \
    python3 -m eagle3_runner.runner apply "$SPEC" $(overrides) "$@" 2>&1 | sed -u 's/\r/\n/g' \
    | grep --line-buffered -v "it/s\]$\|tok/s\]$\|prompt/s\]$\|s/it\]$\|step/s\]$" \
    | while IFS= read -r l; do printf '%4d %s\n' "$SECONDS" "$l"; done \
    | tee -a "$OUT/r/$phase.log" | tail -60
}
bring_back() {
  tar czf "$OUT/r/state-$phase.tgz" runs/*.duckdb.spool $W/logs $W/state $W/*/*/report.json $L \
    $W/train/*/train_metrics.json $W/export/*/inspect*.json $W/export/*/provenance.json \
    $W/bench/*/bench.json $W/bench/*/sglang_profile.json $W/bench/.partial-*/parts 2>/dev/null
  # the SGLang servers' recordings and logs, complete or not (scripts/gpu/sglang_fixtures.py)
  [ "$phase" = bench ] && tar czf "$OUT/r/sglang-rec.tgz" $W/bench/*/sglang \
    $W/bench/.partial-*/sglang 2>/dev/null
  {
    q "SELECT variant, stage, status, round(duration_s,1) s, left(error, 400) error FROM stages ORDER BY started_at"
    q "SELECT name, round(value, 4) v, unit FROM metrics WHERE step IS NULL AND stage IN ('regenerate', 'train', 'export') ORDER BY stage, name"
    q "SELECT backend, num_steps k, eagle_topk topk, num_draft_tokens n, round(tau,3) tau, round(sim_tau,3) sim, round(heldout_tau,3) held, round(server_accept_length,3) sgl_al, round(spec_tok_s,1) spec, round(base_tok_s,1) base, round(speedup,3) x, round(break_even_tau,2) be, round(predicted_speedup,3) pred_x, accept_per_pos, sim_accept_per_pos, lossless_prompts ll, flags FROM bench_summary ORDER BY 2,3,4,1"
    q "SELECT backend, snapshot_step, train_samples, selected, round(tau,3) tau, round(heldout_tau,3) held, round(server_accept_length,3) sgl_al FROM bench_curve ORDER BY 1, 2"
    echo "phase $phase: $((SECONDS - T0)) s"
  } >> "$TXT" 2>&1
  # after the queries: they ingest the stages' last rows. Not beside a regenerated set's parts
  # (8 files come back a call: log, state, up to 4 parts, .sha256, .json); the machine keeps the
  # results file and the next phase brings it back, the log above has the regen tables
  ls "$OUT/r"/regen-*.jsonl.gz.[0-9][0-9] >/dev/null 2>&1 || cp "$RES" "$OUT/r/" 2>/dev/null
  # every phase's `runner results --json` (small: the rows to commit as benchmarks/*.json), where
  # the 8 files have room (a regen phase's log, state, parts, .sha256 and .json come first)
  [ "$phase" != bench ] && [ "$(ls "$OUT/r" | wc -l)" -lt 8 ] \
    && python3 -m eagle3_runner.runner results --json --results "$RES" > "$OUT/r/results.json" 2>/dev/null
  [ "$phase" = train ] && carry_drafter
  tail -45 "$TXT"
}
carry_drafter() {  # the export (no snapshots) as drafter-<name>.tgz.NN, 15 MB parts: gzip's CRC
  # checks the join (stage.sh drafter); 3 parts for SmolLM2's 47 MB
  local key
  key=$(python3 -c "import json; print(json.load(open('$W/state/base.export.json'))['key'][:16])" \
        2>/dev/null) || return 0
  [ -f "$W/export/$key/provenance.json" ] || return 0
  tar czf "/tmp/drafter-$NAME.tgz" --exclude=./snapshots -C "$W/export/$key" . \
    && split -b 15M -d "/tmp/drafter-$NAME.tgz" "$OUT/r/drafter-$NAME.tgz." \
    && echo "drafter: export $key back as $(ls "$OUT/r" | grep -c "^drafter-") part(s)" >> "$TXT"
}
warm() {  # the bench's compiles with a random drafter of the same geometry (a bound in seconds)
  local half=$(( $(nproc) / 2 )) pin=""
  command -v taskset >/dev/null && pin="taskset -c $half-$(( $(nproc) - 1 ))"
  TORCHINDUCTOR_COMPILE_THREADS=$half timeout "$1" $pin \
    python3 scripts/bench/warm_bench.py "$SPEC" $(overrides) > "$L/warm_bench.txt" 2>&1
  tail -3 "$L/warm_bench.txt"
}
trap bring_back EXIT
case $phase in
  regen)
    {
      nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
      python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
      ~/sglang-python -c "import sglang; print('sglang', sglang.__version__)" 2>&1 | tail -1
      nproc; df -h /tmp | tail -1
    } | tee "$L/versions.txt"
    # the embedded capture's GPU tests (never run on a GPU before 2026-12-07) beside the
    # regeneration: train online with it when they pass, else with transformers' capture
    if [ "${GPU_TESTS:-1}" = 0 ]; then : > ~/stage/pays_o; else
    ( timeout 240 python3 -m pytest tests/test_capture_embedded.py -m gpu -v -p no:cacheprovider \
        --tb=short > "$L/gputests.txt" 2>&1
      # the features must agree with transformers'; a host sync in the step only costs speed
      if grep -q "test_gpu_compiled_capture_equals_the_hf_capture PASSED" "$L/gputests.txt"
      then echo "" > ~/stage/pays_o
      else echo "-o stages.train.online_capture=hf -o stages.train.prefetch=false" > ~/stage/pays_o
      fi ) &
    fi
    apply --only regenerate
    wait
    echo "train overrides: $(cat ~/stage/pays_o)"
    # the bench's compiles, with a random drafter of the same geometry, while nothing else runs
    # (beside the train stage they cost its set-up 3 minutes on 2026-12-07)
    [ -z "${WARM_AFTER:-}" ] && warm $(( $(left) - 30 ))
    # the regenerated set (its gzip shards are one gzip stream end to end), with its checksum:
    # carry it to the next window (DEVELOPERS.md: .stage/regen/, stages.regenerate.reuse).
    # The artifact of the stage's state record: one that ran the target (its record names it:
    # a regeneration, or stages.regenerate.extend's union of the carried set and the new
    # conversations); not a plain reuse of a set carried in (~/stage has it, unchanged)
    R=/tmp/regen-$NAME.jsonl.gz
    K=$(python3 -c "import json; r = json.load(open('$W/state/base.regenerate.json'))
print(r['key'][:16] if 'target' in r['inputs']['files'] else '')" 2>/dev/null)
    [ -n "$K" ] && cat $W/regenerate/$K/shards/part-*.jsonl.gz > "$R" 2>/dev/null \
      && (cd /tmp && sha256sum "$(basename "$R")" > "$R.sha256") \
      && split -b 15M -d "$R" "$OUT/r/$(basename "$R")." && cp "$R.sha256" "$OUT/r/" \
      && cp $W/state/base.regenerate.json "$OUT/r/$(basename "$R").json" ;;  # runner/carry.py
  train)
    if [ -n "${WARM_AFTER:-}" ]; then
      ( sleep "$WARM_AFTER"; warm $(( $(left) - 20 )) ) &
    fi
    apply --only train --only export
    wait ;;
  bench)
    D=~/stage/drafter-$NAME
    if [ -f "$D/provenance.json" ] && ! ls $W/export/*/provenance.json >/dev/null 2>&1; then
      echo "pays.sh: no export on this machine: benching the carried drafter $D" | tee -a "$TXT"
      apply --only bench -o "stages.bench.drafter=$D" -o stages.bench.curve=0
    else apply --only bench; fi
    python3 -m eagle3_runner.runner results --json --results "$RES" > "$OUT/r/results.json" ;;
  *) echo "usage: pays.sh regen|train|bench SECONDS"; exit 2 ;;
esac
