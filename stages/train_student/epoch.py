"""Stage two's epoch: the exact order of an epoch's samples over the ranks, and its batches
(docs/architecture.md "The epoch order")."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from torch.utils.data import Sampler

from cache.reader import C_CACHE, C_META_OFF, C_PROMPT, C_TENS_LEN, C_TENS_OFF, CacheIndex

from .index import DataSplit

# Lanes of a grouped epoch's window (`EpochPlan.windows`): a multiple of every world size up to 64 that is a power
# of two, so that each rank of such a run reads only its own lanes, whole (runs of samples adjacent on disk).
LANES = 64


@dataclass(frozen=True)
class EpochPlan:
    """The exact partition of an epoch of `n` samples over `world` ranks (docs/architecture.md "The epoch order")."""

    n: int
    world: int
    batch: int  # per rank per micro-step
    accum: int = 1
    # A grouped order (`window` > 0; `order`): each position's group (a run of samples that lie together on disk:
    # stage two's read groups), and the groups per window.
    groups: np.ndarray | None = field(default=None, repr=False, compare=False)
    window: int = 0

    def __post_init__(self):
        if self.n < 1 or self.world < 1 or self.batch < 1 or self.accum < 1 or self.window < 0:
            raise ValueError(f"EpochPlan needs positive sizes, got {self}")
        if self.window and (self.groups is None or len(self.groups) != self.n):
            raise ValueError(f"a grouped EpochPlan needs a group for each of its {self.n} positions")

    @property
    def global_batch(self) -> int:
        return self.batch * self.world

    @property
    def micro_steps(self) -> int:
        return math.ceil(self.n / self.global_batch)

    @property
    def steps(self) -> int:
        """Optimizer steps per epoch (equal on every rank)."""
        return math.ceil(self.micro_steps / self.accum)

    def order(self, seed: int, epoch: int) -> np.ndarray:
        """The epoch's permutation of 0..n-1: a function of (seed, epoch) only (and of the groups, if grouped)."""
        return self.windows(seed, epoch)[0]

    def windows(self, seed: int, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(the epoch's permutation, the first position of each window; [0] for a shuffled epoch). Grouped: the
        groups in a seeded random order, cut into windows of `window` groups, each served by LANES lanes."""
        seq = np.random.SeedSequence([int(seed), int(epoch), 0x57414E])  # "WAN": keeps it apart from other uses
        rng = np.random.Generator(np.random.PCG64(seq))
        if not self.window:
            return rng.permutation(self.n), np.zeros(1, dtype=np.int64)
        group = np.unique(self.groups, return_inverse=True)[1].reshape(-1)
        place = rng.permutation(int(group.max()) + 1)[group]  # where each position's group comes in the epoch
        win = place // self.window
        pieces = np.lexsort((np.arange(self.n), place))  # window after window, group after group, on-disk order
        win_of = win[pieces]  # non-decreasing: positions [starts[w], starts[w+1]) of the epoch are window w
        starts = np.flatnonzero(np.diff(win_of, prepend=-1))
        nw, lanes = len(starts), LANES
        pos = np.arange(self.n)
        w_out = np.repeat(np.arange(nw), np.diff(np.append(starts, self.n)))  # the window of each epoch position
        lane_out = pos % lanes
        count = np.bincount(w_out * lanes + lane_out, minlength=nw * lanes).reshape(nw, lanes)
        lane_at = np.argsort(rng.random((nw, lanes)), axis=1)  # [w, k]: the lane that gets piece k of window w
        sizes = np.take_along_axis(count, lane_at, axis=1)
        lane_in = np.repeat(lane_at.reshape(-1), sizes.reshape(-1))  # the lane of each entry of `pieces`
        src = np.lexsort((rng.random(self.n), lane_in, win_of))  # each window's lanes, each lane's piece shuffled
        dst = np.lexsort((pos, lane_out, w_out))  # each window's lanes, each lane's positions in order
        out = np.empty(self.n, dtype=np.int64)
        out[dst] = pieces[src]
        return out, starts.astype(np.int64)

    def micro_range(self, step: int) -> range:
        """Micro-steps of optimizer step `step` (0-based within the epoch)."""
        return range(step * self.accum, min((step + 1) * self.accum, self.micro_steps))

    def positions(self, micro: int, rank: int) -> np.ndarray:
        """Positions of the permutation that `rank` takes at micro-step `micro` (may be empty)."""
        lo, hi = micro * self.global_batch, min((micro + 1) * self.global_batch, self.n)
        return np.arange(lo + rank, hi, self.world)

    def step_samples(self, step: int) -> int:
        """Samples of optimizer step `step` over all ranks: the loss denominator of that step."""
        r = self.micro_range(step)
        return min(r.stop * self.global_batch, self.n) - r.start * self.global_batch


# Prompts per read group of a grouped epoch (`read_groups`): consecutive rows of one prompt store, whose
# trajectories stage one writes one after the other into a shard and whose embeddings lie one after the other in
# one file of the store (ROWS_PER_FILE is a multiple); at A14B sizes and 3 steps, ~19 MB of samples and ~13 MB of
# embeddings a group.
GROUP_PROMPTS = 16
# Bytes of samples a grouped epoch's window holds at most (`order_window`): its prompts' embeddings stay in the LRU
# while they are read. A window of A14B samples at 3 steps: ~660 samples, ~210 prompts, 64 lanes of ~10 samples.
READ_WINDOW_BYTES = 256 << 20


def group_prompts(embedding_cache_size: int) -> int:
    """Prompts per read group: GROUP_PROMPTS, fewer where half the embedding LRU holds fewer (a window holds
    whole groups, and at most half the LRU's prompts)."""
    return max(1, min(GROUP_PROMPTS, embedding_cache_size // 2))


def read_groups(index: CacheIndex, rows: np.ndarray, prompts: int = GROUP_PROMPTS) -> np.ndarray:
    """The read group of each of `rows` for a grouped epoch order: `prompts` consecutive rows of one prompt store
    (a part of a cache), whose samples lie together in a shard and whose embeddings lie together in a file."""
    t = index.table[rows]
    parts = np.asarray([int(c.manifest.num_parts) for c in index.caches], dtype=np.int64)[t[:, C_CACHE]]
    store_row = t[:, C_PROMPT] // parts  # format.prompt_location: prompt i is row i // num_parts of part i % num_parts
    width = int(store_row.max(initial=0)) // prompts + 1
    return (t[:, C_CACHE] * int(parts.max(initial=1)) + t[:, C_PROMPT] % parts) * width + store_row // prompts


def order_window(order: str, index: CacheIndex, rows: np.ndarray,
                 embedding_cache_size: int) -> tuple[int, np.ndarray | None]:
    """(The EpochPlan window of `order` over `rows`, the `read_groups` it was counted from): (0, None) for a shuffled
    epoch, else the read groups per window (at most half the embedding LRU's prompts, so every prompt of a window
    stays in memory with room for the next window's, and READ_WINDOW_BYTES of samples; at least one group)."""
    t = index.table[rows]
    n_prompts = len(np.unique(t[:, [C_CACHE, C_PROMPT]], axis=0)) if len(rows) else 0
    if order == "shuffle" or (order == "auto" and n_prompts <= embedding_cache_size):
        return 0, None
    per = group_prompts(embedding_cache_size)
    groups = read_groups(index, rows, per)
    n_groups = len(np.unique(groups))
    group_bytes = float(np.sum(t[:, C_TENS_OFF] + t[:, C_TENS_LEN] - t[:, C_META_OFF])) / max(n_groups, 1)
    by_prompts = (embedding_cache_size // 2) // per  # (groups of `per` prompts; a store's last group may hold fewer)
    return max(1, min(by_prompts, int(READ_WINDOW_BYTES // max(group_bytes, 1.0)))), groups


def epoch_plan(data: DataSplit, world: int, batch: int, accum: int, order: str,
               embedding_cache_size: int) -> EpochPlan:
    """train-student's plan of an epoch over `data`'s training rows, in `order` (`order_window`)."""
    window, groups = order_window(order, data.index, data.train_rows, embedding_cache_size)
    return EpochPlan(len(data.train_rows), world, batch, accum, groups, window)


def order_identity(plan: EpochPlan, embedding_cache_size: int) -> dict | None:
    """What a grouped epoch's order depends on beyond (seed, epoch, data), for the run's identity (a resume with
    another order is refused); None for a shuffled one."""
    return {"grouped": plan.window, "group_prompts": group_prompts(embedding_cache_size), "lanes": LANES} \
        if plan.window else None


class RankBatches(Sampler):
    """Batch sampler: this rank's micro-batches of one epoch, from optimizer step `start_step` on; an empty share of
    a micro-step (only in an epoch's last window) is one zero-weight sample, so the rank still joins the collectives."""

    def __init__(self, plan: EpochPlan, rows: np.ndarray, seed: int, epoch: int, rank: int, start_step: int = 0):
        self.plan, self.rows, self.seed, self.epoch, self.rank = plan, rows, seed, epoch, rank
        self.start_step = start_step

    def __iter__(self):
        perm = self.plan.order(self.seed, self.epoch)
        for step in range(self.start_step, self.plan.steps):
            for micro in self.plan.micro_range(step):
                pos = self.plan.positions(micro, self.rank)
                yield [(int(self.rows[perm[p]]), 1.0) for p in pos] if len(pos) else [(int(self.rows[perm[0]]), 0.0)]

    def __len__(self) -> int:
        return sum(len(self.plan.micro_range(s)) for s in range(self.start_step, self.plan.steps))


def eval_batches(rows: np.ndarray, rank: int, world: int, batch: int) -> list[list[tuple[int, float]]]:
    """This rank's share of the held-out rows (positions rank, rank+W, ...), in batches."""
    mine = rows[rank::world]
    return [[(int(r), 1.0) for r in mine[i:i + batch]] for i in range(0, len(mine), batch)]
