"""A guard saved at step N and resumed in a fresh process state makes exactly the decisions of the run that
never stopped: baselines, absorb ring, counters, skip budget, lr back-off and the rollback cadence."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from guardtower.events import Event, LrBackoffEvent, RollbackEvent, SkipBudgetEvent, SpikeEvent
from guardtower.guard import GuardedOptimizer
from guardtower.testing import capture_events
from tests._guard_helpers import make, same_detector_state, train

SAVE_AT = 40
STEPS = 80


def incidents(i: int, model: nn.Module) -> None:
    """NaN right before the save (step 40) and right after the resume (41); a level shift whose absorb ring
    straddles the save (steps 37-58, absorbed at 49); spikes and an Inf after the resume."""
    if i in (SAVE_AT - 1, SAVE_AT):
        model.inp.weight.grad.fill_(float("nan"))
    if 36 <= i < 58:
        model.out.weight.grad.mul_(30.0)
    if i in (62, 70):
        model.inp.weight.grad.mul_(1e3)
    if i == 66:
        model.out.bias.grad.fill_(float("inf"))


def checkpoint(model: nn.Module, guard: GuardedOptimizer) -> dict[str, Any]:
    """What a training script saves, through torch.save / torch.load(weights_only=True) as a real resume."""
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": guard.state_dict()}, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def decisions(events: list[Event], after: int) -> list[tuple[Any, ...]]:
    """Every decision and what it was based on, bitwise (norms and ratios as the detector saw them; floats by
    ``repr``, so NaN equals NaN)."""
    out: list[tuple[Any, ...]] = []
    for e in events:
        if e.step is None or e.step <= after:
            continue
        if isinstance(e, SpikeEvent):
            out.append((e.kind, e.step, e.action, e.layer, e.reason, e.norm, e.ratio, e.baseline))
        elif isinstance(e, (RollbackEvent, SkipBudgetEvent, LrBackoffEvent)):
            out.append((e.kind, e.step, getattr(e, "to_step", None), getattr(e, "rejected", None),
                        getattr(e, "scale", None)))
    return [tuple(repr(v) if isinstance(v, float) else v for v in d) for d in out]


def counters(guard: GuardedOptimizer) -> tuple[int, ...]:
    return (guard.step_count, guard.total_spikes, guard.total_skips, guard.total_rollbacks, guard.total_clips,
            guard.consecutive_rejections, guard._total_level_shifts)


def run_both(tmp_path: Path, save_at: int, steps: int, corrupt: Callable[[int, nn.Module], None],
             **kwargs: Any) -> tuple[Any, ...]:
    """(uninterrupted events, resumed events, uninterrupted model/guard, resumed model/guard, checkpoint)."""
    with capture_events() as full:
        model, guard = make(tmp_path / "full", **kwargs)
        train(model, guard, steps, corrupt=corrupt)
        guard.flush()
    first_model, first_guard = make(tmp_path / "first", **kwargs)
    train(first_model, first_guard, save_at, corrupt=corrupt)
    saved = checkpoint(first_model, first_guard)
    first_guard.close()
    # a fresh process: another seed's weights, a new optimizer and guard, then the checkpoint
    resumed_model, resumed = make(tmp_path / "resumed", seed=1, **kwargs)
    resumed_model.load_state_dict(saved["model"])
    resumed.load_state_dict(saved["optimizer"])
    with capture_events() as after:
        train(resumed_model, resumed, steps - save_at, start=save_at, corrupt=corrupt)
        resumed.flush()
    return list(full), list(after), (model, guard), (resumed_model, resumed), saved


def test_a_resumed_run_makes_exactly_the_uninterrupted_decisions(tmp_path: Path) -> None:
    full, after, (model, guard), (resumed_model, resumed), saved = run_both(tmp_path, SAVE_AT, STEPS, incidents)
    expected = decisions(full, SAVE_AT)
    assert decisions(after, SAVE_AT) == expected
    kinds = [d[0] for d in expected]
    assert "skip_budget" in kinds  # the budget counted the rejections before the save too
    assert [d[1] for d in expected if d[0] == "spike"] == [41, 42, 43, 44, 45, 46, 47, 48, 63, 67, 71]
    assert counters(resumed) == counters(guard)
    assert guard._total_level_shifts > 0  # the shift was absorbed after the resume, from a ring begun before it
    assert same_detector_state(guard.detector.state_dict()["state"], resumed.detector.state_dict()["state"])
    for name, value in model.state_dict().items():  # weights and BatchNorm statistics, bitwise
        assert torch.equal(value, resumed_model.state_dict()[name]), name
    # the NaN of step 40 never entered a baseline: the saved baselines are finite
    assert torch.isfinite(saved["optimizer"]["guardtower"]["detector"]["state"]["state"]).all()


def test_a_nan_right_after_the_resume_leaves_the_loaded_baselines_untouched(tmp_path: Path) -> None:
    first_model, first = make(tmp_path)
    train(first_model, first, SAVE_AT, corrupt=incidents)
    saved = checkpoint(first_model, first)
    first.close()
    model, guard = make(tmp_path, seed=1)
    model.load_state_dict(saved["model"])
    guard.load_state_dict(saved["optimizer"])
    loaded = guard.detector.state_dict()["state"]["state"].clone()
    train(model, guard, 1, start=SAVE_AT, corrupt=incidents)  # step 41: NaN
    assert guard.total_skips == saved["optimizer"]["guardtower"]["total_skips"] + 1
    assert torch.equal(guard.detector.state_dict()["state"]["state"], loaded)


def test_rollback_runs_resume_exactly_from_a_checkpoint_at_a_snapshot_step(tmp_path: Path) -> None:
    """Saved at a multiple of ``rollback_every``: repeated rollbacks before and after the save lower the lr
    (``on_repeat="lower_lr"``) at the same steps, to the same snapshots, with the same weights."""

    def spikes(i: int, model: nn.Module) -> None:
        if i in (42, 45, 52, 54):  # twice to the snapshot of 40, twice to that of 50
            model.inp.weight.grad.mul_(1e4)

    full, after, (model, guard), (resumed_model, resumed), saved = run_both(
        tmp_path, 50, 70, spikes, nan_action="rollback", rollback_every=10, keep=2, on_repeat="lower_lr")
    expected = decisions(full, 50)
    assert decisions(after, 50) == expected
    assert [(d[1], d[2]) for d in expected if d[0] == "rollback"] == [(53, 50), (55, 50)]
    assert [(d[1], d[4]) for d in expected if d[0] == "lr_backoff"] == [(55, "0.25")]  # 0.5 came before the save
    assert saved["optimizer"]["guardtower"]["on_repeat"]["scale"] == 0.5
    assert counters(resumed) == counters(guard)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), resumed_model.parameters()))
    # the snapshot cadence goes on at multiples of rollback_every
    assert resumed._snapshots is not None and [s.step for s in resumed._snapshots.snapshots] == [60, 70]


def test_a_checkpoint_between_snapshots_rolls_back_to_its_own_state(tmp_path: Path) -> None:
    """Snapshots are not in the state dict: between the checkpoint and the next periodic snapshot, the resumed
    guard's snapshot is the checkpoint's weights and optimizer state (clean: only accepted steps reached
    them), taken at the first resumed step (BatchNorm statistics then already hold that step's batch)."""
    model, guard = make(tmp_path, nan_action="rollback", rollback_every=10, keep=2)
    train(model, guard, 45)
    saved = checkpoint(model, guard)
    guard.close()
    resumed_model, resumed = make(tmp_path, seed=1, nan_action="rollback", rollback_every=10, keep=2)
    resumed_model.load_state_dict(saved["model"])
    resumed.load_state_dict(saved["optimizer"])
    at_save = {k: v.detach().clone() for k, v in resumed_model.named_parameters()}
    with capture_events() as events:
        train(resumed_model, resumed, 3, start=45, corrupt=lambda i, m: m.inp.weight.grad.mul_(1e4) if i == 47 else None)
    rollback = next(e for e in events if isinstance(e, RollbackEvent))
    assert (rollback.from_step, rollback.to_step) == (48, 45)
    assert all(torch.equal(v, dict(resumed_model.named_parameters())[k]) for k, v in at_save.items())


def test_an_old_checkpoint_without_the_new_sections_still_loads(tmp_path: Path) -> None:
    model, guard = make(tmp_path)
    train(model, guard, 12)
    saved = guard.state_dict()
    for key in ("skip_budget", "on_repeat", "total_level_shifts", "world_size"):
        del saved["guardtower"][key]
    other_model, other = make(tmp_path, seed=1)
    other.load_state_dict(saved)
    assert other.step_count == 12 and other._repeats.scale == 1.0


def test_guard_state_loads_into_a_guard_with_another_skip_budget(tmp_path: Path) -> None:
    from guardtower.guard import SkipBudget

    model, guard = make(tmp_path)
    train(model, guard, 12, corrupt=lambda i, m: m.inp.weight.grad.fill_(float("nan")) if i in (3, 5) else None)
    _, other = make(tmp_path, skip_budget=SkipBudget(share=0.1, window=20))
    other.load_state_dict(guard.state_dict())
    assert [s for s, _ in other._budget._recent] == [4, 6]
    _, off = make(tmp_path, skip_budget=False)
    off.load_state_dict(guard.state_dict())
    assert off._budget is None and off.step_count == 12

