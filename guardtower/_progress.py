"""Progress for long work (``audit(steps=N)``, ``guardtower replay`` of a large spool, the demo).

A tqdm bar when tqdm is installed and the stream is a terminal; otherwise a plain line every ``every``
seconds (and one at the end) with the step, the elapsed time and an estimate of the time left, so a log file
gets a few lines rather than a carriage-return bar. Disabled, it prints nothing.
"""

from __future__ import annotations

import sys
import time
from typing import IO, Any, Callable

__all__ = ["Progress"]


#: the progress lines' clock (tests replace this, not ``time.monotonic`` that every thread reads)
_monotonic = time.monotonic


def _clock_text(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    return f"{seconds // 60}:{seconds % 60:02d}" if seconds >= 60 else f"{seconds}s"


class Progress:
    """Counts work done out of ``total``; ``write`` prints a line above the bar."""

    def __init__(self, total: int, label: str, enabled: bool = True, *, every: float = 5.0,
                 stream: IO[str] | None = None, clock: Callable[[], float] | None = None,
                 use_tqdm: bool | None = None) -> None:
        self.total, self.label, self.enabled, self.n = max(0, int(total)), label, enabled, 0
        self.every = every
        self._stream = stream
        self._clock = clock or _monotonic
        self._start = self._clock()
        self._last_line = self._start
        self._printed = False
        self._tqdm: Any = None
        if enabled and (self.stream.isatty() if use_tqdm is None else use_tqdm):
            try:
                from tqdm import tqdm

                self._tqdm = tqdm(total=self.total, desc=label, file=self.stream, ncols=90, leave=True)
            except ImportError:
                pass

    @property
    def stream(self) -> IO[str]:
        return self._stream or sys.stderr

    def line(self, postfix: str = "") -> str:
        """``label 30/100 (30%), 12s elapsed, ~28s left``: the plain form of where the work is."""
        elapsed = self._clock() - self._start
        text = f"{self.label} {self.n}/{self.total}"
        if self.total:
            text += f" ({100 * self.n // self.total}%)"
        text += f", {_clock_text(elapsed)} elapsed"
        if 0 < self.n < self.total:
            text += f", ~{_clock_text(elapsed / self.n * (self.total - self.n))} left"
        return f"{text} {postfix}".rstrip()

    def update(self, postfix: str = "", n: int = 1) -> None:
        self.n += n
        if not self.enabled:
            return
        if self._tqdm is not None:
            if postfix:
                self._tqdm.set_postfix_str(postfix, refresh=False)
            self._tqdm.update(n)
            return
        now = self._clock()
        if now - self._last_line >= self.every or (self.n >= self.total and self._printed):
            self._last_line = now
            self._printed = True
            self.stream.write(self.line(postfix) + "\n")
            self.stream.flush()

    def write(self, text: str) -> None:
        if self._tqdm is not None:
            self._tqdm.write(text, file=self.stream)
        else:
            self.stream.write(text + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self._tqdm is not None:
            self._tqdm.close()
            self._tqdm = None
