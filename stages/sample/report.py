"""How an eval report reads: the table that lines every student up against the teacher, and the one-line summary
(the figure is plot.py's)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from cache import format as F

if TYPE_CHECKING:
    from .evaluate import Entry


def few_step_table(entries: list[Entry], manifest: dict, finals: dict, timing: dict | None, attrs: dict | None) -> list[dict]:
    """One row for the teacher and one per entry: steps, final-latent MSE against the teacher from the same noise,
    attribute accuracy and the share of images with every attribute right (and of the teacher's kept), time per
    image (denoising, whole pipeline) and speed-ups."""
    def attr(name: str) -> dict:
        if not attrs:
            return {}
        a = attrs[name]
        out = {"attribute_accuracy": (a["background"] + a["shape_colour"] + a["position"]) / 3,
               "shape_colour": a["shape_colour"], "position": a["position"], "all_right": a["all"]}
        if name != "teacher":
            out["kept_all_right"] = attrs["vs_teacher"][name]["all"]
        return out

    def times(name: str) -> dict:
        if not timing:
            return {}
        t = timing["teacher"] if name == "teacher" else timing["entries"][name]
        return {k: t.get(k) for k in ("denoise_s_per_image", "pipeline_s_per_image", "speedup_denoise",
                                      "speedup_pipeline") if k in t}

    rows = [{"label": "teacher", "objective": None, "steps": int(manifest[F.F_STEPS]),
             "guidance": float(manifest[F.F_GUIDANCE]), "final_latent_mse": 0.0, **attr("teacher"), **times("teacher")}]
    for e in entries:
        rows.append({**e.describe(), "final_latent_mse": finals[e.label], **attr(e.label), **times(e.label)})
    return rows


def format_table(rows: list[dict]) -> str:
    """`few_step_table` as text, a line per model, `-` where a figure was not measured."""
    def f(v, spec):
        return "-" if v is None else format(v, spec)

    lines = [f"{'model':<24} {'steps':>5} {'latent MSE':>10} {'attr acc':>8} {'all right':>9} {'kept':>6} "
             f"{'denoise s':>9} {'x faster':>8} {'pipeline s':>10} {'x faster':>8}"]
    for r in rows:
        lines.append(f"{r['label'][:24]:<24} {r['steps']:>5} {f(r['final_latent_mse'], '.4g'):>10} "
                     f"{f(r.get('attribute_accuracy'), '.1%'):>8} {f(r.get('all_right'), '.1%'):>9} "
                     f"{f(r.get('kept_all_right'), '.0%'):>6} {f(r.get('denoise_s_per_image'), '.4f'):>9} "
                     f"{f(r.get('speedup_denoise'), '.1f'):>8} {f(r.get('pipeline_s_per_image'), '.4f'):>10} "
                     f"{f(r.get('speedup_pipeline'), '.1f'):>8}")
    return "\n".join(lines)


def _share(attrs: dict, key: str) -> str:
    v = attrs["student_vs_teacher"][key]
    return "n/a (teacher 0%)" if v is None else f"{v:.1%} of the teacher's"


def summary_line(report: dict, entries: list[Entry], report_path: Path, plot_path: Path) -> str:
    """The report in one line: the student's errors against the untrained twin's, its speed-up and attributes."""
    timing, attrs, velocity, finals = (report["timing"], report["attributes"], report["velocity_mse"],
                                       report["final_latent_mse"])
    speed = (f"; {timing['speedup']:.2f}x faster than the teacher ({timing['student_s_per_image']:.3f}s at "
             f"{entries[0].steps} steps vs {timing['teacher_s_per_image']:.3f}s at {timing['steps']} steps per image)"
             ) if timing else ""
    kept = ""
    if attrs:
        t, s = attrs["teacher"], attrs["student"]
        kept = (f"; attributes on {attrs['captions']} captions: colour accuracy teacher {t['colour']:.1%} (background "
                f"{t['background']:.1%}, shape {t['shape_colour']:.1%}), student {s['colour']:.1%} (background "
                f"{s['background']:.1%}, shape {s['shape_colour']:.1%}), kept {_share(attrs, 'colour')}; "
                f"grid {attrs['grid']}")
    return (f"eval of {report['trajectories']} trajectories: velocity MSE {velocity['mean']['student']:.4g} "
            f"(untrained {velocity['mean']['untrained']:.4g}), final-latent MSE {finals['student']:.4g} "
            f"(untrained {finals['untrained']:.4g}){speed}{kept}; report {report_path}, plot {plot_path}")
