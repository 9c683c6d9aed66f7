"""What the loss supervises, measured from the real backward: the gradient that reaches the model's output.

For every root call of the model during the step, a tensor hook on its primary output (``.logits``, else the
first float tensor) reduces the output's gradient to one row per position (per sample, per token): its
magnitude, and for class outputs the target class the loss pulls towards (the most negative gradient entry)
and, when the gradient has the shape of softmax cross-entropy (it sums to zero over the classes), the weight
the loss gives that position: ``-g[y] / (1 - p[y])``. Nothing of the full gradient is kept.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from guardtower.preflight._trace import Supervision

__all__ = ["supervision_hook"]

#: a softmax cross-entropy gradient sums to zero over the classes, up to rounding
_CE_TOLERANCE = 1e-3


def supervision_hook(call: int, output: torch.Tensor, records: list[Supervision]) -> Callable[[torch.Tensor], None]:
    """A gradient hook for ``output`` that appends what the gradient says to ``records``."""
    values = output.detach()

    def hook(grad: torch.Tensor) -> None:
        records.append(_reduce(call, values, grad.detach()))

    return hook


def _reduce(call: int, output: torch.Tensor, grad: torch.Tensor) -> Supervision:
    g = grad.float()
    if g.dim() < 2 or g.shape[-1] < 2:
        return Supervision(call, g.abs().reshape(g.shape[:1] + (-1,)).sum(-1).cpu() if g.dim() else g.abs().cpu(),
                           None, None, 0)
    magnitude = g.abs().sum(-1)
    target = g.argmin(-1)
    total = g.sum(-1).abs()
    supervised = magnitude > 0
    ce_like = bool(supervised.any()) and bool((total[supervised] <= _CE_TOLERANCE * magnitude[supervised]).all())
    weight = None
    if ce_like:
        p = torch.softmax(output.float(), dim=-1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
        g_y = g.gather(-1, target.unsqueeze(-1)).squeeze(-1)
        weight = torch.where(supervised, -g_y / (1 - p).clamp_min(1e-12), torch.zeros_like(g_y)).cpu()
    return Supervision(call, magnitude.cpu(), target.cpu(), weight, int(g.shape[-1]))


def first_call_output(output: Any, primary: Callable[[Any], torch.Tensor | None]) -> torch.Tensor | None:
    """The output tensor whose gradient is measured, when it takes part in the graph."""
    out = primary(output)
    return out if isinstance(out, torch.Tensor) and out.requires_grad and out.is_floating_point() else None
