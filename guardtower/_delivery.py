"""The one delivery engine behind every sink (OpenTelemetry's BatchProcessor/exporter split).

A sink is only a destination: ``handle(event)`` (or ``handle_batch(events)``, to send several in one go)
sends and raises on failure (``TransientError`` when trying again may help), ``close()`` shuts it down.
``Delivery`` owns everything else, once, for every sink: the bounded queue and its worker thread, batching
(or a sink's own grouping ``Batcher``), the retry policy (tenacity, honouring Retry-After against a
deadline), a destination's rate limit, the durable spool with acknowledgements and replay, drop and failure
counting with a reason, one rate-limited failure log, fork re-initialisation, and bounded flush/close.

Accounting: every event offered to a sink ends as exactly one of delivered, spooled, dropped (with a
reason) or failed; until then it is pending. ``close()`` writes what is still pending to the spool
*before* its deadline (a fifth of the time, at most 1 s, is reserved for that) or counts it as dropped.
``offer()`` runs on the training thread: it appends to memory and never blocks, raises or touches the
disk.

Persist before you try: for a sink with a spool (trackers, alerts) a second engine thread, the
persister, appends every accepted event to the spool within ``_PERSIST_WAIT_S`` (batched, fsync at the
spool's bounded cadence) before the worker's first delivery attempt; a delivered event is acknowledged
after. So kill -9 leaves every event accepted more than about a second earlier for ``guardtower replay``,
and SIGTERM (the engine hooks it while its handler is the default) first persists what is in memory.

Refused vs unreachable: ``TransientError`` means the destination is unreachable (the event waits in the
spool); any other error, or ``PartialFailure``, means it refused the event (resending cannot help): the
event is quarantined in ``<spool>.refused`` with its reason and counted failed, and the rest flows, live
and on replay. No exception stops a worker.
"""

from __future__ import annotations

import collections
import logging
import os
import random
import signal
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Protocol, Sequence

from guardtower import _validate
from guardtower.errors import ConfigError
from guardtower.events import Event

__all__ = [
    "Refused",
    "Batch",
    "Batcher",
    "Delivery",
    "Handled",
    "FailureLog",
    "PartialFailure",
    "RetryPolicy",
    "TransientError",
    "DEFAULT_TIMEOUT_S",
    "check_spool_path",
    "close_all",
    "on_fork",
    "send_with_retry",
    "spool_reserve",
]

logger = logging.getLogger("guardtower.delivery")

#: the bound ``flush(None)``/``close(None)`` use: never forever
DEFAULT_TIMEOUT_S = 10.0
_DEFAULT_QUEUE_SIZE = 10_000
_BATCH_MAX = 512
#: events of a full queue parked in memory for the worker to spool (sinks with a spool only)
_OVERFLOW_MAX = 10_000
_IDLE_WAIT_S = 0.5
#: the longest an accepted event waits in memory before the persister writes it to the spool
_PERSIST_WAIT_S = 0.2
#: how long SIGTERM waits for the persisters before the process goes on to end
_SIGTERM_PERSIST_S = 2.0
_ACCEPTED = "accepted; not delivered yet (the process ended or was killed first)"
_PROBE_MIN_S = 0.5
_PROBE_MAX_S = 30.0


class TransientError(Exception):
    """A failure worth retrying (timeout, disconnect, 5xx, 429). ``reason`` is safe to log.

    ``retry_after``: the wait the destination asked for; with ``pause`` (a 429) it holds every sink
    posting to that destination, not just this retry.
    """

    def __init__(self, reason: str, retry_after: float | None = None, *, pause: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry_after = retry_after
        self.pause = pause


class Refused(Exception):
    """The destination refused this event: sending it again cannot help. ``reason`` is safe to log."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def is_refusal(exc: BaseException) -> bool:
    """True when ``exc`` says the destination refused (not: could not be reached)."""
    return not isinstance(exc, TransientError) and (isinstance(exc, Refused) or getattr(exc, "permanent", True))


class PartialFailure(Exception):
    """A sink delivered a batch except ``failed`` (events it could not take); those are counted failed."""

    def __init__(self, failed: Sequence[Event], reason: str) -> None:
        super().__init__(reason)
        self.failed = list(failed)
        self.reason = reason


@dataclass(frozen=True)
class RetryPolicy:
    """How hard to try one batch before it goes to the spool.

    Transient failures are retried with exponential backoff and full jitter (``initial_backoff * 2**n``,
    capped at ``max_backoff``); a Retry-After replaces the backoff, capped at ``max_retry_after``.
    Retrying stops after ``max_attempts``, when the next wait would cross ``deadline`` seconds since the
    first attempt, or when the sink is closing. ``connect_timeout``/``read_timeout`` bound one HTTP attempt.
    """

    max_attempts: int = 5
    initial_backoff: float = 0.5
    max_backoff: float = 30.0
    deadline: float = 60.0
    max_retry_after: float = 60.0
    connect_timeout: float = 3.05
    read_timeout: float = 10.0

    def __post_init__(self) -> None:
        _validate.number("max_attempts", self.max_attempts, minimum=1, integer=True)
        for name in ("initial_backoff", "max_backoff", "max_retry_after"):
            _validate.number(name, getattr(self, name), minimum=0)
        for name in ("deadline", "connect_timeout", "read_timeout"):
            _validate.number(name, getattr(self, name), above=0)


@dataclass(frozen=True)
class Batch:
    """Events sent in one go; ``note`` is a sink's own message (an alert ``Notification``), or None."""

    events: tuple[Event, ...]
    note: Any = None


@dataclass(frozen=True)
class Handled:
    """A ``Batch.note`` for events a batcher dealt with itself: filtered out (``reason=""``, counted
    delivered) or refused before sending (spooled with ``reason``)."""

    reason: str = ""


class Batcher(Protocol):
    """How a sink's events become batches. The default chunks the queue; alerts group by incident."""

    def add(self, events: list[Event], now: float) -> list[Batch]: ...

    def due(self, now: float, drain: bool) -> list[Batch]: ...

    def next_due(self) -> float | None:
        """Seconds until a held batch is due, or None when nothing waits."""

    def held(self) -> int:
        """Events (and messages) held back, not yet returned in a batch."""


class _Chunks:
    def add(self, events: list[Event], now: float) -> list[Batch]:
        return [Batch(tuple(events))]

    def due(self, now: float, drain: bool) -> list[Batch]:
        return []

    def next_due(self) -> float | None:
        return None

    def held(self) -> int:
        return 0


class FailureLog:
    """Warnings about one sink's failures: the first ``first`` of each reason, then every ``every``-th."""

    def __init__(self, what: str, *, first: int = 3, every: int = 100) -> None:
        self.what = what
        self.first = first
        self.every = every
        self._seen: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def warn(self, reason: str, count: int = 1, action: str = "") -> None:
        key = reason.split(":", 1)[0]
        with self._lock:
            self._seen[key] += 1
            n = self._seen[key]
        if n <= self.first or n % self.every == 0:
            suffix = f"; {action}" if action else ""
            repeat = f" (failure #{n} of this kind)" if n > 1 else ""
            logger.warning("guardtower %s: %d event(s) not delivered: %s%s%s", self.what, count, reason, suffix,
                           repeat)


def spool_reserve(timeout: float) -> float:
    """The part of a close timeout kept for writing the spool."""
    return min(1.0, max(0.0, 0.2 * timeout))


def _interrupted_sleep(stop: threading.Event) -> Callable[[float], None]:
    def sleep(seconds: float) -> None:
        stop.wait(seconds)

    return sleep


def send_with_retry(export: Callable[[Batch], None], batch: Batch, policy: RetryPolicy | None, *,
                    stop: threading.Event, throttle: Any = None, sleep: Callable[[float], None] | None = None,
                    clock: Callable[[], float] = time.monotonic, rng: random.Random | None = None) -> int:
    """``export(batch)`` under ``policy``; returns the attempts it took, re-raises the last error.

    ``throttle`` (``reserve()``/``sent()``/``pause(s)``) paces every attempt to one destination; every wait is a
    wait on ``stop``, so closing interrupts it.
    """
    def attempt() -> None:
        if stop.is_set():
            raise TransientError("sink closing")
        delay = throttle.reserve() if throttle is not None else 0.0
        if delay > 0 and stop.wait(delay):
            raise TransientError("sink closing while rate-limited")
        try:
            export(batch)
        except TransientError as exc:
            if exc.pause and exc.retry_after is not None and throttle is not None:
                throttle.pause(exc.retry_after)
            raise
        finally:
            if throttle is not None:
                throttle.sent()

    if policy is None:
        attempt()
        return 1
    import tenacity

    generator = rng or random.Random()

    def wait(state: tenacity.RetryCallState) -> float:
        exc = state.outcome.exception() if state.outcome else None
        if isinstance(exc, TransientError) and exc.retry_after is not None:
            return min(exc.retry_after, policy.max_retry_after)
        backoff = min(policy.max_backoff, policy.initial_backoff * 2 ** (state.attempt_number - 1))
        return generator.uniform(0, backoff)

    retrying = tenacity.Retrying(
        stop=tenacity.stop_any(tenacity.stop_after_attempt(policy.max_attempts),
                               tenacity.stop_before_delay(policy.deadline),
                               tenacity.stop_when_event_set(stop)),
        wait=wait,
        retry=tenacity.retry_if_exception_type(TransientError),
        sleep=sleep or _interrupted_sleep(stop),
        reraise=True,
    )
    retrying(attempt)
    return int(retrying.statistics.get("attempt_number", 1))


_live: "weakref.WeakSet[Any]" = weakref.WeakSet()


def on_fork(obj: Any) -> None:
    """Register ``obj``: its ``_after_fork()`` runs in a forked child (the one fork registry)."""
    _live.add(obj)


def _reinit_after_fork() -> None:
    for obj in list(_live):
        obj._after_fork()


os.register_at_fork(after_in_child=_reinit_after_fork)


class Delivery:
    """One sink's queue, worker, retries, spool and counters."""

    def __init__(self, sink: Any, sink_id: str) -> None:
        self.sink = sink
        self.sink_id = sink_id
        self.name: str = str(getattr(sink, "name", type(sink).__name__))
        self.rank_zero_only = bool(getattr(sink, "rank_zero_only", True))
        self.maxsize = int(getattr(sink, "queue_size", _DEFAULT_QUEUE_SIZE))
        self.batch_max = int(getattr(sink, "batch_max", _BATCH_MAX))
        self.log = FailureLog(f"sink {self.name!r}")
        # while the destination is down, the spool is probed every retry_interval, doubling up to the max
        self._probe_min = float(getattr(sink, "retry_interval", _PROBE_MIN_S))
        self._probe_max = max(self._probe_min, float(getattr(sink, "max_retry_interval", _PROBE_MAX_S)))
        make_batcher = getattr(sink, "make_batcher", None)
        self._make_batcher: Callable[[], Batcher] = make_batcher if callable(make_batcher) else _Chunks
        # a sink with only handle(): the engine loops over its events, so it sends them one at a time; one
        # that raises then leaves no doubt which got through (the ones before it are never sent twice)
        self._one_by_one = not any(callable(getattr(sink, m, None)) for m in ("export", "handle_batch"))
        self._reset()
        self._persist = self._spool() is not None
        on_fork(self)
        spool = self._spool()
        # replay_spool: the engine itself re-sends the spool once the destination answers again (and a
        # previous process's leftovers first); otherwise the spool waits for ``guardtower replay``
        self.replay_spool = bool(getattr(sink, "replay_spool", False))
        if spool is not None and self.replay_spool and spool.path.exists():
            if spool.has_pending():  # a previous process's leftovers go first, even before a new event
                self._backlog = True
                self._start()

    # -- state ------------------------------------------------------------------------------------------

    def _reset(self) -> None:
        # _qlock guards only what publish touches (queue, parked overflow, offer counters), so the
        # training thread never waits for the worker's grouping or accounting under _cond.
        self._qlock = threading.Lock()
        self._cond = threading.Condition(threading.Lock())
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._queue: collections.deque[Event] = collections.deque()
        self._overflow: list[Event] = []
        # persist before you try: _queue -> (persister appends to the spool) -> _ready -> worker
        self._ready: collections.deque[Event] = collections.deque()
        self._on_disk: set[str] = set()  # ids of live (unfinished) events that are in the spool
        self._persisting = False
        self._plock = threading.Lock()
        self._pwake = threading.Event()
        self._persister: threading.Thread | None = None
        self._offered = 0
        self._refused: collections.Counter[str] = collections.Counter()  # dropped at offer, under _qlock
        self._closed = False
        self._batcher = self._make_batcher()
        self._inflight: list[Batch] = []
        self._orphaned: set[int] = set()
        self._counts: collections.Counter[str] = collections.Counter()
        self._dropped: collections.Counter[str] = collections.Counter()
        self._thread: threading.Thread | None = None
        self._closing = False
        self._flush_asked = 0
        self._flush_done = 0
        self._backlog = False
        self._probe_at = 0.0
        self._probe_wait = self._probe_min

    def _after_fork(self) -> None:
        """In a forked child: forget the parent's queue, counters and thread; never re-send them."""
        reinit = getattr(self.sink, "_after_fork", None)
        if callable(reinit):
            reinit()  # first: the sink's own locks may have been held by a parent thread at fork time
        self._reset()

    def _spool(self) -> Any:
        spool = getattr(self.sink, "spool", None)
        return spool if spool is not None and hasattr(spool, "append_many") else None

    # -- the training thread ------------------------------------------------------------------------------

    def offer(self, event: Event) -> None:
        """Queue ``event``: memory only, never waits for the worker."""
        with self._qlock:
            self._offered += 1
            if self._closed:
                self._refused["published after close"] += 1
                return
            if len(self._queue) < self.maxsize:
                self._queue.append(event)
            elif self._spool() is not None and len(self._overflow) < _OVERFLOW_MAX:
                self._overflow.append(event)  # the worker spools it
            else:
                self._refused["queue full"] += 1
                return
        wake = self._pwake if self._persist else self._wake
        if not wake.is_set():
            wake.set()
        if self._thread is None:
            self._start()

    def _start(self) -> None:
        with self._cond:
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, name=f"guardtower-sink-{self.name}", daemon=True)
                self._thread.start()
                if self._persist:
                    self._persister = threading.Thread(target=self._persist_run, daemon=True,
                                                       name=f"guardtower-spool-{self.name}")
                    self._persister.start()
                    _hook_sigterm()

    # -- the persister --------------------------------------------------------------------------------------

    def _persist_run(self) -> None:
        while True:
            self._pwake.wait(_PERSIST_WAIT_S)
            self._pwake.clear()
            try:
                if not self._persist_once():
                    return
            except Exception as exc:  # never stop: the worker still sends what reached _ready
                self.log.warn(f"internal error while spooling: {_describe(exc)}", 0)
                self._stop.wait(0.05)

    def _persist_once(self) -> bool:
        """Move what offer() queued to the spool and on to the worker; False once closed and empty."""
        with self._plock:
            with self._qlock:
                events = list(self._queue)
                self._queue.clear()
                overflow, self._overflow = self._overflow, []
                room = self.maxsize - len(self._ready)
                self._persisting = bool(events or overflow)
                closed = self._closed
            if not events and not overflow:
                return not closed
            keep: list[Event] = []
            durable: list[Event] = []
            on_disk = False
            try:
                keep, spill = events[:max(0, room)], overflow + events[max(0, room):]
                wanted = getattr(self.sink, "accepts", None)  # an alert sink ignores most kinds: no disk for those
                durable = [e for e in keep if wanted(e)] if callable(wanted) else keep
                if durable:
                    try:
                        self._spool().append_many(durable, _ACCEPTED, self._spool_sink(), sync=False)
                        on_disk = True
                    except Exception as exc:
                        self.log.warn(f"spool not writable: {_describe(exc)}", len(keep),
                                      "sending without a copy on disk")
                if spill:  # the worker cannot keep up: these wait in the spool
                    self._to_spool(spill, "bus queue full", enter_backlog=True)
            finally:
                with self._qlock:
                    if events:
                        if on_disk:
                            self._on_disk.update(e.event_id for e in durable)
                        self._ready.extend(keep)
                    self._persisting = False
            self._wake.set()
            return True

    def persist_now(self, deadline: float) -> None:
        """Get everything in memory onto the spool before ``deadline`` (SIGTERM)."""
        while time.monotonic() < deadline:
            with self._qlock:
                busy = bool(self._queue or self._overflow or self._persisting)
            if not busy or self._persister is None or not self._persister.is_alive():
                break
            self._pwake.set()
            time.sleep(0.01)
        spool = self._spool()
        if spool is not None:
            try:
                spool.sync()
            except OSError:
                pass

    # -- the worker ---------------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            try:
                if not self._run_once():
                    return
            except Exception as exc:  # no exception stops a worker: account for what it held, go on
                with self._cond:
                    stuck, self._inflight = self._inflight, []
                self.log.warn(f"internal error: {_describe(exc)}", sum(len(b.events) for b in stuck))
                self._to_spool([e for b in stuck for e in b.events], f"internal error: {_describe(exc)}")
                self._stop.wait(0.05)

    def _run_once(self) -> bool:
        """One round of the worker; False when it is done."""
        self._wake.clear()  # before looking: an event offered from now on sets it again
        with self._cond:
            if self._closed:
                return False
            batches, overflow = self._take_locked()
            queue_empty = self._drained()
            if not batches and not overflow:
                idle = queue_empty and not self._batcher.held()
                if self._closing and idle:
                    self._flush_done = self._flush_asked
                    self._cond.notify_all()
                    return False
                probe = self._backlog and self._probe_at <= time.monotonic()
                flush = idle and self._flush_asked > self._flush_done
                if not probe and not flush:
                    wait = self._idle_wait()
                    self._cond.release()
                    try:
                        self._wake.wait(wait)
                    finally:
                        self._cond.acquire()
                    return True
            self._inflight = list(batches)
            flush_target = self._flush_asked if queue_empty and self._flush_asked > self._flush_done else None
        if overflow:
            self._to_spool(overflow, "bus queue full", enter_backlog=True)
        if self._backlog:
            self._probe()
        for batch in batches:
            self._send(batch)
        with self._cond:
            self._inflight = []
            self._cond.notify_all()
        if flush_target is not None and not self._batcher.held():
            self._call_sink_flush()
            with self._cond:
                self._flush_done = max(self._flush_done, flush_target)
                self._cond.notify_all()
        return True

    def _drained(self) -> bool:
        """Nothing waits before the batcher (in the queue, with the persister, or ready to send)."""
        with self._qlock:
            return not (self._queue or self._ready or self._overflow or self._persisting)

    def _idle_wait(self) -> float:
        waits = [_IDLE_WAIT_S]
        due = self._batcher.next_due()
        if due is not None:
            waits.append(due)
        if self._backlog:
            waits.append(self._probe_at - time.monotonic())
        return max(0.0, min(waits))

    def _take_locked(self) -> tuple[list[Batch], list[Event]]:
        now = time.monotonic()
        events: list[Event] = []
        source = self._ready if self._persist else self._queue
        with self._qlock:
            while source and len(events) < self.batch_max:
                events.append(source.popleft())
            overflow: list[Event] = []
            if not self._persist:
                overflow, self._overflow = self._overflow, []
            more = bool(self._queue or self._ready or self._overflow or self._persisting)
        batches = self._add(events, now) if events else []
        drain = self._closing or self._flush_asked > self._flush_done
        batches.extend(self._batcher.due(now, drain and not more))
        return [b for b in batches if b.events or b.note is not None], overflow

    def _add(self, events: list[Event], now: float) -> list[Batch]:
        """The batcher's batches; if it raises, event by event, so one bad event takes none of the others."""
        try:
            return self._batcher.add(events, now)
        except Exception:
            batches: list[Batch] = []
            for event in events:
                try:
                    batches += self._batcher.add([event], now)
                except Exception as exc:
                    batches.append(Batch((event,), Handled(f"internal error: {_describe(exc)}")))
            return batches

    def _send(self, batch: Batch) -> None:
        if isinstance(batch.note, Handled):
            self._finish(batch, spool_reason=batch.note.reason or None)
            return
        if self._backlog and self._spool() is not None and not self._stop.is_set():
            self._finish(batch, spool_reason="destination unavailable: queued behind the spool", backlog=True)
            return
        if self._one_by_one and batch.note is None and len(batch.events) > 1:
            self._send_each(batch)
            return
        try:
            send_with_retry(self._export, batch, getattr(self.sink, "retry", None), stop=self._stop,
                            throttle=getattr(self.sink, "throttle", None), sleep=getattr(self.sink, "sleep", None))
        except TransientError as exc:
            self._finish(batch, spool_reason=exc.reason, backlog=True)
        except PartialFailure as exc:
            failed = {id(e) for e in exc.failed}
            self._finish(batch, failed_events=[e for e in batch.events if id(e) in failed], reason=exc.reason)
        except Exception as exc:  # refused by the destination (or a sink's bug): resending cannot help
            reason = _describe(exc)
            if batch.note is None and len(batch.events) > 1:
                self._send_each(batch)  # one bad event must not take the others down
            else:
                self._finish(batch, failed_events=list(batch.events), reason=reason)
        else:
            self._finish(batch)

    def _send_each(self, batch: Batch) -> None:
        """Send ``batch`` event by event, each in flight on its own (unless ``close`` already spooled it)."""
        singles = [Batch((event,)) for event in batch.events]
        if self._claim(batch, replaced_by=singles):
            for single in singles:
                self._send(single)

    def _claim(self, batch: Batch, replaced_by: Sequence[Batch] = ()) -> bool:
        """Take ``batch`` back from the in-flight list (putting ``replaced_by`` in flight in its place, in one
        step, so ``close`` accounts for them); False when ``close`` already spooled it."""
        with self._cond:
            if id(batch) in self._orphaned:
                self._orphaned.discard(id(batch))
                return False
            self._inflight = [b for b in self._inflight if b is not batch] + list(replaced_by)
            return True

    def _export(self, batch: Batch) -> None:
        export = getattr(self.sink, "export", None)
        if callable(export):
            export(batch)
            return
        handle_batch = getattr(self.sink, "handle_batch", None)
        if callable(handle_batch):
            handle_batch(list(batch.events))
            return
        for event in batch.events:
            self.sink.handle(event)

    def _finish(self, batch: Batch, *, spool_reason: str | None = None, failed_events: Sequence[Event] = (),
                reason: str = "", backlog: bool = False) -> None:
        """Account for a batch the worker is done with (unless ``close`` already spooled it)."""
        if not self._claim(batch):  # close() spooled it while it was in flight; if it got through, say so
            if spool_reason is None and not failed_events:
                self._ack(batch.events, live=False)
            return
        if spool_reason is not None:
            self._to_spool(list(batch.events), spool_reason, enter_backlog=backlog)
            return
        failed = len(failed_events)
        quarantined = self._quarantine(failed_events, reason) if failed else False
        self._ack(batch.events)
        with self._cond:
            self._counts["delivered"] += len(batch.events) - failed
            self._counts["failed"] += failed
            if quarantined:
                self._counts["quarantined"] += failed
        if failed:
            where = f"quarantined in {self._spool().refused_path}" if quarantined else "counted as failed"
            self.log.warn(reason, failed, where)

    def _quarantine(self, events: Sequence[Event], reason: str) -> bool:
        spool = self._spool()
        if spool is None:
            return False
        try:
            spool.quarantine_many(events, reason, self._spool_sink())
        except Exception:
            logger.debug("guardtower: could not quarantine refused events", exc_info=True)
            return False
        return True

    def _spool_sink(self) -> str:
        return str(getattr(self.sink, "spool_sink", self.name))

    # -- spool, backlog and replay -----------------------------------------------------------------------

    def _to_spool(self, events: list[Event], reason: str, *, enter_backlog: bool = False) -> bool:
        if not events:
            return True
        spool = self._spool()
        if spool is None:
            with self._cond:
                self._dropped[f"undeliverable: {reason}"] += len(events)
            self.log.warn(reason, len(events), "dropped (this sink has no spool)")
            return False
        with self._qlock:  # already on disk since the persister: write only the reason, not the event again
            on_disk = [e for e in events if e.event_id in self._on_disk]
            self._on_disk.difference_update(e.event_id for e in on_disk)
        ids = {id(e) for e in on_disk}
        todo = [e for e in events if id(e) not in ids] if on_disk else events
        if on_disk and not reason.startswith("destination unavailable"):
            todo = events  # the latest line's reason is what replay --list shows
        try:
            if todo:
                spool.append_many(todo, reason, self._spool_sink())
        except Exception as exc:
            why = f"spool not writable: {getattr(exc, 'strerror', None) or type(exc).__name__}"
            lost = [e for e in todo if id(e) not in ids]
            with self._cond:
                self._dropped[why] += len(lost)
                self._counts["spooled"] += len(events) - len(lost)
            self.log.warn(f"{why} (after: {reason})", len(lost), f"dropped; spool {spool.path}")
            return False
        with self._cond:
            self._counts["spooled"] += len(events)
            if enter_backlog and self.replay_spool and not self._backlog:
                self._backlog = True
                self._probe_at = time.monotonic() + self._probe_wait
        if not reason.startswith("destination unavailable"):
            self.log.warn(reason, len(events), f"spooled to {spool.path}")
        return True

    def _ack(self, events: Sequence[Event], *, live: bool = True) -> None:
        """Acknowledge delivered (or quarantined) events that are in the spool."""
        spool = self._spool()
        if spool is None:
            return
        if live:
            with self._qlock:
                ids = [e.event_id for e in events if e.event_id in self._on_disk]
                self._on_disk.difference_update(ids)
        else:
            ids = [e.event_id for e in events]
        if not ids:
            return
        try:
            spool.ack_many(ids, sync=False)
        except Exception:
            logger.debug("guardtower: could not acknowledge spooled events", exc_info=True)

    def _probe(self) -> None:
        """While the destination is down: replay the spool in order once it answers again."""
        if time.monotonic() < self._probe_at:
            return
        spool = self._spool()
        if not spool.ackable():  # sending without acknowledging would resend the same events every time
            self.log.warn(f"spool {spool.path} is read-only: cannot acknowledge, not replaying", 0)
            with self._cond:
                self._backlog = False
            return
        # the persister waits while the spool is replayed: an event it wrote during the replay would be read
        # back by the replay and sent by the worker too (a duplicate); new events wait in memory meanwhile
        with self._plock:
            sent, ok = self._replay_pending(spool)
        with self._cond:
            self._counts["replayed"] += sent
            if ok:
                self._backlog = False
                self._probe_wait = self._probe_min
            else:
                self._probe_wait = min(self._probe_max, self._probe_wait * 2)
                self._probe_at = time.monotonic() + self._probe_wait

    def _replay_pending(self, spool: Any) -> tuple[int, bool]:
        """Send the spool's pending entries in order; (how many were sent, whether all were)."""
        sent, ok = 0, True
        with self._qlock:
            live = set(self._on_disk)  # accepted but not tried yet: the worker sends those itself
        try:
            size = 1 if self._one_by_one else int(getattr(self.sink, "replay_batch", self.batch_max))
            for chunk in spool.pending_chunks(size):
                if self._stop.is_set():
                    ok = False
                    break
                chunk = [e for e in chunk if e.event_id not in live]
                if not chunk:
                    continue
                batch = Batch(tuple(chunk))
                try:
                    send_with_retry(self._export, batch, getattr(self.sink, "retry", None), stop=self._stop,
                                    throttle=getattr(self.sink, "throttle", None), sleep=getattr(self.sink, "sleep", None))
                except TransientError:
                    ok = False
                    break
                except Exception as exc:  # the destination refuses these events: quarantine them, go on
                    failed = exc.failed if isinstance(exc, PartialFailure) else chunk
                    reason = _describe(exc)
                    spool.quarantine_many(failed, reason, self._spool_sink())
                    spool.ack_many([e.event_id for e in chunk])
                    self.log.warn(f"refused on replay: {reason}", len(failed), f"quarantined in {spool.refused_path}")
                    with self._cond:
                        self._counts["replay_refused"] += len(failed)
                    sent += len(chunk) - len(failed)
                    continue
                spool.ack_many([e.event_id for e in chunk])
                sent += len(chunk)
        except OSError as exc:
            ok = False
            self.log.warn(f"spool not usable: {exc.strerror or type(exc).__name__}", 0)
        return sent, ok

    # -- flush and close ---------------------------------------------------------------------------------

    def request_flush(self) -> int:
        with self._cond:
            self._flush_asked += 1
            target = self._flush_asked
        self._wake.set()
        if self._thread is None:
            self._start()
        return target

    def wait_flushed(self, target: int, deadline: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._flush_done >= target or self._closed,
                                       max(0.0, deadline - time.monotonic())) and not self._closed

    def _call_sink_flush(self) -> None:
        flush = getattr(self.sink, "flush", None)
        if callable(flush):
            try:
                flush(None)
            except Exception as exc:
                self.log.warn(f"flush() raised: {_describe(exc)}", 0)

    def begin_close(self) -> None:
        with self._cond:
            self._closing = True
        self._wake.set()

    def wait_drained(self, until: float) -> bool:
        thread = self._thread
        if thread is not None:
            thread.join(max(0.0, until - time.monotonic()))
            return not thread.is_alive()
        return True

    def take_over(self) -> None:
        """Close time: spool (or count as dropped) whatever the worker has not finished, then stop it."""
        self._stop.set()
        self._wake.set()
        self._pwake.set()
        got = self._plock.acquire(timeout=1.0)  # the persister may hold events between queue and _ready
        try:
            self._take_over_locked()
        finally:
            if got:
                self._plock.release()
        spool = self._spool()
        if spool is not None:
            try:
                spool.sync()
                spool.compact()  # everything delivered: no file left behind
            except OSError:
                pass

    def _take_over_locked(self) -> None:
        with self._cond:
            with self._qlock:
                leftovers = list(self._ready) + list(self._overflow) + list(self._queue)
                self._ready.clear()
                self._overflow.clear()
                self._queue.clear()
                self._closed = True
            held = self._batcher.due(time.monotonic(), True) if self._batcher.held() else []
            for batch in self._inflight:
                self._orphaned.add(id(batch))
            leftovers += [e for batch in self._inflight + held for e in batch.events]
            self._inflight = []
            self._cond.notify_all()
        self._to_spool(leftovers, "sink closed before the event was sent")

    def close_sink(self, timeout: float) -> None:
        close = getattr(self.sink, "close", None)
        if callable(close):
            close(timeout)

    def report(self) -> None:
        stats = self.stats()
        if stats["dropped"] or stats["failed"] or stats["spooled"]:  # the totals: a batch's warning saw only its own
            spool = self._spool()
            logger.warning("guardtower sink %r: %d event(s) not delivered in all: %d dropped %s, %d failed, %d in its "
                           "spool%s", self.name, stats["dropped"] + stats["failed"] + stats["spooled"], stats["dropped"],
                           stats["dropped_reasons"], stats["failed"], stats["spooled"],
                           f" ({spool.path}: `guardtower replay` re-sends them)" if spool is not None and stats["spooled"]
                           else "")

    def stats(self) -> dict[str, Any]:
        """delivered + spooled + dropped + failed + pending = published."""
        with self._cond:
            with self._qlock:
                published = self._offered
                reasons = self._dropped + self._refused
            c = self._counts
            dropped = sum(reasons.values())
            done = c["delivered"] + c["spooled"] + dropped + c["failed"]
            return {
                "name": self.name,
                "published": published,
                "delivered": c["delivered"],
                "spooled": c["spooled"],
                "dropped": dropped,
                "failed": c["failed"],
                "quarantined": c["quarantined"],
                "replay_refused": c["replay_refused"],
                "pending": published - done,
                "replayed": c["replayed"],
                "backlog": self._backlog,
                "dropped_reasons": dict(reasons),
            }


_sigterm_lock = threading.Lock()
_sigterm_hooked = False


def _hook_sigterm() -> None:
    """While SIGTERM has its default action (torchrun, schedulers), persist every live spool first, then
    end the process the same way. A handler the user installed is left alone. Main thread only."""
    global _sigterm_hooked
    with _sigterm_lock:
        if _sigterm_hooked or threading.current_thread() is not threading.main_thread():
            return
        _sigterm_hooked = True
        try:
            if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
                return
            signal.signal(signal.SIGTERM, _on_sigterm)
        except (ValueError, OSError):  # not the main interpreter, or no signals here
            return


def _on_sigterm(signum: int, frame: Any) -> None:
    deadline = time.monotonic() + _SIGTERM_PERSIST_S
    for obj in list(_live):
        if isinstance(obj, Delivery) and obj._persist:
            try:
                obj.persist_now(deadline)
            except Exception:
                pass
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def close_all(deliveries: Iterable[Delivery], timeout: float | None) -> None:
    """Close several sinks concurrently against one deadline (not the sum of their timeouts)."""
    items = list(deliveries)
    timeout = DEFAULT_TIMEOUT_S if timeout is None else max(0.0, float(timeout))
    deadline = time.monotonic() + timeout
    spool_at = deadline - spool_reserve(timeout)
    for d in items:
        d.begin_close()
    for d in items:
        d.wait_drained(spool_at)
    for d in items:
        d.take_over()
    threads = []
    for d in items:
        thread = threading.Thread(target=_quietly, args=(d, max(0.0, deadline - time.monotonic())),
                                  name=f"guardtower-close-{d.name}", daemon=True)
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    for d in items:
        d.report()


def _quietly(delivery: Delivery, timeout: float) -> None:
    try:
        delivery.close_sink(timeout)
    except Exception as exc:
        delivery.log.warn(f"close() raised: {_describe(exc)}", 0)


def _describe(exc: BaseException) -> str:
    from guardtower.alerts._secret import redact

    reason = getattr(exc, "reason", None)
    text = reason if isinstance(reason, str) else f"{type(exc).__name__}: {exc}"
    return redact(text.splitlines()[0] if text else type(exc).__name__)[:300]


def check_spool_path(value: object, default: Path, argument: str = "spool_path") -> Path:
    """The spool file a sink will use (created on first write); ``ConfigError`` now if it cannot be."""
    chosen = _validate.path(argument, value, allow_none=True)
    path = (default if chosen is None else chosen).absolute()
    if path.is_dir():
        raise ConfigError(argument, f"{str(path)!r} is a directory", "pass a file path such as spool.jsonl")
    ancestor = path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir() or not os.access(ancestor, os.W_OK | os.X_OK):
        raise ConfigError(argument, f"cannot create files under {str(path.parent)!r}", "pass a writable path")
    return path
