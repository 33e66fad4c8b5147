"""Stage two: setup → fit → validate → save. A student trained from the cache alone.

No teacher and no text encoder are ever loaded here: the targets and the prompt embeddings are read
from the cache (`--init-from-teacher` reads a few tensors of the teacher's weight files, nothing more).
Under torchrun every rank runs this; rank 0 alone writes shared files.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from cache import format as F
from pipeline import lock
from cache.atomic import atomic_write_json, honour_umask, publish_dir
from cache.reader import open_caches
from pipeline import signals
from pipeline.artifact import STUDENT, STUDENT_EMA, DistillRecord, RunLayout
from pipeline.config import TrainStudentConfig, save_resolved
from pipeline.errors import UserError, exit_rank
from pipeline.settings import OWNER, SOURCE
from pipeline.faults import fault_point
from pipeline.runtime import DistEnv, barrier, dist_env, init_distributed, print0, teardown

from . import checkpoint, train_dry_run
from .comm import all_gather_bytes
from .epoch import EpochPlan, epoch_plan, order_identity
from .index import DataSplit, prepare
from .loop import TrainState, Trainer, lr_at, make_ema, plot_losses, truncate_metrics
from .objective_velocity import Objective, check_cache, get_objective
from .strategy import Strategy, get_strategy
from . import lora_student
from .student import build_student, check_compatible, init_from_teacher, load_student_config, trained_parameters
from .tracking import open_tracker, require_backend
from .validation import make_validator

STAGE = "train-student"


@signals.handle_sigterm()
def run(cfg: TrainStudentConfig) -> dict:
    """Train the student described by `cfg`; returns the closing summary."""
    env = dist_env()
    try:
        device = _device(cfg, env)  # before the process group: a refusal comes before any rank touches a GPU
        if env.world_size > 1:
            init_distributed(cfg.collective_timeout_s, use_cuda=device.type == "cuda")
        return _run(cfg, env, device)
    except BaseException as e:
        unwritable = _cannot_write(e, Path(cfg.out))
        if env.world_size > 1:
            exit_rank(unwritable or e, env, STAGE)
        if unwritable is not None:
            raise unwritable from e
        raise
    finally:
        lock.release(Path(cfg.out) / lock.RUN_LOCK)
        teardown()


def _cannot_write(e: BaseException, out: Path) -> UserError | None:
    """A write inside --out refused for its permissions (or a file where a folder must be): the user's to fix, so one
    line instead of a traceback (errors.classify keeps EACCES elsewhere a bug). None for anything else."""
    if not isinstance(e, OSError) or e.errno not in (errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EISDIR):
        return None
    path = Path(e.filename or "")
    if not e.filename or not path.absolute().is_relative_to(out.absolute()):
        return None
    return UserError(f"cannot write {path} ({e.strerror}); make {out} writable or choose another --out, and rerun "
                     "(with --resume to keep its checkpoints)")


def _device(cfg: TrainStudentConfig, env: DistEnv) -> torch.device:
    """This rank's training device. The CPU (`--device cpu`, or auto without CUDA) never initialises CUDA.
    On CUDA each rank takes its LOCAL_RANK GPU; more ranks on this node than GPUs are refused before any rank
    touches one (counting GPUs does not initialise CUDA)."""
    if cfg.device == "cpu" or (cfg.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise UserError("--device cuda but no CUDA device is visible; use --device cpu or auto")
    ranks, gpus = int(os.environ.get("LOCAL_WORLD_SIZE", env.world_size)), torch.cuda.device_count()
    if env.world_size > 1 and ranks > gpus:
        err = UserError(f"{ranks} torchrun ranks on this node but {gpus} GPU(s) visible: each rank trains on its "
                        f"own GPU; use --nproc-per-node {gpus} or fewer (or --device cpu)")
        err.all_ranks = True  # every rank raises it: rank 0 alone prints it
        raise err
    torch.cuda.set_device(env.local_rank)
    return torch.device("cuda", env.local_rank)


def _mixed_precision(cfg: TrainStudentConfig, device: torch.device) -> torch.dtype | None:
    mode = cfg.mixed_precision or ("bf16" if device.type == "cuda" else "no")
    if mode == "fp16" and device.type != "cuda":
        raise UserError("--mixed-precision fp16 needs CUDA; use bf16 or no on the CPU")
    return {"no": None, "bf16": torch.bfloat16, "fp16": torch.float16}[mode]


def _check_out(out: Path, resume: bool) -> None:
    """--out is a run folder of ours (or empty, or new) that no one else is writing; refused before anything in it is
    written (the lock file included)."""
    if out.exists() and not out.is_dir():
        raise UserError(f"output {out} is a file; pass a directory to --out")
    foreign = RunLayout(out).foreign()
    if foreign:  # a project folder: its config.json and metrics.jsonl would be overwritten by the run's
        raise UserError(f"--out {out} is not a train-student run folder: it holds {', '.join(foreign)}, and the run "
                        "would write its own config.json, metrics.jsonl and checkpoints among them; choose a new or "
                        "empty folder for --out")
    if dist_env().is_main:  # one writer per run folder: a second run would collide on checkpoints and metrics
        lock.acquire(out / lock.RUN_LOCK, f"run folder {out}")
    if out.is_dir() and not resume:
        done = RunLayout(out).holds_run()
        if done:
            raise UserError(f"{out} already holds a training run ({done[0]}/); add --resume to continue it or "
                            "choose a new --out")


def _check_apart(out: Path, caches: tuple[str, ...]) -> None:
    """--out neither is, nor is inside, nor holds a --cache folder: the run's files would land in the cache stage one
    wrote (and `teacher-cache --overwrite` or a cleanup of either would take the other with it). Real paths: a link
    does not hide it."""
    where = out.resolve()
    for c in caches:
        cache = Path(c).resolve()
        if where == cache:
            how = "is"
        elif where.is_relative_to(cache):
            how = "is inside"
        elif cache.is_relative_to(where):
            how = "holds"
        else:
            continue
        raise UserError(f"--out {out} {how} the --cache folder {c}: the run would write its checkpoints, metrics and "
                        "student into a cache folder (or around it); choose an --out outside every --cache folder")


def _plan(cfg: TrainStudentConfig, data: DataSplit, env: DistEnv) -> tuple[EpochPlan, int]:
    n = len(data.train_rows)
    share = n // env.world_size
    if cfg.batch_size > share:
        raise UserError(f"--batch-size {cfg.batch_size} is larger than a rank's share of the data: {n} training "
                        f"samples over {env.world_size} rank(s) is {share} per rank per epoch; lower --batch-size "
                        f"to at most {max(share, 1)}" + (" or use fewer ranks" if env.world_size > 1 else ""))
    plan = epoch_plan(data, env.world_size, cfg.batch_size, cfg.grad_accum, cfg.order, cfg.embedding_cache_size)
    if cfg.max_steps is not None:
        total = cfg.max_steps if cfg.epochs is None else min(cfg.max_steps, cfg.epochs * plan.steps)
    else:
        total = (cfg.epochs or 1) * plan.steps
    warning = warmup_warning(cfg, total)
    if warning:
        print0(warning)
    return plan, total


def warmup_warning(cfg: TrainStudentConfig, total: int) -> str | None:
    """One line when the warmup does not end before the run does: the learning rate would climb the whole run and
    never reach --lr (the default 100 warmup steps under `--max-steps 5` train at a twentieth of it), silently."""
    if cfg.warmup_steps < total or total <= 0:
        return None
    top = lr_at(total - 1, total, cfg.lr, cfg.warmup_steps, cfg.min_lr_ratio)
    return (f"warning: --warmup-steps {cfg.warmup_steps} is not below the run's {total} optimizer steps: the learning "
            f"rate climbs the whole run and peaks at {top:.3g}, not --lr {cfg.lr:g}; lower --warmup-steps (e.g. "
            f"{total // 10}) or train longer")


def _optimizer(model: torch.nn.Module, cfg: TrainStudentConfig, device: torch.device,
               heads: torch.nn.Module | None = None) -> torch.optim.Optimizer:
    # Decay matrices only: biases, norm gains and the modulation tables keep their scale.
    decay, no_decay = [], []
    for name, p in trained_parameters(model):  # (a LoRA student's frozen base has no optimizer state)
        (decay if p.ndim >= 2 and "scale_shift_table" not in name else no_decay).append(p)
    groups = [{"params": ps, "weight_decay": wd} for ps, wd in ((decay, cfg.weight_decay), (no_decay, 0.0)) if ps]
    if heads is not None:  # the objective's projection heads: a group of their own, after the student's
        groups.append({"params": list(heads.parameters()), "weight_decay": cfg.weight_decay})
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.999), eps=1e-8, fused=device.type == "cuda")


def _save_pretrained(model: torch.nn.Module, dest: Path) -> None:
    """diffusers format, written beside its final name, fsynced and swapped into place (`atomic.publish_dir`):
    `dest` is the old folder or the new one at every instant, never a half-written one."""
    for stale in dest.parent.glob(f"{dest.name}.*.tmp"):  # what a killed save left (the run lock is held)
        shutil.rmtree(stale, ignore_errors=True)
    tmp = dest.with_name(f"{dest.name}.{os.getpid()}.tmp")
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        honour_umask(tmp)  # (safetensors writes 0600 whatever the umask)
        publish_dir(tmp, dest, before_replace=lambda: fault_point("before_dir_rename"),
                    after_replace=lambda: fault_point("after_dir_rename"))
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)
        err = None if isinstance(e, OSError) else checkpoint.as_os_error(e, tmp)
        if err is None:
            raise
        raise err from e  # a full disk: one line from the CLI, not a SafetensorError traceback


def _distill_record(cfg: TrainStudentConfig, data: DataSplit, state: TrainState, ema: bool,
                    objective: Objective, lora_spec: lora_student.LoraSpec | None = None) -> DistillRecord:
    """What the sampling commands need to know about the targets this student learned and how to sample it."""
    m = data.index.manifest
    steps = list(data.train_steps)
    pick = lambda key: [m[key][k] for k in steps] if isinstance(m.get(key), list) else None  # noqa: E731
    return DistillRecord(
        student=STUDENT, student_ema=STUDENT_EMA if ema else None,
        caches=[{"path": str(c.path), "fingerprint": c.fingerprint} for c in data.index.caches],
        fingerprints=sorted({c.fingerprint for c in data.index.caches}),
        teacher=m.get(F.F_TEACHER), teacher_path=m.get(F.F_TEACHER_PATH), revision=m.get(F.F_REVISION),
        cfg=m.get(F.F_CFG), guidance=m.get(F.F_GUIDANCE), guidance_2=m.get(F.F_GUIDANCE_2),
        boundary_ratio=m.get(F.F_BOUNDARY_RATIO), negative_prompt=m.get(F.F_NEGATIVE_PROMPT),
        max_sequence_length=m.get(F.F_MAX_SEQUENCE_LENGTH), expand_timesteps=m.get(F.F_EXPAND_TIMESTEPS),
        latent_shape=m.get(F.F_LATENT_SHAPE), height=m.get(F.F_HEIGHT), width=m.get(F.F_WIDTH),
        frames=m.get(F.F_FRAMES), dtype=m.get(F.F_DTYPE), steps=m.get(F.F_STEPS), timesteps=m.get(F.F_TIMESTEPS),
        sigmas=m.get(F.F_SIGMAS), scheduler=m.get(F.F_SCHEDULER), train_steps=steps,
        train_timesteps=pick(F.F_TIMESTEPS), heldout_prompts=data.heldout_prompts.tolist(), init_seed=cfg.seed,
        init_from_teacher=cfg.init_from_teacher, student_config=cfg.student_config, optimizer_steps=state.step,
        samples_seen=state.samples, epochs_completed=state.epoch, objective=objective.name,
        objective_settings=objective.record(), student_steps=objective.student_steps(m),
        lora=lora_spec.record() if lora_spec is not None else None,
    )


@dataclass
class _Setup:
    """What stage two decided before building anything: where, what to learn, from which data, in which order."""

    device: torch.device
    mixed: torch.dtype | None
    layout: RunLayout
    student_cfg: dict
    objective: Objective
    data: DataSplit
    plan: EpochPlan
    total: int  # optimizer steps of the run
    identity: dict  # what a checkpoint must match to be resumed
    strategy: Strategy  # how the student is laid over the ranks (strategy.py)
    lora: lora_student.LoraSpec | None = None  # a LoRA student's teacher and adapters (--lora-of)

    @property
    def manifest(self) -> dict:
        return self.data.index.manifest


def _setup(cfg: TrainStudentConfig, env: DistEnv, device: torch.device) -> _Setup:
    """Student config, objective, the caches checked against both and indexed, the exact epoch plan."""
    mixed = _mixed_precision(cfg, device)
    layout = RunLayout(cfg.out)
    _check_apart(layout.root, cfg.cache)
    if not cfg.dry_run:  # a dry run writes nothing to --out: no lock, no folder (train_dry_run.py)
        _check_out(layout.root, cfg.resume)
    student_cfg = load_student_config(cfg.student_config) if cfg.lora_of is None else None
    objective = get_objective(cfg.objective).from_config(cfg)
    caches = open_caches(list(cfg.cache))
    manifest, train_steps, spec = caches[0].manifest, cfg.train_steps, None
    if cfg.lora_of is not None:  # the student is the teacher itself: its transformer config, checked against the cache
        spec = lora_student.LoraSpec.from_config(cfg, manifest)
        spec.check(manifest, str(caches[0].path))
        student_cfg, train_steps = spec.config, spec.train_steps(manifest, cfg.train_steps)
    check_compatible(student_cfg, manifest, cfg.student_config or cfg.lora_of)  # before the (slower) shard check
    check_cache(objective, manifest, str(caches[0].path), int(student_cfg.get("num_layers", 1)))
    # A dry run checks sizes only: the checksum of an A14B cache's shards is hours of reading, not a step's cost.
    data = prepare(caches, env, device, "size" if cfg.dry_run else cfg.verify, train_steps, cfg.holdout_prompts)
    plan, total = _plan(cfg, data, env)
    if env.is_main and not cfg.dry_run:
        layout.root.mkdir(parents=True, exist_ok=True)
    identity = {"fingerprints": sorted({c.fingerprint for c in data.index.caches}), "data": data.digest(),
                "seed": cfg.seed, "global_batch": plan.global_batch, "grad_accum": cfg.grad_accum,
                "student_config": student_cfg | {"patch_size": list(student_cfg.get("patch_size", (1, 2, 2)))}}
    identity[SETTINGS] = {k: _setting(cfg, k, device) for k in KEPT_SETTINGS}
    if spec is not None:
        identity["lora"] = spec.identity()
    if objective.name != "velocity" or objective.record():  # runs from before objectives resume unchanged
        identity["objective"] = {"name": objective.name, **objective.record()}
    order = order_identity(plan, cfg.embedding_cache_size)
    if order is not None:  # (a shuffled epoch's identity is what it was before grouped orders)
        identity["order"] = order
    strategy = get_strategy(cfg.strategy, env, device, mixed)
    return _Setup(device, mixed, layout, student_cfg, objective, data, plan, total, identity, strategy, spec)


def _build_student(cfg: TrainStudentConfig, env: DistEnv, s: _Setup, fresh: bool):
    """The student (same seed on every rank; DDP also broadcasts rank 0's weights when it wraps) placed by the
    strategy, the objective's heads, the optimizer and the fp16 scaler, and the module the loop runs (the DDP
    wrapper, or None: the student itself)."""
    if s.lora is not None:  # the teacher's experts, frozen in the autocast dtype (float32 without), and the adapters
        model = lora_student.build(s.lora, cfg.seed, s.mixed or torch.float32)
    else:
        model = build_student(s.student_cfg, cfg.student_config, cfg.seed)
    if cfg.init_from_teacher and fresh and (env.is_main or not s.strategy.syncs_init):
        rep = init_from_teacher(model, cfg.init_from_teacher, cfg.teacher_blocks, cfg.revision)
        print0(f"initialised {rep['copied']} tensors from {cfg.init_from_teacher} (teacher blocks "
             f"{rep['teacher_blocks']}; {rep['shape_mismatch']} differ in shape, {rep['missing']} not in the teacher)")
        # The seed alone no longer reproduces the untrained student: keep it for evaluation.
        if env.is_main and not cfg.dry_run:
            _save_pretrained(model, s.layout.student_init)
    if cfg.gradient_checkpointing:
        model.enable_gradient_checkpointing()
    model.train()
    with torch.random.fork_rng(devices=[]):  # the heads' own stream: the student's init and data order stay
        torch.manual_seed(cfg.seed + 1)
        heads = s.objective.heads(s.student_cfg, s.manifest)
    if heads is not None:
        heads.train()
    wrapped = s.strategy.wrap(model, heads)  # onto the device: replicated (ddp) or sharded (fsdp)
    optimizer = _optimizer(model, cfg, s.device, heads)
    scaler = torch.amp.GradScaler(s.device.type, enabled=s.mixed == torch.float16)
    return model, heads, optimizer, scaler, wrapped


def _pick_checkpoint(env: DistEnv, s: _Setup) -> Path | None:
    """The checkpoint `--resume` restores: the newest sound one (checkpoint.pick). Rank 0 alone reads and hashes
    the checkpoints and every rank takes its choice, so all ranks resume from the same one; when none is sound,
    every rank raises the same one-line UserError."""
    choice: dict = {}
    if env.is_main:
        try:
            path, lines = checkpoint.pick(s.layout.root)
            choice = {"name": path.name if path else None, "lines": lines}
        except UserError as e:
            choice = {"error": str(e)}
    choice = json.loads(all_gather_bytes(json.dumps(choice).encode(), s.device)[0])
    if "error" in choice:
        err = UserError(choice["error"])
        err.all_ranks = True  # rank 0 alone prints it
        raise err
    for line in choice["lines"]:
        print0(line)
    return s.layout.checkpoints / choice["name"] if choice["name"] else None


# -- what a resume may change ------------------------------------------------------------------------------------
# A resume continues the run its checkpoint holds, and ends bit-equal to that run uninterrupted. So it keeps every
# setting that changes what is computed: the run identity (`_Setup.identity`, in every checkpoint's trainer state),
# checked by `_resume_problem`, the one place that decides. A setting outside it may change: how long the run is
# (--max-steps, --epochs: said in one line, `_length_note`, since the learning-rate schedule follows the new length;
# never below the checkpoint's step), and what does not touch the weights (--checkpoint-every, --keep-checkpoints,
# --eval-every, --log-every, --val-*, --report-to, --num-workers, --verify, --device, --gradient-checkpointing,
# --collective-timeout-s, the number of ranks at the same global batch). --strategy is the checkpoint's format.
SETTINGS = "settings"  # the identity's entry of the settings below, by field name
KEPT_SETTINGS = ("lr", "min_lr_ratio", "warmup_steps", "weight_decay", "max_grad_norm", "ema_decay", "mixed_precision",
                 "train_steps", "holdout_prompts")
# The identity's other entries: what each is, in the refusal's words, and the flags that set it.
_IDENTITY_WORDS = {
    "fingerprints": ("caches", "--cache"), "data": ("data selection", "--cache, --train-steps and --holdout-prompts"),
    "seed": ("seed", "--seed"), "global_batch": ("global batch", "--batch-size x ranks"),
    "grad_accum": ("gradient accumulation", "--grad-accum"), "student_config": ("student config", "--student-config"),
    "lora": ("lora student", "--lora-of and --lora-*"), "objective": ("objective", "--objective and its settings"),
    "order": ("order", "--order and --embedding-cache-size"),
}
_LORA_FLAGS = {"rank": "--lora-rank", "alpha": "--lora-alpha", "targets": "--lora-targets", "trained": "--lora-experts",
               "weights": "--lora-of (its weight files)", "configs": "--lora-of (its configs)"}


def _setting(cfg: TrainStudentConfig, name: str, device: torch.device | None):
    """A kept setting's value as the identity records it (mixed precision resolved: auto is bf16 on CUDA)."""
    if name == "mixed_precision":
        return cfg.mixed_precision or ("bf16" if device.type == "cuda" else "no")
    value = getattr(cfg, name)
    return list(value) if isinstance(value, tuple) else value


def _with(flag: str, v) -> str:
    """How to pass value `v` of `flag` again (`--lr 0.001`; `no --train-steps` for one that was not given)."""
    return f"no {flag}" if v is None else f"{flag} {_show(v)}"


def _show(v) -> str:
    if v is None:
        return "unset"
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, (list, tuple)):
        return ",".join(map(str, v))
    return f"{v!r:.60}" if isinstance(v, dict) else str(v)


def _flag(cfg: TrainStudentConfig, key: str, objective: str) -> str:
    """The flag of an objective's recorded setting `key` (its merged field), or `its <key>` for a derived one."""
    for f in dataclasses.fields(cfg):
        if f.metadata.get(SOURCE) == key and f.metadata.get(OWNER) == objective:
            return "--" + f.name.replace("_", "-")
    return f"its {key.replace('_', ' ')}"


def _difference(key: str, old, new, saved: dict, cfg: TrainStudentConfig) -> tuple[str, str]:
    """(what differs, in words naming the flag; the values to resume with) of identity entry `key`."""
    if key == "global_batch" and isinstance(old, int) and isinstance(new, int):
        world = saved.get("world_size") or 1
        now = new // cfg.batch_size
        return (f"--batch-size x ranks {old // world} x {world} = {old} then, {cfg.batch_size} x {now} = {new} now",
                f"--batch-size x ranks = {old}")
    if key in ("seed", "grad_accum"):
        flag = _IDENTITY_WORDS[key][1]
        return f"{flag} {_show(old)} then, {_show(new)} now", f"{flag} {_show(old)}"
    if isinstance(old, dict) and isinstance(new, dict):
        differ = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
        if key == "objective" and "name" in differ:
            return f"--objective {old.get('name')} then, {new.get('name')} now", f"--objective {old.get('name')}"
        name = (lambda k: _flag(cfg, k, str(new.get("name")))) if key == "objective" else \
            (lambda k: _LORA_FLAGS.get(k, k)) if key == "lora" else (lambda k: k.replace("_", " "))
        shown = [f"{name(k)} {_show(old.get(k))} then, {_show(new.get(k))} now" for k in differ[:2]]
        return ", ".join(shown) + (f" and {len(differ) - 2} more" if len(differ) > 2 else ""), \
            f"the same {_IDENTITY_WORDS.get(key, (key, key))[1]}"
    flags = _IDENTITY_WORDS.get(key, (key, key))[1]
    if key == "fingerprints":
        return f"fingerprint {_show(old)[:12]}… then, {_show(new)[:12]}… now", f"the same {flags}"
    if key == "data":  # name the selection flag that changed, if one did (else the caches' rows did)
        kept, now = (saved.get("extra") or {}).get(SETTINGS) or {}, {k: _setting(cfg, k, None) for k in
                                                                    ("train_steps", "holdout_prompts")}
        for k, v in now.items():
            if k in kept and kept[k] != v:
                flag = "--" + k.replace("_", "-")
                return f"{flag} {_show(kept[k])} then, {_show(v)} now", _with(flag, kept[k])
        return "other rows to train on or hold out", f"the same {flags}"
    return f"{_show(old)} then, {_show(new)} now", f"the same {flags}"


def _resume_problem(ckpt: Path, saved: dict, s: _Setup, cfg: TrainStudentConfig) -> str | None:
    """Why checkpoint `ckpt` (its trainer state `saved`) cannot be continued by this run, in one line naming the flag,
    the checkpoint's value and this run's, and the fix; None when it can. What the run is first (caches, data, student,
    objective, ...), then the kept settings, a flag each (a kept setting the checkpoint lacks, written before it was
    kept, is not compared)."""
    written_by = saved.get("strategy", "ddp")  # checkpoints from before --strategy are ddp's
    if written_by != s.strategy.name:
        return (f"checkpoint {ckpt} was written with --strategy {written_by} (its weights are "
                f"{'sharded' if written_by == 'fsdp' else 'whole'}); resume with --strategy {written_by}, "
                "or use a new --out")
    extra = saved.get("extra") or {}
    found = None
    for k in sorted((s.identity.keys() | extra.keys()) - {SETTINGS}):
        if extra.get(k) != s.identity.get(k):
            found = _IDENTITY_WORDS.get(k, (k.replace("_", " "),))[0], *_difference(k, extra.get(k), s.identity.get(k),
                                                                                    saved, cfg)
            break
    kept, now = extra.get(SETTINGS) or {}, s.identity[SETTINGS]
    for k in [] if found else KEPT_SETTINGS:
        if k in kept and kept[k] != now[k]:
            flag = "--" + k.replace("_", "-")
            found = flag, f"{flag} {_show(kept[k])} then, {_show(now[k])} now", _with(flag, kept[k])
            break
    if found is None:
        return None
    what, detail, fix = found
    return (f"checkpoint {ckpt} was made with another {what} ({detail}); a resume continues the run its checkpoint "
            f"holds, to end as that run would have: rerun with {fix} to continue it, or use a new --out to train "
            "with the new value")


def _length_flag(cfg: TrainStudentConfig, total: int) -> str:
    """The flag that sets the run's length `total`: --max-steps N, or --epochs E when they end it first."""
    if cfg.max_steps is not None and total == cfg.max_steps:
        return f"--max-steps {cfg.max_steps}"
    return f"--epochs {cfg.epochs or 1}"


def _check_resumable(ckpt: Path, s: _Setup, cfg: TrainStudentConfig) -> dict:
    """The trainer state of checkpoint `ckpt` once this run may continue it (every rank checks alike): the same
    identity (`_resume_problem`) and a run that does not end before the checkpoint's step."""
    saved = checkpoint.read_state(ckpt)
    problem = _resume_problem(ckpt, saved, s, cfg)
    if problem is None and saved["step"] > s.total:
        problem = (f"--resume: the newest sound checkpoint, {ckpt.name}, is at step {saved['step']}, past this run's "
                   f"end at step {s.total} ({_length_flag(cfg, s.total)}); pass --max-steps {saved['step']} or more "
                   "to continue that run, or use a new --out to train a shorter one")
    if problem is not None:
        err = UserError(problem)
        err.all_ranks = True  # every rank reads the same state: rank 0 alone prints it
        raise err
    return saved


def _length_note(saved: dict, s: _Setup, cfg: TrainStudentConfig) -> str | None:
    """One line when this resume ends the run at another step than the checkpoint's run would have (a checkpoint
    records its run's length since the note exists)."""
    before = saved.get("total")
    if before is None or before == s.total:
        return None
    return (f"note: --resume: the run now ends at step {s.total} ({_length_flag(cfg, s.total)}), not {before}: "
            f"from step {saved['step'] + 1} the learning rate follows the schedule of {s.total} steps, so the "
            f"student is neither the {before}-step run's nor that of {s.total} steps uninterrupted")


def _finished(saved: dict, s: _Setup) -> bool:
    """A run that already ended where this one would: its student/ is in place (renamed in last) and its
    distill.json says it trained this run's steps; resumed from a checkpoint of the same identity, nothing is left."""
    if not s.layout.student.is_dir() or saved["step"] > s.total:
        return False
    try:
        return DistillRecord.read(s.layout.distill).optimizer_steps == s.total
    except (ValueError, TypeError):
        return False


def _resume(ckpt: Path, saved: dict, env: DistEnv, s: _Setup, optimizer, scaler) -> tuple[TrainState, dict | None]:
    """Restore checkpoint `ckpt` (its state `saved` checked by `_check_resumable`); returns (state, EMA tensors)."""
    saved, ema_state = s.strategy.load_checkpoint(ckpt, optimizer)
    state = TrainState(**{k: saved[k] for k in ("step", "epoch", "epoch_step", "samples", "wall_s")})
    rngs = saved.get("rng") or []
    if env.rank < len(rngs) and saved.get("world_size") == env.world_size:
        checkpoint.set_rng_state(rngs[env.rank])
    if saved.get("scaler") and scaler.is_enabled():
        scaler.load_state_dict(saved["scaler"])
    if env.is_main:
        truncate_metrics(s.layout.root, state.step)
    print0(f"resuming from {ckpt} (step {state.step}, epoch {state.epoch}, {state.epoch_step}/{s.plan.steps} "
         "steps into it)")
    return state, ema_state


def _save(cfg: TrainStudentConfig, env: DistEnv, s: _Setup, ema, state: TrainState) -> None:
    """The EMA student, the distillation record, the loss curve, then the student in diffusers format.
    student/ is renamed into place last, so it exists only when the run finished: a kill before that leaves
    an OUT that `--resume` completes and `sample` refuses, never a raw student without its EMA or record.
    The strategy hands rank 0 the full weights (ddp: the student itself, the EMA swapped in for its save)."""
    if ema is not None:
        with s.strategy.full_model(ema) as full:
            if env.is_main:
                _save_pretrained(full, s.layout.student_ema)
    if env.is_main:
        record = _distill_record(cfg, s.data, state, ema is not None, s.objective, s.lora)
        atomic_write_json(s.layout.distill, record.to_json())
        plot_losses(s.layout.root)
    with s.strategy.full_model() as full:
        if env.is_main:
            _save_pretrained(full, s.layout.student)
    barrier(s.device)


def _run(cfg: TrainStudentConfig, env: DistEnv, device: torch.device) -> dict:
    t0 = time.time()
    require_backend(cfg.report_to)  # a missing tracker package is refused before anything slow
    s = _setup(cfg, env, device)
    ckpt = _pick_checkpoint(env, s) if cfg.resume and not cfg.dry_run else None
    saved = _check_resumable(ckpt, s, cfg) if ckpt is not None else None  # before anything is built
    if saved is not None and _finished(saved, s):  # (the SLURM script passes --resume to every start)
        print0(f"train-student: {s.layout.root} is finished ({s.total} steps, {s.layout.student} written); nothing "
               "to do (to train longer, rerun with --resume and a larger --max-steps)")
        return {"out": str(s.layout.root), "steps": s.total, "finished": True}
    if saved is not None and (note := _length_note(saved, s, cfg)):
        print0(note)
    model, heads, optimizer, scaler, wrapped = _build_student(cfg, env, s, fresh=ckpt is None)
    if cfg.dry_run:  # two measured steps and a report instead of training (train_dry_run.py)
        return train_dry_run.measure(cfg, env, s, model, heads, optimizer, scaler, wrapped)
    state, ema_state = TrainState(), None
    if ckpt is not None:
        state, ema_state = _resume(ckpt, saved, env, s, optimizer, scaler)
    elif cfg.resume:
        print0(f"--resume: no complete checkpoint in {s.layout.checkpoints}; starting from step 0")
    if env.is_main:  # only now: a refused --resume leaves the run as it was
        save_resolved(cfg, s.layout.resolved_config)
        if ckpt is None:
            s.layout.metrics.write_text("")
    ema = make_ema(model, cfg.ema_decay, ema_state, state.step) if cfg.ema_decay > 0 else None
    trained = sum(p.numel() for _, p in trained_parameters(model))
    kind = "" if s.lora is None else f" ({trained / 1e6:.2f}M trained: rank-{s.lora.rank} LoRA of {cfg.lora_of})"
    print0(f"train-student: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M-parameter student{kind} on "
         f"{env.world_size} x {s.device.type} ({cfg.strategy}), objective {s.objective.name}, "
         f"{len(s.data.train_rows)} training samples ({len(s.data.heldout_rows)} held out), global batch "
         f"{s.plan.global_batch} x {cfg.grad_accum} accum, {s.plan.steps} steps/epoch ("
         f"{f'grouped, windows of {s.plan.window} read groups' if s.plan.window else 'shuffled'}), {s.total} steps, "
         f"mixed precision {s.mixed or 'no'}")

    # The run's hyperparameters for the tracker: the resolved config and what it resolved to.
    tracked = dataclasses.asdict(cfg) | {"cache_fingerprint": ",".join(s.identity["fingerprints"]),
                                         "world_size": env.world_size, "global_batch": s.plan.global_batch,
                                         "total_steps": s.total}
    tracker = open_tracker(cfg.report_to, s.layout, config=tracked, resume_step=state.step if ckpt else None,
                           is_main=env.is_main)
    # Validation samples the student as distill.json will say it is sampled (its steps and scheduler).
    validator = make_validator(cfg, env.is_main, s.data, _distill_record(cfg, s.data, state, ema is not None,
                                                                          s.objective, s.lora), s.device,
                               every_rank=s.strategy.lockstep)
    trainer = Trainer(cfg=cfg, env=env, device=s.device, model=model, ddp=wrapped, data=s.data, plan=s.plan,
                      optimizer=optimizer, scaler=scaler, ema=ema, state=state, total=s.total, out=s.layout.root,
                      mixed_dtype=s.mixed, expand_timesteps=bool(s.manifest.get(F.F_EXPAND_TIMESTEPS)),
                      patch=tuple(s.manifest.get(F.F_PATCH_SIZE) or (1, 2, 2)), checkpoint_extra=s.identity,
                      objective=s.objective, heads=heads, tracker=tracker, validator=validator,
                      strategy=s.strategy)
    with signals.deferred():  # SIGTERM: a checkpoint at the next step boundary (Trainer.fit); after the last, finish
        state = trainer.fit()
        sha = s.strategy.weights_sha()  # ddp: also checks that every rank holds the same weights
        trainer.write_debug(sha)
        _save(cfg, env, s, ema, state)

    out = s.layout.root
    summary = {"out": str(out), "steps": state.step, "epochs": state.epoch, "samples": state.samples,
               "final_loss": _last(out, "train", "loss"), "heldout_loss": _last(out, "eval", "heldout_loss"),
               "first_heldout_loss": _first(out, "eval", "heldout_loss"), "wall_s": round(time.time() - t0, 2),
               "param_sha256": sha}
    if s.device.type == "cuda":
        summary["peak_cuda_gib"] = round(torch.cuda.max_memory_allocated(s.device) / 2**30, 3)
    print0(f"student written to {s.layout.student}" + (f" (EMA: {s.layout.student_ema})" if ema else "")
         + f"; {state.step} steps, final loss {summary['final_loss']}, held-out {summary['heldout_loss']}, "
         f"{summary['wall_s']:.1f}s")
    return summary


def _records(out: Path, kind: str, key: str) -> list:
    path = RunLayout(out).metrics
    if not dist_env().is_main or not path.exists():
        return []
    return [r[key] for r in map(json.loads, path.read_text().splitlines()) if r["type"] == kind]


def _last(out: Path, kind: str, key: str):
    r = _records(out, kind, key)
    return r[-1] if r else None


def _first(out: Path, kind: str, key: str):
    r = _records(out, kind, key)
    return r[0] if r else None
