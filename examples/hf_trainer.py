"""The Hugging Face Trainer with a pre-flight audit and a guarded optimizer (CPU, no hub, a few seconds).

A tiny GPT-2 built from a config trains on an in-memory dataset. ``GuardtowerCallback`` audits the model on
the first real batch (raise_on_error=True would stop train() on a FAIL before any weight changes);
``StabilityGuardCallback`` guards every optimizer step, and a gradient spike injected at step 12 is
skipped. The Trainer's logs carry guardtower/skipped_steps.

    pip install "guardtower[hf]"
    python examples/hf_trainer.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from guardtower.integrations.huggingface import GuardtowerCallback, StabilityGuardCallback
from guardtower.sinks import JsonlSink


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 256, seq_len: int = 32, vocab: int = 128) -> None:
        self.ids = torch.randint(0, vocab, (n, seq_len), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class SpikeAt(TrainerCallback):
    """Simulates a hardware fault: the final hidden state is scaled 10,000x during one step."""

    def __init__(self, model: GPT2LMHeadModel, step: int) -> None:
        self.step, self.active = step, False
        model.transformer.ln_f.register_forward_hook(lambda m, i, o: o * 1e4 if self.active else o)

    def on_step_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        self.active = state.global_step + 1 == self.step


def main() -> None:
    out = Path(tempfile.mkdtemp(prefix="hf_trainer_"))
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=64, n_positions=32, vocab_size=128,
                                       bos_token_id=0, eos_token_id=0))
    events = JsonlSink(out / "events.jsonl")
    preflight = GuardtowerCallback(raise_on_error=True, sinks=[events])
    guard = StabilityGuardCallback(spike_threshold=10.0, nan_action="skip", warmup_steps=5,
                                   log_dir=str(out / "spikes"), verbose=False, sinks=[events])
    args = TrainingArguments(output_dir=str(out), max_steps=20, per_device_train_batch_size=8, learning_rate=1e-3,
                             logging_steps=5, report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[SpikeAt(model, 12), preflight, guard])
    trainer.train()

    assert preflight.report is not None
    print(f"pre-flight: {preflight.report.summary()}")
    print(f"guard: {guard.guard.total_spikes if guard.guard else 0} spike(s) skipped")
    logged = [h for h in trainer.state.log_history if "guardtower/skipped_steps" in h]
    print(f"last Trainer log: step {logged[-1]['step']}, guardtower/skipped_steps={logged[-1]['guardtower/skipped_steps']}")
    print(f"events: guardtower report {out}")


if __name__ == "__main__":
    main()
