"""What a Wan transformer's step costs in FLOPs, and in seconds on a named GPU: stage one's teacher step (CFG, no
gradient) and stage two's training sample (forward, backward, and the forward that gradient checkpointing repeats),
both from the transformer's config and the tokens. Seconds are FLOPs / (the GPU's dense bf16 peak x the efficiency
that `STEP_TABLE`'s figure reaches on its GPU): one calibration, carried to every GPU of `GPUS` by its peak alone.
Both stages read it (`plan`, `cache info`, `train-student --dry-run`); docs/costs.md shows the figures and
bench/train_flops.py checks the training model against a measured CPU run. Plain arithmetic: no torch."""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class StepFigure:
    """A measured teacher step: one denoising step of one trajectory, CFG on (two sequences in one forward), bf16."""

    shape: tuple[int, int, int]  # (dim, num_layers, ffn_dim) of the transformer that ran it
    teacher: str
    height: int
    width: int
    frames: int
    seconds: float
    gpu: str
    source: str
    image_tokens: int = 0  # an image-to-video teacher's image tokens, which its cross-attention attends to too

    @property
    def tokens(self) -> int:
        """Latent tokens per sequence (Wan's VAE: 4x in time, 16x in space with patch 2)."""
        return ((self.frames - 1) // 4 + 1) * (self.height // 16) * (self.width // 16)


STEP_TABLE = (
    StepFigure((5120, 40, 13824), "Wan2.2-T2V-A14B (one expert; Wan2.1-T2V-14B has the same shape)", 480, 832, 1,
               0.20, "H100", "a reported figure, not measured by this repo; a FLOP count agrees"),
)


@dataclass(frozen=True)
class Gpu:
    name: str
    tflops: float  # dense bf16 tensor throughput with float32 accumulation (what torch's bf16 matmuls use), no sparsity
    source: str


# Every figure is the vendor's (its datasheet or architecture whitepaper), halved where the vendor states it with 2:4
# sparsity only. GeForce cards accumulate bf16 in float32 at half their fp16-accumulate rate; the figure is that half.
GPUS = (
    Gpu("H100", 989, "H100 SXM datasheet: 1,979 with sparsity"),
    Gpu("H100 PCIe", 756, "H100 datasheet, PCIe: 1,513 with sparsity"),
    Gpu("H200", 989, "H200 SXM datasheet: 1,979 with sparsity"),
    Gpu("B200", 2250, "HGX B200 datasheet: 4.5 PFLOPS a GPU with sparsity"),
    Gpu("A100", 312, "A100 datasheet: 624 with sparsity"),
    Gpu("L40S", 362, "L40S datasheet: 362.05, 733 with sparsity"),
    Gpu("L4", 121, "L4 datasheet: 242 with sparsity"),
    Gpu("A10", 125, "A10 datasheet: 250 with sparsity"),
    Gpu("RTX 6000 Ada", 364, "Ada Lovelace whitepaper: 364.2 with float32 accumulate, 728.5 with sparsity"),
    Gpu("RTX A6000", 155, "RTX A6000 datasheet: 309.7 with sparsity"),
    Gpu("RTX 5090", 209.5, "Blackwell GeForce whitepaper: 209.5 with float32 accumulate, 419 with sparsity"),
    Gpu("RTX 4090", 165, "Ada Lovelace whitepaper: 165.2 with float32 accumulate, 330.3 with sparsity"),
    Gpu("RTX 3090", 71, "Ampere GA102 whitepaper: 71 with float32 accumulate, 142 with sparsity"),
)
DEFAULT_GPU = "H100"


def _key(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def gpu_name(setting: str, value) -> str:
    """A `parse` of --gpu: the table's spelling of `value` (case, spaces and dashes aside: rtx4090 is RTX 4090)."""
    found = next((g.name for g in GPUS if isinstance(value, str) and _key(value) == _key(g.name)), None)
    if found is None:
        raise ValueError(f"{setting} must be one of {', '.join(g.name for g in GPUS)} (any case), or give "
                         f"--gpu-tflops N for another GPU, got {value!r}")
    return found


def gpu(name: str | None = None, tflops: float | None = None) -> Gpu:
    """The GPU of --gpu NAME (the table's) or --gpu-tflops N (a peak of the user's), H100 when neither."""
    if tflops is not None:
        return Gpu(f"a {tflops:g}-TFLOPS GPU", tflops, "--gpu-tflops")
    return next(g for g in GPUS if g.name == gpu_name("gpu", name or DEFAULT_GPU))


def detected_gpu(device_name: str) -> str | None:
    """The table's GPU a CUDA device name is ("NVIDIA GeForce RTX 4090", "NVIDIA H100 80GB HBM3"), or None: the
    longest of the table's names whose words appear in it in a row (H100 PCIe before H100; an L40 is not an L4)."""
    words = re.findall(r"[a-z0-9]+", device_name.lower())
    hits = [g for g in GPUS if (n := re.findall(r"[a-z0-9]+", g.name.lower()))
            and any(words[i:i + len(n)] == n for i in range(len(words)))]
    return max(hits, key=lambda g: len(g.name)).name if hits else None


def _forward(c: dict, tokens: int, text_tokens: int) -> dict:
    """FLOPs of one forward of one sequence over num_layers Wan blocks (2 per multiply-add), by kind: the linear layers
    on the latent tokens (self-attention's q, k, v, o, cross-attention's q, o, the FFN), those on the text and image
    tokens (cross-attention's k, v), self-attention (QK^T and AV) and cross-attention."""
    dim, n = c["num_attention_heads"] * c["attention_head_dim"], c["num_layers"]
    per_block = {"latent_linear": tokens * (6 * dim * dim + 2 * dim * c["ffn_dim"]),
                 "text_linear": text_tokens * 2 * dim * dim, "self_attention": 2 * tokens * tokens * dim,
                 "cross_attention": 2 * tokens * text_tokens * dim}
    return {k: 2 * v * n for k, v in per_block.items()}


def step_flops(transformer_config: dict, tokens: int, text_tokens: int = 512, cfg: bool = True,
               image_tokens: int = 0) -> dict:
    """FLOPs of one teacher step of one trajectory (2 per multiply-add) over num_layers Wan blocks: `linear` (self-
    attention's q, k, v, o and cross-attention's q, o on the latent tokens, its k, v on the text and image tokens, the
    FFN), `self_attention` (QK^T and AV: 2 L^2 dim multiply-adds a block) and `cross_attention` (the same over the
    text and image tokens); CFG runs two sequences. Not counted: norms, RoPE, modulation, the patch embedding, the
    head and the embedders (under 0.2% at A14B's width). Needs only the keys of the cache header's teacher_shape."""
    f = _forward(transformer_config, tokens, text_tokens + image_tokens)
    parts = {"linear": f["latent_linear"] + f["text_linear"], "self_attention": f["self_attention"],
             "cross_attention": f["cross_attention"]}
    out = {k: v * (2 if cfg else 1) for k, v in parts.items()}
    return out | {"total": sum(out.values())}


def _adapters(c: dict, tokens: int, text_tokens: int, rank: int, targets: tuple[str, ...]) -> int:
    """FLOPs of one forward through LoRA adapters of `rank` on the `targets` of every block (r x (in + out)
    multiply-adds a token each); a target this table does not know is not counted."""
    dim, ffn = c["num_attention_heads"] * c["attention_head_dim"], c["ffn_dim"]
    per_token = {"to_q": 2 * tokens * 2 * dim, "to_out.0": 2 * tokens * 2 * dim,  # attn1 and attn2
                 "to_k": (tokens + text_tokens) * 2 * dim, "to_v": (tokens + text_tokens) * 2 * dim,
                 "ffn.net.0.proj": tokens * (dim + ffn), "ffn.net.2": tokens * (ffn + dim)}
    return 2 * rank * c["num_layers"] * sum(per_token.get(t, 0) for t in targets)


def train_flops(transformer_config: dict, tokens: int, text_tokens: int = 512, *, adapter_rank: int = 0,
                adapter_targets: tuple[str, ...] = (), checkpointing: bool = False,
                discriminator: bool = False) -> dict:
    """FLOPs of one training sample of stage two: one sequence (the cache holds the guided target: no CFG), `forward`,
    `backward` and `recompute` (gradient checkpointing runs each block's forward again in the backward).

    A trained transformer (a compact student) takes dX and dW of every linear layer (2x their forward) and the
    attention's gradients (~2x its forward). A frozen base with adapters of `adapter_rank` (a LoRA of the teacher's
    expert) takes dX alone (1x), and not where the input needs no gradient: the text's k, v (the frozen text
    embedder's output) and the first block's q, k, v (the frozen patch embedding's); its adapters ~2x their forward.
    `discriminator`: the segment objective's adversarial term, a student-shaped discriminator trained on three
    sequences (real, the student's fake detached, the perturbed real) plus one forward of it with its weights
    frozen whose backward reaches the student's output (dX)."""
    c = transformer_config
    dim = c["num_attention_heads"] * c["attention_head_dim"]
    f = _forward(c, tokens, text_tokens)
    linear, attention = f["latent_linear"] + f["text_linear"], f["self_attention"] + f["cross_attention"]
    adapters = _adapters(c, tokens, text_tokens, adapter_rank, adapter_targets) if adapter_rank else 0
    forward = linear + attention + adapters
    frozen_dx = f["latent_linear"] - 2 * tokens * 3 * dim * dim  # the dX a frozen base takes
    backward = (frozen_dx + 2 * adapters if adapter_rank else 2 * linear) + 2 * attention
    out = {"forward": forward, "backward": backward, "recompute": forward if checkpointing else 0}
    if discriminator:  # 3 sequences trained (3x a forward each); 1 with its weights frozen: a forward and its dX
        one = linear + attention
        out["discriminator"] = 3 * 3 * one + one + (linear - f["text_linear"]) + 2 * attention
    return out | {"total": sum(out.values())}


CALIBRATION = STEP_TABLE[0]
_A14B = {"num_attention_heads": CALIBRATION.shape[0] // 128, "attention_head_dim": 128,
         "num_layers": CALIBRATION.shape[1], "ffn_dim": CALIBRATION.shape[2]}
# The share of its GPU's peak the table's step reaches (43%), the same for every GPU and length: the model's one
# assumption (docs/costs.md checks it against a second public figure and CPU runs)
EFFICIENCY = step_flops(_A14B, CALIBRATION.tokens)["total"] / CALIBRATION.seconds / (
    gpu(CALIBRATION.gpu).tflops * 1e12)


# Measured by this repo (bench/results-cuda.json, row loader_vs_h100_student): the 1.42B student of
# configs/student-1.3b.json (width 1536) trained 17.97 samples/s at 480x832x1 (1,560 tokens, 512 text tokens) on one
# H200, batch 8, bf16 autocast, AdamW: 25% of the peak by `train_flops`, against the 43% of the A14B-wide calibration
NARROW_CHECK = ({"num_attention_heads": 12, "attention_head_dim": 128, "num_layers": 30, "ffn_dim": 8960}, 1560, 512,
                17.97, "H200")


def width_note(transformer_config: dict) -> str:
    """What a time of a transformer narrower (or wider) than the calibration's misses, as a clause; "" at its width."""
    c, (shape, tokens, text, rate, on) = transformer_config, NARROW_CHECK
    if c["num_attention_heads"] * c["attention_head_dim"] == CALIBRATION.shape[0]:
        return ""
    reached = train_flops(shape, tokens, text)["total"] * rate / (gpu(on).tflops * 1e12)
    return (f"; calibrated at width {CALIBRATION.shape[0]}: another width reaches another share of the peak (the "
            f"1,536-wide student of configs/student-1.3b.json trained at {reached:.0%} of an {on}'s, measured): read "
            "it as a floor, and time a step on that GPU")


def seconds(flops: float, on: Gpu) -> float:
    """Seconds of `flops` on `on` at the calibrated efficiency."""
    return flops / (on.tflops * 1e12 * EFFICIENCY)


def speed_words(on: Gpu) -> str:
    """How a time on `on` is got, in one clause: its peak and the efficiency measured on the calibration's GPU (and,
    on another GPU, the ratio of times that follows: the ratio of their peaks)."""
    base = gpu(CALIBRATION.gpu).tflops
    ratio = f", {base / on.tflops:.2f}x the {CALIBRATION.gpu}'s time" if on.name != CALIBRATION.gpu else ""
    return (f"{on.name}: {on.tflops:g} TFLOPS dense bf16 ({on.source}) x {EFFICIENCY:.0%} (the efficiency the table "
            f"of docs/costs.md reaches on {CALIBRATION.gpu}'s {base:g}){ratio}")


def teacher_step_seconds(teacher_shape: dict, tokens: int, text_tokens: int = 512,
                         on: str | Gpu = DEFAULT_GPU) -> tuple[float, str]:
    """Seconds of one CFG teacher step of one trajectory on `on` (a table name or a Gpu), by the FLOP model, and where
    the figure comes from in one line. `teacher_shape`: the cache header's (cache/records.py TEACHER_SHAPE)."""
    g = on if isinstance(on, Gpu) else gpu(on)
    total = step_flops(teacher_shape, tokens, text_tokens)["total"]
    return seconds(total, g), f"FLOP model: {flop(total)} FLOP a step at {speed_words(g)}{width_note(teacher_shape)}"


def flop(x: float) -> str:
    return f"{x:.2e}".replace("e+", "e")
