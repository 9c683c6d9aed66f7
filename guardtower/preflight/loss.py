"""Loss wiring checks (``loss``, ``loss_inputs``) and the batch/label checks (``data``).

The ``loss_calls`` probe wraps the ``torch.nn.functional`` losses while the step runs; ``nn.CrossEntropyLoss``,
``nn.MSELoss`` & co. and Hugging Face's loss functions call them through the module attribute, so one patch
sees them all. It records what went in (value range, shapes, ignored targets), never the tensors.
"""

from __future__ import annotations

import contextlib
import functools
import math
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.nn.functional as F

from guardtower.preflight._batch import batch_mapping, labelled_padding
from guardtower.preflight._cut_terms import CutTerm, recorder, reduction_patches
from guardtower.preflight._padding_reads import top_level
from guardtower.preflight._registry import AuditContext, check, probe
from guardtower.preflight._util import MAX_GRAPH_NODES, graph_holds, graph_nodes, is_causal_lm, patched, reached_params
from guardtower.preflight._trace import StepTrace
from guardtower.preflight.supervision import skips_a_token, stops_unsupervised
from guardtower.report import Finding
from guardtower.severity import Severity

__all__ = ["LossCall"]

_CLASSIFICATION = ("cross_entropy", "binary_cross_entropy_with_logits", "binary_cross_entropy", "nll_loss")
_REGRESSION = ("mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss")
_DIVERGENCE = ("kl_div", "ctc_loss")
#: the other losses: watched only for a result that carries no gradient
_OTHER = ("cosine_embedding_loss", "margin_ranking_loss", "triplet_margin_loss", "hinge_embedding_loss",
          "soft_margin_loss", "poisson_nll_loss", "gaussian_nll_loss", "multilabel_soft_margin_loss")
#: the Tensor arithmetic a loss term goes through on its way into the total: scalings, then sums
_SCALINGS = ("__mul__", "__rmul__", "__truediv__", "__neg__", "mul", "div")
_SUMS = ("__add__", "__radd__", "__sub__", "__rsub__", "__iadd__", "__isub__", "add", "sub")
#: losses whose input must be log-probabilities over one dimension
_LOG_PROB_INPUT = ("nll_loss", "ctc_loss", "kl_div")
#: losses whose (input, target) roles are not symmetric: the prediction is the input
_ASYMMETRIC = ("kl_div", "cross_entropy", "binary_cross_entropy_with_logits", "binary_cross_entropy")
#: losses that normalise over a class dimension, and lose precision when it runs in 16 bits
_SOFTMAX_FAMILY = ("cross_entropy", "nll_loss", "kl_div", "ctc_loss")
_HALF = (torch.float16, torch.bfloat16)
#: losses that apply their own softmax/sigmoid to unbounded logits
_LOGITS = ("cross_entropy", "binary_cross_entropy_with_logits")


@dataclass
class Values:
    """Value range of a loss argument, and the dimensions over which it is normalised."""

    min: float
    max: float
    log_dims: tuple[int, ...] = ()
    """dims along which the values are log-probabilities (all <= 0, logsumexp 0)"""
    prob_dims: tuple[int, ...] = ()
    """dims along which the values are probabilities (in [0, 1], summing to 1)"""
    lse_range: tuple[float, float] | None = None
    """min and max of logsumexp over the ``class_dim`` the loss reads (``LossCall.class_dim``)"""


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
    input_dtype: torch.dtype | None = None
    autocast: bool = False
    """autocast was on for the input's device (the loss then runs in float32 whatever the input's dtype)"""
    class_dim: int | None = None
    """the dimension the loss normalises over (nll_loss: 1, ctc_loss: the last)"""
    input_values: Values | None = None
    target_values: Values | None = None
    input_grad: bool = False
    """the input depends on a trainable parameter (asymmetric losses only)"""
    target_grad: bool = False
    log_target: bool = False
    bound: str = ""
    """the activation the input comes straight from, when it bounds the prediction (``"sigmoid"`` ...)"""
    outside: float = 0.0
    """share of target elements outside that activation's range (regression losses)"""
    dead: float | None = None
    """the result's (mean) value when it was computed with gradients enabled yet reaches no trainable parameter:
    nothing it compares trains (detached, computed under no_grad, or by frozen modules only)"""
    class_counts: tuple[torch.Tensor, torch.Tensor] | None = None
    """``(weight=, count of each class among the non-ignored targets)`` of a class-weighted ``cross_entropy`` or
    ``nll_loss`` call"""
    dead_added: bool = False
    """that dead result (or a scaling of it) was added to, or subtracted from, a tensor that trains"""
    targets: tuple[torch.Tensor, int, torch.Tensor | None] | None = None
    """``(class-id targets, ignore_index, weight=)`` of a ``cross_entropy`` or ``nll_loss`` call (a CPU copy, up to
    ``_MAX_TARGETS`` ids): what the loss is asked to predict where"""
    reads_calls: frozenset[int] = frozenset()
    """the model calls of the step (indices into ``StepTrace.calls``) whose primary output the input is computed
    from"""
    regression_target: torch.Tensor | None = None
    """a CPU copy of a regression loss's float target (up to ``_MAX_TARGETS`` values)"""
    target_ties: tuple[int, int] | None = None
    """``(rows, judged)`` of a float32 ``cross_entropy`` over candidates (``(N, C)``, 3 to ``_MAX_CANDIDATES``):
    the rows whose target's logit equals another candidate's, out of the rows judged"""
    value: float | None = None
    """the result, when it is one number (a reduced loss), as computed"""
    anchor_positives: int = 0
    """rows of that ``cross_entropy`` whose target logit is the same value in every row judged and above every other
    candidate: each positive scores an anchor against itself (0 when that is not so)"""
    reaches: frozenset[int] = frozenset()
    """ids of the trainable parameters the result's gradient reaches"""
    node: Any = None
    """the result's autograd node, held only while ``step_fn`` runs (to find the backward passes it is part of)"""
    backwards: list[int] = field(default_factory=list)
    """for each of ``step_fn``'s backward passes that holds the result: how many optimizer steps had run when it
    began (an index into ``StepTrace.held_at_step``)"""
    ascended: bool = False
    """the gradient backward brought to the result was nowhere positive and somewhere negative: the loss that was
    backpropagated grows as this term grows (the term is maximised)"""
    pulled: torch.Tensor | None = None
    """of a per-element (``reduction='none'``) class-id loss: which targets the step's backward brought a non-zero
    gradient to (a CPU bool tensor of the targets' shape); a mask multiplied in afterwards shows here"""


#: raw logits all inside [0, 1] without a sigmoid behind them: a few (a small head at init) can, this many cannot
_UNIT_LOGITS = 64
#: autograd nodes of activations that bound a prediction, and the range they allow
_BOUNDED: dict[str, tuple[str, float, float]] = {
    "SigmoidBackward0": ("sigmoid", 0.0, 1.0), "TanhBackward0": ("tanh", -1.0, 1.0),
    "ReluBackward0": ("relu", 0.0, math.inf), "SoftplusBackward0": ("softplus", 0.0, math.inf),
    "SoftmaxBackward0": ("softmax", 0.0, 1.0),
}
#: nodes that only reshape: the activation behind them still bounds the values
_RESHAPES = ("View", "Squeeze", "Unsqueeze", "Reshape", "Permute", "Transpose", "TBackward", "Clone",
             "Select", "Slice", "Expand")


#: activations that make probabilities, and those a double activation applies to them
_PROBABILITIES = {node: bound[0] for node, bound in _BOUNDED.items() if bound[0] in ("sigmoid", "softmax")}
_SQUASHES = {**_PROBABILITIES, "LogSoftmaxBackward0": "log_softmax"}


def _double_activation(ctx: AuditContext) -> tuple[str, str] | None:
    """(outer, inner): an activation applied, through reshapes and selections only, to a sigmoid's or softmax's
    output, in the graph of what the step backpropagated (its first backward passes, or the loss it returned)."""
    trace = ctx.trace
    if trace is None:
        return None
    roots = list(trace.backward_roots)
    if not roots and isinstance(trace.loss, torch.Tensor) and trace.loss.grad_fn is not None:
        roots = [trace.loss.grad_fn]
    seen = 0
    for root in roots:
        for node in graph_nodes(root):
            seen += 1
            if seen > MAX_GRAPH_NODES:
                return None
            outer = _SQUASHES.get(type(node).__name__)
            if outer is None:
                continue
            inner = _below_reshapes(node.next_functions[0][0] if node.next_functions else None)
            if inner is not None and type(inner).__name__ in _PROBABILITIES:
                return outer, _PROBABILITIES[type(inner).__name__]
    return None


def _below_reshapes(node: Any) -> Any:
    """The first autograd node at or below ``node`` that is not a reshape or selection (8 hops at most)."""
    for _ in range(8):
        if node is None or not type(node).__name__.startswith(_RESHAPES):
            return node
        node = node.next_functions[0][0] if node.next_functions else None
    return node


def _bounding_activation(t: torch.Tensor) -> tuple[str, float, float] | None:
    node = _below_reshapes(t.grad_fn)
    return None if node is None else _BOUNDED.get(type(node).__name__)


def _values(x: torch.Tensor, class_dim: int | None) -> Values:
    """Range and normalised dims of a floating tensor (a detached float32 copy)."""
    finite = x[torch.isfinite(x)]
    if finite.numel() == 0:
        return Values(float("nan"), float("nan"))
    lo, hi = float(finite.min()), float(finite.max())
    log_dims: list[int] = []
    prob_dims: list[int] = []
    lse_range = None
    for d in range(x.dim()):
        if x.shape[d] < 2:
            continue
        if hi <= 1e-4:
            lse = torch.logsumexp(x, d)
            lse = lse[torch.isfinite(lse)]
            if lse.numel() and float(lse.abs().max()) <= 1e-2:
                log_dims.append(d)
            if d == class_dim and lse.numel():
                lse_range = (float(lse.min()), float(lse.max()))
        if lo >= 0.0 and hi <= 1.0 and float((x.sum(d) - 1.0).abs().max()) <= 1e-3:
            prob_dims.append(d)
    return Values(lo, hi, tuple(log_dims), tuple(prob_dims), lse_range)


def _trains(t: torch.Tensor, trainable: set[int]) -> bool:
    """The autograd graph behind ``t`` reaches a trainable parameter."""
    return bool(reached_params(t, trainable, first=True))


#: loss calls (and backward passes) whose gradient paths are followed, at most
_MAX_TERMS = 32
#: class-id targets kept per loss call, at most (a copy on the host)
_MAX_TARGETS = 1 << 20
#: above this many classes two logits of a row can tie by chance often enough to matter
_MAX_CANDIDATES = 4096
#: two logits of a row within this share of the row's largest magnitude are the same candidate (one row of a
#: matrix product may round differently from another)
_TIE = 1e-6
#: a logit this large is a mask's fill value, which many candidates share on purpose
_FILL = 1e4


def _target_ties(x: torch.Tensor, target: torch.Tensor, ignore: int) -> tuple[int, int]:
    """``(rows, judged)``: the rows of ``x`` (N, C) whose target logit equals another class's. Not a tie at exactly
    0 (a ReLU) or at a mask's fill (|x| >= 1e4), nor one the whole row shares (a head that outputs a constant).
    Logits computed in 16 bits and cast up (every value exactly a bf16 or fp16 one) tie by chance: none judged."""
    finite = x[torch.isfinite(x)]
    if any(torch.equal(finite, finite.to(low).float()) for low in _HALF):
        return 0, 0
    keep = (target != ignore) & (target >= 0) & (target < x.shape[1])
    x, target = x[keep], target[keep]
    picked = x.gather(1, target[:, None])
    real = torch.isfinite(x) & (x.abs() < _FILL)  # a mask's fill (-1e9 on the diagonal) sets no tolerance
    scale = torch.where(real, x.abs(), torch.zeros_like(x)).amax(1, keepdim=True)
    close = (x - picked).abs() <= _TIE * scale
    close[torch.arange(x.shape[0]), target] = False
    value = picked.squeeze(1)
    tied = close.any(1) & (close.sum(1) < x.shape[1] - 1) & (value != 0) & (value.abs() < _FILL)
    return int(tied.sum()), int(x.shape[0])


#: at least this many rows whose target logits are all one value, above every other candidate, to judge the positives
_MIN_ANCHOR_ROWS = 4


def _anchor_positives(x: torch.Tensor, target: torch.Tensor, ignore: int) -> int:
    """The rows of ``x`` (N, C) when every row's target logit is one value (within float rounding), non-zero and
    the row's largest real candidate: a similarity of each anchor with itself (cos = 1, over a temperature), the
    positive view taken from the same half of the batch as the anchor; else 0."""
    keep = (target != ignore) & (target >= 0) & (target < x.shape[1])
    x, target = x[keep].detach(), target[keep]
    if x.shape[0] < _MIN_ANCHOR_ROWS:
        return 0
    picked = x.gather(1, target[:, None]).squeeze(1)
    first = picked[0]
    if not bool(torch.isfinite(first)) or float(first) == 0.0 or float(first.abs()) >= _FILL:
        return 0
    if not bool(((picked - first).abs() <= 1e-5 * first.abs()).all()):
        return 0
    others = x.clone()
    others[torch.arange(x.shape[0]), target] = -math.inf
    others = torch.where(torch.isfinite(others) & (others.abs() < _FILL), others, torch.full_like(others, -math.inf))
    return int(x.shape[0]) if bool((others.amax(1) < picked - 1e-4 * first.abs()).all()) else 0


def _calls_read(t: torch.Tensor, outputs: dict[int, int]) -> frozenset[int]:
    """Which of the model calls (``outputs``: id of an output's autograd node -> call index) the autograd graph
    behind ``t`` starts from."""
    return frozenset(graph_holds(t.grad_fn, outputs))


def _describe(fn: str, args: tuple[Any, ...], kwargs: dict[str, Any], trainable: set[int]) -> LossCall | None:
    inp = args[0] if args else kwargs.get("input", kwargs.get("log_probs"))
    target = args[1] if len(args) > 1 else kwargs.get("target", kwargs.get("targets"))
    if not isinstance(inp, torch.Tensor) or not isinstance(target, torch.Tensor):
        return None
    reduction = kwargs.get("reduction", args[4] if fn == "kl_div" and len(args) > 4 else "mean")
    call = LossCall(fn, tuple(inp.shape), tuple(target.shape), reduction=str(reduction), input_dtype=inp.dtype,
                    autocast=inp.device.type in ("cpu", "cuda") and torch.is_autocast_enabled(inp.device.type),
                    input_grad=fn in _ASYMMETRIC and _trains(inp, trainable),
                    target_grad=fn in _ASYMMETRIC and _trains(target, trainable),
                    log_target=bool(kwargs.get("log_target", args[5] if fn == "kl_div" and len(args) > 5 else False)))
    if inp.numel() == 0 or not inp.is_floating_point():
        return call
    with torch.no_grad():
        x = inp.detach().float()
        call.input_min, call.input_max = float(x.min()), float(x.max())
        if fn == "cross_entropy" and x.dim() >= 1:
            class_dim = 1 if x.dim() >= 2 else 0
            if x.shape[class_dim] >= 2:
                call.rows_sum_to_one = bool((x.sum(class_dim) - 1.0).abs().max() <= 1e-3)
        if fn in _LOG_PROB_INPUT:
            call.class_dim = {"nll_loss": 1 if x.dim() >= 2 else 0, "ctc_loss": x.dim() - 1}.get(fn)
            call.input_values = _values(x, call.class_dim)
        if target.is_floating_point() and target.numel() > 0 and fn in _ASYMMETRIC:
            call.target_values = _values(target.detach().float(), None)
        if fn in _REGRESSION and target.is_floating_point() and 0 < target.numel() <= _MAX_TARGETS:
            call.regression_target = target.detach().cpu().clone()
        bounded = _bounding_activation(inp) if fn in _REGRESSION + _LOGITS else None
        if bounded is not None:
            call.bound = bounded[0]
        if bounded is not None and fn in _REGRESSION and target.is_floating_point() and target.numel() > 0:
            _, lo, hi = bounded
            y = target.detach().float()
            call.outside = float(((y < lo - 1e-3) | (y > hi + 1e-3)).float().mean())
        if fn in ("cross_entropy", "nll_loss") and not target.is_floating_point() and target.numel() > 0:
            ignore = kwargs.get("ignore_index", -100)
            call.all_ignored = bool((target == ignore).all())
            weight = kwargs.get("weight", args[2] if len(args) > 2 else None)
            if (fn == "cross_entropy" and x.dim() == 2 and 3 <= x.shape[1] <= _MAX_CANDIDATES and not call.autocast
                    and inp.dtype in (torch.float32, torch.float64) and target.dim() == 1):
                call.target_ties = _target_ties(x, target.detach(), int(ignore))
                call.anchor_positives = _anchor_positives(x, target.detach(), int(ignore))
            if target.numel() <= _MAX_TARGETS:
                given = weight.detach().float().cpu() if isinstance(weight, torch.Tensor) and weight.dim() == 1 else None
                call.targets = (target.detach().cpu().clone(), int(ignore), given)
            kept = target.detach()[target.detach() != ignore].flatten().cpu()
            if (isinstance(weight, torch.Tensor) and weight.dim() == 1 and kept.numel()
                    and 0 <= int(kept.min()) and int(kept.max()) < weight.shape[0]):
                call.class_counts = (weight.detach().float().cpu(), torch.bincount(kept, minlength=weight.shape[0]))
    return call


def _output_nodes(calls: list[Any]) -> dict[int, int]:
    from guardtower.preflight._step import primary_output

    nodes: dict[int, int] = {}
    for i, call in enumerate(calls):
        out = primary_output(call.output) if call.output is not None else None
        if isinstance(out, torch.Tensor) and out.grad_fn is not None:
            nodes[id(out.grad_fn)] = i
    return nodes


@probe("loss_calls")
@contextlib.contextmanager
def _loss_calls(ctx: AuditContext) -> Iterator[list[LossCall]]:
    calls: list[LossCall] = []
    ctx.probes["loss_calls"] = calls
    trainable = {id(p) for p in ctx.params.values() if p.requires_grad}
    def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            described = None
            try:
                described = _describe(name, args, kwargs, trainable)
                if described is not None:
                    calls.append(described)
                    inp = args[0] if args else None
                    if isinstance(inp, torch.Tensor) and inp.grad_fn is not None and ctx.trace is not None:
                        described.reads_calls = _calls_read(inp, _output_nodes(ctx.trace.calls))
            except Exception:  # observing must never change what the step does
                pass
            result = fn(*args, **kwargs)
            if described is not None and isinstance(result, torch.Tensor) and result.numel() == 1:
                with contextlib.suppress(Exception):
                    described.value = float(result.detach())
            if (described is not None and torch.is_grad_enabled() and isinstance(result, torch.Tensor)
                    and result.is_floating_point() and result.numel() > 0):
                followed = len(calls) <= _MAX_TERMS  # the first calls: every parameter reached, and the node
                described.reaches = reached_params(result, trainable, first=not followed)
                described.node = result.grad_fn if followed else None
                if followed and described.reaches and not _target_trains(args, kwargs, trainable):
                    with contextlib.suppress(Exception):
                        result.register_hook(functools.partial(_note_pull, described, running))
                if not described.reaches:
                    described.dead = float(result.detach().float().mean())
                    dead[id(result)] = (result, described)
            return result

        return wrapper

    # a dead loss result, followed through scalings (0.5 * kd) until it is added to a tensor that trains
    dead: dict[int, tuple[torch.Tensor, LossCall | CutTerm]] = {}
    cut: list[CutTerm] = []
    ctx.probes["cut_terms"] = cut
    record_cut = recorder(cut)

    def cut_reduction(name: str, source: torch.Tensor, result: torch.Tensor) -> None:
        term = record_cut(name, source, result)
        if term is not None:
            dead[id(result)] = (result, term)

    def follow(name: str, op: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(op)
        def method(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            result = op(self, *args, **kwargs)
            if dead:
                try:
                    operands = [self, *args]
                    source = next((dead[id(t)] for t in operands if isinstance(t, torch.Tensor) and id(t) in dead),
                                  None)
                    if source is not None and isinstance(result, torch.Tensor):
                        # a hand-written term is added to the loss's own top-level sum (a scalar), not
                        # subtracted as a baseline inside it (a relativistic GAN's mean over the other side)
                        if (name in _SUMS and (isinstance(source[1], LossCall) or result.dim() == 0)
                                and any(isinstance(t, torch.Tensor) and _trains(t, trainable) for t in operands)):
                            source[1].dead_added = True
                        elif name in _SCALINGS and not _trains(result, trainable):
                            dead[id(result)] = (result, source[1])
                except Exception:  # observing must never change what the step does
                    pass
            return result

        return method

    running = [True]  # while step_fn runs: what its own backward passes bring to the loss results counts
    # each backward of step_fn: which loss results its graph holds (the steps run so far: StepTrace.backward_steps)
    def feeding(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                tensors = args[0] if args else kwargs.get("tensors")
                roots = [t.grad_fn for t in ([tensors] if isinstance(tensors, torch.Tensor) else tensors or ())
                         if isinstance(t, torch.Tensor)]
                if ctx.trace is not None and len(ctx.trace.backward_steps) < _MAX_TERMS:
                    wanted = {id(c.node): c for c in calls if c.node is not None}
                    for root in roots:
                        for call in graph_holds(root, wanted):
                            call.backwards.append(len(ctx.trace.held_at_step))
            except Exception:  # observing must never change what the step does
                pass
            return original(*args, **kwargs)

        return wrapper

    patches: list[tuple[Any, str, Callable[[Any], Any]]] = [
        (F, name, functools.partial(wrap, name)) for name in _CLASSIFICATION + _REGRESSION + _DIVERGENCE + _OTHER]
    patches += [(torch.Tensor, name, functools.partial(follow, name)) for name in _SCALINGS + _SUMS]
    patches += reduction_patches(cut_reduction)
    patches.append((torch.autograd, "backward", feeding))
    try:
        with patched(patches):
            yield calls
    finally:
        dead.clear()
        running[0] = False
        for call in calls:
            call.node = None  # the graph is the step's; the audit keeps no part of it


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
    if trainable and not trace.loss_requires_grad and not trace.backward and not trace.backward_calls:
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
    if trace.user_backward and (out is None or isinstance(out, (int, float)) and not isinstance(out, bool)):
        # ``return loss.item()``, or no return at all: the step worked, and its own backward gave the audit the
        # gradients
        if out is not None and not math.isfinite(out):
            return [Finding("loss", Severity.ERROR, f"the loss step_fn returned is {out}: the step's gradients are "
                            "not finite either", "LOSS-003", {"value": str(out)})]
        return [Finding(
            "loss", Severity.INFO,
            f"step_fn returned {'nothing' if out is None else 'a ' + type(out).__name__}, not the loss tensor: it ran "
            "backward itself, so the audit "
            "judged its gradients; the checks of the loss tensor itself (detached, not a scalar: LOSS-001/002) "
            "did not run (return the loss tensor to run them)", "LOSS-007", {"returned": type(out).__name__})]
    has_loss_attr = hasattr(out, "loss") or (isinstance(out, dict) and "loss" in out)
    hint = ("its .loss is None (Hugging Face models compute a loss only when labels are passed)"
            if has_loss_attr else f"it returned {type(out).__name__}")
    return [Finding("loss", Severity.ERROR, f"step_fn returned no loss tensor: {hint}", "LOSS-007",
                    {"returned": type(out).__name__})]


@check("loss_inputs", emits=("LOSS-004", "LOSS-005", "LOSS-008", "LOSS-010", "LOSS-011", "LOSS-012", "LOSS-013",
                             "LOSS-014", "LOSS-015", "LOSS-020", "AMP-005"))
def check_loss_inputs(ctx: AuditContext) -> Iterable[Finding]:
    """Each loss call against what its function expects to receive: LOSS-004 probabilities fed to a logits loss,
    LOSS-005 broadcasting targets, LOSS-008 NLL on logits, LOSS-010 a KL divergence averaged over its classes too,
    LOSS-011 log-probabilities that are not (or over the wrong dim), LOSS-012 targets outside the loss's domain,
    LOSS-013 the gradient reaching the target, not the input, LOSS-014 logits that cannot go negative, LOSS-015 a
    prediction whose activation cannot reach the targets, AMP-005 a softmax-family loss computed in 16 bits."""
    calls: list[LossCall] = ctx.probes.get("loss_calls", [])
    findings = []
    doubled = _double_activation(ctx)
    if doubled is not None:
        outer, inner = doubled
        findings.append(Finding(
            "loss_inputs", Severity.ERROR,
            f"the loss applies {outer} to what a {inner} just produced (a double activation, in a hand-written loss "
            f"or after a head that already ends in {inner}): the prediction is squashed twice ({outer} of values in "
            "[0, 1] spans [0.5, 0.73] for a sigmoid, a near-uniform distribution for a softmax), so it cannot reach "
            "its targets and its gradient shrinks; apply the activation once",
            "LOSS-004", {"outer": outer, "inner": inner},
        ))
    masked = ctx.trace.masked_reduction if ctx.trace is not None else None
    if masked is not None:
        call, zeros, elements = masked
        findings.append(Finding(
            "loss_inputs", Severity.WARN,
            f"{call.fn} (input {list(call.input_shape)}) reduces its loss to one number (reduction="
            f"{call.reduction!r}), which the step then multiplies by a weight tensor of {elements} entries, {zeros} "
            "of them zero: a mask applied after the reduction scales a scalar and drops nothing, so the elements it "
            f"should drop (padding, unsupervised slots) still carry loss; pass reduction='none' to {call.fn} and "
            "mask the per-element loss",
            "LOSS-020", {"fn": call.fn, "reduction": call.reduction, "zeros": zeros, "elements": elements},
        ))
    for call in calls:
        findings += _contract(call)
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
        elif call.fn == "binary_cross_entropy_with_logits" and in_unit and (
                call.bound in ("sigmoid", "softmax") or _numel(call.input_shape) >= _UNIT_LOGITS):
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


def _contract(call: LossCall) -> list[Finding]:
    """LOSS-011..014 and AMP-005 for one call: its arguments against the function's documented domain."""
    findings = []
    shape = list(call.input_shape)
    inp, tgt = call.input_values, call.target_values
    if call.fn in _LOG_PROB_INPUT and inp is not None and inp.max == inp.max:
        problem = _not_log_probs(call, inp)
        if problem:
            findings.append(Finding(
                "loss_inputs", Severity.WARN, f"{call.fn} received {problem}", "LOSS-011",
                {"fn": call.fn, "input_shape": shape, "min": inp.min, "max": inp.max,
                 "normalised_dims": list(inp.log_dims), "class_dim": call.class_dim},
            ))
    if tgt is not None and tgt.max == tgt.max:
        problem = _target_outside(call, tgt)
        if problem:
            findings.append(Finding(
                "loss_inputs", Severity.WARN, f"{call.fn}'s target {problem}", "LOSS-012",
                {"fn": call.fn, "target_shape": list(call.target_shape), "min": tgt.min, "max": tgt.max},
            ))
    if call.fn in _ASYMMETRIC and call.target_grad and not call.input_grad:
        findings.append(Finding(
            "loss_inputs", Severity.WARN,
            f"{call.fn}'s target carries the gradient and its input does not: the arguments look swapped "
            f"({call.fn}(input=prediction, target=reference)), so the loss optimises another divergence than "
            "intended (for kl_div: KL(prediction || reference) instead of KL(reference || prediction)); pass the "
            "trained model's output first",
            "LOSS-013", {"fn": call.fn, "input_shape": shape},
        ))
    if (call.fn in _LOGITS and call.bound and call.input_min is not None and call.input_min >= 0.0
            and not call.rows_sum_to_one
            and not (call.fn == "binary_cross_entropy_with_logits" and (call.input_max or 0.0) <= 1.0)):
        floor = "0.5" if call.fn != "cross_entropy" else "uniform"
        findings.append(Finding(
            "loss_inputs", Severity.WARN,
            f"{call.fn} received the output of a {call.bound} (min {call.input_min:.3g}, shape {tuple(shape)}): an "
            f"activation before a loss that applies its own "
            f"{'softmax' if call.fn == 'cross_entropy' else 'sigmoid'} bounds what it can express (no prediction "
            f"below {floor}); feed the raw output of the last linear layer",
            "LOSS-014", {"fn": call.fn, "input_shape": shape, "min": call.input_min},
        ))
    if call.fn in _REGRESSION and call.bound and call.outside >= 0.05:
        findings.append(Finding(
            "loss_inputs", Severity.WARN,
            f"{call.fn}'s prediction comes straight from a {call.bound}, yet {call.outside:.0%} of its targets lie "
            f"outside the range a {call.bound} can output: those targets can never be fitted, and the gradient "
            f"pins the {call.bound} at its bound; drop the final activation or scale the targets into its range",
            "LOSS-015", {"fn": call.fn, "activation": call.bound, "outside": call.outside},
        ))
    if call.fn in _SOFTMAX_FAMILY and call.input_dtype in _HALF and not call.autocast:
        findings.append(Finding(
            "loss_inputs", Severity.WARN,
            f"{call.fn} runs on {str(call.input_dtype).replace('torch.', '')} input of shape {tuple(shape)} outside "
            "autocast: its log-softmax and the gradient it sends back are rounded to 8 (bf16) or 11 (fp16) bits, "
            "so small probability differences vanish; upcast the logits (.float()) before the loss",
            "AMP-005", {"fn": call.fn, "dtype": str(call.input_dtype), "input_shape": shape},
        ))
    return findings


def _not_log_probs(call: LossCall, values: Values) -> str:
    """Why a log-probability input is not one ("" when it is)."""
    dim = call.class_dim
    if call.fn == "kl_div":
        if values.max > 1e-4:
            return (f"input values up to {values.max:.3g}: its input must be log-probabilities (<= 0), e.g. "
                    "log_softmax of the prediction; probabilities or logits here make the loss another quantity")
        return ""
    if call.fn == "nll_loss" and values.max > 0.0:
        return ""  # LOSS-008
    if dim is None or dim in values.log_dims:
        return ""
    if values.log_dims:
        other = values.log_dims[0]
        return (f"input normalised over dim {other} (size {call.input_shape[other]}), not over its class dim {dim} "
                f"(size {call.input_shape[dim]}): log_softmax ran over the wrong dimension, so the loss compares "
                f"across {'the batch' if other == 0 else 'another axis'} instead of across classes; use "
                f"log_softmax(dim={dim if call.fn == 'nll_loss' else -1})")
    if values.max > 1e-4:
        return (f"values up to {values.max:.3g} (shape {call.input_shape}): it expects log-probabilities over dim "
                f"{dim}; raw logits make the loss shift-dependent and not a likelihood; apply log_softmax(dim={dim}) "
                "first")
    lse = values.lse_range
    if lse is not None and max(abs(lse[0]), abs(lse[1])) > 0.7:
        return (f"values whose exp sums to {math.exp(lse[0]):.3g}..{math.exp(lse[1]):.3g} over the class dim {dim}, "
                "not 1: they are not log-probabilities (log of sigmoid, or of unnormalised scores); apply "
                f"log_softmax(dim={dim})")
    return ""


def _target_outside(call: LossCall, values: Values) -> str:
    """Why a floating target is outside the function's domain ("" when it is not)."""
    if call.fn in ("binary_cross_entropy", "binary_cross_entropy_with_logits"):
        if values.min < 0.0 or values.max > 1.0:
            return (f"ranges over [{values.min:.3g}, {values.max:.3g}]: binary cross entropy expects targets in "
                    "[0, 1]; -1/+1 labels or class ids make the loss reward the wrong predictions (map the labels "
                    "to 0/1, or use cross_entropy for class ids)")
        return ""
    if call.fn == "kl_div":
        if not call.log_target and values.min < -1e-6:
            return (f"holds negative values (min {values.min:.3g}): with log_target=False the target must be "
                    "probabilities; these look like log-probabilities (pass log_target=True), or the arguments are "
                    "swapped")
        if call.log_target and values.max > 1e-4:
            return (f"holds positive values (max {values.max:.3g}) with log_target=True: it must be "
                    "log-probabilities; pass log_target=False for probabilities")
        return ""
    if call.fn == "cross_entropy" and len(call.target_shape) >= 2 and call.target_shape == call.input_shape:
        if values.min < 0.0 or 1 not in values.prob_dims:
            return (f"is a soft target (shape {call.target_shape}, values [{values.min:.3g}, {values.max:.3g}]) that "
                    "is not a distribution over the classes (dim 1): cross_entropy then weighs samples by their "
                    "target mass; normalise it (softmax, or divide by its sum)")
    return ""


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _eos_ids(model: Any) -> set[int]:
    eos = getattr(getattr(model, "config", None), "eos_token_id", None)
    eos = eos if isinstance(eos, (list, tuple)) else [eos]
    return {int(e) for e in eos if isinstance(e, int)}


def _is_seq2seq_lm(model: Any) -> bool:
    """A Hugging Face encoder-decoder whose ``labels`` are vocabulary ids (T5, Bart ``ForConditionalGeneration``)."""
    return bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False)) and (
        type(model).__name__.endswith(("ForConditionalGeneration", "Seq2SeqLM")))


def _stop_never_supervised(ctx: AuditContext, labels: Any, mask: Any, ids: Any) -> list[Finding]:
    """DATA-010: the batch holds whole, padded examples that a tokenizer marked with BOS, yet no label is the
    end-of-sequence id (Llama's tokenizer adds BOS but no EOS; a template that drops it): the model is never taught
    to stop and generates until max_length. A causal LM's real EOS in ``ids`` that the labels mask is DATA-003's
    finding, not this one."""
    eos = _eos_ids(ctx.model)
    if not (eos and isinstance(labels, torch.Tensor) and labels.dim() == 2 and not labels.is_floating_point()
            and (is_causal_lm(ctx.model) or _is_seq2seq_lm(ctx.model))):
        return []
    padded = bool((labels[:, -1] == -100).any()) and bool((labels != -100).any())
    if isinstance(mask, torch.Tensor) and mask.shape == labels.shape:
        padded = padded or bool((mask == 0).any())
    stops = torch.tensor(sorted(eos), device=labels.device)
    if not padded or bool(torch.isin(labels, stops).any()):
        return []
    rows = ids if isinstance(ids, torch.Tensor) and ids.shape == labels.shape else labels
    attended = mask != 0 if isinstance(mask, torch.Tensor) and mask.shape == rows.shape else rows != -100
    if isinstance(ids, torch.Tensor) and ids.shape == labels.shape and bool((torch.isin(ids, stops) & attended).any()):
        return []
    # whole examples from a tokenizer that marks their start: every row's first real token is BOS
    bos = getattr(getattr(ctx.model, "config", None), "bos_token_id", None)
    if not isinstance(bos, int) or bos in eos or not bool(attended.any(dim=1).all()):
        return []
    first = rows.gather(1, attended.int().argmax(dim=1, keepdim=True)).squeeze(1)
    if not bool((first == bos).all()):
        return []
    return [Finding(
        "data", Severity.WARN,
        f"the batch holds whole examples (each starts with BOS, padded to a common length) but no label is the "
        f"end-of-sequence id "
        f"{sorted(eos)}: the model is never taught to stop and will generate until max_length; make the "
        "tokenizer or template append EOS (e.g. add_eos_token=True, or text + tokenizer.eos_token)",
        "DATA-010", {"eos_token_ids": sorted(eos), "rows": int(labels.shape[0])},
    )]


def _decoder_start_missing(ctx: AuditContext, decoder_ids: Any) -> list[Finding]:
    """DATA-013: decoder inputs built by the user for an encoder-decoder LM, none of whose rows starts with
    ``config.decoder_start_token_id`` (the token ``generate()`` starts from)."""
    start = getattr(getattr(ctx.model, "config", None), "decoder_start_token_id", None)
    if not (_is_seq2seq_lm(ctx.model) and isinstance(start, int) and isinstance(decoder_ids, torch.Tensor)
            and decoder_ids.dim() == 2 and decoder_ids.shape[0] >= 2 and not decoder_ids.is_floating_point()):
        return []
    first = decoder_ids[:, 0]
    if bool((first == start).any()):
        return []
    return [Finding(
        "data", Severity.WARN,
        f"no row of decoder_input_ids starts with decoder_start_token_id={start} (they start with "
        f"{sorted({int(t) for t in first.unique()[:5]})}): generate() starts every output from {start}, so the "
        "decoder is trained from another start than it meets at inference, and the first target token is never a "
        "label (targets sliced as y[:, :-1] / y[:, 1:]); pass the full targets as labels and let the model shift "
        "them",
        "DATA-013", {"decoder_start_token_id": start, "first_tokens": sorted({int(t) for t in first.unique()[:5]})},
    )]


def _prompt_masked_by_column(labels: Any, mask: Any) -> list[Finding]:
    """DATA-016: on a left-padded batch, the labels of every row whose padding is shorter than some column c are
    masked up to exactly c, and a row padded past c has its first real token supervised: the prompt was masked
    by tensor column (``labels[:, :prompt_len] = -100``), which on left-padded rows covers padding instead of the
    prompt."""
    if not (isinstance(labels, torch.Tensor) and isinstance(mask, torch.Tensor) and labels.dim() == 2
            and labels.shape == mask.shape and labels.shape[0] >= 2 and not labels.is_floating_point()):
        return []
    real = mask != 0
    if not bool(real.any(1).all()) or bool((~real[:, -1]).any()):
        return []  # right padding, or an empty row: not this layout
    pad = (~real).int().argmin(1)  # left padding per row: the first real column
    supervised = labels != -100
    if not bool(supervised.any(1).all()):
        return []
    first = supervised.int().argmax(1)
    whole = first == pad  # rows whose first real token is a label: nothing of theirs was masked
    if not bool(whole.any()) or bool(whole.all()) or int(pad.unique().numel()) < 2:
        return []
    column = int(first[~whole].min())
    masked = ~whole
    same = bool((first[masked] == column).all()) and bool((pad[masked] < column).all())
    if not same or not bool((pad[whole] >= column).all()):
        return []
    rows = [int(r) for r in torch.nonzero(whole).flatten()]
    return [Finding(
        "data", Severity.WARN,
        f"the batch is left-padded, and every row's labels are masked up to column {column} exactly, whatever its "
        f"padding, while row(s) {rows[:8]}, padded past that column, have all their real tokens supervised: the "
        "prompt was masked by tensor column (labels[:, :prompt_len] = -100), which on left-padded rows covers "
        "padding and leaves the prompt in the loss; mask by position among each row's real tokens",
        "DATA-016", {"column": column, "rows": rows[:50], "padding": [int(p) for p in pad.tolist()][:50]},
    )]


def _unsupervised_rows(ctx: AuditContext, labels: Any, mask: Any) -> list[Finding]:
    """DATA-011: in a language-model batch, some examples have no label at all while the others do (truncation
    cut their completion, or the prompt mask covered the whole row): they cost compute and teach nothing."""
    if not (isinstance(labels, torch.Tensor) and labels.dim() == 2 and not labels.is_floating_point()
            and labels.shape[0] >= 2 and (is_causal_lm(ctx.model) or _is_seq2seq_lm(ctx.model))):
        return []
    empty = (labels == -100).all(dim=1)
    if isinstance(mask, torch.Tensor) and mask.shape == labels.shape:
        empty &= (mask != 0).any(dim=1)  # a row of pure padding (an even-batch filler) is not an example
    rows = [int(i) for i in torch.nonzero(empty).flatten()]
    if not rows or len(rows) == labels.shape[0]:
        return []  # no row at all is DATA-001
    return [Finding(
        "data", Severity.WARN,
        f"{len(rows)} of {labels.shape[0]} examples in the batch (rows {rows[:8]}) have no supervised token (every "
        "label is -100) while the others do: truncation cut their completion (the prompt fills max_length) or "
        "the completion mask covers the whole row, so they teach nothing; raise max_length, truncate the "
        "prompt instead, or drop such examples",
        "DATA-011", {"rows": rows[:50], "batch": int(labels.shape[0])},
    )]


def _model_shifts(ctx: AuditContext, labels: torch.Tensor) -> bool | None:
    """Whether the model's loss pulls position t towards ``labels[t+1]`` (it shifts the labels itself), as the
    real backward measured it (``_supervision``); None when no measurement lines up with the labels. A model
    named ``*ForCausalLM`` need not shift (``MBartForCausalLM`` scores position t against ``labels[t]``)."""
    trace = ctx.trace
    rec = next((r for r in (trace.supervision if trace is not None else []) if r.call == 0 and r.target is not None
                and tuple(r.target.shape) == tuple(labels.shape)), None)
    if rec is None or rec.target is None:
        return None
    target, lab = rec.target[:, :-1], labels.detach().cpu()
    pulled = (rec.magnitude[:, :-1] > 0) & (target >= 0)
    n = int(pulled.sum())
    if n < 4:
        return None
    return int(((target == lab[:, 1:]) & pulled).sum()) >= 0.9 * n


def _causal_lm_labels(ctx: AuditContext) -> list[Finding]:
    """DATA-003 every real EOS masked to -100 (pad_token = eos_token), DATA-004 labels already shifted by the
    user and shifted again inside the model, DATA-010 no label is EOS, DATA-013 (encoder-decoders) decoder inputs
    that never start from the decoder start token."""
    batch = batch_mapping(ctx.inputs, ctx.trace.calls if ctx.trace is not None else [])
    if batch is None:
        return []
    ids, labels, mask = batch.get("input_ids"), batch.get("labels"), batch.get("attention_mask")
    causal = is_causal_lm(ctx.model)
    label_mask = mask if causal else batch.get("decoder_attention_mask")
    findings = _stop_never_supervised(ctx, labels, label_mask, ids if causal else None)
    findings += _unsupervised_rows(ctx, labels, label_mask)
    findings += _prompt_masked_by_column(labels, label_mask) if causal else []
    if not causal:
        return findings + _decoder_start_missing(ctx, batch.get("decoder_input_ids"))
    if not (isinstance(ids, torch.Tensor) and isinstance(labels, torch.Tensor) and ids.shape == labels.shape
            and ids.dim() == 2 and not labels.is_floating_point()):
        return findings
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
    if n >= 4 and ids.shape[1] >= 3 and _model_shifts(ctx, labels) is not False:
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


@check("loss_terms", emits=("LOSS-016",), needs=("cut_terms",))
def check_loss_terms(ctx: AuditContext) -> Iterable[Finding]:
    """LOSS-016: a loss function's result reaches no trainable parameter, yet it (or a scaling of it) is added to
    the loss that trains: that term (a distillation target compared with itself, an adversarial term on a detached
    fake judged by a frozen discriminator) changes the loss value and trains nothing. A dead result that is only
    logged, or a zero the total starts from, is not added that way. Also a hand-written term (a full mean or sum
    without gradient) added to the loss whose value moves with the trained weights: computed from the model's
    outputs through ``.numpy()``, ``.item()`` or ``.detach()``."""
    trace = ctx.trace
    calls: list[LossCall] = ctx.probes.get("loss_calls", [])
    added = [call for call in calls if call.dead_added]
    if trace is None or trace.error is not None or not trace.loss_requires_grad:
        return []
    if not added:
        moving = [t for t in ctx.probes.get("cut_terms", []) if t.dead_added and t.moves]
        if not moving:
            return []
        term = moving[0]
        return [Finding(
            "loss_terms", Severity.WARN,
            f"a term added to the trained loss ({term.fn} over {list(term.input_shape)}, value {term.dead:.4g}) has no "
            "gradient, yet its value changes with the trained weights: it is computed from the model's outputs "
            "through a cut (.numpy(), .item(), torch.tensor(...), .data, .detach(), or a derivative taken with "
            "torch.autograd.grad without create_graph=True), so it changes the loss and trains nothing; compute it "
            "from the outputs themselves (index them with a tensor, not through numpy; create_graph=True for a "
            "derivative the loss trains)",
            "LOSS-016", {"fn": term.fn, "value": term.dead, "cut_terms": len(moving), "input_shape": list(term.input_shape)},
        )]
    first = added[0]
    return [Finding(
        "loss_terms", Severity.WARN,
        f"{first.fn} (input {list(first.input_shape)}, value {first.dead:.4g}) was computed with gradients on, yet "
        f"its result has no gradient: nothing it compares trains (both sides detached, computed under no_grad, or "
        f"by frozen modules only), and it is added to the trained loss, where it trains "
        "nothing; compute the side that should learn from the trained model (e.g. the student's logits, the "
        "generator's fake without .detach()), or drop the term",
        "LOSS-016", {"fn": first.fn, "value": first.dead, "dead_terms": [c.fn for c in added][:8]},
    )]


def _note_pull(call: LossCall, running: list[bool], grad: torch.Tensor | None) -> None:
    """Backward hook on a loss result: keep whether the loss ``step_fn`` backpropagated decreases as the term grows,
    and which of a per-element loss's targets it pulls on (the audit's own later passes, which may run through the
    result, are not the step's)."""
    try:
        if running[0] and isinstance(grad, torch.Tensor):
            g = grad.detach()
            if not call.ascended:
                call.ascended = bool((g <= 0).all()) and bool((g < 0).any())
            if call.pulled is None and call.targets is not None and g.shape == call.targets[0].shape:
                call.pulled = (g != 0).cpu()
    except Exception:  # observing must never change what the step does
        pass


def _target_trains(args: tuple[Any, ...], kwargs: dict[str, Any], trainable: set[int]) -> bool:
    """The loss compares two tensors that both carry gradient (a distance pushing a negative away, an entropy
    written as cross_entropy(x, p)): subtracting it is a design, not a maximised loss."""
    target = args[1] if len(args) > 1 else kwargs.get("target")
    return isinstance(target, torch.Tensor) and _trains(target, trainable)


def _held_by_steps_after(trace: StepTrace, before: int) -> set[int]:
    """The tensors held by the optimizer steps a backward that began after ``before`` steps feeds: those that run
    before the next backward that follows a step (several micro-batches' backwards feed one step)."""
    later = [b for b in trace.backward_steps if b > before]
    end = min(later) if later else len(trace.held_at_step)
    return set().union(*trace.held_at_step[before:end])


@check("stepped_terms", emits=("LOSS-017",))
def check_stepped_terms(ctx: AuditContext) -> Iterable[Finding]:
    """LOSS-017: a loss function's result is part of the loss ``step_fn`` backpropagates, and its gradient reaches
    trainable parameters, but none that the optimizer steps after that backward hold: the term trains nothing the
    update moves (a generator's adversarial term that scores the real sample, so only the discriminator, which
    this step does not update, gets its gradient)."""
    trace = ctx.trace
    calls: list[LossCall] = ctx.probes.get("loss_calls", [])
    if trace is None or trace.error is not None or not trace.held_at_step:
        return []
    names = {id(p): n for n, p in ctx.params.items()}
    for call in calls:
        if not call.reaches or not call.backwards:
            continue
        held = [_held_by_steps_after(trace, b) for b in call.backwards]
        if not all(h and not (call.reaches & h) for h in held):
            continue
        reached = sorted(names[i] for i in call.reaches if i in names)
        return [Finding(
            "stepped_terms", Severity.WARN,
            f"{call.fn} (input {list(call.input_shape)}) is part of the loss step_fn backpropagates, and its "
            f"gradient reaches {len(reached)} trainable tensor(s) ({', '.join(reached[:3])}), none of which the "
            "optimizer step after that backward updates: the term trains nothing this update moves (a generator's "
            "adversarial term scoring the real sample instead of the generated one; an actor loss on the replay "
            "buffer's actions instead of the actor's); compute it from the output of the part this step trains",
            "LOSS-017", {"fn": call.fn, "reaches": reached[:8]},
        )]
    return []


@check("maximised_terms", emits=("LOSS-019",))
def check_maximised_terms(ctx: AuditContext) -> Iterable[Finding]:
    """LOSS-019: a loss function's result enters the loss that is backpropagated with a negative sign (the
    gradient arriving at it is nowhere positive), and the update that follows moves what it reaches: the step
    maximises that loss. INFO: an adversarial term (a domain or attention adversary, unlearning) does it on
    purpose, and the step cannot tell that from a penalty subtracted by mistake."""
    trace = ctx.trace
    calls: list[LossCall] = ctx.probes.get("loss_calls", [])
    if trace is None or trace.error is not None:
        return []
    names = {id(p): n for n, p in ctx.params.items()}
    for call in calls:
        if not call.ascended:
            continue
        if trace.user_backward and not any(call.reaches & _held_by_steps_after(trace, b) for b in call.backwards):
            continue  # its gradient is cleared or lands on a tensor no step moves (an attack on the input)
        reached = sorted(names[i] for i in call.reaches if i in names)
        return [Finding(
            "maximised_terms", Severity.INFO,
            f"{call.fn} (input {list(call.input_shape)}) enters the backpropagated loss with a negative sign: the "
            f"gradient arriving at it is nowhere positive, so the update that follows increases it, on "
            f"{len(reached)} trainable tensor(s) ({', '.join(reached[:3])}). A divergence or penalty subtracted "
            "instead of added (loss - beta * kl) is maximised; add it, or negate the reward rather than the loss "
            "(INFO: adversarial objectives, unlearning and minimax generators maximise a loss on purpose)",
            "LOSS-019", {"fn": call.fn, "reaches": reached[:8]},
        )]
    return []


#: rows whose target ties another candidate, at least this many and this share of the rows judged
_MIN_TIED_ROWS = 2
_TIED_SHARE = 0.02


@check("candidates", emits=("DATA-014", "DATA-020"))
def check_candidates(ctx: AuditContext) -> Iterable[Finding]:
    """DATA-014: a ``cross_entropy`` over candidates (in-batch negatives, scores of a contrastive batch) whose
    target's logit equals another candidate's in some rows: the same item is both the positive and a negative, so
    the loss pushes it away from itself and cannot fall below log 2 there. DATA-020: every row's positive is the
    anchor scored against itself."""
    for call in ctx.probes.get("loss_calls", []):
        if call.anchor_positives:
            return [Finding(
                "candidates", Severity.WARN,
                f"in all {call.anchor_positives} rows of {call.fn} (input {list(call.input_shape)}) the target's "
                "logit is one and the same value, above every other candidate: each positive is the anchor scored "
                "against itself (both views sliced from the same half of the batch, a key computed from the query's "
                "own view), so the positive term is constant and the loss only pushes the anchors apart; take the "
                "positive from the other view",
                "DATA-020", {"rows": call.anchor_positives, "fn": call.fn},
            )]
        if call.target_ties is None:
            continue
        tied, judged = call.target_ties
        if tied >= _MIN_TIED_ROWS and tied >= _TIED_SHARE * judged:
            return [Finding(
                "candidates", Severity.WARN,
                f"in {tied} of the {judged} rows of {call.fn} (input {list(call.input_shape)}) the target's logit "
                "equals another candidate's: the same item (a duplicate passage, the positive resampled as a hard "
                "negative, one sample twice in the batch) is both the positive and a negative, so the loss pushes "
                "it away from itself; drop duplicates from the batch, or mask a candidate equal to the positive",
                "DATA-014", {"rows": tied, "judged": judged, "fn": call.fn},
            )]
    return []


#: a target copied from the input needs at least this many samples, and this share of them distinct, to be judged
_MIN_SERIES = 8
_DISTINCT_SHARE = 0.5


def _input_step_equal_to(inputs: torch.Tensor, target: torch.Tensor) -> int | None:
    """The index t along ``inputs``' second axis (time, a window's positions) with ``inputs[:, t] == target`` for
    every sample, or None. ``target`` is (N, ...) with one axis fewer; a trailing axis of 1 may be on either."""
    if target.dim() == inputs.dim() and target.shape[-1] == 1:
        target = target.squeeze(-1)
    if inputs.dim() == target.dim() + 2 and inputs.shape[-1] == 1:
        inputs = inputs.squeeze(-1)
    if (inputs.dim() != target.dim() + 1 or inputs.dim() < 2 or inputs.shape[0] != target.shape[0]
            or tuple(inputs.shape[2:]) != tuple(target.shape[1:]) or inputs.shape[1] < 2):
        return None
    hits = (inputs == target.unsqueeze(1)).reshape(inputs.shape[0], inputs.shape[1], -1).all(-1).all(0)
    return int(hits.int().argmax()) if bool(hits.any()) else None


@check("target_in_input", emits=("DATA-017",))
def check_target_in_input(ctx: AuditContext) -> Iterable[Finding]:
    """DATA-017: a regression loss whose target, for every sample, is exactly one step of the model's own input
    (a window's value at one fixed position): the model can copy it (a forecasting label shifted the wrong way,
    a target column left among the features)."""
    trace = ctx.trace
    if trace is None or not trace.calls:
        return []
    call = trace.training_call()
    inputs = [(k, t) for k, t in top_level(call) if t.is_floating_point()]
    for loss in ctx.probes.get("loss_calls", []):
        target = loss.regression_target
        if target is None or target.shape[0] < _MIN_SERIES or target.unique().numel() < _DISTINCT_SHARE * target.numel():
            continue
        for key, tensor in inputs:
            step = _input_step_equal_to(tensor.detach().cpu(), target)
            if step is not None:
                return [Finding(
                    "target_in_input", Severity.WARN,
                    f"the target of {loss.fn} equals the model's input {key} at position {step} of its second axis, "
                    f"for all {target.shape[0]} samples: the answer is already among the features, so the model "
                    "learns to copy it (a forecasting label shifted the wrong way, shift(1) for shift(-1); the "
                    "target column left in the window); build the target from values the input does not hold",
                    "DATA-017", {"fn": loss.fn, "input": key, "position": step, "samples": int(target.shape[0])},
                )]
    return []


@check("ignored_class", emits=("DATA-015",))
def check_ignored_class(ctx: AuditContext) -> Iterable[Finding]:
    """DATA-015: a per-sample ``cross_entropy``/``nll_loss`` (one target per sample of the model's batch) whose
    ``ignore_index`` is one of its own classes, and samples of that class are in the batch: they are dropped from
    the loss, so the head never learns that class (one criterion with ``ignore_index=0`` shared by a token head,
    where 0 marks padding, and a sample head, where 0 is a class)."""
    trace = ctx.trace
    if trace is None or not trace.calls:
        return []
    call = trace.training_call()
    first = next((t for t in (*call.args, *call.kwargs.values()) if isinstance(t, torch.Tensor) and t.dim() >= 1),
                 None)
    vocab = getattr(getattr(ctx.model, "config", None), "vocab_size", None)
    for loss in ctx.probes.get("loss_calls", []):
        if loss.targets is None or first is None or len(loss.input_shape) != 2 or loss.input_shape[0] != first.shape[0]:
            continue
        targets, ignore, _ = loss.targets
        classes = loss.input_shape[1]
        dropped = int((targets == ignore).sum()) if targets.dim() == 1 else 0
        if 0 <= ignore < classes and classes != vocab and dropped:
            return [Finding(
                "ignored_class", Severity.WARN,
                f"{loss.fn} over {classes} classes has ignore_index={ignore}, which is one of its classes, and "
                f"{dropped} of the {targets.numel()} samples of the batch have that class: they are dropped from "
                f"the loss, so the head never learns class {ignore} (a criterion shared with a token head, where "
                f"{ignore} marks padding); give this head its own loss without ignore_index",
                "DATA-015", {"fn": loss.fn, "ignore_index": ignore, "classes": classes, "dropped": dropped},
            )]
    return []


@check("data", emits=("DATA-001", "DATA-002", "DATA-003", "DATA-004", "DATA-010", "DATA-011", "DATA-013",
                      "DATA-016"),
       needs=("padded_labels",))
def check_data(ctx: AuditContext) -> Iterable[Finding]:
    """DATA-001 no supervised position in the batch, DATA-002 padding positions that carry labels,
    DATA-003/DATA-004 causal-LM labels that mask every EOS or are shifted twice, DATA-010 EOS never a label,
    DATA-011 examples with no label among labelled ones, DATA-013 decoder inputs that never start from the
    decoder start token, DATA-016 a prompt mask applied by column to left-padded rows."""
    findings = _causal_lm_labels(ctx)
    # measured from the gradient where the batch's labels say nothing: each id once
    for cid, measure in (("DATA-003", stops_unsupervised), ("DATA-004", skips_a_token)):
        measured = None if any(f.catalog_id == cid for f in findings) else measure(ctx)
        findings += [measured] if measured is not None else []
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
