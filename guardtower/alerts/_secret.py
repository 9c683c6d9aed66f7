"""Secret values (webhook URLs, routing keys, HMAC keys) that never print, log or travel into errors.

A ``Secret`` reprs as ``<redacted>``; ``redact()`` strips every live secret (and, for URLs, their path and
query, which is where webhook tokens live) from text such as a requests/urllib3 error message, and the
``user:password@`` and ``?query`` of any URL in it (MLflow tracking URIs carry tokens there). A logging
filter on urllib3's loggers does the same for its debug lines, which name the request path. The MLflow
bridge uses the same mechanism for its tracking URI.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import urllib.parse
import weakref

from guardtower.errors import ConfigError

__all__ = ["Secret", "resolve_secret", "resolve_url", "redact", "has_credentials", "REDACTED"]

REDACTED = "<redacted>"
#: loggers of the HTTP stack that put request URLs into their records
_HTTP_LOGGERS = ("urllib3.connectionpool", "urllib3.util.retry", "urllib3.connection", "requests")

_live: "weakref.WeakSet[Secret]" = weakref.WeakSet()
_live_lock = threading.Lock()
_filter_installed = False


class Secret:
    """A string that shows as ``<redacted>`` everywhere except through ``reveal()``."""

    __slots__ = ("_value", "_needles", "__weakref__")

    def __init__(self, value: str) -> None:
        self._value = value
        self._needles = _needles(value)
        with _live_lock:
            _live.add(self)
        _install_log_filter()

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return REDACTED

    __str__ = __repr__

    def __format__(self, spec: str) -> str:
        return REDACTED

    def __reduce__(self) -> tuple[object, ...]:
        raise TypeError("guardtower Secret values cannot be pickled")



def resolve_secret(value: str | Secret | None, argument: str, env: str, *, required: bool = True) -> Secret | None:
    """The secret from the argument, else from ``env``; ``ConfigError`` naming both when required and absent."""
    if isinstance(value, Secret):
        return value
    if value is None or value == "":
        value = os.environ.get(env, "")
    if not isinstance(value, str):
        raise ConfigError(argument, f"expected a string, got {type(value).__name__}", f"pass a string or set {env}")
    value = value.strip()
    if not value:
        if required:
            raise ConfigError(argument, "no value given", f"pass {argument}=... or set the environment variable {env}")
        return None
    return Secret(value)


def resolve_url(value: str | Secret | None, argument: str, env: str) -> Secret:
    """A required http(s) URL secret; ``ConfigError`` (without echoing the value) otherwise."""
    url = resolve_secret(value, argument, env)
    assert url is not None
    parts = urllib.parse.urlsplit(url.reveal())
    if parts.scheme.lower() not in ("https", "http") or not parts.netloc:
        raise ConfigError(argument, "not an http(s) URL", f"pass the full webhook URL (https://...) or set {env}")
    return url


#: ``scheme://user:password@`` (a password may hold an unescaped ``@``: up to the last one before the path)
_USERINFO = re.compile(r"(\b[A-Za-z][A-Za-z0-9+.-]*://)[^/\s]*@")
#: the query of a URL
_QUERY = re.compile(r"(\b[A-Za-z][A-Za-z0-9+.-]*://[^\s?#'\"]*)\?[^\s#'\"]*")


def redact(text: str) -> str:
    """``text`` with every live secret (and the path/query of secret URLs) replaced by ``<redacted>``, and
    with the credentials and query of every URL in it removed."""
    with _live_lock:
        needles = sorted({n for s in _live for n in s._needles}, key=len, reverse=True)
    for needle in needles:
        if needle in text:
            text = text.replace(needle, REDACTED)
    if "://" in text:
        text = _QUERY.sub(lambda m: f"{m.group(1)}?{REDACTED}", _USERINFO.sub(lambda m: f"{m.group(1)}{REDACTED}@", text))
    return text


def has_credentials(url: str) -> bool:
    """Whether a URL carries a user, password or query (where tracking tokens live)."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return "@" in url or "?" in url
    return bool(parts.username or parts.password or parts.query or "@" in parts.netloc)


def _needles(value: str) -> tuple[str, ...]:
    """The substrings that would give the secret away: itself, quoted forms, and a URL's path and query."""
    found = {value, urllib.parse.quote(value, safe=""), urllib.parse.quote(value)}
    parts = urllib.parse.urlsplit(value)
    if parts.scheme and parts.netloc:
        if len(parts.path) > 1:
            found.add(parts.path)
            found.add(urllib.parse.quote(parts.path))
        if parts.query:
            found.add(parts.query)
            found.update(v for _, v in urllib.parse.parse_qsl(parts.query))
        userinfo = parts.netloc.rpartition("@")[0]
        if userinfo:  # the password as written (escaped or not) and as decoded
            found.add(userinfo)
            password = userinfo.partition(":")[2]
            found.update({password, urllib.parse.unquote(password), urllib.parse.quote(urllib.parse.unquote(password), safe="")})
        # the whole destination: urllib3 writes "host='127.0.0.1', port=9" next to the (redacted) path
        found.add(parts.netloc)
        if parts.hostname:
            port = parts.port or (443 if parts.scheme.lower() == "https" else 80)
            found.add(f"host='{parts.hostname}', port={port}")
    return tuple(n for n in found if len(n) >= 4)


class _RedactingFilter(logging.Filter):
    """Rewrites records of the HTTP stack's loggers so request URLs of secret webhooks never reach handlers."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:
            return True
        clean = redact(message)
        if clean != message:
            record.msg, record.args = clean, None
        return True


def _install_log_filter() -> None:
    global _filter_installed
    if _filter_installed:
        return
    _filter_installed = True
    flt = _RedactingFilter()
    for name in _HTTP_LOGGERS:
        logging.getLogger(name).addFilter(flt)
