# WanDistiller. Every target creates/updates the virtual environment itself (the stage targets use an activated
# environment instead where wandistiller is installed in it: ACTIVE_ENV below).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU wheel of torch 2.13.0 lies on this project's machines; on a GPU box pip picks the CUDA build.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
# The stage targets (tiny-teacher, teacher-cache, train-student) run the environment you activated ($VIRTUAL_ENV,
# else $CONDA_PREFIX) as it is, installing nothing, when it holds wandistiller installed from this checkout (`pip
# install -e .`); otherwise, as test, demo and the others always do, this $(VENV), built on first use.
# ACTIVE_ENV= forces the latter.
ACTIVE_ENV ?= $(or $(VIRTUAL_ENV),$(CONDA_PREFIX))
# (the checkout the activated environment imports wandistiller from: -I, not this folder's pipeline/ by chance)
ACTIVE_SRC := $(if $(filter-out $(abspath $(VENV)),$(ACTIVE_ENV)),$(shell test -x "$(ACTIVE_ENV)/bin/wandistiller" \
	&& "$(ACTIVE_ENV)/bin/python" -I -c \
	"import os, pipeline; print(os.path.dirname(os.path.dirname(os.path.abspath(pipeline.__file__))))" 2> /dev/null),)
STAGE_BIN := $(if $(filter $(CURDIR),$(ACTIVE_SRC)),$(ACTIVE_ENV)/bin,$(BIN))
STAGE_DEPS := $(if $(filter $(CURDIR),$(ACTIVE_SRC)),,$(STAMP))

RUNS ?= runs
TINY_TEACHER := $(RUNS)/tiny-teacher
TEACHER ?= $(TINY_TEACHER)
PROMPTS ?= data/prompts.txt
CACHE ?= $(RUNS)/cache
PLACEMENT ?= auto
# Sizes for the tiny teacher; a real teacher uses the stage's defaults (480x832, 40 steps) or CONFIG.
ifeq ($(TEACHER),$(TINY_TEACHER))
CONFIG ?= configs/tiny-teacher-cache.toml
endif
CONFIG_FLAG := $(if $(CONFIG),--config $(CONFIG),)
TEACHER_CACHE_ARGS ?=
PYTEST_ARGS ?=

.PHONY: install tiny-teacher tiny-teacher-train teacher-cache train-student demo demo-video demo-i2v one-step test faults bench gpu-check clean help

help:
	@echo "make demo | demo-video | demo-i2v | one-step | test | faults | bench | gpu-check | teacher-cache | train-student | install | clean"

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[dev,quant,motion]"
	touch $(STAMP)

install: $(STAMP)

$(TINY_TEACHER)/model_index.json: | $(STAGE_DEPS)
	$(STAGE_BIN)/wandistiller tiny-teacher --out $(TINY_TEACHER) --variant wan2.2

tiny-teacher: $(TINY_TEACHER)/model_index.json

# The pretrained tiny teacher (data/tiny-teacher-pretrained, trained by `make tiny-teacher-train`): draws shapes.
PRETRAINED_TEACHER := $(RUNS)/tiny-teacher-pretrained
PRETRAINED_FILES := $(wildcard data/tiny-teacher-pretrained/*/*)
$(PRETRAINED_TEACHER)/model_index.json: $(PRETRAINED_FILES) | $(STAMP)
	$(BIN)/wandistiller tiny-teacher --out $(PRETRAINED_TEACHER) --variant pretrained
	touch $@  # the copy keeps data/'s file times: without this the target would never be up to date

# Train a tiny Wan 2.2 teacher (VAE + two experts, frozen UMT5) to draw the shapes captions of pipeline/shapes.py,
# on CPU (under an hour on 2 cores); OUT/TRAINING.json gets the attribute checker's held-out score. Its output
# is what data/tiny-teacher-pretrained holds; see scripts/train_tiny_teacher.py.
TRAIN_TEACHER_OUT ?= $(RUNS)/tiny-teacher-trained
TRAIN_TEACHER_ARGS ?=
tiny-teacher-train: $(STAMP)
	$(BIN)/python scripts/train_tiny_teacher.py --out $(TRAIN_TEACHER_OUT) $(TRAIN_TEACHER_ARGS)

teacher-cache: $(STAGE_DEPS) $(if $(filter $(TINY_TEACHER),$(TEACHER)),$(TINY_TEACHER)/model_index.json,)
	$(STAGE_BIN)/wandistiller teacher-cache $(CONFIG_FLAG) --teacher $(TEACHER) --prompts $(PROMPTS) \
		--out $(CACHE) --placement $(PLACEMENT) $(TEACHER_CACHE_ARGS)

# Stage two. NPROC > 1 runs torchrun on this node (one rank per GPU, or per CPU process with gloo);
# several nodes: see docs/multi-gpu.md.
STUDENT_CONFIG ?= configs/student-tiny.json
OUT ?= $(RUNS)/student
NPROC ?= 1
# Demo settings for the tiny student on the tiny cache (a minute on a CPU); real runs pass their own.
ifeq ($(STUDENT_CONFIG),configs/student-tiny.json)
TRAIN_ARGS ?= --epochs 3 --batch-size 32 --lr 2e-3 --warmup-steps 10 --holdout-prompts 16 --eval-every 25
endif
TRAIN_ARGS ?=
# (--no-python runs the installed command: a pipeline.py in the working folder cannot shadow the CLI)
TRAIN_LAUNCH := $(if $(filter-out 1,$(NPROC)),$(STAGE_BIN)/torchrun --standalone --nproc-per-node $(NPROC) --no-python $(STAGE_BIN)/wandistiller,$(STAGE_BIN)/wandistiller)

train-student: $(STAGE_DEPS)
	$(TRAIN_LAUNCH) train-student --cache $(CACHE) --student-config $(STUDENT_CONFIG) --out $(OUT) $(TRAIN_ARGS)

# The whole pipeline on the pretrained tiny teacher and the shapes captions: stage one (two seeds per prompt) ->
# stage two from the same cache (a velocity student; a DEMO_FEW_STEPS-step segment student; a DEMO_FEW_STEPS-step
# LoRA of the teacher itself, exported in diffusers' LoRA format) -> sample -> eval with the attribute checker, the
# velocity student sampled at DEMO_FEW_STEPS beside the few-step ones (why K = 2 and two seeds: docs/results.md,
# "Few-step students"). About 25 minutes on 2 CPU cores.
DEMO ?= $(RUNS)/demo
DEMO_FEW_STEPS ?= 2
DEMO_FEW := $(DEMO)/student-$(DEMO_FEW_STEPS)step
DEMO_LORA := $(DEMO)/lora-$(DEMO_FEW_STEPS)step
DEMO_LORA_RANK ?= 16
DEMO_CACHE_ARGS ?= --seeds-per-prompt 2
# Each objective's weighting at K (scripts/measure_lora.sh measured them): K = 2 weights the states the sampler
# queries, K = 4 adds the per-step velocity loss.
DEMO_FEW_ARGS ?= --objective segment --student-steps $(DEMO_FEW_STEPS) \
	$(if $(filter 2,$(DEMO_FEW_STEPS)),--segment-start-weight 4,$(if $(filter 4,$(DEMO_FEW_STEPS)),--segment-velocity-weight 1,))
# 2 epochs of the 2-seed cache (2016 steps); the LoRA, whose step costs ~1.8x a compact one here, trains 1.
DEMO_BASE_ARGS ?= --batch-size 64 --lr 1e-3 --warmup-steps 50 --ema-decay 0.995 --holdout-prompts 64 \
	--val-every 512 --val-decode --val-max-prompts 8
DEMO_TRAIN_ARGS ?= $(DEMO_BASE_ARGS) --epochs 2 --init-from-teacher $(PRETRAINED_TEACHER)
DEMO_LORA_ARGS ?= $(DEMO_BASE_ARGS) --epochs 1 --lora-of $(PRETRAINED_TEACHER) --lora-rank $(DEMO_LORA_RANK)
# A new pretrained teacher (or new stage-one settings or captions) makes a cache left by an earlier demo stale,
# and teacher-cache refuses it; start the cache again instead.
$(DEMO)/cache.stamp: $(PRETRAINED_FILES) configs/shapes-teacher-cache.toml data/shapes-prompts.txt
	rm -rf $(DEMO)/cache
	mkdir -p $(DEMO) && echo "$(DEMO_CACHE_ARGS)" > $@
demo: $(STAMP) $(PRETRAINED_TEACHER)/model_index.json $(DEMO)/cache.stamp
	@# a cache written with other stage-one flags (an earlier demo's one seed) is started again
	@test "$$(cat $(DEMO)/cache.stamp)" = "$(DEMO_CACHE_ARGS)" || { rm -rf $(DEMO)/cache; echo "$(DEMO_CACHE_ARGS)" > $(DEMO)/cache.stamp; }
	$(MAKE) --no-print-directory teacher-cache ACTIVE_ENV= TEACHER=$(PRETRAINED_TEACHER) CONFIG=configs/shapes-teacher-cache.toml \
		PROMPTS=data/shapes-prompts.txt CACHE=$(DEMO)/cache TEACHER_CACHE_ARGS="$(DEMO_CACHE_ARGS)"
	rm -rf $(DEMO)/student $(DEMO_FEW) $(DEMO_LORA) $(DEMO_LORA)-export  # trained afresh; a complete cache is reused
	$(MAKE) --no-print-directory train-student ACTIVE_ENV= CACHE=$(DEMO)/cache OUT=$(DEMO)/student \
		STUDENT_CONFIG=configs/student-shapes.json TRAIN_ARGS="$(DEMO_TRAIN_ARGS)"
	$(MAKE) --no-print-directory train-student ACTIVE_ENV= CACHE=$(DEMO)/cache OUT=$(DEMO_FEW) \
		STUDENT_CONFIG=configs/student-shapes.json TRAIN_ARGS="$(DEMO_TRAIN_ARGS) $(DEMO_FEW_ARGS)"
	$(BIN)/wandistiller train-student --cache $(DEMO)/cache --out $(DEMO_LORA) $(DEMO_LORA_ARGS) $(DEMO_FEW_ARGS)
	$(BIN)/wandistiller export --student $(DEMO_LORA) --out $(DEMO_LORA)-export
	$(BIN)/wandistiller sample --student $(DEMO)/student --compare $(DEMO_FEW) --compare $(DEMO_LORA) \
		--teacher $(PRETRAINED_TEACHER) --prompts data/shapes-heldout.txt --out $(DEMO)/grid.png --max-prompts 8
	$(BIN)/wandistiller eval --student $(DEMO)/student --student-steps $(DEMO_FEW_STEPS),8 --compare $(DEMO_FEW) \
		--compare $(DEMO_LORA) --cache $(DEMO)/cache --teacher $(PRETRAINED_TEACHER) --report $(DEMO)/eval.json \
		--attributes data/shapes-heldout.txt --timing-runs 8
	@echo
	@echo "demo done:"
	@echo "  cache      $(DEMO)/cache        (wandistiller cache info $(DEMO)/cache)"
	@echo "  student    $(DEMO)/student/student  (diffusers WanTransformer3DModel; loss curve $(DEMO)/student/loss.png)"
	@echo "  few-step   $(DEMO_FEW)/student  ($(DEMO_FEW_STEPS)-step segment student from the same cache)"
	@echo "  LoRA       $(DEMO_LORA)-export  ($(DEMO_FEW_STEPS)-step rank-$(DEMO_LORA_RANK) LoRA of the teacher, diffusers' LoRA"
	@echo "                                  format: WanPipeline.from_pretrained(teacher) + load_lora_weights; its README)"
	@echo "  curves     tensorboard --logdir $(DEMO)   (loss terms, lr, samples/s, held-out loss, validation"
	@echo "                                  final-latent error and teacher|student image grids of each run)"
	@echo "  grid       $(DEMO)/grid.png     (teacher | student | $(DEMO_FEW_STEPS)-step student | LoRA, same noise, one"
	@echo "                                  row per held-out caption)"
	@echo "  eval       $(DEMO)/eval.json    (plot $(DEMO)/eval.png; the printed table: final-latent error, attribute"
	@echo "                                  accuracy, time per image of the teacher, the student at $(DEMO_FEW_STEPS) and 8"
	@echo "                                  steps, the few-step student and the LoRA; images $(DEMO)/eval-attributes.png)"

# A 1-step compact student from make demo's cache (docs/results.md, "One step"; run make demo first): the demo's
# 2-step segment student trained on at one step with the pseudo-Huber distance (4 epochs), then eval on the held-out
# captions beside the 1-step segment student trained from the teacher's blocks as the demo trains its students and
# the demo's 2-step student. About 14 minutes on 2 CPU cores. ONE_STEP_COMPARE: more --compare runs for the eval.
ONE_STEP ?= $(RUNS)/one-step
ONE_STEP_BASE_ARGS ?= --cache $(DEMO)/cache --student-config configs/student-shapes.json --batch-size 64 \
	--warmup-steps 50 --ema-decay 0.995 --holdout-prompts 64 --val-every 0 --objective segment --student-steps 1
ONE_STEP_ARGS ?= --segment-start-weight 4 --segment-loss pseudo-huber --segment-huber-c 0.01 --lr 3e-4 --epochs 4 \
	--init-from-teacher $(DEMO_FEW)/student_ema
ONE_STEP_COMPARE ?=
one-step: $(STAMP) $(PRETRAINED_TEACHER)/model_index.json
	@test -f $(DEMO)/cache/manifest.json -a -f $(DEMO_FEW)/student_ema/config.json || { echo "error: make one-step \
	starts from make demo's cache and its $(DEMO_FEW_STEPS)-step student ($(DEMO_FEW)); run make demo first" >&2; exit 2; }
	rm -rf $(ONE_STEP)
	$(BIN)/wandistiller train-student $(ONE_STEP_BASE_ARGS) $(ONE_STEP_ARGS) --out $(ONE_STEP)/student
	$(BIN)/wandistiller train-student $(ONE_STEP_BASE_ARGS) --lr 1e-3 --epochs 2 \
		--init-from-teacher $(PRETRAINED_TEACHER) --out $(ONE_STEP)/from-teacher
	$(BIN)/wandistiller eval --student $(ONE_STEP)/student --compare $(ONE_STEP)/from-teacher --compare $(DEMO_FEW) \
		$(ONE_STEP_COMPARE) --cache $(DEMO)/cache --teacher $(PRETRAINED_TEACHER) --report $(ONE_STEP)/eval.json \
		--attributes data/shapes-heldout.txt --timing-runs 8
	@echo
	@echo "one-step done: $(ONE_STEP)/student (1 step, from $(DEMO_FEW)); eval $(ONE_STEP)/eval.json (its table above)"

# The same on video: the tiny video teacher (data/tiny-video-teacher-pretrained: 9-frame 64x64 clips of a moving
# shape) over the 3,632 clip training captions -> a 4-block velocity student, a DEMO_VIDEO_STEPS-step segment student
# and a DEMO_VIDEO_STEPS-step per-expert LoRA of the teacher (exported in diffusers' and in Wan's key names) -> sample
# (frame-strip grid and animated WebPs) -> eval on all 400 held-out clip captions at two noises (800 clips) with the
# motion checker (motion right, paired kept, speed ratio) and optical flow (flow ratio, dynamic degree, flicker), the
# teacher re-drawn at 16, 4 and 2 steps as rows. About 30 minutes on 2 CPU cores; figures: docs/results.md, "Video".
DEMO_VIDEO ?= $(RUNS)/demo-video
VIDEO_TEACHER := $(RUNS)/tiny-video-teacher-pretrained
VIDEO_TEACHER_FILES := $(wildcard data/tiny-video-teacher-pretrained/*/*)
DEMO_VIDEO_STEPS ?= 4
DEMO_VIDEO_FEW := $(DEMO_VIDEO)/student-$(DEMO_VIDEO_STEPS)step
DEMO_VIDEO_LORA := $(DEMO_VIDEO)/lora-$(DEMO_VIDEO_STEPS)step
# Equal segments: this teacher's 8 steps give its high-noise expert only the first steps (boundary_ratio 0.875), so
# --student-expert-steps 2,2 leaves the low-noise expert's last segment 3 steps long, and kept less (docs/results.md).
DEMO_VIDEO_FEW_ARGS ?= --objective segment --student-steps $(DEMO_VIDEO_STEPS) --segment-velocity-weight 1
DEMO_VIDEO_BASE_ARGS ?= --batch-size 64 --warmup-steps 50 --ema-decay 0.995 --holdout-prompts 64 --val-every 512 \
	--val-decode --val-max-prompts 8
DEMO_VIDEO_TRAIN_ARGS ?= $(DEMO_VIDEO_BASE_ARGS) --lr 1e-3 --epochs 2 --init-from-teacher $(VIDEO_TEACHER)
DEMO_VIDEO_LORA_ARGS ?= $(DEMO_VIDEO_BASE_ARGS) --lr 1e-3 --epochs 1 --lora-of $(VIDEO_TEACHER) --lora-rank 16
$(VIDEO_TEACHER)/model_index.json: $(VIDEO_TEACHER_FILES) | $(STAMP)
	$(BIN)/wandistiller tiny-teacher --out $(VIDEO_TEACHER) --variant video-pretrained
	touch $@
$(DEMO_VIDEO)/cache.stamp: $(VIDEO_TEACHER_FILES) configs/clips-teacher-cache.toml data/clips-prompts.txt
	rm -rf $(DEMO_VIDEO)/cache
	mkdir -p $(DEMO_VIDEO) && touch $@
demo-video: $(STAMP) $(VIDEO_TEACHER)/model_index.json $(DEMO_VIDEO)/cache.stamp
	$(BIN)/wandistiller teacher-cache --teacher $(VIDEO_TEACHER) --config configs/clips-teacher-cache.toml \
		--prompts data/clips-prompts.txt --out $(DEMO_VIDEO)/cache
	rm -rf $(DEMO_VIDEO)/student $(DEMO_VIDEO_FEW) $(DEMO_VIDEO_LORA)-1 $(DEMO_VIDEO_LORA)-2 $(DEMO_VIDEO_LORA)-export \
		$(DEMO_VIDEO_LORA)-wan
	$(BIN)/wandistiller train-student --cache $(DEMO_VIDEO)/cache --out $(DEMO_VIDEO)/student \
		--student-config configs/student-clips.json $(DEMO_VIDEO_TRAIN_ARGS)
	$(BIN)/wandistiller train-student --cache $(DEMO_VIDEO)/cache --out $(DEMO_VIDEO_FEW) \
		--student-config configs/student-clips.json $(DEMO_VIDEO_TRAIN_ARGS) $(DEMO_VIDEO_FEW_ARGS)
	# the LoRA as on A14B: one run per expert (validation sampling needs both: off), then one export of the pair
	for e in 1 2; do $(BIN)/wandistiller train-student --cache $(DEMO_VIDEO)/cache --out $(DEMO_VIDEO_LORA)-$$e \
		$(DEMO_VIDEO_LORA_ARGS) $(DEMO_VIDEO_FEW_ARGS) --lora-experts $$e --val-every 0 --no-val-decode || exit 1; done
	$(BIN)/wandistiller export --student $(DEMO_VIDEO_LORA)-1 --student $(DEMO_VIDEO_LORA)-2 --out $(DEMO_VIDEO_LORA)-export
	$(BIN)/wandistiller export --student $(DEMO_VIDEO_LORA)-1 --student $(DEMO_VIDEO_LORA)-2 --out $(DEMO_VIDEO_LORA)-wan \
		--lora-format wan
	$(BIN)/wandistiller sample --student $(DEMO_VIDEO)/student --compare $(DEMO_VIDEO_FEW) \
		--compare $(DEMO_VIDEO_LORA)-1+$(DEMO_VIDEO_LORA)-2 --hybrid $(DEMO_VIDEO_LORA)-1+$(DEMO_VIDEO_LORA)-2 \
		--teacher $(VIDEO_TEACHER) --prompts data/clips-heldout.txt --out $(DEMO_VIDEO)/grid.png --max-prompts 8
	# the hybrid: the teacher, guided, up to the LoRA pair's first low-noise boundary, then the pair (eval --hybrid)
	$(BIN)/wandistiller eval --student $(DEMO_VIDEO)/student --student-steps $(DEMO_VIDEO_STEPS) \
		--compare $(DEMO_VIDEO_FEW) --compare $(DEMO_VIDEO_LORA)-1+$(DEMO_VIDEO_LORA)-2 --cache $(DEMO_VIDEO)/cache \
		--hybrid $(DEMO_VIDEO_LORA)-1+$(DEMO_VIDEO_LORA)-2 --teacher $(VIDEO_TEACHER) --report $(DEMO_VIDEO)/eval.json \
		--attributes data/clips-heldout-all.txt --attribute-seeds 2 --teacher-redraw 16,4,2 --timing-runs 8
	$(BIN)/python scripts/check_lora_export.py --export $(DEMO_VIDEO_LORA)-export --teacher $(VIDEO_TEACHER) \
		--grid $(DEMO_VIDEO)/grid.png --max-prompts 2
	@echo
	@echo "demo-video done:"
	@echo "  cache      $(DEMO_VIDEO)/cache   (wandistiller cache info $(DEMO_VIDEO)/cache: 9 frames, 3 latent)"
	@echo "  students   $(DEMO_VIDEO)/student (velocity), $(DEMO_VIDEO_FEW) ($(DEMO_VIDEO_STEPS)-step segment)"
	@echo "  LoRA       $(DEMO_VIDEO_LORA)-1, -2 (one run per expert); the pair exported as $(DEMO_VIDEO_LORA)-export"
	@echo "             (diffusers' format) and $(DEMO_VIDEO_LORA)-wan (Wan key names and comfyui-workflow.json, ComfyUI;"
	@echo "             comfyui-hybrid-workflow.json: the teacher's first steps, then the low-noise LoRA)"
	@echo "  videos     $(DEMO_VIDEO)/grid-videos/ (animated WebP and H.264 mp4 per clip)"
	@echo "  grid       $(DEMO_VIDEO)/grid.png (frame strips, teacher | students, same noise) and $(DEMO_VIDEO)/grid-videos/"
	@echo "  eval       $(DEMO_VIDEO)/eval.json (kept, speed_ratio, flow_ratio, dynamic_degree per model, the hybrid"
	@echo "                                  teacher:2+LoRA among them; clips"
	@echo "                                  $(DEMO_VIDEO)/eval-attributes.png)"

# Image-to-video, offline (docs/i2v.md): the tiny I2V teacher (data/tiny-i2v-teacher-pretrained: the video teacher
# fine-tuned to move the shape of a first frame; two experts, 36 input channels as Wan2.2-I2V-A14B) -> first frames
# of the clip captions from the clip generator (scripts/clip_images.py) -> stage one with --images -> a velocity
# student, a DEMO_I2V_STEPS-step segment student and a per-expert LoRA pair, all from that cache -> export of the pair
# -> sample (the image, then teacher | students) -> eval --attributes on the 128 held-out captions' first frames
# (motion kept, speed ratio, first-frame fidelity) -> the export drawn through diffusers as its card says. About 20
# minutes on 2 CPU cores; figures: docs/results.md, "Image-to-video".
DEMO_I2V ?= $(RUNS)/demo-i2v
I2V_TEACHER := $(RUNS)/tiny-i2v-teacher-pretrained
I2V_TEACHER_FILES := $(wildcard data/tiny-i2v-teacher-pretrained/*/*)
DEMO_I2V_STEPS ?= 4
DEMO_I2V_FEW := $(DEMO_I2V)/student-$(DEMO_I2V_STEPS)step
DEMO_I2V_LORA := $(DEMO_I2V)/lora-$(DEMO_I2V_STEPS)step
DEMO_I2V_FEW_ARGS ?= --objective segment --student-steps $(DEMO_I2V_STEPS) --segment-velocity-weight 1
DEMO_I2V_TRAIN_ARGS ?= $(DEMO_VIDEO_BASE_ARGS) --lr 1e-3 --epochs 2 --init-from-teacher $(I2V_TEACHER)
DEMO_I2V_LORA_ARGS ?= $(DEMO_VIDEO_BASE_ARGS) --lr 1e-3 --epochs 1 --lora-of $(I2V_TEACHER) --lora-rank 16
DEMO_I2V_CAPTIONS ?= data/clips-prompts.txt
$(I2V_TEACHER)/model_index.json: $(I2V_TEACHER_FILES) | $(STAMP)
	$(BIN)/wandistiller tiny-teacher --out $(I2V_TEACHER) --variant i2v-pretrained
	touch $@
$(DEMO_I2V)/cache.stamp: $(I2V_TEACHER_FILES) configs/clips-teacher-cache.toml $(DEMO_I2V_CAPTIONS) scripts/clip_images.py
	rm -rf $(DEMO_I2V)/cache $(DEMO_I2V)/images
	$(BIN)/python scripts/clip_images.py --captions $(DEMO_I2V_CAPTIONS) --out $(DEMO_I2V)/images
	mkdir -p $(DEMO_I2V) && touch $@
demo-i2v: $(STAMP) $(I2V_TEACHER)/model_index.json $(DEMO_I2V)/cache.stamp
	$(BIN)/python scripts/clip_images.py --captions data/clips-heldout.txt --out $(DEMO_I2V)/heldout-images --seed 1
	$(BIN)/wandistiller teacher-cache --teacher $(I2V_TEACHER) --config configs/clips-teacher-cache.toml \
		--images $(DEMO_I2V)/images/images.tsv --out $(DEMO_I2V)/cache
	rm -rf $(DEMO_I2V)/student $(DEMO_I2V_FEW) $(DEMO_I2V_LORA)-1 $(DEMO_I2V_LORA)-2 $(DEMO_I2V_LORA)-export \
		$(DEMO_I2V_LORA)-wan
	$(BIN)/wandistiller train-student --cache $(DEMO_I2V)/cache --out $(DEMO_I2V)/student \
		--student-config configs/student-clips-i2v.json $(DEMO_I2V_TRAIN_ARGS)
	$(BIN)/wandistiller train-student --cache $(DEMO_I2V)/cache --out $(DEMO_I2V_FEW) \
		--student-config configs/student-clips-i2v.json $(DEMO_I2V_TRAIN_ARGS) $(DEMO_I2V_FEW_ARGS)
	for e in 1 2; do $(BIN)/wandistiller train-student --cache $(DEMO_I2V)/cache --out $(DEMO_I2V_LORA)-$$e \
		$(DEMO_I2V_LORA_ARGS) $(DEMO_I2V_FEW_ARGS) --lora-experts $$e --val-every 0 --no-val-decode || exit 1; done
	$(BIN)/wandistiller export --student $(DEMO_I2V_LORA)-1 --student $(DEMO_I2V_LORA)-2 --out $(DEMO_I2V_LORA)-export
	$(BIN)/wandistiller export --student $(DEMO_I2V_LORA)-1 --student $(DEMO_I2V_LORA)-2 --out $(DEMO_I2V_LORA)-wan \
		--lora-format wan
	$(BIN)/wandistiller sample --student $(DEMO_I2V)/student --compare $(DEMO_I2V_FEW) \
		--compare $(DEMO_I2V_LORA)-1+$(DEMO_I2V_LORA)-2 --teacher $(I2V_TEACHER) \
		--images $(DEMO_I2V)/heldout-images/images.tsv --out $(DEMO_I2V)/grid.png --max-prompts 8
	$(BIN)/wandistiller eval --student $(DEMO_I2V)/student --student-steps $(DEMO_I2V_STEPS),8 \
		--compare $(DEMO_I2V_FEW) --compare $(DEMO_I2V_LORA)-1+$(DEMO_I2V_LORA)-2 --cache $(DEMO_I2V)/cache \
		--teacher $(I2V_TEACHER) --report $(DEMO_I2V)/eval.json --attributes $(DEMO_I2V)/heldout-images/images.tsv
	$(BIN)/python scripts/check_lora_export.py --export $(DEMO_I2V_LORA)-export --teacher $(I2V_TEACHER) \
		--grid $(DEMO_I2V)/grid.png --max-prompts 2
	@echo
	@echo "demo-i2v done:"
	@echo "  images     $(DEMO_I2V)/images/images.tsv (first frames of the training captions), $(DEMO_I2V)/heldout-images/"
	@echo "  cache      $(DEMO_I2V)/cache   (wandistiller cache info $(DEMO_I2V)/cache: condition concat, 3 latent frames)"
	@echo "  students   $(DEMO_I2V)/student (velocity), $(DEMO_I2V_FEW) ($(DEMO_I2V_STEPS)-step segment)"
	@echo "  LoRA       $(DEMO_I2V_LORA)-1, -2 (one run per expert); the pair exported as $(DEMO_I2V_LORA)-export"
	@echo "             (a WanImageToVideoPipeline LoRA: its README's call) and $(DEMO_I2V_LORA)-wan (Wan key names and"
	@echo "             comfyui-workflow.json, whose LoadImage reads first_frame.png from ComfyUI's input folder)"
	@echo "  grid       $(DEMO_I2V)/grid.png (image | teacher | students, same noise) and $(DEMO_I2V)/grid-videos/"
	@echo "  eval       $(DEMO_I2V)/eval.json (kept, speed_ratio, flow_ratio and first_frame fidelity per model; clips"
	@echo "                                  $(DEMO_I2V)/eval-attributes.png)"

# One pytest-xdist worker per core (TEST_WORKERS=0: one process), each test file whole on one worker so that a
# module's fixtures (the fault suite's reference runs) are built once. On 2 cores: 14 min instead of 19-24. The 20
# slowest tests are listed at the end, so a CI log says where the suite's minutes go.
TEST_WORKERS ?= auto
test: $(STAMP)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --durations=20 $(PYTEST_ARGS)

# Kills, corrupt caches, full disks, bad input: a table of what was tried and what survived
# (docs/reliability.md). `make test` runs the same scenarios through tests/test_faults.py.
# FAULTS_ARGS="--only stage1-kill -v --seed 7"; see python -m tests.faults --help.
FAULTS_ARGS ?=
faults: $(STAMP)
	$(BIN)/python -m tests.faults $(FAULTS_ARGS)

# Every benchmark against its baseline in one run: bench/results.json and a table. BENCH_ARGS="--quick" for a
# smoke run, "--device cuda" on a GPU box; see python -m bench.run_all --help.
BENCH_ARGS ?=
bench: $(STAMP)
	$(BIN)/python -m bench.run_all $(BENCH_ARGS)

# On a GPU box, as is (docs/benchmarks.md, "On a GPU"): the suite with the GPU visible, then the benchmarks on CUDA,
# within 9 minutes; results into bench/results-cuda.json, logs into $(RUNS)/gpu-check. It installs nothing (no network
# needed): GPU_PYTHON is the Python whose packages it uses (this venv's if there is one, else python3), and what that
# Python lacks, a GPU included, is said in one line (exit 2).
GPU_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON))
gpu-check:
	@$(GPU_PYTHON) scripts/gpu_check.py --logs $(RUNS)/gpu-check

clean:
	rm -rf $(RUNS)
