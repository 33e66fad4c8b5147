"""LoRA students (`train-student --lora-of TEACHER`): only the adapters train and the base keeps the teacher's bytes;
each Wan 2.2 expert's adapter learns from the samples that expert produced; kill and resume bit-equal; two ranks equal
one process; what a user can get wrong ends in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from cache import format as F
from cache.manifest import load_manifest
from conftest import read_all_samples
from pipeline.config import TrainStudentConfig
from pipeline.errors import UserError
from stages.students import lora as lora_student
from stages.train_student import checkpoint
from stages.train_student.strategy import state_sha
from test_train_student import invoke, metrics, train

LORA = dict(student_config=None, lora_rank=4, objective="segment", student_steps=2, lr=1e-2)
FILES = ["high_noise_model.safetensors", "lora.json", "low_noise_model.safetensors"]


def lora_train(cache, teacher, out, **kw) -> dict:
    return train(cache, out, **(LORA | {"lora_of": str(teacher)} | kw))


def spec_of(teacher, cache, **kw) -> lora_student.LoraStudent:
    """The LoRA student kind of a run on `cache`, prepared (checked against the cache) as the run prepares it."""
    cfg = TrainStudentConfig(**({"cache": (str(cache),), "out": "o", "lora_of": str(teacher)} | LORA | kw))
    spec = lora_student.LoraStudent(cfg)
    spec.prepare(load_manifest(cache), str(cache), None)
    return spec


def with_adapters(spec: lora_student.LoraStudent, folder: Path, seed: int = 0) -> lora_student.LoraExperts:
    """The LoRA student rebuilt from the teacher and a run's student/ files (diffusers' key names mapped back)."""
    model = spec.build(seed, torch.float32)
    params = dict(model.named_parameters())
    for comp in spec.trained:
        for k, v in load_file(folder / spec.record().files[comp]).items():
            name = k.removeprefix("transformer.").replace(".weight", f".{lora_student.ADAPTER}.weight")
            with torch.no_grad():
                params[f"experts.{comp}.{name}"].copy_(v)
    return model


def _batch(samples: list[tuple[dict, dict]], cache: Path) -> dict:
    from cache.prompt_store import EmbeddingCache

    m = load_manifest(cache)
    emb = EmbeddingCache(cache, int(m.num_parts), 8)
    ctx = torch.stack([torch.as_tensor(emb.get(int(meta[F.M_PROMPT_IDX]))).float() for _, meta in samples])
    return {"hidden_states": torch.stack([t[F.T_X_T].float() for t, _ in samples]),
            "timestep": torch.tensor([float(meta[F.M_TIMESTEP]) for _, meta in samples]),
            "encoder_hidden_states": ctx}


def test_each_sample_reaches_the_expert_that_produced_it(tiny_teacher, tiny_cache):
    """A mixed micro-batch is split at the boundary as stage one split the steps: each sample's prediction is its own
    expert's (the untrained adapters add exactly zero), and a batch of expert-2 samples trains expert 2's adapter
    alone (expert 1's gets zero gradients, so DDP still reduces it)."""
    from diffusers import WanTransformer3DModel

    spec = spec_of(tiny_teacher, tiny_cache)
    assert spec.trained == ("transformer", "transformer_2") and spec.boundary_timestep == 875.0
    samples = sorted(read_all_samples(tiny_cache).values(), key=lambda s: s[1][F.M_STEP])
    by_expert = {e: [s for s in samples if s[1][F.M_EXPERT] == e][:2] for e in (1, 2)}
    assert all(len(v) == 2 for v in by_expert.values())
    mixed = [by_expert[2][0], by_expert[1][0], by_expert[2][1], by_expert[1][1]]
    model = spec.build(0, torch.float32)
    b = _batch(mixed, tiny_cache)
    with torch.no_grad():
        got = model(**b)[0]
        for expert, rows in ((1, [1, 3]), (2, [0, 2])):  # each expert's rows, run as the router runs them
            assert [mixed[j][1][F.M_EXPERT] for j in rows] == [expert, expert]
            comp = lora_student.COMPONENTS[expert - 1]
            teacher = WanTransformer3DModel.from_pretrained(tiny_teacher / comp).eval()
            own = teacher(**{k: v[rows] for k, v in b.items()}, return_dict=False)[0]
            assert torch.equal(got[rows], own), comp

    low = _batch(by_expert[2], tiny_cache)
    model(**low)[0].square().mean().backward()
    grads = {c: [p.grad for k, p in m.named_parameters() if "lora_B" in k] for c, m in model.experts.items()}
    assert all(g is not None and not g.any() for g in grads["transformer"])
    assert all(g is not None and g.abs().sum() > 0 for g in grads["transformer_2"])


@pytest.mark.slow
def test_only_the_adapters_train_and_the_base_keeps_the_teachers_bytes(tiny_teacher, tiny_cache, tmp_path):
    out = tmp_path / "run"
    summary = lora_train(tiny_cache, tiny_teacher, out, max_steps=4, checkpoint_every=2, seed=5)
    assert sorted(p.name for p in (out / "student").iterdir()) == FILES
    record = json.loads((out / "distill.json").read_text())["lora"]
    assert record["trained"] == ["transformer", "transformer_2"] and record["rank"] == 4 and record["alpha"] == 4.0
    for comp, name in record["files"].items():
        tensors = load_file(out / "student" / name)
        assert tensors and all(k.startswith("transformer.blocks.") and ".lora_" in k for k in tensors), name
        assert any(t.abs().sum() > 0 for k, t in tensors.items() if "lora_B" in k), name  # it learned
    # the checkpoint holds the adapters and their AdamW state, nothing of the base
    ckpt = out / "checkpoints" / "step-00000002"
    saved = load_file(ckpt / checkpoint.MODEL)
    assert saved and all(".lora_" in k for k in saved)
    optim = torch.load(ckpt / checkpoint.OPTIMIZER, weights_only=True)
    assert len(optim["state"]) == len(saved)
    # the trained student, whole (base and adapters), is the teacher's base plus the saved adapters, bit for bit
    spec = spec_of(tiny_teacher, tiny_cache)
    assert state_sha(with_adapters(spec, out / "student", seed=5).state_dict()) == summary["param_sha256"]


@pytest.mark.slow
def test_one_expert_alone_trains_on_its_own_samples(tiny_teacher, tiny_cache, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDISTILLER_DEBUG_DIR", str(tmp_path / "debug"))
    out = tmp_path / "low"
    lora_train(tiny_cache, tiny_teacher, out, lora_experts="2", max_steps=3, batch_size=2)
    experts = load_manifest(tiny_cache).experts
    keys = [k for b in json.loads((tmp_path / "debug" / "rank-0.json").read_text())["micro_batches"] for k in b]
    assert keys and {experts[F.parse_key(k)[2]] for k in keys} == {2}
    assert sorted(p.name for p in (out / "student").iterdir()) == ["lora.json", "low_noise_model.safetensors"]
    assert json.loads((out / "distill.json").read_text())["train_steps"] == [k for k, e in enumerate(experts) if e == 2]


@pytest.mark.slow
def test_kill_and_resume_gives_the_same_lora_run(tiny_teacher, tiny_cache, tmp_path, monkeypatch):
    kw = dict(max_steps=8, checkpoint_every=3, warmup_steps=2, ema_decay=0.8, holdout_prompts=1, eval_every=4)
    full, cut = tmp_path / "full", tmp_path / "cut"
    lora_train(tiny_cache, tiny_teacher, full, **kw)
    monkeypatch.setenv("WANDISTILLER_FAIL_AT", "0:6")  # dies as step 6 begins: checkpoint 3 on disk
    with pytest.raises(RuntimeError, match="injected failure"):
        lora_train(tiny_cache, tiny_teacher, cut, **kw)
    monkeypatch.delenv("WANDISTILLER_FAIL_AT")
    with pytest.raises(UserError, match="another lora"):  # another rank is another run
        lora_train(tiny_cache, tiny_teacher, cut, resume=True, **(kw | {"lora_rank": 8}))
    lora_train(tiny_cache, tiny_teacher, cut, resume=True, **kw)
    assert [r["loss"] for r in metrics(cut)] == [r["loss"] for r in metrics(full)]
    assert metrics(cut, "eval") == metrics(full, "eval")
    for folder in ("student", "student_ema"):
        for name in FILES[::2]:
            a, b = load_file(cut / folder / name), load_file(full / folder / name)
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (folder, name)


@pytest.mark.dist
@pytest.mark.slow
def test_lora_on_two_ranks_matches_one_process(tiny_teacher, tiny_cache, tmp_path, monkeypatch):
    from test_train_student import max_rel_diff
    from test_train_student_dist import ARGS, assert_ranks_match_one, two_ranks_and_one

    args = ARGS | LORA | {"lora_of": str(tiny_teacher), "lr": 1e-3}
    out2, out1, ranks, one = two_ranks_and_one(tiny_cache, tmp_path, monkeypatch, args)
    assert_ranks_match_one(out2, out1, ranks, one)
    for name in FILES[::2]:  # (AdamW amplifies the reductions' rounding: up to 1.6e-4 with AVX-512's kernels)
        assert max_rel_diff(load_file(out2 / "student" / name), load_file(out1 / "student" / name)) <= 2e-4


# --strategy fsdp: 7 prompts, 1 held out, steps 0,1,2 -> 18 training samples; batch 1 x 2 ranks x 2 micro-steps, so
# most micro-batches hold one expert's samples and the other expert runs idle (a zero-weighted row) on that rank.
FSDP = dict(train_steps="0,1,2", batch_size=1, grad_accum=2, max_steps=4, checkpoint_every=2, warmup_steps=1,
            ema_decay=0.8, holdout_prompts=1, eval_every=2, val_every=2, seed=3, lr=1e-3, report_to="none",
            strategy="fsdp")


@pytest.fixture(scope="module")
def fsdp_run(tiny_teacher, tiny_cache, tmp_path_factory) -> tuple[Path, dict]:
    """A LoRA run on two gloo ranks under --strategy fsdp: (its folder, rank 0's debug record)."""
    from test_train_student_dist import torchrun

    root = tmp_path_factory.mktemp("fsdp-lora")
    proc = torchrun(tiny_cache, root / "run", {"WANDISTILLER_DEBUG_DIR": str(root / "debug")}, 300,
                    **(LORA | FSDP | {"lora_of": str(tiny_teacher)}))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return root / "run", json.loads((root / "debug" / "rank-0.json").read_text())


def _same_files(a: Path, b: Path, equal: bool = True) -> None:
    """Two student/ folders hold the same files, tensors (names, shapes, dtypes; values too when `equal`) and
    metadata (each adapter's LoraConfig; peft keeps its target_modules as a set, listed in a process's hash order)."""
    from safetensors import safe_open

    def config(f) -> dict:
        c = json.loads(f.metadata()["lora_adapter_metadata"])
        return c | {"transformer.target_modules": sorted(c["transformer.target_modules"])}

    assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir()) == FILES
    assert (a / "lora.json").read_text() == (b / "lora.json").read_text()
    for name in FILES[::2]:
        with safe_open(a / name, "pt") as fa, safe_open(b / name, "pt") as fb:
            assert config(fa) == config(fb) and sorted(fa.keys()) == sorted(fb.keys()), name
            for k in fa.keys():
                x, y = fa.get_tensor(k), fb.get_tensor(k)
                assert x.shape == y.shape and x.dtype == y.dtype and (not equal or torch.equal(x, y)), (name, k)


@pytest.mark.dist
@pytest.mark.slow
def test_fsdp_lora_on_two_ranks_matches_one_process(fsdp_run, tiny_teacher, tiny_cache, tmp_path):
    """Two ranks under fsdp equal one ddp process (the same global batch) to float rounding, the base is the teacher's
    bit for bit, the artifact is what ddp writes, and the sharded checkpoints hold the adapters alone."""
    import torch.distributed.checkpoint as dcp

    from test_train_student import max_rel_diff

    two, debug = fsdp_run
    one = tmp_path / "one"
    lora_train(tiny_cache, tiny_teacher, one, **(FSDP | {"strategy": "ddp", "batch_size": 2}))
    l2, l1 = [r["loss"] for r in metrics(two)], [r["loss"] for r in metrics(one)]
    assert len(l2) == len(l1) == 4 and max(abs(a - b) / b for a, b in zip(l2, l1)) < 1e-5
    assert [r["heldout_loss"] for r in metrics(two, "eval")] == pytest.approx(
        [r["heldout_loss"] for r in metrics(one, "eval")], rel=1e-5)
    # validation samples both experts on every rank (a collective each forward); rank 0's record is one process's
    assert [r["final_latent_mse"] for r in metrics(two, "val")] == pytest.approx(
        [r["final_latent_mse"] for r in metrics(one, "val")], rel=1e-4) and len(metrics(one, "val")) == 3
    # AdamW on a few samples a step amplifies the reductions' float rounding: ddp's two ranks differ from one process
    # by 1e-4 here too (and fsdp's from ddp's; 3.1e-4 with AVX-512's kernels), while the losses agree to 1e-5
    diffs = {}
    for folder in ("student", "student_ema"):
        _same_files(two / folder, one / folder, equal=False)
        for name in FILES[::2]:
            diffs[folder, name] = max_rel_diff(load_file(two / folder / name), load_file(one / folder / name))
    print(f"fsdp LoRA, two ranks vs one process, max relative difference: {max(diffs.values()):.3g}")
    assert max(diffs.values()) <= 4e-4, diffs
    # the whole student (base and adapters) is the teacher's base plus the saved adapters, bit for bit
    spec = spec_of(tiny_teacher, tiny_cache)
    assert state_sha(with_adapters(spec, two / "student", seed=3).state_dict()) == debug["param_sha256"]
    ckpt = two / "checkpoints" / "step-00000004"  # (the last step's)
    assert sorted(p.name for p in (ckpt / "sharded").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    keys = dcp.FileSystemReader(ckpt / "sharded").read_metadata().state_dict_metadata
    tensors = [k for k in keys if k.split(".", 1)[0] in ("model", "ema")]
    assert tensors and all(".lora_" in k for k in tensors)  # nothing of the frozen base
    assert checkpoint.pick(two) == (ckpt, [])


@pytest.mark.dist
@pytest.mark.slow
def test_fsdp_lora_kill_and_resume_is_bit_equal(fsdp_run, tiny_teacher, tiny_cache, tmp_path):
    from test_train_student_dist import torchrun

    full, _ = fsdp_run
    cut, args = tmp_path / "cut", LORA | FSDP | {"lora_of": str(tiny_teacher)}
    # every rank SIGKILLs itself as optimizer step 4 begins: checkpoint 2 is on disk
    proc = torchrun(tiny_cache, cut, {"WANDISTILLER_KILL_AT": "train_step:4"}, 300, **args)
    assert proc.returncode != 0 and not (cut / "student").exists()
    assert sorted(p.name for p in (cut / "checkpoints").iterdir()) == ["step-00000002"]
    proc = torchrun(tiny_cache, cut, {}, 300, resume=True, **args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [r["loss"] for r in metrics(cut)] == [r["loss"] for r in metrics(full)]
    assert metrics(cut, "eval") == metrics(full, "eval") and len(metrics(full, "eval")) == 3
    assert [(r["step"], r["final_latent_mse"]) for r in metrics(cut, "val")] == \
        [(r["step"], r["final_latent_mse"]) for r in metrics(full, "val")]
    for folder in ("student", "student_ema"):
        _same_files(cut / folder, full / folder)


@pytest.mark.dist
@pytest.mark.slow
def test_fsdp_lora_artifact_samples_and_exports(fsdp_run, tiny_teacher, tiny_cache, tmp_path):
    """The fsdp run's student/ is what `sample`, `eval` and `export` take: loaded by diffusers' LoRA loader it is the
    trained student, base and adapters; `export` writes its (EMA) adapter files unchanged."""
    from click.testing import CliRunner

    from pipeline.cli import main
    from stages.sample.models import find_student

    run, debug = fsdp_run
    student = find_student(str(run), "raw")
    model = student.kind.load(student, torch.float32, torch.device("cpu"))
    spec = spec_of(tiny_teacher, tiny_cache)
    mine = with_adapters(spec, run / "student", seed=3).eval()
    b = _batch(sorted(read_all_samples(tiny_cache).values(), key=lambda s: s[1][F.M_STEP])[:3], tiny_cache)
    with torch.no_grad():
        assert torch.equal(model(**b)[0], mine(**b)[0])
    r = CliRunner().invoke(main, ["export", "--student", str(run), "--out", str(tmp_path / "export")],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    for name in FILES[::2]:  # (export's --weights auto: the EMA adapters)
        a, e = load_file(run / "student_ema" / name), load_file(tmp_path / "export" / name)
        assert a.keys() == e.keys() and all(torch.equal(a[k], e[k]) for k in a), name


@pytest.mark.slow
def test_fsdp_lora_bf16_base_in_units_of_its_own_equals_ddp(tiny_teacher, tiny_cache, tmp_path):
    """Under --mixed-precision bf16 the base is bf16 and the adapters float32: fsdp puts each block's adapters in a unit
    of their own. One process, with gradient checkpointing: the same bits as ddp, and it resumes."""
    kw = dict(max_steps=2, checkpoint_every=1, ema_decay=0.8, seed=5, mixed_precision="bf16",
              gradient_checkpointing=True)
    ddp, fsdp = tmp_path / "ddp", tmp_path / "fsdp"
    a = lora_train(tiny_cache, tiny_teacher, ddp, **kw)
    b = lora_train(tiny_cache, tiny_teacher, fsdp, strategy="fsdp", **kw)
    assert a["param_sha256"] == b["param_sha256"]
    assert [r["loss"] for r in metrics(ddp)] == [r["loss"] for r in metrics(fsdp)]
    for folder in ("student", "student_ema"):
        _same_files(fsdp / folder, ddp / folder)
    lora_train(tiny_cache, tiny_teacher, fsdp, strategy="fsdp", resume=True, **(kw | {"max_steps": 3}))
    assert [r["step"] for r in metrics(fsdp)] == [1, 2, 3]


def test_lora_mistakes_end_in_one_line_and_exit_2(tiny_teacher, tiny_teacher_factory, tiny_cache, tmp_path):
    from test_train_student import TINY

    base = ["--cache", str(tiny_cache), "--device", "cpu", "--num-workers", "0"]
    teacher = ["--lora-of", str(tiny_teacher)]
    cases = [
        (teacher + ["--student-config", TINY], "not both"),
        (["--student-config", TINY, "--lora-rank", "8"], "lora-rank applies to --lora-of runs only"),
        (teacher + ["--init-from-teacher", str(tiny_teacher)], "init-from-teacher does not go with --lora-of"),
        (["--lora-of", str(tiny_teacher_factory("wan2.1"))], "pass the teacher the cache was made with"),
        (teacher + ["--lora-targets", "no_such_layer"], "lora-targets no_such_layer"),
        ([], "give --student-config"),
    ]
    for i, (args, needle) in enumerate(cases):
        result = invoke(*base, *args, "--out", str(tmp_path / f"out{i}"))
        lines = result.stderr.strip().splitlines()
        assert result.exit_code == 2 and len(lines) == 1 and needle in lines[0], (needle, result.stderr)
        assert not (tmp_path / f"out{i}" / "student").exists()


@pytest.fixture(scope="module")
def lora_run(tiny_teacher, tiny_cache, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("lora") / "run"
    lora_train(tiny_cache, tiny_teacher, out, max_steps=3, holdout_prompts=2)
    return out


@pytest.mark.slow
def test_export_loads_in_diffusers_as_the_sampler_draws_it_and_fused_alike(lora_run, tiny_teacher, tiny_cache,
                                                                            tmp_path):
    """`WanPipeline.from_pretrained(teacher)` + `load_lora_weights(export)` draws what the project's K-step sampler
    draws with the LoRA student, bit for bit, and the `--fuse` export the same to float rounding."""
    from click.testing import CliRunner
    from diffusers import UniPCMultistepScheduler, WanPipeline

    from pipeline.cli import main
    from pipeline.sampling import sample_latents, student_scheduler
    from stages.sample.models import find_student

    for args, out in (((), tmp_path / "lora"), (("--fuse",), tmp_path / "fused")):
        r = CliRunner().invoke(main, ["export", "--student", str(lora_run), "--out", str(out), *args],
                               catch_exceptions=False)
        assert r.exit_code == 0, r.output
    card = (tmp_path / "lora" / "README.md").read_text()
    assert str(tiny_teacher) not in card  # the base by its name: the card goes to the Hub (test_hostile_exports)
    for needle in (f'from_pretrained("{tiny_teacher.name}"', "guidance_scale=1.0", "num_inference_steps=2",
                   "max_sequence_length=32",
                   'weight_name="low_noise_model.safetensors", adapter_name="transformer_2", load_into_transformer_2'):
        assert needle in card, needle
    m = load_manifest(tiny_cache)
    g = torch.Generator().manual_seed(0)
    init = torch.randn(2, *m.latent_shape, generator=g)
    embeds = torch.randn(2, int(m.max_sequence_length), int(m.text_dim), generator=g)
    kw = dict(prompt_embeds=embeds, num_inference_steps=2, guidance_scale=1.0, height=int(m.height),
              width=int(m.width), num_frames=1, output_type="latent")

    pipe = WanPipeline.from_pretrained(tiny_teacher)
    pipe.set_progress_bar_config(disable=True)
    pipe.scheduler = UniPCMultistepScheduler.from_pretrained(tmp_path / "lora", subfolder="scheduler")
    base = pipe(latents=init.clone(), **kw).frames
    pipe.load_lora_weights(str(tmp_path / "lora"), weight_name="high_noise_model.safetensors")
    pipe.load_lora_weights(str(tmp_path / "lora"), weight_name="low_noise_model.safetensors",
                           load_into_transformer_2=True)
    got = pipe(latents=init.clone(), **kw).frames
    student = find_student(str(lora_run))
    want = sample_latents(student.kind.load(student, torch.float32, torch.device("cpu")),
                          student_scheduler(student.distill), init, embeds, 2)
    assert torch.equal(got, want) and not torch.equal(got, base)  # the adapters are loaded, and they matter
    fused = WanPipeline.from_pretrained(tmp_path / "fused")
    fused.set_progress_bar_config(disable=True)
    assert not any("lora" in k for c in (fused.transformer, fused.transformer_2) for k in c.state_dict())
    merged = fused(latents=init.clone(), **kw).frames
    assert torch.allclose(merged, want, rtol=1e-4, atol=1e-5), (merged - want).abs().max()


@pytest.mark.slow
def test_an_export_in_wan_key_names_draws_the_diffusers_exports_frames(tiny_teacher, tiny_video_cache, tmp_path):
    """`export --lora-format wan`: each expert's adapter under the original Wan key names with `.alpha` (what ComfyUI
    loads), no diffusers metadata; `WanPipeline.load_lora_weights` converts it back and draws the diffusers export's
    frames, decoded: whole clips of a video run (alpha 6 at rank 4: the scale travels in `.alpha`). What it cannot write ends in one line."""
    from click.testing import CliRunner
    from diffusers import WanPipeline
    from safetensors import safe_open

    from pipeline.cli import main
    from test_train_student import train as train_compact

    run = tmp_path / "run"
    lora_train(tiny_video_cache, tiny_teacher, run, max_steps=3, lora_alpha=6)

    def export(student, *args):
        return CliRunner().invoke(main, ["export", "--student", str(student), *map(str, args)], catch_exceptions=False)

    for fmt in ("diffusers", "wan"):
        assert export(run, "--out", tmp_path / fmt, "--lora-format", fmt).exit_code == 0
    for name in (FILES[0], FILES[2]):
        with safe_open(tmp_path / "wan" / name, "pt") as f:
            keys, meta = set(f.keys()), f.metadata()
            alphas = {float(f.get_tensor(k)) for k in keys if k.endswith(".alpha")}
        modules = {k.rsplit(".", 2 if k.endswith(".weight") else 1)[0] for k in keys}
        assert meta is None and alphas == {6.0} and len(keys) == 3 * len(modules)  # lora_down, lora_up, alpha
        assert {k.split(".", 3)[3].split(".lora_")[0].removesuffix(".alpha") for k in keys} == {
            "self_attn.q", "self_attn.k", "self_attn.v", "self_attn.o", "cross_attn.q", "cross_attn.k",
            "cross_attn.v", "cross_attn.o", "ffn.0", "ffn.2"}
        assert all(k.startswith("diffusion_model.blocks.") for k in keys)
    card = (tmp_path / "wan" / "README.md").read_text()
    assert "ComfyUI reads the original Wan key names, which `wandistiller export --lora-format wan` writes" in (
        tmp_path / "diffusers" / "README.md").read_text()  # (the diffusers-keyed card points ComfyUI at those)
    for needle in ("LoraLoaderModelOnly", "`high_noise_model.safetensors` on the high-noise model",
                   "`low_noise_model.safetensors` on the low-noise model", "load_into_transformer_2=True"):
        assert needle in card, needle

    m = load_manifest(tiny_video_cache)
    g = torch.Generator().manual_seed(0)
    init = torch.randn(2, *m.latent_shape, generator=g)
    embeds = torch.randn(2, int(m.max_sequence_length), int(m.text_dim), generator=g)

    def frames(folder: Path | None):
        pipe = WanPipeline.from_pretrained(tiny_teacher)
        pipe.set_progress_bar_config(disable=True)
        for comp, name in (("transformer", FILES[0]), ("transformer_2", FILES[2])) if folder else ():
            pipe.load_lora_weights(str(folder), weight_name=name, adapter_name=comp,
                                   load_into_transformer_2=comp == "transformer_2")
        return pipe(latents=init.clone(), prompt_embeds=embeds, num_inference_steps=2, guidance_scale=1.0,
                    height=int(m.height), width=int(m.width), num_frames=int(m.frames), output_type="np").frames

    want, got = frames(tmp_path / "diffusers"), frames(tmp_path / "wan")
    assert want.shape[1] == int(m.frames) > 1  # clips, not single frames
    diff = float(abs(got - want).max())
    print(f"max pixel difference, wan vs diffusers key names: {diff:.3g} (of 1; {diff * 255:.3g} of 255)")
    assert diff <= 1e-5 and float(abs(want - frames(None)).max()) > 1e-3  # the same frames, and the adapters matter

    compact, odd = tmp_path / "compact", tmp_path / "odd"
    train_compact(tiny_video_cache, compact, max_steps=1)
    lora_train(tiny_video_cache, tiny_teacher, odd, max_steps=1, lora_targets="to_q,proj_out")
    for student, args, needle in (
            (odd, ["--lora-format", "wan"], "the adapter on proj_out has no Wan key name"),
            (run, ["--lora-format", "comfy"], "lora-format must be one of diffusers, wan, got 'comfy'"),
            (run, ["--lora-format", "wan", "--fuse"], "--fuse writes a merged pipeline without adapter files"),
            (compact, ["--lora-format", "wan"], "is a compact student (its export is already a standalone pipeline)"
                                                "; drop --lora-format")):
        r = export(student, "--out", tmp_path / "refused", *args)
        lines = r.stderr.strip().splitlines()
        assert r.exit_code == 2 and len(lines) == 1 and needle in lines[0], r.stderr
        assert not (tmp_path / "refused").exists()


@pytest.mark.slow
def test_a_lora_of_a_video_cache_exports_a_text_to_video_card_with_its_schedule(tiny_teacher, tiny_video_cache,
                                                                                tmp_path):
    """A LoRA trained on a 5-frame cache with a chosen schedule (--student-shift): its card in either key format, and
    merged, says text-to-video, num_frames (table, call, ComfyUI's length), draws a clip through export_to_video
    and passes the chosen sigmas as the full export's card does, naming the file that records them."""
    import yaml
    from click.testing import CliRunner

    from pipeline.cli import main

    run = tmp_path / "run"
    lora_train(tiny_video_cache, tiny_teacher, run, max_steps=1, student_shift=3.0)
    for args in (("--lora-format", "wan"), ("--fuse",)):
        out = tmp_path / args[0].strip("-")
        r = CliRunner().invoke(main, ["export", "--student", str(run), "--out", str(out), *args],
                               catch_exceptions=False)
        assert r.exit_code == 0 and "num_frames=5" in r.output, r.output
        card = (out / "README.md").read_text()
        meta = yaml.safe_load(card.split("---\n")[1])
        assert meta["pipeline_tag"] == "text-to-video" and "text-to-video" in meta["tags"]
        assert "text-to-image" not in meta["tags"]
        marked = out / ("model_index.json" if args == ("--fuse",) else "lora.json")
        points = json.loads(marked.read_text())["_wandistiller"]
        assert points["num_frames"] == 5 and len(points["sigmas"]) == 2
        for needle in ("| num_frames | 5 (the clip length it was trained on) |",
                       "from diffusers.utils import export_to_video", 'num_frames=5, guidance_scale=1.0',
                       '.frames[0]\nexport_to_video(frames, "student.mp4", fps=16)',
                       f"sigmas=numpy.array({points['sigmas']}))` ({marked.name}'s `_wandistiller.sigmas`)"):
            assert needle in card, needle
        assert ("length 5 (frames)" in card) == (args[0] == "--lora-format")  # the ComfyUI note: wan keys only


@pytest.mark.slow
def test_eval_takes_a_lora_run_whose_untrained_twin_is_the_teacher(lora_run, tiny_cache, tmp_path):
    from click.testing import CliRunner

    from pipeline.cli import main

    report = tmp_path / "eval.json"
    r = CliRunner().invoke(main, ["eval", "--student", str(lora_run), "--cache", str(tiny_cache), "--report",
                                  str(report), "--no-teacher-timing", "--device", "cpu"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    rep = json.loads(report.read_text())
    assert rep["trajectories"] == 2 and rep["student"]["init"]["exact"]
    assert rep["final_latent_mse"]["student"] != rep["final_latent_mse"]["untrained"]


@pytest.mark.gpu
@pytest.mark.slow
def test_cuda_bf16_base_with_float32_adapters_and_checkpointing(tiny_teacher, tiny_cache, tmp_path):
    """On CUDA the base is frozen in bf16 under bf16 autocast, the adapters train in float32 (what AdamW updates and
    the checkpoint keeps), with gradient checkpointing through the frozen blocks."""
    import math

    out = tmp_path / "run"
    lora_train(tiny_cache, tiny_teacher, out, device="cuda", mixed_precision="bf16", gradient_checkpointing=True,
               max_steps=3, checkpoint_every=2)
    assert all(math.isfinite(r["loss"]) for r in metrics(out))
    saved = load_file(out / "checkpoints" / "step-00000002" / checkpoint.MODEL)
    assert saved and all(v.dtype == torch.float32 and ".lora_" in k for k, v in saved.items())


def test_dry_run_counts_the_adapters_apart_from_the_frozen_base(tiny_teacher, tiny_cache, tmp_path):
    r = lora_train(tiny_cache, tiny_teacher, tmp_path / "dry", dry_run=True, max_steps=4)
    base = sum(v.numel() * 4 for c in lora_student.COMPONENTS  # float32 on the CPU
               for v in load_file(tiny_teacher / c / "diffusion_pytorch_model.safetensors").values())
    assert r["frozen_bytes"] == base and 0 < r["trained_params"] < r["params"]
    assert r["training_state_bytes_per_gpu"] == r["trained_params"] * 16 + base
    assert not (tmp_path / "dry").exists()
