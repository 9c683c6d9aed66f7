"""Long work shows progress; damaged report files and odd help text are said, not hidden."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from guardtower._progress import Progress
from guardtower.bus import EventBus
from guardtower.cli import main as cli_main
from guardtower.events import StallEvent, SummaryEvent
from guardtower.incidents import load_run_log
from guardtower.preflight import audit
from guardtower.sinks import JsonlSink
from tests._guard_helpers import make, scale_grad, train


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_plain_progress_prints_a_line_every_few_seconds_with_step_and_time_left() -> None:
    out, clock = io.StringIO(), _Clock()
    progress = Progress(100, "audit", stream=out, clock=clock, every=5.0, use_tqdm=False)
    for _ in range(100):
        clock.now += 0.5
        progress.update()
    lines = out.getvalue().splitlines()
    assert 8 <= len(lines) <= 11  # one every ~5 s over 50 s, plus the last
    assert lines[0] == "audit 10/100 (10%), 5s elapsed, ~45s left"
    assert lines[-1] == "audit 100/100 (100%), 50s elapsed"


def test_disabled_progress_prints_nothing() -> None:
    out, clock = io.StringIO(), _Clock()
    progress = Progress(10, "x", False, stream=out, clock=clock, every=0.0)
    for _ in range(10):
        clock.now += 10
        progress.update()
    assert out.getvalue() == ""


def test_progress_uses_tqdm_when_installed() -> None:
    pytest.importorskip("tqdm")
    out = io.StringIO()
    progress = Progress(4, "audit", stream=out, use_tqdm=True)
    for _ in range(4):
        progress.update("loss 1")
    progress.close()
    assert "audit" in out.getvalue() and "4/4" in out.getvalue()


def _overfit_setup() -> tuple[nn.Module, object, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
    return model, lambda: F.cross_entropy(model(x), y), torch.optim.Adam(model.parameters(), lr=1e-2)


def test_audit_steps_shows_progress_unless_verbose_is_false(monkeypatch: pytest.MonkeyPatch) -> None:
    import guardtower._progress as progress_module

    ticks = iter(range(0, 10_000, 3))  # every reading of the clock is 3 s later: a line on every other step
    monkeypatch.setattr(progress_module, "_monotonic", lambda: float(next(ticks)))
    model, step_fn, opt = _overfit_setup()
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        audit(model, step_fn, optimizer=opt, steps=6, checks="overfit_batch")
    shown = err.getvalue()
    assert "overfitting one batch, step" in shown and "/6" in shown and "left" in shown and "loss " in shown
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        audit(model, step_fn, optimizer=opt, steps=6, checks="overfit_batch", verbose=False)
    assert err.getvalue() == ""


def test_a_truncated_spike_report_is_reported_with_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model, guard = make(tmp_path, log_every=5, sinks=[JsonlSink(tmp_path / "logs" / "events.jsonl")])
    train(model, guard, 31, corrupt=lambda i, m: scale_grad("out.weight", 1e4)(m) if i == 30 else None)
    guard.close()
    (report,) = (tmp_path / "logs").glob("spike_step*.json")
    (tmp_path / "logs" / "events.jsonl").unlink()  # only the report knows the incident
    report.write_text(report.read_text()[:200])
    assert cli_main(["report", str(tmp_path / "logs")]) == 2
    captured = capsys.readouterr()
    assert "damaged spike report" in captured.err and report.name in captured.err
    assert "not valid JSON" in " ".join(load_run_log(tmp_path / "logs").malformed[0].problem.split())


def test_the_plots_whole_run_panel_reaches_the_last_step(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from guardtower._plot import figure

    bus = EventBus([JsonlSink(tmp_path / "events.jsonl")])
    for step in (0, 50):
        bus.publish(SummaryEvent(step=step, grad_norm=1.0))
    bus.publish(StallEvent(step=79, seconds=30.0))  # the log knows step 79; no summary point reaches it
    bus.close(5)
    overview = figure(load_run_log(tmp_path)).axes[0]
    assert overview.get_xlim()[1] >= 79


@pytest.mark.parametrize("command", ["replay", "demo", "report", "events"])
def test_help_shows_no_raw_double_backticks(command: str) -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        cli_main([command, "--help"])
    assert "usage:" in out.getvalue() and "``" not in out.getvalue()


def test_json_report_round_trip_is_untouched_by_the_damage_check(tmp_path: Path) -> None:
    (tmp_path / "notes.json").write_text("{not json")  # another program's file, not named like a report
    (tmp_path / "events.jsonl").write_text(json.dumps(SummaryEvent(step=3).to_record()) + "\n")
    assert load_run_log(tmp_path).malformed == []


def test_the_close_warning_counts_every_event_left_undelivered(tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    from guardtower.alerts import WebhookAlert
    from guardtower.events import SpikeEvent

    bus = EventBus([WebhookAlert("http://127.0.0.1:9/hook", spool_path=tmp_path / "spool.jsonl")])  # nothing listens
    for step in range(6):
        bus.publish(SpikeEvent(step=step, layer=f"h.{step}", reason="nonfinite", severity="ERROR"))
    with caplog.at_level("WARNING", logger="guardtower.delivery"):
        bus.close(5)
    assert bus.stats()["sinks"]["webhook"]["spooled"] == 6
    totals = [r.getMessage() for r in caplog.records if "in all" in r.getMessage()]
    assert len(totals) == 1 and "6 event(s) not delivered in all" in totals[0] and "6 in its spool" in totals[0]
    assert "guardtower replay" in totals[0]


def test_replay_of_a_large_spool_shows_progress(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    import guardtower._progress as progress_module
    import guardtower.replay as replay
    from guardtower.events import SpikeEvent
    from guardtower.spool import Spool

    spool = Spool(tmp_path / "webhook.jsonl")
    spool.append_many([SpikeEvent(step=i, layer="h.0") for i in range(150)], "undelivered", "webhook:alerts")
    delivered: list[int] = []
    monkeypatch.setitem(replay.REPLAYERS, "webhook", lambda args: lambda event: delivered.append(event.step))
    ticks = iter(range(0, 100_000))  # one second per reading of the clock
    monkeypatch.setattr(progress_module, "_monotonic", lambda: float(next(ticks)))
    assert replay.main([str(tmp_path / "webhook.jsonl")]) == 0
    assert len(delivered) == 150
    err = capsys.readouterr().err
    assert "guardtower replay webhook.jsonl: sent 5/150" in err and "left" in err and "150/150" in err
