"""Does each sample's prediction depend only on its own input? The gradient of the first sample's prediction (and
the last one's, where the layout allows) with respect to every sample's input must be zero outside those rows.

Probing both ends catches a mix in either direction: a layer that runs along the batch as if it were time (a
sequence-first RNN or a causal encoder fed batch-first data) makes the last sample read every earlier one while
the first reads only itself. The last sample is probed only where the batch axis is unambiguous: the prediction
is one row per sample (``(batch, classes)``), or no layer of the model declares itself sequence-first, whose
correct use puts time first. A square output (a similarity matrix of the batch with itself) and a batch that is
a graph (an ``(n, n)`` adjacency or a ``(2, edges)`` index among the call's tensors) mix samples by design and
are not probed.

When the audit runs the backward, the probe takes the step's own graph; when ``step_fn`` runs it, the audit's own
pass of the model (``_own_pass``, eval mode) gives the graph. That pass also sees dropout that ignores eval mode.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from guardtower.preflight._own_pass import own_pass
from guardtower.preflight._registry import AuditContext
from guardtower.preflight._trace import LeakEntry
from guardtower.preflight._util import iter_tensors

__all__ = ["sample_leaks", "eval_pass", "sequence_first_layers"]


def sequence_first_layers(model: nn.Module) -> list[str]:
    """Layers that take (time, batch, ...) input: ``batch_first=False`` RNNs, attention and transformer layers."""
    return [name for name, m in model.named_modules() if getattr(m, "batch_first", None) is False]


def _graph_batch(call_tensors: list[torch.Tensor], batch: int) -> bool:
    for t in call_tensors:
        if t.dim() == 2 and tuple(t.shape) == (batch, batch):
            return True
        if t.dim() == 2 and t.shape[0] == 2 and not t.is_floating_point() and t.dtype != torch.bool:
            return True
    return False


def _probe(out: torch.Tensor, axis: int, probed: list[int], watched: list[tuple[str, torch.Tensor]], sample_dim: int,
           retain_graph: bool) -> list[LeakEntry]:
    """The gradient of the probed samples' predictions (rows of ``out`` along ``axis``) w.r.t. every watched input,
    read per sample along the inputs' ``sample_dim``."""
    batch = out.shape[axis]
    rows = out.movedim(axis, 0)
    weights = torch.randn(rows[0].shape, generator=torch.Generator().manual_seed(0)).to(out.device, out.dtype)
    probe = torch.stack([(rows[i] * weights).float().sum() for i in probed]).sum()
    grads = torch.autograd.grad(probe, [t for _, t in watched], retain_graph=retain_graph, allow_unused=True)
    result = []
    others = [j for j in range(batch) if j not in probed]
    for (label, _), grad in zip(watched, grads):
        if grad is None:
            continue
        per_sample = grad.detach().float().movedim(sample_dim, 0).reshape(batch, -1).norm(dim=1)
        own = float(per_sample[probed].norm())
        other = per_sample[others]
        leaking = [others[int(j)] for j in torch.nonzero(other > 1e-6 * max(own, 1e-30)).flatten()]
        result.append(LeakEntry(label, own, float(other.norm()), leaking))
    return result


def sample_leaks(model: nn.Module, out: torch.Tensor | None, watched: list[tuple[str, torch.Tensor]],
                 call: Any, retain_graph: bool) -> list[LeakEntry]:
    """The cross-sample probe: for each reading of which input axis is the batch (the first; the second too when
    a layer of the model is sequence-first, whose correct input puts time first), the output axis of that size
    (a prediction laid out ``(time, batch, classes)`` for CTC, say) is probed. Samples leak only when every
    reading leaks: a correct model is separable along its real batch axis."""
    if out is None or not out.requires_grad or out.dim() == 0:
        return []
    watched = [(label, t) for label, t in watched if t.requires_grad and t.dim() > 0]
    if not watched:
        return []
    seq_first = bool(sequence_first_layers(model))
    call_tensors = [t for _, t in iter_tensors(call, depth=4)]
    readings = []
    for sample_dim in ((0, 1) if seq_first else (0,)):
        if watched[0][1].dim() <= sample_dim:
            continue
        batch = watched[0][1].shape[sample_dim]
        axes = [a for a in range(out.dim()) if out.shape[a] == batch]
        inputs = [(label, t) for label, t in watched if t.dim() > sample_dim and t.shape[sample_dim] == batch]
        # no axis of that size, or several (a similarity matrix of the batch with itself): nothing to read
        if batch < 2 or len(axes) != 1 or _graph_batch(call_tensors, batch):
            continue
        probed = [0]
        if batch >= 3 and (out.dim() <= 2 or not seq_first):
            probed.append(batch - 1)
        readings.append((axes[0], probed, inputs, sample_dim))
    found: list[LeakEntry] = []
    for k, (axis, probed, inputs, sample_dim) in enumerate(readings):
        entries = _probe(out, axis, probed, inputs, sample_dim, retain_graph or k < len(readings) - 1)
        if not any(e.leaking_samples for e in entries):
            return entries  # separable along this reading of the batch axis
        found = found or entries
    return found


def eval_pass(ctx: AuditContext, restore_rng: Callable[[], None],
              probe: bool) -> tuple[list[LeakEntry], list[tuple[str, float]]]:
    """One own pass of the model in eval mode: the cross-sample probe on its graph when ``probe`` (``step_fn``
    ran the backward, so the step's graph is gone), and the dropouts that ignored eval mode."""
    if ctx.trace is None or not ctx.trace.calls:
        return [], []
    call = ctx.trace.training_call()
    tensors = [t for _, t in iter_tensors((call.args, call.kwargs), depth=2)]
    batch = next((t.shape[0] for t in tensors if t.dim() > 0), None)
    probe = probe and batch is not None and batch >= 2
    try:
        with own_pass(ctx, restore_rng, lambda t: probe and t.dim() > 0 and t.shape[0] == batch) as run:
            leaks = sample_leaks(ctx.model, run.output, run.leaves, (call.args, call.kwargs),
                                 retain_graph=False) if probe else []
            return leaks, run.dropouts
    except Exception:  # noqa: BLE001 - the audit's own pass never fails the audit
        return [], []
