"""monitor(): a NaN/+Inf watch over every module's forward output, cheap enough to leave on in real runs.

How it stays cheap: forward hooks only record references to the floating-point tensors modules return (no
kernels, no syncs); the recorded tensors are reduced in a few multi-tensor passes per forward and folded into
one flag per top-level forward. On CPU the flag is read when the forward returns. On CUDA it is copied to
pinned memory behind an event and read at the start of a later forward (or at exit / ``check()``), so the host
never waits for the GPU; it waits for the oldest pass only when more than ``MAX_LAG`` are in flight. Only when
a flag trips are the per-module verdicts copied to the host to name the culprit.

What counts as non-finite: NaN or +Inf. -Inf is ignored everywhere, because additive attention masks
legitimately hold -Inf (or overflow ``finfo.min + x`` to -Inf in fp16), and a -Inf that matters turns into
NaN or +Inf in the next module (``-inf - -inf``, ``0 * inf``, ``exp``), which is then reported.
"""

from __future__ import annotations

import collections
import functools
import warnings
from types import TracebackType
from typing import Any, Iterable

from torch import nn
from torch.utils.hooks import RemovableHandle

from guardtower._monitor_pass import MAX_LAG, Blame, PassResult, Tracker
from guardtower.bus import EventBus, Sink, check_bus_args, resolve_bus
from guardtower.errors import ConfigError, NonFiniteActivation
from guardtower.events import HaltEvent, NonFiniteEvent
from guardtower.severity import Severity

__all__ = ["monitor", "Monitor", "MODES", "CLOSE_TIMEOUT_S"]

#: how long leaving ``monitor()`` waits, in total, for the sinks of the bus it made
CLOSE_TIMEOUT_S = 5.0

#: what ``on_nonfinite`` accepts
MODES = ("raise", "warn", "event")


def monitor(
    model: nn.Module,
    *,
    on_nonfinite: str = "raise",
    bus: EventBus | None = None,
    sinks: Iterable[Sink] | None = None,
) -> "Monitor":
    """Watch ``model``'s forward passes for NaN/+Inf activations; use as ``with monitor(model): ...``.

    Every detection is published as a ``NonFiniteEvent`` (module, ``where="forward"``, ``input_nonfinite``,
    ``step`` = index of the top-level forward pass, from 0). ``on_nonfinite`` says what else happens:
    ``"raise"`` raises ``NonFiniteActivation`` on the calling thread (from the forward call in which the check
    happens), ``"warn"`` issues a ``RuntimeWarning``, ``"event"`` does nothing more.
    """
    return Monitor(model, on_nonfinite=on_nonfinite, bus=bus, sinks=sinks)


class Monitor:
    """The handle ``monitor()`` returns: a re-entrant context manager plus counters.

    ``passes``: top-level forward passes seen; ``nonfinite_passes``: how many of them held NaN/+Inf;
    ``last``: the last ``NonFiniteEvent`` reported (None if none). In ``"warn"``/``"event"`` modes a run of
    consecutive bad passes blaming the same module is reported once (at its first pass).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        on_nonfinite: str = "raise",
        bus: EventBus | None = None,
        sinks: Iterable[Sink] | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise ConfigError("model", f"expected a torch.nn.Module, got {type(model).__name__}",
                              "pass the model itself, e.g. monitor(model)")
        if on_nonfinite not in MODES:
            raise ConfigError("on_nonfinite", f"unknown value {on_nonfinite!r}",
                              f"use one of {', '.join(repr(m) for m in MODES)}")
        if bus is not None and not isinstance(bus, EventBus):
            raise ConfigError("bus", f"expected an EventBus, got {type(bus).__name__}",
                              "pass guardtower.EventBus(...) or use sinks=[...]")
        self.model = model
        self.on_nonfinite = on_nonfinite
        self.passes = 0
        self.nonfinite_passes = 0
        self.last: NonFiniteEvent | None = None
        self._bus_arg = bus
        self._sinks_arg = check_bus_args(bus, sinks) if sinks is not None else None
        self._bus: EventBus | None = None
        self._owns_bus = False
        self._entered = 0
        self._handles: list[RemovableHandle] = []
        self._names: list[str] = []
        self._tracker = Tracker()
        self._pending: collections.deque[PassResult] = collections.deque()
        self._depth = 0
        self._closed_normally = False
        self._inplace_inputs: dict[int, list[tuple[int, ...]]] = {}
        self._previous_blame: str | None = None

    # -- lifecycle ---------------------------------------------------------------------------------------
    def __enter__(self) -> "Monitor":
        if self._entered == 0:
            self._attach()
        self._entered += 1
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._entered -= 1
        if self._entered == 0:
            self.close(raise_on_nonfinite=exc is None)

    @property
    def active(self) -> bool:
        """True while the hooks are attached."""
        return bool(self._handles)

    def _attach(self) -> None:
        self._bus, self._owns_bus = resolve_bus(self._bus_arg, self._sinks_arg)
        self._tracker = Tracker()
        self._pending.clear()
        self._depth = 0
        self._previous_blame = None
        self._names = []
        root_type = type(self.model).__name__
        try:
            for index, (name, module) in enumerate(self.model.named_modules()):
                self._names.append(name or root_type)
                if module is self.model:
                    self._hook_root(index)
                else:
                    self._hook_child(index, module)
        except BaseException:
            self._detach()
            raise

    def _hook_root(self, index: int) -> None:
        model = self.model
        self._handles.append(model.register_forward_pre_hook(self._root_pre, with_kwargs=True))
        self._handles.append(model.register_forward_hook(functools.partial(self._root_post, index),
                                                         with_kwargs=True))
        # runs after _root_post in the normal path, alone when the forward raised
        self._handles.append(model.register_forward_hook(self._root_always, with_kwargs=True, always_call=True))

    def _hook_child(self, index: int, module: nn.Module) -> None:
        if getattr(module, "inplace", False) is True:
            # an in-place module overwrites its input: reduce everything pending (its input included) first
            self._handles.append(module.register_forward_pre_hook(
                functools.partial(self._inplace_pre, index), with_kwargs=True))
            self._handles.append(module.register_forward_hook(
                functools.partial(self._inplace_post, index), with_kwargs=True))
        else:
            self._handles.append(module.register_forward_hook(
                functools.partial(self._post, index), with_kwargs=True))

    def close(self, *, raise_on_nonfinite: bool = True) -> None:
        """Detach the hooks, report passes still in flight, and close the bus if this monitor made it.

        With ``raise_on_nonfinite=False`` (used when the ``with`` block is left by an exception) a pass that
        would raise only warns, so the original exception is not masked.
        """
        if not self._handles:
            return
        self._detach()
        self._tracker.discard()
        try:
            self._drain(wait=True, allow_raise=raise_on_nonfinite)
        finally:
            self._entered = 0
            if self._owns_bus and self._bus is not None:
                self._bus.close(CLOSE_TIMEOUT_S)  # a hanging sink must not keep the training loop waiting
            self._bus = None

    def _detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._inplace_inputs.clear()

    def check(self) -> None:
        """Wait for every finished pass's flag and report now (a host sync; not needed in a normal loop)."""
        self._drain(wait=True, allow_raise=True)

    # -- hooks (hot path: Python bookkeeping only) -------------------------------------------------------
    def _post(self, index: int, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
              output: Any) -> None:
        if not self._depth:  # outside a forward of the model: a direct submodule call, checkpoint recompute
            return
        tracker = self._tracker
        inputs = tracker.slots(args) + tracker.slots(kwargs) if kwargs else tracker.slots(args)
        tracker.record(index, inputs, tracker.slots(output))

    def _inplace_pre(self, index: int, module: nn.Module, args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> None:
        if not self._depth:
            return
        tracker = self._tracker
        self._inplace_inputs.setdefault(index, []).append(tracker.slots(args) + tracker.slots(kwargs))
        tracker.reduce()

    def _inplace_post(self, index: int, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                      output: Any) -> None:
        if not self._depth:
            return
        stack = self._inplace_inputs.get(index)
        inputs = stack.pop() if stack else ()
        self._tracker.record(index, inputs, self._tracker.slots(output))

    def _root_pre(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._depth += 1
        if self._depth == 1 and self._pending:
            self._drain(wait=False, allow_raise=True)

    def _root_post(self, index: int, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                   output: Any) -> None:
        self._post(index, module, args, kwargs, output)
        self._closed_normally = True
        self._depth -= 1
        if self._depth == 0:
            self.passes += 1
            self._pending.append(self._tracker.finish())
            self._drain(wait=False, allow_raise=True)

    def _root_always(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                     output: Any) -> None:
        if self._closed_normally:
            self._closed_normally = False
            return
        # the forward raised: release what this pass recorded
        self._depth -= 1
        if self._depth == 0:
            self.passes += 1
            self._tracker.discard()
            self._inplace_inputs.clear()

    # -- checking and reporting --------------------------------------------------------------------------
    def _drain(self, *, wait: bool, allow_raise: bool) -> None:
        """Report finished passes in order; wait for the device only if asked or too many are in flight."""
        while self._pending:
            result = self._pending[0]
            if not (wait or result.ready() or len(self._pending) > MAX_LAG):
                return
            self._pending.popleft()
            if not result.tripped():
                self._previous_blame = None
                continue
            self.nonfinite_passes += 1
            blame = result.blame(self._names)
            if blame is None:
                continue
            try:
                self._report(blame, allow_raise)
            except NonFiniteActivation:
                self._absorb_in_flight()
                raise

    def _absorb_in_flight(self) -> None:
        """After a raise: passes already run belong to the same incident; count them, do not report them."""
        while self._pending:
            if self._pending.popleft().tripped():
                self.nonfinite_passes += 1

    def _report(self, blame: Blame, allow_raise: bool) -> None:
        raising = self.on_nonfinite == "raise"
        repeat = blame.module == self._previous_blame
        self._previous_blame = blame.module
        if repeat and not raising:
            return
        event = NonFiniteEvent(module=blame.module, where="forward", input_nonfinite=blame.input_nonfinite,
                               step=blame.step, severity=Severity.ERROR)  # non-finite is a failure
        self.last = event
        bus = self._bus
        message = _message(blame)
        if bus is not None:
            bus.publish(event)
        if raising and allow_raise:
            if bus is not None:
                bus.publish(HaltEvent(layer=blame.module, reason="nonfinite_activation", message=message,
                                      step=blame.step, severity=Severity.ERROR))
            raise NonFiniteActivation(blame.module, blame.input_nonfinite, details=_details(blame))
        if self.on_nonfinite == "warn" or raising:
            warnings.warn(message, RuntimeWarning, stacklevel=2)


def _message(blame: Blame) -> str:
    origin = "its input was already non-finite" if blame.input_nonfinite else "its input was finite"
    extra = len(blame.nonfinite_modules) - 1
    later = f"; {extra} later module(s) also produced NaN/+Inf" if extra > 0 else ""
    note = " (that output was changed in place afterwards)" if blame.mutated_in_place else ""
    return (f"guardtower.monitor: NaN/+Inf in the output of module {blame.module!r} in forward pass "
            f"{blame.step}{note}; {origin}{later}")


def _details(blame: Blame) -> dict[str, Any]:
    return {"step": blame.step, "nonfinite_modules": blame.nonfinite_modules[:20],
            "mutated_in_place": blame.mutated_in_place, "rule": "NaN or +Inf counts; -Inf is ignored (masks)"}
