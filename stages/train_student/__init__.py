"""Stage two: train a student from the cache alone (no teacher, no text encoder), single process or DDP."""

from .dry_run import dry_run
from .run import run

__all__ = ["dry_run", "run"]
