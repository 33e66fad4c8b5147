#!/bin/bash
# Guidance as a dial (docs/results.md, "Guidance as a dial"): one cache of the pretrained shapes teacher drawn at
# guidance 2 with both branches recorded (--save-cond-uncond); from it, velocity students for guidance 2 (the cached
# guided target) and for guidance 3 (--target-guidance 3: u + 3 (c - u)); each evaluated against the teacher drawn
# at guidance 3 (and at 2) on the held-out captions, from the same noise (final-latent MSE). Run after `make install`.
set -euo pipefail
OUT=${OUT:-runs/guidance-dial}
BIN=${BIN:-.venv/bin}
TEACHER=${TEACHER:-runs/tiny-teacher-pretrained}
EPOCHS=${EPOCHS:-1}
test -f "$TEACHER/model_index.json" || "$BIN/wandistiller" tiny-teacher --out "$TEACHER" --variant pretrained
mkdir -p "$OUT"
cache() {  # cache NAME PROMPTS GUIDANCE [flags]
  local name=$1 prompts=$2 g=$3; shift 3
  test -f "$OUT/$name/manifest.json" || "$BIN/wandistiller" teacher-cache --teacher "$TEACHER" \
    --config configs/shapes-teacher-cache.toml --prompts "$prompts" --out "$OUT/$name" --guidance "$g" \
    --guidance-2 "$g" "$@"
}
cache train-g2 data/shapes-prompts.txt 2 --save-cond-uncond
cache heldout-g2 data/shapes-heldout.txt 2
cache heldout-g3 data/shapes-heldout.txt 3
ARGS="--student-config configs/student-shapes.json --init-from-teacher $TEACHER --batch-size 64 --lr 1e-3 \
  --warmup-steps 50 --ema-decay 0.995 --holdout-prompts 64 --val-every 0 --epochs $EPOCHS"
for w in 2 3; do
  extra=""; test "$w" = 2 || extra="--target-guidance $w"
  test -f "$OUT/student-w$w/distill.json" || "$BIN/wandistiller" train-student --cache "$OUT/train-g2" \
    --out "$OUT/student-w$w" $ARGS $extra
done
for g in 2 3; do
  "$BIN/wandistiller" eval --student "$OUT/student-w2" --compare "$OUT/student-w3" --cache "$OUT/heldout-g$g" \
    --teacher "$TEACHER" --report "$OUT/eval-g$g.json" --no-teacher-timing
done
"$BIN/python" - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
for g in (2, 3):
    mse = json.load(open(f"{out}/eval-g{g}.json"))["final_latent_mse"]
    print(f"against the teacher at guidance {g}: student for 2 {mse['student']:.5f}, student for 3 "
          f"{mse['student-w3']:.5f}, untrained {mse['untrained']:.5f}")
PY
