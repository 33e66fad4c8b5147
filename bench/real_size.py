"""Real-size benchmarks: a cache of Wan2.2-A14B-shaped samples and prompt embeddings, written with the real
cache writer and read with stage two's real loader, against the floors a user feels (issue 34), with raw disk I/O
of the same bytes beside them as information.

The cache holds `--prompts` prompts x `--steps` steps x 1 seed at 480x832: `x_t` and `target` 16x1x60x104
bfloat16 each (~390 KiB a sample), prompt embeddings 512x4096 bfloat16 trimmed to lengths drawn from a
log-normal (median 48 tokens, clipped to 8..512: short user prompts and long rewritten ones), initial noise
and final latents float32, the negative prompt; every part of it written exactly as stage one writes it
(cache/prompt_store, stage one's BlockSink over cache/writer.ShardWriter, cache/progress, cache/manifest) from
generated tensors, no teacher. The result passes `cache verify`.

The floors (targets):
- writer_a14b: MiB/s of the cache writer (prompt store, shards, final latents, progress, manifest, and the flush
  to disk of whatever it leaves unsynced), the faster of two passes (at the start of the run, and at its end into a
  fresh folder), >= 300 MiB/s: under 3% of an A14B stage one, whose teacher makes a few MB/s a GPU;
- loader_a14b: samples/s of stage two's loader per rank over one epoch (RankBatches in train-student's default
  epoch order, SampleDataset with its embeddings, make_loader with the stage's default workers), >= 300 samples/s
  (18x what a Wan2.1-1.3B student consumes on an H100);
- stage_two_overhead: a train-student optimizer step from this cache vs the same student's forward + backward +
  AdamW on batches already in memory, <= 1.10; the student is sized so that its step costs about what the real one
  costs per sample on an H100 (1/16 s), which is the budget the loader must hide in.

Information (no target):
- writer_vs_raw_write_a14b: the writer vs one sequential write + fsync of as many bytes (1 MiB writes through the
  page cache), the faster of two passes, each right after a writer pass;
- loader_vs_raw_read_a14b: the loader vs a sequential read of the bytes it needs (every shard and the embedding
  store, 1 MiB requests, the kernel reading ahead);
- loader_vs_h100_student: the loader's samples/s per rank vs 16 samples/s, what a Wan2.1-1.3B-shaped student
  (30 blocks) trains at on one H100 at 480x832 (13-16 samples/s at batch 4-8, bf16, AdamW); on a GPU, vs the
  student's bare step measured there.

Page cache: before each read pass every file of the cache (and the raw file) is fsynced and dropped with
posix_fadvise(POSIX_FADV_DONTNEED) (`bench.common.drop_tree`); the disk needs the figure printed at the
start (`--prompts 10000 --steps 3`: about 25 GB), which is checked against the free space first.

Run: python -m bench.real_size [--prompts 10000] [--steps 3] [--work DIR] [--device auto] [--quick]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save as st_save

from bench.common import cli_results_path, drop_tree, pick_device, result, save, sync, table, tree_bytes
from cache import format as F
from cache.atomic import WriteBehind, atomic_write_bytes, fsync_paths
from cache.manifest import try_write_manifest
from cache.part_progress import PartProgress
from cache.records import CacheHeader
from cache.prompt_store import (
    PromptRowWriter, create_prompt_store, open_prompt_store, prompt_store_path, write_latent_rows,
)
from cache.verify import verify_cache
from pipeline.config import TrainStudentConfig
from stages.teacher_cache.blocks import BlockSink
from stages.teacher_cache.trajectory import StepRecord

ROOT = Path(__file__).resolve().parents[1]

# Wan2.2-T2V-A14B at 480x832, one frame: the VAE's 16 channels at 1/8 of the image side.
LATENT_SHAPE = (16, 1, 60, 104)
MAX_LEN, TEXT_DIM = 512, 4096
DTYPE = "bfloat16"
# What a Wan2.1-1.3B-shaped student (30 blocks, dim 1536) trains at on one H100 at 480x832, bf16 autocast,
# AdamW: 13-16 samples/s at batch 4-8 (issue 20). The loader must deliver a multiple of it per rank.
H100_STUDENT_SPS = 16.0
# The floors of issue 34 (targets of the writer_a14b and loader_a14b rows).
WRITER_FLOOR_MIBS = 300.0
LOADER_FLOOR_SPS = 300.0
# Prompt lengths in tokens: log-normal, median 48, sigma 0.7 (mean ~61, 99th percentile ~245), clipped.
SEQ_MEDIAN, SEQ_SIGMA, SEQ_MIN = 48, 0.7, 8


def seq_lens(n: int, seed: int = 0) -> np.ndarray:
    """Trimmed lengths of `n` prompts (tokens, EOS included), seeded."""
    rng = np.random.default_rng(seed)
    return np.clip(np.round(SEQ_MEDIAN * np.exp(SEQ_SIGMA * rng.standard_normal(n))), SEQ_MIN, MAX_LEN).astype(np.int32)


def header(prompts: int, steps: int) -> CacheHeader:
    """Stage one's header for an A14B cache of these sizes (the fields stage one writes; teacher identity made up)."""
    sigmas = [float(s) for s in np.linspace(1.0, 1.0 / steps, steps)]
    boundary = 0.875
    return CacheHeader(
        teacher="synthetic/Wan2.2-T2V-A14B-shaped", revision=None, teacher_path="", dtype=DTYPE, steps=steps,
        timesteps=[s * 1000.0 for s in sigmas], sigmas=sigmas, experts=[1 if s >= boundary else 2 for s in sigmas],
        guidance=4.0, guidance_2=3.0, boundary_ratio=boundary, expand_timesteps=False, height=480, width=832,
        frames=1, latent_shape=list(LATENT_SHAPE), max_sequence_length=MAX_LEN, negative_prompt="blurry",
        seeds_per_prompt=1, seed=0, prompts=prompts, prompt_set_sha256=f"synthetic-{prompts}", text_dim=TEXT_DIM,
        in_channels=LATENT_SHAPE[0], patch_size=[1, 2, 2],
        scheduler={"_class_name": "UniPCMultistepScheduler", "shift": 3.0}, cfg=True, save_cond_uncond=False,
        teacher_identity={"synthetic": "Wan2.2-T2V-A14B-shaped"})


class Tensors:
    """Generated inputs, drawn once and sliced per sample so that generating them costs nothing in the timed
    loops: a pool of latents and a long strip of embedding rows (each prompt takes its own window)."""

    def __init__(self, seed: int = 0, pool: int = 16, block: int = 64):
        g = torch.Generator().manual_seed(seed)
        self.latents = torch.randn(pool, *LATENT_SHAPE, generator=g).bfloat16()
        self.latents32 = torch.randn(pool, *LATENT_SHAPE, generator=g)
        self.rows = torch.randn(2 * MAX_LEN, TEXT_DIM, generator=g).bfloat16()
        # reused output buffers: fresh multi-MB tensors cost more in page faults than the writer's work
        self._embeds = torch.zeros(block, MAX_LEN, TEXT_DIM, dtype=torch.bfloat16)
        self._filled = [0] * block
        self._stack = torch.empty(block, *LATENT_SHAPE)

    def latent(self, i: int) -> torch.Tensor:
        return self.latents[i % len(self.latents)]

    def latent32(self, i: int) -> torch.Tensor:
        return self.latents32[i % len(self.latents32)]

    def embeds(self, prompts: list[int], lens: np.ndarray) -> torch.Tensor:
        """Zero-padded [len(prompts), 512, 4096] embeddings, real rows up to each prompt's length (a view of
        a reused buffer: valid until the next call)."""
        out = self._embeds
        for j, p in enumerate(prompts):
            out[j, lens[p]:self._filled[j]] = 0
            off = (p * 131) % MAX_LEN
            out[j, :lens[p]] = self.rows[off:off + lens[p]]
            self._filled[j] = int(lens[p])
        return out[:len(prompts)]

    def latents32_of(self, prompts: list[int], shift: int = 0) -> torch.Tensor:
        """[len(prompts), C, F, H, W] float32 latents (a view of a reused buffer)."""
        out = self._stack[:len(prompts)]
        for j, p in enumerate(prompts):
            out[j].copy_(self.latents32[(p + shift) % len(self.latents32)])
        return out


class Stopwatch:
    """Seconds spent inside `with watch:` blocks, summed (the writer's calls, not the generation of inputs)."""

    def __init__(self):
        self.s = 0.0

    def __enter__(self):
        self._t = time.perf_counter()

    def __exit__(self, *exc):
        self.s += time.perf_counter() - self._t


def write_cache(out: Path, prompts: int, steps: int, batch_size: int = 4, samples_per_shard: int = 1024,
                seed: int = 0) -> dict:
    """Write a complete one-part cache the way stage one writes it: the encode phase (prompt rows, negative
    prompt, initial noise), then blocks of `batch_size` trajectories, each block's steps step-major, packed
    into shards that close at a block boundary past `samples_per_shard`, each followed by its trajectories'
    final latents and the progress record; the manifest last. Returns {"write_s", "sync_s", "bytes"}: the
    time spent in the writer's calls (generating the inputs is not timed), then the time to flush to disk
    what the writer left unsynced (zarr's files are not fsynced); and the parts of the writer's time spent
    in the encode phase (`encode_s`) and in the blocks (`blocks_s`: shards of `shard_bytes` and final latents)."""
    gen = Tensors(seed, block=min(64, prompts))
    head = header(prompts, steps)
    blocks = [list(range(i, min(i + batch_size, prompts))) for i in range(0, prompts, batch_size)]
    watch = Stopwatch()
    with watch:
        prog = PartProgress(part=0, num_parts=1, fingerprint=head.settings_fingerprint(), prompts=prompts,
                            blocks=len(blocks), batch_size=batch_size, samples_per_shard=samples_per_shard,
                            header=head)
        prog.save(out)
    store = _encode_phase(out, prog, gen, seq_lens(prompts, seed), watch)
    encode_s = watch.s
    _blocks_phase(out, prog, store, gen, head, blocks, steps, samples_per_shard, watch)
    blocks_s = watch.s - encode_s
    with watch:
        prog.complete = True
        prog.save(out)
        if try_write_manifest(out, 1) is None:
            raise RuntimeError(f"{out}: the manifest was not written")
    t1 = time.perf_counter()
    drop_tree(out)  # flush what the writer left dirty (and drop it all from the page cache)
    shard_bytes = sum(r.bytes for r in prog.shards)
    return {"write_s": watch.s, "sync_s": time.perf_counter() - t1, "bytes": tree_bytes(out), "encode_s": encode_s,
            "blocks_s": blocks_s, "shard_bytes": shard_bytes}


def _encode_phase(out: Path, prog: PartProgress, gen: Tensors, lens: np.ndarray, watch: Stopwatch):
    """Stage one's encode phase: prompt rows as the text encoder's batches of 16, the negative prompt, the initial
    noise 64 rows (a file) at a time; the store reopened for the blocks."""
    prompts = len(lens)
    with watch:
        store = create_prompt_store(prompt_store_path(out, 0), prompts, MAX_LEN, TEXT_DIM, DTYPE, 1, LATENT_SHAPE)
        prompt_rows = PromptRowWriter(store)
    for lo in range(0, prompts, 16):
        rows = list(range(lo, min(lo + 16, prompts)))
        embeds, texts = gen.embeds(rows, lens), [f"synthetic prompt {p}" for p in rows]
        with watch:
            prompt_rows.add(rows, rows, texts, embeds, torch.from_numpy(lens[rows]))
    with watch:
        prompt_rows.close()
    neg = gen.embeds([0], lens)[0].clone()
    with watch:
        neg = st_save({F.NEG_EMBEDS: neg, F.NEG_SEQ_LEN: torch.tensor([int(lens[0])])})
        atomic_write_bytes(out / F.PARTS_DIR / F.part_dirname(0) / F.NEGATIVE, neg)
        atomic_write_bytes(out / F.NEGATIVE, neg)
    behind = WriteBehind()
    for lo in range(0, prompts, 64):
        rows = list(range(lo, min(lo + 64, prompts)))
        noise = gen.latents32_of(rows)
        with watch:
            write_latent_rows(store, F.Z_INIT_NOISE, rows, [0] * len(rows), noise, behind)
    with watch:
        behind.close()
        fsync_paths([prompt_store_path(out, 0)])  # as stage one, before the record says `encoded`
        prog.encoded = True
        prog.negative_sha256 = hashlib.sha256(neg).hexdigest()
        prog.save(out)
        return open_prompt_store(prompt_store_path(out, 0), mode="r+")


class _Quiet:
    """Stage one's progress figures, not shown (BlockSink reports each block and shard to it)."""

    def block(self, samples: int) -> None:
        pass

    def shard(self, record: dict) -> None:
        pass


def _blocks_phase(out: Path, prog: PartProgress, store, gen: Tensors, head: CacheHeader, blocks: list[list[int]],
                  steps: int, samples_per_shard: int, watch: Stopwatch) -> None:
    """Stage one's blocks through its own writer (`stages.teacher_cache.blocks.BlockSink`): samples into shards,
    each shard followed by its final latents (fsynced) and the progress record, committed in a thread of its own
    while the next shard is written. All of it is timed, the drawing of each block's inputs from the pool included
    (the commit thread works meanwhile)."""
    sink = BlockSink(out, prog, store, samples_per_shard, 1, _Quiet())
    with watch:
        guide = [head.guidance if e == 1 else head.guidance_2 for e in head.experts]
        try:
            for b, block in enumerate(blocks):
                records = [StepRecord(step=k, timestep=head.timesteps[k], sigma=head.sigmas[k],
                                      expert=head.experts[k], guidance=guide[k],
                                      x_t=torch.stack([gen.latent(p * steps + k) for p in block]),
                                      target=torch.stack([gen.latent(p * steps + k + 7) for p in block]))
                           for k in range(steps)]
                sink.add(b, [(p, 0) for p in block], records, gen.latents32_of(block, 3).clone())
            sink.flush()
        except BaseException:
            sink.abort()
            raise
        sink.close()


def raw_write(folder: Path, nbytes: int, file_bytes: int = 2 << 30) -> float:
    """Seconds to write `nbytes` sequentially, fsync included, as files of `file_bytes` one after the other, each
    deleted once written (untimed): the disk holds one at a time. 1 MiB writes of bytes already in memory through
    the page cache."""
    chunk = 1 << 20
    buf = memoryview(os.urandom(chunk))
    total, left, i = 0.0, nbytes, 0
    while left > 0:
        path = folder / f"raw-{i}.bin"
        size = min(file_bytes, left)
        t = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            rest = size
            while rest > 0:
                rest -= os.write(fd, buf[:min(chunk, rest)])
            os.fsync(fd)
        finally:
            os.close(fd)
        total += time.perf_counter() - t
        path.unlink()
        left -= size
        i += 1
    return total


def disk_needed(prompts: int, steps: int) -> int:
    """Bytes the benchmark puts on disk at its peak: the cache, then one raw file of at most 2 GiB beside it."""
    lat = math.prod(LATENT_SHAPE)
    sample = 2 * lat * 2 + 2048  # x_t + target bf16, safetensors and tar headers, json
    embed = float(np.mean(-(-seq_lens(min(prompts, 4096)) // 64) * 64)) * TEXT_DIM * 2  # whole 64-token chunks
    return int(prompts * (steps * sample + 2 * lat * 4 + embed + 16384) * 1.02) + (2 << 30)


def loader_files(cache: Path) -> list[Path]:
    """What stage two's loader reads: every shard and the prompt stores' embeddings and lengths."""
    from cache.manifest import load_manifest

    m = load_manifest(cache)
    files = [cache / s.path for s in m.shards]
    for part in range(m.num_parts):
        store = prompt_store_path(cache, part)
        for name in (F.Z_EMBEDS, F.Z_SEQ_LENS, f"{F.Z_ROW_CRC32C}/{F.Z_EMBEDS}"):
            files += sorted(f for f in (store / name).rglob("*") if f.is_file())
    return files


def raw_read(cache: Path) -> tuple[float, int]:
    """Seconds to read `loader_files` sequentially, one after the other (page cache dropped first), and the bytes:
    1 MiB reads through the page cache (the kernel reading ahead) into one buffer."""
    buf = bytearray(1 << 20)
    drop_tree(cache)
    n = 0
    t = time.perf_counter()
    for f in loader_files(cache):
        with open(f, "rb", buffering=0) as fh:
            while k := fh.readinto(buf):
                n += k
    return time.perf_counter() - t, n


def loader_read(cache: Path, batch_size: int, num_workers: int, limit: int | None = None,
                pin: bool = False) -> tuple[float, int, str]:
    """Seconds for stage two's loader to deliver one epoch (or its first `limit` samples) as train-student
    makes it: the index checked by size, RankBatches of train-student's default epoch order, SampleDataset
    (sample + padded embedding) and make_loader with `num_workers` (`pin`: pinned batches, as on CUDA); page
    cache dropped first, worker start-up included. Then the samples, and the epoch's order."""
    from cache.reader import open_caches
    from pipeline.runtime import dist_env
    from stages.train_student import epoch as E
    from stages.train_student.data import SampleDataset, make_loader
    from stages.train_student.index import prepare

    defaults = TrainStudentConfig.__dataclass_fields__
    lru = defaults["embedding_cache_size"].default
    data = prepare(open_caches([cache]), dist_env(), torch.device("cpu"), "size", None, 0)
    plan = E.epoch_plan(data, 1, batch_size, 1, defaults["order"].default, lru)
    ds = SampleDataset(data.index, lru)
    how = f"grouped, windows of {plan.window} read groups of {E.group_prompts(lru)} prompts" if plan.window \
        else "shuffled"
    drop_tree(cache)
    n = 0
    t = time.perf_counter()
    for batch in make_loader(ds, E.RankBatches(plan, data.train_rows, 0, 0, 0), num_workers, pin):
        n += len(batch["keys"])
        if limit is not None and n >= limit:
            break
    return time.perf_counter() - t, n, how


def default_workers() -> int:
    """Loader workers train-student uses on this machine when --num-workers is not given (one rank)."""
    return TrainStudentConfig(cache=("-",), student_config="-", out="-").num_workers


def student_json(out: Path, dim: int, layers: int, ffn: int, head_dim: int = 128) -> Path:
    """A student for this cache (16 latent channels, patch 1x2x2, text_dim 4096), `layers` blocks of width `dim`."""
    cfg = {"patch_size": [1, 2, 2], "num_attention_heads": dim // head_dim, "attention_head_dim": head_dim,
           "in_channels": LATENT_SHAPE[0], "out_channels": LATENT_SHAPE[0], "text_dim": TEXT_DIM, "freq_dim": 256,
           "ffn_dim": ffn, "num_layers": layers, "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads",
           "eps": 1e-6, "rope_max_seq_len": 1024}
    out.write_text(json.dumps(cfg, indent=2))
    return out


# The stage_two_overhead student. On a GPU, the Wan2.1-1.3B shape itself (30 blocks of width 1536, ffn 8960): the
# figure is then the real one, and its bare step is the consumption the loader is compared with. On a CPU that
# student takes minutes a step; the default is the smallest student that still reads the real sample and text
# sizes, so its step is dominated by them as little as a real one's is (see the row's note).
STUDENTS = {"cuda": dict(dim=1536, layers=30, ffn=8960, batch=8), "cpu": dict(dim=256, layers=2, ffn=1024, batch=4)}


def _args(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=10_000)
    ap.add_argument("--steps", type=int, default=3, help="Cached steps per prompt (samples per prompt).")
    ap.add_argument("--batch-size", type=int, default=8, help="Loader batch per rank (4-8 is what fits an H100).")
    ap.add_argument("--num-workers", type=int, default=None, help="Loader workers; default: train-student's own.")
    ap.add_argument("--student-dim", type=int, default=None, help="Width of the stage_two_overhead student "
                    f"(default per device: {STUDENTS})")
    ap.add_argument("--student-layers", type=int, default=None)
    ap.add_argument("--student-ffn", type=int, default=None)
    ap.add_argument("--student-batch", type=int, default=None)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--work", type=Path, default=None, help="Folder for the cache (default: a temporary folder "
                    "under $TMPDIR); it needs the free space printed at the start.")
    ap.add_argument("--keep", action="store_true", help="Keep the cache (in --work) after the run.")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--quick", action="store_true", help="Minimal sizes (smoke test).")
    return ap.parse_args(argv)


def _work(args) -> Path:
    """The run's folder under --work, refused where the disk lacks the room."""
    if args.work is not None:
        args.work.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="wandistiller-bench-real-", dir=args.work))
    need = disk_needed(args.prompts, args.steps)
    free = shutil.disk_usage(work).free
    print(f"real-size bench: {args.prompts} prompts x {args.steps} steps of A14B samples in {work}: needs "
          f"{need / 1e9:.1f} GB of disk, {free / 1e9:.1f} GB free", flush=True)
    if free < need * 1.1:
        shutil.rmtree(work, ignore_errors=True)
        raise SystemExit(f"not enough free disk in {work.parent} for the real-size bench ({need / 1e9:.1f} GB needed, "
                         f"{free / 1e9:.1f} GB free); pass --work on a larger disk or fewer --prompts")
    return work


def _writer_rows(args, writes: list[dict], raw_ws: list[float]) -> list[dict]:
    """writer_a14b (the floor) and writer_vs_raw_write_a14b (information), from every pass so far."""
    nbytes = writes[0]["bytes"]
    took = [x["write_s"] + x["sync_s"] for x in writes]
    w = writes[took.index(min(took))]
    mibs = nbytes / min(took) / 2**20
    note = (f"{args.prompts} prompts x {args.steps} steps, {nbytes / 2**30:.2f} GiB cache (shards "
            f"{w['shard_bytes'] / 2**30:.2f} GiB); writer {' and '.join(f'{x:.1f}' for x in took)} s, the faster: "
            f"{w['write_s']:.1f} s (encode phase {w['encode_s']:.1f} s, blocks {w['blocks_s']:.1f} s: shards and final "
            f"latents) + {w['sync_s']:.1f} s flushing what it left "
            f"unsynced; at the start and at the end of the run (written again, into a fresh folder)")
    raw = (f"raw sequential write + fsync of as many bytes, 1 MiB writes: {' and '.join(f'{x:.1f}' for x in raw_ws)} "
           "s, each right after a writer pass; the faster of each side")
    return [result("writer_a14b", mibs, WRITER_FLOOR_MIBS, "MiB/s", 1.0, ">=", note=note),
            result("writer_vs_raw_write_a14b", mibs, nbytes / min(raw_ws) / 2**20, "MiB/s", None, "info",
                   note="information, no target: " + raw)]


def _loader_rows(args, cache: Path, workers: int, pin: bool) -> tuple[list[dict], float]:
    """loader_a14b (the floor) and loader_vs_raw_read_a14b (information): one epoch each way, each first in turn."""
    times: dict[str, list[float]] = {"raw": [], "loader": []}
    nbytes = samples = 0
    for r in range(args.reps):
        for name in (["raw", "loader"] if r % 2 == 0 else ["loader", "raw"]):  # each first in turn: the disk drifts
            if name == "loader":
                dt, samples, how = loader_read(cache, args.batch_size, workers, pin=pin)
            else:
                dt, nbytes = raw_read(cache)
            times[name].append(dt)
    print("  " + ", ".join(f"{k} " + " ".join(f"{x:.1f}" for x in v) + " s" for k, v in times.items()), flush=True)
    sps = samples / min(times["loader"])
    note = (f"one epoch of {samples} samples in the epoch's order ({how}), batch {args.batch_size}, {workers} loader "
            f"workers (train-student's default here), embeddings included; page cache dropped before each pass; "
            f"best of {args.reps}")
    raw = (f"information, no target: raw sequential read of {nbytes / 2**30:.2f} GiB (shards + embeddings), 1 MiB "
           f"reads, {nbytes / min(times['raw']) / 2**20:.0f} MiB/s")
    return [result("loader_a14b", sps, LOADER_FLOOR_SPS, "samples/s", 1.0, ">=", note=note),
            result("loader_vs_raw_read_a14b", sps, samples / min(times["raw"]), "samples/s", None, "info", note=raw)], sps


def _student(args, device: torch.device) -> dict:
    student = dict(STUDENTS["cuda" if device.type == "cuda" else "cpu"])
    for k in student:
        if getattr(args, f"student_{k}") is not None:
            student[k] = getattr(args, f"student_{k}")
    if args.quick:
        student.update(dim=128, layers=1, ffn=256, batch=2)
    return student


def main(argv=None) -> list[dict]:
    args = _args(argv)
    device = pick_device(args.device)
    student = _student(args, device)
    if args.quick:
        args.prompts, args.steps, args.reps = 24, 2, 1
    workers = default_workers() if args.num_workers is None else args.num_workers
    work = _work(args)
    cache = work / "cache"
    try:
        # 1. the writer, at the start and at the end of the run (the disk's rate drifts), the faster of each side
        t = time.perf_counter()
        writes = [write_cache(cache, args.prompts, args.steps)]
        raw_ws = [raw_write(work, writes[0]["bytes"])]
        print(f"  cache written and raw write in {time.perf_counter() - t:.0f} s", flush=True)
        # 2. the loader over one epoch
        t = time.perf_counter()
        loader_rows, loader_sps = _loader_rows(args, cache, workers, device.type == "cuda")
        print(f"  loader and raw reads in {time.perf_counter() - t:.0f} s", flush=True)
        # 3. stage-two step vs the bare step, on this cache; on a GPU the bare step is also the consumption rate
        t = time.perf_counter()
        step = overhead(cache, work, device, student, args.reps, args.num_workers, quick=args.quick)
        print(f"  stage-two steps in {time.perf_counter() - t:.0f} s", flush=True)
        if device.type == "cuda":
            consume, how = step["bare_sps"], (f"measured here: the {step['params'] / 1e9:.2f}B-param student's bare "
                                              f"step, batch {student['batch']}, bf16 autocast, AdamW")
        else:
            consume, how = H100_STUDENT_SPS, "what a Wan2.1-1.3B-shaped student trains at on one H100 at 480x832"
        h100 = result("loader_vs_h100_student", loader_sps, consume, "samples/s", 3.0, ">=",
                      note=f"loader samples/s per rank ({workers} workers, this machine) vs {how}")
        problems = verify_cache(cache, progress=False)
        if problems:
            raise RuntimeError(f"the synthetic cache does not verify: {problems[:3]}")
        if not args.keep:  # (kept: the cache stays, and there is no room assumed for a second one)
            shutil.rmtree(cache)
            again = work / "cache-again"
            writes.append(write_cache(again, args.prompts, args.steps))
            shutil.rmtree(again)
        raw_ws.append(raw_write(work, writes[0]["bytes"]))
        writer = _writer_rows(args, writes, raw_ws)
        return [writer[0], loader_rows[0], step["record"], writer[1], loader_rows[1], h100]
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


def overhead(cache: Path, work: Path, device: torch.device, student: dict, reps: int, num_workers: int | None,
             quick: bool = False) -> dict:
    """stage_two_overhead on the real-size cache: train-student's step vs the bare step of the same student
    (bench.stage_two.StepBench, interleaved, best of `reps`); on CUDA with the peak memory allocated."""
    from bench import stage_two

    path = student_json(work / "student.json", student["dim"], student["layers"], student["ffn"])
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    bench = stage_two.StepBench(cache, path, work / "out-step", device, student["batch"], num_workers)
    k = 2 if quick else 4
    step = stage_two.overhead(bench, k, reps)
    sync(device)
    peak = (f"; peak CUDA memory {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB"
            if device.type == "cuda" else "")
    b = student["batch"]
    record = result("stage_two_overhead", step["stage"], step["bare"], "s/step", 1.10, "<=",
                    note=f"A14B-shaped cache (16x60x104 latents, 512x4096 text), batch {b}, {bench.num_workers} "
                         f"loader workers, {bench.params / 1e6:.0f}M-param student ({student['layers']} blocks of "
                         f"width {student['dim']}, ffn {student['ffn']}): {step['bare'] / b * 1e3:.0f} ms a sample "
                         f"bare; best of {reps} x {k} steps{peak}")
    return {"record": record, "bare_sps": b / step["bare"], "params": bench.params}


if __name__ == "__main__":
    import sys

    res = main()
    save(res, cli_results_path(sys.argv[1:]))
    print(table(res))
