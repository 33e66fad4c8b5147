"""`wandistiller`: one subcommand per stage, its options generated from its config (pipeline/options.py). No stage,
torch or diffusers is imported at load: a command imports its stage once its config says where it runs (`_start`)."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import io
import json
import logging
import os
import re
import sys
import warnings

import click

from .config import (
    EvalConfig, ExportConfig, PlanSettings, SampleConfig, TeacherCacheConfig, TeacherRun, TrainStudentConfig,
)
from .config_types import load_config
from .errors import UserError, user_errors
from .options import config_options


def _start(cpu_only: bool) -> None:
    """Once a command knows where it runs, before it imports a stage (whose imports ask CUDA): a CPU run hides the
    GPUs from the process (runtime.hide_gpus); then the libraries are quietened."""
    if cpu_only:
        from .runtime import hide_gpus

        hide_gpus()
    # diffusers/transformers progress bars and advisory warnings would drown our own bar and summary.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*upcast_vae.*")
    # torchao (the [quant] extra, imported by diffusers' quantizers when installed) warns at import of CUDA kernels a
    # CPU build cannot load, and torch of its enums' registration: every command would print three such lines.
    for name in ("diffusers", "transformers", "accelerate", "huggingface_hub", "torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)
        if name in ("diffusers", "transformers"):
            library = importlib.import_module(f"{name}.utils.logging")
            library.disable_progress_bar()
            library.set_verbosity_error()


def common_options(fn):
    """Options every stage command takes: a TOML config and the log level."""

    @click.option("--config", "config_file", type=click.Path(dir_okay=False), default=None,
                  help="TOML file with this stage's settings; flags given on the command line override it.")
    @click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info",
                  show_default=True, help="Verbosity of WanDistiller's own log.")
    @functools.wraps(fn)
    def wrapper(*args, log_level, **kwargs):
        # Our own modules at the chosen level; every library's INFO chatter (an HTTP client's request lines) stays out.
        logging.basicConfig(level=logging.WARNING, format="%(message)s")
        for package in ("pipeline", "stages", "cache"):
            logging.getLogger(package).setLevel(log_level.upper())
        return fn(*args, **kwargs)  # which calls _start() once its config says where it runs

    return wrapper


def _lowercased(call, *args):
    """call(*args), click's own refusals ending in `error: ...` like every other message of ours, not `Error: ...`."""
    try:
        return call(*args)
    except click.ClickException as e:
        show = e.show

        def shown(file=None):
            buf = io.StringIO()
            show(file=buf)
            click.echo(re.sub(r"^Error: ", "error: ", buf.getvalue(), flags=re.M), file=file or sys.stderr, nl=False)

        e.show = shown
        raise


class _Group(click.Group):
    """The `wandistiller` group: every click error raised while it parses or runs a subcommand says `error:`."""

    def make_context(self, *args, **kwargs):
        return _lowercased(functools.partial(super().make_context, **kwargs), *args)

    def invoke(self, ctx):
        return _lowercased(super().invoke, ctx)


def _run_stage(cls, config_file, flags, module: str) -> None:
    """Build the command's config, then run the stage `module` (imported once the config says where it runs)."""
    cfg = load_config(cls, config_file, flags)
    _start(cfg.cpu_only)  # (a train-student dry run too: it measures steps on the device it names)
    importlib.import_module(module).run(cfg)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="wandistiller")
def main():
    """WanDistiller: distill a Wan 2.x video teacher into a compact student or a few-step LoRA of it, text-to-image,
    text-to-video or image-to-video, offline.

    Stage one (teacher-cache) runs the teacher once and writes a cache; stage two (train-student) trains the student (on
    one GPU or many: ddp or fsdp) from that cache alone."""


def _stage_command(name: str, cls, errors: str):
    """Decorator of a stage command: the options of its config `cls`, --config and --log-level, errors in one line."""
    return lambda fn: main.command(name)(config_options(cls)(common_options(user_errors(errors)(fn))))


@main.command("tiny-teacher")
@click.option("--out", required=True, type=click.Path(file_okay=False),
              help="Folder to write the pipeline to: new, empty, or an earlier tiny-teacher output (rebuilt whole).")
@click.option("--variant", type=click.Choice(["wan2.2", "wan2.1", "ti2v", "i2v", "ti2v-i2v", "pretrained",
                                              "video-pretrained", "i2v-pretrained"]),
              default="wan2.2", show_default=True, help="wan2.2: two experts + boundary ratio; wan2.1: one "
              "transformer; ti2v: expand_timesteps; i2v: image-to-video as Wan2.2-I2V-A14B (two experts, 36 input "
              "channels); ti2v-i2v: ti2v's image mode (all five random); pretrained: a Wan 2.2 teacher trained to draw "
              "shapes captions (data/tiny-teacher-pretrained); video-pretrained: one trained to draw 9-frame 64x64 "
              "clips of a shape moving (data/tiny-video-teacher-pretrained; teacher-cache --frames 9); i2v-pretrained: one "
              "trained to move the shape of a first frame (data/tiny-i2v-teacher-pretrained; teacher-cache --images).")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Weights seed of the random variants (same seed, same bytes).")
@user_errors("tiny-teacher")
def tiny_teacher_cmd(out, variant, seed):
    """Write the embedded tiny Wan teacher (diffusers format, no download): random weights, or the trained
    shapes (image) or moving-shapes (video) teacher.

    Example: wandistiller tiny-teacher --out runs/tiny-teacher --variant wan2.2"""
    _start(cpu_only=True)  # builds the weights on the CPU
    from .tiny_teacher import write_tiny_teacher

    try:
        path = write_tiny_teacher(out, variant, seed)
    except OSError as e:
        raise UserError(f"cannot write the tiny teacher to {out} ({e.strerror}); choose a writable --out") from e
    click.echo(f"tiny {variant} teacher written to {path}")


@_stage_command("teacher-cache", TeacherCacheConfig, "teacher-cache")
def teacher_cache_cmd(config_file, **flags):
    """Stage one: run the teacher over prompts x seeds x steps and write a resumable cache.

    Rerunning the same command resumes; under torchrun each rank is one part.

    Example: wandistiller teacher-cache --teacher runs/tiny-teacher --prompts data/prompts.txt --out runs/cache
    --placement cpu --steps 8 --height 64 --width 64 --max-sequence-length 64"""
    cfg = load_config(TeacherCacheConfig, config_file, flags)
    _start(cfg.cpu_only or cfg.dry_run)  # a dry run touches no device
    from stages import teacher_cache

    (teacher_cache.dry_run if cfg.dry_run else teacher_cache.run)(cfg)


@_stage_command("sample", SampleConfig, "sample")
def sample_cmd(config_file, **flags):
    """Teacher and student images from the same noise, side by side: one PNG row per prompt (a video student's
    clips as frame strips, and each clip an animated WebP beside the grid).

    \b
    Example:
      wandistiller sample --student runs/student --teacher runs/tiny-teacher \\
        --prompts data/prompts.txt --out runs/student-grid.png --max-prompts 4"""
    _run_stage(SampleConfig, config_file, flags, "stages.sample.sample")


@_stage_command("export", ExportConfig, "sample")
def export_cmd(config_file, **flags):
    """Write a diffusers pipeline folder with the student as its one transformer, ready for the Hub.

    `DiffusionPipeline.from_pretrained(OUT)` loads it; its README (a model card with the Hub's metadata) and
    model_index.json say which guidance to use. --push-to-hub uploads it.

    \b
    Example:
      wandistiller export --student runs/student --teacher runs/tiny-teacher --out runs/student-pipeline
      wandistiller export --student runs/student --out runs/student-hub --push-to-hub you/wan-student"""
    _run_stage(ExportConfig, config_file, flags, "stages.sample.export")


@_stage_command("eval", EvalConfig, "sample")
def eval_cmd(config_file, **flags):
    """Compare the student with the teacher's cached trajectories: velocity error per step, error of the sampled final
    latent (trained and untrained), and sampling time of student vs teacher; with --attributes, also what share of the
    teacher's attribute accuracy (shape and background colours, position) the student keeps on shapes captions, the
    motion it keeps on clip captions, and on an image-to-video cache (an image list) how closely frame 0 keeps the image.

    \b
    Example:
      wandistiller eval --student runs/student --cache runs/heldout-cache --max-prompts 16
      wandistiller eval --student runs/demo/student --cache runs/demo/cache --attributes data/shapes-heldout.txt
      wandistiller eval --student runs/demo/student --cache runs/demo/cache --student-steps 1,2,4 \\
        --compare runs/demo/student-4step --attributes data/shapes-heldout.txt"""
    _run_stage(EvalConfig, config_file, flags, "stages.sample.evaluate")


@_stage_command("train-student", TrainStudentConfig, "train-student")
def train_student_cmd(config_file, **flags):
    """Stage two: train a student from one or more caches (no teacher, no text encoder); DDP or FSDP (--strategy) under
    torchrun.

    Example: wandistiller train-student --cache runs/cache --student-config configs/student-tiny.json --out runs/student
    --epochs 4 --batch-size 16 --lr 1e-3 --warmup-steps 20 --holdout-prompts 16"""
    _run_stage(TrainStudentConfig, config_file, flags, "stages.train_student")


@main.command("plan")
@config_options(TeacherRun)
@config_options(PlanSettings)
@click.option("--config", "config_file", type=click.Path(dir_okay=False), default=None,
              help="teacher-cache's TOML file: the run's settings as teacher-cache reads them, flags on top; the "
                   "printed command passes it on.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@user_errors("plan")
def plan_cmd(as_json, config_file, **flags):
    """Where the teacher's weights would live, what each device holds, and (auto) why; how stage one uses every GPU
    of the machine (the torchrun or SLURM array command); the bytes of the cache it would write and, for
    --prompts N, its GPU-hours and wall time. From configs alone, unless --measure.

    \b
    Example:
      wandistiller plan --teacher Wan-AI/Wan2.2-T2V-A14B-Diffusers --gpus-per-node 8 --nodes 4 --gpu-memory 80GiB \\
        --prompts 200000
      wandistiller plan --teacher tests/data/wan22-a14b-configs --assume-gpus 4x24GiB --assume-ram 256GiB
      wandistiller plan --config configs/wan2.2-t2v-a14b.toml --teacher Wan-AI/Wan2.2-T2V-A14B-Diffusers"""
    own = {f.name for f in dataclasses.fields(PlanSettings)}
    settings = load_config(PlanSettings, None, {k: v for k, v in flags.items() if k in own})
    given = {k: v for k, v in flags.items() if k not in own and v is not None}
    _start(cpu_only=False)  # plans for the GPUs it sees
    from stages.teacher_cache import plan_from_flags
    from stages.teacher_cache.launch import PLACEHOLDERS
    from stages.teacher_cache.plan_report import NoPlacement

    run = load_config(TeacherCacheConfig, config_file, given | PLACEHOLDERS)  # checked as teacher-cache checks it
    try:
        plan = plan_from_flags(settings, run, given=tuple(given), config_file=config_file)
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
              help="Project the bytes of a cache like this one with N prompts (without it: its own count).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@user_errors("cache")
def cache_info_cmd(cache_dir, prompts, as_json):
    """Summarise a finished cache: samples, shards, prompts, steps, latent shape, bytes, fingerprint, and the
    bytes on disk per sample, per prompt and projected for --prompts N. Of a cache stage one has not finished: each
    part's prompts done, shards and samples, who writes it and its ETA, and how to finish it.

    Example: wandistiller cache info runs/cache --prompts 100000"""
    _start(cpu_only=True)
    from cache.manifest import load_manifest, summarize

    from .cache_status import lines, summarize_unfinished

    info = unfinished = summarize_unfinished(cache_dir)
    if unfinished is None:  # with the teacher's compute for the projected prompts (docs/costs.md)
        from stages.teacher_cache.costs import cache_compute

        m = load_manifest(cache_dir)
        info = summarize(cache_dir, prompts, m) | cache_compute(m, prompts or m.prompts)
    if as_json or unfinished is not None:
        click.echo(json.dumps(info, indent=2) if as_json else "\n".join(lines(unfinished)))
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
    cache, or one whose stage one has not finished: the line names its unfinished parts).

    Example: wandistiller cache verify runs/cache"""
    _start(cpu_only=True)
    from cache import format as F
    from cache.cache_error import CacheError
    from cache.manifest import load_manifest
    from cache.verify import verify_cache

    if not os.path.isdir(cache_dir):  # nothing to verify: the user's to fix, like `cache info`
        what = "is a file, not a cache folder" if os.path.exists(cache_dir) else "does not exist"
        raise CacheError(f"cache directory {cache_dir} {what}; pass the CACHE_DIR that `wandistiller teacher-cache "
                         "--out` wrote")
    if not os.path.exists(os.path.join(cache_dir, F.MANIFEST)):  # not a cache, or an unfinished one: nothing to check
        load_manifest(cache_dir)  # (raises the CacheError that says which, and what to do)
    problems = verify_cache(cache_dir, progress=sys.stderr.isatty())
    if problems:
        click.echo("\n".join(f"BAD {p}" for p in problems))
        click.echo(f"{len(problems)} problem(s) in {cache_dir}; rebuild the named shards by deleting them "
                   "and rerunning teacher-cache, or rebuild the cache with --overwrite", err=True)
        sys.exit(1)
    click.echo(f"OK {cache_dir}: every shard matches its checksum, counts, shapes and prompt rows")


if __name__ == "__main__":  # pragma: no cover
    main()


