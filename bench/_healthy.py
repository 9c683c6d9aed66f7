"""The healthy training configurations of ``bench/detection.py``: real models, real data, no network.

Each ``Config`` builds a fresh model, optimizer and LR schedule and yields batches. Language models read
the text of Python's standard library (bytes as tokens); classifiers use scikit-learn's bundled datasets.
Every loop config exposes ``loss(model, batch)`` and ``corrupt(model, batch)`` (the batch with every label
replaced by the class the model currently finds least likely: a corrupted batch that spikes the loss).
"""

from __future__ import annotations

import math
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import Tensor, nn

__all__ = ["Config", "CONFIGS", "stdlib_bytes", "lm_batches"]

SEQ, BATCH = 64, 8
_TEXT: list[Tensor] = []


def stdlib_bytes(limit: int = 3_000_000) -> Tensor:
    """The standard library's ``.py`` sources (sorted, concatenated) as a uint8 token stream."""
    if not _TEXT:
        root = Path(sysconfig.get_paths()["stdlib"])
        chunks: list[bytes] = []
        size = 0
        for path in sorted(root.rglob("*.py")):
            if "test" in path.parts or "site-packages" in path.parts:
                continue
            data = path.read_bytes()
            chunks.append(data)
            size += len(data)
            if size >= limit:
                break
        _TEXT.append(torch.frombuffer(bytearray(b"".join(chunks)[:limit]), dtype=torch.uint8).long())
    return _TEXT[0]


def lm_batches(seed: int) -> Iterator[dict[str, Tensor]]:
    """Random windows of the stdlib text, ``BATCH`` x ``SEQ`` tokens, forever."""
    text = stdlib_bytes()
    gen = torch.Generator().manual_seed(seed)
    while True:
        start = torch.randint(0, text.numel() - SEQ - 1, (BATCH,), generator=gen)
        yield {"input_ids": torch.stack([text[s:s + SEQ] for s in start.tolist()])}


def _classification_batches(x: Tensor, y: Tensor, batch: int, seed: int) -> Iterator[dict[str, Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(x.shape[0], generator=gen)
        for i in range(0, x.shape[0] - batch + 1, batch):
            idx = order[i:i + batch]
            yield {"x": x[idx], "y": y[idx]}


def _sklearn(name: str) -> tuple[Tensor, Tensor]:
    from sklearn import datasets

    bunch = getattr(datasets, f"load_{name}")()
    x = torch.tensor(bunch.data, dtype=torch.float32)
    x = (x - x.mean(0)) / x.std(0).clamp_min(1e-6)
    return x, torch.tensor(bunch.target, dtype=torch.long)


def _schedule(kind: str, steps: int, warmup: int = 30) -> Callable[[int], float]:
    """LR multiplier per step: ``constant`` from step 0, or linear ``warmup`` then cosine to 10%."""
    if kind == "constant":
        return lambda step: 1.0

    def warmup_cosine(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return warmup_cosine


# ---------------------------------------------------------------- models
def gpt2(layers: int = 4, hidden: int = 64) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=SEQ, n_embd=hidden, n_layer=layers, n_head=4,
                                      bos_token_id=0, eos_token_id=0, loss_type="ForCausalLM"))


def llama(layers: int = 4, hidden: int = 64) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden,
                                        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0,
                                        pad_token_id=0))


class NormMLP(nn.Module):
    """A deep pre-norm residual MLP: LayerNorm gains and biases everywhere."""

    def __init__(self, inputs: int, classes: int, width: int = 64, depth: int = 8) -> None:
        super().__init__()
        self.inp = nn.Linear(inputs, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU())
                                    for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.out = nn.Linear(width, classes)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.out(self.norm(h))


class PlainNormMLP(nn.Module):
    """A deep non-residual MLP, Linear -> LayerNorm -> Tanh per layer: no skip path, so a batch that moves one
    layer's pre-norm statistics swings the whole gradient (heavy-tailed global norm, loss nearly flat)."""

    def __init__(self, inputs: int, classes: int, width: int = 128, depth: int = 16) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(depth):
            layers += [nn.Linear(inputs if i == 0 else width, width), nn.LayerNorm(width), nn.Tanh()]
        self.body = nn.Sequential(*layers)
        self.out = nn.Linear(width, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.body(x))


class BNCNN(nn.Module):
    """A BatchNorm CNN for 8x8 digit images."""

    def __init__(self, classes: int = 10, width: int = 32) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.BatchNorm2d(2 * width), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Linear(2 * width * 4, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x.view(-1, 1, 8, 8)).flatten(1))


class GRULM(nn.Module):
    def __init__(self, vocab: int = 256, width: int = 96) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.rnn = nn.GRU(width, width, num_layers=2, batch_first=True)
        self.head = nn.Linear(width, vocab)

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.head(self.rnn(self.embed(input_ids))[0])


# ---------------------------------------------------------------- losses and corruptions
def _hf_lm_loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    ids = batch["input_ids"]
    return model(input_ids=ids, labels=batch.get("labels", ids)).loss


def _hf_lm_corrupt(model: nn.Module, batch: dict[str, Tensor]) -> dict[str, Tensor]:
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"]).logits
    labels = torch.cat([batch["input_ids"][:, :1], logits[:, :-1].argmin(-1)], 1)  # shifted inside the model
    return {"input_ids": batch["input_ids"], "labels": labels}


def _lm_loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    ids = batch["input_ids"]
    logits = model(ids[:, :-1])
    targets = batch.get("labels", ids)[:, 1:]
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _lm_corrupt(model: nn.Module, batch: dict[str, Tensor]) -> dict[str, Tensor]:
    ids = batch["input_ids"]
    with torch.no_grad():
        worst = model(ids[:, :-1]).argmin(-1)
    return {"input_ids": ids, "labels": torch.cat([ids[:, :1], worst], 1)}


def _cls_loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    return nn.functional.cross_entropy(model(batch["x"]), batch["y"])


def _cls_corrupt(model: nn.Module, batch: dict[str, Tensor]) -> dict[str, Tensor]:
    with torch.no_grad():
        worst = model(batch["x"]).argmin(-1)
    return {"x": batch["x"], "y": worst}


# ---------------------------------------------------------------- configurations
@dataclass
class Config:
    """One healthy run: ``build(seed)`` -> (model, optimizer, lr multiplier per step, batches)."""

    name: str
    family: str
    optimizer: str
    schedule: str
    steps: int
    build: Callable[[int], tuple[nn.Module, torch.optim.Optimizer, Callable[[int], float], Iterator[Any]]]
    loss: Callable[[nn.Module, Any], Tensor] = _cls_loss
    # None: no corrupted-batch incident (a model that has learnt nothing has no least likely class to feed it)
    corrupt: Callable[[nn.Module, Any], Any] | None = _cls_corrupt
    trainer: bool = False  # run through the HF Trainer (bench/_trainer_runs.py) instead of a plain loop
    notes: dict[str, Any] = field(default_factory=dict)


def _loop(model_fn: Callable[[], nn.Module], opt_fn: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
          schedule: str, steps: int, data: Callable[[int], Iterator[Any]]) -> Callable[[int], Any]:
    def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, Callable[[int], float], Iterator[Any]]:
        torch.manual_seed(seed)
        model = model_fn()
        return model, opt_fn(list(model.parameters())), _schedule(schedule, steps), data(seed)

    return build


def _digits(seed: int) -> Iterator[dict[str, Tensor]]:
    x, y = _sklearn("digits")
    return _classification_batches(x, y, 32, seed)


def _cancer(seed: int) -> Iterator[dict[str, Tensor]]:
    x, y = _sklearn("breast_cancer")
    return _classification_batches(x, y, 32, seed)


def _wine(seed: int) -> Iterator[dict[str, Tensor]]:
    x, y = _sklearn("wine")
    return _classification_batches(x, y, 16, seed)


def _random_labels(seed: int) -> Iterator[dict[str, Tensor]]:
    """Gaussian inputs with random labels (10 classes): nothing to learn, the loss stays nearly flat."""
    gen = torch.Generator().manual_seed(1000 + seed)
    x = torch.randn(2000, 32, generator=gen)
    return _classification_batches(x, torch.randint(0, 10, (2000,), generator=gen), 32, seed)


def lora_gpt2() -> nn.Module:
    """A peft LoRA (r=4 on the attention projections) of the GPT-2 above, base frozen."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(gpt2(), LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True,
                                             lora_dropout=0.0))


def _adamw(lr: float) -> Callable[[list[nn.Parameter]], torch.optim.Optimizer]:
    return lambda params: torch.optim.AdamW([p for p in params if p.requires_grad], lr=lr, weight_decay=0.01)


def _sgd(lr: float) -> Callable[[list[nn.Parameter]], torch.optim.Optimizer]:
    return lambda params: torch.optim.SGD(params, lr=lr, momentum=0.9)


CONFIGS: list[Config] = [
    Config("gpt2-adamw-const3e-3", "gpt2", "AdamW 3e-3", "constant", 400,
           _loop(gpt2, _adamw(3e-3), "constant", 400, lm_batches), _hf_lm_loss, _hf_lm_corrupt),
    Config("llama-adamw-cosine1e-3", "llama", "AdamW 1e-3", "warmup+cosine", 400,
           _loop(llama, _adamw(1e-3), "warmup+cosine", 400, lm_batches), _hf_lm_loss, _hf_lm_corrupt),
    Config("llama-adamw-const2e-3", "llama", "AdamW 2e-3", "constant", 300,
           _loop(llama, _adamw(2e-3), "constant", 300, lm_batches), _hf_lm_loss, _hf_lm_corrupt),
    Config("gru-rmsprop-const2e-3", "gru", "RMSprop 2e-3", "constant", 400,
           _loop(GRULM, lambda p: torch.optim.RMSprop(p, lr=2e-3), "constant", 400, lm_batches), _lm_loss,
           _lm_corrupt),
    Config("mlp-ln-digits-sgd-const", "mlp-layernorm", "SGD+momentum 0.05", "constant", 600,
           _loop(lambda: NormMLP(64, 10), _sgd(0.05), "constant", 600, _digits)),
    Config("mlp-ln-cancer-adagrad-cosine", "mlp-layernorm", "Adagrad 2e-2", "warmup+cosine", 500,
           _loop(lambda: NormMLP(30, 2), lambda p: torch.optim.Adagrad(p, lr=2e-2), "warmup+cosine", 500, _cancer)),
    Config("mlp-ln-wine-adamw-const", "mlp-layernorm", "AdamW 3e-3", "constant", 500,
           _loop(lambda: NormMLP(13, 3, depth=6), _adamw(3e-3), "constant", 500, _wine)),
    Config("mlp-plain-ln-random-adamw-const1e-3", "mlp-layernorm, no residual", "AdamW 1e-3", "constant", 300,
           _loop(lambda: PlainNormMLP(32, 10), _adamw(1e-3), "constant", 300, _random_labels), corrupt=None),
    Config("lora-gpt2-adamw-const1e-3", "gpt2+peft LoRA", "AdamW 1e-3", "constant", 300,
           _loop(lora_gpt2, _adamw(1e-3), "constant", 300, lm_batches), _hf_lm_loss, None),
    Config("cnn-bn-digits-sgd-cosine", "cnn-batchnorm", "SGD+momentum 0.05", "warmup+cosine", 500,
           _loop(BNCNN, _sgd(0.05), "warmup+cosine", 500, _digits)),
    Config("cnn-bn-digits-adamw-const", "cnn-batchnorm", "AdamW 2e-3", "constant", 500,
           _loop(BNCNN, _adamw(2e-3), "constant", 500, _digits)),
]
