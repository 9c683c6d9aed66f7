"""``overfit_batch``: with ``audit(steps=N)``, N optimizer steps on the one audited batch must drive its loss
down, as they do for any correctly wired model. Wrong or shuffled labels, a loss that does not measure the
model's output, a frozen model or a uselessly small learning rate all leave it flat."""

from __future__ import annotations

import math
from typing import Iterable

from guardtower.preflight._registry import AuditContext, check
from guardtower.report import Finding
from guardtower.severity import Severity

__all__ = ["MIN_RELATIVE_DROP"]

#: the loss after N steps must be at least this much (relative) below the first one: a correctly wired tiny GPT
#: at AdamW lr=1e-4 falls 3.5% in 10 steps on random tokens, a 1e-9 learning rate or re-drawn labels ~0%
MIN_RELATIVE_DROP = 0.01
#: and at least this share of the steps must lower it: labels re-drawn every step make it wander instead
MIN_FALLING_SHARE = 0.6
#: a loss this close to 0 has nothing left to fall
_ALREADY_FIT = 1e-4


@check("overfit_batch", emits=("LOSS-009",), needs=("overfit",))
def check_overfit_batch(ctx: AuditContext) -> Iterable[Finding]:
    """LOSS-009: the loss does not fall, steadily, over N optimizer steps on one batch."""
    losses = ctx.trace.overfit_losses if ctx.trace is not None else []
    if len(losses) < 2:
        return []
    first, last = losses[0], losses[-1]
    steps = len(losses) - 1
    lrs = ctx.trace.overfit_lrs if ctx.trace is not None else []
    details = {"losses": [round(v, 6) if math.isfinite(v) else str(v) for v in losses], "steps": steps, "lr": lrs}
    at = f" at lr {', '.join(f'{lr:.3g}' for lr in lrs)}" if lrs else ""
    if not math.isfinite(last):
        return [Finding(
            "overfit_batch", Severity.ERROR,
            f"overfitting one batch{at}, the loss went from {first:.4g} to {last} after {steps} step(s): training "
            "diverges on data it has already seen (learning rate far too high, or a numerically unstable loss)",
            "LOSS-009", details,
        )]
    if abs(first) < _ALREADY_FIT:
        return []
    drop = (first - last) / abs(first)
    falling = sum(b < a for a, b in zip(losses, losses[1:])) / steps
    if drop >= MIN_RELATIVE_DROP and falling >= MIN_FALLING_SHARE:
        return []
    return [Finding(
        "overfit_batch", Severity.ERROR,
        f"{steps} optimizer steps{at} on this one batch moved its loss from {first:.4g} to {last:.4g} "
        f"({-100 * drop:+.1f}%, lower after {100 * falling:.0f}% of the steps): a correctly wired model memorises "
        "one batch steadily, so the labels do not match the "
        "inputs, the loss does not measure the model's output, nothing trains, or the learning rate is too small",
        "LOSS-009", {**details, "relative_drop": drop, "falling_share": falling},
    )]
