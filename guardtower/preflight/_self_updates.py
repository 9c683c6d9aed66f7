"""Whether ``step_fn`` updates gradient-less trainable tensors itself.

A MoCo key encoder, a BYOL or DINO target, a mean teacher kept inside the model: their parameters may stay
trainable and in the optimizer, run under ``no_grad`` and get no gradient, because the step moves them itself
(a momentum or EMA copy of the encoder that learns). A copy the step never moves (its update commented out) and a
part run under ``no_grad`` by mistake look the same in the gradients, and the values cannot tell them apart
either: at the first step a fresh copy equals what it follows, so an EMA update can leave it bitwise unchanged.
So the step runs once more with the candidates' values changed: an update moves them off the changed values,
and nothing else does (an optimizer skips a tensor without a gradient).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from guardtower.preflight._value_reads import shifted

__all__ = ["no_grad_only", "confirm_updated_by_step"]


def no_grad_only(params: dict[str, nn.Parameter], grads: dict[str, Any], ran: set[str],
                 ran_with_grad: set[str]) -> list[str]:
    """The trainable parameters without a gradient whose module ran in the step, and only under ``no_grad``."""
    return [n for n, p in params.items() if p.requires_grad and grads.get(n) is None
            and (owner := n.rpartition(".")[0]) in ran and owner not in ran_with_grad]


def confirm_updated_by_step(params: dict[str, nn.Parameter], step_fn: Callable[[], Any], names: list[str],
                            rng: Callable[[], None]) -> set[str]:
    """Re-run ``step_fn`` (same RNG stream) with the values of ``names`` changed; those the step moved off the
    changed values. The caller puts every value back; a run that fails tells nothing."""
    held = [(n, params[n]) for n in names]
    with torch.no_grad():
        changed = [shifted(p) for _, p in held]
        for (_, p), value in zip(held, changed):
            p.copy_(value)
    try:
        rng()
        with torch.enable_grad():
            step_fn()
    except Exception:
        return set()
    with torch.no_grad():
        return {n for (n, p), value in zip(held, changed) if p.shape != value.shape or not torch.equal(p, value)}
