"""TensorBoardBridge: events written by a real SummaryWriter, read back with TensorBoard's own reader."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from _bridges_helpers import failing_report, preflight_event, rollback_event, skip_event, spike_event, summary_event
from guardtower.bus import EventBus
from guardtower.errors import ConfigError
from guardtower.events import Event, HaltEvent, SpikeEvent, StallEvent

P = "guardtower"


def read_back(log_dir: Path) -> Any:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def scalars(acc: Any, tag: str) -> list[tuple[int, float]]:
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def texts(acc: Any, tag: str) -> list[tuple[int, str]]:
    return [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(f"{tag}/text_summary")]


def publish(bridge: Any, events: list[Event]) -> None:
    bus = EventBus([bridge])
    for event in events:
        bus.publish(event)
    bus.close(10)


def test_metrics_are_scalars_at_the_training_step(tmp_path: Path) -> None:
    from guardtower.bridges import TensorBoardBridge

    bridge = TensorBoardBridge(log_dir=tmp_path / "tb")
    publish(bridge, [summary_event(50, grad_norm=1.5), spike_event(60, ratio=42.0), skip_event(60, total=1),
                     rollback_event(70, total=1)])
    acc = read_back(tmp_path / "tb")
    assert scalars(acc, f"{P}/grad_norm") == [(50, 1.5), (60, 11.25)]
    assert scalars(acc, f"{P}/spike_ratio") == [(60, 42.0)]
    assert scalars(acc, f"{P}/loss_at_spike") == [(60, 3.5)]
    assert scalars(acc, f"{P}/skipped_steps")[-1] == (60, 1.0)
    assert scalars(acc, f"{P}/rollbacks")[-1] == (70, 1.0)
    assert scalars(acc, f"{P}/spikes")[-1] == (60, 1.0)
    assert bridge.stats() == {"delivered": 4, "failed": 0}


def test_incidents_and_the_preflight_report_are_text(tmp_path: Path) -> None:
    from guardtower.bridges import TensorBoardBridge

    bridge = TensorBoardBridge(log_dir=tmp_path / "tb")
    halt = HaltEvent(step=80, layer="fc1.weight", reason="nonfinite", message="gradient nonfinite at step 80")
    publish(bridge, [preflight_event(failing_report()), spike_event(60), halt])
    acc = read_back(tmp_path / "tb")
    (step, report), = texts(acc, f"{P}/preflight")
    assert step == 0 and "Pre-flight FAIL" in report and "| optimizer_coverage | FAIL | OPT-001 |" in report
    incidents = texts(acc, f"{P}/incidents")
    assert [s for s, _ in incidents] == [60, 80]
    assert "kind=spike step=60 layer=h.0.mlp.c_fc.weight" in incidents[0][1] and "ratio 42" in incidents[0][1]
    assert "training halted: gradient nonfinite at step 80" in incidents[1][1]
    assert scalars(acc, f"{P}/preflight_errors") == [(0, 2.0)]


def test_non_finite_values_never_become_scalars(tmp_path: Path) -> None:
    from guardtower.bridges import TensorBoardBridge

    bridge = TensorBoardBridge(log_dir=tmp_path / "tb")
    nan_spike = SpikeEvent(step=9, layer="fc.weight", reason="nonfinite", ratio=math.inf, norm=math.nan,
                           global_norm=math.nan, loss=math.nan)
    publish(bridge, [nan_spike])
    acc = read_back(tmp_path / "tb")
    tags = acc.Tags()["scalars"]
    assert f"{P}/spike_ratio" not in tags and f"{P}/grad_norm" not in tags and f"{P}/loss_at_spike" not in tags
    assert scalars(acc, f"{P}/spikes") == [(9, 1.0)]
    assert "ratio inf" in texts(acc, f"{P}/incidents")[0][1]


def test_an_existing_writer_is_used_and_left_open(tmp_path: Path) -> None:
    from torch.utils.tensorboard import SummaryWriter

    from guardtower.bridges import TensorBoardBridge

    writer = SummaryWriter(log_dir=str(tmp_path / "mine"))
    writer.add_scalar("train/loss", 0.5, 1)
    publish(TensorBoardBridge(writer=writer), [StallEvent(step=3, seconds=75.0, stall_after=60.0)])
    writer.add_scalar("train/loss", 0.25, 4)  # still open after the bus closed the bridge
    writer.close()
    acc = read_back(tmp_path / "mine")
    assert scalars(acc, "train/loss") == [(1, 0.5), (4, 0.25)]
    assert scalars(acc, f"{P}/stall_seconds") == [(3, 75.0)]
    assert "no optimizer step for 75 s" in texts(acc, f"{P}/incidents")[0][1]


@pytest.mark.slow
def test_a_guarded_run_charts_its_spike(tmp_path: Path) -> None:
    from guardtower.bridges import TensorBoardBridge
    from guardtower.guard import GuardedOptimizer

    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    guard = GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model, warmup_steps=2, log_every=5,
                             sinks=[TensorBoardBridge(log_dir=tmp_path / "tb")], log_dir=tmp_path, verbose=False)
    for step in range(1, 11):
        guard.zero_grad()
        loss = model(torch.randn(16, 8)).pow(2).mean() * (1e4 if step == 7 else 1.0)
        loss.backward()
        guard.step(loss=loss.detach())
    guard.close()
    acc = read_back(tmp_path / "tb")
    assert [s for s, _ in scalars(acc, f"{P}/spike_ratio")] == [7]
    assert scalars(acc, f"{P}/skipped_steps")[-1] == (10, 1.0)
    assert [s for s, _ in scalars(acc, f"{P}/grad_norm")] == [5, 7, 10]


def test_bad_arguments_are_config_errors(tmp_path: Path) -> None:
    from guardtower.bridges import TensorBoardBridge

    with pytest.raises(ConfigError, match="log_dir"):
        TensorBoardBridge()
    with pytest.raises(ConfigError, match="writer"):
        TensorBoardBridge(writer=object())
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="log_dir"):
        TensorBoardBridge(log_dir=tmp_path / "file")
    with pytest.raises(ConfigError, match="prefix"):
        TensorBoardBridge(log_dir=tmp_path, prefix="a b")
    TensorBoardBridge(log_dir=tmp_path / "lazy")
    assert not (tmp_path / "lazy").exists()  # nothing touches the disk before the first event, on the worker


def test_importing_the_bridges_package_does_not_import_tensorboard() -> None:
    code = ("import sys, guardtower.bridges, guardtower.heartbeat, guardtower.integrations\n"
            "print(sorted(m for m in ('tensorboard', 'lightning') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stderr
