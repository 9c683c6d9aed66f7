"""A guard around Accelerate's ``AcceleratedOptimizer``: judge only the steps Accelerate takes, unscaled.

``accelerator.prepare(GuardedOptimizer(opt))`` needs nothing from here: Accelerate calls the guard only when
gradients sync and hands it a ``GradScaler``'s tensors as it would any optimizer. The other way round,
``GuardedOptimizer(accelerator.prepare(opt))``, the guard is called on every micro-step of gradient
accumulation and sees gradients still multiplied by the loss scale, so an fp16 overflow would look like a
NaN spike and the scaler would never lower its scale. ``AcceleratedBase`` makes that guard pass micro-steps
through unjudged, unscale first (the scaler's own ``step`` then does not unscale again) and read the scaler's
overflow flag, and let the scaler update on a step the guard skips. Duck typed: nothing imports accelerate.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["AcceleratedBase"]


class AcceleratedBase:
    """What a guard needs from the Accelerate wrapper it steps through (``of(optimizer)`` finds one)."""

    def __init__(self, wrapper: Any) -> None:
        self._wrapper = wrapper
        self._found: dict[Any, Tensor] = {}  # the scaler's per-device overflow flags of this step

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer) -> AcceleratedBase | None:
        """An adapter when ``optimizer`` is Accelerate's wrapper (it has ``gradient_state`` and ``optimizer``)."""
        state = getattr(optimizer, "gradient_state", None)
        inner = getattr(optimizer, "optimizer", None)
        if hasattr(state, "sync_gradients") and isinstance(inner, torch.optim.Optimizer):
            return cls(optimizer)
        return None

    @property
    def steps(self) -> bool:
        """False on an accumulation micro-step, where Accelerate does not step the optimizer."""
        return bool(self._wrapper.gradient_state.sync_gradients)

    def scaler(self) -> Any:
        """The wrapper's GradScaler when it is enabled, else None."""
        scaler = getattr(self._wrapper, "scaler", None)
        return scaler if scaler is not None and scaler.is_enabled() else None

    def unscale(self, device: torch.device) -> Tensor | None:
        """Unscale the gradients now, unless done already (``accelerator.clip_grad_norm_``); the scaler's
        overflow flag on ``device`` (not read on the host), or None without a scaler."""
        scaler = self.scaler()
        if scaler is None:
            return None
        inner = self._wrapper.optimizer
        # the per-device flags unscale_ records (what torch's own fused step and Lightning read); empty before
        found = scaler._found_inf_per_device(inner)
        if not found:
            scaler.unscale_(inner)
            found = scaler._found_inf_per_device(inner)
        self._found = found
        return torch.stack([flag.to(device, torch.float32, non_blocking=True) for flag in found.values()]).sum()

    def agree(self, overflow: Tensor) -> None:
        """Give the scaler the overflow the ranks agreed on (a peer's included), so its step skips and its scale
        moves alike on every rank. Device copies, no host read."""
        if self._found:
            flag = (overflow > 0).to(torch.float32)
            for found in self._found.values():
                found.copy_(flag.to(found.device, non_blocking=True).reshape(found.shape))
        self._found = {}

    def skipped(self) -> None:
        """The guard did not step a step Accelerate would have taken: the scaler still closes its iteration."""
        scaler = self.scaler()
        if scaler is not None:
            scaler.update()
