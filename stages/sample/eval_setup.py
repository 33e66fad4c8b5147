"""What `wandistiller eval` resolves before it samples anything (`setup`: the cache through `cache/`'s readers, the
student, the teacher, the trajectories, every check) and what it samples (`Entry`: one student at its steps)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path

import torch

from cache import format as F
from cache import safe_write
from cache.prompt_store import EmbeddingCache, prompt_texts, read_latents
from cache.reader import open_caches
from pipeline import clips, guidance_input
from pipeline.artifact import EVAL_REPORT as REPORT_NAME
from pipeline.config import EvalConfig
from pipeline.errors import UserError
from pipeline.image_condition import open_image, read_image_file
from pipeline.model_call import NONE, InputRule
from pipeline.prompts import dedupe, file_lines, read_prompt_file
from pipeline.sampling import scheduler_from_config

from .attributes import attribute_captions, parse_caption
from .models import Student, check_compatible, find_student, model_name, named_teacher, pick_device
from .sample import hybrid_sampler, student_sampler, teacher_drawer

# distill.json fields whose value should match the cache's for the comparison to mean what it says.
COMPARED = ("cfg", "guidance", "guidance_2", "max_sequence_length", "latent_shape", "steps", "negative_prompt")


@dataclasses.dataclass(frozen=True)
class Trajectory:
    """One (prompt, seed) of the cache."""

    prompt_idx: int
    seed_idx: int
    text: str


@dataclasses.dataclass
class Setup:
    """What `setup` resolved: every check that can fail has run."""

    cache_dir: Path
    manifest: dict
    student: Student
    report_path: Path
    teacher_path: Path | None
    captions: list[str] | None  # --attributes' captions (shapes; clips on a video cache), or --motion's prompts
    images: list | None  # on an image-to-video cache, each caption's first frame (PIL images of the list's)
    checked: bool  # whether the captions are of a checker's grammar (--attributes), not any prompts (--motion)
    trajs: list[Trajectory]
    selection: dict
    in_training: bool | None  # whether the cache is the student's training cache (None: unknown)
    device: torch.device
    dtype: torch.dtype
    target_key: str  # the cached target the student learned
    warnings: list[str]
    checked_captions: list[str] | None = None  # --checked-captions': what caption i's drawings are scored against

    def embeddings(self) -> EmbeddingCache:
        """The prompt embeddings of the cache, every prompt eval reads kept."""
        return EmbeddingCache(self.cache_dir, int(self.manifest.num_parts), max(1, len(self.trajs)))

    def latents(self, trajs: list[Trajectory]) -> tuple[torch.Tensor, torch.Tensor]:
        """Initial noise and the teacher's final latents of `trajs`, each [N, C, F, H, W] float32."""
        return read_latents(self.cache_dir, int(self.manifest.num_parts), [(t.prompt_idx, t.seed_idx) for t in trajs])

    def conditions(self, trajs: list[tuple[int, int]]) -> torch.Tensor | None:
        """The condition latents [N, *condition_shape] of (prompt_idx, seed_idx) pairs on an image-to-video cache (what
        the teacher's trajectory was sampled with, and so the student's), else None."""
        if self.manifest.condition == NONE:
            return None
        return read_latents(self.cache_dir, int(self.manifest.num_parts), trajs, names=(F.Z_CONDITION,))[0]


@dataclasses.dataclass
class Entry:
    """One student sampled one way: `draw(prompt_embeds, latents, negative_embeds, condition=None)` -> final latents,
    at `steps`."""

    label: str
    student: Student
    model: torch.nn.Module
    steps: int
    guidance: float
    draw: Callable
    teacher: Path | None = None  # a --teacher-redraw row: the teacher's folder (`student` is None)
    handover: int | None = None  # a --hybrid row: of its `steps`, the teacher's (at `guidance`) before the student's

    @property
    def passes(self) -> int:
        """Forward passes of one draw: a step is two with guidance (conditional and unconditional), else one; a
        hybrid's student steps are one each."""
        per = 2 if self.guidance > 1.0 else 1
        return per * self.steps if self.handover is None else per * self.handover + self.steps - self.handover

    def describe(self) -> dict:
        s = self.student
        return {"label": self.label, "path": str(self.teacher if s is None else s.path),
                "objective": "teacher redraw" if s is None else "hybrid" if self.handover else s.setting("objective"),
                "trained_steps": s and s.setting("student_steps"), "steps": self.steps, "guidance": self.guidance,
                "passes": self.passes, **({"teacher_steps": self.handover} if self.handover else {})}


def teacher_call(pipe, manifest: dict, steps: int) -> dict:
    """The keyword arguments of the teacher's pipeline drawing the cache's latents at `steps` (its guidance, both
    experts')."""
    kw = dict(num_inference_steps=steps, height=int(manifest.height), width=int(manifest.width),
              num_frames=int(manifest.frames), max_sequence_length=int(manifest.max_sequence_length),
              guidance_scale=float(manifest.guidance), output_type="latent")
    if pipe.config.boundary_ratio is not None and manifest.guidance_2 is not None:
        kw["guidance_scale_2"] = float(manifest.guidance_2)
    return kw


def teacher_entry(pipe, path: Path, manifest: dict, steps: int) -> Entry:
    """The cache's teacher pipeline `pipe` drawn again at `steps` (its scheduler, the cache's guidance), from the
    latents it is given: a --teacher-redraw row, sampled and scored as the students are."""
    draw = teacher_drawer(pipe, teacher_call(pipe, manifest, steps))
    return Entry(f"teacher@{steps}", None, pipe.transformer, steps, float(manifest.guidance), draw, path)


def hybrid_entry(pipe, path: str, manifest: dict, student: Student, model, steps: int | None) -> Entry:
    """The --hybrid row of the segment run `student` at `path`: `sample.hybrid_sampler` on the cache's steps."""
    call = teacher_call(pipe, manifest, int(manifest.steps))
    draw, stop, m = hybrid_sampler(pipe, call, student, model, steps, InputRule.of(manifest), f"--hybrid {path}")
    return Entry(f"teacher:{m}+{model_name(path)}", student, model, stop + student.setting("student_steps") - m,
                 call["guidance_scale"], draw, handover=stop)


def make_entry(label: str, student: Student, model, manifest: dict, steps: int | None = None) -> Entry:
    """`student` at `steps` (else its own, else the cache's), at guidance 1 for guided targets, else the cache's."""
    steps = steps or student.setting("sampling_steps") or int(manifest.steps)
    guidance = 1.0 if student.guided else float(manifest.guidance)
    draw = student_sampler(student, model, steps, guidance, scheduler_from_config(manifest.scheduler),
                           InputRule.of(manifest), teacher_guidance=float(manifest.guidance))
    return Entry(label, student, model, steps, guidance, draw)


def _settings_warnings(student: Student, manifest: dict) -> list[str]:
    notes = []
    asked = guidance_input.trained_range(student.config) is not None  # (the cache's scale is asked of it)
    for key in COMPARED[3:] if asked else COMPARED:
        mine, theirs = student.setting(key), getattr(manifest, key)
        if mine is not None and theirs is not None and mine != theirs:
            notes.append(f"student trained with {key}={mine!r}, the cache has {theirs!r}")
    try:
        scheduler = scheduler_from_config(manifest.scheduler)
    except ValueError as e:
        raise UserError(f"the cache's {e}") from e
    scheduler.set_timesteps(int(manifest.steps))
    if [float(t) for t in scheduler.timesteps.tolist()] != [float(t) for t in manifest.timesteps]:
        notes.append("the cache's scheduler config does not reproduce its recorded timesteps")
    return notes


def _select(cache_dir: Path, manifest: dict, heldout: str | None, max_prompts: int | None,
           only: list[int] | None = None) -> tuple[list[Trajectory], dict]:
    """All seeds of the cache's first `max_prompts` prompts: those listed in `heldout`, else those in `only`."""
    texts = prompt_texts(cache_dir, int(manifest.num_parts))  # (rows never written are left out)
    info: dict = {"cache_prompts": len(texts), "source": "all prompts of the cache"}
    if heldout is not None:
        wanted, _ = dedupe(read_prompt_file(heldout))
        by_text = {t: i for i, t in texts.items()}
        chosen = [by_text[t] for t in wanted if t in by_text]
        info.update(source=f"prompts of {heldout}", heldout_file=str(heldout), heldout_prompts=len(wanted),
                    heldout_not_in_cache=len(wanted) - len(chosen))
        if not chosen:
            raise UserError(f"none of the {len(wanted)} prompts of {heldout} is in the cache {cache_dir}; build a "
                            "cache of the held-out prompts with `wandistiller teacher-cache` and evaluate on it")
    elif only:
        chosen = [p for p in sorted(set(only)) if p in texts]
        info["source"] = "heldout_prompts of distill.json"
        if not chosen:
            raise UserError(f"distill.json's held-out prompts {sorted(only)[:5]} are not in the cache {cache_dir}")
    else:
        chosen = list(texts)
    chosen = chosen[:max_prompts] if max_prompts else chosen
    info["prompts"] = len(chosen)
    seeds = int(manifest.seeds_per_prompt)
    return [Trajectory(p, s, texts[p]) for p in chosen for s in range(seeds)], info


def _check_against_cache(student: Student, manifest: dict, cache_dir: Path) -> None:
    shape = manifest.latent_shape
    check_compatible(student, in_channels=manifest.in_channels, out_channels=int(shape[0]),
                     text_dim=int(manifest.text_dim), latent_hw=(shape[2], shape[3]),
                     rule=InputRule.of(manifest), against=f"cache {cache_dir}")


def _teacher_path(cfg: EvalConfig, manifest: dict, cache_dir: Path) -> Path | None:
    """The cache's teacher (or --teacher), when timing or --attributes needs it."""
    if not (cfg.teacher_timing or cfg.attributes or cfg.motion or cfg.teacher_redraw or cfg.hybrid):
        return None
    try:
        return named_teacher(cfg, manifest.teacher, manifest.revision, f"{cache_dir}/{F.MANIFEST}")
    except UserError as e:
        drawn = cfg.attributes or cfg.motion or cfg.teacher_redraw or cfg.hybrid
        raise UserError(f"{e} (timing, --attributes, --motion, --teacher-redraw and --hybrid need the cache's "
                        f"teacher: pass --teacher PATH{'' if drawn else ' or --no-teacher-timing'})") from e


def _checked_rows(cfg: EvalConfig, listed: list[str], used: int, video: bool, image: bool) -> list[str] | None:
    """--checked-captions' captions (None without it): caption i the one --attributes' caption i of `listed` (the
    whole file, in order) is scored against, the first `used` kept as --attributes' are, each of the checker's grammar
    (clips on a video cache, shapes on an image one); a file of another count, or a text list of --attributes whose
    repeats eval drops (not an image list's: each line is drawn) refused in one line."""
    if cfg.checked_captions is None:
        return None
    path, attrs = cfg.checked_captions, cfg.attributes
    checked = read_prompt_file(path)
    if len(checked) != len(listed):
        raise UserError(f"--checked-captions {path} holds {len(checked)} captions and --attributes {attrs} "
                        f"{len(listed)}; give one checked caption per --attributes caption, caption i for caption i")
    if not image and (repeats := dedupe(listed)[1]):
        raise UserError(f"--attributes {attrs} lists {repeats} caption(s) more than once, which eval draws once, so "
                        f"--checked-captions {path} cannot line up with it; drop the repeats from both files")
    kind = "clips" if video else "shapes"
    for i, c in enumerate(checked[:used]):
        try:
            (clips.parse_caption if video else parse_caption)(c)
        except ValueError as e:
            raise UserError(f"--checked-captions {path} caption {i + 1}: {e}; the attribute checker reads captions of "
                            f"pipeline/{kind}.py's grammar, e.g. data/{kind}-heldout.txt") from e
    return checked[:used]


def _attribute_rows(cfg: EvalConfig, manifest: dict, image: bool) -> tuple[list[str], list | None, list[str] | None]:
    """--attributes' captions (or --motion's prompts), on an image-to-video cache their first frames, and
    `_checked_rows`: a text-to-video cache takes captions alone (`attribute_captions`; --motion's any prompts), an
    image-to-video one an image list (as sample --images); the other form refused in one line."""
    if cfg.attributes and cfg.motion:
        raise UserError("pass --attributes (clip captions: the checker's figures and the flow's) or --motion (prompts "
                        "of any wording: the flow's figures), not both")
    path, flag, what = (cfg.attributes, "--attributes", "clip caption") if cfg.attributes else (
        cfg.motion, "--motion", "prompt")
    if cfg.motion and int(manifest.frames) == 1 and not image:
        raise UserError(f"--motion {path}: the cache holds images (1 frame), which do not move; pass a video cache, or "
                        "score images with --attributes")
    named = ("image list", f"pass {flag} a file of <image path><TAB><{what}> lines") if image else ()
    listed = Path(path).suffix.lower() != ".jsonl" and any(  # (a .jsonl file is prompts: JSON may hold a tab)
        "\t" in t for _, t in file_lines(Path(path), *named) if not t.lstrip().startswith("#"))
    if listed != image:
        raise UserError(f"{flag} {path} is " + (
            "an image list (<image path><TAB><caption> lines), and the cache is text-to-video; pass the captions "
            "alone, one a line" if listed else "captions alone, and the cache is image-to-video; pass a file of "
            f"<image path><TAB><{what}> lines (as sample --images), each image its clip's first frame"))
    if not image:
        if cfg.motion:
            return dedupe(read_prompt_file(path))[0][:cfg.attribute_max_prompts], None, None
        captions = attribute_captions(path, cfg.attribute_max_prompts, manifest.frames)
        listed = read_prompt_file(path) if cfg.checked_captions else []
        return captions, None, _checked_rows(cfg, listed, len(captions), int(manifest.frames) > 1, image)
    listed = read_image_file(path)
    pairs = listed[:cfg.attribute_max_prompts]
    for _, caption in pairs if cfg.attributes else ():
        try:
            clips.parse_caption(caption)
        except ValueError as e:
            raise UserError(f"--attributes {path}: {e}; the motion checker reads captions of pipeline/clips.py's "
                            "grammar, e.g. data/clips-heldout.txt (--motion takes prompts of any wording)") from e
    checked = _checked_rows(cfg, [c for _, c in listed], len(pairs), True, image)
    return [c for _, c in pairs], [open_image(i, f"{flag} {path}") for i, _ in pairs], checked


def setup(cfg: EvalConfig) -> Setup:
    """Cache, student, teacher and selection, checked before the long part (not after it)."""
    cache_dir = Path(cfg.cache)
    # stage two's checks of a cache it opens: its fingerprint (an edited `guidance` or `steps` would mislabel every
    # figure of the report) and its prompt stores' shapes and dtypes (an edited one would allocate terabytes)
    manifest = open_caches([cache_dir])[0].manifest
    student = find_student(cfg.student, cfg.weights)
    # (the run folder the user named, a link or not, is where the report goes by default; a pair's, beside its runs)
    home = Path(os.path.realpath(student.root))
    report_path = Path(cfg.report) if cfg.report else (
        home.with_name(f"{student.name}-{REPORT_NAME}") if student.members else home / REPORT_NAME)
    if report_path.is_dir() and not report_path.is_symlink():
        raise UserError(f"--report {report_path} is a folder; pass the JSON file to write")
    safe_write.ensure_folder(report_path.parent, "the folder of --report")  # (before any model loads)
    _check_against_cache(student, manifest, cache_dir)
    image = manifest.condition != NONE  # image-to-video: the teacher runs on --attributes' images alone (none recorded)
    drawn = bool(cfg.attributes or cfg.motion)
    if image and (cfg.teacher_redraw or cfg.hybrid):
        raise UserError(f"--{'teacher-redraw' if cfg.teacher_redraw else 'hybrid'} on an image-to-video cache: not "
                        "supported (the teacher's pipeline takes the image, which the cache does not record); drop it")
    teacher_path = _teacher_path(cfg, manifest, cache_dir) if drawn or not image else None
    captions, images, checked = _attribute_rows(cfg, manifest, image) if drawn else (None, None, None)
    # Held out: on the training cache, the prompts train-student kept aside (unless --prompts says otherwise).
    in_training = (manifest.fingerprint in student.fingerprints) if student.fingerprints else None
    kept_aside = [int(p) for p in student.setting("heldout_prompts", [])] if in_training else []
    trajs, selection = _select(cache_dir, manifest, cfg.prompts, cfg.max_prompts, only=kept_aside)
    device, dtype = pick_device(cfg.device, cfg.dtype)
    warnings = _settings_warnings(student, manifest)
    if image and cfg.teacher_timing and not drawn:
        warnings.append("teacher timing on an image-to-video cache draws from --attributes' (or --motion's) images (the "
                        "cache records none): skipped without them")
    if in_training:
        seen = sorted({t.prompt_idx for t in trajs} - set(kept_aside))
        if seen:
            warnings.append(f"{len(seen)} of the {selection['prompts']} prompts evaluated were trained on (this is "
                            "the student's training cache): they are not held out")
    if student.setting("init_from_teacher") and not student.kind.init_exact(student, cfg.init_seed):
        warnings.append("train-student initialised the student from teacher blocks: the untrained baseline here is a "
                        "random initialisation, not its starting point (save student_init/ to compare with that)")
    return Setup(cache_dir, manifest, student, report_path, teacher_path, captions, images, bool(cfg.attributes),
                 trajs, selection,
                 in_training, device, dtype, F.T_TARGET_COND if manifest.cfg and not student.guided else F.T_TARGET,
                 warnings, checked)


def entries(cfg: EvalConfig, su: Setup, model) -> list[Entry]:
    """The student at its own steps (or each of --student-steps), then every --compare student at its own."""
    steps_list = list(cfg.student_steps or (None,))
    labels = ["student"] if len(steps_list) == 1 else [f"student@{k}" for k in steps_list]
    out = [make_entry(lab, su.student, model, su.manifest, k) for lab, k in zip(labels, steps_list)]
    taken = set(labels) | {"teacher", "untrained"}
    for path in cfg.compare:
        name = model_name(path)
        label, i = name, 2
        while label in taken:  # two runs' student/ folders, or a run named like an entry
            label, i = f"{name}-{i}", i + 1
        taken.add(label)
        out.append(make_entry(label, *other_student(cfg, su, path, "--compare"), su.manifest))
    return out


def other_student(cfg: EvalConfig, su: Setup, path: str, flag: str) -> tuple[Student, torch.nn.Module]:
    """A --compare or --hybrid run, checked against the cache (a warning if it trained on prompts evaluated), loaded."""
    other = find_student(path, cfg.weights)
    _check_against_cache(other, su.manifest, su.cache_dir)
    if other.fingerprints and su.manifest.fingerprint in other.fingerprints:
        seen = {t.prompt_idx for t in su.trajs} - {int(p) for p in other.setting("heldout_prompts", [])}
        if seen:
            su.warnings.append(f"{flag} {path} was trained on {len(seen)} of the prompts evaluated")
    return other, other.kind.load(other, su.dtype, su.device)
