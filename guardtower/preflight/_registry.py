"""How audit checks plug in.

A check is a function ``(ctx: AuditContext) -> Iterable[Finding]`` registered under its public name with
``@check("name", emits=(catalog ids, ...), needs=(...))``: the ids it may emit (the catalog test reads them) and
the extra measurements it needs (``guardtower.preflight._trace.Need``). ``static=True`` marks checks that need
no forward/backward pass (``lora_summary`` runs only those). A probe is a context-manager factory ``(ctx) -> ContextManager`` registered with ``@probe("name")``;
it is active while ``step_fn`` runs and stores what it observed in ``ctx.probes["name"]`` for checks to read.
"""

from __future__ import annotations


from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterable

import torch
from torch import nn

from guardtower.preflight._trace import NEEDS, Need, StepTrace
from guardtower.report import Finding

__all__ = ["AuditContext", "StepTrace", "CheckSpec", "check", "probe", "CHECKS", "PROBES"]


@dataclass
class AuditContext:
    """Everything a check may look at."""

    model: nn.Module
    optimizer: torch.optim.Optimizer | None
    inputs: Any
    scaler: Any
    params: dict[str, nn.Parameter]
    """``model.named_parameters()`` (shared tensors once, under their first name)"""
    lr_scheduler: Any = None
    """the LR scheduler that will drive ``optimizer``: ``audit(lr_scheduler=)``, else the one attached to it"""
    total_steps: int | None = None
    """the planned number of optimizer steps of the run (``audit(total_steps=)``, the trainer's ``max_steps``)"""
    companions: dict[str, nn.Module] = field(default_factory=dict)
    """modules the training step holds besides the model, by the name it knows them by (an EMA copy, a target
    network, a teacher kept outside the model)"""
    trace: StepTrace | None = None
    """None for static audits (``lora_summary``)"""
    probes: dict[str, Any] = field(default_factory=dict)
    memo: dict[str, Any] = field(default_factory=dict)
    """facts several checks derive from the model, computed once per audit"""


@dataclass(frozen=True)
class CheckSpec:
    """A registered check and what it declares: the catalog ids it may emit (a finding with any other id
    becomes AUDIT-001) and the extra measurements it needs from the runner."""

    name: str
    fn: Callable[[AuditContext], Iterable[Finding]]
    static: bool
    emits: frozenset[str] = frozenset()
    needs: frozenset[str] = frozenset()
    always: bool = False
    """runs whatever ``checks=`` selects (the step's own failure makes every other verdict moot)"""


CHECKS: dict[str, CheckSpec] = {}
PROBES: dict[str, Callable[[AuditContext], ContextManager[Any]]] = {}


def check(
    name: str,
    *,
    emits: Iterable[str],
    needs: Iterable[Need] = (),
    static: bool = False,
    always: bool = False,
) -> Callable[[Callable[[AuditContext], Iterable[Finding]]], Callable[[AuditContext], Iterable[Finding]]]:
    """Register a check under its public name, with the catalog ids it emits and the measurements it needs."""
    unknown = set(needs) - NEEDS
    if unknown:
        raise ValueError(f"check {name!r} declares unknown needs {sorted(unknown)}")

    def decorate(fn: Callable[[AuditContext], Iterable[Finding]]) -> Callable[[AuditContext], Iterable[Finding]]:
        CHECKS[name] = CheckSpec(name, fn, static, frozenset(emits), frozenset(needs), always)
        return fn

    return decorate


def probe(name: str) -> Callable[[Callable[[AuditContext], ContextManager[Any]]], Callable[[AuditContext], ContextManager[Any]]]:
    """Register a probe that is active while the step runs."""

    def decorate(factory: Callable[[AuditContext], ContextManager[Any]]) -> Callable[[AuditContext], ContextManager[Any]]:
        PROBES[name] = factory
        return factory

    return decorate


