"""`wandistiller eval`: `eval_setup.setup` (every check), then each metric family (eval_velocity, eval_timing,
eval_attributes), then the report and how it reads (the table that lines every student up against the teacher, the
one-line summary and the figure, all from the report's own fields): docs/architecture.md, "eval"."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from tqdm.auto import tqdm

from cache import safe_write
from cache.manifest import negative_embeds
from pipeline import teacher_lora
from pipeline.config import EvalConfig
from pipeline.errors import UserError

from .eval_attributes import attribute_scores
from .eval_setup import (REPORT_NAME, Setup, entries as make_entries, hybrid_entry, make_entry, other_student, setup,
                         teacher_entry)
from .eval_timing import time_sampling
from .eval_velocity import final_latent_errors, velocity_errors
from .models import load_teacher

__all__ = ["REPORT_NAME", "run"]
COLORS = {"student": "tab:blue", "untrained": "tab:gray", "teacher re-run": "tab:green"}


def _teacher(su: Setup):
    """The cache's teacher, loaded once when anything needs it (None otherwise): whole with --attributes or --motion
    (text encoder and VAE: it draws captions), an image-to-video cache's as WanImageToVideoPipeline."""
    if su.teacher_path is None:
        return None
    m = su.manifest
    loras = teacher_lora.recorded(m.teacher_loras, m.teacher_lora_paths, f"the cache {su.cache_dir}")
    teacher = load_teacher(su.teacher_path, su.dtype, su.device, text=su.captions is not None,
                           vae=su.captions is not None, image=su.images is not None, teacher_loras=loras)
    channels = int(su.manifest.in_channels)  # a teacher whose inputs are not the cache's is another model
    if int(teacher.transformer.config.in_channels) != channels:
        raise UserError(f"teacher {su.teacher_path} has {teacher.transformer.config.in_channels} input channels, "
                        f"the cache's {channels}: it is not the cache's teacher; pass the right --teacher")
    return teacher


def run(cfg: EvalConfig) -> dict:
    """Evaluate, write the JSON report and the plot next to it; returns the report."""
    t_start = time.time()
    su = setup(cfg)
    manifest = su.manifest
    for w in su.warnings:
        tqdm.write(f"warning: {w}")
    models = {"student": su.student.kind.load(su.student, su.dtype, su.device)}
    models["untrained"], init_how = su.student.kind.untrained(su.student, cfg.init_seed, su.dtype, su.device)
    entries = make_entries(cfg, su, models["student"])
    # the untrained twin at the first entry's steps is the baseline
    untrained = make_entry("untrained", su.student, models["untrained"], manifest, entries[0].steps)
    velocity = velocity_errors(su, models, cfg.batch_size)
    teacher = _teacher(su)
    entries += [teacher_entry(teacher, su.teacher_path, manifest, k) for k in cfg.teacher_redraw or ()]
    entries += [hybrid_entry(teacher, p, manifest, *other_student(cfg, su, p, "--hybrid"),
                             cfg.hybrid_steps) for p in cfg.hybrid]
    neg = negative_embeds(su.cache_dir)[None]
    finals = final_latent_errors(su, [*entries, untrained], neg, cfg.batch_size)
    timing = attrs = None  # (an image-to-video cache's teacher is timed only on --attributes' or --motion's images)
    if teacher is not None and cfg.teacher_timing:
        timing = time_sampling(su, entries, teacher, neg, cfg.timing_runs) | {"teacher_path": str(su.teacher_path)}
    if su.captions is not None:
        attrs = attribute_scores(cfg, su, teacher, entries)
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
    safe_write.write_json(su.report_path, report)
    plot_path = su.report_path.with_suffix(".png")
    plot_report(report, plot_path)
    tqdm.write(summary_line(report, su.report_path, plot_path))
    tqdm.write(format_table(report["table"]))
    return report


def few_step_table(report: dict) -> list[dict]:
    """One row for the teacher and one per entry: steps, forward passes, final-latent MSE, an image-to-video cache's
    first-frame MSE, attribute scores (`kept`: the paired share of the teacher's all-right clips or images the model
    draws all right too; `all_right_ratio`: the ratio of the two all-right rates, not paired), motion figures, times
    and speed-ups."""
    attrs, timing = report["attributes"], report["timing"]
    first = report["final_latent_mse"].get("first_frame")
    image = lambda name: {"first_frame_mse": first[name]} if first else {}  # noqa: E731

    def attr(name: str) -> dict:
        if not attrs:
            return {}
        a, out = attrs[name], {}
        if "motion_right" in a:  # a video eval: attributes per frame, then the motion checker's figures
            out = {"attribute_accuracy": (a["background"] + a["shape_colour"]) / 2, "shape_colour": a["shape_colour"],
                   "motion_right": a["motion_right"],
                   **{k: a["first_frame"][k] for k in ("first_frame_mad", "start_px") if "first_frame" in a}}
        elif "background" in a:
            out = {"attribute_accuracy": (a["background"] + a["shape_colour"] + a["position"]) / 3,
                   "shape_colour": a["shape_colour"], "position": a["position"]}
        if "all" in a:
            out |= {"all_right": a["all"], "all_right_interval": a.get("all_interval")}
        if "kept" in a:
            out |= {k: a[k] for k in ("kept", "kept_of", "kept_interval")}
            out["all_right_ratio"] = attrs["vs_teacher"][name]["all"]
        out |= {k: a[k] for k in ("speed_ratio", "flow_px", "flow_ratio", "flow_ratio_interval", "direction",
                                  "dynamic_degree", "dynamic_degree_interval", "flicker") if k in a}
        return out

    def times(name: str) -> dict:
        if not timing:
            return {}
        t = timing["teacher"] if name == "teacher" else timing["entries"][name]
        return {k: t.get(k) for k in ("denoise_s_per_image", "pipeline_s_per_image", "speedup_denoise",
                                      "speedup_pipeline") if k in t}

    steps, guidance = int(report["cache"]["steps"]), float(report["cache"]["guidance"])
    rows = [{"label": "teacher", "objective": None, "steps": steps, "guidance": guidance,
             "passes": steps * (2 if guidance > 1 else 1), "final_latent_mse": 0.0, **image("teacher"),
             **attr("teacher"), **times("teacher")}]
    moves = report["final_latent_mse"].get("latent_motion", {})
    for e in report["entries"]:
        rows.append({**e, "final_latent_mse": report["final_latent_mse"][e["label"]], **image(e["label"]),
                     **({"latent_motion": moves[e["label"]]} if moves else {}), **attr(e["label"]),
                     **times(e["label"])})
    return rows


def format_table(rows: list[dict]) -> str:
    """`few_step_table` as text, a line per model, `-` where a figure was not measured; a share with its 95%
    interval reads "97% (90-99)"."""
    def f(v, spec):
        return "-" if v is None else format(v, spec)

    def share(r: dict, key: str, spec: str = ".0%") -> str:
        ci = r.get(f"{key}_interval")
        return f(r.get(key), spec) + (f" ({format(ci[0], spec)}-{format(ci[1], spec)})".replace("%-", "-")
                                      if ci and r.get(key) is not None else "")

    cols = [("model", 24, lambda r: r["label"][:24]), ("steps", 5, lambda r: str(r["steps"])),
            ("passes", 6, lambda r: f(r.get("passes"), "d")),
            ("latent MSE", 10, lambda r: f(r["final_latent_mse"], ".4g"))]
    has = lambda k: any(k in r for r in rows)  # noqa: E731  (a column only where some model has the figure)
    cols += [("frame 0 MSE", 11, lambda r: f(r.get("first_frame_mse"), ".4g"))] * has("first_frame_mse")
    cols += [("attr acc", 8, lambda r: f(r.get("attribute_accuracy"), ".1%")),
             ("all right (95%)", 15, lambda r: share(r, "all_right")),
             ("kept (95%)", 14, lambda r: share(r, "kept"))] * has("all_right")
    cols += [("latent mv x", 11, lambda r: f(r.get("latent_motion"), ".2f"))] * has("latent_motion")
    cols += [("speed x", 7, lambda r: f(r.get("speed_ratio"), ".2f"))] * has("speed_ratio")
    cols += [("flow x (95%)", 16, lambda r: share(r, "flow_ratio", ".2f")),
             ("dyn deg", 7, lambda r: f(r.get("dynamic_degree"), ".0%")),
             ("flicker", 7, lambda r: f(r.get("flicker"), ".2f"))] * has("flicker")
    cols += [("frame 0 MAD", 11, lambda r: f(r.get("first_frame_mad"), ".2f")),
             ("start px", 8, lambda r: f(r.get("start_px"), ".2f"))] * has("first_frame_mad")
    cols += [("denoise s", 9, lambda r: f(r.get("denoise_s_per_image"), ".4f")),
             ("x faster", 8, lambda r: f(r.get("speedup_denoise"), ".1f")),
             ("pipeline s", 10, lambda r: f(r.get("pipeline_s_per_image"), ".4f")),
             ("x faster", 8, lambda r: f(r.get("speedup_pipeline"), ".1f"))]
    line = lambda cells: " ".join(c.ljust(w) if i == 0 else c.rjust(w)  # noqa: E731
                                  for i, (c, (_, w, _)) in enumerate(zip(cells, cols)))
    return "\n".join([line([name for name, _, _ in cols])] + [line([cell(r) for _, _, cell in cols]) for r in rows])


def summary_line(report: dict, report_path: Path, plot_path: Path) -> str:
    """The report in one line: the student's errors against the untrained twin's, its speed-up and attributes."""
    timing, attrs, velocity, finals = (report["timing"], report["attributes"], report["velocity_mse"],
                                       report["final_latent_mse"])
    speed = (f"; {timing['speedup']:.2f}x faster than the teacher ({timing['student_s_per_image']:.3f}s at "
             f"{finals['student_steps']} steps vs {timing['teacher_s_per_image']:.3f}s at {timing['steps']} steps "
             "per image)") if timing else ""
    kept, first = "", finals.get("first_frame")
    frame0 = (f"; frame-0 latent MSE against the image {first[report['entries'][0]['label']]:.4g} (teacher "
              f"{first['teacher']:.4g}, untrained {first['untrained']:.4g})") if first else ""
    s = attrs and attrs["student"]
    unit = "clips" if attrs and "frames" in attrs else "images"
    share = "" if not s or "kept" not in s else (
        f"n/a (the teacher drew no {unit[:-1]} all right)" if s["kept"] is None else
        f"{s['kept']:.1%} of the teacher's {s['kept_of']} all-right {unit} (95% interval "
        f"{s['kept_interval'][0]:.1%}-{s['kept_interval'][1]:.1%})")
    if attrs and "motion_right" in attrs["teacher"]:
        t = attrs["teacher"]
        ratio = "n/a" if s["speed_ratio"] is None else f"{s['speed_ratio']:.2f}"
        ff = lambda a: (f"{a['first_frame_mad']:.2f} levels, shape start "  # noqa: E731
                        + ("n/a" if a["start_px"] is None else f"{a['start_px']:.2f} px off"))
        given = (f"; frame 0 against the given image: teacher {ff(t['first_frame'])}, student "
                 f"{ff(s['first_frame'])}") if "first_frame" in t else ""
        kept = (f"; motion on {attrs['clips']} clips of {attrs['frames']} frames: motion right teacher "
                f"{t['motion_right']:.1%}, student {s['motion_right']:.1%}, kept {share}, speed ratio {ratio}"
                f"{given}")
    elif attrs and attrs["checked"]:
        t = attrs["teacher"]
        kept = (f"; attributes on {attrs['captions']} captions: colour accuracy teacher {t['colour']:.1%} (background "
                f"{t['background']:.1%}, shape {t['shape_colour']:.1%}), student {s['colour']:.1%} (background "
                f"{s['background']:.1%}, shape {s['shape_colour']:.1%}), kept {share}")
    if attrs and "flicker" in attrs["teacher"]:
        t, s = attrs["teacher"], attrs["student"]
        ci = s["flow_ratio_interval"]
        ratio = "n/a" if s["flow_ratio"] is None else f"{s['flow_ratio']:.2f}" + (
            f" (95% {ci[0]:.2f}-{ci[1]:.2f})" if ci else "")
        kept += (f"; optical flow on {attrs['clips']} clips: dynamic degree teacher {t['dynamic_degree']:.0%}, student "
                 f"{s['dynamic_degree']:.0%}, flow ratio {ratio}, flicker teacher {t['flicker']:.2f}, student "
                 f"{s['flicker']:.2f} levels")
    kept += f"; grid {attrs['grid']}" if attrs else ""
    return (f"eval of {report['trajectories']} trajectories: velocity MSE {velocity['mean']['student']:.4g} "
            f"(untrained {velocity['mean']['untrained']:.4g}), final-latent MSE {finals['student']:.4g} "
            f"(untrained {finals['untrained']:.4g}){frame0}{speed}{kept}; report {report_path}, plot {plot_path}")


def plot_report(report: dict, path: Path) -> None:
    """Write the PNG; uses the Figure API directly (no pyplot state, safe in any process)."""
    per_step = report["velocity_mse"]["per_step"]
    fig = Figure(figsize=(11, 4.2), dpi=100)
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2, gridspec_kw={"width_ratios": [2.2, 1]})

    steps = [r["step"] for r in per_step]
    for name in ("student", "untrained"):
        left.plot(steps, [r[name] for r in per_step], "o-", color=COLORS[name], label=name)
    left.set(yscale="log", xlabel="denoising step", ylabel="MSE vs cached teacher target")
    left.set_xticks(steps, [f"{r['step']}\nt={r['timestep']:.0f}" for r in per_step], fontsize=8)
    left.set_title("velocity error per step", fontsize=10)
    left.grid(alpha=0.3, which="both")
    left.legend()

    finals = {k: v for k, v in (("student", report["final_latent_mse"]["student"]),
                                ("untrained", report["final_latent_mse"]["untrained"]),
                                ("teacher re-run", (report.get("timing") or {}).get("teacher_final_mse")))
              if v is not None}
    bars = right.bar(list(finals), list(finals.values()), color=[COLORS[k] for k in finals])
    right.bar_label(bars, fmt="%.3g", fontsize=8)
    right.set(ylabel="MSE vs teacher's final latent")
    right.set_title("sampled final latent", fontsize=10)
    right.grid(alpha=0.3, axis="y")

    fig.suptitle(f"{report['student']['path']} on {report['cache']['path']}: {report['trajectories']} trajectories "
                 f"({report['selection']['source']})", fontsize=9)
    fig.tight_layout()
    safe_write.write_file(path, writer=lambda f: fig.savefig(f, format="png"))
