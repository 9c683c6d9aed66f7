"""Spike reports: one strict-JSON file per rejected step, written off the training thread.

``SpikeReportSink`` sits on the guard's bus and writes the report for every ``SpikeEvent`` whose
``report_path`` lies in its directory. The file is written to a temporary name and renamed with
``os.replace``, so a reader never sees half a report. Names are
``spike_step{step:08d}-rank{rank}-{uuid8}.json`` (the original stabilityguard's ``spike_step*.json``
pattern): ranks and resumed runs never collide. ``wait_written`` lets the guard return from a rejected step
only once its report is on disk, when the host has already waited for that step's decision anyway.

Report format (``"format": "guardtower.spike-report/1"``)::

    {
      "format": "guardtower.spike-report/1",
      "event_id": str, "fingerprint": str, "run": str, "rank": int, "time": float (unix seconds),
      "step": int,               # the guard's step counter (1 = first optimizer step)
      "reason": "spike" | "nonfinite",
      "action": "skip" | "clip" | "rollback" | "raise",
      "trigger": {"layer": str, "module": str, "norm": float, "baseline": float, "ratio": float},
      "threshold": float,
      "global_norm": float,
      "loss": float | null, "lr": float | null,
      "top_layers": [{"layer": str, "norm": float, "ratio": float}, ...],   # up to 10, largest ratio first
      "nonfinite_layers": [str, ...],
      "history": {"steps": [int], "global_norm": [float], "trigger_norm": [float]},  # last 32 judged steps
      "ranks": [int, ...],       # the ranks whose local gradients (or loss) tripped
      "rank_values": [{"rank": int, "tripped": bool, "nonfinite": bool, "grad_norm": float,
                       "loss": float | null}, ...],   # every rank (up to 256), under torch.distributed
      "batch": {"step": int, "epoch": int, "index": int, "indices": [int], "fingerprint": str} | null,
      "triage": "transient" | "deterministic" | null, "triage_ranks": [int, ...]
    }

The trigger layer is the parameter name (``"global"`` when only the global norm tripped). Non-finite numbers
are written as ``{"$float": "nan" | "inf" | "-inf"}`` (the encoding of ``guardtower.events``), never as the
non-JSON tokens ``NaN``/``Infinity``; ``read_report`` decodes them back to floats.
"""

from __future__ import annotations

import collections
import json
import os
import threading
import uuid
from pathlib import Path
from typing import Any

from guardtower.bus import BaseSink
from guardtower.events import Event, SpikeEvent, _decode, _encode

__all__ = ["REPORT_FORMAT", "SpikeReportSink", "report_filename", "build_report", "write_json_atomic",
           "read_report"]

REPORT_FORMAT = "guardtower.spike-report/1"


def report_filename(step: int, rank: int) -> str:
    """A name unique across ranks and resumed runs."""
    return f"spike_step{step:08d}-rank{rank}-{uuid.uuid4().hex[:8]}.json"


def build_report(event: SpikeEvent) -> dict[str, Any]:
    """The report for ``event`` as a strict-JSON-safe dict."""
    report = {
        "format": REPORT_FORMAT,
        "event_id": event.event_id,
        "fingerprint": event.fingerprint,
        "run": event.run,
        "rank": event.rank,
        "time": event.time,
        "step": event.step,
        "reason": event.reason,
        "action": event.action,
        "trigger": {"layer": event.layer, "module": event.module, "norm": event.norm,
                    "baseline": event.baseline, "ratio": event.ratio},
        "threshold": event.threshold,
        "global_norm": event.global_norm,
        "loss": event.loss,
        "lr": event.lr,
        "top_layers": [{"layer": name, "norm": norm, "ratio": ratio} for name, norm, ratio in event.top_layers],
        "nonfinite_layers": list(event.nonfinite_layers),
        "history": {"steps": list(event.history_steps), "global_norm": list(event.history_global_norms),
                    "trigger_norm": list(event.history_layer_norms)},
        "ranks": list(event.ranks),
        "rank_values": [dict(v) for v in event.all_ranks],
        "batch": event.batch,
        "triage": event.triage,
        "triage_ranks": list(event.triage_ranks),
    }
    encoded: dict[str, Any] = _encode(report)
    return encoded


def write_json_atomic(path: Path, data: Any) -> None:
    """Write ``data`` as strict JSON to ``path`` via a temporary file and ``os.replace``."""
    text = json.dumps(data, allow_nan=False, indent=2)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def read_report(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Load a spike report, turning encoded non-finite numbers back into floats."""
    with open(path, encoding="utf-8") as fh:
        decoded: dict[str, Any] = _decode(json.load(fh))
    return decoded


class SpikeReportSink(BaseSink):
    """Write the spike report of every ``SpikeEvent`` that points into ``log_dir``. Acts on every rank."""

    rank_zero_only = False

    def __init__(self, log_dir: str | os.PathLike[str]) -> None:
        self.log_dir = Path(log_dir).resolve()
        self.name = f"spike-reports:{self.log_dir.name}"
        self.closed = False
        self._written: collections.deque[str] = collections.deque(maxlen=64)
        self._changed = threading.Condition()

    def handle(self, event: Event) -> None:
        if self.closed or not isinstance(event, SpikeEvent) or not event.report_path:
            return
        path = Path(event.report_path)
        if path.resolve().parent != self.log_dir:
            return  # another guard's report
        self.log_dir.mkdir(parents=True, exist_ok=True)  # created with the first report, not before
        try:
            write_json_atomic(path, build_report(event))
        finally:
            with self._changed:
                self._written.append(event.report_path)
                self._changed.notify_all()

    def wait_written(self, report_path: str, timeout: float) -> bool:
        """Wait (at most ``timeout`` seconds) until the report at ``report_path`` was handled."""
        with self._changed:
            return self._changed.wait_for(lambda: report_path in self._written, timeout)

    def close(self, timeout: float | None = None) -> None:
        self.closed = True
