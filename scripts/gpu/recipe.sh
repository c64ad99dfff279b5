#!/usr/bin/env bash
# On the device machine (after stage.sh a/b/c, DEVELOPERS.md item 17): issue 36's recipe sweep
# and SpecForge peer on specs/smollm2-recipe-gpu.yaml, one phase per back-to-back device call,
# each time-boxed; what exists is copied to $OUT/r whatever happens (scale.sh's trap for the
# apply phases, this script's for the others).
#   bash scripts/gpu/recipe.sh tests SECONDS          # the GPU tests of the training options (the fast
#                                                     # step with LK losses and EAGLE 3.1 = the
#                                                     # reference, the LK kernel); ~100 s
#   bash scripts/gpu/recipe.sh regen SECONDS          # no brought-back conversations: regenerate them
#                                                     # with the scale spec (~430 s) and keep them in
#                                                     # $EAGLE3_CACHE/regen/ (and $OUT/r) for the sweep
#   bash scripts/gpu/recipe.sh base SECONDS           # base: train, export, bench (~3.5 min)
#   bash scripts/gpu/recipe.sh peer SECONDS [MIN]     # SpecForge 0.2.0 trains on base's samples
#                                                     # (scripts/bench/specforge_peer.py, at most MIN
#                                                     # minutes of steps, default 7), then the
#                                                     # `specforge` variant benches its drafter
#   bash scripts/gpu/recipe.sh sweep SECONDS NAME...  # variants at once, one process each on the
#                                                     # one GPU (scale.sh sweep: tau exact, tok/s not)
# The conversations: the pays spec's carried set ~/stage/regen-smollm2-pays-gpu.jsonl.gz
# (`stage.sh regen`: 84,424 of SmolLM2's own greedy answers, made after the end-of-turn fix,
# issue 44's data; its records read as data.source jsonl: 83,708 clean), else
# ~/stage/regenerated.jsonl.gz (an older carried set, records with `messages`), else the regen
# phase. stages.train.kernels: TRAIN_KERNELS (default triton, as the scale runs measured).
source scripts/gpu/setup.sh
mkdir -p "$OUT/r"
export SPEC=specs/smollm2-recipe-gpu.yaml PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
[ -f ~/stage/train_kernels ] || echo "${TRAIN_KERNELS:-triton}" > ~/stage/train_kernels
touch ~/stage/extra_o
REGEN=$EAGLE3_CACHE/regen/regenerated.jsonl.gz
for carried in ~/stage/regen-smollm2-pays-gpu.jsonl.gz ~/stage/regenerated.jsonl.gz; do
  if [ -f "$carried" ] && [ ! -f "$REGEN" ]; then
    mkdir -p "$(dirname "$REGEN")" && cp "$carried" "$REGEN" && echo "recipe.sh: conversations: $carried"
  fi
done
phase=$1; LIMIT=$2; shift 2
T0=$SECONDS
left() { echo $((LIMIT - (SECONDS - T0))); }
case $phase in
  tests)
    trap 'cp /tmp/recipe_tests.txt "$OUT/r/" 2>/dev/null' EXIT
    timeout "$LIMIT" python3 -m pytest tests/test_ttt.py tests/test_ttt_kernels.py -m gpu -q \
      -p no:cacheprovider -rfEs --durations=8 > /tmp/recipe_tests.txt 2>&1
    tail -30 /tmp/recipe_tests.txt ;;
  regen)
    trap 'ls -la "$EAGLE3_CACHE/regen" 2>/dev/null' EXIT
    SPEC=specs/smollm2-scale-gpu.yaml bash scripts/gpu/scale.sh regen "$LIMIT"
    python3 - "$REGEN" <<'PY'
import glob, gzip, json, os, sys
out = sys.argv[1]
os.makedirs(os.path.dirname(out), exist_ok=True)
n = 0
with gzip.open(out + ".tmp", "wt") as w:  # keep the records with messages (dropped ones have none)
    for f in sorted(glob.glob("runs/smollm2-scale-gpu/regenerate/*/shards/part-*.jsonl.gz")):
        for line in gzip.open(f, "rt"):
            if json.loads(line).get("messages"):
                w.write(line); n += 1
os.replace(out + ".tmp", out)
print(f"recipe.sh: {n} regenerated conversations in {out}")
PY
    cp "$REGEN" "$OUT/r/" 2>/dev/null ;;
  base) bash scripts/gpu/scale.sh variant "$LIMIT" base ;;
  peer)  # writes $OUT/r/peer/{peer.json,peer.md,peer.log} even when a step fails
    MIN=${1:-7}
    python3 -c "import specforge" 2>/dev/null || echo "recipe.sh: specforge is not installed: put specforge-0.2.0-py3-none-any.whl in .stage/a" >&2
    # the train key of `specforge` is base's (the bench drafter is not part of it): same inputs;
    # the bench after it needs ~150 s (engines ~60 s cold + 40 prompts)
    B=$(( $(left) - 150 )); [ "$B" -gt 60 ] || B=60
    timeout --signal=INT "$B" python3 scripts/bench/specforge_peer.py "$SPEC" \
      --variant specforge --out "$OUT/r/peer" --max-minutes "$MIN" \
      -o "stages.train.kernels=$(cat ~/stage/train_kernels)" 2>&1 | grep -v -i warn | tail -30
    bash scripts/gpu/scale.sh variant "$(left)" specforge ;;
  sweep) bash scripts/gpu/scale.sh sweep "$LIMIT" "$@" ;;
  *) echo "recipe.sh: unknown phase $phase (tests, regen, base, peer, sweep)"; exit 2 ;;
esac
echo "recipe.sh $phase: $((SECONDS - T0)) s"
