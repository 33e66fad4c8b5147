"""What `wandistiller plan` prints, from configs alone (docs/architecture.md, "What `plan` says about a run")."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from types import SimpleNamespace

import torch

from cache.records import CacheHeader
from cache.schema import recorded_steps
from cache.size import human, project
from pipeline.cache_status import frames_words
from pipeline.config import PlanSettings, RunShape, TeacherCacheConfig, TeacherRun
from pipeline.registries import CHOSEN, StudentSchedule
from pipeline.sampling import chosen_boundaries, segment_boundaries
from pipeline.errors import UserError
from pipeline.hub import CONFIGS, teacher_folder
from pipeline.settings import name_of

from . import costs, launch, placements
from .placements.device_map import parse_max_memory, read_device_map
from .placement_choice import (
    DTYPE_BYTES, FitsNowhere, Inventory, Needs, activation_bytes, decide, gib, machines_that_fit,
    teacher_sizes, tokens_per_sample,
)
from .teacher import TeacherSpec, configs_spec, load_scheduler
from .trajectory import Schedule

VAE_WHERE = "not loaded in stage one (the cache holds latents)"
NO_STEP_TIME = ("no measured step time for this teacher and placement: run `plan --measure` on the machine that "
                "will run it, or give --step-time SECONDS")


@dataclass
class Plan:
    teacher: str
    dtype: str
    batch_size: int
    height: int
    width: int
    frames: int
    tokens_per_sample: int
    inventory: dict
    requested: str
    placement: str
    expert_order: str
    components: list[dict]
    activations_bytes: int
    resident_bytes: dict[str, int]
    streamed_bytes_per_step: int
    decision: list[str]
    notes: list[str]
    cache: dict | None = field(default=None)  # the cache's projected bytes (`cache_projection`)
    launch: dict | None = field(default=None)  # the processes of stage one and their commands (launch.py)
    time: dict | None = field(default=None)  # stage one's GPU-hours and wall time (costs.py), with --prompts
    source: str | None = field(default=None)  # where a Hub id's configs were found
    latent_frames: int | None = field(default=None)  # a video run's (frames > 1), through the teacher's VAE

    def to_json(self) -> str:
        out = asdict(self)
        if self.latent_frames is None:  # an image run's JSON as it was
            del out["latent_frames"]
        return json.dumps(out, indent=2)

    def render(self) -> str:
        nodes = self.launch["nodes"] if self.launch else 1
        tokens = f"{self.tokens_per_sample} tokens per sample, CFG doubles the forward batch"
        clip = frames_words(vars(self), ", ")  # a video run's frames; an image run's line as it was
        size = f"{self.height}x{self.width}" + (f"{clip}, {tokens}" if clip else f"x{self.frames} ({tokens})")
        lines = [f"teacher     {self.teacher}" + (f" ({self.source})" if self.source else ""),
                 f"run         dtype {self.dtype}, batch {self.batch_size} x {size}",
                 f"machine     {f'{nodes} nodes, each: ' if nodes > 1 else ''}{self.inventory['describe']}",
                 f"placement   {self.placement} ({self.expert_order}-major order)"
                 + (", picked by auto" if self.requested == "auto" else ""),
                 "",
                 f"{'component':<14}{'class':<24}{'params':>16}{'bytes':>13}   where"]
        for c in self.components:
            lines.append(f"{c['name']:<14}{c['class']:<24}{c['params']:>16,}{gib(c['bytes']):>13}   {c['where']}")
            if c.get("checkpoint_bytes") is not None:
                lines.append(f"{'':<14}{'checkpoint on disk':<24}{'':>16}{gib(c['checkpoint_bytes']):>13}   "
                             f"{c['checkpoint_dtype']}")
        lines += ["",
                  f"activations (estimate, batch {self.batch_size}): {gib(self.activations_bytes)}",
                  "resident during the trajectory loop: "
                  + ("; ".join(f"{d} {gib(b)}" for d, b in self.resident_bytes.items()) or "-"),
                  f"streamed per denoising step: {gib(self.streamed_bytes_per_step)}"
                  + (" (the active expert's weights)" if self.streamed_bytes_per_step else " (weights resident)"),
                  "", "decision:"] + [f"  - {r}" for r in self.decision]
        if self.notes:
            lines += ["notes:"] + [f"  - {n}" for n in self.notes]
        if self.launch:
            lines += ["", *launch.render(launch.Launch(**{k: v for k, v in self.launch.items() if k != "parts"}))]
        if self.cache:
            lines += ["", _render_cache(self.cache)]
        if self.time:
            lines += costs.render(self.time, self.cache["prompts"], self.cache["seeds_per_prompt"],
                                  self.cache["steps"])
        elif self.cache and self.cache["prompts"]:
            lines.append(f"time        {NO_STEP_TIME}")
        return "\n".join(lines)


def make_plan(teacher: str, placement: str = "auto", shape: RunShape = RunShape(), inventory: Inventory | None = None,
              max_memory: dict | None = None, device_map: dict | None = None, expert_order: str = "auto") -> Plan:
    """Sizes, layout and (for auto) the decision for running `teacher` with `placement` on `inventory`."""
    inv = inventory or Inventory.measure()
    entry = placements.get(placement)
    gpu_exec = any(isinstance(v, int) for v in device_map.values()) if device_map is not None \
        else bool(inv.gpus) and entry.caps.gpu != "no"
    shape = replace(shape, dtype=shape.dtype or ("bfloat16" if gpu_exec else "float32"))
    sizes = teacher_sizes(teacher, shape.dtype)
    needs = Needs.of(sizes, activation_bytes(sizes, shape))
    notes: list[str] = []
    if entry.caps.picks:
        try:
            d = decide(needs, inv)
        except FitsNowhere as e:  # the figures, so the user sees how far off each machine is
            raise NoPlacement(e.line, _nowhere(teacher, shape, inv)) from e
        entry, order, why = placements.get(d.placement), d.expert_order, d.reasons
    else:
        order, why = entry.expert_order(needs, inv), [f"placement {placement} requested"]
        if entry.caps.gpu == "required" and not inv.gpus:
            notes.append(f"{entry.name} needs a CUDA GPU and this inventory has none: it would stop with an error")
    if len(sizes.experts) < 2 or expert_order in ("step", "expert"):
        order = expert_order if len(sizes.experts) > 1 else "step"
    layout = entry.layout(placements.PlanInput(sizes, needs, inv, order, max_memory, device_map))
    where = layout.where | {"vae": VAE_WHERE}
    notes += layout.notes + _encoder_notes(needs, inv, where["text_encoder"])
    comps = [{"name": name, "class": c.cls, "params": c.params, "bytes": c.bytes, "where": where[name],
              "blocks": c.blocks, "block_bytes": c.block_bytes, "checkpoint_bytes": c.checkpoint_bytes,
              "checkpoint_dtype": c.checkpoint_dtype}
             for name in ("text_encoder", *sizes.experts, "vae") if (c := sizes.components.get(name)) is not None]
    return Plan(teacher, shape.dtype, shape.batch_size, shape.height, shape.width, shape.frames,
                tokens_per_sample(sizes, shape.height, shape.width, shape.frames),
                asdict(inv) | {"describe": inv.describe()}, placement, placement if entry.caps.json_map else entry.name,
                order, comps, needs.activations, layout.resident, layout.streamed, why, notes)


class NoPlacement(UserError):
    """`plan` where the teacher fits nowhere: the error line and the figures (`_nowhere`), or them as JSON."""

    def __init__(self, line: str, report: dict):
        self.line, self.report = line, report
        super().__init__(f"{line}\n{_render_nowhere(report)}")

    def to_json(self) -> str:
        return json.dumps({"fits": False, "error": self.line, **self.report}, indent=2)


def _nowhere(teacher: str, shape: RunShape, inv: Inventory) -> dict:
    """Each component's parameters and bytes at each dtype, the activations, and per dtype the least machines."""
    dtypes = list(dict.fromkeys([shape.dtype, *(d for d in DTYPE_BYTES if d != "float16")]))  # fp16 weighs as bf16
    sizes = {d: teacher_sizes(teacher, d) for d in dtypes}
    acts = {d: activation_bytes(sizes[d], shape) for d in dtypes}
    first = sizes[shape.dtype]
    return {"dtype": shape.dtype, "batch_size": shape.batch_size, "height": shape.height, "width": shape.width,
            "frames": shape.frames,
            "components": [{"name": n, "class": c.cls, "params": c.params,
                            "bytes": {d: sizes[d].components[n].bytes for d in dtypes}}
                           for n in ("text_encoder", *first.experts) if (c := first.components.get(n)) is not None],
            "activations_bytes": acts,
            "would_fit": {d: machines_that_fit(Needs.of(sizes[d], acts[d]), inv.ranks_per_node) for d in dtypes}}


def _render_nowhere(r: dict) -> str:
    """`_nowhere`'s figures as the lines `plan` prints under the error line."""
    dtypes = list(r["activations_bytes"])
    lines = [f"  {'component':<14}{'class':<24}{'params':>16}" + "".join(f"{d:>12}" for d in dtypes)]
    for c in r["components"]:
        lines.append(f"  {c['name']:<14}{c['class']:<24}{c['params']:>16,}"
                     + "".join(f"{gib(c['bytes'][d]):>12}" for d in dtypes))
    act = f"activations (batch {r['batch_size']}, {r['height']}x{r['width']}x{r['frames']})"
    lines.append(f"  {act:<54}" + "".join(f"{gib(r['activations_bytes'][d]):>12}" for d in dtypes))
    for d in dtypes:
        lines.append(f"  would fit at {d}{' (this run)' if d == r['dtype'] else ''}, any one of:")
        lines += [f"    - {m}" for m in r["would_fit"][d]]
    return "\n".join(lines)


def _encoder_notes(needs: Needs, inv: Inventory, where: str) -> list[str]:
    """The text encoder runs alone before the transformers load: does it fit where the placement puts it?"""
    enc = needs.text_encoder
    if enc and where.startswith("cuda") and inv.gpus and enc > inv.usable_gpu(0):
        return [f"the text encoder ({gib(enc)}) does not fit cuda:0 ({gib(inv.usable_gpu(0))} usable) for the "
                "encoding pass; use --placement offload (model offload) or a bigger GPU"]
    if enc and where.startswith("cpu") and enc > inv.usable_ram:
        return [f"the text encoder ({gib(enc)}) does not fit in RAM ({gib(inv.usable_ram)} usable) for the "
                "encoding pass; use --dtype bfloat16 or a machine with more RAM"]
    return []


_NAMED = ("teacher", "revision", "placement")  # in the printed command's first words


def plan_from_flags(settings: PlanSettings, cfg: TeacherCacheConfig, *, given: tuple[str, ...] = (),
                    config_file: str | None = None) -> Plan:
    """`wandistiller plan`: the plan, stage one's processes and command, the cache's bytes, GPU-hours and wall time."""
    teacher, revision, placement = cfg.teacher, cfg.revision, cfg.placement
    root = teacher_folder(teacher, revision, files=CONFIGS)  # a Hub id: its configs alone
    inv = _inventory(settings, cfg.offload_dir)
    assumed_gpus = any(v is not None for v in (settings.assume_gpus, settings.gpus_per_node, settings.gpu_memory))
    dmap = read_device_map(placement, check_devices=not assumed_gpus)[0] \
        if placements.get(placement).caps.json_map else None
    plan = make_plan(str(root), placement, cfg, inventory=inv, max_memory=parse_max_memory(cfg.max_memory),
                     device_map=dmap, expert_order=cfg.expert_order)
    # teacher-cache's own check of the sizes (frames 1 or 4k+1, VAE and patch multiples, the rotary table), so that
    # plan does not print a command the run refuses
    spec = configs_spec(root, teacher)
    spec.check_sizes(cfg.height, cfg.width, cfg.frames)
    if cfg.frames > 1:
        plan.latent_frames = spec.latent_shape(cfg.height, cfg.width, cfg.frames)[1]
    if (keep := _student_keep(settings, spec, cfg)) is not None:
        cfg, given = replace(cfg, keep_steps=keep), (*given, "keep_steps")
    if root != Path(teacher).expanduser():  # a Hub id
        plan.teacher, plan.source = teacher, f"revision {revision or 'main'}, configs from {root}"
    plan.cache = cache_projection(spec, replace(cfg, dtype=plan.dtype), settings.prompts)
    flags = {"--config": config_file} if config_file else {}
    for f in fields(TeacherRun):
        value = getattr(cfg, f.name)
        if f.name in given and f.name not in _NAMED and (config_file or value != f.default):
            flags |= _flag(f, value)
    words = launch.teacher_cache_words(teacher, revision, plan.placement, flags)
    plan.launch = launch.plan_launch(plan.placement, settings.nodes, len(inv.gpus), settings.ranks_per_node,
                                     words).to_dict()
    if settings.step_time is not None:
        step = costs.StepTime(settings.step_time, "--step-time")
    elif settings.measure:  # one step measured here
        step = costs.measure_step(cfg, plan.placement)
    else:  # the table's figure for the teacher's shape
        step = costs.table_step_time(spec.transformer_config, plan.tokens_per_sample, plan.placement,
                                     cfg.max_sequence_length)
    if step is not None and settings.prompts:
        plan.time = costs.project(settings.prompts, cfg.seeds_per_prompt, cfg.steps, step,
                                  plan.launch["parts"], plan.launch["gpus_per_rank"])
    return plan


def _student_keep(s: PlanSettings, spec: TeacherSpec, cfg: TeacherCacheConfig) -> tuple[int, ...] | None:
    """--keep-steps with the boundaries of the segment student `s` describes (None: no student, or every step)."""
    choice = {f.name: getattr(s, f.name) for f in fields(StudentSchedule)}
    if cfg.record_steps is None or all(v is None for v in choice.values()):
        return None
    sched = load_scheduler(spec)
    sc = Schedule.build(sched, cfg.steps, spec.boundary_ratio, cfg.guidance, cfg.guidance_2)
    try:
        bounds = (chosen_boundaries(SimpleNamespace(steps=cfg.steps, **asdict(sc)), choice, range(cfg.steps))
                  if any(choice[c] is not None for c in CHOSEN) else segment_boundaries(
                      {"_class_name": type(sched).__name__, **sched.config}, cfg.steps, s.student_steps, sc.sigmas)[0])
    except ValueError as e:
        raise UserError(f"plan: {e}") from None
    return tuple(sorted({*(cfg.keep_steps or ()), *bounds} - {0})) or None


def _flag(f, value) -> dict:
    """{flag: value} of a setting as the printed command gives it (a switch alone: value None)."""
    if isinstance(value, bool):
        on, _, off = (f.metadata.get("flag") or name_of(f)).partition("/")
        return {f"--{on}" if value else f"--{off or 'no-' + on}": None}
    return {f"--{name_of(f)}": ",".join(map(str, value)) if isinstance(value, tuple) else value}


def _inventory(s: PlanSettings, offload_dir: str | None) -> Inventory:
    """A node of the machine `plan` is told about; what is not given is measured here."""
    gpus = s.assume_gpus
    if s.gpus_per_node is not None or s.gpu_memory is not None:
        count = s.gpus_per_node if s.gpus_per_node is not None else (torch.cuda.device_count() or 1)
        memory = s.gpu_memory
        if memory is None and count:
            if not torch.cuda.is_available():
                raise UserError(f"--gpus-per-node {count} takes the memory of this machine's GPUs, and it has none; "
                                "give --gpu-memory too (e.g. 80GiB)")
            memory = f"{torch.cuda.mem_get_info(0)[0]}B"
        gpus = f"{count}x{memory}" if count else "none"
    ranks = s.ranks_per_node or 1
    measured = Inventory.measure(offload_dir, ranks, gpus=gpus is None)
    return Inventory.assume(gpus, s.assume_ram, s.assume_disk, ranks, measured)


def cache_projection(spec: TeacherSpec, cfg: TeacherCacheConfig, prompts: int | None) -> dict:
    """The bytes of the cache `cfg` would write (`cache.size` over the header stage one would record,
    `CacheHeader.planned`: every sample field its settings turn on), per sample and per prompt, and for `prompts`
    prompts when given; each embedding is taken at max_sequence_length tokens, the bound (only a prompt's real
    tokens are stored)."""
    scheduler = load_scheduler(spec)
    schedule = Schedule.build(scheduler, cfg.steps, spec.boundary_ratio, cfg.guidance, cfg.guidance_2)
    # plan reads no prompt file (no prompt-set hash) and the teacher's configs alone (its identity without weights)
    header = CacheHeader.planned(cfg, spec, scheduler, schedule, dtype=cfg.dtype, prompts=prompts or 1,
                                 prompt_set_sha256="", identity=spec.identity())
    size = project(header, prompts or 1, batch_size=cfg.batch_size, samples_per_shard=cfg.samples_per_shard)
    recorded = len(recorded_steps(header))
    per_prompt = cfg.seeds_per_prompt * recorded * size.sample_bytes + size.prompt_bytes
    return {"steps": cfg.steps, "recorded_steps": recorded, "seeds_per_prompt": cfg.seeds_per_prompt,
            "max_sequence_length": cfg.max_sequence_length,
            "sample_bytes": size.sample_bytes, "prompt_store_bytes": round(size.prompt_bytes),
            "bytes_per_prompt": round(per_prompt), "prompts": prompts,
            "total_bytes": size.total if prompts else None}


def _render_cache(c: dict) -> str:
    head = (f"cache       {human(c['sample_bytes'])} per sample x {c['recorded_steps']} of {c['steps']} steps x "
            f"{c['seeds_per_prompt']} seed(s) + {human(c['prompt_store_bytes'])} of prompt store (noise, final latent, "
            f"the embedding at all {c['max_sequence_length']} tokens: at most) = {human(c['bytes_per_prompt'])} per "
            "prompt")
    return head + (f"; {c['prompts']:,} prompts: {human(c['total_bytes'])}" if c["prompts"] else
                   " (--prompts N: the total)")
