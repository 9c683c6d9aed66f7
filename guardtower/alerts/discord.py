"""Discord webhooks: a short ``content`` line and one embed, inside Discord's limits."""

from __future__ import annotations

import datetime
from typing import Any

from guardtower.severity import Severity
from guardtower.alerts import _format
from guardtower.alerts._secret import resolve_url
from guardtower.alerts.base import AlertSink
from guardtower.alerts.grouping import Notification

__all__ = ["DiscordAlert", "MAX_CONTENT", "MAX_EMBEDS", "MAX_EMBED_TOTAL", "MAX_TITLE", "MAX_DESCRIPTION"]

MAX_CONTENT = 2000
MAX_EMBEDS = 10
MAX_EMBED_TOTAL = 6000
MAX_TITLE = 256
MAX_DESCRIPTION = 4096
MAX_FIELDS = 25
MAX_FIELD_NAME = 256
MAX_FIELD_VALUE = 1024
MAX_FOOTER = 2048
_COLORS = {Severity.INFO: 0x3498DB, Severity.WARN: 0xF1C40F, Severity.ERROR: 0xE74C3C}


class DiscordAlert(AlertSink):
    """Post alert messages to a Discord webhook (``url`` or ``DISCORD_WEBHOOK_URL``).

    Mentions are disabled (``allowed_mentions``), so a layer or run name can never ping anyone.
    See ``AlertSink`` for the other arguments.
    """

    kind = "discord"
    default_rate_limit = 0.5  # Discord allows a burst of 5 per 2 s per webhook; stay well below

    def __init__(self, url: str | None = None, **kwargs: Any) -> None:
        super().__init__(resolve_url(url, "url", "DISCORD_WEBHOOK_URL"), **kwargs)

    def render(self, note: Notification) -> dict[str, Any]:
        run_url = self.link(note.run)
        description = _format.headline(note) + (f"\n[Open run]({run_url})" if run_url else "")
        embed: dict[str, Any] = {
            "title": _format.truncate(_format.title(note.event), MAX_TITLE),
            "description": _format.truncate(description, MAX_DESCRIPTION),
            "color": _COLORS[note.severity],
            "fields": [
                {"name": _format.truncate(k, MAX_FIELD_NAME), "value": _format.truncate(v or "-", MAX_FIELD_VALUE),
                 "inline": True}
                for k, v in _format.facts(note)[:MAX_FIELDS]
            ],
            "footer": {"text": _format.truncate(_format.id_line(note), MAX_FOOTER)},
            "timestamp": datetime.datetime.fromtimestamp(note.event.time, datetime.timezone.utc).isoformat(),
        }
        if run_url:
            embed["url"] = run_url
        _fit_total(embed)
        return {
            "content": _format.truncate(_format.headline(note), MAX_CONTENT),
            "embeds": [embed],
            "allowed_mentions": {"parse": []},
        }


def embed_size(embed: dict[str, Any]) -> int:
    """Characters Discord counts against the 6,000 limit (title, description, fields, footer, author)."""
    size = len(embed.get("title", "")) + len(embed.get("description", ""))
    size += len(embed.get("footer", {}).get("text", "")) + len(embed.get("author", {}).get("name", ""))
    return size + sum(len(f["name"]) + len(f["value"]) for f in embed.get("fields", []))


def _fit_total(embed: dict[str, Any]) -> None:
    """Drop fields from the end, then shorten the description, until the embed fits."""
    while embed_size(embed) > MAX_EMBED_TOTAL and embed["fields"]:
        embed["fields"].pop()
    excess = embed_size(embed) - MAX_EMBED_TOTAL
    if excess > 0:
        embed["description"] = _format.truncate(embed["description"], max(1, len(embed["description"]) - excess))
