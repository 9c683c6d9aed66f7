"""Every script in examples/ runs to completion on CPU, offline, in its own process (forked from a warm one:
tests/_forkserver.py) with a bounded timeout."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from _forkserver import Forkserver

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
TIMEOUT_S = 240


def test_there_are_examples() -> None:
    assert {"guarded_training.py", "hf_trainer.py", "mlflow_tags.py"} <= {p.name for p in EXAMPLES}


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S + 30)
@pytest.mark.parametrize("script", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs(script: Path, tmp_path: Path, forkserver: Forkserver) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "MPLBACKEND": "Agg",
        "TMPDIR": str(tmp_path),
        "OMP_NUM_THREADS": "1",
    }
    done = forkserver.run([str(script)], cwd=tmp_path, env=env, timeout=TIMEOUT_S)
    assert done.returncode == 0, f"{script.name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
