"""``guardtower demo``: a short run end to end, and the same run with every optional dependency missing."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from guardtower.sinks import read_events

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


def _run_demo(out: Path, *args: str, block: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    code = (
        "import sys\n"
        f"for name in {block!r}: sys.modules[name] = None\n"
        "from guardtower.demo import main\n"
        f"sys.exit(main(['--out', {str(out)!r}, '--steps', '40', *{list(args)!r}]))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "offline", "WANDB_SILENT": "true",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "MPLBACKEND": "Agg"}
    done = subprocess.run([sys.executable, "-c", code], cwd=out.parent, env=env, capture_output=True, text=True,
                          timeout=360)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return done


def _strict(text: str) -> object:
    def reject(token: str) -> object:
        raise ValueError(f"non-strict JSON token {token}")

    return json.loads(text, parse_constant=reject)


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """One demo run with every optional dependency and the rollback burst, read by the tests below."""
    out = tmp_path_factory.mktemp("demo") / "demo"
    return out, _run_demo(out, "--rollback")


def test_demo_shows_preflight_guarded_and_unguarded_runs_and_writes_everything(
    demo: tuple[Path, subprocess.CompletedProcess[str]], tmp_path: Path
) -> None:
    out, done = demo
    stdout = done.stdout

    # the story, in order
    marks = ["1/3", "planted bug", "pre-flight: FAIL", "fixed", "pre-flight: PASS", "2/3", "3/3", "final loss"]
    positions = [stdout.index(mark) for mark in marks]
    assert positions == sorted(positions)
    final = re.search(r"final loss: guarded (\S+) vs unguarded (\S+)", stdout)
    assert final is not None
    guarded_loss, unguarded_loss = float(final.group(1)), float(final.group(2))
    assert math.isfinite(guarded_loss) and math.isnan(unguarded_loss)

    # the event log: the pre-flight failed then passed, both faults were skipped, the burst was rolled back
    events: list[Any] = list(read_events(out / "events.jsonl"))
    assert [e.status for e in events if e.kind == "preflight"] == ["FAIL", "PASS"]
    spikes = {e.step: e for e in events if e.kind == "spike"}
    assert spikes[16].reason == "nonfinite" and spikes[16].action == "skip"
    assert spikes[24].reason == "spike" and spikes[24].action == "skip"
    assert {16, 24} <= {e.step for e in events if e.kind == "skip"}
    assert [e.kind for e in events].count("rollback") == 1

    reports = sorted((out / "spike_reports").glob("*.json"))
    assert len(reports) >= 3
    for report in reports:
        _strict(report.read_text())

    assert "mlflow ui --backend-store-uri sqlite:///" in stdout and "wandb sync" in stdout
    assert "INFO mlflow" not in stdout + done.stderr and "alembic" not in stdout + done.stderr

    # one plotting path: the demo's picture is what `guardtower report --plot` draws from the same folder
    from guardtower.cli import main as cli_main

    assert cli_main(["report", str(out), "--plot", str(tmp_path / "again.png")]) == 0
    assert (out / "grad_norms.png").read_bytes() == (tmp_path / "again.png").read_bytes()


def _mlflow_runs(db: Path) -> dict[str, object]:
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{db}")
    experiment = client.get_experiment_by_name("guardtower-demo")
    assert experiment is not None
    return {run.info.run_name: run for run in client.search_runs([experiment.experiment_id])}


def test_demo_trackers_keep_the_failed_preflight_visible_next_to_the_fix(
    demo: tuple[Path, subprocess.CompletedProcess[str]]
) -> None:
    from _wandb_reader import read_run

    out, _ = demo
    runs: dict[str, Any] = _mlflow_runs(out / "mlflow.db")
    assert sorted(runs) == ["1a-preflight-planted-bug", "1b-preflight-fixed", "2-guarded-training"]
    assert runs["1a-preflight-planted-bug"].data.tags["guardtower.preflight"] == "FAIL"
    assert "LORA-003" in runs["1a-preflight-planted-bug"].data.tags["guardtower.preflight.errors"]
    assert runs["1b-preflight-fixed"].data.tags["guardtower.preflight"] == "PASS"
    training = runs["2-guarded-training"].data
    assert "guardtower.preflight" not in training.tags and training.metrics["guardtower.skipped_steps"] >= 2
    assert {"loss", "unguarded_loss"} <= set(training.metrics)

    # W&B: three offline runs (their folders sort by start second, so match them by content)
    summaries = [read_run(d).summary for d in out.glob("wandb/offline-run-*")]
    assert sorted(str(s.get("guardtower/preflight")) for s in summaries) == ["FAIL", "None", "PASS"]
    (training_summary,) = [s for s in summaries if "guardtower/preflight" not in s]
    assert training_summary["guardtower/total_skips"] >= 2


def test_demo_degrades_gracefully_without_optional_dependencies(tmp_path: Path) -> None:
    out = tmp_path / "bare"
    stdout = _run_demo(out, "--no-progress", block=("mlflow", "wandb", "matplotlib", "peft")).stdout
    assert 'pip install "guardtower[mlflow]"' in stdout
    assert 'pip install "guardtower[wandb]"' in stdout
    assert 'pip install "guardtower[plot]"' in stdout
    assert "peft is not installed" in stdout and "pre-flight: FAIL" in stdout and "pre-flight: PASS" in stdout
    assert (out / "events.jsonl").is_file()
    assert not (out / "grad_norms.png").exists() and not (out / "mlflow.db").exists()
    assert not (out / "wandb").exists()


def test_demo_rejects_too_few_steps(tmp_path: Path) -> None:
    from guardtower.demo import main

    with pytest.raises(SystemExit) as exit_:
        main(["--out", str(tmp_path), "--steps", "5"])
    assert exit_.value.code == 2
