#!/usr/bin/env bash
# The few-step and feature-distillation tables of docs/results.md (issues 18 and 19), measured on the shapes demo:
# one stage-one run that also records teacher features, then students trained with the demo's settings
# (make demo's DEMO_TRAIN_ARGS without validation), then one `eval` per table (same noise for every model).
#   bash scripts/measure_students.sh [OUT]      # default runs/m; about two hours on 2 CPU cores
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/m}
T=runs/tiny-teacher-pretrained
BIN=.venv/bin
make --no-print-directory $T/model_index.json
mkdir -p "$OUT"
make --no-print-directory teacher-cache TEACHER=$T CONFIG=configs/shapes-teacher-cache.toml \
    PROMPTS=data/shapes-prompts.txt CACHE="$OUT/cache" TEACHER_CACHE_ARGS="--record-features 1,3 --feature-dim 64"
ARGS="--epochs 4 --batch-size 64 --lr 1e-3 --warmup-steps 50 --ema-decay 0.995 --holdout-prompts 64 --eval-every 200
      --init-from-teacher $T"
train() {  # train NAME STUDENT_CONFIG [flags...]
    local name=$1 cfg=$2; shift 2
    rm -rf "$OUT/$name"
    /usr/bin/time -f "$name %e s" $BIN/wandistiller train-student --cache "$OUT/cache" --student-config "$cfg" \
        --out "$OUT/$name" $ARGS "$@" > "$OUT/$name.log" 2>&1
}
# Issue 18: the velocity student sampled with K steps against segment students trained for K steps.
train velocity configs/student-shapes.json
for k in 4 2 1; do train seg$k configs/student-shapes.json --objective segment --student-steps $k; done
train seg4mix configs/student-shapes.json --objective segment --student-steps 4 --segment-velocity-weight 1
$BIN/wandistiller eval --student "$OUT/velocity" --student-steps 1,2,4,8 --compare "$OUT/seg1" --compare "$OUT/seg2" \
    --compare "$OUT/seg4" --compare "$OUT/seg4mix" --cache "$OUT/cache" --teacher $T --report "$OUT/eval-fewstep.json" \
    --attributes data/shapes-heldout.txt --timing-runs 8 | tee "$OUT/eval-fewstep.log"
# Issue 18, K = 2: can a segment student reach half the velocity student's 2-step latent error? The segment starts
# (the only states the sampler queries) weighted 4x, at 4 and at 12 epochs, beside the plain K = 2 student.
train seg2s4 configs/student-shapes.json --objective segment --student-steps 2 --segment-start-weight 4
train seg2s4e12 configs/student-shapes.json --objective segment --student-steps 2 --segment-start-weight 4 --epochs 12
$BIN/wandistiller eval --student "$OUT/velocity" --student-steps 2 --compare "$OUT/seg2" --compare "$OUT/seg2s4" \
    --compare "$OUT/seg2s4e12" --cache "$OUT/cache" --teacher $T --report "$OUT/eval-seg2.json" \
    --attributes data/shapes-heldout.txt --timing-runs 8 | tee "$OUT/eval-seg2.log"
# Issue 19: a one-block student with and without feature distillation, same steps and seed.
train v1b configs/student-shapes-1block.json
train f1b configs/student-shapes-1block.json --objective velocity+feature --feature-pairs 0:3 --feature-weight 0.1
$BIN/wandistiller eval --student "$OUT/v1b" --compare "$OUT/f1b" --cache "$OUT/cache" --teacher $T \
    --report "$OUT/eval-feature.json" --attributes data/shapes-heldout.txt --timing-runs 4 | tee "$OUT/eval-feature.log"
# Issue 18 again on a cache of 2 seeds per prompt (twice the trajectories from the same prompts): at one seed the
# K = 2 segment student fits its 4,032 training trajectories (held-out loss ~2.5x its training loss) and stops at
# ~0.56x the velocity student's 2-step latent error; the same students from this cache, one eval run.
S2="$OUT/seeds2"
mkdir -p "$S2"
make --no-print-directory teacher-cache TEACHER=$T CONFIG=configs/shapes-teacher-cache.toml \
    PROMPTS=data/shapes-prompts.txt CACHE="$S2/cache" TEACHER_CACHE_ARGS="--seeds-per-prompt 2"
OUT_1=$OUT; OUT=$S2
train velocity configs/student-shapes.json
train seg1 configs/student-shapes.json --objective segment --student-steps 1
train seg2s4 configs/student-shapes.json --objective segment --student-steps 2 --segment-start-weight 4
train seg4 configs/student-shapes.json --objective segment --student-steps 4
train seg4mix configs/student-shapes.json --objective segment --student-steps 4 --segment-velocity-weight 1
$BIN/wandistiller eval --student "$S2/velocity" --student-steps 1,2,4,8 --compare "$S2/seg1" --compare "$S2/seg2s4" \
    --compare "$S2/seg4" --compare "$S2/seg4mix" --cache "$S2/cache" --teacher $T --report "$S2/eval-fewstep.json" \
    --attributes data/shapes-heldout.txt --timing-runs 8 | tee "$S2/eval-fewstep.log"
OUT=$OUT_1
