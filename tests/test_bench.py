"""Smoke test of the benchmarks: every piece of `make bench` runs for real at the smallest sizes, and the
results file has the documented schema. The figures themselves mean nothing at these sizes."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from bench import run_all
from bench.common import ROOT, exponent, machine_line, result, table

STUDENT = ROOT / "configs" / "student-tiny.json"
KEYS = {"name", "value", "baseline", "ratio", "target", "met", "unit", "note", "machine"}


def test_bench_pieces_and_results_schema(tiny_teacher, tiny_cache, prompts_file, tmp_path):
    from bench import online, stage_one, stage_two

    cpu = torch.device("cpu")
    records = []

    # stage two: the stage's own step vs the bare step; the reader vs a raw read and vs consumption
    bench = stage_two.StepBench(tiny_cache, STUDENT, tmp_path / "out", cpu, batch_size=4, num_workers=0)
    step = stage_two.overhead(bench, steps_per_rep=2, reps=1)
    records.append(result("stage_two_overhead", step["stage"], step["bare"], "s/step", 1.10, "<="))
    ld = stage_two.loader(bench, reps=1)
    assert ld["bytes_per_sample"] > 0
    records.append(result("loader_vs_raw_read", ld["reader_sps"], ld["raw_sps"], "samples/s", 0.8, ">="))
    records.append(result("loader_vs_consumption", ld["reader_sps"], ld["consume_sps"], "samples/s", 10, ">="))

    # the online step (teacher CFG forward in the loop) on the same teacher, student and batch
    on = online.Online(str(tiny_teacher), str(prompts_file), str(STUDENT), cpu, steps=4, size=64, max_len=32,
                       batch_size=4)
    on.step()
    assert on.teacher_params > 0

    # stage one: the compute-only baseline and the naive cache
    args = argparse.Namespace(steps=4, batch_size=3, device=cpu)
    assert stage_one._compute_only(tiny_teacher, tiny_cache, args) > 0
    assert stage_one._naive(tiny_cache, tmp_path, k=4) > 0

    # the placements' JSON as bench/placements.py writes it -> records
    rows = [{"placement": p, "batch": b, "samples_per_s": s, "vs_in_memory": s / 10.0}
            for b in (1, 32) for p, s in (("cpu", 10.0), ("offload", 9.0), ("disk", 4.0))]
    placed = run_all.placement_records({"weights_bytes": 2**20, "throughput": rows}, ["--steps", "2"])
    assert [r["name"] for r in placed] == ["disk_vs_memory_b32", "offload_vs_memory_b32"]
    assert [r["met"] for r in placed] == [False, True]
    records += placed

    out = tmp_path / "results.json"
    run_all.write(records, out, machine_line(), merge=False)
    saved = json.loads(out.read_text())
    assert isinstance(saved, list) and len(saved) == len(records)
    for r in saved:
        assert set(r) == KEYS, r
        assert isinstance(r["met"], bool) and r["target"].split()[0] in ("<=", ">=")
        assert all(math.isfinite(r[k]) and r[k] > 0 for k in ("value", "baseline", "ratio")), r
    assert "loader_vs_consumption" in table(saved)


def test_exponent_and_merge(tmp_path):
    assert abs(exponent([1, 2, 4], [3.0, 6.0, 12.0]) - 1.0) < 1e-9
    out = tmp_path / "results.json"
    run_all.write([result("a", 1, 2, "s", 1, "<=")], out, "m", merge=False)
    run_all.write([result("b", 2, 1, "s", 1, "<=")], out, "m", merge=True)
    assert [r["name"] for r in json.loads(Path(out).read_text())] == ["a", "b"]


def test_real_size_pieces(tmp_path):
    """bench/real_size.py at a few prompts: the synthetic A14B cache is complete and verifies, and the writer,
    the raw write, the raw read and stage two's loader all run on it."""
    from bench import real_size
    from cache.manifest import load_manifest
    from cache.verify import verify_cache

    cache = tmp_path / "cache"
    w = real_size.write_cache(cache, prompts=5, steps=2, batch_size=2, samples_per_shard=4)
    assert verify_cache(cache, progress=False) == []
    m = load_manifest(cache)
    assert m.samples == 10 and m.latent_shape == list(real_size.LATENT_SHAPE) and len(m.shards) == 3
    assert w["bytes"] > w["shard_bytes"] > 10 * 2 * 2 * 16 * 60 * 104 and w["write_s"] > 0
    assert real_size.raw_write(tmp_path, 3 << 20, file_bytes=1 << 20) > 0 and not list(tmp_path.glob("raw-*"))
    dt, nbytes = real_size.raw_read(cache)
    assert dt > 0 and nbytes >= w["shard_bytes"]
    dt, n, _ = real_size.loader_read(cache, batch_size=3, num_workers=0)
    assert dt > 0 and n == 10


def test_real_size_quick_run(tmp_path):
    """The whole real-size bench at its smoke size: the floors (writer, loader, stage_two_overhead) and the raw-disk
    rows as information, the writer and the raw writes each timed twice (at the start and at the end of the run),
    and nothing left in --work."""
    from bench import real_size

    rows = {r["name"]: r for r in real_size.main(["--quick", "--work", str(tmp_path)])}
    assert set(rows) == {"writer_a14b", "loader_a14b", "stage_two_overhead", "writer_vs_raw_write_a14b",
                         "loader_vs_raw_read_a14b", "loader_vs_h100_student"}
    assert rows["writer_a14b"]["target"] == rows["loader_a14b"]["target"] == ">= 1.0"
    assert rows["writer_a14b"]["baseline"] == rows["loader_a14b"]["baseline"] == 300
    assert rows["writer_a14b"]["note"].count(" and ") >= 1 and "the faster of each side" in \
        rows["writer_vs_raw_write_a14b"]["note"]
    assert rows["writer_vs_raw_write_a14b"]["target"] == rows["loader_vs_raw_read_a14b"]["target"] == "info"
    assert not list(tmp_path.iterdir())


def test_a_quick_run_never_writes_over_the_measured_figures():
    from bench.common import RESULTS, RESULTS_CUDA, cli_results_path, results_path

    # No --device means auto: the CPU's file here, the GPU's on a GPU box.
    auto = RESULTS_CUDA if torch.cuda.is_available() else RESULTS
    assert cli_results_path([]) == auto and cli_results_path(["--device=cpu"]) == RESULTS
    assert cli_results_path(["--quick"]) == auto.with_name(auto.stem + "-quick.json")
    assert cli_results_path(["--device", "cpu", "--quick"]) == RESULTS.with_name("results-quick.json")
    assert results_path(torch.device("cuda"), quick=True) == RESULTS_CUDA.with_name("results-cuda-quick.json")


def test_verify_cost_times_both_checks(tmp_path, capsys):
    """bench/verify_cost.py at a few prompts: it writes the cache, times stage two's check before step 1 both
    ways (cold and warm) and leaves nothing behind."""
    from bench import verify_cost

    verify_cost.main(["--prompts", "5", "--steps", "2", "--work", str(tmp_path)])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["--verify checksum cold", "--verify size     cold",
                                                       "--verify checksum warm", "--verify checksum cold"]
    assert all(" s/GiB, " in line for line in lines) and list(tmp_path.iterdir()) == []
