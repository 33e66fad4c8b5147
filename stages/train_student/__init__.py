"""Stage two: train a student from the cache alone (no teacher, no text encoder), single process or DDP."""

from .train import run

__all__ = ["run"]
