"""The LoRA student kind (`train-student --lora-of TEACHER`): the teacher's own transformer(s), frozen, each with
a peft LoRA adapter; docs/lora.md and docs/architecture.md "The student kind"."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from types import SimpleNamespace

import torch

from cache.schema import recorded_steps
from pipeline.artifact import LoraRecord, lora_file
from pipeline.errors import UserError
from pipeline.hub import teacher_folder
from pipeline.lora_experts import ADAPTER, COMPONENTS, LoraExperts, add_adapter
from pipeline.teacher_files import hash_json, read_component, read_index, sample_file

from .student import StudentKind, check_compatible, trained_parameters

_MODEL_FILES = ("model_index.json", "transformer*/*.json", "transformer*/*.safetensors")


class LoraStudent(StudentKind):
    """A LoRA student: which teacher, which of its experts, which adapters (set by `prepare`, which needs the cache's
    schedule), built as the teacher's experts frozen in the autocast dtype with float32 adapters."""

    bf16_policy = False  # (its base is built in the autocast dtype already, its adapters float32)

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
        weights = {f"{c}/{f.name}": sample_file(f) for c in self.trained for f in sorted((self.path / c).glob(
            "*.safetensors"))}
        configs = {c: hash_json(read_component(self.path, c)) for c in self.trained}
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


def _shard_adapters(module: torch.nn.Module, skip: str, kw: dict) -> None:
    """The adapters' modules (peft's lora_A/lora_B of every adapted layer) under `module`, not under `skip`, as one
    FSDP2 unit."""
    from torch.distributed.fsdp import fully_shard

    leaves = [m[ADAPTER] for name, m in module.named_modules(prefix="") if name.rsplit(".", 1)[-1] in
              ("lora_A", "lora_B") and not (skip and name.startswith(skip)) and ADAPTER in m]
    if leaves:
        fully_shard(leaves, **kw)
