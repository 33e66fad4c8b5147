"""Stage two: setup → fit → validate → save, a student trained from the cache alone (no teacher or text encoder
is loaded). Under torchrun every rank runs this; rank 0 alone writes shared files."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
import time
from pathlib import Path

import torch

from cache import safe_write
from cache.atomic import atomic_write_json, honour_umask, publish_dir
from pipeline import lock, signals
from pipeline.artifact import STUDENT, STUDENT_EMA, DistillRecord
from pipeline.config import TrainStudentConfig, save_resolved
from pipeline.errors import UserError, exit_rank
from pipeline.faults import fault_point
from pipeline.runtime import DistEnv, barrier, dist_env, init_distributed, print0, teardown
from stages.students.compact import init_from_teacher
from stages.students.student_kind import trained_parameters

from . import checkpoint, train_dry_run
from .comm import all_gather_bytes
from .loop import Parts, TrainState, Trainer, make_ema, metric_lines, plot_losses, truncate_metrics
from .run_identity import check_resumable, length_note
from .tracking import open_tracker, require_backend
from .train_plan import TrainPlan, make_plan
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
    if not isinstance(e, OSError) or e.errno not in (errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EISDIR) \
            or not e.filename or not (path := Path(e.filename)).absolute().is_relative_to(out.absolute()):
        return None
    return UserError(f"cannot write {path} ({e.strerror}); make {out} writable or choose another --out, and rerun "
                     "(with --resume to keep its checkpoints)")


def _device(cfg: TrainStudentConfig, env: DistEnv) -> torch.device:
    """This rank's training device: the CPU never initialises CUDA; on CUDA its LOCAL_RANK GPU, more ranks on this
    node than GPUs refused before any rank touches one (counting GPUs does not initialise CUDA)."""
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


def make_optimizer(model: torch.nn.Module, cfg: TrainStudentConfig, device: torch.device,
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
        with checkpoint.os_errors(tmp):
            model.save_pretrained(tmp, safe_serialization=True)
        honour_umask(tmp)  # (safetensors writes 0600 whatever the umask)
        publish_dir(tmp, dest, before_replace=lambda: fault_point("before_dir_rename"),
                    after_replace=lambda: fault_point("after_dir_rename"))
    except Exception:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _distill_record(p: TrainPlan, state: TrainState, ema: bool) -> DistillRecord:
    """What the sampling commands need to know about the targets this student learned and how to sample it."""
    cfg, data, objective, m = p.cfg, p.data, p.objective, p.manifest
    steps = list(data.train_steps)
    return DistillRecord.of_cache(
        m, student=STUDENT, student_ema=STUDENT_EMA if ema else None,
        caches=[{"path": str(c.path), "fingerprint": c.fingerprint} for c in data.index.caches],
        fingerprints=sorted({c.fingerprint for c in data.index.caches}), train_steps=steps,
        train_timesteps=[m.timesteps[k] for k in steps], heldout_prompts=data.heldout_prompts.tolist(),
        train_trajectories=cfg.train_trajectories or None, init_seed=cfg.seed, init_from_teacher=cfg.init_from_teacher,
        student_config=cfg.student_config,
        optimizer_steps=state.step, samples_seen=state.samples, epochs_completed=state.epoch, objective=objective.name,
        objective_settings=objective.record(), student_steps=objective.student_steps(m), lora=p.student.record(),
        **objective.record_fields(m))


def _build(p: TrainPlan, fresh: bool) -> Parts:
    """The student (same seed on every rank) placed by the strategy, the objective's heads, optimizer and scaler."""
    cfg, env = p.cfg, p.env
    model = p.student.build(cfg.seed, p.mixed or torch.float32)
    with torch.random.fork_rng(devices=[]):  # (what it adds draws apart: the student's weights stay the seed's)
        model = p.objective.adapt(model)
    if cfg.init_from_teacher and fresh and (env.is_main or not p.strategy.syncs_init):
        rep = init_from_teacher(model, cfg.init_from_teacher, cfg.teacher_blocks, cfg.revision)
        print0(f"initialised {rep['copied']} tensors from {cfg.init_from_teacher} (teacher blocks "
             f"{rep['teacher_blocks']}; {rep['shape_mismatch']} differ in shape, {rep['missing']} not in the teacher)")
        # The seed alone no longer reproduces the untrained student: keep it for evaluation.
        if env.is_main and not cfg.dry_run:
            _save_pretrained(model, p.layout.student_init)
    if cfg.gradient_checkpointing:
        model.enable_gradient_checkpointing()
    model.train()
    with torch.random.fork_rng(devices=[]):  # the heads' own stream: the student's init and data order stay
        torch.manual_seed(cfg.seed + 1)
        heads = p.objective.heads(p.student.config, p.manifest)
    if heads is not None:
        heads.train()
    wrapped = p.strategy.wrap(model, heads, p.student)  # onto the device: replicated (ddp) or sharded (fsdp)
    return Parts(model, heads, make_optimizer(model, cfg, p.device, heads),
                 torch.amp.GradScaler(p.device.type, enabled=p.mixed == torch.float16), wrapped)


def _pick_checkpoint(p: TrainPlan) -> Path | None:
    """The checkpoint `--resume` restores (checkpoint.pick): rank 0 alone reads and hashes the checkpoints and every
    rank takes its choice, or raises its one-line UserError."""
    choice: dict = {}
    if p.env.is_main:
        try:
            path, lines = checkpoint.pick(p.layout.root)
            choice = {"name": path.name if path else None, "lines": lines}
        except UserError as e:
            choice = {"error": str(e)}
    choice = json.loads(all_gather_bytes(json.dumps(choice).encode(), p.device)[0])
    if "error" in choice:
        err = UserError(choice["error"])
        err.all_ranks = True  # rank 0 alone prints it
        raise err
    for line in choice["lines"]:
        print0(line)
    return p.layout.checkpoints / choice["name"] if choice["name"] else None


def _finished(saved: dict, p: TrainPlan) -> bool:
    """A run that already ended where this one would: its student/ is in place (renamed in last) and its
    distill.json says it trained this run's steps; resumed from a checkpoint of the same identity, nothing is left."""
    if not p.layout.student.is_dir() or saved["step"] > p.total:
        return False
    try:
        return DistillRecord.read(p.layout.distill).optimizer_steps == p.total
    except (ValueError, TypeError):
        return False


def _resume(ckpt: Path, p: TrainPlan, parts: Parts) -> tuple[TrainState, dict | None]:
    saved, ema_state = p.strategy.load_checkpoint(ckpt, parts.optimizer)  # (checked by `check_resumable`)
    state = TrainState(**{k: saved[k] for k in ("step", "epoch", "epoch_step", "samples", "wall_s")})
    if saved["world_size"] == p.env.world_size:
        checkpoint.set_rng_state(saved["rng"][p.env.rank])
    if saved["scaler"] and parts.scaler.is_enabled():
        parts.scaler.load_state_dict(saved["scaler"])
    if p.env.is_main:
        truncate_metrics(p.layout.root, state.step)
    print0(f"resuming from {ckpt} (step {state.step}, epoch {state.epoch}, {state.epoch_step}/{p.epochs.steps} "
           "steps into it)")
    return state, ema_state


def _save(p: TrainPlan, ema, state: TrainState) -> None:
    """The EMA student, the distillation record, the loss curve, then student/, renamed into place last: a kill
    before it leaves an OUT that `--resume` completes and `sample` refuses, never a student without its record."""
    main = p.env.is_main
    if ema is not None:
        with p.strategy.full_model(ema) as full:
            if main:
                _save_pretrained(full, p.layout.student_ema)
    if main:
        atomic_write_json(p.layout.distill, _distill_record(p, state, ema is not None).to_json())
        plot_losses(p.layout.root)
    with p.strategy.full_model() as full:
        if main:
            _save_pretrained(full, p.layout.student)
    barrier(p.device)


def _start(p: TrainPlan) -> tuple[Parts, TrainState, Path | None] | dict:
    """Before training: the checkpoint `--resume` continues, checked before anything is built, the parts built and
    restored from it; the summary instead when the run is already finished."""
    cfg = p.cfg
    ckpt = _pick_checkpoint(p) if cfg.resume else None
    if ckpt is not None:
        saved = checkpoint.read_state(ckpt)
        check_resumable(ckpt, saved, p.identity, cfg, p.strategy.name, p.total)
        if _finished(saved, p):  # (the SLURM script passes --resume to every start)
            print0(f"train-student: {p.layout.root} is finished ({p.total} steps, {p.layout.student} written); "
                   "nothing to do (to train longer, rerun with --resume and a larger --max-steps)")
            return {"out": str(p.layout.root), "steps": p.total, "finished": True}
        if note := length_note(saved, cfg, p.total):
            print0(note)
    parts = _build(p, fresh=ckpt is None)
    state, ema_state = _resume(ckpt, p, parts) if ckpt is not None else (TrainState(), None)
    if ckpt is None and cfg.resume:
        print0(f"--resume: no complete checkpoint in {p.layout.checkpoints}; starting from step 0")
    if p.env.is_main:  # only now: a refused --resume leaves the run as it was
        save_resolved(cfg, p.layout.resolved_config)
        if ckpt is None:
            safe_write.write_file(p.layout.metrics, b"")
    if cfg.ema_decay > 0:
        parts.ema = make_ema(parts.model, cfg.ema_decay, ema_state, state.step)
    return parts, state, ckpt


def _run(cfg: TrainStudentConfig, env: DistEnv, device: torch.device) -> dict:
    t0 = time.time()
    require_backend(cfg.report_to)  # a missing tracker package is refused before anything slow
    p = make_plan(cfg, env, device)
    if cfg.dry_run:  # two measured steps and a report instead of training (train_dry_run.py)
        return train_dry_run.measure(p, _build(p, fresh=True))
    started = _start(p)
    if isinstance(started, dict):
        return started
    parts, state, ckpt = started
    kind = p.student.describe(parts.model)
    print0(f"train-student: {sum(x.numel() for x in parts.model.parameters()) / 1e6:.2f}M-parameter student{kind} "
           f"on {env.world_size} x {device.type} ({cfg.strategy}), objective {p.objective.name}, "
           f"{len(p.data.train_rows)} training samples ({len(p.data.heldout_rows)} held out), global batch "
           f"{p.epochs.global_batch} x {cfg.grad_accum} accum, {p.epochs.steps} steps/epoch ("
           f"{f'grouped, windows of {p.epochs.window} read groups' if p.epochs.window else 'shuffled'}), "
           f"{p.total} steps, mixed precision {p.mixed or 'no'}")

    # The run's hyperparameters for the tracker: the resolved config and what it resolved to.
    tracked = dataclasses.asdict(cfg) | {"cache_fingerprint": ",".join(p.identity.fingerprints),
                                         "world_size": env.world_size, "global_batch": p.epochs.global_batch,
                                         "total_steps": p.total}
    tracker = open_tracker(cfg.report_to, p.layout, config=tracked, resume_step=state.step if ckpt else None,
                           is_main=env.is_main)
    # Validation samples the student as distill.json will say it is sampled (its steps and scheduler).
    validator = make_validator(cfg, env.is_main, p.data, _distill_record(p, state, parts.ema is not None), device,
                               every_rank=p.strategy.lockstep, teacher=p.student.teacher_flag())
    trainer = Trainer(p, parts, state, p.layout.root, tracker, validator)
    with signals.deferred():  # SIGTERM: a checkpoint at the next step boundary (Trainer.fit); after the last, finish
        state = trainer.fit()
        sha = p.strategy.weights_sha()  # ddp: also checks that every rank holds the same weights
        trainer.write_debug(sha)
        _save(p, parts.ema, state)
    return _summary(p, state, sha, parts.ema is not None, t0)


def _summary(p: TrainPlan, state: TrainState, sha: str, ema: bool, t0: float) -> dict:
    records = [r for _, r in metric_lines(p.layout.root) if r] if p.env.is_main else []
    train, held = ([r[k] for r in records if r["type"] == t] for t, k in (("train", "loss"), ("eval", "heldout_loss")))
    summary = {"out": str(p.layout.root), "steps": state.step, "epochs": state.epoch, "samples": state.samples,
               "final_loss": (train or [None])[-1], "heldout_loss": (held or [None])[-1],
               "first_heldout_loss": (held or [None])[0], "wall_s": round(time.time() - t0, 2), "param_sha256": sha}
    if p.device.type == "cuda":
        summary["peak_cuda_gib"] = round(torch.cuda.max_memory_allocated(p.device) / 2**30, 3)
    print0(f"student written to {p.layout.student}" + (f" (EMA: {p.layout.student_ema})" if ema else "")
           + f"; {state.step} steps, final loss {summary['final_loss']}, held-out {summary['heldout_loss']}, "
           f"{summary['wall_s']:.1f}s")
    return summary
