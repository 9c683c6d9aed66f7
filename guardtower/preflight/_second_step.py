"""Whether a gradient that is exactly zero at the first step is still zero once the step has moved the weights.

A zero-initialised layer (a residual gate's last projection, a ControlNet zero convolution, a zero-init output
head) holds the gradient of everything behind it at exactly zero on step one, by design: it gets a gradient
itself, moves, and from the next step on the layers behind it learn. A dead ReLU layer, a graph cut by a
clamp, outputs masked out, or two zero layers that hold each other at zero stay at zero: those are the bugs.
The audit tells them apart by measuring: one real update, then one more step whose gradients it reads.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from guardtower.preflight._step import extract_loss
from guardtower.preflight._util import base_optimizer

__all__ = ["zero_gradients", "gradients_after_one_update"]


def zero_gradients(grads: dict[str, torch.Tensor | None]) -> list[str]:
    """The tensors whose gradient exists and is exactly zero everywhere."""
    return [n for n, g in grads.items() if g is not None and g.numel() > 0 and not bool(g.any())]


def gradients_after_one_update(step_fn: Callable[[], Any], params: Mapping[str, torch.Tensor], names: list[str],
                               restore_rng: Callable[[], None], optimizer: Any, *,
                               user_backward: bool) -> set[str] | None:
    """Those of ``names`` that get a nonzero gradient in a second step run after one real update (the caller
    puts every value back); None when the step raised. A step that returns its loss needs ``optimizer``."""
    optimizer = base_optimizer(optimizer)
    flows: set[str] = set()

    def seen(name: str) -> Callable[[torch.Tensor], None]:
        def hook(tensor: torch.Tensor) -> None:  # after accumulation: a later zero_grad cannot hide it
            if tensor.grad is not None and bool(tensor.grad.any()):
                flows.add(name)
        return hook

    try:
        restore_rng()
        _train_once(step_fn, optimizer, user_backward)
        handles = [params[n].register_post_accumulate_grad_hook(seen(n)) for n in names]
        try:
            _train_once(step_fn, None, user_backward)
        finally:
            for handle in handles:
                handle.remove()
    except Exception:  # the measurement is the audit's own: it never turns into a finding of its own
        return None
    return flows


def _train_once(step_fn: Callable[[], Any], optimizer: Any, user_backward: bool) -> None:
    """``step_fn`` as the user runs it; a step that only returns its loss gets the backward (and the update,
    when ``optimizer`` is given) the audit's own step gives it."""
    out = step_fn()
    if user_backward:
        return
    loss = extract_loss(out)
    if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
        raise RuntimeError("step_fn returned no loss to differentiate")
    (loss if loss.numel() == 1 else loss.float().mean()).backward()
    if optimizer is not None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
