"""Words shared by every alert format: titles, the one-line headline with counts, facts, truncation."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Union

from guardtower._wording import kind, num, title
from guardtower.alerts.grouping import Notification

__all__ = ["RunUrl", "title", "headline", "facts", "text", "truncate", "run_url_for", "id_line"]

#: a fixed URL, or a callable (run name -> URL or None) asked when a message is built
RunUrl = Union[str, Callable[[str], Union[str, None]], None]

_COMMON = {"event_id", "time", "run", "rank", "step", "severity"}
_SKIP = {"report", "details", "metrics"}  # big nested values: in the webhook JSON, not in chat text
_STATUS_PREFIX = {"firing": "", "update": "[update] ", "repeat": "[still firing] ", "resolved": "[resolved] "}
_MAX_LIST = 5


def truncate(value: str, limit: int) -> str:
    """``value`` cut to at most ``limit`` characters, ending in an ellipsis when cut."""
    if len(value) <= limit:
        return value
    return value[: max(0, limit - 1)] + "…"


def headline(note: Notification) -> str:
    """One line with status, title and counts: ``NaN/Inf gradient in h.3: 1,000 occurrences, steps 1,200-2,200``."""
    line = _STATUS_PREFIX.get(note.status, "") + title(note.event)
    if note.total > 1:
        line += f": {note.total:,} occurrences"
        if note.first_step is not None and note.last_step is not None and note.first_step != note.last_step:
            line += f", steps {note.first_step:,}-{note.last_step:,}"
        elif note.last_step is not None:
            line += f", step {note.last_step:,}"
        if note.status == "update":
            line += f" (+{note.count:,} since the last message)"
    elif note.event.step is not None:
        line += f" at step {note.event.step:,}"
    if note.superseded:
        line += "; replaces " + ", ".join(f"{n:,} pending {k} alert(s)" for k, n in sorted(note.superseded.items()))
    if note.reason:
        line += f" ({note.reason})"
    return line


def facts(note: Notification) -> list[tuple[str, str]]:
    """(name, value) pairs: run, severity, steps, then the event's own fields that say something."""
    event = note.event
    pairs = [("run", event.run), ("severity", event.severity.label), ("kind", kind(event))]
    if event.step is not None:
        pairs.append(("step", f"{event.step:,}"))
    if event.rank:
        pairs.append(("rank", str(event.rank)))
    for f in dataclasses.fields(event):
        if f.name in _COMMON or f.name in _SKIP:
            continue
        value = getattr(event, f.name)
        if value in (None, "", (), 0):  # unset defaults say nothing
            continue
        pairs.append((f.name, _show(value)))
    return pairs


def id_line(note: Notification) -> str:
    """Event id(s) and fingerprint, for receivers that deduplicate and for people who grep the logs."""
    ids = note.event_ids
    line = f"event_id {ids[0]}" if ids else f"message {note.message_id}"
    if len(ids) > 1:
        line += f" (+{len(ids) - 1:,} more)"
    return f"{line} · fingerprint {note.fingerprint}"


def text(note: Notification, run_url: str | None = None, *, limit: int = 3000) -> str:
    """Plain text for fallbacks and simple formats: headline, facts, link, ids."""
    lines = [headline(note)] + [f"{k}: {v}" for k, v in facts(note)]
    if run_url:
        lines.append(f"run: {run_url}")
    lines.append(id_line(note))
    return truncate("\n".join(lines), limit)


def run_url_for(run_url: RunUrl, run: str) -> str | None:
    """Resolve the ``run_url=`` argument for one run; a failing callable just gives no link."""
    if run_url is None or isinstance(run_url, str):
        return run_url or None
    try:
        value = run_url(run)
    except Exception:
        return None
    return value if isinstance(value, str) and value else None


def _show(value: Any) -> str:
    if isinstance(value, float):
        return num(value)
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (list, tuple)):
        shown = [" ".join(num(v) for v in item) if isinstance(item, (list, tuple)) else num(item)
                 for item in value[:_MAX_LIST]]
        more = f" (+{len(value) - _MAX_LIST} more)" if len(value) > _MAX_LIST else ""
        return ", ".join(shown) + more
    return truncate(str(value), 500)
