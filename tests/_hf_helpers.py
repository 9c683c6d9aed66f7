"""Shared fixtures for the Hugging Face tests: a tiny GPT-2 from a config and an in-memory dataset."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


class TokenDataset(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Fixed random token sequences as dicts, the way a tokenized dataset hands them to the Trainer."""

    def __init__(self, n: int = 64, seq_len: int = 16, vocab: int = 64, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, seq_len), generator=gen)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_gpt2(seed: int = 0, vocab: int = 64) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=32, vocab_size=vocab, bos_token_id=0,
                        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


def training_args(out: Path, **overrides: Any) -> Any:
    from transformers import TrainingArguments

    kwargs: dict[str, Any] = dict(
        output_dir=str(out), per_device_train_batch_size=8, max_steps=10, learning_rate=1e-3,
        logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0, seed=0, lr_scheduler_type="constant",
    )
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
