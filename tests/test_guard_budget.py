"""The skip budget (one WARN when too many recent steps were rejected) and ``on_repeat`` (what a repeated
rollback does: roll back again, halt, or lower the learning rate within a floor, then halt)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from guardtower.alerts import DEFAULT_KINDS
from guardtower.errors import ConfigError, GradientSpikeError
from guardtower.events import HaltEvent, LrBackoffEvent, RollbackEvent, SkipBudgetEvent, from_json, to_json
from guardtower.guard import GuardedOptimizer, LowerLR, SkipBudget
from guardtower.sinks import ConsoleSink, JsonlSink, read_events
from guardtower.testing import capture_events
from tests._guard_helpers import SyncCounter, backward, make, train


def nan_at(*steps: int) -> Any:
    """Corrupt the gradients of these (0-based) loop indices with NaN."""
    return lambda i, m: m.inp.weight.grad.fill_(float("nan")) if i in steps else None


def test_one_warning_when_the_share_of_rejected_steps_goes_over_the_budget(tmp_path: Path) -> None:
    out = io.StringIO()
    jsonl = tmp_path / "events.jsonl"
    # 3 of 20 allowed: the 4th rejection within 20 steps warns; 6 more in the same window stay quiet
    bad = (12, 14, 16, 18, 19, 20, 21, 22, 23)
    model, guard = make(tmp_path, skip_budget=SkipBudget(share=0.15, window=20),
                        sinks=[ConsoleSink(out, min_severity="WARN"), JsonlSink(jsonl)])
    with capture_events() as events:
        train(model, guard, 38, corrupt=nan_at(*bad))
        guard.flush()
    warnings = [e for e in events if isinstance(e, SkipBudgetEvent)]
    assert len(warnings) == 1
    w = warnings[0]
    assert (w.step, w.rejected, w.steps, w.window, w.skipped, w.clipped, w.rolled_back) == (19, 4, 19, 20, 4, 0, 0)
    assert w.severity.label == "WARN" and "4 of the last 19 steps were rejected" in w.message
    guard.close()
    # every sink renders it: the console line, the JSONL record (round trip), the alerts' default kinds
    assert "skip_budget step=19" in out.getvalue() and "rejected=4" in out.getvalue()
    assert [e for e in read_events(jsonl) if e.kind == "skip_budget"] == [w]
    assert from_json(to_json(w)) == w and "skip_budget" in DEFAULT_KINDS


def test_the_budget_warns_again_one_window_later_if_the_run_is_still_over(tmp_path: Path) -> None:
    model, guard = make(tmp_path, skip_budget=SkipBudget(share=0.1, window=10), max_consecutive_skips=None)
    with capture_events() as events:
        train(model, guard, 45, corrupt=nan_at(*range(11, 45, 2)))  # every other step from 12 on
        guard.flush()
    assert [e.step for e in events if isinstance(e, SkipBudgetEvent)] == [14, 24, 34, 44]


def test_clipped_steps_count_against_the_budget(tmp_path: Path) -> None:
    model, guard = make(tmp_path, nan_action="clip", skip_budget=SkipBudget(share=0.1, window=20))
    spikes = lambda i, m: m.inp.weight.grad.mul_(1e3) if i in (12, 15, 18) else None  # noqa: E731
    with capture_events() as events:
        train(model, guard, 20, corrupt=spikes)
        guard.flush()
    (w,) = [e for e in events if isinstance(e, SkipBudgetEvent)]
    assert (w.step, w.rejected, w.clipped, w.skipped) == (19, 3, 3, 0)


def test_no_budget_no_warning_and_the_budget_adds_no_host_sync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, guard = make(tmp_path, skip_budget=False)
    with capture_events() as events:
        train(model, guard, 30, corrupt=nan_at(*range(12, 30)))
        guard.flush()
    assert not any(isinstance(e, SkipBudgetEvent) for e in events)
    # fused AdamW, skip: the guarded step itself reads nothing back, budget or not
    counter = SyncCounter(monkeypatch)
    model, guard = make(tmp_path, skip_budget=SkipBudget(share=0.01, window=10))
    train(model, guard, 12)
    for i in range(12, 16):  # rejected steps, over budget: counted from the records, never read from the device
        guard.zero_grad()
        loss = backward(model, i)
        model.inp.weight.grad.fill_(float("nan"))
        counter.active = True
        guard.step(loss=loss)
        counter.active = False
        guard.flush()  # builds the events (and counts the budget) on the host, outside the counted step
    assert guard.total_skips == 4 and guard._budget is not None and len(guard._budget._recent) == 4
    assert counter.calls == 0


@pytest.mark.parametrize("value", [0.01, "1%", (0.01, 1000), 1])
def test_a_bad_skip_budget_is_refused_naming_the_argument(tmp_path: Path, value: Any) -> None:
    with pytest.raises(ConfigError) as info:
        make(tmp_path, skip_budget=value)
    assert info.value.argument == "skip_budget"


@pytest.mark.parametrize(("kwargs", "argument"), [({"share": 0.0}, "skip_budget.share"),
                                                  ({"share": 1.5}, "skip_budget.share"),
                                                  ({"window": 0}, "skip_budget.window"),
                                                  ({"window": 10.0}, "skip_budget.window")])
def test_skip_budget_options_are_validated(kwargs: dict[str, Any], argument: str) -> None:
    with pytest.raises(ConfigError) as info:
        SkipBudget(**kwargs)
    assert info.value.argument == argument


# ---------------------------------------------------------------------------------- on_repeat

def repeated_spikes(*steps: int) -> Any:
    return lambda i, m: m.inp.weight.grad.mul_(1e4) if i in steps else None


def test_lower_lr_backs_off_on_each_repeated_rollback_then_halts_at_the_floor(tmp_path: Path) -> None:
    model, guard = make(tmp_path, nan_action="rollback", rollback_every=10, on_repeat=LowerLR(factor=0.5, floor=0.2))
    lr = guard.param_groups[0]["lr"]
    seen: list[float] = []
    guard.base_optimizer.register_step_pre_hook(lambda opt, a, k: seen.append(opt.param_groups[0]["lr"]))
    with capture_events() as events:
        train(model, guard, 12)
        train(model, guard, 6, start=12, corrupt=repeated_spikes(13, 15))  # both return to the snapshot of 10
        with pytest.raises(GradientSpikeError):
            train(model, guard, 6, start=18, corrupt=repeated_spikes(19, 21))
    backoffs = [e for e in events if isinstance(e, LrBackoffEvent)]
    assert [(e.step, e.scale, e.repeats, e.to_step) for e in backoffs] == [(16, 0.5, 2, 10), (20, 0.25, 3, 10)]
    assert backoffs[0].lr == pytest.approx(lr * 0.5) and backoffs[0].severity.label == "WARN"
    assert [e.to_step for e in events if isinstance(e, RollbackEvent)] == [10, 10, 10, 10]
    halt = next(e for e in events if isinstance(e, HaltEvent))
    assert halt.step == 22 and "4 rollbacks in a row to the snapshot of step 10" in halt.message
    # the optimizer stepped with the lowered lr; the param group (what schedulers and logs see) kept its own
    assert seen[-1] == pytest.approx(lr * 0.25) and guard.param_groups[0]["lr"] == lr
    assert "lr_backoff" in DEFAULT_KINDS


def test_on_repeat_raise_halts_on_the_first_repeat_and_rollback_goes_on(tmp_path: Path) -> None:
    model, guard = make(tmp_path, nan_action="rollback", rollback_every=10, on_repeat="raise")
    train(model, guard, 12)
    with pytest.raises(GradientSpikeError):
        train(model, guard, 6, start=12, corrupt=repeated_spikes(13, 15))
    assert guard.total_rollbacks == 2
    model, guard = make(tmp_path, nan_action="rollback", rollback_every=10)  # the default: roll back again
    train(model, guard, 18, corrupt=repeated_spikes(13, 15, 17))
    assert guard.total_rollbacks == 3 and guard._repeats.scale == 1.0


def test_a_new_snapshot_resets_the_repeats_but_keeps_the_lowered_lr(tmp_path: Path) -> None:
    model, guard = make(tmp_path, nan_action="rollback", rollback_every=10, on_repeat="lower_lr")
    with capture_events() as events:
        train(model, guard, 30, corrupt=repeated_spikes(13, 15, 24))
    assert [e.step for e in events if isinstance(e, LrBackoffEvent)] == [16]
    assert guard._repeats.scale == 0.5 and guard._repeats.repeats == 0


@pytest.mark.parametrize(("kwargs", "argument"), [
    ({"on_repeat": "lower"}, "on_repeat"),
    ({"on_repeat": "lower_lr"}, "on_repeat"),  # nan_action="skip" never rolls back
    ({"on_repeat": LowerLR(), "nan_action": "raise"}, "on_repeat"),
])
def test_a_bad_on_repeat_is_refused(tmp_path: Path, kwargs: dict[str, Any], argument: str) -> None:
    with pytest.raises(ConfigError) as info:
        make(tmp_path, **kwargs)
    assert info.value.argument == argument


@pytest.mark.parametrize(("kwargs", "argument"), [({"factor": 1.0}, "on_repeat.factor"),
                                                  ({"factor": 0}, "on_repeat.factor"),
                                                  ({"floor": -0.1}, "on_repeat.floor"),
                                                  ({"factor": 0.5, "floor": 0.6}, "on_repeat.floor"),
                                                  ({"factor": True}, "on_repeat.factor")])
def test_lower_lr_options_are_validated(kwargs: dict[str, Any], argument: str) -> None:
    with pytest.raises(ConfigError) as info:
        LowerLR(**kwargs)
    assert info.value.argument == argument


def test_escalation_to_rollback_counts_repeats_too(tmp_path: Path) -> None:
    model, guard = make(tmp_path, max_consecutive_skips=1, escalate_to="rollback", rollback_every=10,
                        on_repeat="lower_lr")
    with capture_events() as events:
        train(model, guard, 20, corrupt=nan_at(12, 13, 15, 16))  # two skips in a row escalate, twice
    assert [e.to_step for e in events if isinstance(e, RollbackEvent)] == [10, 10]
    assert [e.scale for e in events if isinstance(e, LrBackoffEvent)] == [0.5]


def test_a_bad_guard_state_section_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    model, guard = make(tmp_path, nan_action="rollback", on_repeat="lower_lr")
    train(model, guard, 12)
    saved = guard.state_dict()
    for key, bad in (("skip_budget", {"steps": [1], "actions": []}), ("on_repeat", {"scale": 2.0})):
        broken = json.loads(json.dumps({k: v for k, v in saved["guardtower"].items() if k != "detector"}))
        broken[key] = bad
        broken["detector"] = saved["guardtower"]["detector"]
        with pytest.raises(ConfigError) as info:
            guard.load_state_dict({**saved, "guardtower": broken})
        assert info.value.argument == "state_dict"
    assert guard.step_count == 12 and guard._repeats.scale == 1.0


def test_state_dict_is_loadable_with_weights_only(tmp_path: Path) -> None:
    model, guard = make(tmp_path, nan_action="rollback", on_repeat="lower_lr")
    train(model, guard, 14, corrupt=nan_at(12))
    buf = io.BytesIO()
    torch.save(guard.state_dict(), buf)
    buf.seek(0)
    _, other = make(tmp_path, nan_action="rollback", on_repeat="lower_lr")
    other.load_state_dict(torch.load(buf, weights_only=True))
    assert other.total_rollbacks == 1 and isinstance(other, GuardedOptimizer)
