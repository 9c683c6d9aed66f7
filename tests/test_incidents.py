"""``guardtower report``: incidents read back from event files and spike reports, table and plot."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from guardtower.bus import EventBus
from guardtower.cli import main as cli_main
from guardtower.events import (
    PreflightEvent,
    RollbackEvent,
    SkipEvent,
    SpikeEvent,
    SummaryEvent,
)
from guardtower.incidents import format_table, load_run_log
from guardtower.severity import Severity
from guardtower.sinks import JsonlSink, read_events


def _write_run(path: Path) -> None:
    """A 40-step run: a spike skipped at 10, a NaN skipped at 20, a rollback at 30, a failed pre-flight."""
    bus = EventBus([JsonlSink(path)])
    bus.publish(PreflightEvent(step=0, status="FAIL", errors=1, error_ids=("LORA-003",), severity=Severity.ERROR))
    for step in range(1, 41):
        bus.publish(SummaryEvent(step=step, grad_norm=1.0 + step / 100,
                                 metrics={"grad_norm/h.0.attn": 0.5, "grad_norm/h.1.mlp": 0.25}))
    bus.publish(SpikeEvent(step=10, layer="h.0.attn", reason="spike", norm=5000.0, baseline=0.5, ratio=10000.0,
                           threshold=10.0, global_norm=7000.0, action="skip", severity=Severity.WARN,
                           top_layers=(("h.0.attn", 5000.0, 10000.0),)))
    bus.publish(SkipEvent(step=10, layer="h.0.attn"))
    bus.publish(SpikeEvent(step=20, layer="h.1.mlp", reason="nonfinite", norm=math.nan, baseline=0.25,
                           ratio=math.inf, threshold=10.0, global_norm=math.nan, action="skip",
                           severity=Severity.WARN, nonfinite_layers=("h.1.mlp",)))
    bus.publish(SkipEvent(step=20, layer="h.1.mlp", reason="nonfinite"))
    bus.publish(RollbackEvent(step=30, layer="h.0.attn", from_step=30, to_step=27, severity=Severity.WARN))
    bus.close(5)


def test_report_lists_every_incident_in_step_order(tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    _write_run(events)
    log = load_run_log(events)
    assert [(i.step, i.kind, i.action) for i in log.incidents] == [
        (0, "preflight", "fail"),
        (10, "spike", "skip"),
        (20, "nonfinite", "skip"),
        (30, "rollback", "rollback 30->27"),
    ]
    assert log.incidents[1].ratio == pytest.approx(10000.0)
    assert {10, 20, 28, 29, 30} <= log.skipped_steps
    assert 15 not in log.skipped_steps
    assert log.global_norms[10] == pytest.approx(7000.0)  # the incident's own norm, not a summary's
    assert log.layer_norms["h.1.mlp"][5] == pytest.approx(0.25)


def test_table_shows_step_kind_layer_ratio_action(tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    _write_run(events)
    table = format_table(load_run_log(events).incidents)
    lines = table.splitlines()
    assert lines[0].split() == ["step", "kind", "layer", "ratio", "action"]
    spike = next(line for line in lines if line.startswith("10 "))
    assert spike.split() == ["10", "spike", "h.0.attn", "1e+04", "skip"]
    nan_row = next(line for line in lines if line.startswith("20 "))
    assert nan_row.split()[1:4] == ["nonfinite", "h.1.mlp", "inf"]


def _guarded_run(log_dir: Path) -> None:
    """A real GuardedOptimizer run: a gradient spike at step 15 and a NaN batch at step 20, both skipped."""
    from guardtower.guard import GuardedOptimizer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    guard = GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model, warmup_steps=5, log_every=1,
                             log_dir=log_dir, verbose=False, sinks=[JsonlSink(log_dir / "events.jsonl")])
    for step in range(1, 26):
        x, y = torch.randn(32, 8), torch.randn(32, 1)
        if step == 20:
            x = x * float("nan")
        loss = torch.nn.functional.mse_loss(model(x), y) * (1e4 if step == 15 else 1.0)
        loss.backward()
        guard.step(loss=loss)
        guard.zero_grad()
    guard.close()


def test_log_dir_of_a_real_guarded_run_lists_each_incident_once(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    _guarded_run(tmp_path)
    assert len(list(tmp_path.glob("spike_step*.json"))) == 2
    log = load_run_log(tmp_path)  # the event log and the spike reports describe the same two incidents
    assert [(i.step, i.kind, i.action) for i in log.incidents] == [(15, "spike", "skip"), (20, "nonfinite", "skip")]
    assert log.incidents[0].ratio is not None and log.incidents[0].ratio > 10
    assert {15, 20} <= log.skipped_steps
    assert set(range(1, 26)) <= set(log.global_norms)  # summaries every step (log_every=1)
    assert cli_main(["report", str(tmp_path)]) == 0
    assert "25 steps, 2 incidents in" in capsys.readouterr().out


def test_spike_reports_alone_are_enough(tmp_path: Path) -> None:
    _guarded_run(tmp_path)
    (tmp_path / "events.jsonl").unlink()
    (tmp_path / "unrelated.json").write_text(json.dumps({"hello": 1}))
    log = load_run_log(tmp_path)
    assert [(i.step, i.kind) for i in log.incidents] == [(15, "spike"), (20, "nonfinite")]
    spike = log.incidents[0]
    assert spike.report_path is not None and spike.layer
    assert set(range(6, 15)) <= set(log.global_norms)  # the report's history of the steps before the spike
    assert len(log.layer_norms[spike.layer]) > 5


def test_spools_and_foreign_jsonl_in_a_log_dir_are_read_or_skipped(tmp_path: Path) -> None:
    from guardtower.spool import Spool

    _guarded_run(tmp_path)
    spike = next(e for e in read_events(tmp_path / "events.jsonl") if e.kind == "spike")
    (tmp_path / "spool").mkdir()
    Spool(tmp_path / "spool" / "mlflow-run.jsonl").append(spike, "undelivered: ConnectionError", "mlflow")
    (tmp_path / "other-tool.jsonl").write_text('{"loss": 1.0}\n[1, 2]\nnot json\n')
    log = load_run_log(tmp_path)
    assert [(i.step, i.kind) for i in log.incidents] == [(15, "spike"), (20, "nonfinite")]


def test_cli_json_output_is_strict_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    events = tmp_path / "events.jsonl"
    _write_run(events)
    assert cli_main(["report", str(events), "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["step"] for r in rows] == [0, 10, 20, 30]


def test_cli_errors_on_missing_path_and_reports_quiet_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["report", str(tmp_path / "nope")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert cli_main(["report", str(tmp_path)]) == 2  # a directory without any event file
    quiet = tmp_path / "quiet.jsonl"
    bus = EventBus([JsonlSink(quiet)])
    bus.publish(SummaryEvent(step=1, grad_norm=1.0))
    bus.publish(PreflightEvent(step=0, status="PASS"))
    bus.close(5)
    assert cli_main(["report", str(quiet)]) == 0
    assert "1 step, 0 incidents in" in capsys.readouterr().out


def test_plot_writes_a_png_with_one_panel_per_incident(tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    _write_run(events)
    out = tmp_path / "plots" / "incidents.png"
    assert cli_main(["report", str(events), "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    import matplotlib.image as mpimg

    height, width = mpimg.imread(out).shape[:2]
    assert width > 1000 and height > 800  # overview + 2 rows of incident panels


def _write_burst_run(path: Path) -> None:
    """Summaries every 5 steps over 60 steps, a spike in h.0.attn at 20, then a burst of NaN at 40-42."""
    bus = EventBus([JsonlSink(path)])
    for step in range(5, 61, 5):
        bus.publish(SummaryEvent(step=step, grad_norm=20.0))
    bus.publish(SpikeEvent(step=20, layer="h.0.attn", reason="spike", norm=9.0, baseline=0.05, ratio=180.0,
                           threshold=10.0, global_norm=25.0, action="skip", severity=Severity.WARN,
                           history_steps=tuple(range(10, 21)), history_global_norms=(20.0,) * 10 + (25.0,),
                           history_layer_norms=(0.05,) * 10 + (9.0,)))
    for step in (40, 41, 42):
        bus.publish(SpikeEvent(step=step, layer="h.1.mlp", reason="nonfinite", norm=math.nan, baseline=0.1,
                               ratio=math.inf, threshold=10.0, global_norm=math.nan, action="skip",
                               severity=Severity.WARN, history_steps=tuple(range(step - 5, step + 1)),
                               history_global_norms=(20.0,) * 5 + (math.nan,),
                               history_layer_norms=(0.1,) * 5 + (math.nan,)))
    bus.close(5)


def test_plot_draws_the_whole_run_and_one_panel_per_burst(tmp_path: Path) -> None:
    from guardtower._plot import bursts, figure

    _write_burst_run(tmp_path / "events.jsonl")
    log = load_run_log(tmp_path)
    assert [[i.step for i in group] for group in bursts(log.incidents)] == [[20], [40, 41, 42]]
    fig = figure(log)
    overview, spike_panel, nan_panel = (ax for ax in fig.axes if ax.get_title() and ax.get_ylabel() != "global norm")
    (whole_run,) = [line for line in overview.get_lines() if line.get_label() == "global grad norm"]
    steps = list(whole_run.get_xdata())
    assert steps[0] <= 5 and steps[-1] == 60  # summaries from the first to the last, not just the windows
    assert not any(math.isnan(y) for x, y in zip(steps, whole_run.get_ydata()) if x in range(5, 61, 5))
    assert spike_panel.get_title().startswith("step 20: spike -> skip")
    assert nan_panel.get_title().startswith("steps 40-42: 3 x nonfinite -> skip")


def test_incident_threshold_is_drawn_against_the_trigger_layer_not_the_global_norm(tmp_path: Path) -> None:
    from guardtower._plot import figure

    _write_burst_run(tmp_path / "events.jsonl")
    fig = figure(load_run_log(tmp_path))
    panels = [ax for ax in fig.axes if ax.get_title().startswith("step")]
    for panel, limit in zip(panels, (0.5, 1.0)):  # the trigger layer's baseline (0.05, 0.1) x threshold 10
        labels = {line.get_label(): line for line in panel.get_lines()}
        trigger = next(line for label, line in labels.items() if label.endswith("(trigger)"))
        threshold = next(line for label, line in labels.items() if label.startswith("threshold of this layer"))
        assert "h." in trigger.get_label()
        assert "global grad norm" not in labels  # the global norm has its own axis, on the right
        twins = [ax for ax in fig.axes if ax is not panel and ax.bbox.bounds == panel.bbox.bounds]
        assert [line.get_label() for twin in twins for line in twin.get_lines()] == ["global grad norm (right axis)"]
        assert threshold.get_ydata()[0] == pytest.approx(limit)
    spike_panel, nan_panel = panels
    assert max(y for y in spike_panel.get_lines()[0].get_ydata() if not math.isnan(y)) == pytest.approx(9.0)
    # the NaN steps are marked at the top edge, named in the legend, with no text over the threshold line
    assert not nan_panel.texts
    legend = [text.get_text() for text in nan_panel.get_legend().get_texts()]
    assert "NaN/Inf (off the scale)" in legend
    (marker,) = [line for line in nan_panel.get_lines() if line.get_label() == "NaN/Inf (off the scale)"]
    assert list(marker.get_xdata()) == [40, 41, 42]


def test_report_on_a_real_clean_run_says_n_steps_0_incidents(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """With the default log_every=50, 20 clean steps still leave a record: the start event and the summary
    at close."""
    from guardtower.guard import GuardedOptimizer

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    guard = GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, verbose=False, log_dir=tmp_path,
                             sinks=[JsonlSink(tmp_path / "events.jsonl")])
    for _ in range(20):
        model(torch.randn(8, 4)).pow(2).mean().backward()
        guard.step()
        guard.zero_grad()
    guard.close()
    assert cli_main(["report", str(tmp_path)]) == 0
    assert capsys.readouterr().out.startswith(f"20 steps, 0 incidents in {tmp_path}")
