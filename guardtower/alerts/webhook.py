"""Generic JSON webhook: the event record plus group counts, optionally signed with HMAC-SHA256.

Signature scheme (receivers: use ``verify_signature``): header ``X-Guardtower-Timestamp`` holds unix
seconds, ``X-Guardtower-Signature`` holds ``sha256=<hex>`` of HMAC-SHA256(secret, timestamp + "." + body).
Signing the timestamp lets a receiver reject replays older than a tolerance. Each attempt is signed anew.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from typing import Any, Mapping

from guardtower.alerts import _format
from guardtower.alerts._secret import Secret, resolve_secret, resolve_url
from guardtower.alerts.base import AlertSink
from guardtower.alerts.grouping import Notification

__all__ = ["WebhookAlert", "verify_signature", "sign", "SIGNATURE_HEADER", "TIMESTAMP_HEADER", "PAYLOAD_VERSION"]

SIGNATURE_HEADER = "X-Guardtower-Signature"
TIMESTAMP_HEADER = "X-Guardtower-Timestamp"
PAYLOAD_VERSION = 1


class WebhookAlert(AlertSink):
    """POST each alert message as JSON to ``url`` (or ``GUARDTOWER_WEBHOOK_URL``).

    Payload: ``status``, ``title``, ``text``, ``kind``, ``run``, ``severity``, ``fingerprint``, ``count``,
    ``total``, ``first_step``/``last_step``, ``superseded``, ``event`` (the latest event's record),
    ``event_id`` (the message id) and ``event_ids`` (every event the message delivers: deduplicate on
    these), ``run_url``. With ``secret`` (or ``GUARDTOWER_WEBHOOK_SECRET``) the body is signed.
    See ``AlertSink`` for the other arguments.
    """

    kind = "webhook"

    def __init__(self, url: str | None = None, *, secret: str | None = None, **kwargs: Any) -> None:
        destination = resolve_url(url, "url", "GUARDTOWER_WEBHOOK_URL")
        self._secret = resolve_secret(secret, "secret", "GUARDTOWER_WEBHOOK_SECRET", required=False)
        super().__init__(destination, **kwargs)

    def render(self, note: Notification) -> dict[str, Any]:
        return {
            "source": "guardtower",
            "version": PAYLOAD_VERSION,
            "status": note.status,
            "title": _format.title(note.event),
            "text": _format.headline(note),
            "kind": _format.kind(note.event),  # a NaN/Inf step is "nonfinite" here as in the text
            "run": note.run,
            "severity": note.severity.label,
            "fingerprint": note.fingerprint,
            "count": note.count,
            "total": note.total,
            "first_step": note.first_step,
            "last_step": note.last_step,
            "superseded": dict(note.superseded),
            "reason": note.reason,
            "event_id": note.message_id,
            "event_ids": note.event_ids,
            "event": note.event.to_record(),
            "run_url": self.link(note.run),
        }

    def headers(self, body: bytes) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self._secret is not None:
            headers.update(sign(body, self._secret))
        return headers


def sign(body: bytes, secret: str | bytes | Secret, timestamp: int | None = None) -> dict[str, str]:
    """The timestamp and signature headers for ``body``."""
    ts = str(int(time.time()) if timestamp is None else timestamp)
    digest = hmac.new(_key(secret), ts.encode() + b"." + body, hashlib.sha256).hexdigest()
    return {TIMESTAMP_HEADER: ts, SIGNATURE_HEADER: f"sha256={digest}"}


def verify_signature(body: bytes, headers: Mapping[str, str], secret: str | bytes | Secret,
                     tolerance_s: float = 300.0, *, now: float | None = None) -> bool:
    """True when ``headers`` carry a valid signature of ``body`` made within ``tolerance_s`` of ``now``.

    For receivers: pass the raw request body (before JSON parsing) and its headers (any capitalisation).
    """
    lower = {k.lower(): v for k, v in headers.items()}
    ts = lower.get(TIMESTAMP_HEADER.lower(), "")
    signature = lower.get(SIGNATURE_HEADER.lower(), "")
    try:
        sent = int(ts)
    except ValueError:
        return False
    if abs((time.time() if now is None else now) - sent) > tolerance_s:
        return False
    expected = sign(body, secret, sent)[SIGNATURE_HEADER]
    return hmac.compare_digest(expected.encode(), signature.encode())


def _key(secret: str | bytes | Secret) -> bytes:
    if isinstance(secret, Secret):
        secret = secret.reveal()
    return secret if isinstance(secret, bytes) else secret.encode()

