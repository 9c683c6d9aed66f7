"""Duck-typed introspection of PEFT / LoRA models, without importing peft.

peft is optional: everything here reads class names, attributes (``peft_config``, ``lora_A``, ``scaling``,
``merged``, ``disable_adapters``) and parameter names (``...lora_A.default.weight``), so hand-rolled LoRA
modules that follow the same naming are understood too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn

__all__ = [
    "ADAPTER_PARTS",
    "AdapterPair",
    "adapter_pairs",
    "base_model",
    "head_modules",
    "is_adapter_param",
    "is_peft_model",
    "is_saved_param",
    "lora_layers",
    "peft_config",
    "block_lists",
    "saved_wrappers",
    "storage_key",
    "unwrap_parallel",
]

ADAPTER_PARTS = frozenset({"lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector"})
"""name segments that mark a LoRA / DoRA adapter parameter"""

_PEFT_CLASS_PREFIXES = ("PeftModel", "PeftMixedModel", "LoraModel")
_PARALLEL_WRAPPERS = ("DistributedDataParallel", "FullyShardedDataParallel", "DataParallel")
_HEAD_NAMES = ("score", "classifier", "classification_head", "qa_outputs")
_HEAD_TASKS = {"SEQ_CLS", "TOKEN_CLS", "QUESTION_ANS"}
_HEAD_CLASS_SUFFIXES = ("ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering")


def unwrap_parallel(model: nn.Module) -> nn.Module:
    """Strip DDP / FSDP(1) / DataParallel wrappers, which keep the real model in ``.module``."""
    while type(model).__name__ in _PARALLEL_WRAPPERS:
        inner = getattr(model, "module", None)
        if not isinstance(inner, nn.Module):
            break
        model = inner
    return model


def _segments(name: str) -> list[str]:
    return name.split(".")


def is_adapter_param(name: str) -> bool:
    """True for LoRA factors (and DoRA magnitudes), judged by the parameter's name."""
    return any(s in ADAPTER_PARTS for s in _segments(name))


def is_saved_param(name: str) -> bool:
    """True for the trainable copies peft makes for ``modules_to_save`` (heads, embeddings)."""
    return "modules_to_save" in _segments(name)


def is_peft_model(model: nn.Module) -> bool:
    """True for a peft model (or a hand-rolled LoRA model using peft's parameter names).

    Checks class names (``PeftModel*``, ``LoraModel``), a dict-like ``peft_config`` attribute, and parameter
    names containing ``lora_A`` / ``lora_B``; DDP/FSDP wrappers are looked through. Never imports peft.
    """
    if not isinstance(model, nn.Module):
        return False
    inner = unwrap_parallel(model)
    for cls in type(inner).__mro__:
        if cls.__name__.startswith(_PEFT_CLASS_PREFIXES):
            return True
    if isinstance(getattr(inner, "peft_config", None), dict) and inner.peft_config:
        return True
    return any(is_adapter_param(name) for name, _ in inner.named_parameters())


def peft_components(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The peft models held inside a model that is not one itself (a frozen LoRA policy under a value head), by
    their qualified names; empty when the model is the peft model."""
    inner = unwrap_parallel(model)
    if isinstance(getattr(inner, "peft_config", None), dict):
        return []
    found: list[tuple[str, nn.Module]] = []
    for name, module in inner.named_modules():  # parents come first: a PeftModel's own LoraModel is left out
        if (name and isinstance(getattr(module, "peft_config", None), dict) and module.peft_config
                and not any(name.startswith(f"{outer}.") for outer, _ in found)):
            found.append((name, module))
    return found


def peft_config(model: nn.Module) -> Any:
    """The active adapter's config object (a peft ``LoraConfig``), or None."""
    inner = unwrap_parallel(model)
    configs = getattr(inner, "peft_config", None)
    if not isinstance(configs, dict) or not configs:
        return None
    active = getattr(inner, "active_adapter", None)
    if isinstance(active, str) and active in configs:
        return configs[active]
    return next(iter(configs.values()))


def base_model(model: nn.Module) -> nn.Module:
    """The transformer under the peft wrappers (``PeftModel.base_model.model``), or the model itself."""
    inner = unwrap_parallel(model)
    get_base = getattr(inner, "get_base_model", None)
    if callable(get_base):
        base = get_base()
        if isinstance(base, nn.Module):
            return base
    return inner


def _single_factor(value: object, attr: str) -> tuple[str, nn.Parameter] | None:
    """A hand-rolled layer's one factor: a bare Parameter (loralib: ``lora_A`` of shape [r, in]) or a module with
    a ``weight`` (``self.lora_A = nn.Linear(in, r)``), as (name within the layer, parameter)."""
    if isinstance(value, nn.Parameter):
        return attr, value
    weight = getattr(value, "weight", None)
    if isinstance(value, nn.Module) and not isinstance(value, nn.ModuleDict) and isinstance(weight, nn.Parameter):
        return f"{attr}.weight", weight
    return None


def lora_layers(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Every LoRA-adapted layer: peft's (``lora_A`` / ``lora_embedding_A`` dicts keyed by adapter name) and
    hand-rolled ones whose ``lora_A`` and ``lora_B`` are single factors (loralib, research code)."""
    for name, module in model.named_modules():
        factors = getattr(module, "lora_A", None)
        if (
            isinstance(factors, nn.ModuleDict)
            or isinstance(getattr(module, "lora_embedding_A", None), nn.ParameterDict)
            or (_single_factor(factors, "lora_A") and _single_factor(getattr(module, "lora_B", None), "lora_B"))
        ):
            yield name, module


@dataclass(frozen=True)
class AdapterPair:
    """The two low-rank factors of one adapter on one layer: ``delta W = B @ A * scaling``."""

    layer: str
    adapter: str
    a_name: str
    a: nn.Parameter
    b_name: str
    b: nn.Parameter


_SINGLE_ADAPTER = "default"
"""the adapter name given to a hand-rolled layer's one pair of factors (peft's default adapter name)"""


def adapter_pairs(model: nn.Module) -> list[AdapterPair]:
    """The (A, B) factor pairs of every LoRA layer, with their full parameter names in ``model``."""
    pairs: list[AdapterPair] = []
    for layer, module in lora_layers(model):
        prefix = f"{layer}." if layer else ""
        linear_a = getattr(module, "lora_A", None)
        linear_b = getattr(module, "lora_B", None)
        single_a, single_b = _single_factor(linear_a, "lora_A"), _single_factor(linear_b, "lora_B")
        if single_a and single_b:
            pairs.append(AdapterPair(layer, _SINGLE_ADAPTER, prefix + single_a[0], single_a[1],
                                     prefix + single_b[0], single_b[1]))
        if isinstance(linear_a, nn.ModuleDict) and isinstance(linear_b, nn.ModuleDict):
            for adapter in linear_a.keys():
                if adapter not in linear_b:
                    continue
                a = getattr(linear_a[adapter], "weight", None)
                b = getattr(linear_b[adapter], "weight", None)
                if isinstance(a, nn.Parameter) and isinstance(b, nn.Parameter):
                    pairs.append(
                        AdapterPair(layer, adapter, f"{prefix}lora_A.{adapter}.weight", a, f"{prefix}lora_B.{adapter}.weight", b)
                    )
        emb_a = getattr(module, "lora_embedding_A", None)
        emb_b = getattr(module, "lora_embedding_B", None)
        if isinstance(emb_a, nn.ParameterDict) and isinstance(emb_b, nn.ParameterDict):
            for adapter in emb_a.keys():
                if adapter in emb_b:
                    pairs.append(
                        AdapterPair(
                            layer,
                            adapter,
                            f"{prefix}lora_embedding_A.{adapter}",
                            emb_a[adapter],
                            f"{prefix}lora_embedding_B.{adapter}",
                            emb_b[adapter],
                        )
                    )
    return pairs


def saved_wrappers(model: nn.Module) -> Iterator[tuple[str, nn.Module, nn.Module, nn.Module | None]]:
    """peft ``ModulesToSaveWrapper``s as (name, wrapper, frozen original, active trainable copy or None)."""
    for name, module in model.named_modules():
        original = getattr(module, "original_module", None)
        copies = getattr(module, "modules_to_save", None)
        if isinstance(original, nn.Module) and isinstance(copies, nn.ModuleDict):
            active = getattr(module, "active_adapter", None)
            if isinstance(active, (list, tuple)):
                active = active[0] if active else None
            copy = copies[active] if isinstance(active, str) and active in copies else None
            if copy is None and len(copies) == 1:
                copy = next(iter(copies.values()))
            yield name, module, original, copy


def block_lists(model: nn.Module) -> Iterator[tuple[str, list[nn.Module]]]:
    """Stacks of repeated blocks: every ``ModuleList`` of >= 2 same-class modules with parameters (``h``, ``layers``)."""
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) < 2:
            continue
        children = list(module)
        if len({type(c) for c in children}) == 1 and any(True for _ in children[0].parameters()):
            yield name, children


def head_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Freshly initialised task heads (``score``, ``classifier``, ...) of a classification / QA model.

    Returns [] unless the peft task type or the base model's class says the model has such a head.
    """
    config = peft_config(model)
    task = str(getattr(config, "task_type", "") or "").rsplit(".", 1)[-1]
    base = base_model(model)
    is_head_task = task in _HEAD_TASKS or type(base).__name__.endswith(_HEAD_CLASS_SUFFIXES)
    if not is_head_task:
        return []
    heads = []
    for attr in _HEAD_NAMES:
        module = getattr(base, attr, None)
        if isinstance(module, nn.Module):
            heads.append((attr, module))
    return heads


def storage_key(tensor: torch.Tensor) -> tuple[int, tuple[int, ...]]:
    """Identifies tensors that share memory (tied weights) even when they are different Parameter objects."""
    return tensor.data_ptr(), tuple(tensor.shape)
