"""Blind batches: real silent-bug reports reproduced by someone who does not write the audit's checks.

A batch module (``tests/_blind_batch<N>.py``) holds ``CASES: list[BlindCase]``. Each case builds the bug and
its fixed twin on a tiny model and proves the bug without the audit (``proof(True)`` and not ``proof(False)``).
``outcome()`` runs one ``audit()`` on each side. A case counts as caught when the bug side has a WARN or FAIL
finding whose catalog id the twin does not also raise at WARN or above (a difference the bug made); the twin
counts as a false alarm when it gets any WARN or FAIL. ``bench/blind.py`` prints a batch's figures;
``tests/test_audit_blind.py`` keeps them.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

from torch import nn

from guardtower.preflight import audit
from guardtower.severity import Severity

Case = tuple[nn.Module, Callable[[], Any], dict[str, Any]]


@dataclass(frozen=True)
class BlindCase:
    """One public report: the bug and its fixed twin (``build(bug)``), and a proof that needs no audit."""

    key: str
    source: str
    """the public thread (URL) the bug was reported in"""
    bug_class: str
    summary: str
    """one sentence: what goes silently wrong in training"""
    build: Callable[[bool], Case]
    proof: Callable[[bool], bool]
    """True when the bug is present in this setup (True for the bug, False for the twin)"""
    known_miss: str = ""
    """why the audit does not catch it, when it does not (filled in after the blind measurement)"""
    known_alarm: tuple[str, ...] = ()
    """catalog ids the fixed twin is known to get at WARN or above: false alarms written down, not hidden"""


@dataclass
class Outcome:
    """What one audit of each side reported."""

    key: str
    proven: bool
    caught_by: list[str] = field(default_factory=list)
    bug_loud: list[str] = field(default_factory=list)
    twin_loud: list[str] = field(default_factory=list)
    error: str = ""

    @property
    def caught(self) -> bool:
        return bool(self.caught_by)


def _loud(report: Any) -> list[tuple[str, str]]:
    return [(f.catalog_id, f"{f.severity.label} {f.catalog_id}: {f.message}") for f in report
            if f.severity >= Severity.WARN]


def outcome(case: BlindCase) -> Outcome:
    """Prove the case, then audit the bug and the twin once each."""
    try:
        proven = case.proof(True) and not case.proof(False)
        model, step, kwargs = case.build(True)
        bug = _loud(audit(model, step, **kwargs))
        model, step, kwargs = case.build(False)
        twin = _loud(audit(model, step, **kwargs))
    except Exception as exc:  # a broken reproduction is reported, not hidden
        return Outcome(case.key, False, error=f"{type(exc).__name__}: {exc}")
    twin_ids = {cid for cid, _ in twin}
    caught = sorted({cid for cid, _ in bug if cid not in twin_ids})
    return Outcome(case.key, proven, caught, [m for _, m in bug], [m for _, m in twin])


def load(batch: int) -> list[BlindCase]:
    """The cases of ``tests/_blind_batch<batch>.py``."""
    module = importlib.import_module(f"tests._blind_batch{batch}")
    cases: list[BlindCase] = module.CASES
    return cases
