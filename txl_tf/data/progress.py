"""A small text progress report on stderr for downloads, preparation and evaluation (no dependency).

On a terminal a bar is redrawn in place; elsewhere (a pipe, a log file, CI) a plain line is printed every
`interval` seconds, so a log never holds one line of thousands of carriage returns.
"""

from __future__ import annotations

import sys
import time
from typing import Optional

_UNITS = {"bytes": (1e6, "MB"), "tokens": (1e6, "M tokens")}


class Progress:
    """`Progress(desc, total, unit)`; `update(n)` adds n; `close()` prints the final line with the rate.

    On a terminal it redraws at most 5 times a second; otherwise it prints a line every `interval` seconds.
    With a total, the line shows the estimated time left. The final line is always printed, unless
    `quiet_if_fast` and no line was printed before it (work that ended within `interval` seconds).
    `update(n, note)` shows `note` (e.g. "loss 1.234") after the counts.
    """

    def __init__(self, desc: str, total: Optional[int], unit: str = "bytes", stream=None, interval: float = 5.0,
                 quiet_if_fast: bool = False):
        self.desc, self.total, self.unit = desc, total, unit
        self.stream = stream or sys.stderr
        self.done = 0
        self.note = ""
        self.start = self._last = time.monotonic()
        self._tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._interval = 0.2 if self._tty else interval
        self._closed = False
        self._shown = not quiet_if_fast

    def _line(self) -> str:
        scale, name = _UNITS.get(self.unit, (1.0, self.unit))
        if self.total and self.total < scale:  # "1,234/5,000 tokens", not "0.0/0.0 M tokens"
            scale, name = 1.0, self.unit
        elapsed = max(time.monotonic() - self.start, 1e-9)
        rate = self.done / scale / elapsed
        if self.total:
            frac = min(self.done / self.total, 1.0)
            bar = "#" * int(frac * 30)
            done, total = (f"{self.done:,}", f"{self.total:,}") if scale == 1.0 else \
                (f"{self.done / scale:.1f}", f"{self.total / scale:.1f}")
            line = f"{self.desc}: [{bar:<30}] {frac:6.1%} {done}/{total} {name} {rate:,.1f} {name}/s"
            if 0 < self.done < self.total:
                line += f", {_duration((self.total - self.done) * elapsed / self.done)} left"
        else:
            line = f"{self.desc}: {self.done / scale:.1f} {name} {rate:.1f} {name}/s"
        return line + (f" | {self.note}" if self.note else "")

    def update(self, n: int, note: str = "") -> None:
        self.done += n
        self.note = note or self.note
        now = time.monotonic()
        if now - self._last > self._interval:
            self._last = now
            self._shown = True
            self.stream.write("\r" + self._line() if self._tty else self._line() + "\n")
            self.stream.flush()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if not self._shown:
                return
            self.stream.write(("\r" if self._tty else "") + self._line() + "\n")
            self.stream.flush()


def _duration(seconds: float) -> str:
    """'45 s', '12 min', '3.5 h'."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
