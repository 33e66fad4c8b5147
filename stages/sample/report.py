"""How an eval report reads: the table that lines every student up against the teacher, the one-line summary and
the figure (velocity error per step, final-latent error, trained vs untrained), all from the report's own fields."""

from __future__ import annotations

import os
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

COLORS = {"student": "tab:blue", "untrained": "tab:gray", "teacher re-run": "tab:green"}


def few_step_table(report: dict) -> list[dict]:
    """One row for the teacher and one per entry: steps, final-latent MSE, attribute scores, times and speed-ups."""
    attrs, timing = report["attributes"], report["timing"]

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

    rows = [{"label": "teacher", "objective": None, "steps": int(report["cache"]["steps"]),
             "guidance": float(report["cache"]["guidance"]), "final_latent_mse": 0.0, **attr("teacher"),
             **times("teacher")}]
    for e in report["entries"]:
        rows.append({**e, "final_latent_mse": report["final_latent_mse"][e["label"]], **attr(e["label"]),
                     **times(e["label"])})
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


def summary_line(report: dict, report_path: Path, plot_path: Path) -> str:
    """The report in one line: the student's errors against the untrained twin's, its speed-up and attributes."""
    timing, attrs, velocity, finals = (report["timing"], report["attributes"], report["velocity_mse"],
                                       report["final_latent_mse"])
    speed = (f"; {timing['speedup']:.2f}x faster than the teacher ({timing['student_s_per_image']:.3f}s at "
             f"{finals['student_steps']} steps vs {timing['teacher_s_per_image']:.3f}s at {timing['steps']} steps "
             "per image)") if timing else ""
    kept = ""
    if attrs:
        t, s, share = attrs["teacher"], attrs["student"], attrs["student_vs_teacher"]["colour"]
        share = "n/a (teacher 0%)" if share is None else f"{share:.1%} of the teacher's"
        kept = (f"; attributes on {attrs['captions']} captions: colour accuracy teacher {t['colour']:.1%} (background "
                f"{t['background']:.1%}, shape {t['shape_colour']:.1%}), student {s['colour']:.1%} (background "
                f"{s['background']:.1%}, shape {s['shape_colour']:.1%}), kept {share}; grid {attrs['grid']}")
    return (f"eval of {report['trajectories']} trajectories: velocity MSE {velocity['mean']['student']:.4g} "
            f"(untrained {velocity['mean']['untrained']:.4g}), final-latent MSE {finals['student']:.4g} "
            f"(untrained {finals['untrained']:.4g}){speed}{kept}; report {report_path}, plot {plot_path}")


def plot_report(report: dict, path: str | os.PathLike) -> None:
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
    fig.savefig(path, format="png")
