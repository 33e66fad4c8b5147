"""The figure of an eval report: velocity error per step, and final-latent error, trained vs untrained."""

from __future__ import annotations

import os

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

COLORS = {"student": "tab:blue", "untrained": "tab:gray", "teacher re-run": "tab:green"}


def plot_report(report: dict, path: str | os.PathLike) -> None:
    """Write the PNG; uses the Figure API directly (no pyplot state, safe in any process)."""
    per_step = report["velocity_mse"]["per_step"]
    fig = Figure(figsize=(11, 4.2), dpi=100)
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2, gridspec_kw={"width_ratios": [2.2, 1]})

    steps = [r["step"] for r in per_step]
    for name in ("student", "untrained"):
        left.plot(steps, [r[name] for r in per_step], "o-", color=COLORS[name], label=name)
    left.set_yscale("log")
    left.set_xticks(steps, [f"{r['step']}\nt={r['timestep']:.0f}" for r in per_step], fontsize=8)
    left.set_xlabel("denoising step")
    left.set_ylabel("MSE vs cached teacher target")
    left.set_title("velocity error per step", fontsize=10)
    left.grid(alpha=0.3, which="both")
    left.legend()

    finals = {k: v for k, v in (("student", report["final_latent_mse"]["student"]),
                                ("untrained", report["final_latent_mse"]["untrained"]),
                                ("teacher re-run", (report.get("timing") or {}).get("teacher_final_mse")))
              if v is not None}
    bars = right.bar(list(finals), list(finals.values()), color=[COLORS[k] for k in finals])
    right.bar_label(bars, fmt="%.3g", fontsize=8)
    right.set_ylabel("MSE vs teacher's final latent")
    right.set_title("sampled final latent", fontsize=10)
    right.grid(alpha=0.3, axis="y")

    fig.suptitle(f"{report['student']['path']} on {report['cache']['path']}: {report['trajectories']} trajectories "
                 f"({report['selection']['source']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, format="png")
