"""Tiny real models and a bitwise training-state fingerprint for the audit-core tests."""

from __future__ import annotations

import random
import sys
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 97

#: what a trigger or clean case builds: the model, its step and the audit() keyword arguments
Case = tuple[nn.Module, Callable[[], Any], dict[str, Any]]


def case_registry() -> tuple[dict[str, Callable[[bool], Case]], Callable[[str], Callable[[Callable[[bool], Case]], Callable[[bool], Case]]]]:
    """A fresh ``CASES`` dict and the ``@case(key)`` decorator that fills it (key: catalog id, optionally
    ``ID/variant``); each test module keeps its own registry."""
    cases: dict[str, Callable[[bool], Case]] = {}

    def case(key: str) -> Callable[[Callable[[bool], Case]], Callable[[bool], Case]]:
        def register(fn: Callable[[bool], Case]) -> Callable[[bool], Case]:
            cases[key] = fn
            return fn

        return register

    return cases, case


def quiet_transformers() -> None:
    import transformers

    transformers.logging.set_verbosity_error()


def mlp(d_in: int = 8, hidden: int = 32, d_out: int = 1, *, act: nn.Module | None = None) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(d_in, hidden), act or nn.ReLU(inplace=True), nn.Dropout(0.1), nn.Linear(hidden, d_out))


class SmallCNN(nn.Module):
    """Conv + BatchNorm + in-place ReLU classifier, the CIFAR-style baseline."""

    def __init__(self, classes: int = 5) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.head = nn.Linear(8, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.relu(self.bn(self.conv(x)))
        return self.head(h.mean(dim=(2, 3)))


def gpt2(**overrides: Any) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    quiet_transformers()
    torch.manual_seed(0)
    cfg = dict(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32, bos_token_id=0, eos_token_id=0,
               pad_token_id=0)
    cfg.update(overrides)
    return GPT2LMHeadModel(GPT2Config(**cfg))


def llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    quiet_transformers()
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                                        bos_token_id=0, eos_token_id=0, pad_token_id=0))


def bert_mlm() -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    quiet_transformers()
    torch.manual_seed(0)
    return BertForMaskedLM(BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                      intermediate_size=64, max_position_embeddings=32, pad_token_id=0))


def token_batch(batch: int = 4, seq: int = 8, *, pad_last: int = 0, seed: int = 1) -> dict[str, torch.Tensor]:
    """input_ids/attention_mask/labels as a collator builds them (padding labelled -100)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    if pad_last:
        ids[-1, -pad_last:] = 0
        mask[-1, -pad_last:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def regression_batch(n: int = 16, d: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return torch.randn(n, d, generator=g), torch.randn(n, 1, generator=g)


def train_a_bit(model: nn.Module, opt: torch.optim.Optimizer, step_fn: Any, steps: int = 2) -> None:
    """Real optimizer steps so Adam has state and BatchNorm running stats moved."""
    for _ in range(steps):
        opt.zero_grad()
        loss = step_fn()
        loss = getattr(loss, "loss", loss)
        loss.backward()
        opt.step()


def _bits(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def fingerprint(model: nn.Module, optimizer: Any = None, inputs: Any = None) -> dict[str, Any]:
    """Everything the audit promises to leave bitwise identical, as comparable plain values."""
    fp: dict[str, Any] = {
        "params": {n: (_bits(p), p.dtype, p.requires_grad) for n, p in model.named_parameters()},
        "param_ids": [id(p) for p in model.parameters()],
        "buffers": {n: _bits(b) for n, b in model.named_buffers()},
        "grads": {n: (None if p.grad is None else (id(p.grad), _bits(p.grad))) for n, p in model.named_parameters()},
        "training": {n: m.training for n, m in model.named_modules()},
        "torch_rng": _bits(torch.get_rng_state()),
        "py_rng": random.getstate(),
        "grad_enabled": torch.is_grad_enabled(),
    }
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        state = numpy.random.get_state()
        fp["np_rng"] = (state[0], state[1].tobytes(), state[2:])
    if optimizer is not None:
        fp["opt_state"] = {
            i: {k: (_bits(v) if isinstance(v, torch.Tensor) else v) for k, v in optimizer.state[p].items()}
            for i, p in enumerate(q for g in optimizer.param_groups for q in g["params"]) if p in optimizer.state
        }
        fp["opt_groups"] = [
            {k: (_bits(v) if isinstance(v, torch.Tensor) else v) for k, v in g.items() if k != "params"}
            | {"params": [id(p) for p in g["params"]]}
            for g in optimizer.param_groups
        ]
        fp["opt_state_keys"] = len(optimizer.state)
    if inputs is not None:
        tensors = inputs.values() if isinstance(inputs, dict) else inputs
        fp["inputs"] = [(t.requires_grad, None if t.grad is None else _bits(t.grad), _bits(t)) for t in tensors]
    return fp


def relu_cls_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor):  # type: ignore[no-untyped-def]
    return lambda: F.cross_entropy(model(x), y)


def sgd_step(model: nn.Module, opt: torch.optim.Optimizer,
             loss_fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """One plain training step as users write it: zero_grad, forward + loss, backward, step (``step_fn`` runs
    the backward itself)."""

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = loss_fn()
        loss.backward()
        opt.step()
        return loss

    return step
