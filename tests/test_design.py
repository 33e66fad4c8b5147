"""The redesign's figures held to their bounds (tests/design_figures.py measures them; `python -m tests.design_figures`
prints them with the files they come from)."""

from __future__ import annotations

import design_figures as D

SRC = D.sources()


def test_no_file_name_is_used_twice():
    assert D.repeated_file_names(SRC) == []


def test_records_are_read_by_attribute_outside_the_modules_that_define_them():
    assert D.record_lookups(SRC) == {}


def test_no_registry_entry_is_chosen_by_its_name_outside_the_registry():
    assert D.name_comparisons(SRC) == {}


def test_only_the_student_kind_modules_tell_compact_from_lora():
    assert D.student_kind_branches(SRC) == {}


def test_the_transformer_is_called_in_one_module():
    """Every forward of a Wan transformer goes through pipeline/model_call.py (the benches and scripts too), and no
    signature elsewhere carries the input rule's parts: the rule travels as one value."""
    import ast

    code = D.sources() | {str(p.relative_to(D.ROOT)): p.read_text() for d in ("bench", "scripts")
                          for p in sorted((D.ROOT / d).glob("*.py"))}
    calls, params = [], []
    for rel, text in code.items():
        if rel == "pipeline/model_call.py":
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Call) and any(k.arg == "hidden_states" for k in node.keywords):
                calls.append(f"{rel}:{node.lineno}")
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                params += [f"{rel}:{node.name}({x.arg})" for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)
                           if x.arg in ("expand_timesteps", "patch", "patch_size")]
    assert calls == [] and params == []


def test_the_readme_is_a_front_door():
    assert D.readme_lines() <= 250


# Issue 42's bound: pipeline/ cache/ stages/ at most 15,000 lines (17,185 before the redesign, 14,976 after it). A
# feature that needs more raises it in its own commit, saying what the lines buy. Issue 43 (video), so far: +40 for
# `export --lora-format wan` (LoRA files in the original Wan key names, for ComfyUI); +116 for the K-step student's
# schedule as a choice (explicit, shifted, per expert; its refusals, sampler, export hint and plan's --keep-steps);
# +174 for the moving-shape clips and the motion checker; +67 for eval's motion figures (clips drawn whole on a video
# cache, motion kept and speed ratio per entry, the table's motion columns, clip/shapes captions refused by frames);
# +47 for `sample` in frames (clips at the run's frame count, frame strips, animated WebPs, --fps and a mismatched
# --compare refused) and `tiny-teacher --variant video-pretrained`; +57 for `export` in frames (num_frames, a
# text-to-video card and call, the LoRA card's sigmas) and frames counted by plan, cache info and the dry run.
# Issue 45: +38 for the FLOP cost model of stage one's step (costs.step_flops, the table as its calibration, the
# public check point) and cache info's teacher steps; +294 for the teacher's speed options (speed.py: attention backend,
# regional compile with its warm-up outside the progress figures, TF32, torchao quantization, cache-skipping hooks
# refused; their settings and registries, the header's numerics, a refused resume naming the option that differs)
# and cache info's FLOP-model time from the header's recorded teacher shape. Issue 44, so far: +12 for the segment
# objective's pseudo-Huber distance (--segment-loss, --segment-huber-c; the default left unrecorded). CI: +6 for a
# SIGTERM that a library wrapped in its own error (diffusers' weight loader) still ending as the SIGTERM. Issue 44:
# +24 for --train-trajectories (the first N trajectories of the caches: a smaller stage one's data, the data curve);
# +148 for the segment objective's adversarial term (adversarial.py: a discriminator from the velocity student among
# the objective's heads, one backward for both sides, noise per sample so resumes and ranks draw the same; its four
# settings, unrecorded when off; the LoRA student refusing it). Issue 53: +1,023 for one trust boundary: the read side
# (cache/safe_open.py: any folder, bounded reads, nesting caps, walks, Hub snapshots' blob links, safetensors headers)
# and the write side (cache/safe_write.py: O_EXCL|O_NOFOLLOW temp+rename, output folders claimed by a marker), the
# prompt store's zarr.json/codec/chunk checks and the count bound (+250 in cache/), typed teacher folders
# (teacher_files.py), ranged run records and weight checks against config.json and lora.json, and every reader and
# writer moved onto them. Issue 54, so far: +4 for eval's plots in the run folder (a later --resume takes it). Issue
# 54, the Lightning road: +1,296: grid-exact caches (--for-students, StudentGrid, stage one's resolution, the refusal
# naming the missing steps and a rebuild's GPU-hours, stage two's printed commands: ~225), costs on the user's GPU and
# for stage two (pipeline/flops.py: the GPU table, the training FLOP model; plan's and the dry run's figures: ~296),
# one export of the expert pair with its ComfyUI workflow, the pair as one model in sample/eval, mp4s (~371), the
# cache's disk measured and refused up front, plan never printing a command that does not fit, the one-frame note
# (~330), and the -Diffusers hint, the weight-file check, the last step's checkpoint, the umask at publish (~76).
# Image-to-video, so far: +686. The one model call (pipeline/model_call.py: Inputs, predict, the input rule and the
# conditions' layouts, less the timestep helper and the expand_timesteps/patch threading it replaces: ~+130); the
# student kinds as one package with no import circle (~+12); the per-trajectory arrays declared in the schema, with
# the header's condition and its checks (~+70); stage one from --images / --images-from (the image list and its
# refusals, the condition latent as WanImageToVideoPipeline builds it, the first frames of a video cache, the VAE
# pass, the dry run's, plan's and cache info's figures: ~+277); stage two, validation and eval on conditions (the
# loader, frame 0 left out of TI2V's loss, the first-frame figure: ~+90); sample, export and the ComfyUI workflow as
# image-to-video pipelines (~+107). Then +116 for make demo-i2v: eval --attributes on an image-to-video cache (an
# image list of clip captions, its refusals, the teacher given each image and every entry its condition, motion.fidelity
# moved in from the teacher's training script, the image column of the grid, the table's frame-0 columns: ~+80),
# eval's timing on those images (~+20), plan --image-to-video for TI2V-5B's image mode (~+9) and
# `tiny-teacher --variant i2v-pretrained` (~+7). Issue 56, so far: +29 for a denominator and a 95% Wilson interval on
# every clip share eval reports (all right per model, motion kept per entry; the table's and the summary's). Issue 56:
# +250 for motion on real video: optical flow (stages/sample/flow.py, +123: OpenCV's DIS per frame pair, VBench's
# dynamic degree, the flow ratio with its bootstrap interval, the direction cosine, flicker, the latent frame-difference
# ratio), the checker's shape colour weighed by distance from the background (the VAE's halo: +10), and eval's side
# (+117): --motion for prompts of any wording with its refusals, --attribute-seeds, --teacher-redraw rows
# (teacher_entry, passes), the latent motion ratio, images' kept paired, the table as declared columns with intervals,
# the summary's flow part, the teacher loaded once for all of them. Then +5 for the latent motion ratio in stage two's
# validation too (pipeline/sampling.latent_motion, moved out of flow.py so both stages share it). Then +4 for an
# old checkpoint renamed aside before prune deletes it (CI's random SIGKILL left one half deleted under its final name).
# Issue 57, so far: +86 for the teacher/LoRA hybrid as a model (sample.hybrid_sampler: the teacher's pipeline ended at
# the run's boundary by diffusers' interrupt, the run from there through sample_latents(start=M), its refusals;
# eval's --hybrid rows with their passes, sample's --hybrid column; teacher_call/teacher_drawer shared by the redraw,
# the hybrid and eval's timing, other_student shared by --compare and --hybrid), +32 for guidance as a dial
# (velocity --target-guidance: u + w (c - u) from the recorded branches, its refusal, Objective.record_fields and
# DistillRecord.of_cache taking the guidance the student learned). Then +76 for the hybrid in ComfyUI (export's
# comfyui-hybrid-workflow.json: the workflow's samplers as declared passes, the teacher's own models over its steps
# up to the run's first low-noise boundary then the low-noise adapter, the card's paragraph with the handover sigmas).
# Review: -3 (the teacher's ComfyUI sampler and shift read once, comfyui.teacher_sampling; sample's checks of a
# --compare and a --hybrid run in one place; eval's timing draws the teacher through sample.teacher_drawer).
# Then +231 for the guidance-conditioned student (pipeline/guidance_input.py, 112 lines: the scale's embedding beside the
# timestep's, its hook, bake; velocity --guidance-range with each sample's scale and Objective.adapt; the scale
# through model_call.Inputs and sample_latents; the compact kind's load, check and FSDP gather of it; sample, eval
# and validation asking for the teacher's scale; export --guidance-scale baking it, with its refusals and card line). Then +2 for validation reading the teacher's
# latent motion once. Then +317 for the user's LoRA in the teacher (pipeline/teacher_lora.py, 181 lines: the flag's
# form, the file read through safe_open with its sha256 and adapter config, the fit on meta experts, the fuse by
# diffusers and peft with its count of landed layers, the recorded files hashed a chunk at a time (safe_open.sha256_named)
# before they are read, then re-hashed; TeacherLora and the
# header's and distill.json's two fields; each placement's fuse before it moves, streams or dispatches, disk's
# refusal; sample's and eval's teacher fused; the cards', cache info's and --dry-run's line; the ComfyUI hybrid's
# teacher passes loading them), +44 for eval
# --checked-captions (read, lined up with --attributes, its grammar, its refusals; scores against it).
LINE_BOUND = 20_213


def test_the_packages_do_not_grow_back():
    assert D.lines(SRC) <= LINE_BOUND
