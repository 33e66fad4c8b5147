"""A run folder someone else made, as `sample`, `eval` and `export` take it: records that name paths or values no
run of a Wan teacher has, JSON nested past any record's depth, links planted where the commands write, and weights
that are not what the run's records say (another shape, another rank, a pickle). Each is refused in one `error:`
line naming the file, before a model loads, and nothing outside the run is read, written or executed (or, for a
link planted at an output's name, the link is replaced and its target kept)."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import sys
from pathlib import Path

import pytest
import torch

from conftest import TEST_PROMPTS
from pipeline.artifact import DISTILL, LORA_JSON, METRICS, STUDENT, LoraRecord, RunLayout, lora_file
from test_sample import assert_one_line_error, invoke, tiny_student, write_run

pytestmark = pytest.mark.timeout(300)  # a FIFO read the old way blocks for ever: fail instead


@pytest.fixture(scope="module")
def compact_run(tiny_cache, tiny_teacher, tmp_path_factory) -> Path:
    """An untrained tiny student saved as train-student saves one (not fitted: these tests never get that far)."""
    return write_run(tmp_path_factory.mktemp("compact") / "run", tiny_student(), tiny_cache, tiny_teacher)


@pytest.fixture(scope="module")
def lora_run(compact_run, tiny_teacher, tmp_path_factory) -> Path:
    """A rank-4 LoRA run of the tiny teacher's two experts, saved by the student's own `save_pretrained`."""
    from diffusers import WanTransformer3DModel

    from pipeline.lora_experts import LoraExperts, add_adapter
    from pipeline.registries import LORA_TARGETS

    run = tmp_path_factory.mktemp("lora") / "run"
    experts = ["transformer", "transformer_2"]
    record = LoraRecord(teacher=str(tiny_teacher), revision=None, experts=experts, trained=experts,
                        files={c: lora_file(c, 2) for c in experts}, boundary_ratio=0.875, boundary_timestep=875.0,
                        rank=4, alpha=4.0, targets=LORA_TARGETS.split(","))
    models = {}
    for c in experts:
        models[c] = WanTransformer3DModel.from_pretrained(tiny_teacher / c)
        add_adapter(models[c], 4, 4.0, tuple(record.targets))
    LoraExperts(models, 875.0, record).save_pretrained(run / STUDENT)
    distill = json.loads((compact_run / DISTILL).read_text()) | {"lora": record.to_json()}
    (run / DISTILL).write_text(json.dumps(distill))
    return run


@pytest.fixture
def prompts(tmp_path) -> Path:
    p = tmp_path / "one.txt"
    p.write_text(TEST_PROMPTS[0] + "\n")
    return p


def copy_run(run: Path, tmp_path: Path) -> Path:
    dst = tmp_path / run.parent.name / "run"
    shutil.copytree(run, dst)
    return dst


def edit(path: Path, **fields) -> None:
    path.write_text(json.dumps(json.loads(path.read_text()) | fields))


def sample(run: Path, prompts: Path, out: Path, teacher: Path, *extra):
    return invoke(["sample", "--student", run, "--teacher", teacher, "--prompts", prompts, "--out", out, *extra])


# -- lora.json: its adapter files are the names train-student gives them, never a path ---------------------------

@pytest.mark.parametrize("name", ["../../home/thesis.tex", "/etc/passwd", "high_noise_model.safetensors/../x"])
def test_a_lora_file_named_as_a_path_is_refused_and_nothing_is_exported(lora_run, tmp_path, home, name):
    run = copy_run(lora_run, tmp_path)
    edit(run / STUDENT / LORA_JSON, files={"transformer": name, "transformer_2": "low_noise_model.safetensors"})
    out = tmp_path / "export"
    assert_one_line_error(invoke(["export", "--student", run, "--out", out]), str(run / STUDENT / LORA_JSON),
                          "'files'", "high_noise_model.safetensors")
    assert not out.exists() and (home / "thesis.tex").read_text() == "precious"


@pytest.mark.parametrize("field,value,needle", [
    ("rank", 10**6, "'rank' is 1000000"), ("alpha", float("nan"), "'alpha' is nan"),
    ("experts", ["transformer", "transformer"], "'experts'"), ("targets", [], "'targets' is []"),
])
def test_a_lora_record_out_of_range_is_refused(lora_run, tmp_path, prompts, tiny_teacher, field, value, needle):
    run = copy_run(lora_run, tmp_path)
    edit(run / STUDENT / LORA_JSON, **{field: value})
    assert_one_line_error(sample(run, prompts, tmp_path / "g.png", tiny_teacher), LORA_JSON, needle)
    assert not (tmp_path / "g.png").exists()


# -- distill.json: every number sample, eval and export compute with is one a Wan teacher takes ------------------

@pytest.mark.parametrize("field,value", [
    ("student_steps", 10**9), ("max_sequence_length", 10**8), ("frames", 10**9), ("height", 10**9),
    ("width", 2**40), ("steps", 0), ("latent_shape", [16, 1, 8]), ("guidance", float("inf")),
    ("negative_prompt", "x" * 10**6), ("timesteps", []), ("init_seed", 10**30),
])
def test_distill_values_no_wan_teacher_takes_are_refused(compact_run, tmp_path, prompts, tiny_teacher, field, value):
    run = copy_run(compact_run, tmp_path)
    edit(run / DISTILL, **{field: value})
    assert_one_line_error(sample(run, prompts, tmp_path / "g.png", tiny_teacher), str(run / DISTILL),
                          f"field {field!r}")
    assert_one_line_error(invoke(["export", "--student", run, "--out", tmp_path / "e"]), str(run / DISTILL))


# -- records read through the trust boundary: bounded, nesting capped, no FIFO waited on, no link followed --------

def _deep(n: int = 100_000) -> str:
    return "[" * n + "]" * n


@pytest.mark.parametrize("victim", [DISTILL, f"{STUDENT}/{LORA_JSON}", f"{STUDENT}/config.json"])
@pytest.mark.parametrize("kind", ["deep", "fifo", "link", "sparse"])
def test_a_hostile_record_is_refused_in_one_line(compact_run, lora_run, tmp_path, home, prompts, tiny_teacher,
                                                 victim, kind):
    run = copy_run(lora_run if LORA_JSON in victim else compact_run, tmp_path)
    path = run / victim
    path.unlink()
    if kind == "deep":
        path.write_text(_deep())
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "link":
        path.symlink_to(home / "thesis.tex")
    else:  # 20 GB of nothing: refused by its size, never read
        with open(path, "wb") as f:
            f.truncate(20 << 30)
    r = sample(run, prompts, tmp_path / "g.png", tiny_teacher)
    needle = {"deep": "nests deeper", "fifo": "FIFO", "link": "symbolic link", "sparse": "bytes, more than"}[kind]
    assert_one_line_error(r, str(path), needle)
    assert "RecursionError" not in r.output and (home / "thesis.tex").read_text() == "precious"


def test_a_student_folder_that_is_a_link_is_refused(compact_run, tmp_path, prompts, tiny_teacher):
    run = copy_run(compact_run, tmp_path)
    elsewhere = tmp_path / "elsewhere"
    (run / STUDENT).rename(elsewhere)
    (run / STUDENT).symlink_to(elsewhere, target_is_directory=True)
    assert_one_line_error(sample(run, prompts, tmp_path / "g.png", tiny_teacher), str(run / STUDENT),
                          "symbolic link")


def test_metrics_nested_or_linked_neither_recurse_nor_are_followed(tmp_path, home):
    from cache.cache_error import UnsafeFileError
    from stages.train_student.loop import plot_losses, truncate_metrics

    good = [json.dumps({"type": "train", "step": s, "loss": 1.0}) for s in (1, 2)]
    (tmp_path / METRICS).write_text("\n".join([good[0], _deep(), good[1], '{"type": "train", "step": "3"}']) + "\n")
    truncate_metrics(tmp_path, 5)  # a line no record of ours: dropped as a torn one is
    assert (tmp_path / METRICS).read_text() == "".join(line + "\n" for line in good)
    (tmp_path / "loss.png").symlink_to(home / "thesis.tex")
    plot_losses(tmp_path)  # the link at loss.png is replaced, its target kept
    assert not (tmp_path / "loss.png").is_symlink() and (home / "thesis.tex").read_text() == "precious"
    (tmp_path / METRICS).unlink()
    (tmp_path / METRICS).symlink_to(home / "thesis.tex")
    with pytest.raises(UnsafeFileError, match="symbolic link"):
        truncate_metrics(tmp_path, 5)
    assert (home / "thesis.tex").read_text() == "precious"


@pytest.mark.parametrize("planted,want", [("fifo", None), ('{"id": "../../home"}', None), (_deep(), None),
                                           ('{"id": "a1b2c3d4"}', "a1b2c3d4")], ids=["fifo", "path", "deep", "own"])
def test_a_resumed_wandb_run_takes_only_an_id_from_its_record(tmp_path, monkeypatch, planted, want):
    import types

    from pipeline.artifact import WANDB_RUN
    from stages.train_student.tracking import WandbTracker

    asked = {}
    run = types.SimpleNamespace(id="new", project="p", dir=str(tmp_path / "wandb" / "run"))
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(
        init=lambda **kw: asked.update(kw) or run))
    if planted == "fifo":
        os.mkfifo(tmp_path / WANDB_RUN)
    else:
        (tmp_path / WANDB_RUN).write_text(planted)
    WandbTracker(RunLayout(tmp_path), {}, resume_step=3)  # (a FIFO is never waited on)
    assert asked["id"] == want and json.loads((tmp_path / WANDB_RUN).read_text())["id"] == "new"


# -- what sample and eval write: never through a planted link, their folders made before the long work ----------

def test_sample_replaces_links_planted_at_its_outputs(compact_run, tmp_path, home, prompts, tiny_teacher):
    out = tmp_path / "grids" / "g.png"
    out.parent.mkdir()
    for name in ("g.png", "g.png.json"):
        (out.parent / name).symlink_to(home / "thesis.tex")
    r = sample(compact_run, prompts, out, tiny_teacher, "--device", "cpu")
    assert r.exit_code == 0, r.output
    assert (home / "thesis.tex").read_text() == "precious" and sorted(os.listdir(home)) == ["thesis.tex"]
    assert not out.is_symlink() and json.loads(out.with_name("g.png.json").read_text())["rows"] == 1


def test_sample_checks_its_output_folders_before_any_model_loads(compact_run, tmp_path, home, prompts,
                                                                 tiny_teacher):
    (tmp_path / "a-file").write_text("mine")
    assert_one_line_error(sample(compact_run, prompts, tmp_path / "a-file" / "g.png", tiny_teacher),
                          "the folder of --out", "a-file")
    assert (tmp_path / "a-file").read_text() == "mine"
    video = copy_run(compact_run, tmp_path)  # a video run: its clips go to a folder beside the grid
    edit(video / DISTILL, frames=5, latent_shape=[16, 2, 8, 8])
    (tmp_path / "g-videos").symlink_to(home, target_is_directory=True)
    assert_one_line_error(sample(video, prompts, tmp_path / "g.png", tiny_teacher), "the video folder",
                          str(tmp_path / "g-videos"), "symbolic link")
    assert sorted(os.listdir(home)) == ["thesis.tex"] and not (tmp_path / "g.png").exists()


def test_eval_replaces_links_planted_at_its_report_and_plot(compact_run, tiny_cache, tmp_path, home):
    run = copy_run(compact_run, tmp_path)
    for name in ("eval.json", "eval.png"):
        (run / name).symlink_to(home / name)  # (dangling: O_CREAT through it would create the victim's file)
    (home / "eval.png").write_text("precious")
    r = invoke(["eval", "--student", run, "--cache", tiny_cache, "--max-prompts", 1, "--no-teacher-timing",
                "--device", "cpu"])
    assert r.exit_code == 0, r.output
    assert sorted(os.listdir(home)) == ["eval.png", "thesis.tex"] and (home / "eval.png").read_text() == "precious"
    assert not (run / "eval.png").is_symlink() and json.loads((run / "eval.json").read_text())["trajectories"] >= 1
    # what eval leaves in a run folder never blocks its `--resume` (the fixture's own config.json aside)
    assert not [e for e in RunLayout(run).foreign(limit=99) if e.startswith("eval")]


# -- weights that are not what the run's records say ----------------------------------------------------------

class _Payload:
    """What a pickled weight file can do when torch.load unpickles it: run a command."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("command", ["sample", "export"])
@pytest.mark.parametrize("alone", [False, True], ids=["beside-safetensors", "alone"])
def test_a_pickled_weight_file_is_refused_never_loaded(compact_run, tmp_path, prompts, tiny_teacher, command, alone):
    run = copy_run(compact_run, tmp_path)
    marker = tmp_path / "pwned"
    (run / STUDENT / "diffusion_pytorch_model.bin").write_bytes(pickle.dumps(_Payload(marker)))
    if alone:
        (run / STUDENT / "diffusion_pytorch_model.safetensors").unlink()
    r = (sample(run, prompts, tmp_path / "g.png", tiny_teacher) if command == "sample"
         else invoke(["export", "--student", run, "--out", tmp_path / "e"]))
    assert_one_line_error(r, str(run / STUDENT), "diffusion_pytorch_model.bin", "pickled")
    assert not marker.exists() and not (tmp_path / "e").exists()


def test_student_weights_that_lie_about_their_config_are_refused(compact_run, tmp_path, prompts, tiny_teacher):
    from safetensors.torch import save_file

    run = copy_run(compact_run, tmp_path)
    weights = run / STUDENT / "diffusion_pytorch_model.safetensors"
    narrow = tiny_student(text_dim=16).state_dict()  # (another text_dim: other shapes)
    save_file(narrow, weights)
    assert_one_line_error(invoke(["export", "--student", run, "--out", tmp_path / "e"]), str(run / STUDENT),
                          "not what its config.json builds", "condition_embedder.text_embedder")
    save_file({k: v for k, v in narrow.items() if not k.startswith("blocks.")}, weights)
    assert_one_line_error(sample(run, prompts, tmp_path / "g.png", tiny_teacher), "it lacks 'blocks.0.")
    edit(run / STUDENT / "config.json", num_layers=10**6)  # (no model of a million blocks is built to compare)
    assert_one_line_error(sample(run, prompts, tmp_path / "g.png", tiny_teacher), "num_layers 1000000")
    weights.write_bytes((2**60).to_bytes(8, "little") + b"{}")  # a header as long as no file is
    assert_one_line_error(sample(run, prompts, tmp_path / "g.png", tiny_teacher), str(weights),
                          "not a safetensors file")
    assert not (tmp_path / "e").exists() and not (tmp_path / "g.png").exists()


@pytest.mark.parametrize("lie", ["rank", "targets", "keys"])
def test_lora_files_that_disagree_with_lora_json_are_refused(lora_run, tmp_path, lie):
    from safetensors.torch import load_file, save_file

    run = copy_run(lora_run, tmp_path)
    if lie == "rank":
        edit(run / STUDENT / LORA_JSON, rank=8)
    elif lie == "targets":
        edit(run / STUDENT / LORA_JSON, targets=["to_q"])
    else:
        path = run / STUDENT / lora_file("transformer_2", 2)
        state = load_file(path)
        state["transformer.blocks.0.attn1.to_q.lora_A.weight"] = torch.zeros(4, 7)
        save_file(state, path)
    assert_one_line_error(invoke(["export", "--student", run, "--out", tmp_path / "e"]), "LoRA file",
                          str(run / STUDENT), "lora.json describes")
    assert not (tmp_path / "e").exists()


def test_the_run_fixtures_are_accepted(compact_run, lora_run):
    from stages.sample.models import find_student

    assert find_student(str(compact_run)).weights == "raw"
    lora = find_student(str(lora_run))
    assert lora.lora is not None and lora.lora.rank == 4
