"""Dead-letter spool: events a sink could not deliver, kept on disk to be replayed later.

One JSONL file per sink. Each line is ``{"reason": ..., "sink": ..., "time": ..., "event": <record>}``.
Replaying (the delivery engine, or ``guardtower replay``) re-sends in order; the acknowledged ``event_id``s are written to ``<spool>.acked`` as they
succeed, so a replay that is interrupted never sends an acknowledged event twice. A spool may hold lines
written by another version or damaged by a crash (no ``event``, an unknown kind or severity, binary
garbage): those are skipped and counted in ``skipped``, never stall delivery and never raise.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Iterable, Iterator

from guardtower._jsonl import read_json_lines
from guardtower.errors import GuardtowerError
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
    """An append-only JSONL dead-letter file with an acknowledgement log beside it.

    Nothing touches the disk until the first write, which creates the folder.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.acked_path = self.path.with_name(self.path.name + ".acked")
        self.skipped = 0  # unreadable lines seen by the last read
        self._lock = threading.Lock()

    def append(self, event: Event, reason: str, sink: str = "") -> None:
        """Write one undelivered event (thread-safe, flushed and fsynced: it is the last copy)."""
        self.append_many([event], reason, sink)

    def append_many(self, events: Iterable[Event], reason: str, sink: str = "") -> None:
        """Write several undelivered events with one fsync; raises ``OSError`` (full disk, read-only)."""
        now = time.time()
        text = "".join(
            json.dumps({"reason": reason, "sink": sink, "time": now, "event": event.to_record()}, allow_nan=False)
            + "\n"
            for event in events
        )
        if text:
            self._write(self.path, text)

    def _write(self, path: Path, text: str) -> None:
        with self._lock:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a", encoding="utf-8") as fh:
                fh.write(text)
                fh.flush()
                os.fsync(fh.fileno())

    def entries(self) -> Iterator[SpoolEntry]:
        """Spooled events not yet acknowledged, in order, each event id once; bad lines are skipped."""
        self.skipped = 0
        if not self.path.is_file():
            return
        acked = self.acked_ids()
        seen: set[str] = set()
        for record in read_json_lines(self.path, on_bad_line=self._skip):
            entry = _entry(record)
            if entry is None:
                self.skipped += 1
                continue
            event_id = entry.event.event_id
            if event_id in acked or event_id in seen:
                continue
            seen.add(event_id)
            yield entry

    def _skip(self) -> None:
        self.skipped += 1

    def has_pending(self) -> bool:
        return next(self.entries(), None) is not None

    def pending_chunks(self, size: int) -> Iterator[list[Event]]:
        """Pending events in order, ``size`` at a time."""
        chunk: list[Event] = []
        for entry in self.entries():
            chunk.append(entry.event)
            if len(chunk) >= size:
                yield chunk
                chunk = []
        if chunk:
            yield chunk

    def acked_ids(self) -> set[str]:
        if not self.acked_path.is_file():
            return set()
        with open(self.acked_path, encoding="utf-8", errors="replace") as fh:
            return {line.strip() for line in fh if line.strip()}

    def ack(self, event_id: str) -> None:
        self.ack_many([event_id])

    def ack_many(self, event_ids: Iterable[str]) -> None:
        """Mark events delivered (one fsync for all of them)."""
        text = "".join(event_id + "\n" for event_id in event_ids)
        if text:
            self._write(self.acked_path, text)

    def __len__(self) -> int:
        return sum(1 for _ in self.entries())


def _entry(record: object) -> SpoolEntry | None:
    """The entry of one spool line, or None when it is not one this version can replay."""
    if not isinstance(record, dict) or not isinstance(record.get("event"), dict):
        return None
    try:
        event = event_from_record(record["event"])
    except (GuardtowerError, KeyError, TypeError, ValueError, AttributeError):
        return None
    return SpoolEntry(event, str(record.get("reason", "")), str(record.get("sink", "")))
