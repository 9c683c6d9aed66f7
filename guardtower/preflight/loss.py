"""Loss wiring checks (``loss``, ``loss_inputs``) and the batch/label checks (``data``).

The ``loss_calls`` probe wraps the ``torch.nn.functional`` losses while the step runs; ``nn.CrossEntropyLoss``,
``nn.MSELoss`` & co. and Hugging Face's loss functions call them through the module attribute, so one patch
sees them all. It records what went in (value range, shapes, ignored targets), never the tensors.
"""

from __future__ import annotations

import contextlib
import functools
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.nn.functional as F

from guardtower.preflight._batch import batch_mapping, labelled_padding
from guardtower.preflight._registry import AuditContext, check, probe
from guardtower.preflight._trace import StepTrace
from guardtower.report import Finding
from guardtower.severity import Severity

__all__ = ["LossCall"]

_CLASSIFICATION = ("cross_entropy", "binary_cross_entropy_with_logits", "nll_loss")
_REGRESSION = ("mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss")
_DIVERGENCE = ("kl_div",)


@dataclass
class LossCall:
    """What one functional loss call received."""

    fn: str
    input_shape: tuple[int, ...]
    target_shape: tuple[int, ...]
    input_min: float | None = None
    input_max: float | None = None
    rows_sum_to_one: bool = False
    all_ignored: bool = False
    reduction: str = "mean"


def _describe(fn: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> LossCall | None:
    inp = args[0] if args else kwargs.get("input")
    target = args[1] if len(args) > 1 else kwargs.get("target")
    if not isinstance(inp, torch.Tensor) or not isinstance(target, torch.Tensor):
        return None
    reduction = kwargs.get("reduction", args[4] if fn == "kl_div" and len(args) > 4 else "mean")
    call = LossCall(fn, tuple(inp.shape), tuple(target.shape), reduction=str(reduction))
    if inp.numel() == 0 or not inp.is_floating_point():
        return call
    with torch.no_grad():
        x = inp.detach().float()
        call.input_min, call.input_max = float(x.min()), float(x.max())
        if fn == "cross_entropy" and x.dim() >= 1:
            class_dim = 1 if x.dim() >= 2 else 0
            if x.shape[class_dim] >= 2:
                call.rows_sum_to_one = bool((x.sum(class_dim) - 1.0).abs().max() <= 1e-3)
        if fn in ("cross_entropy", "nll_loss") and not target.is_floating_point() and target.numel() > 0:
            ignore = kwargs.get("ignore_index", -100)
            call.all_ignored = bool((target == ignore).all())
    return call


@probe("loss_calls")
@contextlib.contextmanager
def _loss_calls(ctx: AuditContext) -> Iterator[list[LossCall]]:
    calls: list[LossCall] = []
    ctx.probes["loss_calls"] = calls
    originals: dict[str, Callable[..., Any]] = {name: getattr(F, name)
                                                  for name in _CLASSIFICATION + _REGRESSION + _DIVERGENCE}

    def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                described = _describe(name, args, kwargs)
                if described is not None:
                    calls.append(described)
            except Exception:  # observing must never change what the step does
                pass
            return fn(*args, **kwargs)

        return wrapper

    for name, fn in originals.items():
        setattr(F, name, wrap(name, fn))
    try:
        yield calls
    finally:
        for name, fn in originals.items():
            setattr(F, name, fn)


@check("loss", emits=("LOSS-001", "LOSS-002", "LOSS-003", "LOSS-006", "LOSS-007"), always=True)
def check_loss(ctx: AuditContext) -> Iterable[Finding]:
    """LOSS-006 the step raised, LOSS-007 no loss tensor, LOSS-001 detached, LOSS-002 not scalar, LOSS-003 not
    finite. Runs whatever ``checks=`` selects: without a usable loss no other verdict means anything."""
    trace = ctx.trace
    if trace is None:
        return []
    if trace.error is not None or not isinstance(trace.loss, torch.Tensor):
        return _step_failed(trace)
    loss = trace.loss
    findings = []
    trainable = any(p.requires_grad for p in ctx.params.values())
    if trainable and not trace.loss_requires_grad and not trace.backward:
        findings.append(Finding(
            "loss", Severity.ERROR,
            "the loss does not require grad: it was detached (.detach(), .item(), torch.tensor(...), or computed "
            "under torch.no_grad()), so backward() cannot reach any parameter",
            "LOSS-001", {"dtype": str(loss.dtype)},
        ))
    elif trainable and trace.loss_requires_grad and trace.loss_is_leaf and not trace.user_backward:
        findings.append(Finding(
            "loss", Severity.ERROR,
            "the loss is a new leaf tensor that requires grad (torch.tensor(loss.item(), requires_grad=True), or "
            "loss.requires_grad = True on a detached loss): backward() runs but reaches no parameter",
            "LOSS-001", {"dtype": str(loss.dtype), "leaf": True},
        ))
    if loss.numel() != 1:
        findings.append(Finding(
            "loss", Severity.ERROR,
            f"the loss has shape {tuple(loss.shape)}, not a scalar (reduction='none' left un-reduced?); "
            "the audit continued with its mean",
            "LOSS-002", {"shape": list(loss.shape)},
        ))
    if loss.numel() > 0 and loss.is_floating_point() and not bool(torch.isfinite(loss).all()):
        findings.append(Finding(
            "loss", Severity.ERROR, "the loss is NaN or Inf on this batch", "LOSS-003",
            {"value": [float(v) for v in loss.detach().float().flatten()[:8]]},
        ))
    return findings


def _step_failed(trace: StepTrace) -> list[Finding]:
    """LOSS-006/LOSS-007: the step itself did not produce a usable loss."""
    if trace.error is not None:
        phase = trace.phase or "step_fn"
        err = trace.error
        where = traceback.extract_tb(err.__traceback__)[-1] if err.__traceback__ else None
        return [Finding(
            "loss", Severity.ERROR,
            f"the training step raised in {phase}: {type(err).__name__}: {err}",
            "LOSS-006",
            {"phase": phase, "exception": type(err).__name__, "error": str(err)[:2000],
             "where": f"{where.filename}:{where.lineno} in {where.name}" if where else None},
        )]
    out = trace.raw_output
    has_loss_attr = hasattr(out, "loss") or (isinstance(out, dict) and "loss" in out)
    hint = ("its .loss is None (Hugging Face models compute a loss only when labels are passed)"
            if has_loss_attr else f"it returned {type(out).__name__}")
    return [Finding("loss", Severity.ERROR, f"step_fn returned no loss tensor: {hint}", "LOSS-007",
                    {"returned": type(out).__name__})]


@check("loss_inputs", emits=("LOSS-004", "LOSS-005", "LOSS-008", "LOSS-010"))
def check_loss_inputs(ctx: AuditContext) -> Iterable[Finding]:
    """LOSS-004 probabilities fed to a logits loss, LOSS-005 broadcasting targets, LOSS-008 NLL on logits,
    LOSS-010 a KL divergence averaged over its classes too."""
    calls: list[LossCall] = ctx.probes.get("loss_calls", [])
    findings = []
    for call in calls:
        if call.fn == "kl_div" and call.reduction == "mean" and len(call.input_shape) >= 2 and call.input_shape[-1] > 1:
            findings.append(Finding(
                "loss_inputs", Severity.WARN,
                f"kl_div (nn.KLDivLoss) with reduction='mean' on input of shape {call.input_shape}: 'mean' averages "
                f"over every element, so the divergence is also divided by the {call.input_shape[-1]} classes and the "
                "term weighs that much less than intended (distillation barely pulls); use reduction='batchmean'",
                "LOSS-010", {"input_shape": list(call.input_shape), "reduction": call.reduction},
            ))
            continue
        lo, hi = call.input_min, call.input_max
        if lo is None or hi is None:
            continue
        in_unit = lo >= 0.0 and hi <= 1.0
        if call.fn == "cross_entropy" and in_unit and call.rows_sum_to_one:
            findings.append(Finding(
                "loss_inputs", Severity.ERROR,
                f"cross_entropy received probabilities (every row in [0, 1] and summing to 1, shape "
                f"{call.input_shape}): softmax is applied twice; pass the raw logits",
                "LOSS-004", {"fn": call.fn, "input_shape": list(call.input_shape), "min": lo, "max": hi},
            ))
        elif call.fn == "binary_cross_entropy_with_logits" and in_unit and _numel(call.input_shape) >= 4:
            findings.append(Finding(
                "loss_inputs", Severity.ERROR,
                f"binary_cross_entropy_with_logits received values all in [0, 1] (shape {call.input_shape}): "
                "sigmoid is applied twice; pass the raw logits",
                "LOSS-004", {"fn": call.fn, "input_shape": list(call.input_shape), "min": lo, "max": hi},
            ))
        elif call.fn == "nll_loss" and hi > 0.0:
            findings.append(Finding(
                "loss_inputs", Severity.ERROR,
                f"nll_loss received values up to {hi:.3g}; it expects log-probabilities (<= 0): apply "
                "log_softmax first, or use cross_entropy on the logits",
                "LOSS-008", {"fn": call.fn, "input_shape": list(call.input_shape), "max": hi},
            ))
        if call.fn in _REGRESSION and call.input_shape != call.target_shape:
            try:
                shape = tuple(torch.broadcast_shapes(call.input_shape, call.target_shape))
            except RuntimeError:
                continue
            findings.append(Finding(
                "loss_inputs", Severity.ERROR,
                f"{call.fn} input {call.input_shape} and target {call.target_shape} broadcast to {shape}: every "
                "prediction is compared with every target; make the shapes equal (squeeze/unsqueeze)",
                "LOSS-005", {"fn": call.fn, "input_shape": list(call.input_shape),
                             "target_shape": list(call.target_shape), "broadcast_shape": list(shape)},
            ))
    return findings


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _is_causal_lm(model: Any) -> bool:
    """A Hugging Face language model that shifts ``labels`` itself (``*ForCausalLM``, ``*LMHeadModel``)."""
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return False
    name = type(model).__name__
    return "CausalLM" in name or name.endswith("LMHeadModel")


def _eos_ids(model: Any) -> set[int]:
    eos = getattr(getattr(model, "config", None), "eos_token_id", None)
    eos = eos if isinstance(eos, (list, tuple)) else [eos]
    return {int(e) for e in eos if isinstance(e, int)}


def _causal_lm_labels(ctx: AuditContext) -> list[Finding]:
    """DATA-003 every real EOS masked to -100 (pad_token = eos_token), DATA-004 labels already shifted by the
    user and shifted again inside the model."""
    batch = batch_mapping(ctx.inputs, ctx.trace.calls if ctx.trace is not None else [])
    if batch is None or not _is_causal_lm(ctx.model):
        return []
    ids, labels, mask = batch.get("input_ids"), batch.get("labels"), batch.get("attention_mask")
    if not (isinstance(ids, torch.Tensor) and isinstance(labels, torch.Tensor) and ids.shape == labels.shape
            and ids.dim() == 2 and not labels.is_floating_point()):
        return []
    findings = []
    eos = _eos_ids(ctx.model)
    if eos and isinstance(mask, torch.Tensor) and mask.shape == ids.shape:
        real_eos = torch.isin(ids, torch.tensor(sorted(eos), device=ids.device)) & (mask != 0)
        n_eos = int(real_eos.sum())
        if n_eos and not bool((labels[real_eos] != -100).any()) and not bool(torch.isin(
                labels, torch.tensor(sorted(eos), device=labels.device)).any()):
            findings.append(Finding(
                "data", Severity.WARN,
                f"all {n_eos} real end-of-sequence token(s) (attention_mask 1) are labelled -100: with pad_token = "
                "eos_token the collator masks every EOS as padding, so the model never learns to stop; use a "
                "distinct pad token, or mask by attention_mask instead of by token id",
                "DATA-003", {"eos_token_ids": sorted(eos), "real_eos": n_eos},
            ))
    supervised = labels[:, :-1] != -100
    n = int(supervised.sum())
    if n >= 4 and ids.shape[1] >= 3:
        shifted = int(((labels[:, :-1] == ids[:, 1:]) & supervised).sum())
        same = int(((labels == ids) & (labels != -100)).sum())
        if shifted >= 0.9 * n and same < 0.5 * n:
            findings.append(Finding(
                "data", Severity.WARN,
                f"labels[t] equals input_ids[t+1] at {shifted} of {n} supervised positions: the labels are already "
                f"shifted, and {type(ctx.model).__name__} shifts them again, so it learns to predict the token after "
                "next; pass labels = input_ids (masked) and let the model shift",
                "DATA-004", {"shifted_matches": shifted, "supervised": n},
            ))
    return findings


@check("data", emits=("DATA-001", "DATA-002", "DATA-003", "DATA-004"), needs=("padded_labels",))
def check_data(ctx: AuditContext) -> Iterable[Finding]:
    """DATA-001 no supervised position in the batch, DATA-002 padding positions that carry labels,
    DATA-003/DATA-004 causal-LM labels that mask every EOS or are shifted twice."""
    findings = _causal_lm_labels(ctx)
    batch = batch_mapping(ctx.inputs, ctx.trace.calls if ctx.trace is not None else [])
    labels = batch.get("labels") if batch is not None else None
    calls: list[LossCall] = ctx.probes.get("loss_calls", [])
    all_ignored = any(c.all_ignored for c in calls)
    if isinstance(labels, torch.Tensor) and not labels.is_floating_point() and labels.numel() > 0:
        all_ignored = all_ignored or bool((labels == -100).all())
    if all_ignored:
        findings.append(Finding(
            "data", Severity.ERROR,
            "no position in this batch has a label (all targets equal ignore_index -100): the loss is 0/0 = NaN "
            "or zero, and the step teaches nothing; check truncation and the completion-only masking",
            "DATA-001", {},
        ))
    padding = labelled_padding(ctx.model, batch)
    ignored = ctx.trace is not None and ctx.trace.padded_labels_ignored
    if padding is not None and not ignored:
        _, leaked = padding
        n = int(leaked.sum())
        findings.append(Finding(
            "data", Severity.WARN,
            f"{n} padding positions (attention_mask == 0) carry labels, and the loss changes when they change: "
            "the model is trained to predict padding; set labels to -100 where attention_mask is 0",
            "DATA-002", {"labelled_padding": n},
        ))
    return findings
