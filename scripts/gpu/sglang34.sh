#!/usr/bin/env bash
# On the device machine, after the .stage/sgl staging calls (DEVELOPERS.md "SGLang on the H200"):
# issue 34 in phases, one or two per device call, each time-boxed (SIGINT at SECONDS); every phase
# copies what exists to $OUT/r whatever happens (an EXIT trap).
#   bash scripts/gpu/sglang34.sh train SECONDS  # setup (sglang_setup.sh), versions, a plain SGLang
#                                               # server started beside the training (the install
#                                               # proven, kernel caches warmed), then
#                                               # runner apply --only extract/train/export
#   bash scripts/gpu/sglang34.sh bench SECONDS  # the bench stage, backend both: embedded and SGLang
#                                               # on the same prompts (parity, speeds, the profile)
#   bash scripts/gpu/sglang34.sh lab SECONDS    # the conformance lab on the exported drafter
# EXTRA_O="-o stages.bench.backend=sglang -o stages.bench.num_prompts=8": overrides for apply
# (SGLang alone, no embedded engines to compile: the short bench when time is short)
# $OUT/r gets: results-sglang.duckdb, state-<phase>.tgz (spool, logs, bench.json, the SGLang
# recordings sglang/<server>/ and sglang_profile.json, train metrics, export config and
# inspect), <phase>.txt (the phase's tables), versions.txt and smoke.log (train), lab.json,
# lab.md and lab-rec.tgz (lab).
source scripts/gpu/sglang_setup.sh
mkdir -p "$OUT/r"
SPEC=${SPEC:-specs/smollm2-sglang-gpu.yaml}
W=runs/$(basename "$SPEC" .yaml)
RES=runs/results-sglang.duckdb
GGUF=$EAGLE3_CACHE/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
# the launch flags of every server here (the spec's extra_args say the same): FA3, xgrammar and
# flashinfer's sampling are not carried (sglang_pins.txt); a small KV pool per server, so that
# many start side by side (SGLang sizes a pool from the memory free when it starts)
EXTRA="--attention-backend triton --sampling-backend pytorch --grammar-backend none \
--disable-radix-cache --max-total-tokens 16384"
export PYTHONUNBUFFERED=1
phase=$1; LIMIT=$2; T0=$SECONDS
TXT="$OUT/r/$phase.txt"
q() { python3 -m eagle3_runner.runner query "$1" --results "$RES" 2>&1 | tail -40; }
bring_back() {
  cp "$RES" "$OUT/r/" 2>/dev/null
  tar czf "$OUT/r/state-$phase.tgz" runs/*.duckdb.spool $W/logs $W/state $W/bench/*/bench.json \
    $W/bench/*/sglang $W/bench/*/sglang_profile.json $W/train/*/train_metrics.json \
    $W/export/*/config.json $W/export/*/inspect*.json $W/extract/*/report.json 2>/dev/null
  {
    q "SELECT variant, stage, status, round(duration_s,1) s, left(error, 300) error FROM stages ORDER BY started_at"
    q "SELECT backend, num_steps k_steps, eagle_topk topk, num_draft_tokens n, round(tau,3) tau, round(server_accept_length,3) sgl_acc_len, round(spec_tok_s,1) spec, round(base_tok_s,1) base, round(speedup,3) x, round(break_even_tau,2) be, round(predicted_speedup,3) pred_x, lossless_prompts ll, ref_same_prompts ref, flags FROM bench_summary ORDER BY 2,3,4,1"
    q "SELECT * FROM bench_parity"
    echo "phase $phase: $((SECONDS - T0)) s"
  } >> "$TXT" 2>&1
  tail -60 "$TXT"
}
trap bring_back EXIT
left() { echo $((LIMIT - (SECONDS - T0))); }
apply() {  # runner apply within the phase's time (EXTRA_O: more -o overrides); progress bars
  # dropped
  timeout --signal=INT "$(left)" python3 -m eagle3_runner.runner apply "$SPEC" "$@" ${EXTRA_O:-} 2>&1 \
    | tr '\r' '\n' | grep -v "it/s\]$\|tok/s\]$\|prompt/s\]$\|s/it\]$" | tail -40
}
case $phase in
  train)
    {
      nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
      python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
      ~/sglang-python -c "import sglang; print('sglang', sglang.__version__)" 2>&1 | tail -1
      git log -1 --format='commit %h %s' 2>/dev/null || true
      nproc; df -h /tmp | tail -1
    } | tee "$OUT/r/versions.txt"
    # the install proven while the drafter trains: the target served plain (the GGUF converted
    # by the extract stage's first step: waited for, at most 120 s), one /generate, stopped;
    # bounded (<= 360 s) so that it ends within the phase
    rm -f /tmp/apply-done
    ( for _ in $(seq 60); do ls "$EAGLE3_CACHE"/converted/*/config.json >/dev/null 2>&1 && break
        [ -f /tmp/apply-done ] && break; sleep 2; done  # the apply ended first: no target to serve
      M=$(ls "$EAGLE3_CACHE"/converted/*/config.json 2>/dev/null | head -1)
      [ -n "$M" ] || { echo "smoke: no converted target (the extract stage did not start)" \
        > "$OUT/r/smoke.log"; exit 0; }
      M=$(dirname "$M")
      timeout 240 python3 - "$M" $EXTRA > "$OUT/r/smoke.log" 2>&1 <<'PY'
import json, sys, time
from pathlib import Path
from eagle3_runner.targets.sglang import (free_ports, generate, launch, server_argv, server_info,
                                         stop_all, wait_ready)
port, nccl = free_ports(2)
srv = launch("smoke", server_argv("~/sglang-python", sys.argv[1], port, cuda_graph_max_bs=1,
                                  dtype="bfloat16", mem_fraction_static=0.5, nccl_port=nccl,
                                  extra=sys.argv[2:]),
             "127.0.0.1", port, Path("/tmp/smoke-server.log"))
try:
    wait_ready(srv, 220)
    print("ready in", round(srv.ready_s, 1), "s; version", server_info(srv.url).get("version"))
    r, dt = generate(srv.url, [1, 9690, 198, 2683, 359, 253], 32, 0.0, 60)
    print(json.dumps(r)[:600], f"client {dt:.3f} s")
except Exception as e:  # noqa: BLE001 - a smoke test reports, it never stops the phase
    print("smoke failed:", e)
finally:
    stop_all([srv])
    print("\n".join(srv.log_text().splitlines()[-40:]))
PY
    ) &
    apply --only extract --only train --only export
    touch /tmp/apply-done
    wait ;;
  bench) apply --only bench ;;
  lab)
    D=$(ls -d $W/export/*/ 2>/dev/null | head -1)
    [ -n "$D" ] || { echo "lab: no export under $W/export: run the train phase first"; exit 1; }
    # each server: ready within WAIT s, then 4 requests of <= 60 s; the lab's tables are written
    # when its servers end, so WAIT leaves room for the requests before the phase's SIGINT
    WAIT=$(( $(left) - 150 )); [ $WAIT -gt 300 ] && WAIT=300
    timeout -k 30 --signal=INT "$(left)" python3 scripts/gpu/sglang_lab.py --draft "$D" \
      --target "$GGUF" --python ~/sglang-python --out "$OUT/r" --prompts 4 --max-new 128 \
      --parallel 32 --mem-fraction 0.5 --timeout "$WAIT" --extra "$EXTRA" 2>&1 | tail -60 ;;
  *) echo "usage: sglang34.sh train|bench|lab SECONDS"; exit 2 ;;
esac
