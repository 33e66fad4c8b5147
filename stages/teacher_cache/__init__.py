"""Stage one: run the teacher once over prompts × seeds × steps and write the cache (`run`, `dry_run`, `plan`)."""

from .make_cache import run
from .part_plan import dry_run
from .plan_report import plan_from_flags

__all__ = ["dry_run", "plan_from_flags", "run"]
