"""Loading a config (`load_config`: TOML with the CLI flags on top), every value checked against its field's
declared type before a stage sees it, and refused (never coerced) when it does not fit: `overwrite = "false"` is a
true string to Python (docs/reliability.md, "Exit codes")."""

from __future__ import annotations

import dataclasses
import math
import os
import re
import reprlib  # a value in a message is shown short: a config file may hold megabytes of it
import types
import typing
from pathlib import Path
from typing import Any

from cache import safe_open
from cache.cache_error import UnsafeFileError

from .errors import UserError
from .settings import declared, hints, name_of, required


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


def _type_problem(cls, values: dict[str, Any], given: dict[str, Any], toml_path) -> str | None:
    """Why the first value that does not fit its field's type is refused, and the file it came from (unless a flag
    gave it); None when all fit."""
    types = hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in values and not _fits(values[f.name], types[f.name], seq_as_str=True):
            where = f" (config file {toml_path})" if toml_path and f.name not in given else ""
            got = reprlib.repr(values[f.name])
            return f"{f.name.replace('_', '-')} must be {_describe(types[f.name])}, got {got}{where}"
    return None


def read_object(path: str | os.PathLike, what: str, fix: str = "rewrite it or remove it", fmt: str = "JSON") -> dict:
    """The table (object) a JSON or TOML file holds, or a UserError naming `what` at `path` and the `fix`: read by
    `safe_open` (a FIFO or folder refused, never waited on; at most CAPS["config"] bytes; nesting capped)."""
    p = Path(path)
    try:
        raw = safe_open.read_named(p, what, safe_open.CAPS["config"], fix)
        where = f"{what} {p}"
        data = (safe_open.parse_json(raw, where, fix) if fmt == "JSON"
                else safe_open.parse_toml(raw.decode(), where, fix))
    except FileNotFoundError:
        raise UserError(f"{what} {p} does not exist; {fix}") from None
    except OSError as e:  # a file this process may not read (permissions, I/O): named, not a traceback
        raise UserError(f"{what} {p} cannot be read ({e.strerror or e}); {fix}") from e
    except UnsafeFileError as e:  # a FIFO, a folder, too large, nested too deep, not JSON (its line ends in `fix`)
        raise UserError(str(e)) from None
    except (ValueError, UnicodeDecodeError) as e:  # TOML's decode errors (JSON's are safe_open's)
        raise UserError(f"{what} {p} is not valid {fmt} ({e}); {fix}") from e
    if not isinstance(data, dict):
        raise UserError(f"{what} {p} must be a {fmt} object, not a {type(data).__name__}; {fix}")
    return data


def load_config(cls, toml_path: str | os.PathLike | None, overrides: dict[str, Any]):
    """Build `cls` from a TOML file (optional; keys with dashes or underscores, at the top level or under the
    stage's table) with `overrides` (the CLI flags given) on top; a bad key or value is a UserError naming it."""
    values: dict[str, Any] = {}
    names = {f.name for f in dataclasses.fields(cls)}
    if toml_path is not None:
        p = Path(toml_path)
        data = read_object(p, "config file", "pass an existing TOML file to --config", "TOML")
        section = getattr(cls, "TOML_SECTION", None)
        if section and isinstance(data.get(section), dict):
            data = {**{k: v for k, v in data.items() if not isinstance(v, dict)}, **data[section]}
        for k, v in data.items():
            key = k.replace("-", "_")
            if key not in names:
                raise UserError(f"config file {p}: unknown key {reprlib.repr(k)}; valid keys: "
                                f"{', '.join(sorted(names))}")
            values[key] = v
    in_file = set(values)
    given = {k: v for k, v in overrides.items() if v is not None}
    values.update(given)
    _refuse_missing(cls, values, toml_path)
    problem = _type_problem(cls, values, given, toml_path)
    try:
        cfg = cls(**values)
    except ValueError as e:  # a range check names the range too: its message wins
        raise UserError(f"{e}{_source(cls, str(e), given, in_file, toml_path)}") from e
    except Exception as e:  # a TypeError (a missing field, a wrong type), or a wrong type __post_init__ tripped over
        if problem is None and not isinstance(e, TypeError):
            raise
        raise UserError(problem or f"incomplete configuration: {e}") from e
    if problem is not None:
        raise UserError(problem)
    return cfg


def _source(cls, message: str, given: dict[str, Any], in_file: set[str], toml_path) -> str:
    """Where the settings a refusal names came from, as the end of its line: the config file, the command line, or
    each its own (without a config file: nothing to add)."""
    if not toml_path:
        return ""
    words = {w.rstrip("-") for w in re.findall(r"[A-Za-z][\w-]*", message)}
    named = [f for f in declared(cls) if name_of(f) in words]
    flags = [name_of(f) for f in named if f.name in given]
    from_file = [name_of(f) for f in named if f.name in in_file and f.name not in given]
    if not flags:  # every setting it names is the file's (or a default), or it names none: the file, as ever
        return f" (config file {toml_path})"
    if not from_file:
        return " (given on the command line)"
    return f" ({', '.join(from_file)} from config file {toml_path}, {', '.join(flags)} from the command line)"


def _refuse_missing(cls, values: dict[str, Any], toml_path) -> None:
    """A required setting given neither as a flag nor in the config file: one line naming each flag."""
    missing = [f for f in declared(cls) if required(f) and values.get(f.name) is None]
    if not missing:
        return
    flags = [f"--{name_of(f)}" for f in missing]
    if len(missing) == 1:
        gist = missing[0].metadata["help"].split(";")[0]
        if gist.count("(") > gist.count(")"):  # the ';' was inside a parenthesis: the words before it
            gist = gist[:gist.rfind("(")]
        what = f"{flags[0]} is required ({gist.strip().rstrip('.')})"
    else:
        what = f"{', '.join(flags[:-1])} and {flags[-1]} are required"
    keys = ", ".join(f.name for f in missing)
    where = f"the config file {toml_path}" if toml_path else "a --config TOML file"
    raise UserError(f"{what}; give {'it' if len(missing) == 1 else 'them'} on the command line or as {keys} in {where}")
