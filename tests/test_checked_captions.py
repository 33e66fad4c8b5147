"""eval --checked-captions: the drawings of --attributes' captions scored against another file's, caption i for
caption i (what a recolouring LoRA'd teacher is meant to draw). Its refusals end in one line; a copy of --attributes
scores what --attributes alone does, on the tiny teacher's real drawings; and with the models' drawing stood in for by
shapes.render of the drawn caption (the tiny random teacher draws noise, which no checked file could tell apart), a
file with every shape recoloured takes the shape-colour score from all right to none, while the drawing still gets
--attributes' captions."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from pipeline.prompts import read_prompt_file
from pipeline.shapes import COLOURS, Scene, Shape, parse_caption, render
from stages.sample import eval_attributes

from test_sample import assert_one_line_error, invoke, tiny_student, write_run

SCORES = ("background", "shape_colour", "position", "colour", "all")


def recoloured(caption: str) -> str:
    """`caption` with each shape's colour changed to one the scene does not hold (nor its background)."""
    scene = parse_caption(caption)
    taken = {s.colour for s in scene.shapes} | {scene.background}
    free = [c for c in COLOURS if c not in taken]
    return Scene(tuple(Shape(free[i], s.shape, s.size, s.position) for i, s in enumerate(scene.shapes)),
                 scene.background).caption


@pytest.fixture(scope="module")
def files(tiny_cache, tiny_teacher, tmp_path_factory):
    """(untrained student run, --attributes file of 3 held-out shapes captions, its copy, its recoloured twin)."""
    folder = tmp_path_factory.mktemp("checked")
    run = write_run(folder / "run", tiny_student(), tiny_cache, tiny_teacher)
    caps = read_prompt_file("data/shapes-heldout.txt")[:3]
    paths = folder / "caps.txt", folder / "copy.txt", folder / "recoloured.txt"
    for p, lines in zip(paths, (caps, caps, [recoloured(c) for c in caps])):
        p.write_text("\n".join(lines) + "\n")
    return run, *paths


def attributes(run, cache, report, caps, checked=None) -> dict:
    r = invoke(["eval", "--student", run, "--cache", cache, "--report", report, "--no-teacher-timing",
                "--attributes", caps, "--attribute-grid", 0, *(["--checked-captions", checked] if checked else [])])
    assert r.exit_code == 0, r.output
    return json.loads(report.read_text())["attributes"]


def test_refusals(files, tiny_cache, tmp_path):
    run, caps, _, _ = files
    base = ["eval", "--student", run, "--cache", tiny_cache, "--no-teacher-timing"]
    assert_one_line_error(invoke(base + ["--checked-captions", caps]), "checked-captions", "--attributes FILE")
    short = tmp_path / "short.txt"
    short.write_text("\n".join(read_prompt_file(caps)[:2]) + "\n")
    assert_one_line_error(invoke(base + ["--attributes", caps, "--checked-captions", short]),
                          "short.txt holds 2 captions", "caps.txt 3", "one checked caption per --attributes caption")
    bad = tmp_path / "bad.txt"
    bad.write_text("\n".join(read_prompt_file(caps)[:2] + ["a red circle somewhere nice"]) + "\n")
    assert_one_line_error(invoke(base + ["--attributes", caps, "--checked-captions", bad]),
                          "bad.txt caption 3", "not a shapes caption", "grammar")
    twice = tmp_path / "twice.txt"  # (eval draws a repeated caption once: caption i would no longer be line i)
    twice.write_text("\n".join(read_prompt_file(caps)[:2] * 2) + "\n")
    assert_one_line_error(invoke(base + ["--attributes", twice, "--checked-captions", twice]),
                          "lists 2 caption(s) more than once", "drop the repeats")


@pytest.mark.slow
def test_a_copy_scores_the_real_drawings_as_attributes_alone(files, tiny_cache, tmp_path):
    run, caps, copy, _ = files
    alone = attributes(run, tiny_cache, tmp_path / "alone.json", caps)
    checked = attributes(run, tiny_cache, tmp_path / "copy.json", caps, copy)
    assert "checked_captions" not in alone and checked["checked_captions"] == str(copy)
    for who in ("teacher", "student", "untrained"):
        assert who not in alone or alone[who] == checked[who]
    assert alone["teacher"]["images"] == 3 and alone["vs_teacher"] == checked["vs_teacher"]


@pytest.mark.slow
def test_scores_follow_the_checked_captions(files, tiny_cache, tmp_path, monkeypatch):
    run, caps, _, recolour = files
    drawn = []

    def rendered(teacher, entries, captions, *_, **__):  # every model draws its caption's scene exactly
        drawn.append(list(captions))
        cs = [np.asarray(render(parse_caption(c), random.Random(i)))[None] for i, c in enumerate(captions)]
        return {"teacher": cs, **{e.label: cs for e in entries}}, None

    monkeypatch.setattr(eval_attributes, "_draw_all", rendered)
    right = attributes(run, tiny_cache, tmp_path / "right.json", caps)["teacher"]
    wrong = attributes(run, tiny_cache, tmp_path / "wrong.json", caps, recolour)["teacher"]
    assert drawn == [read_prompt_file(caps)] * 2  # drawn from --attributes' captions both times
    assert right["shape_colour"] == 1.0 and wrong["shape_colour"] == 0.0 and wrong["colour"] == 0.0
    assert wrong["background"] == right["background"] == 1.0
