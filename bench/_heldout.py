"""Held-out healthy runs of ``bench/detection.py --set heldout``: model families the default detector was
never tuned on, kept apart so its false-alarm rate can be measured blind after a change to its rules.

A plain CNN (no BatchNorm) on scikit-learn digits, an LSTM language model on the standard library's text,
a BERT-tiny masked LM, a ViT-tiny on generated images and a T5-tiny seq2seq (reverse a byte span), all built
from configs in code; 300 steps from step 0, AdamW or SGD, constant LR or warmup+cosine.
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch import Tensor, nn

from _healthy import SEQ, BATCH, Config, _adamw, _digits, _loop, _sgd, lm_batches, stdlib_bytes

__all__ = ["HELDOUT"]

_STEPS = 300


class PlainCNN(nn.Module):
    """A CNN without normalisation for 8x8 digit images."""

    def __init__(self, classes: int = 10, width: int = 32) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, width, 3, padding=1), nn.ReLU(),
                                      nn.Conv2d(width, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                      nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Linear(2 * width * 4, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x.view(-1, 1, 8, 8)).flatten(1))


class LSTMLM(nn.Module):
    def __init__(self, vocab: int = 256, width: int = 96) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.rnn = nn.LSTM(width, width, num_layers=2, batch_first=True)
        self.head = nn.Linear(width, vocab)

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.head(self.rnn(self.embed(input_ids))[0])


def _lm_loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    ids = batch["input_ids"]
    logits = model(ids[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, 256), batch.get("labels", ids)[:, 1:].reshape(-1))


def _lm_corrupt(model: nn.Module, batch: dict[str, Tensor]) -> dict[str, Tensor]:
    ids = batch["input_ids"]
    with torch.no_grad():
        worst = model(ids[:, :-1]).argmin(-1)
    return {"input_ids": ids, "labels": torch.cat([ids[:, :1], worst], 1)}


# ---------------------------------------------------------------- BERT-tiny masked LM
_MASK = 1  # byte 1 never occurs in the stdlib text


def bert_mlm() -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    return BertForMaskedLM(BertConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                      intermediate_size=128, max_position_embeddings=SEQ))


def _mlm_batches(seed: int) -> Iterator[dict[str, Tensor]]:
    gen = torch.Generator().manual_seed(seed + 7)
    for batch in lm_batches(seed):
        ids = batch["input_ids"]
        masked = torch.rand(ids.shape, generator=gen) < 0.15
        yield {"input_ids": torch.where(masked, torch.full_like(ids, _MASK), ids),
               "labels": torch.where(masked, ids, torch.full_like(ids, -100))}


def _hf_loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    return model(**batch).loss


def _mlm_corrupt(model: nn.Module, batch: dict[str, Tensor]) -> dict[str, Tensor]:
    with torch.no_grad():
        worst = model(input_ids=batch["input_ids"]).logits.argmin(-1)
    labels = batch["labels"]
    return {"input_ids": batch["input_ids"], "labels": torch.where(labels >= 0, worst, labels)}


# ---------------------------------------------------------------- ViT-tiny on generated images
def vit() -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    return ViTForImageClassification(ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=64,
                                               num_hidden_layers=3, num_attention_heads=4, intermediate_size=128,
                                               num_labels=4))


def _images(seed: int) -> Iterator[dict[str, Tensor]]:
    """Noisy images of 4 classes: a bright square in one quadrant (a learnable, not trivial, task)."""
    gen = torch.Generator().manual_seed(seed + 11)
    while True:
        labels = torch.randint(0, 4, (16,), generator=gen)
        x = torch.randn(16, 3, 16, 16, generator=gen)
        for i, label in enumerate(labels.tolist()):
            r, c = divmod(label, 2)
            x[i, :, 8 * r:8 * r + 8, 8 * c:8 * c + 8] += 0.8
        yield {"pixel_values": x, "labels": labels}


def _image_corrupt(model: nn.Module, batch: dict[str, Tensor]) -> dict[str, Tensor]:
    with torch.no_grad():
        worst = model(pixel_values=batch["pixel_values"]).logits.argmin(-1)
    return {"pixel_values": batch["pixel_values"], "labels": worst}


# ---------------------------------------------------------------- T5-tiny seq2seq: reverse a byte span
def t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    return T5ForConditionalGeneration(T5Config(vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                               num_decoder_layers=2, num_heads=4, decoder_start_token_id=0,
                                               pad_token_id=0, eos_token_id=1))


def _reverse_batches(seed: int) -> Iterator[dict[str, Tensor]]:
    text = stdlib_bytes()
    gen = torch.Generator().manual_seed(seed + 13)
    span = 24
    while True:
        start = torch.randint(0, text.numel() - span, (BATCH,), generator=gen)
        ids = torch.stack([text[s:s + span] for s in start.tolist()])
        yield {"input_ids": ids, "labels": ids.flip(1)}


def _seq2seq_corrupt(model: nn.Module, batch: dict[str, Tensor]) -> dict[str, Tensor]:
    with torch.no_grad():
        worst = model(**batch).logits.argmin(-1)
    return {"input_ids": batch["input_ids"], "labels": worst}


HELDOUT: list[Config] = [
    Config("cnn-plain-digits-sgd-cosine", "cnn (no norm)", "SGD+momentum 0.02", "warmup+cosine", _STEPS,
           _loop(PlainCNN, _sgd(0.02), "warmup+cosine", _STEPS, _digits)),
    Config("lstm-adamw-const2e-3", "lstm", "AdamW 2e-3", "constant", _STEPS,
           _loop(LSTMLM, _adamw(2e-3), "constant", _STEPS, lm_batches), _lm_loss, _lm_corrupt),
    Config("bert-tiny-mlm-adamw-cosine1e-3", "bert mlm", "AdamW 1e-3", "warmup+cosine", _STEPS,
           _loop(bert_mlm, _adamw(1e-3), "warmup+cosine", _STEPS, _mlm_batches), _hf_loss, _mlm_corrupt),
    Config("vit-tiny-images-adamw-const1e-3", "vit", "AdamW 1e-3", "constant", _STEPS,
           _loop(vit, _adamw(1e-3), "constant", _STEPS, _images), _hf_loss, _image_corrupt),
    Config("t5-tiny-reverse-adamw-const2e-3", "t5 seq2seq", "AdamW 2e-3", "constant", _STEPS,
           _loop(t5, _adamw(2e-3), "constant", _STEPS, _reverse_batches), _hf_loss, _seq2seq_corrupt),
]
