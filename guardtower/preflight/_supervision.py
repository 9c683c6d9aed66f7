"""What the loss supervises, measured from the real backward: the gradient that reaches the model's output.

For every root call of the model during the step, a tensor hook on its primary output (``.logits``, else the
first float tensor) reduces the output's gradient to one row per position (per sample, per token, per pixel of a
channels-first ``(N, C, H, W)`` output whose gradient sums to zero over the channels): its
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
#: how far (relative) a position's gradient may be from w * (p - onehot(y)) and still pull towards class y
#: (label smoothing of 0.1 stays within it)
_PULL_TOLERANCE = 0.25


def supervision_hook(call: int, output: torch.Tensor, records: list[Supervision],
                     tokens: tuple[int, ...] | None = None) -> Callable[[torch.Tensor], None]:
    """A gradient hook for ``output`` that appends what the gradient says to ``records``; ``tokens``: the
    (batch, tokens) shape of the call's token inputs, which an output of one value per token has."""
    values = output.detach()

    def hook(grad: torch.Tensor | None) -> None:
        # a measurement must never fail the step it measures: a gradient it cannot read is simply not recorded
        if grad is None:
            return
        try:
            if tokens is not None and tuple(grad.shape) == tokens:  # one value per token: no class dim
                records.append(Supervision(call, grad.detach().float().abs().cpu(), None, None, 0))
                return
            records.append(_reduce(call, values, grad.detach()))
        except Exception:  # noqa: BLE001 - e.g. an output whose gradient has another layout
            return

    return hook


def _sums_to_zero(g: torch.Tensor, dim: int) -> bool:
    magnitude = g.abs().sum(dim)
    supervised = magnitude > 0
    return bool(supervised.any()) and bool((g.sum(dim).abs()[supervised] <= _CE_TOLERANCE * magnitude[supervised]).all())


def _reduce(call: int, output: torch.Tensor, grad: torch.Tensor) -> Supervision:
    g = grad if grad.dtype == torch.float32 else grad.float()
    if g.dim() >= 3 and g.shape[1] >= 2 and not _sums_to_zero(g, -1) and _sums_to_zero(g, 1):
        # channels-first class scores ((N, C, H, W) segmentation, (N, C, T) per-frame): classes to the end
        g, output = g.movedim(1, -1), output.movedim(1, -1)
    if g.dim() < 2 or g.shape[-1] < 2:
        return Supervision(call, g.abs().reshape(g.shape[:1] + (-1,)).sum(-1).cpu() if g.dim() else g.abs().cpu(),
                           None, None, 0)
    magnitude = g.abs().sum(-1)
    target = g.argmin(-1)
    supervised = magnitude > 0
    ce_like = _sums_to_zero(g, -1)
    weight = None
    if ce_like:
        probs = torch.softmax(output.float(), dim=-1)
        p = probs.gather(-1, target.unsqueeze(-1)).squeeze(-1)
        g_y = g.gather(-1, target.unsqueeze(-1)).squeeze(-1)
        w = torch.where(supervised, -g_y / (1 - p).clamp_min(1e-12), torch.zeros_like(g_y))
        # a position the loss pulls towards one class has g = w * (p - onehot(y)), w > 0; one it pushes away
        # from its label (the rejected side of a preference loss) does not, and has no target of its own
        # w * (p - onehot(y)) - g, in place: no one-hot tensor of the logits' size
        residual = probs.mul_(w.unsqueeze(-1)).sub_(g).scatter_add_(-1, target.unsqueeze(-1), -w.unsqueeze(-1))
        pulled = (residual.norm(dim=-1) <= _PULL_TOLERANCE * g.norm(dim=-1)) & (w > 0)
        target = torch.where(pulled | ~supervised, target, torch.full_like(target, -1))
        weight = w.cpu() if bool(pulled[supervised].all()) else None
    return Supervision(call, magnitude.cpu(), target.cpu(), weight, int(g.shape[-1]))


def first_call_output(output: Any, primary: Callable[[Any], torch.Tensor | None]) -> torch.Tensor | None:
    """The output tensor whose gradient is measured, when it takes part in the graph."""
    out = primary(output)
    return out if isinstance(out, torch.Tensor) and out.requires_grad and out.is_floating_point() else None
