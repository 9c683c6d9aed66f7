"""The grouping, throttle and Retry-After logic, driven by a fake clock: no threads, no waiting."""

from __future__ import annotations

import email.utils

import pytest

from guardtower.alerts import GroupPolicy, Grouper, RetryPolicy, Throttle
from guardtower.alerts._format import headline
from guardtower.alerts.policy import parse_retry_after
from guardtower.errors import ConfigError
from guardtower.events import HaltEvent, PreflightEvent, RollbackEvent, SkipEvent, SpikeEvent, SummaryEvent


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def nan(step: int, layer: str = "transformer.h.3.mlp", run: str = "r1") -> SpikeEvent:
    return SpikeEvent(run=run, step=step, layer=layer, reason="nonfinite", severity="ERROR")


@pytest.fixture
def clock() -> Clock:
    return Clock()


def make(clock: Clock, **policy: float | None) -> Grouper:
    settings: dict = {"group_wait": 10.0, "group_interval": 60.0, "repeat_interval": 3600.0}
    settings.update(policy)
    return Grouper(GroupPolicy(**settings), clock=clock)


def test_first_burst_waits_group_wait_then_becomes_one_message(clock: Clock) -> None:
    grouper = make(clock)
    events = [nan(1200 + i) for i in range(1000)]
    for event in events:
        assert grouper.add(event)
    clock.advance(9.9)
    assert grouper.due() == []
    assert grouper.next_due() == pytest.approx(1010.0)
    clock.advance(0.2)
    (note,) = grouper.due()
    assert note.status == "firing"
    assert note.total == note.count == 1000
    assert note.event_ids == [e.event_id for e in events]
    assert (note.first_step, note.last_step) == (1200, 2199)
    assert headline(note) == "NaN/Inf gradient in transformer.h.3.mlp: 1,000 occurrences, steps 1,200-2,199"
    assert grouper.pending_events == 0
    assert grouper.due() == []


def test_updates_come_at_most_once_per_group_interval_with_counts(clock: Clock) -> None:
    grouper = make(clock)
    grouper.add(nan(1))
    clock.advance(10)
    assert [n.status for n in grouper.due()] == ["firing"]
    sent: list[tuple[float, int, int]] = []
    for second in range(1, 131):  # one event a second for 130 s
        clock.advance(1)
        grouper.add(nan(1 + second))
        sent += [(clock.now, n.count, n.total) for n in grouper.due() if n.status == "update"]
    # updates at +60 s and +120 s after the first message, each with the occurrences since the last one
    assert sent == [(1070.0, 60, 61), (1130.0, 60, 121)]
    clock.advance(60)
    (last,) = grouper.due()
    assert (last.count, last.total) == (10, 131)
    assert headline(last).endswith("131 occurrences, steps 1-131 (+10 since the last message)")


def test_fingerprint_ignores_step_but_separates_layers_and_runs(clock: Clock) -> None:
    grouper = make(clock)
    for step in range(5):
        grouper.add(nan(step))
        grouper.add(nan(step, layer="lm_head"))
        grouper.add(nan(step, run="r2"))
    clock.advance(10)
    notes = grouper.due()
    assert len(notes) == 3 and all(n.count == 5 for n in notes)


def test_repeat_interval_resends_an_unchanged_incident(clock: Clock) -> None:
    grouper = make(clock, repeat_interval=100.0)
    grouper.add(nan(1))
    clock.advance(10)
    grouper.due()
    clock.advance(99)
    assert grouper.due() == []
    clock.advance(1)
    (note,) = grouper.due()
    assert note.status == "repeat" and note.events == () and note.total == 1
    assert grouper.next_due() == pytest.approx(clock.now + 100)


def test_no_repeat_when_disabled(clock: Clock) -> None:
    grouper = make(clock, repeat_interval=None)
    grouper.add(nan(1))
    clock.advance(10)
    grouper.due()
    assert grouper.next_due() is None


def test_rollback_supersedes_pending_spike_and_skip_alerts_of_its_run(clock: Clock) -> None:
    grouper = make(clock)
    spikes = [nan(i) for i in range(3)]
    skips = [SkipEvent(run="r1", step=i, layer="transformer.h.3.mlp") for i in range(3)]
    other_run = nan(1, run="r2")
    for event in [*spikes, *skips, other_run]:
        grouper.add(event)
    rollback = RollbackEvent(run="r1", step=3, layer="transformer.h.3.mlp", from_step=3, to_step=0)
    grouper.add(rollback)
    clock.advance(10)
    notes = {n.kind: n for n in grouper.due()}
    assert set(notes) == {"rollback", "spike"}  # r1's spike and skip groups are gone
    assert notes["spike"].run == "r2"
    rb = notes["rollback"]
    assert rb.count == 1 and dict(rb.superseded) == {"spike": 3, "skip": 3}
    assert set(rb.event_ids) == {e.event_id for e in [*spikes, *skips, rollback]}
    assert "replaces 3 pending skip alert(s), 3 pending spike alert(s)" in headline(rb)
    assert grouper.pending_events == 0


def test_halt_resolves_already_sent_spike_incidents_when_send_resolved(clock: Clock) -> None:
    grouper = Grouper(GroupPolicy(group_wait=0, group_interval=60), clock=clock, send_resolved=True)
    grouper.add(nan(1))
    assert [n.status for n in grouper.due()] == ["firing"]
    grouper.add(HaltEvent(run="r1", step=2, layer="transformer.h.3.mlp", reason="nonfinite"))
    notes = grouper.due()
    assert [(n.kind, n.status) for n in notes] == [("spike", "resolved"), ("halt", "firing")]
    assert notes[0].reason == "superseded by halt"


def test_summary_quiet_for_resolve_after_steps_clears_the_incident(clock: Clock) -> None:
    grouper = Grouper(GroupPolicy(group_wait=0, resolve_after_steps=100), clock=clock, send_resolved=True)
    grouper.add(nan(50))
    grouper.due()
    summary = SummaryEvent(run="r1", step=149)
    grouper.progress(summary.run, summary.step)
    assert grouper.due() == []
    grouper.progress("other-run", 1000)
    assert grouper.due() == []
    grouper.progress("r1", 150)
    (note,) = grouper.due()
    assert note.status == "resolved" and "100 steps" in note.reason


def test_explicit_resolve_sends_pending_first(clock: Clock) -> None:
    grouper = Grouper(GroupPolicy(group_wait=10), clock=clock, send_resolved=True)
    grouper.add(nan(1))
    grouper.resolve(run="r1")
    assert [n.status for n in grouper.due()] == ["firing", "resolved"]


def test_per_event_mode_and_max_pending(clock: Clock) -> None:
    grouper = Grouper(None, clock=clock, max_pending=3)
    events = [nan(i) for i in range(5)]
    assert [grouper.add(e) for e in events] == [True, True, True, False, False]
    notes = grouper.due()
    assert [n.event_ids for n in notes] == [[e.event_id] for e in events[:3]]
    assert grouper.pending_events == 0 and grouper.add(events[3])


def test_drain_ignores_waits(clock: Clock) -> None:
    grouper = make(clock)
    grouper.add(nan(1))
    grouper.add(PreflightEvent(run="r1", status="FAIL", errors=1, error_ids=("LORA-001",), severity="ERROR"))
    assert grouper.due() == []
    assert sorted(n.kind for n in grouper.drain()) == ["preflight", "spike"]


def test_throttle_spaces_messages_and_429_pauses(clock: Clock) -> None:
    throttle = Throttle(1.0, clock=clock)
    assert [throttle.reserve() for _ in range(3)] == [0.0, 1.0, 2.0]
    clock.advance(5)
    throttle.pause(30)
    assert throttle.reserve() == pytest.approx(30.0)
    assert throttle.paused_for() == pytest.approx(30.0)


def test_throttle_counts_the_interval_from_the_end_of_a_slow_send(clock: Clock) -> None:
    throttle = Throttle(1.0, clock=clock)
    assert throttle.reserve() == 0.0
    clock.advance(0.7)  # the request took 0.7 s to go out: the receiver saw it at about t=0.7
    throttle.sent()
    assert throttle.reserve() == pytest.approx(1.0)  # the next one leaves at t=1.7, not at the booked t=1.0


def test_parse_retry_after_seconds_date_and_cap() -> None:
    assert parse_retry_after("1", cap=60) == 1.0
    assert parse_retry_after("120", cap=60) == 60.0
    assert parse_retry_after("-3", cap=60) == 0.0
    date = email.utils.formatdate(1_000_030, usegmt=True)
    assert parse_retry_after(date, cap=60, now=1_000_000) == pytest.approx(30.0)
    assert parse_retry_after("soon", cap=60) is None
    assert parse_retry_after(None, cap=60) is None


@pytest.mark.parametrize("kwargs", [{"group_wait": -1}, {"group_interval": float("nan")}, {"repeat_interval": 0},
                                    {"resolve_after_steps": 0}])
def test_group_policy_rejects_bad_values(kwargs: dict) -> None:
    with pytest.raises(ConfigError) as info:
        GroupPolicy(**kwargs)
    assert next(iter(kwargs)) in str(info.value)


@pytest.mark.parametrize("kwargs", [{"max_attempts": 0}, {"deadline": 0}, {"initial_backoff": -1}])
def test_retry_policy_rejects_bad_values(kwargs: dict) -> None:
    with pytest.raises(ConfigError):
        RetryPolicy(**kwargs)


def test_sinks_of_one_destination_share_a_throttle_while_they_live() -> None:
    import gc

    from guardtower.alerts.policy import shared_throttle

    clock = Clock()
    strict = shared_throttle("https://hooks.example.test/a", 1.0, clock)
    loose = shared_throttle("https://hooks.example.test/a", 0.0, clock)
    assert loose is strict and strict.interval == 1.0
    assert shared_throttle("https://hooks.example.test/b", 0.0, clock) is not strict
    del strict, loose
    gc.collect()
    assert shared_throttle("https://hooks.example.test/a", 0.0, clock).interval == 0.0
