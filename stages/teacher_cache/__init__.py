"""Stage one: run the teacher once over prompts × seeds × steps and write the cache.

What the CLI needs: `run` (the stage), `dry_run` (`--dry-run`) and `plan_from_flags` (`wandistiller plan`); the CLI
builds the config (`pipeline.legacy_flags.config_from_flags`)."""

from .cache_dry_run import dry_run
from .plan_report import plan_from_flags
from .make_cache import run

__all__ = ["dry_run", "plan_from_flags", "run"]
