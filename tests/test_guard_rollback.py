"""Rollback to periodic snapshots, and escalation after too many consecutive skips."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from guardtower.errors import GradientSpikeError
from guardtower.events import HaltEvent, RollbackEvent
from guardtower.guard.snapshots import SnapshotStore
from guardtower.testing import capture_events
from tests._guard_helpers import full_state, make, same_state, scale_grad, train


@pytest.mark.parametrize("opt", ["adamw_fused", "sgd_momentum"])
def test_rollback_restores_params_buffers_and_optimizer_state_of_the_last_snapshot(tmp_path: Path, opt: str) -> None:
    model, guard = make(tmp_path, opt, nan_action="rollback", rollback_every=10, keep=2)
    hook_calls: list[tuple[int, int]] = []
    guard.on_rollback = lambda a, b: hook_calls.append((a, b))
    train(model, guard, 20)
    at_20 = full_state(model, guard, buffers=True)
    train(model, guard, 4, start=20)
    with capture_events() as events:
        train(model, guard, 1, start=24, corrupt=lambda i, m: scale_grad("out.weight", 1e4)(m))
    assert same_state(at_20, full_state(model, guard, buffers=True))
    rollback = next(e for e in events if isinstance(e, RollbackEvent))
    assert (rollback.from_step, rollback.to_step, rollback.layer) == (25, 20, "out.weight")
    assert hook_calls == [(25, 20)]
    assert (guard.total_rollbacks, guard.total_spikes, guard.total_skips) == (1, 1, 0)
    train(model, guard, 3, start=25)  # training continues from the restored state
    assert not same_state(at_20, full_state(model, guard, buffers=True))


def test_rollback_before_the_first_periodic_snapshot_goes_to_the_initial_state(tmp_path: Path) -> None:
    model, guard = make(tmp_path, nan_action="rollback", rollback_every=50)
    initial = full_state(model, guard, buffers=True)
    train(model, guard, 5, corrupt=lambda i, m: m.inp.weight.grad.fill_(float("nan")) if i == 4 else None)
    assert same_state(initial, full_state(model, guard, buffers=True))
    assert guard.total_rollbacks == 1


def test_snapshots_are_periodic_bounded_and_reuse_their_buffers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, guard = make(tmp_path, nan_action="rollback", rollback_every=5, keep=2)
    store = guard._snapshots
    assert isinstance(store, SnapshotStore)
    taken: list[int] = []
    original = store.take
    monkeypatch.setattr(store, "take", lambda step: (taken.append(step), original(step))[1])
    train(model, guard, 30)
    assert taken == [5, 10, 15, 20, 25, 30]  # plus the one at construction (step 0)
    assert [s.step for s in store.snapshots] == [25, 30]
    first_buffers = [t.data_ptr() for t in store.snapshots[0].tensors]
    train(model, guard, 10, start=30)
    assert [s.step for s in store.snapshots] == [35, 40]
    assert [t.data_ptr() for t in store.snapshots[0].tensors] == first_buffers  # step 35 reused the slot of 25


def test_no_snapshots_without_a_rollback_policy(tmp_path: Path) -> None:
    _, guard = make(tmp_path, nan_action="skip", max_consecutive_skips=None)
    assert guard._snapshots is None


@pytest.mark.parametrize("opt", ["adamw_fused", "adamw_foreach"])
def test_too_many_consecutive_skips_escalate_to_raise(tmp_path: Path, opt: str) -> None:
    model, guard = make(tmp_path, opt, max_consecutive_skips=3, escalate_to="raise")
    train(model, guard, 12)
    with capture_events() as events, pytest.raises(GradientSpikeError) as info:
        train(model, guard, 10, start=12, corrupt=lambda i, m: m.out.bias.grad.fill_(float("inf")))
    assert info.value.step == 16  # the 4th rejected step in a row
    halt = next(e for e in events if isinstance(e, HaltEvent))
    assert "4 rejected steps in a row" in halt.message
    # with a fused optimizer the host learns of it at most two steps later; every bad update was skipped
    assert guard.step_count <= 18
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_too_many_consecutive_skips_escalate_to_rollback(tmp_path: Path) -> None:
    model, guard = make(tmp_path, "adamw_foreach", max_consecutive_skips=2, escalate_to="rollback",
                        rollback_every=10)
    train(model, guard, 10)
    at_10 = full_state(model, guard, buffers=True)
    with capture_events() as events:
        train(model, guard, 3, start=10, corrupt=lambda i, m: m.out.bias.grad.fill_(float("nan")))
    kinds = [e.kind for e in events if e.kind != "summary"]
    assert kinds == ["spike", "skip", "spike", "skip", "spike", "rollback"]
    assert same_state(at_10, full_state(model, guard, buffers=True))
    assert guard.consecutive_rejections == 0
