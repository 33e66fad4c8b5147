"""Malformed input across every subcommand: each must end in exit 2 and one error line naming the
problem and the fix, with no traceback, and must leave existing caches, runs, exports and inputs exactly
as they were (a hash of every file before and after), and create no data where it was pointed."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path


from cache.prompt_store import open_prompt_store

from .check import read_samples, tree_digest
from .damage import chunk_location
from .proc import run_cli
from .report import Row
from .workspace import STUDENT_CONFIG, Workspace


class Inputs:
    """Existing outputs a bad command could damage, and malformed input files; all below `root`."""

    def __init__(self, ws: Workspace):
        self.ws = ws
        root = self.root = ws.fresh("bad-input")
        root.mkdir()
        self.cache = root / "cache"
        shutil.copytree(ws.ref_cache, self.cache)
        self.run = root / "run"
        shutil.copytree(ws.ref_run, self.run, ignore=shutil.ignore_patterns("debug"))
        self.export = root / "export"
        ws.must(run_cli(["export", "--student", self.run, "--teacher", ws.teacher, "--out", self.export]))
        self.files = root / "inputs"
        self.files.mkdir()
        self.new = ws.fresh("bad-input-new")  # where commands are pointed to create something: must stay empty

    def file(self, name: str, content: str | bytes) -> Path:
        p = self.files / name
        p.write_bytes(content if isinstance(content, bytes) else content.encode())
        return p

    def student_config(self, name: str, **change) -> Path:
        cfg = json.loads(STUDENT_CONFIG.read_text()) | change
        return self.file(name, json.dumps(cfg))

    def out(self, name: str) -> Path:
        return self.new / name


def cases(x: Inputs) -> list[tuple[str, list, list[str]]]:
    """(what is wrong, argv, substrings of the one error line: the problem and the fix)."""
    ws = x.ws
    t1 = lambda out=None, **over: ws.stage_one(out or x.out("cache"), **over)  # noqa: E731
    t2 = lambda out=None, **over: ws.train(out or x.out("run"), cache=x.cache, **over)  # noqa: E731
    prompts = lambda name, content: ["--prompts", x.file(name, content)]  # noqa: E731
    toml = lambda name, content: ["--config", x.file(name, content)]  # noqa: E731
    not_a_pipeline = x.files / "not-a-pipeline"
    not_a_pipeline.mkdir(exist_ok=True)
    foreign = x.files / "home"
    foreign.mkdir(exist_ok=True)
    (foreign / "thesis.tex").write_text("precious")
    stage_one_dir = x.files / "unfinished-cache"
    shutil.copytree(x.cache, stage_one_dir, dirs_exist_ok=True)
    (stage_one_dir / "manifest.json").unlink()
    edited = x.files / "edited-cache"  # guidance changed by hand: no longer hashes to its fingerprint
    shutil.copytree(x.cache, edited, dirs_exist_ok=True)
    m = json.loads((edited / "manifest.json").read_text())
    (edited / "manifest.json").write_text(json.dumps(m | {"guidance": m["guidance"] + 1}))
    return [
        # teacher-cache: prompt files
        ("prompt file missing", t1() + ["--prompts", x.files / "nope.txt"], ["nope.txt does not exist", "pass a .txt"]),
        ("prompt file empty", t1() + prompts("empty.txt", "\n# only a comment\n"), ["holds no prompts", "add one"]),
        ("prompt file not UTF-8", t1() + prompts("latin1.txt", b"ok\n\xe9t\xe9\n"), ["not UTF-8 (line 2", "re-save"]),
        ("jsonl line not JSON", t1() + prompts("bad.jsonl", '{"prompt": "a"}\n{"prompt": \n'),
         ["line 2: not valid JSON", '{"prompt": "..."}']),
        ("jsonl line without prompt", t1() + prompts("nokey.jsonl", '{"text": "a"}\n'),
         ["line 1: expected", '"prompt"']),
        # teacher-cache: paths
        ("teacher path missing", t1() + ["--teacher", x.files / "no-teacher"], ["does not exist"]),
        ("teacher not a Wan pipeline", t1() + ["--teacher", not_a_pipeline], ["model_index.json is missing"]),
        ("output is a file", t1(x.file("a-file", "x")), ["is a file", "pass a directory"]),
        ("output is someone's folder", t1(foreign), ["not a WanDistiller cache", "choose a new or empty directory"]),
        ("cache made with other settings", t1(x.cache, steps=3), ["other settings", "--overwrite"]),
        ("cache started with another batch size", t1(x.cache, batch_size=3), ["--batch-size 2", "--overwrite"]),
        # teacher-cache: numeric ranges and conflicting flags
        ("height not a multiple of 16", t1(height=70), ["--height 70 is not divisible by 16"]),
        ("zero steps", t1(steps=0), ["steps must be an integer >= 1, got 0"]),
        ("frames not 4k+1", t1(frames=3), ["--frames 3 must be 1 or 4k+1"]),
        ("negative guidance", t1(guidance=-1), ["guidance must be a non-negative number"]),
        ("too many seeds", t1(seeds_per_prompt=100), ["seeds-per-prompt must be at most 99"]),
        ("part out of range", t1(part=2, num_parts=2), ["part must be in [0, num-parts)"]),
        ("part without num-parts", t1(part=1), ["give --part and --num-parts together"]),
        ("steps not a number", t1(steps="four"), ["'four' is not a valid integer"]),
        ("the seed script's retired flag", t1(dtype="float32") + ["--teacher_dtype", "float16"],
         ["No such option '--teacher_dtype'"]),
        # teacher-cache: placements, device maps, memory specs
        ("unknown placement", t1(placement="gpu-farm"), ["placement must be one of", "device-map .json"]),
        ("device map missing", t1(placement=x.files / "nope.json"), ["device map", "does not exist", "pass a JSON"]),
        ("device map not JSON", t1(placement=x.file("map.json", "{transformer: cuda}")), ["not valid JSON"]),
        ("device map names no device", t1(placement=x.file("map2.json", '{"transformer": "gpu7"}')),
         ["is not a device", "use \"cuda:N\", \"cpu\" or \"disk\""]),
        ("memory spec unreadable", ["plan", "--teacher", ws.teacher, "--max-memory", "lots"],
         ["cannot read --max-memory item 'lots'", "0=70GiB"]),
        ("memory spec without a balanced placement", t1(max_memory="cpu=8GiB"),
         ["--max-memory applies to --placement balanced or sequential"]),
        # teacher-cache: TOML configs
        ("TOML unknown key", t1() + toml("k.toml", "[teacher_cache]\nstepz = 3\n"),
         ["unknown key 'stepz'", "valid keys"]),
        ("TOML syntax error", t1() + toml("s.toml", "steps = [\n"), ["not valid TOML"]),
        ("TOML wrong type", t1() + toml("t.toml", 'seeds_per_prompt = "two"\n'),
         ["seeds-per-prompt must be an integer >= 1, got 'two'", "t.toml"]),
        ("TOML file missing", t1() + ["--config", x.files / "none.toml"], ["none.toml does not exist"]),
        # train-student: caches
        ("cache missing", t2() + ["--cache", x.files / "no-cache"], ["does not exist", "teacher-cache"]),
        ("cache not finished", ws.train(x.out("run"), cache=stage_one_dir), ["has no manifest.json", "rerun"]),
        ("same cache twice", t2() + ["--cache", x.cache], ["given twice", "pass each CACHE_DIR once"]),
        # train-student: student configs
        ("student config missing", t2() + ["--student-config", x.files / "none.json"],
         ["does not exist", "pass a JSON"]),
        ("student config not JSON", t2() + ["--student-config", x.file("s.json", "{num_layers: 2")],
         ["not valid JSON"]),
        ("student config not an object", t2() + ["--student-config", x.file("l.json", "[1, 2]")],
         ["must be a JSON object"]),
        ("student config unknown key", t2() + ["--student-config", x.student_config("u.json", hidden_size=8)],
         ["unknown key(s) hidden_size", "WanTransformer3DModel takes"]),
        ("student config does not fit the cache", t2() + ["--student-config", x.student_config("w.json", text_dim=64)],
         ["text_dim 64 but the cache", "does not fit"]),
        ("student rotary table smaller than the cache's latents",
         t2() + ["--student-config", x.student_config("r.json", rope_max_seq_len=1)],
         ["rope_max_seq_len 1 is fewer positions", "set rope_max_seq_len to at least"]),
        # train-student: numeric ranges and conflicting flags
        ("zero batch size", t2(batch_size=0), ["batch-size must be an integer >= 1"]),
        ("batch larger than the data", t2(batch_size=100), ["larger than a rank's share", "lower --batch-size"]),
        ("train steps not integers", t2(train_steps="1,x"), ["comma-separated integers like 0,4,8"]),
        ("train step not in the cache", t2(train_steps="5"), ["has no step 5", "choose from those"]),
        ("every prompt held out", t2(holdout_prompts=24), ["leaves no prompt to train on"]),
        ("EMA decay 1", t2(ema_decay=1.0), ["ema-decay must be in [0, 1)"]),
        ("negative learning rate", t2(lr=-1), ["lr must be a positive number"]),
        ("teacher blocks without a teacher", t2(teacher_blocks="0,1"), ["needs --init-from-teacher"]),
        ("fp16 on the CPU", t2(mixed_precision="fp16"), ["fp16 needs CUDA", "use bf16 or no"]),
        ("TOML unknown key (stage two)", t2() + toml("k2.toml", "[train_student]\nbatchsize = 3\n"),
         ["unknown key 'batchsize'"]),
        # train-student: an existing run
        ("run exists, no --resume", ws.train(x.run, cache=x.cache), ["already holds a training run", "--resume"]),
        ("resume with another seed", ws.train(x.run, cache=x.cache, seed=4) + ["--resume"],
         ["was made with another seed", "use a new --out"]),
        ("resume with another batch", ws.train(x.run, cache=x.cache, batch_size=2) + ["--resume"],
         ["was made with another global batch", "use a new --out"]),
        # sample, export, eval, cache, plan
        ("sample: student missing", ["sample", "--student", x.files / "none", "--prompts", ws.prompts, "--out",
                                     x.out("grid.png")], ["does not exist", "train-student"]),
        ("sample: device unknown", ["sample", "--student", x.run, "--prompts", ws.prompts, "--out", x.out("g.png"),
                                    "--device", "tpu"], ["device must be auto, cpu, cuda or cuda:N"]),
        ("sample: output is a folder", ["sample", "--student", x.run, "--prompts", ws.prompts, "--out", x.files],
         ["is a folder", "pass the PNG file"]),
        ("export over an earlier export", ["export", "--student", x.run, "--teacher", ws.teacher, "--out", x.export],
         ["--overwrite"]),
        ("export over a folder it did not make", ["export", "--student", x.run, "--teacher", ws.teacher,
                                                  "--out", x.cache, "--overwrite"], [str(x.cache)]),
        ("eval: cache missing", ["eval", "--student", x.run, "--cache", x.files / "none"], ["does not exist"]),
        ("eval: zero prompts", ["eval", "--student", x.run, "--cache", x.cache, "--max-prompts", "0"],
         ["max-prompts must be an integer >= 1"]),
        ("cache info: not a cache", ["cache", "info", x.files], ["has no manifest.json"]),
        ("plan: GPUs unreadable", ["plan", "--teacher", ws.teacher, "--assume-gpus", "fourx24GiB"],
         ["cannot read --assume-gpus", "4x24GiB"]),
        # issue 21, item 7, and the previous review's leftovers: each was a traceback
        ("train: --out below a file", t2(x.file("plain", "x") / "run"), ["cannot write to", "choose a writable"]),
        ("height beyond the teacher's rotary positions", t1(height=528),
         ["33 patches", "rope_max_seq_len 32", "the maximum is --height 512"]),
        ("cache verify: folder missing", ["cache", "verify", x.files / "none"], ["does not exist", "CACHE_DIR"]),
        ("plan: the teacher fits nowhere", ["plan", "--teacher", ws.teacher, "--assume-gpus", "none",
                                            "--assume-ram", "0", "--assume-disk", "0"], ["fits nowhere"]),
        ("eval: manifest edited after stage one", ["eval", "--student", x.run, "--cache", edited],
         ["no longer hash to its fingerprint", "guidance is"]),
        ("resume: a prompt-store chunk fails its crc32c", t1(_killed_copy(x, "bad-chunk", _flip_embeds)),
         ["is damaged", "fail their chunk's crc32c", "delete", "--overwrite"]),
        ("resume: the part's negative prompt changed", t1(_killed_copy(x, "bad-negative", _flip_negative)),
         ["is damaged", "negative.safetensors fails its sha256 check", "--overwrite"]),
        # The command server's processes see no GPU, whatever this machine has (tests/faults/proc.py).
        ("CUDA placement without a GPU", t1(placement="cuda"), ["needs a CUDA GPU", "--placement"]),
        ("device map on a GPU that is not there", t1(placement=x.file("map3.json", '{"transformer": "cuda:0"}')),
         ["no CUDA GPU is visible", "use cpu"]),
        ("train on CUDA without a GPU", t2(device="cuda"), ["no CUDA device is visible", "--device cpu"]),
    ]


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def _flip_embeds(part_dir: Path) -> None:
    """Flip a byte of every row's first embeds token (in its chunk, in its file)."""
    store = part_dir / "prompts.zarr"
    for row in range(open_prompt_store(store)["seq_lens"].shape[0]):
        where = chunk_location(store, "embeds", row)
        if where is not None:
            _flip(where[0], where[1] + 8)


def _flip_negative(part_dir: Path) -> None:
    neg = part_dir / "negative.safetensors"
    _flip(neg, neg.stat().st_size - 3)  # tensor data: it still decodes, to other values


def _killed_copy(x: Inputs, name: str, damage) -> Path:
    """A copy of the cache as a SIGKILLed stage one leaves it (no manifest, its last shard not yet written), with
    part 0's own files then damaged by `damage(part_dir)`: the resume must refuse before computing anything.
    Outside the protected inputs: a refused resume still rewrites the part's resolved config."""
    path = x.root / name
    shutil.copytree(x.cache, path)
    m = json.loads((path / "manifest.json").read_text())
    (path / "manifest.json").unlink()
    (path / m["shards"][-1]["path"]).unlink()
    damage(path / "parts" / "part-00000")
    return path


def type_cases(x: Inputs) -> list[tuple[str, list, list[str]]]:
    """Config values of the wrong type (issue 21): quoted booleans, numbers for strings, NaN and infinity.
    Each used to be taken as something else (a quoted "false" is true) or to end in a traceback."""
    ws = x.ws
    toml = lambda name, content: ["--config", x.file(name, content)]  # noqa: E731
    # No --placement/--negative-prompt flags here: the TOML's value must be the one checked.
    bare1 = lambda out: ["teacher-cache", "--teacher", ws.teacher, "--prompts", ws.prompts, "--out", out]  # noqa: E731
    t2 = lambda out=None, **over: ws.train(out or x.out("run"), cache=x.cache, **over)  # noqa: E731
    return [
        ("TOML overwrite = \"false\" on a finished cache", bare1(x.cache) + toml("o.toml", 'overwrite = "false"\n'),
         ["overwrite must be true or false", "got 'false'", "o.toml"]),
        ("TOML placement = 5", bare1(x.out("cache")) + toml("p.toml", "placement = 5\n"),
         ["placement must be a string", "got 5", "p.toml"]),
        ("TOML negative_prompt = 5", bare1(x.out("cache")) + toml("n.toml", "negative_prompt = 5\n"),
         ["negative-prompt must be a string", "got 5"]),
        ("TOML guidance = nan", bare1(x.out("cache")) + toml("g.toml", "guidance = nan\n"),
         ["guidance must be a finite number", "got nan"]),
        ("TOML save_cond_uncond = 1", bare1(x.out("cache")) + toml("c.toml", "save_cond_uncond = 1\n"),
         ["save-cond-uncond must be true or false", "got 1"]),
        ("TOML resume = \"no\" on a run", ws.train(x.run, cache=x.cache) + toml("r.toml", 'resume = "no"\n'),
         ["resume must be true or false", "got 'no'", "r.toml"]),
        ("TOML weight_decay = inf", t2() + toml("w.toml", "weight_decay = inf\n"),
         ["weight-decay must be a finite number", "got inf"]),
        ("--lr nan", t2(lr="nan"), ["lr must be a finite number", "got nan"]),
        ("--lr inf", t2(lr="inf"), ["lr must be a finite number", "got inf"]),
        ("export: TOML overwrite = \"yes\"", ["export", "--student", x.run, "--teacher", ws.teacher, "--out", x.export]
         + toml("e.toml", 'overwrite = "yes"\n'), ["overwrite must be true or false", "got 'yes'"]),
    ]


def _check_table(ws: Workspace, x: Inputs, row: Row, table: list) -> None:
    """Run every case: exit 2, one error line holding the needles, no traceback, nothing changed or created."""
    protected = [x.cache, x.run, x.export, x.files, ws.prompts, ws.teacher, STUDENT_CONFIG.parent]
    digest = {p: tree_digest(p) if p.is_dir() else p.read_bytes() for p in protected}
    keys = set(read_samples(x.cache)[0])
    for what, argv, needles in table:
        r = run_cli(argv)
        said = [ln for ln in (r.err + r.out).splitlines() if ln.lower().startswith("error:")]
        problems = []
        if r.code != 2:
            problems.append(f"exit {r.code}, expected 2")
        if len(said) != 1:
            problems.append(f"{len(said)} error lines, expected one")
        elif not all(n in said[0] for n in needles):
            problems.append(f"the error line lacks {[n for n in needles if n not in said[0]]}")
        if "Traceback" in r.err + r.out:
            problems.append("a traceback was printed")
        changed = [str(p) for p in protected if digest[p] != (tree_digest(p) if p.is_dir() else p.read_bytes())]
        if changed:
            problems.append(f"changed {changed}")
            digest.update({p: tree_digest(p) if p.is_dir() else p.read_bytes() for p in protected})
        made = [str(p) for p in x.new.rglob("*") if p.is_file()] if x.new.exists() else []
        if made:
            problems.append(f"created {made[:3]}")
            shutil.rmtree(x.new)
        now = set(read_samples(x.cache)[0]) if changed else keys
        row.notes.append(f"{what}: {said[0] if said else r.err.strip()[-200:]}")
        if problems:
            problems.append(r.describe())
        row.record(what, problems, lost=len(keys - now), duplicated=0)


def _table_row(ws: Workspace, fault: str, min_attempts: int, make_cases) -> Row:
    """One table row: every case of `make_cases(inputs)` run and checked."""
    row = Row(fault, min_attempts=min_attempts)
    t0 = time.perf_counter()
    x = Inputs(ws)
    _check_table(ws, x, row, make_cases(x))
    row.wall_s = time.perf_counter() - t0
    return row


def bad_inputs(ws: Workspace) -> Row:
    return _table_row(ws, "bad input (every subcommand)", 25, cases)


def config_types(ws: Workspace) -> Row:
    return _table_row(ws, "config values of the wrong type", 10, type_cases)
