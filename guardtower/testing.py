"""Helpers for users' own tests: an in-memory sink and a context manager that captures events."""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

from guardtower.bus import BaseSink, add_tap, remove_tap
from guardtower.events import Event

__all__ = ["InMemorySink", "capture_events"]


class InMemorySink(BaseSink):
    """Keeps every event it handles in ``.events`` (thread-safe); acts on every rank."""

    name = "memory"
    rank_zero_only = False

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: list[Event] = []

    def handle(self, event: Event) -> None:
        with self._lock:
            self._events.append(event)

    @property
    def events(self) -> list[Event]:
        with self._lock:
            return list(self._events)

    def of_kind(self, kind: str) -> list[Event]:
        return [e for e in self.events if e.kind == kind]


@contextlib.contextmanager
def capture_events() -> Iterator[list[Event]]:
    """Collect every event any guardtower bus publishes inside the block, synchronously, in order.

    >>> with capture_events() as events:
    ...     guarded.step()
    >>> [e.kind for e in events]
    """
    captured: list[Event] = []
    add_tap(captured.append)
    try:
        yield captured
    finally:
        remove_tap(captured.append)
