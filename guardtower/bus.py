"""The in-process event bus: producers publish, each sink consumes on its own worker thread.

``publish()`` only appends to each sink's bounded in-memory queue, so a sink that hangs, raises or is slow
never blocks or crashes training. Overflow is never silent: the event goes to the sink's spool when it has
one (``sink.spill(event)`` returns True), else it is counted as dropped in ``stats()`` and reported at close.
Live buses are flushed at interpreter exit with a bounded total timeout, and a forked child starts with
empty queues so it never re-sends its parent's events.
"""

from __future__ import annotations

import atexit
import collections
import logging
import os
import threading
import time
import weakref
from typing import Any, Callable, Iterable, Protocol, runtime_checkable

from guardtower._dist import current_rank, is_distributed
from guardtower.errors import ConfigError
from guardtower.events import Event

__all__ = [
    "Sink",
    "BaseSink",
    "EventBus",
    "resolve_bus",
    "check_sink",
    "add_tap",
    "remove_tap",
    "EXIT_FLUSH_TIMEOUT_S",
]

logger = logging.getLogger("guardtower.bus")

#: total time the interpreter-exit hook spends flushing every live bus
EXIT_FLUSH_TIMEOUT_S = float(os.environ.get("GUARDTOWER_EXIT_TIMEOUT", "5"))
_DEFAULT_QUEUE_SIZE = 10_000
_BATCH_MAX = 512
_IDLE_POLL_S = 0.5


@runtime_checkable
class Sink(Protocol):
    """What the bus needs from a sink. ``handle`` runs on the sink's own worker thread."""

    name: str

    def handle(self, event: Event) -> None: ...

    def flush(self, timeout: float | None = None) -> bool: ...

    def close(self, timeout: float | None = None) -> None: ...


class BaseSink:
    """Convenient defaults for sinks.

    Attributes the bus reads (with these defaults for sinks that do not subclass ``BaseSink``):
    ``rank_zero_only`` — with ``main_process_only`` buses, act on rank 0 only (remote sinks: trackers,
    alerts); ``queue_size`` — the bound of the sink's queue.
    """

    name: str = "sink"
    rank_zero_only: bool = True
    queue_size: int = _DEFAULT_QUEUE_SIZE

    def handle(self, event: Event) -> None:
        raise NotImplementedError

    def handle_batch(self, events: list[Event]) -> None:
        """Handle what the worker drained in one go; override to write or send in batches."""
        for event in events:
            self.handle(event)

    def spill(self, event: Event) -> bool:
        """Called on the publishing thread when the queue is full; return True if the event was kept.

        Must be fast and must not raise; the default keeps nothing, so the event counts as dropped.
        """
        return False

    def flush(self, timeout: float | None = None) -> bool:
        return True

    def close(self, timeout: float | None = None) -> None:
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class _SinkWorker:
    """One sink's bounded queue and daemon thread."""

    def __init__(self, sink: Sink) -> None:
        self.sink = sink
        self.name: str = getattr(sink, "name", type(sink).__name__)
        self.rank_zero_only: bool = bool(getattr(sink, "rank_zero_only", True))
        self.maxsize: int = int(getattr(sink, "queue_size", _DEFAULT_QUEUE_SIZE))
        self.counters = collections.Counter[str]()
        self._reset_runtime()
        self._start()  # now, so the first publish does not pay for a thread start

    def _reset_runtime(self) -> None:
        self.queue: collections.deque[Event] = collections.deque()
        self.wake = threading.Event()
        self.stopping = False
        self.thread: threading.Thread | None = None
        self.start_lock = threading.Lock()

    def after_fork(self) -> None:
        """In a forked child: forget the parent's queue and thread (threads do not survive fork).

        The child's worker starts again on its first publish.
        """
        self._reset_runtime()
        self.counters.clear()

    def offer(self, event: Event) -> None:
        if len(self.queue) >= self.maxsize:
            try:
                kept = bool(getattr(self.sink, "spill", _never_spill)(event))
            except Exception:  # a sink's spill must not break publish
                kept = False
            self.counters["spilled" if kept else "dropped"] += 1
            return
        self.counters["queued"] += 1
        self.queue.append(event)
        if self.thread is None:
            self._start()
        if not self.wake.is_set():
            self.wake.set()

    def _start(self) -> None:
        with self.start_lock:
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name=f"guardtower-sink-{self.name}", daemon=True)
                self.thread.start()

    def _run(self) -> None:
        handle_batch: Callable[[list[Event]], None] | None = getattr(self.sink, "handle_batch", None)
        while True:
            self.wake.wait(_IDLE_POLL_S)
            self.wake.clear()
            while self.queue:
                batch: list[Event] = []
                while self.queue and len(batch) < _BATCH_MAX:
                    batch.append(self.queue.popleft())
                self._deliver(batch, handle_batch)
            if self.stopping and not self.queue:
                return

    def _deliver(self, batch: list[Event], handle_batch: Callable[[list[Event]], None] | None) -> None:
        try:
            if handle_batch is not None:
                handle_batch(batch)
            else:
                for event in batch:
                    self.sink.handle(event)
            self.counters["delivered"] += len(batch)
        except Exception:
            self.counters["failed"] += len(batch)
            if self.counters["failed_logged"] < 5:
                self.counters["failed_logged"] += 1
                logger.warning("guardtower sink %r raised while handling events", self.name, exc_info=True)

    def done(self) -> int:
        return self.counters["delivered"] + self.counters["failed"]

    def pending(self) -> int:
        """Events accepted but not yet handled (queued or in the sink's hands)."""
        return self.counters["queued"] - self.done()

    def wait_idle(self, deadline: float | None) -> bool:
        """Wait until everything queued before this call was handled; False at the deadline."""
        target = self.counters["queued"]
        pause = 0.0005
        while self.done() < target:
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(pause)
            pause = min(pause * 2, 0.02)
        return True

    def stats(self) -> dict[str, int]:
        return {
            "queued": self.counters["queued"],
            "delivered": self.counters["delivered"],
            "failed": self.counters["failed"],
            "dropped": self.counters["dropped"],
            "spilled": self.counters["spilled"],
            "pending": self.pending(),
        }


def _never_spill(event: Event) -> bool:
    return False


_taps: list[Callable[[Event], None]] = []


def add_tap(tap: Callable[[Event], None]) -> None:
    """Call ``tap(event)`` synchronously for every event any bus publishes (used by ``capture_events``)."""
    _taps.append(tap)


def _call_taps(event: Event) -> None:
    for tap in tuple(_taps):
        try:
            tap(event)
        except Exception:
            logger.debug("guardtower tap raised", exc_info=True)


def remove_tap(tap: Callable[[Event], None]) -> None:
    if tap in _taps:
        _taps.remove(tap)


class EventBus:
    """Fan events out to sinks, each behind its own bounded queue and daemon worker thread."""

    def __init__(self, sinks: Iterable[Sink] = (), *, main_process_only: bool = True) -> None:
        self.main_process_only = main_process_only
        self._workers: list[_SinkWorker] = []
        self._published = 0
        self._closed = False
        self._env_rank = current_rank()
        for sink in sinks:
            self.add_sink(sink)
        _live_buses.add(self)

    def add_sink(self, sink: Sink) -> None:
        """Attach a sink; raises ``ConfigError`` now for an object that cannot be one."""
        check_sink(sink)
        if self._closed:
            raise ConfigError("sink", "the bus is closed", "create a new EventBus")
        self._workers.append(_SinkWorker(sink))

    @property
    def sinks(self) -> list[Sink]:
        return [w.sink for w in self._workers]

    def publish(self, event: Event) -> None:
        """Queue ``event`` for every sink. Never blocks; raises only ``ConfigError`` for a non-event."""
        if not isinstance(event, Event):
            raise ConfigError("event", f"expected a guardtower.events.Event, got {type(event).__name__}",
                              "publish instances of the classes in guardtower.events")
        self._published += 1
        if _taps:
            _call_taps(event)
        if self._closed:
            for worker in self._workers:
                worker.counters["dropped"] += 1
            return
        remote_ok = not self.main_process_only or self._is_rank_zero()
        for worker in self._workers:
            if worker.rank_zero_only and not remote_ok:
                continue
            worker.offer(event)

    def _is_rank_zero(self) -> bool:
        # The process group may be initialised after the bus was made; the environment does not change.
        if is_distributed():
            return current_rank() == 0
        return self._env_rank == 0

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued event was handled and every sink flushed; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        ok = all([worker.wait_idle(deadline) for worker in self._workers])
        for worker in self._workers:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            ok = _call_sink(worker, "flush", remaining) is not False and ok
        return ok

    def close(self, timeout: float | None = None) -> None:
        """Flush, stop the workers and close the sinks, within ``timeout`` seconds in total.

        Events still queued when time runs out are counted as dropped and reported in the log.
        """
        if self._closed:
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        for worker in self._workers:
            worker.wait_idle(deadline)
        for worker in self._workers:
            worker.stopping = True
            worker.wake.set()
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            _call_sink(worker, "close", remaining)
        self._closed = True
        _live_buses.discard(self)
        for worker in self._workers:
            lost = worker.pending()
            if lost:
                worker.counters["dropped"] += lost
            stats = worker.stats()
            if stats["dropped"] or stats["failed"]:
                logger.warning(
                    "guardtower sink %r: %d event(s) dropped, %d failed, %d spilled to its spool",
                    worker.name, stats["dropped"], stats["failed"], stats["spilled"],
                )

    def stats(self) -> dict[str, Any]:
        """Counters: events published, and per sink queued/delivered/failed/dropped/spilled/pending."""
        return {"published": self._published, "closed": self._closed,
                "sinks": {w.name: w.stats() for w in self._workers}}

    def _after_fork(self) -> None:
        for worker in self._workers:
            worker.after_fork()
        self._published = 0

    def __repr__(self) -> str:
        return f"EventBus(sinks={[w.name for w in self._workers]!r})"


def _call_sink(worker: _SinkWorker, method: str, timeout: float | None) -> Any:
    """Call ``sink.flush``/``sink.close`` on a helper thread so a hung sink cannot exceed the timeout."""
    result: list[Any] = []

    def target() -> None:
        try:
            result.append(getattr(worker.sink, method)(timeout))
        except Exception:
            logger.warning("guardtower sink %r raised in %s()", worker.name, method, exc_info=True)
            result.append(False)

    thread = threading.Thread(target=target, name=f"guardtower-{method}-{worker.name}", daemon=True)
    thread.start()
    thread.join(timeout)
    return result[0] if result else False


def check_sink(sink: Any) -> None:
    """Raise ``ConfigError`` for an object that cannot be a sink (without attaching it anywhere)."""
    for method in ("handle", "flush", "close"):
        if not callable(getattr(sink, method, None)):
            raise ConfigError(
                "sink",
                f"{type(sink).__name__} has no callable {method}()",
                "pass an object implementing the Sink protocol (subclass guardtower.bus.BaseSink)",
            )


def resolve_bus(bus: EventBus | None, sinks: Iterable[Sink] | None) -> tuple[EventBus, bool]:
    """The bus a producer publishes to, and whether the producer owns it (and must close it).

    ``sinks`` are added to ``bus`` when both are given; with neither, a bus without sinks is made (events
    still reach ``capture_events``).
    """
    if bus is not None and not isinstance(bus, EventBus):
        raise ConfigError("bus", f"expected an EventBus, got {type(bus).__name__}", "pass guardtower.EventBus(...)")
    sink_list = list(sinks or ())
    if bus is None:
        return EventBus(sink_list), True
    for sink in sink_list:
        bus.add_sink(sink)
    return bus, False


_live_buses: "weakref.WeakSet[EventBus]" = weakref.WeakSet()


def _flush_at_exit() -> None:
    deadline = time.monotonic() + EXIT_FLUSH_TIMEOUT_S
    for bus in list(_live_buses):
        bus.close(max(0.0, deadline - time.monotonic()))


def _reinit_after_fork() -> None:
    for bus in list(_live_buses):
        bus._after_fork()


atexit.register(_flush_at_exit)
os.register_at_fork(after_in_child=_reinit_after_fork)
