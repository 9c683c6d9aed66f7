"""Whether the loss reads what a gradient-less module computes.

A module that ran with autograd on and got no gradient was either cut from the graph (its output used through
``detach()``, ``torch.tensor(...)``, ``.item()``: the loss depends on it, yet no gradient can flow back) or simply
discarded (the critic head of a policy that is distilled on its actions alone, an unused pooler). Only the first
is the silent bug; the two look the same in the gradients, so the step runs once more with each candidate's
output changed and the loss compared.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from guardtower.preflight._step import extract_loss
from guardtower.preflight._util import is_library_model, is_lora_factor

__all__ = ["gradientless_modules", "confirm_outputs_unread"]

#: at most this many candidate modules get a run of their own
_MAX_CANDIDATES = 3


def gradientless_modules(model: nn.Module, grads: dict[str, Any], ran_with_grad: set[str]) -> list[str]:
    """The outermost submodules of the user's own code that ran with autograd on, hold trainable parameters,
    and none of whose trainable parameters got a gradient. Not the parts of a library model (GRAD-001 judges those
    by the rest of that model) nor an adapter factor (an adapter that does not train is the bug itself)."""
    modules = dict(model.named_modules())
    found: list[str] = []
    for name, module in modules.items():
        if not name or name not in ran_with_grad or any(name.startswith(f"{f}.") for f in found):
            continue
        path = name.split(".")
        if any(is_library_model(modules.get(".".join(path[:i]))) for i in range(len(path) + 1)):
            continue
        params = [(n, p) for n, p in module.named_parameters(prefix=name) if p.requires_grad]
        if params and all(grads.get(n) is None and not is_lora_factor(n) and "lora_" not in n for n, _ in params):
            found.append(name)
    return found[:_MAX_CANDIDATES]


def _shifted(value: Any) -> Any:
    """Every float tensor of an output moved off its value (``x / 2 + 1`` changes zeros too, unlike the inputs'
    ``_perturb``, which zeroes them: a cut head's output may already be zero)."""
    if isinstance(value, torch.Tensor):
        return value * 0.5 + 1.0 if value.is_floating_point() else value
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_shifted(v) for v in value)
    if isinstance(value, list):
        return [_shifted(v) for v in value]
    return value


def confirm_outputs_unread(model: nn.Module, step_fn: Callable[[], Any], names: list[str], loss: torch.Tensor,
                           rng: Callable[[], None], *, backward: bool) -> set[str]:
    """Re-run ``step_fn`` once per module of ``names`` with that module's output changed (same RNG stream);
    the modules whose change leaves the loss bitwise equal. Without gradients, unless ``step_fn`` runs
    ``backward()`` itself (the caller puts the weights back). A run that fails tells nothing."""
    modules = dict(model.named_modules())
    unread: set[str] = set()
    for name in names:
        handle = modules[name].register_forward_hook(lambda _m, _args, out: _shifted(out))
        try:
            rng()
            with torch.set_grad_enabled(backward):
                other = extract_loss(step_fn())
        except Exception:
            continue
        finally:
            handle.remove()
        if isinstance(other, torch.Tensor) and other.shape == loss.shape and torch.equal(other.detach(),
                                                                                         loss.detach()):
            unread.add(name)
    return unread
