"""What the Hugging Face and Lightning pre-flight callbacks share: their arguments and running the audit."""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable

from torch import nn

from guardtower._dist import current_rank
from guardtower._validate import flag
from guardtower.bus import EventBus, Sink, resolve_bus
from guardtower.errors import ConfigError
from guardtower.report import Report

__all__ = ["PreflightCallbackBase"]

logger = logging.getLogger("guardtower.integrations")


class PreflightCallbackBase:
    """Arguments validated at construction (an unknown check name fails now, not at the first batch), and an
    audit that keeps and prints its report; a bug in a check never stops a run the user did not ask to stop."""

    def __init__(self, *, raise_on_error: bool, checks: str | Iterable[str], verbose: bool,
                 sinks: Iterable[Sink] | None, bus: EventBus | None, fail_mlflow_run: bool) -> None:
        from guardtower.preflight._runner import select_checks

        if not isinstance(raise_on_error, bool):
            raise ConfigError("raise_on_error", f"expected True or False, got {raise_on_error!r}",
                              "pass raise_on_error=True to stop training on a failed pre-flight")
        select_checks(checks)
        self.checks = checks
        self.raise_on_error = raise_on_error
        self.verbose = flag("verbose", verbose)
        self.fail_mlflow_run = flag("fail_mlflow_run", fail_mlflow_run)
        self._bus, self._owns_bus = resolve_bus(bus, sinks)
        self.report: Report | None = None
        #: the run name the audit's events carry (set from the trainer when training starts)
        self.run: str | None = None

    def _audit(self, model: nn.Module, step_fn: Callable[[], Any], **kwargs: Any) -> Report | None:
        """``audit(model, step_fn, **kwargs)`` on this callback's bus and checks; None if the audit itself broke."""
        from guardtower.preflight import audit

        try:
            report = audit(model, step_fn, checks=self.checks, bus=self._bus, run=self.run, **kwargs)
        except ConfigError:
            raise
        except Exception:
            logger.warning("guardtower: the pre-flight audit itself failed; training continues", exc_info=True)
            return None
        self.report = report
        if self.verbose and current_rank() == 0:
            print(report, flush=True)
        return report

    def close(self) -> None:
        """Close the event bus if this callback created it."""
        if self._owns_bus:
            self._bus.close(5.0)
