"""What a train-student start pays before its first step: the check of the cache (`--verify checksum`, the default,
and `--verify size`), timed on a cache of Wan2.2-A14B-shaped samples written by the real writer (bench.real_size),
the page cache dropped before each pass, as a requeued job on a fresh node finds it (and once warm: the CPU's
share). One rank checks the whole
cache here; N ranks each check a 1/N share (stages/train_student/index.py splits the shards and prompt rows).

Run: python -m bench.verify_cost [--prompts 1000] [--steps 3] [--work DIR] [--keep]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch

from bench.common import drop_tree, tree_bytes
from bench.real_size import write_cache
from cache.manifest import load_manifest
from cache.reader import open_caches
from pipeline.runtime import DistEnv
from stages.train_student.index import build_index

GIB = 2**30


def check_s(cache: Path, how: str, cold: bool = True) -> float:
    """Seconds of stage two's check before step 1 (`--verify how`) on one rank, from a cold page cache (or a warm
    one: what the check costs in CPU alone)."""
    if cold:
        drop_tree(cache)
    t0 = time.perf_counter()
    build_index(open_caches([cache]), DistEnv(0, 1, 0), torch.device("cpu"), how)
    return time.perf_counter() - t0


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=3, help="Cached steps per prompt (samples per prompt).")
    ap.add_argument("--work", type=Path, default=None, help="Folder for the cache (default: a temporary folder).")
    ap.add_argument("--keep", action="store_true", help="Keep the cache after the run.")
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="verify-cost-", dir=args.work))
    cache = work / "cache"
    try:
        write_cache(cache, args.prompts, args.steps)
        shards = load_manifest(cache).bytes
        total = tree_bytes(cache)
        for how, cold in (("checksum", True), ("size", True), ("checksum", False), ("checksum", True)):
            s = check_s(cache, how, cold)
            print(f"--verify {how:8} {'cold' if cold else 'warm'}: {s:6.1f} s for {total / GIB:.2f} GiB "
                  f"({shards / GIB:.2f} GiB of shards): {s / (total / GIB):.2f} s/GiB, "
                  f"{total / GIB / s * 1024:.0f} MiB/s")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
