"""Where a teacher the user names lives on this machine: the one place that turns `--teacher` (and
`--init-from-teacher`) into a local folder (docs/architecture.md, "Teachers by name: local folders and Hub ids").
huggingface_hub is imported when a Hub id is resolved, never at load: the CLI imports this module."""

from __future__ import annotations

import os
import re
from fnmatch import fnmatch
from pathlib import Path

from cache.cache_error import UnsafeFileError
from cache.safe_open import CAPS, open_fd, read_bytes

from .errors import UserError, first_line
from .teacher_files import check_folder

# What each command reads of a diffusers pipeline (huggingface_hub's allow_patterns).
CONFIGS = ("model_index.json", "*/config.json", "scheduler/scheduler_config.json", "*/*.safetensors.index.json")
PIPELINE = ("*.json", "*.safetensors", "*.model", "*.txt", "tokenizer*/*")
FIRST_TRANSFORMER = ("model_index.json", "transformer/*.json", "transformer/*.safetensors")
_COMMIT = re.compile(r"[0-9a-f]{40}")
# Wan's own releases in their original layout (no model_index.json: not diffusers) -> the diffusers copy of each
DIFFUSERS_COPIES = {f"wan-ai/{n.lower()}": f"Wan-AI/{n}-Diffusers" for n in (
    "Wan2.1-T2V-1.3B", "Wan2.1-T2V-14B", "Wan2.1-I2V-14B-480P", "Wan2.1-I2V-14B-720P", "Wan2.2-T2V-A14B",
    "Wan2.2-I2V-A14B", "Wan2.2-TI2V-5B")}


def is_hub_id(name: str) -> bool:
    """`Org/Name`: one slash, not a relative or absolute path."""
    return name.count("/") == 1 and not name.startswith((".", "/", "~")) and all(name.split("/"))


def teacher_folder(name: str, revision: str | None = None, *, files: tuple[str, ...] = PIPELINE,
                   flag: str = "--teacher", hint_files: tuple[str, ...] | None = None,
                   recorded_in: str | None = None) -> Path:
    """The local folder of teacher `name`: the path itself, or the Hub snapshot at `revision` holding at least
    `files` (patterns); else a UserError whose `hf download` names `hint_files` (default `files`). `recorded_in`:
    the file the name came from, not the user; then the local Hub cache only (a file must not choose downloads)."""
    p = Path(name).expanduser()
    if p.exists():
        if revision is not None:
            raise UserError(f"--revision {revision} applies to a Hub id, and {flag} {name} is a local path; drop "
                            "--revision")
        if p.is_dir():
            check_folder(p, f"rerun with {flag} {name}")
        return p
    if not is_hub_id(name):
        raise UserError(f"{flag} {name} does not exist; pass a diffusers folder or a Hub id like "
                        "Wan-AI/Wan2.2-T2V-A14B-Diffusers (build a tiny one with `wandistiller tiny-teacher`)")
    if (copy := DIFFUSERS_COPIES.get(name.lower())) is not None:  # (before anything is fetched: ~100 GB of it)
        raise _not_diffusers(flag, name, copy)
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub import errors as hf

    at = f" at revision {revision}" if revision else ""
    repo = _cached_repo(name)
    fix = f"download {name} again (`hf download {name}`, once {repo} is removed)"
    _check_ref(repo, revision, fix)
    try:
        snap = Path(snapshot_download(name, revision=revision, allow_patterns=list(files),
                                      local_files_only=recorded_in is not None))
    except hf.RevisionNotFoundError as e:
        raise UserError(f"{flag} {name}: the Hub has no revision {revision!r} of it; pass a branch, tag or commit "
                        "that exists (or leave --revision out for main)") from e
    except (hf.GatedRepoError, hf.RepositoryNotFoundError) as e:
        raise UserError(f"{flag} {name} is not on the Hub or needs a login ({first_line(e)}); check the id, accept "
                        "its licence on huggingface.co and run `hf auth login`, or pass a local folder") from e
    except hf.IncompleteSnapshotError as e:  # (a LocalEntryNotFoundError: before it)
        raise UserError(f"{flag} {name}{at}: the cached copy is incomplete and the Hub cannot be reached "
                        f"({first_line(e)}); rerun where the Hub is reachable, or pass a local folder") from e
    except hf.LocalEntryNotFoundError as e:  # neither the Hub nor a cached copy
        if (copy := _cached_copy(name)) is not None:
            raise _not_diffusers(flag, name, copy) from e
        if recorded_in is not None:
            raise UserError(f"{recorded_in} names the teacher {name}{at}, a Hub id that is not in the local Hub cache "
                            f"({constants.HF_HUB_CACHE}); nothing is downloaded because a file says so: pass "
                            f"{flag} {name} to fetch it (or a local folder)") from e
        why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the Hub cannot be reached"
        hint = files if hint_files is None else hint_files
        include = " --include " + " ".join(f"'{f}'" for f in hint) if hint != PIPELINE else ""
        raise UserError(f"{flag} {name}{at} is not in the local Hub cache ({constants.HF_HUB_CACHE}) and {why}; "
                        f"download it where the Hub is reachable (`hf download {name}{include}`) into that cache "
                        "(or set HF_HOME to one that holds it), or pass a local folder") from e
    except hf.HfHubHTTPError as e:  # (an OSError: before it)
        raise UserError(f"{flag} {name}: the Hub answered {first_line(e)}; retry later, or pass a local "
                        "folder") from e
    except OSError as e:  # a cache folder that cannot be written, a full disk
        raise UserError(f"{flag} {name}: fetching it from the Hub failed ({first_line(e)}); free space or fix the "
                        f"permissions of {constants.HF_HUB_CACHE}, or pass a local folder") from e
    if snap.parent != repo / "snapshots" or not _COMMIT.fullmatch(snap.name):
        raise UnsafeFileError(f"{flag} {name}: the local Hub cache gave {snap}, not a snapshot folder of {repo}; {fix}")
    if any(fnmatch("model_index.json", f) for f in files) and not (snap / "model_index.json").exists() and (
            copy := _cached_copy(name)) is not None:
        raise _not_diffusers(flag, name, copy)
    check_folder(snap, fix)
    return snap


def offline() -> bool:
    """True where huggingface_hub fetches nothing (HF_HUB_OFFLINE): a Hub id is what the local Hub cache holds."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _cached_repo(name: str) -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE) / f"models--{name.replace('/', '--')}"


def _cached_copy(name: str) -> str | None:
    """`name`-Diffusers where the local Hub cache holds a diffusers pipeline of that name (a snapshot with a
    model_index.json), and `name` is not such a copy itself."""
    copy = f"{name}-Diffusers"
    snaps = _cached_repo(copy) / "snapshots"
    found = not name.lower().endswith("-diffusers") and snaps.is_dir() and any(
        (s / "model_index.json").exists() for s in snaps.iterdir())
    return copy if found else None


def _not_diffusers(flag: str, name: str, copy: str) -> UserError:
    return UserError(f"{flag} {name} is not a diffusers pipeline (it has no model_index.json); did you mean {flag} "
                     f"{copy}?")


def _check_ref(repo: Path, revision: str | None, fix: str) -> None:
    """Before huggingface_hub opens them: refuse a cached repository's ref of `revision` (refs/main by default) that is
    no commit hash (huggingface_hub joins it to snapshots/ as a path: `../../..` would name a folder outside the
    cache), and a ref or tree listing that is a link, a FIFO or too large."""
    rev = revision or "main"
    try:
        commit = rev
        if not _COMMIT.fullmatch(rev):
            ref = read_bytes(repo, f"refs/{rev}", 64, fix)
            if not _COMMIT.fullmatch(commit := ref.decode("ascii", "replace")):
                raise UnsafeFileError(f"{repo / 'refs' / rev} holds {ref[:50]!r}, not a commit hash; {fix}")
        fd = open_fd(repo, f"trees/{commit}.json", fix)
        size = os.fstat(fd).st_size
        os.close(fd)
        if size > CAPS["config"]:
            raise UnsafeFileError(f"{repo / 'trees' / commit}.json is {size:,} bytes, more than a tree listing holds; "
                                  f"{fix}")
    except FileNotFoundError:  # not cached (yet): huggingface_hub fetches it, or says it is missing
        pass
