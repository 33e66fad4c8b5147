"""Shared fixtures: tiny Wan teachers and a tiny cache, built once per session on the CPU."""

from __future__ import annotations

import os
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(min(2, os.cpu_count() or 1))

# Small settings that every stage-one test shares (64x64 images -> 8x8 latents, 4 steps).
TINY_CACHE_ARGS = dict(steps=4, guidance=4.0, height=64, width=64, frames=1, max_sequence_length=32,
                       negative_prompt="blurry, low quality", batch_size=3, samples_per_shard=12)

TEST_PROMPTS = [
    "a red circle on a blue background",
    "a small green square in the top left",
    "a lighthouse at night under the stars",
    "a cat sleeping on a wooden chair",
    "watercolor painting of a mountain lake at dawn",
    "a yellow triangle next to a purple star",
    "pixel art of a rocket flying to the moon",
]


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs CUDA")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
    # The files with the most end-to-end (`slow`) tests first, each file's tests in their order: pytest-xdist hands
    # out whole files in this order, and a long file handed out last would run alone at the end.
    slow = Counter(item.path for item in items if "slow" in item.keywords)
    items.sort(key=lambda item: -slow[item.path])


def pytest_terminal_summary(terminalreporter):
    """The fault-tolerance table (tests/test_faults.py; `python -m tests.faults` prints the same), from the rows
    each scenario test put in its report: a pytest-xdist worker's own output never reaches the terminal."""
    from faults import FAULT_ROWS, Row, render

    rows = [Row(**r) for reports in terminalreporter.stats.values() for rep in reports
            if getattr(rep, "when", None) == "call"
            for name, value in getattr(rep, "user_properties", ()) if name == FAULT_ROWS for r in value]
    if rows:
        terminalreporter.write_sep("-", "fault-tolerance suite (python -m tests.faults prints the same table)")
        terminalreporter.write_line(render(rows))


_VISIBLE_AT_START = os.environ.get("CUDA_VISIBLE_DEVICES")


@pytest.fixture(autouse=True)
def _gpus_stay_visible():
    """A CPU command run in this process hides the GPUs from it (`runtime.hide_gpus` sets CUDA_VISIBLE_DEVICES);
    the next test, and the processes it starts (torchrun ranks of a gpu test), see them again. Restored to the
    session's value, not the test's: a session or module fixture that ran a CPU command during this test's setup
    hid them before this fixture could save anything."""
    saved = _VISIBLE_AT_START
    yield
    if saved is None:
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    else:
        os.environ["CUDA_VISIBLE_DEVICES"] = saved


@pytest.fixture(scope="session")
def tiny_teacher_factory(tmp_path_factory):
    """tiny_teacher_factory(variant, seed=0) -> path of a tiny teacher folder (built once per variant/seed)."""
    from pipeline.tiny_teacher import write_tiny_teacher

    built: dict[tuple[str, int], Path] = {}

    def make(variant: str = "wan2.2", seed: int = 0) -> Path:
        if (variant, seed) not in built:
            built[(variant, seed)] = write_tiny_teacher(tmp_path_factory.mktemp(f"teacher-{variant}"), variant, seed)
        return built[(variant, seed)]

    return make


@pytest.fixture(scope="session")
def tiny_teacher(tiny_teacher_factory) -> Path:
    return tiny_teacher_factory("wan2.2")


@pytest.fixture(scope="session")
def prompts_file(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    p.write_text("# test prompts\n" + "\n".join(TEST_PROMPTS) + "\n")
    return p


def make_cache(teacher: Path, prompts: Path, out: Path, **overrides):
    """Run stage one in-process and return the cache path."""
    from pipeline.config import TeacherCacheConfig
    from stages import teacher_cache

    args = dict(TINY_CACHE_ARGS, teacher=str(teacher), prompts=prompts and str(prompts), out=str(out), placement="cpu")
    args.update(overrides)
    teacher_cache.run(TeacherCacheConfig(**args))
    return out


@pytest.fixture(scope="session")
def tiny_cache(tiny_teacher, prompts_file, tmp_path_factory) -> Path:
    """A finished cache of the two-expert tiny teacher: 7 prompts x 1 seed x 4 steps = 28 samples."""
    return make_cache(tiny_teacher, prompts_file, tmp_path_factory.mktemp("cache") / "cache")


@pytest.fixture(scope="session")
def tiny_video_cache(tiny_teacher, tmp_path_factory) -> Path:
    """A finished video cache of the tiny teacher: 5 frames (2 latent frames through its VAE's 4x temporal factor),
    2 prompts x 1 seed x 4 steps = 8 samples."""
    prompts = tmp_path_factory.mktemp("video-prompts") / "two.txt"
    prompts.write_text("\n".join(TEST_PROMPTS[:2]) + "\n")
    return make_cache(tiny_teacher, prompts, tmp_path_factory.mktemp("video-cache") / "cache", frames=5)


def sample_header(**overrides):
    """A stage-one header of tiny settings, for tests that write cache records without running stage one."""
    from cache.records import CacheHeader

    return CacheHeader(**dict(
        teacher="tiny", revision=None, teacher_path="/tiny", dtype="float32", steps=4,
        timesteps=[999.0, 750.0, 500.0, 250.0], sigmas=[1.0, 0.75, 0.5, 0.25], experts=[1, 1, 2, 2], guidance=4.0,
        guidance_2=4.0, boundary_ratio=0.875, expand_timesteps=False, height=64, width=64, frames=1,
        latent_shape=[4, 1, 8, 8], max_sequence_length=32, negative_prompt="", seeds_per_prompt=1, seed=0, prompts=2,
        prompt_set_sha256="0" * 64, text_dim=32, in_channels=4, patch_size=[1, 2, 2],
        scheduler={"_class_name": "UniPCMultistepScheduler"}, cfg=True, save_cond_uncond=False, teacher_identity={},
    ) | overrides)


def sample_distill(**overrides):
    """A distill.json record of a student trained on `sample_header`'s cache."""
    from pipeline.artifact import DistillRecord

    return DistillRecord.of_cache(sample_header(), **dict(
        caches=[{"path": "/cache", "fingerprint": "abc"}], fingerprints=["abc"], train_steps=[0, 1, 2, 3],
        train_timesteps=[999.0, 750.0, 500.0, 250.0], heldout_prompts=[1], init_seed=0, objective="velocity",
        objective_settings={}) | overrides)


def write_prompt_rows(g, rows: list[int], prompt_idx: list[int], texts: list[str], embeds: torch.Tensor,
                      seq_lens: torch.Tensor) -> None:
    """Write encoded prompts into a prompt store at once, as stage one does batch by batch (`PromptRowWriter`)."""
    from cache.prompt_store import PromptRowWriter

    writer = PromptRowWriter(g)
    writer.add(rows, prompt_idx, texts, embeds, seq_lens)
    writer.close()


def read_all_samples(cache_dir: Path) -> dict[str, tuple[dict, dict]]:
    """key -> (tensors, meta) for every sample listed in the manifest (test helper; not the stage-two reader)."""
    import tarfile

    from cache.manifest import load_manifest
    from cache.reader import decode_sample

    out: dict[str, tuple[dict, dict]] = {}
    for rec in load_manifest(cache_dir).shards:
        members: dict[str, dict[str, bytes]] = {}
        with tarfile.open(Path(cache_dir) / rec.path) as tar:
            for info in tar:
                key, _, ext = info.name.partition(".")
                members.setdefault(key, {})[ext] = tar.extractfile(info).read()
        for key, mem in members.items():
            assert key not in out, f"duplicate sample {key}"
            out[key] = decode_sample(mem)
    return out


def assert_recipe_text_encoder(text_encoder, recipe: dict) -> None:
    """`text_encoder` is what the tiny-teacher recipe (its TRAINING.json `recipe`) keeps frozen: the random UMT5 of
    the tiny teacher of `text_encoder_seed`, with only its relative-position bias scaled by `text_bias_scale`."""
    from pipeline.tiny_teacher import build_tiny_pipeline

    want = build_tiny_pipeline("wan2.2", recipe["text_encoder_seed"]).text_encoder.state_dict()
    got = text_encoder.state_dict()
    assert got.keys() == want.keys() and any("relative_attention_bias" in k for k in want)
    for k, v in want.items():
        scale = recipe["text_bias_scale"] if "relative_attention_bias" in k else 1.0
        assert torch.equal(got[k], v * scale), k


@pytest.fixture
def home(tmp_path) -> Path:
    """A victim's files, outside every cache, run and output folder: hostile links and paths point in here."""
    h = tmp_path / "home"
    h.mkdir()
    (h / "thesis.tex").write_text("precious")
    return h
