#!/bin/bash
# Guidance as a dial (docs/results.md, "Guidance as a dial"): one cache of the pretrained shapes teacher drawn at
# guidance 2 with both branches recorded (--save-cond-uncond); from it, velocity students for guidance 2 (the cached
# guided target) and for each other scale of WS (--target-guidance w: u + w (c - u)); each evaluated against the
# teacher drawn at each scale of WS on the held-out captions, from the same noise (final-latent MSE). Run after
# `make install`. STUDENT=compact: configs/student-shapes.json from teacher blocks; STUDENT=lora: a rank-16 LoRA of
# the teacher; NAME: the runs' folder names (another EPOCHS: another NAME).
set -euo pipefail
OUT=${OUT:-runs/guidance-dial}
BIN=${BIN:-.venv/bin}
TEACHER=${TEACHER:-runs/tiny-teacher-pretrained}
EPOCHS=${EPOCHS:-1}
STUDENT=${STUDENT:-compact}
NAME=${NAME:-$STUDENT}
WS=${WS:-2 3}
RANGE=${RANGE:-}
RANGE_EPOCHS=${RANGE_EPOCHS:-$EPOCHS}
test -f "$TEACHER/model_index.json" || "$BIN/wandistiller" tiny-teacher --out "$TEACHER" --variant pretrained
mkdir -p "$OUT"
cache() {  # cache NAME PROMPTS GUIDANCE [flags]
  local name=$1 prompts=$2 g=$3; shift 3
  test -f "$OUT/$name/manifest.json" || "$BIN/wandistiller" teacher-cache --teacher "$TEACHER" \
    --config configs/shapes-teacher-cache.toml --prompts "$prompts" --out "$OUT/$name" --guidance "$g" \
    --guidance-2 "$g" "$@"
}
cache train-g2 data/shapes-prompts.txt 2 --save-cond-uncond
if [ "$STUDENT" = lora ]; then KIND="--lora-of $TEACHER --lora-rank 16"
else KIND="--student-config configs/student-shapes.json --init-from-teacher $TEACHER"; fi
ARGS="$KIND --batch-size 64 --lr 1e-3 --warmup-steps 50 --ema-decay 0.995 --holdout-prompts 64 --val-every 0 \
  --epochs $EPOCHS"
others=()
for w in $WS; do
  cache "heldout-g$w" data/shapes-heldout.txt "$w"
  extra=""; test "$w" = 2 || { extra="--target-guidance $w"; others+=(--compare "$OUT/$NAME-w$w"); }
  test -f "$OUT/$NAME-w$w/distill.json" || "$BIN/wandistiller" train-student --cache "$OUT/train-g2" \
    --out "$OUT/$NAME-w$w" $ARGS $extra
done
RANGED=$NAME-range-${RANGE_EPOCHS}ep
if [ -n "$RANGE" ]; then
  test -f "$OUT/$RANGED/distill.json" || "$BIN/wandistiller" train-student --cache "$OUT/train-g2" \
    --out "$OUT/$RANGED" ${ARGS/--epochs $EPOCHS/--epochs $RANGE_EPOCHS} --guidance-range "$RANGE"
  others+=(--compare "$OUT/$RANGED")
fi
for g in $WS; do
  "$BIN/wandistiller" eval --student "$OUT/$NAME-w2" "${others[@]}" --cache "$OUT/heldout-g$g" \
    --teacher "$TEACHER" --report "$OUT/eval-$NAME-g$g.json" --no-teacher-timing
done
"$BIN/python" - "$OUT" "$NAME" "$RANGED" $WS <<'PY'
import json, sys
out, name, ranged, *ws = sys.argv[1:]
for g in ws:
    mse = json.load(open(f"{out}/eval-{name}-g{g}.json"))["final_latent_mse"]
    rows = ", ".join(f"for {w} {mse['student' if w == '2' else f'{name}-w{w}']:.5f}" for w in ws)
    over = f", over the range ({ranged}) {mse[ranged]:.5f}" if ranged in mse else ""
    print(f"{name} against the teacher at guidance {g}: trained {rows}{over}, untrained {mse['untrained']:.5f}")
PY
