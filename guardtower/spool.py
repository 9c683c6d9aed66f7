"""Dead-letter spool: events a sink could not deliver, kept on disk to be replayed later.

One JSONL file per sink. Each line is ``{"reason": ..., "sink": ..., "time": ..., "event": <record>}``.
Replaying re-sends in order; the acknowledged ``event_id``s are written to ``<spool>.acked`` as they
succeed, so a replay that is interrupted never sends an acknowledged event twice.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Callable, Iterable, Iterator

from guardtower._jsonl import check_writable_dir, read_json_lines
from guardtower.events import Event, event_from_record

__all__ = ["Spool", "SpoolEntry", "default_spool_dir"]


def default_spool_dir() -> Path:
    """Where sinks keep undelivered events unless told otherwise: ``GUARDTOWER_SPOOL_DIR`` or ``./sg_logs/spool``."""
    return Path(os.environ.get("GUARDTOWER_SPOOL_DIR", os.path.join("sg_logs", "spool")))


class SpoolEntry:
    __slots__ = ("event", "reason", "sink")

    def __init__(self, event: Event, reason: str, sink: str) -> None:
        self.event = event
        self.reason = reason
        self.sink = sink


class Spool:
    """An append-only JSONL dead-letter file with an acknowledgement log beside it."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.acked_path = self.path.with_name(self.path.name + ".acked")
        check_writable_dir(self.path.parent, "spool_path")
        self._lock = threading.Lock()

    def append(self, event: Event, reason: str, sink: str = "") -> None:
        """Write one undelivered event (thread-safe, flushed and fsynced: it is the last copy)."""
        self.append_many([event], reason, sink)

    def append_many(self, events: Iterable[Event], reason: str, sink: str = "") -> None:
        """Write several undelivered events with one fsync (a failed grouped alert can hold thousands)."""
        now = time.time()
        text = "".join(
            json.dumps({"reason": reason, "sink": sink, "time": now, "event": event.to_record()}, allow_nan=False)
            + "\n"
            for event in events
        )
        if not text:
            return
        with self._lock, open(self.path, "a", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())

    def entries(self) -> Iterator[SpoolEntry]:
        """Spooled events not yet acknowledged, in order, each event id once; a torn last line is skipped."""
        if not self.path.exists():
            return
        acked = self.acked_ids()
        seen: set[str] = set()
        for record in read_json_lines(self.path):
            event = event_from_record(record["event"])
            if event.event_id in acked or event.event_id in seen:
                continue
            seen.add(event.event_id)
            yield SpoolEntry(event, str(record.get("reason", "")), str(record.get("sink", "")))

    def acked_ids(self) -> set[str]:
        if not self.acked_path.exists():
            return set()
        return {line.strip() for line in self.acked_path.read_text(encoding="utf-8").splitlines() if line.strip()}

    def ack(self, event_id: str) -> None:
        self.ack_many([event_id])

    def ack_many(self, event_ids: Iterable[str]) -> None:
        """Mark events delivered (one fsync for all of them)."""
        text = "".join(event_id + "\n" for event_id in event_ids)
        if not text:
            return
        with self._lock, open(self.acked_path, "a", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())

    def __len__(self) -> int:
        return sum(1 for _ in self.entries())

    def replay(self, deliver: Callable[[Event], None]) -> tuple[int, int]:
        """Call ``deliver(event)`` for each pending entry, acknowledging each success.

        Stops at the first failure (order matters to receivers) and returns ``(sent, remaining)``.
        """
        pending = list(self.entries())
        sent = 0
        for entry in pending:
            try:
                deliver(entry.event)
            except Exception:
                break
            self.ack(entry.event.event_id)
            sent += 1
        return sent, len(pending) - sent
