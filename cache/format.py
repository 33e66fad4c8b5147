"""The on-disk cache format: every file, member and array name, defined once (the JSON records' keys: records.py).

Outside readers rely on these names: add new ones, never rename. See ARCHITECTURE.md, "The cache"."""

from __future__ import annotations

import re

import numpy as np
import torch

# The version of the bytes below; a cache of another version is refused (`manifest.check_version`), never read.
FORMAT_VERSION = 3

# Files and folders below CACHE_DIR.
MANIFEST = "manifest.json"
PARTS_DIR = "parts"
SHARDS_DIR = "shards"
PROGRESS = "progress.json"
LOCKS_DIR = "locks"  # stage one: one lock file per part in here (pipeline/lock.py)
PROMPTS_ZARR = "prompts.zarr"
NEGATIVE = "negative.safetensors"
FEATURE_PROJECTION = "feature_projection.safetensors"  # the fixed matrix features are projected with
RESOLVED_CONFIG = "config.json"
TENSORBOARD = "tensorboard"  # parts/part-P/tensorboard: stage one's progress (teacher-cache --report-to tensorboard)
# Anything being written carries this suffix until it is complete; readers never look at it.
TMP_SUFFIX = ".tmp"

# Arrays of each part's prompts.zarr.
Z_PROMPT_IDX = "prompt_idx"
Z_TEXT = "text"
Z_EMBEDS = "embeds"  # every row's real tokens, one after another: [tokens, text_dim]
Z_TOKEN_START = "token_start"  # where each row's tokens begin in `embeds` (int64; -1: never written)
Z_SEQ_LENS = "seq_lens"
Z_INIT_NOISE = "init_noise"
Z_FINAL_LATENTS = "final_latents"
Z_CONDITION = "condition"  # image-to-video: each trajectory's condition latent (schema.py TRAJECTORY_FIELDS)
# Group of per-row checksums: `row_crc32c/embeds` is the crc32c of each row's real tokens (int64; -1: none), so that a
# chunk or file of them that is gone (zarr reads it as zeros) is an error; every chunk also ends in its own crc32c.
Z_ROW_CRC32C = "row_crc32c"
# Tokens per chunk and per file (zarr shard) of `embeds`: the real tokens packed end to end, 32 MiB a file at A14B.
EMBED_CHUNK_TOKENS = 64
TOKENS_PER_FILE = 4096
# Rows per file (zarr shard) of `init_noise` and `final_latents`: at A14B sizes ~25 MB a file, ~16 files per 1,000
# prompts instead of ~2,000.
ROWS_PER_FILE = 64
# Attribute holding the torch dtype of an array stored as raw bits (bfloat16 has no numpy dtype).
Z_ATTR_TORCH_DTYPE = "torch_dtype"

# Members of one sample in a tar shard: `<key>.safetensors` and `<key>.json`.
EXT_TENSORS = "safetensors"
EXT_META = "json"
T_X_T = "x_t"
T_TARGET = "target"
T_TARGET_COND = "target_cond"
T_TARGET_UNCOND = "target_uncond"
T_FEATURES = "features"  # the teacher's hidden states after chosen blocks, projected to feature_dim (schema.py)
T_CONDITION = "condition"  # a batch's per-trajectory condition latent (image-to-video), from the prompt store
# How a cache's condition latent enters the transformer (the header's `condition`; pipeline/model_call.py lays each out)
NO_CONDITION, CONCAT, FIRST_FRAME = "none", "concat", "first_frame"
CONDITIONS = (NO_CONDITION, CONCAT, FIRST_FRAME)
M_PROMPT_IDX = "prompt_idx"
M_SEED_IDX = "seed_idx"
M_STEP = "step"
M_TIMESTEP = "timestep"
M_SIGMA = "sigma"
M_EXPERT = "expert"
M_GUIDANCE = "guidance"
# What each tensor and metadata field holds, its dtype and shape: schema.py.

# Feature-projection file tensors.
P_MATRIX = "matrix"  # [teacher dim, feature_dim] float32
# Negative-prompt file tensors.
NEG_EMBEDS = "embeds"
NEG_SEQ_LEN = "seq_len"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

_KEY_RE = re.compile(r"^p(\d{8})_s(\d{2})_k(\d{3})$")


def sample_key(prompt_idx: int, seed_idx: int, step: int) -> str:
    """The tar key of one (prompt, seed, step) sample."""
    return f"p{prompt_idx:08d}_s{seed_idx:02d}_k{step:03d}"


def parse_key(key: str) -> tuple[int, int, int]:
    """Inverse of `sample_key`; raises ValueError for a foreign key."""
    if not (m := _KEY_RE.match(key)):
        raise ValueError(f"not a WanDistiller sample key: {key!r}")
    return tuple(map(int, m.groups()))


def part_dirname(part: int) -> str:
    return f"part-{part:05d}"


def prompt_location(prompt_idx: int, num_parts: int) -> tuple[int, int]:
    """(part, row) holding a prompt: prompt i belongs to part i % num_parts, at row i // num_parts of its store."""
    return prompt_idx % num_parts, prompt_idx // num_parts


def part_prompts(part: int, prompts: int, num_parts: int) -> range:
    """The global prompt indices of `part`, in row order (inverse of `prompt_location`)."""
    return range(part, prompts, num_parts)


def shard_relpath(part: int, index: int) -> str:
    """Path of a shard relative to CACHE_DIR."""
    return f"{SHARDS_DIR}/part-{part:05d}-{index:06d}.tar"


def torch_to_storage(t: torch.Tensor) -> np.ndarray:
    """A numpy view that keeps the tensor's bits (bfloat16 travels as uint16)."""
    t = t.detach().cpu().contiguous()
    return (t.view(torch.uint16) if t.dtype == torch.bfloat16 else t).numpy()


def storage_to_torch(a: np.ndarray, dtype_name: str) -> torch.Tensor:
    """Inverse of `torch_to_storage`."""
    t = torch.from_numpy(np.ascontiguousarray(a))
    return t.view(torch.bfloat16) if dtype_name == "bfloat16" else t.to(DTYPES[dtype_name])


def storage_numpy_dtype(dtype_name: str) -> str:
    return "uint16" if dtype_name == "bfloat16" else dtype_name
