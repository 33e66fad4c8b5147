"""`make gpu-check`: on a machine without a GPU, or without a package, one line and exit 2; it installs nothing."""

from __future__ import annotations

import importlib.metadata as md
import subprocess
import sys

import pytest
import torch

from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import gpu_check  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_it_says_so_in_one_line_and_exits_2(tmp_path):
    r = subprocess.run(["make", "--no-print-directory", "gpu-check", f"RUNS={tmp_path}",
                        f"GPU_PYTHON={sys.executable}"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    ours = [ln for ln in (r.stdout + r.stderr).splitlines() if not ln.startswith("make")]
    assert len(ours) == 1 and ours[0].startswith(f"gpu-check: no CUDA GPU is visible to torch {torch.__version__}")
    assert ours[0].endswith("run it on a machine with a GPU"), ours
    assert not (tmp_path / "gpu-check").exists()  # nothing ran


def test_a_missing_package_is_named_in_one_line(monkeypatch):
    real = md.version

    def version(name):
        if name in ("zarr", "wandistiller"):
            raise md.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_check.md, "version", version)
    line = gpu_check.missing()
    assert line.startswith("missing packages: zarr, wandistiller (this check installs nothing") and "\n" not in line
    assert "pip install -e . --no-deps" in line
    monkeypatch.setattr(gpu_check.md, "version", real)
    assert gpu_check.missing() is None  # everything the project declares is installed here
