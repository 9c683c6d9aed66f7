"""Alert sinks against real HTTP servers on 127.0.0.1: retries, 429 pauses, dead letters, close, replay."""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

import pytest

from _alerts_helpers import Reply, ScriptedServer, refused_url
from guardtower.alerts import DeliveryError, GroupPolicy, PagerDutyAlert, RetryPolicy, SlackAlert, WebhookAlert
from guardtower.bus import EventBus
from guardtower.events import HaltEvent, SpikeEvent, SummaryEvent
from guardtower.spool import Spool

FAST = RetryPolicy(max_attempts=3, initial_backoff=0.01, max_backoff=0.02, deadline=10, read_timeout=2)
SECRET_BITS = ("T0SECRET", "B0SECRET", "xoxsecrettoken", "hmac-secret-value", "PDKEYsecret")


def nan(step: int, layer: str = "transformer.h.3.mlp", run: str = "r1") -> SpikeEvent:
    return SpikeEvent(run=run, step=step, layer=layer, reason="nonfinite", severity="ERROR")


def webhook(server_url: str, tmp_path: Path, **kw: object) -> WebhookAlert:
    settings: dict = {"grouping": None, "retry": FAST, "spool_path": tmp_path / "spool.jsonl"}
    settings.update(kw)
    return WebhookAlert(server_url, **settings)


def spooled(path: Path) -> list[dict]:
    """The spool's pending lines (every accepted event is written before its first attempt, then acknowledged)."""
    if not path.exists():
        return []
    acked_path = path.with_name(path.name + ".acked")
    acked = set(acked_path.read_text().split()) if acked_path.exists() else set()
    latest: dict[str, dict] = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if record["event"]["event_id"] not in acked:
            latest[record["event"]["event_id"]] = record
    return list(latest.values())


def test_200_delivers_once_with_event_id(tmp_path) -> None:
    with ScriptedServer() as server:
        sink = webhook(server.url, tmp_path)
        bus = EventBus([sink])
        event = nan(5)
        bus.publish(event)
        bus.close(10)
    assert [r.json["event_ids"] for r in server.requests] == [[event.event_id]]
    assert server.requests[0].path == "/hooks/T0SECRET/B0SECRET/xoxsecrettoken"
    assert sink.stats() == {"messages": 1, "delivered": 1, "timeouts": 0}
    assert not sink.spool_path.exists()


def test_500_then_200_is_retried_and_delivered(tmp_path) -> None:
    with ScriptedServer([Reply(500), Reply(200)]) as server:
        bus = EventBus([sink := webhook(server.url, tmp_path)])
        bus.publish(nan(1))
        bus.close(10)
    assert [r.reply.status for r in server.requests] == [500, 200]
    assert server.requests[0].body == server.requests[1].body
    assert sink.stats()["delivered"] == 1 and not sink.spool_path.exists()


def test_429_retry_after_pauses_every_sink_of_the_destination(tmp_path) -> None:
    with ScriptedServer([Reply(429, {"Retry-After": "1"})]) as server:
        first = webhook(server.url, tmp_path, name="first")
        second = webhook(server.url, tmp_path, name="second")
        bus = EventBus([first])
        bus.publish(nan(1))
        deadline = time.monotonic() + 5
        while first.throttle.paused_for() == 0 and time.monotonic() < deadline:
            time.sleep(0.001)  # until the 429 reached the client
        other = EventBus([second])
        other.publish(nan(2, layer="lm_head"))  # same URL, other sink: must wait for the pause too
        bus.close(10)
        other.close(10)
    times = [r.time for r in server.requests]
    assert [r.reply.status for r in server.requests] == [429, 200, 200]
    assert times[1] - times[0] >= 0.95 and times[2] - times[0] >= 0.95


@pytest.mark.parametrize("status", [400, 410])
def test_permanent_errors_are_not_retried_and_dead_lettered(tmp_path, status: int) -> None:
    with ScriptedServer([Reply(status, body=b"channel_is_archived")]) as server:
        bus = EventBus([sink := webhook(server.url, tmp_path)])
        event = nan(1)
        bus.publish(event)
        bus.close(10)
    assert len(server.requests) == 1
    assert spooled(sink.spool_path) == []  # refused, not unreachable: it never holds up the spool
    (entry,) = sink.spool.refused()  # quarantined with its reason
    assert entry.event.event_id == event.event_id
    assert entry.reason == f"HTTP {status}: channel_is_archived"
    assert entry.sink == "webhook:webhook"
    stats = bus.stats()["sinks"]["webhook"]
    assert stats["failed"] == stats["quarantined"] == 1


def test_a_reply_slower_than_the_timeout_is_retried(tmp_path) -> None:
    retry = RetryPolicy(max_attempts=3, initial_backoff=0.01, read_timeout=0.2)
    with ScriptedServer([Reply(200, delay=1.0)]) as server:
        bus = EventBus([sink := webhook(server.url, tmp_path, retry=retry)])
        bus.publish(nan(1))
        bus.close(10)
        acked = server.acknowledged_ids()
    assert len(server.requests) == 2
    assert 0.15 <= server.requests[1].time - server.requests[0].time < 0.95  # the 0.2 s timeout, not the 1 s reply
    assert len(acked) == 1 and sink.stats()["delivered"] == 1


def test_refused_port_exhausts_retries_then_spools_without_the_url(tmp_path, caplog) -> None:
    caplog.set_level(logging.DEBUG)
    bus = EventBus([sink := webhook(refused_url(), tmp_path)])
    bus.publish(nan(1))
    bus.close(10)
    (record,) = spooled(sink.spool_path)
    assert record["reason"].startswith("connection error: ConnectionError")
    assert "<redacted>" in record["reason"] or "/hooks" not in record["reason"]
    assert "spooled to" in caplog.text
    for bit in SECRET_BITS:
        assert bit not in caplog.text and bit not in sink.spool_path.read_text()


def test_close_interrupts_the_backoff_and_spools(tmp_path) -> None:
    slow_retry = RetryPolicy(max_attempts=10, initial_backoff=20, max_backoff=20, deadline=100)
    with ScriptedServer(lambda n: Reply(503)) as server:
        bus = EventBus([sink := webhook(server.url, tmp_path, retry=slow_retry)])
        bus.publish(event := nan(1))
        deadline = time.monotonic() + 5
        while not server.requests and time.monotonic() < deadline:
            time.sleep(0.005)
        started = time.monotonic()
        bus.close(1.0)
        took = time.monotonic() - started
    assert took < 1.5
    assert [r["event"]["event_id"] for r in spooled(sink.spool_path)] == [event.event_id]
    assert len(server.requests) <= 2


def test_close_sends_groups_still_in_group_wait(tmp_path) -> None:
    with ScriptedServer() as server:
        sink = webhook(server.url, tmp_path, grouping=GroupPolicy(group_wait=60))
        bus = EventBus([sink])
        events = [nan(i) for i in range(5)]
        for event in events:
            bus.publish(event)
        time.sleep(0.05)
        assert server.requests == []
        started = time.monotonic()
        bus.close(5)
    assert time.monotonic() - started < 2
    (request,) = server.requests
    assert request.json["event_ids"] == [e.event_id for e in events] and request.json["total"] == 5


def test_storm_of_1000_nan_events_gives_one_message_and_paced_updates(tmp_path) -> None:
    policy = GroupPolicy(group_wait=0.2, group_interval=0.5)
    with ScriptedServer() as server:
        sink = webhook(server.url, tmp_path, grouping=policy)
        bus = EventBus([sink])
        events = [nan(1200 + i) for i in range(1000)]
        started = time.monotonic()
        for i, event in enumerate(events):  # 1,000 events spread over one second
            bus.publish(event)
            if i % 100 == 99:
                time.sleep(max(0.0, started + (i + 1) / 1000 - time.monotonic()))
        time.sleep(0.8)
        closing = time.monotonic()
        bus.close(5)
        duration = time.monotonic() - started
    bodies = [r.json for r in server.requests]
    assert bodies[0]["status"] == "firing"
    assert all(b["status"] == "update" for b in bodies[1:]), [b["status"] for b in bodies]
    # paced while running (unpaced updates would come milliseconds apart); arrival times also carry each
    # request's own latency on a loaded machine, hence the margin. close() sends what is left at once.
    times = [r.time for r in server.requests if r.time < closing]
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert all(gap >= policy.group_interval * 0.5 for gap in gaps), gaps
    assert len(bodies) <= 1 + duration / policy.group_interval
    ids = [i for b in bodies for i in b["event_ids"]]
    assert sorted(ids) == sorted(e.event_id for e in events)  # every event in exactly one message
    assert bodies[-1]["total"] == 1000
    assert "NaN/Inf gradient in transformer.h.3.mlp: 1,000 occurrences, steps 1,200-2,199" in bodies[-1]["text"]


def test_slack_sends_at_most_one_message_per_second(tmp_path) -> None:
    with ScriptedServer() as server:
        sink = SlackAlert(server.url.replace("hooks", "slack-hooks"), grouping=None, retry=FAST,
                          spool_path=tmp_path / "s.jsonl")
        bus = EventBus([sink])
        for i in range(3):
            bus.publish(nan(i, layer=f"layer{i}"))
        bus.close(10)
    times = [r.time for r in server.requests]
    assert len(times) == 3 and all(b - a >= 0.95 for a, b in zip(times, times[1:]))


def test_queue_overflow_is_spilled_to_the_spool(tmp_path) -> None:
    with ScriptedServer() as server:
        sink = webhook(server.url, tmp_path, queue_size=2)
        bus = EventBus([sink])
        events = [nan(i) for i in range(20)]
        writers: list[str] = []
        append_many = sink.spool.append_many

        def spy(*args: object, **kwargs: object) -> None:
            writers.append(threading.current_thread().name)
            append_many(*args, **kwargs)  # type: ignore[arg-type]

        sink.spool.append_many = spy  # type: ignore[method-assign]
        with sink._grouper_lock:  # hold the sink so the bus worker blocks in its grouping and its queue fills up
            for event in events:
                bus.publish(event)
            time.sleep(0.05)
        bus.close(10)
        assert writers and threading.current_thread().name not in writers  # never the publishing thread
        acked = set(server.acknowledged_ids())
    spilled = {r["event"]["event_id"] for r in spooled(sink.spool_path) if r["reason"] == "bus queue full"}
    stats = bus.stats()["sinks"]["webhook"]
    assert stats["spooled"] >= len(spilled) > 0 and stats["dropped"] == 0
    assert stats["delivered"] + stats["spooled"] == stats["published"] == len(events)
    everything = acked | {r["event"]["event_id"] for r in spooled(sink.spool_path)}
    assert everything == {e.event_id for e in events}


def test_replay_resends_once_and_never_twice(tmp_path, capsys) -> None:
    from guardtower.cli import main

    with ScriptedServer(lambda n: Reply(503)) as dead:
        bus = EventBus([sink := webhook(dead.url, tmp_path)])
        events = [nan(i) for i in range(3)]
        for event in events:
            bus.publish(event)
        bus.close(10)
    assert len(spooled(sink.spool_path)) == 3
    with ScriptedServer([Reply(200)] + [Reply(503)] * 20) as flaky:
        assert main(["replay", str(sink.spool_path), "--url", flaky.url]) == 1
        assert "sent 1, remaining 2" in capsys.readouterr().out
    with ScriptedServer() as good:
        assert main(["replay", str(sink.spool_path), "--url", good.url]) == 0
        assert main(["replay", str(sink.spool_path), "--url", good.url]) == 0
        assert "nothing to replay" in capsys.readouterr().out
    resent = flaky.acknowledged_ids() + good.acknowledged_ids()
    assert sorted(resent) == sorted(e.event_id for e in events)
    assert len(Spool(sink.spool_path)) == 0


def test_replay_without_destination_explains(tmp_path, capsys, monkeypatch) -> None:
    from guardtower.replay import main

    monkeypatch.delenv("SLACK_WEBHOOK_URL", raising=False)
    Spool(tmp_path / "s.jsonl").append(nan(1), "HTTP 500", "slack:alerts")
    assert main([str(tmp_path / "s.jsonl")]) == 2
    assert "SLACK_WEBHOOK_URL" in capsys.readouterr().err
    assert main([str(tmp_path / "missing.jsonl")]) == 2
    assert main([str(tmp_path / "s.jsonl"), "--list"]) == 0
    assert "slack:alerts\tspike\t" in capsys.readouterr().out
    Spool(tmp_path / "o.jsonl").append(nan(1), "HTTP 500", "carrier-pigeon:x")
    assert main([str(tmp_path / "o.jsonl")]) == 2
    assert "no replayer for sink kind 'carrier-pigeon'" in capsys.readouterr().err


def test_pagerduty_triggers_then_resolves_when_the_run_is_quiet(tmp_path) -> None:
    with ScriptedServer(lambda n: Reply(202, body=b'{"status":"success"}')) as server:
        sink = PagerDutyAlert("PDKEYsecret123", url=server.url, retry=FAST, spool_path=tmp_path / "pd.jsonl",
                              grouping=GroupPolicy(group_wait=0, group_interval=0.1, resolve_after_steps=50))
        bus = EventBus([sink])
        bus.publish(spike := nan(10))
        bus.flush(5)
        bus.publish(SummaryEvent(run="r1", step=40))
        bus.flush(5)
        assert len(server.requests) == 1
        bus.publish(SummaryEvent(run="r1", step=60))
        bus.close(5)
    trigger, resolve = (r.json for r in server.requests)
    assert trigger["event_action"] == "trigger" and resolve["event_action"] == "resolve"
    assert trigger["dedup_key"] == resolve["dedup_key"] == spike.fingerprint


def test_halt_supersedes_pending_spikes_of_the_run(tmp_path) -> None:
    with ScriptedServer() as server:
        bus = EventBus([webhook(server.url, tmp_path, grouping=GroupPolicy(group_wait=0.3))])
        spikes = [nan(i) for i in range(5)]
        for event in spikes:
            bus.publish(event)
        bus.publish(halt := HaltEvent(run="r1", step=5, layer="transformer.h.3.mlp", reason="nonfinite"))
        bus.close(5)
    (body,) = (r.json for r in server.requests)
    assert body["kind"] == "halt" and body["superseded"] == {"spike": 5}
    assert sorted(body["event_ids"]) == sorted([halt.event_id] + [e.event_id for e in spikes])


def test_only_rank_zero_sends(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("RANK", "1")
    with ScriptedServer() as server:
        bus = EventBus([webhook(server.url, tmp_path)])
        bus.publish(nan(1, run="rank1"))
        bus.close(5)
    assert server.requests == []


def test_no_secret_in_logs_errors_spool_or_reprs(tmp_path, caplog) -> None:
    """Every failure path, with DEBUG logging on: the URL tokens and the HMAC secret appear nowhere."""
    caplog.set_level(logging.DEBUG)
    texts: list[str] = []
    script = [Reply(500), Reply(429, {"Retry-After": "0"}), Reply(404, body=b"no_service")]
    with ScriptedServer(script) as server:
        sink = webhook(server.url, tmp_path, secret="hmac-secret-value",
                       retry=RetryPolicy(max_attempts=2, initial_backoff=0.01, read_timeout=1))
        bus = EventBus([sink])
        bus.publish(nan(1))
        bus.publish(nan(2, layer="x"))
        bus.close(10)
        texts += [repr(sink), str(sink), repr(bus), str(bus.stats())]
        try:
            webhook(server.url, tmp_path, secret="hmac-secret-value", retry=FAST).send_now(nan(3))
        except Exception as exc:  # 200 expected; any failure text is checked below too
            texts.append(f"{exc!r} {exc}")
    for url in (refused_url(), server.url):
        try:
            webhook(url, tmp_path, retry=RetryPolicy(max_attempts=1)).send_now(nan(4))
        except Exception as exc:
            texts += [str(exc), repr(exc), exc.reason]  # type: ignore[attr-defined]
    pd = PagerDutyAlert("PDKEYsecret123", url=refused_url(), retry=RetryPolicy(max_attempts=1),
                        spool_path=tmp_path / "pd.jsonl", grouping=None)
    pd_bus = EventBus([pd])
    pd_bus.publish(nan(5))
    pd_bus.close(10)
    texts += [repr(pd), str(vars(pd))]
    files = [p.read_text() for p in tmp_path.iterdir() if p.is_file()]
    assert len(spooled(sink.spool_path)) >= 1 and len(spooled(pd.spool_path)) == 1
    assert any(r.name.startswith("urllib3") and "<redacted>" in r.getMessage() for r in caplog.records)
    haystack = "\n".join([caplog.text, *texts, *files, *(r.getMessage() for r in caplog.records)])
    for bit in SECRET_BITS:
        assert bit not in haystack, bit


def _guarded_run(tmp_path: Path, server_url: str, *, nan_steps: range, **guard: object) -> None:
    """A real GuardedOptimizer on a tiny model, NaN in one gradient during ``nan_steps``."""
    import torch

    from guardtower.guard import GuardedOptimizer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    sink = webhook(server_url, tmp_path, grouping=GroupPolicy(group_wait=30))
    opt = GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model, nan_action="skip", log_every=10,
                           log_dir=tmp_path / "logs", verbose=False, sinks=[sink], run="tiny", **guard)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    try:
        for step in range(60):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            if step in nan_steps:
                model[2].weight.grad[0, 0] = float("nan")
            opt.step()
    finally:
        opt.close(timeout=10)
    assert all(p.isfinite().all() for p in model.parameters())


@pytest.mark.slow
def test_guarded_training_run_with_a_nan_storm_sends_one_grouped_alert(tmp_path) -> None:
    with ScriptedServer() as server:
        _guarded_run(tmp_path, server.url, nan_steps=range(20, 50), max_consecutive_skips=None)
    bodies = {r.json["kind"]: r.json for r in server.requests}
    assert sorted(bodies) == ["nonfinite", "skip_budget"]  # the storm, and one WARN that 30 steps were skipped
    assert bodies["skip_budget"]["total"] == 1
    body = bodies["nonfinite"]
    assert body["kind"] == "nonfinite" and body["run"] == "tiny"
    assert body["total"] == 30 and len(body["event_ids"]) == 30
    assert body["text"] == "NaN/Inf gradient in 2.weight: 30 occurrences, steps 21-50"  # the guard counts from 1


@pytest.mark.slow
def test_guard_escalation_halt_supersedes_the_pending_spikes(tmp_path) -> None:
    from guardtower.errors import GradientSpikeError

    with ScriptedServer() as server:
        with pytest.raises(GradientSpikeError):
            _guarded_run(tmp_path, server.url, nan_steps=range(20, 60))
        # the guard flushes the bus before raising: the halt went out at once, not after group_wait
        assert [r.json["kind"] for r in server.requests] == ["halt"]
    body = server.requests[0].json
    # the pending spikes and the skip budget's WARN ride along with the halt that supersedes them
    assert body["total"] == 1 and body["superseded"] == {"spike": len(body["event_ids"]) - 2, "skip_budget": 1}
    assert len(body["event_ids"]) - 1 >= 20  # every rejected step's spike event rides along
    assert body["text"].startswith("Training halted: nonfinite in 2.weight at step ")


def test_a_forked_child_never_sends_its_parents_pending_alerts(tmp_path) -> None:
    import os

    with ScriptedServer() as server:
        sink = webhook(server.url, tmp_path, grouping=GroupPolicy(group_wait=30))
        bus = EventBus([sink])
        bus.publish(parent_event := nan(1))
        deadline = time.monotonic() + 5
        while bus.stats()["sinks"]["webhook"]["delivered"] == 0 and not any(b.grouper.pending_events
                                                                             for b in sink._batchers) \
                and time.monotonic() < deadline:
            time.sleep(0.005)  # until the event waits in the sink's group rather than in the bus queue
        time.sleep(0.5)  # the parent's persister has written it to the spool (persist before you try)
        before = sink.spool_path.read_bytes() if sink.spool_path.exists() else b""
        pid = os.fork()
        if pid == 0:  # a DataLoader worker, say
            child = EventBus([sink])
            child.close(2)
            bus.close(2)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        after = sink.spool_path.read_bytes() if sink.spool_path.exists() else b""
        assert server.requests == [] and after == before  # neither sent nor spooled by the child
        bus.close(5)
    assert [r.json["event_ids"] for r in server.requests] == [[parent_event.event_id]]


def test_close_spools_a_failing_storm_message_quickly(tmp_path) -> None:
    """1,000 events of one grouped message, the receiver down: close() spools them all within its timeout."""
    slow_retry = RetryPolicy(max_attempts=10, initial_backoff=20, max_backoff=20, deadline=100)
    with ScriptedServer(lambda n: Reply(503)) as server:
        bus = EventBus([sink := webhook(server.url, tmp_path, retry=slow_retry, grouping=GroupPolicy(group_wait=0))])
        events = [nan(i) for i in range(1000)]
        with sink._grouper_lock:  # all 1,000 reach the group before its first message goes out
            for event in events:
                bus.publish(event)
            time.sleep(0.05)
        deadline = time.monotonic() + 5
        while not server.requests and time.monotonic() < deadline:
            time.sleep(0.005)
        started = time.monotonic()
        bus.close(2.0)
        took = time.monotonic() - started
    # not the 20 s backoff: close stops retrying and spools (1,000 records take a while on a loaded host)
    assert took < 10
    assert len(Spool(sink.spool_path)) == 1000


def test_attached_to_a_guard_the_spool_defaults_under_its_log_dir(tmp_path, monkeypatch) -> None:
    import torch

    from guardtower.guard import GuardedOptimizer

    monkeypatch.chdir(tmp_path)
    default = WebhookAlert(refused_url())
    explicit = WebhookAlert(refused_url(), name="mine", spool_path=tmp_path / "mine.jsonl")
    model = torch.nn.Linear(2, 1)
    guard = GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, log_dir=tmp_path / "run1",
                             sinks=[default, explicit], verbose=False)
    assert default.spool_path == tmp_path / "run1" / "spool" / "webhook.jsonl"
    assert explicit.spool_path == tmp_path / "mine.jsonl"
    assert not (tmp_path / "run1" / "spool").exists()  # created on the first write only
    guard.close(1)


def test_errors_never_show_the_destination_host_and_port(tmp_path, caplog) -> None:
    url = refused_url()
    port = url.split(":")[2].split("/")[0]
    sink = WebhookAlert(url, grouping=None, spool_path=tmp_path / "s.jsonl",
                        retry=RetryPolicy(max_attempts=1, connect_timeout=0.5, read_timeout=0.5))
    bus = EventBus([sink])
    with caplog.at_level("DEBUG"):
        bus.publish(nan(1))
        bus.close(5)
    with pytest.raises(DeliveryError) as info:
        sink.send_now(nan(2))
    texts = caplog.text + (tmp_path / "s.jsonl").read_text() + str(info.value) + repr(sink)
    assert "Connection refused" in texts and "T0SECRET" not in texts
    assert f"port={port}" not in texts and f"127.0.0.1:{port}" not in texts
