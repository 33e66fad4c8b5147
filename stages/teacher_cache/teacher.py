"""The Wan teacher: find and check it (local folder or hub id), read its configs without weights, load its scheduler
and text encoder (its experts: placements/, where their weights go) and encode prompts with its own
`encode_prompt`."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.errors import UserError
from pipeline.hub import is_hub_id, offline, teacher_folder
from pipeline.model_call import NONE, InputRule
from pipeline.progress_bar import progress_bar
from pipeline.teacher_files import (
    I2V_PIPELINE, PIPELINES, brief, hash_json, missing_weights, read_component, read_index, sample_file,
)

REQUIRED = ("tokenizer", "text_encoder", "vae", "scheduler")
CONFIG_FILES = {"tokenizer": "", "text_encoder": "config.json", "vae": "config.json",
                "scheduler": "scheduler_config.json", "transformer": "config.json", "transformer_2": "config.json"}
ROPE_MAX_SEQ_LEN = 1024  # WanTransformer3DModel's default, for a config that does not say


@dataclass(frozen=True)
class TeacherSpec:
    """What WanDistiller needs to know of a teacher before loading any weight."""

    name: str  # as the user gave it (path or hub id)
    path: Path  # local folder
    revision: str | None
    model_index: dict
    configs: dict  # component -> its config dict
    experts: tuple[str, ...]  # "transformer" and/or "transformer_2", in expert order 1, 2

    @property
    def boundary_ratio(self) -> float | None:
        return self.model_index.get("boundary_ratio") if len(self.experts) == 2 else None

    @property
    def expand_timesteps(self) -> bool:
        return bool(self.model_index.get("expand_timesteps", False))

    @property
    def transformer_config(self) -> dict:
        return self.configs[self.experts[0]]

    @property
    def vae_spatial(self) -> int:
        return int(self.configs["vae"].get("scale_factor_spatial") or 8)

    @property
    def vae_temporal(self) -> int:
        return int(self.configs["vae"].get("scale_factor_temporal") or 4)

    @property
    def patch_size(self) -> tuple[int, int, int]:
        return tuple(self.transformer_config.get("patch_size", (1, 2, 2)))

    @property
    def image_to_video(self) -> bool:
        """A WanImageToVideoPipeline: it draws from an image (the condition on its input channels)."""
        return self.model_index.get("_class_name") == I2V_PIPELINE

    def condition_for(self, images: bool) -> str:
        """How the teacher takes a trajectory's image (model_call's conditions): Wan I2V's channels, TI2V's first
        frame, or none (text-to-video)."""
        if self.image_to_video and not images:
            raise UserError(f"teacher {self.name!r} is an image-to-video pipeline: give --images FILE (lines of "
                            "<image path><TAB><prompt>) instead of --prompts")
        if not images:
            return NONE
        if not (self.image_to_video or self.expand_timesteps):
            raise UserError(f"teacher {self.name!r} is text-to-video only: drop --images and give --prompts, or pass "
                            "an image-to-video teacher (WanImageToVideoPipeline, or Wan2.2-TI2V-5B)")
        if self.model_index.get("image_encoder") not in (None, [None, None]):
            raise UserError(f"teacher {self.name!r} conditions on CLIP image embeddings (Wan2.1-I2V), which stage one "
                            "does not compute yet; use a Wan2.2 image-to-video teacher (I2V-A14B or TI2V-5B)")
        return InputRule.of_teacher(self.model_index, self.transformer_config, True).condition

    def condition_shape(self, height: int, width: int, frames: int) -> list[int] | None:
        """[C, F, H, W] of one trajectory's condition latent, as WanImageToVideoPipeline.prepare_latents makes it."""
        c, f, h, w = self.latent_shape(height, width, frames)
        return [c, 1, h, w] if self.expand_timesteps else [self.vae_temporal + c, f, h, w]

    def latent_shape(self, height: int, width: int, frames: int) -> tuple[int, int, int, int]:
        """[C, F, H, W] of the teacher's latents, exactly as WanPipeline.prepare_latents computes it (the VAE's
        channels: an I2V transformer takes the condition's besides)."""
        tcfg = self.transformer_config
        return (int(tcfg.get("out_channels") or tcfg["in_channels"]), (frames - 1) // self.vae_temporal + 1,
                height // self.vae_spatial, width // self.vae_spatial)

    def check_sizes(self, height: int, width: int, frames: int) -> None:
        pt, ph, pw = self.patch_size
        for name, v, m in (("height", height, self.vae_spatial * ph), ("width", width, self.vae_spatial * pw)):
            if v % m:
                lo, hi = v // m * m, (v // m + 1) * m
                raise UserError(f"--{name} {v} is not divisible by {m} (VAE factor {self.vae_spatial} x patch "
                                f"{m // self.vae_spatial}); use {lo or hi} or {hi}")
        if (frames - 1) % self.vae_temporal:
            raise UserError(f"--frames {frames} must be 1 or 4k+1 for this VAE (temporal factor {self.vae_temporal})")
        # Wan's rotary embedding (diffusers' WanRotaryPosEmbed) holds rope_max_seq_len positions per axis (frames,
        # height, width, in patches): a larger size fails in the first forward, after the prompts were encoded.
        rope = min(int(self.configs[e].get("rope_max_seq_len", ROPE_MAX_SEQ_LEN)) for e in self.experts)
        _, f, h, w = self.latent_shape(height, width, frames)
        for name, value, patches, top in (
                ("height", height, h // ph, rope * ph * self.vae_spatial),
                ("width", width, w // pw, rope * pw * self.vae_spatial),
                ("frames", frames, f // pt, (rope * pt - 1) * self.vae_temporal + 1)):
            if patches > rope:
                raise UserError(f"--{name} {value} is {patches} patches along that axis, more than the teacher's "
                                f"rotary position table holds (rope_max_seq_len {rope}); the maximum is --{name} {top}")

    def identity(self) -> dict:
        """Placement-independent identity for the fingerprint: config hashes and weight-file samples."""
        configs = {c: hash_json(v) for c, v in sorted(self.configs.items())}
        return {"model_index": hash_json(self.model_index), **configs,
                "weights": {f"{comp}/{f.name}": sample_file(f) for comp in ("text_encoder", *self.experts)
                            for f in sorted((self.path / comp).glob("*.safetensors"))}}


def read_json(root: Path, rel: str) -> dict:
    """The teacher's JSON config ROOT/`rel`, read bounded and typed (pipeline/teacher_files.py: the run and the dry
    run check the same), or a UserError naming the file when it is missing."""
    try:
        if rel == "model_index.json":
            return read_index(root)
        comp, name = rel.split("/")
        return read_component(root, comp, name)
    except FileNotFoundError as e:
        raise UserError(f"{root / rel} is missing; the planner needs the teacher's model_index.json and component "
                        "configs (weights are optional)") from e


def _experts(mi: dict) -> tuple[str, ...]:
    return tuple(c for c in ("transformer", "transformer_2") if isinstance(mi.get(c), list) and mi[c][0])


def configs_spec(root: Path, name: str) -> TeacherSpec:
    """The teacher's shapes from its configs alone (no weights, no tokenizer), for `plan` and a Hub id's dry run."""
    mi = read_json(root, "model_index.json")
    if mi.get("_class_name") not in PIPELINES:
        raise UserError(f"{root} is a {brief(mi.get('_class_name'))}, not a WanPipeline or {I2V_PIPELINE}")
    experts = _experts(mi)
    if not experts:
        raise UserError(f"teacher {name!r}: {root / 'model_index.json'} names no transformer; pass a Wan pipeline")
    configs = {c: read_json(root, f"{c}/config.json") for c in experts}
    try:
        configs["vae"] = read_component(root, "vae")
    except FileNotFoundError:
        configs["vae"] = {}  # Wan's factors (8, 4) by default
    configs["scheduler"] = read_json(root, "scheduler/scheduler_config.json")  # (`plan`'s header: its schedule)
    with contextlib.suppress(FileNotFoundError):  # checked as the run checks it (the planner builds it on meta)
        read_component(root, "text_encoder")
    return TeacherSpec(name=name, path=root, revision=None, model_index=mi, configs=configs, experts=experts)


def resolve_teacher(name: str, revision: str | None = None) -> TeacherSpec:
    """Locate the teacher and check it is a Wan pipeline; say what is missing if it is not."""
    p = teacher_folder(name, revision)  # (its files checked: no link out of it, no FIFO, no pickled weights)
    if not p.is_dir():
        raise UserError(f"teacher {name!r} is a file, not a diffusers pipeline folder")
    try:
        mi = read_index(p)
    except FileNotFoundError:
        raise UserError(f"teacher {name!r} is not a diffusers pipeline: model_index.json is missing in {p}") from None
    if mi.get("_class_name") not in PIPELINES:
        raise UserError(f"teacher {name!r} is a {brief(mi.get('_class_name'))}, not a WanPipeline or {I2V_PIPELINE} "
                        "(Wan 2.1/2.2 in diffusers format)")
    experts = _experts(mi)
    missing = [c for c in REQUIRED if not (isinstance(mi.get(c), list) and mi[c][0])]
    if not experts:
        missing.append("transformer")
    configs = {}
    for comp in [c for c in (*REQUIRED, *experts) if c not in missing]:
        try:
            if comp != "tokenizer":
                configs[comp] = read_component(p, comp, CONFIG_FILES[comp])
            elif not (p / comp).is_dir():  # the tokenizer: its folder
                raise FileNotFoundError
        except FileNotFoundError:
            missing.append(f"{comp}/{CONFIG_FILES[comp]}")
    missing += [f for c in ("text_encoder", *experts) if c in configs for f in missing_weights(p, c)]
    if missing:
        # Offline, a Hub id resolves to whatever the local Hub cache holds, maybe only the configs `plan` fetched
        hint = (f"; the local Hub cache holds only part of it: download the rest where the Hub is reachable (`hf "
                f"download {name}`)" + (", or unset HF_HUB_OFFLINE for the run to fetch it" if offline() else "")
                if is_hub_id(name) and not Path(name).exists() else "")
        raise UserError(f"teacher {name!r} is not a complete Wan pipeline: missing {', '.join(missing)} in {p}{hint}")
    if len(experts) == 2 and mi.get("boundary_ratio") is None:
        raise UserError(f"teacher {name!r} has two transformers but no boundary_ratio in model_index.json")
    return TeacherSpec(name=name, path=p, revision=revision, model_index=mi, configs=configs, experts=experts)


def load_scheduler(spec: TeacherSpec):
    """The teacher's own scheduler class and config (UniPC flow for the released Wan 2.x pipelines)."""
    import diffusers

    cls_name = spec.configs["scheduler"].get("_class_name")
    cls = getattr(diffusers, cls_name, None)
    if cls is None:
        raise UserError(f"teacher scheduler class {cls_name!r} is unknown to diffusers {diffusers.__version__}")
    return cls.from_pretrained(spec.path, subfolder="scheduler")


def load_vae(spec: TeacherSpec, device: torch.device):
    """The teacher's VAE in float32 on `device` (image-to-video: each image's condition latent)."""
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan.from_pretrained(spec.path, subfolder="vae", torch_dtype=torch.float32,
                                            use_safetensors=True).to(device).eval().requires_grad_(False)


def load_text_encoder(spec: TeacherSpec, dtype: torch.dtype, device: torch.device, model_offload: bool = False):
    """Tokenizer and UMT5 encoder on `device` (bf16 for fp16: T5 overflows), or in RAM with `model_offload`."""
    from transformers import AutoTokenizer, UMT5EncoderModel

    enc_dtype = torch.bfloat16 if dtype == torch.float16 else dtype
    tokenizer = AutoTokenizer.from_pretrained(spec.path, subfolder="tokenizer")
    encoder = UMT5EncoderModel.from_pretrained(spec.path, subfolder="text_encoder", dtype=enc_dtype,
                                               use_safetensors=True)  # (never a pickle: check_folder refuses them too)
    encoder = encoder.eval().requires_grad_(False)
    if model_offload and device.type == "cuda":
        from accelerate import cpu_offload_with_hook

        return tokenizer, cpu_offload_with_hook(encoder, device)[0]
    return tokenizer, encoder.to(device)


def iter_encoded(tokenizer, text_encoder, prompts: list[str], max_len: int, dtype: torch.dtype,
                 device: torch.device, batch_size: int = 16, progress: bool = True):
    """(index of the batch's first prompt, embeddings [b, L, D] zero past each prompt's length, the lengths [b])
    per batch, on the CPU; the pipeline's own encode_prompt and tokenizer call, so exactly the teacher's."""
    from diffusers import WanPipeline
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean

    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=None, scheduler=None)
    bar = progress_bar(total=len(prompts), desc="encode prompts", unit="prompt", disable=not progress)
    try:
        for i in range(0, len(prompts), batch_size):
            chunk = prompts[i:i + batch_size]
            with torch.inference_mode():
                e, _ = pipe.encode_prompt(chunk, do_classifier_free_guidance=False, max_sequence_length=max_len,
                                          device=device, dtype=dtype)
            mask = tokenizer([prompt_clean(u) for u in chunk], padding="max_length", max_length=max_len,
                             truncation=True, add_special_tokens=True, return_attention_mask=True,
                             return_tensors="pt").attention_mask
            yield i, e.to(dtype).cpu(), mask.gt(0).sum(dim=1).to(torch.int32)
            bar.update(len(chunk))
    finally:
        bar.close()


def encode_prompts(tokenizer, text_encoder, prompts: list[str], max_len: int, dtype: torch.dtype,
                   device: torch.device, batch_size: int = 16, progress: bool = True):
    """Embeddings [n, L, D] and lengths [n] of a few prompts at once (`iter_encoded`, gathered)."""
    parts = list(iter_encoded(tokenizer, text_encoder, prompts, max_len, dtype, device, batch_size, progress))
    return torch.cat([e for _, e, _ in parts]), torch.cat([n for _, _, n in parts])
