"""Stall detection: a heartbeat per optimizer step and a watchdog thread that notices when they stop.

A run that hangs (a dead rank, a stuck data loader, a deadlocked collective) never produces a spike, so
the guard cannot see it from inside ``step()``. ``Heartbeat.beat(step)`` only records the step and the
time; a daemon watchdog thread, started on the first beat, publishes a ``StallEvent`` when no beat came for
``stall_after`` seconds and a ``resolved=True`` one on the first beat after that.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from guardtower.errors import ConfigError
from guardtower.events import Event, StallEvent, default_run_name
from guardtower.severity import Severity

__all__ = ["Heartbeat", "check_stall_after"]

logger = logging.getLogger("guardtower.heartbeat")

_MAX_POLL_S = 1.0
_STOP_JOIN_S = 2.0


def check_stall_after(value: object) -> float | None:
    """``None`` (off) or a positive number of seconds; ``ConfigError`` otherwise."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or value == float("inf"):
        raise ConfigError("stall_after", f"{value!r} is not a positive number of seconds",
                          "pass e.g. stall_after=600 (ten minutes without an optimizer step), or None to turn it off")
    return float(value)


class Heartbeat:
    """Publish ``stall`` events when ``beat()`` stops being called for ``stall_after`` seconds.

    ``publish`` receives the events (the guard's ``bus.publish``, which never blocks). ``clock`` is the time
    source (monotonic seconds; inject a fake one in tests) and ``poll`` how often the watchdog looks (default
    a quarter of ``stall_after``, at most a second). Nothing runs until the first ``beat()``.
    """

    def __init__(self, stall_after: float, publish: Callable[[Event], None], *,
                 clock: Callable[[], float] = time.monotonic, poll: float | None = None,
                 run: str | None = None) -> None:
        found = check_stall_after(stall_after)
        if found is None:
            raise ConfigError("stall_after", "is None", "pass a number of seconds (None means: build no Heartbeat)")
        if poll is not None and (isinstance(poll, bool) or not isinstance(poll, (int, float)) or not poll > 0):
            raise ConfigError("poll", f"{poll!r} is not a positive number of seconds", "pass e.g. poll=1.0 or None")
        self.stall_after = found
        self.poll = min(found / 4, _MAX_POLL_S) if poll is None else float(poll)
        self._publish = publish
        self._clock = clock
        self._run = default_run_name() if run is None else run
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_step = 0
        self._last_beat = 0.0
        self._beating = False  # no watch before the first step: start-up takes as long as it takes
        self._stalled = False
        self._paused = False

    @property
    def stalled(self) -> bool:
        """True between a published stall and the beat that resolves it."""
        return self._stalled

    def beat(self, step: int) -> None:
        """An optimizer step happened (training thread). Starts the watchdog on the first call."""
        now = self._clock()
        with self._lock:
            resumed = self._stalled
            idle = now - self._last_beat
            self._stalled = self._paused = False
            self._beating = True
            self._last_step, self._last_beat = step, now
        if resumed:
            self._publish(self._event(step, idle, resolved=True))
        if self._thread is None and not self._stop.is_set():
            self._thread = threading.Thread(target=self._watch, name="guardtower-heartbeat", daemon=True)
            self._thread.start()

    def check(self) -> bool:
        """One look by the watchdog: publish a stall if the last beat is too old. True if it published."""
        now = self._clock()
        with self._lock:
            if self._stalled or self._paused or not self._beating:
                return False
            idle = now - self._last_beat
            if idle < self.stall_after:
                return False
            self._stalled = True
            step = self._last_step
        self._publish(self._event(step, idle, resolved=False))
        return True

    def pause(self) -> None:
        """Watch nothing until the next beat (training stopped on purpose, e.g. on a halt)."""
        with self._lock:
            self._paused = True

    def stop(self) -> None:
        """Stop the watchdog (idempotent); later beats start nothing."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(_STOP_JOIN_S)

    def _event(self, step: int, idle: float, *, resolved: bool) -> StallEvent:
        return StallEvent(run=self._run, step=step, severity=Severity.INFO if resolved else Severity.WARN,
                          seconds=idle, stall_after=self.stall_after, resolved=resolved)

    def _watch(self) -> None:
        while not self._stop.wait(self.poll):
            try:
                self.check()
            except Exception:  # telemetry never crashes training; the next look tries again
                logger.debug("guardtower: stall check failed", exc_info=True)
