"""Packaging: the public API, light imports, the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import guardtower
from guardtower.bus import EventBus
from guardtower.cli import main
from guardtower.events import SkipEvent, SpikeEvent
from guardtower.severity import Severity
from guardtower.sinks import JsonlSink

_HEAVY = ["wandb", "mlflow", "transformers", "peft", "requests", "tenacity", "lightning", "tensorboard"]


def _run(code: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    return subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, env=env).stdout


def test_import_guardtower_imports_no_optional_integration() -> None:
    out = _run(
        "import sys, guardtower, guardtower.bus, guardtower.sinks, guardtower.events;"
        f"print([m for m in {_HEAVY!r} if m in sys.modules])"
    )
    assert out.strip() == "[]"


def test_every_public_name_resolves_without_optional_integrations() -> None:
    out = _run(
        "import sys, guardtower\n"
        "missing = [n for n in guardtower.__all__ if getattr(guardtower, n, None) is None]\n"
        f"print(missing, [m for m in {_HEAVY!r} if m in sys.modules])"
    )
    assert out.strip() == "[] []"


def test_version_and_all_are_explicit() -> None:
    assert guardtower.__version__ and "__version__" in guardtower.__all__
    assert len(guardtower.__all__) == len(set(guardtower.__all__))


def test_cli_version(capsys) -> None:
    try:
        main(["--version"])
    except SystemExit as exit_:
        assert exit_.code == 0
    assert capsys.readouterr().out.strip() == f"guardtower {guardtower.__version__}"


def test_cli_events_pretty_prints_and_filters(tmp_path, capsys) -> None:
    path = tmp_path / "events.jsonl"
    bus = EventBus([JsonlSink(path)])
    bus.publish(SpikeEvent(step=12, layer="h.1", ratio=55.0, severity=Severity.WARN))
    bus.publish(SkipEvent(step=12, layer="h.1"))
    bus.close(timeout=5)
    assert main(["events", str(path)]) == 0
    everything = capsys.readouterr().out
    assert "step 12" in everything and "skip step=12" in everything
    assert main(["events", str(path), "--kind", "skip"]) == 0
    only_skip = capsys.readouterr().out
    assert "skip step=12" in only_skip and "gradient spike" not in only_skip
    assert main(["events", str(path), "--min-severity", "WARN"]) == 0
    assert "skip step=12" not in capsys.readouterr().out


def test_cli_events_reports_bad_arguments(tmp_path, capsys) -> None:
    assert main(["events", str(tmp_path / "nope.jsonl")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_console_script_is_installed_as_guardtower_module() -> None:
    out = _run("import runpy, sys; sys.argv = ['guardtower', 'catalog', '--json']; runpy.run_module('guardtower', run_name='__main__')")
    assert isinstance(json.loads(out), list)


@pytest.mark.slow
@pytest.mark.timeout(1200)  # a whole-package check from a cold cache: minutes on a loaded 2-core host
def test_the_package_is_mypy_clean(mypy_check: subprocess.Popen[str]) -> None:
    out, _ = mypy_check.communicate(timeout=1100)  # started with the session (conftest.py), read here
    assert mypy_check.returncode == 0, out
