"""``guardtower report``: the incidents of a run, as a table and optionally as a plot.

Reads a JSONL event file (``JsonlSink``) or a directory holding event files and the guard's per-incident
spike reports. An incident is a rejected step (spike or non-finite gradients), a rollback, a halt, a
non-finite activation or a failed pre-flight. The gradient-norm history for ``--plot`` comes from the
guard's summary events and the norms recorded with each incident.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from guardtower._argparse import ArgumentParser
from guardtower._runs import pick_run
from guardtower._eventlog import Malformed, describe_malformed, read_event_log
from guardtower.errors import ConfigError, MissingDependencyError
from guardtower.events import (
    Event,
    HaltEvent,
    NonFiniteEvent,
    PreflightEvent,
    RollbackEvent,
    SkipEvent,
    SpikeEvent,
    SummaryEvent,
    _decode,
)
from guardtower.severity import Severity

__all__ = ["Incident", "RunLog", "load_run_log", "format_table", "main"]

_REPORT_PREFIX = "guardtower.spike-report/"
#: the most steps one rollback can undo that the report shades (rollback_every is 100 by default)
_MAX_UNDONE = 100_000


@dataclass(frozen=True)
class Incident:
    """One row of the report."""

    step: int | None
    kind: str  # spike, nonfinite, rollback, halt, activation, preflight
    layer: str
    ratio: float | None
    action: str
    run: str = "default"
    rank: int = 0
    norm: float | None = None
    baseline: float | None = None
    threshold: float | None = None
    report_path: str | None = None


@dataclass
class RunLog:
    """Everything ``guardtower report`` knows about a run, merged from all the files it read."""

    incidents: list[Incident] = field(default_factory=list)
    #: step -> global gradient norm (from summaries and incidents)
    global_norms: dict[int, float] = field(default_factory=dict)
    #: layer -> step -> gradient norm (from summary metrics and the incidents' top layers)
    layer_norms: dict[str, dict[int, float]] = field(default_factory=dict)
    #: steps whose update was not applied (skipped, or undone by a rollback)
    skipped_steps: set[int] = field(default_factory=set)
    #: steps of the loss history, when the summaries carry it
    losses: dict[int, float] = field(default_factory=dict)
    files: list[Path] = field(default_factory=list)
    #: lines of the event files that are not guardtower events
    malformed: list[Malformed] = field(default_factory=list)
    #: the last optimizer step any event mentions (None when no event carries a step)
    last_step: int | None = None


def load_run_log(path: str | os.PathLike[str]) -> RunLog:
    """Read a JSONL event file, or every event file and spike report under a directory.

    Lines that are not guardtower events are counted in ``malformed`` (a neighbour's JSONL file under a
    directory is left out without a word), so the command can say what it skipped.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise ConfigError("path", f"expected a file or directory path, got {type(path).__name__}",
                          "pass a log_dir or an events.jsonl path")
    root = Path(path)
    if not root.exists():
        raise ConfigError("path", f"no such file or directory: {str(root)!r}", "pass a log_dir or an events.jsonl path")
    log = RunLog()
    events = read_event_log(root)
    log.files.extend(events.files)
    log.malformed.extend(events.malformed)
    found = list(events.events)
    if root.is_dir():
        for file in sorted(root.rglob("*.json")):
            try:
                event = _spike_report_event(file)
            except ValueError as exc:  # a spike report cut short or damaged: said, never silently dropped
                log.malformed.append(Malformed(file, 1, f"damaged spike report ({exc})"))
                continue
            if event is not None:
                log.files.append(file)
                found.append(event)
    _merge(log, found)
    return log


_REPORT_NAME = re.compile(r"spike_step\d+-rank\d+-[0-9a-f]+\.json")


def _spike_report_event(file: Path) -> SpikeEvent | None:
    """The spike described by a guard spike report (``guardtower.spike-report/1``), else None (another
    program's JSON). ``ValueError`` for a file named or marked as a report that does not parse (truncated)."""
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, ValueError):
        return None
    try:
        data = _decode(json.loads(text))
    except ValueError as exc:
        if _REPORT_NAME.fullmatch(file.name) or _REPORT_PREFIX in text[:200]:
            raise ValueError(f"not valid JSON: {exc}") from None
        return None
    if not isinstance(data, dict) or not str(data.get("format", "")).startswith(_REPORT_PREFIX):
        return None
    step = data.get("step")
    if step is not None and (not isinstance(step, int) or isinstance(step, bool)):
        return None
    try:
        trigger = data.get("trigger") or {}
        history = data.get("history") or {}
        return SpikeEvent(
            event_id=str(data["event_id"]), time=float(data["time"]), run=str(data["run"]), rank=int(data["rank"]),
            step=step, severity=Severity.WARN, layer=str(trigger.get("layer", "")),
            module=str(trigger.get("module", "")), reason=str(data.get("reason", "spike")),
            norm=float(trigger.get("norm", math.nan)), baseline=float(trigger.get("baseline", math.nan)),
            ratio=float(trigger.get("ratio", math.nan)), threshold=float(data.get("threshold", math.nan)),
            global_norm=float(data.get("global_norm", math.nan)), action=str(data.get("action", "")),
            loss=data.get("loss"), lr=data.get("lr"),
            top_layers=tuple((str(t["layer"]), float(t["norm"]), float(t["ratio"])) for t in data.get("top_layers", ())),
            nonfinite_layers=tuple(data.get("nonfinite_layers", ())), report_path=str(file),
            history_steps=tuple(history.get("steps", ())),
            history_global_norms=tuple(history.get("global_norm", ())),
            history_layer_norms=tuple(history.get("trigger_norm", ())),
        )
    except (KeyError, TypeError, ValueError):
        return None  # a file that only looks like a report


def _merge(log: RunLog, events: list[Event]) -> None:
    seen: set[tuple[Any, ...]] = set()
    for event in sorted(events, key=lambda e: (e.step if e.step is not None else -1, e.time)):
        step = event.step
        if step is not None and not isinstance(event, PreflightEvent):
            log.last_step = step if log.last_step is None else max(log.last_step, step)
        if isinstance(event, SummaryEvent) and step is not None:
            log.global_norms.setdefault(step, event.grad_norm)
            if event.loss is not None:
                log.losses.setdefault(step, event.loss)
            for key, value in event.metrics.items():
                layer = _layer_metric(key)
                if layer is not None:
                    log.layer_norms.setdefault(layer, {}).setdefault(step, value)
            continue
        if isinstance(event, SkipEvent) and step is not None:
            log.skipped_steps.add(step)
            continue
        incident = _incident(event)
        if incident is None:
            continue
        identity = (incident.run, incident.rank, incident.step, incident.kind, incident.layer)
        if identity in seen:  # the same spike from the event log and from its spike report
            continue
        seen.add(identity)
        log.incidents.append(incident)
        if isinstance(event, SpikeEvent) and step is not None:
            if event.action == "skip":
                log.skipped_steps.add(step)
            if math.isfinite(event.global_norm) or not log.global_norms.get(step):
                log.global_norms[step] = event.global_norm
            for name, norm, _ratio in event.top_layers:
                log.layer_norms.setdefault(name, {})[step] = norm
            _merge_event_history(log, event)
        if isinstance(event, RollbackEvent):
            undone = event.from_step - event.to_step
            # a damaged record must not make the reader build an absurd range
            log.skipped_steps.update(range(event.to_step + 1, event.from_step + 1) if 0 <= undone <= _MAX_UNDONE
                                     else [event.from_step])


def _merge_event_history(log: RunLog, event: SpikeEvent) -> None:
    """The norms of the steps before a spike, when the guard recorded them with the event."""
    for step, norm in zip(event.history_steps, event.history_global_norms):
        log.global_norms.setdefault(step, norm)
    if event.layer:
        layer = log.layer_norms.setdefault(event.layer, {})
        for step, norm in zip(event.history_steps, event.history_layer_norms):
            layer.setdefault(step, norm)


def _layer_metric(key: str) -> str | None:
    """``grad_norm/<layer>`` metric keys carry per-layer norms."""
    for prefix in ("grad_norm/", "layer_grad_norm/"):
        if key.startswith(prefix) and len(key) > len(prefix):
            return key[len(prefix):]
    return None


def _incident(event: Event) -> Incident | None:
    common: dict[str, Any] = {"step": event.step, "run": event.run, "rank": event.rank}
    if isinstance(event, SpikeEvent):
        return Incident(kind=event.reason, layer=event.layer, ratio=event.ratio, action=event.action,
                        norm=event.global_norm, baseline=event.baseline, threshold=event.threshold,
                        report_path=event.report_path, **common)
    if isinstance(event, RollbackEvent):
        return Incident(kind="rollback", layer=event.layer, ratio=None,
                        action=f"rollback {event.from_step}->{event.to_step}", **common)
    if isinstance(event, HaltEvent):
        return Incident(kind="halt", layer=event.layer, ratio=event.ratio, action="raise", **common)
    if isinstance(event, NonFiniteEvent):
        return Incident(kind="activation" if event.where == "forward" else "nonfinite", layer=event.module,
                        ratio=None, action=event.severity.label.lower(), **common)
    if isinstance(event, PreflightEvent) and event.status != "PASS":
        return Incident(kind="preflight", layer=",".join(event.error_ids), ratio=None, action="fail", **common)
    return None


def format_table(incidents: Sequence[Incident]) -> str:
    """A plain-text table: step, kind, layer, ratio, action (plus run/rank when there are several)."""
    incidents = _incident_list(incidents)
    multi = len({(i.run, i.rank) for i in incidents}) > 1
    header = ["step", "kind", "layer", "ratio", "action"] + (["run", "rank"] if multi else [])
    rows = [header]
    for i in incidents:
        row = ["-" if i.step is None else str(i.step), i.kind, i.layer or "-", _fmt_ratio(i.ratio), i.action]
        if multi:
            row += [i.run, str(i.rank)]
        rows.append(row)
    widths = [max(len(r[c]) for r in rows) for c in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _incident_list(value: Any) -> list[Incident]:
    """``value`` as a list, or a ConfigError when it is not a sequence of Incident."""
    try:
        items = None if isinstance(value, (str, bytes)) else list(value)
    except TypeError:
        items = None
    if items is None or not all(isinstance(i, Incident) for i in items):
        raise ConfigError("incidents", f"expected a sequence of Incident, got {type(value).__name__}",
                          "pass load_run_log(path).incidents")
    return items


def _fmt_ratio(ratio: float | None) -> str:
    if ratio is None:
        return "-"
    if math.isnan(ratio):
        return "nan"
    if math.isinf(ratio):
        return "inf"
    return f"{ratio:.3g}"


def main(argv: Sequence[str] | None = None) -> int:
    """Exit status: 0 listed, 2 bad usage or unreadable input (also after listing, when lines were skipped)."""
    parser = ArgumentParser(
        prog="guardtower report",
        description="List the incidents (rejected steps, rollbacks, halts, failed pre-flights) of a run.",
    )
    parser.add_argument("path", help="a log_dir or a JSONL event file")
    parser.add_argument("--plot", metavar="OUT.png",
                        help="draw the whole run's gradient norms with a panel per incident (or burst) below")
    parser.add_argument("--json", action="store_true", help="print the incidents as JSON lines")
    parser.add_argument("--list", action="store_true", help="list the run folders under a log root, newest last")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    chosen, note = pick_run(Path(args.path), listing=args.list)
    if args.list:
        print(note)
        return 0
    if note:
        print(note, file=sys.stderr)

    try:
        log = load_run_log(chosen)
    except ConfigError as exc:
        print(f"guardtower report: {exc}", file=sys.stderr)
        return 2
    path = chosen
    if not log.files:
        problem = f" ({describe_malformed(log.malformed)})" if log.malformed else ""
        print(f"guardtower report: no guardtower event or spike report in {path}{problem}", file=sys.stderr)
        return 2
    if args.json:
        for incident in log.incidents:
            print(json.dumps({k: _json_number(v) for k, v in vars(incident).items()}, allow_nan=False))
    else:
        steps = "no step recorded" if log.last_step is None else _count(log.last_step, "step")
        print(f"{steps}, {_count(len(log.incidents), 'incident')} in {path}")
        if log.incidents:
            print(format_table(log.incidents))
    if args.plot:
        from guardtower._plot import plot_run_log

        try:
            out = plot_run_log(log, args.plot)
        except MissingDependencyError as exc:
            print(f"guardtower report: {exc}", file=sys.stderr)
            return 2
        print(f"plot written to {out}")
    if log.malformed:
        print(f"guardtower report: {describe_malformed(log.malformed)}", file=sys.stderr)
        return 2
    return 0


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _json_number(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value
