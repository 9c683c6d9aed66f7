"""Walk an LR schedule without moving it: step the scheduler on the real optimizer, read the learning rates,
and put the scheduler and the groups' hyper-parameters back. Also find the scheduler that drives an optimizer
when the caller did not pass one."""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from typing import Any, cast

import torch

from guardtower._schedulers import schedulers_of

__all__ = ["LOOKAHEAD_STEPS", "MAX_WALK", "Walk", "ScheduleState", "peak_lrs", "walk_schedule", "find_scheduler"]

#: how many scheduler steps the audit looks ahead when the run length is unknown (a schedule still at 0 after
#: this many never trains in time)
LOOKAHEAD_STEPS = 1000
#: the longest walk, in scheduler steps: a longer planned run is judged on its first MAX_WALK steps
MAX_WALK = 20_000


@dataclass(frozen=True)
class Walk:
    """The lr each param group uses at each optimizer step of the planned run, at the measured cadence."""

    lrs: list[list[float]]
    """``lrs[g][k]``: the lr of group ``g`` at optimizer step ``k`` (0 = now)"""
    cadence: int
    """scheduler steps per optimizer step the walk used"""
    planned: int
    """the planned optimizer steps (the walk may be shorter when capped)"""


class ScheduleState:
    """A scheduler's state, kept so the audit can put it back after a ``step_fn`` that steps it."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self.saved = (copy.deepcopy(scheduler.state_dict())
                      if callable(getattr(scheduler, "state_dict", None))
                      and callable(getattr(scheduler, "load_state_dict", None)) else None)

    def restore(self) -> None:
        if self.saved is not None:
            self.scheduler.load_state_dict(copy.deepcopy(self.saved))


def _groups(scheduler: Any, optimizer: Any) -> list[dict[str, Any]] | None:
    found = getattr(optimizer, "param_groups", None)
    if not isinstance(found, list):
        return None
    groups = cast("list[dict[str, Any]]", found)
    if getattr(getattr(scheduler, "optimizer", None), "param_groups", None) is not groups:
        return None
    if not callable(getattr(scheduler, "state_dict", None)) or not callable(getattr(scheduler, "load_state_dict", None)):
        return None
    return groups


def walk_schedule(scheduler: Any, optimizer: Any, planned: int, cadence: int = 1, *,
                  stop_when_positive: bool = False) -> Walk | None:
    """Step ``scheduler`` ``cadence`` times per planned optimizer step and record every group's lr, then put the
    scheduler and the groups back. None when the scheduler cannot be stepped on its own (it needs a metric, or
    it drives another optimizer)."""
    groups = _groups(scheduler, optimizer)
    if groups is None or planned < 1 or cadence < 1:
        return None
    saved_sched = copy.deepcopy(scheduler.state_dict())
    saved_groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in groups]
    lrs: list[list[float]] = [[_lr(g)] for g in groups]
    steps = min(planned, max(1, MAX_WALK // cadence))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "lr_scheduler.step() before optimizer.step()": on purpose here
            for _ in range(steps - 1):
                for _ in range(cadence):
                    scheduler.step()
                for series, g in zip(lrs, groups):
                    series.append(_lr(g))
                if stop_when_positive and all(max(s) > 0 for s in lrs):
                    break
    except (TypeError, ValueError, ZeroDivisionError):
        # ReduceLROnPlateau and friends need a metric; OneCycleLR refuses to step past its total_steps
        if all(len(s) < 2 for s in lrs):
            return None
    finally:
        scheduler.load_state_dict(saved_sched)
        for group, hyper in zip(groups, saved_groups):
            group.update(hyper)
    return Walk(lrs, cadence, planned)


def peak_lrs(scheduler: Any, optimizer: Any, steps: int = LOOKAHEAD_STEPS) -> list[float] | None:
    """The largest lr each param group reaches over the next ``steps`` scheduler steps (now included), or None
    when the scheduler cannot be walked."""
    walk = walk_schedule(scheduler, optimizer, steps + 1, stop_when_positive=True)
    return None if walk is None else [max(series) for series in walk.lrs]


def find_scheduler(optimizer: Any) -> Any:
    """The LR scheduler object whose ``.optimizer`` is ``optimizer`` (a scheduler attached to it but not passed
    to the audit), or None."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        return None
    if not hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        return None  # torch's LR schedulers mark the step of an optimizer they drive; none was built for this one
    found = schedulers_of(optimizer)
    return found[0] if found else None


def _lr(group: dict[str, Any]) -> float:
    lr = group.get("lr", 0.0)
    try:
        return float(lr)
    except (TypeError, ValueError):
        return 0.0
