"""Weights & Biases bridge: guardtower events become history rows, run summary, a findings table and alerts.

Everything goes to the run the user already has (``run=`` or the active ``wandb.run`` when the bridge is
built); the bridge never starts a run. Metrics live under ``{prefix}/`` on their own x-axis
``{prefix}/step`` (the training step of the event), so they chart correctly whatever the user does with
``wandb.log``'s own step.
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Any, Iterable

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

__all__ = ["WandBBridge", "ALERT_KINDS", "ALERT_TITLES"]

logger = logging.getLogger("guardtower.bridges.wandb")

#: incident kind -> W&B alert title (stable, < 64 characters, so W&B's wait_duration throttles repeats)
ALERT_TITLES: dict[str, str] = {
    PreflightEvent.kind: "guardtower: pre-flight failed",
    SpikeEvent.kind: "guardtower: gradient spike",
    RollbackEvent.kind: "guardtower: rolled back to a snapshot",
    HaltEvent.kind: "guardtower: training halted",
    StallEvent.kind: "guardtower: training stalled",
}
#: the title of the alert that a stall is over (its own title, so W&B's wait_duration does not swallow it)
RESUMED_TITLE = "guardtower: training resumed"
ALERT_KINDS = frozenset(ALERT_TITLES)

_FINDING_COLUMNS = ["check", "severity", "catalog_id", "message"]


class WandBBridge(BaseSink):
    """Forward guardtower events to a W&B run.

    ``alerts``: True (failed pre-flight, spikes, rollbacks, halts, stalls), False, or an iterable of those kinds.
    ``alert_wait``: seconds W&B waits before sending another alert with the same title.
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
        if isinstance(alert_wait, bool) or not isinstance(alert_wait, (int, float)) or not alert_wait >= 0:
            raise ConfigError("alert_wait", f"{alert_wait!r} is not a number of seconds >= 0", "pass e.g. 300")
        self.alert_wait = float(alert_wait)
        self.findings_table = bool(findings_table)
        self._wandb = require("wandb", "wandb")
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
            rows: list[dict[str, Any]] = []
            for event in events:
                try:
                    row = self._apply(event)
                except Exception:
                    self._failed(event)
                    continue
                if row:
                    _merge_row(rows, row, f"{self.prefix}/step")
                self._counts["delivered"] += 1
            for row in rows:
                try:
                    self.run.log(row)
                except Exception:
                    self._failed(None)

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
                   f"{p}/trigger_layer": event.layer, f"{p}/spikes": self._totals["spikes"]}
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
        for key, value in summary.items():
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
            title=RESUMED_TITLE if resumed else ALERT_TITLES[event.kind],
            text=_alert_text(event),
            level=level.ERROR if severe else (level.INFO if resumed else level.WARN),
            wait_duration=self.alert_wait,
        )

    def _failed(self, event: Event | None) -> None:
        self._counts["failed"] += 1
        if self._counts["failed"] <= 3:
            what = f"a {event.kind} event" if event is not None else "a history row"
            logger.warning("guardtower: W&B rejected %s", what, exc_info=True)

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


def _merge_row(rows: list[dict[str, Any]], row: dict[str, Any], step_key: str) -> None:
    """Fold ``row`` into the last row when it is for the same step and has no clashing key: fewer W&B steps."""
    if rows and rows[-1][step_key] == row[step_key] and not (set(rows[-1]) & set(row)) - {step_key}:
        rows[-1].update(row)
    else:
        rows.append(row)
