"""The in-process event bus: producers publish, every sink gets the event through the delivery engine.

``publish()`` only appends to each sink's bounded in-memory queue (``guardtower._delivery``), so a sink
that hangs, raises or is slow never blocks or crashes training. Nothing is lost silently: ``stats()``
says per sink how many events were delivered, spooled, dropped (with the reason) or failed. Live buses
are closed at interpreter exit within ``EXIT_FLUSH_TIMEOUT_S``, and a forked child starts with empty
queues so it never re-sends its parent's events.
"""

from __future__ import annotations

import atexit
import logging
import os
import time
import weakref
from pathlib import Path
from typing import Any, Callable, Iterable, Protocol, runtime_checkable

from guardtower._delivery import DEFAULT_TIMEOUT_S, Delivery, close_all, on_fork
from guardtower._dist import current_rank, is_distributed
from guardtower.errors import ConfigError
from guardtower.events import Event

__all__ = [
    "Sink",
    "BaseSink",
    "EventBus",
    "resolve_bus",
    "check_bus_args",
    "adopt_log_dir",
    "check_sink",
    "add_tap",
    "remove_tap",
    "EXIT_FLUSH_TIMEOUT_S",
]

logger = logging.getLogger("guardtower.bus")

#: total time the interpreter-exit hook spends closing every live bus
EXIT_FLUSH_TIMEOUT_S = float(os.environ.get("GUARDTOWER_EXIT_TIMEOUT", "5"))
_DEFAULT_QUEUE_SIZE = 10_000


@runtime_checkable
class Sink(Protocol):
    """What the bus needs from a sink. ``handle`` runs on the sink's own worker thread."""

    name: str

    def handle(self, event: Event) -> None: ...

    def flush(self, timeout: float | None = None) -> bool: ...

    def close(self, timeout: float | None = None) -> None: ...


class BaseSink:
    """Convenient defaults for sinks: a sink is a destination, the delivery engine does the rest.

    ``handle(event)`` sends and raises on failure (``guardtower._delivery.TransientError`` when a retry may
    help); a sink that sends several events in one go defines ``handle_batch(events)`` too (without it, the
    engine hands over one event at a time, so a failure names exactly the event it concerns); ``close()``
    shuts the destination down. Attributes the engine reads (with these defaults for sinks that do not subclass
    ``BaseSink``): ``rank_zero_only`` — with ``main_process_only`` buses, act on rank 0 only (remote sinks:
    trackers, alerts); ``queue_size`` — the bound of the queue;
    ``spool`` — a ``Spool`` for what cannot be delivered (None: counted as dropped); ``replay_spool`` —
    the engine re-sends the spool itself once the destination answers again (else ``guardtower replay``
    does); ``retry`` — a ``RetryPolicy`` (None: one attempt).
    """

    name: str = "sink"
    rank_zero_only: bool = True
    queue_size: int = _DEFAULT_QUEUE_SIZE
    spool: Any = None
    replay_spool: bool = False
    retry: Any = None

    def handle(self, event: Event) -> None:
        raise NotImplementedError

    def use_log_dir(self, log_dir: Path) -> None:
        """A guard with ``log_dir`` adopted this sink: sinks with a default spool may move it there."""
        return None

    def flush(self, timeout: float | None = None) -> bool:
        return True

    def close(self, timeout: float | None = None) -> None:
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


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
    """Fan events out to sinks, each behind its own bounded queue and worker thread."""

    def __init__(self, sinks: Iterable[Sink] = (), *, main_process_only: bool = True) -> None:
        if sinks is None or isinstance(sinks, (str, bytes)) or not isinstance(sinks, Iterable):
            raise ConfigError("sinks", f"expected a list of sinks, got {type(sinks).__name__}",
                              "pass e.g. sinks=[JsonlSink('sg_logs/events.jsonl')] (or nothing)")
        if not isinstance(main_process_only, bool):
            raise ConfigError("main_process_only", f"expected True or False, got {main_process_only!r}",
                              "pass a bool")
        self.main_process_only = main_process_only
        self._deliveries: list[Delivery] = []
        self._published = 0
        self._closed = False
        self._env_rank = current_rank()
        for sink in list(sinks):
            self.add_sink(sink)
        _live_buses.add(self)
        on_fork(self)

    def add_sink(self, sink: Sink) -> None:
        """Attach a sink; raises ``ConfigError`` now for an object that cannot be one."""
        check_sink(sink)
        if self._closed:
            raise ConfigError("sink", "the bus is closed", "create a new EventBus")
        name = str(getattr(sink, "name", type(sink).__name__))
        taken = {d.sink_id for d in self._deliveries}
        sink_id, n = name, 1
        while sink_id in taken:
            n += 1
            sink_id = f"{name}#{n}"
        self._deliveries.append(Delivery(sink, sink_id))

    @property
    def sinks(self) -> list[Sink]:
        return [d.sink for d in self._deliveries]

    def publish(self, event: Event) -> None:
        """Queue ``event`` for every sink. Never blocks; raises only ``ConfigError`` for a non-event."""
        if not isinstance(event, Event):
            raise ConfigError("event", f"expected a guardtower.events.Event, got {type(event).__name__}",
                              "publish instances of the classes in guardtower.events")
        self._published += 1
        if _taps:
            _call_taps(event)
        remote_ok = not self.main_process_only or self._is_rank_zero()
        for delivery in self._deliveries:
            if delivery.rank_zero_only and not remote_ok:
                continue
            delivery.offer(event)

    def _is_rank_zero(self) -> bool:
        # The process group may be initialised after the bus was made; the environment does not change.
        if is_distributed():
            return current_rank() == 0
        return self._env_rank == 0

    def flush(self, timeout: float | None = None) -> bool:
        """Deliver everything queued (alert groups too) and flush every sink; False at the deadline.

        ``timeout=None`` means the default bound (``guardtower._delivery.DEFAULT_TIMEOUT_S``), not forever.
        """
        deadline = time.monotonic() + (DEFAULT_TIMEOUT_S if timeout is None else max(0.0, timeout))
        targets = [(d, d.request_flush()) for d in self._deliveries]
        return all([d.wait_flushed(target, deadline) for d, target in targets])

    def close(self, timeout: float | None = None) -> None:
        """Deliver what is queued, spool or count the rest, and close the sinks, all within ``timeout``.

        Sinks close concurrently against one deadline; the spool is written before it. ``None`` means
        the default bound, not forever.
        """
        if self._closed:
            return
        self._closed = True
        _live_buses.discard(self)
        close_all(self._deliveries, timeout)

    def stats(self) -> dict[str, Any]:
        """Events published, and per sink id: name, published, delivered, spooled, dropped (and why),
        failed, pending. Per sink, delivered + spooled + dropped + failed + pending = published."""
        return {"published": self._published, "closed": self._closed,
                "sinks": {d.sink_id: d.stats() for d in self._deliveries}}

    def _after_fork(self) -> None:
        self._published = 0

    def __repr__(self) -> str:
        return f"EventBus(sinks={[d.sink_id for d in self._deliveries]!r})"


def check_sink(sink: Any, argument: str = "sink") -> None:
    """Raise ``ConfigError`` for an object that cannot be a sink (without attaching it anywhere)."""
    for method in ("handle", "flush", "close"):
        if not callable(getattr(sink, method, None)):
            raise ConfigError(
                argument,
                f"{type(sink).__name__} has no callable {method}()",
                "pass an object implementing the Sink protocol (subclass guardtower.bus.BaseSink)",
            )


def check_bus_args(bus: EventBus | None, sinks: Iterable[Sink] | None) -> list[Sink]:
    """Validate a producer's ``bus=`` and ``sinks=`` arguments without attaching anything; returns the sinks."""
    if bus is not None and not isinstance(bus, EventBus):
        raise ConfigError("bus", f"expected an EventBus, got {type(bus).__name__}", "pass guardtower.EventBus(...)")
    if sinks is not None and (isinstance(sinks, (str, bytes)) or not isinstance(sinks, Iterable)):
        raise ConfigError("sinks", f"expected a list of sinks, got {type(sinks).__name__}",
                          "pass e.g. sinks=[JsonlSink('sg_logs/events.jsonl')]")
    sink_list = list(sinks or ())
    for sink in sink_list:
        check_sink(sink, "sinks")
    return sink_list


def adopt_log_dir(sinks: Iterable[Sink], log_dir: Path) -> None:
    """Sinks whose spool is not set explicitly keep it under ``log_dir/spool`` (a guard's log folder)."""
    for sink in sinks:
        adopt = getattr(sink, "use_log_dir", None)
        if callable(adopt):
            adopt(Path(log_dir))


def resolve_bus(bus: EventBus | None, sinks: Iterable[Sink] | None) -> tuple[EventBus, bool]:
    """The bus a producer publishes to, and whether the producer owns it (and must close it).

    ``sinks`` are added to ``bus`` when both are given; with neither, a bus without sinks is made (events
    still reach ``capture_events``).
    """
    sink_list = check_bus_args(bus, sinks)
    if bus is None:
        return EventBus(sink_list), True
    for sink in sink_list:
        bus.add_sink(sink)
    return bus, False


_live_buses: "weakref.WeakSet[EventBus]" = weakref.WeakSet()


def _flush_at_exit() -> None:
    """Close every live bus's sinks concurrently within ``EXIT_FLUSH_TIMEOUT_S`` in total."""
    buses = list(_live_buses)
    for bus in buses:
        bus._closed = True
        _live_buses.discard(bus)
    close_all([d for bus in buses for d in bus._deliveries], EXIT_FLUSH_TIMEOUT_S)


atexit.register(_flush_at_exit)
