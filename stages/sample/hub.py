"""What makes an export ready for the Hugging Face Hub: the model card's metadata (YAML front matter the Hub reads
for its license, base model, task and library), names without local paths, and the upload itself
(`export --push-to-hub REPO_ID`), all through huggingface_hub.

A Hub card describes the model to strangers: it names the teacher by its Hub id and says nothing of the folders it
was trained from (an absolute path there leaks a user name and means nothing to anyone else).
"""

from __future__ import annotations

import re
from pathlib import Path

from pipeline.errors import UserError
from pipeline.hub import is_hub_id

# The folder name of a Hub snapshot in the local cache: models--NAMESPACE--NAME/snapshots/REVISION.
_CACHED = re.compile(r"^models--([\w.-]+?)--([\w.-]+)$")
TAGS = ["wandistiller", "distillation", "wan", "text-to-image"]


def hub_id(teacher: str, folder: Path | None = None) -> str | None:
    """The Hub id the teacher is known by: the name itself when it is one (and no local folder of that name exists),
    or the repository of the local Hub cache snapshot it was loaded from; None for a folder of one's own."""
    if is_hub_id(teacher) and not Path(teacher).exists():
        return teacher
    for part in Path(folder or teacher).resolve().parts[::-1]:
        m = _CACHED.match(part)
        if m:
            return f"{m.group(1)}/{m.group(2)}"
    return None


def teacher_license(folder: Path, repo_id: str | None) -> str | None:
    """The license the teacher's own model card declares (its README.md front matter: in its folder, or its Hub
    repo's, from the local Hub cache or the Hub), if it has one; None when no card can be read."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.repocard import metadata_load

    card = folder / "README.md"
    if not card.is_file() and repo_id is not None:
        try:  # (the snapshot of the teacher's weights leaves its card out)
            card = Path(hf_hub_download(repo_id, "README.md"))
        except Exception:  # offline and not cached, or no card: the license stays unknown, the export goes on
            return None
    if not card.is_file():
        return None
    try:
        meta = metadata_load(card) or {}
    except Exception:  # a card whose front matter is not YAML declares nothing we can carry over
        return None
    license_ = meta.get("license")
    return license_ if isinstance(license_, str) and license_ else None


def front_matter(license_: str | None, base_model: str | None, few_step: bool) -> str:
    """The model card's YAML metadata block: what the Hub indexes the model by."""
    from huggingface_hub import ModelCardData

    tags = TAGS + (["few-step"] if few_step else [])
    data = ModelCardData(license=license_, base_model=base_model, pipeline_tag="text-to-image",
                         library_name="diffusers", tags=tags)
    return f"---\n{data.to_yaml()}\n---\n"


def check_online(repo_id: str) -> None:
    """Refuse --push-to-hub up front, before the export is written, when huggingface_hub is told to stay offline."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        raise UserError(f"--push-to-hub {repo_id} needs the Hub, and HF_HUB_OFFLINE is set; unset it, or export "
                        "without --push-to-hub and upload the folder later with `hf upload`")


def push(folder: Path, repo_id: str, private: bool) -> str:
    """Upload the export `folder` to the Hub model repo `repo_id` (created if missing); its URL. Offline, refused or
    unreachable: one UserError line that says the folder is complete and how to upload it later."""
    try:
        from huggingface_hub import HfApi

        api = HfApi()
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        info = api.upload_folder(folder_path=str(folder), repo_id=repo_id, repo_type="model",
                                 commit_message="Upload a WanDistiller student pipeline")
    except Exception as e:  # offline mode, no network, no token, refused: all the user's to fix, never a bug of ours
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(f"cannot push {folder} to the Hub repo {repo_id} ({type(e).__name__}: {reason}); the export "
                        f"itself is complete: upload it later with `hf upload {repo_id} {folder} .` once online and "
                        "logged in (`hf auth login`, or HF_TOKEN)") from e
    return getattr(info, "commit_url", None) or f"{repo_id}"
