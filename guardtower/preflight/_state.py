"""Snapshot and exact restore of everything a training step can touch.

The audit runs a real forward/backward (and a trial optimizer step for the update-ratio check) on the
user's objects, so it must put back parameters, buffers, ``.grad`` tensors, optimizer state and
hyper-parameters, RNG streams, ``training`` flags, the inputs' ``requires_grad``/``.grad`` and a
``GradScaler``'s state. Memory stays near one plain step: trainable parameters (and any tensor an optimizer
holds) and buffers are cloned once, frozen parameters are only watched for in-place changes, gradients are
kept by reference, and the optimizer state is swapped out while ``step_fn`` runs instead of being copied.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import functools
import random
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch import nn

from guardtower.preflight._util import iter_tensors, patched, wrapper_chain

__all__ = ["TrainingState", "OptimizerState", "TensorFlags", "clone_value", "restore_value"]


@dataclass
class TensorFlags:
    """``requires_grad`` and ``.grad`` of tensors the audit may mark for gradients (the inputs)."""

    entries: list[tuple[torch.Tensor, bool, torch.Tensor | None, torch.Tensor | None]] = field(default_factory=list)

    def add(self, t: torch.Tensor) -> None:
        if any(t is e[0] for e in self.entries):
            return
        grad = t.grad if t.is_leaf else None
        self.entries.append((t, t.requires_grad, grad, None if grad is None else grad.detach().clone()))

    def restore(self) -> None:
        for t, requires_grad, grad, grad_copy in self.entries:
            if not t.is_leaf:
                continue
            if t.requires_grad != requires_grad:
                t.requires_grad_(requires_grad)
            if grad is not None and grad_copy is not None:
                with torch.no_grad():
                    grad.copy_(grad_copy)
            t.grad = grad


class OptimizerState:
    """One optimizer's group hyper-parameters, and its per-parameter state kept aside while the step runs.

    The state (Adam moments: twice the trainable parameters) is never copied: ``isolated()`` swaps in an
    empty state dict while ``step_fn`` runs, so an ``optimizer.step()`` inside it cannot touch the real
    moments, and ``restore()`` puts the very same dict back. The trial update saves one tensor's state at a
    time (``guardtower.preflight._update``).
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.state = optimizer.state
        self.groups = [
            ({k: clone_value(v) for k, v in g.items() if k != "params"}, list(g["params"])) for g in optimizer.param_groups
        ]
        self.n_groups = len(optimizer.param_groups)
        self.flags = {k: v for k, v in vars(optimizer).items() if k in ("_opt_called",)}

    @contextlib.contextmanager
    def isolated(self) -> Iterator[None]:
        try:
            self.optimizer.state = collections.defaultdict(dict)
        except AttributeError:  # a wrapper exposing its base's state read-only; the base is isolated instead
            yield
            return
        try:
            yield
        finally:
            self.optimizer.state = self.state

    def restore(self) -> None:
        opt = self.optimizer
        if opt.state is not self.state:
            opt.state = self.state
        del opt.param_groups[self.n_groups:]
        for group, (hyper, params) in zip(opt.param_groups, self.groups):
            for k in [k for k in group if k != "params" and k not in hyper]:
                del group[k]
            for k, v in hyper.items():
                group[k] = restore_value(group.get(k), v)
            group["params"][:] = params
        for k in ("_opt_called",):
            if k in self.flags:
                setattr(opt, k, self.flags[k])
            elif k in vars(opt):
                delattr(opt, k)


class AcceleratePhase:
    """Where Accelerate's gradient accumulation stands: each ``Accelerator``'s micro-step counter and the
    process-wide ``sync_gradients`` flag. A pass of the audit that stops ``step_fn`` after its first micro-batch
    would otherwise leave the cycle off by one: the next pass, and the user's first update after the audit, would
    sync on the wrong micro-batch. The counters are learnt while ``step_fn`` runs (``Accelerator._do_sync`` is
    watched), since nothing else leads from the model or the optimizer to the ``Accelerator``."""

    def __init__(self) -> None:
        self.steps: dict[int, tuple[Any, int]] = {}  # id(accelerator) -> (accelerator, its step before the audit)
        module = sys.modules.get("accelerate.state")
        self.gradient_state = module.GradientState() if module is not None else None
        self.sync = None if self.gradient_state is None else self.gradient_state.sync_gradients

    @contextlib.contextmanager
    def watched(self) -> Iterator[None]:
        module = sys.modules.get("accelerate.accelerator")
        if module is None:
            yield
            return
        steps = self.steps

        def watch(original: Any) -> Any:
            @functools.wraps(original)
            def do_sync(accelerator: Any) -> Any:
                steps.setdefault(id(accelerator), (accelerator, accelerator.step))
                return original(accelerator)

            return do_sync

        with patched([(module.Accelerator, "_do_sync", watch)]):
            yield

    def restore(self) -> None:
        for accelerator, step in self.steps.values():
            accelerator.step = step
        if self.gradient_state is not None:
            self.gradient_state.sync_gradients = self.sync


class TrainingState:
    """Everything ``audit()`` promises to leave bitwise identical."""

    def __init__(self, model: nn.Module, optimizer: Any = None, inputs: Any = None, scaler: Any = None) -> None:
        self.model = model
        self.optimizer = optimizer
        self.optimizers = [OptimizerState(o) for o in _optimizer_chain(optimizer)]
        held = _unique(p for o in self.optimizers for g in o.optimizer.param_groups for p in g["params"])
        in_optimizer = {id(p) for p in held}
        # the model's parameters, then what an optimizer holds beside them (a mixed-precision optimizer's float32
        # main weights, which its step updates and copies back)
        all_params = _unique([*model.parameters(), *held])
        # only tensors an optimizer step can touch are cloned: a LoRA audit does not copy the frozen base
        self.params = [(p, p.detach().clone()) for p in all_params if p.requires_grad or id(p) in in_optimizer]
        cloned = {id(p) for p, _ in self.params}
        self.flags = [(p, p.requires_grad) for p in all_params]  # a step may unfreeze (or freeze) tensors itself
        self.frozen_versions = [(p, p._version) for p in all_params if id(p) not in cloned]
        self.grads = [(p, p.grad, None if p.grad is None else p.grad.detach().clone()) for p in all_params]
        self.buffers = [(b, b.detach().clone()) for b in _unique(model.buffers())]
        self.training = [(m, m.training) for m in model.modules()]
        self.inputs = TensorFlags()
        for _, t in iter_tensors(inputs, depth=6):
            self.inputs.add(t)
        self.scaler = scaler
        self.scaler_state = _copy_or_none(vars(scaler)) if scaler is not None and hasattr(scaler, "__dict__") else None
        self.accelerate = AcceleratePhase()
        self.grad_enabled = torch.is_grad_enabled()
        self.torch_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        self.py_rng = random.getstate()
        numpy = sys.modules.get("numpy")
        self.np_rng = numpy.random.get_state() if numpy is not None else None

    @contextlib.contextmanager
    def isolated_optimizers(self) -> Iterator[None]:
        """While ``step_fn`` runs, optimizers see an empty state (see ``OptimizerState.isolated``) and wrappers'
        own ``step`` is bypassed."""
        with contextlib.ExitStack() as stack:
            for opt in self.optimizers:
                stack.enter_context(opt.isolated())
            stack.enter_context(_steps_bypass_wrappers(self.optimizer))
            stack.enter_context(self.accelerate.watched())
            yield

    def clear_grads(self) -> None:
        """Detach the user's gradients so the audit's backward produces fresh ones (restored later)."""
        for p, _, _ in self.grads:
            p.grad = None

    def unfrozen(self) -> list[torch.Tensor]:
        """The parameters that were frozen when the audit began and require grad now (the step unfroze them)."""
        return [p for p, requires_grad in self.flags if not requires_grad and p.requires_grad]

    def restore_weights(self) -> None:
        """Put back ``requires_grad`` flags, parameter and buffer values (not the optimizers: a pass running
        under ``isolated_optimizers()`` keeps its scratch state) (idempotent)."""
        for p, requires_grad in self.flags:
            if p.requires_grad != requires_grad:
                p.requires_grad_(requires_grad)
        with torch.no_grad():
            for p, saved in self.params:
                _copy_into(p, saved)
            for b, saved in self.buffers:
                _copy_into(b, saved)

    def restore_values(self) -> None:
        """Put back ``requires_grad`` flags, parameter and buffer values, optimizer state, the scaler and
        Accelerate's accumulation phase (idempotent)."""
        self.restore_weights()
        for opt in self.optimizers:
            opt.restore()
        if self.scaler is not None and self.scaler_state is not None:
            vars(self.scaler).clear()
            vars(self.scaler).update(copy.deepcopy(self.scaler_state))
        self.accelerate.restore()

    def restore_rng(self) -> None:
        """Rewind every RNG stream to the snapshot (also used to replay a step with identical dropout masks)."""
        torch.set_rng_state(self.torch_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        random.setstate(self.py_rng)
        numpy = sys.modules.get("numpy")
        if numpy is not None and self.np_rng is not None:
            numpy.random.set_state(self.np_rng)

    def restore(self) -> None:
        """Put back everything (idempotent)."""
        torch.set_grad_enabled(self.grad_enabled)
        self.restore_values()
        touched = [p for p, version in self.frozen_versions if p._version != version]
        if touched:
            warnings.warn(
                f"guardtower.audit: step_fn modified {len(touched)} frozen parameter(s) outside the optimizer "
                "in place; the audit does not snapshot frozen parameters, so they keep the new values",
                RuntimeWarning,
                stacklevel=3,
            )
        with torch.no_grad():
            for p, grad, grad_copy in self.grads:
                if grad is not None and grad_copy is not None:
                    grad.copy_(grad_copy)
                p.grad = grad
        for m, training in self.training:
            m.training = training
        self.inputs.restore()
        self.restore_rng()


def _unique(tensors: Any) -> list[torch.Tensor]:
    seen: set[int] = set()
    out = []
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def _optimizer_chain(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The optimizers whose state must be kept: the optimizer and any it wraps, once per state dict."""
    # wrappers sharing param_groups/state with their base need only one snapshot of that state
    unique: list[torch.optim.Optimizer] = []
    for opt in reversed(wrapper_chain(optimizer, torch.optim.Optimizer)):  # innermost first: its ``state`` is a plain, settable attribute
        if not any(opt.state is u.state for u in unique):
            unique.append(opt)
    return unique


_MISSING = object()


def _base_step(base: torch.optim.Optimizer, closure: Any = None, *args: Any, **kwargs: Any) -> Any:
    return base.step(closure) if closure is not None else base.step()


@contextlib.contextmanager
def _steps_bypass_wrappers(optimizer: Any) -> Iterator[None]:
    """While ``step_fn`` runs, a ``GuardedOptimizer``'s ``step()`` goes straight to the optimizer it wraps, so it
    counts no step and moves no baseline for an update that is undone. Only the guards are bypassed: another
    wrapper's step is its algorithm (SAM's second forward and backward, Lookahead's slow weights), and an
    Accelerate optimizer's decides whether there is an update at all (none on the micro-batches of an
    accumulation window); skipping either would change the step the audit measures."""
    from guardtower.guard.optimizer import GuardedOptimizer

    chain: list[torch.optim.Optimizer] = wrapper_chain(optimizer, torch.optim.Optimizer)
    bypassed = [(w, chain[i + 1]) for i, w in enumerate(chain[:-1]) if isinstance(w, GuardedOptimizer)]
    wrappers = [w for w, _ in bypassed]
    saved = [vars(w).get("step", _MISSING) for w in wrappers]
    try:
        for w, inner in bypassed:
            w.step = functools.partial(_base_step, inner)  # type: ignore[method-assign]
        yield
    finally:
        for w, previous in zip(wrappers, saved):
            if previous is _MISSING:
                vars(w).pop("step", None)
            else:
                w.step = previous  # type: ignore[method-assign]


def clone_value(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return copy.deepcopy(value)


def restore_value(current: Any, saved: Any) -> Any:
    if isinstance(saved, torch.Tensor):
        if (
            isinstance(current, torch.Tensor)
            and current.shape == saved.shape
            and current.dtype == saved.dtype
            and current.device == saved.device
        ):
            with torch.no_grad():
                current.copy_(saved)
            return current
        return saved.clone()
    return copy.deepcopy(saved)


def _copy_into(target: torch.Tensor, saved: torch.Tensor) -> None:
    if target.shape == saved.shape and target.dtype == saved.dtype and target.device == saved.device:
        target.copy_(saved)
    else:
        target.data = saved.clone()


def _copy_or_none(state: dict[str, Any]) -> dict[str, Any] | None:
    try:
        return copy.deepcopy(state)
    except Exception:  # an exotic scaler that cannot be copied is left alone
        return None
