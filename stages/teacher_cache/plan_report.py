"""What `wandistiller plan` prints, from configs alone (docs/architecture.md, "What `plan` says about a run")."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import torch

from cache.records import CacheHeader
from cache.schema import recorded_steps
from cache.size import human, project
from pipeline.cache_status import frames_words
from pipeline.config import PlanSettings, RunShape, TeacherCacheConfig, TeacherRun
from pipeline.registries import StudentSchedule, grid_choice
from pipeline.sampling import student_grid
from pipeline import flops
from pipeline.errors import UserError
from pipeline.hub import CONFIGS, teacher_folder
from pipeline.settings import name_of

from . import costs, launch, outdir, placement_choice, placements, student_grids
from .part_plan import one_frame_note
from .placements.device_map import parse_max_memory, read_device_map
from .placement_choice import (
    DTYPE_BYTES, FitsNowhere, Inventory, Needs, activation_bytes, decide, gib, machines_that_fit,
    teacher_sizes, tokens_per_sample,
)
from .teacher import TeacherSpec, configs_spec, load_scheduler
from .trajectory import Schedule

VAE_WHERE = "not loaded in stage one (the cache holds latents)"
VAE_I2V = "float32 in stage one, encoding each image before the transformers load, then freed"
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
    students: list[dict] | None = field(default=None)  # --for-students: each grid's boundaries (student_grids.py)
    unfit: list[str] | None = field(default=None)  # why the layout (or the cache) does not fit: no command printed
    train: dict | None = field(default=None)  # stage two's GPU-hours and wall time (costs.train_projection)

    def to_json(self) -> str:
        out = asdict(self)
        if self.latent_frames is None:  # an image run's JSON as it was
            del out["latent_frames"]
        if self.students is None:
            del out["students"]
        if self.unfit is None:  # (a plan that fits: its JSON as it was)
            del out["unfit"]
        if self.train is None:
            del out["train"]
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
        if self.unfit:
            lines += ["", "stage one   no command: " + "; ".join(self.unfit)]
        elif self.launch:
            lines += ["", *launch.render(launch.Launch(**{k: v for k, v in self.launch.items() if k != "parts"}))]
        if self.cache:
            lines += ["", _render_cache(self.cache), _render_disk(self.cache)]
        if self.students:
            width = max(len(g["spec"]) for g in self.students)
            lines += [f"{'students' if i == 0 else '':<12}{g['spec']:<{width}}  {g['line']}"
                      for i, g in enumerate(self.students)]
        if self.time:
            lines += costs.render(self.time, self.cache["prompts"], self.cache["seeds_per_prompt"],
                                  self.cache["steps"])
        elif self.cache and self.cache["prompts"]:
            lines.append(f"time        {NO_STEP_TIME}")
        if self.train:
            lines += costs.render_train(self.train)
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
    needs = Needs.of(sizes, activation_bytes(sizes, shape), shape.batch_size)
    notes: list[str] = []
    if entry.caps.picks:
        try:
            d = decide(needs, inv, smaller_batches=True)
        except FitsNowhere as e:  # the figures, so the user sees how far off each machine is
            raise NoPlacement(e.line, _nowhere(teacher, shape, inv)) from e
        entry, order, why = placements.get(d.placement), d.expert_order, d.reasons
        if d.batch_size is not None:  # a smaller batch fits where the one asked for does not (or only streamed)
            shape = replace(shape, batch_size=d.batch_size)
            needs = Needs.of(sizes, activation_bytes(sizes, shape), shape.batch_size)
    else:
        order, why = entry.expert_order(needs, inv), [f"placement {placement} requested"]
        if entry.caps.gpu == "required" and not inv.gpus:
            notes.append(f"{entry.name} needs a CUDA GPU and this inventory has none: it would stop with an error")
    if len(sizes.experts) < 2 or expert_order in ("step", "expert"):
        order = expert_order if len(sizes.experts) > 1 else "step"
    layout = entry.layout(placements.PlanInput(sizes, needs, inv, order, max_memory, device_map))
    where = layout.where | {"vae": VAE_WHERE}
    encoder = _encoder_notes(needs, inv, where["text_encoder"])
    notes += layout.notes + encoder
    unfit = _misfits(layout.resident, inv) + encoder
    if unfit:
        unfit[0] = f"placement {entry.name} at batch {shape.batch_size}: {unfit[0]}; " + _what_fits(
            entry, placements.PlanInput(sizes, needs, inv, order, max_memory, device_map))
    comps = [{"name": name, "class": c.cls, "params": c.params, "bytes": c.bytes, "where": where[name],
              "blocks": c.blocks, "block_bytes": c.block_bytes, "checkpoint_bytes": c.checkpoint_bytes,
              "checkpoint_dtype": c.checkpoint_dtype}
             for name in ("text_encoder", *sizes.experts, "vae") if (c := sizes.components.get(name)) is not None]
    return Plan(teacher, shape.dtype, shape.batch_size, shape.height, shape.width, shape.frames,
                tokens_per_sample(sizes, shape.height, shape.width, shape.frames),
                asdict(inv) | {"describe": inv.describe()}, placement, placement if entry.caps.json_map else entry.name,
                order, comps, needs.activations, layout.resident, layout.streamed, why, notes, unfit=unfit or None)


class NoPlacement(UserError):
    """`plan` where the teacher fits nowhere: the error line and the figures (`_nowhere`), or them as JSON."""

    def __init__(self, line: str, report: dict):
        self.line, self.report = line, report
        super().__init__(f"{line}\n{_render_nowhere(report)}")

    def to_json(self) -> str:
        return json.dumps({"fits": False, "error": self.line, **self.report}, indent=2)


class NotRunnable(NoPlacement):
    """`plan` where the layout it reports, or the cache's bytes, does not fit: the first reason as the error line,
    then the whole plan without a command (or its JSON with "fits": false); exit 2."""

    def __init__(self, plan: Plan):
        self.line, self.plan = plan.unfit[0], plan
        UserError.__init__(self, f"{self.line}; no command printed\n{plan.render()}")

    def to_json(self) -> str:
        return json.dumps({"fits": False, "error": self.line, **json.loads(self.plan.to_json())}, indent=2)


def _misfits(resident: dict[str, int], inv: Inventory) -> list[str]:
    """What the layout holds beyond the machine: a GPU's, RAM's or the offload folder's usable bytes (the margins
    `decide` keeps), so that a requested placement is held to the same bounds as auto's pick."""
    out = []
    for dev, held in resident.items():
        if dev.startswith("cuda"):
            i = int(dev.partition(":")[2] or 0)
            room, what = (inv.usable_gpu(i), f"{dev} ({gib(inv.usable_gpu(i))} usable)") if i < len(inv.gpus) \
                else (0, f"{dev}, which this machine does not have")
        elif dev == "cpu":
            room, what = inv.usable_ram, f"RAM ({gib(inv.usable_ram)} usable per rank)"
        else:
            room, what = inv.usable_disk, f"the offload folder's disk ({gib(inv.usable_disk)} usable)"
        if held > room:
            out.append(f"{gib(held)} does not fit {what}")
    return out


def _what_fits(entry, x: placements.PlanInput) -> str:
    """The remedy of a layout that does not fit: the largest smaller batch it fits (a device map's layout is not
    tried again: it builds the model's map each time), else the resolution, frames or auto."""
    for b in range(x.needs.batch - 1, 0, -1) if not entry.caps.json_map else ():
        if not _misfits(entry.layout(replace(x, needs=x.needs.at_batch(b))).resident, x.inv):
            return f"--batch-size {b} fits it"
    return "lower the resolution or --frames, or plan without --placement (auto picks one that fits)"


def _cache_disk(s: PlanSettings, cfg: TeacherCacheConfig, cache: dict) -> dict:
    """The free space of the cache's filesystem: measured at --out (or its nearest existing folder), else
    --assume-disk's where the offload folder is inside the cache folder, else unknown; and whether what the cache
    still writes fits it (what --out already holds, the shards its parts list, is written)."""
    written = 0
    if s.out:
        out = Path(s.out)
        outdir.refuse_foreign(out)  # (the run refuses a folder that is not a cache)
        free, where = placement_choice.free_space(out)
        how, at = "measured", str(where)
        written = outdir.listed_shard_bytes(out) if out.is_dir() else 0
    elif s.assume_disk and not cfg.offload_dir:
        free, how, at = placement_choice.parse_size(s.assume_disk), "assumed, --assume-disk", None
    else:
        return {"disk_free_bytes": None, "fits": None}
    need = cache["total_bytes"] - written if cache["total_bytes"] is not None else None
    return {"disk_free_bytes": free, "disk_source": how, "disk_at": at, "written_bytes": written,
            "bytes_to_write": need, "fits": None if need is None else need <= free}


def _render_disk(c: dict) -> str:
    if c["disk_free_bytes"] is None:
        return ("disk        the cache's disk is not checked: give --out CACHE_DIR (its free space measured) or "
                "--assume-disk SIZE")
    where = f" at {c['disk_at']}" if c["disk_at"] else ""
    line = f"disk        {human(c['disk_free_bytes'])} free{where} ({c['disk_source']})"
    if c["fits"] is None:
        return line + " (--prompts N: whether the cache fits)"
    done = f"{human(c['written_bytes'])} written, " if c["written_bytes"] else ""
    return line + f": {done}{human(c['bytes_to_write'])} to write, " + ("it fits" if c["fits"] else "it does NOT fit")


def _disk_line(c: dict) -> str:
    """The refusal of a cache that does not fit its disk, as teacher-cache's own (outdir.disk_refusal)."""
    step = c["prompts"] * c["seeds_per_prompt"] * c["sample_bytes"]
    where = f"at {c['disk_at']}" if c["disk_at"] else "(--assume-disk)"
    return (f"the cache would write {human(c['bytes_to_write'])} and its disk has {human(c['disk_free_bytes'])} free "
            f"{where}: free space, record fewer steps per trajectory with --record-steps N (now "
            f"{c['recorded_steps']} of {c['steps']}; each step costs ~{human(step)}), or plan another --out")


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
    # the offload folder's disk: --offload-dir's, else the one inside the cache folder (--out's, where given)
    inv = _inventory(settings, cfg.offload_dir or (settings.out and str(Path(settings.out) / outdir.OFFLOAD_DIR)))
    assumed_gpus = any(v is not None for v in (settings.assume_gpus, settings.gpus_per_node, settings.gpu_memory))
    dmap = read_device_map(placement, check_devices=not assumed_gpus)[0] \
        if placements.get(placement).caps.json_map else None
    plan = make_plan(str(root), placement, cfg, inventory=inv, max_memory=parse_max_memory(cfg.max_memory),
                     device_map=dmap, expert_order=cfg.expert_order)
    if plan.batch_size != cfg.batch_size:  # auto found a smaller batch that fits (the decision says why)
        cfg, given = replace(cfg, batch_size=plan.batch_size), (*given, "batch_size")
    # teacher-cache's own check of the sizes (frames 1 or 4k+1, VAE and patch multiples, the rotary table), so that
    # plan does not print a command the run refuses
    spec = configs_spec(root, teacher)
    spec.check_sizes(cfg.height, cfg.width, cfg.frames)
    if settings.image_to_video:  # TI2V's image mode (a text-to-video-only teacher refused as teacher-cache refuses)
        spec.condition_for(True)
        cfg = replace(cfg, prompts=None, images=launch.IMAGES)
    if image := spec.image_to_video or settings.image_to_video:  # its VAE encodes each image before the experts load
        for c in plan.components:
            c["where"] = VAE_I2V if c["name"] == "vae" else c["where"]
    if cfg.frames > 1:
        plan.latent_frames = spec.latent_shape(cfg.height, cfg.width, cfg.frames)[1]
    if note := one_frame_note(spec, cfg.frames):
        plan.notes.append(note)
    if (keep := _student_keep(settings, spec, cfg)) is not None:
        cfg, given = replace(cfg, keep_steps=keep), (*given, "keep_steps")
    if root != Path(teacher).expanduser():  # a Hub id
        plan.teacher, plan.source = teacher, f"revision {revision or 'main'}, configs from {root}"
    resolved, grids = student_grids.resolve(cfg, spec)  # --for-students: the steps their boundaries need
    plan.students = [{"spec": g.spec, "steps": g.bounds, "timesteps": g.timesteps, "experts": g.experts,
                      "off_sigma": round(g.off, 6), "line": g.describe()} for g in grids] or None
    plan.cache = cache_projection(spec, replace(resolved, dtype=plan.dtype), settings.prompts)
    plan.cache |= _cache_disk(settings, cfg, plan.cache)
    flags = {"--config": config_file} if config_file else {}
    for f in fields(TeacherRun):
        value = getattr(cfg, f.name)
        if f.name in given and f.name not in _NAMED and (config_file or value != f.default):
            flags |= _flag(f, value)
    words = launch.teacher_cache_words(teacher, revision, plan.placement, flags, settings.out, image)
    plan.launch = launch.plan_launch(plan.placement, settings.nodes, len(inv.gpus), settings.ranks_per_node,
                                     words).to_dict()
    on = flops.gpu(settings.gpu, settings.gpu_tflops) if settings.gpu or settings.gpu_tflops else None
    if settings.step_time is not None:
        step = costs.StepTime(settings.step_time, "--step-time")
    elif settings.measure:  # one step measured here
        step = costs.measure_step(cfg, plan.placement)
    else:  # the table's figure for the teacher's shape
        step = costs.table_step_time(spec.transformer_config, plan.tokens_per_sample, plan.placement,
                                     cfg.max_sequence_length, on)
    if step is not None and settings.prompts:
        plan.time = costs.project(settings.prompts, cfg.seeds_per_prompt, cfg.steps, step,
                                  plan.launch["parts"], plan.launch["gpus_per_rank"])
    if settings.prompts:
        plan.train = costs.stage_two(settings, spec.transformer_config, plan, settings.nodes * len(inv.gpus), on)
        plan.train["commands"] = launch.stage_two_words(
            teacher, revision, settings.out, _schedule_flags(settings, grids), settings.train_epochs,
            settings.gradient_checkpointing, settings.student_config, len(spec.experts), len(inv.gpus),
            cfg.frames > 1)
    if plan.cache.get("fits") is False:
        plan.unfit = [*(plan.unfit or []), _disk_line(plan.cache)]
    if plan.unfit:
        raise NotRunnable(plan)
    return plan


def _schedule_flags(s: PlanSettings, grids) -> dict:
    """train-student's schedule flags for stage two's printed commands: plan's own student settings, else the
    first --for-students grid, else 4 equal segments."""
    choice = {f.name: getattr(s, f.name) for f in fields(StudentSchedule)}
    if all(v is None for v in choice.values()) and grids:
        choice = grid_choice(grids[0].spec)
    flags = {f"--{k.replace('_', '-')}": ",".join(map(str, v)) if isinstance(v, tuple) else f"{v:g}"
             if isinstance(v, float) else str(v) for k, v in choice.items() if v is not None}
    if "--student-expert-steps" in flags:
        flags.pop("--student-steps", None)  # (H,L count them)
    return flags or {"--student-steps": "4"}


def _student_keep(s: PlanSettings, spec: TeacherSpec, cfg: TeacherCacheConfig) -> tuple[int, ...] | None:
    """--keep-steps with the boundaries of the segment student `s` describes (None: no student, or every step)."""
    choice = {f.name: getattr(s, f.name) for f in fields(StudentSchedule)}
    if cfg.record_steps is None or all(v is None for v in choice.values()):
        return None
    try:
        bounds = student_grid(student_grids.schedule_of(spec, cfg), choice).bounds
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
            "bytes_per_prompt": round(per_prompt), "prompts": prompts, "condition": header.condition_shape,
            "total_bytes": size.total if prompts else None}


def _render_cache(c: dict) -> str:
    head = (f"cache       {human(c['sample_bytes'])} per sample x {c['recorded_steps']} of {c['steps']} steps x "
            f"{c['seeds_per_prompt']} seed(s) + {human(c['prompt_store_bytes'])} of prompt store (noise, final latent, "
            + ("the image's condition latent, " if c.get("condition") else "") + f"the embedding at all {c['max_sequence_length']} tokens: at most) = {human(c['bytes_per_prompt'])} per "
            "prompt")
    return head + (f"; {c['prompts']:,} prompts: {human(c['total_bytes'])}" if c["prompts"] else
                   " (--prompts N: the total)")
