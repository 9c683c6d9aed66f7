"""What the instrumented step observed, as typed fields checks read (``StepTrace``), and what a check may ask
the runner to measure beyond the plain step (``Need``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch

__all__ = ["Need", "NEEDS", "RootCall", "Moved", "UpdateStats", "LeakEntry", "FutureLeak", "PaddingRead", "Supervision", "StepTrace"]

#: extra work a check can declare: ``leak`` one more backward from the first and last samples' predictions
#: (batch mixing; an eval-mode pass of the model when step_fn runs backward itself),
#: ``update`` a trial optimizer step on the audit's gradients (undone), ``input_independence`` a second,
#: gradient-free run of ``step_fn`` on perturbed inputs when no gradient reached the input,
#: ``padded_labels`` a gradient-free run with the labels on padding changed, when padding carries labels
#: (does the loss drop padding itself?), ``overfit`` N optimizer steps on the one batch (``audit(steps=N)``),
#: ``future`` one eval-mode pass of the model for a next-token setup (does a prediction see later tokens?),
#: ``eval_mode`` one eval-mode pass of a model that is not a library one (does dropout still drop?),
#: ``padding`` three gradient-free eval-mode passes of one padded row (does its prediction read its padding?),
#: ``packing`` two gradient-free eval-mode passes of a packed batch (do its packed examples see each other?),
#: ``second_step`` a real update and one more step when gradients are exactly zero (do they flow afterwards?),
#: ``value_reads`` one run per gradient-less module or parameter of the user's with its values changed (does the
#: loss read them?), ``self_updates`` one run with the values of gradient-less parameters that ran only under
#: no_grad changed (does the step move them itself?), ``cut_terms`` one run with the trained weights changed when a
#: term without gradient is added to the loss (does its value move with the weights?)
Need = Literal["leak", "update", "input_independence", "padded_labels", "overfit", "future", "eval_mode", "padding",
               "second_step", "value_reads", "packing", "self_updates", "cut_terms"]
NEEDS: frozenset[str] = frozenset({"leak", "update", "input_independence", "padded_labels", "overfit", "future",
                                    "eval_mode", "padding", "second_step", "value_reads",
                                    "packing", "self_updates", "cut_terms"})


@dataclass
class RootCall:
    """One call of the audited model's own ``forward`` during the step."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    training: dict[str, bool]
    """``training`` of the root (``""``) and of mode-sensitive submodules at call time"""
    autocast: dict[str, torch.dtype]
    """device type -> autocast dtype, for devices where autocast was on"""
    output: Any = None
    fingerprint: tuple[tuple[int, ...], float, float, float] | None = None
    """(shape, float64 sum, max, min) of the primary output, kept when the output itself is let go (reductions
    only: no copy of a large output): two calls with equal inputs and equal fingerprints computed the same"""
    grad_enabled: bool = True
    """autograd was on: a training forward, not a validation or target forward under ``no_grad``"""
    named: dict[str, Any] = field(default_factory=dict)
    """the call's arguments by the forward's parameter names, positional ones included (``model(ids, mask)``)"""
    output_grads: dict[str, bool] = field(default_factory=dict)
    """of the first call: each floating output tensor the step's backward reached (by its path in the output)
    -> whether the gradient it brought was anywhere non-zero"""

    def argument(self, key: str) -> Any:
        """The argument the forward's parameter ``key`` received, passed by name or by position."""
        return self.named.get(key)


@dataclass(frozen=True)
class Moved:
    """A tensor an optimizer step moved where it had no gradient to follow."""

    whole: bool
    """the tensor had no gradient at all (None, or all zero)"""
    rows: int = 0
    """rows (first dimension) whose gradient the step zeroed between backward and optimizer.step(), that moved"""


@dataclass(frozen=True)
class UpdateStats:
    """How one optimizer step changed one parameter tensor."""

    ratio: float
    """``||delta|| / ||param||`` (inf when the parameter norm is zero and it moved)"""
    stuck_fraction: float
    """fraction of elements with a non-zero gradient whose value did not change"""
    dtype: str
    ndim: int
    finite: bool = True
    """False when the step turned a finite tensor non-finite"""
    moved_without_grad: Moved | None = None
    """set when the step moved this tensor (or rows of it) where its gradient was None or zero"""
    has_grad: bool = True
    """the tensor had a gradient in the trial step"""


@dataclass(frozen=True)
class Supervision:
    """What the loss gradient reaching one model call's output says, one entry per output position (the output's
    leading dimensions: samples, or samples x tokens). CPU tensors."""

    call: int
    """index of the model call in ``StepTrace.calls``"""
    magnitude: torch.Tensor
    """sum of |gradient| over the classes: 0 where the loss does not supervise the position"""
    target: torch.Tensor | None
    """the class the loss pulls the position towards (most negative gradient entry), -1 where the gradient does not
    pull towards one class (a rejected sequence of a preference loss); None without a class dim"""
    weight: torch.Tensor | None
    """the weight of each position in a softmax cross-entropy (``-g[y] / (1 - p[y])``); None when the gradient
    does not have that shape"""
    classes: int
    """size of the class dimension (0 when there is none)"""


@dataclass(frozen=True)
class LeakEntry:
    """How much the probed samples' predictions (the first, and the last) depend on one watched input of the others."""

    input: str
    own: float
    other: float
    leaking_samples: list[int]


@dataclass(frozen=True)
class FutureLeak:
    """How much one prediction (sample 0, ``position``) depends on the token embeddings up to it and after it."""

    position: int
    past: float
    """summed gradient norm reaching positions 0..position"""
    future: float
    """summed gradient norm reaching positions after ``position``: 0 in a causal model"""
    length: int


@dataclass(frozen=True)
class PackingRead:
    """How much the later examples of one packed row (position ids restart inside it) change when its first
    example's tokens change, in eval mode."""

    row: int
    boundary: int
    """the position where the row's second example starts"""
    change: float
    """relative change of the predictions from ``boundary`` on"""


@dataclass(frozen=True)
class PaddingRead:
    """How much one padded row's prediction changes when its padding is dropped (the row run alone, then run
    alone cut to its real tokens), in eval mode."""

    row: int
    real: int
    """the row's real positions"""
    padding: int
    """its padding positions (a run at the end of the row)"""
    marked_by: str
    """what says they are padding: ``"mask <argument>"`` or ``"pad id <id>"``"""
    change: float
    """relative change of the row's prediction (its real positions, or its pooled output)"""


@dataclass
class SequenceReads:
    """One embedding's (batch, positions) token input and which of its entries the loss gradient reached."""

    ids: torch.Tensor
    reached: torch.Tensor
    """bool (batch, positions): the gradient reaching the embedding's output there is non-zero"""
    padding_idx: int | None


@dataclass
class StepTrace:
    """What the instrumented step produced. Tensors here are detached copies owned by the audit."""

    loss: torch.Tensor | None = None
    """the loss tensor as returned (or ``.loss`` of the returned object); None if step_fn raised"""
    raw_output: Any = None
    """whatever step_fn returned"""
    grads: dict[str, torch.Tensor | None] = field(default_factory=dict)
    """param name -> gradient the step produced (None when the param got no gradient)"""
    error: BaseException | None = None
    """the exception step_fn (or backward) raised, if any"""
    marked_inputs: bool = False
    """the audit made float inputs of the model require grad (to measure input dependency)"""
    phase: str | None = None
    """where ``error`` was raised: ``"step_fn"`` or ``"backward"``"""
    calls: list[RootCall] = field(default_factory=list)
    """the model's own forward calls during the step (at most a few)"""
    backward: bool = False
    """gradients were produced (by the audit's backward, or by ``step_fn`` itself)"""
    user_backward: bool = False
    """``step_fn`` ran backward itself"""
    loop_events: list[str] = field(default_factory=list)
    """``"backward"``, ``"zero_grad"``, ``"step"``, ``"clip"`` (gradient clipping), ``"unscale"`` (a GradScaler
    unscaling the gradients) and ``"scheduler"`` as ``step_fn`` itself ran them, in order (repeats of
    backward and zero_grad merged)"""
    loss_weights: list[tuple[torch.Tensor, str]] = field(default_factory=list)
    """``(weight, reduction)`` of each class-weighted ``cross_entropy``/``nll_loss`` call ``step_fn`` made"""
    stepped_optimizers: list[torch.optim.Optimizer] = field(default_factory=list)
    """every optimizer ``step_fn`` stepped (the one given as ``optimizer=`` and any other, e.g. a GAN's second)"""
    backward_versions: list[int] = field(default_factory=list)
    """for each ``"backward"`` of ``loop_events``: the summed in-place version counters of the trainable
    tensors when it began (equal across two backwards: no weight changed in between)"""
    binary_float_masks: list[str] = field(default_factory=list)
    """each attention call (``scaled_dot_product_attention``, ``nn.MultiheadAttention``) that got a floating mask
    holding only 0s and 1s, as ``"<function>.<argument>"``: a 0/1 keep-mask where an additive one is expected"""
    backward_calls: int = 0
    """how many separate backward passes ``step_fn`` ran itself (micro-batches of one accumulated step)"""
    backward_values: list[tuple[float | None, bool]] = field(default_factory=list)
    """for each of those passes (the first few): the value it backpropagated (None unless one scalar) and whether
    it kept its graph (``retain_graph=True``: terms of one forward, not micro-batches)"""
    schedulers_stepped: list[Any] = field(default_factory=list)
    """every LR scheduler ``step_fn`` stepped (once each, in order): which optimizer each one drives"""
    plateau_metrics: list[tuple[Any, float]] = field(default_factory=list)
    """``(scheduler, metric)`` for each ``ReduceLROnPlateau.step(metric)`` ``step_fn`` made"""
    masked_reduction: tuple[Any, int, int] | None = None
    """``(loss call, zeros, elements)``: a backward pass whose graph multiplies a loss already reduced to one number
    by a weight tensor holding zeros (read before the backward frees the saved tensors)"""
    backward_roots: list[Any] = field(default_factory=list)
    """the autograd nodes the first of those passes started from (the graph's structure outlives the backward)"""
    backward_leaves: list[frozenset[int]] = field(default_factory=list)
    """for each of those passes: the ids of the trainable tensors its graph reaches (micro-batches of one update
    reach the same ones; the objectives of several tasks, each through its own head, do not)"""
    backward_unscaled: list[bool] = field(default_factory=list)
    """for each of those passes: it backpropagated a mean-reduced loss as it is, not divided or scaled (a mean loss
    call's result, a ``.mean()``, or a sum with such a term unscaled in it)"""
    held_at_step: list[set[int]] = field(default_factory=list)
    """for each optimizer step inside ``step_fn`` (any optimizer, in order): the ids of the tensors it holds"""
    backward_steps: list[int] = field(default_factory=list)
    """for each backward pass ``step_fn`` ran: how many of those optimizer steps had run when it began"""
    scaled_backward: bool = False
    """``step_fn`` scaled its loss with an enabled GradScaler before backward"""
    cross_phase: list[tuple[int, list[str]]] = field(default_factory=list)
    """``(step, tensors)`` for each optimizer step (numbered over all optimizers from 0) whose tensors' gradients
    were accumulated both before and after another optimizer's earlier step: a phase's leftover gradient"""
    restepped: list[tuple[int, list[str]]] = field(default_factory=list)
    """``(step, tensors)`` for each optimizer step whose tensors' gradients still hold what the same tensors'
    earlier step in ``step_fn`` applied (accumulated before and after it, never cleared): an update applied twice"""
    stacked: list[tuple[int, list[str]]] = field(default_factory=list)
    """``(step, tensors)`` for each optimizer step run inside another's (a SAM-style wrapper's base) whose tensors'
    gradients still hold what was there when the wrapper's step began: its own backward added to it"""
    step_grads: list[int] = field(default_factory=list)
    """for each ``optimizer.step()`` inside ``step_fn``: how many trainable tensors held a non-zero gradient"""
    step_params: list[set[int]] = field(default_factory=list)
    """for each ``"step"`` of ``loop_events``: the ids of the trainable tensors that optimizer holds"""
    cleared: set[int] = field(default_factory=set)
    """the ids of the tensors some ``zero_grad()`` (or ``.grad = None``) inside ``step_fn`` cleared"""
    cleared_at: list[set[int]] = field(default_factory=list)
    """for each ``"zero_grad"`` of ``loop_events``: the ids of the tensors it cleared"""
    clip_params: list[set[int]] = field(default_factory=list)
    """for each ``"clip"`` of ``loop_events``: the ids of the tensors that clip was given"""
    loss_requires_grad: bool = False
    loss_is_leaf: bool = False
    """the loss has no ``grad_fn``: a tensor built anew (``torch.tensor(loss.item(), requires_grad=True)``), not
    the result of the step's computation"""
    position_reads: dict[str, SequenceReads] = field(default_factory=dict)
    """embedding name -> the positions of its token sequence (3 or more per row) the loss gradient reached"""
    input_grads: dict[str, float | None] | None = None
    """watched input (float input or embedding output) -> norm of the gradient the loss sent it, or None"""
    leak: list[LeakEntry] = field(default_factory=list)
    eval_dropouts: list[tuple[str, float]] | None = None
    """``(function, p)`` of each functional dropout that ran with ``training=True`` in the audit's eval-mode pass
    of the model; None when that pass did not run"""
    ran: set[str] = field(default_factory=set)
    """names of the model's submodules whose forward ran during the step"""
    ran_with_grad: set[str] = field(default_factory=set)
    """those of ``ran`` that ran at least once with autograd on (so their output was in the graph)"""
    value_checked: set[str] = field(default_factory=set)
    """the modules and parameters whose values were changed in a rerun of ``step_fn`` (``unread`` holds those of
    them the loss does not read)"""
    unread: set[str] = field(default_factory=set)
    """modules (none of whose parameters got a gradient) and single parameters that took part with autograd on,
    got no gradient, and whose values the loss does not read (changed, the loss stays bitwise equal): not cut
    from the graph"""
    grad_rows_after_backward: dict[str, torch.Tensor] = field(default_factory=dict)
    """param name -> which rows of its gradient were non-zero right after ``step_fn``'s backward passes"""
    grad_rows_at_step: dict[str, torch.Tensor | None] = field(default_factory=dict)
    """param name -> which rows of its gradient were non-zero when ``step_fn``'s first optimizer step ran"""
    user_update: dict[str, "Moved"] = field(default_factory=dict)
    """param name -> how ``step_fn``'s own optimizer step moved it, for tensors it moved without a gradient"""
    unfrozen: set[str] = field(default_factory=set)
    """params frozen (requires_grad=False) when the audit began that ``step_fn`` left requiring grad"""
    updated_by_step: set[str] = field(default_factory=set)
    """trainable params that ran only under no_grad, got no gradient, and that ``step_fn`` moves itself when their
    values are changed (a momentum or EMA copy of the encoder that learns)"""
    supervision: list[Supervision] = field(default_factory=list)
    """per backward through a model call's output: what the loss supervised there (the real backward only)"""
    update: dict[str, UpdateStats] = field(default_factory=dict)
    """param name -> what the trial optimizer step did to it (``update`` need)"""
    update_error: BaseException | None = None
    flows_after_update: set[str] | None = None
    """of the tensors with an all-zero gradient, those that get one in a second step after one real update
    (``second_step`` need); None: not measured"""
    input_independent: bool | None = None
    """the loss was bitwise unchanged on perturbed inputs (``input_independence`` need); None: not asked/unknown"""
    padded_labels_ignored: bool | None = None
    """the loss was bitwise unchanged with the labels on padding changed (``padded_labels`` need)"""
    overfit_lrs: list[float] = field(default_factory=list)
    """the lr of each param group during the overfitting steps: the schedule's peak, not its first value"""
    overfit_losses: list[float] = field(default_factory=list)
    """the batch's loss before each overfitting step and after the last (``overfit`` need, ``audit(steps=N)``)"""
    future_leak: FutureLeak | None = None
    padding_read: PaddingRead | None = None
    packing_read: PackingRead | None = None
    """``future`` need: what one prediction of a next-token setup reads (None: not such a setup, or not measured)"""
    given_inputs_ignored: bool | None = None
    """the loss was bitwise unchanged after perturbing ``inputs=`` itself, which never reached the model
    (``input_independence`` need); None: not asked/unknown"""

    def training_call(self) -> RootCall:
        """The step's first call of the model with autograd on (the training forward), else its first call: a
        validation or pseudo-label forward under ``no_grad`` that runs before it is not what trains."""
        return next((c for c in self.calls if c.grad_enabled), self.calls[0])
