"""``checkpointing``: would reentrant ``torch.utils.checkpoint`` cut trainable weights off from the gradient
in the user's own run?

Reentrant checkpointing (``use_reentrant=True``, the default before torch 2.9) gives a block's output a
gradient only if one of its positional tensor inputs requires grad. A block that holds trainable weights but
is fed tensors that do not (token embeddings from a frozen table, detached features) trains nothing, silently.
The probe watches every reentrant checkpoint call of the step, including direct ``checkpoint(fn, x)`` calls
in custom models; inputs the audit itself marked for gradients do not count (see ``_checkpoint``).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

from guardtower.preflight._checkpoint import reentrant_layers, watch_checkpointing
from guardtower.preflight._peft import is_peft_model
from guardtower.preflight._registry import AuditContext, check, probe
from guardtower.preflight._util import fmt_names
from guardtower.report import Finding
from guardtower.severity import Severity

__all__ = ["StarvedCall"]

_MAX_CALLS = 64


@dataclass
class StarvedCall:
    """One reentrant checkpoint call whose inputs would not require grad without the audit."""

    function: str
    modules: list[nn.Module] = field(default_factory=list)


def _modules_of(fn: Any, depth: int = 3) -> list[nn.Module]:
    """The modules a checkpointed function runs: the module itself, a bound method's owner, a partial's
    function and arguments, or modules captured in a closure."""
    if depth < 0:
        return []
    if isinstance(fn, nn.Module):
        return [fn]
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, nn.Module):
        return [owner]
    if isinstance(fn, functools.partial):
        found = _modules_of(fn.func, depth - 1)
        for arg in (*fn.args, *fn.keywords.values()):
            found += _modules_of(arg, depth - 1) if isinstance(arg, nn.Module) else []
        return found
    found = []
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(value, nn.Module) or callable(value):
            found += _modules_of(value, depth - 1)
    return found


@probe("checkpointing")
@contextlib.contextmanager
def _checkpoint_probe(ctx: AuditContext) -> Iterator[list[StarvedCall]]:
    starved: list[StarvedCall] = []
    ctx.probes["checkpointing"] = starved
    function_cls: Any = torch_checkpoint.CheckpointFunction
    original = function_cls.__dict__["forward"]
    calls = [0]

    with watch_checkpointing(ctx.model, []) as watch:
        def forward(fctx: Any, run_function: Callable[..., Any], preserve_rng_state: bool, *args: Any) -> Any:
            try:
                calls[0] += 1
                if calls[0] <= _MAX_CALLS:
                    tensors = [a for a in args if isinstance(a, torch.Tensor)]
                    if watch.would_starve(tensors):
                        name = getattr(run_function, "__qualname__", None) or type(run_function).__name__
                        starved.append(StarvedCall(str(name), _modules_of(run_function)))
            except Exception:  # observing must never change what the step does
                pass
            return original.__func__(fctx, run_function, preserve_rng_state, *args)

        function_cls.forward = staticmethod(forward)
        try:
            yield starved
        finally:
            function_cls.forward = original


@check("checkpointing", emits=("GRAD-006",))
def check_checkpointing(ctx: AuditContext) -> Iterable[Finding]:
    """GRAD-006: a reentrant checkpoint around trainable weights whose inputs do not require grad."""
    starved: list[StarvedCall] = ctx.probes.get("checkpointing", [])
    if not starved:
        return []
    # Hugging Face checkpointing layers of a peft model are judged by lora_gradient_flow (LORA-006)
    judged = {id(m) for _, m in reentrant_layers(ctx.model)} if is_peft_model(ctx.model) else set()
    names = {id(p): n for n, p in ctx.params.items()}
    params: dict[str, None] = {}
    functions: dict[str, None] = {}
    for call in starved:
        for module in call.modules:
            if id(module) in judged:
                continue
            trainable = [names[id(p)] for p in module.parameters() if p.requires_grad and id(p) in names]
            if trainable:
                functions[call.function] = None
                params.update(dict.fromkeys(trainable))
    if not params:
        return []
    return [Finding(
        "checkpointing", Severity.ERROR,
        f"reentrant torch.utils.checkpoint runs {fmt_names(list(functions))} on inputs that do not require grad, "
        f"so {len(params)} trainable parameter(s) inside get no gradient in the real run: {fmt_names(list(params))}; "
        "pass use_reentrant=False, or make the input require grad (model.enable_input_require_grads())",
        "GRAD-006", {"params": list(params)[:200], "functions": list(functions), "count": len(params)},
    )]
