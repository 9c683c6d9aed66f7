"""A real optimizer step on the audit's gradients, one trainable tensor at a time, measured and undone.

Each call runs the base optimizer's own ``step`` below the hook wrapper, so optimizer step hooks (EMA
updates, LR-scheduler bookkeeping, guards) do not fire for an update that is rolled back anyway.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from guardtower.audit._registry import AuditContext
from guardtower.audit._state import clone_value, restore_value
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


def measure_update(ctx: AuditContext) -> dict[str, UpdateStats]:
    """Step the base optimizer one trainable tensor at a time, measure, and put that tensor and its optimizer
    state back before the next, so the extra memory is one tensor's worth, not a copy of the optimizer."""
    opt = base_optimizer(ctx.optimizer)
    if opt is None or isinstance(opt, torch.optim.LBFGS):  # LBFGS steps need a closure re-evaluating the loss
        return {}
    step: Any = type(opt).step
    raw = step.__wrapped__ if getattr(step, "hooked", False) and hasattr(step, "__wrapped__") else step
    names = {id(p): n for n, p in ctx.params.items()}
    groups = opt.param_groups
    lists = [g["params"] for g in groups]
    stats: dict[str, UpdateStats] = {}
    try:
        for gi, params in enumerate(lists):
            for p in params:
                if id(p) in names and p.grad is not None and p.requires_grad:
                    for gj, group in enumerate(groups):
                        group["params"] = [p] if gj == gi else []
                    stats[names[id(p)]] = _step_one(opt, raw, p)
    finally:
        for group, params in zip(groups, lists):
            group["params"] = params
    return stats


def _step_one(opt: torch.optim.Optimizer, raw: Any, p: torch.Tensor) -> UpdateStats:
    before = p.detach().clone()
    saved = opt.state.get(p)
    saved_copy = None if saved is None else {k: clone_value(v) for k, v in saved.items()}
    try:
        raw(opt)
        with torch.no_grad():
            delta = p.detach().float() - before.float()
            p_norm = float(before.float().norm())
            d_norm = float(delta.norm())
            moving = p.grad != 0 if p.grad is not None else torch.zeros_like(p, dtype=torch.bool)
            n_moving = int(moving.sum())
            stuck = float(((delta == 0) & moving).sum()) / n_moving if n_moving else 0.0
    finally:
        with torch.no_grad():
            p.copy_(before)
        if saved is None or saved_copy is None:
            opt.state.pop(p, None)
        else:
            current = opt.state.setdefault(p, saved)
            if current is not saved:
                opt.state[p] = saved
            for k in [k for k in saved if k not in saved_copy]:
                del saved[k]
            for k, v in saved_copy.items():
                saved[k] = restore_value(saved.get(k), v)
    ratio = d_norm / p_norm if p_norm > 0 else (float("inf") if d_norm > 0 else 0.0)
    return UpdateStats(ratio=ratio, stuck_fraction=stuck, dtype=str(p.dtype).replace("torch.", ""), ndim=p.dim())
