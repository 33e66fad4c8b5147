"""Stage one: run the teacher once over prompts × seeds × steps and write the cache.

What the CLI needs: `run` (the stage) and `plan_from_flags` (`wandistiller plan`); the CLI builds the config
(`pipeline.legacy_flags.config_from_flags`)."""

from .plan import plan_from_flags
from .run import run

__all__ = ["plan_from_flags", "run"]
