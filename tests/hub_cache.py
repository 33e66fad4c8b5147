"""A local Hugging Face Hub cache built by hand, for tests that name teachers by Hub id with no network.

huggingface_hub finds a repo in its cache as `HF_HUB_CACHE/models--Org--Name/snapshots/<commit>/...`, with
`refs/<branch>` holding the commit a branch points at; offline (HF_HUB_OFFLINE=1) `snapshot_download` returns that
folder. Files are copied in as they are (the real cache keeps blobs and symlinks to them: the resolver reads the
snapshot folder either way).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
A14B_ID = "Wan-AI/Wan2.2-T2V-A14B-Diffusers"
A14B_CONFIGS = ROOT / "tests" / "data" / "wan22-a14b-configs"  # the public configs of A14B, no weights


def add_snapshot(home: Path, repo: str, folder: Path, commit: str, branch: str | None = "main") -> Path:
    """Copy `folder` into the cache under HF_HOME `home` as `repo` at `commit` (and point `branch` at it)."""
    repo_dir = home / "hub" / f"models--{repo.replace('/', '--')}"
    snap = repo_dir / "snapshots" / commit
    shutil.copytree(folder, snap, dirs_exist_ok=True)
    if branch is not None:
        (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
        (repo_dir / "refs" / branch).write_text(commit)
    return snap


def hub_env(home: Path, offline: bool = True, **extra: str) -> dict[str, str]:
    """The environment of a process that uses the cache under `home` (and no other: the caller's HF_* variables
    are dropped)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(HF_HOME=str(home), **extra)
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    return env


def use_hub_here(monkeypatch, home: Path) -> None:
    """Point this process at the cache under `home`, offline: the environment as for a child process, and
    huggingface_hub's constants, which it reads from the environment once, when it is first imported."""
    from huggingface_hub import constants

    for k, v in hub_env(home).items():
        if k.startswith("HF_"):
            monkeypatch.setenv(k, v)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
