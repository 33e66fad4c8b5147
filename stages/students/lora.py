"""The LoRA student kind (`train-student --lora-of TEACHER`, docs/lora.md): the teacher's own transformer(s), frozen,
each with a peft LoRA adapter, one model (pipeline/lora_experts.py); a run's student/ holds the adapters and
lora.json; two one-expert runs are one student, RUN1+RUN2 (`LoraStudent.pair`)."""

from __future__ import annotations

import os
from dataclasses import replace
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import torch

from cache.cache_error import UnsafeFileError
from cache.schema import recorded_steps
from pipeline import lora_experts
from pipeline.artifact import DISTILL, LORA_JSON, LoraRecord, lora_file
from pipeline.errors import UserError
from pipeline.hub import teacher_folder
from pipeline.lora_experts import ADAPTER, COMPONENTS, LoraExperts, add_adapter
from pipeline.sampling import own_sampler
from pipeline.teacher_files import hash_json, read_component, read_index, sample_file

from .student_kind import (
    PAIR, Student, StudentKind, check_compatible, meta_model, read_distill, teacher_dir, teacher_transformer_config,
    trained_parameters,
)

_MODEL_FILES = ("model_index.json", "transformer*/*.json", "transformer*/*.safetensors")
PAIR_FIX = "pair the --lora-experts 1 and --lora-experts 2 runs of one cache and schedule"


class LoraStudent(StudentKind):
    """A LoRA student: which teacher, which of its experts, which adapters (set by `prepare`, which needs the cache's
    schedule), built as the teacher's experts frozen in the autocast dtype with float32 adapters; found as its
    adapters (student_ema/'s when chosen) on the teacher lora.json names."""

    bf16_policy = False  # (its base is built in the autocast dtype already, its adapters float32)
    marker = LORA_JSON
    adapters = True

    def prepare(self, manifest, cache, requested):
        self._read_teacher(self.cfg, manifest)
        self.check(manifest, cache)
        check_compatible(self.config, manifest, self.cfg.lora_of)
        return self.train_steps(manifest, requested)

    def _read_teacher(self, cfg, manifest: dict) -> None:
        path = teacher_folder(cfg.lora_of, cfg.revision, files=_MODEL_FILES, flag="--lora-of")
        try:  # (read and typed as every command reads a teacher's: pipeline/teacher_files.py)
            index = read_index(path)
        except FileNotFoundError:
            index = {}
        experts = tuple(c for c in COMPONENTS if isinstance(index.get(c), list) and index[c][0])
        if not experts or not all((path / c / "config.json").is_file() for c in experts):
            raise UserError(f"--lora-of {cfg.lora_of} is not a Wan pipeline with its transformer folders ({path})")
        trained = experts if cfg.lora_experts == "all" else experts[int(cfg.lora_experts) - 1:int(cfg.lora_experts)]
        if not trained:
            raise UserError(f"--lora-experts {cfg.lora_experts}: the teacher {cfg.lora_of} has one transformer; use "
                            "--lora-experts all")
        ratio = index.get("boundary_ratio") if len(experts) == 2 else None
        steps = manifest.scheduler.get("num_train_timesteps", 1000)
        config = {k: v for k, v in read_component(path, experts[0]).items() if not k.startswith("_")}
        self.teacher, self.path, self.revision = cfg.lora_of, path, cfg.revision  # teacher: as the user named it
        self.experts, self.trained = experts, trained  # the teacher's transformers in expert order; those adapted
        # expert 1 runs at t >= boundary_timestep (None: one expert)
        self.boundary_timestep, self.boundary_ratio = None if ratio is None else ratio * steps, ratio
        self.config = config  # the transformer's config (both experts share it)
        self.rank, self.alpha = cfg.lora_rank, float(cfg.lora_alpha or cfg.lora_rank)
        self.targets = tuple(t.strip() for t in cfg.lora_targets.split(",") if t.strip())

    def expert_of(self, timestep: float) -> int:
        """1 or 2: the expert WanPipeline (and stage one) runs at `timestep`."""
        return 1 if self.boundary_timestep is None or timestep >= self.boundary_timestep else 2

    def check(self, manifest: dict, cache: str) -> None:
        """Refuse (one line) a cache made with another teacher than the base, or whose samples would reach an adapter
        of another expert than the one that produced them."""
        recorded = manifest.teacher_identity
        mine = self.identity()
        weights = recorded.get("weights", {})
        for comp in self.trained:
            if recorded.get(comp) not in (None, mine["configs"][comp]) or any(
                    weights.get(k, v) != v for k, v in mine["weights"].items() if k.split("/")[0] == comp):
                raise UserError(f"--lora-of {self.teacher}: its {comp} is not the teacher the cache {cache} was made "
                                f"with ({manifest.teacher}): a LoRA student adapts the teacher that made its "
                                "targets; pass the teacher the cache was made with")
        experts = manifest.experts
        if len(set(experts)) > len(self.experts):
            raise UserError(f"the cache {cache} was made with a two-expert teacher and --lora-of {self.teacher} has "
                            "one transformer; pass the teacher the cache was made with")
        for k, (t, e) in enumerate(zip(manifest.timesteps, experts)):
            if self.expert_of(float(t)) != int(e):
                raise UserError(f"the cache {cache} ran step {k} (timestep {t:g}) with expert {e}, but the boundary of "
                                f"--lora-of {self.teacher} (ratio {self.boundary_ratio}) gives it to expert "
                                f"{self.expert_of(float(t))}; pass the teacher the cache was made with")

    def train_steps(self, manifest: dict, requested: tuple[int, ...] | None) -> tuple[int, ...] | None:
        """The cached steps to train on: `requested` (None: all), those of the trained expert when one is chosen."""
        if self.trained == self.experts:
            return requested
        expert = COMPONENTS.index(self.trained[0]) + 1
        steps = requested if requested is not None else tuple(recorded_steps(manifest))
        if not (mine := tuple(k for k in steps if int(manifest.experts[k]) == expert)):
            raise UserError(f"--lora-experts {expert}: none of the cached steps {','.join(map(str, steps))} ran with "
                            f"expert {expert}; choose the other expert or other --train-steps")
        return mine

    def identity(self) -> dict:
        """The base and the adapters, as a resume must find them again."""
        configs, weights = _experts_identity(self.path, self.trained)
        return {"configs": configs, "weights": weights, "trained": list(self.trained), "rank": self.rank,
                "alpha": self.alpha, "targets": list(self.targets)}

    def teacher_flag(self):
        return "--lora-of", self.cfg.lora_of

    def record(self) -> LoraRecord:
        """distill.json's `lora` and student/lora.json: what `sample`, `eval` and `export` rebuild the student from."""
        return LoraRecord(teacher=self.teacher, revision=self.revision, experts=list(self.experts),
                          trained=list(self.trained), files={c: lora_file(c, len(self.experts)) for c in self.trained},
                          boundary_ratio=self.boundary_ratio, boundary_timestep=self.boundary_timestep,
                          rank=self.rank, alpha=self.alpha, targets=list(self.targets))

    def build(self, seed, dtype) -> LoraExperts:
        """The trained experts of the teacher in `dtype`, frozen, each with a fresh adapter drawn from `seed` (the
        same on every rank); lora_B starts at zero, so the untrained student is the teacher."""
        from diffusers import WanTransformer3DModel

        experts = {}
        for i, comp in enumerate(self.trained):
            model = WanTransformer3DModel.from_pretrained(self.path / comp, torch_dtype=dtype, use_safetensors=True)
            torch.manual_seed(seed + i)
            try:
                add_adapter(model, self.rank, self.alpha, self.targets)
            except ValueError as e:  # e.g. a target that no module matches
                raise UserError(f"--lora-targets {','.join(self.targets)}: {str(e).splitlines()[0]}") from e
            experts[comp] = model
        return LoraExperts(experts, self.boundary_timestep, self.record())

    def describe(self, model):
        trained = sum(p.numel() for _, p in trained_parameters(model))
        return f" ({trained / 1e6:.2f}M trained: rank-{self.rank} LoRA of {self.teacher})"

    def checkpoint_state(self, model):
        """The adapters alone: the base is read again from the teacher at every start."""
        return {k: p.detach().cpu().contiguous() for k, p in trained_parameters(model)}

    def load_checkpoint_state(self, model, tensors):
        params = dict(trained_parameters(model))
        if params.keys() != tensors.keys():
            raise RuntimeError(f"checkpoint holds {len(tensors)} trained tensors, the student {len(params)} "
                               f"(e.g. {sorted(params.keys() ^ tensors.keys())[:1]})")
        with torch.no_grad():
            for k, p in params.items():
                p.copy_(tensors[k])

    def shard(self, model: LoraExperts, **kw) -> None:
        """FSDP2 units, per expert: one per transformer block and one for the rest of the expert, the frozen base and
        the adapters sharded alike (only the adapters have gradients to reduce-scatter). Where the base is not float32
        each block's adapters are a unit of their own, gathered just before the block's: older FSDP2 releases want
        one dtype across a unit's parameters. No MixedPrecisionPolicy: autocast casts as under ddp."""
        from torch.distributed.fsdp import fully_shard

        for expert in model.experts.values():
            split = any(p.dtype != torch.float32 for p in expert.parameters() if not p.requires_grad)
            for block in expert.blocks:
                if split:
                    _shard_adapters(block, "", kw)
                fully_shard(block, **kw)
            if split:  # adapters outside the blocks (a --lora-targets that matches e.g. proj_out)
                _shard_adapters(expert, "blocks.", kw)
            fully_shard(expert, **kw)
        model.every_expert = True

    def gathered(self, model, is_main):
        """The adapters alone, gathered (the base is the teacher's): what a DDP run saves."""
        states = model.adapter_states()
        return SimpleNamespace(save_pretrained=partial(model.save_pretrained, states=states)) if is_main else None

    @classmethod
    def find(cls, p, run, chosen, which):
        try:
            record = LoraRecord.read(chosen)  # (bounded, no link followed: a refusal is its own line)
        except UnsafeFileError:
            raise
        except ValueError as e:
            raise UserError(f"LoRA description {chosen / LORA_JSON}: {e}; it was not written by this WanDistiller's "
                            "train-student --lora-of: rerun it") from e
        missing = [f for f in record.files.values() if not (chosen / f).is_file()]
        if missing or not run.distill.is_file():
            raise UserError(f"{p} holds an incomplete LoRA run ({', '.join(missing) or DISTILL} missing); rerun the "
                            "same train-student command with --resume")
        teacher = teacher_dir(record.teacher, record.revision, recorded_in=str(chosen / LORA_JSON))
        config = teacher_transformer_config(teacher)
        lora_experts.check_files(p, chosen.name, record, meta_model(config, teacher))  # (headers only, bounded)
        return Student(root=p, path=chosen, weights=which, config=config, kind=cls,
                       distill=read_distill(run.distill), lora=record, teacher_path=teacher)

    @classmethod
    def load(cls, student, dtype, device):
        folders = {comp: student.adapter_folder(comp) for comp in student.lora.files}  # (a pair's: two runs')
        return lora_experts.load(student.teacher_path, folders, student.lora, dtype, device)

    @classmethod
    def init_exact(cls, student, seed):
        return True  # it starts as the teacher: its adapters start at zero

    @classmethod
    def untrained(cls, student, seed, dtype, device):
        model = lora_experts.load(student.teacher_path, student.path, replace(student.lora, files={}), dtype, device)
        return model, {"source": f"the teacher {student.lora.teacher} (LoRA adapters start at zero)", "exact": True}

    @classmethod
    def pair(cls, members, names):
        """The one-expert runs of a two-expert teacher as one student, each expert with its own run's adapter; its
        records the pair's: both files, the steps either trained, the prompts both held out. Refused in one line
        unless they are halves of one student (`_mismatch`)."""
        spelled = PAIR.join(names)
        for m, name in zip(members, names):
            if m.kind is not cls:
                return m.kind.pair([m], [name])  # (its refusal)
            if len(m.lora.experts) != 2 or len(m.lora.trained) != 1:
                what = ("its teacher has one transformer" if len(m.lora.experts) != 2 else
                        "it trained both experts (--lora-experts all) and is one student already")
                raise UserError(f"{spelled}: {name} is not a one-expert run of a two-expert teacher ({what}); pass "
                                f"it alone, or {PAIR_FIX}")
        hi, lo = sorted(members, key=lambda m: COMPONENTS.index(m.lora.trained[0]))
        if hi.lora.trained == lo.lora.trained:
            expert = COMPONENTS.index(hi.lora.trained[0]) + 1
            raise UserError(f"{spelled}: both runs trained expert {expert} ({hi.lora.trained[0]}); a pair is one "
                            "--lora-experts 1 run and one --lora-experts 2 run")
        if problem := _mismatch(hi, lo):
            raise UserError(f"{spelled}: the two runs do not make one student ({problem}); {PAIR_FIX}")
        a, b = hi.distill, lo.distill
        lora = replace(hi.lora, trained=list(hi.lora.experts), files={**hi.lora.files, **lo.lora.files})
        steps = dict(zip(a.train_steps, a.train_timesteps)) | dict(zip(b.train_steps, b.train_timesteps))
        distill = replace(a, lora=lora, train_steps=sorted(steps), train_timesteps=[steps[k] for k in sorted(steps)],
                          heldout_prompts=sorted(set(a.heldout_prompts) & set(b.heldout_prompts)),
                          optimizer_steps=a.optimizer_steps + b.optimizer_steps,
                          samples_seen=a.samples_seen + b.samples_seen,
                          epochs_completed=min(a.epochs_completed, b.epochs_completed),
                          student_ema=a.student_ema if a.student_ema and b.student_ema else None)
        weights = hi.weights if hi.weights == lo.weights else f"{hi.weights}{PAIR}{lo.weights}"
        return replace(hi, weights=weights, distill=distill, lora=lora, members=(hi, lo))


def _shard_adapters(module: torch.nn.Module, skip: str, kw: dict) -> None:
    """The adapters' modules (peft's lora_A/lora_B of every adapted layer) under `module`, not under `skip`, as one
    FSDP2 unit."""
    from torch.distributed.fsdp import fully_shard

    leaves = [m[ADAPTER] for name, m in module.named_modules(prefix="") if name.rsplit(".", 1)[-1] in
              ("lora_A", "lora_B") and not (skip and name.startswith(skip)) and ADAPTER in m]
    if leaves:
        fully_shard(leaves, **kw)


def _experts_identity(path: Path, comps) -> tuple[dict, dict]:
    """The experts `comps` of the teacher at `path` as a LoRA identity knows them: each config's hash, and a sample
    of each weight file."""
    return ({c: hash_json(read_component(path, c)) for c in comps},
            {f"{c}/{f.name}": sample_file(f) for c in comps for f in sorted((path / c).glob("*.safetensors"))})


def _mismatch(hi: Student, lo: Student) -> str | None:
    """Why two one-expert runs are not one student's halves, in words; None when they are: one cache (so one
    teacher's targets, frames and text length), one schedule, one adapter shape (the pair's lora.json describes
    one), one teacher's experts to load them into."""
    if set(hi.fingerprints) != set(lo.fingerprints):
        return (f"they were trained on different caches, fingerprints {', '.join(f[:12] for f in hi.fingerprints)} "
                f"and {', '.join(f[:12] for f in lo.fingerprints)}")
    if (one := _schedule(hi)) != (two := _schedule(lo)):
        return f"their schedules differ: {one}, and {two}"
    if (one := _shape(hi)) != (two := _shape(lo)):
        return f"their adapters differ: {one}, and {two}"
    if os.path.realpath(hi.teacher_path) != os.path.realpath(lo.teacher_path) and (
            _identity(hi.teacher_path) != _identity(lo.teacher_path)):
        return f"their teachers differ: {hi.lora.teacher} and {lo.lora.teacher} hold other configs or weights"
    return None


def _schedule(m: Student) -> str:
    bounds = m.distill.objective_settings.get("boundaries")
    return (f"{m.distill.sampling_steps} {own_sampler(m.distill) or 'teacher-scheduler'} steps"
            + (f" from the teacher's steps {bounds}" if bounds else ""))


def _shape(m: Student) -> str:
    return f"rank {m.lora.rank}, alpha {m.lora.alpha:g} on {','.join(m.lora.targets)}"


def _identity(path: Path) -> dict:
    """A teacher's experts as train-student's LoRA identity knows them, and the boundary between them."""
    configs, weights = _experts_identity(path, COMPONENTS)
    return {"boundary_ratio": read_index(path).get("boundary_ratio"), **configs, **weights}
