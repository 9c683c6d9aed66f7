"""Look ahead along an LR schedule without moving it: step the scheduler on the real optimizer, read the
learning rates, and put the scheduler and the groups' hyper-parameters back."""

from __future__ import annotations

import copy
import warnings
from typing import Any, cast

__all__ = ["LOOKAHEAD_STEPS", "peak_lrs"]

#: how many scheduler steps the audit looks ahead (a schedule still at 0 after this many never trains in time)
LOOKAHEAD_STEPS = 1000


def peak_lrs(scheduler: Any, optimizer: Any, steps: int = LOOKAHEAD_STEPS) -> list[float] | None:
    """The largest lr each param group reaches over the next ``steps`` scheduler steps (now included), or None
    when the scheduler cannot be stepped on its own (it needs a metric, or it drives another optimizer)."""
    found = getattr(optimizer, "param_groups", None)
    if not isinstance(found, list):
        return None
    groups = cast("list[dict[str, Any]]", found)
    if getattr(getattr(scheduler, "optimizer", None), "param_groups", None) is not groups:
        return None
    if not callable(getattr(scheduler, "state_dict", None)) or not callable(getattr(scheduler, "load_state_dict", None)):
        return None
    saved_sched = copy.deepcopy(scheduler.state_dict())
    saved_groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in groups]
    peaks = [_lr(g) for g in groups]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "lr_scheduler.step() before optimizer.step()": on purpose here
            for _ in range(steps):
                scheduler.step()
                peaks = [max(p, _lr(g)) for p, g in zip(peaks, groups)]
                if all(p > 0 for p in peaks):
                    break
    except TypeError:  # ReduceLROnPlateau and friends need a metric
        return None
    finally:
        scheduler.load_state_dict(saved_sched)
        for group, hyper in zip(groups, saved_groups):
            group.update(hyper)
    return peaks


def _lr(group: dict[str, Any]) -> float:
    lr = group.get("lr", 0.0)
    try:
        return float(lr)
    except (TypeError, ValueError):
        return 0.0
