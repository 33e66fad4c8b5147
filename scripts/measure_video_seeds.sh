#!/usr/bin/env bash
# Issue 43: do two seeds per caption help the video students as they helped the image ones (docs/results.md,
# "Few-step students")? Stage one over the clip captions with --seeds-per-prompt 2, then make demo-video's three
# students from it with make demo-video's flags and epochs (so twice its steps), and one `eval` of them beside the
# demo's one-seed students (same noise, the 128 held-out clip captions, the motion checker). Then whether the LoRA
# gains from longer training or a higher rank (3 epochs at rank 16; 2 epochs at rank 64), in a second eval beside
# the one-epoch LoRA and the segment student (OUT/eval-lora.json). Each training's wall time is in OUT/NAME.log.
# Run make demo-video first (or pass its folder as DEMO).
#   bash scripts/measure_video_seeds.sh [OUT] [DEMO]      # default runs/video-seeds, runs/demo-video
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/video-seeds}
DEMO=${2:-runs/demo-video}
BIN=.venv/bin
T=runs/tiny-video-teacher-pretrained
test -f "$DEMO/student/distill.json" -a -f "$DEMO/lora-4step/distill.json" || {
    echo "error: run make demo-video first (or give its folder as the second argument)" >&2; exit 2; }
mkdir -p "$OUT"
$BIN/wandistiller teacher-cache --teacher $T --config configs/clips-teacher-cache.toml --prompts data/clips-prompts.txt \
    --out "$OUT/cache" --seeds-per-prompt 2
BASE="--batch-size 64 --warmup-steps 50 --ema-decay 0.995 --holdout-prompts 64 --val-every 0 --lr 1e-3"
FEW="--objective segment --student-steps 4 --segment-velocity-weight 1"
train() {  # train NAME [flags...]
    local name=$1; shift
    if [ -f "$OUT/$name/distill.json" ]; then return; fi
    rm -rf "$OUT/$name"
    /usr/bin/time -f "$name %e s" $BIN/wandistiller train-student --cache "$OUT/cache" --out "$OUT/$name" $BASE "$@" \
        > "$OUT/$name.log" 2>&1
    tail -1 "$OUT/$name.log"
}
COMPACT="--student-config configs/student-clips.json --init-from-teacher $T --epochs 2"
train velocity-2seeds $COMPACT
train segment4-2seeds $COMPACT $FEW
train lora4-2seeds --lora-of $T --lora-rank 16 --epochs 1 $FEW
$BIN/wandistiller eval --student "$OUT/velocity-2seeds" --student-steps 4 --compare "$OUT/segment4-2seeds" \
    --compare "$OUT/lora4-2seeds" --compare "$DEMO/student-4step" --compare "$DEMO/lora-4step" \
    --cache "$OUT/cache" --teacher $T --report "$OUT/eval.json" \
    --attributes data/clips-heldout.txt --timing-runs 2
train lora4-r16-e3 --lora-of $T --lora-rank 16 --epochs 3 $FEW
train lora4-r64-e2 --lora-of $T --lora-rank 64 --epochs 2 $FEW
$BIN/wandistiller eval --student "$OUT/lora4-2seeds" --compare "$OUT/lora4-r16-e3" --compare "$OUT/lora4-r64-e2" \
    --compare "$OUT/segment4-2seeds" --cache "$OUT/cache" --teacher $T --report "$OUT/eval-lora.json" \
    --attributes data/clips-heldout.txt --timing-runs 1
