"""What an export, a run and --val-decode do with inputs and machines that are not the user's own: no local path in
any file an export writes (`--push-to-hub` uploads them all), a cache that cannot choose what is downloaded, a
teacher's file modes that do not pass into an export, and weights that colleagues on shared storage can read
(0o666 less the umask, not safetensors' own 0600)."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
from pathlib import Path

import pytest
from click.testing import CliRunner

from conftest import ROOT
from pipeline.cli import main

pytestmark = pytest.mark.slow

TINY = ROOT / "configs" / "student-tiny.json"
TRAIN = ["--max-steps", 2, "--batch-size", 4, "--warmup-steps", 0, "--device", "cpu", "--report-to", "none"]


def invoke(args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture
def umask():
    """umask(mask): set the process's umask for the test; the old one comes back after it."""
    old = os.umask(0o022)
    os.umask(old)
    yield os.umask
    os.umask(old)


def local_paths(folder: Path, *roots: Path) -> list[str]:
    """Every text file below `folder` (whatever its name, anything that decodes as UTF-8 but the weights) that names
    a path of this machine: one of `roots`, or an absolute path under a usual top-level folder."""
    found = []
    for f in sorted(folder.rglob("*")):
        if not f.is_file() or f.suffix == ".safetensors":
            continue
        try:
            text = f.read_bytes().decode()
        except UnicodeDecodeError:
            continue
        if any(str(r) in text for r in roots) or re.search(r"(?<![\w.:/])/(tmp|home|work|root|Users|data|var)/", text):
            found.append(str(f.relative_to(folder)))
    return found


def modes(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_mode & 0o777 for p in [folder, *folder.rglob("*")]}


@pytest.fixture(scope="module")
def lora_run(tiny_teacher, tiny_cache, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("lora-run") / "run"
    r = invoke(["train-student", "--cache", tiny_cache, "--lora-of", tiny_teacher, "--out", out, *TRAIN])
    assert r.exit_code == 0, r.output
    return out


# -- D12: no local path in an export ---------------------------------------------------------------------------
@pytest.mark.parametrize("fuse", [False, True], ids=["adapters", "fused"])
def test_a_lora_export_names_no_local_path(lora_run, tiny_teacher, tiny_cache, tmp_path, fuse):
    out = tmp_path / "export"
    r = invoke(["export", "--student", lora_run, "--out", out, *(["--fuse"] if fuse else [])])
    assert r.exit_code == 0, r.output
    assert local_paths(out, tmp_path, lora_run, tiny_teacher, tiny_cache, ROOT, Path.home()) == []
    card = (out / "README.md").read_text()
    if fuse:
        assert 'WanPipeline.from_pretrained("export"' in card
    else:  # the base by its folder's name (no Hub id is known for it), the adapters by the export's
        assert f'WanPipeline.from_pretrained("{tiny_teacher.name}"' in card
        assert 'load_lora_weights("export", weight_name="high_noise_model.safetensors"' in card
        lora = json.loads((out / "lora.json").read_text())
        assert lora["teacher"] == lora["_wandistiller"]["lora"]["teacher"] == tiny_teacher.name
        assert lora["_wandistiller"]["student_run"] == lora_run.name
    distill = json.loads((out / "distill.json").read_text())
    assert distill["teacher"] == distill["lora"]["teacher"] == tiny_teacher.name and distill["teacher_path"] is None
    assert [set(c) for c in distill["caches"]] == [{"fingerprint"}]


def test_a_resaved_teacher_does_not_leak_its_folder_into_a_compact_export(tiny_cache, tiny_teacher, tmp_path):
    """A teacher folder a user loaded and saved again (diffusers writes `_name_or_path`, the folder it was loaded
    from, into every config): the export drops those names."""
    teacher = tmp_path / "teacher"
    shutil.copytree(tiny_teacher, teacher)
    for cfg in teacher.glob("*/config.json"):
        cfg.write_text(json.dumps(json.loads(cfg.read_text()) | {"_name_or_path": str(cfg.parent)}))
    index = teacher / "model_index.json"
    index.write_text(json.dumps(json.loads(index.read_text()) | {"_name_or_path": str(teacher)}))
    run = tmp_path / "run"
    assert invoke(["train-student", "--cache", tiny_cache, "--student-config", TINY, "--out", run, *TRAIN]).exit_code == 0
    out = tmp_path / "export"
    r = invoke(["export", "--student", run, "--teacher", teacher, "--out", out])
    assert r.exit_code == 0, r.output
    assert local_paths(out, tmp_path, teacher, tiny_teacher, tiny_cache, ROOT, Path.home()) == []


# -- D13: a cache does not choose what is downloaded ----------------------------------------------------------
def _hostile_cache(tiny_cache: Path, dest: Path, teacher: str) -> Path:
    """The tiny cache with its manifest naming another teacher: the `teacher` fields are outside the fingerprint, so
    every reader takes it as it is."""
    shutil.copytree(tiny_cache, dest)
    manifest = dest / "manifest.json"
    m = json.loads(manifest.read_text())
    manifest.write_text(json.dumps(m | {"teacher": teacher, "teacher_path": "/nonexistent/wan-teacher"}, indent=2))
    return dest


@pytest.fixture
def no_network(monkeypatch, tmp_path):
    """Every connection this process tries is refused and recorded; the local Hub cache is an empty folder."""
    from huggingface_hub import constants

    tried = []

    def connect(self, address):
        tried.append(address)
        raise OSError("no network in this test")

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    return tried


def test_val_decode_fetches_nothing_a_cache_names(tiny_cache, tiny_teacher, tmp_path, no_network):
    cache = _hostile_cache(tiny_cache, tmp_path / "cache", "attacker/evil-vae")
    val = ["--holdout-prompts", 2, "--val-every", 2, "--val-decode", "--report-to", "tensorboard"]
    args = ["train-student", "--cache", cache, "--student-config", TINY, *TRAIN[:-2], *val]
    r = invoke([*args, "--out", tmp_path / "run"])
    assert r.exit_code == 2 and no_network == []
    assert r.stderr.strip().splitlines() == [
        "error: --val-decode needs the teacher's VAE, and the cache names its teacher only as the Hub id "
        "attacker/evil-vae, whose VAE is not in the local Hub cache; nothing is downloaded because a cache says so: "
        "download its VAE yourself (`hf download attacker/evil-vae --include 'vae/*'`), name the teacher with "
        "--lora-of or --init-from-teacher (a pipeline folder or Hub id), or drop --val-decode"]
    assert not (tmp_path / "run" / "student").exists()

    # The teacher the user names decodes: its VAE, and the grid is logged.
    r = invoke([*args, "--out", tmp_path / "named", "--init-from-teacher", tiny_teacher])
    assert r.exit_code == 0, r.output
    assert f"the teacher's VAE from --init-from-teacher {tiny_teacher} on rank 0" in r.output

    # What the user downloaded into the local Hub cache (`hf download ... --include 'vae/*'`) is used, fetching nothing.
    from huggingface_hub import constants

    repo = Path(constants.HF_HUB_CACHE) / "models--attacker--evil-vae"
    shutil.copytree(tiny_teacher / "vae", repo / "snapshots" / ("0" * 40) / "vae")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    r = invoke([*args, "--out", tmp_path / "cached"])
    assert r.exit_code == 0, r.output
    assert "the teacher's VAE from the local Hub cache's attacker/evil-vae" in r.output and no_network == []


def test_val_decode_refuses_a_teacher_folder_of_another_machine(tiny_cache, tmp_path, no_network):
    cache = _hostile_cache(tiny_cache, tmp_path / "cache", "/nonexistent/wan-teacher")
    r = invoke(["train-student", "--cache", cache, "--student-config", TINY, "--out", tmp_path / "run", *TRAIN[:-2],
                "--holdout-prompts", 2, "--val-every", 2, "--val-decode"])
    assert r.exit_code == 2 and no_network == []
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("error: --val-decode needs the teacher's VAE, and the cache names its teacher only by the "
                           "folder /nonexistent/wan-teacher, which holds no vae/ on this machine;")


# -- D17 and the umask: modes ----------------------------------------------------------------------------------
def test_an_export_takes_the_umask_not_the_teachers_modes(tiny_cache, tiny_teacher, lora_run, tmp_path, umask):
    teacher = tmp_path / "open-teacher"
    shutil.copytree(tiny_teacher, teacher)
    for p in [teacher, *teacher.rglob("*")]:  # a world-writable teacher folder
        p.chmod(0o777 if p.is_dir() else 0o666)
    for p in (lora_run / "student").iterdir():
        p.chmod(0o666)
    umask(0o022)
    run = tmp_path / "run"
    assert invoke(["train-student", "--cache", tiny_cache, "--student-config", TINY, "--out", run, *TRAIN]).exit_code == 0
    for args in (["--student", run, "--teacher", teacher], ["--student", lora_run]):
        out = tmp_path / f"export-{len(args)}"
        r = invoke(["export", *args, "--out", out])
        assert r.exit_code == 0, r.output
        got = modes(out)
        assert {m for name, m in got.items() if (out / name).is_dir()} == {0o755}, got
        assert {m for name, m in got.items() if not (out / name).is_dir()} == {0o644}, got


@pytest.mark.parametrize("mask", [0o022, 0o027], ids=["umask-022", "umask-027"])
def test_saved_weights_honour_the_umask(tiny_cache, lora_run, tmp_path, umask, mask):
    """A student, a checkpoint and an export, compact and fused, are 0o666 less the umask: 0644 under 022."""
    umask(mask)
    want = 0o666 & ~mask
    run = tmp_path / "run"
    r = invoke(["train-student", "--cache", tiny_cache, "--student-config", TINY, "--out", run, *TRAIN,
                "--checkpoint-every", 1, "--ema-decay", 0.9])
    assert r.exit_code == 0, r.output
    assert invoke(["export", "--student", run, "--out", tmp_path / "export"]).exit_code == 0
    assert invoke(["export", "--student", lora_run, "--out", tmp_path / "fused", "--fuse"]).exit_code == 0
    weights = {p: p.stat().st_mode & 0o777 for folder in (run, tmp_path / "export", tmp_path / "fused")
               for p in folder.rglob("*.safetensors")}
    kinds = {"student", "student_ema", "checkpoints", "transformer", "transformer_2", "vae", "text_encoder"}
    assert {p.relative_to(tmp_path).parts[1] for p in weights} == kinds
    assert set(weights.values()) == {want}, {str(p): oct(m) for p, m in weights.items()}
