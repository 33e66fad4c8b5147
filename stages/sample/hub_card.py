"""What every export shares (its folder swapped in whole, its hints under `MARK`, the card's snippets) and what makes
it ready for the Hugging Face Hub through huggingface_hub: the card's metadata, names without local paths (an
absolute path leaks a user name) and the upload: docs/architecture.md, "The export"."""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

from cache import safe_open, safe_write
from cache.records import TeacherLora
from pipeline.artifact import DistillRecord
from pipeline.errors import UserError
from pipeline.faults import fault_point
from pipeline.hub import is_hub_id
from pipeline.teacher_files import I2V_PIPELINE, snapshot_blobs


# The folder name of a Hub snapshot in the local cache: models--NAMESPACE--NAME/snapshots/REVISION.
_CACHED = re.compile(r"^models--([\w.-]+?)--([\w.-]+)$")
TAGS = ["wandistiller", "distillation", "wan"]  # then the task: text-to-image, -to-video, image-to-video
# model_index key of an export's hints (diffusers ignores keys starting with '_'); what lets --overwrite replace a
# folder is safe_write's marker file, never a key any JSON may hold
MARK = "_wandistiller"


def building(out: Path):
    """safe_write.building for an export (a new folder beside `out`, swapped in whole, its marker listing what it
    holds), with the swap's fault points."""
    return safe_write.building(out, "export", before_replace=lambda: fault_point("before_dir_rename"),
                               after_replace=lambda: fault_point("after_dir_rename"))


def sigmas_sentence(hints: dict, where: str, whose: str = "Its") -> str:
    """How a card's reader passes a chosen schedule (train-student --student-timesteps, --student-shift, ...): the
    boundaries `hints` holds, which `where` (the file holding MARK) records too."""
    return (f"{whose} boundaries are its own choice, which the scheduler's config cannot hold: before calling, "
            "`pipe.scheduler.set_timesteps = functools.partial(pipe.scheduler.set_timesteps, "
            f"sigmas=numpy.array({hints['sigmas']}))` ({where}'s `{MARK}.sigmas`).")


def pipeline_class(hints: dict, default: str) -> str:
    """The diffusers class a card loads the export with: WanImageToVideoPipeline for an image-to-video student (TI2V's
    WanPipeline folder loads as one too), else `default`."""
    return I2V_PIPELINE if "condition" in hints else default


def draw(hints: dict, args: str, wrap: bool = False) -> tuple[str, str]:
    """(an import, the call) of a card's python snippet, `args` after the prompt and num_frames (`wrap`: the output
    type on a line of its own): a video student's frames written as an mp4 through diffusers' export_to_video; an
    image-to-video student's drawn from the image diffusers' load_image reads."""
    frames, image = hints.get("num_frames", 1), "condition" in hints
    still = frames == 1 and not image
    lhs = "image" if still else "frames"
    sep = "\n" + " " * len(f"{lhs} = pipe(") if wrap else " "
    prompt = 'image=load_image("first_frame.png"), prompt="a lighthouse at night"' if image else \
        '"a lighthouse at night"'
    call = f'{lhs} = pipe({prompt}, num_frames={frames}, {args},{sep}output_type="pil").frames[0]'
    if still:
        return "", call + "[0]"
    return (f"from diffusers.utils import export_to_video{', load_image' * image}\n",
            f'{call}\nexport_to_video(frames, "student.mp4", fps=16)')


def public_teacher(teacher: str, folder: Path | None, base_model: str | None = None) -> tuple[str | None, str]:
    """(base_model, name): the teacher's Hub id for the card (--base-model, else the name if a Hub id and no local
    folder, else the repo of the Hub cache snapshot it was loaded from, else None), and that id or its folder name."""
    base = base_model or (teacher if is_hub_id(teacher) and not Path(teacher).exists() else None)
    if base is None:
        snapshots = (_CACHED.match(part) for part in Path(folder or teacher).resolve().parts[::-1])
        base = next((f"{m.group(1)}/{m.group(2)}" for m in snapshots if m), None)
    return base, base or Path(teacher).name


def carried_teacher_loras(record: DistillRecord | None, what: str) -> str:
    """The card's paragraph on the LoRAs the teacher carried when the cache was drawn ("" without any): `what` draws
    their style with no LoRA of them loaded."""
    if record is None or not record.teacher_loras:
        return ""
    return (f"\n\nIts teacher carried LoRAs fused into its experts when its cache was drawn: "
            f"{TeacherLora.describe(record.teacher_loras)}. {what} draws their style as learned: load none of them "
            "beside it (they would apply twice).")


def public_record(record: DistillRecord, teacher: str) -> dict:
    """distill.json as an export carries it: the teacher by its public name, caches by fingerprint, files by name."""
    name = lambda p: Path(p).name if p else p  # noqa: E731
    return dataclasses.replace(record, teacher=teacher, teacher_path=None, teacher_lora_paths=None,
                               caches=[{"fingerprint": c["fingerprint"]} for c in record.caches],
                               init_from_teacher=name(record.init_from_teacher),
                               student_config=name(record.student_config)).to_json()


def drop_local_names(folder: Path) -> None:
    """Remove from every JSON file below `folder` (the export being built) the `_name_or_path` (`name_or_path`)
    diffusers and transformers save where it is a local path, which says nothing to anyone else (a Hub id stays);
    symlinked folders are left alone, and so is any file larger than a config (a tokenizer's vocabulary)."""
    cap = safe_open.CAPS["config"]
    for root, _dirs, files in os.walk(folder):
        for name in files:
            path = Path(root) / name
            if not name.endswith(".json") or path.is_symlink() or path.stat().st_size > cap:
                continue
            data = safe_open.read_bytes(folder, path.relative_to(folder).as_posix(), cap, "export again")
            if b"name_or_path" not in data:
                continue
            try:
                obj = safe_open.parse_json(data, path)
            except ValueError:
                continue
            local = [k for k in ("_name_or_path", "name_or_path") if isinstance(obj, dict) and
                     isinstance(obj.get(k), str) and os.path.isabs(os.path.expanduser(obj[k]))]
            if local:
                safe_write.write_json(path, {k: v for k, v in obj.items() if k not in local})


def teacher_license(folder: Path, repo_id: str | None) -> str | None:
    """The license the teacher's own model card declares (in its folder, else its Hub repo's); None when unknown."""
    import yaml
    from huggingface_hub import hf_hub_download
    from huggingface_hub.repocard import REGEX_YAML_BLOCK

    cap = safe_open.CAPS["config"]
    try:
        try:  # bounded, a FIFO never waited on, a Hub snapshot's link only into its own blobs/
            card = safe_open.resolve_inside(folder, "README.md", "remove it", snapshot_blobs(folder))
        except FileNotFoundError:  # (the snapshot of the teacher's weights leaves its card out)
            if repo_id is None:
                return None
            card = hf_hub_download(repo_id, "README.md")
        text = safe_open.read_named(card, "the teacher's model card", cap).decode("utf-8-sig")
        license_ = yaml.safe_load(REGEX_YAML_BLOCK.search(text).group(2)).get("license")  # (metadata_load's parse)
    except Exception:  # offline and not cached, no card, or front matter that is not YAML: the license stays unknown,
        return None  # and the export goes on
    return license_ if isinstance(license_, str) and license_ else None


def front_matter(license_: str | None, base_model: str | None, few_step: bool, tags: tuple[str, ...] = (),
                 video: bool = False, image: bool = False) -> str:
    """The model card's YAML metadata (what the Hub indexes it by), `tags` after the common ones; `video`: a student
    trained on clips (frames > 1), a text-to-video pipeline; `image`: one that draws from an image, image-to-video."""
    from huggingface_hub import ModelCardData

    task = "image-to-video" if image else "text-to-video" if video else "text-to-image"
    tags = TAGS + [task] + (["few-step"] if few_step else []) + list(tags)
    data = ModelCardData(license=license_, base_model=base_model, pipeline_tag=task, library_name="diffusers",
                         tags=tags)
    return f"---\n{data.to_yaml()}\n---\n"


def check_online(repo_id: str) -> None:
    """Refuse --push-to-hub up front, before the export is written, when huggingface_hub is told to stay offline."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        raise UserError(f"--push-to-hub {repo_id} needs the Hub, and HF_HUB_OFFLINE is set; unset it, or export "
                        "without --push-to-hub and upload the folder later with `hf upload`")


def push(folder: Path, repo_id: str, private: bool) -> str:
    """Upload `folder` to the Hub model repo `repo_id` (created if missing); its URL, else one UserError line."""
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
