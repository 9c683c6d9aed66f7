"""Realistic events for the bridge tests: what audit() and GuardedOptimizer publish."""

from __future__ import annotations

import json
from pathlib import Path

from guardtower.events import PreflightEvent, RollbackEvent, SkipEvent, SpikeEvent, SummaryEvent
from guardtower.report import Finding, Report
from guardtower.severity import Severity


def failing_report() -> Report:
    return Report(
        findings=[
            Finding("loss", Severity.ERROR, "the loss does not require grad (detached)", "LOSS-001"),
            Finding("optimizer_coverage", Severity.ERROR, "2 trainable parameters are not in the optimizer",
                    "OPT-001", {"params": ["fc2.weight", "fc2.bias"]}),
            Finding("dead_relu", Severity.WARN, "61% of ReLU units never fire", "RELU-001", {"fraction": 0.61}),
            Finding("weight_tying", Severity.INFO, "lm_head is tied to wte", "TIE-001"),
        ],
        checks_run=["loss", "optimizer_coverage", "dead_relu", "weight_tying"],
    )


def preflight_event(report: Report, *, run: str = "test-run", step: int | None = None) -> PreflightEvent:
    """Build the event the way audit() does: status, counts, catalog ids, full report."""
    return PreflightEvent(
        run=run, step=step, status=report.status,
        severity=Severity.ERROR if report.errors else (Severity.WARN if report.warnings else Severity.INFO),
        errors=len(report.errors), warnings=len(report.warnings), infos=len(report.infos),
        error_ids=tuple(f.catalog_id for f in report.errors),
        warning_ids=tuple(f.catalog_id for f in report.warnings),
        info_ids=tuple(f.catalog_id for f in report.infos),
        report=report.to_dict(),
    )


def spike_event(step: int, *, log_dir: Path | None = None, layer: str = "h.0.mlp.c_fc.weight",
                ratio: float = 42.0, run: str = "test-run", rank: int = 0) -> SpikeEvent:
    """A spike with, when ``log_dir`` is given, the JSON report file the guard writes next to it."""
    report_path = None
    if log_dir is not None:
        path = log_dir / f"spike_rank{rank}_step{step:07d}.json"
        path.write_text(json.dumps({"step": step, "layer": layer, "ratio": ratio, "top_layers": [[layer, 9.5, ratio]]}))
        report_path = str(path)
    return SpikeEvent(
        run=run, rank=rank, step=step, severity=Severity.WARN, layer=layer, module=layer.rsplit(".", 1)[0],
        norm=9.5, baseline=9.5 / ratio, ratio=ratio, threshold=10.0, global_norm=11.25, action="skip",
        loss=3.5, lr=1e-3, top_layers=((layer, 9.5, ratio),), report_path=report_path,
    )


def skip_event(step: int, total: int, *, run: str = "test-run", rank: int = 0) -> SkipEvent:
    return SkipEvent(run=run, rank=rank, step=step, severity=Severity.WARN, layer="h.0.mlp.c_fc.weight",
                     total_skips=total, consecutive_skips=1)


def rollback_event(step: int, total: int, *, run: str = "test-run") -> RollbackEvent:
    return RollbackEvent(run=run, step=step, severity=Severity.WARN, layer="h.1.attn.c_attn.weight",
                         from_step=step, to_step=step - 5, total_rollbacks=total)


def summary_event(step: int, *, grad_norm: float = 1.25, spikes: int = 0, skips: int = 0,
                  run: str = "test-run", rank: int = 0) -> SummaryEvent:
    return SummaryEvent(run=run, rank=rank, step=step, grad_norm=grad_norm, loss=2.0, lr=1e-3,
                        total_spikes=spikes, total_skips=skips)
