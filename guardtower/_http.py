"""Total-time and byte bounds for the HTTP requests of guardtower's worker threads (alerts and MLflow).

A read timeout bounds the gap between two bytes, not the reply: a server that answers and then trickles a
byte every second keeps one request alive forever, and a huge error body is read whole into memory.
Inside ``bounded(total_s, max_bytes)`` every urllib3 connection the calling thread uses is watched: at
the deadline a timer shuts its socket down, so the blocked read returns at once, and a response body is
cut off after ``max_bytes``. urllib3's ``HTTPConnection.getresponse`` is wrapped once for this; it does
nothing on threads outside ``bounded()``, so the user's own HTTP calls are untouched.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from typing import Any, Iterator

__all__ = ["bounded", "Watch", "TooLarge", "DEFAULT_MAX_BYTES"]

#: the most bytes of one response body guardtower reads (replies it needs are a few hundred bytes)
DEFAULT_MAX_BYTES = 4 * 1024 * 1024

_local = threading.local()
_install_lock = threading.Lock()
_installed = False


class TooLarge(OSError):
    """A response body went past the byte bound (read as a broken connection by urllib3 and requests)."""


class Watch:
    """The deadline and byte bound of one ``bounded()`` block; ``expired`` says the deadline cut it off."""

    def __init__(self, total_s: float, max_bytes: int) -> None:
        self.total_s = total_s
        self.max_bytes = max_bytes
        self.expired = False
        self.too_large = False
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        self._timer = threading.Timer(total_s, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def arm(self, sock: Any) -> None:
        if not isinstance(sock, socket.socket):
            return
        with self._lock:
            self._socks.append(sock)
            expired = self.expired
        if expired:
            _shut(sock)

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            socks = list(self._socks)
        for sock in socks:
            _shut(sock)

    def cancel(self) -> None:
        self._timer.cancel()


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class _Limited:
    """A response's socket file that raises ``TooLarge`` once more than ``limit`` bytes were read."""

    def __init__(self, fp: Any, watch: Watch) -> None:
        self._fp = fp
        self._watch = watch
        self._left = watch.max_bytes

    def _count(self, n: int) -> None:
        self._left -= n
        if self._left < 0:
            self._watch.too_large = True
            raise TooLarge(f"response larger than {self._watch.max_bytes} bytes")

    def read(self, *args: Any) -> bytes:
        data: bytes = self._fp.read(*args)
        self._count(len(data))
        return data

    def read1(self, *args: Any) -> bytes:
        data: bytes = self._fp.read1(*args)
        self._count(len(data))
        return data

    def readinto(self, buffer: Any) -> int:
        n: int = self._fp.readinto(buffer)
        self._count(n or 0)
        return n

    def readline(self, *args: Any) -> bytes:
        data: bytes = self._fp.readline(*args)
        self._count(len(data))
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fp, name)


def _install() -> None:
    global _installed
    with _install_lock:
        if _installed:
            return
        import urllib3.connection

        original = urllib3.connection.HTTPConnection.getresponse

        def getresponse(self: Any, *args: Any, **kwargs: Any) -> Any:
            watch: Watch | None = getattr(_local, "watch", None)
            if watch is None:
                return original(self, *args, **kwargs)
            watch.arm(getattr(self, "sock", None))
            response = original(self, *args, **kwargs)
            inner = getattr(response, "_fp", None)  # http.client.HTTPResponse: its body comes from .fp
            if inner is not None and getattr(inner, "fp", None) is not None:
                inner.fp = _Limited(inner.fp, watch)
            return response

        urllib3.connection.HTTPConnection.getresponse = getresponse  # type: ignore[method-assign]
        _installed = True


@contextlib.contextmanager
def bounded(total_s: float, max_bytes: int = DEFAULT_MAX_BYTES) -> Iterator[Watch]:
    """HTTP requests this thread makes inside the block end within ``total_s`` seconds (all of them
    together) and read at most ``max_bytes`` per response."""
    _install()
    previous = getattr(_local, "watch", None)
    watch = Watch(total_s, max_bytes)
    _local.watch = watch
    try:
        yield watch
    finally:
        watch.cancel()
        _local.watch = previous

