"""How an incident is named for people, in one place: console boxes, W&B alerts and every alert format.

A rejected step with NaN/Inf gradients is a "NaN/Inf gradient", never a "gradient spike".
"""

from __future__ import annotations

import math
from typing import Any

from guardtower.events import Event

__all__ = ["what", "title", "num", "kind"]


def what(event: Event) -> str:
    """The short name of what happened, without place or numbers (stable: W&B throttles on it)."""
    get = lambda name: getattr(event, name, "")  # noqa: E731
    if event.kind == "spike":
        return "NaN/Inf gradient" if get("reason") == "nonfinite" else "gradient spike"
    if event.kind == "preflight":
        return "pre-flight failed" if get("status") == "FAIL" else f"pre-flight {get('status')}"
    if event.kind == "rollback":
        return "rolled back to a snapshot"
    if event.kind == "halt":
        return "training halted"
    if event.kind == "skip":
        return "skipped update"
    if event.kind == "nonfinite":
        return f"NaN/Inf {get('where') or 'value'}"
    if event.kind == "stall":
        return "training resumed" if get("resolved") else "training stalled"
    if event.kind == "skip_budget":
        return "skip budget exceeded"
    if event.kind == "lr_backoff":
        return "learning rate lowered"
    return event.kind


def kind(event: Event) -> str:
    """The kind people are shown: a rejected step with NaN/Inf gradients is ``nonfinite``, not ``spike``."""
    if event.kind == "spike" and getattr(event, "reason", "") == "nonfinite":
        return "nonfinite"
    return event.kind


def title(event: Event) -> str:
    """What happened and where, without counts: ``NaN/Inf gradient in transformer.h.3.mlp``."""
    get = lambda name: getattr(event, name, "")  # noqa: E731
    where = get("layer") or get("module") or "the model"
    if event.kind == "spike":
        if get("reason") == "nonfinite":
            return f"NaN/Inf gradient in {where}"
        return f"Gradient spike in {where} ({num(get('ratio'))}x baseline)"
    if event.kind == "skip":
        return f"Skipped update ({get('reason')}) in {where}"
    if event.kind == "rollback":
        return f"Rolled back to step {get('to_step'):,} after {get('reason')} in {where}"
    if event.kind == "halt":
        return f"Training halted: {get('reason') or 'error'} in {where}"
    if event.kind == "nonfinite":
        return f"NaN/Inf {get('where')} in {where}"
    if event.kind == "stall":
        if get("resolved"):
            return f"Training resumed after {num(get('seconds'))} s without an optimizer step"
        return f"Training stalled: no optimizer step for {num(get('seconds'))} s"
    if event.kind == "preflight":
        ids = ", ".join(get("error_ids") or get("warning_ids"))
        return f"Pre-flight {get('status')}: {get('errors')} error(s), {get('warnings')} warning(s)" + (
            f" ({ids})" if ids else "")
    if event.kind == "finding":
        return f"{get('catalog_id')} {get('check')}: {get('message')}"
    if event.kind == "summary":
        return f"Step summary: grad norm {num(get('grad_norm'))}"
    if event.kind == "skip_budget":
        return f"Skip budget exceeded: {get('rejected')} of the last {get('steps'):,} steps rejected"
    if event.kind == "lr_backoff":
        return f"Learning rate lowered to {num(get('scale'))}x after {get('repeats')} rollbacks to step {get('to_step'):,}"
    return event.kind


def num(value: Any) -> str:
    """A number for people: 4 significant digits; nan/inf spelled out."""
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:.4g}"
    return str(value)
