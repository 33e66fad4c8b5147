"""Stage two: setup → fit → validate → save. A student trained from the cache alone.

No teacher and no text encoder are ever loaded here: the targets and the prompt embeddings are read
from the cache (`--init-from-teacher` reads a few tensors of the teacher's weight files, nothing more).
Under torchrun every rank runs this; rank 0 alone writes shared files.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from cache import format as F
from cache.atomic import atomic_write_json
from cache.errors import CacheError
from cache.reader import EpochPlan, open_caches
from pipeline.config import TrainStudentConfig, save_resolved
from pipeline.errors import EXIT_OOM, EXIT_USAGE, UserError, disk_message, is_disk_error, oom_message
from pipeline.runtime import DistEnv, dist_env, init_distributed, teardown

from . import checkpoint
from .comm import all_gather_bytes, barrier
from .data import DataSplit, prepare
from .loop import EMA, TrainState, Trainer, plot_losses, truncate_metrics
from .student import build_student, check_compatible, init_from_teacher, load_student_config

STAGE = "train-student"
STUDENT = "student"
STUDENT_EMA = "student_ema"
STUDENT_INIT = "student_init"  # the untrained student, saved when it was initialised from the teacher
DISTILL = "distill.json"
RESOLVED = "config.json"


def _say(msg: str) -> None:
    from tqdm.auto import tqdm

    if dist_env().is_main:
        tqdm.write(msg)


def run(cfg: TrainStudentConfig) -> dict:
    """Train the student described by `cfg`; returns the closing summary."""
    env = dist_env()
    if env.world_size > 1:
        init_distributed(cfg.collective_timeout_s)
    try:
        return _run(cfg, env)
    except BaseException as e:
        if env.world_size > 1:
            _exit_rank(e, env)
        raise
    finally:
        teardown()


def _exit_rank(e: BaseException, env: DistEnv) -> None:
    """Under torchrun: print this rank's error to stderr (visible in torchrun's output), record it for
    torchrun's summary, and leave at once. torchrun then stops the other ranks; a rank blocked in a
    collective with the dead one fails fast (gloo) or at --collective-timeout-s (NCCL)."""
    prefix = f"[rank {env.rank}] "
    if isinstance(e, torch.OutOfMemoryError):
        msg, code = oom_message(STAGE, e), EXIT_OOM
    elif isinstance(e, (UserError, CacheError)):
        msg, code = f"{prefix}error: {e}", EXIT_USAGE
        if getattr(e, "all_ranks", False) and env.rank != 0:
            msg = None  # the same line comes from rank 0
    elif is_disk_error(e):
        msg, code = f"{prefix}error: {disk_message(e, STAGE)}", EXIT_USAGE
    elif isinstance(e, dist.DistError) or "Connection closed by peer" in str(e) or "Connection reset" in str(e):
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        msg, code = f"{prefix}error: lost contact with another rank ({first}); its own message says why", 1
    elif isinstance(e, KeyboardInterrupt):
        msg, code = f"{prefix}error: interrupted; rerun with --resume to continue from the last checkpoint", 130
    else:
        msg, code = f"{traceback.format_exc().rstrip()}\n{prefix}error: {type(e).__name__}: {e}", 1
    if msg:
        # The leading newline keeps the message off rank 0's progress-bar line.
        print("\n" + msg, file=sys.stderr, flush=True)
        _record_for_torchrun(msg)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _record_for_torchrun(msg: str) -> None:
    """Write torchrun's per-worker error file, so its ChildFailedError summary quotes our message too."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    record = {"message": {"message": msg, "extraInfo": {
        "py_callstack": f"{msg}\n\n{traceback.format_exc()}", "timestamp": str(int(time.time()))}}}
    try:
        Path(path).write_text(json.dumps(record))
    except OSError:
        pass  # the message is on stderr already


def _device(cfg: TrainStudentConfig, env: DistEnv) -> torch.device:
    if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise UserError("--device cuda but no CUDA device is visible; use --device cpu or auto")
        torch.cuda.set_device(env.local_rank)
        return torch.device("cuda", env.local_rank)
    return torch.device("cpu")


def _mixed_precision(cfg: TrainStudentConfig, device: torch.device) -> torch.dtype | None:
    mode = cfg.mixed_precision or ("bf16" if device.type == "cuda" else "no")
    if mode == "fp16" and device.type != "cuda":
        raise UserError("--mixed-precision fp16 needs CUDA; use bf16 or no on the CPU")
    return {"no": None, "bf16": torch.bfloat16, "fp16": torch.float16}[mode]


def _check_out(out: Path, resume: bool) -> None:
    if out.exists() and not out.is_dir():
        raise UserError(f"output {out} is a file; pass a directory to --out")
    if out.is_dir() and not resume:
        done = [p.name for p in out.iterdir() if p.name in (STUDENT, STUDENT_EMA, checkpoint.CHECKPOINTS)]
        if done:
            raise UserError(f"{out} already holds a training run ({done[0]}/); add --resume to continue it or "
                            "choose a new --out")


def _plan(cfg: TrainStudentConfig, data: DataSplit, env: DistEnv) -> tuple[EpochPlan, int]:
    n = len(data.train_rows)
    share = n // env.world_size
    if cfg.batch_size > share:
        raise UserError(f"--batch-size {cfg.batch_size} is larger than a rank's share of the data: {n} training "
                        f"samples over {env.world_size} rank(s) is {share} per rank per epoch; lower --batch-size "
                        f"to at most {max(share, 1)}" + (" or use fewer ranks" if env.world_size > 1 else ""))
    plan = EpochPlan(n, env.world_size, cfg.batch_size, cfg.grad_accum)
    if cfg.max_steps is not None:
        total = cfg.max_steps if cfg.epochs is None else min(cfg.max_steps, cfg.epochs * plan.steps)
    else:
        total = (cfg.epochs or 1) * plan.steps
    return plan, total


def _optimizer(model: torch.nn.Module, cfg: TrainStudentConfig, device: torch.device) -> torch.optim.Optimizer:
    # Decay matrices only: biases, norm gains and the modulation tables keep their scale.
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.ndim >= 2 and "scale_shift_table" not in name else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.999), eps=1e-8, fused=device.type == "cuda")


def _param_sha(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _save_pretrained(model: torch.nn.Module, dest: Path) -> None:
    """diffusers format, written beside its final name and renamed into place."""
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)
        err = checkpoint.as_os_error(e, tmp)
        if err is None:
            raise
        raise err from e  # a full disk: one line from the CLI, not a SafetensorError traceback
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)


def _distill_record(cfg: TrainStudentConfig, data: DataSplit, state: TrainState, ema: bool) -> dict:
    """What the sampling stage needs to know about the targets this student learned."""
    m = data.index.manifest
    steps = list(data.train_steps)
    pick = lambda key: [m[key][k] for k in steps] if isinstance(m.get(key), list) else None  # noqa: E731
    return {
        "student": STUDENT, "student_ema": STUDENT_EMA if ema else None,
        "caches": [{"path": str(c.path), "fingerprint": c.fingerprint} for c in data.index.caches],
        "fingerprints": sorted({c.fingerprint for c in data.index.caches}),
        "teacher": m.get(F.F_TEACHER), "teacher_path": m.get(F.F_TEACHER_PATH), "revision": m.get(F.F_REVISION),
        # The targets are the teacher's *guided* predictions when cfg is true: sample the student without CFG.
        "cfg": m.get(F.F_CFG), "guidance": m.get(F.F_GUIDANCE), "guidance_2": m.get(F.F_GUIDANCE_2),
        "boundary_ratio": m.get(F.F_BOUNDARY_RATIO), "negative_prompt": m.get(F.F_NEGATIVE_PROMPT),
        "max_sequence_length": m.get(F.F_MAX_SEQUENCE_LENGTH), "expand_timesteps": m.get(F.F_EXPAND_TIMESTEPS),
        "latent_shape": m.get(F.F_LATENT_SHAPE), "height": m.get(F.F_HEIGHT), "width": m.get(F.F_WIDTH),
        "frames": m.get(F.F_FRAMES), "dtype": m.get(F.F_DTYPE), "steps": m.get(F.F_STEPS),
        "timesteps": m.get(F.F_TIMESTEPS), "sigmas": m.get(F.F_SIGMAS), "scheduler": m.get(F.F_SCHEDULER),
        "train_steps": steps, "train_timesteps": pick(F.F_TIMESTEPS),
        "heldout_prompts": data.heldout_prompts.tolist(), "init_seed": cfg.seed,
        "init_from_teacher": cfg.init_from_teacher, "student_config": cfg.student_config,
        "optimizer_steps": state.step, "samples_seen": state.samples, "epochs_completed": state.epoch,
    }


def _run(cfg: TrainStudentConfig, env: DistEnv) -> dict:
    t0 = time.time()
    # 1. setup: device, student config, data (checked and indexed), the exact epoch plan.
    device = _device(cfg, env)
    mixed = _mixed_precision(cfg, device)
    out = Path(cfg.out)
    _check_out(out, cfg.resume)
    student_cfg = load_student_config(cfg.student_config)
    caches = open_caches(list(cfg.cache))
    check_compatible(student_cfg, caches[0].manifest, cfg.student_config)  # before the (slower) shard check
    data = prepare(caches, env, device, cfg.verify, cfg.train_steps, cfg.holdout_prompts)
    manifest = data.index.manifest
    plan, total = _plan(cfg, data, env)
    if env.is_main:
        out.mkdir(parents=True, exist_ok=True)
    identity = {"fingerprints": sorted({c.fingerprint for c in data.index.caches}), "data": data.digest(),
                "seed": cfg.seed, "global_batch": plan.global_batch, "grad_accum": cfg.grad_accum,
                "student_config": student_cfg | {"patch_size": list(student_cfg.get("patch_size", (1, 2, 2)))}}

    # 2. the student (same seed on every rank; DDP also broadcasts rank 0's weights when it wraps).
    model = build_student(student_cfg, cfg.student_config, cfg.seed)
    ckpt = checkpoint.latest(out) if cfg.resume else None
    if cfg.init_from_teacher and env.is_main and ckpt is None:
        rep = init_from_teacher(model, cfg.init_from_teacher, cfg.teacher_blocks)
        _say(f"initialised {rep['copied']} tensors from {cfg.init_from_teacher} (teacher blocks "
             f"{rep['teacher_blocks']}; {rep['shape_mismatch']} differ in shape, {rep['missing']} not in the teacher)")
        # The seed alone no longer reproduces the untrained student: keep it for evaluation.
        _save_pretrained(model, out / STUDENT_INIT)
    if cfg.gradient_checkpointing:
        model.enable_gradient_checkpointing()
    model.to(device).train()
    optimizer = _optimizer(model, cfg, device)
    scaler = torch.amp.GradScaler(device.type, enabled=mixed == torch.float16)
    state, ema_state = TrainState(), None
    if ckpt is not None:
        saved = checkpoint.read_state(ckpt)
        for k, v in identity.items():
            if saved["extra"].get(k) != v:
                raise UserError(f"checkpoint {ckpt} was made with another {k.replace('_', ' ')} "
                                f"({saved['extra'].get(k)!r:.80} vs {v!r:.80}); resume with the same caches, seed, "
                                "--batch-size x ranks, --grad-accum, data selection and student config, or use a new --out")
        saved, ema_state = checkpoint.load(ckpt, model, optimizer, device)
        state = TrainState(**{k: saved[k] for k in ("step", "epoch", "epoch_step", "samples", "wall_s")})
        rngs = saved.get("rng") or []
        if env.rank < len(rngs) and saved.get("world_size") == env.world_size:
            checkpoint.set_rng_state(rngs[env.rank])
        if saved.get("scaler") and scaler.is_enabled():
            scaler.load_state_dict(saved["scaler"])
        if env.is_main:
            truncate_metrics(out, state.step)
        _say(f"resuming from {ckpt} (step {state.step}, epoch {state.epoch}, {state.epoch_step}/{plan.steps} "
             "steps into it)")
    elif cfg.resume:
        _say(f"--resume: no complete checkpoint in {out / checkpoint.CHECKPOINTS}; starting from step 0")
    if env.is_main:  # only now: a refused --resume leaves the run as it was
        save_resolved(cfg, out / RESOLVED)
    if env.is_main and ckpt is None:
        (out / "metrics.jsonl").write_text("")
    ddp = None
    if env.world_size > 1:
        ddp = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None, broadcast_buffers=False,
            gradient_as_bucket_view=True)
    ema = EMA(model, cfg.ema_decay, ema_state) if cfg.ema_decay > 0 else None
    n_params = sum(p.numel() for p in model.parameters())
    _say(f"train-student: {n_params / 1e6:.2f}M-parameter student on {env.world_size} x {device.type}, "
         f"{len(data.train_rows)} training samples ({len(data.heldout_rows)} held out), global batch "
         f"{plan.global_batch} x {cfg.grad_accum} accum, {plan.steps} steps/epoch, {total} steps, "
         f"mixed precision {mixed or 'no'}")

    # 3. fit.
    trainer = Trainer(cfg=cfg, env=env, device=device, model=model, ddp=ddp, data=data, plan=plan,
                      optimizer=optimizer, scaler=scaler, ema=ema, state=state, total=total, out=out,
                      mixed_dtype=mixed, expand_timesteps=bool(manifest.get(F.F_EXPAND_TIMESTEPS)),
                      patch=tuple(manifest.get(F.F_PATCH_SIZE) or (1, 2, 2)), checkpoint_extra=identity)
    state = trainer.fit()

    # 4. validate: DDP must have kept every rank's weights identical.
    sha = _param_sha(model)
    shas = [s.decode() for s in all_gather_bytes(sha.encode(), device)]
    if len(set(shas)) != 1:
        raise RuntimeError(f"ranks ended with different weights ({[s[:12] for s in shas]}); this is a bug")
    trainer.write_debug(sha)

    # 5. save: the EMA student, the distillation record, the loss curve, then the student in diffusers format.
    # student/ is renamed into place last, so it exists only when the run finished: a kill before that leaves
    # an OUT that `--resume` completes and `sample` refuses, never a raw student without its EMA or record.
    if env.is_main:
        if ema is not None:  # swap the EMA weights in for the save (no second model to initialise)
            raw = {k: p.detach().to("cpu", copy=True) for k, p in model.named_parameters()}
            ema.copy_to(model)
            _save_pretrained(model, out / STUDENT_EMA)
            with torch.no_grad():
                for k, p in model.named_parameters():
                    p.copy_(raw[k])
        atomic_write_json(out / DISTILL, _distill_record(cfg, data, state, ema is not None))
        plot_losses(out)
        _save_pretrained(model, out / STUDENT)
    barrier(device)
    summary = {"out": str(out), "steps": state.step, "epochs": state.epoch, "samples": state.samples,
               "final_loss": _last(out, "train", "loss"), "heldout_loss": _last(out, "eval", "heldout_loss"),
               "first_heldout_loss": _first(out, "eval", "heldout_loss"), "wall_s": round(time.time() - t0, 2),
               "param_sha256": sha}
    if device.type == "cuda":
        summary["peak_cuda_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
    _say(f"student written to {out / STUDENT}" + (f" (EMA: {out / STUDENT_EMA})" if ema else "")
         + f"; {state.step} steps, final loss {summary['final_loss']}, held-out {summary['heldout_loss']}, "
         f"{summary['wall_s']:.1f}s")
    return summary


def _records(out: Path, kind: str, key: str) -> list:
    path = out / "metrics.jsonl"
    if not dist_env().is_main or not path.exists():
        return []
    return [r[key] for r in map(json.loads, path.read_text().splitlines()) if r["type"] == kind]


def _last(out: Path, kind: str, key: str):
    r = _records(out, kind, key)
    return r[-1] if r else None


def _first(out: Path, kind: str, key: str):
    r = _records(out, kind, key)
    return r[0] if r else None
