"""What the guard does with a rejected step, how a skip reaches the optimizer, and how much a clip scales.

Two ways to skip an update:

* **On the device** (zero host syncs). Fused optimizers (``Adam/AdamW/SGD/Adagrad(fused=True)``) declare
  ``_step_supports_amp_scaling`` and read two tensors from attributes of the optimizer, ``grad_scale`` and
  ``found_inf`` — the contract ``torch.amp.GradScaler`` uses. The fused kernel leaves parameters and moments
  untouched when ``found_inf`` is 1.0 and takes the step counters back, so the guard sets ``found_inf`` to an
  exact 0.0/1.0 tensor (its decision OR the scaler's overflow flag) and never reads it on the host.
* **On the host** (one sync per step). Any other optimizer: the guard reads its decision flag once and does
  not call ``step`` on a rejected step. Never multiply an update by zero: ``0 * NaN`` is NaN and would poison
  Adam's moments.

``nan_action="clip"`` scales a finite spike down to what the detector would have accepted (its ``limits``)
before the update, with a factor computed on the device; NaN/Inf and a spike of the loss alone are skipped.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Literal

import torch
from torch import Tensor

from guardtower.errors import ConfigError

__all__ = ["Action", "ACTIONS", "CLIP_MODES", "ActionPolicy", "clip_factor", "supports_device_skip", "device_skip"]

Action = Literal["skip", "clip", "rollback", "raise"]
ACTIONS: tuple[str, ...] = ("skip", "clip", "rollback", "raise")
CLIP_MODES: tuple[str, ...] = ("global", "per_tensor")


class ActionPolicy:
    """``nan_action`` for each rejected step; after ``max_consecutive_skips`` skips in a row, ``escalate_to``."""

    def __init__(self, nan_action: str, max_consecutive_skips: int | None, escalate_to: str) -> None:
        if nan_action not in ACTIONS:
            raise ConfigError("nan_action", f"unknown action {nan_action!r}", f"pass one of {list(ACTIONS)}")
        if escalate_to not in ("rollback", "raise"):
            raise ConfigError("escalate_to", f"unknown action {escalate_to!r}", "pass 'rollback' or 'raise'")
        if max_consecutive_skips is not None and (
            not isinstance(max_consecutive_skips, int) or isinstance(max_consecutive_skips, bool)
            or max_consecutive_skips < 1
        ):
            raise ConfigError("max_consecutive_skips", f"must be a positive int or None, got {max_consecutive_skips!r}",
                              "pass e.g. max_consecutive_skips=20")
        self.nan_action: Action = nan_action  # type: ignore[assignment]
        self.max_consecutive_skips = max_consecutive_skips
        self.escalate_to: Action = escalate_to  # type: ignore[assignment]

    def action(self, consecutive_rejections: int) -> Action:
        """The action for a step that was not applied, the ``consecutive_rejections``-th in a row (1-based).

        Under ``"clip"`` these are the steps that cannot be clipped (NaN/Inf, a loss-only spike): skipped.
        """
        if self.nan_action not in ("skip", "clip"):
            return self.nan_action
        if self.max_consecutive_skips is not None and consecutive_rejections > self.max_consecutive_skips:
            return self.escalate_to
        return "skip"

    @property
    def may_rollback(self) -> bool:
        return self.nan_action == "rollback" or (self.max_consecutive_skips is not None
                                                 and self.escalate_to == "rollback")


def clip_factor(mode: str, norms: Tensor, global_norm: Tensor, limits: Tensor, global_limit: Tensor) -> Tensor:
    """The factor that brings a spike within the detector's limits: 0-d (``"global"``) or one per tensor.

    ``"global"`` keeps the update's direction: the largest factor <= 1 that puts the global norm and every
    tensor's norm at or below its limit. ``"per_tensor"`` scales each tensor to its own limit, then all of
    them together if the global norm is still above its limit. 1 where nothing tripped; an undefined ratio
    (0/0, inf/inf: a non-finite step, which is skipped, never scaled) counts as 1.
    """
    if mode == "global":
        ratios = torch.cat([limits, global_limit.reshape(1)]) / torch.cat(
            [norms, global_norm.reshape(1)])
        return ratios.nan_to_num(1.0, 1.0).amin().clamp_max(1.0)
    each = (limits / norms).nan_to_num(1.0, 1.0).clamp_max(1.0)
    together = (global_limit / torch.linalg.vector_norm(norms * each)).nan_to_num(1.0, 1.0).clamp_max(1.0)
    return each * together


def supports_device_skip(optimizer: torch.optim.Optimizer) -> bool:
    """True when ``optimizer.step`` honours the ``found_inf`` attribute on the device (fused kernels)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


@contextlib.contextmanager
def _attributes(obj: Any, **values: Any) -> Iterator[None]:
    missing = object()
    saved = {k: getattr(obj, k, missing) for k in values}
    for k, v in values.items():
        if v is None:
            if hasattr(obj, k):
                delattr(obj, k)
        else:
            setattr(obj, k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is missing:
                if hasattr(obj, k):
                    delattr(obj, k)
            else:
                setattr(obj, k, v)


def device_skip(optimizer: torch.optim.Optimizer, found_inf: Tensor, grad_scale: Tensor | None,
                closure: Callable[[], Any] | None) -> Any:
    """Run ``optimizer.step`` with ``found_inf`` (exact 0.0/1.0 float32) and ``grad_scale`` set, then unset them."""
    with _attributes(optimizer, found_inf=found_inf, grad_scale=grad_scale):
        return optimizer.step(closure) if closure is not None else optimizer.step()
