"""``train_mode``: the step should run with the model (and its dropout/BatchNorm layers) in training mode."""

from __future__ import annotations

from typing import Iterable

from guardtower.preflight._registry import AuditContext, check
from guardtower.preflight._step import MODE_SENSITIVE
from guardtower.preflight._trace import RootCall
from guardtower.preflight._util import fmt_names
from guardtower.report import Finding
from guardtower.severity import Severity

__all__: list[str] = []


@check("train_mode", emits=("MODE-001",))
def check_train_mode(ctx: AuditContext) -> Iterable[Finding]:
    """MODE-001: model in eval mode during the step, or dropout/BatchNorm submodules left in eval mode."""
    calls: list[RootCall] = ctx.trace.calls if ctx.trace is not None else []
    if calls:
        training = calls[0].training
    else:
        training = {"": ctx.model.training, **{n: m.training for n, m in ctx.model.named_modules()
                                               if n and isinstance(m, MODE_SENSITIVE)}}
    if not training.get("", True):
        return [Finding(
            "train_mode", Severity.WARN,
            "the model is in eval mode during the training step: dropout is off and BatchNorm uses (and does not "
            "update) running statistics; call model.train() (from_pretrained() returns an eval-mode model)",
            "MODE-001", {"modules": [""], "root_training": False},
        )]
    stuck = [n for n, t in training.items() if n and not t]
    if stuck:
        return [Finding(
            "train_mode", Severity.WARN,
            f"the model trains but {len(stuck)} dropout/BatchNorm submodule(s) are in eval mode: {fmt_names(stuck)} "
            "(a submodule's .eval() survives model.train() only if called after it; intended for frozen BatchNorm)",
            "MODE-001", {"modules": stuck, "root_training": True},
        )]
    return []
