"""Weights & Biases bridge: guardtower events become history rows, run summary, a findings table and alerts.

Everything goes to the run the user already has (``run=`` or the active ``wandb.run`` when the bridge is
built); the bridge never starts a run. Metrics live under ``{prefix}/`` on their own x-axis
``{prefix}/step`` (the training step of the event), so they chart correctly whatever the user does with
``wandb.log``'s own step.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
from typing import Any, Iterable

from guardtower import _validate
from guardtower._delivery import PartialFailure
from guardtower._wording import what
from guardtower.bridges._common import check_prefix, incident_label, require, warn_once
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

__all__ = ["WandBBridge", "ALERT_KINDS", "alert_title"]

logger = logging.getLogger("guardtower.bridges.wandb")

#: the incident kinds that raise a W&B alert
ALERT_KINDS = frozenset({PreflightEvent.kind, SpikeEvent.kind, RollbackEvent.kind, HaltEvent.kind, StallEvent.kind,
                         "skip_budget", "lr_backoff"})


def alert_title(event: Event) -> str:
    """``guardtower: NaN/Inf gradient``: stable per kind of incident (< 64 characters), so W&B's
    ``wait_duration`` throttles repeats; the same wording as every other alert."""
    return f"guardtower: {what(event)}"

_FINDING_COLUMNS = ["check", "severity", "catalog_id", "message"]


class WandBBridge(BaseSink):
    """Forward guardtower events to a W&B run.

    ``alerts``: True (failed pre-flight, spikes, rollbacks, halts, stalls), False, or an iterable of those kinds.
    ``alert_wait``: seconds W&B waits before sending another alert with the same title. Only finite
    numbers are logged: a NaN/Inf value is left out and ``{prefix}/nonfinite`` is set to 1 instead.
    """

    rank_zero_only = True

    def __init__(
        self,
        run: Any = None,
        *,
        prefix: str = "guardtower",
        alerts: bool | Iterable[str] = True,
        alert_wait: float = 300.0,
        findings_table: bool = True,
    ) -> None:
        self.prefix = check_prefix(prefix)
        self.alert_kinds = _alert_kinds(alerts)
        self.alert_wait = float(_validate.number("alert_wait", alert_wait, minimum=0))
        self.findings_table = _validate.flag("findings_table", findings_table)
        self._wandb = require("wandb", "wandb")
        if run is not None and not all(callable(getattr(run, m, None)) for m in ("log", "define_metric", "alert")):
            raise ConfigError("run", f"expected a W&B run (from wandb.init()), got {type(run).__name__}",
                              "pass run=wandb.init(...) or leave it None to use wandb.run")
        self.run = run if run is not None else self._wandb.run
        run_id = getattr(self.run, "id", None)
        self.name = f"wandb:{run_id}" if run_id else "wandb"
        self._lock = threading.Lock()
        self._counts: collections.Counter[str] = collections.Counter()
        self._totals = {"spikes": 0, "skips": 0, "rollbacks": 0}
        if self.run is None:
            warn_once("wandb-no-run", "guardtower WandBBridge: no W&B run (pass run= or call wandb.init() before building the bridge); "
                      "guardtower events will not be sent to W&B")
            return
        try:
            self.run.define_metric(f"{self.prefix}/step")
            self.run.define_metric(f"{self.prefix}/*", step_metric=f"{self.prefix}/step")
        except Exception:
            logger.warning("guardtower: could not define the %s/step axis on the W&B run", self.prefix, exc_info=True)

    @property
    def active(self) -> bool:
        """False when there was no run to log to: events are then ignored (and counted in ``stats()``)."""
        return self.run is not None

    def handle(self, event: Event) -> None:
        self.handle_batch([event])

    def handle_batch(self, events: list[Event]) -> None:
        with self._lock:
            if self.run is None:
                self._counts["ignored"] += len(events)
                return
            rows: list[tuple[dict[str, Any], list[Event]]] = []
            failed: list[Event] = []
            reason = ""
            for event in events:
                try:
                    row = self._apply(event)
                except Exception as exc:
                    failed.append(event)
                    reason = f"W&B rejected a {event.kind} event: {type(exc).__name__}"
                    continue
                if row:
                    _merge_row(rows, _finite(row, self.prefix), event, f"{self.prefix}/step")
            for row, row_events in rows:
                try:
                    self.run.log(row)
                except Exception as exc:
                    failed.extend(row_events)
                    reason = f"W&B rejected a history row: {type(exc).__name__}"
            self._counts["delivered"] += len(events) - len(failed)
            if failed:
                self._counts["failed"] += len(failed)
                raise PartialFailure(failed, reason)

    def stats(self) -> dict[str, int]:
        """Events delivered, failed (the W&B call raised) and ignored (no run)."""
        with self._lock:
            return {k: self._counts[k] for k in ("delivered", "failed", "ignored")}

    # -- one event -------------------------------------------------------------------------------------

    def _apply(self, event: Event) -> dict[str, Any] | None:
        """Update summary and alerts for ``event``; return its history row (or None)."""
        p = self.prefix
        row: dict[str, Any] = {}
        summary: dict[str, Any] = {}
        if isinstance(event, SummaryEvent):
            row = {f"{p}/grad_norm": event.grad_norm, f"{p}/spikes": event.total_spikes,
                   f"{p}/skipped_steps": event.total_skips, f"{p}/rollbacks": event.total_rollbacks}
            self._raise_totals(event.total_spikes, event.total_skips, event.total_rollbacks)
        elif isinstance(event, SpikeEvent):
            self._totals["spikes"] += 1
            row = {f"{p}/spike_ratio": event.ratio, f"{p}/grad_norm": event.global_norm,
                   f"{p}/trigger_layer": event.layer, f"{p}/spikes": self._totals["spikes"],
                   f"{p}/nonfinite": int(event.reason == "nonfinite")}
            if event.loss is not None:
                row[f"{p}/loss_at_spike"] = event.loss
        elif isinstance(event, SkipEvent):
            self._raise_totals(0, event.total_skips, 0)
            row = {f"{p}/skipped_steps": self._totals["skips"]}
        elif isinstance(event, RollbackEvent):
            self._raise_totals(0, 0, event.total_rollbacks)
            row = {f"{p}/rollbacks": self._totals["rollbacks"]}
        elif isinstance(event, HaltEvent):
            summary[f"{p}/halted"] = incident_label(event)
        elif isinstance(event, PreflightEvent):
            summary.update({
                f"{p}/preflight": event.status,
                f"{p}/preflight_errors": ",".join(dict.fromkeys(event.error_ids)),
                f"{p}/preflight_warnings": ",".join(dict.fromkeys(event.warning_ids)),
            })
            if self.findings_table:
                row = {f"{p}/preflight_findings": self._findings_table(event)}
        if event.kind in ("spike", "skip", "rollback", "halt", "nonfinite"):
            summary[f"{p}/last_incident"] = incident_label(event)
        if row or summary:
            summary.update({f"{p}/total_{k}": v for k, v in self._totals.items()})
        for key, value in _finite(summary, p).items():
            self.run.summary[key] = value
        self._maybe_alert(event)
        if row:
            row[f"{p}/step"] = event.step if event.step is not None else 0
        return row or None

    def _raise_totals(self, spikes: int, skips: int, rollbacks: int) -> None:
        """Producers report running totals; keep the largest seen (events may arrive from several sources)."""
        self._totals["spikes"] = max(self._totals["spikes"], spikes)
        self._totals["skips"] = max(self._totals["skips"], skips)
        self._totals["rollbacks"] = max(self._totals["rollbacks"], rollbacks)

    def _findings_table(self, event: PreflightEvent) -> Any:
        findings = event.report.get("findings", []) if isinstance(event.report, dict) else []
        data = [[str(f.get(c, "")) for c in _FINDING_COLUMNS] for f in findings if isinstance(f, dict)]
        return self._wandb.Table(columns=list(_FINDING_COLUMNS), data=data)

    def _maybe_alert(self, event: Event) -> None:
        if event.kind not in self.alert_kinds:
            return
        if isinstance(event, PreflightEvent) and event.status != "FAIL":
            return
        level = self._wandb.AlertLevel
        severe = isinstance(event, (PreflightEvent, HaltEvent))
        resumed = isinstance(event, StallEvent) and event.resolved
        self.run.alert(
            title=alert_title(event),
            text=_alert_text(event),
            level=level.ERROR if severe else (level.INFO if resumed else level.WARN),
            wait_duration=self.alert_wait,
        )

    def __repr__(self) -> str:
        return f"WandBBridge(run={getattr(self.run, 'id', None)!r}, prefix={self.prefix!r})"


def _alert_kinds(alerts: bool | Iterable[str]) -> frozenset[str]:
    if alerts is True:
        return ALERT_KINDS
    if alerts is False or alerts is None:
        return frozenset()
    if isinstance(alerts, str):
        alerts = [alerts]
    try:
        kinds = frozenset(alerts)
    except TypeError:
        kinds = frozenset({repr(alerts)})
    unknown = kinds - ALERT_KINDS
    if unknown:
        raise ConfigError("alerts", f"unknown alert kind(s) {sorted(map(str, unknown))}",
                          f"pass True, False or a subset of {sorted(ALERT_KINDS)}")
    return kinds


def _alert_text(event: Event) -> str:
    where = f"run {event.run}, step {event.step if event.step is not None else '-'}"
    if isinstance(event, PreflightEvent):
        ids = ", ".join(dict.fromkeys(event.error_ids)) or "-"
        return f"Pre-flight FAIL ({where}): {event.errors} error(s) [{ids}], {event.warnings} warning(s)."
    if isinstance(event, SpikeEvent):
        return (f"{event.reason} in {event.layer or '?'} ({where}): ratio {event.ratio:.3g} "
                f"(threshold {event.threshold:g}), global grad norm {event.global_norm:.3g}; action {event.action}.")
    if isinstance(event, RollbackEvent):
        return (f"Rolled back from step {event.from_step} to the snapshot of step {event.to_step} ({where}); "
                f"{event.reason} in {event.layer or '?'}; {event.total_rollbacks} rollback(s) so far.")
    if isinstance(event, HaltEvent):
        return f"Training halted ({where}): {event.message or event.reason} in {event.layer or '?'}."
    if isinstance(event, StallEvent):
        if event.resolved:
            return f"Training resumed ({where}) after {event.seconds:.0f} s without an optimizer step."
        return (f"No optimizer step for {event.seconds:.0f} s ({where} was the last; "
                f"stall_after {event.stall_after:g} s).")
    return incident_label(event)


def _finite(values: dict[str, Any], prefix: str) -> dict[str, Any]:
    """``values`` without NaN/Inf numbers (W&B would chart ``inf``); ``{prefix}/nonfinite`` = 1 says so."""
    kept = {k: v for k, v in values.items() if not (isinstance(v, float) and not math.isfinite(v))}
    if len(kept) < len(values):
        kept[f"{prefix}/nonfinite"] = 1
    return kept


def _merge_row(rows: list[tuple[dict[str, Any], list[Event]]], row: dict[str, Any], event: Event,
               step_key: str) -> None:
    """Fold ``row`` into the last row when it is for the same step and has no clashing key: fewer W&B steps."""
    if rows and rows[-1][0][step_key] == row[step_key] and not (set(rows[-1][0]) & set(row)) - {step_key}:
        rows[-1][0].update(row)
        rows[-1][1].append(event)
    else:
        rows.append((row, [event]))
