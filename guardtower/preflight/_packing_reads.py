"""Do the examples packed into one row see each other? Position ids that restart inside a row say the row holds
several examples (packing); they must not attend one another. One packed row's first example gets other tokens,
and the model runs twice on the batch, in eval mode without gradients: when the predictions of the row's later
examples change, attention crosses the boundary (a 2-D all-ones mask passed with packed position ids, an
attention backend that ignores them). Anything unexpected gives up silently, so the pass never fails a step
that works.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from guardtower.preflight._own_pass import in_eval_mode
from guardtower.preflight._padding_reads import top_level
from guardtower.preflight._registry import AuditContext
from guardtower.preflight._trace import PackingRead, RootCall

__all__ = ["packed_row", "packing_boundaries", "measure_packing_reads"]


def _restarting(t: torch.Tensor) -> bool:
    """Rows of counters that climb by one and restart at 0, at least once inside a row: positions of packing."""
    steps = t[:, 1:] - t[:, :-1]
    return bool(((steps == 1) | (t[:, 1:] == 0)).all()) and bool((t[:, 1:] == 0).any())


def packing_boundaries(call: RootCall) -> tuple[str, torch.Tensor, torch.Tensor] | None:
    """``(ids argument, ids, restarts)``: ``restarts[:, t]`` is True where a new packed example starts at position
    ``t`` (t >= 1), by ``position_ids``, or an unnamed argument of position counters that restart."""
    tensors = top_level(call)
    # token ids, a single packed row included (token_ids() asks for two rows, to tell a batch from one sequence)
    found = next(((k, t) for k, t in tensors if t.dim() == 2 and not t.is_floating_point() and not t.is_complex()
                  and t.dtype != torch.bool and t.shape[1] >= 3), None)
    if found is None:
        return None
    key, ids = found
    named = call.argument("position_ids")
    candidates = [named] if isinstance(named, torch.Tensor) else [t for k, t in tensors if k != key]
    for positions in candidates:
        if positions.is_floating_point() or positions.dtype == torch.bool or positions.dim() not in (1, 2):
            continue
        if positions.shape[-1] != ids.shape[1] or (positions.dim() == 2 and positions.shape[0] not in (1, ids.shape[0])):
            continue
        positions = positions.expand_as(ids)
        if named is None and not _restarting(positions):
            continue
        restarts = torch.zeros_like(ids, dtype=torch.bool)
        restarts[:, 1:] = positions[:, 1:] < positions[:, :-1]
        if bool(restarts.any()):
            return key, ids, restarts
    return None


def packed_row(call: RootCall) -> tuple[str, torch.Tensor, int, int] | None:
    """``(ids argument, ids, row, first boundary)`` of the first row where a new packed example starts."""
    found = packing_boundaries(call)
    if found is None:
        return None
    key, ids, restarts = found
    row = int(torch.nonzero(restarts.any(1)).flatten()[0])
    return key, ids, row, int(restarts[row].int().argmax())


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / a.norm().clamp_min(1e-30))


def measure_packing_reads(ctx: AuditContext, restore_rng: Callable[[], None]) -> PackingRead | None:
    """How much the later examples of one packed row change when its first example's tokens change."""
    from guardtower.preflight._step import primary_output

    if ctx.trace is None or not ctx.trace.calls:
        return None
    call = ctx.trace.training_call()
    found = packed_row(call)
    if found is None:
        return None
    key, ids, row, boundary = found
    other = ids.clone()
    other[row, :boundary] = ids[row, boundary]  # a token of the row's second example, all over its first

    def run(tokens: torch.Tensor) -> torch.Tensor | None:
        args = tuple(tokens if f"args[{i}]" == key else a for i, a in enumerate(call.args))
        kwargs: dict[str, Any] = {k: tokens if k == key else v for k, v in call.kwargs.items()}
        return primary_output(ctx.model(*args, **kwargs))

    try:
        with torch.no_grad(), in_eval_mode(ctx.model, restore_rng):
            before, after = run(ids), run(other)
    except Exception:  # noqa: BLE001 - the audit's own passes never fail the audit
        return None
    if (before is None or after is None or before.shape != after.shape or before.dim() < 2
            or tuple(before.shape[:2]) != tuple(ids.shape) or bool(torch.equal(other, ids))):
        return None
    later_before, later_after = before[row, boundary:], after[row, boundary:]
    if not bool(torch.isfinite(later_before).all()):
        return None
    return PackingRead(row, boundary, _relative(later_before, later_after))
