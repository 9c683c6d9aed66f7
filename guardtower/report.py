"""Findings and the pre-flight report."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

from guardtower._render import box
from guardtower.errors import ConfigError, PreflightFailed
from guardtower.failure_modes import CATALOG
from guardtower.severity import Severity

__all__ = ["Finding", "Report", "Severity"]


@dataclass(frozen=True)
class Finding:
    """One problem (or fact) a check found, linked to its catalog entry."""

    check: str
    severity: Severity
    message: str
    catalog_id: str
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "check": self.check,
            "severity": self.severity.label,
            "message": self.message,
            "catalog_id": self.catalog_id,
            "details": _json_safe(self.details),
        }


@dataclass
class Report:
    """What an audit (or ``lora_summary``) found. ``ok`` means no FAIL finding.

    A report iterates and counts its findings (``for f in report``, ``len(report)``). It has no truth value:
    ``if report:`` would read as "passed" to some and "found something" to others, so ``bool(report)``
    raises ``TypeError`` naming ``report.ok`` and ``len(report)``.
    """

    findings: list[Finding] = field(default_factory=list)
    checks_run: list[str] = field(default_factory=list)
    title: str = "guardtower pre-flight"
    step_fn_calls: int = 0
    """how many times the audit called ``step_fn`` (1 normally; ``notes`` says why when more)"""
    notes: list[str] = field(default_factory=list)

    def __iter__(self) -> Iterator[Finding]:
        return iter(self.findings)

    def __len__(self) -> int:
        return len(self.findings)

    def __bool__(self) -> bool:
        raise TypeError("a Report has no truth value: use report.ok (no FAIL finding) or len(report) "
                        "(number of findings)")

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity is Severity.ERROR]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.severity is Severity.WARN]

    @property
    def infos(self) -> list[Finding]:
        return [f for f in self.findings if f.severity is Severity.INFO]

    @property
    def ok(self) -> bool:
        return not self.errors

    @property
    def status(self) -> str:
        """``PASS`` or ``FAIL``."""
        return "PASS" if self.ok else "FAIL"

    def by_check(self, name: str) -> list[Finding]:
        """Findings of the check ``name`` (e.g. ``"lora_optimizer"``); ``ConfigError`` for a name that is no check."""
        import guardtower.preflight  # noqa: F401  (registers every check)
        from guardtower.preflight._registry import CHECKS

        if not isinstance(name, str) or name not in CHECKS:
            raise ConfigError("name", f"{name!r} is not a check name", f"use one of: {', '.join(sorted(CHECKS))}")
        return [f for f in self.findings if f.check == name]

    def by_id(self, catalog_id: str) -> list[Finding]:
        """Findings with this catalog id; ``ConfigError`` for an id that is not in the catalog (a typo)."""
        if catalog_id not in CATALOG:
            close = sorted(i for i in CATALOG if i.split("-")[0] == str(catalog_id).split("-")[0].upper())
            raise ConfigError("catalog_id", f"{catalog_id!r} is not a catalog id",
                              f"use one of {', '.join(close) if close else ', '.join(sorted(CATALOG))}")
        return [f for f in self.findings if f.catalog_id == catalog_id]

    def raise_if_errors(self) -> "Report":
        """Raise ``PreflightFailed`` (carrying this report) when there is a FAIL finding; else return self."""
        if self.errors:
            raise PreflightFailed(self)
        return self

    def summary(self) -> str:
        """One line: status and counts."""
        return (
            f"{self.status}: {len(self.errors)} error(s), {len(self.warnings)} warning(s), "
            f"{len(self.infos)} info(s) from {len(self.checks_run)} check(s)"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "summary": self.summary(),
            "checks_run": list(self.checks_run),
            "step_fn_calls": self.step_fn_calls,
            "notes": list(self.notes),
            "findings": [f.to_dict() for f in self.findings],
        }

    def __str__(self) -> str:
        lines = [self.summary(), ""]
        ordered = sorted(self.findings, key=lambda f: (-int(f.severity), f.check))
        for f in ordered:
            lines.append(f"[{f.severity.label:<4}] {f.catalog_id:<9} {f.check}: {f.message}")
        if not ordered:
            lines.append("no findings")
        lines += [f"note: {note}" for note in self.notes]
        return box(f"{self.title}: {self.status}", lines)


def _json_safe(value: Any) -> Any:
    """Details hold numbers, strings and lists of them; anything else becomes its string."""
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_json_safe(v) for v in value]
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else str(value)
    if value is None or isinstance(value, (str, int, bool)):
        return value
    try:
        return float(value)  # numpy / python scalar likes
    except (TypeError, ValueError):
        return str(value)
