"""The on-disk cache format: every file, member, array and manifest name, defined once.

Outside readers rely on these names: add new ones, never rename. See ARCHITECTURE.md, "The cache".
"""

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

# manifest.json fields (the stable ones named in ARCHITECTURE.md, then additions).
F_FORMAT_VERSION = "format_version"
F_FINGERPRINT = "fingerprint"
F_TEACHER = "teacher"
F_DTYPE = "dtype"
F_STEPS = "steps"
F_TIMESTEPS = "timesteps"
F_GUIDANCE = "guidance"
F_GUIDANCE_2 = "guidance_2"
F_BOUNDARY_RATIO = "boundary_ratio"
F_HEIGHT = "height"
F_WIDTH = "width"
F_FRAMES = "frames"
F_LATENT_SHAPE = "latent_shape"
F_MAX_SEQUENCE_LENGTH = "max_sequence_length"
F_NEGATIVE_PROMPT = "negative_prompt"
F_SEEDS_PER_PROMPT = "seeds_per_prompt"
F_SEED = "seed"
F_PROMPTS = "prompts"
F_SAMPLES = "samples"
F_BYTES = "bytes"
F_NUM_PARTS = "num_parts"
F_SHARDS = "shards"
# additions
F_SIGMAS = "sigmas"
F_EXPERTS = "experts"  # expert used at each step (1 = high-noise `transformer`, 2 = `transformer_2`)
F_EXPAND_TIMESTEPS = "expand_timesteps"
F_TEXT_DIM = "text_dim"
F_IN_CHANNELS = "in_channels"
F_PATCH_SIZE = "patch_size"
F_SCHEDULER = "scheduler"
F_PROMPT_SET_SHA256 = "prompt_set_sha256"
F_PARTS = "parts"
F_CREATED = "created"
F_CFG = "cfg"  # whether targets are CFG-guided predictions (guidance > 1)
F_SAVE_COND_UNCOND = "save_cond_uncond"
F_TEACHER_PATH = "teacher_path"  # absolute local folder of the teacher when stage one ran
F_REVISION = "revision"
F_RECORD_FEATURES = "record_features"  # teacher block indices whose outputs are recorded (each expert's), or []
F_FEATURE_DIM = "feature_dim"  # D of the fixed projection
F_FEATURE_POOL = "feature_pool"  # "none" (one row per latent token) or "mean" (pooled over tokens)
F_FEATURE_SEED = "feature_seed"  # seed of the projection matrix
F_FEATURE_TOKENS = "feature_tokens"  # rows per recorded block: the teacher's latent tokens, or 1 when pooled
F_FEATURE_PROJECTION_SHA256 = "feature_projection_sha256"
F_SAMPLE_FIELDS = "sample_fields"  # tensors every sample carries (schema.py)
F_TEACHER_IDENTITY = "teacher_identity"  # hashes of the teacher's configs and weight files (fingerprinted)
F_NEGATIVE_SHA256 = "negative_sha256"  # sha256 of negative.safetensors
# teacher-cache --record-steps N: the steps every trajectory records (sorted; absent: every step), and the settings
# that chose them (absent without --record-steps, so caches of every step keep their fingerprint)
F_RECORDED_STEPS = "recorded_steps"
F_RECORD_STEPS = "record_steps"
F_RECORD_SEED = "record_seed"
F_KEEP_STEPS = "keep_steps"
# shard records (in the manifest and in progress.json)
S_PATH = "path"
S_PART = "part"
S_SAMPLES = "samples"
S_BYTES = "bytes"
S_CRC32C = "crc32c"  # of the shard's bytes (cache/checksum.py)
S_BLOCKS = "blocks"  # the part's trajectory blocks the shard holds (lets a lost shard be recomputed alone)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

_KEY_RE = re.compile(r"^p(\d{8})_s(\d{2})_k(\d{3})$")


def sample_key(prompt_idx: int, seed_idx: int, step: int) -> str:
    """The tar key of one (prompt, seed, step) sample."""
    return f"p{prompt_idx:08d}_s{seed_idx:02d}_k{step:03d}"


def parse_key(key: str) -> tuple[int, int, int]:
    """Inverse of `sample_key`; raises ValueError for a foreign key."""
    m = _KEY_RE.match(key)
    if not m:
        raise ValueError(f"not a WanDistiller sample key: {key!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


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
    if t.dtype == torch.bfloat16:
        return t.view(torch.uint16).numpy()
    return t.numpy()


def storage_to_torch(a: np.ndarray, dtype_name: str) -> torch.Tensor:
    """Inverse of `torch_to_storage`."""
    t = torch.from_numpy(np.ascontiguousarray(a))
    if dtype_name == "bfloat16":
        return t.view(torch.bfloat16)
    return t.to(DTYPES[dtype_name])


def storage_numpy_dtype(dtype_name: str) -> str:
    return "uint16" if dtype_name == "bfloat16" else dtype_name
