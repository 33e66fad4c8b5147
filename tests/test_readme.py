"""The README is a front door (at most 250 lines, every doc named) and every command it and docs/ show is real:
`wandistiller ...` lines parse against the CLI (flags and choices included), `make ...` lines dry-run (`make -n`),
the A14B recipe's `plan` lines print what the README quotes of them, and the benchmark tables of docs/ are the rows
bench/ recorded. What the commands do is covered by the end-to-end tests of each stage."""

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


DOCS = sorted((ROOT / "docs").glob("*.md"))


def _commands(prefix: str, files=(ROOT / "README.md",)) -> list[list[str]]:
    cmds = []
    for path in files:
        for block in re.findall(r"```bash\n(.*?)```", path.read_text(), flags=re.S):
            joined = re.sub(r"\\\n\s*", " ", block)
            for line in joined.splitlines():
                line = line.split(" #")[0].strip()
                words = shlex.split(line) if line and not line.startswith("#") else []
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
# docs/ show shell loops and SLURM scripts: a line holding a shell variable ($e, $SLURM_ARRAY_TASK_ID) gets its
# value from the shell, so only the lines without one are parsed as written
DOCS_WANDISTILLER = [c for c in _commands("wandistiller", DOCS) if not any("$" in w for w in c)]


def test_readme_is_a_front_door():
    """At most 250 lines: results, benchmarks and stories live in docs/, and the README's table names every doc."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    named = set(re.findall(r"^\| (docs/[\w-]+\.md) \|", text, flags=re.M))
    assert named == {f"docs/{p.name}" for p in DOCS}


def test_every_doc_a_page_names_exists():
    for path in [ROOT / "README.md", *DOCS]:
        for name in re.findall(r"\bdocs/[\w-]+\.md", path.read_text()):
            assert (ROOT / name).is_file(), f"{path.name} names {name}"


def test_readme_shows_torchrun_in_the_form_a_local_pipeline_py_cannot_break():
    text = (ROOT / "README.md").read_text() + "".join(p.read_text() for p in (ROOT / "docs").glob("*.md"))
    lines = [line for line in re.sub(r"\\\n\s*", " ", text).splitlines() if line.lstrip().startswith("torchrun --")]
    assert lines and all(re.search(r" --no-python \S*wandistiller ", line) for line in lines), lines


def test_readme_shows_commands():
    assert len(WANDISTILLER) >= 8 and {"demo", "test"} <= {m[0] for m in MAKE if m}
    assert len(DOCS_WANDISTILLER) >= 20


@pytest.mark.parametrize("args", WANDISTILLER, ids=[" ".join(a[:1]) for a in WANDISTILLER])
def test_readme_wandistiller_command_parses(args):
    _parse(main, args)


@pytest.mark.parametrize("args", DOCS_WANDISTILLER, ids=[" ".join(a[:1]) for a in DOCS_WANDISTILLER])
def test_docs_wandistiller_command_parses(args):
    _parse(main, args)


@pytest.mark.parametrize("args", MAKE, ids=[" ".join(a[:1]) for a in MAKE])
def test_readme_make_target_exists(args):
    r = subprocess.run(["make", "-n", "-C", str(ROOT)] + args, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


# -- the A14B recipe, run as written ---------------------------------------------------------------------

def _recipe() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("## The real-model recipe")
    return text[start:text.index("\n## ", start)]


def _recipe_plans() -> list[str]:
    """The `wandistiller plan` lines of the README's real-model recipe, as written (continuations joined)."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", _recipe(), flags=re.S):
        lines += [ln.strip() for ln in re.sub(r"\\\n\s*", " ", block).splitlines()
                  if ln.startswith("wandistiller plan")]
    return lines


def _quoted_plan() -> list[list[str]]:
    """The lines the README quotes of the cluster's plan (its first unlabelled block), each cut at its `...`."""
    block = next(body for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", _recipe(), flags=re.M | re.S) if not lang)
    return [[piece.strip() for piece in line.split("...") if piece.strip()] for line in block.splitlines() if line]


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
    quoted = _quoted_plan()
    assert len(quoted) >= 8
    for pieces in quoted:  # every line the README quotes is one the plan prints, up to what it leaves out
        assert any(all(piece in line for piece in pieces) for line in outs[1].splitlines()), pieces


# -- docs/benchmarks.md: the tables are bench/'s rows --------------------------------------------------------------

def _bench_tables() -> list[tuple[str, list[list[str]]]]:
    """Each table of docs/benchmarks.md with the results file named last before it."""
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    tables = []
    for m in re.finditer(r"^```\n(name +value .*?)^```", text, flags=re.M | re.S):
        source = re.findall(r"bench/results[\w-]*\.json", text[:m.start()])[-1]
        tables.append((source, [line.split() for line in m.group(1).splitlines()[1:] if line.strip()]))
    return tables


def test_benchmark_tables_are_the_rows_bench_recorded():
    """Every row shown is the recorded one, as bench.common.table prints it: name, value, baseline, unit and ratio
    as measured; target and met as recorded, except a row shown as information (target `info`, met `-`), whose
    target the benchmark retired after the run (bench/real_size.py's raw-disk rows)."""
    import json

    tables = _bench_tables()
    assert [source for source, _ in tables] == ["bench/results.json", "bench/results-cuda.json"]
    for source, rows in tables:
        recorded = {r["name"]: r for r in json.loads((ROOT / source).read_text())}
        assert len(rows) >= 4
        for name, value, baseline, unit, ratio, *target, met in rows:
            r = recorded[name]
            assert [value, baseline, unit, ratio] == [f"{r['value']:.4g}", f"{r['baseline']:.4g}", r["unit"],
                                                      f"{r['ratio']:.3f}"], (source, name)
            if target == ["info"]:
                assert met == "-" and "_vs_raw_" in name, (source, name)
            else:
                shown = "-" if r["target"] == "info" else "yes" if r["met"] else "NO"
                assert [" ".join(target), met] == [r["target"], shown], (source, name)
