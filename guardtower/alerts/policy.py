"""Delivery policies of alert sinks: retry, grouping and the per-destination rate limit.

``RetryPolicy`` (the delivery engine's, re-exported here) and ``GroupPolicy`` are plain settings. ``Throttle`` is the rate limit one destination
(one webhook URL) gets, shared by every sink in the process that posts there, and also the pause a 429
imposes on all of them. Time comes from an injectable clock so tests never wait.
"""

from __future__ import annotations

import email.utils
import hashlib
import math
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Callable

from guardtower import _validate
from guardtower._delivery import RetryPolicy

__all__ = ["RetryPolicy", "GroupPolicy", "Throttle", "shared_throttle", "parse_retry_after"]


@dataclass(frozen=True)
class GroupPolicy:
    """Alertmanager-style grouping of events that share a fingerprint (run, kind, layer; never the step).

    ``group_wait``: collect the first burst this long into one message. ``group_interval``: at most one
    update per group this often, with counts. ``repeat_interval``: re-send an unchanged incident this often
    (None: never). ``resolve_after_steps``: a summary event of the same run this many steps after the
    group's last event clears the incident (None: only explicit ``resolve()`` clears).
    """

    group_wait: float = 10.0
    group_interval: float = 60.0
    repeat_interval: float | None = 4 * 3600.0
    resolve_after_steps: int | None = 200

    def __post_init__(self) -> None:
        _validate.number("group_wait", self.group_wait, minimum=0)
        _validate.number("group_interval", self.group_interval, minimum=0)
        _validate.number("repeat_interval", self.repeat_interval, above=0, allow_none=True)
        _validate.number("resolve_after_steps", self.resolve_after_steps, minimum=1, integer=True, allow_none=True)


class Throttle:
    """At most one message per ``interval`` seconds to one destination, and the pause a 429 imposes.

    ``reserve()`` books the next free slot and returns how long to wait for it, so several threads (or
    sinks) sharing a destination queue up instead of bursting; ``sent()`` moves it behind the end of a send.
    """

    def __init__(self, interval: float = 0.0, *, clock: Callable[[], float] = time.monotonic) -> None:
        _validate.number("rate_limit", interval, minimum=0)
        self.interval = interval
        self._clock = clock
        self._next_free = -math.inf
        self._paused_until = -math.inf
        self._lock = threading.Lock()

    def reserve(self) -> float:
        """Book the next slot; seconds to wait before sending."""
        with self._lock:
            now = self._clock()
            slot = max(now, self._next_free, self._paused_until)
            self._next_free = slot + self.interval
            return slot - now

    def sent(self) -> None:
        """An attempt just ended: the next slot is at least ``interval`` from now, so the destination sees the
        spacing even when a request took long to arrive (a slow network, a loaded host)."""
        with self._lock:
            self._next_free = max(self._next_free, self._clock() + self.interval)

    def pause(self, seconds: float) -> None:
        """Hold every send to this destination for ``seconds`` from now (a 429's Retry-After)."""
        with self._lock:
            self._paused_until = max(self._paused_until, self._clock() + seconds)

    def paused_for(self) -> float:
        with self._lock:
            return max(0.0, self._paused_until - self._clock())


#: live throttles by destination hash; one dies with the last sink using it
_shared: "weakref.WeakValueDictionary[str, Throttle]" = weakref.WeakValueDictionary()
_shared_lock = threading.Lock()


def shared_throttle(destination: str, interval: float, clock: Callable[[], float] = time.monotonic) -> Throttle:
    """The throttle every live sink posting to ``destination`` shares (the strictest interval wins).

    Keyed by a hash, so the URL itself is never kept.
    """
    key = hashlib.sha256(destination.encode()).hexdigest()
    with _shared_lock:
        throttle = _shared.get(key)
        if throttle is None or throttle._clock is not clock:
            throttle = _shared[key] = Throttle(interval, clock=clock)
        else:
            throttle.interval = max(throttle.interval, interval)
        return throttle


def parse_retry_after(value: str | None, *, cap: float, now: float | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (delta seconds or an HTTP date), clamped to [0, cap]."""
    if value is None:
        return None
    value = value.strip()
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        if when is None:
            return None
        seconds = when.timestamp() - (time.time() if now is None else now)
    if not math.isfinite(seconds):
        return None
    return min(max(0.0, seconds), cap)
