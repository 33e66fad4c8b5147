"""Teachers named by Hub id, with no network: every command resolves them through pipeline/hub.py from a local Hub
cache built by hand (tests/hub_cache.py), and says in one line what to do when neither the Hub nor a cached copy
is there."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from cache import format as F
from conftest import ROOT, TINY_CACHE_ARGS
from hub_cache import A14B_CONFIGS, A14B_ID, add_snapshot, hub_env, use_hub_here
from pipeline.cli import main
from pipeline.errors import UserError
from pipeline.hub import CONFIGS, teacher_folder

TINY_ID = "wandistiller-test/tiny-wan"
MAIN, OTHER = "a" * 40, "b" * 40  # commits: main, and another revision holding the one-transformer (Wan 2.1) teacher
STUDENT = str(ROOT / "configs" / "student-tiny.json")
WANDISTILLER = str(Path(sys.executable).parent / "wandistiller")


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def cli(env: dict, *args) -> subprocess.CompletedProcess:
    """The CLI in a process of its own: huggingface_hub reads HF_HOME and HF_HUB_OFFLINE when it is imported."""
    return subprocess.run([WANDISTILLER, *map(str, args)], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=300)


def assert_one_line(r: subprocess.CompletedProcess, *needles: str) -> str:
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in r.stderr, r.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def hub_home(tiny_teacher_factory, tmp_path_factory) -> Path:
    """HF_HOME with the tiny Wan 2.2 teacher (main) and the Wan 2.1 one (commit OTHER) under TINY_ID, and the A14B
    configs alone under its real id."""
    home = tmp_path_factory.mktemp("hf-home")
    add_snapshot(home, TINY_ID, tiny_teacher_factory("wan2.2"), MAIN)
    add_snapshot(home, TINY_ID, tiny_teacher_factory("wan2.1"), OTHER, branch=None)
    add_snapshot(home, A14B_ID, A14B_CONFIGS, MAIN)
    return home


@pytest.fixture
def offline(hub_home, monkeypatch) -> Path:
    use_hub_here(monkeypatch, hub_home)
    return hub_home


def test_a_hub_id_resolves_to_its_snapshot_and_revision(offline):
    snap = offline / "hub" / f"models--{TINY_ID.replace('/', '--')}" / "snapshots"
    assert teacher_folder(TINY_ID) == snap / MAIN
    assert teacher_folder(TINY_ID, OTHER) == snap / OTHER
    assert teacher_folder(A14B_ID, files=CONFIGS) == offline / "hub" / "models--Wan-AI--Wan2.2-T2V-A14B-Diffusers" / \
        "snapshots" / MAIN
    with pytest.raises(UserError, match="applies to a Hub id, and --teacher .* is a local path; drop --revision"):
        teacher_folder(str(snap / MAIN), "main")
    with pytest.raises(UserError, match="does not exist; pass a diffusers folder or a Hub id like"):
        teacher_folder("no/such/folder")
    with pytest.raises(UserError, match="is not in the local Hub cache .* HF_HUB_OFFLINE is set"):
        teacher_folder("wandistiller-test/absent")


def test_a_hub_id_a_file_names_is_taken_from_the_local_cache_and_never_fetched(offline, monkeypatch):
    """A cache's manifest or a run's distill.json/lora.json may come from someone else: the Hub id it names is used
    when this machine already holds it, and refused in one line, with no request made, when it does not (online
    here, the Hub at a closed port: a request would have said it cannot be reached)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    snap = offline / "hub" / f"models--{TINY_ID.replace('/', '--')}" / "snapshots"
    assert teacher_folder(TINY_ID, recorded_in="cache/manifest.json") == snap / MAIN
    with pytest.raises(UserError, match=r"cache/manifest.json names the teacher attacker/evil-vae, a Hub id that is "
                                        r"not in the local Hub cache .* nothing is downloaded because a file says so: "
                                        r"pass --teacher attacker/evil-vae"):
        teacher_folder("attacker/evil-vae", recorded_in="cache/manifest.json")


def test_plan_takes_a_hub_id_and_its_revision(offline):
    r = invoke("plan", "--teacher", TINY_ID, "--assume-gpus", "none", "--height", "64", "--width", "64", "--json")
    assert r.exit_code == 0, r.output
    p = json.loads(r.output)
    assert p["teacher"] == TINY_ID and f"revision main, configs from {offline}" in p["source"]
    assert {c["name"] for c in p["components"]} >= {"transformer", "transformer_2"}
    r = invoke("plan", "--teacher", TINY_ID, "--revision", OTHER, "--assume-gpus", "none", "--height", "64",
               "--width", "64", "--json")
    p = json.loads(r.output)
    assert "transformer_2" not in {c["name"] for c in p["components"]} and f"revision {OTHER}" in p["source"]
    assert p["launch"]["commands"][0]["argv"][:6] == ["wandistiller", "teacher-cache", "--teacher", TINY_ID,
                                                      "--revision", OTHER]


def test_a_cached_copy_of_the_configs_alone_is_refused_for_weights(offline):
    r = invoke("teacher-cache", "--teacher", A14B_ID, "--prompts", ROOT / "data" / "prompts.txt", "--out",
               offline / "never", "--placement", "cpu")
    assert r.exit_code == 2 and "not a complete Wan pipeline: missing" in r.output, r.output
    assert "text_encoder/*.safetensors, transformer/*.safetensors" in r.output
    assert "the local Hub cache holds only part of it" in r.output and f"hf download {A14B_ID}" in r.output


@pytest.mark.slow
def test_no_network_and_no_cached_copy_is_one_line(tmp_path):
    """Offline with an empty cache, and 'online' with the Hub unreachable (a closed local port stands for it)."""
    args = ("plan", "--teacher", A14B_ID, "--gpus-per-node", "8", "--gpu-memory", "80GiB")
    line = assert_one_line(cli(hub_env(tmp_path), *args), A14B_ID, "not in the local Hub cache", "HF_HUB_OFFLINE is set",
                           f"`hf download {A14B_ID} --include 'model_index.json'")
    assert str(tmp_path / "hub") in line
    assert_one_line(cli(hub_env(tmp_path, offline=False, HF_ENDPOINT="http://127.0.0.1:9"), *args),
                    "the Hub cannot be reached")


@pytest.mark.slow
def test_every_command_that_names_a_teacher_takes_its_hub_id(offline, prompts_file, tmp_path):
    """teacher-cache, train-student --init-from-teacher, sample, eval and export, with the teacher's Hub id (sample
    and eval as distill.json and the manifest recorded it)."""
    cache, run = tmp_path / "cache", tmp_path / "run"
    tiny = [f"--{k.replace('_', '-')}={v}" for k, v in TINY_CACHE_ARGS.items()]
    r = invoke("teacher-cache", "--teacher", TINY_ID, "--prompts", prompts_file, "--out", cache, "--placement", "cpu",
               *tiny)
    assert r.exit_code == 0, r.output
    manifest = json.loads((cache / F.MANIFEST).read_text())
    assert manifest["teacher"] == TINY_ID and manifest["teacher_path"].endswith(MAIN)
    r = invoke("train-student", "--cache", cache, "--student-config", STUDENT, "--out", run, "--max-steps", "2",
               "--batch-size", "4", "--num-workers", "0", "--device", "cpu", "--init-from-teacher", TINY_ID,
               "--revision", "main", "--holdout-prompts", "1")
    assert r.exit_code == 0 and f"from {TINY_ID}" in r.output, r.output
    r = invoke("sample", "--student", run, "--prompts", prompts_file, "--out", tmp_path / "grid.png",
               "--max-prompts", "1", "--device", "cpu")
    assert r.exit_code == 0 and (tmp_path / "grid.png").is_file(), r.output
    r = invoke("eval", "--student", run, "--cache", cache, "--device", "cpu", "--timing-runs", "1",
               "--report", tmp_path / "eval.json")
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "eval.json").read_text())["timing"]["teacher_path"].endswith(MAIN)
    r = invoke("export", "--student", run, "--teacher", TINY_ID, "--out", tmp_path / "pipe")
    assert r.exit_code == 0 and (tmp_path / "pipe" / "model_index.json").is_file(), r.output
    r = invoke("export", "--student", run, "--teacher", TINY_ID, "--revision", "v9", "--out", tmp_path / "pipe2")
    assert r.exit_code == 2 and f"{TINY_ID} at revision v9 is not in the local Hub cache" in r.output, r.output
