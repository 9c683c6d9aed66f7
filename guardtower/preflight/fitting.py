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

#: the loss after N steps must be at least this much (relative) below the first one
MIN_RELATIVE_DROP = 0.05
#: a loss this close to 0 has nothing left to fall
_ALREADY_FIT = 1e-4


@check("overfit_batch", emits=("LOSS-009",), needs=("overfit",))
def check_overfit_batch(ctx: AuditContext) -> Iterable[Finding]:
    """LOSS-009: the loss does not fall over N optimizer steps on one batch."""
    losses = ctx.trace.overfit_losses if ctx.trace is not None else []
    if len(losses) < 2:
        return []
    first, last = losses[0], losses[-1]
    steps = len(losses) - 1
    details = {"losses": [round(v, 6) if math.isfinite(v) else str(v) for v in losses], "steps": steps}
    if not math.isfinite(last):
        return [Finding(
            "overfit_batch", Severity.ERROR,
            f"overfitting one batch, the loss went from {first:.4g} to {last} after {steps} step(s): training "
            "diverges on data it has already seen (learning rate far too high, or a numerically unstable loss)",
            "LOSS-009", details,
        )]
    if abs(first) < _ALREADY_FIT:
        return []
    drop = (first - last) / abs(first)
    if drop >= MIN_RELATIVE_DROP:
        return []
    return [Finding(
        "overfit_batch", Severity.ERROR,
        f"{steps} optimizer steps on this one batch moved its loss from {first:.4g} to {last:.4g} "
        f"({-100 * drop:+.1f}%): a correctly wired model memorises one batch, so the labels do not match the "
        "inputs, the loss does not measure the model's output, nothing trains, or the learning rate is too small",
        "LOSS-009", {**details, "relative_drop": drop},
    )]
