"""The trajectory loop's two halves: running windows of blocks through the experts, and packing finished blocks into
shards in the writer thread; and stage one's progress figures (bar, log line per shard, TensorBoard scalars)."""

from __future__ import annotations

import concurrent.futures as cf
import time
from functools import partial
from pathlib import Path

import torch

from cache import format as F
from cache.atomic import fsync_paths
from cache.part_progress import PartProgress
from cache.prompt_store import damaged_part, write_latent_rows
from cache.records import ShardRecord
from cache.size import human
from cache.writer import ShardWriter
from pipeline import signals
from pipeline.faults import fault_point
from pipeline.runtime import print0

from .outdir import next_shard_index
from .trajectory import StepRecord, TrajectoryRunner

# Expert-major order holds a window of blocks' records in RAM until the low-noise expert has run them;
# the window is as many blocks as fit in this budget (at least one).
EXPERT_MAJOR_RECORD_BUDGET = 2 * 2**30


def expert_window(batch_size: int, steps: int, latent_numel: int, dtype_bytes: int, keep_cond_uncond: bool) -> int:
    """Blocks run together in expert-major order: as many as keep their records within the budget."""
    per_block = batch_size * steps * latent_numel * dtype_bytes * (4 if keep_cond_uncond else 2)
    return max(1, EXPERT_MAJOR_RECORD_BUDGET // max(per_block, 1))


class StageOneProgress:
    """Fed by the writer thread (`block`, `shard`); projects the cache from the bytes per sample so far."""

    def __init__(self, bar, *, part: int, steps: int, seeds: int, cache_samples: int, shards: list[ShardRecord],
                 tensorboard_dir=None):
        self.bar, self.part, self.steps, self.seeds = bar, part, steps, seeds
        self.cache_samples = cache_samples  # samples of the whole cache (every part)
        self.bytes = sum(s.bytes for s in shards)
        self.samples_written = sum(s.samples for s in shards)
        self.samples_run = 0  # by this run, written to a shard or not yet
        self.t0 = time.perf_counter()
        self.writer = None
        if tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(tensorboard_dir), purge_step=self.samples_written)

    @property
    def projected(self) -> float | None:
        return self.bytes / self.samples_written * self.cache_samples if self.samples_written else None

    def figures(self) -> dict[str, float]:
        """The figures so far, set on the bar at every block and shard (else a one-shard part's bar ends on
        `written=0 B`)."""
        dt = max(time.perf_counter() - self.t0, 1e-9)
        out = {"samples_per_s": self.samples_run / dt, "prompts_per_s": self.samples_run / self.steps / self.seeds / dt,
               "bytes_written": float(self.bytes)}
        post = {"prompts/s": f"{out['prompts_per_s']:.2f}", "written": human(self.bytes)}
        if self.projected is not None:
            out["projected_cache_bytes"] = self.projected
            post["cache"] = "~" + human(self.projected)
        if self.bar.total:
            left = self.bar.total - self.bar.n
            out["eta_s"] = left / out["samples_per_s"] if out["samples_per_s"] > 0 else float("nan")
        self.bar.set_postfix(post, refresh=False)
        return out

    def exclude(self, seconds: float) -> None:
        """Leave `seconds` (a compile warm-up) out of the rates and the ETA."""
        self.t0 += seconds
        if hasattr(self.bar, "start_t"):  # (a disabled bar has no clock)
            self.bar.start_t += seconds

    def block(self, samples: int) -> None:
        """A block's samples were packed into the open shard."""
        self.samples_run += samples
        self.bar.update(samples)
        self.figures()

    def shard(self, record: ShardRecord) -> None:
        """A shard was renamed into place and recorded."""
        self.bytes += record.bytes
        self.samples_written += record.samples
        f = self.figures()
        eta = f.get("eta_s")
        print0(f"part {self.part}: {record.path} written ({record.samples} samples, "
               f"{human(record.bytes)}); {human(self.bytes)} so far, cache ~{human(self.projected)}, "
               f"{f['prompts_per_s']:.2f} prompts/s, {f['samples_per_s']:.1f} samples/s"
               + (f", ETA {eta / 60:.1f} min" if eta is not None and eta == eta else ""))
        if self.writer is not None:
            for k, v in f.items():
                if v == v:  # NaN is left out
                    self.writer.add_scalar(f"teacher_cache/{k}", v, self.samples_written)
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class BlockSink:
    """Runs in the writer thread: per shard, rename the tar into place (fsynced), write and fsync its final latents,
    rewrite progress.json (a crash before the last: the blocks rerun). The last two (the commit) run in a thread of
    their own, one at a time, in shard order (docs/architecture.md, "Write path")."""

    def __init__(self, out: Path, prog: PartProgress, store, samples_per_shard: int, num_parts: int,
                 progress: StageOneProgress):
        self.out, self.prog, self.store, self.progress = out, prog, store, progress
        self.samples_per_shard, self.num_parts = samples_per_shard, num_parts
        self.writer: ShardWriter | None = None
        self.next_index = next_shard_index(prog)  # kept here: the commit in flight has not recorded its shard yet
        self.pending: list[tuple[int, list[tuple[int, int]], torch.Tensor]] = []
        self._committer = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-commit")
        self._commit: cf.Future | None = None

    def add(self, block: int, traj: list[tuple[int, int]], records: list[StepRecord], final: torch.Tensor) -> None:
        if self._commit is not None and self._commit.done():
            self._wait_commit()  # an error of the last commit stops the run here, not a shard later
        if self.writer is None:
            self.writer = ShardWriter(self.out, self.prog.part, self.next_index)
            self.next_index += 1
        try:
            for rec in records:
                fields = [(F.T_X_T, rec.x_t), (F.T_TARGET, rec.target), (F.T_TARGET_COND, rec.target_cond),
                          (F.T_TARGET_UNCOND, rec.target_uncond), (F.T_FEATURES, rec.features)]
                for j, (p, s) in enumerate(traj):
                    tensors = {k: v[j] for k, v in fields if v is not None}  # the fields the cache records
                    meta = {F.M_PROMPT_IDX: p, F.M_SEED_IDX: s, F.M_STEP: rec.step, F.M_TIMESTEP: rec.timestep,
                            F.M_SIGMA: rec.sigma, F.M_EXPERT: rec.expert, F.M_GUIDANCE: rec.guidance}
                    self.writer.write(F.sample_key(p, s, rec.step), tensors, meta)
            fault_point("mid_shard")
        except BaseException:
            self.writer.abort()
            self.writer = None
            self.pending = []
            raise
        self.pending.append((block, traj, final))
        self.progress.block(len(records) * len(traj))
        if self.writer.samples >= self.samples_per_shard:
            self.flush(wait=False)

    def flush(self, wait: bool = True) -> None:
        """Close the shard in progress and commit it; `wait`: return once every commit is done (the last shard)."""
        if self.writer is not None:
            record = self.writer.close(sorted(b for b, _, _ in self.pending))
            self.writer = None
            fault_point("after_rename")
            pending, self.pending = self.pending, []
            self._wait_commit()  # one commit in flight at a time, in shard order
            self._commit = self._committer.submit(self._commit_shard, record, pending)
        if wait:
            self._wait_commit()

    def _wait_commit(self) -> None:
        commit, self._commit = self._commit, None
        if commit is not None:
            commit.result()

    def _commit_shard(self, record: ShardRecord, pending: list[tuple[int, list[tuple[int, int]], torch.Tensor]]) -> None:
        traj = [t for _, block_traj, _ in pending for t in block_traj]
        try:  # one call for the shard's blocks: each prompt-store file written once (a row shared with an earlier
            # block, or a file holding earlier rows, is read back first: its chunks are checked then)
            written = write_latent_rows(self.store, F.Z_FINAL_LATENTS, [p // self.num_parts for p, _ in traj],
                                        [s for _, s in traj], torch.cat([final for _, _, final in pending]))
        except ValueError as e:  # zarr's check of a chunk's crc32c, in a file of rows written before
            raise damaged_part(self.out, self.prog.part,
                               f"its prompt store's {F.Z_FINAL_LATENTS} do not read ({e})") from e
        fsync_paths(written)  # durable before the progress record calls their blocks done
        fault_point("before_progress")
        self.prog.shards.append(record)
        self.prog.done_blocks = sorted(set(self.prog.done_blocks) | {b for b, _, _ in pending})
        self.prog.save(self.out)
        self.progress.shard(record)

    def close(self) -> None:
        """After the last `flush`: end the commit thread."""
        self._committer.shutdown(wait=True)

    def abort(self) -> None:
        """After an error: drop the shard in progress; a commit in flight finishes (its shard is whole)."""
        if self.writer is not None:
            self.writer.abort()
            self.writer = None
        self._committer.shutdown(wait=True)


def denoise(runner: TrajectoryRunner, experts, phases, windows: list[list[int]], inputs, neg: torch.Tensor):
    """Yields (block, records, final latents) as each window of blocks finishes; phases [None]: step-major, [(1,),
    (2,)]: expert-major (same records). SIGTERM stops it after the step in progress or between windows."""
    def keep(record: StepRecord, into: list[StepRecord]) -> None:
        into.append(record)
        fault_point("denoise_step")
        signals.check()

    for window in windows:
        records: dict[int, list[StepRecord]] = {b: [] for b in window}
        states, finals = {}, {}
        for phase in phases:
            experts.activate(phase)
            for b in window:
                noise, cond, condition = inputs(b)
                finals[b], states[b] = runner.run(noise, cond, neg, on_step=partial(keep, into=records[b]),
                                                  experts=phase, state=states.get(b), condition=condition)
        yield from [(b, records[b], finals[b]) for b in window]
        signals.check()
