#!/usr/bin/env bash
# Issue 36's table, on the shapes teacher: LoRA students of the teacher itself at K = 1, 2, 4 (rank 16 and 64) beside
# the compact segment students at the same K, the velocity student sampled at K, and the teacher, in one `eval` run
# (same noise for every model; 64 held-out trajectories for the latent error, the held-out captions of
# data/shapes-heldout.txt for the attribute checker). Each training's wall time and trained parameters are in
# OUT/NAME.log (`/usr/bin/time`, and train-student's first line).
#   bash scripts/measure_lora.sh [OUT]      # default runs/lora-m; reuses OUT/cache when it is complete
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/lora-m}
T=runs/tiny-teacher-pretrained
BIN=.venv/bin
make --no-print-directory $T/model_index.json
mkdir -p "$OUT"
[ -f "$OUT/cache/manifest.json" ] || make --no-print-directory teacher-cache TEACHER=$T \
    CONFIG=configs/shapes-teacher-cache.toml PROMPTS=data/shapes-prompts.txt CACHE="$OUT/cache"
ARGS="--epochs 4 --batch-size 64 --lr 1e-3 --warmup-steps 50 --holdout-prompts 64 --eval-every 200"
train() {  # train NAME [flags...]
    local name=$1; shift
    rm -rf "$OUT/$name"
    /usr/bin/time -f "$name %e s" $BIN/wandistiller train-student --cache "$OUT/cache" --out "$OUT/$name" $ARGS "$@" \
        > "$OUT/$name.log" 2>&1
}
COMPACT="--student-config configs/student-shapes.json --init-from-teacher $T --ema-decay 0.995"
train velocity $COMPACT
compare=()
for k in 1 2 4; do
    train seg$k $COMPACT --objective segment --student-steps $k
    compare+=(--compare "$OUT/seg$k")
    for r in 16 64; do
        train lora$k-r$r --lora-of $T --lora-rank $r --objective segment --student-steps $k
        compare+=(--compare "$OUT/lora$k-r$r")
    done
done
$BIN/wandistiller eval --student "$OUT/velocity" --student-steps 1,2,4 "${compare[@]}" --cache "$OUT/cache" \
    --teacher $T --report "$OUT/eval-lora.json" --attributes data/shapes-heldout.txt --timing-runs 8 \
    | tee "$OUT/eval-lora.log"
grep -h " s$" "$OUT"/*.log | sort
