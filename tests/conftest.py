import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest
import torch

from _forkserver import Forkserver
from _mlflow_server import MlflowServer

ROOT = Path(__file__).resolve().parents[1]
MYPY_TEST = "test_package.py::test_the_package_is_mypy_clean"
#: the whole-package mypy check, started when the session's tests are known (see mypy_check)
_MYPY = pytest.StashKey[subprocess.Popen[str]]()


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


@pytest.fixture(autouse=True)
def _fresh_accelerate() -> None:
    """Accelerate keeps its state in process-wide singletons: a test's ``Accelerator`` would otherwise inherit
    another test's accumulation setting and a ``sync_gradients`` left False mid-cycle (its optimizer then
    never steps)."""
    if "accelerate.state" in sys.modules:
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


@pytest.fixture(autouse=True)
def _no_leftover_process_group() -> Iterator[None]:
    """A test that initialises a single-process group (a DDP reproduction on gloo) and leaves it would make every
    later test in that worker see rank 0 of a real group instead of the ``RANK`` it sets: destroyed after the test
    that made it."""
    import torch.distributed as dist

    before = dist.is_available() and dist.is_initialized()
    yield
    if not before and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Tiny models on a shared CPU run faster on one thread than fighting over two."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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


def mypy_command() -> list[str]:
    """The whole-package check from a cold cache, as CI runs it."""
    return [sys.executable, "-m", "mypy", "guardtower", "--no-incremental", "--cache-dir", os.devnull]


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the mypy check (a minute of one core, mostly reading torch's and transformers' types) as soon as
    its test is selected, so it runs beside the other tests instead of after them; its test waits for it.
    Under pytest-xdist the workers run tests side by side already: there the test runs it itself."""
    if "PYTEST_XDIST_WORKER" not in os.environ and any(item.nodeid.endswith(MYPY_TEST) for item in session.items):
        session.config.stash[_MYPY] = subprocess.Popen(mypy_command(), cwd=ROOT, stdout=subprocess.PIPE,
                                                       stderr=subprocess.STDOUT, text=True)


def pytest_unconfigure(config: pytest.Config) -> None:
    proc = config.stash.get(_MYPY, None)
    if proc is not None and proc.poll() is None:  # the session ended before its test read it
        proc.kill()
        proc.communicate()


@pytest.fixture()
def mypy_check(request: pytest.FixtureRequest) -> subprocess.Popen[str]:
    """The mypy check of the package, started earlier (pytest_collection_finish) or now."""
    proc = request.config.stash.get(_MYPY, None)
    if proc is None:
        proc = subprocess.Popen(mypy_command(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        request.config.stash[_MYPY] = proc
    return proc
