"""A clip as a file every player opens: an mp4 of H.264 in yuv420p, encoded by imageio's ffmpeg writer (the
imageio-ffmpeg wheel carries ffmpeg, as it serves diffusers' export_to_video) and published through safe_write."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from cache import safe_write

MP4_QUALITY = 8  # imageio's 0-10 scale; for libx264 it is -crf 51 x (1 - q / 10): crf 10, visually lossless


def write_mp4(path: Path, clip: np.ndarray, fps: int) -> Path:
    """The uint8 clip [F, H, W, 3] as an H.264 mp4 at `path`: ffmpeg writes it into a private folder beside `path`
    (mkdtemp: new, the user's alone), and safe_write copies it in under a temporary name renamed over `path`, so a
    link planted at the name is replaced, never written through. yuv420p halves the chroma of each side, so a side
    must be even: an odd one gets its last row or column repeated (never a resize; Wan's sides are multiples of 16)
    and imageio's own rounding up to 16 (`macro_block_size`) is off, so no frame is scaled."""
    import imageio.v2 as imageio

    h, w = clip.shape[1:3]
    clip = np.pad(clip, ((0, 0), (0, h % 2), (0, w % 2), (0, 0)), mode="edge")
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=f".{path.name}.") as tmp:
        encoded = Path(tmp) / path.name
        with imageio.get_writer(encoded, format="FFMPEG", fps=fps, codec="libx264", pixelformat="yuv420p",
                                quality=MP4_QUALITY, macro_block_size=1, ffmpeg_log_level="error") as writer:
            for frame in clip:
                writer.append_data(frame)
        safe_write.copy_file(encoded, path)
    return path
