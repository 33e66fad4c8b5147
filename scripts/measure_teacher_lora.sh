#!/usr/bin/env bash
# The user's LoRA baked into the teacher (docs/results.md, "Your LoRA in the teacher"): the recolouring LoRA of
# scripts/train_recolour_lora.py fused into the pretrained shapes teacher for stage one (`teacher-cache
# --teacher-lora`, both experts' files, two seeds a caption), a 2-step LoRA student of the plain teacher trained on
# that cache (one file: the style and the few steps), then one `eval` run: the teacher row is the LoRA'd teacher
# (eval fuses the LoRAs the cache records), the student beside it from the same noise, both drawn from the held-out
# captions and scored against those captions recoloured (--checked-captions). Each stage's wall time is in
# OUT/NAME.log (`/usr/bin/time`). RANK, LR and EPOCHS set the student's recipe, NAME its folder (default
# lora2-rRANK-EPOCHSep).
#   bash scripts/measure_teacher_lora.sh [OUT]      # default runs/teacher-lora; reuses what is complete
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/teacher-lora}
T=runs/tiny-teacher-pretrained
L=runs/recolour-lora
BIN=.venv/bin
RANK=${RANK:-32}
LR=${LR:-2e-3}
EPOCHS=${EPOCHS:-3}
NAME=${NAME:-lora2-r$RANK-${EPOCHS}ep}
make --no-print-directory $T/model_index.json
[ -f "$L/TRAINING.json" ] || /usr/bin/time -f "recolour-lora %e s" $BIN/python scripts/train_recolour_lora.py \
    --teacher $T --out $L
mkdir -p "$OUT"
[ -f "$OUT/cache/manifest.json" ] || /usr/bin/time -f "cache %e s" $BIN/wandistiller teacher-cache --teacher $T \
    --config configs/shapes-teacher-cache.toml --prompts data/shapes-prompts.txt --seeds-per-prompt 2 \
    --out "$OUT/cache" --teacher-lora "high=$L/high_noise_model.safetensors" \
    --teacher-lora "low=$L/low_noise_model.safetensors" > "$OUT/cache.log" 2>&1
[ -f "$OUT/$NAME/distill.json" ] || /usr/bin/time -f "$NAME %e s" $BIN/wandistiller train-student \
    --cache "$OUT/cache" --out "$OUT/$NAME" --lora-of $T --lora-rank "$RANK" --objective segment --student-steps 2 \
    --segment-start-weight 4 --batch-size 64 --lr "$LR" --warmup-steps 50 --ema-decay 0.995 --holdout-prompts 64 \
    --val-every 0 --epochs "$EPOCHS" > "$OUT/$NAME.log" 2>&1
/usr/bin/time -f "eval %e s" $BIN/wandistiller eval --student "$OUT/$NAME" --cache "$OUT/cache" \
    --attributes data/shapes-heldout.txt --checked-captions $L/recoloured-heldout.txt \
    --report "$OUT/eval-$NAME.json" > "$OUT/eval-$NAME.log" 2>&1
tail -n 3 "$OUT/eval-$NAME.log"
