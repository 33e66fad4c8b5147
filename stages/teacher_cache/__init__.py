"""Stage one: run the teacher once over prompts × seeds × steps and write the cache.

What the CLI needs: `config_from_flags` (teacher-cache's flags and TOML -> the config), `run` (the stage),
`plan_from_flags` (`wandistiller plan`)."""

from .flags import config_from_flags
from .plan import plan_from_flags
from .run import run

__all__ = ["config_from_flags", "plan_from_flags", "run"]
