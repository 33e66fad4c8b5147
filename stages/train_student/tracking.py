"""Experiment trackers: the run's curves in TensorBoard or Weights & Biases, beside metrics.jsonl, on rank 0
(docs/usage.md "Watch a run" has the scalar names and how a resumed run continues its curve)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import time
from pathlib import Path

import numpy as np

from cache import safe_open
from cache.atomic import atomic_write_json
from pipeline.artifact import WANDB_RUN, RunLayout
from pipeline.errors import UserError, first_line
from pipeline.registries import TRACKERS

WANDB_EXTRA = 'pip install wandb (or the wandb extra, from the WanDistiller checkout: pip install -e ".[wandb]")'
WANDB_PROJECT = "wandistiller"  # when WANDB_PROJECT is not set


def require_backend(report_to: str) -> None:
    """Refuse, before anything slow, a tracker whose package is not installed (every rank alike)."""
    tracker = TRACKERS.get(report_to, "--report-to").load()
    if tracker.package and importlib.util.find_spec(tracker.package) is None:
        err = UserError(f"--report-to {report_to} needs the {tracker.package} package, which is not installed: "
                        f"{tracker.install} (or pass --report-to none)")
        err.all_ranks = True  # every rank raises it: rank 0 alone prints it
        raise err


def scalars(record: dict) -> dict[str, float]:
    """The scalars of a metrics.jsonl record: `type/key` for each number, `type/key/name` for a dict of numbers."""
    kind = record["type"]
    out: dict[str, float] = {}
    for key, value in record.items():
        if key in ("type", "step"):
            continue
        if isinstance(value, dict):
            out.update({f"{kind}/{key}/{k}": float(v) for k, v in value.items() if _number(v)})
        elif _number(value):
            out[f"{kind}/{key}"] = float(value)
    return out


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def hparams(config: dict) -> dict[str, int | float | str | bool]:
    """Flat hyperparameters both backends accept: lists and dicts as JSON text, None left out."""
    return {k: v if isinstance(v, (int, float, str, bool)) else json.dumps(v, default=str)
            for k, v in config.items() if v is not None}


class Tracker:
    """What the loop calls. The base class records nothing (every rank but 0, and --report-to none)."""

    name = "none"
    package, install = None, ""  # the package it needs, and how to install it

    def __init__(self, layout: RunLayout | None = None, config: dict | None = None, resume_step: int | None = None):
        """Opened by `open_tracker` with the run's folder, hyperparameters and checkpoint step."""

    def log(self, record: dict) -> None:
        """A metrics.jsonl record (with `type` and `step`)."""

    def log_image(self, tag: str, step: int, image: np.ndarray, caption: str = "") -> None:
        """An HxWx3 uint8 image."""

    def flush(self) -> None:
        """Everything logged so far on disk (called at each checkpoint, so a resume finds no gap)."""

    def close(self, failed: bool = False) -> None:
        """Flush and release the writer."""


def _wait_past_event_files(log_dir: Path, most_s: float = 2.0) -> None:
    """Return once this second is past the newest event file's in `log_dir` (at most `most_s`: a clock set back).
    TensorBoard reads event files in name order, which starts with the second a writer opened it: a file of the same
    second may sort first, and the earlier file's events are then read after the purge meant to hide them."""
    stamps = [int(p.name.split(".")[3]) for p in log_dir.glob("events.out.tfevents.*")
              if len(p.name.split(".")) > 3 and p.name.split(".")[3].isdigit()]
    deadline = time.monotonic() + most_s
    while stamps and int(time.time()) <= max(stamps) and time.monotonic() < deadline:
        time.sleep(0.02)


class TensorBoardTracker(Tracker):
    """Event files under OUT/tensorboard, written by torch's SummaryWriter."""

    name = "tensorboard"
    package, install = "tensorboard", "pip install tensorboard"

    def __init__(self, layout: RunLayout, config: dict, resume_step: int | None):
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams as hparams_summary

        # purge_step: TensorBoard drops the events of earlier files at or past this step. A fresh run (0)
        # hides a killed run's events that --resume could not continue; a resumed one (checkpoint + 1) hides
        # what was logged after its checkpoint, exactly as metrics.jsonl is truncated.
        purge = 0 if resume_step is None else resume_step + 1
        _wait_past_event_files(layout.tensorboard)
        self.writer = SummaryWriter(str(layout.tensorboard), purge_step=purge, flush_secs=30)
        # The hparams plugin's summaries go into this run's own event file (add_hparams would open a second run).
        metrics = {"eval/heldout_loss": 0.0, "val/final_latent_mse": 0.0, "train/loss": 0.0}
        for summary in hparams_summary(hparams(config), metrics):
            self.writer.file_writer.add_summary(summary)
        # At the step this process starts from: a resumed run's config (a raised --max-steps, say) shows beside
        # the first one's.
        self.writer.add_text("config", "```\n" + json.dumps(config, indent=2, default=str) + "\n```",
                             resume_step or 0)

    def log(self, record: dict) -> None:
        for tag, value in scalars(record).items():
            self.writer.add_scalar(tag, value, record["step"])

    def log_image(self, tag: str, step: int, image: np.ndarray, caption: str = "") -> None:
        self.writer.add_image(tag, image, step, dataformats="HWC")

    def flush(self) -> None:
        self.writer.flush()

    def close(self, failed: bool = False) -> None:
        self.writer.close()


class WandbTracker(Tracker):
    """A W&B run (WANDB_MODE says online, offline or disabled); a resume continues the id in OUT/wandb-run.json
    (W&B keeps the values first logged of steps a killed run logged past its checkpoint: only timings differ)."""

    name = "wandb"
    package, install = "wandb", WANDB_EXTRA

    def __init__(self, layout: RunLayout, config: dict, resume_step: int | None):
        import wandb

        self.wandb = wandb
        run_id = None  # W&B draws one
        if resume_step is not None:
            # No earlier W&B run, or a torn file, a link or a FIFO (never followed or waited on): W&B draws an id.
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                run_id = safe_open.read_json(layout.root, WANDB_RUN, "record", fix="remove it")["id"]
            if not (isinstance(run_id, str) and re.fullmatch(r"[A-Za-z0-9_-]{1,64}", run_id)):  # (a path: no id)
                run_id = None
        try:
            self.run = wandb.init(
                id=run_id, resume="allow" if run_id else None, config=config, name=layout.root.resolve().name,
                project=None if os.environ.get("WANDB_PROJECT") else WANDB_PROJECT,
                dir=None if os.environ.get("WANDB_DIR") else str(layout.root))
        except Exception as e:  # no login, no network, a bad entity: the user's to fix, in one line
            raise UserError(f"--report-to wandb: W&B could not start a run ({first_line(e)}); run `wandb login`, set "
                            "WANDB_MODE=offline to log without a network, or pass --report-to tensorboard") from e
        atomic_write_json(layout.wandb_run, {"id": self.run.id, "project": self.run.project,
                                             "dir": str(Path(self.run.dir).parent)})

    def log(self, record: dict) -> None:
        self.run.log(scalars(record), step=record["step"])

    def log_image(self, tag: str, step: int, image: np.ndarray, caption: str = "") -> None:
        self.run.log({tag: self.wandb.Image(image, caption=caption or None)}, step=step)

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)


def open_tracker(report_to: str, layout: RunLayout, *, config: dict, resume_step: int | None,
                 is_main: bool) -> Tracker:
    """The tracker of this rank: `report_to`'s on rank 0, one that records nothing elsewhere (`resume_step`: the
    checkpoint's step, None from step 0)."""
    if not is_main:
        return Tracker()
    require_backend(report_to)
    return TRACKERS[report_to].load()(layout, config, resume_step)
