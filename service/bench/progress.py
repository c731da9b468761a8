"""A one-line progress bar on stderr, redrawn in place with a carriage return."""

from __future__ import annotations

import sys
import time


class Progress:
    """`update()` per finished request; redraws at most ten times a second, and once more at the end."""

    def __init__(self, total: int, label: str = "", enabled: bool = True, stream=None, width: int = 30) -> None:
        self.total, self.label, self.enabled, self.width = total, label, enabled, width
        self.stream = stream or sys.stderr
        self.done = self.failed = 0
        self._start = time.perf_counter()
        self._last_draw = 0.0

    def update(self, ok: bool = True) -> None:
        """Count one finished request."""
        self.done += 1
        self.failed += not ok
        now = time.perf_counter()
        if self.enabled and (now - self._last_draw >= 0.1 or self.done == self.total):
            self._last_draw = now
            self._draw(now)

    def close(self) -> None:
        """Finish the line."""
        if self.enabled:
            self._draw(time.perf_counter())
            self.stream.write("\n")
            self.stream.flush()

    def _draw(self, now: float) -> None:
        filled = self.width * self.done // max(self.total, 1)
        bar = "#" * filled + "." * (self.width - filled)
        failed = f", {self.failed} failed" if self.failed else ""
        self.stream.write(f"\r{self.label}[{bar}] {self.done}/{self.total}{failed} {now - self._start:6.1f}s")
        self.stream.flush()
