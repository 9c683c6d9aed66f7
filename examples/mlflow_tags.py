"""A failed pre-flight becomes MLflow run tags; a skipped spike becomes a metric (local SQLite store, no server).

The LoRA optimizer bug (an optimizer built before ``get_peft_model`` holds none of the adapters) is caught
by the audit; the MLflowBridge tags the run ``guardtower.preflight=FAIL`` with the catalog ids, so the
failed launch is searchable in the MLflow UI. The fixed setup then trains under a GuardedOptimizer, and
the skipped spike shows up as ``guardtower.skipped_steps``.

    pip install "guardtower[mlflow,peft,hf]"
    python examples/mlflow_tags.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import mlflow
import torch
from peft import LoraConfig, get_peft_model
from transformers import GPT2Config, GPT2LMHeadModel

from guardtower import EventBus, GuardedOptimizer, audit
from guardtower.bridges import MLflowBridge


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=64, n_positions=32, vocab_size=128,
                                      bos_token_id=0, eos_token_id=0))


def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="mlflow_tags_"))
    uri = f"sqlite:///{root / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment("guardtower-example")
    batch = torch.randint(0, 128, (8, 32), generator=torch.Generator().manual_seed(0))

    # run 1: the optimizer is built before get_peft_model -> the audit fails, the run is tagged
    with mlflow.start_run(run_name="lora-bug") as run:
        bus = EventBus([MLflowBridge(run.info.run_id, tracking_uri=uri)])
        base = tiny_gpt2()
        stale = torch.optim.AdamW(base.parameters(), lr=1e-3)
        model = get_peft_model(base, LoraConfig(r=8, target_modules=["c_attn"], fan_in_fan_out=True))
        report = audit(model, lambda: model(input_ids=batch, labels=batch), optimizer=stale, bus=bus)
        print(report)
        bus.close(30)
    bug_run = run.info.run_id

    # run 2: the fixed setup passes, then trains guarded; a spike at step 15 is skipped
    with mlflow.start_run(run_name="lora-fixed") as run:
        bus = EventBus([MLflowBridge(run.info.run_id, tracking_uri=uri)])
        model = get_peft_model(tiny_gpt2(), LoraConfig(r=8, target_modules=["c_attn"], fan_in_fan_out=True))
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        print(audit(model, lambda: model(input_ids=batch, labels=batch), optimizer=optimizer, bus=bus).summary())
        guarded = GuardedOptimizer(optimizer, model, warmup_steps=5, log_dir=root / "spikes", verbose=False, bus=bus)
        for step in range(1, 21):
            loss = model(input_ids=batch, labels=batch).loss
            (loss * (1e4 if step == 15 else 1.0)).backward()
            guarded.step(loss=loss)
            guarded.zero_grad()
        guarded.close()
        bus.close(30)
    fixed_run = run.info.run_id

    client = mlflow.MlflowClient(tracking_uri=uri)
    for name, run_id in (("lora-bug", bug_run), ("lora-fixed", fixed_run)):
        data = client.get_run(run_id).data
        tags = {k: v for k, v in data.tags.items() if k.startswith("guardtower")}
        metrics = {k: v for k, v in data.metrics.items() if k.startswith("guardtower")}
        print(f"{name}: tags {tags}")
        print(f"{' ' * len(name)}  metrics {metrics}")
    print(f"open the runs with: mlflow ui --backend-store-uri {uri}")


if __name__ == "__main__":
    main()
