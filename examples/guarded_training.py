"""A plain PyTorch loop with a pre-flight audit and a GuardedOptimizer (CPU, a few seconds).

Two faults are injected: a NaN batch at step 30 and a gradient spike at step 45. The guard skips both
updates; the events and spike reports land in a temporary log_dir, and `guardtower report` lists them.

    python examples/guarded_training.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from torch import nn

from guardtower import GuardedOptimizer, JsonlSink, audit
from guardtower.incidents import main as report


def main() -> None:
    torch.manual_seed(0)
    log_dir = Path(tempfile.mkdtemp(prefix="guarded_training_"))
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1))
    x = torch.randn(2048, 16)
    y = x[:, :4].sum(dim=1, keepdim=True) + 0.1 * torch.randn(2048, 1)

    # 1. pre-flight: one instrumented step on one batch; the training state is left exactly as it was
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    batch_x, batch_y = x[:64], y[:64]
    report_ = audit(model, lambda: nn.functional.mse_loss(model(batch_x), batch_y), optimizer=optimizer)
    print(report_)
    report_.raise_if_errors()

    # 2. guarded training: every step's gradients are judged before the update reaches the weights
    guarded = GuardedOptimizer(optimizer, model, spike_threshold=10.0, nan_action="skip", warmup_steps=10,
                               log_dir=log_dir, log_every=10, verbose=False,
                               sinks=[JsonlSink(log_dir / "events.jsonl")])
    for step in range(1, 81):
        idx = torch.randint(0, len(x), (64,))
        inputs, target = x[idx], y[idx]
        if step == 30:
            inputs = inputs * float("nan")  # a corrupted batch
        if step == 45:
            target = target * 1e4  # a batch of garbage labels: a gradient spike
        loss = nn.functional.mse_loss(model(inputs), target)
        loss.backward()
        guarded.step(loss=loss)
        guarded.zero_grad()
    guarded.close()
    final = nn.functional.mse_loss(model(x), y).item()
    print(f"final loss {final:.4f}; {guarded.total_skips} step(s) skipped, weights finite: "
          f"{all(torch.isfinite(p).all() for p in model.parameters())}")

    # 3. the incidents, as `guardtower report <log_dir>` prints them
    report([str(log_dir)])


if __name__ == "__main__":
    main()
