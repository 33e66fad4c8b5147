"""Imported once by the command server (`proc.PRELOAD`), never by the suite itself: the lazily imported
model classes every command needs, so forked commands start in milliseconds."""

import threading

import diffusers
import tqdm
import transformers

from pipeline import cli  # noqa: F401

# Touch the lazy modules (diffusers and transformers import a class on first attribute access).
for _name in ("WanTransformer3DModel", "AutoencoderKLWan", "UniPCMultistepScheduler", "WanPipeline"):
    getattr(diffusers, _name)
for _name in ("UMT5EncoderModel", "AutoTokenizer", "T5TokenizerFast"):
    getattr(transformers, _name)
# tqdm's default lock is a multiprocessing semaphore made on first use: one per command, each reported as
# leaked when the suite exits. A thread lock made here is shared by every fork instead.
tqdm.tqdm.set_lock(threading.RLock())
