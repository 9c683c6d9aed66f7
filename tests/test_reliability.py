"""Nothing lost under kill, poison values or a misbehaving server (issue 21), on real loopback servers,
real child processes (kill -9, SIGTERM, fork) and real limits (RLIMIT_FSIZE, a read-only bind mount)."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from _alerts_helpers import Reply, ScriptedServer, read_http_request
from guardtower.alerts import RetryPolicy, WebhookAlert
from guardtower.bus import EventBus
from guardtower.errors import ConfigError
from guardtower.events import Event, FindingEvent, SpikeEvent, SummaryEvent
from guardtower.sinks import JsonlSink, read_events
from guardtower.spool import Spool
from guardtower.testing import InMemorySink

TESTS = Path(__file__).parent
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), str(TESTS)])}
FAST = RetryPolicy(max_attempts=1, connect_timeout=1.0, read_timeout=2.0)


def spike(i: int, **kw: Any) -> SpikeEvent:
    return SpikeEvent(step=i, layer=f"layer{i}", run=kw.pop("run", "r"), reason="nonfinite", **kw)


class RawServer:
    """A raw-socket server on 127.0.0.1: ``hang`` (never answers), ``trickle_first`` (the first request gets
    its status line one byte every 0.5 s, the rest 200), ``trickle`` (every request does), or ``huge`` (500 with
    an endless chunked body)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.requests = 0
        self.sent = 0
        self._stop = threading.Event()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.sock.settimeout(0.1)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            while not self._stop.is_set():
                conn.settimeout(30)
                body = read_http_request(conn)
                if body is None:
                    return
                self.requests += 1
                if self.mode == "hang":
                    self._stop.wait(120)
                    return
                if self.mode == "huge":
                    conn.sendall(b"HTTP/1.1 500 Oops\r\nTransfer-Encoding: chunked\r\n\r\n")
                    block = b"10000\r\n" + b"z" * 65536 + b"\r\n"
                    for _ in range(300 * 16):  # 300 MB
                        conn.sendall(block)
                        self.sent += len(block)
                    return
                if self.mode == "trickle" or (self.mode == "trickle_first" and self.requests == 1):
                    for byte in b"HTTP/1.1 200 OK\r\nX-Slow: " + b"y" * 200:
                        if self._stop.wait(0.5):
                            return
                        conn.sendall(bytes([byte]))
                    return
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
        except OSError:
            pass
        finally:
            conn.close()

    def stop(self) -> None:
        self._stop.set()
        self.sock.close()


@pytest.fixture()
def hung() -> Iterator[RawServer]:
    server = RawServer("hang")
    yield server
    server.stop()


# -- one bad event never takes the others down ---------------------------------------------------------------


def test_a_lone_surrogate_in_the_run_name_is_repaired_at_construction_and_every_alert_is_sent(tmp_path: Path) -> None:
    run = os.fsdecode(b"run-\xff")  # what os.environ gives for bytes that are not UTF-8
    assert SpikeEvent(run=run).run == "run-\ufffd" and SpikeEvent(run=run).fingerprint
    with ScriptedServer() as server:
        sink = WebhookAlert(server.url + "/hook/T0", grouping=None, retry=FAST, spool_path=tmp_path / "s.jsonl")
        bus = EventBus([sink])
        for i in range(11):
            bus.publish(spike(i, run=run))
        bus.close(10)
        assert len(server.requests) == 11
    stats = bus.stats()["sinks"]["webhook"]
    assert stats["delivered"] == 11 and stats["pending"] == 0


class _PickyBatcher:
    """A batcher with a bug for one event: raises on step 3."""

    def add(self, events: list[Event], now: float) -> list[Any]:
        from guardtower._delivery import Batch

        if any(e.step == 3 for e in events):
            raise RuntimeError("batcher bug")
        return [Batch(tuple(events))]

    def due(self, now: float, drain: bool) -> list[Any]:
        return []

    def next_due(self) -> float | None:
        return None

    def held(self) -> int:
        return 0


class _PickySink(InMemorySink):
    name = "picky"

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.spool = Spool(path)

    def make_batcher(self) -> _PickyBatcher:
        return _PickyBatcher()


def test_no_exception_in_a_worker_stops_it(tmp_path: Path) -> None:
    sink = _PickySink(tmp_path / "spool.jsonl")
    bus = EventBus([sink])
    events = [SummaryEvent(step=i) for i in range(8)]
    for event in events:
        bus.publish(event)
    assert bus.flush(10)
    bus.close(5)
    assert sorted(e.step for e in sink.events) == [0, 1, 2, 4, 5, 6, 7]
    stats = bus.stats()["sinks"]["picky"]
    assert stats["delivered"] == 7 and stats["spooled"] == 1 and stats["pending"] == 0
    (entry,) = sink.spool.entries()
    assert entry.event.step == 3 and "batcher bug" in entry.reason


def test_cyclic_or_deep_values_are_a_config_error_and_a_deep_spool_line_is_skipped(tmp_path: Path) -> None:
    cyclic: dict[str, Any] = {}
    cyclic["self"] = cyclic
    deep: dict[str, Any] = {}
    node = deep
    for _ in range(5000):
        node["k"] = {}
        node = node["k"]
    for bad in (cyclic, deep, [deep]):
        with pytest.raises(ConfigError) as info:
            FindingEvent(details={"x": bad})
        assert info.value.argument.startswith("details")
    spool = Spool(tmp_path / "spool.jsonl")
    spool.path.write_text("[" * 100_000 + "]" * 100_000 + "\n" + '{"event": ' * 20_000 + "\n")
    spool.append(SummaryEvent(step=1), "down", "webhook:webhook")
    assert [e.event.step for e in spool.entries()] == [1] and spool.skipped == 2
    from guardtower.bridges import MLflowBridge

    # the bridge reads its leftover spool at construction (it sends it first): no RecursionError there
    bridge = MLflowBridge("0123456789abcdef", tracking_uri="http://127.0.0.1:9", spool_path=spool.path,
                          request_timeout=1, request_retries=0)
    EventBus([bridge]).close(2)


# -- persist before you try: kill -9 and SIGTERM --------------------------------------------------------------

_CHILD = """
import os, signal, sys, time
from pathlib import Path
from guardtower.alerts import RetryPolicy, WebhookAlert
from guardtower.bus import EventBus
from guardtower.events import SpikeEvent
if {kind!r} == "webhook":
    sink = WebhookAlert({url!r} + "/hook/T0", grouping=None, spool_path=Path({spool!r}),
                        retry=RetryPolicy(max_attempts=2, connect_timeout=1, read_timeout=30))
else:
    from guardtower.bridges import MLflowBridge
    sink = MLflowBridge("0123456789abcdef", tracking_uri={url!r}, request_timeout=30, spool_path=Path({spool!r}))
bus = EventBus([sink])
mode = {mode!r}
for i in range(100_000):
    bus.publish(SpikeEvent(step=i, layer=f"l{{i}}", reason="nonfinite"))
    if mode == "kill" and i == 199:
        print("published 200", flush=True)
        time.sleep(120)
    if mode == "term" and i % 50 == 49:
        print(f"published {{i + 1}}", flush=True)
        time.sleep(0.01)
"""


def _run_child(url: str, spool: Path, mode: str, sig: int, after: int, kind: str = "webhook") -> int:
    script = textwrap.dedent(_CHILD.format(url=url, spool=str(spool), mode=mode, kind=kind))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=ENV)
    published = 0
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 120
        while published < after and time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line.startswith("published"), line
            published = int(line.split()[1])
        if mode == "kill":
            time.sleep(1.5)  # the goal: every event published more than 1 s before the kill survives
        proc.send_signal(sig)
        proc.wait(timeout=60)
    finally:
        proc.kill()
        proc.wait(timeout=60)
    assert proc.returncode == -sig
    return published


@pytest.mark.slow
def test_kill_9_while_the_destination_hangs_leaves_every_event_for_replay_once(hung: RawServer,
                                                                              tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool.jsonl")
    published = _run_child(hung.url, spool.path, "kill", signal.SIGKILL, 200)
    assert sorted(e.event.step for e in spool.entries()) == list(range(published))
    with ScriptedServer() as good:
        replay = subprocess.run([sys.executable, "-m", "guardtower", "replay", str(spool.path), "--url",
                                 good.url + "/hook/T0"], capture_output=True, text=True, timeout=300, env=ENV)
        again = subprocess.run([sys.executable, "-m", "guardtower", "replay", str(spool.path), "--url",
                                good.url + "/hook/T0"], capture_output=True, text=True, timeout=300, env=ENV)
        sent = [eid for r in good.requests for eid in r.json["event_ids"]]
    assert replay.returncode == 0 and again.returncode == 0, replay.stderr + again.stderr
    assert len(sent) == len(set(sent)) == published  # each once


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["webhook", "mlflow"])
def test_sigterm_while_the_destination_hangs_leaves_every_published_event_in_the_spool(hung: RawServer,
                                                                                      tmp_path: Path,
                                                                                      kind: str) -> None:
    spool = Spool(tmp_path / "spool.jsonl")
    published = _run_child(hung.url, spool.path, "term", signal.SIGTERM, 300, kind)
    steps = {e.event.step for e in spool.entries()}
    assert set(range(published)) <= steps


# -- local files: fork, full disk, read-only ------------------------------------------------------------------


def test_a_forked_child_writes_its_events_even_if_the_parent_held_the_jsonl_lock(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    sink = JsonlSink(path)
    bus = EventBus([sink])
    bus.publish(SummaryEvent(step=-1))
    assert bus.flush(5)
    children = []
    for k in range(4):
        held, release = threading.Event(), threading.Event()

        def hold() -> None:  # the parent's worker thread, mid-write at the moment of the fork
            with sink._lock:
                held.set()
                release.wait(10)

        holder = threading.Thread(target=hold)
        holder.start()
        assert held.wait(10)
        pid = os.fork()
        if pid != 0:
            release.set()
            holder.join(10)
        if pid == 0:
            try:
                child = EventBus([sink])
                for i in range(5):
                    child.publish(SummaryEvent(step=100 * k + i))
                child.close(5)
            finally:
                os._exit(0)
        children.append(pid)
    for pid in children:
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    bus.close(5)
    steps = sorted(e.step for e in read_events(path) if e.step is not None)
    assert steps == [-1] + [100 * k + i for k in range(4) for i in range(5)]


_FULL_DISK_CHILD = """
import resource, signal
from guardtower.bus import EventBus
from guardtower.events import SummaryEvent
from guardtower.sinks import JsonlSink
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit, write() fails with EFBIG instead
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
sink = JsonlSink({path!r})
bus = EventBus([sink])
resource.setrlimit(resource.RLIMIT_FSIZE, (3000, hard))  # the disk is full at 3,000 bytes
for i in range(40):
    bus.publish(SummaryEvent(step=i, metrics={{"x": 1.0}}))
    bus.flush(5)
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))  # space was freed
for i in range(40, 45):
    bus.publish(SummaryEvent(step=i))
bus.close(5)
print(bus.stats()["sinks"][sink.name]["failed"])
"""


def test_a_full_disk_never_tears_a_jsonl_line(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    child = subprocess.run([sys.executable, "-c", textwrap.dedent(_FULL_DISK_CHILD.format(path=str(path)))],
                           capture_output=True, text=True, timeout=120, env=ENV)
    assert child.returncode == 0, child.stderr
    failed = int(child.stdout.split()[-1])
    assert failed > 0  # the limit was hit
    lines = path.read_bytes().split(b"\n")
    assert lines[-1] == b"" and all(json.loads(line) for line in lines[:-1])
    steps = [json.loads(line)["step"] for line in lines[:-1]]
    assert steps[-5:] == list(range(40, 45)) and steps == sorted(set(steps))
    assert len(steps) == 45 - failed  # an event counted failed is not in the file, one counted written is
    events = subprocess.run([sys.executable, "-m", "guardtower", "events", str(path)], capture_output=True,
                            text=True, timeout=120, env=ENV)
    assert events.returncode == 0 and events.stderr == ""


def test_replay_from_a_read_only_spool_folder_sends_nothing_rather_than_resending_forever(tmp_path: Path) -> None:
    folder = tmp_path / "ro"
    spool = Spool(folder / "spool.jsonl")
    spool.append_many([spike(i) for i in range(3)], "HTTP 500", "webhook:webhook")
    with ScriptedServer() as good:
        cmd = (f"mount --bind {folder} {folder} && mount -o remount,bind,ro {folder} && "
               f"{sys.executable} -m guardtower replay {spool.path} --url {good.url}/hook/T0")
        replay = subprocess.run(["unshare", "-rm", "sh", "-c", cmd], capture_output=True, text=True, timeout=120,
                                env=ENV)
        assert good.requests == []
    assert replay.returncode == 2 and "read-only" in replay.stderr, replay.stderr
    assert len(list(spool.entries())) == 3


# -- every request bounded in total time and bytes ---------------------------------------------------------------


@pytest.mark.slow
def test_a_trickling_server_cannot_wedge_an_alert_sink_or_replay(tmp_path: Path) -> None:
    server = RawServer("trickle_first")
    try:
        sink = WebhookAlert(server.url + "/hook/T0", grouping=None, retry=FAST, spool_path=tmp_path / "s.jsonl")
        bus = EventBus([sink])
        for i in range(5):
            bus.publish(spike(i))
        deadline = time.monotonic() + 30
        while bus.stats()["sinks"]["webhook"]["delivered"] < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        bus.close(5)
        stats = bus.stats()["sinks"]["webhook"]
        assert stats["delivered"] == 4 and stats["spooled"] == 1, stats
        (entry,) = sink.spool.entries()
        assert entry.reason.startswith("timeout: no complete reply within 3 s")
    finally:
        server.stop()
    # every request trickles: on a loaded host the client's 1 s read timeout may cut the first trickle, and a
    # retry that a healthy server answers would then rightly succeed
    trickle = RawServer("trickle")
    spool = Spool(tmp_path / "m.jsonl")
    spool.append(SummaryEvent(step=1, grad_norm=1.0), "down", f"mlflow:0123456789abcdef|guardtower|{trickle.url}")
    try:
        start = time.monotonic()
        replay = subprocess.run([sys.executable, "-m", "guardtower", "replay", str(spool.path), "--timeout", "1"],
                                capture_output=True, text=True, timeout=120, env=ENV)
        assert replay.returncode == 1 and time.monotonic() - start < 60, replay.stderr
    finally:
        trickle.stop()


def test_a_huge_error_body_is_not_read(tmp_path: Path) -> None:
    server = RawServer("huge")
    try:
        sink = WebhookAlert(server.url + "/hook/T0", grouping=None, retry=FAST, spool_path=tmp_path / "s.jsonl")
        start = time.monotonic()
        with pytest.raises(Exception) as info:
            sink.send_now(spike(1))
        assert "HTTP 500" in str(info.value) and time.monotonic() - start < 10
        time.sleep(0.5)
        assert server.sent < 32 * 1024 * 1024  # a few socket buffers, not 300 MB
    finally:
        server.stop()


# -- MLflow URIs are redacted like alert URLs -----------------------------------------------------------------


@pytest.mark.slow
def test_mlflow_uri_credentials_never_appear_at_any_log_level(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from guardtower.bridges import MLflowBridge

    caplog.set_level(logging.DEBUG)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # nothing listens: refused
    secrets = ["p@ss%40w0rd", "p@ss@w0rd", "w0rd", "TOKEN123456"]
    texts = []
    for uri in (f"http://alice:p@ss%40w0rd@127.0.0.1:{port}/?token=TOKEN123456",
                f"http://alice:p@ss@w0rd@127.0.0.1:{port}/mlflow?token=TOKEN123456"):
        bridge = MLflowBridge("0123456789abcdef", tracking_uri=uri, request_timeout=1, request_retries=0,
                              retry_interval=0.05, spool_path=tmp_path / f"spool{len(texts)}.jsonl")
        texts.append(repr(bridge) + bridge.name)
        bus = EventBus([bridge])
        for i in range(3):
            bus.publish(SummaryEvent(step=i, grad_norm=1.0))
        bus.close(5)
        assert bus.stats()["sinks"][bridge.name]["spooled"] == 3
        texts.append(bridge.spool_path.read_text())
        listing = subprocess.run([sys.executable, "-m", "guardtower", "replay", "--list", str(bridge.spool_path)],
                                 capture_output=True, text=True, timeout=120, env=ENV)
        texts += [listing.stdout, listing.stderr]
        replay = subprocess.run([sys.executable, "-m", "guardtower", "replay", str(bridge.spool_path),
                                 "--tracking-uri", uri, "--timeout", "1"],
                                capture_output=True, text=True, timeout=120, env=ENV)
        texts += [replay.stdout, replay.stderr]
    texts += [caplog.text] + [r.getMessage() for r in caplog.records]
    leaks = [s for s in secrets for t in texts if s in t]
    assert not leaks, leaks
    assert any("unreachable" in t for t in texts)
