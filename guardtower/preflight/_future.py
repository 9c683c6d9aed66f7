"""Does the prediction see its own target? For a next-token setup (the loss pulls each position towards the
token the input holds one position later), one extra pass of the model in eval mode takes the gradient of one
position's prediction with respect to the embedding of every position: any gradient from a later position means
the model reads the future (a missing causal mask, a bidirectional encoder used as a language model), and it
learns to copy the next token instead of predicting it.

The pass is the audit's own: it runs the model's first call again with the same arguments, under the RNG the
step started from, in eval mode (no dropout, no running-statistics update), and gives up silently on anything
unexpected, so it can never fail a step that works in training.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from guardtower.preflight._registry import AuditContext
from guardtower.preflight._trace import FutureLeak
from guardtower.preflight._util import NOT_INPUT_KEYS, iter_tensors

__all__ = ["measure_future_leak"]

#: share of supervised positions whose target must be the next input token for a setup to count as next-token
_NEXT_TOKEN_SHARE = 0.9
_MIN_POSITIONS = 4


def _next_token_ids(ctx: AuditContext) -> tuple[torch.Tensor, int] | None:
    """The token-id argument of the model's first call whose next token (along its sequence axis: 1 for
    batch-first, 0 for sequence-first) is what the loss pulls each position towards, and that axis."""
    trace = ctx.trace
    if trace is None or not trace.calls:
        return None
    sup = next((s for s in trace.supervision if s.call == 0 and s.target is not None and s.target.dim() == 2), None)
    if sup is None or sup.target is None:
        return None
    call = trace.calls[0]
    for _, ids in iter_tensors((call.args, call.kwargs), skip_keys=NOT_INPUT_KEYS):
        if ids.is_floating_point() or ids.dtype == torch.bool or tuple(ids.shape) != tuple(sup.target.shape):
            continue
        ids_cpu = ids.detach().cpu()
        for axis in (1, 0):
            if ids.shape[axis] < 3:
                continue
            length = ids.shape[axis]
            target = sup.target.narrow(axis, 0, length - 1)
            supervised = (sup.magnitude.narrow(axis, 0, length - 1) > 0) & (target >= 0)
            n = int(supervised.sum())
            following = ids_cpu.narrow(axis, 1, length - 1)
            if n >= _MIN_POSITIONS and int(((target == following) & supervised).sum()) >= _NEXT_TOKEN_SHARE * n:
                return ids, axis
    return None


def measure_future_leak(ctx: AuditContext, restore_rng: Callable[[], None]) -> FutureLeak | None:
    """The gradient one mid-sequence prediction of sample 0 sends to earlier and to later token embeddings."""
    found = _next_token_ids(ctx)
    if found is None or ctx.trace is None:
        return None
    ids, axis = found
    from guardtower.preflight._step import primary_output

    call = ctx.trace.calls[0]
    ptr = ids.untyped_storage().data_ptr()
    captured: list[torch.Tensor] = []

    def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        if (not captured and args and isinstance(args[0], torch.Tensor) and args[0].shape == ids.shape
                and args[0].untyped_storage().data_ptr() == ptr and isinstance(output, torch.Tensor)
                and output.is_floating_point()):
            leaf = output.detach().requires_grad_(True)
            captured.append(leaf)
            return leaf
        return None

    modes = {m: m.training for m in ctx.model.modules()}
    handles = [m.register_forward_hook(hook) for m in ctx.model.modules() if isinstance(m, nn.Embedding)]
    try:
        restore_rng()
        ctx.model.eval()
        with torch.enable_grad():
            out = primary_output(ctx.model(*call.args, **call.kwargs))
        if not captured or out is None or out.dim() < 3 or tuple(out.shape[:2]) != tuple(ids.shape):
            return None
        length = ids.shape[axis]
        t = (length - 1) // 2
        first = out.movedim(axis, 1)[0]  # (positions, ...) of sample 0
        weights = torch.randn(first.shape[1:], generator=torch.Generator().manual_seed(0)).to(out.device, out.dtype)
        (grad,) = torch.autograd.grad((first[t] * weights).float().sum(), captured[0], allow_unused=True)
        if grad is None:
            return None
        per_position = grad.detach().movedim(axis, 1)[0].float().reshape(length, -1).norm(dim=1)
        return FutureLeak(position=t, past=float(per_position[:t + 1].sum()), future=float(per_position[t + 1:].sum()),
                          length=int(length))
    except Exception:  # noqa: BLE001 - the audit's own pass never fails the audit
        return None
    finally:
        for h in handles:
            h.remove()
        for m, training in modes.items():
            m.training = training
        restore_rng()
