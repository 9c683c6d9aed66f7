"""GuardedOptimizer core: detection, skip/raise, reports, events, counters, bad input."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from guardtower.bus import EventBus
from guardtower.errors import ConfigError, GradientSpikeError
from guardtower.events import HaltEvent, SkipEvent, SpikeEvent, SummaryEvent
from guardtower.guard import GuardedOptimizer, RatioDetector, read_report
from guardtower.testing import InMemorySink, capture_events
from tests._guard_helpers import (OPTIMIZERS, SyncCounter, TinyNet, backward, full_state, make, same_detector_state, same_state, scale_grad,
                                  train)


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_skipped_spike_leaves_weights_moments_and_counters_bit_identical(tmp_path: Path, opt: str) -> None:
    model, guard = make(tmp_path, opt)
    train(model, guard, 15)
    guard.zero_grad()
    backward(model, 99)
    scale_grad("inp.weight", 1e3)(model)
    before = full_state(model, guard)
    guard.step()
    guard.flush()
    assert same_state(before, full_state(model, guard))
    assert (guard.total_spikes, guard.total_skips, guard.step_count) == (1, 1, 16)
    train(model, guard, 3, start=16)  # and training goes on normally
    assert guard.total_spikes == 1
    assert not same_state(before, full_state(model, guard))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_is_rejected_even_in_the_first_warmup_step(tmp_path: Path, bad: float) -> None:
    model, guard = make(tmp_path, "adamw_foreach", warmup_steps=10)
    guard.zero_grad()
    backward(model, 0)
    model.out.bias.grad[0] = bad
    before = full_state(model, guard)
    with capture_events() as events:
        guard.step()
        guard.flush()
    assert same_state(before, full_state(model, guard))
    spike = next(e for e in events if isinstance(e, SpikeEvent))
    assert (spike.reason, spike.layer, spike.module, spike.step) == ("nonfinite", "out.bias", "out", 1)
    assert spike.nonfinite_layers == ("out.bias",)
    assert all(math.isfinite(p.detach().sum().item()) for p in model.parameters())


def test_warmup_only_builds_baselines_then_spikes_are_rejected(tmp_path: Path) -> None:
    model, guard = make(tmp_path, warmup_steps=10)
    corrupt = {3: 100.0, 20: 100.0}
    train(model, guard, 25, corrupt=lambda i, m: scale_grad("inp.weight", corrupt[i])(m) if i in corrupt else None)
    guard.flush()
    assert guard.total_spikes == 1  # step 4 (warmup) passed, step 21 was rejected


def test_baseline_is_compared_before_update_and_never_absorbs_rejected_steps(tmp_path: Path) -> None:
    model, guard = make(tmp_path)
    train(model, guard, 30)
    baseline = {k: v.clone() for k, v in guard.detector.state_dict()["state"].items()}
    with capture_events() as events:
        train(model, guard, 1, start=30, corrupt=lambda i, m: scale_grad("out.weight", 1e4)(m))
        guard.flush()
    after = guard.detector.state_dict()["state"]
    # only the ring of recent trips (which lets a sustained shift be absorbed) may move
    assert same_detector_state(baseline, after, skip=("ring",))
    spike = next(e for e in events if isinstance(e, SpikeEvent))
    # a pre-update EMA (alpha 0.01) could never report a ratio above 1/alpha = 100
    assert spike.ratio > 1 / 0.01
    assert spike.layer == "out.weight"


def test_a_tiny_tensor_below_the_floor_cannot_trigger(tmp_path: Path) -> None:
    model, guard = make(tmp_path, norm_floor=1e-3)
    shrink = scale_grad("out.bias", 1e-7)
    train(model, guard, 20, corrupt=lambda i, m: shrink(m))
    grow = scale_grad("out.bias", 1e-5)  # 100x its own baseline, still far below 1e-3 of the global norm
    train(model, guard, 1, start=20, corrupt=lambda i, m: grow(m))
    guard.flush()
    assert guard.total_spikes == 0


def test_global_spike_of_many_moderate_layers_is_caught(tmp_path: Path) -> None:
    model, guard = make(tmp_path, spike_threshold=10.0)
    train(model, guard, 20)

    def all_up(i: int, m: torch.nn.Module) -> None:
        for p in m.parameters():  # every share stays the same: only the global norm can see this
            p.grad.mul_(30.0)

    with capture_events() as events:
        train(model, guard, 1, start=20, corrupt=all_up)
        guard.flush()
    assert guard.total_spikes == 1
    assert any(isinstance(e, SpikeEvent) and e.layer == "global" for e in events)


def test_layers_are_named_from_the_model_or_by_group_and_index(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TinyNet()
    guard = GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), None, verbose=False,
                             log_dir=tmp_path)
    train(model, guard, 12)
    with capture_events() as events:
        train(model, guard, 1, start=12, corrupt=lambda i, m: scale_grad("out.weight", 1e3)(m))
    spike = next(e for e in events if isinstance(e, SpikeEvent))
    assert spike.layer == "group0.param4"
    assert spike.module == "group0"


def test_spike_report_is_strict_json_with_the_documented_fields(tmp_path: Path) -> None:
    model, guard = make(tmp_path)
    train(model, guard, 40)
    with capture_events() as events:
        train(model, guard, 1, start=40, corrupt=lambda i, m: scale_grad("norm.weight", 500.0)(m))
        guard.flush()
    spike = next(e for e in events if isinstance(e, SpikeEvent))
    path = Path(spike.report_path or "")
    assert path.parent == (tmp_path / "logs").resolve()
    assert path.name.startswith("spike_step00000041-rank0-") and path.suffix == ".json"
    text = path.read_text()

    def refuse(token: str) -> Any:
        raise AssertionError(f"non-strict JSON token {token}")

    raw = json.loads(text, parse_constant=refuse)
    assert raw["format"] == "guardtower.spike-report/1"
    assert raw["step"] == 41 and raw["action"] == "skip" and raw["reason"] == "spike"
    assert raw["trigger"]["layer"] == "norm.weight" and raw["trigger"]["ratio"] > 10
    assert raw["trigger"]["baseline"] > 0 and raw["global_norm"] > 0
    assert raw["loss"] is not None and raw["lr"] == pytest.approx(1e-2)
    assert raw["top_layers"][0]["layer"] == "norm.weight" and len(raw["top_layers"]) == 6
    history = raw["history"]
    assert history["steps"] == list(range(10, 42))
    assert len(history["global_norm"]) == len(history["trigger_norm"]) == 32
    assert history["trigger_norm"][-1] == pytest.approx(raw["trigger"]["norm"])
    assert read_report(path)["event_id"] == spike.event_id


def test_nonfinite_report_encodes_nan_without_nan_tokens(tmp_path: Path) -> None:
    model, guard = make(tmp_path)
    train(model, guard, 5, corrupt=lambda i, m: m.inp.weight.grad.fill_(float("nan")) if i == 4 else None)
    guard.flush()
    (path,) = (tmp_path / "logs").glob("spike_step*.json")
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text
    report = read_report(path)
    assert math.isnan(report["trigger"]["norm"]) and report["nonfinite_layers"] == ["inp.weight"]


def test_report_names_never_collide_for_the_same_step(tmp_path: Path) -> None:
    for _ in range(2):  # a resumed run repeats step numbers
        model, guard = make(tmp_path)
        train(model, guard, 5, corrupt=lambda i, m: m.inp.weight.grad.fill_(float("inf")) if i == 2 else None)
        guard.close()
    assert len(list((tmp_path / "logs").glob("spike_step00000003-rank0-*.json"))) == 2


def test_raise_stops_before_the_update_and_publishes_a_halt(tmp_path: Path) -> None:
    model, guard = make(tmp_path, nan_action="raise")
    train(model, guard, 12)
    guard.zero_grad()
    backward(model, 12)
    scale_grad("out.weight", 1e3)(model)
    before = full_state(model, guard)
    with capture_events() as events, pytest.raises(GradientSpikeError) as info:
        guard.step()
    assert (info.value.step, info.value.layer) == (13, "out.weight")
    assert info.value.ratio > 10
    assert same_state(before, full_state(model, guard))
    kinds = [e.kind for e in events]
    assert kinds.index("spike") < kinds.index("halt")
    halt = next(e for e in events if isinstance(e, HaltEvent))
    assert halt.layer == "out.weight" and "step 13" in halt.message
    assert list((tmp_path / "logs").glob("spike_step00000013-*.json"))  # written before the raise returned


def test_summary_every_log_every_steps_with_loss_and_counters(tmp_path: Path) -> None:
    model, guard = make(tmp_path, log_every=5)
    with capture_events() as events:
        train(model, guard, 12, corrupt=lambda i, m: m.inp.bias.grad.fill_(float("nan")) if i == 7 else None)
        guard.flush()
    summaries = [e for e in events if isinstance(e, SummaryEvent)]
    assert [s.step for s in summaries] == [5, 10]
    assert summaries[1].total_spikes == 1 and summaries[1].total_skips == 1
    assert summaries[0].loss is not None and summaries[0].grad_norm > 0
    assert summaries[0].lr == pytest.approx(1e-2)


def test_events_reach_the_bus_within_two_steps_with_a_fused_optimizer(tmp_path: Path) -> None:
    model, guard = make(tmp_path, "adamw_fused")
    train(model, guard, 15)
    with capture_events() as events:
        train(model, guard, 1, start=15, corrupt=lambda i, m: scale_grad("inp.weight", 1e3)(m))
        train(model, guard, 2, start=16)
    assert any(isinstance(e, SpikeEvent) and e.step == 16 for e in events)


@pytest.mark.parametrize(("opt", "expected"), [("adamw_fused", 0), ("sgd_fused", 0), ("adamw_foreach", 1),
                                               ("sgd_momentum", 1)])
def test_host_reads_per_step_zero_for_fused_one_otherwise(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          opt: str, expected: int) -> None:
    model, guard = make(tmp_path, opt, log_every=1000)
    train(model, guard, 12)
    counter = SyncCounter(monkeypatch)
    base_step = guard.base_optimizer.step

    def uncounted_base_step(*args: Any, **kwargs: Any) -> Any:  # the base optimizer's own reads are not ours
        counter.active = False
        try:
            return base_step(*args, **kwargs)
        finally:
            counter.active = True

    monkeypatch.setattr(guard.base_optimizer, "step", uncounted_base_step)
    for i in range(12, 20):
        guard.zero_grad()
        loss = backward(model, i)
        counter.active = True
        guard.step(loss=loss)
        counter.active = False
    assert counter.calls == expected * 8


def test_counters_and_user_bus_and_close(tmp_path: Path) -> None:
    sink = InMemorySink()
    bus = EventBus([sink])
    model, guard = make(tmp_path, bus=bus)
    train(model, guard, 20, corrupt=lambda i, m: m.out.bias.grad.fill_(float("inf")) if i in (5, 15) else None)
    guard.close()
    assert (guard.step_count, guard.total_spikes, guard.total_skips, guard.total_rollbacks) == (20, 2, 2, 0)
    assert [e.step for e in sink.events if isinstance(e, SkipEvent)] == [6, 16]
    assert not bus.stats()["closed"]  # not ours to close
    guard.close()  # idempotent
    before = model.out.weight.detach().clone()
    train(model, guard, 1, start=20, corrupt=lambda i, m: m.out.weight.grad.fill_(float("nan")))
    assert torch.isnan(model.out.weight).all() and not torch.isnan(before).any()  # closed: unguarded pass-through
    bus.close()


def test_owned_bus_is_closed_by_close(tmp_path: Path) -> None:
    model, guard = make(tmp_path)
    train(model, guard, 2)
    guard.close()
    assert guard.bus.stats()["closed"]


def test_loss_may_be_a_float(tmp_path: Path) -> None:
    model, guard = make(tmp_path)
    train(model, guard, 3)
    guard.zero_grad()
    backward(model, 3)
    model.inp.weight.grad.fill_(float("nan"))
    with capture_events() as events:
        guard.step(loss=1.25)
        guard.flush()
    assert next(e for e in events if isinstance(e, SpikeEvent)).loss == 1.25


def test_repr_names_the_wrapped_optimizer(tmp_path: Path) -> None:
    _, guard = make(tmp_path, "sgd_momentum")
    assert "GuardedOptimizer" in repr(guard) and "SGD" in repr(guard)


def test_a_custom_detector_instance_is_used(tmp_path: Path) -> None:
    detector = RatioDetector(threshold=3.0, warmup_steps=2)
    model, guard = make(tmp_path, detector=detector)
    assert guard.detector is detector
    train(model, guard, 6, corrupt=lambda i, m: scale_grad("inp.weight", 5.0)(m) if i == 5 else None)
    guard.flush()
    assert guard.total_spikes == 1


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"nan_action": "ignore"}, "nan_action"),
        ({"spike_threshold": 0}, "spike_threshold"),
        ({"spike_threshold": -1.0}, "spike_threshold"),
        ({"spike_threshold": float("nan")}, "spike_threshold"),
        ({"ema_alpha": 0.0}, "ema_alpha"),
        ({"ema_alpha": 1.0}, "ema_alpha"),
        ({"ema_alpha": 1.5}, "ema_alpha"),
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"log_every": 0}, "log_every"),
        ({"max_consecutive_skips": 0}, "max_consecutive_skips"),
        ({"escalate_to": "skip"}, "escalate_to"),
        ({"rollback_every": 0}, "rollback_every"),
        ({"keep": 0}, "keep"),
        ({"detector": "magic"}, "detector"),
        ({"norm_floor": 2.0}, "norm_floor"),
        ({"on_rollback": 3}, "on_rollback"),
    ],
)
def test_bad_arguments_raise_config_error_naming_the_argument(tmp_path: Path, kwargs: dict[str, Any],
                                                              argument: str) -> None:
    model = TinyNet()
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError) as info:
        GuardedOptimizer(base, model, log_dir=tmp_path / "never", verbose=False, **kwargs)
    assert info.value.argument == argument
    assert argument in str(info.value) and "Fix:" in str(info.value)
    assert not (tmp_path / "never").exists()  # nothing created


def test_model_whose_parameters_are_not_in_the_optimizer_is_refused(tmp_path: Path) -> None:
    base = torch.optim.SGD(TinyNet().parameters(), lr=0.1)
    with pytest.raises(ConfigError) as info:
        GuardedOptimizer(base, TinyNet(), log_dir=tmp_path, verbose=False)
    assert info.value.argument == "model"


def test_unwritable_log_dir_is_refused(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    model = TinyNet()
    with pytest.raises(ConfigError) as info:
        GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, log_dir=blocker / "logs", verbose=False)
    assert info.value.argument == "log_dir"


def test_base_must_be_an_optimizer(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        GuardedOptimizer(object(), log_dir=tmp_path, verbose=False)  # type: ignore[arg-type]
    assert info.value.argument == "base_optimizer"


def test_reports_and_console_box_are_produced_off_the_training_thread(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import threading

    from guardtower.guard import reports

    writers: list[str] = []
    original = reports.write_json_atomic

    def spy(path: Path, data: Any) -> None:
        writers.append(threading.current_thread().name)
        original(path, data)

    monkeypatch.setattr(reports, "write_json_atomic", spy)
    model, guard = make(tmp_path, verbose=True)
    train(model, guard, 15, corrupt=lambda i, m: scale_grad("out.weight", 1e3)(m) if i == 12 else None)
    guard.close()
    assert writers and all(name != threading.main_thread().name for name in writers)
    err = capsys.readouterr().err
    assert "guardtower: gradient spike" in err and "trigger layer: out.weight" in err and "action: SKIP" in err
