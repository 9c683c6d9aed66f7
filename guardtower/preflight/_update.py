"""A real optimizer step on the audit's gradients, a bounded chunk of trainable tensors at a time, measured
and undone.

Each call runs the base optimizer's own ``step`` below the hook wrapper, so optimizer step hooks (EMA
updates, LR-scheduler bookkeeping, guards) do not fire for an update that is rolled back anyway.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from guardtower.preflight._registry import AuditContext
from guardtower.preflight._state import clone_value, restore_value
from guardtower.preflight._trace import Moved, UpdateStats
from guardtower.preflight._util import base_optimizer

__all__ = ["measure_update", "unhooked_step", "moved_without_grad"]

#: elements stepped at once: a small model takes one step, a large one never copies more than this at a time
_CHUNK_ELEMENTS = 1 << 23


def measure_update(ctx: AuditContext) -> dict[str, UpdateStats]:
    """Step the base optimizer on a chunk of trainable tensors, measure, and put those tensors and their
    optimizer state back before the next chunk, so the extra memory is one chunk's worth, not a copy of the
    model and optimizer."""
    opt = base_optimizer(ctx.optimizer)
    if opt is None or isinstance(opt, torch.optim.LBFGS):  # LBFGS steps need a closure re-evaluating the loss
        return {}
    raw = unhooked_step(opt)
    names = {id(p): n for n, p in ctx.params.items()}
    groups = opt.param_groups
    lists = [g["params"] for g in groups]
    stats: dict[str, UpdateStats] = {}
    try:
        for gi, params in enumerate(lists):
            # tensors without a gradient take part too: an optimizer that moves them anyway is a finding
            eligible = [p for p in params if id(p) in names]
            for chunk in _chunks(eligible):
                for gj, group in enumerate(groups):
                    group["params"] = chunk if gj == gi else []
                stats.update((names[id(p)], s) for p, s in zip(chunk, _step_chunk(opt, raw, chunk)))
    finally:
        for group, params in zip(groups, lists):
            group["params"] = params
    return stats


def unhooked_step(opt: torch.optim.Optimizer) -> Any:
    """The optimizer class's own ``step`` below the hook wrapper (no step hooks fire for an undone update)."""
    step: Any = type(opt).step
    return step.__wrapped__ if getattr(step, "hooked", False) and hasattr(step, "__wrapped__") else step


def _chunks(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    chunks: list[list[torch.Tensor]] = []
    size = _CHUNK_ELEMENTS
    for p in params:
        if size + p.numel() > _CHUNK_ELEMENTS:
            chunks.append([])
            size = 0
        chunks[-1].append(p)
        size += p.numel()
    return chunks


def _step_chunk(opt: torch.optim.Optimizer, raw: Any, chunk: list[torch.Tensor]) -> list[UpdateStats]:
    befores = [p.detach().clone() for p in chunk]
    saved = [opt.state.get(p) for p in chunk]
    saved_copies = [None if s is None else {k: clone_value(v) for k, v in s.items()} for s in saved]
    try:
        raw(opt)
        with torch.no_grad():
            return [_measure(p, before) for p, before in zip(chunk, befores)]
    finally:
        for p, before, state, state_copy in zip(chunk, befores, saved, saved_copies):
            with torch.no_grad():
                p.copy_(before)
            _restore_state(opt, p, state, state_copy)


def _measure(p: torch.Tensor, before: torch.Tensor) -> UpdateStats:
    """A few passes over the tensor: the step's delta, two norms, the gradient's non-zeros and the stuck ones.
    A NaN or Inf the step wrote shows in the delta's norm (non-finite while the weights before were finite), and
    an unchanged tensor has a zero delta."""
    delta = p.detach().float() - before.float()
    p_norm = float(torch.linalg.vector_norm(before.float()))
    d_norm = float(torch.linalg.vector_norm(delta))
    grad = p.grad
    n_moving = int(torch.count_nonzero(grad)) if grad is not None else 0
    stuck = float(torch.count_nonzero((delta == 0) & (grad != 0))) / n_moving if n_moving and grad is not None else 0.0
    ratio = d_norm / p_norm if p_norm > 0 else (float("inf") if d_norm > 0 else 0.0)
    finite = math.isfinite(d_norm) or not math.isfinite(p_norm)
    moved = moved_without_grad(p, before, grad_rows(grad), unchanged=d_norm == 0)
    return UpdateStats(ratio=ratio, stuck_fraction=stuck, dtype=str(p.dtype).replace("torch.", ""), ndim=p.dim(),
                       finite=finite, moved_without_grad=moved, has_grad=grad is not None)


def grad_rows(grad: torch.Tensor | None) -> torch.Tensor | None:
    """Which rows of a gradient are non-zero (one flag for a tensor of fewer than 2 dims); None: no gradient."""
    if grad is None:
        return None
    with torch.no_grad():
        if grad.is_sparse:  # a sparse embedding's gradient: the rows its indices name (nn.Embedding(sparse=True))
            grad = grad.coalesce()
            if grad.dim() < 2:
                return grad.values().any().reshape(1)
            rows = torch.zeros(grad.shape[0], dtype=torch.bool, device=grad.device)
            return rows.index_fill_(0, grad.indices()[0][grad.values().reshape(grad.values().shape[0], -1).any(1)],
                                    True)
        return grad.reshape(grad.shape[0], -1).any(dim=1) if grad.dim() >= 2 else grad.any().reshape(1)


def moved_without_grad(p: torch.Tensor, before: torch.Tensor, rows_with_grad: torch.Tensor | None,
                       zeroed: torch.Tensor | None = None, *, unchanged: bool | None = None) -> Moved | None:
    """How a step moved ``p`` where its gradient gave it nothing to follow: the whole tensor when it had no
    gradient at all (None: cut from the graph, run under no_grad), or the rows whose gradient the step zeroed
    between backward and ``optimizer.step()`` (``zeroed``: rows that had a gradient after backward and none
    at the step). An all-zero gradient from backward itself is left alone: LoRA factors and zero-initialised
    gates have one at the first step by design. ``unchanged``: whether ``p`` equals ``before``, when known."""
    with torch.no_grad():
        if unchanged if unchanged is not None else torch.equal(p, before):
            return None
        if rows_with_grad is None:
            return Moved(whole=True)
        if zeroed is None or not bool(zeroed.any()):
            return None
        delta = (p != before).reshape(p.shape[0], -1).any(dim=1) if p.dim() >= 2 else (p != before).any().reshape(1)
        count = int((zeroed.to(delta.device) & delta).sum())
        return Moved(whole=False, rows=count) if count else None


def _restore_state(opt: torch.optim.Optimizer, p: torch.Tensor, saved: dict[str, Any] | None,
                   saved_copy: dict[str, Any] | None) -> None:
    if saved is None or saved_copy is None:
        opt.state.pop(p, None)
        return
    if opt.state.setdefault(p, saved) is not saved:
        opt.state[p] = saved
    for k in [k for k in saved if k not in saved_copy]:
        del saved[k]
    for k, v in saved_copy.items():
        saved[k] = restore_value(saved.get(k), v)
