"""The HF callback hands each optimizer step's loss to the guard (a real Trainer on a tiny GPT-2)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from guardtower.events import SummaryEvent
from guardtower.testing import capture_events
from _hf_helpers import TokenDataset, tiny_gpt2, training_args

from transformers import Trainer, TrainerCallback  # noqa: E402

from guardtower.integrations.huggingface import StabilityGuardCallback  # noqa: E402

pytestmark = pytest.mark.slow


class _Losses(TrainerCallback):  # type: ignore[misc]
    """The loss of every training forward, grouped by the optimizer step it belongs to."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.step = 0
        self.by_step: dict[int, list[float]] = {}
        model.register_forward_hook(self._hook)

    def _hook(self, module: Any, args: Any, output: Any) -> None:
        if module.training:
            self.by_step.setdefault(self.step + 1, []).append(float(output.loss.detach()))

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.step = state.global_step


@pytest.mark.parametrize("accumulation", [1, 2])
def test_the_guard_gets_the_mean_loss_of_each_optimizer_step(tmp_path: Path, accumulation: int) -> None:
    torch.set_num_threads(1)
    model = tiny_gpt2()
    losses = _Losses(model)
    guard_cb = StabilityGuardCallback(log_every=1, log_dir=str(tmp_path / "sg"), verbose=False)
    args = training_args(tmp_path, max_steps=6, per_device_train_batch_size=8 // accumulation,
                         gradient_accumulation_steps=accumulation)
    trainer = Trainer(model=model, args=args, train_dataset=TokenDataset(), callbacks=[losses, guard_cb])
    with capture_events() as events:
        trainer.train()
    seen = {e.step: e.loss for e in events if isinstance(e, SummaryEvent) and e.step is not None and e.step <= 6}
    assert sorted(seen) == [1, 2, 3, 4, 5, 6]
    for step, loss in seen.items():
        expected = sum(losses.by_step[step]) / len(losses.by_step[step])
        assert len(losses.by_step[step]) == accumulation
        assert loss == pytest.approx(expected, rel=1e-5)
    guard_cb.close()
