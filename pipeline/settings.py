"""A setting is declared once: one dataclass field whose metadata holds its help, its check and how the CLI spells it
(docs/architecture.md, "Settings and registries"). Imports nothing heavy: the CLI reads it at load."""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Callable, Iterable
from typing import Any

Check = Callable[[str, Any], None]  # (the setting's name as the user spells it, value) -> None, or ValueError


def setting(default: Any = dataclasses.MISSING, *, help: str, check: Check | None = None,
            parse: Callable[[str, Any], Any] | None = None, flag: str | None = None, default_text: str | None = None,
            path: bool = False, multiple: bool = False, cli: bool = True) -> Any:
    """A dataclass field with its `--help` line (the default is appended), its `check` (ValueError naming the
    setting) and `parse` ("0,4" -> (0, 4)); `flag`: its CLI name when not the field's ("copy/link" for a boolean);
    `default_text`: what the default means when the value does not say it; `path`: a file or folder; `multiple`: a
    repeatable flag; `cli`: False for a TOML-only setting."""
    meta = {"help": help, "check": check, "parse": parse, "flag": flag, "default_text": default_text, "path": path,
            "multiple": multiple, "cli": cli}
    return dataclasses.field(default=default, metadata=meta)


def name_of(f: dataclasses.Field) -> str:
    """How the user spells the setting of field `f` (the flag without its dashes, as in messages)."""
    return (f.metadata.get("flag") or f.name.replace("_", "-")).split("/")[0]


def required(f: dataclasses.Field) -> bool:
    """A setting without a default: the command refuses to run without it (from a flag or the --config file)."""
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def declared(cls) -> list[dataclasses.Field]:
    """The fields of `cls` declared with `setting`."""
    return [f for f in dataclasses.fields(cls) if "help" in f.metadata]


@functools.cache
def hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def check_settings(obj) -> None:
    """Parse, then check every setting of `obj` (a frozen dataclass); None passes (unset)."""
    for f in declared(type(obj)):
        value = getattr(obj, f.name)
        parse = f.metadata.get("parse")
        if parse is not None and value is not None:
            value = parse(name_of(f), value)
            object.__setattr__(obj, f.name, value)
        check = f.metadata.get("check")
        if check is not None and value is not None:
            check(name_of(f), value)


# -- checks ------------------------------------------------------------------------------------------------------

def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def must(ok: Callable[[Any], Any], what: str) -> Check:
    """A check refusing a value `ok` rejects: "NAME must WHAT, got VALUE"."""

    def check(name, v):
        if not ok(v):
            raise ValueError(f"{name} must {what}, got {v!r}")

    return check


def at_least(low: int) -> Check:
    return must(lambda v: _is_int(v) and v >= low, f"be an integer >= {low}")


def positive(allow_zero: bool = False) -> Check:
    return must(lambda v: _is_number(v) and not (v < 0 or (v == 0 and not allow_zero)),  # (NaN: config_types')
                f"be a {'non-negative' if allow_zero else 'positive'} number")


def in_range(low: float, high: float, high_open: bool = False, note: str = "") -> Check:
    """A number in [low, high] (or [low, high))."""
    return must(lambda v: _is_number(v) and (low <= v < high if high_open else low <= v <= high),
                f"be in [{low:g}, {high:g}{')' if high_open else ']'}{note}")


def int_in(low: int, high: int, why: str = "") -> Check:
    """An integer in [low, high]; `why` says where the upper bound comes from."""
    return must(lambda v: _is_int(v) and low <= v <= high, f"be an integer from {low} to {high:,}{why}")


def non_empty(name, v) -> None:
    if not isinstance(v, str) or not v:
        raise ValueError(f"{name} must be a non-empty string")


class one_of:  # noqa: N801 (used like the other check factories)
    """One of a list of names, fixed or read from a registry when the check runs (so a plug-in counts); `cli_choice`:
    the CLI offers them as a click choice; `otherwise`: a value outside the names that is also fine (a .json path)."""

    def __init__(self, names: Iterable[str] | Callable[[], Iterable[str]], *, cli_choice: bool = True,
                 otherwise: Callable[[Any], bool] | None = None, otherwise_text: str = ""):
        self._names, self.cli_choice = names, cli_choice
        self.otherwise, self.otherwise_text = otherwise, otherwise_text

    def names(self) -> list[str]:
        return list(self._names() if callable(self._names) else self._names)

    def __call__(self, name, v) -> None:
        if not isinstance(v, str):  # a wrong type: config_types' message says what the key takes
            raise TypeError(f"{name} must be a string, got {v!r}")
        if v not in self.names() and not (self.otherwise is not None and self.otherwise(v)):
            raise ValueError(f"{name} must be one of {', '.join(self.names())}{self.otherwise_text}, got {v!r}")


def int_list(name: str, value) -> tuple[int, ...]:
    """'0,4,8' or [0, 4, 8] -> (0, 4, 8); ValueError naming the setting otherwise (a `parse`)."""
    items = value.split(",") if isinstance(value, str) else value
    try:
        out = tuple(int(str(v).strip()) for v in items if str(v).strip() != "")
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be comma-separated integers like 0,4,8, got {value!r}") from None
    if not out or any(v < 0 for v in out):
        raise ValueError(f"{name} must list integers >= 0, got {value!r}")
    return out


def str_tuple(name: str, value) -> tuple[str, ...]:
    """One path or a list of them -> a tuple (a `parse` for repeatable path settings)."""
    return (value,) if isinstance(value, str) else tuple(value)


# -- a component's settings inside a stage config ------------------------------------------------------------------

OWNER = "owner"  # metadata key of a merged field: the registry entry that owns it
SOURCE = "source"  # ... and its field's name in the entry's own settings dataclass


def merged(cls_name: str, registry) -> type:
    """A dataclass of every setting of every entry of `registry`, each field named as its flag (so that the stage
    config deriving from it keeps `--segment-velocity-weight`)."""
    specs = [(name_of(f).replace("-", "_"), hints(e.settings)[f.name], dataclasses.field(
        default=f.default, metadata={**f.metadata, "flag": None, OWNER: e.name, SOURCE: f.name}))
        for e in registry.entries() if e.settings is not None for f in dataclasses.fields(e.settings)]
    return dataclasses.make_dataclass(cls_name, specs, frozen=True, kw_only=True)


def settings_of(cfg, entry) -> Any:
    """The settings dataclass of registry `entry`, built from the merged fields of the stage config `cfg`."""
    if entry.settings is None:
        return None
    values = {f.metadata[SOURCE]: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
              if f.metadata.get(OWNER) == entry.name}
    return entry.settings(**values)


def refuse_foreign(cfg, chosen: str, what: str) -> None:
    """A merged setting of an entry other than `chosen`, away from its default, would do nothing: refused."""
    for f in dataclasses.fields(cfg):
        owner = f.metadata.get(OWNER)
        if owner is not None and owner != chosen and getattr(cfg, f.name) != f.default:
            raise ValueError(f"{name_of(f)} applies to --{what} {owner} only, and this run's --{what} is {chosen}; "
                             f"drop it or choose --{what} {owner}")


# -- byte sizes ("80GiB") ---------------------------------------------------------------------------------------

_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text, what: str = "the size") -> int:
    """'24GiB', '80GB', '512MiB', '2TiB', '123B' -> bytes (GB = 10^9, GiB = 2^30, as accelerate). A number without a
    unit is refused (0 aside): `--gpu-memory 80` means 80 GiB to a person and 80 bytes to a parser."""
    t = str(text).strip().lower().replace(" ", "")
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(num):]
    try:
        value = float(num)
    except ValueError:
        value = -1.0
    if unit == "" and value > 0:
        raise ValueError(f"{what} {text!r} has no unit; write {num}GiB (GiB = 2^30 bytes) or {num}GB (10^9 bytes)")
    if (unit not in _UNITS and not (unit == "" and value == 0)) or not value >= 0 or value == float("inf"):
        raise ValueError(f"cannot read {what} {text!r}; write it like 24GiB, 80GB, 512MiB or 2TiB")
    return int(value * _UNITS.get(unit, 1))


def parse_gpus(text: str, what: str = "--assume-gpus") -> tuple[int, ...]:
    """A node's GPUs, each one's memory in bytes: '4x24GiB', '80GiB,40GiB' or 'none'; ValueError otherwise."""
    t = str(text).strip().lower()
    if t in ("", "none", "0"):
        return ()
    if "x" in t and "," not in t:
        n, size = t.split("x", 1)
        if not n.strip().isdigit():
            raise ValueError(f"cannot read {what} {text!r}; write e.g. 4x24GiB or 80GiB,40GiB")
        return (parse_bytes(size, f"{what} {text!r}: the size"),) * int(n)
    return tuple(parse_bytes(s, f"{what} {text!r}: the size") for s in t.split(","))


def byte_size(name, v) -> None:
    """A size with its unit, e.g. 80GiB (a check)."""
    parse_bytes(v, f"--{name}")


def gpu_sizes(name, v) -> None:
    """A node's GPUs as parse_gpus reads them (a check)."""
    parse_gpus(v, f"--{name}")
