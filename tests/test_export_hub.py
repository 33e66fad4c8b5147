"""A Hub-ready export: a self-contained folder (copies, no symlinks) whose model card carries the Hub's YAML metadata
and no local path, that `DiffusionPipeline.from_pretrained` loads, and `--push-to-hub` through huggingface_hub
against a hand-written stand-in for the Hub's HTTP API (the endpoints create_repo and upload_folder use)."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from conftest import ROOT
from pipeline.cli import main

pytestmark = pytest.mark.slow

TEACHER_ID = "Wan-AI/Wan2.2-T2V-A14B-Diffusers"


def invoke(args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def run_dir(tiny_cache, tmp_path_factory):
    """A student trained for two steps on the tiny cache (its distill.json names the tiny teacher's folder)."""
    out = tmp_path_factory.mktemp("hub-run") / "run"
    r = invoke(["train-student", "--cache", tiny_cache, "--student-config", ROOT / "configs/student-tiny.json",
                "--out", out, "--max-steps", 2, "--batch-size", 4, "--warmup-steps", 0, "--device", "cpu",
                "--report-to", "none"])
    assert r.exit_code == 0, r.output
    return out


@pytest.fixture(scope="module")
def cached_teacher(tiny_teacher, tmp_path_factory):
    """The tiny teacher where the local Hub cache would keep a snapshot of TEACHER_ID, with the model card that
    repo would have (its license in the YAML front matter)."""
    ns, name = TEACHER_ID.split("/")
    snap = tmp_path_factory.mktemp("hf-cache") / f"models--{ns}--{name}" / "snapshots" / ("0" * 40)
    shutil.copytree(tiny_teacher, snap)
    (snap / "README.md").write_text("---\nlicense: apache-2.0\npipeline_tag: text-to-video\n---\n# Wan2.2\n")
    return snap


def front_matter(card: str) -> dict:
    assert card.startswith("---\n")
    return yaml.safe_load(card.split("---\n")[1])


def local_paths(folder: Path, *roots: Path) -> list[str]:
    """Every text file of `folder` naming a path on this machine: one of `roots`, or an absolute path under a usual
    top-level folder."""
    found = []
    for f in folder.rglob("*"):
        if f.suffix not in (".json", ".md", ".txt") or not f.is_file():
            continue
        text = f.read_text(errors="replace")
        if any(str(r) in text for r in roots) or re.search(r"(?<![\w.:/])/(tmp|home|work|root|Users|data)/", text):
            found.append(str(f.relative_to(folder)))
    return found


def test_export_is_self_contained_with_hub_metadata_and_no_local_path(run_dir, cached_teacher, tmp_path):
    from diffusers import DiffusionPipeline

    out = tmp_path / "pipe"
    r = invoke(["export", "--student", run_dir, "--teacher", cached_teacher, "--out", out])
    assert r.exit_code == 0, r.output
    assert not [p for p in out.rglob("*") if p.is_symlink()]  # copies by default
    card = (out / "README.md").read_text()
    assert front_matter(card) == {"base_model": TEACHER_ID, "library_name": "diffusers", "license": "apache-2.0",
                                  "pipeline_tag": "text-to-image",
                                  "tags": ["wandistiller", "distillation", "wan", "text-to-image"]}
    assert f'DiffusionPipeline.from_pretrained("{out.name}"' in card
    assert re.search(rf"from teacher\s+`{re.escape(TEACHER_ID)}`", card)
    assert local_paths(out, tmp_path, cached_teacher, run_dir, ROOT) == []
    index = json.loads((out / "model_index.json").read_text())
    assert index["_wandistiller"]["teacher"] == TEACHER_ID and index["_wandistiller"]["components"] == "copied"
    pipe = DiffusionPipeline.from_pretrained(out)
    assert type(pipe).__name__ == "WanPipeline" and pipe.transformer_2 is None

    # --link: symlinks on request (the folder then holds the teacher's absolute paths, as links, by design)
    linked = tmp_path / "linked"
    r = invoke(["export", "--student", run_dir, "--teacher", cached_teacher, "--out", linked, "--link"])
    assert r.exit_code == 0, r.output
    assert all((linked / c).is_symlink() for c in ("text_encoder", "tokenizer", "vae", "scheduler"))
    r = invoke(["export", "--student", run_dir, "--out", tmp_path / "x", "--link", "--push-to-hub", "you/r"])
    assert r.exit_code == 2 and "drop --link" in r.output


def test_a_local_teacher_without_a_card_leaves_license_and_base_model_out(run_dir, tmp_path):
    out = tmp_path / "pipe"
    r = invoke(["export", "--student", run_dir, "--out", out])  # distill.json's teacher: a local folder, no card
    assert r.exit_code == 0, r.output
    meta = front_matter((out / "README.md").read_text())
    assert "license" not in meta and "base_model" not in meta and meta["pipeline_tag"] == "text-to-image"
    assert local_paths(out, tmp_path, run_dir, ROOT) == []
    r = invoke(["export", "--student", run_dir, "--out", tmp_path / "p2", "--base-model", TEACHER_ID])
    assert front_matter((tmp_path / "p2" / "README.md").read_text())["base_model"] == TEACHER_ID


def test_a_video_students_export_is_text_to_video_and_its_card_draws_a_clip(tiny_video_cache, cached_teacher,
                                                                             tmp_path):
    """A student trained on a 5-frame cache: its card says text-to-video (metadata and tags), num_frames in its table,
    its call and model_index.json's hints; the card's own call, run on the export, draws a 5-frame clip that
    diffusers' export_to_video takes. (An image student's card and files: test_byte_identity.)"""
    from diffusers import DiffusionPipeline

    run, out = tmp_path / "run", tmp_path / "pipe"
    r = invoke(["train-student", "--cache", tiny_video_cache, "--student-config", ROOT / "configs/student-tiny.json",
                "--out", run, "--max-steps", 1, "--batch-size", 4, "--warmup-steps", 0, "--device", "cpu",
                "--report-to", "none", "--objective", "segment", "--student-steps", 2])
    assert r.exit_code == 0, r.output
    r = invoke(["export", "--student", run, "--teacher", cached_teacher, "--out", out])
    assert r.exit_code == 0 and "num_frames=5" in r.output, r.output
    card = (out / "README.md").read_text()
    meta = front_matter(card)
    assert meta["pipeline_tag"] == "text-to-video" and meta["base_model"] == TEACHER_ID
    assert meta["tags"] == ["wandistiller", "distillation", "wan", "text-to-video", "few-step"]
    assert "| num_frames | 5 |" in card and "on clips of 5 frames" in card and "num_frames=1" not in card
    assert json.loads((out / "model_index.json").read_text())["_wandistiller"]["num_frames"] == 5
    code = card.split("```python\n")[1].split("```")[0]
    assert 'export_to_video(frames, "student.mp4", fps=16)' in code
    call = code[code.index("frames = pipe("):code.index("\nexport_to_video")]
    pipe = DiffusionPipeline.from_pretrained(out)  # (the card's own loading, on the CPU in float32)
    pipe.set_progress_bar_config(disable=True)
    scope = {"pipe": pipe}
    exec(code.split("\n\n")[0].replace("import torch\n", "") + "\n" + call, scope)  # its imports, its call
    assert callable(scope["export_to_video"]) and len(scope["frames"]) == 5
    assert {f.size for f in scope["frames"]} == {(64, 64)}


class _Hub(BaseHTTPRequestHandler):
    """The Hub API as huggingface_hub's create_repo and upload_folder use it: create a repo, validate a model card's
    metadata, ask how each file is to be uploaded (here: inline, "regular"), commit (NDJSON, base64 contents)."""

    repos: dict = {}
    files: dict = {}
    refuse: bool = False

    def _reply(self, code: int, obj: dict) -> None:
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._reply(404, {"error": "not part of the stand-in"})

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        base = "http://%s:%d" % self.server.server_address
        if self.refuse:
            return self._reply(401, {"error": "Invalid credentials in Authorization header"})
        if self.path == "/api/repos/create":
            req = json.loads(body)
            self.repos[f"{req['organization']}/{req['name']}"] = req
            return self._reply(200, {"url": f"{base}/{req['organization']}/{req['name']}"})
        if self.path == "/api/validate-yaml":
            meta = yaml.safe_load(json.loads(body)["content"].split("---\n")[1])
            missing = [k for k in ("pipeline_tag", "library_name") if k not in meta]
            return self._reply(400 if missing else 200, {"errors": [{"message": f"no {k}"} for k in missing],
                                                         "warnings": []})
        m = re.match(r"^/api/models/([^/]+/[^/]+)/(preupload|commit)/main$", self.path)
        if m and m.group(2) == "preupload":
            return self._reply(200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                               for f in json.loads(body)["files"]]})
        if m:
            for line in body.decode().splitlines():
                item = json.loads(line)
                if item["key"] == "file":
                    self.files[(m.group(1), item["value"]["path"])] = base64.b64decode(item["value"]["content"])
            return self._reply(200, {"commitUrl": f"{base}/{m.group(1)}/commit/{'a' * 40}", "commitOid": "a" * 40,
                                     "pullRequestUrl": None})
        self._reply(404, {"error": f"no {self.path}"})

    def log_message(self, *args):
        pass


@pytest.fixture
def hub():
    _Hub.repos, _Hub.files, _Hub.refuse = {}, {}, False
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield "http://%s:%d" % server.server_address
    server.shutdown()


def _export(args, endpoint: str) -> subprocess.CompletedProcess:
    """`wandistiller export ...` in its own process: huggingface_hub reads HF_ENDPOINT when it is imported."""
    env = dict(os.environ, HF_ENDPOINT=endpoint, HF_TOKEN="hf_stand_in", HF_HUB_DISABLE_TELEMETRY="1")
    return subprocess.run([sys.executable, "-m", "pipeline.cli", "export", *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_push_to_hub_uploads_the_folder(run_dir, cached_teacher, hub, tmp_path):
    out = tmp_path / "pipe"
    r = _export(["--student", run_dir, "--teacher", cached_teacher, "--out", out, "--push-to-hub", "you/wan-student",
                 "--private"], hub)
    assert r.returncode == 0, r.stderr
    assert f"pushed to the Hub: {hub}/you/wan-student/commit/" in r.stdout + r.stderr
    assert _Hub.repos["you/wan-student"]["visibility"] == "private"
    local = {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert {path: data for (repo, path), data in _Hub.files.items() if repo == "you/wan-student"} == local
    assert 'from_pretrained("you/wan-student"' in local["README.md"].decode()


def test_a_lora_export_pushed_names_the_hub_ids_and_no_local_path(tiny_cache, cached_teacher, hub, tmp_path):
    """A LoRA run of the teacher as the local Hub cache holds it: the card loads the base by its Hub id and the adapters
    by the repo pushed to, and no uploaded file names a path of this machine."""
    run = tmp_path / "lora-run"
    r = invoke(["train-student", "--cache", tiny_cache, "--lora-of", cached_teacher, "--out", run, "--max-steps", 1,
                "--batch-size", 4, "--warmup-steps", 0, "--device", "cpu", "--report-to", "none"])
    assert r.exit_code == 0, r.output
    out = tmp_path / "lora"
    r = _export(["--student", run, "--out", out, "--push-to-hub", "you/wan-lora"], hub)
    assert r.returncode == 0, r.stderr
    uploaded = {path: data.decode(errors="replace") for (repo, path), data in _Hub.files.items()
                if repo == "you/wan-lora" and not path.endswith(".safetensors")}
    assert {"README.md", "lora.json", "distill.json"} <= set(uploaded)
    card = uploaded["README.md"]
    meta = front_matter(card)
    assert meta["base_model"] == TEACHER_ID and meta["license"] == "apache-2.0" and "lora" in meta["tags"]
    assert f'WanPipeline.from_pretrained("{TEACHER_ID}"' in card
    assert 'load_lora_weights("you/wan-lora", weight_name="high_noise_model.safetensors"' in card
    assert json.loads(uploaded["lora.json"])["teacher"] == json.loads(uploaded["distill.json"])["teacher"] == TEACHER_ID
    assert local_paths(out, tmp_path, cached_teacher, tiny_cache, ROOT) == []


def test_a_push_that_fails_is_one_line_and_keeps_the_export(run_dir, hub, tmp_path, monkeypatch):
    _Hub.refuse = True
    out = tmp_path / "pipe"
    r = _export(["--student", run_dir, "--out", out, "--push-to-hub", "you/r"], hub)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 2 and len(errors) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "cannot push" in errors[0] and f"hf upload you/r {out} ." in errors[0]
    assert (out / "model_index.json").is_file()  # the folder itself is complete

    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # offline: refused before anything is written
    r = invoke(["export", "--student", run_dir, "--out", tmp_path / "offline", "--push-to-hub", "you/r"])
    assert r.exit_code == 2 and r.output.strip().splitlines() == [
        "error: --push-to-hub you/r needs the Hub, and HF_HUB_OFFLINE is set; unset it, or export without "
        "--push-to-hub and upload the folder later with `hf upload`"]
    assert not (tmp_path / "offline").exists()
