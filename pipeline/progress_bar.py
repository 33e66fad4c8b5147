"""Progress bars: tqdm's redrawn bar on a terminal, and in a log file (stderr not a TTY) one plain line every
LOG_INTERVAL_S instead of carriage-return frames, which a log keeps all of."""

from __future__ import annotations

import sys
import time

from tqdm import tqdm

LOG_INTERVAL_S = 30.0  # between two lines of a bar in a log file: a day-long run writes ~3,000 lines per bar


class LineBar(tqdm):
    """A tqdm bar writing its state as a whole line at most every `mininterval` seconds, and once more at close."""

    def __init__(self, *args, **kwargs):
        self._line_t = -float("inf")  # when the last line was written (the first refresh writes one at once)
        self._line_n = None  # the count that line showed: close() does not repeat it
        kwargs.setdefault("mininterval", LOG_INTERVAL_S)
        # No width: a log has none to fit, and tqdm cuts a line at `ncols`, its figures (the postfix) first.
        kwargs.update(ascii=True, dynamic_ncols=False, ncols=None)
        super().__init__(*args, **kwargs)

    def refresh(self, nolock=False, lock_args=None):
        # tqdm.write and set_postfix refresh after every message: a line per interval, not per call.
        if self.disable or time.monotonic() - self._line_t < self.mininterval:
            return False
        return super().refresh(nolock, lock_args)

    def display(self, msg=None, pos=None):
        if msg == "":  # tqdm clearing the bar's line: a log has no line to clear
            return True
        self.fp.write((self.__str__() if msg is None else msg) + "\n")
        self.fp.flush()
        self._line_t, self._line_n = time.monotonic(), self.n
        return True

    def clear(self, nolock=False):
        pass  # (tqdm.write clears the bar before its message and redraws it after: nothing to undo in a log)

    def close(self):
        if not self.disable and self._line_n != self.n:  # the last state, once
            self.display()
        self.sp = None  # tqdm's close then only unregisters the bar: no newline, no carriage return
        super().close()


def progress_bar(*args, file=None, **kwargs) -> tqdm:
    """A tqdm bar (same arguments) on stderr or `file`: redrawn on a terminal, plain lines (`LineBar`) elsewhere."""
    file = sys.stderr if file is None else file
    bar = tqdm if getattr(file, "isatty", lambda: False)() else LineBar
    return bar(*args, file=file, **kwargs)
