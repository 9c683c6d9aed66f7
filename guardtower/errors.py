"""Exceptions raised by guardtower.

    GuardtowerError                 root of everything guardtower raises on purpose
    ├── ConfigError                 a bad argument (also a ValueError); names the argument and the fix
    ├── MissingDependencyError      an optional extra is not installed (also an ImportError)
    ├── PreflightFailed             audit().raise_if_errors() found FAIL findings; carries .report
    ├── GradientSpikeError          GuardedOptimizer(nan_action="raise") rejected a step
    ├── NonFiniteActivation         monitor() saw a NaN/Inf activation
    └── LoopInvariantError          Watch(strict=True) saw a broken loop invariant; carries .finding
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from guardtower.report import Report

__all__ = [
    "GuardtowerError",
    "ConfigError",
    "MissingDependencyError",
    "PreflightFailed",
    "GradientSpikeError",
    "NonFiniteActivation",
    "LoopInvariantError",
]


class GuardtowerError(Exception):
    """Root of every exception guardtower raises on purpose."""


class ConfigError(GuardtowerError, ValueError):
    """A bad argument: the message names the argument and how to fix it."""

    def __init__(self, argument: str, problem: str, fix: str) -> None:
        self.argument = argument
        super().__init__(f"{argument}: {problem}. Fix: {fix}")


class MissingDependencyError(GuardtowerError, ImportError):
    """An integration needs an optional extra that is not installed."""

    def __init__(self, package: str, extra: str) -> None:
        self.package = package
        self.extra = extra
        super().__init__(
            f"{package} is not installed; install it with: pip install \"guardtower[{extra}]\"",
            name=package,
        )


class PreflightFailed(GuardtowerError):
    """The pre-flight audit found at least one FAIL finding."""

    def __init__(self, report: Report) -> None:
        self.report = report
        ids = ", ".join(sorted({f.catalog_id for f in report.errors}))
        super().__init__(f"pre-flight failed with {len(report.errors)} blocking issue(s): {ids}\n{report}")


class GradientSpikeError(GuardtowerError):
    """A guarded step was rejected and nan_action="raise" asked to stop training."""

    def __init__(self, step: int, layer: str, ratio: float, message: str = "") -> None:
        self.step = step
        self.layer = layer
        self.ratio = ratio
        super().__init__(message or f"gradient spike at step {step} in {layer} (ratio {ratio:.3g})")


class NonFiniteActivation(GuardtowerError):
    """A module's forward output contained NaN or Inf."""

    def __init__(self, module: str, input_nonfinite: bool, details: Any = None) -> None:
        self.module = module
        self.input_nonfinite = input_nonfinite
        self.details = details
        origin = "its input was already non-finite" if input_nonfinite else "its input was finite"
        super().__init__(f"non-finite output from module {module!r} ({origin})")


class LoopInvariantError(GuardtowerError):
    """The loop watch (``Watch(strict=True)``) saw a broken invariant; ``.finding`` is the published event."""

    def __init__(self, finding: Any) -> None:
        self.finding = finding
        super().__init__(f"{finding.catalog_id}: {finding.message}")
