"""The audit's own pass of the model, for measurements the step's own backward cannot give.

It runs the step's first call of the model again with the same arguments, under the RNG the step started from,
in eval mode (no dropout, no running-statistics update) and with gradients on, with chosen inputs turned into
gradient leaves: float arguments are replaced by leaf copies, and the output of an embedding that reads a chosen
token-id argument is. A measurement then takes gradients of the output with respect to those leaves. The pass
also records every functional dropout that runs with ``training=True`` while the model is in eval mode. Weights
are never touched and everything is put back, also when the pass raises.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from guardtower.preflight._registry import AuditContext
from guardtower.preflight._util import NOT_INPUT_KEYS, patched

__all__ = ["OwnPass", "own_pass", "in_eval_mode"]


@dataclass
class OwnPass:
    """The primary output of the audit's own call, the gradient leaves it was computed from, and each dropout
    call that ran with ``training=True`` although every module was in eval mode (``(function, p)``)."""

    output: torch.Tensor | None
    leaves: list[tuple[str, torch.Tensor]]
    dropouts: list[tuple[str, float]] = field(default_factory=list)


#: the functional dropouts; each takes ``(input, p, training)`` and defaults to ``training=True``
_DROPOUTS = ("dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout")


def _recording_dropout(name: str, original: Callable[..., Any], *, seen: list[tuple[str, float]]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
        training = kwargs.get("training", args[2] if len(args) > 2 else True)
        if training is True and isinstance(p, (int, float)) and p > 0:
            seen.append((name, float(p)))
        return original(*args, **kwargs)

    return wrapper


@contextlib.contextmanager
def own_pass(ctx: AuditContext, restore_rng: Callable[[], None],
             chosen: Callable[[torch.Tensor], bool]) -> Iterator[OwnPass]:
    """Run the first call again; ``chosen`` picks the (top-level) tensor arguments that become leaves."""
    from guardtower.preflight._step import primary_output

    assert ctx.trace is not None and ctx.trace.calls
    call = ctx.trace.training_call()
    leaves: list[tuple[str, torch.Tensor]] = []
    ids_shapes: dict[int, tuple[int, ...]] = {}  # storage of a chosen token-id argument -> its shape

    def swap(value: Any, label: str, key: str | None = None) -> Any:
        if key in NOT_INPUT_KEYS or not isinstance(value, torch.Tensor) or not chosen(value):
            return value
        if value.is_floating_point():
            leaf = value.detach().clone().requires_grad_(True)
            leaves.append((label, leaf))
            return leaf
        if value.dtype != torch.bool and not value.is_complex():
            ids_shapes[value.untyped_storage().data_ptr()] = tuple(value.shape)
        return value

    args = tuple(swap(a, f"input args[{i}]") for i, a in enumerate(call.args))
    kwargs = {k: swap(v, f"input {k}", k) for k, v in call.kwargs.items()}

    def embedding_hook(name: str) -> Callable[[nn.Module, tuple[Any, ...], Any], Any]:
        def hook(module: nn.Module, inputs: tuple[Any, ...], output: Any) -> Any:
            ids = inputs[0] if inputs else None
            label = f"embedding {name}"
            if (isinstance(ids, torch.Tensor) and isinstance(output, torch.Tensor) and output.is_floating_point()
                    and ids_shapes.get(ids.untyped_storage().data_ptr()) == tuple(ids.shape)
                    and all(n != label for n, _ in leaves)):
                leaf = output.detach().requires_grad_(True)
                leaves.append((label, leaf))
                return leaf
            return None

        return hook

    handles = [m.register_forward_hook(embedding_hook(n)) for n, m in ctx.model.named_modules()
               if isinstance(m, nn.Embedding)] if ids_shapes else []
    try:
        with in_eval_mode(ctx.model, restore_rng):
            dropouts: list[tuple[str, float]] = []
            recorded: list[tuple[Any, str, Callable[[Any], Any]]] = [
                (F, name, functools.partial(_recording_dropout, name, seen=dropouts)) for name in _DROPOUTS]
            with torch.enable_grad(), patched(recorded):
                out = primary_output(ctx.model(*args, **kwargs))
            yield OwnPass(out, leaves, dropouts)
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def in_eval_mode(model: nn.Module, restore_rng: Callable[[], None]) -> Iterator[None]:
    """Every module in eval mode, under the RNG the step started from; modes and RNG put back afterwards."""
    modes = {m: m.training for m in model.modules()}
    try:
        restore_rng()
        model.eval()
        yield
    finally:
        for m, training in modes.items():
            m.training = training
        restore_rng()
