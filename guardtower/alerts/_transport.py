"""HTTP delivery of one message with retries: requests for the wire, tenacity for the schedule.

Retry connection errors, timeouts, 408, 429 and 5xx; never other 4xx. A 429 pauses the whole destination
(its ``Throttle``) for the Retry-After it names. Every wait (rate limit, backoff) is a ``threading.Event``
wait, so ``close()`` interrupts it. Error texts pass through ``redact()``: requests and urllib3 put the
URL, and so a webhook's token, into their messages.
"""

from __future__ import annotations

import random
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Mapping

from guardtower.errors import GuardtowerError, MissingDependencyError
from guardtower.alerts._secret import Secret, redact
from guardtower.alerts.policy import RetryPolicy, Throttle, parse_retry_after

if TYPE_CHECKING:
    import requests

__all__ = ["DeliveryError", "Transport", "require_dependencies"]

_USER_AGENT = "guardtower-alerts/0.1"


class DeliveryError(GuardtowerError):
    """A message could not be delivered; ``reason`` is safe to log (no URL, no token)."""

    def __init__(self, reason: str, *, permanent: bool, attempts: int) -> None:
        self.reason = reason
        self.permanent = permanent
        self.attempts = attempts
        kind = "permanent error" if permanent else f"gave up after {attempts} attempt(s)"
        super().__init__(f"alert not delivered ({kind}): {reason}")


class _Retryable(Exception):
    def __init__(self, reason: str, retry_after: float | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry_after = retry_after


class _Permanent(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _Interrupted(Exception):
    reason = "sink closed while the message was waiting to be retried"


def require_dependencies() -> None:
    """Raise ``MissingDependencyError`` naming the ``alerts`` extra when requests or tenacity is missing."""
    for package in ("requests", "tenacity"):
        try:
            __import__(package)
        except ImportError:
            raise MissingDependencyError(package, "alerts") from None


class Transport:
    """POSTs a body to one destination with the retry policy; raises ``DeliveryError`` when it gives up."""

    def __init__(self, policy: RetryPolicy, throttle: Throttle, stop: threading.Event, *,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] | None = None,
                 rng: random.Random | None = None) -> None:
        require_dependencies()
        self.policy = policy
        self.throttle = throttle
        self.stop = stop
        self._clock = clock
        self._sleep = sleep or self._interruptible_sleep
        self._rng = rng or random.Random()
        self._local = threading.local()

    def _session(self) -> "requests.Session":
        session = getattr(self._local, "session", None)
        if session is None:
            import requests

            session = self._local.session = requests.Session()
            session.headers["User-Agent"] = _USER_AGENT
        return session

    def post(self, url: Secret, body: bytes, headers: Callable[[bytes], Mapping[str, str]]) -> int:
        """Deliver ``body``; ``headers(body)`` is called per attempt (fresh signature timestamps).

        Returns the number of attempts it took.
        """
        import tenacity

        policy = self.policy
        start = self._clock()

        def remaining() -> float:
            return policy.deadline - (self._clock() - start)

        def attempt() -> None:
            if self.stop.is_set():
                raise _Interrupted()
            delay = self.throttle.reserve()
            if delay > 0 and self.stop.wait(delay):
                raise _Interrupted()
            self._send_once(url, body, headers, max(0.05, min(policy.read_timeout, remaining())))

        def wait(state: tenacity.RetryCallState) -> float:
            exc = state.outcome.exception() if state.outcome else None
            if isinstance(exc, _Retryable) and exc.retry_after is not None:
                return exc.retry_after
            backoff = min(policy.max_backoff, policy.initial_backoff * 2 ** (state.attempt_number - 1))
            return self._rng.uniform(0, backoff)

        retrying = tenacity.Retrying(
            stop=tenacity.stop_any(tenacity.stop_after_attempt(policy.max_attempts),
                                   tenacity.stop_before_delay(policy.deadline),  # the next wait would cross it
                                   tenacity.stop_when_event_set(self.stop)),
            wait=wait,
            retry=tenacity.retry_if_exception_type(_Retryable),
            sleep=self._sleep,
            reraise=True,
        )
        try:
            retrying(attempt)
        except _Retryable as exc:
            raise DeliveryError(exc.reason, permanent=False, attempts=_attempts(retrying)) from None
        except (_Permanent, _Interrupted) as exc:
            raise DeliveryError(exc.reason, permanent=isinstance(exc, _Permanent),
                                attempts=_attempts(retrying)) from None
        return _attempts(retrying)

    def _interruptible_sleep(self, seconds: float) -> None:
        self.stop.wait(seconds)

    def _send_once(self, url: Secret, body: bytes, headers: Callable[[bytes], Mapping[str, str]],
                   read_timeout: float) -> None:
        import requests

        policy = self.policy
        try:
            response = self._session().post(
                url.reveal(), data=body, headers=dict(headers(body)), allow_redirects=False,
                timeout=(policy.connect_timeout, read_timeout),
            )
        except requests.exceptions.SSLError as exc:
            raise _Permanent(f"TLS error: {_describe(exc)}") from None
        except requests.Timeout as exc:
            raise _Retryable(f"timeout: {_describe(exc)}") from None
        except requests.ConnectionError as exc:
            raise _Retryable(f"connection error: {_describe(exc)}") from None
        except requests.RequestException as exc:
            raise _Permanent(f"request error: {_describe(exc)}") from None
        status = response.status_code
        snippet = redact(response.text[:4000]).strip()[:200] if status >= 300 else ""
        response.close()
        if 200 <= status < 300:
            return
        retry_after = parse_retry_after(response.headers.get("Retry-After"), cap=policy.max_retry_after)
        reason = f"HTTP {status}" + (f": {snippet}" if snippet else "")
        if status == 429 and retry_after is not None:
            self.throttle.pause(retry_after)
        if status in (408, 429) or status >= 500:
            raise _Retryable(reason, retry_after)
        raise _Permanent(reason)


def _describe(exc: BaseException) -> str:
    return redact(f"{type(exc).__name__}: {exc}")[:300]


def _attempts(retrying: Any) -> int:
    return int(retrying.statistics.get("attempt_number", 1))
