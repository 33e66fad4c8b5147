"""Placements on CPU: every placement that runs here writes the `cpu` placement's cache, bit for bit.

Also: the disk offload folder (one per expert, tied to the weights, rebuilt when stale), custom device maps
and their errors, GPU-only placements failing fast, the seed script's flags, expert-major order, the OOM
report, and RSS of `disk` (a fresh process streaming a 300 MB teacher).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from cache import format as F
from cache.manifest import load_manifest
from cache.prompt_store import open_prompt_store, prompt_store_path
from conftest import ROOT, TINY_CACHE_ARGS, make_cache, read_all_samples
from pipeline.cli import main
from pipeline.errors import UserError
from stages.teacher_cache import blocks, group_offload, placements
from stages.teacher_cache.placements import ExpertSet
from stages.teacher_cache.placements.device_map import check_device_map, parse_max_memory, read_device_map
from stages.teacher_cache.teacher import resolve_teacher

# Every module of the tiny teacher's transformer, split between RAM and the offload folder.
MIXED_MAP = {"rope": "cpu", "patch_embedding": "disk", "condition_embedder": "cpu", "blocks.0": "disk",
             "blocks.1": "cpu", "norm_out": "cpu", "proj_out": "disk", "scale_shift_table": "cpu"}


def assert_same_cache(a: Path, b: Path) -> None:
    """Same fingerprint, same samples and metadata, same tensors (float32: bit-identical, else <= 1e-6 rel)."""
    ma, mb = load_manifest(a), load_manifest(b)
    assert ma.fingerprint == mb.fingerprint
    sa, sb = read_all_samples(a), read_all_samples(b)
    assert sa.keys() == sb.keys() and sa
    for key, (ta, meta_a) in sa.items():
        tb, meta_b = sb[key]
        assert meta_a == meta_b, key
        assert ta.keys() == tb.keys(), key
        for name in ta:
            if not torch.equal(ta[name], tb[name]):
                torch.testing.assert_close(tb[name], ta[name], rtol=1e-6, atol=0, msg=f"{key}/{name}")
    for part in range(ma.num_parts):
        za, zb = open_prompt_store(prompt_store_path(a, part)), open_prompt_store(prompt_store_path(b, part))
        torch.testing.assert_close(torch.from_numpy(zb[F.Z_FINAL_LATENTS][:]),
                                   torch.from_numpy(za[F.Z_FINAL_LATENTS][:]), rtol=1e-6, atol=0)


@pytest.fixture(autouse=True)
def cpu_only(monkeypatch):
    """These tests are about the CPU: hide any GPU, so offload/disk execute on the CPU here too and the
    caches compare bit for bit with the `cpu` one (test_placement_gpu.py covers GPUs)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture(scope="module")
def spec(tiny_teacher):
    return resolve_teacher(str(tiny_teacher))


@pytest.fixture(scope="module")
def mixed_map(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("maps") / "mixed.json"
    p.write_text(json.dumps(MIXED_MAP))
    return p


@pytest.mark.parametrize("name, over", [
    ("offload", dict(placement="offload")),
    ("disk", dict(placement="disk")),
    ("map-cpu-disk", dict(placement="MIXED")),
    ("cpu-expert-major", dict(placement="cpu", expert_order="expert")),
    ("disk-expert-major", dict(placement="disk", expert_order="expert")),
])
def test_placement_writes_the_cpu_cache(name, over, tiny_cache, tiny_teacher, prompts_file, mixed_map, tmp_path):
    if over["placement"] == "MIXED":
        over = dict(over, placement=str(mixed_map))
    out = make_cache(tiny_teacher, prompts_file, tmp_path / name, **over)
    assert_same_cache(tiny_cache, out)


def test_expert_major_keeps_one_expert_resident(tiny_cache, tiny_teacher, prompts_file, tmp_path, monkeypatch):
    """Windows of one block (tiny record budget): each block switches expert twice; never two resident."""
    monkeypatch.setattr(blocks, "EXPERT_MAJOR_RECORD_BUDGET", 1)
    most = []
    activate = ExpertSet.activate

    def spy(self, experts):
        activate(self, experts)
        most.append(sum(m is not None for m in self.models))

    monkeypatch.setattr(ExpertSet, "activate", spy)
    out = make_cache(tiny_teacher, prompts_file, tmp_path / "c", placement="offload", expert_order="expert")
    assert most and max(most) == 1 and len(most) >= 4
    assert_same_cache(tiny_cache, out)


def test_expert_window_budget():
    assert blocks.expert_window(4, 40, 16 * 60 * 104, 2, False) == 2 * 2**30 // (4 * 40 * 16 * 60 * 104 * 2 * 2)
    assert blocks.expert_window(64, 999, 10**9, 4, True) == 1


# --- the disk offload folder --------------------------------------------------------------------------------------

def _forward(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 16, 1, 8, 8, generator=g)
    ctx = torch.randn(2, 32, 32, generator=g)
    with torch.inference_mode():
        return model(hidden_states=x, timestep=torch.tensor([900.0, 400.0]), encoder_hidden_states=ctx,
                     return_dict=False)[0]


def test_disk_expert_streams_its_own_weights(spec, tmp_path):
    from diffusers import WanTransformer3DModel

    cpu = torch.device("cpu")
    for comp in spec.experts:
        ref = WanTransformer3DModel.from_pretrained(spec.path, subfolder=comp).eval()
        disk = group_offload.load_disk_expert(spec, comp, torch.float32, cpu, tmp_path, log=lambda m: None)
        assert torch.equal(_forward(ref), _forward(disk)), comp
        assert torch.equal(_forward(ref, 1), _forward(disk, 1)), comp  # second pass: reloaded from the folder
    folders = sorted(p.name for p in tmp_path.iterdir() if p.is_dir())
    assert len(folders) == 2 and folders[0].startswith("transformer-") and folders[1].startswith("transformer_2-")


def test_disk_folder_is_reused_only_when_it_matches(spec, tmp_path):
    cpu, f32 = torch.device("cpu"), torch.float32
    quiet = lambda m: None  # noqa: E731
    folder = group_offload.prepare_disk_folder(spec, "transformer", f32, cpu, tmp_path, quiet)
    stamps = {f.name: f.stat().st_mtime_ns for f in folder.iterdir()}
    assert group_offload.prepare_disk_folder(spec, "transformer", f32, cpu, tmp_path, quiet) == folder
    assert {f.name: f.stat().st_mtime_ns for f in folder.iterdir()} == stamps  # reused as is

    group = next(f for f in folder.glob("group_*.safetensors"))
    group.write_bytes(group.read_bytes()[:-10])  # truncated: incomplete
    assert group_offload.prepare_disk_folder(spec, "transformer", f32, cpu, tmp_path, quiet) == folder
    assert group.stat().st_size == json.loads((folder / group_offload.MARKER).read_text())["files"][group.name]

    marker = json.loads((folder / group_offload.MARKER).read_text())
    (folder / group_offload.MARKER).write_text(json.dumps(marker | {"fingerprint": "0" * 64}))  # made for other weights
    group_offload.prepare_disk_folder(spec, "transformer", f32, cpu, tmp_path, quiet)
    assert json.loads((folder / group_offload.MARKER).read_text())["fingerprint"] == marker["fingerprint"]

    stale = tmp_path / "transformer-0123456789abcdef"  # another teacher's (or dtype's) folder for this expert
    stale.mkdir()
    (stale / "group_x.safetensors").write_bytes(b"old")
    bf16 = group_offload.prepare_disk_folder(spec, "transformer", torch.bfloat16, cpu, tmp_path, quiet)
    assert bf16 != folder and not stale.exists() and not folder.exists()


def test_hollow_model_has_from_pretrained_dtypes_and_buffers(spec):
    from diffusers import WanTransformer3DModel

    ref = WanTransformer3DModel.from_pretrained(spec.path, subfolder="transformer", torch_dtype=torch.bfloat16)
    hollow = group_offload.hollow_transformer(spec.path, "transformer", torch.bfloat16)
    assert {n: p.dtype for n, p in hollow.named_parameters()} == {n: p.dtype for n, p in ref.named_parameters()}
    assert any(p.dtype == torch.float32 for p in ref.parameters())  # _keep_in_fp32_modules is exercised
    rb = dict(ref.named_buffers())
    for n, b in hollow.named_buffers():
        assert b.dtype == rb[n].dtype and torch.equal(b, rb[n]), n
    assert all(p.numel() == 0 for p in hollow.parameters())


# --- custom device maps and errors --------------------------------------------------------------------------------

def _write_map(tmp_path, content) -> str:
    p = tmp_path / "map.json"
    p.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(p)


@pytest.mark.parametrize("content, needle", [
    (MIXED_MAP | {"blocks.7": "cpu"}, "unknown module(s) 'blocks.7'"),
    ({k: v for k, v in MIXED_MAP.items() if k not in ("blocks.1", "proj_out")}, "no device for module(s) blocks.1, proj_out"),
    ({"": "cpu", "blocks": "disk"}, "overlap"),
    ({"": "gpu"}, "is not a device"),
    (MIXED_MAP | {"scale_shift_table": "disk"}, "is a parameter, not a module"),
    ("[1, 2]", "must be a JSON object, not a list"),
    ("{nope", "is not valid JSON"),
])
def test_bad_device_map_is_one_clear_error(content, needle, spec, tmp_path):
    path = _write_map(tmp_path, content)
    with pytest.raises(UserError, match="device map") as e:
        dmap, _ = read_device_map(path)
        check_device_map(group_offload.meta_transformer(spec.path, "transformer"), dmap, path)
    assert needle in str(e.value)


def test_device_map_with_cuda_entries_on_cpu(tmp_path):
    with pytest.raises(UserError, match="no CUDA GPU is visible"):
        read_device_map(_write_map(tmp_path, {"": "cuda:0"}))


def _cli(teacher, prompts, out, *extra, **over):
    kw = dict(TINY_CACHE_ARGS)
    kw.update(over)
    args = ["teacher-cache", "--teacher", str(teacher), "--prompts", str(prompts), "--out", str(out), *extra]
    for k, v in kw.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    return CliRunner().invoke(main, args, catch_exceptions=False)


def test_bad_map_stops_before_any_work(tiny_teacher, prompts_file, tmp_path):
    res = _cli(tiny_teacher, prompts_file, tmp_path / "c", placement=_write_map(tmp_path, {"blocks.0": "cpu"}))
    assert res.exit_code == 2, res.output
    assert "no device for module(s)" in res.output and "Traceback" not in res.output
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("name", ["cuda", "balanced", "sequential"])
def test_gpu_placements_fail_fast_without_cuda(name, tiny_teacher, prompts_file, tmp_path):
    res = _cli(tiny_teacher, prompts_file, tmp_path / "c", placement=name)
    assert res.exit_code == 2, res.output
    errors = [ln for ln in res.output.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and f"placement {name!r} needs a CUDA GPU" in errors[0]
    assert not (tmp_path / "c").exists()


def test_max_memory_is_checked(tiny_teacher, prompts_file, tmp_path):
    assert parse_max_memory("0=70GiB, cuda:1=70GB,cpu=200GiB") == {0: "70GiB", 1: "70GB", "cpu": "200GiB"}
    with pytest.raises(UserError, match="cannot read --max-memory item"):
        parse_max_memory("gpu0=70GiB")
    with pytest.raises(UserError, match="cannot read the size"):
        parse_max_memory("0=lots")
    res = _cli(tiny_teacher, prompts_file, tmp_path / "c", "--max-memory", "cpu=1GiB", placement="cpu")
    assert res.exit_code == 2 and "applies to --placement balanced or sequential" in res.output


# --- the seed script's flags, retired at 0.1 ---------------------------------------------------------------------

@pytest.mark.parametrize("flag", ["--teacher_on_cpu", "--teacher_device_strategy", "--teacher_dtype"])
def test_the_seed_scripts_flags_are_refused(flag, tiny_teacher, prompts_file, tmp_path):
    res = _cli(tiny_teacher, prompts_file, tmp_path / "c", flag)
    assert res.exit_code == 2 and f"No such option '{flag}'" in res.output


# --- out of memory ------------------------------------------------------------------------------------------------

def test_cuda_oom_in_stage_one_exits_3_with_figures_and_remedies(tiny_teacher, prompts_file, tmp_path, monkeypatch):
    from stages.teacher_cache.trajectory import TrajectoryRunner

    def oom(self, *a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (GPU 0; 79.11 GiB total)")

    monkeypatch.setattr(TrajectoryRunner, "run", oom)
    res = _cli(tiny_teacher, prompts_file, tmp_path / "c", placement="cpu")
    assert res.exit_code == 3, res.output
    err = res.stderr
    assert "error: out of memory in teacher-cache: CUDA out of memory. Tried to allocate 20.00 GiB" in err
    assert "memory: peak host RSS" in err and "remedies:" in err
    assert "--placement offload" in err and "--placement disk" in err and "--batch-size" in err
    assert "Traceback" not in res.output
    assert not list((tmp_path / "c" / F.SHARDS_DIR).glob("*.tmp"))


# --- RSS of `disk` --------------------------------------------------------------------------------------------------

def test_disk_rss_stays_near_one_block(tmp_path_factory):
    """A fresh process streams a 300 MB two-expert teacher from disk: while it denoises, RSS grows by less
    than 35% of the weights (a block being read, the one in use, the non-block group, activations and the
    process's own warm-up). bench/placements.py measures the same with the `cpu` placement beside it."""
    import sys

    sys.path.insert(0, str(ROOT))
    from bench.placements import build_wide_teacher, measure_rss, weight_bytes

    work = tmp_path_factory.mktemp("rss")
    teacher = build_wide_teacher(work / "teacher", dim=384, ffn=1536, layers=16)
    prompts = work / "prompts.txt"
    prompts.write_text("\n".join(f"a red circle number {i}" for i in range(4)) + "\n")
    m = measure_rss(teacher, prompts, work / "cache", "disk", batch_size=4, steps=4, threads=1)
    assert m["placement"] == "disk" and m["samples"] == 16
    weights = weight_bytes(teacher)
    assert weights >= 300e6  # 300 MB
    if not m["hwm_reset"]:
        pytest.skip("this kernel does not let a process reset its peak RSS (/proc/self/clear_refs)")
    grew = m["loop_peak"] - m["before_experts"]
    assert grew < 0.35 * weights, f"RSS grew {grew / 2**20:.1f} MiB while streaming {weights / 2**20:.1f} MiB"


def test_offload_dir_default_is_inside_the_cache(tiny_teacher, prompts_file, tmp_path):
    from pipeline.config import TeacherCacheConfig

    cfg = TeacherCacheConfig(**dict(TINY_CACHE_ARGS, teacher=str(tiny_teacher), prompts=str(prompts_file),
                                    out=str(tmp_path / "c"), placement="disk"))
    p = placements.choose_placement(cfg, resolve_teacher(str(tiny_teacher)))
    assert p.offload_dir == tmp_path / "c" / "offload" and p.kind == "disk" and p.device.type == "cpu"
