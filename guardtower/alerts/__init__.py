"""Alert sinks: guard events as Slack, webhook, Discord, Teams and PagerDuty notifications.

Every sink groups events by incident (``GroupPolicy``), rate-limits per destination, retries with
backoff (``RetryPolicy``) and writes what it cannot deliver to a dead-letter spool that
``guardtower replay`` re-sends. Needs ``pip install "guardtower[alerts]"`` (requests, tenacity); this
package imports them only when a sink is built.
"""

from __future__ import annotations

from guardtower.alerts._secret import Secret
from guardtower.alerts._transport import DeliveryError
from guardtower.alerts.base import DEFAULT_KINDS, AlertSink
from guardtower.alerts.discord import DiscordAlert
from guardtower.alerts.grouping import Grouper, Notification
from guardtower.alerts.pagerduty import PagerDutyAlert
from guardtower.alerts.policy import GroupPolicy, RetryPolicy, Throttle
from guardtower.alerts.slack import SlackAlert
from guardtower.alerts.teams import TeamsAlert
from guardtower.alerts.webhook import WebhookAlert, verify_signature

__all__ = [
    "WebhookAlert",
    "SlackAlert",
    "DiscordAlert",
    "TeamsAlert",
    "PagerDutyAlert",
    "AlertSink",
    "GroupPolicy",
    "RetryPolicy",
    "Throttle",
    "Grouper",
    "Notification",
    "DeliveryError",
    "Secret",
    "DEFAULT_KINDS",
    "verify_signature",
]
