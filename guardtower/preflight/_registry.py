"""How audit checks plug in.

A check is a function ``(ctx: AuditContext) -> Iterable[Finding]`` registered under its public name with
``@check("name")``. ``static=True`` marks checks that need no forward/backward pass (``lora_summary`` runs
only those). A probe is a context-manager factory ``(ctx) -> ContextManager`` registered with ``@probe("name")``;
it is active while ``step_fn`` runs and stores what it observed in ``ctx.probes["name"]`` for checks to read.
"""

from __future__ import annotations


from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterable

import torch
from torch import nn

from guardtower.report import Finding

__all__ = ["AuditContext", "StepTrace", "CheckSpec", "check", "probe", "CHECKS", "PROBES"]


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
    extras: dict[str, Any] = field(default_factory=dict)
    """more observations the runner records (activations, update ratios, ...)"""


@dataclass
class AuditContext:
    """Everything a check may look at."""

    model: nn.Module
    optimizer: torch.optim.Optimizer | None
    inputs: Any
    scaler: Any
    params: dict[str, nn.Parameter]
    """``model.named_parameters()`` (shared tensors once, under their first name)"""
    trace: StepTrace | None = None
    """None for static audits (``lora_summary``)"""
    probes: dict[str, Any] = field(default_factory=dict)
    memo: dict[str, Any] = field(default_factory=dict)
    """facts several checks derive from the model, computed once per audit"""


@dataclass(frozen=True)
class CheckSpec:
    name: str
    fn: Callable[[AuditContext], Iterable[Finding]]
    static: bool


CHECKS: dict[str, CheckSpec] = {}
PROBES: dict[str, Callable[[AuditContext], ContextManager[Any]]] = {}


def check(name: str, *, static: bool = False) -> Callable[[Callable[[AuditContext], Iterable[Finding]]], Callable[[AuditContext], Iterable[Finding]]]:
    """Register a check under its public name."""

    def decorate(fn: Callable[[AuditContext], Iterable[Finding]]) -> Callable[[AuditContext], Iterable[Finding]]:
        CHECKS[name] = CheckSpec(name, fn, static)
        return fn

    return decorate


def probe(name: str) -> Callable[[Callable[[AuditContext], ContextManager[Any]]], Callable[[AuditContext], ContextManager[Any]]]:
    """Register a probe that is active while the step runs."""

    def decorate(factory: Callable[[AuditContext], ContextManager[Any]]) -> Callable[[AuditContext], ContextManager[Any]]:
        PROBES[name] = factory
        return factory

    return decorate


