"""examples/lora_optimizer_bug.py runs as a user would run it and keeps its promises."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_lora_optimizer_bug_example_catches_the_bug_and_passes_the_fix() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "lora_optimizer_bug.py")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    first, second = run.stdout.split("guardtower pre-flight: ")[1:3]
    assert first.startswith("FAIL") and "LORA-003" in first and "OPT-003" in first and "[INFO] LORA-004" in first
    assert second.startswith("PASS") and "LORA-003" not in second
    assert "params trainable" in run.stdout
