"""Placements on a GPU (marker `gpu`, skipped without CUDA): cuda, offload with CUDA-stream prefetch, disk,
expert-major order, and accelerate device maps over GPUs (balanced / sequential, with and without a CPU spill).

Within one GPU every placement runs the same kernels on the same weights, so caches agree to float32
round-off; against the CPU they agree to the GPU's own arithmetic (TF32 convolutions), hence looser bounds.
"""

from __future__ import annotations

import pytest
import torch

from cache import format as F
from cache.manifest import load_manifest
from conftest import make_cache, read_all_samples
from pipeline import diffusers_private
from stages.teacher_cache import group_offload
from stages.teacher_cache.placements import Placement, choose_placement
from stages.teacher_cache.teacher import resolve_teacher

pytestmark = pytest.mark.gpu
F32 = dict(dtype="float32")
SAME_GPU = dict(rtol=1e-5, atol=1e-6)
GPU_VS_CPU = dict(rtol=2e-2, atol=2e-2)


def assert_close_caches(a, b, **tol) -> None:
    assert load_manifest(a).fingerprint == load_manifest(b).fingerprint
    sa, sb = read_all_samples(a), read_all_samples(b)
    assert sa.keys() == sb.keys() and sa
    for key, (ta, meta_a) in sa.items():
        tb, meta_b = sb[key]
        assert meta_a == meta_b
        for name in ta:
            torch.testing.assert_close(tb[name], ta[name], msg=f"{key}/{name}", **tol)


@pytest.fixture(scope="module")
def cuda_cache(tiny_teacher, prompts_file, tmp_path_factory):
    return make_cache(tiny_teacher, prompts_file, tmp_path_factory.mktemp("gpu") / "cuda", placement="cuda", **F32)


@pytest.fixture(scope="module")
def spec(tiny_teacher):
    return resolve_teacher(str(tiny_teacher))


def _forward(model, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 16, 1, 8, 8, generator=g).to(device)
    ctx = torch.randn(2, 32, 32, generator=g).to(device)
    with torch.inference_mode():
        return model(hidden_states=x, timestep=torch.tensor([900.0, 400.0], device=device),
                     encoder_hidden_states=ctx, return_dict=False)[0].float().cpu()


def _reference(spec, comp, device):
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel.from_pretrained(spec.path, subfolder=comp).to(device).eval()


def test_cuda_matches_cpu(tiny_cache, cuda_cache):
    assert_close_caches(tiny_cache, cuda_cache, **GPU_VS_CPU)


@pytest.mark.parametrize("over", [dict(placement="offload"), dict(placement="disk"),
                                  dict(placement="cuda", expert_order="expert"),
                                  dict(placement="offload", expert_order="expert")])
def test_gpu_placements_match_cuda(over, cuda_cache, tiny_teacher, prompts_file, tmp_path):
    out = make_cache(tiny_teacher, prompts_file, tmp_path / "c", **over, **F32)
    assert_close_caches(cuda_cache, out, **SAME_GPU)


def test_offload_prefetches_on_a_cuda_stream(spec):
    """Leaf level: every Linear / Conv3d is a group of its own, prefetched on the side stream from pinned RAM."""
    dev = torch.device("cuda", 0)
    model = group_offload.load_ram_expert(spec, "transformer", torch.float32, dev)
    groups = [g for g in diffusers_private.groups(model) if g.modules or g.parameters or g.buffers]
    layers = [m for m in model.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv3d))]
    assert len([g for g in groups if g.modules]) == len(layers)  # one group per layer, not per block
    assert all(g.stream is not None and g.record_stream for g in groups)
    assert all(p.device.type == "cpu" and p.is_pinned() for p in model.parameters())  # in pinned RAM between forwards
    ref = _reference(spec, "transformer", dev)
    for seed in (0, 1):  # the first pass records the order, the second prefetches along it
        torch.testing.assert_close(_forward(model, dev, seed), _forward(ref, dev, seed), **SAME_GPU)


def test_disk_streams_to_the_gpu(spec, tmp_path):
    dev = torch.device("cuda", 0)
    for comp in spec.experts:
        model = group_offload.load_disk_expert(spec, comp, torch.float32, dev, tmp_path, log=lambda m: None)
        ref = _reference(spec, comp, dev)
        for seed in (0, 1):
            torch.testing.assert_close(_forward(model, dev, seed), _forward(ref, dev, seed), **SAME_GPU)


def _load(spec, kind, max_memory, tmp_path):
    p = Placement(kind, torch.device("cuda", 0), "float32", max_memory=max_memory, offload_dir=tmp_path)
    return p.load_expert(spec, "transformer")


def test_sequential_spills_to_cpu_on_one_gpu(spec, tmp_path):
    """A budget too small for GPU 0: accelerate keeps the rest in RAM and moves it at each forward."""
    model = _load(spec, "sequential", {0: "120KB", "cpu": "1GiB"}, tmp_path)
    assert set(model.hf_device_map.values()) == {0, "cpu"}
    dev = torch.device("cuda", 0)
    torch.testing.assert_close(_forward(model, dev), _forward(_reference(spec, "transformer", dev), dev), **SAME_GPU)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_sequential_splits_over_two_gpus_without_splitting_blocks(spec, tmp_path):
    model = _load(spec, "sequential", {0: "120KB", 1: "1GiB"}, tmp_path)
    dmap = model.hf_device_map
    assert set(dmap.values()) == {0, 1}
    assert all(not k.startswith("blocks.") or k.count(".") == 1 for k in dmap)
    dev = torch.device("cuda", 0)
    torch.testing.assert_close(_forward(model, dev), _forward(_reference(spec, "transformer", dev), dev), **SAME_GPU)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_balanced_cache_matches_cuda(cuda_cache, tiny_teacher, prompts_file, tmp_path):
    out = make_cache(tiny_teacher, prompts_file, tmp_path / "c", placement="balanced", **F32)
    assert_close_caches(cuda_cache, out, **SAME_GPU)


def test_auto_picks_cuda_for_a_teacher_that_fits(cuda_cache, tiny_teacher, prompts_file, tmp_path):
    from pipeline.config import TeacherCacheConfig

    cfg = TeacherCacheConfig(teacher=str(tiny_teacher), prompts=str(prompts_file), out=str(tmp_path / "c"))
    p = choose_placement(cfg, resolve_teacher(str(tiny_teacher)))
    assert (p.kind, p.expert_major, p.dtype) == ("cuda", False, "bfloat16")
