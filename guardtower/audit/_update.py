"""One real optimizer step on the audit's gradients, measured and then undone by the caller's snapshot.

The step calls the base optimizer's own ``step`` below the hook wrapper, so optimizer step hooks (EMA
updates, LR-scheduler bookkeeping, guards) do not fire for an update that is rolled back anyway.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from guardtower.audit._registry import AuditContext
from guardtower.audit._util import base_optimizer

__all__ = ["UpdateStats", "measure_update"]


@dataclass(frozen=True)
class UpdateStats:
    """How one optimizer step changed one parameter tensor."""

    ratio: float
    """``||delta|| / ||param||`` (inf when the parameter norm is zero and it moved)"""
    stuck_fraction: float
    """fraction of elements with a non-zero gradient whose value did not change"""
    dtype: str
    ndim: int


def measure_update(ctx: AuditContext, before: dict[int, torch.Tensor]) -> dict[str, UpdateStats]:
    """Run one step of the base optimizer and measure it per trainable parameter (values are NOT restored)."""
    opt = base_optimizer(ctx.optimizer)
    if opt is None or isinstance(opt, torch.optim.LBFGS):  # LBFGS steps need a closure re-evaluating the loss
        return {}
    in_opt = {id(p) for group in opt.param_groups for p in group["params"]}
    step: Any = type(opt).step
    raw = step.__wrapped__ if getattr(step, "hooked", False) and hasattr(step, "__wrapped__") else step
    raw(opt)
    stats: dict[str, UpdateStats] = {}
    with torch.no_grad():
        for name, p in ctx.params.items():
            saved = before.get(id(p))
            if saved is None or id(p) not in in_opt or p.grad is None or not p.requires_grad:
                continue
            delta = p.detach().float() - saved.float()
            p_norm = float(saved.float().norm())
            d_norm = float(delta.norm())
            ratio = d_norm / p_norm if p_norm > 0 else (float("inf") if d_norm > 0 else 0.0)
            moving = p.grad != 0
            n_moving = int(moving.sum())
            stuck = float(((delta == 0) & moving).sum()) / n_moving if n_moving else 0.0
            stats[name] = UpdateStats(ratio=ratio, stuck_fraction=stuck, dtype=str(p.dtype).replace("torch.", ""), ndim=p.dim())
    return stats
