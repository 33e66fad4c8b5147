"""The inputs every scenario shares: a tiny teacher, a prompt set, and the uninterrupted results (one
reference cache, one reference training run) that every faulted run is compared with."""

from __future__ import annotations

import functools
import itertools
import json
from pathlib import Path

from .check import read_samples
from .proc import ROOT, Result, run_cli

# Tiny sizes: 24 prompts x 2 steps = 48 samples; 2 trajectories a block, one block (4 samples) a shard:
# 12 shards, so a dozen kills each land in a different shard. Two seconds for the whole cache on a CPU.
STAGE_ONE = dict(placement="cpu", steps=2, guidance=4.0, height=64, width=64, max_sequence_length=32,
                 negative_prompt="blurry, low quality", batch_size=2, samples_per_shard=4)
N_PROMPTS = 24
STUDENT_CONFIG = ROOT / "configs" / "student-tiny.json"
# 48 samples, batch 4: 12 steps an epoch; 16 steps cross into the second epoch; a checkpoint every 3 steps.
TRAIN = dict(max_steps=16, batch_size=4, lr=1e-3, warmup_steps=2, ema_decay=0.9, checkpoint_every=3,
             keep_checkpoints=2, eval_every=0, log_every=1, num_workers=0, seed=3, device="cpu")

COLOURS = ["red", "green", "blue", "yellow", "purple", "orange"]
SHAPES = ["circle", "square", "triangle", "star"]


def flags(**kw) -> list[str]:
    out = []
    for k, v in kw.items():
        out += [f"--{k.replace('_', '-')}", str(v)]
    return out


class Workspace:
    """Everything below `root`; the references are built on first use and then shared."""

    def __init__(self, root: Path, teacher: Path | None = None):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._teacher = teacher
        self._names = itertools.count()
        self.prompts = self.root / "prompts.txt"
        self.prompts.write_text("\n".join(f"a {c} {s} on a {COLOURS[(i + 2) % 6]} background" for i, (c, s) in
                                          enumerate(itertools.product(COLOURS, SHAPES))) + "\n")

    def fresh(self, name: str) -> Path:
        """A new, not yet existing path below the workspace."""
        return self.root / f"{name}-{next(self._names)}"

    @functools.cached_property
    def teacher(self) -> Path:
        if self._teacher is not None:
            return Path(self._teacher)
        out = self.root / "tiny-teacher"
        self.must(run_cli(["tiny-teacher", "--out", out, "--variant", "wan2.2"]))
        return out

    def stage_one(self, out: Path, **over) -> list[str]:
        return ["teacher-cache", "--teacher", self.teacher, "--prompts", self.prompts, "--out", out,
                *flags(**(STAGE_ONE | over))]

    def train(self, out: Path, cache: Path | None = None, **over) -> list[str]:
        return ["train-student", "--cache", cache or self.ref_cache, "--student-config", STUDENT_CONFIG,
                "--out", out, *flags(**(TRAIN | over))]

    @staticmethod
    def must(r: Result) -> Result:
        if r.code != 0:
            raise RuntimeError(f"a reference run failed: {r.describe()}")
        return r

    @functools.cached_property
    def ref_cache(self) -> Path:
        out = self.root / "ref-cache"
        self.ref_cache_wall_s = self.must(run_cli(self.stage_one(out))).wall_s
        return out

    @functools.cached_property
    def ref_samples(self) -> dict:
        samples, dup = read_samples(self.ref_cache)
        assert len(samples) == N_PROMPTS * STAGE_ONE["steps"] and not dup, "the reference cache is wrong"
        return samples

    @functools.cached_property
    def ref_run(self) -> Path:
        """An uninterrupted training run; its debug record lists every micro-batch it trained on."""
        out = self.root / "ref-run"
        r = self.must(run_cli(self.train(out), env={"WANDISTILLER_DEBUG_DIR": str(out / "debug")}))
        self.ref_run_wall_s = r.wall_s
        return out

    @functools.cached_property
    def ref_batches(self) -> list[list[str]]:
        return json.loads((self.ref_run / "debug" / "rank-0.json").read_text())["micro_batches"]
