"""An image-to-video teacher's image: the `--images` file that names each image with its prompt, the image read as
the pipeline reads it, and the condition latent each trajectory carries, built exactly as diffusers'
WanImageToVideoPipeline.prepare_latents builds it (so that a trajectory of the cache is one of the pipeline's)."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import torch

from cache import safe_open
from cache.cache_error import UnsafeFileError

from .errors import UserError
from .model_call import CONCAT, FIRST_FRAME, NONE, InputRule
from .prompts import check_prompt, file_lines

MAX_IMAGE_BYTES = 256 << 20  # an image file: a 8K PNG many times over
_WHAT = "image list"
_FIX = "pass --images a text file of <image path><TAB><prompt> lines"


def read_image_file(path: str | Path) -> list[tuple[Path, str]]:
    """(image path, prompt) of every line of an image list, in order (duplicates kept). A line is
    `<image path><TAB><prompt>`: the path up to the first tab (relative to the list's folder, or absolute), the prompt
    after it (checked as a prompt file's are); blank lines and lines starting with `#` are skipped. Every image is
    opened and decoded here (`open_image`), so that a bad one is refused with its line before any work starts."""
    p = Path(path)
    pairs = []
    for n, text in file_lines(p, _WHAT, _FIX):
        if not text.strip() or text.lstrip().startswith("#"):
            continue
        name, tab, prompt = text.partition("\t")
        name, prompt = name.strip(), prompt.strip()
        if not (tab and name and prompt):
            raise UserError(f"{_WHAT} {p} line {n} is not <image path><TAB><prompt>; write the image's path, one tab, "
                            "then its prompt")
        check_prompt(p, n, prompt, _WHAT)
        image = p.parent / name
        open_image(image, f"{_WHAT} {p} line {n}")
        pairs.append((image, prompt))
    if not pairs:
        raise UserError(f"{_WHAT} {p} holds no images (only blank or comment lines); add one <image path><TAB><prompt> "
                        "line per image")
    return pairs


def open_image(path: Path, where: str):
    """The RGB image at `path`, read through safe_open and opened as diffusers.utils.load_image opens it (EXIF
    orientation applied, converted to RGB); UserError naming `where` when it is missing, unreadable or no image."""
    import PIL.Image
    from diffusers.utils import load_image

    fix = "fix the path (relative to the list's folder) or remove the line"
    try:
        data = safe_open.read_named(path, "the image", MAX_IMAGE_BYTES, fix)
    except FileNotFoundError:
        raise UserError(f"{where}: the image {path} does not exist; {fix}") from None
    except UnsafeFileError as e:
        raise UserError(f"{where}: {e}") from None
    except OSError as e:
        raise UserError(f"{where}: the image {path} cannot be read ({e.strerror or e}); {fix}") from e
    try:
        image = load_image(PIL.Image.open(io.BytesIO(data)))
        image.load()
    except (OSError, ValueError, SyntaxError, PIL.Image.DecompressionBombError) as e:
        why = "of no format PIL knows" if isinstance(e, PIL.UnidentifiedImageError) else f"PIL: {e}"
        raise UserError(f"{where}: {path} is not an image ({why}); replace it with a PNG or JPEG, or {fix}") from None
    return image


def image_sha256(image) -> str:
    """An image's identity in the cache's prompt set: a file's bytes (another image under the same name is another
    set), an image in memory its RGB pixels."""
    data = safe_open.read_named(image, "the image", MAX_IMAGE_BYTES) if isinstance(image, Path) else image.tobytes()
    return hashlib.sha256(data).hexdigest()


def image_tensor(image, height: int, width: int) -> torch.Tensor:
    """A PIL image as the pipeline's video_processor.preprocess makes it: [1, 3, height, width] in [-1, 1]."""
    from diffusers.video_processor import VideoProcessor

    return VideoProcessor().preprocess(image, height=height, width=width).to(dtype=torch.float32)


def condition_latent(vae, image: torch.Tensor, frames: int, rule: InputRule) -> torch.Tensor | None:
    """The condition latent of images [B, 3, H, W] in [-1, 1] for a clip of `frames` frames, as prepare_latents
    builds it (float32): `concat`, the mask (frame 0 kept: ones, the rest zeros; one channel per frame the VAE folds
    into a latent frame) stacked on the channels with the normalised latent of [image, zeros...], [B, 4 + C, F, h, w];
    `first_frame` (expand_timesteps), the normalised latent of the image alone, [B, C, 1, h, w]; `none`: None."""
    if rule.condition == NONE:
        return None
    temporal = vae.config.scale_factor_temporal
    if frames < 1 or (frames - 1) % temporal:
        raise ValueError(f"{frames} frames is not 1 + a multiple of {temporal}, as an image-to-video clip is")
    video = image.unsqueeze(2)
    if rule.condition == CONCAT:
        video = torch.cat([video, video.new_zeros(*video.shape[:2], frames - 1, *video.shape[3:])], dim=2)
    latent = vae.encode(video.to(device=vae.device, dtype=vae.dtype)).latent_dist.mode().float()
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1).to(latent.device)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1).to(latent.device)
    latent = (latent - mean) * inv_std  # (as the pipeline computes it, to the bit)
    if rule.condition == FIRST_FRAME:
        return latent
    mask = torch.zeros_like(latent[:, :temporal])
    mask[:, :, 0] = 1
    return torch.cat([mask, latent], dim=1)
