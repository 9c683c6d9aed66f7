"""``AlertSink``: what every alert format shares, as a destination of the delivery engine.

The engine (``guardtower._delivery``) owns the queue, the worker, retries, the per-destination rate
limit, the dead-letter spool and close. An alert sink only adds its batcher, the ``Grouper``
(Alertmanager-style grouping by incident, clock-driven), and ``export``: render one message and POST it
once. A message that cannot be delivered has its events written to the sink's spool with the reason;
``guardtower replay`` re-sends them later. Each payload carries its event ids, so receivers can drop
duplicates, and a spooled event that was delivered after all is acknowledged in the spool.
"""

from __future__ import annotations

import collections
import inspect
import json
import os
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterable

from guardtower import _validate
from guardtower._delivery import Batch, Handled, RetryPolicy, TransientError, check_spool_path, send_with_retry
from guardtower.bus import BaseSink
from guardtower.errors import ConfigError
from guardtower.events import EVENT_TYPES, Event
from guardtower.severity import Severity
from guardtower.spool import Spool, default_spool_dir
from guardtower.alerts._format import RunUrl, run_url_for
from guardtower.alerts._secret import REDACTED, Secret
from guardtower.alerts._transport import DeliveryError, Transport, require_dependencies
from guardtower.alerts.grouping import Grouper, Notification
from guardtower.alerts.policy import GroupPolicy, shared_throttle

__all__ = ["AlertSink", "DEFAULT_KINDS"]

#: what alerts by default: failed pre-flights, spikes, rollbacks, halts, stalls (only published with stall_after),
#: an exceeded skip budget and a learning-rate back-off
DEFAULT_KINDS = ("preflight", "spike", "rollback", "halt", "stall", "skip_budget", "lr_backoff")
_PREFLIGHT_STATUS = {"PASS": Severity.INFO, "WARN": Severity.WARN, "FAIL": Severity.ERROR}
#: keywords users reach for, and the argument they mean
_ALIASES = {"webhook_url": "url", "webhook": "url", "endpoint": "url", "spool": "spool_path",
            "spool_file": "spool_path", "routing": "routing_key", "integration_key": "routing_key",
            "severity": "min_severity", "retries": "retry", "retry_policy": "retry", "group": "grouping"}


class AlertSink(BaseSink):
    """Base class of the alert sinks. Subclasses set ``kind`` and implement ``render(note)``.

    Arguments shared by every alert sink:

    - ``name``: the sink's name (default: its kind); the spool record's ``sink`` is ``"<kind>:<name>"``.
    - ``kinds``, ``min_severity``: which events alert. Defaults: failed pre-flights (a ``preflight``
      event's status counts as its severity), every spike, rollback and halt, an exceeded skip budget and a
      learning-rate back-off.
    - ``grouping``: a ``GroupPolicy`` (Alertmanager-style grouping by fingerprint) or None for one message
      per event.
    - ``rate_limit``: messages per second to one destination, shared by every sink posting there
      (0: unlimited).
    - ``retry``: a ``RetryPolicy``. ``spool_path``: the dead-letter JSONL file (default
      ``<GUARDTOWER_SPOOL_DIR or ./sg_logs/spool>/<kind>[-<name>].jsonl``, or ``<log_dir>/spool/...``
      when a guard adopts the sink; created only when needed).
    - ``run_url``: a URL, or a callable ``run name -> URL``, linked from messages (e.g. the W&B or
      MLflow run page a bridge knows).
    - ``send_resolved``: also send a message when an incident clears.
    - ``max_pending``: events that may wait for their group's message; more are spooled.
    - ``clock``, ``sleep``: time source and backoff sleep (tests); the default sleep is a wait that
      ``close()`` interrupts.
    """

    kind: ClassVar[str] = "alert"
    #: messages per second a destination accepts (Slack: 1)
    default_rate_limit: ClassVar[float] = 0.0
    default_send_resolved: ClassVar[bool] = False
    rank_zero_only = True
    #: a spooled alert is re-sent as its own message
    replay_batch = 1

    def __new__(cls, *args: Any, **kwargs: Any) -> "AlertSink":
        _validate.no_unknown_kwargs(cls.__name__, kwargs, _known_keywords(cls), _ALIASES)
        return super().__new__(cls)

    def __init__(
        self,
        destination: Secret,
        *,
        name: str | None = None,
        kinds: Iterable[str] | str | None = None,
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
        self.name = self.kind if name is None else _validate.text("name", name, example="'alerts'")
        if not self.name.replace("-", "").replace("_", "").isalnum():
            raise ConfigError("name", f"{name!r} is not a simple name", "use letters, digits, '-' and '_'")
        self.kinds = _validate.choices("kinds", DEFAULT_KINDS if kinds is None else kinds, EVENT_TYPES)
        self.min_severity = _validate.severity("min_severity", min_severity, allow_none=True)
        if grouping is not None and not isinstance(grouping, GroupPolicy):
            raise ConfigError("grouping", f"expected a GroupPolicy or None, got {type(grouping).__name__}",
                              "pass guardtower.alerts.GroupPolicy(...) or None for one message per event")
        rate = _validate.number("rate_limit", self.default_rate_limit if rate_limit is None else rate_limit,
                                minimum=0)
        if retry is not None and not isinstance(retry, RetryPolicy):
            raise ConfigError("retry", f"expected a RetryPolicy or None, got {type(retry).__name__}",
                              "pass guardtower.alerts.RetryPolicy(max_attempts=..., deadline=...)")
        _validate.number("max_pending", max_pending, minimum=1, integer=True)
        self.queue_size = _validate.number("queue_size", queue_size, minimum=1, integer=True)
        if run_url is not None and not (isinstance(run_url, str) or callable(run_url)):
            raise ConfigError("run_url", f"expected a str or a callable, got {type(run_url).__name__}",
                              "pass the run's URL or a function run name -> URL")
        if send_resolved is not None:
            _validate.flag("send_resolved", send_resolved)
        for argument, fn in (("clock", clock), ("sleep", sleep)):
            if fn is not None and not callable(fn):
                raise ConfigError(argument, f"expected a callable, got {type(fn).__name__}", "pass a function")
        _validate.text("throttle_key", throttle_key, allow_none=True, example="a destination key")
        self._explicit_spool = spool_path is not None
        self.spool_path = check_spool_path(spool_path, default_spool_dir() / self._default_spool_name())
        self.retry = retry or RetryPolicy()
        self.grouping = grouping
        self.run_url = run_url
        self.send_resolved = self.default_send_resolved if send_resolved is None else send_resolved
        self.sleep = sleep
        self._destination = destination
        self._clock = clock
        self._max_pending = max_pending
        self.throttle = shared_throttle(throttle_key or destination.reveal(), 1.0 / rate if rate else 0.0, clock)
        self._transport = Transport(self.retry)
        self._spool_obj: Spool | None = None
        self._counters: collections.Counter[str] = collections.Counter()
        self._grouper_lock = threading.Lock()
        # one batcher (and grouper) per bus the sink is on; resolve() reaches all of them
        self._batchers: "weakref.WeakSet[_GroupBatcher]" = weakref.WeakSet()

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

    # -- what the delivery engine calls ---------------------------------------------------------------------

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

    def make_batcher(self) -> "_GroupBatcher":
        batcher = _GroupBatcher(self, Grouper(self.grouping, clock=self._clock, send_resolved=self.send_resolved,
                                              max_pending=self._max_pending))
        self._batchers.add(batcher)
        return batcher

    def export(self, batch: Batch) -> None:
        """Send one message (a spooled event being replayed: one message per event); raise on failure."""
        notes = [batch.note] if batch.note is not None else [Notification.single(e) for e in batch.events]
        for note in notes:
            body = json.dumps(self.render(note), allow_nan=False, separators=(",", ":")).encode()
            self._transport.post(self._destination, body, self.headers)
            self._counters["messages"] += 1
            self._counters["delivered"] += len(note.events)

    def handle(self, event: Event) -> None:
        """Send ``event`` as its own message on the calling thread (the engine normally calls ``export``)."""
        self.send_now(event)

    def resolve(self, *, run: str | None = None, fingerprint: str | None = None) -> None:
        """Clear incidents now (all, one run's, or one fingerprint); PagerDuty gets a resolve."""
        with self._grouper_lock:
            for batcher in list(self._batchers):
                batcher.grouper.resolve(run=run, fingerprint=fingerprint)

    def send_now(self, event: Event) -> None:
        """Deliver one event as its own message on the calling thread, with retries; raise
        ``DeliveryError`` on failure. Used by ``guardtower replay``; never spools."""
        try:
            send_with_retry(self.export, Batch((event,)), self.retry, stop=threading.Event(),
                            throttle=self.throttle, sleep=self.sleep)
        except TransientError as exc:
            raise DeliveryError(exc.reason, permanent=False, attempts=self.retry.max_attempts) from None

    def stats(self) -> dict[str, int]:
        """Messages sent, the events they delivered, and attempts that timed out (a timed-out message may
        have arrived: it is retried, and receivers drop the duplicate by event id). The bus's ``stats()``
        has the full accounting."""
        return {**self._counters, "timeouts": self._transport.timeouts}

    @property
    def spool(self) -> Spool:
        """The dead-letter spool (its folder is created on the first write)."""
        if self._spool_obj is None or self._spool_obj.path != self.spool_path:
            self._spool_obj = Spool(self.spool_path)
        return self._spool_obj

    @property
    def sink_id(self) -> str:
        return f"{self.kind}:{self.name}"

    spool_sink = sink_id

    def use_log_dir(self, log_dir: Path) -> None:
        """Attached to a guard: keep the spool under the guard's ``log_dir/spool`` unless one was given."""
        if not self._explicit_spool:
            self.spool_path = check_spool_path(None, Path(log_dir) / "spool" / self._default_spool_name())

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, url={REDACTED}, spool_path={str(self.spool_path)!r})"

    # -- helpers ----------------------------------------------------------------------------------------------

    def _default_spool_name(self) -> str:
        return f"{self.kind}.jsonl" if self.name == self.kind else f"{self.kind}-{self.name}.jsonl"

    def _after_fork(self) -> None:
        self._transport = Transport(self.retry)
        self._counters.clear()
        self._grouper_lock = threading.Lock()


class _GroupBatcher:
    """The engine's view of a ``Grouper``: events in, due messages out (locked: ``resolve()`` comes from
    the user's thread)."""

    def __init__(self, sink: AlertSink, grouper: Grouper) -> None:
        self.sink = sink
        self.grouper = grouper

    def add(self, events: list[Event], now: float) -> list[Batch]:
        sink = self.sink
        skipped: list[Event] = []
        refused: list[Event] = []
        with sink._grouper_lock:
            for event in events:
                if event.kind == "summary":
                    self.grouper.progress(event.run, event.step)
                if not sink.accepts(event):
                    skipped.append(event)
                elif not self.grouper.add(event):
                    refused.append(event)
        batches = [Batch(tuple(skipped), Handled())] if skipped else []
        if refused:
            reason = f"overflow: {sink._max_pending} alert events already pending"
            batches.append(Batch(tuple(refused), Handled(reason)))
        return batches

    def due(self, now: float, drain: bool) -> list[Batch]:
        with self.sink._grouper_lock:
            notes = self.grouper.drain() if drain else self.grouper.due()
        return [Batch(note.events, note) for note in notes]

    def next_due(self) -> float | None:
        with self.sink._grouper_lock:
            due = self.grouper.next_due()
        return None if due is None else max(0.0, due - self.sink._clock())

    def held(self) -> int:
        with self.sink._grouper_lock:
            return self.grouper.held


def _known_keywords(cls: type) -> set[str]:
    names: set[str] = set()
    for klass in (cls, AlertSink):
        for p in inspect.signature(klass.__init__).parameters.values():  # type: ignore[misc]
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in ("self", "destination"):
                names.add(p.name)
    return names
