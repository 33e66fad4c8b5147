"""Every benchmark in one run: each figure against its baseline, measured side by side in the same run.

Writes bench/results.json (a list of {name, value, baseline, ratio, target, met, unit, note, machine}) and
prints the table, the machine and the command. `make bench` runs it; BENCH_ARGS passes flags:

    python -m bench.run_all                     # full sizes (about 5 minutes on 2 CPU cores)
    python -m bench.run_all --quick             # minimal sizes: checks that every benchmark runs
    python -m bench.run_all --only online,stage_two --device cuda
    python -m bench.run_all --stage-two-args="--prompts 256 --batch-size 64"   # any benchmark's own flags
    python -m bench.run_all --device cuda       # on a GPU box: adds placements_a14b (offload/disk vs cuda)

Torch runs `--threads` intra-op threads (default: all cores but one). The stages run I/O threads beside
torch (shard writer, zarr, loader workers); on a machine whose cores torch fills, each of them preempts an
intra-op thread and every parallel region waits for it, which on a small shared box swamps what is measured.
Value and baseline always run with the same setting; the machine line records it.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from bench import common
from bench.common import ROOT, machine, machine_line, pick_device, result, results_path, table

BENCHES = ("stage_one", "stage_two", "real_size", "online", "placements", "placements_a14b", "teacher_flops",
           "train_flops", "teacher_speed")
CUDA_ONLY = ("placements_a14b",)  # GPU placements at real A14B widths: skipped (and said so) on the CPU
# bench/placements.py at sizes that keep it to a few minutes on 2 CPU cores (its own defaults are larger).
PLACEMENTS_ARGS = "--dim 256 --ffn 1024 --layers 8 --batch-sizes 1,8,32 --steps 2 --repeats 2"
PLACEMENTS_QUICK = "--dim 64 --ffn 256 --layers 2 --batch-sizes 1,8,32 --steps 2 --repeats 1"
# Streaming the weights (from RAM or from disk) may cost at most 30% of in-memory throughput at batch 32:
# the placement issue's target for `disk`, applied to `offload` as well.
PLACEMENT_TARGET = 0.7


def placements(argv: list[str]) -> list[dict]:
    """bench/placements.py in its own process (it has no main(argv)); its JSON rows become result records."""
    with tempfile.TemporaryDirectory(prefix="wandistiller-bench-placements-") as tmp:
        out = Path(tmp) / "placements.json"
        cmd = [sys.executable, str(ROOT / "bench" / "placements.py"), "--work", str(Path(tmp) / "work"),
               "--json", str(out), *argv]
        res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                             env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
        if res.returncode or not out.exists():
            raise RuntimeError(f"{shlex.join(cmd)} failed (exit {res.returncode}):\n{(res.stdout + res.stderr)[-3000:]}")
        data = json.loads(out.read_text())
    return placement_records(data, argv)


def placement_records(data: dict, argv: list[str]) -> list[dict]:
    """Records of disk and offload vs in-memory at the largest batch (the smaller batches in the note), from
    the JSON bench/placements.py writes: {"weights_bytes", "throughput": [{placement, batch, samples_per_s,
    vs_in_memory}]}."""
    rows = {(r["placement"], r["batch"]): r for r in data["throughput"]}
    batches = sorted({b for _, b in rows})
    b = max(batches)
    records = []
    for name in ("disk", "offload"):
        r, mem = rows[(name, b)], rows[("cpu", b)]
        others = ", ".join(f"b{k} {rows[(name, k)]['vs_in_memory']:.2f}x" for k in batches if k != b)
        records.append(result(f"{name}_vs_memory_b{b}", r["samples_per_s"], mem["samples_per_s"], "samples/s",
                              PLACEMENT_TARGET, ">=", note=f"{others}; teacher weights "
                              f"{data['weights_bytes'] / 2**20:.0f} MiB; bench/placements.py {' '.join(argv)}"))
    return records


def write(results: list[dict], out: Path, line: str, merge: bool) -> None:
    """results.json: the run's records, each with the machine line; `merge` keeps other names already there."""
    for r in results:
        r["machine"] = line
    if merge:
        common.save(results, out)
    else:
        out.write_text(json.dumps(results, indent=2) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="Minimal sizes: every benchmark runs, no figure means much.")
    ap.add_argument("--only", default=",".join(BENCHES), help=f"Comma-separated subset of {','.join(BENCHES)}.")
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda[:i] (every benchmark but placements).")
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                    help="torch intra-op threads (default: all cores but one).")
    ap.add_argument("--out", type=Path, default=None,
                    help="Results file (default: bench/results.json, bench/results-cuda.json on CUDA).")
    for b in BENCHES:
        ap.add_argument(f"--{b.replace('_', '-')}-args", default=None, help=f"Extra flags for bench/{b}.py.")
    args = ap.parse_args(argv)
    only = [b.strip() for b in args.only.split(",") if b.strip()]
    unknown = set(only) - set(BENCHES)
    if unknown:
        ap.error(f"--only: unknown benchmark(s) {', '.join(sorted(unknown))}; choose from {', '.join(BENCHES)}")
    torch.set_num_threads(args.threads)
    if args.out is None:
        args.out = results_path(pick_device(args.device), quick=args.quick)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    command = shlex.join(["python", "-m", "bench.run_all", *(sys.argv[1:] if argv is None else argv)])

    from bench import (
        online, placements_a14b, real_size, stage_one, stage_two, teacher_flops, teacher_speed, train_flops,
    )

    def flags(name: str) -> list[str]:
        extra = getattr(args, f"{name}_args")
        if name == "placements":
            return shlex.split(PLACEMENTS_QUICK if args.quick else PLACEMENTS_ARGS) + shlex.split(extra or "")
        return (["--quick"] if args.quick else []) + ["--device", args.device] + shlex.split(extra or "")

    runners = {"stage_one": stage_one.main, "stage_two": stage_two.main, "real_size": real_size.main,
               "online": online.main, "placements": placements, "placements_a14b": placements_a14b.main,
               "teacher_flops": teacher_flops.main, "train_flops": train_flops.main,
               "teacher_speed": teacher_speed.main}
    on_cuda = pick_device(args.device).type == "cuda"
    results, failed, took = [], [], {}
    t_all = time.perf_counter()
    for name in BENCHES:
        if name not in only:
            continue
        if name in CUDA_ONLY and not on_cuda:
            print(f"== {name}: CUDA only, skipped on the CPU", flush=True)
            continue
        print(f"== {name}: {shlex.join(flags(name))}", flush=True)
        t = time.perf_counter()
        try:
            results += runners[name](flags(name))
        except Exception:
            traceback.print_exc()
            failed.append(name)
        took[name] = time.perf_counter() - t
        print(f"== {name}: {took[name]:.0f} s", flush=True)
    total = time.perf_counter() - t_all

    line = machine_line(machine())
    # A full run writes only what it measured; a subset merges its records by name into the file.
    write(results, args.out, line, merge=set(only) != set(BENCHES))
    print()
    print(table(results))
    print(f"\nmachine: {line}")
    print(f"command: {command}")
    print(f"time: {total:.0f} s ({', '.join(f'{k} {v:.0f} s' for k, v in took.items())}); written to {args.out}")
    missed = [r["name"] for r in results if not r["met"]]
    if missed:
        print(f"targets missed: {', '.join(missed)}")
    if failed:
        print(f"FAILED (no figure): {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
