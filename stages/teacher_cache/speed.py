"""The teacher's speed options (`TeacherSpeedSettings`; docs/costs.md, "A faster teacher step"): checked against this
machine and the placement before a weight loads, applied to each expert as it loads, the compile warm-up run before
the progress figures start, and what can change a target recorded as the cache header's `numerics` (fingerprinted),
so a resumed cache never mixes numerics. Cache-skipping hooks are refused wherever they come from."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, fields

import torch

from pipeline.errors import UserError
from pipeline.registries import QUANTS, STEP_CACHE_WHY, STEP_CACHES, TeacherSpeedSettings
from pipeline.model_call import Inputs, predict
from pipeline.settings import name_of

FLAGS = {f.name: f"--{name_of(f)}" for f in fields(TeacherSpeedSettings)}  # field -> how the command line spells it


def spelled(options: dict) -> str:
    """Options (field -> value) as the command line gives them: "--compile --teacher-quant int8"."""
    return " ".join(FLAGS[k] + ("" if v is True else f" {v}") for k, v in options.items())


@dataclass(frozen=True, kw_only=True)
class TeacherSpeed(TeacherSpeedSettings):
    """The speed options of one run, as TeacherSpeedSettings declares them (a refused `--step-cache` never gets
    here), and what they do."""

    @property
    def quantizes(self) -> bool:
        return QUANTS[self.teacher_quant].caps.torchao is not None

    @classmethod
    def of(cls, cfg) -> TeacherSpeed:
        """The options of a config carrying TeacherSpeedSettings (teacher-cache's, plan's)."""
        return cls(**{f.name: getattr(cfg, f.name) for f in fields(TeacherSpeedSettings)})

    def numerics(self, device: torch.device | None) -> dict | None:
        """The options given that can change a target on `device` (None: not known yet), as the header records them;
        None for the plain teacher, so older caches keep their fingerprints. TF32 touches only CUDA matmuls."""
        return {f.name: v for f in fields(self) if (v := getattr(self, f.name)) != f.default
                and (f.name != "tf32" or device is None or device.type == "cuda")} or None

    def check(self, placement) -> None:
        """One line naming an option this machine or `placement` (resolved) cannot run, before any weight loads."""
        device, caps = placement.device, placement.entry.caps
        cuda = device.type == "cuda"
        b = self.attention_backend
        if b != "native":
            if not cuda and b != "_native_math":  # (with native, torch's SDPA: the backends that run on a CPU)
                raise UserError(f"--attention-backend {b} runs on CUDA, and this run computes on {device} (placement "
                                f"{placement.name}); leave it out (native) or run on a GPU")
            from diffusers.models.attention_dispatch import AttentionBackendName, _check_attention_backend_requirements

            try:
                _check_attention_backend_requirements(AttentionBackendName(b))
            except RuntimeError as e:
                raise UserError(f"--attention-backend {b} cannot run here: {e}; or leave it out (native)") from None
        if (self.compile or self.quantizes) and (caps.streams or caps.spreads or caps.json_map):
            chosen = " and ".join(n for n, on in (("--compile", self.compile),
                                                  (f"--teacher-quant {self.teacher_quant}", self.quantizes)) if on)
            raise UserError(f"{chosen} needs the teacher's weights resident on the device that computes (placement cuda "
                            f"or cpu); placement {placement.name} moves them while it runs")
        if self.quantizes:
            q = QUANTS[self.teacher_quant].caps
            if importlib.util.find_spec("torchao") is None:
                raise UserError(f"--teacher-quant {self.teacher_quant} quantizes through torchao, which is not "
                                "installed; pip install 'wandistiller[quant]' (or leave the option out)")
            if q.capability is not None and not (cuda and torch.cuda.get_device_capability(device) >= q.capability):
                have = f"{device} of compute capability {torch.cuda.get_device_capability(device)}" if cuda else device
                raise UserError(f"--teacher-quant {self.teacher_quant} needs a CUDA GPU of compute capability "
                                f"{'.'.join(map(str, q.capability))} or newer, and this run computes on {have}; use "
                                "int8 or leave it out")

    def prepare(self, model: torch.nn.Module) -> torch.nn.Module:
        """Apply the options to one loaded expert (in place) and refuse a cache-skipping hook it carries."""
        refuse_step_caches(model)
        if self.tf32:  # process-wide, and only CUDA reads it; the text encoder has already run
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        if self.attention_backend != "native":
            model.set_attention_backend(self.attention_backend)
        if self.quantizes:
            quantize(model, self.teacher_quant)
        if self.compile:
            model.compile_repeated_blocks(fullgraph=True)
        return model

    @torch.inference_mode()
    def warm_up(self, runner, model: torch.nn.Module, batches: list[int], latent_shape, context: tuple[int, int]):
        """Run `model` once at every batch size of the run (zeros), so that compiling happens here and not in a
        counted step. `context`: (text tokens, text width)."""
        for b in sorted(set(batches)):
            latents = torch.zeros(b, *latent_shape, device=runner.device, dtype=runner.dtype)
            text = torch.zeros(b, *context, device=runner.device, dtype=runner.dtype)
            inputs = Inputs(latents, torch.full((b,), 999.0, device=runner.device), text,
                            text[:1] if runner.schedule.cfg else None)
            predict(model, inputs, 1.0, runner.rule, batched=True)
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)


def quantize(model: torch.nn.Module, name: str) -> None:
    """The repeated blocks' linear layers through torchao's config for `name` (embedders and the output projection,
    small and partly float32, stay as they are)."""
    import torchao.quantization as tq  # (its import warnings are quietened by the CLI's _start)

    config = getattr(tq, QUANTS[name].caps.torchao)()
    tq.quantize_(model, config, filter_fn=lambda m, fqn: isinstance(m, torch.nn.Linear) and fqn.startswith("blocks."))


def refuse_step_caches(model: torch.nn.Module) -> None:
    """A transformer carrying one of diffusers' cache-skipping hooks (applied by a plug-in or a device-map loader)
    would write targets that are not the teacher's: refused in one line."""
    hooks = {h: e.name for e in STEP_CACHES.entries() for h in e.caps}
    for module in model.modules():
        registry = getattr(module, "_diffusers_hook", None)
        found = [hooks[h] for h in getattr(registry, "hooks", {}) if h in hooks]
        if found:
            raise UserError(f"the teacher's transformer carries diffusers' {found[0]} hook, refused for stage one: "
                            f"{STEP_CACHE_WHY}; load it without the hook")

