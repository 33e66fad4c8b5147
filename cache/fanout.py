"""One read that serves many items: a share of its result per item.

Stage two reads a window's samples and embeddings in large requests (one `pread` of adjacent samples, one of
consecutive prompts' embeddings), each made once in a read thread, while the loader takes the items one at a
time (`SampleReader.submit_run`, `EmbeddingCache.submit_many`). The read's future holds the bytes read; the
first item taken decodes them (`Decoded`) into a list, an entry per item: a value, or the exception that item's
read raises; each item holds a `Share` of it, which behaves as that item's own future would (one future per
read, not per item: a Future costs ~30 us to make on a busy 2-core machine, as much as decoding the sample).

The read threads only read: decoding (parsing, checksums, copies) runs in the thread that takes the items. That
thread waits on the reads most of an epoch (the real-size bench's in-process loader: 7.8 s of a 12 s epoch spent
waiting, 0.4 s of CPU), so decoding there costs no time, and the read threads go from one request to the next
without holding the GIL in between.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Callable


class Decoded:
    """What `decode` makes of the result of `fut`, made once, by the first caller of `result()` (one thread
    takes a loader's items); an error of the read itself (raised by `fut`) is raised to every caller."""

    __slots__ = ("fut", "decode", "values")

    def __init__(self, fut: Future, decode: Callable[[object], list]):
        self.fut, self.decode, self.values = fut, decode, None

    def result(self) -> list:
        if self.values is None:
            raw = self.fut.result()
            self.values, self.decode = self.decode(raw), None
            self.fut = None  # (the raw bytes go once decoded: the values hold what they need of them)
        return self.values

    def cancel(self) -> bool:
        return self.fut.cancel() if self.fut is not None else False


class Share:
    """Entry `k` of the list `fut` will hold (a Future's or a `Decoded`'s), taken once: `result()` returns it or
    raises it (and lets go of it: an exception raised here carries the caller's frames, which the list must not
    keep alive)."""

    __slots__ = ("fut", "k")

    def __init__(self, fut: Future | Decoded, k: int):
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
