"""GuardedOptimizer mechanics: warmup 0, the loss signal, clip, BatchNorm protection, current counters,
dtypes, side-effect-free construction, validated state loading, start/summary events, the flat hot path."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from bench.overhead import added_ops
from guardtower._readback import Fence, host_copy
from guardtower.errors import ConfigError
from guardtower.events import SkipEvent, SpikeEvent, StartEvent, SummaryEvent, event_from_record
from guardtower.guard import GuardedOptimizer
from guardtower.sinks import JsonlSink
from guardtower.testing import InMemorySink, capture_events
from tests._guard_helpers import (OPTIMIZERS, SyncCounter, TinyNet, backward, full_state, explain, make,
                                  same_detector_state, same_state, scale_grad, train)


# ---------------------------------------------------------------- warmup_steps=0 and overfit-one-batch
def test_warmup_zero_seeds_on_the_first_step_and_trains(tmp_path: Path) -> None:
    model, guard = make(tmp_path, warmup_steps=0)
    before = full_state(model, guard)
    train(model, guard, 5)
    assert guard.total_spikes == 0 and guard.step_count == 5
    assert not same_state(before, full_state(model, guard))  # every step was applied


@pytest.mark.parametrize("opt", ["adamw_foreach", "sgd_momentum"])
def test_warmup_zero_rejects_nan_on_the_first_step(tmp_path: Path, opt: str) -> None:
    model, guard = make(tmp_path, opt, warmup_steps=0)
    guard.zero_grad()
    backward(model, 0)
    model.inp.weight.grad[0, 0] = float("nan")
    before = full_state(model, guard)
    guard.step()
    assert same_state(before, full_state(model, guard))
    assert (guard.total_spikes, guard.total_skips) == (1, 1)


def test_overfit_one_batch_never_deadlocks(tmp_path: Path) -> None:
    """The same batch every step, and from step 30 on the same, much larger, gradient: rejected a few times
    at most, then absorbed as the new level; the run is never stopped and keeps learning."""
    torch.manual_seed(0)
    model = TinyNet()
    guard = GuardedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True), model,
                             warmup_steps=0, verbose=False, log_dir=tmp_path)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 8, generator=gen), torch.randn(32, 1, generator=gen)
    losses = []
    for step in range(120):
        guard.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        (loss * (50.0 if step >= 30 else 1.0)).backward()
        guard.step(loss=loss.detach())
        losses.append(float(loss.detach()))
    guard.close()
    assert guard.total_skips <= 20
    assert guard.consecutive_rejections == 0
    assert losses[-1] < 0.5 * losses[0]


# ---------------------------------------------------------------- the loss as a signal
def test_a_loss_spike_alone_rejects_the_step(tmp_path: Path) -> None:
    model, guard = make(tmp_path)
    train(model, guard, 30)
    guard.zero_grad()
    loss = backward(model, 30)
    before = full_state(model, guard)
    with capture_events() as events:
        guard.step(loss=loss * 1e4)  # a corrupted batch: the gradients look normal, the loss does not
        guard.flush()
    assert same_state(before, full_state(model, guard))
    spike = next(e for e in events if isinstance(e, SpikeEvent))
    assert spike.layer == "loss" and spike.loss == pytest.approx(float(loss) * 1e4, rel=1e-5)


@pytest.mark.parametrize("loss_kind", ["tensor", "float"])
def test_the_loss_reaches_the_detector_on_the_device(tmp_path: Path, loss_kind: str) -> None:
    model, guard = make(tmp_path)
    seen: list[torch.Tensor] = []
    judge = guard.detector.judge

    def spy(norms: torch.Tensor, global_norm: torch.Tensor, loss: torch.Tensor) -> Any:
        seen.append(loss)
        return judge(norms, global_norm, loss)

    guard.detector.judge = spy  # type: ignore[method-assign]
    guard.zero_grad()
    loss = backward(model, 0)
    guard.step(loss=loss if loss_kind == "tensor" else float(loss))
    guard.zero_grad()
    backward(model, 1)
    guard.step()
    assert seen[0].dtype == torch.float32 and seen[0].dim() == 0 and seen[0].device == guard._device
    assert float(seen[0]) == pytest.approx(float(loss))
    assert float(seen[1]) == guard.detector.absent_loss  # no loss given


def test_observe_loss_is_used_by_the_next_step_only(tmp_path: Path) -> None:
    model, guard = make(tmp_path, log_every=1)
    guard.zero_grad()
    backward(model, 0)
    guard.observe_loss(torch.tensor(3.5))
    with capture_events() as events:
        guard.step()
        train(model, guard, 1, start=1)  # train() passes its own loss
        guard.zero_grad()
        backward(model, 2)
        guard.step()
        guard.flush()
    losses = [e.loss for e in events if isinstance(e, SummaryEvent)]
    assert losses[0] == 3.5 and losses[1] is not None and losses[2] is None


# ---------------------------------------------------------------- nan_action="clip"
@pytest.mark.parametrize("clip", ["global", "per_tensor"])
@pytest.mark.parametrize("opt", ["adamw_fused", "sgd_momentum"])
def test_clip_scales_a_finite_spike_to_the_limit_and_applies_it(tmp_path: Path, clip: str, opt: str) -> None:
    model, guard = make(tmp_path, opt, nan_action="clip", clip=clip)
    train(model, guard, 30)
    guard.zero_grad()
    backward(model, 30)
    scale_grad("inp.weight", 1e4)(model)
    norms = guard._meter.norms(guard._params)
    verdict = guard.detector.judge(norms, torch.linalg.vector_norm(norms), guard._absent_loss)
    limit = float(guard.detector.limits()[0][0])
    assert explain(guard.detector, verdict, norms).tripped[0] and float(norms[0]) > limit
    before = full_state(model, guard)
    with capture_events() as events:
        guard.step()
        guard.flush()
    assert not same_state(before, full_state(model, guard))  # applied
    assert float(model.inp.weight.grad.norm()) <= limit * 1.001
    assert (guard.total_spikes, guard.total_clips, guard.total_skips) == (1, 1, 0)
    spike = next(e for e in events if isinstance(e, SpikeEvent))
    assert spike.action == "clip" and spike.layer == "inp.weight"
    assert not any(isinstance(e, SkipEvent) for e in events)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_global_clip_keeps_the_direction_per_tensor_clip_only_the_offender(tmp_path: Path) -> None:
    grads = {}
    for clip in ("global", "per_tensor"):
        model, guard = make(tmp_path / clip, nan_action="clip", clip=clip)
        train(model, guard, 30)
        guard.zero_grad()
        backward(model, 30)
        scale_grad("inp.weight", 1e4)(model)
        original = {n: p.grad.clone() for n, p in model.named_parameters()}
        guard.step()
        grads[clip] = {n: (p.grad / original[n])[original[n] != 0] for n, p in model.named_parameters()}
    ratios = torch.cat([r.flatten() for r in grads["global"].values()])
    assert torch.allclose(ratios, ratios[0].expand_as(ratios), rtol=1e-3) and float(ratios[0]) < 1e-2
    # per tensor: the offender is scaled to its own limit first, the rest only by the common global factor
    others = torch.cat([r.flatten() for n, r in grads["per_tensor"].items() if n != "inp.weight"])
    assert torch.allclose(others, others[0].expand_as(others), rtol=1e-3)
    assert float(grads["per_tensor"]["inp.weight"].flatten()[0]) < 0.1 * float(others[0])


@pytest.mark.parametrize("case", ["nan", "loss_only"])
def test_clip_skips_nonfinite_and_loss_only_spikes(tmp_path: Path, case: str) -> None:
    model, guard = make(tmp_path, nan_action="clip")
    train(model, guard, 30)
    guard.zero_grad()
    loss = backward(model, 30)
    if case == "nan":
        model.out.bias.grad[0] = float("nan")
    before = full_state(model, guard)
    guard.step(loss=loss * 1e4 if case == "loss_only" else loss)
    assert same_state(before, full_state(model, guard))
    assert (guard.total_clips, guard.total_skips) == (0, 1)


def test_clip_costs_no_host_sync_with_a_fused_optimizer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, guard = make(tmp_path, nan_action="clip", log_every=1000)
    train(model, guard, 12)
    counter = SyncCounter(monkeypatch)
    for i in range(12, 16):
        guard.zero_grad()
        loss = backward(model, i)
        if i == 14:
            scale_grad("inp.weight", 1e4)(model)
        counter.active = True
        guard.step(loss=loss)
        counter.active = False
        guard.flush()  # builds the events on the host, outside the counted step
    assert counter.calls == 0
    assert guard.total_clips == 1


# ---------------------------------------------------------------- BatchNorm protection
@pytest.mark.parametrize("opt", ["adamw_fused", "sgd_momentum"])
@pytest.mark.parametrize("action", ["skip", "clip"])
def test_a_skipped_step_leaves_batchnorm_statistics_as_before_its_forward(tmp_path: Path, opt: str,
                                                                          action: str) -> None:
    model, guard = make(tmp_path, opt, nan_action=action)
    train(model, guard, 12)
    stats = {k: v.clone() for k, v in model.norm.state_dict().items()}
    guard.zero_grad()
    x = torch.randn(32, 8)
    x[3] = float("nan")  # one bad sample: the forward pass poisons the running statistics
    ((model(x) - 1.0) ** 2).mean().backward()
    assert not torch.isfinite(model.norm.running_mean).all()
    guard.step()
    assert guard.total_skips == 1
    for key, value in model.norm.state_dict().items():
        assert torch.equal(value, stats[key]), key
    train(model, guard, 1, start=13)  # an accepted step updates them again
    assert not torch.equal(model.norm.running_mean, stats["running_mean"])
    assert int(model.norm.num_batches_tracked) == int(stats["num_batches_tracked"]) + 1
    model.eval()
    assert torch.isfinite(model(torch.randn(4, 8))).all()


# ---------------------------------------------------------------- counters
@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_counters_reflect_the_last_step_at_once_on_cpu(tmp_path: Path, opt: str) -> None:
    model, guard = make(tmp_path, opt)
    train(model, guard, 12)
    guard.zero_grad()
    backward(model, 12)
    scale_grad("inp.weight", 1e4)(model)
    guard.step()
    assert (guard.step_count, guard.total_spikes, guard.total_skips, guard.total_rollbacks) == (13, 1, 1, 0)


# ---------------------------------------------------------------- dtypes and devices
@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128])
def test_every_parameter_dtype_is_measured_and_guarded(tmp_path: Path, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(16, 4).to(dtype))
    bias = nn.Parameter(torch.zeros(4, dtype=torch.float32))
    guard = GuardedOptimizer(torch.optim.SGD([weight, bias], lr=1e-3), verbose=False, log_dir=tmp_path)
    for step in range(15):
        guard.zero_grad()
        weight.grad = torch.full_like(weight, 0.5)
        bias.grad = torch.full_like(bias, 0.1)
        if step == 14:
            weight.grad.mul_(1e4)
        norms = guard._meter.norms(guard._params)
        assert norms.dtype == torch.float32
        expected = torch.linalg.vector_norm(weight.grad.to(torch.complex128 if dtype.is_complex else torch.float64))
        assert float(norms[0]) == pytest.approx(float(expected.real if expected.is_complex() else expected), rel=1e-3)
        guard.step()
    assert (guard.total_spikes, guard.total_skips) == (1, 1)


def test_meta_device_parameters_are_refused_at_construction(tmp_path: Path) -> None:
    with torch.device("meta"):
        model = nn.Linear(4, 4)
    with pytest.raises(ConfigError, match="meta device") as info:
        GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, log_dir=tmp_path)
    assert info.value.argument == "base_optimizer" and "to_empty" in str(info.value)


# ---------------------------------------------------------------- no side effects before the first step
def test_construction_creates_no_directory_thread_or_sink(tmp_path: Path) -> None:
    log_dir = tmp_path / "not" / "yet"
    sink = InMemorySink()
    threads = {t.ident for t in threading.enumerate()}
    model = TinyNet()
    guard = GuardedOptimizer(torch.optim.AdamW(model.parameters(), fused=True), model, log_dir=log_dir,
                             sinks=[sink], verbose=True)
    assert not (tmp_path / "not").exists()
    assert {t.ident for t in threading.enumerate()} == threads
    assert guard.bus.sinks == []
    train(model, guard, 1)
    assert sink in guard.bus.sinks
    assert not log_dir.exists()  # created with the first spike report only
    train(model, guard, 12, start=1, corrupt=lambda i, m: scale_grad("inp.weight", 1e4)(m) if i == 12 else None)
    guard.flush()
    assert len(list(log_dir.glob("spike_step*.json"))) == 1
    guard.close()


def test_stability_guard_callback_construction_has_no_side_effect(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from guardtower.integrations.huggingface import StabilityGuardCallback

    monkeypatch.chdir(tmp_path)
    threads = {t.ident for t in threading.enumerate()}
    StabilityGuardCallback(spike_threshold=5.0, sinks=[InMemorySink()])
    assert list(tmp_path.iterdir()) == []
    assert {t.ident for t in threading.enumerate()} == threads
    with pytest.raises(ConfigError) as info:
        StabilityGuardCallback(spike_threshold=-1.0)
    assert info.value.argument == "spike_threshold"


def test_log_dir_below_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError) as info:
        make(tmp_path, log_dir=tmp_path / "file" / "logs")
    assert info.value.argument == "log_dir" and "not a directory" in str(info.value)


# ---------------------------------------------------------------- start and summary events
def test_a_clean_run_leaves_start_and_summary_in_the_events_file(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    model, guard = make(tmp_path, sinks=[JsonlSink(path)])
    train(model, guard, 20)
    assert not path.exists() or path.read_text() == "" or "start" in path.read_text()
    guard.close()
    events = [event_from_record(json.loads(line)) for line in path.read_text().splitlines()]
    assert [type(e) for e in events] == [StartEvent, SummaryEvent]
    start, summary = events
    assert (start.step, start.optimizer, start.nan_action, start.tensors) == (0, "AdamW", "skip", 6)
    assert start.device_decides and start.detector == guard.detector.name
    assert start.parameters == sum(p.numel() for p in model.parameters())
    assert (summary.step, summary.total_spikes) == (20, 0)


def test_close_adds_no_second_summary_for_a_step_that_had_one(tmp_path: Path) -> None:
    with capture_events() as events:
        model, guard = make(tmp_path, log_every=10)
        train(model, guard, 20)
        guard.close()
    assert [e.step for e in events if isinstance(e, SummaryEvent)] == [10, 20]


def test_close_before_any_step_publishes_nothing(tmp_path: Path) -> None:
    with capture_events() as events:
        _, guard = make(tmp_path)
        guard.close()
    assert events == []


# ---------------------------------------------------------------- load_state_dict validates first
def _broken(state: dict[str, Any], how: str) -> dict[str, Any]:
    guard = dict(state["guardtower"])
    if how == "truncated":
        guard.pop("total_skips")
    elif how == "detector_truncated":
        detector = dict(guard["detector"])
        detector["state"] = dict(list(detector["state"].items())[:-1])
        guard["detector"] = detector
    elif how == "wrong_type":
        guard["step_count"] = "12"
    elif how == "wrong_shape":
        detector = dict(guard["detector"])
        key = next(iter(detector["state"]))
        detector["state"] = {**detector["state"], key: torch.zeros(3)}
        guard["detector"] = detector
    elif how == "not_a_dict":
        guard = [1, 2]  # type: ignore[assignment]
    return {**state, "guardtower": guard}


@pytest.mark.parametrize("how", ["truncated", "detector_truncated", "wrong_type", "wrong_shape", "not_a_dict"])
def test_a_broken_guard_section_is_refused_and_changes_nothing(tmp_path: Path, how: str) -> None:
    model, guard = make(tmp_path)
    train(model, guard, 15)
    saved = guard.state_dict()
    train(model, guard, 5, start=15)
    before = full_state(model, guard)
    detector_before = guard.detector.state_dict()
    counters = (guard.step_count, guard.total_spikes)
    with pytest.raises(ConfigError) as info:
        guard.load_state_dict(_broken(saved, how))
    assert info.value.argument == "state_dict"
    assert same_state(before, full_state(model, guard))
    after = guard.detector.state_dict()
    assert same_detector_state(detector_before["state"], after["state"])
    assert (guard.step_count, guard.total_spikes) == counters


@pytest.mark.parametrize("bad", ["state", "groups", 5])
def test_a_broken_base_section_is_refused_and_changes_nothing(tmp_path: Path, bad: Any) -> None:
    model, guard = make(tmp_path)
    train(model, guard, 3)
    saved = guard.state_dict()
    before = full_state(model, guard)
    if bad == "state":
        broken: Any = {k: v for k, v in saved.items() if k != "state"}
    elif bad == "groups":
        broken = {**saved, "param_groups": saved["param_groups"] * 2}
    else:
        broken = bad
    with pytest.raises(ConfigError) as info:
        guard.load_state_dict(broken)
    assert info.value.argument == "state_dict"
    assert same_state(before, full_state(model, guard))


# ---------------------------------------------------------------- bad arguments
@pytest.mark.parametrize(("kwargs", "argument"), [
    ({"clip": "both"}, "clip"),
    ({"nan_action": "clamp"}, "nan_action"),
    ({"log_dir": 42}, "log_dir"),
    ({"run": 7}, "run"),
    ({"sinks": [object()]}, "sinks"),
    ({"bus": "bus"}, "bus"),
])
def test_more_bad_arguments_raise_config_error_before_any_change(tmp_path: Path, kwargs: dict[str, Any],
                                                                 argument: str) -> None:
    model = TinyNet()
    base = torch.optim.AdamW(model.parameters())
    with pytest.raises(ConfigError) as info:
        GuardedOptimizer(base, model, **{"verbose": False, "log_dir": tmp_path / "logs", **kwargs})
    assert info.value.argument == argument and "Fix:" in str(info.value)
    assert not (tmp_path / "logs").exists()
    assert not hasattr(base, "found_inf")


# ---------------------------------------------------------------- the flat hot path
@pytest.mark.parametrize("clip", [None, "global", "per_tensor"])
def test_the_ops_a_guard_adds_do_not_grow_with_the_number_of_tensors(clip: str | None) -> None:
    kwargs: dict[str, Any] = {} if clip is None else {"nan_action": "clip", "clip": clip}
    small, large = added_ops(30, **kwargs), added_ops(250, **kwargs)
    assert small == large
    if clip is None:  # the default: 53 ops a step in all (44 the detector's), the guard's own share (measure,
        assert large.total <= 53 and large.mechanics <= 10  # decide, record) 9
    else:  # clipping adds the limits, the factor and one multiply per group
        assert large.mechanics <= 40


# ---------------------------------------------------------------- the readback helper
def test_host_copy_reuses_a_fitting_buffer_and_the_cpu_fence_is_done() -> None:
    src = torch.arange(4.0)
    buf = host_copy(src)
    assert torch.equal(buf, src) and buf.data_ptr() != src.data_ptr()
    again = host_copy(src * 2, buf)
    assert again is buf and torch.equal(buf, src * 2)
    assert host_copy(torch.zeros(3), buf) is not buf
    fence = Fence(torch.device("cpu"))
    assert fence.done()
    fence.wait()
