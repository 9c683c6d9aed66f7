import os
from pathlib import Path
from typing import Iterator

import pytest

from _forkserver import Forkserver
from _mlflow_server import MlflowServer

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _no_hub(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing in the tests may reach a model hub."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.setenv("WANDB_SILENT", "true")


@pytest.fixture(autouse=True)
def _tracker_env() -> Iterator[None]:
    """Libraries write tracker settings into ``os.environ`` (``mlflow.set_experiment`` sets
    ``MLFLOW_EXPERIMENT_ID``); put them back so no test sees another test's experiment or run."""
    saved = {k: v for k, v in os.environ.items() if k.startswith(("MLFLOW_", "WANDB_"))}
    yield
    for key in [k for k in os.environ if k.startswith(("MLFLOW_", "WANDB_"))]:
        if key not in saved:
            del os.environ[key]
    os.environ.update(saved)


@pytest.fixture(scope="session")
def forkserver() -> Iterator[Forkserver]:
    """One warm Python for the README blocks and the examples (their imports cost more than their runs)."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    server = Forkserver({**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                         "WANDB_SILENT": "true", "MPLBACKEND": "Agg"})
    yield server
    server.close()


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    """One real ``mlflow server`` for every test that needs one (starting one costs seconds); tests use their
    own runs or experiments in it. A test that stops it starts it again on the same port before it ends."""
    server = MlflowServer(tmp_path_factory.mktemp("mlflow-server"))
    server.start()
    yield server
    server.stop()
