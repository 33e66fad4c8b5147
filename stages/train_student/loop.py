"""The training loop (`Trainer`): the objective's loss, AdamW with warmup + cosine, clipping, accumulation,
autocast, EMA, held-out evaluation, validation, metrics and checkpoints. The loss scaling over ranks:
docs/architecture.md "Stage two: train-student"."""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from diffusers.training_utils import EMAModel

from cache import format as F
from cache import safe_open, safe_write
from cache.atomic import atomic_write_bytes
from cache.cache_error import UnsafeFileError
from pipeline import signals
from pipeline.artifact import METRICS, RunLayout
from pipeline.errors import UserError
from pipeline.faults import fault_point
from pipeline.progress_bar import progress_bar
from pipeline.runtime import barrier
from pipeline.model_call import InputRule
from stages.students.student_kind import trained_parameters

from . import checkpoint
from .comm import all_gather_bytes, all_reduce
from .data import collate, make_loader, padded_context, to_device
from .epoch import RankBatches, eval_batches
from .objective_base import Batch
from .tracking import Tracker
from .train_plan import TrainPlan, lr_at

# Test hooks. FAIL_AT="rank:step[:oom]" makes that rank fail as optimizer step `step` (1-based) begins,
# with an out-of-memory error when ":oom" is given. DEBUG_DIR: each rank writes the sample keys of its
# micro-batches and a hash of its final parameters to DEBUG_DIR/rank-R.json.
FAIL_AT_ENV = "WANDISTILLER_FAIL_AT"
DEBUG_DIR_ENV = "WANDISTILLER_DEBUG_DIR"


def maybe_fail(rank: int, step: int) -> None:
    spec = os.environ.get(FAIL_AT_ENV)
    parts = spec.split(":") if spec else []
    if parts and int(parts[0]) == rank and int(parts[1]) == step:
        where = f"(injected by {FAIL_AT_ENV}={spec} at step {step} on rank {rank})"
        if parts[2:3] == ["oom"]:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 2.00 GiB {where}")
        raise RuntimeError(f"injected failure {where}")


def make_ema(model: torch.nn.Module, decay: float, shadow: dict[str, torch.Tensor] | None = None,
             updates: int = 0) -> EMAModel:
    """diffusers' EMAModel over the trained parameters (a LoRA student's frozen base would be a second copy of the
    teacher), with its warmup of the decay; `shadow` (by parameter name) and `updates` restore a checkpoint's EMA."""
    named = trained_parameters(model)
    ema = EMAModel([p for _, p in named], decay=decay, min_decay=0.0, update_after_step=0, use_ema_warmup=False,
                   foreach=True)
    if shadow is not None:
        ema.shadow_params = [shadow[k].to(p.device, p.dtype).clone() for k, p in named]
        ema.optimization_step = updates
    return ema


@dataclass
class Parts:
    """What a run trains, as `train._build` makes it: the student, the objective's heads, the optimizer, the fp16
    scaler, the module forward and backward run through (the strategy's wrapper; None: the student) and the EMA."""

    model: torch.nn.Module
    heads: torch.nn.Module | None
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    wrapped: torch.nn.Module | None = None
    ema: EMAModel | None = None


@dataclass
class TrainState:
    """Where training stands: saved in every checkpoint, restored on --resume."""

    step: int = 0  # optimizer steps done
    epoch: int = 0  # current epoch
    epoch_step: int = 0  # optimizer steps done in the current epoch (position in its exact sequence)
    samples: int = 0  # samples trained on, all ranks
    wall_s: float = 0.0
    extra: dict = field(default_factory=dict)  # its place in trainer_state.json: the run identity (Trainer)


def to_batch(batch: dict, device: torch.device, rule: InputRule) -> Batch:
    """A collated micro-batch on the device, its inputs following the cache teacher's `rule`."""
    fields = {k: to_device(v, device) for k, v in batch["fields"].items()}
    # collate passes the real tokens alone; the padding, zeros as WanPipeline pads, is added here on the device
    # (a padded A14B embedding is 4 MiB, trimmed ~0.5 MiB)
    return Batch(fields, batch["timestep"].to(device), padded_context(batch, device), batch["weight"].to(device),
                 {k: batch[k].to(device) for k in ("timestep", "sigma", "step", "sample")}, rule)


def nonfinite_input(b: Batch, keys: list[str]) -> str | None:
    """The first NaN or infinity among a micro-batch's inputs (each cached field and the prompt embedding, sample
    by sample), in words naming the sample; None when every input is finite. Called only once a loss is not."""
    real = torch.nonzero(b.weight > 0).flatten().tolist()  # the samples; `keys` names them in order
    for j, key in zip(real, keys):
        for name, t in [*b.fields.items(), ("its prompt embedding", b.context)]:
            if not bool(torch.isfinite(t[j]).all()):
                kind = "NaN" if bool(torch.isnan(t[j]).any()) else "an infinity"
                p, s, k = F.parse_key(key)
                return f"{kind} in {name} of sample {key} (prompt {p}, seed {s}, step {k})"
    return None


@dataclass
class _Pace:
    """How fast fit goes: wall time since the run began (`t_start`, moved back by a resumed run's wall time), samples/s
    as an exponential average over steps, and the step and data-wait seconds since the last metrics line."""

    t_start: float
    rate: float | None = None
    wait_s: float = 0.0
    step_s: float = 0.0

    def add(self, count: int, dt: float, wait_s: float) -> None:
        self.wait_s, self.step_s = self.wait_s + wait_s, self.step_s + dt
        self.rate = count / dt if self.rate is None else 0.9 * self.rate + 0.1 * count / dt


class Trainer:
    """Runs optimizer steps from `state` to the plan's total over its exact epoch sequence."""

    def __init__(self, plan: TrainPlan, parts: Parts, state: TrainState, out: Path, tracker: Tracker | None = None,
                 validator=None):
        self.cfg, self.env, self.device, self.strategy = plan.cfg, plan.env, plan.device, plan.strategy
        self.model, self.ddp, self.heads, self.ema = parts.model, parts.wrapped, parts.heads, parts.ema
        self.optimizer, self.scaler = parts.optimizer, parts.scaler
        self.objective, self.data, self.plan, self.total = plan.objective, plan.data, plan.epochs, plan.total
        self.state, self.out, self.identity = state, out, plan.identity
        self.rule = InputRule.of(plan.manifest)
        self.dataset = plan.objective.dataset(plan.data.index, self.cfg.embedding_cache_size)
        mixed = plan.mixed
        self.autocast = (lambda: torch.autocast(self.device.type, dtype=mixed)) if mixed else contextlib.nullcontext
        self.params = [p for m in (self.model, self.heads) if m is not None for p in m.parameters() if p.requires_grad]
        self.debug_dir = os.environ.get(DEBUG_DIR_ENV)
        self.trained_keys: list[list[str]] = []
        self.metrics = safe_write.open_append(RunLayout(out).metrics) if self.env.is_main else None
        self.tracker = tracker or Tracker()
        self.validator = validator  # validation.Validator on rank 0 when --val-every is on, else None
        self.last_eval: float | None = None
        self.checkpointed: int | None = None  # the step of the last checkpoint this run wrote
        self.data_wait_s = 0.0  # seconds step() spent blocked in next(loader) since fit last read it

    def log(self, record: dict) -> None:
        """One metrics.jsonl record, and the same to the tracker (rank 0; the others hold neither)."""
        if self.metrics is not None:
            self.metrics.write(json.dumps(record) + "\n")
            self.metrics.flush()
        self.tracker.log(record)

    def close_logs(self, failed: bool = False) -> None:
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        self.tracker.close(failed)

    @torch.no_grad()
    def log_eval(self) -> None:
        """Log the mean loss over the held-out prompts' samples (all ranks); nothing without a held-out set."""
        rows = self.data.heldout_rows
        if len(rows) == 0:
            return
        self._train_mode(False)
        total = torch.zeros(2, dtype=torch.float64)
        batches = eval_batches(rows, self.env.rank, self.env.world_size, self.cfg.batch_size)
        if self.strategy.lockstep:  # every forward is a collective: as many as rank 0's (the most), extras discarded
            most = len(eval_batches(rows, 0, self.env.world_size, self.cfg.batch_size))
            batches += [None] * (most - len(batches))
        for items in batches:
            b = to_batch(collate([self.dataset[i] for i in items or [(int(rows[0]), 0.0)]]), self.device, self.rule)
            per, _ = self.objective.loss(self.model, b, self.autocast, self.heads)
            if items is not None:
                total += torch.tensor([per.sum().item(), len(items)], dtype=torch.float64)
        self._train_mode(True)
        total = all_reduce(total, self.device)
        self.last_eval = float(total[0] / total[1])
        self.log({"type": "eval", "step": self.state.step, "heldout_loss": self.last_eval,
                  "heldout_samples": int(len(rows))})

    def _train_mode(self, on: bool) -> None:
        for module in (self.model, self.heads):
            if module is not None:
                module.train(on)

    def validate(self) -> None:
        """Rank 0 samples the held-out prompts (validation.py; the EMA weights with EMA, as `eval` would) while the
        other ranks go on to the next step. A failure is one warning line, never the run's end."""
        if self.validator is None:
            return
        swap = self.ema is not None
        try:
            with self.strategy.ema_weights(self.ema) if swap else contextlib.nullcontext(), self.strategy.inference():
                record, grid = self.validator.run(self.model, self.state.step)
        except Exception as e:  # noqa: BLE001 -- validation must never stop training
            tqdm.write(f"warning: validation at step {self.state.step} failed, training goes on: "
                       f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}")
            return
        finally:
            self.model.train()
        self.log({"type": "val", "step": self.state.step, "weights": "ema" if swap else "raw", **record})
        if grid is not None:
            self.tracker.log_image("val/teacher_vs_student", self.state.step, grid,
                                   caption="teacher | student, one row per held-out trajectory")

    def save_checkpoint(self) -> None:
        rng = all_gather_bytes(json.dumps(checkpoint.rng_state()).encode(), self.device)
        if self.env.is_main:
            self.tracker.flush()  # before the checkpoint: what it covers is on disk, so a resume leaves no gap
        state = asdict(self.state) | {"rng": [json.loads(r) for r in rng], "world_size": self.env.world_size,
                                      "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else None,
                                      "strategy": self.strategy.name, "total": self.total,  # (the run's length)
                                      "extra": self.identity.to_json()}
        # every rank: ddp's rank 0 writes the whole checkpoint, under fsdp each rank its shards
        ema = dict(zip((k for k, _ in trained_parameters(self.model)), self.ema.shadow_params)) if self.ema else None
        self.strategy.save_checkpoint(self.out, self.state.step, ema, self.optimizer, state, self.cfg.keep_checkpoints)
        if self.env.is_main:
            plot_losses(self.out)
        barrier(self.device)
        self.checkpointed = self.state.step

    def stop(self) -> None:
        """A SIGTERM reached some rank: every rank writes this step's checkpoint (unless it just did) and raises the
        same `Terminated`, so the rerun with --resume loses no optimizer step."""
        step = self.state.step
        if self.checkpointed != step:
            self.save_checkpoint()
        err = signals.Terminated(f"terminated (SIGTERM) at step {step} of {self.total}; checkpoint "
                                 f"{checkpoint.step_dirname(step)} written; rerun the same command with --resume "
                                 "to continue")
        err.all_ranks = True  # every rank stops here alike: rank 0 alone prints it
        raise err

    def nonfinite_error(self, loss: float, bad: str | None) -> UserError:
        """Why the loss of the step being taken is not finite, in one line every rank raises alike: a NaN or infinity
        in the batch (any rank's: gathered) is the cache's, else the training diverged."""
        found = [s.decode() for s in all_gather_bytes((bad or "").encode(), self.device)]
        where, step, caches = next((s for s in found if s), None), self.state.step + 1, list(self.cfg.cache)
        if where is not None:
            verify = (f"`wandistiller cache verify {caches[0]}`" if len(caches) == 1 else
                      f"`wandistiller cache verify` on each of {', '.join(map(str, caches))}")
            err = UserError(f"loss became {loss} at step {step}: its batch holds {where}, so the cache does, not "
                            f"the training; run {verify} (a cache that verifies was written so by stage one: rebuild "
                            "it, e.g. with --dtype bfloat16 rather than float16)")
        else:
            err = UserError(f"loss became {loss} at step {step} with finite inputs (every cached tensor and prompt "
                            f"embedding of the batch is finite): the training diverged; lower --lr (now "
                            f"{self.cfg.lr:g}) or raise --warmup-steps, keep --max-grad-norm on, and rerun (with "
                            "--resume to continue from the last checkpoint)")
        err.all_ranks = True  # every rank raises it at the same step: rank 0 alone prints it
        return err

    def step(self, loader_iter, epoch_step: int) -> tuple[float, float, int, dict[str, float]]:
        """One optimizer step; returns (mean loss over all ranks' samples, grad norm, samples, mean of each term)."""
        cfg, plan = self.cfg, self.plan
        count = plan.step_samples(epoch_step)
        micros = plan.micro_range(epoch_step)
        loss_sum = torch.zeros((), dtype=torch.float64)
        term_sums: dict[str, torch.Tensor] = {}
        bad, looked = None, False  # the first non-finite input of this rank's micro-batches, once a loss is not
        for j, _ in enumerate(micros):
            t_wait = time.perf_counter()
            batch = next(loader_iter)
            self.data_wait_s += time.perf_counter() - t_wait  # blocked on the loader, not computing
            if self.debug_dir:
                self.trained_keys.append(batch["keys"])
            b = to_batch(batch, self.device, self.rule)
            with self.strategy.accumulate(j == len(micros) - 1):
                per, terms = self.objective.loss(self.ddp or self.model, b, self.autocast, self.heads)
                weighted = (per * b.weight).sum()
                self.scaler.scale(weighted * (self.env.world_size / count)).backward()
            loss_sum += weighted.detach().double().cpu()
            if not looked and not math.isfinite(loss_sum):
                bad, looked = nonfinite_input(b, batch["keys"]), True
            if len(terms) > 1:
                for name, t in terms.items():
                    term_sums[name] = term_sums.get(name, 0) + (t.detach() * b.weight).sum().double().cpu()
        self.strategy.reduce_gradients()
        self.scaler.unscale_(self.optimizer)
        grad_norm = self.strategy.clip_grad_norm(self.params, cfg.max_grad_norm if cfg.max_grad_norm > 0 else math.inf)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        if self.ema is not None:
            self.ema.step([p for _, p in trained_parameters(self.model)])
        loss = all_reduce(loss_sum, self.device).item() / count
        if not math.isfinite(loss) and not self.scaler.is_enabled():  # fp16: the scaler skips such steps
            raise self.nonfinite_error(loss, bad)
        terms = {}
        if term_sums:
            names = sorted(term_sums)
            sums = all_reduce(torch.stack([term_sums[n] for n in names]), self.device)
            terms = {n: float(v) / count for n, v in zip(names, sums)}
        return loss, float(grad_norm), count, terms

    def fit(self) -> TrainState:
        """Train from the current state to `total` steps; a fresh run evaluates and validates first, every run last,
        then checkpoints its last step (with checkpoints on), so that `--resume` of it finds the run finished, or,
        given more steps, goes on from there. Resumed from that checkpoint, nothing is left but the saving."""
        st = self.state
        ended = st.step >= self.total  # resumed from the last step's checkpoint (its student/ not yet in place)
        if st.step == 0:
            self.log_eval()
            self.validate()
        bar = progress_bar(total=self.total, initial=st.step, desc="train-student", unit="step", dynamic_ncols=True,
                           disable=not self.env.is_main)
        pace = _Pace(t_start=time.time() - st.wall_s)
        try:
            while st.step < self.total:
                self._fit_epoch(bar, pace)
        except BaseException:
            bar.close()  # end the bar's line so the error message starts on its own
            self.close_logs(failed=True)
            raise
        bar.close()
        try:
            if not ended:  # (as at every step boundary: evaluation, validation, then the checkpoint)
                self.log_eval()
                if self.cfg.val_every:
                    self.validate()
                if self.cfg.checkpoint_every and self.checkpointed != st.step:
                    self.save_checkpoint()
        finally:
            self.close_logs()
        return st

    def _fit_epoch(self, bar, pace: _Pace) -> None:
        """The steps left in the current epoch (up to `total`), from its exact position; then the next epoch."""
        cfg, st, env = self.cfg, self.state, self.env
        sampler = RankBatches(self.plan, self.data.train_rows, cfg.seed, st.epoch, env.rank, st.epoch_step)
        loader = make_loader(self.dataset, sampler, cfg.num_workers, self.device.type == "cuda")
        with signals.held():  # its workers start with SIGTERM held, until they ignore it (data.make_loader)
            it = iter(loader)
        while st.epoch_step < self.plan.steps and st.step < self.total:
            maybe_fail(env.rank, st.step + 1)
            fault_point("train_step")
            lr = lr_at(st.step, self.total, cfg.lr, cfg.warmup_steps, cfg.min_lr_ratio)  # this step's, scheduled
            for g in self.optimizer.param_groups:
                g["lr"] = lr
            t0 = time.time()
            self.data_wait_s = 0.0
            loss, grad_norm, count, terms = self.step(it, st.epoch_step)
            pace.add(count, time.time() - t0, self.data_wait_s)
            st.step += 1
            st.epoch_step += 1
            st.samples += count
            st.wall_s = time.time() - pace.t_start
            self._log_step(bar, pace, loss, lr, grad_norm, terms)
            self._at_step_boundary()
        del it, loader  # stops the workers of this epoch
        if st.epoch_step >= self.plan.steps:
            st.epoch += 1
            st.epoch_step = 0

    def _log_step(self, bar, pace: _Pace, loss: float, lr: float, grad_norm: float, terms: dict[str, float]) -> None:
        """The metrics line every `log_every` steps (and at the last), and the progress bar after every step."""
        cfg, st = self.cfg, self.state
        if st.step % cfg.log_every == 0 or st.step == self.total:
            self.log({"type": "train", "step": st.step, "epoch": st.epoch, "loss": loss, "lr": lr,
                      "grad_norm": grad_norm, "samples": st.samples, "samples_per_s": pace.rate,
                      "wall_s": round(st.wall_s, 3), "data_wait_frac": pace.wait_s / max(pace.step_s, 1e-9),
                      "peak_mem_gib": peak_memory_gib(self.device),
                      **{f"loss_{k}": v for k, v in terms.items()}})
            pace.wait_s = pace.step_s = 0.0
        post = {"loss": f"{loss:.4f}", "samples/s": f"{pace.rate:.1f}", "epoch": st.epoch}
        if self.last_eval is not None:
            post["heldout"] = f"{self.last_eval:.4f}"
        bar.set_postfix(post, refresh=False)
        bar.update(1)

    def _at_step_boundary(self) -> None:
        """What is due between two steps: evaluation, validation, a checkpoint, and the stop a SIGTERM asks for.
        None of it after the last step, where fit's own ending takes over."""
        cfg, step = self.cfg, self.state.step
        if step >= self.total:
            return
        if cfg.eval_every and step % cfg.eval_every == 0:
            self.log_eval()
        if cfg.val_every and step % cfg.val_every == 0:
            self.validate()
        if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
            self.save_checkpoint()
        if signals.agree(self.device):  # any rank's SIGTERM (one collective a step: all ranks stop at this one)
            self.stop()

    def write_debug(self, param_sha: str) -> None:
        if not self.debug_dir:
            return
        record = {"rank": self.env.rank, "world": self.env.world_size, "micro_batches": self.trained_keys,
                  "steps": self.state.step, "param_sha256": param_sha}
        safe_write.write_json(safe_write.ensure_folder(self.debug_dir, DEBUG_DIR_ENV) / f"rank-{self.env.rank}.json",
                              record, indent=None)


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory so far: CUDA memory allocated on `device`, or on the CPU this process's peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


METRICS_LINE_BYTES = 1 << 20  # a metrics line is a few hundred bytes; one past this is no line of ours


def metric_lines(out: Path) -> list[tuple[str, dict | None]]:
    """Each line of OUT/metrics.jsonl (opened by `safe_open`: no link followed, CAPS["metrics"] in all, a line at a
    time) with its record, None where the line is no JSON object (one torn by a crash or a full disk); [] without
    the file."""
    path = RunLayout(out).metrics
    fix = f"remove {path} (a run's metrics are not needed to resume it)"
    try:
        fd = safe_open.open_fd(out, METRICS, fix)
    except FileNotFoundError:
        return []
    lines = []
    with os.fdopen(fd, "rb") as f:
        if (size := os.fstat(fd).st_size) > safe_open.CAPS["metrics"]:
            raise UnsafeFileError(f"{path} is {size:,} bytes, more than a run's metrics hold; {fix}")
        while raw := f.readline(METRICS_LINE_BYTES + 1):
            if len(raw) > METRICS_LINE_BYTES:
                raise UnsafeFileError(f"{path} holds a line longer than {METRICS_LINE_BYTES:,} bytes; {fix}")
            line = raw.decode(errors="replace").rstrip("\n")
            try:
                record = safe_open.parse_json(line, path)
            except UnsafeFileError:
                record = None
            if line.strip():
                lines.append((line, record if isinstance(record, dict) else None))
    return lines


def truncate_metrics(out: Path, step: int) -> None:
    """Drop metrics past `step` (written after the checkpoint a run resumes from), and torn lines."""
    if not (lines := metric_lines(out)):
        return
    keep = [line for line, r in lines if r is not None and type(r.get("step")) in (int, float) and r["step"] <= step]
    atomic_write_bytes(RunLayout(out).metrics, "".join(line + "\n" for line in keep).encode())  # (a kill: not emptied)


def plot_losses(out: Path) -> None:
    """OUT/loss.png: training loss per logged step and held-out loss, log scale."""
    records = [r for _, r in metric_lines(out) if r is not None]  # validation records ("val") are skipped
    if not records:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def points(kind: str, key: str) -> list:
        return [(r["step"], r[key]) for r in records if r.get("type") == kind
                and all(type(r.get(k)) in (int, float) for k in ("step", key))]

    train, held = points("train", "loss"), points("eval", "heldout_loss")
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    if train:
        ax.plot(*np.asarray(train).T, label="train loss", lw=1)
    if held:
        ax.plot(*np.asarray(held).T, "o-", label="held-out loss", ms=3)
    ax.set(xlabel="optimizer step", ylabel="MSE to cached target", yscale="log")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    safe_write.write_file(RunLayout(out).loss_png, writer=lambda f: fig.savefig(f, format="png"))
    plt.close(fig)
