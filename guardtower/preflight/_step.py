"""The instrumented training step: run ``step_fn`` once under probes, then backward, and record a ``StepTrace``.

Besides the registered probes, the step watches the model's inputs so ``input_dependency`` can ask how the
loss depends on them: float inputs to the root ``model(...)`` call are marked ``requires_grad`` (restored
afterwards) and, for token ids, the output of the embedding that consumed them is watched instead (made a
gradient leaf only when the embedding is frozen, which changes no parameter's gradient).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from guardtower.preflight._registry import PROBES, AuditContext
from guardtower.preflight._sample_leak import sample_leaks
from guardtower.preflight._state import TensorFlags
from guardtower.preflight._update import grad_rows, moved_without_grad
from guardtower.preflight._supervision import first_call_output, supervision_hook
from guardtower.preflight._trace import LeakEntry, Moved, RootCall, SequenceReads, StepTrace, Supervision
from guardtower.preflight._util import (NOT_INPUT_KEYS, base_optimizer, iter_tensors, masked_reduction,
                                        master_copies_of, patched, reached_params)

__all__ = ["run_step", "primary_output", "confirm_input_independence", "given_inputs_unused", "confirm_given_inputs_ignored", "extract_loss", "MODE_SENSITIVE"]

_MAX_ROOT_CALLS = 4
#: backward passes whose value is recorded, at most
_MAX_BACKWARDS = 64
_AUTOCAST_DEVICES = ("cpu", "cuda")

#: module types whose behaviour depends on ``training``
MODE_SENSITIVE: tuple[type[nn.Module], ...] = (nn.modules.dropout._DropoutNd, nn.modules.batchnorm._BatchNorm)


@dataclass
class _Watch:
    """Tensors whose gradient tells whether (and how) the loss depends on the model's input."""

    tensors: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    token_ptrs: set[int] = field(default_factory=set)
    positions: dict[str, SequenceReads] = field(default_factory=dict)
    """embedding name -> what the loss gradient reached of its (batch, positions) token input"""
    marked: bool = False
    """the audit made a float input require grad"""


def _watch_positions(positions: dict[str, SequenceReads], name: str, module: nn.Module, ids: torch.Tensor,
                     output: torch.Tensor) -> None:
    """Record which (row, position) entries of ``output`` the loss gradient reaches (first call per embedding)."""
    if name in positions or len(positions) >= 8:
        return
    padding = getattr(module, "padding_idx", None)
    reads = positions[name] = SequenceReads(ids.detach().clone(), torch.zeros(ids.shape, dtype=torch.bool,
                                                                               device=ids.device), padding)

    def hook(grad: torch.Tensor) -> None:
        reads.reached |= grad.detach().ne(0).any(-1)

    output.register_hook(hook)


def _by_name(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """A call's arguments under the names of the forward's parameters (the positional ones bound in order)."""
    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return dict(kwargs)
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return {**dict(zip(positional, args)), **kwargs}


def _token_shape(call: RootCall) -> tuple[int, ...] | None:
    """(batch, tokens) of a call that takes a token mask or token ids: an output of exactly that shape holds one
    value per token (a per-token reward or score), not class scores."""
    for key in ("attention_mask", "input_ids"):
        value = call.argument(key)
        if isinstance(value, torch.Tensor) and value.dim() == 2 and not value.is_floating_point():
            return tuple(value.shape)
    return None


def _zeroed_rows(trace: StepTrace, name: str) -> torch.Tensor | None:
    """The rows of tensor ``name`` that backward filled and the step zeroed before ``optimizer.step()``."""
    at_step = trace.grad_rows_at_step.get(name)
    after = trace.grad_rows_after_backward.get(name)
    return after & ~at_step if after is not None and at_step is not None and after.shape == at_step.shape else None


def _nothing_to_follow(trace: StepTrace, name: str) -> bool:
    """Whether the step's gradient leaves some of tensor ``name`` alone: none at all, or zeroed rows."""
    zeroed = _zeroed_rows(trace, name)
    return trace.grad_rows_at_step.get(name) is None or (zeroed is not None and bool(zeroed.any()))


def _moved(trace: StepTrace, name: str, p: torch.Tensor, before: torch.Tensor) -> Moved | None:
    """How ``p`` moved since ``before`` where the step's gradient gave it nothing to follow (``moved_without_grad``)."""
    if before.shape != p.shape:
        return None
    return moved_without_grad(p, before, trace.grad_rows_at_step.get(name), _zeroed_rows(trace, name))


def _unscaled_mean(node: Any, means: set[int], depth: int = 0) -> bool:
    """The autograd node is a mean-reduced loss's (a loss call with ``reduction='mean'``, a ``.mean()``), or a sum
    or difference of terms with one such term in it, weighted or not (``0.5 * ce + 0.5 * kd``): what a backward of
    an undivided micro-batch loss starts from. A division anywhere on the way, or a scaling of the whole loss (its
    root a multiplication: ``loss * (1 / k)``, ``scaler.scale(loss)``), is a normalisation."""
    if node is None or depth > 8:
        return False
    name = type(node).__name__
    if id(node) in means or name.startswith("MeanBackward"):
        return True
    if name.startswith(("AddBackward", "SubBackward")) or (depth > 0 and name.startswith("MulBackward")):
        return any(_unscaled_mean(child, means, depth + 1) for child, _ in node.next_functions)
    if name.startswith(("DivBackward", "MulBackward")) and _by_one(node):  # a wrapper's ``loss / 1``
        return _unscaled_mean(node.next_functions[0][0], means, depth)
    return False


def _by_one(node: Any) -> bool:
    """A division or multiplication whose other operand is exactly 1 (an accumulation count of 1)."""
    try:
        other = node._saved_other
    except Exception:  # a node that saved no operand
        return False
    return isinstance(other, torch.Tensor) and other.numel() == 1 and float(other) == 1.0


def _find_masked_reduction(ctx: AuditContext, trace: StepTrace, loss: torch.Tensor) -> None:
    """Before a backward of ``loss`` frees its graph's saved tensors: a mask multiplied onto a reduced loss."""
    if trace.masked_reduction is not None or loss.grad_fn is None:
        return
    reduced = {id(c.node): c for c in ctx.probes.get("loss_calls", ()) if c.node is not None
               and c.reduction in ("mean", "sum")}
    if reduced:
        trace.masked_reduction = masked_reduction(loss.grad_fn, reduced)


def extract_loss(output: Any) -> Any:
    """The loss inside what ``step_fn`` returned: the tensor itself or ``.loss`` / ``["loss"]``."""
    if isinstance(output, torch.Tensor):
        return output
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    return loss


@contextlib.contextmanager
def _instrument(model: nn.Module, flags: TensorFlags, calls: list[RootCall], watch: _Watch,
                mark_inputs: bool, supervised: list[Supervision], ran: set[str],
                ran_with_grad: set[str]) -> Iterator[None]:
    sensitive = [(n, m) for n, m in model.named_modules() if n and isinstance(m, MODE_SENSITIVE)]

    def pre_hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if len(calls) >= _MAX_ROOT_CALLS:
            return
        autocast = {
            dev: torch.get_autocast_dtype(dev) for dev in _AUTOCAST_DEVICES if torch.is_autocast_enabled(dev)
        }
        training = {"": module.training, **{n: m.training for n, m in sensitive}}
        calls.append(RootCall(args=args, kwargs=dict(kwargs), training=training, autocast=autocast,
                              grad_enabled=torch.is_grad_enabled(), named=_by_name(module, args, kwargs)))
        for path, t in iter_tensors((args, kwargs), skip_keys=NOT_INPUT_KEYS):
            if t.is_floating_point():
                if mark_inputs and t.is_leaf and not t.requires_grad:
                    flags.add(t)
                    t.requires_grad_(True)
                    watch.marked = True
                if t.requires_grad:
                    watch.tensors.append((f"input {path}", t))
            elif not t.is_complex() and t.dtype != torch.bool and t.device.type != "meta":
                watch.token_ptrs.add(t.untyped_storage().data_ptr())

    def post_hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        for index in range(len(calls) - 1, -1, -1):
            if calls[index].output is None:
                calls[index].output = output
                measured = first_call_output(output, primary_output)
                if measured is not None and torch.is_grad_enabled():
                    measured.register_hook(supervision_hook(index, measured, supervised,
                                                            _token_shape(calls[index])))
                if index == 0 and torch.is_grad_enabled():
                    _watch_output_grads(calls[0], output)
                break

    def embedding_hook(name: str) -> Callable[[nn.Module, tuple[Any, ...], Any], Any]:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            ids = args[0] if args else None
            if not isinstance(ids, torch.Tensor) or not isinstance(output, torch.Tensor) or ids.device.type == "meta":
                return None
            if ids.untyped_storage().data_ptr() not in watch.token_ptrs:
                return None
            replaced = not output.requires_grad and output.is_floating_point()
            if replaced:
                output = output.detach().requires_grad_(True)
            watch.tensors.append((f"embedding {name}", output))
            if torch.is_grad_enabled() and ids.dim() == 2 and output.dim() == 3 and ids.shape[1] >= 3:
                _watch_positions(watch.positions, name, module, ids, output)
            return output if replaced else None

        return hook

    names = {id(m): n for n, m in model.named_modules()}

    def ran_hook(module: nn.Module, args: tuple[Any, ...]) -> None:
        name = names.get(id(module))
        if name is not None:
            ran.add(name)
            if torch.is_grad_enabled():
                ran_with_grad.add(name)

    handles = [
        model.register_forward_pre_hook(pre_hook, with_kwargs=True),
        model.register_forward_hook(post_hook, with_kwargs=True),
        torch.nn.modules.module.register_module_forward_pre_hook(ran_hook),
    ]
    handles += [
        m.register_forward_hook(embedding_hook(n)) for n, m in model.named_modules() if isinstance(m, nn.Embedding)
    ]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


#: output tensors of the first model call whose gradient is watched (a tuple of heads, an HF output's fields)
_WATCHED_OUTPUTS = 8


def _watch_output_grads(call: RootCall, output: Any) -> None:
    """Record, per output tensor of the call, whether the step's backward brought it a non-zero gradient: an
    output the loss reads whose gradient is exactly zero is one the loss is flat in (its target is the output)."""
    def note(path: str, grad: torch.Tensor) -> None:
        with contextlib.suppress(Exception):  # observing must never change what the step does
            call.output_grads[path] = call.output_grads.get(path, False) or bool(grad.detach().ne(0).any())

    watched = [(path, t) for path, t in iter_tensors(output, depth=2)
               if t.is_floating_point() and t.requires_grad and t.numel() > 0][:_WATCHED_OUTPUTS]
    for path, t in watched:
        t.register_hook(functools.partial(note, path))


#: contrastive outputs (CLIP, SigLIP): ``logits_per_*`` is batch x batch by design; the embeddings are per sample
_PER_SAMPLE_EMBEDS = ("image_embeds", "text_embeds")


def primary_output(output: Any) -> torch.Tensor | None:
    """The per-sample prediction of a model call: ``.logits`` of HF outputs (a contrastive model's embeddings),
    else the first tensor."""
    if any(isinstance(getattr(output, name, None), torch.Tensor) for name in ("logits_per_image", "logits_per_text")):
        return next((e for e in (getattr(output, n, None) for n in _PER_SAMPLE_EMBEDS) if isinstance(e, torch.Tensor)),
                    None)
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    for _, t in iter_tensors(output, depth=2):
        if t.dim() > 0 and t.is_floating_point():
            return t
    return None


def _leak_analysis(model: nn.Module, calls: list[RootCall], watch: _Watch) -> list[LeakEntry]:
    """The cross-sample probe (``_sample_leak``) on the step's own graph, kept for the real backward."""
    if not calls:
        return []
    call = calls[0]
    return sample_leaks(model, primary_output(call.output), watch.tensors, (call.args, call.kwargs),
                        retain_graph=True)


#: the ``Tensor.grad`` descriptor (the C one on ``TensorBase``) that ``_watch_loop`` shadows while the step runs
_GRAD: Any = inspect.getattr_static(torch.Tensor, "grad")


def _binary_float(mask: Any) -> bool:
    """A floating mask of only 0s and 1s, both present: attention adds a float mask to its scores, so such a
    keep-mask (1 = attend) masks nothing (it shifts the kept scores by 1)."""
    if not isinstance(mask, torch.Tensor) or not mask.is_floating_point() or mask.numel() < 2:
        return False
    values = mask.detach().unique()
    return values.numel() == 2 and bool((values == 0).any()) and bool((values == 1).any())


@contextlib.contextmanager
def _watch_loop(ctx: AuditContext, trace: StepTrace) -> Iterator[dict[str, torch.Tensor]]:
    """Record, in order, the ``backward``, ``zero_grad`` and ``step`` that ``step_fn`` runs itself, and the
    gradients each backward left (by reference: a later ``zero_grad(set_to_none=True)`` cannot hide them).

    Clearing counts as ``zero_grad`` however it is spelled: ``optimizer.zero_grad()``, ``model.zero_grad()``, or
    ``p.grad = None`` on a trainable parameter (the "faster zero_grad" loop), seen through a ``Tensor.grad``
    property that stands in for the C descriptor while the step runs."""
    names = {id(p): n for n, p in ctx.params.items()}
    left: dict[str, torch.Tensor] = {}
    # which optimizer steps (numbered over every optimizer the step steps) each tensor's gradient spans: the
    # step count at each accumulation since the tensor was last cleared, and which optimizer took each step
    spans: dict[int, set[int]] = {}
    step_log = trace.held_at_step

    def cleared(tensors: Iterable[torch.Tensor] | None = None) -> None:
        if not trace.loop_events or trace.loop_events[-1] != "zero_grad":
            trace.loop_events.append("zero_grad")
            trace.cleared_at.append(set())
        for t in tensors if tensors is not None else ():
            spans.pop(id(t), None)
            trace.cleared.add(id(t))
            trace.cleared_at[-1].add(id(t))

    def get_grad(tensor: torch.Tensor) -> Any:
        return _GRAD.__get__(tensor)

    def set_grad(tensor: torch.Tensor, value: Any) -> None:
        _GRAD.__set__(tensor, value)
        if value is None and id(tensor) in names:
            cleared([tensor])

    def del_grad(tensor: torch.Tensor) -> None:
        _GRAD.__delete__(tensor)
        if id(tensor) in names:
            cleared([tensor])

    trainable = [p for p in ctx.params.values() if p.requires_grad]
    trainable_ids = {id(p) for p in trainable}

    def on_grad(p: torch.Tensor) -> None:
        spans.setdefault(id(p), set()).add(len(step_log))
        if not trace.loop_events or trace.loop_events[-1] != "backward":
            trace.loop_events.append("backward")
            trace.backward_versions.append(sum(t._version for t in trainable))
        if p.grad is not None and id(p) in names:
            left[names[id(p)]] = p.grad
            if not trace.step_grads:  # which rows backward filled, to tell the rows the step zeroed afterwards
                rows = grad_rows(p.grad)
                if rows is not None:
                    trace.grad_rows_after_backward[names[id(p)]] = rows

    depth = [0]  # an optimizer subclass whose step() calls super().step() runs the hooks of both: one step
    closure = [False]  # the outer step got a closure: its zero_grad and backward run inside, before the update
    #: the first step's tensors that had nothing to follow, with their values just before it: what that step
    #: alone did to them (a momentum copy the forward moves, an EMA after the step, are the user's own updates)
    before_step: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    moved_from: list[tuple[str, torch.Tensor, torch.Tensor]] = []  # what that step moved, judged again at the end

    def post_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        depth[0] -= 1
        if depth[0] > 0:
            return
        if closure[0]:
            closure[0] = False
            record_step(opt)
        for name, p, before in before_step:
            moved = _moved(trace, name, p, before)
            if moved is not None:
                trace.user_update[name] = moved
                moved_from.append((name, p, before))
        before_step.clear()

    def pre_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        depth[0] += 1
        if depth[0] > 1:
            return
        closure[0] = callable(args[1] if len(args) > 1 else kwargs.get("closure"))  # args[0] is the optimizer
        first = not trace.step_grads
        if not closure[0]:
            record_step(opt)
        if first:  # a closure computes the gradients inside the step: every tracked tensor is a candidate then
            watched = [p for g in opt.param_groups for p in g["params"] if id(p) in names and p.requires_grad
                       and (closure[0] or _nothing_to_follow(trace, names[id(p)]))]
            before_step.extend((names[id(p)], p, p.detach().clone()) for p in watched)

    def updated_by(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
        """The trainable tensors a step of ``opt`` updates: its own, or the model's 16-bit ones when it steps
        float32 copies of them (the gradients are copied in and the weights back inside its step)."""
        masters = master_copies_of(opt, ctx.params)
        return masters if masters is not None else [p for g in opt.param_groups for p in g["params"]]

    def record_step(opt: torch.optim.Optimizer) -> None:
        """The step as it used the gradients: for a closure, once it has run (its gradients are then there)."""
        trace.loop_events.append("step")
        tracked = [p for p in updated_by(opt) if p.requires_grad]
        trace.step_params.append({id(p) for p in tracked})
        rows = [grad_rows(p.grad) for p in tracked]
        trace.step_grads.append(sum(1 for r in rows if r is not None and bool(r.any())))
        if len(trace.step_grads) == 1:  # what the first step had to follow, before a later zero_grad clears it
            trace.grad_rows_at_step = {names[id(p)]: grad_rows(p.grad) for g in opt.param_groups
                                       for p in g["params"] if id(p) in names}

    def zero_grad_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)  # keeps the signature callers inspect (Accelerate's zero_grad)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            cleared([p for g in self.param_groups for p in g["params"]] if isinstance(self, torch.optim.Optimizer)
                    else list(self.parameters()))
            return original(self, *args, **kwargs)

        return wrapper

    def recording(event: str, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            trace.loop_events.append(event)
            return original(*args, **kwargs)

        return wrapper

    def counting_backward(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            trace.backward_calls += 1
            trace.backward_steps.append(len(step_log))
            tensors = args[0] if args else kwargs.get("tensors")
            retained = args[2] if len(args) > 2 else kwargs.get("retain_graph")
            if len(trace.backward_values) < _MAX_BACKWARDS:
                value = float(tensors.detach()) if isinstance(tensors, torch.Tensor) and tensors.numel() == 1 else None
                trace.backward_values.append((value, bool(retained)))
                means = {id(c.node) for c in ctx.probes.get("loss_calls", ()) if c.node is not None
                         and c.reduction == "mean"}
                trace.backward_unscaled.append(isinstance(tensors, torch.Tensor)
                                               and _unscaled_mean(tensors.grad_fn, means))
                trace.backward_leaves.append(reached_params(tensors, trainable_ids)
                                             if isinstance(tensors, torch.Tensor) else frozenset())
                if isinstance(tensors, torch.Tensor) and tensors.grad_fn is not None and len(trace.backward_roots) < 4:
                    trace.backward_roots.append(tensors.grad_fn)
                    _find_masked_reduction(ctx, trace, tensors)
            return original(*args, **kwargs)

        return wrapper

    def scaling(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def wrapper(scaler: Any, outputs: Any) -> Any:
            if scaler.is_enabled() and float(scaler.get_scale()) != 1.0:
                trace.scaled_backward = True
            return original(scaler, outputs)

        return wrapper

    running: list[int] = []  # the optimizer steps (indices into step_log) that began and have not finished

    def any_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if all(opt is not seen for seen in trace.stepped_optimizers):
            trace.stepped_optimizers.append(opt)
        held = {id(p) for p in updated_by(opt)}
        # a gradient accumulated both before and after another optimizer's step of other tensors: this update
        # applies what an earlier phase's backward (another objective) left on these tensors
        # and one accumulated both before and after an earlier step of these same tensors: that step's gradient
        # is applied again
        # (judged against the steps that finished: a wrapper still running, SAM calling its base, applied nothing)
        spanned = [i for i in held if i in names and len(spans.get(i, ())) > 1]
        between = {i: [k for k in range(min(spans[i]), max(spans[i])) if k not in running] for i in spanned}
        stale = [names[i] for i in spanned if any(i not in step_log[k] for k in between[i])]
        if stale and len(trace.cross_phase) < 8:
            trace.cross_phase.append((len(step_log), sorted(stale)))
        again = [names[i] for i in spanned if any(i in step_log[k] for k in between[i])]
        if again and len(trace.restepped) < 8:
            trace.restepped.append((len(step_log), sorted(again)))
        # inside a wrapper's step: a gradient that was there when the wrapper began, which its own backward added to
        stacked = [names[i] for i in spanned if running and min(spans[i]) <= running[0] < max(spans[i])]
        if stacked and len(trace.stacked) < 8:
            trace.stacked.append((len(step_log), sorted(stacked)))
        running.append(len(step_log))
        step_log.append(held)

    def any_step_done(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if running:
            running.pop()

    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    handles = [p.register_post_accumulate_grad_hook(on_grad) for p in ctx.params.values() if p.requires_grad]
    handles += [register_optimizer_step_pre_hook(any_step), register_optimizer_step_post_hook(any_step_done)]
    base = base_optimizer(ctx.optimizer)
    if base is not None:
        handles += [base.register_step_pre_hook(pre_step), base.register_step_post_hook(post_step)]
    # (owner, attribute, wrapper factory): what the step calls, seen while it runs and put back afterwards
    patches: list[tuple[Any, str, Callable[[Any], Any]]] = [
        (torch.optim.Optimizer, "zero_grad", zero_grad_wrapper), (nn.Module, "zero_grad", zero_grad_wrapper),
        (torch.autograd, "backward", counting_backward),
        (torch.amp.GradScaler, "scale", scaling),
        (torch.amp.GradScaler, "unscale_", lambda f: recording("unscale", f)),
    ]

    def clipping(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            given, rest = (kwargs.pop("parameters"), args) if "parameters" in kwargs else (args[0], args[1:])
            tensors = [given] if isinstance(given, torch.Tensor) else list(given)  # a generator is read once
            trace.loop_events.append("clip")
            trace.clip_params.append({id(t) for t in tensors})
            return original(tensors, *rest, **kwargs)

        return wrapper

    patches += [(owner, name, clipping)
                for owner in (torch.nn.utils, torch.nn.utils.clip_grad)
                for name in ("clip_grad_norm_", "clip_grad_value_") if hasattr(owner, name)]

    def weighted_loss(original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            weight = kwargs.get("weight", args[2] if len(args) > 2 else None)
            if isinstance(weight, torch.Tensor):
                trace.loss_weights.append((weight.detach().float().cpu(), str(kwargs.get("reduction", "mean"))))
            return original(*args, **kwargs)

        return wrapper

    patches += [(F, name, weighted_loss) for name in ("cross_entropy", "nll_loss")]

    def masked_attention(function: str, positions: dict[str, int]) -> Callable[[Callable[..., Any]], Any]:
        def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                for name, index in positions.items():
                    mask = kwargs.get(name, args[index] if len(args) > index else None)
                    if _binary_float(mask):
                        trace.binary_float_masks.append(f"{function}.{name}")
                return original(*args, **kwargs)

            return wrapper

        return wrap

    patches += [(F, "scaled_dot_product_attention", masked_attention("scaled_dot_product_attention",
                                                                     {"attn_mask": 3})),
                (F, "multi_head_attention_forward", masked_attention("multi_head_attention_forward",
                                                                     {"key_padding_mask": 14, "attn_mask": 16}))]
    def note_scheduler(stepped: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if all(stepped is not s for s in trace.schedulers_stepped) and len(trace.schedulers_stepped) < 16:
            trace.schedulers_stepped.append(stepped)
        metric: Any = args[0] if args else kwargs.get("metrics")
        if isinstance(stepped, torch.optim.lr_scheduler.ReduceLROnPlateau) and len(trace.plateau_metrics) < 8:
            with contextlib.suppress(Exception):
                trace.plateau_metrics.append((stepped, float(metric)))

    def noting_scheduler(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            note_scheduler(self, args, kwargs)
            return original(self, *args, **kwargs)

        return wrapper

    patches += [(torch.optim.lr_scheduler.LRScheduler, "step", noting_scheduler),
                (torch.optim.lr_scheduler.ReduceLROnPlateau, "step", noting_scheduler)]
    scheduler = ctx.lr_scheduler
    if scheduler is not None and callable(getattr(scheduler, "step", None)) and hasattr(scheduler, "__dict__"):
        def scheduler_step(original: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(original)
            def wrapper(*args: Any, **kwargs: Any) -> Any:  # the instance's own step: the class patch is behind it
                note_scheduler(scheduler, args, kwargs)
                trace.loop_events.append("scheduler")
                return original(*args, **kwargs)

            return wrapper

        patches.append((scheduler, "step", scheduler_step))
    own_grad = torch.Tensor.__dict__.get("grad")
    try:
        with patched(patches):
            torch.Tensor.grad = property(get_grad, set_grad, del_grad, _GRAD.__doc__)  # type: ignore[assignment]
            yield left
    finally:
        if own_grad is None:
            del torch.Tensor.grad  # the descriptor on TensorBase shows through again
        else:
            torch.Tensor.grad = own_grad
        for h in handles:
            h.remove()
        for name, p, before in moved_from:  # what step_fn put back after its optimizer step (frozen rows rewritten)
            moved = _moved(trace, name, p, before)
            if moved is None:
                trace.user_update.pop(name, None)
            else:
                trace.user_update[name] = moved


def run_step(ctx: AuditContext, step_fn: Callable[[], Any], flags: TensorFlags, *, leak_analysis: bool = True,
             mark_inputs: bool = True) -> StepTrace:
    """Run ``step_fn`` under the probes, backward once, and record what happened. Never raises ``Exception``."""
    trace = StepTrace()
    ctx.trace = trace
    calls = trace.calls
    watch = _Watch()
    output: Any = None
    with contextlib.ExitStack() as stack:
        stack.enter_context(_instrument(ctx.model, flags, calls, watch, mark_inputs, trace.supervision, trace.ran,
                                        trace.ran_with_grad))
        left_by_backward = stack.enter_context(_watch_loop(ctx, trace))
        for factory in PROBES.values():
            stack.enter_context(factory(ctx))
        try:
            output = step_fn()
        except Exception as exc:
            trace.error = exc
            trace.phase = "step_fn"
        returned = extract_loss(output)
        if isinstance(returned, torch.Tensor) and "backward" not in trace.loop_events:
            _find_masked_reduction(ctx, trace, returned)  # the audit's own backward comes after the probes let go
    trace.raw_output = output
    trace.marked_inputs = watch.marked
    trace.position_reads = watch.positions
    loss = extract_loss(output)
    # step_fn ran backward itself; its gradients are the ones to judge (never a second backward on its graph)
    ran_backward = "backward" in trace.loop_events or any(p.grad is not None for p in ctx.params.values())
    if not isinstance(loss, torch.Tensor):
        if ran_backward and trace.error is None:  # ``return loss.item()``: the gradients are there all the same
            trace.backward = trace.user_backward = True
            _keep_grads(ctx, trace, left_by_backward)
        return trace
    trace.loss = loss.detach()
    trace.loss_requires_grad = loss.requires_grad
    trace.loss_is_leaf = loss.grad_fn is None
    if ran_backward:
        trace.backward = trace.user_backward = True
    elif trace.backward_calls:
        pass  # step_fn's own backward passes reached none of the model's tensors (it trains copies): none of the audit's
    elif loss.requires_grad and trace.error is None:
        target = loss if loss.numel() == 1 else loss.float().mean()
        if leak_analysis:  # one extra backward from the probed samples' predictions; only input_dependency reads it
            try:
                trace.leak = _leak_analysis(ctx.model, calls, watch)
            except RuntimeError:
                # torch.autograd.grad is refused by reentrant checkpointing; the real backward below is not
                trace.leak = []
        trace.supervision.clear()  # the leak analysis' own gradient passed the output hooks: not the loss's
        for reads in watch.positions.values():
            reads.reached.zero_()
        try:
            captured: dict[str, torch.Tensor] = {}
            handles = [
                t.register_hook(lambda g, label=label: captured.__setitem__(label, g.detach()))
                for label, t in watch.tensors
                if t.requires_grad
            ]
            try:
                target.backward()
            finally:
                for h in handles:
                    h.remove()
            trace.backward = True
            trace.input_grads = {
                label: (float(captured[label].float().norm()) if label in captured else None)
                for label, t in watch.tensors
                if t.requires_grad
            }
        except Exception as exc:
            trace.error = exc
            trace.phase = "backward"
    _keep_grads(ctx, trace, left_by_backward)
    return trace


def _keep_grads(ctx: AuditContext, trace: StepTrace, left_by_backward: dict[str, torch.Tensor]) -> None:
    """The step's gradients into the trace, and the model calls' outputs (their graphs, the logits) let go."""
    # a gradient step_fn's own zero_grad() dropped after its backward is still the one that backward produced
    grads = {name: (p.grad if p.grad is not None else left_by_backward.get(name)) for name, p in ctx.params.items()}
    # a sparse embedding gradient is judged as the dense one it stands for (the checks read rows and norms)
    trace.grads = {name: (None if g is None else g.detach().to_dense() if g.is_sparse else g.detach())
                   for name, g in grads.items()}
    for call in trace.calls:
        out = primary_output(call.output)
        if isinstance(out, torch.Tensor) and out.is_floating_point() and out.numel() > 0:
            with torch.no_grad():
                call.fingerprint = (tuple(out.shape), float(out.sum(dtype=torch.float64)), float(out.max()),
                                    float(out.min()))
        call.output = None


def _perturb(t: torch.Tensor) -> torch.Tensor:
    """A different input of the same shape and dtype: zeros for floats, reversed/rolled ids for tokens."""
    if t.is_floating_point():
        return torch.zeros_like(t)
    out = t.flip(-1) if t.dim() > 0 else t
    return out.roll(1, 0) if out.dim() > 0 and out.shape[0] > 1 else out


def confirm_input_independence(model: nn.Module, step_fn: Callable[[], Any], loss: torch.Tensor,
                               rng: Callable[[], None]) -> bool | None:
    """Re-run ``step_fn`` without gradients on perturbed model inputs (labels untouched) and the same RNG
    stream; True when the loss is bitwise unchanged. None when it cannot tell (no root call, step failed).

    A zero input gradient alone is not enough: a frozen feature extractor run under ``torch.no_grad()`` has
    none either, yet its loss does depend on the input.
    """
    replaced: list[bool] = []

    def pre_hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        def swap(obj: Any, key: str | None = None) -> Any:
            if key in NOT_INPUT_KEYS:
                return obj
            if isinstance(obj, torch.Tensor) and obj.dtype != torch.bool and not obj.is_complex():
                replaced.append(True)
                return _perturb(obj)
            return obj

        return tuple(swap(a) for a in args), {k: swap(v, k) for k, v in kwargs.items()}

    handle = model.register_forward_pre_hook(pre_hook, with_kwargs=True)
    try:
        rng()
        with torch.no_grad():
            other = extract_loss(step_fn())
    except Exception:
        return None
    finally:
        handle.remove()
    if not replaced or not isinstance(other, torch.Tensor) or other.shape != loss.shape:
        return None
    return bool(torch.equal(other.detach(), loss.detach()))


def given_inputs_unused(inputs: Any, calls: list[RootCall]) -> bool:
    """True when ``inputs=`` holds model inputs and none of them (by storage) reached a call of the model."""
    given = {t.untyped_storage().data_ptr() for _, t in iter_tensors(inputs, depth=6, skip_keys=NOT_INPUT_KEYS)
             if t.device.type != "meta"}
    if not given:
        return False
    used = {t.untyped_storage().data_ptr() for call in calls for _, t in iter_tensors((call.args, call.kwargs), depth=6)
            if t.device.type != "meta"}
    return not (given & used)


def confirm_given_inputs_ignored(step_fn: Callable[[], Any], inputs: Any, loss: torch.Tensor,
                                 rng: Callable[[], None]) -> bool | None:
    """Re-run ``step_fn`` without gradients after perturbing the tensors of ``inputs=`` in place (labels
    untouched; values put back afterwards) and the same RNG stream; True when the loss is bitwise unchanged.

    This catches a step that never reads the batch it was handed (a stale batch from an earlier iteration, a
    loss built from parameters only), which the model's own inputs cannot reveal.
    """
    tensors = [t for _, t in iter_tensors(inputs, depth=6, skip_keys=NOT_INPUT_KEYS)
               if t.dtype != torch.bool and not t.is_complex() and t.device.type != "meta" and t.numel() > 0]
    if not tensors:
        return None
    saved = [t.detach().clone() for t in tensors]
    try:
        with torch.no_grad():
            for t in tensors:
                t.copy_(_perturb(t.detach()))
            rng()
            other = extract_loss(step_fn())
    except Exception:
        return None
    finally:
        with torch.no_grad():
            for t, original in zip(tensors, saved):
                t.copy_(original)
    if not isinstance(other, torch.Tensor) or other.shape != loss.shape:
        return None
    return bool(torch.equal(other.detach(), loss.detach()))
