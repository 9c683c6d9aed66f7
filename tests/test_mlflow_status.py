"""A halt or a failed pre-flight ends the MLflow run FAILED with a reason tag (real ``mlflow server``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from _hf_helpers import SpikeAt, TokenDataset, lora, stale_optimizer_found, tiny_gpt2, training_args
from _lightning_helpers import TinyModule, lightning_trainer
from _mlflow_server import MlflowServer
from guardtower.errors import GradientSpikeError, PreflightFailed
from guardtower.integrations._run_status import FAILURE_TAG

pytestmark = pytest.mark.slow


@pytest.fixture()
def hf_mlflow(mlflow_server: MlflowServer, monkeypatch: pytest.MonkeyPatch,
              request: pytest.FixtureRequest) -> Iterator[Any]:
    """The Trainer's own MLflowCallback (report_to="mlflow") logging to the server; yields a client."""
    import mlflow

    experiment = f"status-{request.node.name}"[:200]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.url)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", experiment)
    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(mlflow_server.url)
    client = mlflow.MlflowClient(tracking_uri=mlflow_server.url)
    client.experiment_name = experiment
    yield client
    while mlflow.active_run() is not None:  # a test that failed half-way must not leak its run
        mlflow.end_run()
    mlflow.set_tracking_uri(previous)


def _only_run(client: Any) -> Any:
    experiment = client.get_experiment_by_name(client.experiment_name)
    (run,) = client.search_runs([experiment.experiment_id])
    return run


def _halting_trainer(tmp_path: Path, **callback_kwargs: Any) -> Any:
    from transformers import Trainer

    from guardtower.integrations.huggingface import StabilityGuardCallback

    model = tiny_gpt2()
    guard = StabilityGuardCallback(nan_action="raise", warmup_steps=2, log_dir=str(tmp_path / "sg"), verbose=False,
                                   **callback_kwargs)
    return Trainer(model=model, args=training_args(tmp_path, report_to=["mlflow"]), train_dataset=TokenDataset(),
                   callbacks=[SpikeAt(model, 5), guard])


def test_hf_halt_ends_the_trainers_mlflow_run_failed_with_the_halt_message(hf_mlflow: Any, tmp_path: Path) -> None:
    import mlflow

    with pytest.raises(GradientSpikeError) as halted:
        _halting_trainer(tmp_path).train()
    run = _only_run(hf_mlflow)
    assert run.info.status == "FAILED"
    assert run.data.tags[FAILURE_TAG] == str(halted.value)
    assert "step 5" in run.data.tags[FAILURE_TAG]
    assert mlflow.active_run() is None  # nothing left for an exit hook to close as FINISHED


def test_hf_opt_out_leaves_the_run_to_the_user(hf_mlflow: Any, tmp_path: Path) -> None:
    trainer = _halting_trainer(tmp_path, fail_mlflow_run=False)  # alive: MLflowCallback.__del__ would end the run
    with pytest.raises(GradientSpikeError):
        trainer.train()
    run = _only_run(hf_mlflow)
    assert run.info.status == "RUNNING" and FAILURE_TAG not in run.data.tags


def test_hf_failed_preflight_ends_the_users_run_failed_with_the_catalog_ids(hf_mlflow: Any, tmp_path: Path) -> None:
    import mlflow
    from transformers import Trainer

    from guardtower.integrations.huggingface import GuardtowerCallback

    base = tiny_gpt2()
    stale = torch.optim.AdamW(base.parameters(), lr=1e-3)
    model = lora(base)
    mlflow.set_experiment(hf_mlflow.experiment_name)
    mlflow.start_run()  # the user's own run, no context manager: nothing else would end it
    trainer = Trainer(model=model, args=training_args(tmp_path), train_dataset=TokenDataset(),
                      optimizers=(stale, None), callbacks=[GuardtowerCallback(raise_on_error=True, verbose=False)])
    with pytest.raises(PreflightFailed) as failed:
        trainer.train()
    run = _only_run(hf_mlflow)
    ids = run.data.tags[FAILURE_TAG].split(",")
    assert run.info.status == "FAILED" and stale_optimizer_found(ids)
    assert ids == sorted({f.catalog_id for f in failed.value.report.errors})


def test_lightning_halt_tags_the_mlflow_logger_run(mlflow_server: MlflowServer, tmp_path: Path) -> None:
    from lightning.pytorch.loggers import MLFlowLogger

    from guardtower.integrations.lightning import GuardtowerGuard

    logger = MLFlowLogger(experiment_name="lightning-halt", tracking_uri=mlflow_server.url)
    module = TinyModule(spike_at=4)
    guard = GuardtowerGuard(nan_action="raise", warmup_steps=2, log_dir=str(tmp_path / "sg"), verbose=False)
    with pytest.raises(GradientSpikeError) as halted:
        lightning_trainer(tmp_path, callbacks=[guard], logger=logger, max_steps=8).fit(module)
    run = logger.experiment.get_run(logger.run_id)
    assert run.info.status == "FAILED"
    assert run.data.tags[FAILURE_TAG] == str(halted.value)


def test_lightning_failed_preflight_tags_the_mlflow_logger_run(mlflow_server: MlflowServer, tmp_path: Path) -> None:
    from lightning.pytorch.loggers import MLFlowLogger

    from guardtower.integrations.lightning import GuardtowerPreflight

    logger = MLFlowLogger(experiment_name="lightning-preflight", tracking_uri=mlflow_server.url)
    module = TinyModule(forget_layer=True)
    with pytest.raises(PreflightFailed):
        lightning_trainer(tmp_path, callbacks=[GuardtowerPreflight(raise_on_error=True, verbose=False)],
                          logger=logger).fit(module)
    run = logger.experiment.get_run(logger.run_id)
    assert run.info.status == "FAILED" and "OPT-001" in run.data.tags[FAILURE_TAG].split(",")
