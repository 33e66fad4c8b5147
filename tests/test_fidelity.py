"""Stage one is faithful to the teacher's own sampler: cached final latents equal WanPipeline's output."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cache import format as F
from cache.manifest import load_manifest
from cache.prompt_store import PartRows, open_prompt_store, prompt_store_path
from conftest import TEST_PROMPTS, make_cache, read_all_samples

pytestmark = pytest.mark.slow

NEG = "blurry, low quality"


@pytest.mark.parametrize("variant", ["wan2.2", "wan2.1", "ti2v"])
def test_final_latents_and_embeddings_match_wan_pipeline(variant, tiny_teacher_factory, prompts_file, tmp_path):
    from diffusers import WanPipeline

    teacher = tiny_teacher_factory(variant)
    g2 = 2.5 if variant == "wan2.2" else None
    # On the CPU, as the reference pipeline below runs: the comparison is of the sampler, not of two devices.
    same = dict(guidance=5.0, guidance_2=g2, seeds_per_prompt=2, num_parts=2, negative_prompt=NEG, placement="cpu")
    cache = make_cache(teacher, prompts_file, tmp_path / "cache", part=0, **same)
    make_cache(teacher, prompts_file, tmp_path / "cache", part=1, **same)
    m = load_manifest(cache)
    if variant == "wan2.2":  # both experts ran
        assert set(m.experts) == {1, 2}
    pipe = WanPipeline.from_pretrained(teacher).to("cpu")
    for prompt_idx in (0, 5):  # one prompt from each part
        part, row = prompt_idx % 2, prompt_idx // 2
        g = open_prompt_store(prompt_store_path(cache, part))
        assert g[F.Z_TEXT][row] == TEST_PROMPTS[prompt_idx]
        # embeddings: equal to encode_prompt on the real tokens, zero past them (no_grad, as __call__ runs it)
        with torch.no_grad():
            ref_emb, _ = pipe.encode_prompt(TEST_PROMPTS[prompt_idx], do_classifier_free_guidance=False,
                                            max_sequence_length=32, device="cpu")
        n = int(g[F.Z_SEQ_LENS][row])
        emb = torch.from_numpy(PartRows(cache, part, 2).padded([row])[0])
        assert 0 < n < 32
        assert torch.equal(emb[:n], ref_emb[0, :n]) and not emb[n:].any() and not ref_emb[0, n:].any()
        for seed_idx in (0, 1):
            noise = torch.from_numpy(g[F.Z_INIT_NOISE][row, seed_idx]).unsqueeze(0)
            ref = pipe(TEST_PROMPTS[prompt_idx], negative_prompt=NEG, height=64, width=64, num_frames=1,
                       num_inference_steps=4, guidance_scale=5.0, guidance_scale_2=g2, latents=noise.clone(),
                       max_sequence_length=32, output_type="latent").frames
            got = torch.from_numpy(g[F.Z_FINAL_LATENTS][row, seed_idx]).unsqueeze(0)
            err = (got - ref).abs().max().item()
            assert err <= 1e-4 * ref.abs().max().item(), (variant, prompt_idx, seed_idx, err)


def test_samples_are_the_trajectory(tiny_cache):
    """Each step's target, stepped by the scheduler from x_t, lands on the next step's x_t."""
    from diffusers import UniPCMultistepScheduler

    m = load_manifest(tiny_cache)
    samples = read_all_samples(tiny_cache)
    assert len(samples) == 7 * 4
    keys = sorted(samples)
    assert keys == sorted(F.sample_key(p, 0, k) for p in range(7) for k in range(4))
    sched = UniPCMultistepScheduler.from_config(m.scheduler)
    sched.set_timesteps(4)
    x = samples[F.sample_key(3, 0, 0)][0][F.T_X_T].unsqueeze(0)
    g = open_prompt_store(prompt_store_path(tiny_cache, 0))
    assert torch.equal(x[0], torch.from_numpy(g[F.Z_INIT_NOISE][3, 0]))
    for k, t in enumerate(sched.timesteps):
        tensors, meta = samples[F.sample_key(3, 0, k)]
        assert torch.equal(tensors[F.T_X_T], x[0])
        assert meta[F.M_TIMESTEP] == float(t) == m.timesteps[k]
        assert meta[F.M_EXPERT] == m.experts[k] and meta[F.M_GUIDANCE] == 4.0
        x = sched.step(tensors[F.T_TARGET].unsqueeze(0), t, x, return_dict=False)[0]
    np.testing.assert_array_equal(x[0].numpy(), g[F.Z_FINAL_LATENTS][3, 0])
