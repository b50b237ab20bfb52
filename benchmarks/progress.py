"""A progress line on stderr: a few lines of our own rather than a tqdm dependency, which neither the
package nor every machine that runs the benchmarks has."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """`[done/total pct] elapsed  label` for each unit of work as it starts.

    On a terminal the line is rewritten in place; into a file or pipe (a log, a remote run's captured
    output) each update is a line of its own, so the log shows what ran and for how long.
    """

    def __init__(self, total: int, stream: TextIO = sys.stderr):
        self.total = total
        self.done = 0
        self.stream = stream
        self.in_place = stream.isatty()
        self.start = time.monotonic()
        self._width = 0

    def _write(self, text: str) -> None:
        if self.in_place:
            self.stream.write("\r" + text.ljust(self._width))
            self._width = len(text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def _elapsed(self) -> str:
        minutes, seconds = divmod(int(time.monotonic() - self.start), 60)
        return f"{minutes}:{seconds:02d}"

    def step(self, label: str) -> None:
        """A unit of work starts (it counts as done when the next one starts, or at `close`)."""
        percent = 100 * self.done // max(self.total, 1)
        self._write(f"[{self.done + 1}/{self.total} {percent:3d}%] {self._elapsed()}  {label}")
        self.done += 1

    def note(self, message: str) -> None:
        """A message outside the counted units (setup stages)."""
        self._write(f"[{self._elapsed()}] {message}")

    def close(self) -> None:
        self._write(f"[{self.done}/{self.total} 100%] {self._elapsed()}  done")
        if self.in_place:
            self.stream.write("\n")
            self.stream.flush()
