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
    "audit": "guardtower.audit",
    "lora_summary": "guardtower.audit",
    "is_peft_model": "guardtower.audit",
    "monitor": "guardtower.monitor",
    "Report": "guardtower.report",
    "Finding": "guardtower.report",
    "Severity": "guardtower.severity",
    "FailureMode": "guardtower.catalog",
    "CATALOG": "guardtower.catalog",
    "catalog": "guardtower.catalog",
    "catalog_markdown": "guardtower.catalog",
    # runtime guard
    "GuardedOptimizer": "guardtower.guard",
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
}

__all__ = ["__version__", *_EXPORTS]

if TYPE_CHECKING:
    from guardtower.audit import audit, is_peft_model, lora_summary
    from guardtower.bus import BaseSink, EventBus, Sink
    from guardtower.catalog import CATALOG, FailureMode, catalog, catalog_markdown
    from guardtower.errors import (
        ConfigError,
        GradientSpikeError,
        GuardtowerError,
        MissingDependencyError,
        NonFiniteActivation,
        PreflightFailed,
    )
    from guardtower.guard import GuardedOptimizer
    from guardtower.monitor import monitor
    from guardtower.report import Finding, Report
    from guardtower.severity import Severity
    from guardtower.sinks import ConsoleSink, JsonlSink
    from guardtower.testing import capture_events


# ``audit`` and ``monitor`` name both a submodule and the function in it. Importing a submodule binds the
# package attribute to the module, so these two are imported now: the function is bound last and stays.
from guardtower.audit import audit  # noqa: E402
from guardtower.monitor import monitor  # noqa: E402


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'guardtower' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
