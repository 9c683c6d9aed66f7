"""PagerDuty Events API v2: trigger an incident per fingerprint, resolve it when it clears.

``dedup_key`` is the event fingerprint (run, kind, layer), so every update of one incident lands on the
same PagerDuty alert. An incident clears when a summary event of the same run arrives
``GroupPolicy.resolve_after_steps`` steps after its last occurrence (the guard publishes summaries every
``log_every`` steps), when a rollback or halt of the run supersedes a spike/skip incident, or on an
explicit ``sink.resolve(run=..., fingerprint=...)``; each sends ``event_action: resolve``.
"""

from __future__ import annotations

import datetime
import socket
from typing import Any

from guardtower import _validate
from guardtower.severity import Severity
from guardtower.alerts import _format
from guardtower.alerts._secret import resolve_secret, resolve_url
from guardtower.alerts.base import AlertSink
from guardtower.alerts.grouping import Notification

__all__ = ["PagerDutyAlert", "EVENTS_API_URL", "MAX_SUMMARY", "pagerduty_severity"]

EVENTS_API_URL = "https://events.pagerduty.com/v2/enqueue"
MAX_SUMMARY = 1024
_MAX_IDS = 1000  # PagerDuty caps an event at 512 KB


def pagerduty_severity(kind: str, severity: Severity) -> str:
    """PagerDuty's critical/error/warning/info: a halt is critical, otherwise the event's severity."""
    if kind == "halt":
        return "critical"
    return {Severity.ERROR: "error", Severity.WARN: "warning"}.get(severity, "info")


class PagerDutyAlert(AlertSink):
    """Trigger and resolve PagerDuty incidents (``routing_key`` or ``PAGERDUTY_ROUTING_KEY``).

    ``source`` names the affected system (default: this host), ``url`` the Events API endpoint.
    ``send_resolved`` defaults to True here. See ``AlertSink`` for the other arguments.
    """

    kind = "pagerduty"
    default_rate_limit = 2.0  # the Events API allows 120 events per minute per routing key
    default_send_resolved = True

    def __init__(self, routing_key: str | None = None, *, url: str = EVENTS_API_URL, source: str | None = None,
                 **kwargs: Any) -> None:
        self._routing_key = resolve_secret(routing_key, "routing_key", "PAGERDUTY_ROUTING_KEY")
        self.source = _validate.text("source", source, allow_none=True, example="a host name") or socket.gethostname()
        endpoint = resolve_url(url, "url", "PAGERDUTY_EVENTS_URL")
        assert self._routing_key is not None
        kwargs.setdefault("throttle_key", endpoint.reveal() + "#" + self._routing_key.reveal())
        super().__init__(endpoint, **kwargs)

    def render(self, note: Notification) -> dict[str, Any]:
        assert self._routing_key is not None
        base: dict[str, Any] = {"routing_key": self._routing_key.reveal(), "dedup_key": note.fingerprint}
        if note.status == "resolved":
            return {**base, "event_action": "resolve"}
        event = note.event
        label = getattr(event, "layer", "") or getattr(event, "module", "") or getattr(event, "check", "")
        details: dict[str, Any] = dict(_format.facts(note))
        details.update(status=note.status, count=note.count, total=note.total, first_step=note.first_step,
                       last_step=note.last_step, superseded=dict(note.superseded), event_id=note.message_id,
                       event_ids=note.event_ids[:_MAX_IDS], event_ids_total=len(note.events))
        shown_kind = _format.kind(event)  # a NaN/Inf step is "nonfinite", as in the text
        payload: dict[str, Any] = {
            "summary": _format.truncate(f"[{note.run}] " + _format.headline(note), MAX_SUMMARY),
            "source": self.source,
            "severity": pagerduty_severity(shown_kind, note.severity),
            "timestamp": datetime.datetime.fromtimestamp(event.time, datetime.timezone.utc).isoformat(),
            "component": label or shown_kind,
            "group": note.run,
            "class": shown_kind,
            "custom_details": details,
        }
        message: dict[str, Any] = {**base, "event_action": "trigger", "payload": payload, "client": "guardtower"}
        run_url = self.link(note.run)
        if run_url:
            message["client_url"] = run_url
            message["links"] = [{"href": run_url, "text": "training run"}]
        return message
