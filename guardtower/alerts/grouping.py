"""Turning a stream of events into few messages: the Alertmanager model as a pure, clock-driven class.

``Grouper`` holds no thread and never sleeps: the sink feeds it events (``add``) and step progress
(``progress``), asks what is due (``due``) and when to ask next (``next_due``). Every event it accepts
ends up in exactly one ``Notification.events`` (its id travels in that message's payload), so a sink can
reconcile deliveries by event id or spool exactly the events of a message that failed.
"""

from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping

from guardtower.events import Event
from guardtower.severity import Severity
from guardtower.alerts.policy import GroupPolicy

__all__ = ["Notification", "Grouper", "SUPERSEDING_KINDS", "SUPERSEDED_KINDS"]

#: a rollback or halt makes pending alerts of these kinds (same run) redundant
SUPERSEDING_KINDS = frozenset({"rollback", "halt"})
SUPERSEDED_KINDS = frozenset({"spike", "skip", "skip_budget"})


@dataclass(frozen=True)
class Notification:
    """One message to send.

    ``status``: ``firing`` (first message of an incident), ``update`` (new occurrences since the last
    message), ``repeat`` (unchanged incident, re-sent after ``repeat_interval``) or ``resolved``.
    ``event`` is the latest event of the incident; ``events`` are the events this message delivers (its
    own new occurrences plus pending alerts it superseded), ``count`` how many of them are its own kind,
    ``total`` the occurrences since the incident began, ``first_step``/``last_step`` their step range.
    """

    status: str
    fingerprint: str
    kind: str
    run: str
    event: Event
    events: tuple[Event, ...] = ()
    count: int = 0
    total: int = 0
    first_step: int | None = None
    last_step: int | None = None
    superseded: Mapping[str, int] = field(default_factory=dict)
    reason: str = ""

    @property
    def event_ids(self) -> list[str]:
        return [e.event_id for e in self.events]

    @property
    def message_id(self) -> str:
        """An id receivers can deduplicate the message on: its first event's id, or a status-derived key."""
        if self.events:
            return self.events[0].event_id
        return f"{self.fingerprint}-{self.status}-{self.total}"

    @property
    def severity(self) -> Severity:
        return max([e.severity for e in self.events] + [self.event.severity])

    @classmethod
    def single(cls, event: Event) -> "Notification":
        """A message for exactly one event (per-event mode, replay)."""
        return cls("firing", event.fingerprint, event.kind, event.run, event, (event,), 1, 1, event.step, event.step)


class _Group:
    __slots__ = ("fingerprint", "kind", "run", "last_event", "total", "first_step", "last_step", "pending",
                 "folded", "superseded", "sent_at", "due_at")

    def __init__(self, event: Event, due_at: float) -> None:
        self.fingerprint = event.fingerprint
        self.kind = event.kind
        self.run = event.run
        self.last_event = event
        self.total = 0
        self.first_step: int | None = None
        self.last_step: int | None = None
        self.pending: list[Event] = []
        self.folded: list[Event] = []
        self.superseded: collections.Counter[str] = collections.Counter()
        self.sent_at: float | None = None
        self.due_at: float | None = due_at

    def add(self, event: Event) -> None:
        self.last_event = event
        self.total += 1
        self.pending.append(event)
        if event.step is not None:
            self.first_step = event.step if self.first_step is None else min(self.first_step, event.step)
            self.last_step = event.step if self.last_step is None else max(self.last_step, event.step)

    def has_pending(self) -> bool:
        return bool(self.pending or self.folded)

    def emit(self, now: float) -> Notification:
        status = "firing" if self.sent_at is None else "update"
        note = Notification(
            status, self.fingerprint, self.kind, self.run, self.last_event, tuple(self.pending + self.folded),
            len(self.pending), self.total, self.first_step, self.last_step, dict(self.superseded),
        )
        self.pending, self.folded = [], []
        self.superseded = collections.Counter()
        self.sent_at, self.due_at = now, None
        return note

    def closing_note(self, status: str, reason: str) -> Notification:
        return Notification(status, self.fingerprint, self.kind, self.run, self.last_event, (), 0, self.total,
                            self.first_step, self.last_step, {}, reason)


class Grouper:
    """Groups events by fingerprint and decides, from ``clock()``, which messages are due.

    ``policy=None`` turns grouping off: every accepted event becomes its own message, due at once.
    At most ``max_pending`` events wait at any time; ``add`` returns False for the rest (the sink spools
    them). ``send_resolved`` adds ``resolved`` messages when an incident clears or is superseded.
    Not thread-safe: the sink calls it under its own lock.
    """

    def __init__(self, policy: GroupPolicy | None = None, *, clock: Callable[[], float] = time.monotonic,
                 send_resolved: bool = False, max_pending: int = 10_000) -> None:
        self.policy = policy
        self.send_resolved = send_resolved
        self.max_pending = max_pending
        self._clock = clock
        self._groups: dict[str, _Group] = {}
        self._ready: list[Notification] = []
        self._pending = 0

    @property
    def pending_events(self) -> int:
        """Events accepted but not yet handed out in a notification."""
        return self._pending

    @property
    def held(self) -> int:
        """Pending events plus messages ready to go (a resolve carries no event but must still be sent)."""
        return self._pending + len(self._ready)

    def add(self, event: Event) -> bool:
        """Accept an alert-worthy event; False (nothing changed) when ``max_pending`` events already wait."""
        if self._pending >= self.max_pending:
            return False
        self._pending += 1
        if self.policy is None:
            self._ready.append(Notification.single(event))
            return True
        now = self._clock()
        group = self._groups.get(event.fingerprint)
        if group is None:
            group = self._groups[event.fingerprint] = _Group(event, now + self.policy.group_wait)
        if event.kind in SUPERSEDING_KINDS:
            self._supersede(event, group)
        group.add(event)
        if group.due_at is None:  # already sent once: the next update waits for group_interval
            assert group.sent_at is not None
            group.due_at = max(now, group.sent_at + self.policy.group_interval)
        return True

    def _supersede(self, event: Event, by: _Group) -> None:
        for key, group in list(self._groups.items()):
            if group.run != event.run or group.kind not in SUPERSEDED_KINDS:
                continue
            by.superseded[group.kind] += len(group.pending)
            by.folded.extend(group.pending + group.folded)
            if group.sent_at is not None and self.send_resolved:
                self._ready.append(group.closing_note("resolved", f"superseded by {event.kind}"))
            del self._groups[key]

    def progress(self, run: str, step: int | None) -> None:
        """A summary event reached ``step``: incidents of ``run`` quiet for ``resolve_after_steps`` clear."""
        if self.policy is None or self.policy.resolve_after_steps is None or step is None:
            return
        quiet = self.policy.resolve_after_steps
        for key, group in list(self._groups.items()):
            if group.run == run and group.last_step is not None and not group.has_pending() \
                    and step - group.last_step >= quiet:
                self._clear(key, f"no new {group.kind} for {step - group.last_step:,} steps")

    def resolve(self, *, run: str | None = None, fingerprint: str | None = None) -> None:
        """Clear incidents explicitly (all, one run's, or one fingerprint); pending occurrences are sent first."""
        now = self._clock()
        for key, group in list(self._groups.items()):
            if (run is None or group.run == run) and (fingerprint is None or key == fingerprint):
                if group.has_pending():
                    self._take(group.emit(now))
                self._clear(key, "resolved explicitly")

    def _clear(self, key: str, reason: str) -> None:
        group = self._groups.pop(key)
        if group.sent_at is not None and self.send_resolved:
            self._ready.append(group.closing_note("resolved", reason))

    def _take(self, note: Notification) -> None:
        self._pending -= len(note.events)
        self._ready.append(note)

    def due(self) -> list[Notification]:
        """The messages to send now, in order; each is handed out once."""
        now = self._clock()
        policy = self.policy
        for group in self._groups.values():
            if group.has_pending():
                if group.due_at is not None and group.due_at <= now:
                    self._take(group.emit(now))
            elif policy is not None and policy.repeat_interval is not None and group.sent_at is not None \
                    and group.sent_at + policy.repeat_interval <= now:
                group.sent_at = now
                self._ready.append(group.closing_note("repeat", ""))
        return self._pop_ready()

    def drain(self) -> list[Notification]:
        """Every pending occurrence now, ignoring the waits (flush and close)."""
        now = self._clock()
        for group in self._groups.values():
            if group.has_pending():
                self._take(group.emit(now))
        return self._pop_ready()

    def _pop_ready(self) -> list[Notification]:
        ready, self._ready = self._ready, []
        if self.policy is None:
            self._pending -= sum(len(n.events) for n in ready)
        return ready

    def next_due(self) -> float | None:
        """The clock time of the next message (``-inf`` if one is ready now), or None when nothing waits."""
        if self._ready:
            return -math.inf
        times: list[float] = []
        policy = self.policy
        for group in self._groups.values():
            if group.has_pending() and group.due_at is not None:
                times.append(group.due_at)
            elif policy is not None and policy.repeat_interval is not None and group.sent_at is not None:
                times.append(group.sent_at + policy.repeat_interval)
        return min(times) if times else None
