"""Hostile folders: run folders, exports, teacher folders, Hub caches, configs and prompt files built as an attacker
(or a careless colleague) would, one row per kind of attack on the trust boundary (cache/safe_open.py,
cache/safe_write.py). Each attempt is checked as the `hostile` scenario's are (tests/faults/hostile.py: no payload
ran, the victim's folder unchanged, no hang, one `error:` line and exit 2, or exit 0 where going on is right), and,
where the attack is a size, under a bound on memory (`prlimit --as`: MEM bytes beyond the command's start)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np

from cache import format as F
from cache.safe_write import MARKER

from .hostile import Case, Hostile, hostile_inputs
from .proc import UNSAFE_PICKLE, Result, run_cli
from .report import Row
from .workspace import Workspace

MEM = 2 << 30  # a refusal needs a few MiB; 16 GiB read whole, or 10^8 prompts' rows, would need far more
STORE = f"{F.PARTS_DIR}/part-00000/{F.PROMPTS_ZARR}"
# numcodecs decoding pickles, as every version before 0.16.6 did: the refusal must not rest on numcodecs' own
UNSAFE = {UNSAFE_PICKLE: "1"}
UNSAFE_WORDS = ("ALLOW_UNSAFE", "UnsafeDecode")  # numcodecs' advice to turn its guard off, never relayed


def _pickled_store(h: Hostile, cache: Path) -> None:
    """Part 0's prompt store rewritten as a zarr v2 store whose `text` array decodes through numcodecs' Pickle
    filter, its one chunk a pickle that runs `touch PWNED`: what a downloaded cache could carry (its metadata
    written by hand, as zarr itself no longer makes such arrays)."""
    import zarr

    store = cache / STORE
    old = zarr.open_group(str(store), mode="r")
    arrays = {name: (a[...], dict(a.attrs)) for name, a in old.members(max_depth=None) if isinstance(a, zarr.Array)}
    shutil.rmtree(store)
    g = zarr.open_group(str(store), mode="w", zarr_format=2)
    for name, (data, attrs) in arrays.items():
        if name != F.Z_TEXT:
            g.create_array(name, data=np.asarray(data), chunks=data.shape, compressors=None).attrs.update(attrs)
    (store / F.Z_TEXT).mkdir()
    n = len(arrays[F.Z_TEXT][0])
    (store / F.Z_TEXT / ".zarray").write_text(json.dumps({
        "zarr_format": 2, "shape": [n], "chunks": [n], "dtype": "|O", "compressor": None, "fill_value": None,
        "filters": [{"id": "vlen-utf8"}, {"id": "pickle"}], "order": "C", "dimension_separator": "."}))
    (store / F.Z_TEXT / "0").write_bytes(h.payload())


def _text_chunk_claiming(cache: Path, count: int) -> None:
    """Part 0's `text` chunk replaced by a few bytes whose vlen-utf8 header claims `count` strings, compressed as
    stage one's are and its crc32c made valid: the codec would allocate for all of them."""
    from numcodecs import Zstd

    from cache.checksum import crc32c

    chunks = [p for p in (cache / STORE / F.Z_TEXT).rglob("*") if p.is_file() and p.name != "zarr.json"]
    body = bytes(Zstd().encode(count.to_bytes(4, "little") + (3).to_bytes(4, "little") + b"abc"))
    chunks[0].write_bytes(body + crc32c(body).to_bytes(4, "little"))


def _rerecord_manifest(cache: Path, edit: Callable[[dict], None]) -> None:
    """The manifest edited and its fingerprint made to agree, as a tool that knows the format would."""
    from cache.records import Manifest

    m = json.loads((cache / F.MANIFEST).read_text())
    edit(m)
    try:
        m["fingerprint"] = Manifest.from_json(m).settings_fingerprint()
    except ValueError:  # the edit is out of the record's range already: refused as cheaply either way
        pass
    (cache / F.MANIFEST).write_text(json.dumps(m))


def _copy_run(h: Hostile, name: str) -> Path:
    run = h.path(name)
    shutil.copytree(h.ws.ref_run, run, ignore=shutil.ignore_patterns("debug", "checkpoints"))
    return run


def _students(run: Path) -> list[Path]:
    """The run's weights folders (student/, and student_ema/, which `--weights auto` picks first): an attack on a
    run's weights is planted in each."""
    return [run / name for name in ("student", "student_ema") if (run / name).is_dir()]


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def _regular(path: Path) -> Callable[[Result], list[str]]:
    """After the command: `path` a regular file the command wrote, not the link that was planted there."""
    return lambda r: [] if path.is_file() and not path.is_symlink() else [f"{path.name} is still a link"]


def code_and_outside_writes(h: Hostile) -> list[tuple[str, list[Case]]]:
    ws = h.ws
    pickled = h.cache("pickled-store")
    _pickled_store(h, pickled)
    lora = h.lora_run()
    climb = h.path("lora-climb")
    shutil.copytree(lora, climb)
    for folder in _students(climb):
        h.edit_json(folder / "lora.json", lambda d: d.update(files={k: "../../home/.bashrc" for k in d["files"]}))
    evald = _copy_run(h, "eval-link")
    (evald / "eval.png").symlink_to(h.home / "thesis.tex")
    grid = h.path("grid")
    grid.mkdir()
    (grid / "grid.png.json").symlink_to(h.home / "thesis.tex")
    someone = h.path("someones-model")
    shutil.copytree(ws.teacher, someone, ignore=shutil.ignore_patterns(MARKER))  # (a model tiny-teacher did not write)
    linked = h.path("tiny-linked")
    linked.mkdir()
    (linked / "vae").symlink_to(h.home / "project", target_is_directory=True)
    evaluate = ["eval", "--cache", ws.ref_cache, "--max-prompts", "2", "--no-teacher-timing"]
    return [
        ("T1 a zarr v2 prompt store with a pickle filter", [
            Case("cache verify", ["cache", "verify", pickled], (F.PROMPTS_ZARR,), forbid=UNSAFE_WORDS, env=UNSAFE),
            Case("eval", evaluate[:2] + [pickled] + evaluate[3:] + ["--student", ws.ref_run, "--report",
                                                                    h.path("eval") / "eval.json"],
                 (F.PROMPTS_ZARR,), forbid=UNSAFE_WORDS, env=UNSAFE),
        ]),
        ("T2 lora.json naming its adapter ../../home/.bashrc", [
            Case("export", ["export", "--student", climb, "--out", h.path("climb-export")], ("lora.json",)),
        ]),
        ("T3 outputs through a link planted in the run or --out folder", [
            Case("eval: eval.png a link", evaluate + ["--student", evald], expect="ok",
                 check=_regular(evald / "eval.png")),
            Case("sample: grid.png.json a link", ["sample", "--student", ws.ref_run, "--teacher", ws.teacher,
                                                  "--prompts", ws.prompts, "--out", grid / "grid.png",
                                                  "--max-prompts", "1", "--steps", "2", "--device", "cpu"],
                 expect="ok", check=_regular(grid / "grid.png.json")),
            Case("tiny-teacher --out someone's model", ["tiny-teacher", "--out", someone], (str(someone),),
                 protect=(someone,)),
            Case("tiny-teacher --out with a linked subfolder", ["tiny-teacher", "--out", linked], ("vae",)),
        ]),
    ]


def leaks(h: Hostile) -> list[tuple[str, list[Case]]]:
    ws = h.ws
    leaky = h.path("leaky-teacher")
    shutil.copytree(ws.teacher, leaky)
    (leaky / "vae" / "notes.txt").symlink_to(h.home / "thesis.tex")
    looped = h.path("looped-teacher")
    shutil.copytree(ws.teacher, looped)
    (looped / "vae" / "loop").symlink_to(looped / "vae" / "loop")
    hub = h.path("hub-home")
    repo = hub / "hub" / "models--evil--teacher"
    snap = repo / "snapshots" / ("1" * 40)
    shutil.copytree(ws.teacher, snap)
    (snap / "vae" / "notes.txt").symlink_to(h.home / "thesis.tex")
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("1" * 40)
    climbing = h.path("hub-climb")
    shutil.copytree(ws.teacher, climbing / "hub" / "models--evil--climb" / "snapshots" / ("2" * 40))
    (climbing / "hub" / "models--evil--climb" / "refs").mkdir()
    (climbing / "hub" / "models--evil--climb" / "refs" / "main").write_text("../../../../home")
    hub_env = lambda home: {"HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}  # noqa: E731
    dry = lambda teacher: ws.stage_one(h.path("c")) + ["--teacher", teacher, "--dry-run"]  # noqa: E731
    return [
        ("T4 links in a teacher folder or Hub snapshot pointing out of it", [
            Case("export --copy of a teacher with a link out", ["export", "--student", ws.ref_run, "--teacher", leaky,
                                                               "--copy", "--out", h.path("leak-export")],
                 ("notes.txt",)),
            Case("teacher-cache --dry-run: a Hub snapshot linking out", dry("evil/teacher"), ("notes.txt",),
                 env=hub_env(hub)),
            Case("teacher-cache --dry-run: refs/main of ../../../../home", dry("evil/climb"), ("refs",),
                 env=hub_env(climbing)),
            Case("teacher-cache --dry-run: a link loop in the teacher", dry(looped), ("loop",)),
        ]),
    ]


def exports(h: Hostile) -> list[tuple[str, list[Case]]]:
    ws = h.ws
    fifo_out = h.path("fifo-export")
    fifo_out.mkdir()
    os.mkfifo(fifo_out / "model_index.json")
    marked = h.path("marked-folder")
    marked.mkdir()
    (marked / "lora.json").write_text(json.dumps({"_wandistiller": {"student_run": "x"}}))
    (marked / "notes.md").write_text("mine\n")
    earlier = h.path("earlier-export")
    ws.must(run_cli(["export", "--student", ws.ref_run, "--out", earlier]))
    (earlier / ".git").mkdir()
    (earlier / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    export = lambda out: ["export", "--student", ws.ref_run, "--out", out, "--overwrite"]  # noqa: E731
    return [
        ("T5 export --out holding what export did not write", [
            Case("a FIFO as model_index.json", export(fifo_out), (str(fifo_out),)),
            Case("--overwrite of a folder whose lora.json has the export key", export(marked), (str(marked),),
                 protect=(marked,)),
            Case("--overwrite of an earlier export holding .git/", export(earlier), (".git",),
                 protect=(earlier / ".git",)),
        ]),
    ]


def sizes_and_records(h: Hostile) -> list[tuple[str, list[Case]]]:
    ws = h.ws
    sparse = _copy_run(h, "sparse-distill")
    with open(sparse / "distill.json", "r+b") as f:
        f.truncate(16 << 30)  # 16 GiB, sparse
    many = h.cache("many-prompts")
    _rerecord_manifest(many, lambda m: m.update(prompts=10**8))
    claims = h.cache("claiming-chunk")
    _text_chunk_claiming(claims, 2**31)
    lying = {}
    for field, value in (("student_steps", 10**9), ("frames", 10**9), ("max_sequence_length", 10**8)):
        run = lying[field] = _copy_run(h, f"distill-{field}")
        h.edit_json(run / "distill.json", lambda d, f=field, v=value: d.update({f: v}))
    deep_run = _copy_run(h, "deep-distill")
    (deep_run / "distill.json").write_text(_nested(100_000))
    deep_toml = h.path("deep.toml")
    deep_toml.write_text("steps = " + _nested(100_000) + "\n")
    deep_jsonl = h.path("deep.jsonl")
    deep_jsonl.write_text('{"prompt": ' + _nested(100_000) + "}\n")
    sample = lambda run: ["sample", "--student", run, "--teacher", ws.teacher, "--prompts", ws.prompts,  # noqa: E731
                          "--out", h.path("grid") / "grid.png", "--max-prompts", "1", "--device", "cpu"]
    return _bounded([
        ("T6 sizes: a 16 GiB sparse record, 10^8 prompts, a chunk claiming 2^31 strings", [
            Case("sample: a 16 GiB distill.json", sample(sparse), ("distill.json",)),
            Case("export: a 16 GiB distill.json", ["export", "--student", sparse, "--out", h.path("e")],
                 ("distill.json",)),
            Case("cache info: 10^8 prompts", ["cache", "info", many], ("prompts",)),
            Case("cache verify: 10^8 prompts", ["cache", "verify", many], ("prompts",)),
            Case("cache verify: a text chunk claiming 2^31 strings", ["cache", "verify", claims], (F.Z_TEXT,)),
        ]),
        ("T7 run records out of range or nested 10^5 deep", [
            *(Case(f"sample: distill.json {k} {v}", sample(lying[k]), (k,)) for k, v in
              (("student_steps", "10^9"), ("frames", "10^9"), ("max_sequence_length", "10^8"))),
            Case("sample: distill.json nested 10^5 deep", sample(deep_run), ("distill.json",)),
            Case("teacher-cache --config nested 10^5 deep", ws.stage_one(h.path("c")) + ["--config", deep_toml],
                 ("deep.toml",)),
            Case("teacher-cache: a JSONL prompt nested 10^5 deep", ws.stage_one(h.path("c")) + [
                "--prompts", deep_jsonl], ("deep.jsonl",)),
            Case("teacher-cache --negative-prompt of 10 MB", ws.stage_one(h.path("c"), negative_prompt="a" * 10**7),
                 ("--negative-prompt",)),
        ]),
    ])


def _bounded(rows: list[tuple[str, list[Case]]]) -> list[tuple[str, list[Case]]]:
    """`rows` with every attempt run under MEM."""
    return [(fault, [dataclasses.replace(c, mem=MEM) for c in cases]) for fault, cases in rows]


def teachers_and_weights(h: Hostile) -> list[tuple[str, list[Case]]]:
    ws = h.ws
    unknown = h.path("unknown-class")
    shutil.copytree(ws.teacher, unknown)
    h.edit_json(unknown / "model_index.json", lambda d: d.update(vae=["diffusers", "EvilAutoencoder"]))
    listed = h.path("list-entry")
    shutil.copytree(ws.teacher, listed)
    h.edit_json(listed / "model_index.json", lambda d: d.update(transformer=[["diffusers"], 3]))
    pickled, liar, rank = _copy_run(h, "pickled-bin"), _copy_run(h, "lying-weights"), h.path("lora-rank")
    shutil.copytree(h.lora_run(), rank)
    for folder in _students(pickled):
        next(folder.glob("*.safetensors")).unlink()
        (folder / "diffusion_pytorch_model.bin").write_bytes(h.payload())
    for folder in _students(liar):
        h.edit_json(folder / "config.json", lambda d: d.update(num_attention_heads=d["num_attention_heads"] * 2))
    for folder in _students(rank):
        h.edit_json(folder / "lora.json", lambda d: d.update(rank=d["rank"] * 2))
    below_file = h.path("a-file")
    below_file.write_text("mine\n")
    fifo_prompts = h.path("prompts.fifo")
    os.mkfifo(fifo_prompts)
    bom = h.path("bom.txt")
    bom.write_bytes("\ufeffa red circle on a blue background\n".encode())
    bom_cache = h.path("bom-cache")

    def no_bom(r: Result) -> list[str]:
        from cache.prompt_store import open_prompt_store

        text = open_prompt_store(bom_cache / STORE)[F.Z_TEXT][0]
        return [] if not str(text).startswith("\ufeff") else [f"prompt 0 keeps the BOM: {text!r}"]

    export = lambda run: ["export", "--student", run, "--out", h.path("e")]  # noqa: E731
    return [
        ("T8 malformed teacher folders: the dry run refuses what the run would crash on", [
            Case("teacher-cache --dry-run: an unknown class", ws.stage_one(h.path("c")) + ["--teacher", unknown,
                                                                                          "--dry-run"],
                 ("EvilAutoencoder",)),
            Case("teacher-cache --dry-run: a list entry", ws.stage_one(h.path("c")) + ["--teacher", listed,
                                                                                      "--dry-run"],
                 ("transformer",)),
        ]),
        ("T9 weights: pickled .bin, shapes or rank that lie", [
            Case("export: a pickled .bin student", export(pickled), (".bin",)),
            Case("export: weights that disagree with config.json", export(liar), ("config.json",)),
            Case("export: LoRA files of another rank than lora.json", export(rank), ("rank",)),
        ]),
        ("T10 prompt files and --out: a FIFO, a BOM, a folder below a file", [
            Case("teacher-cache: a FIFO prompt file", ws.stage_one(h.path("c")) + ["--prompts", fifo_prompts],
                 ("FIFO",)),
            Case("teacher-cache: a BOM before prompt 1", ws.stage_one(bom_cache) + ["--prompts", bom], expect="ok",
                 check=no_bom),
            Case("sample --out below a file", ["sample", "--student", ws.ref_run, "--teacher", ws.teacher,
                                               "--prompts", ws.prompts, "--out", below_file / "grid.png",
                                               "--max-prompts", "1", "--device", "cpu"], (str(below_file),)),
        ]),
    ]


GROUPS = (code_and_outside_writes, leaks, exports, sizes_and_records, teachers_and_weights)


def hostile_folders(ws: Workspace) -> list[Row]:
    return hostile_inputs(ws, GROUPS)
