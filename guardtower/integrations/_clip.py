"""Gradient clipping moved behind the guard's decision, for trainers that would clip before the guard looks.

A clipped spike looks like a normal step, so the integrations turn the trainer's own clipping off and
clip with the same setting in a step pre-hook of the base optimizer, which only runs for accepted steps.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["deferred_clipper"]


def deferred_clipper(optimizer: torch.optim.Optimizer, value: float,
                     algorithm: str = "norm") -> Callable[[torch.optim.Optimizer, Any, Any], None]:
    """A step pre-hook clipping ``optimizer``'s gradients to ``value`` (total norm, or each element)."""

    def clip(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if not params:
            return
        if algorithm == "value":
            torch.nn.utils.clip_grad_value_(params, value)
        else:
            torch.nn.utils.clip_grad_norm_(params, value)

    return clip
