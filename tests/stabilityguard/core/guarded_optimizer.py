"""``stabilityguard.core.guarded_optimizer.GuardedOptimizer`` (tests-only shim) over guardtower's guard."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from guardtower.guard import GuardedOptimizer as _GuardedOptimizer

__all__ = ["GuardedOptimizer"]


class GuardedOptimizer(_GuardedOptimizer):
    """The original's constructor (same arguments and defaults, positional or not) on guardtower's guard.

    The one difference in defaults: the original checkpoints after every clean step, so its ``"rollback"``
    returns to the last clean step; guardtower snapshots every ``rollback_every`` steps (100 by default,
    a full copy is not free), so the shim asks for a snapshot every step.
    """

    def __init__(self, base_optimizer: torch.optim.Optimizer, model: nn.Module, spike_threshold: float = 10.0,
                 nan_action: str = "skip", log_every: int = 50, log_dir: str | os.PathLike[str] = "./sg_logs",
                 ema_alpha: float = 0.01, warmup_steps: int = 10, verbose: bool = True, **kwargs: Any) -> None:
        kwargs.setdefault("rollback_every", 1)
        super().__init__(base_optimizer, model, spike_threshold=spike_threshold, nan_action=nan_action,
                         log_every=log_every, log_dir=log_dir, ema_alpha=ema_alpha, warmup_steps=warmup_steps,
                         verbose=verbose, **kwargs)
