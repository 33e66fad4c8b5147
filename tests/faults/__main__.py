"""`python -m tests.faults [--only NAME ...] [--seed N] [--keep DIR] [-v]`: run the fault suite, print the table.

Exit status 0 when every attempt survived with zero samples lost and zero duplicated, 1 otherwise.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from . import SCENARIOS, render, run
from .proc import cleanup


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.faults", description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", choices=sorted(SCENARIOS), help="run only these scenarios")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random kill moments (default 0)")
    ap.add_argument("--keep", type=Path, help="work in this folder and keep it (default: a temporary one)")
    ap.add_argument("-v", "--verbose", action="store_true", help="also print what each attempt said")
    args = ap.parse_args()
    root = args.keep or Path(tempfile.mkdtemp(prefix="wandistiller-faults-"))
    try:
        rows = run(args.only or list(SCENARIOS), root, seed=args.seed, log=lambda m: print(m, flush=True))
    finally:
        cleanup()
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    print()
    print(render(rows, verbose=args.verbose))
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
