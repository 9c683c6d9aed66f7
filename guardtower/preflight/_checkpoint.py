"""Would reentrant gradient checkpointing drop a block's gradients in the user's real run?

Reentrant ``torch.utils.checkpoint`` returns an output that requires grad only if one of its positional
tensor inputs does; otherwise every parameter inside the block (LoRA factors included) silently gets no
gradient. The audit's own instrumentation may mark the model's inputs (or a frozen embedding's output) as
requiring grad to measure input dependency, which would hide the problem; so this watch judges each
checkpointed block's inputs by where their gradient requirement comes from: a trainable parameter or a
tensor the user made require grad counts, a leaf the audit created does not.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch import nn

from guardtower.preflight._walk import iter_tensors

__all__ = ["reentrant_layers", "CheckpointWatch", "watch_checkpointing"]


def reentrant_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Layers that run reentrant checkpointing (Hugging Face ``GradientCheckpointingLayer`` with
    ``gradient_checkpointing_kwargs={"use_reentrant": True}``)."""
    found = []
    for name, module in model.named_modules():
        fn = getattr(module, "_gradient_checkpointing_func", None)
        is_layer = any(c.__name__ == "GradientCheckpointingLayer" for c in type(module).__mro__)
        if is_layer and getattr(module, "gradient_checkpointing", False) and isinstance(fn, functools.partial):
            if fn.keywords.get("use_reentrant", True):
                found.append((name, module))
    return found


@dataclass
class CheckpointWatch:
    """Checkpointed layers whose inputs would not require grad without the audit."""

    layers: list[str] = field(default_factory=list)
    starved: list[str] = field(default_factory=list)
    _audit_leaves: list[torch.Tensor] = field(default_factory=list)
    _candidates: list[torch.Tensor] = field(default_factory=list)
    """float leaves the user passed without requires_grad (the audit may mark them)"""
    _seen: set[str] = field(default_factory=set)

    def would_starve(self, tensors: list[torch.Tensor]) -> bool:
        """True when none of ``tensors`` would require grad in the user's own run (reentrant checkpointing
        then gives the block's output no gradient at all)."""
        self._audit_leaves.extend(t for t in self._candidates if t.requires_grad and not self.is_audit_leaf(t))
        return not self.requires_grad_naturally(tensors)

    def is_audit_leaf(self, t: torch.Tensor) -> bool:
        return any(t is leaf for leaf in self._audit_leaves)

    def requires_grad_naturally(self, tensors: list[torch.Tensor]) -> bool:
        """True when some tensor's gradient requirement traces back to a leaf the audit did not create."""
        stack: list[Any] = []
        for t in tensors:
            if not t.requires_grad:
                continue
            if t.grad_fn is None:
                if not self.is_audit_leaf(t):
                    return True
            else:
                stack.append(t.grad_fn)
        seen: set[int] = set()
        while stack:
            node = stack.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            leaf = getattr(node, "variable", None)  # AccumulateGrad: the end of a path, at a leaf
            if isinstance(leaf, torch.Tensor):
                if not self.is_audit_leaf(leaf):
                    return True
                continue
            stack.extend(nxt for nxt, _ in node.next_functions if nxt is not None)
        return False


@contextlib.contextmanager
def watch_checkpointing(model: nn.Module, layers: list[tuple[str, nn.Module]]) -> Iterator[CheckpointWatch]:
    """Hooks that tell, for each reentrant-checkpointed layer, whether its inputs require grad on their own."""
    watch = CheckpointWatch(layers=[n for n, _ in layers])
    originals: dict[int, Any] = {}

    def root_pre(module: nn.Module, args: Any, kwargs: Any) -> None:
        for t in iter_tensors((args, kwargs)):
            if t.is_floating_point() and t.grad_fn is None and not t.requires_grad:
                watch._candidates.append(t)

    def embedding_first(module: nn.Module, args: Any, output: Any) -> None:
        originals[id(module)] = output

    def embedding_last(module: nn.Module, args: Any, output: Any) -> None:
        # an output object other than the module's own is a replacement made by a later hook (the audit's
        # input-dependency watch); the user's enable_input_require_grads flips requires_grad in place instead
        if isinstance(output, torch.Tensor) and output is not originals.pop(id(module), output):
            watch._audit_leaves.append(output)

    def layer_pre(name: str, module: nn.Module, args: Any) -> None:
        if name in watch._seen:
            return
        watch._seen.add(name)
        if watch.would_starve(list(iter_tensors(args))):
            watch.starved.append(name)

    handles = [model.register_forward_pre_hook(root_pre, with_kwargs=True, prepend=True)]
    for m in model.modules():
        if isinstance(m, nn.Embedding):
            handles.append(m.register_forward_hook(embedding_first, prepend=True))
            handles.append(m.register_forward_hook(embedding_last))
    handles += [m.register_forward_pre_hook(functools.partial(layer_pre, n)) for n, m in layers]
    try:
        yield watch
    finally:
        for h in handles:
            h.remove()
