"""Stage one: run the teacher once over prompts × seeds × steps and write the cache.

What the CLI needs: `run` (the stage), `dry_run` (`--dry-run`: the plan the run executes, printed) and
`plan_from_flags` (`wandistiller plan`)."""

from .make_cache import run
from .part_plan import dry_run
from .plan_report import plan_from_flags

__all__ = ["dry_run", "plan_from_flags", "run"]
