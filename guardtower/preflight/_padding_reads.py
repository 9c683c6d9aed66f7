"""Does a row's prediction depend on how much padding it got? The setup says which positions are padding (a
mask among the model's arguments whose one value marks a run at the end of rows, over one token id; or, for a
model with attention, runs of ``config.pad_token_id`` or an embedding's ``padding_idx``). The padded row is run
three times in eval mode without gradients: inside the batch, alone, and alone cut to its real tokens. The first
two must agree (else the batch mixes samples: INPUT-002's business, not this one); when the cut changes the
prediction, the model reads the padding as input: a mask that is not applied, or inverted, or a pooling or
normalisation over the padded length. When the cut row does not run, or gives NaN (an inverted mask then masks
every key), the row is run with a real token in place of its padding instead, the mask unchanged. Only right padding is cut (cutting left padding would move the real
tokens' positions). Anything unexpected gives up silently, so the passes can never fail a step that works.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from guardtower.preflight._own_pass import in_eval_mode
from guardtower.preflight._registry import AuditContext
from guardtower.preflight._trace import PaddingRead
from guardtower.preflight._util import LABEL_KEYS

__all__ = ["measure_padding_reads", "marked_padding", "inferred_padding", "token_ids", "top_level"]

#: the prediction of a row run alone may differ from its prediction inside the batch by float noise only
_SAME = 1e-4
#: a cut that changes the prediction by more than this (relative) reads the padding
CHANGED = 1e-3


def top_level(call: Any) -> list[tuple[str, torch.Tensor]]:
    named = [(f"args[{i}]", a) for i, a in enumerate(call.args)] + list(call.kwargs.items())
    return [(k, v) for k, v in named if isinstance(v, torch.Tensor) and k not in LABEL_KEYS]


def token_ids(tensors: list[tuple[str, torch.Tensor]]) -> tuple[str, torch.Tensor] | None:
    return next(((k, t) for k, t in tensors if t.dim() == 2 and not t.is_floating_point() and t.dtype != torch.bool
                 and not t.is_complex() and t.shape[0] >= 2 and t.shape[1] >= 3), None)


def _end_runs(flags: torch.Tensor) -> bool:
    """Each row's flagged positions are a run at its end, at least one row has some, and every row keeps one."""
    as_int = flags.int()
    return bool((as_int[:, 1:] >= as_int[:, :-1]).all()) and bool(flags.any()) and not bool(flags[:, 0].any())


def marked_padding(ctx: AuditContext, tensors: list[tuple[str, torch.Tensor]], ids_key: str,
                    ids: torch.Tensor) -> tuple[torch.Tensor, str] | None:
    """(padding positions, what marks them): by a mask argument, else by a declared pad id in an attention model."""
    for key, mask in tensors:
        if key == ids_key or tuple(mask.shape) != tuple(ids.shape) or mask.is_floating_point() and not bool(
                ((mask == 0) | (mask == 1)).all()):
            continue
        values = mask.unique()
        if values.numel() != 2:
            continue
        for value in values:
            padding = mask == value
            if _end_runs(padding) and ids[padding].unique().numel() == 1:
                return padding, f"mask {key}"
    if not any("attention" in type(m).__name__.lower() for m in ctx.model.modules()):
        return None
    declared = {getattr(getattr(ctx.model, "config", None), "pad_token_id", None)}
    declared |= {m.padding_idx for m in ctx.model.modules() if isinstance(m, nn.Embedding)}
    for pad in sorted(p for p in declared if isinstance(p, int)):
        padding = (ids == pad).flip(1).cummin(1).values.flip(1)  # the run of pad ids that ends each row
        if _end_runs(padding):
            return padding, f"pad id {pad}"
    return None


def inferred_padding(ids: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """(padding positions, pad id) of token ids that nothing declares: one id that occurs only as the run ending
    rows, in runs of different lengths, one of them at least two long. A real token (even EOS, which precedes
    the padding) also occurs inside rows, or ends them all alike; rows padded to the longest one look this way."""
    if ids.dim() != 2 or ids.is_floating_point() or ids.shape[0] < 2 or ids.shape[1] < 3:
        return None
    for pad in ids[:, -1].unique().tolist():
        at = ids == pad
        padding = at.flip(1).cummin(1).values.flip(1)
        runs = padding.sum(1)
        if (bool(torch.equal(at, padding)) and _end_runs(padding) and int(runs.max()) >= 2
                and int((runs > 0).sum()) >= 2 and int(runs.unique().numel()) >= 2):
            return padding, int(pad)
    return None


def _cut(value: Any, row: int, batch: int, length: int, real: int | None) -> Any:
    """``value`` for the row alone (its batch axis narrowed to it), cut to ``real`` positions along every axis of
    the sequence's length when ``real`` is given."""
    if isinstance(value, dict):
        return {k: _cut(v, row, batch, length, real) for k, v in value.items()}
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return value
    out = value[row:row + 1] if value.shape[0] == batch else value
    for dim in range(1 if value.shape[0] == batch else 0, out.dim()):
        if real is not None and out.shape[dim] == length:
            out = out.narrow(dim, 0, real)
    return out


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / a.norm().clamp_min(1e-30))


def measure_padding_reads(ctx: AuditContext, restore_rng: Callable[[], None]) -> PaddingRead | None:
    """How much the most padded row's prediction changes when its padding is cut off."""
    from guardtower.preflight._step import primary_output

    if ctx.trace is None or not ctx.trace.calls:
        return None
    call = ctx.trace.training_call()
    tensors = top_level(call)
    found = token_ids(tensors)
    if found is None:
        return None
    ids_key, ids = found
    batch, length = ids.shape
    marked = marked_padding(ctx, tensors, ids_key, ids) if batch != length else None
    if marked is None:
        return None
    padding, marked_by = marked
    counts = padding.sum(1)
    row = int(counts.argmax())
    real = length - int(counts[row])

    swapped = ids.clone()
    swapped[row][padding[row]] = ids[row, 0]  # a real token where the row's padding was (the mask unchanged)

    def run(variant: str) -> torch.Tensor | None:
        if variant == "inside":
            return primary_output(ctx.model(*call.args, **call.kwargs))
        cut = real if variant == "cut" else None

        def narrowed(key: str, value: Any) -> Any:
            return _cut(swapped if variant == "swapped" and key == ids_key else value, row, batch, length, cut)

        args = tuple(narrowed(f"args[{i}]", a) for i, a in enumerate(call.args))
        kwargs = {k: narrowed(k, v) for k, v in call.kwargs.items()}
        return primary_output(ctx.model(*args, **kwargs))

    try:
        with torch.no_grad(), in_eval_mode(ctx.model, restore_rng):
            full, alone = run("inside"), run("alone")
            try:
                short = run("cut")
            except Exception:  # noqa: BLE001 - a row without padding may not run at all (every key masked)
                short = None
            if short is None or not bool(torch.isfinite(short).all()):
                short = run("swapped")  # then: does the padding's content reach the prediction?
    except Exception:  # noqa: BLE001 - the audit's own passes never fail the audit
        return None
    if full is None or alone is None or short is None or full.dim() == 0 or full.shape[0] != batch:
        return None
    per_position = full.dim() >= 2 and full.shape[1] == length
    if per_position:
        if short.dim() < 2 or short.shape[1] not in (real, length) or alone.shape[1] != length:
            return None
        inside, alone, short = full[row, :real], alone[0, :real], short[0, :real]
    else:
        inside, alone, short = full[row], alone[0], short[0]
    if (inside.shape != alone.shape or alone.shape != short.shape or not bool(torch.isfinite(alone).all())
            or _relative(inside, alone) > _SAME):
        return None
    return PaddingRead(row, real, length - real, marked_by, _relative(alone, short))
