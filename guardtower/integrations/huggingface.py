"""Hugging Face ``Trainer`` callbacks: a pre-flight audit on the first real batch, and a guarded optimizer.

``GuardtowerCallback`` audits the model on the first training batch, before the first optimizer step, with
the batch, precision (the Trainer's autocast) and optimizer the Trainer itself uses. A ``TrainerCallback``
never sees the batch, so the callback hooks the model's forward once: the first training-mode forward
carries exactly the inputs ``compute_loss`` passes. The audit leaves every tensor as it found it, so the
real step then runs unchanged; with ``raise_on_error=True`` a failed pre-flight raises ``PreflightFailed``
out of ``trainer.train()`` before any weight has changed.

``StabilityGuardCallback`` puts a ``GuardedOptimizer`` inside the optimizer the Trainer steps (Accelerate's
``AcceleratedOptimizer`` holds the real optimizer in ``.optimizer``), so every update goes through the guard.
The Trainer clips gradients before it steps; clipped gradients hide a spike, so when ``max_grad_norm`` is
set the callback moves the clipping behind the guard's decision (same norm, applied only to accepted steps).
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

import torch
from torch import nn

from guardtower._dist import current_rank
from guardtower.bus import EventBus, Sink, resolve_bus
from guardtower.errors import ConfigError, MissingDependencyError, PreflightFailed

try:
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
except ImportError as exc:  # pragma: no cover - exercised in a subprocess without transformers
    raise MissingDependencyError("transformers", "hf") from exc

if False:  # pragma: no cover - typing only, without importing the guard at module import
    from guardtower.guard import GuardedOptimizer
    from guardtower.report import Report

__all__ = ["GuardtowerCallback", "StabilityGuardCallback"]

logger = logging.getLogger("guardtower.integrations.huggingface")


class GuardtowerCallback(TrainerCallback):  # type: ignore[misc]
    """Run ``guardtower.audit`` on the Trainer's first real batch, before the first optimizer step.

    ``raise_on_error=True`` stops ``trainer.train()`` with ``PreflightFailed`` when the audit finds a FAIL;
    otherwise the report is printed (``verbose``) and training goes on. The audit publishes its ``finding``
    and ``preflight`` events to ``sinks`` (e.g. an ``MLflowBridge`` tags the run). ``.report`` holds the
    last report, ``None`` before the first audit.
    """

    def __init__(
        self,
        *,
        raise_on_error: bool = False,
        checks: str | Iterable[str] = "all",
        verbose: bool = True,
        sinks: Iterable[Sink] | None = None,
        bus: EventBus | None = None,
    ) -> None:
        if not isinstance(raise_on_error, bool):
            raise ConfigError("raise_on_error", f"expected True or False, got {raise_on_error!r}",
                              "pass raise_on_error=True to stop training on a failed pre-flight")
        self.checks = _validate_checks(checks)
        self.raise_on_error = raise_on_error
        self.verbose = bool(verbose)
        self._bus, self._owns_bus = resolve_bus(bus, sinks)
        self.report: Report | None = None
        self._handle: torch.utils.hooks.RemovableHandle | None = None
        self._optimizer: Any = None

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       model: nn.Module | None = None, optimizer: Any = None, **kwargs: Any) -> None:
        if model is None:
            logger.warning("guardtower: the Trainer passed no model to on_train_begin; pre-flight skipped")
            return
        self._remove_hook()
        self._optimizer = optimizer
        self._handle = model.register_forward_pre_hook(self._first_forward, with_kwargs=True)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        self._remove_hook()
        self._optimizer = None
        self._bus.flush(5.0)

    def close(self) -> None:
        """Detach from the model and close the event bus if this callback created it."""
        self._remove_hook()
        if self._owns_bus:
            self._bus.close(5.0)

    def _remove_hook(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _first_forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Forward pre-hook: audit with this exact call, once, on the first training-mode forward."""
        if not module.training or not torch.is_grad_enabled():
            return None  # an evaluation before training (eval_on_start) is not the first training batch
        self._remove_hook()
        report = self.run_audit(module, args, kwargs)
        if report is not None and self.raise_on_error and not report.ok:
            raise PreflightFailed(report)
        return None

    def run_audit(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Report | None:
        """Audit ``model`` on one call's inputs with the Trainer's optimizer and scaler; keep and print the report."""
        from guardtower.audit import audit

        optimizer = _innermost_optimizer(self._optimizer)
        scaler = getattr(self._optimizer, "scaler", None)

        def step_fn() -> Any:  # the loss exactly as Trainer.compute_loss gets it: model(**inputs).loss
            return model(*args, **kwargs)

        try:
            report = audit(model, step_fn, optimizer=optimizer, inputs=kwargs or args, checks=self.checks,
                           scaler=scaler, bus=self._bus)
        except ConfigError:
            raise
        except Exception:  # a bug in a check must not stop a training run the user did not ask to stop
            logger.warning("guardtower: the pre-flight audit itself failed; training continues", exc_info=True)
            return None
        self.report = report
        if self.verbose and current_rank() == 0:
            print(report, flush=True)
        return report


def _validate_checks(checks: str | Iterable[str]) -> str | tuple[str, ...]:
    """The ``checks`` argument as audit() takes it, rejecting unknown names now rather than at step 0."""
    import guardtower.audit  # noqa: F401  (registers the checks)
    from guardtower.audit._registry import CHECKS

    names: tuple[str, ...]
    if isinstance(checks, str):
        if checks == "all":
            return checks
        names = (checks,)
    else:
        try:
            names = tuple(checks)
        except TypeError:
            raise ConfigError("checks", f"expected 'all', a check name or names, got {checks!r}",
                              "pass checks='all' or e.g. checks=['lora_optimizer']") from None
    unknown = [n for n in names if n not in CHECKS]
    if unknown or not names:
        raise ConfigError("checks", f"unknown check name(s) {unknown}" if unknown else "no check named",
                          f"use 'all' or names from {sorted(CHECKS)}")
    return names


def _innermost_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    """The user's optimizer under Accelerate's wrapper and a GuardedOptimizer (the audit must not count steps)."""
    seen: set[int] = set()
    while optimizer is not None and id(optimizer) not in seen:
        seen.add(id(optimizer))
        inner = getattr(optimizer, "optimizer", None)
        if inner is None:
            inner = getattr(optimizer, "base_optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            break
        optimizer = inner
    return optimizer if isinstance(optimizer, torch.optim.Optimizer) else None
