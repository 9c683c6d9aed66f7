"""Slack incoming webhooks: Block Kit with a plain-text fallback, inside Slack's limits."""

from __future__ import annotations

from typing import Any

from guardtower.alerts import _format
from guardtower.alerts._secret import resolve_url
from guardtower.alerts.base import AlertSink
from guardtower.alerts.grouping import Notification

__all__ = ["SlackAlert", "MAX_BLOCKS", "MAX_SECTION_TEXT", "MAX_HEADER_TEXT", "MAX_FIELDS", "MAX_FIELD_TEXT"]

MAX_BLOCKS = 50
MAX_SECTION_TEXT = 3000
MAX_HEADER_TEXT = 150
MAX_FIELDS = 10
MAX_FIELD_TEXT = 2000
MAX_CONTEXT_ELEMENTS = 10
_FALLBACK_TEXT = 3000


class SlackAlert(AlertSink):
    """Post alert messages to a Slack incoming webhook (``url`` or ``SLACK_WEBHOOK_URL``).

    At most one message per second per webhook (Slack's limit), grouped by incident; a message links the
    W&B or MLflow run when ``run_url=`` is given. See ``AlertSink`` for the other arguments.
    """

    kind = "slack"
    default_rate_limit = 1.0

    def __init__(self, url: str | None = None, **kwargs: Any) -> None:
        super().__init__(resolve_url(url, "url", "SLACK_WEBHOOK_URL"), **kwargs)

    def render(self, note: Notification) -> dict[str, Any]:
        run_url = self.link(note.run)
        status = {"firing": "", "update": "Update: ", "repeat": "Still firing: ", "resolved": "Resolved: "}
        header = _format.truncate(status.get(note.status, "") + _format.title(note.event), MAX_HEADER_TEXT)
        blocks: list[dict[str, Any]] = [
            {"type": "header", "text": {"type": "plain_text", "text": header}},
            _section(f"*{_escape(_format.headline(note))}*"),
        ]
        fields = [_mrkdwn(f"*{_escape(k)}*\n{_escape(v)}", MAX_FIELD_TEXT) for k, v in _format.facts(note)]
        for start in range(0, len(fields), MAX_FIELDS):
            blocks.append({"type": "section", "fields": fields[start:start + MAX_FIELDS]})
        if run_url:
            blocks.append({"type": "actions", "elements": [
                {"type": "button", "text": {"type": "plain_text", "text": "Open run"}, "url": run_url}]})
        blocks.append({"type": "context", "elements": [_mrkdwn(_escape(_format.id_line(note)), MAX_SECTION_TEXT)]})
        if len(blocks) > MAX_BLOCKS:  # keep the head and the ids
            blocks = blocks[: MAX_BLOCKS - 1] + blocks[-1:]
        return {
            "text": _format.truncate(_escape(_format.text(note, run_url)), _FALLBACK_TEXT),
            "blocks": blocks,
            "unfurl_links": False,
            "unfurl_media": False,
        }


def _escape(text: str) -> str:
    """Slack mrkdwn control characters (names and messages must not become links or mentions)."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _mrkdwn(text: str, limit: int) -> dict[str, str]:
    return {"type": "mrkdwn", "text": _format.truncate(text, limit)}


def _section(text: str) -> dict[str, Any]:
    return {"type": "section", "text": _mrkdwn(text, MAX_SECTION_TEXT)}
