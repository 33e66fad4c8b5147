"""How many trajectories must stage one buy? (docs/costs.md, "How many prompts"). From one cache (make demo's: 4,096
shapes captions x 2 seeds, 64 prompts held out), train on its first N trajectories (`--train-trajectories`) the
students the demo and `make one-step` train, each with the recipe and the number of optimizer steps it has on the whole
cache (equal compute at every N: a smaller N is more epochs of less data):
  seg2   the 2-step compact segment student from the teacher's blocks (make demo: 2016 steps);
  seg1   the 1-step compact student trained on from that N's seg2 (make one-step: pseudo-Huber, 4032 steps);
  lora2  the 2-step rank-16 LoRA of the teacher (make demo: 1008 steps).
Then one `eval` of them all (same noise, the held-out captions of data/shapes-heldout.txt) and a table of kept vs N,
with where each curve flattens, into OUT/data_curve.json. Each training's wall time is kept there too; a finished
training (its student_ema written) is reused when the script is run again.
    .venv/bin/python scripts/data_curve.py [--out runs/data-curve] [--n 1024,2048,4096,8064]
About 15 minutes per N on 2 CPU cores, and 8 for the eval."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent / "wandistiller"
TEACHER = "runs/tiny-teacher-pretrained"
COMMON = ["--batch-size", "64", "--warmup-steps", "50", "--ema-decay", "0.995", "--holdout-prompts", "64",
          "--val-every", "0", "--objective", "segment"]
COMPACT = ["--student-config", "configs/student-shapes.json"]


def recipes(out: Path, n: int) -> dict[str, list[str]]:
    """Each student's flags at N trajectories (make demo's and make one-step's, by steps instead of epochs)."""
    return {
        f"seg2-{n}": [*COMPACT, "--init-from-teacher", TEACHER, "--lr", "1e-3", "--max-steps", "2016",
                      "--student-steps", "2", "--segment-start-weight", "4"],
        f"seg1-{n}": [*COMPACT, "--init-from-teacher", str(out / f"seg2-{n}" / "student_ema"), "--lr", "3e-4",
                      "--max-steps", "4032", "--student-steps", "1", "--segment-start-weight", "4",
                      "--segment-loss", "pseudo-huber", "--segment-huber-c", "0.01"],
        f"lora2-{n}": ["--lora-of", TEACHER, "--lora-rank", "16", "--lr", "1e-3", "--max-steps", "1008",
                       "--student-steps", "2", "--segment-start-weight", "4"],
    }


def flattens(points: list[tuple[int, float]], images: int) -> int | None:
    """The smallest N from which no larger N keeps more than one image's share more (one image: 1 / `images`)."""
    for i, (n, _) in enumerate(points):
        if all(k <= points[i][1] + 1.0 / images + 1e-9 for _, k in points[i:]):
            return n
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cache", default="runs/demo/cache")
    ap.add_argument("--out", default="runs/data-curve", type=Path)
    ap.add_argument("--n", default="1024,2048,4096,8064", help="trajectories to train on (8064: all of the demo's "
                                                                 "8,192 but the 64 held-out prompts' 128)")
    args = ap.parse_args()
    ns = [int(x) for x in args.n.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    record = args.out / "data_curve.json"
    result = json.loads(record.read_text()) if record.exists() else {"train_s": {}}
    trained = False
    for n in ns:
        for name, flags in recipes(args.out, n).items():
            run = args.out / name
            if (run / "distill.json").exists() and (run / "student_ema").exists():
                continue
            trained = True
            cmd = [str(BIN), "train-student", "--cache", args.cache, "--out", str(run), "--train-trajectories",
                   str(n), *COMMON, *flags]
            print(f"[data-curve] {name}: {' '.join(cmd[1:])}", flush=True)
            subprocess.run(["rm", "-rf", str(run)], check=True)
            t0 = time.perf_counter()
            subprocess.run(cmd, check=True, cwd=ROOT)
            result["train_s"][name] = round(time.perf_counter() - t0, 1)
            record.write_text(json.dumps(result, indent=1))
    names = [name for n in ns for name in recipes(args.out, n)]
    report = args.out / "eval.json"
    cmd = [str(BIN), "eval", "--student", str(args.out / names[0]),
           *[x for name in names[1:] for x in ("--compare", str(args.out / name))], "--cache", args.cache,
           "--teacher", TEACHER, "--report", str(report), "--attributes", "data/shapes-heldout.txt", "--timing-runs", "2"]
    if trained or not report.exists():  # (an eval of these very runs is reused)
        subprocess.run(cmd, check=True, cwd=ROOT)
    table = {e["label"]: e for e in json.loads(report.read_text())["table"]}
    table[names[0]] = table["student"]  # (eval's label for its --student)
    images = round(table["teacher"]["all_right"] * 128)  # the teacher's all-right images among 128 captions
    result["kept"] = {name: table[name]["all_right_ratio"] for name in names}
    result["latent_mse"] = {name: round(table[name]["final_latent_mse"], 4) for name in names}
    result["flattens_at"] = {}
    print(f"\nkept (share of the teacher's {images} all-right held-out images) by trajectories trained on:")
    print(f"{'student':<8}" + "".join(f"{n:>9,}" for n in ns) + "   flattens at")
    for family in ("seg2", "seg1", "lora2"):
        points = [(n, result["kept"][f"{family}-{n}"]) for n in ns]
        result["flattens_at"][family] = flat = flattens(points, images)
        print(f"{family:<8}" + "".join(f"{k:>9.1%}" for _, k in points) + f"   {flat:,}")
    record.write_text(json.dumps(result, indent=1))
    print(f"\n{record}")


if __name__ == "__main__":
    main()
