"""What identifies a teacher's files, the same for every stage: a config's hash and a weight file's sampled digest.

Stage one fingerprints the teacher with these (`TeacherSpec.identity`, written to the manifest as
`teacher_identity`), and stage two's LoRA student checks with the same functions that the base it loads is the
teacher the cache was made with (stages/train_student/lora_student.py), so neither stage imports the other.
"""

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
