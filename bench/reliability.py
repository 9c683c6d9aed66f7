"""Reliability figures: the fault matrix and kill -9 / SIGTERM of a training process, on loopback only.

    python bench/reliability.py [--events 200] [--only matrix|kill]

Every scenario publishes ``--events`` events (each its own step) to a webhook alert sink and to an MLflow
bridge pointed at a loopback server that misbehaves one way. Then it counts, by step, what the destination
received (delivered), what is pending in the spool on disk (spooled: ``guardtower replay`` sends it),
what was quarantined as refused, what is nowhere (lost), and, after replaying the spool to a healthy
server, what arrived more than once (duplicated; delivery is at-least-once, receivers dedupe by event id).

matrix: in process, ``close(5)`` then replay. kill: a child process publishes, the parent waits 1.5 s and
sends SIGKILL or SIGTERM while the destination is down, hung or slow, then replays.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from guardtower.spool import Spool  # noqa: E402
from tests._alerts_helpers import read_http_request  # noqa: E402

RUN_ID = "0123456789abcdef"
FAULTS = ["ok", "down", "hung", "slow", "500", "429", "garbage", "disconnect", "trickle", "huge", "400"]


class Destination:
    """A raw-socket HTTP server on 127.0.0.1 failing in one way; records the steps each request carried."""

    def __init__(self, fault: str) -> None:
        self.fault = fault
        self.steps: collections.Counter[int] = collections.Counter()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        if fault == "down":
            self.sock.close()
            return
        self.sock.listen(128)
        self.sock.settimeout(0.1)
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _record(self, body: bytes) -> None:
        try:
            data = json.loads(body)
        except ValueError:
            return
        steps = [m.get("step") for m in data.get("metrics", [])][:1] if "metrics" in data else \
            [data.get("event", {}).get("step")]
        with self._lock:
            for step in steps:
                if isinstance(step, (int, str)):
                    self.steps[int(step)] += 1

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(60)
        try:
            while not self._stop.is_set():
                body = read_http_request(conn)
                if body is None:
                    return
                fault = self.fault
                if fault == "hung":
                    self._stop.wait(120)
                    return
                if fault == "slow":
                    self._stop.wait(2.0)
                if fault == "trickle":
                    for byte in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"y" * 100:
                        if self._stop.wait(0.5):
                            return
                        conn.sendall(bytes([byte]))
                    return
                if fault == "huge":
                    conn.sendall(b"HTTP/1.1 500 Oops\r\nTransfer-Encoding: chunked\r\n\r\n")
                    block = b"10000\r\n" + b"z" * 65536 + b"\r\n"
                    for _ in range(300 * 16):
                        conn.sendall(block)
                    return
                replies = {
                    "500": b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 4\r\n\r\nboom",
                    "429": b"HTTP/1.1 429 Too Many Requests\r\nRetry-After: 1\r\nContent-Length: 4\r\n\r\nslow",
                    "400": b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nContent-Length: 58\r\n\r\n"
                           b'{"error_code": "INVALID_PARAMETER_VALUE", "message": "no"}',
                    "garbage": b"HTTP/1.1 200 OK\r\nContent-Length: 8\r\n\r\n\x00\xff{<garb",
                    "disconnect": b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n{\"partial",
                }
                reply = replies.get(fault, b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
                if reply.startswith(b"HTTP/1.1 200"):  # the destination took it (the client may not know)
                    self._record(body)
                conn.sendall(reply)
                if fault in ("garbage", "disconnect"):
                    return
        except OSError:
            pass
        finally:
            conn.close()

    def stop(self) -> None:
        self._stop.set()
        try:
            self.sock.close()
        except OSError:
            pass


def _sink_code(kind: str, url: str, spool: Path) -> str:
    if kind == "webhook":
        return (f"from guardtower.alerts import RetryPolicy, WebhookAlert\n"
                f"sink = WebhookAlert({url + '/hook/T0'!r}, grouping=None, rate_limit=0, spool_path={str(spool)!r}, "
                f"kinds=['summary'], retry=RetryPolicy(max_attempts=2, initial_backoff=0.05, max_backoff=0.1, "
                f"deadline=2.0, connect_timeout=0.5, read_timeout=1.0))\n")
    return (f"from guardtower.bridges import MLflowBridge\n"
            f"sink = MLflowBridge({RUN_ID!r}, tracking_uri={url!r}, request_timeout=1, request_retries=0, "
            f"retry_interval=0.2, max_retry_interval=1.0, artifacts=False, spool_path={str(spool)!r})\n")


_PUBLISH = """
import sys, time
{sink}
from guardtower.bus import EventBus
from guardtower.events import SummaryEvent
bus = EventBus([sink])
for i in range({n}):
    bus.publish(SummaryEvent(step=i, grad_norm=1.0))
{after}
"""


def _replay(kind: str, spool: Path) -> Destination:
    good = Destination("ok")
    args = [sys.executable, "-m", "guardtower", "replay", str(spool)]
    args += ["--url", good.url + "/hook/T0"] if kind == "webhook" else ["--tracking-uri", good.url, "--timeout", "2"]
    if spool.exists():
        subprocess.run(args, capture_output=True, text=True, timeout=600, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    good.stop()
    return good


def _count(kind: str, fault: str, scenario: str, n: int, dest: Destination, spool_path: Path,
           elapsed: float) -> dict[str, Any]:
    spool = Spool(spool_path)
    pending = {e.event.step for e in spool.entries()} if spool_path.exists() else set()
    refused = {e.event.step for e in spool.refused()}
    delivered = set(dest.steps)
    replayed = _replay(kind, spool_path)
    everywhere = dest.steps + replayed.steps
    lost = set(range(n)) - delivered - pending - refused
    return {"sink": kind, "fault": fault, "scenario": scenario, "published": n, "delivered": len(delivered),
            "spooled": len(pending - delivered), "spooled_and_delivered": len(pending & delivered),
            "refused": len(refused), "lost": len(lost),
            "duplicated": sum(1 for s, c in everywhere.items() if c > 1),
            "after_replay_delivered": len(set(everywhere)), "seconds": round(elapsed, 1)}


def matrix(n: int) -> list[dict[str, Any]]:
    rows = []
    for kind in ("webhook", "mlflow"):
        for fault in FAULTS:
            with tempfile.TemporaryDirectory() as tmp:
                dest = Destination(fault)
                spool = Path(tmp) / "spool.jsonl"
                code = _PUBLISH.format(sink=_sink_code(kind, dest.url, spool), n=n, after="bus.close(5)")
                start = time.monotonic()
                subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT,
                               env={**os.environ, "PYTHONPATH": str(ROOT)})
                elapsed = time.monotonic() - start
                dest.stop()
                rows.append(_count(kind, fault, "close(5)", n, dest, spool, elapsed))
                print(json.dumps(rows[-1]), file=sys.stderr)
    return rows


def kill(n: int) -> list[dict[str, Any]]:
    import signal

    rows = []
    for kind in ("webhook", "mlflow"):
        for fault in ("down", "hung", "slow"):
            for sig in (signal.SIGKILL, signal.SIGTERM):
                with tempfile.TemporaryDirectory() as tmp:
                    dest = Destination(fault)
                    spool = Path(tmp) / "spool.jsonl"
                    code = _PUBLISH.format(sink=_sink_code(kind, dest.url, spool), n=n,
                                           after="print('published', flush=True)\ntime.sleep(600)")
                    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE,
                                            text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
                    assert proc.stdout is not None
                    start = time.monotonic()
                    line = proc.stdout.readline()
                    time.sleep(1.5)  # every event was published 1.5 s before the signal
                    proc.send_signal(sig)
                    proc.wait(timeout=60)
                    elapsed = time.monotonic() - start
                    dest.stop()
                    row = _count(kind, fault, f"{signal.Signals(sig).name} after 1.5 s", n, dest, spool, elapsed)
                    row["exit"] = proc.returncode if line.strip() == "published" else f"child said {line!r}"
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=200)
    parser.add_argument("--only", choices=["matrix", "kill"])
    args = parser.parse_args()
    rows = []
    if args.only in (None, "matrix"):
        rows += matrix(args.events)
    if args.only in (None, "kill"):
        rows += kill(args.events)
    keys = ["published", "delivered", "spooled", "refused", "lost", "duplicated", "after_replay_delivered"]
    print("| sink | destination | scenario | " + " | ".join(keys) + " |")
    print("|---|---|---|" + "---|" * len(keys))
    for row in rows:
        print(f"| {row['sink']} | {row['fault']} | {row['scenario']} | " + " | ".join(str(row[k]) for k in keys) + " |")


if __name__ == "__main__":
    main()
