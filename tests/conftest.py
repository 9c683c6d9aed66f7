import os
from typing import Iterator

import pytest
import torch


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


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Tiny models on a shared CPU run faster on one thread than fighting over two."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
