"""`wandistiller eval`, the orchestration: `eval_setup.setup` (every check), then each metric family (eval_velocity,
eval_timing, eval_attributes), then the report (report.py): docs/architecture.md, "eval"."""

from __future__ import annotations

import dataclasses
import time

from tqdm.auto import tqdm

from cache.atomic import atomic_write_json
from cache.manifest import negative_embeds
from pipeline.config import EvalConfig
from pipeline.errors import UserError

from .eval_attributes import attribute_scores
from .eval_setup import REPORT_NAME, Entry, Setup, entries as make_entries, make_entry, setup
from .eval_timing import time_sampling
from .eval_velocity import final_latent_errors, velocity_errors
from .models import load_teacher, load_transformer
from .report import few_step_table, format_table, plot_report, summary_line

__all__ = ["REPORT_NAME", "run"]


def _against_teacher(cfg: EvalConfig, su: Setup, entries: list[Entry], neg) -> tuple[dict | None, dict | None]:
    """(timing, attributes), None where not asked. The teacher is loaded once, for both; with --attributes whole
    (text encoder and VAE), and the whole pipeline is timed too."""
    if not (cfg.teacher_timing or su.captions is not None):
        return None, None
    teacher = load_teacher(su.teacher_path, su.dtype, su.device, text=su.captions is not None,
                           vae=su.captions is not None)
    channels = int(su.manifest.latent_shape[0])  # a teacher whose latents are not the cache's is another model
    if int(teacher.transformer.config.in_channels) != channels:
        raise UserError(f"teacher {su.teacher_path} has {teacher.transformer.config.in_channels} latent channels, "
                        f"the cache {channels}: it is not the cache's teacher; pass the right --teacher")
    timing = None
    if cfg.teacher_timing:
        timing = time_sampling(su, entries, teacher, neg, cfg.timing_runs) | {"teacher_path": str(su.teacher_path)}
    attrs = attribute_scores(cfg, su, teacher, entries) if su.captions is not None else None
    return timing, attrs


def run(cfg: EvalConfig) -> dict:
    """Evaluate, write the JSON report and the plot next to it; returns the report."""
    t_start = time.time()
    su = setup(cfg)
    manifest = su.manifest
    for w in su.warnings:
        tqdm.write(f"warning: {w}")
    models = {"student": load_transformer(su.student, su.dtype, su.device)}
    models["untrained"], init_how = su.student.kind.untrained(su.student, cfg.init_seed, su.dtype, su.device)
    entries = make_entries(cfg, su, models["student"])
    # the untrained twin at the first entry's steps is the baseline
    untrained = make_entry("untrained", su.student, models["untrained"], manifest, entries[0].steps)
    velocity = velocity_errors(su, models, cfg.batch_size)
    neg = negative_embeds(su.cache_dir)[None]
    finals = final_latent_errors(su, [*entries, untrained], neg, cfg.batch_size)
    timing, attrs = _against_teacher(cfg, su, entries, neg)
    report = {
        "student": {**su.student.describe(), "init": init_how},
        "cache": {"path": str(su.cache_dir), "fingerprint": manifest.fingerprint, "teacher": manifest.teacher,
                  "steps": manifest.steps, "guidance": manifest.guidance, "cfg": su.manifest.cfg,
                  "in_training_cache": su.in_training},
        "selection": su.selection, "trajectories": len(su.trajs), "target": su.target_key,
        "student_guidance": entries[0].guidance,
        "velocity_mse": velocity, "final_latent_mse": finals, "timing": timing, "attributes": attrs,
        "entries": [e.describe() for e in entries], "table": None, "warnings": su.warnings,
        "device": str(su.device), "dtype": str(su.dtype).removeprefix("torch."),
        "wall_s": None, "config": dataclasses.asdict(cfg),
    }
    report["table"] = few_step_table(report)
    report["wall_s"] = round(time.time() - t_start, 2)
    su.report_path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(su.report_path, report)
    plot_path = su.report_path.with_suffix(".png")
    plot_report(report, plot_path)
    tqdm.write(summary_line(report, su.report_path, plot_path))
    tqdm.write(format_table(report["table"]))
    return report
