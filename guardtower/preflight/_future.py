"""Does the prediction see its own target? For a next-token setup (the loss pulls each position towards the
token the input holds one position later), the audit's own pass of the model (``_own_pass``) takes the gradient
of one position's prediction with respect to the embedding of every position: any gradient from a later position
means the model reads the future (a missing causal mask, a bidirectional encoder used as a language model), and it
learns to copy the next token instead of predicting it. Anything unexpected gives up silently, so the pass can
never fail a step that works in training.
"""

from __future__ import annotations

from typing import Callable

import torch

from guardtower.preflight._own_pass import own_pass
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
    call = trace.training_call()
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
    try:
        with own_pass(ctx, restore_rng, lambda t: t is ids) as run:
            out = run.output
            embedded = [leaf for label, leaf in run.leaves if label.startswith("embedding")]
            if not embedded or out is None or out.dim() < 3 or tuple(out.shape[:2]) != tuple(ids.shape):
                return None
            length = ids.shape[axis]
            t = (length - 1) // 2
            first = out.movedim(axis, 1)[0]  # (positions, ...) of sample 0
            weights = torch.randn(first.shape[1:], generator=torch.Generator().manual_seed(0)).to(out.device,
                                                                                                    out.dtype)
            (grad,) = torch.autograd.grad((first[t] * weights).float().sum(), embedded[0], allow_unused=True)
    except Exception:  # noqa: BLE001 - the audit's own pass never fails the audit
        return None
    if grad is None:
        return None
    per_position = grad.detach().movedim(axis, 1)[0].float().reshape(length, -1).norm(dim=1)
    return FutureLeak(position=t, past=float(per_position[:t + 1].sum()), future=float(per_position[t + 1:].sum()),
                      length=int(length))
