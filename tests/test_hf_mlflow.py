"""GuardtowerCallback in a real Trainer publishes its pre-flight to an MLflowBridge (embedded SQLite store)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from guardtower.errors import PreflightFailed
from _hf_helpers import TokenDataset, lora, stale_optimizer_found, tiny_gpt2, training_args

from transformers import Trainer  # noqa: E402

from guardtower.integrations.huggingface import GuardtowerCallback  # noqa: E402

pytestmark = pytest.mark.slow


def test_mlflow_run_carries_the_preflight_tags(tmp_path: Path) -> None:
    import mlflow

    from guardtower.bridges import MLflowBridge

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow.MlflowClient(tracking_uri=uri)
    experiment = client.create_experiment("hf", artifact_location=(tmp_path / "artifacts").as_uri())
    run_id = client.create_run(experiment).info.run_id
    bridge = MLflowBridge(run_id, tracking_uri=uri, spool_path=tmp_path / "spool.jsonl")
    base = tiny_gpt2()
    stale = torch.optim.AdamW(base.parameters(), lr=1e-3)
    model = lora(base)
    callback = GuardtowerCallback(raise_on_error=True, verbose=False, sinks=[bridge])
    trainer = Trainer(model=model, args=training_args(tmp_path), train_dataset=TokenDataset(),
                      optimizers=(stale, None), callbacks=[callback])
    with pytest.raises(PreflightFailed):
        trainer.train()
    tags = client.get_run(run_id).data.tags  # no close() needed: the failure was flushed before the raise
    assert tags["guardtower.preflight"] == "FAIL"
    assert stale_optimizer_found(tags["guardtower.preflight.errors"].split(","))
    callback.close()
