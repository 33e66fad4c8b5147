"""Every command the README shows is real: `wandistiller ...` lines parse against the CLI (flags and
choices included) and `make ...` lines dry-run (`make -n`). What the commands do is covered by the
end-to-end tests of each stage."""

from __future__ import annotations

import re
import shlex
import subprocess

import click
import pytest

from conftest import ROOT
from pipeline.cli import main


def _commands(prefix: str) -> list[list[str]]:
    text = (ROOT / "README.md").read_text()
    cmds = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = line.split(" #")[0].strip()
            words = shlex.split(line) if line else []
            # torchrun ... --no-python wandistiller <subcommand> ... (or -m pipeline.cli) runs the same CLI
            if words and words[0] == "torchrun" and "wandistiller" in words:
                words = words[words.index("wandistiller"):]
            if "pipeline.cli" in words:
                words = ["wandistiller"] + words[words.index("pipeline.cli") + 1:]
            if words and words[0] == prefix:
                cmds.append(words[1:])
    return cmds


def _parse(group: click.Group, args: list[str]) -> None:
    ctx = group.make_context("wandistiller", list(args), resilient_parsing=False)
    name, cmd, rest = group.resolve_command(ctx, ctx.protected_args + ctx.args)
    if isinstance(cmd, click.Group):
        _parse(cmd, rest)
    else:
        cmd.make_context(name, rest)


WANDISTILLER = _commands("wandistiller")
MAKE = _commands("make")


def test_readme_shows_torchrun_in_the_form_a_local_pipeline_py_cannot_break():
    text = (ROOT / "README.md").read_text() + "".join(p.read_text() for p in (ROOT / "docs").glob("*.md"))
    lines = [line for line in re.sub(r"\\\n\s*", " ", text).splitlines() if line.lstrip().startswith("torchrun --")]
    assert lines and all(re.search(r" --no-python \S*wandistiller ", line) for line in lines), lines


def test_readme_shows_commands():
    assert len(WANDISTILLER) >= 8 and {"demo", "test"} <= {m[0] for m in MAKE if m}


@pytest.mark.parametrize("args", WANDISTILLER, ids=[" ".join(a[:1]) for a in WANDISTILLER])
def test_readme_wandistiller_command_parses(args):
    _parse(main, args)


@pytest.mark.parametrize("args", MAKE, ids=[" ".join(a[:1]) for a in MAKE])
def test_readme_make_target_exists(args):
    r = subprocess.run(["make", "-n", "-C", str(ROOT)] + args, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
