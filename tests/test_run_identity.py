"""Runs name themselves and keep to their own folder; callbacks finish the run's log without a close()."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from guardtower.cli import main as cli_main
from guardtower.guard import GuardedOptimizer
from guardtower.sinks import JsonlSink, read_events
from guardtower.testing import capture_events


def _steps(guard: GuardedOptimizer, model: torch.nn.Module, n: int) -> None:
    for _ in range(n):
        model(torch.randn(8, 4)).pow(2).mean().backward()
        guard.step()
        guard.zero_grad()


def test_a_guard_takes_the_active_mlflow_runs_name_and_tags_it(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    mlflow = pytest.importorskip("mlflow")
    from guardtower.bridges import MLflowBridge

    monkeypatch.delenv("GUARDTOWER_RUN", raising=False)
    monkeypatch.chdir(tmp_path)
    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    # an experiment of this store: another test's active experiment id means nothing here
    monkeypatch.setattr(mlflow.tracking.fluent, "_active_experiment_id", None, raising=False)
    mlflow.set_experiment("run-identity")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    with mlflow.start_run(run_name="sweep-3") as active:
        bridge = MLflowBridge(spool_path=tmp_path / "spool.jsonl")
        guard = GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, verbose=False, sinks=[bridge])
        with capture_events() as events:
            _steps(guard, model, 3)
            guard.close()
    assert guard.run == "sweep-3" and {e.run for e in events} == {"sweep-3"}
    assert guard.log_dir.parent == (tmp_path / "sg_logs").resolve() and guard.log_dir.name.startswith("sweep-3-")
    tags = mlflow.MlflowClient().get_run(active.info.run_id).data.tags
    mlflow.set_tracking_uri(previous)  # later tests use the shared tracking server
    assert tags["guardtower.run"] == "sweep-3"


def test_each_default_run_has_its_own_folder_and_report_picks_the_latest(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    first = GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, verbose=False, run="noisy")
    _steps(first, model, 2)
    model.weight.grad = torch.full_like(model.weight, float("nan"))
    model.bias.grad = torch.zeros_like(model.bias)
    first.step()
    first.close()
    model.zero_grad(set_to_none=True)
    second = GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, verbose=False, run="clean")
    _steps(second, model, 5)
    second.close()
    assert first.log_dir != second.log_dir
    assert [e.kind for e in read_events(second.log_dir / "events.jsonl")] == ["start", "summary"]
    os.utime(first.log_dir / "events.jsonl", (1, 1))  # whatever the clock's resolution: "clean" is newer
    for report in first.log_dir.glob("*.json"):
        os.utime(report, (1, 1))
    assert cli_main(["report", "sg_logs"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("5 steps, 0 incidents in") and second.log_dir.name in captured.out
    assert "latest of 2 run(s)" in captured.err
    assert cli_main(["report", "sg_logs", "--list"]) == 0
    assert capsys.readouterr().out.split() == [str(Path("sg_logs") / first.log_dir.name),
                                               str(Path("sg_logs") / second.log_dir.name)]
    assert cli_main(["events", "sg_logs", "--kind", "summary"]) == 0
    assert "run=clean" in capsys.readouterr().out


@pytest.mark.slow
def test_hf_callbacks_name_the_run_and_finish_its_log_without_close(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("transformers")
    from transformers import Trainer

    from guardtower.integrations.huggingface import GuardtowerCallback, StabilityGuardCallback
    from tests._hf_helpers import TokenDataset, tiny_gpt2, training_args

    monkeypatch.delenv("GUARDTOWER_RUN", raising=False)
    monkeypatch.chdir(tmp_path)
    preflight = GuardtowerCallback(verbose=False, sinks=[JsonlSink(tmp_path / "preflight.jsonl")])
    guard = StabilityGuardCallback(verbose=False, log_every=50)
    trainer = Trainer(model=tiny_gpt2(), args=training_args(tmp_path / "out", max_steps=12, run_name="exp-7"),
                      train_dataset=TokenDataset(), callbacks=[preflight, guard])
    trainer.train()  # no callback.close()
    assert guard.guard is not None
    (folder,) = (tmp_path / "sg_logs").iterdir()
    assert folder.name.startswith("exp-7-")
    events = list(read_events(folder / "events.jsonl"))
    assert [(e.kind, e.step) for e in events if e.kind == "summary"][-1] == ("summary", 12)
    assert {e.run for e in events} == {"exp-7"}
    preflight_events = list(read_events(tmp_path / "preflight.jsonl"))
    assert preflight_events and {e.run for e in preflight_events} == {"exp-7"}
    assert cli_main(["report", str(tmp_path / "sg_logs")]) == 0


@pytest.mark.slow
def test_hf_guard_finishes_its_log_when_training_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """HF has no exception callback: a step that raises still leaves the summary of the last step taken."""
    pytest.importorskip("transformers")
    from transformers import Trainer

    from guardtower.integrations.huggingface import StabilityGuardCallback
    from tests._hf_helpers import TokenDataset, tiny_gpt2, training_args

    monkeypatch.chdir(tmp_path)
    model = tiny_gpt2()
    forwards = []

    def fail_on_the_seventh(module: torch.nn.Module, args: object) -> None:
        forwards.append(1)
        if len(forwards) == 7:
            raise RuntimeError("data worker died")

    model.register_forward_pre_hook(fail_on_the_seventh)
    guard = StabilityGuardCallback(verbose=False, log_every=50)
    trainer = Trainer(model=model, args=training_args(tmp_path / "out", max_steps=12, run_name="crash-1"),
                      train_dataset=TokenDataset(), callbacks=[guard])
    with pytest.raises(RuntimeError, match="data worker died"):
        trainer.train()
    assert guard.guard is not None and not guard.guard._closed  # no close(): the callback finished the log itself
    events = list(read_events(guard.guard.log_dir / "events.jsonl"))
    assert [(e.kind, e.step) for e in events if e.kind == "summary"][-1] == ("summary", 6)
    assert "training_step" not in vars(trainer)  # the wrapper is gone once the run is over
    guard.close()


def test_a_guard_left_open_by_a_crash_writes_its_final_summary_at_exit(tmp_path: Path) -> None:
    import subprocess
    import sys

    script = (
        "import torch\n"
        "from guardtower.guard import GuardedOptimizer\n"
        "model = torch.nn.Linear(4, 1)\n"
        "guard = GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, verbose=False, log_every=50)\n"
        "for _ in range(5):\n"
        "    model(torch.randn(8, 4)).pow(2).mean().backward()\n"
        "    guard.step()\n"
        "    guard.zero_grad()\n"
        "raise SystemExit('loader crashed')\n"
    )
    repo = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "GUARDTOWER_RUN": "crashed",
           "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1 and "loader crashed" in done.stderr
    (folder,) = (tmp_path / "sg_logs").iterdir()
    assert [(e.kind, e.step) for e in read_events(folder / "events.jsonl")] == [("start", 0), ("summary", 5)]


@pytest.mark.slow
def test_lightning_run_is_named_by_its_logger_with_one_step_numbering_in_tensorboard(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("lightning")
    pytest.importorskip("tensorboard")
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from guardtower.bridges import TensorBoardBridge
    from guardtower.integrations.lightning import GuardtowerGuard, GuardtowerPreflight
    from tests._lightning_helpers import TinyModule, lightning_trainer

    monkeypatch.delenv("GUARDTOWER_RUN", raising=False)
    monkeypatch.chdir(tmp_path)
    logger = TensorBoardLogger(str(tmp_path / "tb"), name="exp")
    bridge = TensorBoardBridge(writer=logger.experiment)
    preflight = GuardtowerPreflight(verbose=False)
    guard = GuardtowerGuard(verbose=False, log_every=1, sinks=[bridge])
    trainer = lightning_trainer(tmp_path, logger=logger, max_steps=12, callbacks=[preflight, guard])
    with capture_events() as events:
        trainer.fit(TinyModule(spike_at=11))  # after the 10 warmup steps
    assert preflight.report is not None
    assert not any("no tensor of inputs= reached the model" in note for note in preflight.report.notes)
    assert {e.run for e in events} == {"exp-version_0"}
    assert guard.guards[0].log_dir.name.startswith("exp-version_0-")
    summaries = [e.step for e in events if e.kind == "summary"]
    assert summaries[-1] == trainer.global_step == 12
    logger.experiment.flush()
    accumulator = EventAccumulator(logger.log_dir)
    accumulator.Reload()
    for tag in ("guardtower/spikes", "guardtower/skipped_steps"):
        steps = [s.step for s in accumulator.Scalars(tag)]
        assert len(steps) == len(set(steps)), (tag, steps, accumulator.Scalars(tag))  # no duplicate points
        assert steps == sorted(steps) and steps[-1] == trainer.global_step
    spikes = [(s.step, s.value) for s in accumulator.Scalars("guardtower/spikes")]
    assert dict(spikes)[11] == 1.0 and dict(spikes)[10] == 0.0  # counted at the Trainer's step 11


def test_a_halt_leaves_the_final_summary_at_the_halted_step(tmp_path: Path) -> None:
    from guardtower.errors import GradientSpikeError

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    guard = GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, verbose=False, log_dir=tmp_path,
                             nan_action="raise", log_every=50)
    with capture_events() as events:
        _steps(guard, model, 3)
        model.weight.grad = torch.full_like(model.weight, float("nan"))
        with pytest.raises(GradientSpikeError):
            guard.step()
    assert [(e.kind, e.step) for e in events][-2:] == [("halt", 4), ("summary", 4)]
    guard.close()
