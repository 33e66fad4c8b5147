"""`wandistiller`: one subcommand per stage. Each command parses, builds its config and calls the stage."""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
import warnings

import click

from .errors import UserError, user_errors


def _quiet_libraries() -> None:
    # diffusers/transformers progress bars and advisory warnings would drown our own bar and summary.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*upcast_vae.*")
    for name in ("diffusers", "transformers", "accelerate", "huggingface_hub"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        from diffusers.utils import logging as dlog

        dlog.disable_progress_bar()
        dlog.set_verbosity_error()
        from transformers.utils import logging as tlog

        tlog.disable_progress_bar()
        tlog.set_verbosity_error()
    except ImportError:
        pass


def _start(cpu_only: bool) -> None:
    """What a command does once it knows where it runs, before it imports a stage (whose imports ask CUDA): a run
    that asked for the CPU hides the GPUs from the process (runtime.hide_gpus); then the libraries are quietened."""
    if cpu_only:
        from .runtime import hide_gpus

        hide_gpus()
    _quiet_libraries()


def common_options(fn):
    """Options every stage command takes: a TOML config and the log level."""

    @click.option("--config", "config_file", type=click.Path(dir_okay=False), default=None,
                  help="TOML file with this stage's settings; flags given on the command line override it.")
    @click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info",
                  show_default=True, help="Verbosity of WanDistiller's own log.")
    @functools.wraps(fn)
    def wrapper(*args, log_level, **kwargs):
        logging.basicConfig(level=log_level.upper(), format="%(message)s")
        return fn(*args, **kwargs)  # which calls _start() once its config says where it runs

    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="wandistiller")
def main():
    """WanDistiller: distill a Wan 2.x video teacher into a small text-to-image student, offline.

    Stage one (teacher-cache) runs the teacher once and writes a cache; stage two (train-student) trains a
    DDP student from that cache alone.
    """


@main.command("tiny-teacher")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Folder to write the pipeline to.")
@click.option("--variant", type=click.Choice(["wan2.2", "wan2.1", "ti2v", "pretrained"]), default="wan2.2",
              show_default=True, help="wan2.2: two experts + boundary ratio; wan2.1: one transformer; ti2v: "
              "expand_timesteps (all three random); pretrained: a Wan 2.2 teacher trained to draw shapes captions "
              "(data/tiny-teacher-pretrained).")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Weights seed of the random variants (same seed, same bytes).")
@user_errors("tiny-teacher")
def tiny_teacher_cmd(out, variant, seed):
    """Write the embedded tiny Wan teacher (diffusers format, no download): random weights, or the trained
    shapes teacher.

    Example: wandistiller tiny-teacher --out runs/tiny-teacher --variant wan2.2
    """
    _start(cpu_only=True)  # builds the weights on the CPU
    from .tiny_teacher import write_tiny_teacher

    try:
        path = write_tiny_teacher(out, variant, seed)
    except OSError as e:
        raise UserError(f"cannot write the tiny teacher to {out} ({e.strerror}); choose a writable --out") from e
    click.echo(f"tiny {variant} teacher written to {path}")


@main.command("teacher-cache")
@click.option("--teacher", help="Wan pipeline: local diffusers folder or hub id (e.g. Wan-AI/Wan2.2-T2V-A14B-Diffusers).")
@click.option("--revision", help="Hub revision of --teacher (branch, tag or commit).")
@click.option("--prompts", type=click.Path(), help="Prompt file: .txt (one a line, # comments) or .jsonl.")
@click.option("--out", type=click.Path(), help="CACHE_DIR to write (or resume).")
@click.option("--placement", help="Where teacher weights live: auto | cpu | cuda | balanced | sequential | offload | "
              "disk | a device-map .json (docs/placements.md; `wandistiller plan` explains auto).  [default: auto]")
@click.option("--device", type=int, help="CUDA device index for --placement cuda.  [default: 0]")
@click.option("--max-memory", help="balanced/sequential: memory per device, e.g. \"0=70GiB,1=70GiB,cpu=200GiB\".")
@click.option("--offload-dir", type=click.Path(file_okay=False),
              help="--placement disk: folder the weights stream from.  [default: CACHE_DIR/offload]")
@click.option("--expert-order", type=click.Choice(["auto", "step", "expert"]),
              help="Two experts: expert = one expert resident at a time (same cache).  [default: auto]")
@click.option("--teacher_on_cpu", "teacher_on_cpu", is_flag=True, default=None, hidden=True)
@click.option("--teacher_device_strategy", "teacher_device_strategy", hidden=True,
              type=click.Choice(["cpu", "balanced", "gpu0", "auto"]))
@click.option("--teacher_dtype", "teacher_dtype", type=click.Choice(["float32", "bfloat16", "float16"]), hidden=True)
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]),
              help="Teacher dtype.  [default: bfloat16 on CUDA, float32 on CPU]")
@click.option("--steps", type=int, help="Denoising steps; one sample per step.  [default: 40]")
@click.option("--guidance", type=float, help="CFG scale (high-noise expert for Wan 2.2).  [default: 4.0]")
@click.option("--guidance-2", "guidance_2", type=float, help="CFG scale of the low-noise expert (Wan 2.2).")
@click.option("--height", type=int, help="Image height in pixels.  [default: 480]")
@click.option("--width", type=int, help="Image width in pixels.  [default: 832]")
@click.option("--frames", type=int, help="Frames (1 = images).  [default: 1]")
@click.option("--seeds-per-prompt", type=int, help="Trajectories per prompt.  [default: 1]")
@click.option("--seed", type=int, help="Base seed of the initial noise.  [default: 0]")
@click.option("--negative-prompt", help="Negative prompt for CFG.  [default: empty]")
@click.option("--max-sequence-length", type=int, help="Text tokens (padding length).  [default: 512]")
@click.option("--batch-size", type=int, help="Trajectories run together.  [default: 4]")
@click.option("--samples-per-shard", type=int, help="Samples per tar shard (at block boundaries).  [default: 1024]")
@click.option("--part", type=int, help="This process's part (with --num-parts), e.g. one per node.")
@click.option("--num-parts", type=int, help="Number of parts the prompt set is split into.")
@click.option("--overwrite/--no-overwrite", default=None, help="Replace a cache made with other settings.")
@click.option("--save-cond-uncond/--no-save-cond-uncond", default=None,
              help="Also store the conditional and unconditional predictions.")
@click.option("--record-features", help="Teacher blocks (each expert's) whose projected outputs every sample stores, "
              "e.g. 0,20: for `train-student --objective velocity+feature`.")
@click.option("--feature-dim", type=int, help="Width the recorded features are projected to.  [default: 256]")
@click.option("--feature-pool", type=click.Choice(["none", "mean"]),
              help="Keep one feature row per latent token (none) or their mean.  [default: none]")
@click.option("--feature-seed", type=int, help="Seed of the fixed feature projection.  [default: 0]")
@click.option("--record-steps", type=int,
              help="Record only N of the --steps per trajectory (every step still runs; the final latent is always "
              "kept): step 0, --keep-steps, the rest drawn by --record-seed, the same for every trajectory; "
              "`plan --record-steps` and `cache info` show the bytes.  [default: every step]")
@click.option("--record-seed", type=int, help="Seed of the steps --record-steps draws.  [default: --seed]")
@click.option("--keep-steps", help="Steps --record-steps always records besides 0, e.g. the boundaries a "
              "`--objective segment --student-steps K` student needs (0,20 for K=2 of 40 steps).")
@click.option("--report-to", type=click.Choice(["tensorboard", "none"]),
              help="Progress scalars (prompts/s, samples/s, bytes, projected size, ETA) for TensorBoard under "
              "CACHE_DIR/parts/part-P/tensorboard.  [default: none]")
@common_options
@user_errors("teacher-cache")
def teacher_cache_cmd(config_file, **flags):
    """Stage one: run the teacher over prompts x seeds x steps and write a resumable cache.

    Rerunning the same command resumes; under torchrun each rank is one part.

    Example: wandistiller teacher-cache --teacher runs/tiny-teacher --prompts data/prompts.txt
    --out runs/cache --placement cpu --steps 8 --height 64 --width 64 --max-sequence-length 64
    """
    from .legacy_flags import config_from_flags

    cfg = config_from_flags(config_file, flags)
    _start(cfg.cpu_only)
    from stages import teacher_cache

    teacher_cache.run(cfg)


def inference_options(fn):
    """Options of the commands that run a trained student: which weights, on which device, in which dtype."""
    options = [
        click.option("--student", help="train-student --out folder (student/, distill.json) or a student model folder."),
        click.option("--weights", type=click.Choice(["auto", "ema", "raw"]),
                     help="Student weights: auto = student_ema/ when the run saved it, else student/.  [default: auto]"),
        click.option("--device", help="auto | cpu | cuda | cuda:N.  [default: auto, the first GPU if any]"),
        click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]),
                     help="Model dtype.  [default: bfloat16 on CUDA, float32 on CPU]"),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


@main.command("sample")
@inference_options
@click.option("--teacher", help="Wan pipeline folder or hub id.  [default: the teacher named in distill.json]")
@click.option("--prompts", type=click.Path(), help="Prompt file (.txt or .jsonl); one grid row per prompt.")
@click.option("--out", type=click.Path(), help="PNG grid to write; the settings used go to OUT.json.")
@click.option("--steps", type=int, help="Denoising steps for both.  [default: distill.json's, else 40]")
@click.option("--guidance", type=float, help="The teacher's CFG scale.  [default: distill.json's, else 4.0]")
@click.option("--guidance-2", "guidance_2", type=float, help="The teacher's low-noise expert scale (Wan 2.2).")
@click.option("--student-guidance", type=float,
              help="[default: 1.0 if the student learned guided targets, else --guidance]")
@click.option("--negative-prompt", help="Negative prompt for CFG.  [default: distill.json's, else empty]")
@click.option("--seed", type=int, help="Noise seed; prompt i starts from seed + i.  [default: 0]")
@click.option("--height", type=int, help="Image height.  [default: the training resolution, else 480]")
@click.option("--width", type=int, help="Image width.  [default: the training resolution, else 832]")
@click.option("--max-sequence-length", type=int, help="Text tokens.  [default: distill.json's, else 512]")
@click.option("--max-prompts", type=int, help="Use the first K prompts of the file.  [default: 8]")
@click.option("--student-steps", type=int,
              help="The student's sampling steps.  [default: distill.json's: a few-step student's K, else --steps]")
@click.option("--compare", multiple=True, type=click.Path(),
              help="Another train-student OUT drawn beside the student at its own steps (repeatable).")
@common_options
@user_errors("sample")
def sample_cmd(config_file, **flags):
    """Teacher and student images from the same noise, side by side: one PNG row per prompt.

    \b
    Example:
      wandistiller sample --student runs/student --teacher runs/tiny-teacher \\
        --prompts data/prompts.txt --out runs/student/grid.png --max-prompts 4
    """
    from .config import SampleConfig, load_config

    flags["compare"] = flags.get("compare") or None  # none given: the config file's, if any
    cfg = load_config(SampleConfig, config_file, flags)
    _start(cfg.cpu_only)
    from stages.sample import sample

    sample.run(cfg)


@main.command("export")
@click.option("--student", help="train-student --out folder (student/, distill.json) or a student model folder.")
@click.option("--weights", type=click.Choice(["auto", "ema", "raw"]),
              help="Student weights: auto = student_ema/ when the run saved it, else student/.  [default: auto]")
@click.option("--teacher", help="Wan pipeline folder or hub id.  [default: the teacher named in distill.json]")
@click.option("--out", type=click.Path(), help="Pipeline folder to create.")
@click.option("--copy/--symlink", "copy", default=None,
              help="Copy the teacher's text encoder, tokenizer, VAE and scheduler, or symlink them.  [default: symlink]")
@click.option("--overwrite/--no-overwrite", default=None, help="Replace an earlier export at --out.")
@common_options
@user_errors("sample")
def export_cmd(config_file, **flags):
    """Write a diffusers pipeline folder with the student as its one transformer.

    `DiffusionPipeline.from_pretrained(OUT)` loads it; its README and model_index.json say which guidance to use.

    \b
    Example:
      wandistiller export --student runs/student --teacher runs/tiny-teacher --out runs/student-pipeline
    """
    from .config import ExportConfig, load_config

    cfg = load_config(ExportConfig, config_file, flags)
    _start(cfg.cpu_only)
    from stages.sample import export

    export.run(cfg)


@main.command("eval")
@inference_options
@click.option("--cache", type=click.Path(), help="CACHE_DIR whose trajectories to compare with (ideally held out).")
@click.option("--prompts", type=click.Path(), help="Held-out prompt file: only the cache's prompts listed there.")
@click.option("--max-prompts", type=int, help="Use the first K selected prompts (all their seeds).  [default: all]")
@click.option("--report", type=click.Path(), help="JSON report; the plot goes next to it.  [default: STUDENT/eval.json]")
@click.option("--teacher", help="Teacher for the timing comparison.  [default: the cache manifest's teacher]")
@click.option("--teacher-timing/--no-teacher-timing", default=None, help="Time the teacher too.  [default: on]")
@click.option("--timing-runs", type=int, help="Trajectories timed per model, after a warm-up.  [default: 2]")
@click.option("--init-seed", type=int,
              help="Seed of the untrained baseline.  [default: student_init/ if saved, else distill.json's, else 0]")
@click.option("--batch-size", type=int, help="Samples or trajectories per forward.  [default: 8]")
@click.option("--attributes", type=click.Path(),
              help="Shapes captions (data/shapes-heldout.txt) that teacher and student draw, scored by the "
                   "attribute checker (colours, position); needs the teacher's text encoder and VAE.")
@click.option("--attribute-max-prompts", type=int, help="Use the first K --attributes captions.  [default: all]")
@click.option("--attribute-grid", type=int,
              help="Teacher | student pairs drawn into REPORT-attributes.png (0: none).  [default: 8]")
@click.option("--student-steps", help="Sample the student with each of these step counts, e.g. 1,2,4.  "
                                      "[default: its own: distill.json's student_steps, else the teacher's steps]")
@click.option("--compare", multiple=True, type=click.Path(),
              help="Another train-student OUT sampled at its own steps from the same noise (repeatable); the "
                   "report's table lines them up with the teacher.")
@common_options
@user_errors("sample")
def eval_cmd(config_file, **flags):
    """Compare the student with the teacher's cached trajectories: velocity error per step, error of the
    sampled final latent (trained and untrained), and sampling time of student vs teacher; with
    --attributes, also what share of the teacher's attribute accuracy (shape and background colours,
    position) the student keeps on shapes captions.

    \b
    Example:
      wandistiller eval --student runs/student --cache runs/heldout-cache --max-prompts 16
      wandistiller eval --student runs/demo/student --cache runs/demo/cache --attributes data/shapes-heldout.txt
      wandistiller eval --student runs/demo/student --cache runs/demo/cache --student-steps 1,2,4 \\
        --compare runs/demo/student-4step --attributes data/shapes-heldout.txt
    """
    from .config import EvalConfig, load_config

    flags["compare"] = flags.get("compare") or None  # none given: the config file's, if any
    cfg = load_config(EvalConfig, config_file, flags)
    _start(cfg.cpu_only)
    from stages.sample import evaluate

    evaluate.run(cfg)


class _ObjectiveOption(click.Option):
    """--objective, whose help lists the registered objectives: read when help is shown, since importing stage two
    at the CLI's load would import diffusers, whose import queries CUDA before a CPU run can hide the GPUs."""

    def get_help_record(self, ctx):
        from stages.train_student.objectives import OBJECTIVES

        listed = "; ".join(f"{name} ({cls.help})" for name, cls in OBJECTIVES.items())
        self.help = f"What the student learns: {listed}.  [default: velocity]"
        return super().get_help_record(ctx)


@main.command("train-student")
@click.option("--cache", multiple=True, type=click.Path(),
              help="CACHE_DIR of stage one; repeat for several caches with the same fingerprint.")
@click.option("--student-config", type=click.Path(), help="Student WanTransformer3DModel JSON (configs/student-*.json).")
@click.option("--out", type=click.Path(), help="Output folder: student/, checkpoints/, metrics.jsonl, loss.png.")
@click.option("--epochs", type=int, help="Passes over the cache.  [default: 1, or what --max-steps needs]")
@click.option("--max-steps", type=int, help="Stop after this many optimizer steps.")
@click.option("--batch-size", type=int, help="Samples per rank per micro-step.  [default: 8]")
@click.option("--grad-accum", type=int, help="Micro-steps per optimizer step.  [default: 1]")
@click.option("--lr", type=float, help="Peak AdamW learning rate.  [default: 1e-4]")
@click.option("--min-lr-ratio", type=float, help="Cosine floor as a fraction of --lr.  [default: 0]")
@click.option("--warmup-steps", type=int, help="Linear warmup steps.  [default: 100]")
@click.option("--weight-decay", type=float, help="AdamW weight decay of matrices.  [default: 0.01]")
@click.option("--max-grad-norm", type=float, help="Gradient clipping norm; 0 disables.  [default: 1.0]")
@click.option("--ema-decay", type=float, help="EMA decay (e.g. 0.999); 0 = no EMA.  [default: 0]")
@click.option("--mixed-precision", type=click.Choice(["no", "bf16", "fp16"]),
              help="Autocast dtype.  [default: bf16 on CUDA, no on CPU]")
@click.option("--gradient-checkpointing/--no-gradient-checkpointing", default=None,
              help="Recompute activations in the backward pass (less memory).")
@click.option("--num-workers", type=int,
              help="DataLoader workers per rank.  [default: CPU cores per rank - 2, at most 4]")
@click.option("--seed", type=int, help="Student init and epoch order seed.  [default: 0]")
@click.option("--checkpoint-every", type=int, help="Optimizer steps between checkpoints; 0 = none.  [default: 500]")
@click.option("--keep-checkpoints", type=int, help="Newest checkpoints kept.  [default: 2]")
@click.option("--resume/--no-resume", default=None, help="Continue from the newest complete checkpoint in --out.")
@click.option("--train-steps", help="Train only on these cached step indices, e.g. 0,4,8.  [default: all]")
@click.option("--init-from-teacher", type=click.Path(),
              help="Teacher pipeline/transformer folder to copy matching weights from.")
@click.option("--teacher-blocks", help="Teacher block for each student block, e.g. 0,4,8.  [default: spread]")
@click.option("--holdout-prompts", type=int, help="Prompts kept out of training for the held-out loss.  [default: 0]")
@click.option("--eval-every", type=int, help="Steps between held-out evaluations.  [default: 100]")
@click.option("--log-every", type=int, help="Steps between metrics.jsonl lines.  [default: 10]")
@click.option("--report-to", type=click.Choice(["tensorboard", "wandb", "none"]),
              help="Tracker beside metrics.jsonl: OUT/tensorboard, W&B (pip install \"wandistiller[wandb]\"; "
              "WANDB_MODE=offline works offline) or none.  [default: tensorboard]")
@click.option("--val-every", type=int,
              help="Steps between validations by sampling the held-out prompts (final-latent MSE against the "
              "teacher's cached latents; needs --holdout-prompts); 0 = off.  [default: 0]")
@click.option("--val-max-prompts", type=int, help="Held-out prompts (all their seeds) validation samples.  [default: 4]")
@click.option("--val-decode/--no-val-decode", default=None,
              help="Also decode the validation latents with the teacher's VAE (rank 0) and log a teacher|student "
              "image grid.")
@click.option("--device", type=click.Choice(["auto", "cuda", "cpu"]), help="Training device.  [default: auto]")
@click.option("--verify", type=click.Choice(["checksum", "size", "sha256"]),
              help="Shard check before training: checksum (every byte of every shard against its recorded "
              "checksum, and the prompt rows against theirs) or size (sizes and member index); sha256 is checksum's "
              "earlier name.  [default: checksum]")
@click.option("--embedding-cache-size", type=int,
              help="Prompt embeddings each reader process keeps in memory (LRU).  [default: 1024]")
@click.option("--order", type=click.Choice(["auto", "shuffle", "grouped"]),
              help="Epoch order: shuffle (uniform), grouped (prompts a window of --embedding-cache-size / 2 at a "
              "time, samples shuffled within the window: each embedding read once per epoch) or auto (grouped when "
              "the prompts outnumber --embedding-cache-size).  [default: auto]")
@click.option("--collective-timeout-s", type=float, help="Seconds a rank may wait in a collective.  [default: 600]")
@click.option("--strategy", type=click.Choice(["ddp", "fsdp"]),
              help="ddp: a full student per rank; fsdp: weights, gradients, AdamW state and EMA sharded over the "
              "ranks (FSDP2), for students that do not fit one GPU (docs/multi-gpu.md).  [default: ddp]")
@click.option("--objective", cls=_ObjectiveOption)
@click.option("--feature-pairs", help="velocity+feature: student block:teacher block pairs, e.g. 0:1,1:3.")
@click.option("--feature-weight", type=float, help="velocity+feature: weight of the feature term.  [default: 1.0]")
@click.option("--student-steps", type=int,
              help="segment: the student's sampling steps K, 1 .. the cache's steps (a divisor of them reproduces the "
                   "teacher's schedule exactly).")
@click.option("--segment-velocity-weight", type=float,
              help="segment: weight of an added per-step velocity loss at the same states.  [default: 0]")
@click.option("--segment-start-weight", type=float,
              help="segment: weight of the loss at each segment's first state (where the K-step sampler queries the "
                   "student) against 1 inside a segment.  [default: 1]")
@common_options
@user_errors("train-student")
def train_student_cmd(config_file, cache, **flags):
    """Stage two: train a student from one or more caches (no teacher, no text encoder); DDP or FSDP (--strategy)
    under torchrun.

    Example: wandistiller train-student --cache runs/cache --student-config configs/student-tiny.json
    --out runs/student --epochs 4 --batch-size 16 --lr 1e-3 --warmup-steps 20 --holdout-prompts 16
    """
    from .config import TrainStudentConfig, load_config

    cfg = load_config(TrainStudentConfig, config_file, {"cache": list(cache) or None, **flags})
    _start(cfg.cpu_only)
    from stages import train_student

    train_student.run(cfg)


@main.command("plan")
@click.option("--teacher", required=True, help="Wan pipeline folder; configs alone are enough (no weights needed).")
@click.option("--placement", default="auto", show_default=True,
              help="auto | cpu | cuda | balanced | sequential | offload | disk | a device-map .json.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]),
              help="Teacher dtype.  [default: bfloat16 with a GPU, float32 without]")
@click.option("--batch-size", type=int, default=4, show_default=True, help="Trajectories run together.")
@click.option("--height", type=int, default=480, show_default=True)
@click.option("--width", type=int, default=832, show_default=True)
@click.option("--frames", type=int, default=1, show_default=True)
@click.option("--max-sequence-length", type=int, default=512, show_default=True, help="Text tokens.")
@click.option("--max-memory", help="balanced/sequential: memory per device, e.g. \"0=70GiB,1=70GiB,cpu=200GiB\".")
@click.option("--expert-order", type=click.Choice(["auto", "step", "expert"]), default="auto", show_default=True)
@click.option("--offload-dir", type=click.Path(file_okay=False), help="Where disk offload would go (for free space).")
@click.option("--assume-gpus", help="Plan for other GPUs than this machine's: 4x24GiB, 80GiB,40GiB or none.")
@click.option("--assume-ram", help="Plan for this much available RAM (e.g. 256GiB).")
@click.option("--assume-disk", help="Plan for this much free disk under --offload-dir (e.g. 2TiB).")
@click.option("--ranks-per-node", type=int, default=1, show_default=True, help="torchrun processes per node.")
@click.option("--prompts", type=click.IntRange(min=1), help="Prompt count: project the cache's total bytes.")
@click.option("--seeds-per-prompt", type=click.IntRange(min=1), default=1, show_default=True,
              help="Trajectories per prompt (for the cache's bytes).")
@click.option("--steps", type=click.IntRange(min=1), default=40, show_default=True,
              help="Denoising steps (for the cache's bytes).")
@click.option("--record-steps", type=click.IntRange(min=1), help="Steps recorded per trajectory (teacher-cache "
              "--record-steps).  [default: every step]")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@user_errors("plan")
def plan_cmd(teacher, placement, dtype, batch_size, height, width, frames, max_sequence_length, max_memory,
             expert_order, offload_dir, assume_gpus, assume_ram, assume_disk, ranks_per_node, prompts,
             seeds_per_prompt, steps, record_steps, as_json):
    """Where the teacher's weights would live, what each device holds, and (auto) why, and the bytes of the cache
    it would write: from configs alone.

    \b
    Example:
      wandistiller plan --teacher tests/data/wan22-a14b-configs --assume-gpus 4x24GiB --assume-ram 256GiB
      wandistiller plan --teacher tests/data/wan22-a14b-configs --prompts 100000 --record-steps 8
    """
    _start(cpu_only=False)  # plans for the GPUs it sees
    from stages.teacher_cache import plan_from_flags
    from stages.teacher_cache.plan import NoPlacement

    try:
        plan = plan_from_flags(teacher, placement, dtype, batch_size, height, width, frames, max_sequence_length,
                               max_memory, expert_order, offload_dir, assume_gpus, assume_ram, assume_disk,
                               ranks_per_node, prompts, seeds_per_prompt, steps, record_steps)
    except NoPlacement as e:
        if not as_json:
            raise
        click.echo(e.to_json())  # {"fits": false, "error": the line, the figures}: still JSON, still exit 2
        sys.exit(2)
    click.echo(plan.to_json() if as_json else plan.render())


@main.group("cache")
def cache_group():
    """Inspect and check a teacher cache."""


@cache_group.command("info")
@click.argument("cache_dir", type=click.Path())
@click.option("--prompts", type=click.IntRange(min=1),
              help="Project the bytes of a cache like this one with N prompts.  [default: its own count]")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@user_errors("cache")
def cache_info_cmd(cache_dir, prompts, as_json):
    """Summarise a finished cache: samples, shards, prompts, steps, latent shape, bytes, fingerprint, and the
    bytes on disk per sample, per prompt and projected for --prompts N.

    Example: wandistiller cache info runs/cache --prompts 100000
    """
    _start(cpu_only=True)
    from cache.manifest import summarize

    info = summarize(cache_dir, prompts)
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    from cache.size import human

    for k, v in info.items():
        if "bytes" in k and isinstance(v, int):
            v = f"{v:,} ({human(v)})"
        click.echo(f"{k:>18}: {v}")


@cache_group.command("verify")
@click.argument("cache_dir", type=click.Path())
@user_errors("cache")
def cache_verify_cmd(cache_dir):
    """Re-hash every shard and check counts, shapes, dtypes and prompt rows. Exit 0 if sound, 1 if not (2: not a
    cache, or one whose stage one has not finished).

    Example: wandistiller cache verify runs/cache
    """
    _start(cpu_only=True)
    from cache import format as F
    from cache.errors import CacheError
    from cache.manifest import load_manifest
    from cache.verify import verify_cache

    if not os.path.isdir(cache_dir):  # nothing to verify: the user's to fix, like `cache info`
        what = "is a file, not a cache folder" if os.path.exists(cache_dir) else "does not exist"
        raise CacheError(f"cache directory {cache_dir} {what}; pass the CACHE_DIR that `wandistiller teacher-cache "
                         "--out` wrote")
    if not os.path.exists(os.path.join(cache_dir, F.MANIFEST)):  # not a cache, or an unfinished one: nothing to check
        load_manifest(cache_dir)  # (raises the CacheError that says which, and what to do)
    notes: list[str] = []
    problems = verify_cache(cache_dir, progress=sys.stderr.isatty(), notes=notes)
    for n in notes:  # what a cache of an earlier WanDistiller records no checksum for: not a problem
        click.echo(f"NOTE {n}")
    if problems:
        for p in problems:
            click.echo(f"BAD {p}")
        click.echo(f"{len(problems)} problem(s) in {cache_dir}; rebuild the named shards by deleting them "
                   "and rerunning teacher-cache, or rebuild the cache with --overwrite", err=True)
        sys.exit(1)
    click.echo(f"OK {cache_dir}: every shard matches its checksum, counts, shapes and prompt rows")


if __name__ == "__main__":  # pragma: no cover
    main()


