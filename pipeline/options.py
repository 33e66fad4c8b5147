"""The click options of a command, generated from its config's settings (docs/architecture.md, "Settings and
registries"). Every option defaults to None (not given), so that a TOML value stands unless a flag overrides it."""

from __future__ import annotations

import dataclasses
import typing

import click

from .settings import OWNER, declared, hints, name_of, one_of, required


def _default_text(f: dataclasses.Field) -> str | None:
    d, text = f.default, f.metadata.get("default_text")
    if text is not None or d is dataclasses.MISSING or d is None or d == ():
        return text
    if isinstance(d, bool):  # the spelling of the switch that is on by default
        on, _, off = (f.metadata.get("flag") or f.name.replace("_", "-")).partition("/")
        return on if d else (off or f"no-{on}")
    return f"{d:g}" if isinstance(d, float) else str(d)


def help_of(f: dataclasses.Field, text: str | None = None) -> str:
    """The field's help (or `text`) with its default appended; `[required]` for a setting without one (not click's
    `required=True`: the value may come from the --config file)."""
    text, default = text or f.metadata["help"], _default_text(f)
    if required(f):
        return f"{text}  [required]"
    return f"{text}  [default: {default}]" if default is not None else text


def _type(f: dataclasses.Field, tp):
    check = f.metadata.get("check")
    if isinstance(check, one_of) and check.cli_choice:
        return click.Choice(check.names())
    if f.metadata.get("path"):
        return click.Path()
    base = ([a for a in typing.get_args(tp) if a is not type(None)] or [tp])[0]
    return base if base in (int, float) else str  # (lists too: "0,4,8", which the config parses)


def _option(f: dataclasses.Field, tp):
    name = name_of(f)
    kw: dict = {"default": None, "help": help_of(f)}
    if tp is bool:
        on, _, off = (f.metadata.get("flag") or name).partition("/")
        return click.option(f"--{on}/--{off or 'no-' + on}", f.name, **kw)
    kw["type"] = _type(f, tp)
    if f.metadata.get("multiple"):
        # A repeatable flag not given is None: the config file's value, if any, stands.
        kw.update(multiple=True, default=(), callback=lambda ctx, param, value: value or None)
    return click.option(f"--{name}", f.name, **kw)


def config_options(cls):
    """Decorator: the options of `cls`'s CLI settings: its own first, then those it inherits, then its components'."""
    types = hints(cls)
    mine = set(cls.__dict__.get("__annotations__", {}))
    fields = [f for f in declared(cls) if f.metadata.get("cli", True)]
    fields.sort(key=lambda f: (f.metadata.get(OWNER) is not None, f.name not in mine))

    def deco(fn):
        for f in reversed(fields):
            fn = _option(f, types[f.name])(fn)
        return fn

    return deco

