"""EventBus: never blocks, never raises, loses nothing silently, fork-safe."""

from __future__ import annotations

import os
import threading
import time

import pytest

from pathlib import Path

from guardtower.bus import BaseSink, EventBus, resolve_bus
from guardtower.errors import ConfigError
from guardtower.events import Event, SkipEvent, SummaryEvent
from guardtower.spool import Spool
from guardtower.testing import InMemorySink, capture_events


class HangingSink(BaseSink):
    """Blocks forever on the first event (until released at teardown)."""

    name = "hanging"

    def __init__(self, queue_size: int = 10_000) -> None:
        self.queue_size = queue_size
        self.release = threading.Event()
        self.entered = threading.Event()

    def handle(self, event: Event) -> None:
        self.entered.set()
        self.release.wait(30)

    def close(self, timeout: float | None = None) -> None:
        self.release.wait(30)  # a close that hangs too


class RaisingSink(BaseSink):
    name = "raising"

    def handle(self, event: Event) -> None:
        raise RuntimeError("sink is broken")


class SlowSink(InMemorySink):
    name = "slow"

    def handle(self, event: Event) -> None:
        time.sleep(0.001)
        super().handle(event)


class SpoolingSink(InMemorySink):
    """A slow destination with a real spool: the engine keeps its overflow on disk, off the training thread."""

    name = "spooling"
    queue_size = 5
    replay_spool = True

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.spool = Spool(path)
        self.publisher = threading.get_ident()

    def handle(self, event: Event) -> None:
        self.gate.wait(10)
        super().handle(event)


def adds_up(stats: dict) -> bool:
    return stats["delivered"] + stats["spooled"] + stats["dropped"] + stats["failed"] + stats["pending"] \
        == stats["published"]


def test_publish_stays_fast_and_healthy_sinks_get_every_event_despite_hung_raising_slow_sinks() -> None:
    hanging, raising, slow, healthy = HangingSink(), RaisingSink(), SlowSink(), InMemorySink()
    bus = EventBus([hanging, raising, slow, healthy])
    sent = [SummaryEvent(step=i) for i in range(500)]
    worst = 0.0
    for event in sent:
        start = time.perf_counter()
        bus.publish(event)
        worst = max(worst, time.perf_counter() - start)
    assert worst < 0.05  # a blocked sink would make publish wait seconds
    assert bus.flush(timeout=0.5) is False  # the hung sink cannot finish
    deadline = time.monotonic() + 10
    while len(slow.events) < len(sent) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [e.event_id for e in healthy.events] == [e.event_id for e in sent]
    assert [e.event_id for e in slow.events] == [e.event_id for e in sent]
    stats = bus.stats()["sinks"]
    assert stats["raising"]["failed"] == len(sent) and stats["raising"]["delivered"] == 0
    assert stats["hanging"]["pending"] == len(sent)
    start = time.monotonic()
    bus.close(timeout=0.5)
    assert time.monotonic() - start < 2.0
    assert bus.stats()["sinks"]["hanging"]["dropped"] == len(sent)  # reported, not silently lost
    hanging.release.set()


def test_overflow_is_counted_per_sink_with_its_reason_never_silent() -> None:
    hanging, healthy = HangingSink(queue_size=10), InMemorySink()
    bus = EventBus([hanging, healthy])
    bus.publish(SummaryEvent(step=0))
    assert hanging.entered.wait(5)  # the worker holds one event, the queue is empty
    for i in range(1, 31):
        bus.publish(SummaryEvent(step=i))
    stats = bus.stats()["sinks"]["hanging"]
    assert stats["pending"] == 11 and stats["dropped"] == 20 and stats["dropped_reasons"] == {"queue full": 20}
    assert adds_up(stats)
    assert bus.flush(timeout=0.5) is False
    assert len(healthy.events) == 31
    hanging.release.set()
    bus.close(timeout=5)


def test_overflow_goes_to_the_spool_on_the_worker_and_is_replayed(tmp_path: Path, monkeypatch) -> None:
    sink = SpoolingSink(tmp_path / "spool.jsonl")
    written_on: set[int] = set()
    append = sink.spool.append_many
    monkeypatch.setattr(sink.spool, "append_many",
                        lambda *a, **k: (written_on.add(threading.get_ident()), append(*a, **k))[1])
    bus = EventBus([sink])
    bus.publish(SummaryEvent(step=0))
    time.sleep(0.05)
    for i in range(1, 11):  # 5 fill the queue, 5 more are parked for the spool
        bus.publish(SummaryEvent(step=i))
    time.sleep(0.5)  # the persister writes every accepted event to the spool before the first attempt
    assert {e.event.step for e in sink.spool.entries()} == set(range(11))
    sink.gate.set()
    assert bus.flush(timeout=10)
    deadline = time.monotonic() + 10
    while bus.stats()["sinks"]["spooling"]["backlog"] and time.monotonic() < deadline:
        time.sleep(0.05)  # the spool is replayed once the destination keeps up again
    assert {e.step for e in sink.events} == set(range(11))
    stats = bus.stats()["sinks"]["spooling"]
    assert stats["spooled"] > 0 and stats["replayed"] == stats["spooled"] and adds_up(stats)
    assert written_on and threading.get_ident() not in written_on
    bus.close(timeout=5)


class RejectingSpoolingSink(SpoolingSink):
    """A destination that refuses one event for good (a 4xx): the rest of the spool still goes through."""

    def handle(self, event: Event) -> None:
        self.gate.wait(10)
        if event.step == 7:
            raise ValueError("cannot take step 7")
        InMemorySink.handle(self, event)


def test_an_event_refused_on_replay_is_quarantined_and_the_rest_is_replayed(tmp_path: Path) -> None:
    sink = RejectingSpoolingSink(tmp_path / "spool.jsonl")
    bus = EventBus([sink])
    bus.publish(SummaryEvent(step=0))
    time.sleep(0.05)
    for i in range(1, 11):  # 5 fill the queue, 5 more (6..10) are parked for the spool
        bus.publish(SummaryEvent(step=i))
    sink.gate.set()
    assert bus.flush(timeout=10)
    deadline = time.monotonic() + 10
    while bus.stats()["sinks"]["spooling"]["backlog"] and time.monotonic() < deadline:
        time.sleep(0.05)
    stats = bus.stats()["sinks"]["spooling"]
    assert not stats["backlog"] and adds_up(stats)
    assert sorted(e.step for e in sink.events) == [i for i in range(11) if i != 7]
    assert list(sink.spool.entries()) == []  # nothing holds up the spool
    refused = sink.spool.refused()
    assert [e.event.step for e in refused] == [7] and "cannot take step 7" in refused[0].reason
    assert stats["replayed"] + stats["replay_refused"] == stats["spooled"] and stats["replay_refused"] == 1
    bus.close(timeout=5)


class RefusingSink(InMemorySink):
    """Only ``handle()``, blocked on its first event until ``gate`` opens, refusing step 3 for good."""

    name = "refusing"

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.entered = threading.Event()

    def handle(self, event: Event) -> None:
        self.entered.set()
        self.gate.wait(10)
        if event.step == 3:
            raise ValueError("cannot take step 3")
        super().handle(event)


def test_a_sink_with_only_handle_that_refuses_one_event_gets_each_other_event_once() -> None:
    sink = RefusingSink()
    bus = EventBus([sink])
    bus.publish(SummaryEvent(step=0))
    assert sink.entered.wait(10)  # the worker holds step 0: steps 1..9 wait together for its next round
    for i in range(1, 10):
        bus.publish(SummaryEvent(step=i))
    sink.gate.set()
    assert bus.flush(timeout=10)
    stats = bus.stats()["sinks"]["refusing"]
    assert [e.step for e in sink.events] == [0, 1, 2, 4, 5, 6, 7, 8, 9]  # in order, none twice
    assert stats["delivered"] == 9 and stats["failed"] == 1 and adds_up(stats)
    bus.close(timeout=5)


def test_sinks_close_concurrently_against_one_deadline() -> None:
    sinks = [HangingSink(), HangingSink(), HangingSink()]
    bus = EventBus(sinks)
    bus.publish(SummaryEvent(step=1))
    start = time.monotonic()
    bus.close(timeout=1.0)
    assert time.monotonic() - start < 2.5  # not 3 x 1 s
    stats = bus.stats()["sinks"]
    assert sorted(stats) == ["hanging", "hanging#2", "hanging#3"]  # unique ids, the name kept for display
    assert all(s["name"] == "hanging" and s["dropped"] == 1 and adds_up(s) for s in stats.values())
    for sink in sinks:
        sink.release.set()


def test_close_without_timeout_uses_the_default_bound(monkeypatch) -> None:
    import guardtower._delivery as delivery

    monkeypatch.setattr(delivery, "DEFAULT_TIMEOUT_S", 0.5)
    hanging = HangingSink()
    bus = EventBus([hanging])
    bus.publish(SummaryEvent(step=1))
    start = time.monotonic()
    bus.close()
    assert time.monotonic() - start < 2.0
    hanging.release.set()


class PickySink(InMemorySink):
    name = "picky"

    def handle_batch(self, events: list[Event]) -> None:
        if any(e.step == 13 for e in events):
            raise ValueError("cannot take step 13")
        for event in events:
            self.handle(event)


def test_one_failing_event_is_isolated_and_the_rest_delivered() -> None:
    sink = PickySink()
    bus = EventBus([sink])
    for i in range(50):
        bus.publish(SummaryEvent(step=i))
    assert bus.flush(5)
    assert sorted(e.step for e in sink.events) == [i for i in range(50) if i != 13]
    stats = bus.stats()["sinks"]["picky"]
    assert stats["failed"] == 1 and stats["delivered"] == 49 and adds_up(stats)
    bus.close(5)


def test_close_returns_within_timeout_with_a_hung_sink() -> None:
    hanging = HangingSink()
    bus = EventBus([hanging])
    bus.publish(SummaryEvent(step=1))
    start = time.monotonic()
    bus.close(timeout=0.3)
    assert time.monotonic() - start < 1.5
    hanging.release.set()


def test_publish_after_close_counts_drops_and_does_not_raise() -> None:
    sink = InMemorySink()
    bus = EventBus([sink])
    bus.close(timeout=1)
    bus.publish(SummaryEvent(step=1))
    assert bus.stats()["sinks"]["memory"]["dropped"] == 1


def test_forked_child_never_resends_parent_events(tmp_path) -> None:
    """A sink that records in files: the child must not deliver what the parent had queued."""
    out = tmp_path / "delivered.txt"

    class FileSink(BaseSink):
        name = "file"
        rank_zero_only = False

        def __init__(self) -> None:
            self.gate = threading.Event()

        def handle(self, event: Event) -> None:
            self.gate.wait(5)
            with open(out, "a") as fh:
                fh.write(f"{os.getpid()} {event.step}\n")

    sink = FileSink()
    bus = EventBus([sink])
    for i in range(5):
        bus.publish(SummaryEvent(step=i))  # stuck behind the gate
    pid = os.fork()
    if pid == 0:  # child: its queue must be empty; publish one event of its own
        try:
            sink.gate.set()
            bus.publish(SummaryEvent(step=100))
            ok = bus.flush(timeout=5) and bus.stats()["sinks"]["file"]["delivered"] == 1
        finally:
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    sink.gate.set()
    assert bus.flush(timeout=5)
    bus.close(timeout=5)
    rows = [line.split() for line in out.read_text().splitlines()]
    child = [int(step) for p, step in rows if int(p) == pid]
    parent = [int(step) for p, step in rows if int(p) == os.getpid()]
    assert child == [100]
    assert parent == [0, 1, 2, 3, 4]


def test_remote_sinks_act_on_rank_zero_only(monkeypatch: pytest.MonkeyPatch) -> None:
    remote, local = InMemorySink(), InMemorySink()
    remote.rank_zero_only = True
    monkeypatch.setenv("RANK", "1")
    bus = EventBus([remote, local])
    bus.publish(SkipEvent(step=1))
    assert bus.flush(timeout=5)
    assert remote.events == [] and len(local.events) == 1
    everywhere = EventBus([remote], main_process_only=False)
    everywhere.publish(SkipEvent(step=2))
    assert everywhere.flush(timeout=5) and len(remote.events) == 1
    bus.close(1)
    everywhere.close(1)


def test_capture_events_sees_every_bus_synchronously() -> None:
    bus_a, bus_b = EventBus(), EventBus()
    with capture_events() as events:
        bus_a.publish(SkipEvent(step=1))
        bus_b.publish(SkipEvent(step=2))
    bus_a.publish(SkipEvent(step=3))
    assert [e.step for e in events] == [1, 2]


@pytest.mark.parametrize("bad", [object(), "events.jsonl", InMemorySink.handle])
def test_a_sink_without_the_protocol_is_rejected_at_construction(bad: object) -> None:
    with pytest.raises(ConfigError, match="sink"):
        EventBus([bad])  # type: ignore[list-item]


def test_publishing_a_non_event_is_a_clear_error_and_changes_nothing() -> None:
    sink = InMemorySink()
    bus = EventBus([sink])
    with pytest.raises(ConfigError, match="event"):
        bus.publish({"kind": "spike"})  # type: ignore[arg-type]
    assert bus.stats()["published"] == 0
    bus.close(1)


def test_resolve_bus_adds_sinks_to_a_given_bus_and_reports_ownership() -> None:
    given = EventBus()
    sink = InMemorySink()
    bus, owned = resolve_bus(given, [sink])
    assert bus is given and not owned and bus.sinks == [sink]
    bus, owned = resolve_bus(None, None)
    assert owned and bus.sinks == []
    with pytest.raises(ConfigError, match="bus"):
        resolve_bus("not a bus", None)  # type: ignore[arg-type]


def test_process_exit_flushes_pending_events_with_a_bounded_timeout(tmp_path) -> None:
    """A script that publishes and exits without closing: events reach the file; a hung sink cannot hold exit."""
    import subprocess
    import sys
    import textwrap

    path = tmp_path / "events.jsonl"
    script = textwrap.dedent(
        f"""
        import threading, time
        from guardtower.bus import BaseSink, EventBus
        from guardtower.events import SummaryEvent
        from guardtower.sinks import JsonlSink

        class Hang(BaseSink):
            name = "hang"
            def handle(self, event):
                threading.Event().wait()

        bus = EventBus([JsonlSink({str(path)!r}), Hang()])
        for i in range(200):
            bus.publish(SummaryEvent(step=i))
        """
    )
    env = {**os.environ, "GUARDTOWER_EXIT_TIMEOUT": "2", "PYTHONPATH": os.getcwd()}
    start = time.monotonic()
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60, env=env)
    assert time.monotonic() - start < 30
    assert len(path.read_text().splitlines()) == 200
