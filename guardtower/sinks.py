"""Local sinks: a JSON-lines event log and the human-readable console."""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import threading
from pathlib import Path
from typing import IO, Iterator

from guardtower import _validate
from guardtower._delivery import on_fork
from guardtower._jsonl import append_fd, check_writable_dir, read_json_lines, write_whole
from guardtower._dist import current_rank, world_size
from guardtower._render import box
from guardtower._wording import num, what
from guardtower.bus import BaseSink
from guardtower.errors import ConfigError
from guardtower.events import Event, PreflightEvent, SpikeEvent, event_from_record
from guardtower.severity import Severity

__all__ = ["JsonlSink", "ConsoleSink", "read_events", "render_event"]


class JsonlSink(BaseSink):
    """Append every event as one strict-JSON line.

    Under ``torch.distributed`` with several ranks each rank writes its own file (``events.rank1.jsonl``).
    The parent folder is created here if missing. Each batch is one append of whole lines, straight to
    the file (no buffer in the process): on a full disk it is written completely or not at all, so the
    file never holds a torn line, and a forked child starts with a fresh lock and descriptor. A batch
    holding an event of severity ``fsync_severity`` (default WARN) or above is also fsynced.
    """

    rank_zero_only = False

    def __init__(self, path: str | os.PathLike[str], *, fsync_severity: Severity | str = Severity.WARN) -> None:
        target = _validate.path("path", path)
        assert target is not None
        severity = _validate.severity("fsync_severity", fsync_severity)
        assert severity is not None
        self.fsync_severity = severity
        if target.is_dir():
            raise ConfigError("path", f"{str(target)!r} is a directory", "pass a file path such as events.jsonl")
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError("path", f"cannot create the folder {str(target.parent)!r} ({exc.strerror})",
                              "pass a path in a writable folder") from None
        check_writable_dir(target.parent, "path")
        self.path = target
        self.name = f"jsonl:{self.path.name}"
        self._fd: int | None = None
        self._lock = threading.Lock()
        on_fork(self)

    def _after_fork(self) -> None:
        """In a forked child: the parent's lock may have been held by one of its threads at fork time."""
        self._lock = threading.Lock()
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.close(fd)  # the child's copy only
            except OSError:
                pass

    def file_path(self) -> Path:
        """The file this process writes: the path itself, or a per-rank file under multi-rank jobs."""
        if world_size() > 1:
            return self.path.with_name(f"{self.path.stem}.rank{current_rank()}{self.path.suffix}")
        return self.path

    def handle(self, event: Event) -> None:
        self.handle_batch([event])

    def handle_batch(self, events: list[Event]) -> None:
        data = "".join(json.dumps(e.to_record(), allow_nan=False) + "\n" for e in events).encode("utf-8")
        with self._lock:
            if self._fd is None:
                self._fd = append_fd(self.file_path())
            write_whole(self._fd, data)
            if any(e.severity >= self.fsync_severity for e in events):
                os.fsync(self._fd)

    def flush(self, timeout: float | None = None) -> bool:
        with self._lock:
            if self._fd is not None:
                os.fsync(self._fd)
        return True

    def close(self, timeout: float | None = None) -> None:
        with self._lock:
            if self._fd is not None:
                fd, self._fd = self._fd, None
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)

    def __repr__(self) -> str:
        return f"JsonlSink({str(self.path)!r})"


def read_events(path: str | os.PathLike[str]) -> Iterator[Event]:
    """Events from a JSONL file written by ``JsonlSink``; a torn line (a crash mid-write) is skipped with a
    warning on the ``guardtower`` logger."""
    def notice() -> None:
        logging.getLogger("guardtower").warning("guardtower: skipped a torn or unreadable line in %s", path)

    for record in read_json_lines(Path(path), on_bad_line=notice):
        yield event_from_record(record)


class ConsoleSink(BaseSink):
    """Print events for people: a box for spikes and pre-flight results, one line for the rest."""

    name = "console"

    def __init__(self, stream: IO[str] | None = None, *, min_severity: Severity | str = Severity.INFO) -> None:
        if stream is not None and not callable(getattr(stream, "write", None)):
            raise ConfigError("stream", f"expected a text stream with write(), got {type(stream).__name__}",
                              "pass e.g. sys.stdout, an open text file, or None for sys.stderr")
        severity = _validate.severity("min_severity", min_severity)
        assert severity is not None
        self._stream = stream
        self.min_severity = severity

    def handle(self, event: Event) -> None:
        if event.severity < self.min_severity:
            return
        stream = self._stream or sys.stderr
        if stream is not sys.stdout and sys.stdout is not None:
            sys.stdout.flush()  # the user's pending print output goes out first, on its own line
        # one write of whole lines: a print() on another thread cannot split it
        stream.write(render_event(event) + "\n")
        stream.flush()


def _spike_lines(event: SpikeEvent) -> list[str]:
    """The spike box: every number says what it is (a share of the gradient is not a norm ratio; a NaN step
    has no baseline to show)."""
    tensor = event.layer not in ("global", "loss", "peer-rank")
    share = event.share_ratios and tensor
    limit = f"threshold {event.threshold:.4g}x"
    lines = [f"step {event.step}  action: {event.action.upper()}  reason: {event.reason}",
             f"trigger layer: {event.layer}" + (f"  (module {event.module})" if event.module else "")]
    if event.reason == "nonfinite":
        lines.append(f"gradient norm {num(event.norm)} (NaN/Inf: rejected whatever the baseline)")
    elif event.layer == "loss":
        lines.append(f"loss {event.ratio:.4g}x its baseline ({limit})")
    elif share:
        lines.append(f"gradient norm {event.norm:.4g}; its share of the gradient is {event.ratio:.4g}x its usual "
                     f"share ({limit})")
    else:
        lines.append(f"gradient norm {event.norm:.4g}  baseline norm {event.baseline:.4g}  ratio {event.ratio:.4g}x "
                     f"({limit})")
    lines.append(f"global grad norm {num(event.global_norm)}" + ("" if event.loss is None else f"  loss {num(event.loss)}"))
    if event.nonfinite_layers:
        lines.append("non-finite: " + ", ".join(event.nonfinite_layers[:5]))
    if event.top_layers:
        lines.append("largest: grad norm, " + ("share of the gradient vs its usual share" if event.share_ratios
                                               else "norm vs its baseline norm"))
    for name, norm, ratio in event.top_layers[:5]:
        if not math.isfinite(norm):
            lines.append(f"  {name}: grad norm {num(norm)}")
        else:
            lines.append(f"  {name}: grad norm {norm:.4g}, " + (f"share {ratio:.4g}x usual" if event.share_ratios
                                                                 else f"ratio {ratio:.4g}x"))
    if event.report_path:
        lines.append(f"report: {event.report_path}")
    return lines


def render_event(event: Event) -> str:
    """The human-readable form of an event."""
    if isinstance(event, SpikeEvent):
        return box(f"guardtower: {what(event)} [{event.run}]", _spike_lines(event))
    if isinstance(event, PreflightEvent):
        lines = [f"{event.errors} error(s), {event.warnings} warning(s), {event.infos} info(s)"]
        if event.error_ids:
            lines.append("errors: " + ", ".join(event.error_ids))
        if event.warning_ids:
            lines.append("warnings: " + ", ".join(event.warning_ids))
        return box(f"guardtower pre-flight: {event.status} [{event.run}]", lines)
    record = event.to_record()
    common = {"kind", "event_id", "time", "run", "rank", "step", "severity", "fingerprint", "report", "details"}
    fields = "  ".join(f"{k}={v}" for k, v in record.items() if k not in common and v not in (None, "", [], {}))
    return f"[guardtower {event.severity.label}] {event.kind} step={event.step} run={event.run} {fields}".rstrip()
