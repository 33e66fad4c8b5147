#!/usr/bin/env bash
# Issue 36's table, on the shapes teacher, from the demo's cache of two seeds per prompt: LoRA students of the
# teacher itself at K = 1, 2, 4 (rank 16 and 64) beside the compact segment students at the same K, the velocity
# student sampled at K, and the teacher, in one `eval` run (same noise for every model; 64 held-out prompts' 128
# trajectories for the latent error, the held-out captions of data/shapes-heldout.txt for the attribute checker).
# Equal training time: a LoRA step costs ~1.8x a compact step on the CPU (the teacher's 4 blocks per expert against
# the student's 2), so the compact students train 2 epochs (2016 steps) and the LoRAs 1 (1008 steps). Each
# training's wall time is in OUT/NAME.log (`/usr/bin/time`), its trained parameters in its first line.
#   bash scripts/measure_lora.sh [OUT]      # default runs/lora-m; reuses OUT/cache2 when it is complete
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/lora-m}
T=runs/tiny-teacher-pretrained
BIN=.venv/bin
make --no-print-directory $T/model_index.json
mkdir -p "$OUT"
[ -f "$OUT/cache2/manifest.json" ] || make --no-print-directory teacher-cache TEACHER=$T \
    CONFIG=configs/shapes-teacher-cache.toml PROMPTS=data/shapes-prompts.txt CACHE="$OUT/cache2" \
    TEACHER_CACHE_ARGS="--seeds-per-prompt 2"
ARGS="--batch-size 64 --lr 1e-3 --warmup-steps 50 --holdout-prompts 64 --ema-decay 0.995"
train() {  # train NAME [flags...]
    local name=$1; shift
    rm -rf "$OUT/$name"
    /usr/bin/time -f "$name %e s" $BIN/wandistiller train-student --cache "$OUT/cache2" --out "$OUT/$name" $ARGS "$@" \
        > "$OUT/$name.log" 2>&1
}
COMPACT="--student-config configs/student-shapes.json --init-from-teacher $T --epochs 2"
LORA="--lora-of $T --epochs 1"
declare -A K_ARGS=([1]="" [2]="--segment-start-weight 4" [4]="--segment-velocity-weight 1")
train velocity $COMPACT
compare=()
for k in 1 2 4; do
    train seg$k $COMPACT --objective segment --student-steps $k ${K_ARGS[$k]}
    compare+=(--compare "$OUT/seg$k")
    for r in 16 64; do
        train lora$k-r$r $LORA --lora-rank $r --objective segment --student-steps $k ${K_ARGS[$k]}
        compare+=(--compare "$OUT/lora$k-r$r")
    done
done
$BIN/wandistiller eval --student "$OUT/velocity" --student-steps 1,2,4 "${compare[@]}" --cache "$OUT/cache2" \
    --teacher $T --report "$OUT/eval-lora.json" --attributes data/shapes-heldout.txt --timing-runs 8 \
    | tee "$OUT/eval-lora.log"
grep -h " s$" "$OUT"/*.log | sort
$BIN/python scripts/lora_table.py "$OUT" | tee "$OUT/table.md"  # the table of docs/results.md
