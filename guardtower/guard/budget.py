"""The skip budget: one warning when too large a share of recent steps was rejected, so a run that quietly
skips (or clips) its way through bad data is never silent.

Counted on the host from the step records the guard already reads back asynchronously: no device op and
no host sync per step, a deque append per rejected step only.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass
from typing import Any

from guardtower.errors import ConfigError

__all__ = ["SkipBudget", "BudgetCounter", "resolve_skip_budget"]

_FIX = "load a state dict saved by GuardedOptimizer.state_dict()"


@dataclass(frozen=True)
class SkipBudget:
    """``GuardedOptimizer(skip_budget=SkipBudget(...))``; ``skip_budget=True`` is ``SkipBudget()``.

    A ``skip_budget`` event (WARN) is published when more than ``share`` of the last ``window`` steps were
    rejected (skipped, clipped or rolled back), at most once per ``window`` steps while the run stays over.
    """

    share: float = 0.01
    window: int = 1000

    def __post_init__(self) -> None:
        share = self.share
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not (0 < share < 1):
            raise ConfigError("skip_budget.share", f"must lie strictly between 0 and 1, got {share!r}",
                              "pass e.g. SkipBudget(share=0.01) for 1% of the window")
        window = self.window
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ConfigError("skip_budget.window", f"must be a positive int, got {window!r}",
                              "pass e.g. SkipBudget(window=1000)")
        object.__setattr__(self, "share", float(share))

    @property
    def allowed(self) -> int:
        """Rejected steps the window may hold without a warning."""
        return math.floor(self.share * self.window + 1e-9)


def resolve_skip_budget(value: Any) -> SkipBudget | None:
    """``True`` -> ``SkipBudget()``, ``False``/``None`` -> off, a ``SkipBudget`` as it is; else ConfigError."""
    if value is True:
        return SkipBudget()
    if value is False or value is None:
        return None
    if isinstance(value, SkipBudget):
        return value
    raise ConfigError("skip_budget", f"expected True, False or a SkipBudget(...), got {value!r}",
                      "pass skip_budget=SkipBudget(share=0.01, window=1000), or False to turn it off")


class BudgetCounter:
    """The rejected steps of the last ``window`` steps, and when the budget last warned."""

    def __init__(self, options: SkipBudget) -> None:
        self.options = options
        self._recent: collections.deque[tuple[int, str]] = collections.deque()  # (step, action), oldest first
        self._warned_at: int | None = None

    def note(self, step: int, action: str) -> dict[str, Any] | None:
        """Count a rejected step; the counts when this one takes the window over budget and a warning is due."""
        window = self.options.window
        recent = self._recent
        recent.append((step, action))
        while recent and recent[0][0] <= step - window:
            recent.popleft()
        if len(recent) <= self.options.allowed:
            return None
        if self._warned_at is not None and step < self._warned_at + window:
            return None
        self._warned_at = step
        actions = collections.Counter(a for _, a in recent)
        return {"rejected": len(recent), "steps": min(step, window), "window": window, "share": self.options.share,
                "skipped": actions["skip"], "clipped": actions["clip"], "rolled_back": actions["rollback"]}

    def state_dict(self) -> dict[str, Any]:
        return {"steps": [s for s, _ in self._recent],
                "actions": [a for _, a in self._recent], "warned_at": -1 if self._warned_at is None else self._warned_at}

    @staticmethod
    def check_state_dict(state: Any) -> None:
        """Raise ``ConfigError`` unless ``state`` is a ``state_dict()`` of a counter."""
        ok = (isinstance(state, dict) and isinstance(state.get("steps"), list) and isinstance(state.get("actions"), list)
              and len(state["steps"]) == len(state["actions"]) and isinstance(state.get("warned_at"), int)
              and all(isinstance(s, int) and not isinstance(s, bool) for s in state["steps"])
              and all(isinstance(a, str) for a in state["actions"]))
        if not ok:
            raise ConfigError("state_dict", "its skip-budget section is malformed", _FIX)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a (checked) state; under a different ``window`` the next ``note`` drops what falls outside."""
        self._recent = collections.deque(zip(state["steps"], state["actions"]))
        self._warned_at = None if state["warned_at"] < 0 else state["warned_at"]
