"""The flagship configurations: real HF ``Trainer`` runs, a peft LoRA fine-tune and a full encoder fine-tune.

``record_trainer`` runs the Trainer unguarded and records, at every optimizer step, the norms the guard
would judge (its own ``GradMeter``, before clipping: the Trainer's clipping is moved behind the recording,
as ``StabilityGuardCallback`` moves it behind the guard) and the training loss. ``live_trainer`` runs the
same configuration with ``StabilityGuardCallback()`` at its defaults.
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor, nn

from _healthy import SEQ, gpt2, stdlib_bytes
from _trace import Incident, Trace, global_of, param_names, synthetic
from guardtower.errors import GradientSpikeError
from guardtower.guard._measure import GradMeter

__all__ = ["TrainerConfig", "TRAINER_CONFIGS", "record_trainer", "live_trainer"]


class _Windows(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Fixed random windows of the stdlib text; ``label`` turns a window into a classification example."""

    def __init__(self, n: int, seed: int, label: Callable[[Tensor], int] | None = None) -> None:
        text = stdlib_bytes()
        gen = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, text.numel() - SEQ - 1, (n,), generator=gen).tolist()
        self.ids = torch.stack([text[s:s + SEQ] for s in starts])
        self.label = label

    def __len__(self) -> int:
        return self.ids.shape[0]

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        ids = self.ids[i]
        if self.label is None:
            return {"input_ids": ids, "labels": ids}
        return {"input_ids": ids, "labels": torch.tensor(self.label(ids))}


def _has_self(ids: Tensor) -> int:
    """1 when the window mentions ``self``: a learnable, roughly balanced label of stdlib code."""
    return int(b"self" in bytes(ids.to(torch.uint8).tolist()))


def _lora_gpt2(seed: int) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    return get_peft_model(gpt2(), LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn", "c_proj"],
                                             fan_in_fan_out=True, lora_dropout=0.0))


def _bert(seed: int) -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    return BertForSequenceClassification(BertConfig(vocab_size=256, hidden_size=64, num_hidden_layers=4,
                                                    num_attention_heads=4, intermediate_size=128,
                                                    max_position_embeddings=SEQ, num_labels=2))


@dataclass
class TrainerConfig:
    name: str
    family: str
    optimizer: str
    schedule: str
    steps: int
    model: Callable[[int], nn.Module]
    label: Callable[[Tensor], int] | None
    args: dict[str, Any]


TRAINER_CONFIGS = [
    TrainerConfig("lora-gpt2-trainer", "gpt2+peft LoRA (HF Trainer)", "AdamW 1e-3 (Trainer)",
                  "warmup 30 + linear", 300, _lora_gpt2, None, {"learning_rate": 1e-3, "warmup_steps": 30}),
    TrainerConfig("bert-cls-trainer", "BERT classifier, full FT (HF Trainer)", "AdamW 5e-4 (Trainer)",
                  "linear from step 0", 300, _bert, _has_self, {"learning_rate": 5e-4}),
]


def _args(out: str, config: TrainerConfig, seed: int) -> Any:
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=out, per_device_train_batch_size=8, max_steps=config.steps, logging_steps=50,
                             report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True,
                             dataloader_num_workers=0, seed=seed, **config.args)


def _trainer(config: TrainerConfig, seed: int, out: str, callbacks: list[Any]) -> Any:
    from transformers import Trainer

    model = config.model(seed)
    data = _Windows(config.steps * 8, seed, config.label)
    return Trainer(model=model, args=_args(out, config, seed), train_dataset=data, callbacks=callbacks)


class _Recorder:
    """A TrainerCallback that records the guard's view of every optimizer step, then clips as the Trainer would."""

    def __init__(self, incidents: dict[int, tuple[str, str]]) -> None:
        self.incidents = incidents
        self.rows: list[Tensor] = []
        self.losses: list[Tensor] = []
        self.found: list[Incident] = []
        self.params: list[Tensor] = []
        self.names: list[str] = []
        self._loss = torch.tensor(math.nan)
        self._max_norm = 0.0

    def callback(self) -> Any:
        from transformers import TrainerCallback

        recorder = self

        class Callback(TrainerCallback):  # type: ignore[misc]
            def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                               **kwargs: Any) -> None:
                inner = optimizer.optimizer
                recorder.params = [p for g in inner.param_groups for p in g["params"]]
                recorder.names = param_names(model, recorder.params)
                recorder._max_norm, args.max_grad_norm = float(args.max_grad_norm), 0.0
                model.register_forward_hook(lambda m, i, out: recorder._keep(out))

            def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                recorder._record(state.global_step)

        return Callback()

    def _keep(self, out: Any) -> None:
        loss = getattr(out, "loss", None)
        if isinstance(loss, Tensor) and loss.requires_grad:
            self._loss = loss.detach().float()

    def _record(self, step: int) -> None:
        norms = GradMeter(torch.device("cpu")).norms(self.params).detach().clone()
        self.rows.append(norms)
        self.losses.append(self._loss)
        plan = self.incidents.get(step)
        if plan is not None and plan[0] != "batch":
            sizes = [(p.numel(), i) for i, p in enumerate(self.params) if p.requires_grad]
            bad = synthetic(plan[0], norms, {"small": min(sizes)[1], "large": max(sizes)[1]})
            self.found.append(Incident(step, plan[0], plan[1], bad, global_of(bad), self._loss))
        if self._max_norm > 0:
            torch.nn.utils.clip_grad_norm_([p for p in self.params if p.grad is not None], self._max_norm)


def record_trainer(config: TrainerConfig, seed: int, incidents: dict[int, tuple[str, str]]) -> Trace:
    recorder = _Recorder(incidents)
    with tempfile.TemporaryDirectory() as out:
        _trainer(config, seed, out, [recorder.callback()]).train()
    norms = torch.stack(recorder.rows)
    loss = torch.stack(recorder.losses)
    return Trace(config.name, recorder.names, norms, global_of(norms), loss, recorder.found,
                 float(loss[-20:].mean()), not bool(torch.isfinite(loss).all()))


@dataclass
class TrainerLive:
    steps: int
    rejected: int
    stopped: bool
    final_loss: float


def live_trainer(config: TrainerConfig, seed: int) -> TrainerLive:
    """The same run through ``StabilityGuardCallback()`` at its defaults."""
    from guardtower.integrations.huggingface import StabilityGuardCallback

    with tempfile.TemporaryDirectory() as out:
        callback = StabilityGuardCallback(log_dir=f"{out}/sg_logs", verbose=False)
        trainer = _trainer(config, seed, out, [callback])
        stopped = False
        try:
            trainer.train()
        except GradientSpikeError:
            stopped = True
        guard = callback.guard
        assert guard is not None
        guard.flush()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        result = TrainerLive(trainer.state.global_step, guard.total_spikes, stopped,
                             float(losses[-1]) if losses else math.nan)
        callback.close()
    return result
