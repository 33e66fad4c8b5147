"""Stage one: run the teacher once over prompts × seeds × steps and write the cache."""

from .run import run

__all__ = ["run"]
