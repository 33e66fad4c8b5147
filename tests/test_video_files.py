"""Video files people open: `sample` writes an H.264 (yuv420p) mp4 beside each animated WebP, through imageio's
ffmpeg writer (imageio-ffmpeg's wheel carries ffmpeg); a link planted at its name is replaced, never written
through; frames keep their size (an odd side padded by one repeated row, never scaled); and diffusers'
export_to_video, which the export cards call, runs in the project's own environment."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from conftest import TEST_PROMPTS
from stages.sample.video_file import write_mp4
from test_sample import invoke
from test_sample_video import FRAMES, video_run  # noqa: F401 (the module fixture: a 5-frame run of the tiny teacher)


def _read(path) -> tuple[list[np.ndarray], dict]:
    import imageio.v2 as imageio

    reader = imageio.get_reader(path)
    return list(reader.iter_data()), reader.get_meta_data()


def _clip(frames: int, h: int, w: int) -> np.ndarray:
    """A square moving right over a gradient: frames an encoder keeps apart."""
    clip = np.zeros((frames, h, w, 3), dtype=np.uint8)
    clip[..., 2] = np.linspace(40, 200, w, dtype=np.uint8)
    for i in range(frames):
        clip[i, h // 4: h // 2, 4 * i: 4 * i + 12, 0] = 255
    return clip


def test_an_mp4_is_h264_yuv420p_of_every_frame_at_its_size(tmp_path):
    clip = _clip(9, 64, 64)
    frames, meta = _read(write_mp4(tmp_path / "a.mp4", clip, fps=16))
    assert (len(frames), meta["size"], meta["codec"], meta["fps"]) == (9, (64, 64), "h264", 16.0)
    assert meta["pix_fmt"].startswith("yuv420p")
    error = max(float(np.abs(f.astype(int) - c.astype(int)).mean()) for f, c in zip(frames, clip))
    assert error < 3.0, error  # (crf 10: the frames come back, up to H.264's rounding)
    assert sorted(os.listdir(tmp_path)) == ["a.mp4"]  # (ffmpeg's own file went with its private folder)


def test_an_odd_side_is_padded_by_one_row_never_scaled(tmp_path):
    clip = _clip(5, 63, 65)
    frames, meta = _read(write_mp4(tmp_path / "odd.mp4", clip, fps=8))
    assert meta["size"] == (66, 64) and frames[0].shape == (64, 66, 3)  # (imageio: width x height)
    assert float(np.abs(frames[2][:63, :65].astype(int) - clip[2].astype(int)).mean()) < 3.0  # the frame, unscaled


def test_a_link_planted_at_the_mp4_name_is_replaced_not_written_through(tmp_path, home):
    victim = home / "thesis.tex"
    os.symlink(victim, tmp_path / "clip.mp4")
    write_mp4(tmp_path / "clip.mp4", _clip(5, 32, 32), fps=8)
    assert victim.read_text() == "precious" and not (tmp_path / "clip.mp4").is_symlink()
    assert len(_read(tmp_path / "clip.mp4")[0]) == 5


@pytest.mark.slow
def test_sample_writes_an_mp4_beside_each_webp(video_run, tmp_path):  # noqa: F811
    prompts = tmp_path / "p.txt"
    prompts.write_text("\n".join(TEST_PROMPTS[:2]) + "\n")
    out = tmp_path / "grid.png"
    r = invoke(["sample", "--student", video_run, "--prompts", prompts, "--out", out, "--fps", 4,
                "--steps", 2, "--student-steps", 2])
    assert r.exit_code == 0 and "each also as an H.264 mp4" in r.output, r.output
    meta = json.loads(out.with_name("grid.png.json").read_text())
    assert list(meta["mp4"]) == list(meta["videos"]) == ["teacher", "student"]
    for name, paths in meta["mp4"].items():
        assert [p.removesuffix(".mp4") for p in paths] == [p.removesuffix(".webp") for p in meta["videos"][name]]
        for path in paths:
            frames, info = _read(path)
            assert (len(frames), info["size"], info["codec"], info["fps"]) == (FRAMES, (64, 64), "h264", 4.0)


def test_diffusers_export_to_video_runs_in_the_projects_environment(tmp_path):
    """What every video card calls: with imageio and imageio-ffmpeg installed, diffusers' export_to_video writes the
    clip (not its legacy OpenCV path, which this environment lacks)."""
    from diffusers.utils import export_to_video
    from diffusers.utils.import_utils import is_imageio_available
    from PIL import Image

    assert is_imageio_available()
    frames = [Image.fromarray(f) for f in _clip(9, 64, 64)]
    path = export_to_video(frames, str(tmp_path / "student.mp4"), fps=16)
    got, meta = _read(path)
    assert (len(got), meta["size"], meta["codec"]) == (9, (64, 64), "h264")
