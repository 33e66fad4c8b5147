"""From the `teacher-cache` command line to the stage's config: TOML + flags, with the seed script's flags
folded in (each with a one-line deprecation note on stderr)."""

from __future__ import annotations

import sys

from .config import TeacherCacheConfig, load_config
from .errors import UserError

# The seed script's flags, still accepted: (flag, value) -> the settings they stand for.
_LEGACY_STRATEGY = {"cpu": {"placement": "cpu"}, "balanced": {"placement": "balanced"},
                    "gpu0": {"placement": "cuda", "device": 0}, "auto": {"placement": "auto"}}


def config_from_flags(config_file: str | None, flags: dict) -> TeacherCacheConfig:
    """The stage's config from a TOML file (optional) and the command's flags (None = not given)."""
    flags = dict(flags)
    for note in legacy_flags(flags):
        print(note, file=sys.stderr, flush=True)
    return load_config(TeacherCacheConfig, config_file, flags)


def legacy_flags(flags: dict) -> list[str]:
    """Fold the seed script's --teacher_on_cpu / --teacher_device_strategy / --teacher_dtype into `flags`
    (in place); returns one deprecation note per flag used. Conflicting new flags are a UserError."""
    notes, implied = [], {}
    if flags.pop("teacher_on_cpu", None):
        notes.append("note: --teacher_on_cpu is deprecated; use --placement cpu")
        implied["placement"] = ("cpu", "--teacher_on_cpu")
    strategy = flags.pop("teacher_device_strategy", None)
    if strategy is not None:
        new = _LEGACY_STRATEGY[strategy]
        extra = " --device 0" if "device" in new else ""
        notes.append(f"note: --teacher_device_strategy is deprecated; use --placement {new['placement']}{extra}")
        for k, v in new.items():
            implied[k] = (v, f"--teacher_device_strategy {strategy}")
    dtype = flags.pop("teacher_dtype", None)
    if dtype is not None:
        notes.append(f"note: --teacher_dtype is deprecated; use --dtype {dtype}")
        implied["dtype"] = (dtype, "--teacher_dtype")
    for key, (value, source) in implied.items():
        if flags.get(key) is not None and flags[key] != value:
            raise UserError(f"{source} (= --{key} {value}) contradicts --{key} {flags[key]}; drop the deprecated flag")
        flags[key] = value
    return notes
