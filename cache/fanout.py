"""One read that serves many items: a share of its result per item.

Stage two reads a window's samples and embeddings in large requests (one `pread` of adjacent samples, one of
consecutive prompts' embeddings), each made once in a read thread, while the loader takes the items one at a
time (`SampleReader.submit_run`, `EmbeddingCache.submit_many`). The read's future holds a list, an entry per item:
a value, or the exception that item's read raises; each item holds a `Share` of it, which behaves as that item's
own future would (one future per read, not per item: a Future costs ~30 us to make on a busy 2-core machine,
as much as decoding the sample).
"""

from __future__ import annotations

from concurrent.futures import Future


class Share:
    """Entry `k` of the list `fut` will hold, taken once: `result()` returns it or raises it (and lets go of it:
    an exception raised here carries the caller's frames, which the list must not keep alive)."""

    __slots__ = ("fut", "k")

    def __init__(self, fut: Future, k: int):
        self.fut, self.k = fut, k

    def result(self):
        values = self.fut.result()
        value, values[self.k] = values[self.k], None
        if isinstance(value, BaseException):
            raise value
        return value

    def cancel(self) -> bool:
        """Cancel the whole read unless it has begun (the owner drops all of its items at once)."""
        return self.fut.cancel()
