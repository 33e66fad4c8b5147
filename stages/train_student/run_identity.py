"""What a resume may change: the run identity, one typed record, and the one place that decides (`resume_problem`);
docs/architecture.md "What a resume keeps"."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.errors import UserError
from pipeline.registries import STRATEGIES
from pipeline.settings import OWNER, SOURCE

if TYPE_CHECKING:
    from pipeline.config import TrainStudentConfig


def _kept(what: str, flags: str, optional: bool = False, keys: dict | None = None):
    """An identity field a resume must keep: `what` it is and the `flags` that set it, in the refusal's words (and,
    for a dict, the flag of each of its `keys`)."""
    meta = {"what": what, "flags": flags, "keys": keys or {}}
    return field(default=None, metadata=meta) if optional else field(metadata=meta)


_LORA_FLAGS = {"rank": "--lora-rank", "alpha": "--lora-alpha", "targets": "--lora-targets", "trained": "--lora-experts",
               "weights": "--lora-of (its weight files)", "configs": "--lora-of (its configs)"}


@dataclass(frozen=True)
class KeptSettings:
    """The settings of the run a resume must keep, by their TrainStudentConfig field (the flag is its name)."""

    lr: float
    min_lr_ratio: float
    warmup_steps: int
    weight_decay: float
    max_grad_norm: float
    ema_decay: float
    mixed_precision: str  # resolved: bf16 on CUDA, no on the CPU when not given
    train_steps: list[int] | None
    holdout_prompts: int

    @classmethod
    def of(cls, cfg: TrainStudentConfig, mixed_precision: str) -> KeptSettings:
        values = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cls)} | {"mixed_precision": mixed_precision}
        return cls(**values | {"train_steps": None if cfg.train_steps is None else list(cfg.train_steps)})


@dataclass(frozen=True)
class RunIdentity:
    """What a checkpoint must match to be resumed (the JSON keys of its trainer state's `extra`)."""

    fingerprints: list[str] = _kept("caches", "--cache")
    data: str = _kept("data selection", "--cache, --train-steps, --holdout-prompts and "
                                                   "--train-trajectories")
    seed: int = _kept("seed", "--seed")
    global_batch: int = _kept("global batch", "--batch-size x ranks")
    grad_accum: int = _kept("gradient accumulation", "--grad-accum")
    student_config: dict = _kept("student config", "--student-config")
    settings: KeptSettings = _kept("settings", "")  # compared setting by setting, a flag each
    lora: dict | None = _kept("lora student", "--lora-of and --lora-*", optional=True, keys=_LORA_FLAGS)
    # None for the velocity objective without settings (what it was before objectives were chosen)
    objective: dict | None = _kept("objective", "--objective and its settings", optional=True)
    order: dict | None = _kept("order", "--order and --embedding-cache-size", optional=True)  # None: shuffled

    def to_json(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}
        return out | {"settings": dataclasses.asdict(self.settings)}

    @classmethod
    def from_json(cls, d) -> RunIdentity:
        """The identity a checkpoint saved; ValueError naming the first key this version would not have written."""
        if not isinstance(d, dict) or not isinstance(d.get("settings"), dict):
            raise ValueError("settings")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        wrong = sorted(n for n, f in fields.items() if f.default is dataclasses.MISSING and n not in d) \
            or sorted(d.keys() - fields.keys()) \
            or sorted(d["settings"].keys() ^ {f.name for f in dataclasses.fields(KeptSettings)})
        if wrong:
            raise ValueError(wrong[0])
        return cls(**d | {"settings": KeptSettings(**d["settings"])})


def _show(v) -> str:
    if v is None:
        return "unset"
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, (list, tuple)):
        return ",".join(map(str, v))
    return f"{v!r:.60}" if isinstance(v, dict) else str(v)


def _changed(name: str, old, new) -> tuple[str, str, str]:
    """(flag, what differs, how to pass the old value again: `--lr 0.001`, `no --train-steps`) of setting `name`."""
    flag = "--" + name.replace("_", "-")
    return flag, f"{flag} {_show(old)} then, {_show(new)} now", f"no {flag}" if old is None else f"{flag} {_show(old)}"


def _flag(cfg: TrainStudentConfig, key: str, objective: str) -> str:
    """The flag of an objective's recorded setting `key` (its merged field), or `its <key>` for a derived one."""
    for f in dataclasses.fields(cfg):
        if f.metadata.get(SOURCE) == key and f.metadata.get(OWNER) == objective:
            return "--" + f.name.replace("_", "-")
    return f"its {key.replace('_', ' ')}"


def _difference(f: dataclasses.Field, old, new, saved: dict, cfg: TrainStudentConfig) -> tuple[str, str]:
    """(what differs, in words naming the flag; the values to resume with) of identity field `f`."""
    key, flags = f.name, f.metadata["flags"]
    if key == "global_batch":
        world = saved["world_size"]
        now = new // cfg.batch_size
        return (f"--batch-size x ranks {old // world} x {world} = {old} then, {cfg.batch_size} x {now} = {new} now",
                f"--batch-size x ranks = {old}")
    if key in ("seed", "grad_accum"):
        return f"{flags} {_show(old)} then, {_show(new)} now", f"{flags} {_show(old)}"
    if isinstance(old, dict) and isinstance(new, dict):
        differ = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
        if key == "objective" and "name" in differ:
            return f"--objective {old.get('name')} then, {new.get('name')} now", f"--objective {old.get('name')}"
        keys = f.metadata["keys"]
        name = (lambda k: _flag(cfg, k, str(new.get("name")))) if key == "objective" else \
            (lambda k: keys.get(k, k.replace("_", " ")))
        shown = [f"{name(k)} {_show(old.get(k))} then, {_show(new.get(k))} now" for k in differ[:2]]
        return ", ".join(shown) + (f" and {len(differ) - 2} more" if len(differ) > 2 else ""), f"the same {flags}"
    if key == "fingerprints":
        return f"fingerprint {_show(old)[:12]}… then, {_show(new)[:12]}… now", f"the same {flags}"
    return f"{_show(old)} then, {_show(new)} now", f"the same {flags}"


def _data_difference(then: KeptSettings, now: KeptSettings, flags: str) -> tuple[str, str]:
    """The data selection differs: name the selection flag that changed, if one did (else the caches' rows did)."""
    for k in ("train_steps", "holdout_prompts"):
        if getattr(then, k) != getattr(now, k):
            return _changed(k, getattr(then, k), getattr(now, k))[1:]
    return "other rows to train on or hold out", f"the same {flags}"


def _differences(saved: dict, then: RunIdentity, now: RunIdentity, cfg: TrainStudentConfig):
    """(what, detail, fix) of each identity field, then each kept setting, that differs between `then` and `now`."""
    for f in sorted(dataclasses.fields(RunIdentity), key=lambda f: f.name):
        old, new = getattr(then, f.name), getattr(now, f.name)
        if f.name != "settings" and old != new:
            yield f.metadata["what"], *(_data_difference(then.settings, now.settings, f.metadata["flags"])
                                        if f.name == "data" else _difference(f, old, new, saved, cfg))
    for s in dataclasses.fields(KeptSettings):
        old, new = getattr(then.settings, s.name), getattr(now.settings, s.name)
        if old != new:
            yield _changed(s.name, old, new)


def resume_problem(ckpt: Path, saved: dict, then: RunIdentity, now: RunIdentity, cfg: TrainStudentConfig,
                   strategy: str) -> str | None:
    """Why checkpoint `ckpt` (its trainer state `saved`, its identity `then`) cannot be continued by this run (`now`,
    `cfg`, `strategy`), in one line naming the flag, the checkpoint's value and this run's, and the fix; None when it
    can. What the run is first (caches, data, student, objective, ...), then the kept settings, a flag each."""
    if (written_by := saved["strategy"]) != strategy:
        sharded = written_by in STRATEGIES and STRATEGIES[written_by].caps.shards
        return (f"checkpoint {ckpt} was written with --strategy {written_by} (its weights are "
                f"{'sharded' if sharded else 'whole'}); resume with --strategy {written_by}, or use a new --out")
    if (found := next(_differences(saved, then, now, cfg), None)) is None:
        return None
    what, detail, fix = found
    return (f"checkpoint {ckpt} was made with another {what} ({detail}); a resume continues the run its checkpoint "
            f"holds, to end as that run would have: rerun with {fix} to continue it, or use a new --out to train "
            "with the new value")


def length_flag(cfg: TrainStudentConfig, total: int) -> str:
    """The flag that sets the run's length `total`: --max-steps N, or --epochs E when they end it first."""
    return f"--max-steps {total}" if total == cfg.max_steps else f"--epochs {cfg.epochs or 1}"


_STATE_KEYS = ("strategy", "total", "world_size", "rng", "scaler", "extra")  # what a resume reads beside the position


def check_resumable(ckpt: Path, saved: dict, now: RunIdentity, cfg: TrainStudentConfig, strategy: str,
                    total: int) -> None:
    """Checkpoint `ckpt`'s trainer state `saved` may be continued by this run (every rank checks alike): written by
    this version, the same identity (`resume_problem`) and a run of `total` steps, not ending before its step."""
    try:
        if missing := next((k for k in _STATE_KEYS if k not in saved), None):
            raise ValueError(missing)
        problem = resume_problem(ckpt, saved, RunIdentity.from_json(saved["extra"]), now, cfg, strategy)
    except ValueError as e:
        problem = (f"checkpoint {ckpt} was written by another version of train-student (its trainer state's {e} is "
                   "missing or not this version's); resume it with that version, or use a new --out")
    if problem is None and saved["step"] > total:
        problem = (f"--resume: the newest sound checkpoint, {ckpt.name}, is at step {saved['step']}, past this run's "
                   f"end at step {total} ({length_flag(cfg, total)}); pass --max-steps {saved['step']} or more "
                   "to continue that run, or use a new --out to train a shorter one")
    if problem is not None:
        err = UserError(problem)
        err.all_ranks = True  # every rank reads the same state: rank 0 alone prints it
        raise err


def length_note(saved: dict, cfg: TrainStudentConfig, total: int) -> str | None:
    """One line when this resume ends the run at another step (`total`) than the checkpoint's run would have."""
    if (before := saved["total"]) == total:
        return None
    return (f"note: --resume: the run now ends at step {total} ({length_flag(cfg, total)}), not {before}: "
            f"from step {saved['step'] + 1} the learning rate follows the schedule of {total} steps, so the "
            f"student is neither the {before}-step run's nor that of {total} steps uninterrupted")
