"""One HTTP attempt of one alert message; the delivery engine owns retries, waits and the spool.

Connection errors, timeouts, mid-response disconnects (``ChunkedEncodingError``) and other transport
errors, 408, 429 and 5xx raise ``TransientError`` (a 429's Retry-After travels with it); TLS errors,
invalid URLs and other 4xx raise ``DeliveryError(permanent=True)``. A retry after a lost answer can
deliver a message twice: payloads carry their event ids so receivers drop duplicates. Error texts never
quote the exception's message (requests and urllib3 put the URL, and so a webhook's token, into them):
they name the error's class and the system's reason, and pass through ``redact()`` too.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Callable, Mapping

from guardtower._delivery import RetryPolicy, TransientError
from guardtower._http import bounded
from guardtower.errors import GuardtowerError, MissingDependencyError
from guardtower.alerts._secret import Secret, redact
from guardtower.alerts.policy import parse_retry_after

if TYPE_CHECKING:
    import requests

__all__ = ["DeliveryError", "Transport", "require_dependencies", "describe_error"]

_USER_AGENT = "guardtower-alerts/0.1"
#: the most bytes of an error reply read for the reason's snippet, and of any reply at all
_SNIPPET_BYTES = 4096
_MAX_BYTES = 65536


class DeliveryError(GuardtowerError):
    """A message could not be delivered; ``reason`` is safe to log (no URL, no token)."""

    def __init__(self, reason: str, *, permanent: bool, attempts: int = 1) -> None:
        self.reason = reason
        self.permanent = permanent
        self.attempts = attempts
        kind = "permanent error" if permanent else f"gave up after {attempts} attempt(s)"
        super().__init__(f"alert not delivered ({kind}): {reason}")


def require_dependencies() -> None:
    """Raise ``MissingDependencyError`` naming the ``alerts`` extra when requests or tenacity is missing."""
    for package in ("requests", "tenacity"):
        try:
            __import__(package)
        except ImportError:
            raise MissingDependencyError(package, "alerts") from None


class Transport:
    """POSTs a body to one destination once, with the policy's connect and read timeouts, within
    ``connect_timeout + read_timeout`` in all (a server trickling its reply is cut off) and reading at most
    a few KB of the answer (a success's body is not read at all)."""

    def __init__(self, policy: RetryPolicy) -> None:
        require_dependencies()
        self.policy = policy
        self.timeouts = 0  # attempts that ran out of time: the receiver may still have got them
        self._local = threading.local()

    def _session(self) -> "requests.Session":
        session = getattr(self._local, "session", None)
        if session is None:
            import requests

            session = self._local.session = requests.Session()
            session.headers["User-Agent"] = _USER_AGENT
        return session

    def post(self, url: Secret, body: bytes, headers: Callable[[bytes], Mapping[str, str]]) -> None:
        """One attempt; ``headers(body)`` is called per attempt (fresh signature timestamps)."""
        import requests

        policy = self.policy
        total = policy.connect_timeout + policy.read_timeout
        with bounded(total, _MAX_BYTES) as watch:
            try:
                response = self._session().post(
                    url.reveal(), data=body, headers=dict(headers(body)), allow_redirects=False, stream=True,
                    timeout=(policy.connect_timeout, policy.read_timeout),
                )
                status = response.status_code
                snippet = ""
                if status >= 300:
                    raw = next(response.iter_content(_SNIPPET_BYTES), b"")
                    snippet = redact(raw.decode("utf-8", "replace")).strip()[:200]
                response.close()
            except (requests.exceptions.SSLError, requests.exceptions.InvalidURL, requests.exceptions.MissingSchema,
                    requests.exceptions.InvalidSchema) as exc:
                raise DeliveryError(describe_error(exc), permanent=True) from None
            except requests.Timeout as exc:
                self.timeouts += 1
                raise TransientError(f"timeout: {describe_error(exc)}") from None
            except (requests.RequestException, OSError) as exc:  # refused, reset, disconnected mid-response, ...
                if watch.expired:
                    self.timeouts += 1
                    raise TransientError(f"timeout: no complete reply within {total:g} s") from None
                raise TransientError(f"connection error: {describe_error(exc)}") from None
        if 200 <= status < 300:
            return
        retry_after = parse_retry_after(response.headers.get("Retry-After"), cap=policy.max_retry_after)
        reason = f"HTTP {status}" + (f": {snippet}" if snippet else "")
        if status in (408, 429) or status >= 500:
            raise TransientError(reason, retry_after, pause=status == 429)
        raise DeliveryError(reason, permanent=True)


def describe_error(exc: BaseException) -> str:
    """``ReadTimeout`` or ``ConnectionRefusedError: Connection refused``: the innermost cause's class and
    the system's reason, never the message (it names the URL)."""
    seen: list[BaseException] = []
    todo: list[object] = [exc]
    while todo and len(seen) < 8:
        item = todo.pop(0)
        if not isinstance(item, BaseException) or item in seen:
            continue
        seen.append(item)
        todo += [getattr(item, "reason", None), item.__cause__, item.__context__, *item.args[:1]]
    innermost = seen[-1]
    names = [type(e).__name__ for e in (seen[0], innermost)]
    text = names[0] if names[0] == names[1] else f"{names[0]} ({names[1]})"
    strerror = next((e.strerror for e in reversed(seen) if isinstance(e, OSError) and e.strerror), None)
    return redact(text + (f": {strerror}" if strerror else ""))
