"""``forward_weights``: layers built inside the model's forward (OPT-020).

``nn.Linear(...)`` or ``nn.Parameter(...)`` made in ``forward`` draws new random weights on every call: they get a
gradient, but no optimizer holds them (it was built before), ``state_dict()`` never saves them and the next call
replaces them, so that part of the network stays random while the rest trains around it. The probe records every
parameter a module registers while the model's forward runs; one the model does not hold once the step is over
was made for that call and thrown away.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

from torch import nn
from torch.nn.modules.module import register_module_parameter_registration_hook

from guardtower.preflight._registry import AuditContext, check, probe
from guardtower.preflight._util import fmt_names
from guardtower.report import Finding
from guardtower.severity import Severity

__all__: list[str] = []


@dataclass
class ForwardWeights:
    """The trainable parameters registered while the model's forward ran: ``(module type, name, parameter)``."""

    made: list[tuple[str, str, nn.Parameter]] = field(default_factory=list)


@probe("forward_weights")
@contextlib.contextmanager
def _forward_weights_probe(ctx: AuditContext) -> Iterator[ForwardWeights]:
    record = ForwardWeights()
    ctx.probes["forward_weights"] = record
    depth = [0]

    def enter(module: nn.Module, args: Any) -> None:
        depth[0] += 1

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        depth[0] = max(0, depth[0] - 1)

    def registered(module: nn.Module, name: str, param: Any) -> None:
        if depth[0] and isinstance(param, nn.Parameter) and param.requires_grad and len(record.made) < 64:
            record.made.append((type(module).__name__, name, param))

    handles = [ctx.model.register_forward_pre_hook(enter), ctx.model.register_forward_hook(leave),
               register_module_parameter_registration_hook(registered)]
    try:
        yield record
    finally:
        for handle in handles:
            handle.remove()


@check("forward_weights", emits=("OPT-020",))
def check_forward_weights(ctx: AuditContext) -> Iterable[Finding]:
    """OPT-020: trainable weights made inside forward that the model does not keep."""
    record = ctx.probes.get("forward_weights")
    if not isinstance(record, ForwardWeights) or not record.made:
        return []
    held = {id(p) for p in ctx.model.parameters()}
    thrown = [f"{kind}.{name}" for kind, name, p in record.made if id(p) not in held]
    if not thrown:
        return []
    return [Finding(
        "forward_weights", Severity.WARN,
        f"the model's forward built {len(thrown)} trainable weight(s) the model does not keep: {fmt_names(thrown)}; "
        "each call draws them anew at random, no optimizer holds them and state_dict() never saves them, so that "
        "part of the network never trains; build the layer in __init__ and only call it in forward",
        "OPT-020", {"weights": thrown[:50]},
    )]
