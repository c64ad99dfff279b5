#!/usr/bin/env bash
# On the device machine, after the .stage/sgl staging calls (DEVELOPERS.md item 17): issue 44's
# SpecForge peer and issue 36's recipe sweep on specs/smollm2-recipe-gpu.yaml, one phase per
# back-to-back device call, each time-boxed (SIGINT at SECONDS less RESERVE); every phase brings
# what exists back to $OUT/r whatever happens (an EXIT trap), as scripts/gpu/pays.sh does.
#   bash scripts/gpu/recipe.sh check SECONDS [gpu]  # versions; every SpecForge module the peer
#                                             # imports (specforge_peer.py --check-imports);
#                                             # `runner plan` of base; with gpu: the peer's
#                                             # round trip on CUDA (tests/test_specforge_peer.py
#                                             # -m gpu: its Triton loss, flex_attention) ~60 s
#   bash scripts/gpu/recipe.sh tests SECONDS  # the GPU tests of the training options (the fast
#                                             # step with LK losses and EAGLE 3.1 = the
#                                             # reference, the LK kernel); ~100 s
#   bash scripts/gpu/recipe.sh regen SECONDS  # no carried set: the pays spec's regenerate stage
#                                             # (its sharegpt-first prompts, 4.5 minutes), kept
#                                             # as this spec's data; its set comes back
#   bash scripts/gpu/recipe.sh base SECONDS [ARGS]  # base: train, export, bench (resumes when cut);
#                                             # ARGS go to runner apply (--only train --only
#                                             # export: the drafter only, benched later)
#   bash scripts/gpu/recipe.sh peer SECONDS [MIN]  # SpecForge 0.2.0 trains on base's samples
#                                             # (scripts/bench/specforge_peer.py, at most MIN
#                                             # minutes of steps, default 7.5), exports, and the
#                                             # `specforge` variant's bench starts only when
#                                             # PEER_BENCH_S (default 330) seconds are left
#   bash scripts/gpu/recipe.sh bench SECONDS [VARIANT...]  # runner apply per variant (default
#                                             # base specforge): what an earlier call left (a
#                                             # cut bench resumes), or a new variant (bs16: train,
#                                             # export, bench)
#   bash scripts/gpu/recipe.sh sweep SECONDS NAME...  # variants at once, one process each on the
#                                             # one GPU (tau exact, tok/s not)
# The conversations: the pays spec's carried set ~/stage/regen-smollm2-pays-gpu.jsonl.gz
# (`stage.sh regen`, its .sha256 checked: SmolLM2's own greedy answers after the end-of-turn fix,
# issue 44's data), else ~/stage/regenerated.jsonl.gz (an older carried set), else the regen
# phase; copied to $EAGLE3_CACHE/regen/regenerated.jsonl.gz, the spec's data.path.
# SpecForge: `stage.sh peer` (.stage/peer, scripts/gpu/sglang_wheels.sh) puts its wheel in
# ~/stage, where setup.sh installs it into /tmp/site; peer.sha256 is checked here.
# A SpecForge drafter carried from an earlier window (drafter-specforge-peer.tgz.NN, which the peer
# phase brings back, in .stage/drafter-peer/ here; `stage.sh drafter-peer` unpacks it into
# ~/stage/drafter-specforge-peer/) is put where the `specforge` variant's bench reads it.
# Overrides that enter cache keys (EXTRA_O, e.g. -o stages.bench.backend=sglang) are kept in
# ~/stage/recipe_extra so every phase (and the peer script) passes the same ones: a call that sets
# EXTRA_O replaces the kept one; one that does not reuses it.
# What comes back in $OUT/r (at most 8 files a call): <phase>.log (the phase's output as it is
# written, each line after the call's seconds so far, the tables after it), results-recipe.duckdb,
# state-<phase>.tgz (spool, state, logs, reports, train_metrics, inspect, bench.json, kept bench
# parts, the peer's peer.json/peer.md/peer.log/draft_config.json, recipe-logs/), results.json
# (`runner results --json`; base, bench, sweep), sglang-rec.tgz (the SGLang recordings and server
# logs of a phase that benched), peer.json and drafter-specforge-peer.tgz.NN (peer phase).
source scripts/gpu/sglang_setup.sh
mkdir -p "$OUT/r" ~/stage
if [ -n "${EXTRA_O+set}" ]; then echo "$EXTRA_O" > ~/stage/recipe_extra
else EXTRA_O=$(cat ~/stage/recipe_extra 2>/dev/null); fi
echo "recipe.sh: overrides: ${EXTRA_O:-none}"
export SPEC=${SPEC:-specs/smollm2-recipe-gpu.yaml} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
NAME=$(basename "$SPEC" .yaml)
W=runs/$NAME
RES=runs/results-recipe.duckdb
REGEN=$EAGLE3_CACHE/regen/regenerated.jsonl.gz
for carried in ~/stage/regen-smollm2-pays-gpu.jsonl.gz ~/stage/regenerated.jsonl.gz; do
  if [ -f "$carried" ] && [ ! -f "$REGEN" ]; then
    if [ -f "$carried.sha256" ] && ! (cd ~/stage && sha256sum -c --quiet "$(basename "$carried").sha256"); then
      echo "recipe.sh: $carried differs from its .sha256: stage it again" >&2; continue
    fi
    mkdir -p "$(dirname "$REGEN")" && cp "$carried" "$REGEN" && echo "recipe.sh: conversations: $carried"
  fi
done
if [ -f ~/stage/peer.sha256 ]; then
  (cd ~/stage && sha256sum -c --quiet peer.sha256) \
    || echo "recipe.sh: ~/stage/specforge-*.whl differs from peer.sha256: stage .stage/peer again" >&2
fi
SF=$EAGLE3_CACHE/peer/specforge  # the `specforge` variant's stages.bench.drafter
if [ -f ~/stage/drafter-specforge-peer/provenance.json ] && [ ! -f "$SF/provenance.json" ]; then
  mkdir -p "$(dirname "$SF")" && rm -rf "$SF" && cp -r ~/stage/drafter-specforge-peer "$SF" \
    && echo "recipe.sh: the carried SpecForge drafter is $SF"
fi
PEER=/tmp/peer  # the peer script's --out (its checkpoint is ~50 MB: not under $OUT)
phase=$1; LIMIT=$2; shift 2; T0=$SECONDS
TXT="$OUT/r/$phase.log"
L=/tmp/recipe-logs  # versions, the GPU tests', the sweep's per-variant logs: in state-<phase>.tgz
mkdir -p $L
RESERVE=${RESERVE:-45}  # seconds kept after a run for its stop (SGLang servers) and bring_back
q() { python3 -m eagle3_runner.runner query "$1" --results "$RES" 2>&1 | tail -40; }
left() { echo $((LIMIT - (SECONDS - T0))); }
stamp() {  # each line after the call's seconds so far, into the phase's log as it is written
  sed -u 's/\r/\n/g' | grep --line-buffered -v "it/s\]$\|tok/s\]$\|prompt/s\]$\|s/it\]$\|step/s\]$" \
    | while IFS= read -r l; do printf '%4d %s\n' "$SECONDS" "$l"; done | tee -a "$TXT" | tail -60
}
boxed() {  # boxed COMMAND...: within the phase's time less RESERVE, streamed into the log
  local b=$(( $(left) - RESERVE ))
  [ "$b" -gt 10 ] || { echo "recipe.sh: no time left for: $*" | tee -a "$TXT"; return 1; }
  timeout --signal=INT --kill-after=30 "$b" "$@" 2>&1 | stamp
}
apply() { boxed python3 -m eagle3_runner.runner apply "$SPEC" $EXTRA_O "$@"; }
bring_back() {
  tar czf "$OUT/r/state-$phase.tgz" runs/*.duckdb.spool $W/logs $W/state $W/*/*/report.json $L \
    $W/train/*/train_metrics.json $W/export/*/inspect*.json $W/export/*/provenance.json \
    $W/bench/*/bench.json $W/bench/*/sglang_profile.json $W/bench/.partial-*/parts \
    $PEER/peer.json $PEER/peer.md $PEER/peer.log $PEER/draft_config.json 2>/dev/null
  case $phase in base|peer|bench|sweep)  # the SGLang servers' recordings and logs
    ls -d $W/bench/*/sglang $W/bench/.partial-*/sglang >/dev/null 2>&1 && tar czf \
      "$OUT/r/sglang-rec.tgz" $W/bench/*/sglang $W/bench/.partial-*/sglang 2>/dev/null ;;
  esac
  {
    q "SELECT variant, stage, status, round(duration_s,1) s, left(error, 400) error FROM stages WHERE status != 'skipped' ORDER BY started_at"
    q "SELECT variant, name, round(value, 4) v, unit FROM metrics WHERE step IS NULL AND stage IN ('train', 'export') ORDER BY variant, stage, name"
    q "SELECT variant, backend, num_steps k, eagle_topk topk, num_draft_tokens n, train_samples, round(tau,3) tau, round(sim_tau,3) sim, round(heldout_tau,3) held, round(server_accept_length,3) sgl_al, round(spec_tok_s,1) spec, round(base_tok_s,1) base, round(speedup,3) x, round(break_even_tau,2) be, accept_per_pos, lossless_prompts ll, flags FROM bench_summary ORDER BY 1, 2"
    echo "phase $phase: $((SECONDS - T0)) s"
  } >> "$TXT" 2>&1
  cp "$RES" "$OUT/r/" 2>/dev/null  # after the queries: they ingest the stages' last rows
  case $phase in base|bench|sweep)
    python3 -m eagle3_runner.runner results --json --results "$RES" > "$OUT/r/results.json" 2>/dev/null ;;
  esac
  [ "$phase" = peer ] && carry_peer
  tail -45 "$TXT"
}
carry_peer() {  # peer.json, and SpecForge's export as drafter-specforge-peer.tgz.NN (15 MB parts)
  cp $PEER/peer.json "$OUT/r/" 2>/dev/null
  [ -f "$SF/provenance.json" ] || return 0
  tar czf /tmp/drafter-specforge-peer.tgz -C "$SF" . \
    && split -b 15M -d /tmp/drafter-specforge-peer.tgz "$OUT/r/drafter-specforge-peer.tgz." \
    && echo "drafter: $SF back as $(ls "$OUT/r" | grep -c "^drafter-") part(s)" >> "$TXT"
}
trap bring_back EXIT
case $phase in
  check)
    {
      nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
      python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
      ~/sglang-python -c "import sglang; print('sglang', sglang.__version__)" 2>&1 | tail -1
      git log -1 --format='commit %h %s' 2>/dev/null; nproc; df -h /tmp | tail -1
      ls -la "$REGEN" ~/stage/*.whl 2>&1 | grep -v "^total"
    } 2>&1 | tee "$L/versions.txt" | stamp
    boxed python3 scripts/bench/specforge_peer.py --check-imports
    boxed python3 -m eagle3_runner.runner plan "$SPEC" --variant base $EXTRA_O
    if [ "${1:-}" = gpu ]; then
      boxed python3 -m pytest tests/test_specforge_peer.py -m gpu -v -p no:cacheprovider \
        --timeout 150 --tb=short
    fi ;;
  tests)
    boxed python3 -m pytest tests/test_ttt.py tests/test_ttt_kernels.py -m gpu -v \
      -p no:cacheprovider --timeout 45 --tb=line -rfEs --durations=8 ;;
  regen)  # the pays spec's regeneration (reuse/extend off: nothing is carried), then its
    # shards as this spec's data (records without messages are dropped by the reader)
    boxed python3 -m eagle3_runner.runner apply specs/smollm2-pays-gpu.yaml --only regenerate -o stages.regenerate.reuse=null \
      -o stages.regenerate.extend=false
    K=$(python3 -c "import json; print(json.load(open('runs/smollm2-pays-gpu/state/base.regenerate.json'))['key'][:16])" 2>/dev/null)
    if [ -n "$K" ]; then
      mkdir -p "$(dirname "$REGEN")"
      cat runs/smollm2-pays-gpu/regenerate/$K/shards/part-*.jsonl.gz > "$REGEN" \
        && split -b 15M -d "$REGEN" "$OUT/r/regen-smollm2-pays-gpu.jsonl.gz." \
        && echo "recipe.sh: $(zcat "$REGEN" | wc -l) records in $REGEN" | tee -a "$TXT"
    fi ;;
  base) apply --variant base "$@" ;;  # e.g. --only train --only export: no bench this call
  peer)
    MIN=${1:-7.5}
    python3 -c "import specforge" 2>/dev/null \
      || echo "recipe.sh: specforge is not installed: carry .stage/peer and run stage.sh peer" | tee -a "$TXT"
    # base's train stage is the `specforge` variant's (same key): its samples, and its metrics
    # for the comparison; the peer's export goes to $SF, which the variant's bench reads
    rm -rf "$PEER" && mkdir -p "$PEER"
    B=$(( $(left) - RESERVE - 30 ))  # the script's own stop after MIN minutes of steps comes first
    if [ "$B" -lt 120 ]; then echo "recipe.sh: $B s is too little for the peer" | tee -a "$TXT"; exit 1; fi
    timeout --signal=INT --kill-after=30 "$B" python3 scripts/bench/specforge_peer.py "$SPEC" \
      --variant specforge --out "$PEER" --max-minutes "$MIN" $EXTRA_O 2>&1 \
      | grep --line-buffered -v "Warning\|warnings.warn" | stamp
    if [ "$(left)" -ge "${PEER_BENCH_S:-330}" ]; then apply --variant specforge
    else echo "recipe.sh: $(left) s left: bench it in the next call (recipe.sh bench SECONDS specforge)" | tee -a "$TXT"
    fi ;;
  bench) for v in ${@:-base specforge}; do apply --variant "$v"; done ;;
  sweep)
    export OMP_NUM_THREADS=$(( $(nproc) / $# ))
    B=$(( $(left) - RESERVE ))
    for v in "$@"; do
      timeout --signal=INT --kill-after=30 "$B" python3 -m eagle3_runner.runner apply "$SPEC" \
        $EXTRA_O --variant "$v" > "$L/sweep_$v.log" 2>&1 &
    done
    wait
    for v in "$@"; do echo "== $v"; tail -12 "$L/sweep_$v.log"; done | tee -a "$TXT" ;;
  *) echo "recipe.sh: unknown phase $phase (check, tests, regen, base, peer, bench, sweep)"; exit 2 ;;
esac
echo "recipe.sh $phase: $((SECONDS - T0)) s" | tee -a "$TXT"
