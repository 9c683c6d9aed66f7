"""An HF Trainer run with a bad sample, for tests/test_hf_incidents.py: in the test process, and as a script that
is killed with SIGKILL after its checkpoint.

64 samples read in order, 4 per micro-batch, 2 micro-batches per optimizer step: 8 steps per epoch. Sample
``BAD`` holds the token ``MARK``, which the embedding turns into NaN: micro-batch 5 of every epoch, so steps 3
and 11 go NaN (deterministically: a recompute reproduces it). Usage: python _hf_incident_run.py OUT (a run
that checkpoints at step 6 and kills itself at step 13).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _hf_helpers import TokenDataset, snapshot, tiny_gpt2, training_args  # noqa: E402
from transformers import Trainer, TrainerCallback  # noqa: E402

from guardtower.integrations.huggingface import StabilityGuardCallback  # noqa: E402
from guardtower.testing import capture_events  # noqa: E402

MARK = 64  # outside the dataset's random tokens (0..63)
BAD = 20  # sample 20: micro-batch 5 of each epoch, the second micro-batch of step 3 (and of step 11)
SAVE_AT, KILL_AT, STEPS = 6, 13, 16


class Poison:
    """NaN from the embedding wherever the input holds ``MARK`` (a bad sample), and once, on demand, for the
    whole of one forward (a transient fault). Counts the training forwards and those that saw ``MARK``."""

    def __init__(self, model: Any) -> None:
        self.forwards = 0
        self.bad_forwards = 0
        self.once = False
        model.transformer.wte.register_forward_hook(self._hook)

    def _hook(self, module: Any, args: Any, out: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return out
        self.forwards += 1
        marked = (args[0] == MARK).unsqueeze(-1)
        self.bad_forwards += int(marked.any())
        if self.once:
            self.once = False
            return out * float("nan")
        return out.masked_fill(marked, float("nan"))


class Steps(TrainerCallback):  # type: ignore[misc]
    """Arms the transient fault at ``transient_at``; counts the training forwards per step; kills at ``kill_at``."""

    def __init__(self, poison: Poison, transient_at: int | None, kill_at: int | None) -> None:
        self.poison, self.transient_at, self.kill_at = poison, transient_at, kill_at
        self.forwards: dict[int, int] = {}
        self._before = 0

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._before = self.poison.forwards
        self.poison.once = state.global_step + 1 == self.transient_at

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.forwards[state.global_step] = self.poison.forwards - self._before
        if state.global_step == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)  # a real kill: no on_train_end, no close(), no flush


def dataset() -> TokenDataset:
    data = TokenDataset()
    data.ids[BAD, 3] = MARK
    return data


def run(out: Path, *, resume: str | None = None, kill_at: int | None = None, transient_at: int | None = None,
        steps: int = STEPS, batch_size: int = 4, **guard: Any) -> dict[str, Any]:
    """Train (``batch_size`` samples per micro-batch); return the events, the callback, the weights and the
    per-step forward counts."""
    model = tiny_gpt2(seed=1 if resume else 0, vocab=MARK + 1)  # resumed: other weights until the checkpoint loads
    poison = Poison(model)
    counter = Steps(poison, transient_at, kill_at)
    callback = StabilityGuardCallback(warmup_steps=2, log_dir=str(out / "sg"), verbose=False, **guard)
    args = training_args(out, max_steps=steps, per_device_train_batch_size=batch_size, gradient_accumulation_steps=2,
                         train_sampling_strategy="sequential", lr_scheduler_type="linear", save_strategy="steps",
                         save_steps=SAVE_AT)
    trainer = Trainer(model=model, args=args, train_dataset=dataset(), callbacks=[counter, callback])
    with capture_events() as events:
        trainer.train(resume_from_checkpoint=resume)
    callback.close()
    return {"events": list(events), "callback": callback, "weights": snapshot(model), "poison": poison,
            "forwards": counter.forwards}


if __name__ == "__main__":
    torch.set_num_threads(1)
    run(Path(sys.argv[1]), kill_at=KILL_AT)
    raise SystemExit("not killed")
