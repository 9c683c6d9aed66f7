"""TensorBoard bridge: guardtower metrics as scalars at the training step, incidents and pre-flights as text.

Writes through ``torch.utils.tensorboard.SummaryWriter``: one the user already has (``writer=``, e.g. the
one their loop logs to, so guardtower's charts sit beside theirs), or its own under ``log_dir`` (created on
the bus's worker thread at the first event, never on the training thread). Scalars are the ones the W&B
bridge logs, under ``{prefix}/``; a non-finite value (the ratio of a NaN spike) is never a scalar (it would
break TensorBoard's charts) and only appears in the incident text.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from pathlib import Path
from typing import Any

from guardtower import _validate
from guardtower.bridges._common import check_prefix, incident_label, require
from guardtower.bus import BaseSink
from guardtower.errors import ConfigError
from guardtower.events import (
    Event,
    HaltEvent,
    PreflightEvent,
    RollbackEvent,
    SkipEvent,
    SpikeEvent,
    StallEvent,
    SummaryEvent,
)

__all__ = ["TensorBoardBridge"]

logger = logging.getLogger("guardtower.bridges.tensorboard")

_TEXT_KINDS = frozenset({SpikeEvent.kind, RollbackEvent.kind, HaltEvent.kind, StallEvent.kind, "nonfinite",
                         "skip_budget", "lr_backoff"})


class TensorBoardBridge(BaseSink):
    """Forward guardtower events to TensorBoard: pass ``log_dir`` or an existing ``SummaryWriter``.

    A writer handed in stays the caller's (flushed, never closed); one made from ``log_dir`` is closed
    with the sink. Acts on rank 0 only under ``torch.distributed``, like the other trackers.
    """

    rank_zero_only = True

    def __init__(self, log_dir: str | os.PathLike[str] | None = None, *, writer: Any = None,
                 prefix: str = "guardtower") -> None:
        if (log_dir is None) == (writer is None):
            raise ConfigError("log_dir", "pass exactly one of log_dir= and writer=",
                              'pass e.g. TensorBoardBridge(log_dir="runs/exp1") or writer=your_summary_writer')
        if writer is not None and not callable(getattr(writer, "add_scalar", None)):
            raise ConfigError("writer", f"{type(writer).__name__} has no add_scalar()",
                              "pass a torch.utils.tensorboard.SummaryWriter")
        self.prefix = check_prefix(prefix)
        _validate.path("log_dir", log_dir, allow_none=True)
        require("tensorboard", "tensorboard")
        self.log_dir = Path(log_dir).expanduser().absolute() if log_dir is not None else Path(writer.log_dir)
        if log_dir is not None and self.log_dir.exists() and not self.log_dir.is_dir():
            raise ConfigError("log_dir", f"{str(self.log_dir)!r} is a file", "pass a directory path")
        self.name = f"tensorboard:{self.log_dir}"
        self._writer = writer
        self._owns_writer = writer is None
        self._lock = threading.Lock()
        self._spikes = 0
        self._last_step: dict[str, int] = {}
        self.counts = {"delivered": 0, "failed": 0}

    @property
    def writer(self) -> Any:
        """The ``SummaryWriter`` (made on first use when the bridge was given ``log_dir``)."""
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.log_dir))
        return self._writer

    def handle(self, event: Event) -> None:
        self.handle_batch([event])

    def handle_batch(self, events: list[Event]) -> None:
        with self._lock:
            self.send(events)

    def send(self, events: list[Event]) -> None:
        """Write these events; one that fails is counted and logged, the others still go."""
        for event in events:
            try:
                self._write(event)
                self.counts["delivered"] += 1
            except Exception:
                self.counts["failed"] += 1
                if self.counts["failed"] <= 3:
                    logger.warning("guardtower: TensorBoard could not write a %s event", event.kind, exc_info=True)

    def flush(self, timeout: float | None = None) -> bool:
        with self._lock:
            if self._writer is not None:
                self._writer.flush()
        return True

    def close(self, timeout: float | None = None) -> None:
        with self._lock:
            if self._writer is None:
                return
            if self._owns_writer:
                self._writer.close()
                self._writer = None
            else:
                self._writer.flush()

    def stats(self) -> dict[str, int]:
        """Events written, and events whose write raised."""
        return dict(self.counts)

    def __repr__(self) -> str:
        return f"TensorBoardBridge(log_dir={str(self.log_dir)!r}, prefix={self.prefix!r})"

    # -- one event -------------------------------------------------------------------------------------

    def _write(self, event: Event) -> None:
        step = event.step if event.step is not None else 0
        for key, value in self._scalars(event).items():
            # one point per tag and step: a spike and its step's summary both carry the spike count, and a
            # chart with two points at one step zig-zags
            if value is not None and math.isfinite(value) and self._last_step.get(key) != step:
                self._last_step[key] = step
                self.writer.add_scalar(f"{self.prefix}/{key}", float(value), step, walltime=event.time)
        text = _text(event)
        if text:
            tag = "preflight" if isinstance(event, PreflightEvent) else "incidents"
            self.writer.add_text(f"{self.prefix}/{tag}", text, step, walltime=event.time)

    def _scalars(self, event: Event) -> dict[str, float | None]:
        """The W&B bridge's metrics for this event."""
        if isinstance(event, SummaryEvent):
            self._spikes = max(self._spikes, event.total_spikes)
            return {"grad_norm": event.grad_norm, "spikes": event.total_spikes,
                    "skipped_steps": event.total_skips, "rollbacks": event.total_rollbacks}
        if isinstance(event, SpikeEvent):
            self._spikes += 1
            return {"spike_ratio": event.ratio, "grad_norm": event.global_norm, "spikes": self._spikes,
                    "loss_at_spike": event.loss}
        if isinstance(event, SkipEvent):
            return {"skipped_steps": event.total_skips}
        if isinstance(event, RollbackEvent):
            return {"rollbacks": event.total_rollbacks}
        if isinstance(event, StallEvent):
            return {"stall_seconds": 0.0 if event.resolved else event.seconds}
        if isinstance(event, PreflightEvent):
            return {"preflight_errors": event.errors, "preflight_warnings": event.warnings}
        return {}


def _text(event: Event) -> str:
    """Markdown for TensorBoard's text tab: the pre-flight findings table, or one incident's facts."""
    if isinstance(event, PreflightEvent):
        lines = [f"**Pre-flight {event.status}**: {event.errors} error(s), {event.warnings} warning(s)", "",
                 "| check | severity | catalog id | message |", "|---|---|---|---|"]
        findings = event.report.get("findings", []) if isinstance(event.report, dict) else []
        for f in findings:
            if isinstance(f, dict):
                cells = [str(f.get(c, "")).replace("|", "\\|").replace("\n", " ")
                         for c in ("check", "severity", "catalog_id", "message")]
                lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)
    if event.kind not in _TEXT_KINDS:
        return ""
    parts = [f"**{incident_label(event)}** (run {event.run}, rank {event.rank})"]
    if isinstance(event, SpikeEvent):
        parts.append(f"{event.reason}: ratio {event.ratio:.4g} (threshold {event.threshold:g}), global grad norm "
                     f"{event.global_norm:.4g}, action {event.action}" + (f", loss {event.loss:.4g}"
                                                                          if event.loss is not None else ""))
    elif isinstance(event, RollbackEvent):
        parts.append(f"rolled back from step {event.from_step} to the snapshot of step {event.to_step}")
    elif isinstance(event, HaltEvent):
        parts.append(f"training halted: {event.message or event.reason}")
    elif isinstance(event, StallEvent):
        parts.append(f"training resumed after {event.seconds:.4g} s without an optimizer step" if event.resolved
                     else f"no optimizer step for {event.seconds:.4g} s (stall_after {event.stall_after:g} s)")
    elif event.kind in ("skip_budget", "lr_backoff"):
        parts.append(str(getattr(event, "message", "")))
    return "  \n".join(parts)
