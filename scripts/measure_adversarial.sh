#!/usr/bin/env bash
# Issue 44's adversarial row (docs/results.md, "One step"): make one-step's 1-step student (its regression training is
# the warm-up) trained on with the segment objective's adversarial term (--segment-adversarial-weight: a discriminator
# whose trunk starts from the demo's velocity student, on the cached final latents re-noised), beside the same
# training without the term (the control: the same steps, lr and distance), then one `eval` of both with the
# one-step student they start from and the demo's 2-step student (same noise, the 128 held-out captions). Each
# training's wall time is in OUT/NAME.log (`/usr/bin/time`). Run make demo and make one-step first.
#   bash scripts/measure_adversarial.sh [OUT] [STEPS] [WEIGHTS] [LR]   # default runs/adversarial, 1008, "0.3", 3e-4
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/adversarial}
STEPS=${2:-1008}
WEIGHTS=${3:-0.3}
LR=${4:-3e-4}
BIN=.venv/bin
T=runs/tiny-teacher-pretrained
FROM=runs/one-step/student/student_ema
test -f runs/demo/student/student_ema/config.json -a -f $FROM/config.json || {
    echo "error: run make demo and make one-step first (this starts from runs/one-step/student)" >&2; exit 2; }
mkdir -p "$OUT"
ARGS="--cache runs/demo/cache --student-config configs/student-shapes.json --batch-size 64 --warmup-steps 20
      --ema-decay 0.995 --holdout-prompts 64 --val-every 0 --objective segment --student-steps 1
      --segment-start-weight 4 --segment-loss pseudo-huber --segment-huber-c 0.01 --lr $LR --max-steps $STEPS
      --init-from-teacher $FROM"
train() {  # train NAME [flags...]
    local name=$1; shift
    rm -rf "$OUT/$name"
    /usr/bin/time -f "$name %e s" $BIN/wandistiller train-student $ARGS --out "$OUT/$name" "$@" > "$OUT/$name.log" 2>&1
    tail -1 "$OUT/$name.log"
}
train control
compare=(--compare "$OUT/control")
for w in $WEIGHTS; do
    train "adv-$w" --segment-adversarial-weight "$w" --segment-disc-init runs/demo/student/student_ema \
        --segment-disc-warmup 100
    compare+=(--compare "$OUT/adv-$w")
done
$BIN/wandistiller eval --student runs/one-step/student "${compare[@]}" --compare runs/demo/student-2step \
    --cache runs/demo/cache --teacher $T --report "$OUT/eval.json" --attributes data/shapes-heldout.txt \
    --timing-runs 4
