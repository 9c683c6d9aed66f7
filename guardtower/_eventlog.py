"""Reading event logs for the command line: every event that parses, and a count of the lines that do not.

``JsonlSink`` logs and dead-letter spools (whose lines wrap an ``event``) are read line by line. A line that is
not UTF-8, not JSON, not an event, of an unknown kind or with a field of the wrong type is *malformed*: it is
counted with its file, line number and problem instead of raising, so ``guardtower events``/``report`` can
say in one line what they skipped. An unterminated last line that does not parse is a write torn by a crash,
expected after ``kill -9``: it is not counted as malformed, only listed in ``torn`` for a notice.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence, Union

from guardtower.errors import ConfigError
from guardtower.events import EVENT_TYPES, Event, _decode, _type_hints, event_from_record
from guardtower.severity import Severity

__all__ = ["Malformed", "EventLog", "read_event_log", "describe_malformed"]


@dataclass(frozen=True)
class Malformed:
    """A line that is not a guardtower event."""

    file: Path
    line: int
    problem: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.problem}"


@dataclass
class EventLog:
    """The events of one or more files, in file order, and what could not be read."""

    events: list[Event] = field(default_factory=list)
    #: files that held at least one event
    files: list[Path] = field(default_factory=list)
    malformed: list[Malformed] = field(default_factory=list)
    #: files whose unterminated last line was cut short (skipped)
    torn: list[Path] = field(default_factory=list)


def describe_malformed(malformed: Sequence[Malformed]) -> str:
    """One line: how many lines were skipped, and the first one's problem."""
    files = len({m.file for m in malformed})
    where = "" if files == 1 else f" in {files} files"
    return f"skipped {len(malformed)} malformed line(s){where}; first: {malformed[0]}"


def _event_files(path: Path) -> list[Path]:
    """The file itself, or every ``*.jsonl`` under a directory, sorted."""
    return [path] if path.is_file() else sorted(p for p in path.rglob("*.jsonl") if p.is_file())


def read_event_log(path: Path) -> EventLog:
    """Read an event file, or every ``*.jsonl`` under a directory.

    A file named on the command line counts each bad line as malformed. Under a directory, a file with no
    event at all is another tool's (or a spool's acknowledgements): it is left out, its lines not counted.
    """
    log = EventLog()
    explicit = path.is_file()
    for file in _event_files(path):
        events, malformed = _read_file(file)
        if events or explicit:
            log.malformed.extend(m for m in malformed if m.problem != _TORN)
            log.torn.extend(m.file for m in malformed if m.problem == _TORN)
        if events:
            log.files.append(file)
            log.events.extend(events)
    return log


def _read_file(file: Path) -> tuple[list[Event], list[Malformed]]:
    events: list[Event] = []
    malformed: list[Malformed] = []
    try:
        data = file.read_bytes()
    except OSError as exc:
        return [], [Malformed(file, 0, f"cannot be read ({exc.strerror or exc})")]
    lines = data.split(b"\n")
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            events.append(_parse_line(raw))
        except _TornLine:
            # only the unterminated last line can be torn
            malformed.append(Malformed(file, number, "not JSON" if number != len(lines) else _TORN))
        except ValueError as exc:
            malformed.append(Malformed(file, number, str(exc)))
    return events, malformed


_JSON_NAMES = {type(None): "null", bool: "boolean", int: "number", float: "number", str: "string", list: "array"}


class _TornLine(Exception):
    pass


_TORN = "torn last line"


def _parse_line(raw: bytes) -> Event:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("not UTF-8 text") from None
    try:
        record = json.loads(text)
    except json.JSONDecodeError:
        raise _TornLine() from None
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
    if not isinstance(record, dict):
        raise ValueError(f"a JSON {_JSON_NAMES.get(type(record), 'value')}, not an event object")
    if "kind" not in record and "event" in record:  # a dead-letter spool entry
        record = record["event"]
        if not isinstance(record, dict):
            raise ValueError("the spool entry's 'event' is not an event object")
    return _parse_record(record)


def _parse_record(record: dict[str, Any]) -> Event:
    """The event a record describes; ValueError saying what is wrong when it describes none."""
    kind = record.get("kind")
    if kind is None:
        raise ValueError("no 'kind' field")
    if not isinstance(kind, str) or kind not in EVENT_TYPES:
        raise ValueError(f"unknown kind {_short(kind)}")
    cls = EVENT_TYPES[kind]
    hints = _type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in record and not _conforms(_decode(record[f.name]), hints[f.name]):
            raise ValueError(f"{kind} field {f.name!r} is {_short(record[f.name])}, not {_hint_name(hints[f.name])}")
    if kind == "spike" and "action" not in record:  # the dataclass default ("skip") would invent an action
        record = {**record, "action": "unknown"}
    try:
        return event_from_record(record)
    except (ConfigError, TypeError, ValueError, KeyError) as exc:
        raise ValueError(f"not a valid {kind} event ({exc})") from None


def _conforms(value: Any, hint: Any) -> bool:
    """Whether a decoded JSON value fits a field's type hint (the types events use)."""
    if hint is Any:
        return True
    if hint is Severity:
        try:
            Severity.parse(value)
        except ConfigError:
            return False
        return True
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint in (str, bool):
        return isinstance(value, hint)
    if hint is type(None):
        return value is None
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        return any(_conforms(value, arg) for arg in args)
    if origin is tuple:
        if not isinstance(value, list):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_conforms(v, args[0]) for v in value)
        return len(value) == len(args) and all(_conforms(v, a) for v, a in zip(value, args))
    if origin is dict:
        return isinstance(value, dict) and all(_conforms(v, args[1]) for v in value.values())
    if origin is list:
        return isinstance(value, list) and all(_conforms(v, args[0]) for v in value)
    return isinstance(value, hint) if isinstance(hint, type) else True


def _hint_name(hint: Any) -> str:
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")


def _short(value: Any, width: int = 40) -> str:
    text = json.dumps(value)
    return text if len(text) <= width else text[: width - 3] + "..."
