"""A small text progress bar on stderr for downloads and preparation (no dependency)."""

from __future__ import annotations

import sys
import time
from typing import Optional

_UNITS = {"bytes": (1e6, "MB"), "tokens": (1e6, "M tokens")}


class Progress:
    """`Progress(desc, total, unit)`; `update(n)` adds n; `close()` prints the final line with the rate.

    Redraws at most 5 times a second, and only on a terminal; the final line is always printed.
    """

    def __init__(self, desc: str, total: Optional[int], unit: str = "bytes", stream=None):
        self.desc, self.total, self.unit = desc, total, unit
        self.stream = stream or sys.stderr
        self.done = 0
        self.start = self._last = time.monotonic()
        self._tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._closed = False

    def _line(self) -> str:
        scale, name = _UNITS.get(self.unit, (1.0, self.unit))
        elapsed = max(time.monotonic() - self.start, 1e-9)
        rate = self.done / scale / elapsed
        if self.total:
            frac = min(self.done / self.total, 1.0)
            bar = "#" * int(frac * 30)
            return (f"{self.desc}: [{bar:<30}] {frac:6.1%} {self.done / scale:.1f}/{self.total / scale:.1f} "
                    f"{name} {rate:.1f} {name}/s")
        return f"{self.desc}: {self.done / scale:.1f} {name} {rate:.1f} {name}/s"

    def update(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if self._tty and now - self._last > 0.2:
            self._last = now
            self.stream.write("\r" + self._line())
            self.stream.flush()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.stream.write(("\r" if self._tty else "") + self._line() + "\n")
            self.stream.flush()
