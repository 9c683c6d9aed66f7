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
            disable_nagle_algorithm = True  # else delayed ACKs add 40 ms to every keep-alive request

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


def flaky_script(failure_rate: float = 0.3, seed: int = 0, timeout_delay: float = 2.0) -> Callable[[int], Reply]:
    """Fail ``failure_rate`` of requests at random: half 500, 40% 429, 10% answered too late (timeouts).

    A late answer counts as not acknowledged, which holds only if the client really gave up first: the delay
    is 40x the client's read timeout, so a client thread stalled by an overloaded machine cannot still read
    the answer and count it as delivered.
    """
    import random

    rng = random.Random(seed)
    lock = threading.Lock()

    def script(n: int) -> Reply:
        with lock:
            r = rng.random()
        if r < failure_rate * 0.5:
            return Reply(500, body=b"boom")
        if r < failure_rate * 0.9:
            return Reply(429, {"Retry-After": "0.01"}, body=b"rate limited")
        if r < failure_rate:
            return Reply(200, delay=timeout_delay)
        return Reply(200)

    return script


def mixed_events(n: int, run: str = "reliability") -> list:
    """``n`` events cycling through every kind an alert sink can send."""
    from guardtower.events import (FindingEvent, HaltEvent, NonFiniteEvent, PreflightEvent, RollbackEvent,
                                   SkipEvent, SpikeEvent, SummaryEvent)

    makers = [
        lambda i: SpikeEvent(run=run, step=i, layer=f"h.{i % 4}.mlp", reason="nonfinite", severity="ERROR"),
        lambda i: SpikeEvent(run=run, step=i, layer="lm_head", ratio=42.0, severity="WARN"),
        lambda i: SkipEvent(run=run, step=i, layer="h.1.attn", total_skips=i),
        lambda i: RollbackEvent(run=run, step=i, layer="h.2.mlp", from_step=i, to_step=max(0, i - 50)),
        lambda i: HaltEvent(run=run, step=i, layer="h.3.mlp", reason="nonfinite", severity="ERROR"),
        lambda i: PreflightEvent(run=run, status="FAIL", errors=1, error_ids=("LORA-001",), severity="ERROR"),
        lambda i: NonFiniteEvent(run=run, step=i, module="h.0.ln", severity="ERROR"),
        lambda i: FindingEvent(run=run, check="loss", catalog_id="LOSS-001", message="detached", severity="ERROR"),
        lambda i: SummaryEvent(run=run, step=i, grad_norm=1.5),
    ]
    return [makers[i % len(makers)](i) for i in range(n)]


class ServerProcess:
    """A ``ScriptedServer`` running ``flaky_script`` in its own process, so its threads do not compete with
    the publishing thread for the GIL; ``stop()`` returns the acknowledged event ids and the request count."""

    def __init__(self, failure_rate: float, seed: int) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, failure_rate, seed), daemon=True)
        self.process.start()
        if not self._conn.poll(60):
            raise RuntimeError("the test server process did not start")
        self.url: str = self._conn.recv()

    def stop(self) -> tuple[list[str], int, int]:
        """Acknowledged event ids, requests seen, and replies the script made late on purpose."""
        self._conn.send("stop")
        acked, count, late = self._conn.recv()
        self.process.join(10)
        return acked, count, late


def _serve(conn, failure_rate: float, seed: int) -> None:  # type: ignore[no-untyped-def]
    with ScriptedServer(flaky_script(failure_rate, seed)) as server:
        conn.send(server.url)
        conn.recv()
        late = sum(1 for r in server.requests if r.reply.delay > 0)
        conn.send((server.acknowledged_ids(), len(server.requests), late))


def reliability_run(spool_dir: str, n_events: int = 2000, failure_rate: float = 0.3, seed: int = 0,
                    pace_s: float = 0.0005) -> dict:
    """Publish ``n_events`` mixed events, ``pace_s`` seconds apart, to a WebhookAlert (one message per
    event) whose receiver fails ``failure_rate`` of requests; reconcile acknowledged and spooled ids."""
    import gc
    import os
    import resource
    from pathlib import Path

    from guardtower.alerts import RetryPolicy, WebhookAlert
    from guardtower.bus import EventBus
    from guardtower.events import EVENT_TYPES

    events = mixed_events(n_events)
    retry = RetryPolicy(max_attempts=3, initial_backoff=0.002, max_backoff=0.02, deadline=5.0, read_timeout=0.05)
    server = ServerProcess(failure_rate, seed)
    try:
        sink = WebhookAlert(server.url, grouping=None, rate_limit=0, retry=retry, kinds=list(EVENT_TYPES),
                            min_severity="INFO", spool_path=Path(spool_dir) / "reliability.jsonl")
        bus = EventBus([sink])
        latencies, cpu, blocked, in_gc = [], [], 0, 0
        collections = [0]

        def count_gc(phase: str, info: dict) -> None:
            collections[0] += phase == "start"

        gc.callbacks.append(count_gc)
        started = time.monotonic()
        for event in events:
            switches = resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw
            gcs = collections[0]
            c0 = time.thread_time()
            t0 = time.perf_counter()
            bus.publish(event)
            t1 = time.perf_counter()
            if collections[0] != gcs:  # the interpreter's garbage collector ran inside: not publish's cost
                in_gc += 1
            else:
                cpu.append(time.thread_time() - c0)
            blocked += resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw != switches
            latencies.append(t1 - t0)
            time.sleep(pace_s)  # a training step (GPU work, GIL released) between events
        publish_s = time.monotonic() - started
        gc.callbacks.remove(count_gc)
        closing = time.monotonic()
        bus.close(timeout=120)
        elapsed = time.monotonic() - started
        close_s = time.monotonic() - closing
    finally:
        acked, requests_seen, late_replies = server.stop()
    spooled = [entry.event.event_id for entry in sink.spool.entries()] if os.path.exists(sink.spool_path) else []
    first_publish_ms = latencies[0] * 1e3
    latencies.sort()
    all_ids = {e.event_id for e in events}
    return {
        "events": n_events,
        "requests": requests_seen,
        "delivered": len(set(acked)),
        "spooled": len(spooled),
        "duplicates": len(acked) - len(set(acked)),
        "lost": len(all_ids - set(acked) - set(spooled)),
        "both": len(set(acked) & set(spooled)),
        "unknown": len((set(acked) | set(spooled)) - all_ids),
        # a client timeout on a reply the receiver sent on time: the one way an event arrives twice
        "timeouts_on_acknowledged": sink.stats()["timeouts"] - late_replies,
        "max_publish_ms": latencies[-1] * 1e3,
        "max_publish_cpu_ms": max(cpu) * 1e3,
        "publishes_over_1ms_cpu": sum(c > 1e-3 for c in cpu),
        "publishes_during_gc": in_gc,
        "publishes_that_blocked": blocked,
        "publishes_over_1ms": sum(x > 1e-3 for x in latencies),
        "first_publish_ms": first_publish_ms,
        "p99_publish_ms": latencies[int(0.99 * (len(latencies) - 1))] * 1e3,
        "median_publish_us": latencies[len(latencies) // 2] * 1e6,
        "publish_s": publish_s,
        "elapsed_s": elapsed,
        "close_s": close_s,
        "bus": bus.stats()["sinks"][sink.name],
    }


def read_http_request(conn: socket.socket) -> bytes | None:
    """One HTTP/1.1 request's body from a raw socket (headers read up to the blank line, then Content-Length
    bytes); None when the peer closed first. For the loopback servers that fail on purpose."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return None
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length")), 0)
    while len(body) < length:
        body += conn.recv(65536)
    return body
