"""Hostile inputs: a cache, a checkpoint, an `--out` folder or a prompt file built as an attacker (or a careless
colleague on a shared scratch disk) would build it, one table row per kind (issue 41's defects D1-D19, the file
modes, and the steps a new user tripped on).

Every attempt runs one command on such an input and checks four things:
- nothing ran: a planted payload would create the file `PWNED`; it must not exist afterwards;
- nothing outside the cache or `--out` changed: a digest of the victim's folder (a stand-in for their home, which
  the hostile links and paths point into) and of every input the case names, before and after;
- no hang: the command must end within its time limit (a FIFO, a tar member that claims a petabyte);
- one line: exit 2 with exactly one `error:` line holding the case's words and no traceback, or, where the right
  answer is to go on (an export's file modes, a lock that is junk), exit 0 and the case's own check.
"""

from __future__ import annotations

import functools
import json
import os
import pickle
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from cache import format as F
from cache.checksum import crc32c

from .check import sha256_file, tree_digest
from .proc import Result, run_cli
from .report import Row
from .workspace import Workspace

HANG_S = 60.0  # a refusal takes a few seconds; a command still running after this has hung (or is eating memory)
OFFLINE = {"HF_HUB_OFFLINE": "1"}  # whatever a hostile file names, nothing is fetched during the suite


@dataclass
class Case:
    """One attempt. `expect`: "refuse" (exit 2, one error line holding `needles`), "ok" (exit 0), or "no-hang"
    (exit 0, or a refusal as above: junk where a lock belongs may be ignored or refused, never waited on)."""

    what: str
    argv: list
    needles: tuple[str, ...] = ()
    expect: str = "refuse"
    protect: tuple[Path, ...] = ()  # inputs (besides the victim's folder) that must keep every byte
    check: Callable[[Result], list[str]] | None = None  # further problems, after the command
    env: dict = field(default_factory=dict)
    umask: int | None = None
    forbid: tuple[str, ...] = ()  # words the output must not hold ("cache complete", "weights_only=False")
    mem: int | None = None  # the bytes of address space it may take beyond its start (`prlimit --as`)


class _Payload:
    """Pickled, it runs `cmd` through os.system when unpickled: what a planted checkpoint file carries."""

    def __init__(self, cmd: str):
        self.cmd = cmd

    def __reduce__(self):
        return os.system, (self.cmd,)


class Hostile:
    """The victim's folder, the payload's marker, and copies of the references to damage; all below one root."""

    def __init__(self, ws: Workspace):
        self.ws = ws
        self.root = ws.fresh("hostile")
        self.home = self.root / "home"  # the victim: links and hostile paths point in here
        (self.home / "project").mkdir(parents=True)
        (self.home / "thesis.tex").write_text("four years of work\n")
        (self.home / ".bashrc").write_text("export PATH=$HOME/bin:$PATH\n")
        (self.home / "project" / "config.json").write_text('{"mine": true}\n')
        (self.home / "project" / "metrics.jsonl").write_text('{"step": 1}\n')
        self.marker = self.root / "PWNED"
        self._n = 0

    def path(self, name: str) -> Path:
        self._n += 1
        return self.root / f"{self._n:02d}-{name}"

    def payload(self) -> bytes:
        return pickle.dumps(_Payload(f"touch {self.marker}"))

    # -- caches ---------------------------------------------------------------------------------------------
    def cache(self, name: str) -> Path:
        out = self.path(name)
        shutil.copytree(self.ws.ref_cache, out)
        return out

    def killed_cache(self, name: str) -> Path:
        """A cache as a SIGKILLed stage one leaves it: no manifest, its last shard not yet written; rerunning the
        same command resumes it."""
        out = self.cache(name)
        m = json.loads((out / F.MANIFEST).read_text())
        (out / F.MANIFEST).unlink()
        last = m["shards"][-1]["path"]
        (out / last).unlink()
        progress = out / F.PARTS_DIR / "part-00000" / F.PROGRESS
        rec = json.loads(progress.read_text())
        rec["shards"] = [s for s in rec["shards"] if s["path"] != last]
        rec["done_blocks"] = sorted({b for s in rec["shards"] for b in s["blocks"]})
        rec["complete"] = False
        progress.write_text(json.dumps(rec))
        return out

    def edit_json(self, path: Path, edit: Callable[[dict], None]) -> None:
        d = json.loads(path.read_text())
        edit(d)
        path.write_text(json.dumps(d))

    # -- training runs ----------------------------------------------------------------------------------------
    @functools.cached_property
    def _lora(self) -> Path:
        out = self.path("lora-run")
        argv = self.ws.train(out)
        i = argv.index("--student-config")
        argv[i:i + 2] = ["--lora-of", self.ws.teacher, "--lora-rank", "4"]
        argv[argv.index("--max-steps") + 1] = "2"
        r = run_cli(argv)
        if r.code != 0:
            raise RuntimeError(f"the LoRA run failed: {r.describe()}")
        return out

    def lora_run(self) -> Path:
        """A 2-step LoRA run of rank 4 (built once; copy it before damaging it)."""
        return self._lora

    def killed_run(self, name: str, **over) -> Path:
        """A run SIGKILLed at its 8th step, with checkpoints at steps 3 and 6."""
        out = self.path(name)
        r = run_cli(self.ws.train(out, **over), env={"WANDISTILLER_KILL_AT": "train_step:8"})
        if r.code != -9 or not (out / "checkpoints").is_dir():
            raise RuntimeError(f"the run to damage did not end as planned: {r.describe()}")
        return out

    def replant(self, run: Path, rel: str, data: bytes) -> None:
        """Put `data` in `rel` of every checkpoint and record its size and sha256 in digests.json, as an attacker
        who read the format would: the digest check alone cannot tell."""
        for ckpt in sorted((run / "checkpoints").iterdir()):
            target = ckpt / rel
            target.write_bytes(data)
            digests = ckpt / "digests.json"
            rec = json.loads(digests.read_text())
            rec["files"][rel] = {"bytes": len(data), "sha256": sha256_file(target)}
            digests.write_text(json.dumps(rec))


def _set_tar_size(shard: Path, size: int) -> None:
    """Make the shard's first member claim `size` bytes (GNU base-256 for sizes past 8 GiB), with a valid header
    checksum, so tarfile believes it."""
    data = bytearray(shard.read_bytes())
    data[124:136] = b"\x80" + size.to_bytes(11, "big")
    data[148:156] = b" " * 8
    data[148:156] = b"%06o\0 " % sum(data[:512])
    shard.write_bytes(bytes(data))


def _rerecord(cache: Path) -> None:
    """The manifest made to agree with the shards' current bytes (an attacker's edit, or a buggy tool's)."""
    m = json.loads((cache / F.MANIFEST).read_text())
    for s in m["shards"]:
        p = cache / s["path"]
        s["bytes"], s["crc32c"] = p.stat().st_size, crc32c(p.read_bytes())
    (cache / F.MANIFEST).write_text(json.dumps(m))


def _no_abs_paths(root: Path, paths: list[str]) -> Callable[[Result], list[str]]:
    def check(r: Result) -> list[str]:
        found = []
        for p in root.rglob("*"):
            if p.is_file() and p.suffix in (".md", ".json", ".txt", ".py", ".toml", ".yaml"):
                text = p.read_text(errors="replace")
                found += [f"{p.relative_to(root)} holds {s}" for s in paths if s in text]
        return found
    return check


def _modes(root: Path, want: Callable[[int], bool], what: str, pattern: str = "*") -> Callable[[Result], list[str]]:
    def check(r: Result) -> list[str]:
        files = [p for p in root.rglob(pattern) if p.is_file()]
        bad = [f"{p.relative_to(root)} is {p.stat().st_mode & 0o777:o}" for p in files if not want(p.stat().st_mode)]
        return ([f"no file matches {pattern} below {root}"] if not files else []) + [f"{b} ({what})" for b in bad[:3]]
    return check


# -- the rows ---------------------------------------------------------------------------------------------------

def code_execution(h: Hostile) -> list[tuple[str, list[Case]]]:
    ws = h.ws
    fsdp = h.killed_run("fsdp-run", strategy="fsdp")
    h.replant(fsdp, "sharded/.metadata", h.payload())
    ddp = h.killed_run("ddp-run")
    import torch

    planted = h.path("optimizer.pt")
    torch.save({"state": {}, "param_groups": [_Payload(f"touch {h.marker}")]}, planted)
    h.replant(ddp, "optimizer.pt", planted.read_bytes())
    return [
        ("D1 pickled payload in an FSDP checkpoint's .metadata", [
            Case("train-student --strategy fsdp --resume", ws.train(fsdp, strategy="fsdp") + ["--resume"],
                 (".metadata",)),
        ]),
        ("D11 pickled payload in a ddp checkpoint's optimizer.pt", [
            Case("train-student --resume", ws.train(ddp) + ["--resume"], ("optimizer.pt",),
                 forbid=("weights_only=False",)),
        ]),
    ]


def locks_and_folders(h: Hostile) -> list[tuple[str, list[Case]]]:
    ws = h.ws
    thesis, bashrc = h.home / "thesis.tex", h.home / ".bashrc"
    # D2: a lock file that is a link to (or a hard link of) the victim's file
    c_link = h.killed_cache("lock-symlink")
    (c_link / F.LOCKS_DIR).mkdir(exist_ok=True)
    (c_link / F.LOCKS_DIR / "part-00000.lock").symlink_to(thesis)
    r_link = h.killed_run("run-lock-symlink")
    (r_link / "writer.lock").unlink(missing_ok=True)
    (r_link / "writer.lock").symlink_to(bashrc)
    r_hard = h.killed_run("run-lock-hardlink")
    (r_hard / "writer.lock").unlink(missing_ok=True)
    os.link(thesis, r_hard / "writer.lock")
    c_locks_dir = h.killed_cache("locks-dir-symlink")
    shutil.rmtree(c_locks_dir / F.LOCKS_DIR, ignore_errors=True)
    (h.home / "locks").mkdir()
    (c_locks_dir / F.LOCKS_DIR).symlink_to(h.home / "locks")
    # D3: a part folder that is a link to a folder of the victim's
    c_part = h.killed_cache("part-symlink")
    part0 = c_part / F.PARTS_DIR / "part-00000"
    shutil.move(part0, h.home / "part-copy")
    part0.symlink_to(h.home / "part-copy")
    c_part_ow = h.cache("part-symlink-overwrite")
    part0 = c_part_ow / F.PARTS_DIR / "part-00000"
    shutil.copytree(part0, h.home / "part-copy-2")
    shutil.rmtree(part0)
    part0.symlink_to(h.home / "part-copy-2")
    # D5: a FIFO where a lock file or the manifest belongs
    c_fifo_lock = h.cache("fifo-lock")
    (c_fifo_lock / F.LOCKS_DIR).mkdir(exist_ok=True)
    os.mkfifo(c_fifo_lock / F.LOCKS_DIR / "part-00000.lock")
    c_fifo_manifest = h.cache("fifo-manifest")
    (c_fifo_manifest / F.MANIFEST).unlink()
    os.mkfifo(c_fifo_manifest / F.MANIFEST)
    # D7: someone's folder that happens to hold offload/ and shards/
    foreign = h.path("not-a-cache")
    for sub in ("offload", "shards"):
        (foreign / sub).mkdir(parents=True)
        (foreign / sub / "results.csv").write_text("a,b\n1,2\n")
    run_fifo = h.path("run-fifo-lock")
    shutil.copytree(ws.ref_run, run_fifo, ignore=shutil.ignore_patterns("debug"))
    os.mkfifo(run_fifo / "writer.lock")
    run_fifo_metrics = h.path("run-fifo-metrics")  # what --out's check reads to tell a run of ours
    shutil.copytree(ws.ref_run, run_fifo_metrics, ignore=shutil.ignore_patterns("debug"))
    (run_fifo_metrics / "metrics.jsonl").unlink()
    os.mkfifo(run_fifo_metrics / "metrics.jsonl")
    fifo_cmds = lambda c: [  # noqa: E731
        ("cache info", ["cache", "info", c]), ("cache verify", ["cache", "verify", c]),
        ("train-student", ws.train(h.path("run"), cache=c, max_steps=2)),
        ("teacher-cache --dry-run", ws.stage_one(c) + ["--dry-run"])]
    return [
        ("D2 lock file linked to the user's file", [
            Case("cache lock a symlink (teacher-cache resume)", ws.stage_one(c_link), ("part-00000.lock",)),
            Case("run lock a symlink (train-student --resume)", ws.train(r_link) + ["--resume"], ("writer.lock",)),
            Case("run lock a hard link (train-student --resume)", ws.train(r_hard) + ["--resume"], ("writer.lock",)),
            Case("cache's locks/ a symlink (teacher-cache resume)", ws.stage_one(c_locks_dir), ("locks",)),
        ]),
        ("D3 part folder linked out of the cache", [
            Case("teacher-cache resume", ws.stage_one(c_part), ("part-00000",)),
            Case("teacher-cache --overwrite", ws.stage_one(c_part_ow) + ["--overwrite"], ("part-00000",),
                 expect="no-hang"),
        ]),
        ("D5 FIFO as a lock file or a run folder's record", [
            Case(f"{what}: locks/part-00000.lock", argv, expect="no-hang") for what, argv in fifo_cmds(c_fifo_lock)
        ] + [Case("train-student --resume: writer.lock", ws.train(run_fifo) + ["--resume"], ("writer.lock",)),
             Case("train-student --resume: metrics.jsonl", ws.train(run_fifo_metrics) + ["--resume"],
                  ("metrics.jsonl",))]),
        ("D5 FIFO as manifest.json", [
            Case(f"{what}: manifest.json", argv, (F.MANIFEST,)) for what, argv in fifo_cmds(c_fifo_manifest)
        ]),
        ("D7 --overwrite of a folder that is no cache", [
            Case("teacher-cache --overwrite", ws.stage_one(foreign) + ["--overwrite"], (str(foreign),),
                 protect=(foreign,)),
        ]),
    ]


def cache_readers(h: Hostile) -> list[tuple[str, list[Case]]]:
    ws = h.ws
    train = lambda c: ws.train(h.path("run"), cache=c, max_steps=2)  # noqa: E731
    # D4: a tar member that claims 10^15 bytes, the manifest re-recorded to match
    c_tar = h.cache("tar-huge-member")
    shard = c_tar / json.loads((c_tar / F.MANIFEST).read_text())["shards"][0]["path"]
    _set_tar_size(shard, 10**15)
    _rerecord(c_tar)
    # D6: a progress record claiming a billion parts
    c_parts = h.killed_cache("billion-parts")
    h.edit_json(c_parts / F.PARTS_DIR / "part-00000" / F.PROGRESS, lambda d: d.update(num_parts=10**9))
    # D10: manifest and progress fields of the wrong type or missing
    c_bytes = h.cache("manifest-bytes")
    h.edit_json(c_bytes / F.MANIFEST, lambda d: d["shards"][0].update({"bytes": "lots"}))
    c_samples = h.cache("manifest-samples")
    h.edit_json(c_samples / F.MANIFEST, lambda d: d.pop("samples"))
    c_prompts = h.cache("manifest-prompts")
    h.edit_json(c_prompts / F.MANIFEST, lambda d: d.update({"prompts": "235"}))
    c_done = h.killed_cache("progress-done-blocks")
    h.edit_json(c_done / F.PARTS_DIR / "part-00000" / F.PROGRESS, lambda d: d.update(done_blocks=5))
    # D14: a shard, shards/ and prompts.zarr that are links to copies outside the cache
    c_shard_link = h.cache("shard-symlink")
    first = sorted((c_shard_link / F.SHARDS_DIR).iterdir())[0]
    shutil.move(first, h.home / "stolen.tar")
    first.symlink_to(h.home / "stolen.tar")
    c_shards_link = h.cache("shards-symlink")
    shutil.move(c_shards_link / F.SHARDS_DIR, h.home / "shards-copy")
    (c_shards_link / F.SHARDS_DIR).symlink_to(h.home / "shards-copy")
    c_zarr_link = h.cache("zarr-symlink")
    store = c_zarr_link / F.PARTS_DIR / "part-00000" / F.PROMPTS_ZARR
    shutil.move(store, h.home / "prompts-copy.zarr")
    store.symlink_to(h.home / "prompts-copy.zarr")
    # D15: a progress record that lists a file of the victim's as one of its shards
    c_foreign = h.killed_cache("foreign-shard")
    thesis = h.home / "thesis.tex"
    h.edit_json(c_foreign / F.PARTS_DIR / "part-00000" / F.PROGRESS, lambda d: d["shards"].append(
        {"path": str(thesis), "part": 0, "samples": 4, "bytes": thesis.stat().st_size,
         "crc32c": crc32c(thesis.read_bytes()), "blocks": [d["blocks"] - 1]}) or d.update(
        done_blocks=list(range(d["blocks"]))))
    return [
        ("D4 tar member claiming 10^15 bytes", [Case("train-student", train(c_tar), (shard.name,))]),
        ("D6 progress record with num_parts 10^9", [
            Case("cache info", ["cache", "info", c_parts], ("num_parts",)),
            Case("teacher-cache resume", ws.stage_one(c_parts), ("num_parts",)),
        ]),
        ("D10 manifest and progress fields malformed", [
            Case("shard bytes a string: train-student", train(c_bytes), ("bytes",)),
            Case("shard bytes a string: cache info", ["cache", "info", c_bytes], ("bytes",)),
            Case("samples missing: train-student", train(c_samples), ("samples",)),
            Case("prompts a string: cache info", ["cache", "info", c_prompts], ("prompts",)),
            Case("done_blocks a number: teacher-cache resume", ws.stage_one(c_done), ("done_blocks",)),
            Case("done_blocks a number: cache info", ["cache", "info", c_done], ("done_blocks",)),
        ]),
        ("D14 links inside a cache pointing out of it", [
            Case("a shard: train-student", train(c_shard_link), (first.name,)),
            Case("shards/: train-student", train(c_shards_link), (F.SHARDS_DIR,)),
            Case("prompts.zarr: train-student", train(c_zarr_link), (F.PROMPTS_ZARR,)),
        ]),
        ("D15 progress record naming a file outside as a shard", [
            Case("teacher-cache resume", ws.stage_one(c_foreign), (str(thesis),), forbid=("cache complete",)),
        ]),
    ]


def user_inputs(h: Hostile) -> list[tuple[str, list[Case]]]:
    ws = h.ws

    def prompts(name: str, content: str | bytes) -> list:
        p = h.path(name)
        p.write_bytes(content if isinstance(content, bytes) else content.encode())
        return ["--prompts", p]

    new = lambda name: h.path(name)  # noqa: E731
    bad_map = h.path("map.json")
    bad_map.write_text("{transformer: cuda}")
    return [
        ("D9 a 10 MB prompt; --max-sequence-length 10^8", [
            Case("one 10 MB line", ws.stage_one(new("c")) + prompts("huge.txt", "a" * 10_000_000 + "\n"),
                 ("line 1",)),
            Case("--max-sequence-length 100000000", ws.stage_one(new("c"), max_sequence_length=100_000_000),
                 ("max-sequence-length",)),
        ]),
        ("D16 NUL, form feed and U+2028 in a prompt file", [
            Case("NUL-only line after a U+2028 line: the editor's line 2",
                 ws.stage_one(new("c")) + prompts("nul.txt", "a red circle\u2028on blue\n\x00\n"), ("line 2",)),
            Case("NUL-only line after a form-feed line: the editor's line 2",
                 ws.stage_one(new("c")) + prompts("ff.txt", "a red\fcircle\n\x00\n"), ("line 2",)),
        ]),
        ("D18 --num-workers 500", [
            Case("train-student", ws.train(new("run"), num_workers=500), ("num-workers",)),
        ]),
        ("D19 dry run of a device map that does not parse", [
            Case("teacher-cache --dry-run", ws.stage_one(new("c"), placement=bad_map) + ["--dry-run"],
                 ("not valid JSON",)),
        ]),
    ]


def artifacts(h: Hostile) -> list[tuple[str, list[Case]]]:
    ws = h.ws
    # D12: a LoRA run and its export; D13: a cache that names a Hub repo as its teacher
    lora = h.lora_run()
    lora_export = h.path("lora-export")
    c_hub = h.cache("teacher-hub-id")
    h.edit_json(c_hub / F.MANIFEST, lambda d: d.update(teacher="someone/evil-vae", teacher_path="someone/evil-vae"))
    # D17: a teacher whose files anyone may write
    loose = h.path("loose-teacher")
    shutil.copytree(ws.teacher, loose)
    for p in [loose, *loose.rglob("*")]:
        p.chmod(0o777 if p.is_dir() else 0o666)
    loose_export = h.path("loose-export")
    umask_export, umask_run = h.path("umask-export"), h.path("umask-run")
    not_world_writable = lambda m: not m & 0o002  # noqa: E731
    readable_by_group = lambda m: m & 0o777 == 0o644  # noqa: E731
    return [
        ("D12 absolute paths in a LoRA export", [
            Case("export of a LoRA run", ["export", "--student", lora, "--out", lora_export], expect="ok",
                 check=_no_abs_paths(lora_export, [str(ws.root), str(Path(ws.teacher).resolve())])),
        ]),
        ("D13 a cache choosing the Hub repo --val-decode fetches", [
            Case("train-student --val-decode", ws.train(h.path("run"), cache=c_hub, val_every=2, holdout_prompts=2)
                 + ["--val-decode"],
                 ("someone/evil-vae",), env=OFFLINE),
        ]),
        ("D17 export copying a world-writable teacher's modes", [
            Case("export", ["export", "--student", ws.ref_run, "--teacher", loose, "--out", loose_export],
                 expect="ok", check=_modes(loose_export, not_world_writable, "world-writable")),
        ]),
        ("safetensors written 0600 whatever the umask", [
            Case("export under umask 022", ["export", "--student", ws.ref_run, "--teacher", ws.teacher, "--out",
                                            umask_export], expect="ok", umask=0o022,
                 check=_modes(umask_export, readable_by_group, "not 644 under umask 022", "*.safetensors")),
            Case("train-student under umask 022", ws.train(umask_run, max_steps=3), expect="ok", umask=0o022,
                 check=_modes(umask_run, readable_by_group, "not 644 under umask 022", "*.safetensors")),
        ]),
    ]


def outs(h: Hostile) -> list[tuple[str, list[Case]]]:
    ws = h.ws
    project = h.home / "project"
    c = h.cache("out-cache")
    return [
        ("D8 train-student --out on someone's folder or on the cache", [
            Case("--out a folder with config.json and metrics.jsonl", ws.train(project), (str(project),)),
            Case("--out equal to --cache", ws.train(c, cache=c), ("--cache",), protect=(c,)),
            Case("--out inside --cache", ws.train(c / "student-run", cache=c), ("--cache",), protect=(c,)),
        ]),
    ]


def road(h: Hostile) -> list[tuple[str, list[Case]]]:
    """The steps two new users tripped on (issue 41, "The user's road"), where a command can show them."""
    ws = h.ws
    csv = h.path("prompts.csv")
    csv.write_text("prompt,seed\na red circle,1\n")
    finished = h.path("finished-run")
    shutil.copytree(ws.ref_run, finished, ignore=shutil.ignore_patterns("debug"))
    evald = h.path("road-evaluated")  # a finished run that `eval` then wrote its report and plot into
    shutil.copytree(ws.ref_run, evald, ignore=shutil.ignore_patterns("debug"))
    ws.must(run_cli(["eval", "--student", evald, "--cache", ws.ref_cache, "--max-prompts", "2",
                     "--no-teacher-timing"]))
    killed = h.killed_run("road-killed")
    lr, below = h.path("road-lr"), h.path("road-below")
    for copy in (lr, below):
        shutil.copytree(killed, copy)

    def untouched(run: Path) -> Callable[[Result], list[str]]:
        """Nothing trained again: the student's file is the one the run wrote (same inode, same mtime)."""
        weights = next((run / "student").glob("*.safetensors"))
        before = weights.stat()
        return lambda r: [] if weights.exists() and (weights.stat().st_ino, weights.stat().st_mtime_ns) == (
            before.st_ino, before.st_mtime_ns) else [f"{weights.relative_to(run)} was written again"]

    return [
        ("road: careless flags", [
            Case("plan --gpu-memory 80 (no unit)", ["plan", "--teacher", ws.teacher, "--gpu-memory", "80"], ("80",)),
            Case("plan --frames 80", ["plan", "--teacher", ws.teacher, "--frames", "80"], ("frames",)),
            Case("a .csv prompt file", ws.stage_one(h.path("c")) + ["--prompts", csv], (".csv",)),
            Case("--part 32 --num-parts 32 names no TOML", ws.stage_one(h.path("c"), part=32, num_parts=32),
                 ("--part",), forbid=(".toml",)),
            Case("dry run of a Hub id that does not exist", ws.stage_one(h.path("c")) + [
                "--teacher", "no-such-org/no-such-model", "--dry-run"], ("no-such-org/no-such-model",), env=OFFLINE),
        ]),
        ("road: resume", [
            Case("--resume of a finished run is a no-op", ws.train(finished) + ["--resume"], expect="ok",
                 check=untouched(finished)),
            Case("--resume after eval wrote eval.json and eval.png into the run", ws.train(evald) + ["--resume"],
                 expect="ok", check=untouched(evald)),
            Case("--resume with another --lr", ws.train(lr, lr=5e-4) + ["--resume"], ("--lr",), protect=(lr,)),
            Case("--resume --max-steps below the checkpoint", ws.train(below, max_steps=2) + ["--resume"],
                 ("--max-steps",), protect=(below,)),
        ]),
    ]


GROUPS = (code_execution, locks_and_folders, cache_readers, outs, user_inputs, artifacts, road)


def _digest(h: Hostile, root: Path) -> str:
    """tree_digest of `root`; of an input, less its writers' lock files: a lock file only records its last holder, and
    a refused writer may take the lock (rewriting a dead holder's record) and remove it on its way out. The victim's
    folder is hashed whole: a lock file appearing in it is what a linked locks/ would do."""
    return tree_digest(root) if root == h.home else tree_digest(root, skip="*.lock")


def _attempt(h: Hostile, row: Row, case: Case) -> None:
    protected = [h.home, *case.protect]
    before = {p: _digest(h, p) for p in protected}
    r = run_cli(case.argv, env=case.env, timeout_s=HANG_S, umask=case.umask, mem=case.mem)
    said = r.error_lines
    problems = []
    if r.code is None:
        problems.append(f"hung: still running after {HANG_S:.0f}s")
    elif case.expect == "ok" or (case.expect == "no-hang" and r.code == 0):
        if r.code != 0:
            problems.append(f"exit {r.code}, expected 0")
    else:
        if r.code != 2:
            problems.append(f"exit {r.code}, expected 2")
        if len(said) != 1:
            problems.append(f"{len(said)} error lines, expected one")
        elif missing := [n for n in case.needles if n not in said[0]]:
            problems.append(f"the error line lacks {missing}")
    if "Traceback" in r.out + r.err:
        problems.append("a traceback was printed")
    if h.marker.exists():
        problems.append("the planted payload ran")
        h.marker.unlink()
    problems += [f"printed {w!r}" for w in case.forbid if w in r.out + r.err]
    problems += [f"changed {p}" for p in protected if _digest(h, p) != before[p]]
    if case.check is not None and r.code is not None:
        problems += case.check(r)
    row.notes.append(f"{case.what}: exit {r.code}, {r.wall_s:.1f}s: {said[0] if said else '(no error line)'}")
    if problems:
        problems.append(r.describe())
    row.record(case.what, problems)


def hostile_inputs(ws: Workspace, groups=GROUPS) -> list[Row]:
    h = Hostile(ws)
    rows = []
    for group in groups:
        t0 = time.perf_counter()
        built = group(h)
        share = (time.perf_counter() - t0) / len(built)  # what building the inputs cost, spread over the rows
        for fault, cases in built:
            row = Row(f"hostile: {fault}", min_attempts=len(cases))
            t = time.perf_counter()
            for case in cases:
                _attempt(h, row, case)
            row.wall_s = time.perf_counter() - t + share
            rows.append(row)
    return rows
