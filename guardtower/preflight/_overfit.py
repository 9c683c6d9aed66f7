"""Overfit one batch: N real optimizer steps on the audited batch, whose losses a correctly wired model must
drive down. Run under the audit's isolated optimizer state; the caller restores every value afterwards."""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from guardtower._dist import current_rank
from guardtower._progress import Progress
from guardtower.preflight._registry import AuditContext
from guardtower.preflight._schedule import LOOKAHEAD_STEPS, walk_schedule
from guardtower.preflight._step import extract_loss
from guardtower.preflight._update import unhooked_step
from guardtower.preflight._util import base_optimizer

__all__ = ["overfit_losses", "at_peak_lr"]


def at_peak_lr(ctx: AuditContext) -> list[float]:
    """Set every param group to the peak lr its schedule reaches over the planned run (or the look-ahead), so
    one batch is overfit at the lr training will really use, not at warmup's first value; returns the lrs.
    The caller restores the groups' hyper-parameters afterwards."""
    opt = base_optimizer(ctx.optimizer)
    if opt is None:
        return []
    walk = (walk_schedule(ctx.lr_scheduler, opt, ctx.total_steps or LOOKAHEAD_STEPS)
            if ctx.lr_scheduler is not None else None)
    peaks = None if walk is None else [max(series) for series in walk.lrs]
    for gi, group in enumerate(opt.param_groups):
        if peaks is not None and gi < len(peaks) and peaks[gi] > 0:
            group["lr"] = peaks[gi]
    return [float(g["lr"]) for g in opt.param_groups]


def overfit_losses(ctx: AuditContext, step_fn: Callable[[], Any], steps: int, *, verbose: bool = True) -> list[float]:
    """The loss before each of ``steps`` optimizer steps on the same batch, plus the loss after the last one.

    Stops early (shorter list) when the loss goes non-finite or the step stops producing a differentiable
    loss. Optimizer step hooks do not fire: nothing outside the audit sees these updates.
    """
    opt = base_optimizer(ctx.optimizer)
    if opt is None or isinstance(opt, torch.optim.LBFGS):
        return []
    raw = unhooked_step(opt)
    trainable = [p for p in ctx.params.values() if p.requires_grad]
    losses: list[float] = []
    progress = Progress(steps, "guardtower audit: overfitting one batch, step", verbose and current_rank() == 0)
    try:
        _run(opt, raw, trainable, step_fn, steps, losses, progress)
    finally:
        progress.close()
    for p in trainable:
        p.grad = None
    return losses


def _run(opt: Any, raw: Any, trainable: list[Any], step_fn: Callable[[], Any], steps: int, losses: list[float],
         progress: Progress) -> None:
    for i in range(steps + 1):
        for p in trainable:
            p.grad = None
        with torch.enable_grad():
            loss = extract_loss(step_fn())
        if not isinstance(loss, torch.Tensor):
            break
        value = float(loss.detach().float().mean())
        losses.append(value)
        if i == steps or not math.isfinite(value) or not loss.requires_grad:
            break
        (loss if loss.numel() == 1 else loss.float().mean()).backward()
        raw(opt)
        progress.update(f"loss {value:.4g}")
