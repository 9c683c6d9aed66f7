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

``on_repeat`` says what a *repeated* rollback does: one that returns to the same snapshot as the rollback
before it (the run could not get past that point). ``"rollback"`` (the default) rolls back again, ``"raise"``
halts, ``"lower_lr"``/``LowerLR(...)`` multiplies the learning rate by ``factor`` each time, bounded by
``floor``, and halts once the next back-off would go below it.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Literal

import torch
from torch import Tensor

from guardtower.errors import ConfigError

__all__ = ["Action", "ACTIONS", "CLIP_MODES", "ON_REPEAT", "ActionPolicy", "LowerLR", "RepeatTracker", "resolve_on_repeat",
           "scaled_lr", "clip_factor", "supports_device_skip", "device_skip"]

Action = Literal["skip", "clip", "rollback", "raise"]
ACTIONS: tuple[str, ...] = ("skip", "clip", "rollback", "raise")
CLIP_MODES: tuple[str, ...] = ("global", "per_tensor")
ON_REPEAT: tuple[str, ...] = ("rollback", "raise", "lower_lr")
_STATE_FIX = "load a state dict saved by GuardedOptimizer.state_dict()"


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


@dataclass(frozen=True)
class LowerLR:
    """``on_repeat=LowerLR(...)`` (``"lower_lr"`` is ``LowerLR()``): each repeated rollback multiplies the
    learning rate by ``factor``; ``floor`` is the smallest multiple of the scheduled learning rate allowed
    (0.5 and 0.05: at most 4 back-offs, to 0.0625x; the next repeat halts)."""

    factor: float = 0.5
    floor: float = 0.05

    def __post_init__(self) -> None:
        for name in ("factor", "floor"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < 1):
                raise ConfigError(f"on_repeat.{name}", f"must lie strictly between 0 and 1, got {value!r}",
                                  f"pass e.g. LowerLR({name}={getattr(LowerLR, name)})")
            object.__setattr__(self, name, float(value))
        if self.factor < self.floor:
            raise ConfigError("on_repeat.floor", f"floor {self.floor:g} is above the first back-off "
                              f"({self.factor:g}x): the first repeat would halt", "pass a floor below factor")


def resolve_on_repeat(value: Any, policy: ActionPolicy) -> str | LowerLR:
    """``"rollback"``, ``"raise"`` or a ``LowerLR`` (``"lower_lr"`` -> ``LowerLR()``); a value other than
    ``"rollback"`` needs a policy that rolls back."""
    if value == "lower_lr":
        value = LowerLR()
    if not isinstance(value, LowerLR) and value not in ON_REPEAT:
        raise ConfigError("on_repeat", f"expected one of {list(ON_REPEAT)} or a LowerLR(...), got {value!r}",
                          'pass e.g. on_repeat="lower_lr" or on_repeat=LowerLR(factor=0.5, floor=0.05)')
    if value != "rollback" and not policy.may_rollback:
        raise ConfigError("on_repeat", "acts on repeated rollbacks, and this guard never rolls back",
                          "pass nan_action='rollback' (or escalate_to='rollback'), or leave on_repeat out")
    return value


class RepeatTracker:
    """Rollbacks in a row to the same snapshot, and the learning-rate scale the back-offs brought."""

    def __init__(self, on_repeat: str | LowerLR) -> None:
        self.on_repeat = on_repeat
        self.target: int | None = None  # the snapshot step the last rollback went to
        self.repeats = 0  # rollbacks to ``target`` after the first
        self.scale = 1.0
        self.backoffs = 0

    def rollback(self, to_step: int) -> str:
        """What a rollback to ``to_step`` does: ``"rollback"``, ``"lower_lr"`` (the scale went down) or ``"raise"``."""
        self.repeats = self.repeats + 1 if to_step == self.target else 0
        self.target = to_step
        if self.repeats == 0 or self.on_repeat == "rollback":
            return "rollback"
        if not isinstance(self.on_repeat, LowerLR):
            return "raise"
        lower = self.scale * self.on_repeat.factor
        if lower < self.on_repeat.floor * (1 - 1e-9):
            return "raise"
        self.scale, self.backoffs = lower, self.backoffs + 1
        return "lower_lr"

    def state_dict(self) -> dict[str, Any]:
        return {"target": -1 if self.target is None else self.target, "repeats": self.repeats, "scale": self.scale,
                "backoffs": self.backoffs}

    @staticmethod
    def check_state_dict(state: Any) -> None:
        ints = ("target", "repeats", "backoffs")
        ok = (isinstance(state, dict) and all(isinstance(state.get(k), int) and not isinstance(state.get(k), bool)
                                              for k in ints)
              and isinstance(state.get("scale"), (int, float)) and not isinstance(state.get("scale"), bool)
              and math.isfinite(state["scale"]) and 0 < state["scale"] <= 1)
        if not ok:
            raise ConfigError("state_dict", "its on_repeat section is malformed", _STATE_FIX)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.target = None if state["target"] < 0 else state["target"]
        self.repeats, self.scale, self.backoffs = state["repeats"], float(state["scale"]), state["backoffs"]


@contextlib.contextmanager
def scaled_lr(optimizer: torch.optim.Optimizer, scale: float) -> Iterator[None]:
    """Every group's ``lr`` times ``scale`` for one ``step`` (schedulers and the loop watch see theirs)."""
    if scale == 1.0:
        yield
        return
    saved = [group["lr"] for group in optimizer.param_groups]
    for group, lr in zip(optimizer.param_groups, saved):
        group["lr"] = lr * scale
    try:
        yield
    finally:
        for group, lr in zip(optimizer.param_groups, saved):
            group["lr"] = lr


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
