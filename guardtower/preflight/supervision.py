"""``supervision``: what the loss supervises, measured from the gradient that reached the model's output in the
real backward (``_supervision``), against what the batch and the config intend: padding that carries loss
gradient, targets that are the input token at the same position, a batch of one class, class weights that grow
with class frequency, and how the micro-batches of one accumulated step are weighted."""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable

import torch
from torch import nn

from guardtower.preflight._batch import batch_mapping, labelled_padding
from guardtower.preflight._packing_reads import packing_boundaries
from guardtower.preflight._padding_reads import inferred_padding, marked_padding, top_level, token_ids
from guardtower.preflight._registry import AuditContext, check
from guardtower.preflight._step import extract_loss
from guardtower.preflight._trace import RootCall, StepTrace, Supervision
from guardtower.preflight._util import is_causal_lm, iter_tensors
from guardtower.report import Finding
from guardtower.severity import Severity

__all__ = ["skips_a_token", "stops_unsupervised"]

#: a position counts as supervised when its gradient is above this share of the largest one
_SUPERVISED = 1e-6
#: at least this share of the supervised positions predicting their own input token is a copy task
COPY_SHARE = 0.3
#: the same for a hand-written model, whose vocabulary is only known by its embedding table's size
HAND_WRITTEN_COPY_SHARE = 0.98
#: a batch of one class is reported when a uniform draw of its classes would give that with less chance
ONE_CLASS_CHANCE = 1e-2
#: per-position targets of one class need at least this many supervised positions to be judged
_MIN_POSITIONS = 8
#: per-micro-batch weights that differ by more than this factor weight the samples of one step unequally
UNEQUAL = 1.2


def _config(model: nn.Module) -> Any:
    return getattr(model, "config", None)


def _vocab(model: nn.Module) -> int | None:
    size = getattr(_config(model), "vocab_size", None)
    if isinstance(size, int):
        return size
    get = getattr(model, "get_input_embeddings", None)
    emb = get() if callable(get) else None
    return emb.num_embeddings if isinstance(emb, nn.Embedding) else None


def _call_tensor(call: RootCall, key: str) -> torch.Tensor | None:
    value = call.argument(key)
    if value is None and key == "input_ids" and call.args and isinstance(call.args[0], torch.Tensor):
        value = call.args[0]
    return value if isinstance(value, torch.Tensor) else None


def _aligned(call: RootCall, rec: Supervision, model: nn.Module) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(token ids, attention mask) of the call that line up with the supervised positions: the decoder's for an
    encoder-decoder model, else the input's."""
    shape = tuple(rec.magnitude.shape)
    if getattr(_config(model), "is_encoder_decoder", False):
        keys = ("decoder_input_ids", "decoder_attention_mask")
    else:
        keys = ("input_ids", "attention_mask")
    ids, mask = (_call_tensor(call, k) for k in keys)
    ids = ids.detach().cpu() if ids is not None and tuple(ids.shape) == shape and not ids.is_floating_point() else None
    mask = mask.detach().cpu() if mask is not None and tuple(mask.shape) == shape else None
    return ids, mask


def _supervised(rec: Supervision) -> torch.Tensor:
    top = float(rec.magnitude.max()) if rec.magnitude.numel() else 0.0
    return rec.magnitude > _SUPERVISED * top if top > 0 else torch.zeros_like(rec.magnitude, dtype=torch.bool)


def _left_pad_boundary(mask: torch.Tensor) -> torch.Tensor:
    """The last padding position before each left-padded row's first real token: a causal LM predicts the first
    real token from it, which is supervision of that token, not of padding."""
    boundary = torch.zeros_like(mask, dtype=torch.bool)
    real = mask != 0
    for row in range(mask.shape[0]):
        first = int(real[row].float().argmax()) if bool(real[row].any()) else 0
        if first > 0:
            boundary[row, first - 1] = True
    return boundary


def _padding_supervised(ctx: AuditContext, call: RootCall, rec: Supervision) -> Finding | None:
    """DATA-005: padding positions (by the mask the model receives, the pad id among the targets, or, when
    nothing declares padding, the id whose runs end the rows of the token ids) that carry loss gradient."""
    if rec.magnitude.dim() != 2:
        return None
    ids, mask = _aligned(call, rec, ctx.model)
    supervised = _supervised(rec)
    config = _config(ctx.model)
    pad, eos = getattr(config, "pad_token_id", None), getattr(config, "eos_token_id", None)
    inferred = inferred_padding(ids) if ids is not None and mask is None and not isinstance(pad, int) else None
    if mask is not None and bool((mask == 0).any()):
        padded = (mask == 0) & ~_left_pad_boundary(mask)
        hit = supervised & padded
        how = "the attention mask marks as padding"
    elif (isinstance(pad, int) and rec.target is not None and rec.classes == _vocab(ctx.model)
          and rec.weight is not None):
        is_pad = supervised & (rec.target == pad)
        if pad == eos:  # a real EOS is a pad id too: only a second one in a row is padding
            is_pad = is_pad & (is_pad.cumsum(-1) >= 2)
        hit = is_pad
        how = f"have the pad id {pad} as their target"
    elif inferred is not None:
        hit = supervised & inferred[0]
        how = f"hold token {inferred[1]}, which only ever pads the ends of the rows,"
    else:
        return None
    count = int(hit.sum())
    if count < 2:
        return None
    rows = sorted({int(r) for r in torch.nonzero(hit)[:, 0]})
    remedy = ("the loss trains the model to predict padding; set their labels to -100 (or mask them out of the "
              "loss)" if rec.classes else "the loss reads the model's per-token output (a score, a reward) at "
              "padding; read it at each row's last real token, found from the mask, or mask padding out")
    return Finding(
        "supervision", Severity.WARN,
        f"{count} position(s) that {how} receive loss gradient (rows {rows[:8]}): {remedy}",
        "DATA-005", {"positions": count, "rows": rows[:50], "supervised": int(supervised.sum())},
    )


def stops_unsupervised(ctx: AuditContext) -> Finding | None:
    """DATA-003, measured: in a causal LM's step whose loss is computed outside the model, none of the real
    end-of-sequence tokens (attention mask 1) is a supervised target, while other positions are: the loss mask was
    built by token value (``labels == pad_id`` with pad_token = eos_token) and the model never learns to stop."""
    return _first_measured(ctx, _stops_unsupervised)


def skips_a_token(ctx: AuditContext) -> Finding | None:
    """DATA-004, measured: the loss pulls position t towards the token the model receives at t+2 (``_skips_a_token``)."""
    return _first_measured(ctx, _skips_a_token)


def _first_measured(ctx: AuditContext, judge: Callable[[AuditContext, RootCall, Supervision], Finding | None]
                    ) -> Finding | None:
    """The first finding ``judge`` makes of the step's supervision records."""
    trace = ctx.trace
    if trace is None or trace.error is not None:
        return None
    return next((f for rec in trace.supervision if rec.call < len(trace.calls)
                 for f in [judge(ctx, trace.calls[rec.call], rec)] if f is not None), None)


def _stops_unsupervised(ctx: AuditContext, call: RootCall, rec: Supervision) -> Finding | None:
    if rec.magnitude.dim() != 2 or _call_tensor(call, "labels") is not None or not is_causal_lm(ctx.model):
        return None
    ids, mask = _aligned(call, rec, ctx.model)
    eos = getattr(_config(ctx.model), "eos_token_id", None)
    stops = [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if isinstance(e, int)]
    if ids is None or mask is None or not stops or ids.shape[1] < 2:
        return None
    # position t predicts token t + 1
    real_stop = torch.isin(ids[:, 1:], torch.tensor(stops)) & (mask[:, 1:] != 0)
    supervised = _supervised(rec)[:, :-1]
    n_stops, n_supervised = int(real_stop.sum()), int(supervised.sum())
    if n_stops < 2 or n_supervised < 4 * n_stops or bool((supervised & real_stop).any()):
        return None
    return Finding(
        "data", Severity.WARN,
        f"none of the {n_stops} real end-of-sequence tokens (attention mask 1) is a supervised target: the positions "
        f"that predict them get no loss gradient while {n_supervised} others do, so the model never learns to stop "
        "(a loss mask built by token value, labels == pad_id with pad_token = eos_token); mask padding by position, "
        "from the attention mask, instead",
        "DATA-003", {"real_eos": n_stops, "supervised": n_supervised, "eos_token_ids": stops},
    )


def _crosses_packing(call: RootCall, rec: Supervision) -> Finding | None:
    """DATA-019: in a packed batch (position ids restart where each example starts), the last position of an
    example is pulled towards the next example's first token: the labels run on across the boundary."""
    found = packing_boundaries(call) if rec.target is not None and rec.magnitude.dim() == 2 else None
    if found is None or rec.target is None:
        return None
    _, ids, restarts = found
    ids, restarts = ids.detach().cpu(), restarts.cpu()
    if tuple(ids.shape) != tuple(rec.target.shape):
        return None
    before = torch.zeros_like(restarts)
    before[:, :-1] = restarts[:, 1:]  # the last position of each example that another one follows
    crossing = before & _supervised(rec) & (rec.target == ids.roll(-1, dims=1))
    boundaries, count = int(restarts.sum()), int(crossing.sum())
    if count < 2 or count < 0.5 * boundaries:
        return None
    return Finding(
        "supervision", Severity.WARN,
        f"{count} of the {boundaries} packed examples' last positions are trained to predict the next example's "
        "first token (position ids restart there): the labels run on across the packing boundary, so the model "
        "learns to continue one document with an unrelated one; set the label of each example's first token to "
        "-100",
        "DATA-019", {"crossing": count, "boundaries": boundaries},
    )


def _token_vocab(ctx: AuditContext, rec: Supervision) -> tuple[int | None, bool]:
    """(the vocabulary size, hand-written): the config's; a hand-written model has none, and its vocabulary is an
    embedding table the size of the output."""
    vocab = _vocab(ctx.model)
    if vocab is None and any(isinstance(m, nn.Embedding) and m.num_embeddings == rec.classes
                             for m in ctx.model.modules()):
        return rec.classes, True
    return vocab, False


def _copies_input(ctx: AuditContext, call: RootCall, rec: Supervision) -> Finding | None:
    """DATA-006: the loss asks for the token the model is given at the same position (nothing to predict)."""
    if rec.target is None or rec.magnitude.dim() != 2:
        return None
    vocab, hand_written = _token_vocab(ctx, rec)
    # a denoiser that reconstructs every position copies most of them on purpose, so in a hand-written model only
    # near-all counts
    share = HAND_WRITTEN_COPY_SHARE if hand_written else COPY_SHARE
    if rec.classes != vocab:
        return None
    ids, _ = _aligned(call, rec, ctx.model)
    if ids is None:
        return None
    supervised = _supervised(rec)
    n = int(supervised.sum())
    same = int((supervised & (rec.target == ids)).sum())
    if n < 4 or same < share * n:
        return None
    return Finding(
        "supervision", Severity.WARN,
        f"{same} of the {n} supervised positions ({100 * same / n:.0f}%) have as their target the very token the "
        "model receives at that position: the loss rewards copying the input (labels not shifted, or masked-LM "
        "labels kept at unmasked positions instead of -100)",
        "DATA-006", {"copying": same, "supervised": n},
    )


def _skips_a_token(ctx: AuditContext, call: RootCall, rec: Supervision) -> Finding | None:
    """DATA-004 measured: the loss pulls position t towards the token the model receives at t+2, not t+1 (labels
    shifted twice: already shifted, then shifted by a causal-LM loss, or a decoder's labels shifted right into its
    inputs and shifted again by the loss)."""
    if rec.target is None or rec.magnitude.dim() != 2 or rec.magnitude.shape[1] < 4:
        return None
    if rec.classes != _token_vocab(ctx, rec)[0]:
        return None
    ids, _ = _aligned(call, rec, ctx.model)
    if ids is None:
        return None
    supervised = _supervised(rec)[:, :-2]
    n = int(supervised.sum())
    target = rec.target[:, :-2]
    after_next = int((supervised & (target == ids[:, 2:])).sum())
    next_token = int((supervised & (target == ids[:, 1:-1])).sum())
    if n < 4 or after_next < 0.9 * n or next_token >= 0.5 * n:
        return None
    return Finding(
        "supervision", Severity.WARN,
        f"at {after_next} of {n} supervised positions the loss asks for the token the model receives two positions "
        "later, not the next one: the labels are shifted twice (labels already shifted, then shifted again by a "
        "causal-LM loss; or a decoder's labels shifted right into its inputs and shifted again by the loss), so "
        "the model learns to predict the token after next; shift once",
        "DATA-004", {"after_next": after_next, "supervised": n},
    )


def _per_sample(rec: Supervision) -> bool:
    return rec.magnitude.dim() == 1 and rec.target is not None and rec.weight is not None and rec.classes >= 2


def _one_class(rec: Supervision) -> Finding | None:
    """DATA-007: every supervised sample of the batch has the same class, or every supervised position (token,
    pixel) of a batch over three classes or more: labels that collapsed on their way to the loss (a class-id mask
    scaled by an image transform, then truncated) look exactly like that."""
    per_position = rec.magnitude.dim() >= 2 and rec.target is not None and rec.weight is not None and rec.classes >= 3
    if not (_per_sample(rec) or per_position):
        return None
    assert rec.target is not None
    targets = rec.target[_supervised(rec)]
    n = int(targets.numel())
    if n < (2 if _per_sample(rec) else _MIN_POSITIONS) or int(targets.unique().numel()) != 1 or int(targets[0]) < 0:
        return None
    chance = rec.classes * (1.0 / rec.classes) ** n
    if chance >= ONE_CLASS_CHANCE:
        return None
    if _per_sample(rec):
        what, fix = (f"all {n} samples of the batch have class {int(targets[0])} (of {rec.classes})",
                     "shuffle the data (shuffle=True, or a sampler that mixes classes)")
    else:
        what, fix = (f"all {n} supervised positions of the batch (over {rec.magnitude.shape[0]} samples) have "
                     f"class {int(targets[0])} (of {rec.classes})",
                     "check the labels the loss receives (a class-id mask must not go through an image transform "
                     "such as ToTensor, which divides by 255 before .long() truncates every id to 0)")
    return Finding(
        "supervision", Severity.WARN,
        f"{what}: batches of one class teach the model to predict that class, whatever the input; {fix}",
        "DATA-007", {"samples": n if _per_sample(rec) else int(rec.magnitude.shape[0]), "class": int(targets[0]),
                     "classes": rec.classes, "positions": None if _per_sample(rec) else n},
    )


def _weights_follow_frequency(rec: Supervision) -> Finding | None:
    """DATA-008: per-class loss weights, measured per sample, that grow with how often the class occurs in the
    batch."""
    if not _per_sample(rec):
        return None
    assert rec.target is not None and rec.weight is not None
    keep = _supervised(rec)
    targets, weights = rec.target[keep], rec.weight[keep]
    classes = targets.unique()
    if classes.numel() < 2:
        return None
    counts = torch.stack([(targets == c).sum() for c in classes]).float()
    means = torch.stack([weights[targets == c].mean() for c in classes])
    return _grows_with_frequency(classes, counts, means)


def _class_weights_follow_frequency(ctx: AuditContext) -> Finding | None:
    """DATA-008 from a ``weight=`` handed to ``cross_entropy``/``nll_loss`` and the classes of that call's targets
    (any shape: per token, per pixel, per frame)."""
    for call in ctx.probes.get("loss_calls", []):
        if call.class_counts is None:
            continue
        weight, counts = call.class_counts
        present = torch.nonzero(counts).flatten()
        if present.numel() >= 2:
            found = _grows_with_frequency(present, counts[present].float(), weight[present])
            if found is not None:
                return found
    return None


def _grows_with_frequency(classes: torch.Tensor, counts: torch.Tensor, means: torch.Tensor) -> Finding | None:
    if float(counts.max()) < 2 * float(counts.min()) or float(means.max()) < UNEQUAL * float(means.min()):
        return None
    if int(counts.argmax()) != int(means.argmax()) or int(counts.argmin()) != int(means.argmin()):
        return None
    order = torch.argsort(counts)
    if not bool((means[order][1:] >= means[order][:-1]).all()):
        return None
    common, rare = int(classes[counts.argmax()]), int(classes[counts.argmin()])
    return Finding(
        "supervision", Severity.WARN,
        f"the loss weights class {common} ({int(counts.max())} samples) {float(means.max()) / float(means.min()):.1f}x "
        f"more than class {rare} ({int(counts.min())} samples): the class weights grow with class frequency, so "
        "the rare classes count even less; weights for imbalance are inverse frequencies (n / (k * count_c))",
        "DATA-008", {"classes": [int(c) for c in classes], "counts": [int(c) for c in counts],
                     "weights": [float(w) for w in means]},
    )


def _weights_cancel(ctx: AuditContext, rec: Supervision) -> Finding | None:
    """DATA-009: class weights given to the loss, with a mean reduction, over a batch whose supervised samples
    are all of one class: the weighted mean divides the weight back out, so the weights change nothing."""
    assert ctx.trace is not None
    if not _per_sample(rec) or not ctx.trace.loss_weights:
        return None
    assert rec.target is not None
    targets = rec.target[_supervised(rec)].unique()
    uneven = [(w, red) for w, red in ctx.trace.loss_weights if red == "mean" and float(w.max()) > float(w.min())]
    if targets.numel() != 1 or not uneven:
        return None
    cls = int(targets[0])
    weight = uneven[0][0]
    return Finding(
        "supervision", Severity.WARN,
        f"the loss has class weights ({', '.join(f'{v:.3g}' for v in weight.tolist()[:8])}) with reduction='mean', "
        f"but every supervised sample of the batch is class {cls}: the weighted mean divides the weight back out, "
        "so the class weights have no effect (batch size 1, or batches of one class); use reduction='sum' over the "
        "batch size, or mix classes in each batch", "DATA-009", {"class": cls, "weight": weight.tolist()[:50]},
    )


def _padding_targets(ctx: AuditContext) -> Finding | None:
    """DATA-005 from the loss calls themselves (a loss computed inside ``forward``, on a shifted slice, leaves the
    model's output without a gradient to measure): a ``cross_entropy``/``nll_loss`` whose targets are the batch's
    tokens (as they are, or shifted by one) asks for the pad id at positions the batch marks as padding, and
    neither ``ignore_index``, a zero class weight nor (for ``reduction='none'``) a mask multiplied into the
    per-token loss drops them: only the padded targets the step's backward pulls on count."""
    trace = ctx.trace
    if trace is None or not trace.calls:
        return None
    tensors = top_level(trace.training_call())
    found = token_ids(tensors)
    marked = marked_padding(ctx, tensors, *found) if found is not None else None
    if found is None or marked is None:
        return None
    ids, (padding, marked_by) = found[1].detach().cpu(), marked
    padding = padding.cpu()
    pad = int(ids[padding][0])
    for call in ctx.probes.get("loss_calls", []):
        if call.targets is None:
            continue
        targets, ignore, weight = call.targets
        if ignore == pad or (weight is not None and 0 <= pad < weight.numel() and float(weight[pad]) == 0.0):
            continue
        for shift in (0, 1):
            tokens, padded = ids[:, shift:], padding[:, shift:]
            if targets.numel() != tokens.numel():
                continue
            asked = targets.reshape(tokens.shape)
            real = ~padded & (asked != ignore)
            if not bool(real.any()) or not bool((asked[real] == tokens[real]).all()):
                continue  # not the batch's own tokens
            hit = padded & (asked == pad)
            if call.pulled is not None:  # a per-element loss weighted afterwards: only targets that get gradient
                hit &= call.pulled.reshape(tokens.shape)
            count = int(hit.sum())
            if count >= 2:
                return Finding(
                    "supervision", Severity.WARN,
                    f"{count} target(s) of {call.fn} are the pad id {pad} at positions the batch marks as padding "
                    f"({marked_by}), and its ignore_index is {ignore}: the loss trains the model to predict padding; "
                    + (f"the per-token loss is weighted by a mask that keeps them (a mask of the inputs where the "
                       f"shifted targets need theirs, mask[:, 1:]): give the padded targets weight 0, or set them "
                       f"to {ignore}" if call.pulled is not None else
                       f"pass ignore_index={pad} (or set the padded targets to {ignore})"),
                    "DATA-005", {"positions": count, "pad_id": pad, "ignore_index": ignore, "fn": call.fn,
                                 "shift": shift},
                )
    return None


def _one_objective(trace: StepTrace) -> bool:
    """The step's backward passes all reach the same trainable tensors: micro-batches of one objective. Passes that
    train different tensors are several objectives (tasks on their own batches, each with its own head), whose
    gradients add up by design. Passes that reach none of the model's trainable tensors (copies trained in the
    step, federated clients) are not the model's micro-batches."""
    leaves = set(trace.backward_leaves)
    return len(leaves) <= 1 and all(leaves)


def _inputs_seen(call: RootCall) -> tuple[tuple[int, int, tuple[int, ...]], ...]:
    """Which tensors a model call read (storage, offset, shape): two forwards of one batch read the same ones,
    micro-batches other ones (slices of one tensor included)."""
    return tuple((t.untyped_storage().data_ptr(), int(t.storage_offset()), tuple(t.shape))
                 for _, t in iter_tensors((call.args, call.kwargs), depth=3) if t.device.type != "meta")


def _undivided_micro_batches(trace: StepTrace, k: int) -> Finding | None:
    """LOOP-004 from the graphs, when the reported loss says nothing (a step that returns another value): each of
    the step's backward passes starts from a mean-reduced loss as it is, over forwards of different micro-batches
    (at least ``k`` forwards with autograd on, not all reading the same tensors), every pass reaches the same trainable
    tensors (one objective, not several tasks), and at most one optimizer step follows."""
    forwards = [_inputs_seen(call) for call in trace.calls if call.grad_enabled]
    if (len(trace.backward_unscaled) != k or not all(trace.backward_unscaled) or len(forwards) < k
            or len(set(forwards)) < 2 or not _one_objective(trace)):
        return None
    return Finding(
        "supervision", Severity.WARN,
        f"the step runs {k} backward passes over {len(forwards)} forwards of different micro-batches for one "
        f"optimizer update, and each backpropagates a mean-reduced loss as it is (not divided by {k}): the "
        f"accumulated gradient is the sum of {k} mean gradients, {k}x the mean gradient of the accumulated batch "
        f"(gradient clipping then clips a {k}x larger norm, SGD takes {k}x the lr); divide each micro-batch's loss "
        f"by {k} before backward",
        "LOOP-004", {"micro_batches": k, "from": "graphs"},
    )


def _backpropagated_multiple(ctx: AuditContext) -> Finding | None:
    """LOOP-004 from the values: the step's separate backward passes (none keeping its graph, so not terms of one
    forward) backpropagate, together, exactly k times the loss ``step_fn`` reports, while their own values
    differ: each micro-batch's mean loss went into backward undivided, and the step reports their mean."""
    trace = ctx.trace
    assert trace is not None
    k, values = trace.backward_calls, [v for v, _ in trace.backward_values]
    # one update's backward passes: step_fn steps once, or leaves the step to the loop that calls it (a trainer)
    if (k < 2 or trace.loop_events.count("step") > 1 or len(values) != k or trace.scaled_backward
            or any(retained for _, retained in trace.backward_values) or not _one_objective(trace)):
        return None
    reported = extract_loss(trace.raw_output)
    if isinstance(reported, torch.Tensor) and reported.numel() == 1:
        reported = float(reported.detach())
    if not isinstance(reported, float) or reported == 0.0 or not all(isinstance(v, float) for v in values):
        return _undivided_micro_batches(trace, k)
    measured = [v for v in values if v is not None]
    total, spread = sum(measured), max(measured) - min(measured)
    if not (math.isclose(total, k * reported, rel_tol=1e-4) and spread > 1e-3 * max(abs(v) for v in measured)):
        return _undivided_micro_batches(trace, k)
    return Finding(
        "supervision", Severity.WARN,
        f"the step's {k} backward passes together backpropagate {total:.4g}, exactly {k}x the loss step_fn reports "
        f"({reported:.4g}, the mean of its micro-batch losses): each micro-batch's loss goes into backward "
        f"undivided, so every update is {k}x the mean gradient (the lr is effectively {k}x larger, and changes "
        f"with the accumulation count); divide each micro-batch's loss by {k} before backward",
        "LOOP-004", {"micro_batches": k, "backpropagated": measured, "reported": reported},
    )


def _accumulation(ctx: AuditContext) -> Iterable[Finding]:
    """LOOP-004 / LOOP-005: how the micro-batches of one accumulated step (several backward passes before one
    optimizer step inside ``step_fn``) are weighted against each other."""
    trace = ctx.trace
    assert trace is not None
    records = [r for r in trace.supervision if r.weight is not None]
    k = trace.backward_calls
    if k < 2 or trace.loop_events.count("step") != 1 or len(records) != k:
        return
    if not _one_objective(trace):
        return
    calls = [trace.calls[r.call] for r in records if r.call < len(trace.calls)]
    if len(calls) == k and all(_same_arguments(calls[0], c) for c in calls[1:]):
        return  # one batch's gradient computed k times (SAM's second pass at perturbed weights), not micro-batches
    totals = [float(r.weight.sum()) for r in records if r.weight is not None]
    positions = sum(int(_supervised(r).sum()) for r in records)
    if all(math.isclose(t, 1.0, rel_tol=0.05) for t in totals) and positions > k:
        yield Finding(
            "supervision", Severity.WARN,
            f"the step sums the mean losses of its {k} micro-batches without dividing by {k}: each optimizer step "
            f"gets {k}x the mean gradient over its {positions} supervised positions (the lr is effectively {k}x "
            f"larger, and changes with the accumulation count); divide each micro-batch's loss by {k}",
            "LOOP-004", {"micro_batches": k, "weight_totals": totals, "positions": positions},
        )
        return
    window = sum(totals)
    if math.isclose(window, 1.0 / k, rel_tol=0.05) and positions > k:
        yield Finding(
            "supervision", Severity.WARN,
            f"the {k} micro-batches of one step carry a total loss weight of {window:.3g} = 1/{k}: the loss, already "
            f"normalised over the whole step's {positions} supervised positions, is divided by the accumulation "
            f"count again, so every gradient is {k}x too small (an lr {k}x lower with SGD, and weight decay and "
            "epsilon weigh more with Adam); divide once",
            "LOOP-011", {"micro_batches": k, "weight_totals": totals, "window_weight": window,
                         "positions": positions},
        )
        return
    per_token = []
    for r in records:
        assert r.weight is not None
        w = r.weight[_supervised(r)]
        if w.numel() == 0 or float(w.max()) > 1.01 * float(w.min()):
            return  # weights vary inside a micro-batch: not a plain mean per micro-batch
        per_token.append(float(w.mean()))
    if max(per_token) > UNEQUAL * min(per_token):
        yield Finding(
            "supervision", Severity.WARN,
            f"the {k} micro-batches of one step weight their positions differently ({min(per_token):.3g} to "
            f"{max(per_token):.3g} per position): each micro-batch's loss is a mean over its own count, so positions "
            "of small micro-batches weigh more; normalise by the step's total count of supervised positions",
            "LOOP-005", {"micro_batches": k, "weights": per_token},
        )


def _same_arguments(a: RootCall, b: RootCall) -> bool:
    """The two calls got the same arguments: equal tensors, everything else equal, nothing but tensors judged."""
    if len(a.args) != len(b.args) or set(a.kwargs) != set(b.kwargs):
        return False
    pairs = [*zip(a.args, b.args), *((a.kwargs[k], b.kwargs[k]) for k in a.kwargs)]
    tensors = 0
    for x, y in pairs:
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            if x.shape != y.shape or x.dtype != y.dtype or not torch.equal(x, y):
                return False
            tensors += 1
        elif isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor) or x is not y and x != y:
            return False
    return tensors > 0


@check("repeated_forward", emits=("DATA-018",))
def check_repeated_forward(ctx: AuditContext) -> Iterable[Finding]:
    """DATA-018: two training forwards of the step get the same inputs and compute the same output, and one
    loss function compares them (its input is computed from both; two losses that each read one forward are a
    recomputation, not this): nothing random (no augmentation, no dropout) told them apart, so a loss that compares them
    (the two views of a contrastive pair, a consistency term) compares each sample with itself."""
    trace = ctx.trace
    if trace is None or trace.error is not None:
        return []
    supervised = {r.call for r in trace.supervision if float(r.magnitude.sum()) > 0}
    compared = [c.reads_calls for c in ctx.probes.get("loss_calls", [])]
    calls = [(i, c) for i, c in enumerate(trace.calls) if c.grad_enabled and i in supervised]
    for n, (i, first) in enumerate(calls):
        for j, second in calls[n + 1:]:
            if (first.training != second.training or not any({i, j} <= read for read in compared)
                    or not _same_arguments(first, second)):
                continue
            if first.fingerprint is not None and first.fingerprint == second.fingerprint:
                return [Finding(
                    "repeated_forward", Severity.WARN,
                    f"calls {i} and {j} of the model in this step get the same inputs and compute the same output, "
                    "and one loss compares them: nothing random (no augmentation between them, no dropout) "
                    "tells them apart, so a loss comparing them (two views of a contrastive pair, a consistency "
                    "term) compares each sample with itself; pass the second view (batch['aug2'], not 'aug1' "
                    "again), or keep the dropout that is meant to make the views differ",
                    "DATA-018", {"calls": [i, j]},
                )]
    return []


@check("supervision", emits=("DATA-005", "DATA-006", "DATA-007", "DATA-008", "DATA-009", "DATA-019", "LOOP-004",
                             "LOOP-005",
                             "LOOP-011"))
def check_supervision(ctx: AuditContext) -> Iterable[Finding]:
    """What the loss supervises against the batch, the config and the step's accumulation."""
    trace = ctx.trace
    if trace is None or trace.error is not None:
        return []
    labelled = labelled_padding(ctx.model, batch_mapping(ctx.inputs, trace.calls)) is not None  # DATA-002's case
    found = [_class_weights_follow_frequency(ctx), None if labelled else _padding_targets(ctx),
             _backpropagated_multiple(ctx)]
    findings: list[Finding] = [f for f in found if f is not None]
    if not trace.supervision:
        return findings
    seen: set[str] = {f.catalog_id for f in findings}
    for rec in trace.supervision:
        if rec.call >= len(trace.calls):
            continue
        call = trace.calls[rec.call]
        candidates = [None if labelled else _padding_supervised(ctx, call, rec), _copies_input(ctx, call, rec),
                      _crosses_packing(call, rec),
                      _one_class(rec), _weights_follow_frequency(rec), _weights_cancel(ctx, rec)]
        for f in candidates:
            if f is not None and f.catalog_id not in seen:
                seen.add(f.catalog_id)
                findings.append(f)
    findings.extend(f for f in _accumulation(ctx) if f.catalog_id not in {g.catalog_id for g in findings})
    return findings
