"""A scripted HTTP receiver on 127.0.0.1 for the alert tests and the alerts benchmark."""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Iterable


@dataclass
class Reply:
    """What the server does with one request: wait ``delay`` seconds, then answer ``status``."""

    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    delay: float = 0.0
    body: bytes = b"ok"


@dataclass
class Received:
    time: float
    path: str
    headers: dict[str, str]
    body: bytes
    reply: Reply

    @property
    def json(self) -> dict:
        return json.loads(self.body)

    @property
    def acknowledged(self) -> bool:
        """The receiver accepted it and answered in time (a delayed answer is a client timeout)."""
        return 200 <= self.reply.status < 300 and self.reply.delay == 0


class ScriptedServer:
    """ThreadingHTTPServer whose replies come from ``script`` (a list consumed in order, then 200s, or a
    callable taking the request number)."""

    def __init__(self, script: Iterable[Reply] | Callable[[int], Reply] = ()) -> None:
        self._script = script if callable(script) else list(script)
        self._lock = threading.Lock()
        self.requests: list[Received] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                reply = owner._next()
                with owner._lock:
                    owner.requests.append(Received(time.monotonic(), self.path, dict(self.headers), body, reply))
                if reply.delay:
                    time.sleep(reply.delay)
                try:
                    self.send_response(reply.status)
                    for key, value in reply.headers.items():
                        self.send_header(key, value)
                    self.send_header("Content-Length", str(len(reply.body)))
                    self.end_headers()
                    self.wfile.write(reply.body)
                except OSError:
                    pass  # the client gave up (timeout)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def _next(self) -> Reply:
        with self._lock:
            n = len(self.requests)
            if callable(self._script):
                return self._script(n)
            return self._script.pop(0) if self._script else Reply()

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}/hooks/T0SECRET/B0SECRET/xoxsecrettoken"

    def acknowledged_ids(self) -> list[str]:
        """Every event id the server acknowledged, once per acknowledgement (duplicates show)."""
        with self._lock:
            return [i for r in self.requests if r.acknowledged for i in r.json.get("event_ids", [])]

    def __enter__(self) -> "ScriptedServer":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def refused_url() -> str:
    """A 127.0.0.1 URL nothing listens on."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return f"http://127.0.0.1:{port}/hooks/T0SECRET/B0SECRET/xoxsecrettoken"
