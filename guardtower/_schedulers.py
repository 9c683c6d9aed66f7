"""Find the LR schedulers that drive an optimizer without being handed them: the audit and the loop watch both
need it, for a plain loop that never passes its scheduler."""

from __future__ import annotations

import gc
from typing import Any

__all__ = ["schedulers_of"]


def schedulers_of(target: Any) -> list[Any]:
    """Scheduler-like objects (``get_last_lr`` and ``state_dict``) whose ``.optimizer`` is ``target``, found
    through the objects that refer to it (``gc.get_referrers``: it walks the heap, so callers ask only once a
    scheduler has marked the optimizer)."""
    found: list[Any] = []
    for ref in gc.get_referrers(target):
        owner = ref
        if isinstance(ref, dict):  # an instance whose attributes live in a separate __dict__
            if ref.get("optimizer") is not target:
                continue
            owner = next((o for o in gc.get_referrers(ref) if getattr(o, "__dict__", None) is ref), None)
        if (owner is not None and not isinstance(owner, dict) and getattr(owner, "optimizer", None) is target
                and callable(getattr(owner, "get_last_lr", None)) and callable(getattr(owner, "state_dict", None))
                and all(owner is not f for f in found)):
            found.append(owner)
    return found
