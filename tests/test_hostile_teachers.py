"""Teacher folders, Hub caches and output folders built by someone else: a link out of a teacher folder (to a file or
a folder), a link loop, a FIFO, pickled weights, a model_index.json or component config that lies about its
classes or numbers, a Hub cache whose snapshot links leave its blobs/ or whose refs/main is `../../..`; an export or
`tiny-teacher --out` over a FIFO, someone else's folder or an earlier output holding a user's `.git/`. Each ends in
one `error:` line naming the path (exit 2), the dry run refusing what the run refuses, with nothing outside read,
written or deleted and nothing hanging; what is the user's own (an earlier output, a clean Hub snapshot) passes."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import stat
from pathlib import Path

import pytest

from cache.safe_write import MARKER
from conftest import ROOT
from hub_cache import use_hub_here
from test_teacher_cache_cli import _args, invoke

pytestmark = pytest.mark.timeout(300)  # a FIFO opened the old way blocks forever: fail instead

TINY = ROOT / "configs" / "student-tiny.json"
TRAIN = ["--max-steps", 1, "--batch-size", 4, "--warmup-steps", 0, "--device", "cpu", "--report-to", "none"]
HUB_ID, MAIN = "attacker/wan-teacher", "c" * 40


def one_line(r, *needles: str) -> str:
    """The command's one `error:` line (exit 2, no traceback), holding every needle."""
    errors = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert r.exit_code == 2 and len(errors) == 1 and "Traceback" not in r.output, r.output
    for n in needles:
        assert n in errors[0], errors[0]
    return errors[0]


def ok(r) -> None:
    assert r.exit_code == 0, r.output


def tree(folder: Path) -> dict[str, str]:
    """Every entry below `folder` (and itself), links as their target, FIFOs as such, files by digest."""
    out = {}
    for p in [folder, *sorted(folder.rglob("*"))]:
        st = os.lstat(p)
        out[str(p.relative_to(folder))] = (f"-> {os.readlink(p)}" if stat.S_ISLNK(st.st_mode) else "fifo"
                                           if stat.S_ISFIFO(st.st_mode) else "dir" if stat.S_ISDIR(st.st_mode)
                                           else hashlib.sha256(p.read_bytes()).hexdigest())
    return out


@pytest.fixture
def victim(tmp_path) -> Path:
    v = tmp_path / "home" / ".bashrc"
    v.parent.mkdir()
    v.write_text("export PATH=$HOME/bin:$PATH\n")
    return v


@pytest.fixture(scope="module")
def run_dir(tiny_cache, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("run") / "run"
    ok(invoke(["train-student", "--cache", tiny_cache, "--student-config", TINY, "--out", out, *TRAIN]))
    return out


def export(run_dir: Path, out: Path, *extra):
    return invoke(["export", "--student", run_dir, "--out", out, *extra])


# -- export --out: what it may replace ----------------------------------------------------------------------------
def test_export_reads_nothing_in_out_and_replaces_only_its_own_earlier_output(run_dir, tmp_path):
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / "model_index.json")  # once opened to look for a marker key: a hang
    for extra in ((), ("--overwrite",)):
        one_line(export(run_dir, fifo, *extra), str(fifo), "did not write", "model_index.json")
    foreign = tmp_path / "foreign"  # a marker key is something any JSON may hold: not ownership
    foreign.mkdir()
    (foreign / "lora.json").write_text(json.dumps({"_wandistiller": {"student_run": "x"}}))
    (foreign / "notes.txt").write_text("mine")
    theirs = tree(foreign)
    one_line(export(run_dir, foreign, "--overwrite"), str(foreign), "did not write")
    assert tree(foreign) == theirs and tree(fifo)["model_index.json"] == "fifo"

    out = tmp_path / "export"
    ok(export(run_dir, out))
    assert json.loads((out / MARKER).read_text())["written_by"] == "export"
    assert "_wandistiller" in json.loads((out / "model_index.json").read_text())  # the hints stay, for the card
    one_line(export(run_dir, out), "earlier export", "--overwrite")
    ok(export(run_dir, out, "--overwrite"))
    (out / ".git").mkdir()  # the user made the export a repository to push it
    (out / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    before = tree(out)
    one_line(export(run_dir, out, "--overwrite"), str(out), ".git/HEAD", "did not write")
    assert tree(out) == before
    link = tmp_path / "linked-out"
    link.symlink_to(foreign, target_is_directory=True)
    one_line(export(run_dir, link, "--overwrite"), str(link), "symbolic link")
    assert tree(foreign) == theirs


# -- teacher folders ----------------------------------------------------------------------------------------------
class Payload:
    """Unpickled, it would create the marker file: the proof a pickle was loaded."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _plant(teacher: Path, case: str, victim: Path) -> str:
    """Make the copy `teacher` hostile by `case`; the relative path the error line names."""
    if case == "link-to-a-file":
        (teacher / "vae" / "notes.json").symlink_to(victim)
        return "vae/notes.json"
    if case == "link-to-a-folder":
        shutil.copytree(teacher / "tokenizer", victim.parent / "tokenizer")
        shutil.rmtree(teacher / "tokenizer")
        (teacher / "tokenizer").symlink_to(victim.parent / "tokenizer", target_is_directory=True)
        return "tokenizer"
    if case == "link-loop":
        (teacher / "vae" / "loop").symlink_to("loop")
        return "vae/loop"
    if case == "fifo":
        os.mkfifo(teacher / "scheduler" / "extra.json")
        return "scheduler/extra.json"
    (teacher / "text_encoder" / "pytorch_model.bin").write_bytes(pickle.dumps(Payload(victim.parent / "pwned")))
    return "text_encoder/pytorch_model.bin"


@pytest.mark.parametrize("case", ["link-to-a-file", "link-to-a-folder", "link-loop", "fifo", "pickled-weights"])
def test_a_teacher_folder_holding_links_fifos_or_pickles_is_refused_by_every_command(
        case, tiny_teacher, run_dir, prompts_file, tmp_path, victim):
    teacher = tmp_path / "teacher"
    shutil.copytree(tiny_teacher, teacher)
    rel = _plant(teacher, case, victim)
    outside = tree(victim.parent)
    out = tmp_path / "export"
    line = one_line(export(run_dir, out, "--teacher", teacher), str(teacher / rel))
    assert not out.exists() and not list(tmp_path.glob("export.*"))
    for dry in (["--dry-run"], []):  # the dry run refuses what the run refuses, with the same line
        assert one_line(invoke([*_args(teacher, prompts_file, tmp_path / "cache"), *dry])) == line
    one_line(invoke(["plan", "--teacher", teacher]), str(teacher / rel))
    assert tree(victim.parent) == outside and not (victim.parent / "pwned").exists()


def _edit(path: Path, **changes) -> None:
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))


@pytest.mark.parametrize("where,changes,needle", [
    ("model_index.json", dict(text_encoder=["transformers", "EvilEncoderModel"]),
     "text_encoder is 'transformers.EvilEncoderModel', a class WanDistiller does not load"),
    ("model_index.json", dict(vae=["diffusers"]), "vae is ['diffusers'], not a [library, class] pair"),
    ("model_index.json", dict(scheduler=["os", "system"]), "scheduler is 'os.system', a class WanDistiller does not"),
    ("model_index.json", dict(boundary_ratio="late"), "boundary_ratio is 'late', not a number in [0, 1]"),
    ("transformer/config.json", dict(in_channels="16"), "in_channels is '16', not a whole number"),
    ("transformer_2/config.json", dict(num_layers=10**9), "num_layers is 1000000000, not a whole number in [1, 1024]"),
    ("transformer/config.json", dict(patch_size=[1, 2]), "patch_size is [1, 2], not three whole numbers"),
    ("vae/config.json", dict(scale_factor_spatial=0), "scale_factor_spatial is 0"),
    ("text_encoder/config.json", dict(d_model=[4096]), "d_model is [4096]"),
    ("scheduler/scheduler_config.json", dict(_class_name="EvilScheduler"), "the scheduler class 'EvilScheduler'"),
], ids=["unknown-class", "short-entry", "module-call", "boundary", "string-int", "huge-layers", "patch", "vae-zero",
        "list-int", "scheduler-class"])
def test_a_lying_model_index_or_config_is_refused_by_the_dry_run_as_by_the_run(
        where, changes, needle, tiny_teacher, run_dir, prompts_file, tmp_path):
    teacher = tmp_path / "teacher"
    shutil.copytree(tiny_teacher, teacher)
    _edit(teacher / where, **changes)
    lines = {one_line(invoke([*_args(teacher, prompts_file, tmp_path / "cache"), *dry]), needle, str(teacher))
             for dry in (["--dry-run"], [])}
    assert len(lines) == 1 and not (tmp_path / "cache").exists()
    if where == "model_index.json":  # whichever command loads the teacher (export, sample, eval: diffusers would)
        assert one_line(export(run_dir, tmp_path / "export", "--teacher", teacher)) in lines


def test_an_oversized_model_index_is_refused_before_it_is_read(tiny_teacher, run_dir, prompts_file, tmp_path):
    teacher = tmp_path / "teacher"
    shutil.copytree(tiny_teacher, teacher)
    with open(teacher / "model_index.json", "r+b") as f:
        f.truncate(16 << 30)  # sparse: read whole, it would take the machine's memory
    one_line(invoke([*_args(teacher, prompts_file, tmp_path / "cache"), "--dry-run"]), "model_index.json",
             "17,179,869,184 bytes")
    one_line(export(run_dir, tmp_path / "export", "--teacher", teacher), "17,179,869,184 bytes")


# -- the Hub cache ------------------------------------------------------------------------------------------------
def blob_snapshot(home: Path, folder: Path, commit: str = MAIN) -> Path:
    """`folder` in the Hub cache under HF_HOME `home` as huggingface_hub lays it out: each file a blob, the snapshot
    relative links into blobs/, refs/main the commit."""
    repo = home / "hub" / f"models--{HUB_ID.replace('/', '--')}"
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snap = repo / "snapshots" / commit
    for f in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MARKER):
        blob = repo / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        blob.write_bytes(f.read_bytes())
        link = snap / f.relative_to(folder)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snap


def test_a_hub_snapshots_links_into_its_blobs_are_followed_and_copied_as_files(tiny_teacher, run_dir, prompts_file,
                                                                               tmp_path, monkeypatch):
    use_hub_here(monkeypatch, tmp_path / "hf")
    blob_snapshot(tmp_path / "hf", tiny_teacher)
    ok(invoke([*_args(HUB_ID, prompts_file, tmp_path / "cache"), "--dry-run"]))
    out = tmp_path / "export"
    ok(export(run_dir, out, "--teacher", HUB_ID))
    assert not [p for p in out.rglob("*") if p.is_symlink()]
    weights = "vae/diffusion_pytorch_model.safetensors"
    assert (out / weights).read_bytes() == (tiny_teacher / weights).read_bytes()


@pytest.mark.parametrize("case", ["link-out", "blob-is-a-link-out", "ref-up-and-out", "ref-is-a-fifo",
                                  "tree-listing-is-a-fifo"])
def test_a_hostile_hub_cache_is_refused_in_one_line(case, tiny_teacher, run_dir, prompts_file, tmp_path, victim,
                                                      monkeypatch):
    home = tmp_path / "hf"
    use_hub_here(monkeypatch, home)
    snap = blob_snapshot(home, tiny_teacher)
    repo = snap.parent.parent
    if case == "link-out":  # a snapshot entry leading out of the repository: its bytes would be exported, uploaded
        (snap / "vae" / "leak.json").symlink_to(victim)
        needle = "vae/leak.json is a symbolic link"
    elif case == "blob-is-a-link-out":
        blob = Path(os.path.realpath(snap / "vae" / "config.json"))
        blob.unlink()
        blob.symlink_to(victim)
        needle = "vae/config.json is a symbolic link"
    elif case == "ref-up-and-out":  # snapshots/../../.. is HF_HOME: huggingface_hub would hand it out as the teacher
        (repo / "refs" / "main").write_text("../../..")
        needle = "refs/main holds b'../../..', not a commit hash"
    elif case == "ref-is-a-fifo":
        (repo / "refs" / "main").unlink()
        os.mkfifo(repo / "refs" / "main")
        needle = "refs/main is a FIFO"
    else:  # huggingface_hub's own listing of the commit's files, which it opens to check the snapshot is whole
        (repo / "trees").mkdir()
        os.mkfifo(repo / "trees" / f"{MAIN}.json")
        needle = f"trees/{MAIN}.json is a FIFO"
    before = tree(victim.parent)
    line = one_line(export(run_dir, tmp_path / "export", "--teacher", HUB_ID), needle)
    assert one_line(invoke([*_args(HUB_ID, prompts_file, tmp_path / "cache"), "--dry-run"])) == line
    assert tree(victim.parent) == before and not (tmp_path / "export").exists()


# -- tiny-teacher --out -------------------------------------------------------------------------------------------
def test_tiny_teacher_rebuilds_its_own_output_and_refuses_anything_else(tmp_path, victim):
    out = tmp_path / "teacher"
    old = os.umask(0o022)
    try:
        for _ in range(2):  # `make` reruns it: its own earlier output is rebuilt whole
            ok(invoke(["tiny-teacher", "--out", out, "--variant", "wan2.1"]))
    finally:
        os.umask(old)
    assert {p.stat().st_mode & 0o777 for p in out.rglob("*.safetensors")} == {0o644}
    (out / "vae" / "my-notes.txt").write_text("mine")
    before = tree(out)
    one_line(invoke(["tiny-teacher", "--out", out]), "vae/my-notes.txt", "did not write")
    assert tree(out) == before

    model = tmp_path / "someones-model"  # someone else's pipeline, or a folder with a subfolder linked out
    (model / "transformer").mkdir(parents=True)
    (model / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"}))
    (model / "vae").symlink_to(victim.parent, target_is_directory=True)
    linked = tmp_path / "linked"
    linked.symlink_to(model, target_is_directory=True)
    outside, mine = tree(victim.parent), tree(model)
    one_line(invoke(["tiny-teacher", "--out", model]), str(model), "did not write")
    one_line(invoke(["tiny-teacher", "--out", linked]), str(linked), "symbolic link")
    assert tree(model) == mine and tree(victim.parent) == outside
