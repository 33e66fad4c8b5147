"""Where stage one is: prompts/s, samples/s, bytes written, the projected cache size (bytes per sample of the
shards so far times the cache's samples) and the ETA, on the progress bar, in one log line per shard, and
(`--report-to tensorboard`) as TensorBoard scalars under CACHE_DIR/parts/part-P/tensorboard.
"""

from __future__ import annotations

import time

from cache.records import ShardRecord
from cache.size import human
from pipeline.runtime import print0


class StageOneProgress:
    """Fed by the writer thread (`block`, `shard`); owns the bar's postfix and the optional event writer."""

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
        dt = max(time.perf_counter() - self.t0, 1e-9)
        out = {"samples_per_s": self.samples_run / dt, "prompts_per_s": self.samples_run / self.steps / self.seeds / dt,
               "bytes_written": float(self.bytes)}
        if self.projected is not None:
            out["projected_cache_bytes"] = self.projected
        if self.bar.total:
            left = self.bar.total - self.bar.n
            out["eta_s"] = left / out["samples_per_s"] if out["samples_per_s"] > 0 else float("nan")
        return out

    def block(self, samples: int) -> None:
        """A block's samples were packed into the open shard."""
        self.samples_run += samples
        self.bar.update(samples)
        self._postfix(self.figures())

    def _postfix(self, f: dict[str, float]) -> None:
        """The bar's figures, set again at every shard (else a part whose one shard closes after its last block ends
        its bar on `written=0 B`)."""
        post = {"prompts/s": f"{f['prompts_per_s']:.2f}", "written": human(f["bytes_written"])}
        if "projected_cache_bytes" in f:
            post["cache"] = "~" + human(f["projected_cache_bytes"])
        self.bar.set_postfix(post, refresh=False)

    def shard(self, record: ShardRecord) -> None:
        """A shard was renamed into place and recorded."""
        self.bytes += record.bytes
        self.samples_written += record.samples
        f = self.figures()
        self._postfix(f)
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
