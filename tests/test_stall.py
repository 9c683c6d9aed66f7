"""Stall alerts: the heartbeat's watchdog with a fake clock, and a real loop that hangs mid-run."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from _alerts_helpers import Reply, ScriptedServer
from guardtower.alerts import GroupPolicy, Notification, RetryPolicy, SlackAlert, WebhookAlert
from guardtower.bus import EventBus
from guardtower.errors import ConfigError
from guardtower.spool import Spool
from guardtower.events import Event, StallEvent, event_from_record
from guardtower.guard import GuardedOptimizer
from guardtower.heartbeat import Heartbeat
from guardtower.testing import InMemorySink

FAST = RetryPolicy(max_attempts=3, initial_backoff=0.01, max_backoff=0.02, deadline=10, read_timeout=2)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def watchdogs() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "guardtower-heartbeat"]


def wait_for(predicate, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


def test_no_stall_before_the_limit_one_after_it_and_a_resolved_one_when_steps_resume() -> None:
    clock, events = FakeClock(), []
    beat = Heartbeat(60, events.append, clock=clock, poll=3600)  # the test drives check() itself
    clock.now += 10_000
    assert not beat.check()  # nothing is watched before the first step
    beat.beat(1)
    clock.now += 59.0
    assert not beat.check() and events == []
    clock.now += 2.0
    assert beat.check() and beat.stalled
    clock.now += 100.0
    assert not beat.check()  # one event per stall, however long it lasts
    beat.beat(2)
    beat.stop()
    stall, resumed = events
    assert isinstance(stall, StallEvent) and (stall.step, stall.seconds, stall.resolved) == (1, 61.0, False)
    assert stall.severity.label == "WARN" and stall.stall_after == 60.0
    assert (resumed.step, resumed.seconds, resumed.resolved) == (2, 161.0, True)
    assert stall.fingerprint != resumed.fingerprint  # the resumed message is its own incident
    assert not beat.stalled


def test_stall_event_round_trips_through_strict_json() -> None:
    event = StallEvent(step=7, seconds=12.5, stall_after=10.0, resolved=True, run="r")
    assert event_from_record(event.to_record()) == event


def test_watchdog_starts_on_the_first_step_not_at_construction_and_close_stops_it(tmp_path: Path) -> None:
    model = nn.Linear(4, 1)
    guard = GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, stall_after=30, verbose=False,
                             log_dir=tmp_path)
    assert watchdogs() == []
    model(torch.randn(2, 4)).sum().backward()
    guard.step()
    (thread,) = watchdogs()
    assert thread.daemon
    guard.close()
    assert not thread.is_alive()


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), "10", True])
def test_bad_stall_after_is_a_config_error_before_anything_starts(bad: object, tmp_path: Path) -> None:
    model = nn.Linear(4, 1)
    with pytest.raises(ConfigError, match="stall_after"):
        GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, stall_after=bad, verbose=False,
                         log_dir=tmp_path / "sg")
    assert not (tmp_path / "sg").exists()  # rejected before the guard touched anything


def test_a_guard_without_stall_after_has_no_watchdog(tmp_path: Path) -> None:
    model = nn.Linear(4, 1)
    guard = GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, verbose=False, log_dir=tmp_path)
    model(torch.randn(2, 4)).sum().backward()
    guard.step()
    assert guard.heartbeat is None and watchdogs() == []
    guard.close()


def _train(guard: GuardedOptimizer, model: nn.Module, steps: int, hang_at: int, hang_s: float) -> None:
    for step in range(1, steps + 1):
        if step == hang_at:
            time.sleep(hang_s)  # a stuck data loader
        guard.zero_grad()
        model(torch.randn(8, 4)).pow(2).mean().backward()
        guard.step()


@pytest.mark.slow
def test_a_loop_that_hangs_mid_run_alerts_slack_and_then_resolves(tmp_path: Path) -> None:
    with ScriptedServer() as server:
        slack = SlackAlert(server.url, grouping=GroupPolicy(group_wait=0.0), rate_limit=0, retry=FAST,
                           spool_path=tmp_path / "spool.jsonl")
        memory = InMemorySink()
        model = nn.Linear(4, 1)
        guard = GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model, stall_after=1.0,
                                 sinks=[slack, memory], verbose=False, log_dir=tmp_path, run="hang")
        _train(guard, model, steps=6, hang_at=4, hang_s=3.0)
        guard.close()
        wait_for(lambda: len(server.requests) >= 2, 15, "two Slack messages")
    stalls = [e for e in memory.events if isinstance(e, StallEvent)]
    assert [(e.step, e.resolved) for e in stalls] == [(3, False), (4, True)]
    assert 1.0 <= stalls[0].seconds <= stalls[1].seconds
    headers = [r.json["blocks"][0]["text"]["text"] for r in server.requests]
    assert headers[0].startswith("Training stalled: no optimizer step for")
    assert headers[1].startswith("Training resumed after")
    assert [r.json["text"].count("run: hang") for r in server.requests] == [1, 1]


@pytest.mark.slow
def test_a_stall_that_cannot_be_delivered_is_retried_then_spooled(tmp_path: Path) -> None:
    with ScriptedServer(lambda n: Reply(503)) as server:
        webhook = WebhookAlert(server.url, grouping=None, retry=FAST, spool_path=tmp_path / "spool.jsonl")
        bus = EventBus([webhook])
        beat = Heartbeat(0.2, bus.publish, poll=0.05)
        beat.beat(10)
        wait_for(lambda: beat.stalled, 10, "the watchdog to see the stall")
        beat.stop()
        bus.close(10)
    assert len(server.requests) == FAST.max_attempts
    spooled = list(Spool(tmp_path / "spool.jsonl").entries())  # pending: written before the first attempt
    assert len(spooled) == 1 and spooled[0].event.kind == "stall" and "HTTP" in spooled[0].reason


def test_stall_alerts_by_default_and_renders_both_states(tmp_path: Path) -> None:
    sink = SlackAlert("http://127.0.0.1:9/hooks/x", spool_path=tmp_path / "s.jsonl")
    stall: Event = StallEvent(step=3, seconds=612.0, stall_after=600.0, severity="WARN")
    resumed = StallEvent(step=4, seconds=700.0, stall_after=600.0, resolved=True)
    assert sink.accepts(stall) and sink.accepts(resumed)
    header = [sink.render(Notification.single(e))["blocks"][0]["text"]["text"] for e in (stall, resumed)]
    assert header == ["Training stalled: no optimizer step for 612 s",
                      "Training resumed after 700 s without an optimizer step"]


def test_a_halt_pauses_the_watchdog_until_the_next_step(tmp_path: Path) -> None:
    from guardtower.errors import GradientSpikeError

    model = nn.Linear(4, 1)
    guard = GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, stall_after=30, verbose=False,
                             nan_action="raise", log_dir=tmp_path)
    clock = FakeClock()
    assert guard.heartbeat is not None
    guard.heartbeat._clock = clock  # the guard's watchdog, on a clock the test moves
    model(torch.randn(2, 4)).sum().backward()
    guard.step()
    model.weight.grad.fill_(float("nan"))
    with pytest.raises(GradientSpikeError):
        guard.step()
    clock.now += 3600
    assert not guard.heartbeat.check()  # a stopped run is not a stalled one
    guard.close()


@pytest.mark.slow
def test_wandb_gets_a_stall_alert_and_a_resumed_alert(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import wandb

    from _wandb_reader import find_run_dir, read_run
    from guardtower.bridges import WandBBridge

    for key, value in {"WANDB_MODE": "offline", "WANDB_BASE_URL": "http://127.0.0.1:9", "WANDB_API_KEY": ""}.items():
        monkeypatch.setenv(key, value)
    run = wandb.init(mode="offline", dir=str(tmp_path), project="guardtower-tests")
    bus = EventBus([WandBBridge()])
    bus.publish(StallEvent(step=3, seconds=612.0, stall_after=600.0, severity="WARN"))
    bus.publish(StallEvent(step=4, seconds=700.0, stall_after=600.0, resolved=True))
    assert bus.flush(10)
    run.finish()
    bus.close(5)
    alerts = read_run(find_run_dir(tmp_path)).alerts
    assert [(a["title"], a["level"]) for a in alerts] == [("guardtower: training stalled", "WARN"),
                                                          ("guardtower: training resumed", "INFO")]
    assert "No optimizer step for 612 s" in alerts[0]["text"]


@pytest.mark.slow
def test_a_finished_hf_training_is_not_reported_as_a_stall(tmp_path: Path) -> None:
    from transformers import Trainer

    from _hf_helpers import TokenDataset, tiny_gpt2, training_args
    from guardtower.integrations.huggingface import StabilityGuardCallback
    from guardtower.testing import capture_events

    guard = StabilityGuardCallback(stall_after=0.3, log_dir=str(tmp_path / "sg"), verbose=False)
    trainer = Trainer(model=tiny_gpt2(), args=training_args(tmp_path, max_steps=3), train_dataset=TokenDataset(),
                      callbacks=[guard])
    with capture_events() as events:
        trainer.train()
        assert guard.guard is not None and guard.guard.heartbeat is not None
        time.sleep(1.2)  # four stall periods after the last step: the watchdog looked and stayed quiet
    assert [e for e in events if isinstance(e, StallEvent)] == []
    assert watchdogs()  # still there for a second train(), just not watching
    guard.close()
    assert watchdogs() == []


@pytest.mark.slow
def test_rank_zero_reports_a_hang_on_another_rank_while_it_waits_in_a_collective(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    from guardtower.events import from_json

    worker = Path(__file__).with_name("_stall_dist_worker.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    procs = [subprocess.Popen([sys.executable, str(worker), str(rank), "2", str(tmp_path / "init"), str(tmp_path)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    try:
        outputs = [proc.communicate(timeout=180)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    assert [proc.returncode for proc in procs] == [0, 0], "\n".join(o[-2000:] for o in outputs)
    lines = (tmp_path / "events.rank0.jsonl").read_text().splitlines()
    stalls = [e for e in map(from_json, lines) if isinstance(e, StallEvent)]
    assert [(e.rank, e.step, e.resolved) for e in stalls] == [(0, 3, False), (0, 4, True)]
    assert stalls[1].seconds >= 1.5  # rank 0 sat in the all-reduce for most of rank 1's 3 s hang
