"""Shared fixtures for the LoRA and distributed audit tests: tiny real transformers / peft models."""

from __future__ import annotations

import warnings
from typing import Any, Callable, Iterable

import torch
from torch import nn

from guardtower.report import Report

VOCAB = 100


def quiet() -> None:
    """Silence transformers' config chatter about tiny vocabularies."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    import transformers

    transformers.logging.set_verbosity_error()


def tiny_gpt2(seed: int = 0) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    quiet()
    torch.manual_seed(seed)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=64, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def llama_config(**kw: Any) -> Any:
    from transformers import LlamaConfig

    base = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    base.update(kw)
    return LlamaConfig(**base)


def tiny_llama(seed: int = 0, **kw: Any) -> nn.Module:
    from transformers import LlamaForCausalLM

    quiet()
    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config(**kw))


def tiny_llama_cls(seed: int = 0) -> nn.Module:
    from transformers import LlamaForSequenceClassification

    quiet()
    torch.manual_seed(seed)
    return LlamaForSequenceClassification(llama_config(num_labels=2))


def tiny_bert_cls(seed: int = 0) -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    quiet()
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        num_labels=3,
    )
    return BertForSequenceClassification(config)


def lora(model: nn.Module, **kw: Any) -> nn.Module:
    """get_peft_model with a small LoraConfig; keyword arguments override the defaults."""
    from peft import LoraConfig, get_peft_model

    config = dict(r=4, lora_alpha=8, lora_dropout=0.0)
    config.update(kw)
    return get_peft_model(model, LoraConfig(**config))


def lm_batch(seed: int = 0, batch: int = 2, length: int = 8) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=g)


def lm_step(model: nn.Module, ids: torch.Tensor) -> Callable[[], Any]:
    return lambda: model(input_ids=ids, labels=ids)


def cls_step(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> Callable[[], Any]:
    return lambda: model(input_ids=ids, labels=labels)


def run_audit(
    model: nn.Module,
    step_fn: Callable[[], Any],
    *,
    optimizer: torch.optim.Optimizer | None = None,
    checks: str | Iterable[str] = "all",
) -> Report:
    """The public entry point, end to end (snapshot, probes, step, checks, restore)."""
    from guardtower.preflight import audit

    return audit(model, step_fn, optimizer=optimizer, checks=checks)


def ids(report: Report) -> set[str]:
    return {f.catalog_id for f in report.findings}


def loralib_llama_cls(*, r: int = 4, mark_only_lora: bool = True, targets: tuple[str, ...] = ("q_proj", "v_proj"),
                      layers: Iterable[int] | None = None) -> nn.Module:
    """A tiny Llama classifier adapted the loralib way (microsoft/LoRA): ``q_proj``/``v_proj`` replaced by
    ``loralib.Linear`` carrying the original weights, then ``mark_only_lora_as_trainable`` (unless
    ``mark_only_lora=False``: the step users forget) and the new ``score`` head unfrozen."""
    import loralib

    model = tiny_llama_cls()
    blocks = model.model.layers
    for i in range(len(blocks)) if layers is None else layers:
        attn = blocks[i].self_attn
        for name in targets:
            old = getattr(attn, name)
            new = loralib.Linear(old.in_features, old.out_features, r=r, lora_alpha=2 * r, bias=False)
            new.weight.data.copy_(old.weight.data)
            setattr(attn, name, new)
    if mark_only_lora:
        loralib.mark_only_lora_as_trainable(model)
        model.score.requires_grad_(True)
    return model
