"""Microsoft Teams via Workflows (Power Automate) webhooks: an Adaptive Card in a message envelope.

Teams' classic Office 365 connectors are retired; a Workflows "post to a channel when a webhook request is
received" flow takes ``{"type": "message", "attachments": [{"contentType":
"application/vnd.microsoft.card.adaptive", "content": <card>}]}`` and answers 202.
"""

from __future__ import annotations

from typing import Any

from guardtower.severity import Severity
from guardtower.alerts import _format
from guardtower.alerts._secret import resolve_url
from guardtower.alerts.base import AlertSink
from guardtower.alerts.grouping import Notification

__all__ = ["TeamsAlert", "CARD_CONTENT_TYPE", "CARD_VERSION"]

CARD_CONTENT_TYPE = "application/vnd.microsoft.card.adaptive"
CARD_VERSION = "1.4"
_MAX_TEXT = 2000  # Teams rejects messages over ~28 KB; keep every text block small
_MAX_FACTS = 20
_COLORS = {Severity.INFO: "Accent", Severity.WARN: "Warning", Severity.ERROR: "Attention"}


class TeamsAlert(AlertSink):
    """Post alert messages to a Teams Workflows webhook (``url`` or ``TEAMS_WEBHOOK_URL``).

    See ``AlertSink`` for the other arguments.
    """

    kind = "teams"
    default_rate_limit = 1.0

    def __init__(self, url: str | None = None, **kwargs: Any) -> None:
        super().__init__(resolve_url(url, "url", "TEAMS_WEBHOOK_URL"), **kwargs)

    def render(self, note: Notification) -> dict[str, Any]:
        run_url = self.link(note.run)
        card: dict[str, Any] = {
            "type": "AdaptiveCard",
            "$schema": "http://adaptivecards.io/schemas/adaptive-card.json",
            "version": CARD_VERSION,
            "msteams": {"width": "Full"},
            "body": [
                {"type": "TextBlock", "text": _format.truncate(_format.title(note.event), 200), "weight": "Bolder",
                 "size": "Medium", "wrap": True, "color": _COLORS[note.severity]},
                {"type": "TextBlock", "text": _format.truncate(_format.headline(note), _MAX_TEXT), "wrap": True},
                {"type": "FactSet", "facts": [
                    {"title": _format.truncate(k, 100), "value": _format.truncate(v, 500)}
                    for k, v in _format.facts(note)[:_MAX_FACTS]
                ]},
                {"type": "TextBlock", "text": _format.truncate(_format.id_line(note), _MAX_TEXT), "wrap": True,
                 "size": "Small", "isSubtle": True},
            ],
        }
        if run_url:
            card["actions"] = [{"type": "Action.OpenUrl", "title": "Open run", "url": run_url}]
        return {"type": "message", "attachments": [{"contentType": CARD_CONTENT_TYPE, "contentUrl": None,
                                                     "content": card}]}
