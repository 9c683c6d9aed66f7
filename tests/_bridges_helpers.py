"""Realistic events for the bridge tests: what audit() and GuardedOptimizer publish."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from guardtower.guard.reports import build_report, report_filename, write_json_atomic
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
                ratio: float = 42.0, run: str = "test-run", rank: int = 0, write_report: bool = True) -> SpikeEvent:
    """A spike; with ``log_dir`` it points at a report file there, written like the guard writes it
    (unless ``write_report`` is False: the guard's report sink has not got to it yet)."""
    report_path = str(log_dir / report_filename(step, rank)) if log_dir is not None else None
    event = SpikeEvent(
        run=run, rank=rank, step=step, severity=Severity.WARN, layer=layer, module=layer.rsplit(".", 1)[0],
        norm=9.5, baseline=9.5 / ratio, ratio=ratio, threshold=10.0, global_norm=11.25, action="skip",
        loss=3.5, lr=1e-3, top_layers=((layer, 9.5, ratio),), report_path=report_path,
    )
    if report_path is not None and write_report:
        write_json_atomic(Path(report_path), build_report(event))
    return event


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


SPIKE_STEP = 12  # the guard counts optimizer steps from 1


def audit_then_train(log_dir: Path, audit_sinks: list[Any], guard_sinks: list[Any], steps: int = 20) -> tuple[Report, Any]:
    """A user's script: a pre-flight audit that finds a missing optimizer param, then guarded training in
    which one step's gradient spikes (x1e4 on the last layer) and is skipped. Returns (report, guard)."""
    import torch
    from torch import nn

    from guardtower.preflight import audit
    from guardtower.guard import GuardedOptimizer

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    x, y = torch.randn(32, 8), torch.randn(32, 1)

    def step_fn() -> torch.Tensor:
        return nn.functional.mse_loss(model(x), y)

    buggy = torch.optim.SGD(model[0].parameters(), lr=1e-2)  # forgot the head
    report = audit(model, step_fn, optimizer=buggy, sinks=audit_sinks)
    guard = GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-2), model, sinks=guard_sinks,
                             log_dir=log_dir, warmup_steps=3, log_every=5, verbose=False, run="e2e")
    for i in range(1, steps + 1):
        guard.zero_grad()
        loss = step_fn()
        loss.backward()
        if i == SPIKE_STEP:
            model[2].weight.grad.mul_(1e4)
        guard.step(loss=loss.detach())
    guard.close()
    return report, guard
