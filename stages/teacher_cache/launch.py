"""How stage one uses the machine `plan` is told about, and its command (docs/architecture.md, on `plan`)."""

from __future__ import annotations

import shlex
from dataclasses import asdict, dataclass, field

from pipeline.errors import UserError

from . import placements

HEAD_PORT = 29500
WIDTH = 112  # where printed commands wrap (shell continuation lines)
# What the printed command's --prompts (--images: IMAGES) and --out say: the user's to choose.
PLACEHOLDERS = {"prompts": "PROMPTS.txt", "out": "CACHE_DIR"}
IMAGES = "IMAGES.tsv"


@dataclass
class Launch:
    placement: str
    nodes: int
    ranks_per_node: int
    gpus_per_rank: int  # GPUs one process holds: 1, a node's under a spreading placement, 0 on the CPU
    how: str
    commands: list[dict] = field(default_factory=list)  # {"when": what it is for, "command": the shell line}

    @property
    def parts(self) -> int:
        return self.nodes * self.ranks_per_node

    def to_dict(self) -> dict:
        return asdict(self) | {"parts": self.parts}


def plan_launch(placement: str, nodes: int, gpus_per_node: int, ranks_given: int | None,
                teacher_cache: list[str]) -> Launch:
    """The processes of stage one for the concrete `placement` on `nodes` nodes, and their commands."""
    caps = placements.get(placement).caps
    if caps.spreads:
        ranks, gpus = 1, gpus_per_node
        how = (f"one process per node spreads its replica over the node's {gpus_per_node} GPUs (one GPU computes at a "
               "time: a replica fits no single GPU)")
    elif caps.gpu == "no" or not gpus_per_node:
        ranks, gpus = ranks_given or 1, 0
        how = f"{ranks} process{'es' if ranks > 1 else ''} per node on the CPU"
    else:
        ranks = ranks_given or (gpus_per_node if caps.replica_per_gpu else 1)
        if ranks > gpus_per_node:
            raise UserError(f"--ranks-per-node {ranks} is more than the {gpus_per_node} GPU(s) of a node: each rank of "
                            f"placement {placement} computes on its own GPU; use at most {gpus_per_node}")
        gpus = 1
        how = ("the replica on the node's one GPU" if gpus_per_node == 1 else
               "one replica per GPU, all computing at once" if ranks == gpus_per_node else
               f"{ranks} of the {gpus_per_node} GPUs of a node, one process each")
    launch = Launch(placement, nodes, ranks, gpus, how)
    launch.commands = _commands(launch, teacher_cache)
    return launch


def _commands(launch: Launch, words: list[str]) -> list[dict]:
    """{"when": what it is for, "argv": the words, "command": them as a shell line} for each way to run it."""
    n, r, parts = launch.nodes, launch.ranks_per_node, launch.parts
    array = words + ["--part", "$SLURM_ARRAY_TASK_ID", "--num-parts", str(parts)]
    if parts == 1:
        found = [("one process", words)]
    elif n == 1:
        found = [(f"torchrun, one rank per part ({parts} parts)",
                  ["torchrun", "--standalone", "--nproc-per-node", str(r), "--no-python"] + words)]
    elif r == 1:
        what = "one part per node" + (" (whole nodes: --nodes 1 --exclusive)" if launch.gpus_per_rank > 1 else "")
        found = [(f"{what}, parts 0..{parts - 1}, e.g. a SLURM array --array=0-{parts - 1}", array)]
    else:
        run = ["torchrun", "--nnodes", str(n), "--nproc-per-node", str(r), "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"$HEAD_HOST:{HEAD_PORT}", "--rdzv-id", "teacher-cache", "--no-python"] + words
        found = [("the same command on every node (HEAD_HOST: the first node's address; --out on storage every node "
                  "sees)", run),
                 (f"or one part per SLURM array task, --array=0-{parts - 1} with {launch.gpus_per_rank or 'no'} GPU "
                  "each (a failed task is rerun alone)", array)]
    return [{"when": when, "argv": argv, "command": _line(argv)} for when, argv in found]


def _line(words: list[str]) -> str:
    """Shell words joined ($VARS unquoted), wrapped with backslashes before WIDTH, never inside a flag and value."""
    tokens: list[str] = []
    for w in (w if w.startswith("$") else shlex.quote(w) for w in words):
        if tokens and not w.startswith("-") and tokens[-1].startswith("-") and " " not in tokens[-1]:
            tokens[-1] += " " + w
        else:
            tokens.append(w)
    lines, cur = [], ""
    for t in tokens:
        if cur and len(cur) + 1 + len(t) > WIDTH - 2:
            lines.append(cur)
            cur = "    " + t
        else:
            cur = f"{cur} {t}" if cur else t
    return " \\\n".join(lines + [cur])


def render(launch: Launch) -> list[str]:
    n, r, parts = launch.nodes, launch.ranks_per_node, launch.parts
    lines = [f"stage one   {parts} process{'es' if parts > 1 else ''} ({n} node{'s' if n > 1 else ''} x {r} "
             f"rank{'s' if r > 1 else ''}), placement {launch.placement}: {launch.how}"
             + (f"; each is one part, prompt i goes to part i % {parts}" if parts > 1 else "")]
    for c in launch.commands:
        lines.append(f"  {c['when']}:")
        lines += ["    " + line for line in c["command"].splitlines()]
    return lines


def teacher_cache_words(teacher: str, revision: str | None, placement: str, given: dict,
                        out: str | None = None, images: bool = False) -> list[str]:
    """`wandistiller teacher-cache` with placeholders (or plan's --out; an image-to-video teacher's --images), the
    placement and the settings `plan` was given."""
    words = ["wandistiller", "teacher-cache", "--teacher", teacher]
    if revision:
        words += ["--revision", revision]
    named = ({"images": IMAGES} if images else {"prompts": PLACEHOLDERS["prompts"]}) | {
        "out": out or PLACEHOLDERS["out"]}
    words += [w for name, value in named.items() for w in (f"--{name}", value)] + ["--placement", placement]
    for flag, value in given.items():  # a switch: value None
        words += [flag] if value is None else [flag, str(value)]
    return words


def stage_two_words(teacher: str, revision: str | None, cache: str | None, schedule: dict, epochs: int,
                    checkpointing: bool, student_config: str | None, experts: int, gpus: int,
                    video: bool = False) -> list[dict]:
    """Stage two's commands for the cache `plan` prints: a segment student of `schedule` (its train-student flags)
    trained from CACHE_DIR (or plan's --out), a LoRA of the teacher as one run per expert (each on the node's GPUs)
    and one export of the pair; or --student-config's compact student. A `video` cache's sample is thousands of
    tokens: batch 1 a GPU (docs/lora.md's memory arithmetic; the dry run measures it)."""
    base = ["wandistiller", "train-student", "--cache", cache or PLACEHOLDERS["out"]]
    run = ["--objective", "segment", *(w for k, v in schedule.items() for w in (k, v)), "--mixed-precision", "bf16",
           "--epochs", str(epochs)] + (["--gradient-checkpointing"] if checkpointing else []) + \
        (["--batch-size", "1"] if video else [])
    head = ["torchrun", "--standalone", "--nproc-per-node", str(gpus), "--no-python"] if gpus > 1 else []
    if student_config is not None or experts < 2:
        kind = ["--student-config", student_config] if student_config else \
            ["--lora-of", teacher, *(["--revision", revision] if revision else []), "--lora-rank", "16"]
        argv = head + base + kind + run + ["--out", "RUN"]
        return [{"when": "the student (--dry-run first: memory and time on the GPU)", "argv": argv,
                 "command": _line(argv)},
                {"when": "its export", "argv": (e := ["wandistiller", "export", "--student", "RUN", "--out", "EXPORT"]),
                 "command": _line(e)}]
    lora = ["--lora-of", teacher, *(["--revision", revision] if revision else []), "--lora-rank", "16"]
    out = [{"when": f"expert {e}'s LoRA, one run each (--dry-run first: memory and time on the GPU)",
            "argv": (argv := head + base + lora + ["--lora-experts", str(e)] + run + ["--out", f"RUN_{e}"]),
            "command": _line(argv)} for e in (1, 2)]
    pair = ["wandistiller", "export", "--student", "RUN_1", "--student", "RUN_2", "--out", "EXPORT"]
    return out + [{"when": "one export of the pair (add --lora-format wan for ComfyUI's key names)", "argv": pair,
                   "command": _line(pair)}]
