"""Small things a new user met on the road to a video LoRA: Wan's original repository named instead of its
diffusers copy, a Hub snapshot of configs alone that an offline dry run called valid, a run whose last step had no
checkpoint, tiny-teacher weights only their owner could read, and a front page that said "text-to-image" alone."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from cache.atomic import publish_dir
from conftest import ROOT
from hub_cache import A14B_CONFIGS, A14B_ID, add_snapshot, use_hub_here
from pipeline.cli import main
from pipeline.errors import UserError
from pipeline.hub import FIRST_TRANSFORMER, teacher_folder
from stages.sample.models import teacher_dir
from stages.teacher_cache.teacher import resolve_teacher

TINY = str(ROOT / "configs" / "student-tiny.json")
MAIN = "a" * 40
WEIGHTS = "diffusion_pytorch_model.safetensors"


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def one_line(r, *needles: str) -> str:
    """The one `error:` line of a refused command (exit 2), holding each of `needles`."""
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def hub_home(tiny_teacher, tmp_path_factory) -> Path:
    """HF_HOME holding the tiny teacher under its own id and as ORG/tiny-Diffusers, beside ORG/tiny: a repository in
    another layout (one config, no model_index.json); and the A14B configs alone, no weight file."""
    home = tmp_path_factory.mktemp("hf-home")
    add_snapshot(home, "wandistiller-test/tiny-wan", tiny_teacher, MAIN)
    add_snapshot(home, "wandistiller-test/tiny-Diffusers", tiny_teacher, MAIN)
    original = tmp_path_factory.mktemp("original")
    (original / "low_noise_model").mkdir()
    shutil.copy(tiny_teacher / "transformer" / "config.json", original / "low_noise_model" / "config.json")
    add_snapshot(home, "wandistiller-test/tiny", original, MAIN)
    add_snapshot(home, A14B_ID, A14B_CONFIGS, MAIN)
    return home


@pytest.fixture
def offline(hub_home, monkeypatch) -> Path:
    use_hub_here(monkeypatch, hub_home)
    return hub_home


# -- "did you mean ...-Diffusers" ---------------------------------------------------------------------------------

def test_wans_original_repository_is_refused_naming_its_diffusers_copy(offline, prompts_file, tmp_path):
    """Before anything is fetched (the original A14B is ~126 GB), by every command that resolves a teacher: they
    all go through pipeline/hub.py's teacher_folder."""
    want = "is not a diffusers pipeline (it has no model_index.json); did you mean --teacher " \
           "Wan-AI/Wan2.2-T2V-A14B-Diffusers?"
    one_line(invoke("plan", "--teacher", "Wan-AI/Wan2.2-T2V-A14B", "--assume-gpus", "1x80GiB"), want)
    one_line(invoke("teacher-cache", "--teacher", "Wan-AI/Wan2.2-T2V-A14B", "--prompts", prompts_file, "--out",
                    tmp_path / "c", "--dry-run"), want)
    with pytest.raises(UserError, match=r"did you mean --lora-of Wan-AI/Wan2.2-TI2V-5B-Diffusers\?$"):
        teacher_folder("wan-ai/wan2.2-ti2v-5b", files=FIRST_TRANSFORMER, flag="--lora-of")
    with pytest.raises(UserError, match=r"did you mean --teacher Wan-AI/Wan2.1-T2V-1.3B-Diffusers\?$"):
        teacher_dir("Wan-AI/Wan2.1-T2V-1.3B", recorded_in="run/distill.json")  # sample, eval, export
    assert not (offline / "hub" / "models--Wan-AI--Wan2.2-T2V-A14B").exists()


def test_an_id_without_model_index_names_the_diffusers_copy_the_cache_holds(offline):
    with pytest.raises(UserError, match=r"--teacher wandistiller-test/tiny is not a diffusers pipeline .*did you "
                                        r"mean --teacher wandistiller-test/tiny-Diffusers\?$"):
        resolve_teacher("wandistiller-test/tiny")  # cached, another layout
    with pytest.raises(UserError, match=r"did you mean --teacher wandistiller-test/tiny-Diffusers\?$"):
        teacher_folder("wandistiller-test/tiny", files=FIRST_TRANSFORMER)
    with pytest.raises(UserError, match="is not in the local Hub cache"):  # no copy cached: the usual line
        teacher_folder("wandistiller-test/tiny-wan-other")
    assert teacher_folder("wandistiller-test/tiny-Diffusers").name == MAIN  # a diffusers pipeline is taken as it is


# -- a configs-only snapshot under HF_HUB_OFFLINE -----------------------------------------------------------------

def test_an_offline_dry_run_checks_the_weight_files_and_plan_still_reads_configs_alone(offline, prompts_file,
                                                                                         tmp_path):
    line = one_line(invoke("teacher-cache", "--teacher", A14B_ID, "--prompts", prompts_file, "--out", tmp_path / "c",
                           "--dry-run", "--placement", "cpu"),
                    "not a complete Wan pipeline: missing", "text_encoder/*.safetensors",
                    "transformer/*.safetensors, transformer_2/*.safetensors", f"`hf download {A14B_ID}`",
                    "unset HF_HUB_OFFLINE")
    assert "tokenizer" in line  # (its folder too)
    assert not (tmp_path / "c").exists()
    r = invoke("plan", "--teacher", A14B_ID, "--assume-gpus", "8x80GiB", "--step-time", "8", "--json")
    assert r.exit_code == 0 and json.loads(r.output)["teacher"] == A14B_ID, r.output
    r = invoke("teacher-cache", "--teacher", "wandistiller-test/tiny-wan", "--prompts", prompts_file, "--out",
               tmp_path / "c", "--dry-run", "--placement", "cpu", "--height", "64", "--width", "64")
    assert r.exit_code == 0 and "the command is valid" in r.output, r.output


def _sharded(teacher: Path, dest: Path) -> Path:
    """A copy of `teacher` whose transformer's weights are two shards and an index, as diffusers writes big ones."""
    shutil.copytree(teacher, dest)
    folder = dest / "transformer"
    tensors = load_file(folder / WEIGHTS)
    (folder / WEIGHTS).unlink()
    names = sorted(tensors)
    halves = {f"diffusion_pytorch_model-0000{i + 1}-of-00002.safetensors": names[i::2] for i in range(2)}
    for file, part in halves.items():
        save_file({k: tensors[k] for k in part}, folder / file)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (folder / f"{WEIGHTS}.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": {k: f for f, part in halves.items() for k in part}}))
    return folder / "diffusion_pytorch_model-00002-of-00002.safetensors"


def test_a_shard_the_index_names_is_checked_present_and_whole(tiny_teacher, prompts_file, tmp_path):
    shard = _sharded(tiny_teacher, tmp_path / "teacher")
    assert resolve_teacher(str(tmp_path / "teacher")).experts == ("transformer", "transformer_2")
    whole = shard.read_bytes()
    shard.write_bytes(whole[:len(whole) // 2])  # a download cut short
    with pytest.raises(UserError, match=r"missing transformer/ weights \(\d[\d,]* of the [\d,]+ bytes its index "
                                        r"names: a file cut short\)"):
        resolve_teacher(str(tmp_path / "teacher"))
    shard.unlink()
    one_line(invoke("teacher-cache", "--teacher", tmp_path / "teacher", "--prompts", prompts_file, "--out",
                    tmp_path / "c", "--dry-run", "--placement", "cpu"),
             "missing transformer/diffusion_pytorch_model-00002-of-00002.safetensors in")


# -- the last step's checkpoint -----------------------------------------------------------------------------------

def test_a_run_checkpoints_its_last_step_so_resume_finds_it_finished_or_extends_it(tiny_cache, tmp_path):
    """7 steps, a checkpoint every 3: 3, 6 and the last. --resume then does nothing; --max-steps 9 goes on from 7."""
    out = tmp_path / "run"
    args = ("train-student", "--cache", tiny_cache, "--student-config", TINY, "--out", out, "--num-workers", "0",
            "--batch-size", "4", "--device", "cpu", "--checkpoint-every", "3", "--keep-checkpoints", "3",
            "--report-to", "none")
    r = invoke(*args, "--max-steps", "7")
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000003", "step-00000006",
                                                                       "step-00000007"]
    weights = (out / "student" / WEIGHTS).stat()
    r = invoke(*args, "--max-steps", "7", "--resume")
    assert r.exit_code == 0 and "is finished (7 steps" in r.output and "nothing to do" in r.output, r.output
    assert (out / "student" / WEIGHTS).stat().st_mtime_ns == weights.st_mtime_ns
    r = invoke(*args, "--max-steps", "9", "--resume")
    assert r.exit_code == 0 and "step-00000007 (step 7," in r.output, r.output
    assert json.loads((out / "distill.json").read_text())["optimizer_steps"] == 9
    assert sorted(p.name for p in (out / "checkpoints").iterdir())[-1] == "step-00000009"


# -- published files get the umask's modes ------------------------------------------------------------------------

@pytest.fixture
def umask_of():
    """umask_of(mask): set the process's umask for the test; restored after it."""
    before = os.umask(0o022)

    def set_mask(mask: int) -> int:
        os.umask(mask)
        return mask

    yield set_mask
    os.umask(before)


def modes(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_mode & 0o777 for p in folder.rglob("*")}


@pytest.mark.parametrize("mask", [0o022, 0o002, 0o077])
def test_a_published_folder_has_the_umasks_modes(umask_of, tmp_path, mask):
    """publish_dir gives every file below the folder the mode open() would: safetensors writes 0600 whatever the
    umask, so a folder of weights written by anything is fixed where it is published, not at each writer."""
    umask_of(mask)
    tmp = tmp_path / "out.tmp"
    (tmp / "transformer").mkdir(parents=True)
    save_file({"w": load_file(ROOT / "data" / "tiny-teacher-pretrained" / "transformer" / WEIGHTS)[
        "proj_out.bias"]}, tmp / "transformer" / WEIGHTS)
    (tmp / "model_index.json").write_text("{}")
    assert (tmp / "transformer" / WEIGHTS).stat().st_mode & 0o777 == 0o600  # what safetensors does
    publish_dir(tmp, tmp_path / "out")
    assert modes(tmp_path / "out") == {"transformer": 0o777 & ~mask, "transformer/" + WEIGHTS: 0o666 & ~mask,
                                       "model_index.json": 0o666 & ~mask}


def test_tiny_teacher_weights_are_readable_under_umask_022(umask_of, tmp_path):
    umask_of(0o022)
    r = invoke("tiny-teacher", "--out", tmp_path / "t", "--variant", "wan2.1")
    assert r.exit_code == 0, r.output
    found = modes(tmp_path / "t")
    assert found["transformer/" + WEIGHTS] == 0o644 and set(found.values()) == {0o644, 0o755}, found


# -- what the project says it does --------------------------------------------------------------------------------

def test_the_front_page_and_help_say_image_and_video_students():
    first = (ROOT / "README.md").read_text().split("\n\n")[1]
    help_text = invoke("--help").output.split("\n\n")[1]
    for text in (first, help_text):
        assert all(w in text for w in ("text-to-image", "text-to-video", "image-to-video", "LoRA")), text
