"""Dead-letter spool: events a sink could not deliver, kept on disk to be replayed later.

One JSONL file per sink. Each line is ``{"reason": ..., "sink": ..., "time": ..., "event": <record>}``.
A remote sink writes every event it accepts here *before* its first delivery attempt and acknowledges it
after (persist before you try), so a process killed at any moment leaves what it had not delivered.
Replaying (the delivery engine, or ``guardtower replay``) re-sends in order; the acknowledged ``event_id``s
are written to ``<spool>.acked`` as they succeed, so a replay that is interrupted never sends an
acknowledged event twice. An event the destination refused (resending cannot help) is moved to
``<spool>.refused`` with its reason and acknowledged, so it never holds up the others. A spool may hold
lines written by another version or damaged by a crash (no ``event``, an unknown kind or severity, binary
garbage, a torn last line): those are skipped and counted in ``skipped``, never stall delivery and never
raise. Appends are whole batches of lines; ``fsync`` runs at most every ``FSYNC_EVERY_S`` seconds unless a
caller asks for it (kill -9 does not lose what reached the kernel; fsync guards against power loss).
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Iterable, Iterator

from guardtower._jsonl import read_json_lines, write_whole
from guardtower.errors import GuardtowerError
from guardtower.events import Event, event_from_record

__all__ = ["Spool", "SpoolEntry", "default_spool_dir", "FSYNC_EVERY_S"]

#: the longest an appended line waits for its fsync (unless a write asks for one at once)
FSYNC_EVERY_S = 1.0


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
        self.refused_path = self.path.with_name(self.path.name + ".refused")
        self.skipped = 0  # unreadable lines seen by the last read
        self._lock = threading.Lock()
        self._synced_at: dict[Path, float] = {}

    def append(self, event: Event, reason: str, sink: str = "") -> None:
        """Write one undelivered event (thread-safe, flushed and fsynced: it is the last copy)."""
        self.append_many([event], reason, sink)

    def append_many(self, events: Iterable[Event], reason: str, sink: str = "", *, sync: bool = True) -> None:
        """Write several events in one append; raises ``OSError`` (full disk, read-only).

        ``sync=False``: fsync only if the last one is ``FSYNC_EVERY_S`` old (the engine's cadence)."""
        self._write(self.path, _lines(events, reason, sink), sync)

    def quarantine_many(self, events: Iterable[Event], reason: str, sink: str = "") -> None:
        """Keep events the destination refused in ``<spool>.refused``, with the reason (never replayed)."""
        self._write(self.refused_path, _lines(events, reason, sink), True)

    def refused(self) -> list[SpoolEntry]:
        """The quarantined events, with the destination's reason."""
        if not self.refused_path.is_file():
            return []
        return [e for e in map(_entry, read_json_lines(self.refused_path)) if e is not None]

    def sync(self) -> None:
        """fsync what was appended since the last fsync."""
        with self._lock:
            for path in list(self._synced_at):
                if path.exists():
                    fd = os.open(path, os.O_RDONLY)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
                self._synced_at[path] = time.monotonic()

    def ackable(self) -> bool:
        """Whether acknowledgements can be written: replaying without them would resend the same events."""
        folder = self.acked_path.parent
        if self.acked_path.exists():
            return os.access(self.acked_path, os.W_OK) and os.access(folder, os.X_OK)
        return os.access(folder, os.W_OK | os.X_OK)

    def compact(self) -> bool:
        """Remove the spool (its acknowledgements, and its folder if that is then empty) once nothing in it
        is pending; True if removed."""
        with self._lock:
            if not self.path.exists() or next(self.entries(), None) is not None or self.skipped:
                return False
            for path in (self.path, self.acked_path):
                try:
                    path.unlink()
                except FileNotFoundError:
                    pass
            try:
                self.path.parent.rmdir()  # only if nothing else is in it
            except OSError:
                pass
            self._synced_at.clear()
            return True

    def _write(self, path: Path, text: str, sync: bool) -> None:
        if not text:
            return
        data = text.encode("utf-8")
        with self._lock:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_whole(path, data)
            now = time.monotonic()
            if sync or now - self._synced_at.setdefault(path, now) >= FSYNC_EVERY_S:
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
                self._synced_at[path] = now

    def entries(self) -> Iterator[SpoolEntry]:
        """Spooled events not yet acknowledged, in order, each event id once; bad lines are skipped."""
        self.skipped = 0
        if not self.path.is_file():
            return
        acked = self.acked_ids()
        pending: dict[str, SpoolEntry] = {}  # first position, latest reason
        for record in read_json_lines(self.path, on_bad_line=self._skip):
            entry = _entry(record)
            if entry is None:
                self.skipped += 1
                continue
            event_id = entry.event.event_id
            if event_id in acked:
                continue
            if event_id in pending:
                pending[event_id].reason = entry.reason
                continue
            pending[event_id] = entry
        yield from pending.values()

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

    def ack_many(self, event_ids: Iterable[str], *, sync: bool = True) -> None:
        """Mark events delivered (one append for all of them)."""
        self._write(self.acked_path, "".join(event_id + "\n" for event_id in event_ids), sync)

    def __len__(self) -> int:
        return sum(1 for _ in self.entries())


def _lines(events: Iterable[Event], reason: str, sink: str) -> str:
    now = time.time()
    return "".join(
        json.dumps({"reason": reason, "sink": sink, "time": now, "event": event.to_record()}, allow_nan=False) + "\n"
        for event in events
    )


def _entry(record: object) -> SpoolEntry | None:
    """The entry of one spool line, or None when it is not one this version can replay."""
    if not isinstance(record, dict) or not isinstance(record.get("event"), dict):
        return None
    try:
        event = event_from_record(record["event"])
    except (GuardtowerError, KeyError, TypeError, ValueError, AttributeError, RecursionError):
        return None
    return SpoolEntry(event, str(record.get("reason", "")), str(record.get("sink", "")))
