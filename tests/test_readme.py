"""Every command the README shows is real: `wandistiller ...` lines parse against the CLI (flags and
choices included) and `make ...` lines dry-run (`make -n`). What the commands do is covered by the
end-to-end tests of each stage."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

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
            if "pipeline.cli" in words:
                words = ["wandistiller"] + words[words.index("pipeline.cli") + 1:]
            elif words[:1] == ["torchrun"] and "wandistiller" in words:
                words = words[words.index("wandistiller"):]
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


# -- the A14B recipe, run as written ---------------------------------------------------------------------

def _recipe_plans() -> list[str]:
    """The `wandistiller plan` lines of the README's real-model recipe, as written (continuations joined)."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## The real-model recipe"):text.index("## Stage one: `teacher-cache`")]
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", section, flags=re.S):
        lines += [ln.strip() for ln in re.sub(r"\\\n\s*", " ", block).splitlines()
                  if ln.startswith("wandistiller plan")]
    return lines


@pytest.mark.slow
def test_the_a14b_recipe_plans_run_as_written(tmp_path):
    """Against a local Hub cache holding A14B's configs alone, offline: one 80 GB GPU, and 4 nodes x 8 GPUs."""
    from hub_cache import A14B_CONFIGS, A14B_ID, add_snapshot, hub_env

    add_snapshot(tmp_path, A14B_ID, A14B_CONFIGS, "c" * 40)
    one, cluster = _recipe_plans()
    assert "--gpus-per-node 1 --gpu-memory 80GiB --prompts 200000" in one and "--nodes 4" in cluster
    outs = []
    for line in (one, cluster):
        argv = shlex.split(line)  # `wandistiller` is this environment's (its PATH need not hold it)
        argv[0] = str(Path(sys.executable).parent / argv[0])
        r = subprocess.run(argv, capture_output=True, text=True, env=hub_env(tmp_path), cwd=ROOT, timeout=300)
        assert r.returncode == 0, r.stderr
        out = r.stdout
        assert f"teacher     {A14B_ID} (revision main, configs from {tmp_path}" in out
        assert "placement   cuda (step-major order), picked by auto" in out  # the layout
        assert "200,000 prompts: 3.8 TiB" in out and "= 444.4 GPU-hours" in out  # cache bytes, GPU-hours
        outs.append(out)
    assert "stage one   1 process (1 node x 1 rank)" in outs[0] and "18.5 days wall on 1 GPU" in outs[0]
    assert "stage one   32 processes (4 nodes x 8 ranks)" in outs[1] and "13.9 h wall on 32 GPUs" in outs[1]
    assert "torchrun --nnodes 4 --nproc-per-node 8 --rdzv-backend c10d" in outs[1]
    assert "--part $SLURM_ARRAY_TASK_ID --num-parts 32" in outs[1]
