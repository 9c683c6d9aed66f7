"""The runtime guard: ``GuardedOptimizer`` and its pluggable parts (detectors, actions, snapshots, reports)."""

from guardtower.guard.detector import (
    AutoDetector,
    Detector,
    PreUpdateEMADetector,
    RatioDetector,
    RollingSigmaDetector,
    Verdict,
    ZScoreDetector,
)
from guardtower.guard.actions import LowerLR
from guardtower.guard.budget import SkipBudget
from guardtower.guard.optimizer import GuardedOptimizer
from guardtower.guard.reports import SpikeReportSink, read_report
from guardtower.guard.watch import Watch

__all__ = [
    "GuardedOptimizer",
    "Watch",
    "SkipBudget",
    "LowerLR",
    "Detector",
    "Verdict",
    "AutoDetector",
    "RatioDetector",
    "ZScoreDetector",
    "PreUpdateEMADetector",
    "RollingSigmaDetector",
    "SpikeReportSink",
    "read_report",
]
