"""``AlertSink``: the delivery machinery every alert format shares.

The bus hands events to ``handle_batch`` on its worker thread; that only filters them and feeds the
``Grouper`` (microseconds). A small sender thread owned by the sink wakes when a group is due, renders
the message and POSTs it with retries. A message that cannot be delivered, or that is still pending when
``close()`` runs out of time, has its events written to the sink's dead-letter spool with the reason;
``guardtower replay`` re-sends them later. Each payload carries its event ids, so receivers can drop
duplicates, and a spooled event that was delivered after all is acknowledged in the spool.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterable

from guardtower.bus import BaseSink
from guardtower.errors import ConfigError
from guardtower.events import EVENT_TYPES, Event
from guardtower.severity import Severity
from guardtower.spool import Spool, default_spool_dir
from guardtower.alerts._format import RunUrl, run_url_for
from guardtower.alerts._secret import REDACTED, Secret, redact
from guardtower.alerts._transport import DeliveryError, Transport, require_dependencies
from guardtower.alerts.grouping import Grouper, Notification
from guardtower.alerts.policy import GroupPolicy, RetryPolicy, shared_throttle

__all__ = ["AlertSink", "DEFAULT_KINDS"]

logger = logging.getLogger("guardtower.alerts")

#: what alerts by default: failed pre-flights, spikes, rollbacks, halts, stalls (only published with stall_after)
DEFAULT_KINDS = ("preflight", "spike", "rollback", "halt", "stall")
_IDLE_WAIT_S = 1.0
_LOGGED_FAILURES = 10
_PREFLIGHT_STATUS = {"PASS": Severity.INFO, "WARN": Severity.WARN, "FAIL": Severity.ERROR}

_live_sinks: "weakref.WeakSet[AlertSink]" = weakref.WeakSet()


class AlertSink(BaseSink):
    """Base class of the alert sinks. Subclasses set ``kind`` and implement ``render(note)``.

    Arguments shared by every alert sink:

    - ``name``: the sink's name (default: its kind); the spool record's ``sink`` is ``"<kind>:<name>"``.
    - ``kinds``, ``min_severity``: which events alert. Defaults: failed pre-flights (a ``preflight``
      event's status counts as its severity), every spike, rollback and halt.
    - ``grouping``: a ``GroupPolicy`` (Alertmanager-style grouping by fingerprint) or None for one message
      per event.
    - ``rate_limit``: messages per second to one destination, shared by every sink posting there
      (0: unlimited).
    - ``retry``: a ``RetryPolicy``. ``spool_path``: the dead-letter JSONL file (default
      ``<GUARDTOWER_SPOOL_DIR or ./sg_logs/spool>/<kind>[-<name>].jsonl``; created only when needed).
    - ``run_url``: a URL, or a callable ``run name -> URL``, linked from messages (e.g. the W&B or
      MLflow run page a bridge knows).
    - ``send_resolved``: also send a message when an incident clears.
    - ``max_pending``: events that may wait for their group's message; more are spooled.
    - ``clock``, ``sleep``: time source and backoff sleep (tests); the default sleep is an event wait
      that ``close()`` interrupts.
    """

    kind: ClassVar[str] = "alert"
    #: messages per second a destination accepts (Slack: 1)
    default_rate_limit: ClassVar[float] = 0.0
    default_send_resolved: ClassVar[bool] = False
    rank_zero_only = True
    _closing: bool
    _closed: bool
    _overflow: list[Event]
    _overflow_lock: threading.Lock

    def __init__(
        self,
        destination: Secret,
        *,
        name: str | None = None,
        kinds: Iterable[str] | None = None,
        min_severity: Severity | str | int | None = None,
        grouping: GroupPolicy | None = GroupPolicy(),
        rate_limit: float | None = None,
        retry: RetryPolicy | None = None,
        spool_path: str | os.PathLike[str] | None = None,
        run_url: RunUrl = None,
        send_resolved: bool | None = None,
        max_pending: int = 10_000,
        queue_size: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] | None = None,
        throttle_key: str | None = None,
    ) -> None:
        require_dependencies()
        self.name = name or self.kind
        if not isinstance(self.name, str) or not self.name.replace("-", "").replace("_", "").isalnum():
            raise ConfigError("name", f"{name!r} is not a simple name", "use letters, digits, '-' and '_'")
        self.kinds = frozenset(DEFAULT_KINDS if kinds is None else ([kinds] if isinstance(kinds, str) else kinds))
        unknown = self.kinds - set(EVENT_TYPES)
        if unknown:
            raise ConfigError("kinds", f"unknown event kind(s) {sorted(unknown)}", f"use some of {sorted(EVENT_TYPES)}")
        try:
            self.min_severity = None if min_severity is None else Severity.parse(min_severity)
        except (KeyError, ValueError):
            raise ConfigError("min_severity", f"{min_severity!r} is not a severity", "pass INFO, WARN or FAIL") from None
        if grouping is not None and not isinstance(grouping, GroupPolicy):
            raise ConfigError("grouping", f"expected a GroupPolicy or None, got {type(grouping).__name__}",
                              "pass guardtower.alerts.GroupPolicy(...) or None for one message per event")
        rate = self.default_rate_limit if rate_limit is None else rate_limit
        if not isinstance(rate, (int, float)) or rate < 0:
            raise ConfigError("rate_limit", f"expected messages per second >= 0, got {rate!r}", "pass e.g. 1.0")
        if not isinstance(max_pending, int) or max_pending < 1:
            raise ConfigError("max_pending", f"expected an int >= 1, got {max_pending!r}", "pass e.g. 10000")
        if not isinstance(queue_size, int) or queue_size < 1:
            raise ConfigError("queue_size", f"expected an int >= 1, got {queue_size!r}", "pass e.g. 10000")
        if run_url is not None and not (isinstance(run_url, str) or callable(run_url)):
            raise ConfigError("run_url", f"expected a str or a callable, got {type(run_url).__name__}",
                              "pass the run's URL or a function run name -> URL")
        self.spool_path = _spool_path(spool_path, self.kind, self.name)
        self.retry = retry or RetryPolicy()
        self.grouping = grouping
        self.run_url = run_url
        self.send_resolved = self.default_send_resolved if send_resolved is None else bool(send_resolved)
        self.queue_size = queue_size
        self._destination = destination
        self._clock = clock
        self._sleep = sleep
        self._max_pending = max_pending
        self._throttle = shared_throttle(throttle_key or destination.reveal(), 1.0 / rate if rate else 0.0, clock)
        self._spool_obj: Spool | None = None
        self._spool_lock = threading.Lock()
        self._counters = collections.Counter[str]()
        self._reset_runtime()
        _live_sinks.add(self)

    # -- what subclasses provide ---------------------------------------------------------------------------

    def render(self, note: Notification) -> dict[str, Any]:
        """The JSON payload of one message."""
        raise NotImplementedError

    def headers(self, body: bytes) -> dict[str, str]:
        """HTTP headers of one attempt (called per attempt, so signatures carry a fresh timestamp)."""
        return {"Content-Type": "application/json"}

    def link(self, run: str) -> str | None:
        """The run's URL from ``run_url=``, if any."""
        return run_url_for(self.run_url, run)

    # -- the bus side --------------------------------------------------------------------------------------

    def accepts(self, event: Event) -> bool:
        """Whether ``event`` should alert under ``kinds`` and ``min_severity``."""
        if event.kind not in self.kinds:
            return False
        severity = event.severity
        if event.kind == "preflight":
            severity = max(severity, _PREFLIGHT_STATUS.get(str(getattr(event, "status", "")).upper(), Severity.INFO))
        threshold = self.min_severity
        if threshold is None:
            threshold = Severity.ERROR if event.kind == "preflight" else Severity.INFO
        return severity >= threshold

    def handle(self, event: Event) -> None:
        self.handle_batch([event])

    def handle_batch(self, events: list[Event]) -> None:
        self._drain_overflow()
        rejected: list[tuple[Event, str]] = []
        with self._cond:
            for event in events:
                if event.kind == "summary":
                    self._grouper.progress(event.run, event.step)
                if not self.accepts(event):
                    continue
                if self._closing:
                    rejected.append((event, "sink closed before the event was sent"))
                elif not self._grouper.add(event):
                    rejected.append((event, f"overflow: {self._max_pending} alert events already pending"))
            if not self._closing:
                self._start_locked()
            self._cond.notify_all()
        for event, reason in rejected:
            self._spool_events([event], reason)

    def spill(self, event: Event) -> bool:
        """The bus queue is full: the event goes to the spool rather than being dropped.

        Runs on the publishing thread, so it only parks the event in memory; the bus worker (next batch) or
        ``flush``/``close`` writes parked events to the spool in one go. Only when ``max_pending`` events are
        already parked does it write synchronously.
        """
        if not self.accepts(event):
            return True  # it would not alert anyway; nothing is lost
        with self._overflow_lock:
            if len(self._overflow) < self._max_pending:
                self._overflow.append(event)
                return True
        try:
            self._spool_events([event], "bus queue full")
        except Exception:
            return False
        return True

    def _drain_overflow(self) -> None:
        with self._overflow_lock:
            parked, self._overflow = self._overflow, []
        self._spool_events(parked, "bus queue full")

    def resolve(self, *, run: str | None = None, fingerprint: str | None = None) -> None:
        """Clear incidents now (all, one run's, or one fingerprint); PagerDuty gets a resolve."""
        with self._cond:
            self._grouper.resolve(run=run, fingerprint=fingerprint)
            self._start_locked()
            self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Send everything pending now (ignoring group waits); False if not done within ``timeout``."""
        self._drain_overflow()
        with self._cond:
            if self._thread is None:
                return self._grouper.pending_events == 0
            self._flush_requested += 1
            target = self._flush_requested
            self._cond.notify_all()
            return self._cond.wait_for(
                lambda: self._thread_done or (self._flush_done >= target and self._current is None
                                              and not self._outgoing), timeout)

    def close(self, timeout: float | None = None) -> None:
        """Send what is pending within ``timeout``; spool whatever is left (also a message in flight)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            if self._closed:
                return
            self._closing = True
            thread = self._thread
            self._cond.notify_all()
        if thread is not None:
            # leave a fifth of the time to spool what could not be sent
            thread.join(None if deadline is None else max(0.0, (deadline - time.monotonic()) * 0.8))
            if thread.is_alive():
                self._stop.set()  # interrupts backoff and rate-limit waits; an HTTP attempt runs to its timeout
                thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        with self._cond:
            leftovers = list(self._outgoing) + self._grouper.drain()
            self._outgoing.clear()
            if self._current is not None:
                self._current_orphaned = True
                leftovers.append(self._current)
            self._closed = True
            self._stop.set()
            self._cond.notify_all()
        self._spool_events([e for note in leftovers for e in note.events], "sink closed with the message still pending")
        self._drain_overflow()

    # -- replay and stats ----------------------------------------------------------------------------------

    def send_now(self, event: Event) -> None:
        """Deliver one event as its own message on the calling thread; raise ``DeliveryError`` on failure.

        Used by ``guardtower replay``; never spools.
        """
        self._post(Notification.single(event))

    def stats(self) -> dict[str, int]:
        """Counters: events delivered and spooled, messages sent and failed."""
        return dict(self._counters)

    @property
    def spool(self) -> Spool:
        """The dead-letter spool (its directory is created on first use)."""
        with self._spool_lock:
            if self._spool_obj is None:
                self.spool_path.parent.mkdir(parents=True, exist_ok=True)
                self._spool_obj = Spool(self.spool_path)
            return self._spool_obj

    @property
    def sink_id(self) -> str:
        return f"{self.kind}:{self.name}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, url={REDACTED}, spool={str(self.spool_path)!r})"

    # -- the sender thread ---------------------------------------------------------------------------------

    def _reset_runtime(self) -> None:
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._grouper = Grouper(self.grouping, clock=self._clock, send_resolved=self.send_resolved,
                                max_pending=self._max_pending)
        self._transport = Transport(self.retry, self._throttle, self._stop, clock=self._clock, sleep=self._sleep)
        self._outgoing: collections.deque[Notification] = collections.deque()
        self._overflow = []
        self._overflow_lock = threading.Lock()
        self._current: Notification | None = None
        self._current_orphaned = False
        self._thread: threading.Thread | None = None
        self._thread_done = False
        self._flush_requested = self._flush_taken = self._flush_done = 0
        self._closing = False
        self._closed = False

    def _start_locked(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"guardtower-alert-{self.sink_id}", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                note = self._next_locked()
                if note is None:
                    self._thread_done = True
                    self._cond.notify_all()
                    return
                self._current, self._current_orphaned = note, False
            self._deliver(note)

    def _next_locked(self) -> Notification | None:
        while True:
            if self._stop.is_set():
                return None
            if not self._outgoing:
                if self._closing or self._flush_requested > self._flush_taken:
                    self._flush_taken = self._flush_requested
                    self._outgoing.extend(self._grouper.drain())
                else:
                    self._outgoing.extend(self._grouper.due())
            if self._outgoing:
                return self._outgoing.popleft()
            self._flush_done = self._flush_taken
            self._cond.notify_all()
            if self._closing:
                return None
            next_due = self._grouper.next_due()
            wait = _IDLE_WAIT_S if next_due is None else min(_IDLE_WAIT_S, max(0.0, next_due - self._clock()))
            self._cond.wait(wait)

    def _deliver(self, note: Notification) -> None:
        reason = ""
        try:
            self._post(note)
        except DeliveryError as exc:
            reason = exc.reason
        except Exception as exc:  # a rendering bug must not kill the sender thread or lose events
            reason = f"internal error: {type(exc).__name__}: {redact(str(exc))[:300]}"
        with self._cond:
            orphaned = self._current_orphaned
            self._current = None
            self._cond.notify_all()
        if not reason:
            self._counters["messages"] += 1
            self._counters["delivered"] += len(note.events)
            if orphaned:  # close() spooled it meanwhile: mark it done so a replay skips it
                self.spool.ack_many(note.event_ids)
            return
        self._counters["failed_messages"] += 1
        if self._counters["failed_messages"] <= _LOGGED_FAILURES or self._counters["failed_messages"] % 100 == 0:
            logger.warning("guardtower %s alert not delivered (%s); %d event(s) spooled to %s",
                           self.sink_id, reason, len(note.events), self.spool_path)
        if not orphaned:
            try:
                self._spool_events(list(note.events), reason)
            except OSError as exc:  # keep the sender alive; say loudly what could not be kept
                self._counters["lost"] += len(note.events)
                logger.error("guardtower %s could not write its spool %s (%s): %d event(s) lost",
                             self.sink_id, self.spool_path, type(exc).__name__, len(note.events))

    def _post(self, note: Notification) -> None:
        body = json.dumps(self.render(note), allow_nan=False, separators=(",", ":")).encode()
        self._transport.post(self._destination, body, self.headers)

    def _spool_events(self, events: list[Event], reason: str) -> None:
        if not events:
            return
        self.spool.append_many(events, reason, self.sink_id)
        with self._spool_lock:  # several threads spool: worker, sender, close() and spill()
            self._counters["spooled"] += len(events)

    def _after_fork(self) -> None:
        self._reset_runtime()
        self._counters.clear()


def _spool_path(value: str | os.PathLike[str] | None, kind: str, name: str) -> Path:
    default_name = f"{kind}.jsonl" if name == kind else f"{kind}-{name}.jsonl"
    path = (default_spool_dir() / default_name) if value is None else Path(value)
    path = path.expanduser().absolute()
    if path.is_dir():
        raise ConfigError("spool_path", f"{str(path)!r} is a directory", "pass a file path such as alerts.jsonl")
    ancestor = path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir() or not os.access(ancestor, os.W_OK | os.X_OK):
        raise ConfigError("spool_path", f"cannot create files under {str(path.parent)!r}", "pass a writable path")
    return path


def _reinit_after_fork() -> None:
    for sink in list(_live_sinks):
        sink._after_fork()


os.register_at_fork(after_in_child=_reinit_after_fork)

