"""guardtower: stop PyTorch training from silently wasting GPU-hours.

The public API is listed in ``__all__``. Names resolve lazily on first use, so ``import guardtower`` stays
cheap and never imports an optional integration (wandb, mlflow, transformers, peft, requests, tenacity).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    # pre-flight
    "audit": "guardtower.preflight",
    "lora_summary": "guardtower.preflight",
    "is_peft_model": "guardtower.preflight",
    "monitor": "guardtower.nonfinite_watch",
    "Report": "guardtower.report",
    "Finding": "guardtower.report",
    "Severity": "guardtower.severity",
    "FailureMode": "guardtower.failure_modes",
    "CATALOG": "guardtower.failure_modes",
    "catalog": "guardtower.failure_modes",
    "catalog_markdown": "guardtower.failure_modes",
    # runtime guard
    "GuardedOptimizer": "guardtower.guard",
    "Watch": "guardtower.guard",
    # events, bus, sinks
    "EventBus": "guardtower.bus",
    "BaseSink": "guardtower.bus",
    "Sink": "guardtower.bus",
    "JsonlSink": "guardtower.sinks",
    "ConsoleSink": "guardtower.sinks",
    "capture_events": "guardtower.testing",
    # errors
    "GuardtowerError": "guardtower.errors",
    "ConfigError": "guardtower.errors",
    "MissingDependencyError": "guardtower.errors",
    "PreflightFailed": "guardtower.errors",
    "GradientSpikeError": "guardtower.errors",
    "NonFiniteActivation": "guardtower.errors",
    "LoopInvariantError": "guardtower.errors",
}

__all__ = ["__version__", *_EXPORTS]

if TYPE_CHECKING:
    from guardtower.preflight import audit, is_peft_model, lora_summary
    from guardtower.bus import BaseSink, EventBus, Sink
    from guardtower.failure_modes import CATALOG, FailureMode, catalog, catalog_markdown
    from guardtower.errors import (
        ConfigError,
        GradientSpikeError,
        GuardtowerError,
        LoopInvariantError,
        MissingDependencyError,
        NonFiniteActivation,
        PreflightFailed,
    )
    from guardtower.guard import GuardedOptimizer, Watch
    from guardtower.nonfinite_watch import monitor
    from guardtower.report import Finding, Report
    from guardtower.severity import Severity
    from guardtower.sinks import ConsoleSink, JsonlSink
    from guardtower.testing import capture_events


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'guardtower' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
