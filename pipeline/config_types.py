"""Every config value checked against its field's declared type, before a stage sees it, and refused (never coerced)
when it does not fit: `overwrite = "false"` is a true string to Python (docs/reliability.md, "Exit codes").
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any

from .settings import hints


# The scalar types: (how a message describes them, whether a value fits).
_SCALARS = {
    bool: ("true or false (a TOML boolean, not quoted)", lambda v: isinstance(v, bool)),
    int: ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    float: ("a finite number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)),
    str: ("a string (quoted)", lambda v: isinstance(v, str)),
    type(None): ("absent", lambda v: v is None),
}


def _describe(tp) -> str:
    if tp in _SCALARS:
        return _SCALARS[tp][0]
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp) if a is not type(None))
    if origin in (tuple, list):
        return f"a list of {_describe(typing.get_args(tp)[0]).removeprefix('an ').removeprefix('a ')}s"
    return str(tp)


def _fits(value, tp, seq_as_str: bool) -> bool:
    if tp in _SCALARS:
        return _SCALARS[tp][1](value)
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, a, seq_as_str) for a in typing.get_args(tp))
    if origin in (tuple, list):
        if isinstance(value, str):  # "0,4,8": the config's own __post_init__ parses (and checks) it
            return seq_as_str
        elem = typing.get_args(tp)[0]
        return isinstance(value, (list, tuple)) and all(_fits(v, elem, False) for v in value)
    return True  # a type this check does not know: the dataclass's own validation decides


def type_problem(cls, values: dict[str, Any]) -> tuple[str, str] | None:
    """(field, message) of the first value in `values` that does not fit its field's type; None when all fit."""
    types = hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in values and not _fits(values[f.name], types[f.name], seq_as_str=True):
            return f.name, f"{f.name.replace('_', '-')} must be {_describe(types[f.name])}, got {values[f.name]!r}"
    return None
