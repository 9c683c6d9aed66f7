"""Hand-written loss terms cut from the graph.

A full reduction (``mean``, ``sum``) computed with gradients on whose result has no gradient, then added to the loss
that trains, changes the loss value and trains nothing. A constant term is a design (a KL written as a
cross-entropy minus the targets' entropy, a frozen teacher's own score); a term whose value moves with the trained
weights was computed from the model's outputs through ``.numpy()``, ``.item()``, ``torch.tensor(...)`` or
``.detach()``: the graph was cut where the loss needed it. The step runs once more with the trained weights changed
to tell the two apart.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch

from guardtower.preflight._util import patched

__all__ = ["CutTerm", "reduction_patches", "recorder", "mark_moving"]

#: the reductions a hand-written loss term ends with
_REDUCTIONS = ("mean", "sum")
#: cut reductions recorded per step, at most
_MAX_TERMS = 16
#: the change given to each trained weight, relative to its mean magnitude
_NUDGE = 0.05


@dataclass
class CutTerm:
    """One full reduction computed with gradients on whose result has no gradient."""

    fn: str
    input_shape: tuple[int, ...]
    dead: float
    """its value"""
    dead_added: bool = False
    """it (or a scaling of it) was added to, or subtracted from, a tensor that trains"""
    moves: bool = False
    """its value changed when the trained weights did"""


def reduction_patches(seen: Callable[[str, torch.Tensor, torch.Tensor], object]) -> list[tuple[Any, str, Any]]:
    """Patches (for ``_util.patched``) of ``torch.mean/sum`` and ``Tensor.mean/sum`` that call ``seen(fn, input,
    result)`` for every full reduction, computed with gradients on, whose result has no gradient."""

    def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            result = fn(*args, **kwargs)
            try:
                source = args[0] if args else None
                if (torch.is_grad_enabled() and isinstance(result, torch.Tensor) and result.dim() == 0
                        and result.is_floating_point() and not result.requires_grad
                        and isinstance(source, torch.Tensor) and source.numel() >= 2):
                    seen(name, source, result)
            except Exception:  # observing must never change what the step does
                pass
            return result

        return wrapper

    return [(owner, name, functools.partial(wrap, name)) for owner in (torch, torch.Tensor) for name in _REDUCTIONS]


def recorder(terms: list[CutTerm]) -> Callable[[str, torch.Tensor, torch.Tensor], CutTerm | None]:
    """A ``seen`` callback that records each cut reduction as a ``CutTerm`` (the first ``_MAX_TERMS``)."""

    def seen(name: str, source: torch.Tensor, result: torch.Tensor) -> CutTerm | None:
        if len(terms) >= _MAX_TERMS:
            return None
        term = CutTerm(name, tuple(source.shape), float(result.detach().float()))
        terms.append(term)
        return term

    return seen


def mark_moving(terms: list[CutTerm], trained: list[torch.Tensor], step_fn: Callable[[], Any],
                rng: Callable[[], None]) -> None:
    """Re-run ``step_fn`` (same RNG stream) with every trained weight nudged, record the cut reductions again in
    order, and set ``moves`` on the added terms whose value changed. The caller puts every value back; a run
    that fails tells nothing, and a term with no reduction of its kind in the run again stays unjudged."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in trained:
            noise = torch.randn(p.shape, generator=generator).to(device=p.device, dtype=p.dtype)
            p.add_(noise * (p.detach().abs().mean() * _NUDGE + _NUDGE * 1e-3))  # on the device: no host sync
    again: list[CutTerm] = []
    try:
        rng()
        with torch.enable_grad(), patched(reduction_patches(recorder(again))):
            step_fn()
    except Exception:
        return
    # the k-th reduction of a kind (function, input shape) pairs with the k-th of that kind in the run again: a
    # reduction only the first run made (the audit's own instrumentation) leaves the others paired
    rerun: dict[tuple[str, tuple[int, ...]], list[CutTerm]] = {}
    for term in again:
        rerun.setdefault((term.fn, term.input_shape), []).append(term)
    seen: dict[tuple[str, tuple[int, ...]], int] = {}
    for first in terms:
        key = (first.fn, first.input_shape)
        k = seen[key] = seen.get(key, -1) + 1
        twins = rerun.get(key, [])
        if first.dead_added and k < len(twins):
            first.moves = first.dead != twins[k].dead
