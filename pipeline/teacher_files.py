"""What identifies a teacher's files, the same for every stage: a config's hash and a weight file's sampled digest
(stage one's `teacher_identity`, and stage two's LoRA check that its base is the cache's teacher)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

SAMPLE_BYTES = 1 << 16  # bytes read at each end of a weight file for its identity


def hash_json(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def sample_file(path: Path) -> str:
    """sha256 of size + first and last 64 KiB: cheap, and tells apart teachers that share configs."""
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(SAMPLE_BYTES))
        if size > SAMPLE_BYTES:
            f.seek(max(size - SAMPLE_BYTES, SAMPLE_BYTES))
            h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()
