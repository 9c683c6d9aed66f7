"""``audit()`` and the static runner behind ``lora_summary()``.

The runner validates arguments, snapshots the training state, runs the instrumented step, runs the selected
checks (a crashing check becomes an ``AUDIT-001`` finding), restores the state, and publishes one
``FindingEvent`` per finding plus a ``PreflightEvent`` on the bus.
"""

from __future__ import annotations

import time
import traceback
from typing import Any, Callable, Iterable

import torch
from torch import nn

from guardtower.preflight._future import measure_future_leak
from guardtower.preflight._value_reads import confirm_values_unread, gradientless_candidates
from guardtower.preflight._sample_leak import eval_pass
from guardtower.preflight._packing_reads import measure_packing_reads
from guardtower.preflight._padding_reads import measure_padding_reads
from guardtower.preflight._overfit import at_peak_lr, overfit_losses
from guardtower.preflight._batch import batch_mapping, confirm_padded_labels_ignored, labelled_padding
from guardtower.preflight._registry import CHECKS, AuditContext, CheckSpec
from guardtower.preflight._state import TrainingState
from guardtower.preflight._step import (
    confirm_given_inputs_ignored,
    confirm_input_independence,
    given_inputs_unused,
    run_step,
)
from guardtower.preflight._update import measure_update
from guardtower.preflight._schedule import ScheduleState, find_scheduler
from guardtower.preflight._cut_terms import mark_moving
from guardtower.preflight._self_updates import confirm_updated_by_step, no_grad_only
from guardtower.preflight._second_step import gradients_after_one_update, zero_gradients
from guardtower.preflight._util import base_optimizer, base_scheduler, companion_modules, is_causal_lm, is_library_model, unique_params
from guardtower._dist import multi_rank
from guardtower.bus import EventBus, Sink, resolve_bus
from guardtower.failure_modes import CATALOG
from guardtower.errors import ConfigError
from guardtower._runs import run_name
from guardtower._validate import flag
from guardtower.events import FindingEvent, PreflightEvent
from guardtower.report import Finding, Report
from guardtower.severity import Severity

__all__ = ["audit", "run_static", "select_checks", "FLUSH_TIMEOUT_S"]

#: how long ``audit()`` waits (in total) for the sinks of the bus it made before returning
FLUSH_TIMEOUT_S = 5.0


def select_checks(checks: str | Iterable[str], *, static_only: bool = False) -> list[CheckSpec]:
    """Resolve ``checks`` ("all", a name, or names) to registered checks, plus those that always run; ``ConfigError``
    for unknown names. "all" is in name order, so the report does not depend on which module registered first."""
    pool = {name: spec for name, spec in CHECKS.items() if spec.static or not static_only}
    if isinstance(checks, str):
        names = sorted(pool) if checks == "all" else [checks]
    else:
        try:
            names = list(checks)
        except TypeError:
            raise ConfigError("checks", f"expected 'all', a check name or an iterable of names, got {type(checks).__name__}",
                              "pass checks='all' or e.g. checks=['loss', 'grad_connectivity']") from None
    if not names:
        raise ConfigError("checks", "is empty: no check would run", "pass checks='all' or at least one check name")
    unknown = [n for n in names if not isinstance(n, str) or n not in pool]
    if unknown:
        kind = "static check" if static_only else "check"
        raise ConfigError("checks", f"unknown {kind} name(s) {unknown}", f"use 'all' or any of: {', '.join(sorted(pool))}")
    names += sorted(n for n, spec in pool.items() if spec.always)
    return [pool[n] for n in dict.fromkeys(names)]  # first occurrence order, duplicates dropped


def _validate_model(model: Any) -> None:
    if not isinstance(model, nn.Module):
        raise ConfigError("model", f"expected a torch.nn.Module, got {type(model).__name__}",
                          "pass the model itself (the object whose parameters you train)")


def _validate_optimizer(optimizer: Any) -> None:
    if optimizer is not None and not isinstance(getattr(optimizer, "param_groups", None), list):
        raise ConfigError("optimizer", f"expected a torch.optim.Optimizer, got {type(optimizer).__name__}",
                          "pass the optimizer you call .step() on, or leave it out")


def run_static(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    checks: str | Iterable[str] = "all",
    title: str = "guardtower static audit",
) -> Report:
    """Run the static checks (no forward or backward pass, nothing is modified) and return their report."""
    _validate_model(model)
    _validate_optimizer(optimizer)
    specs = select_checks(checks, static_only=True)
    ctx = AuditContext(model=model, optimizer=optimizer, inputs=None, scaler=None, params=unique_params(model))
    report = Report(checks_run=[s.name for s in specs], title=title)
    for spec in specs:
        report.findings.extend(_run_check(spec, ctx))
    return report


def audit(
    model: nn.Module,
    step_fn: Callable[[], Any],
    *,
    optimizer: torch.optim.Optimizer | None = None,
    inputs: Any = None,
    checks: str | Iterable[str] = "all",
    scaler: Any = None,
    lr_scheduler: Any = None,
    steps: int = 0,
    total_steps: int | None = None,
    sinks: Iterable[Sink] | None = None,
    bus: EventBus | None = None,
    run: str | None = None,
    verbose: bool = True,
) -> Report:
    """Run one instrumented training step and report the silent bugs it reveals.

    ``step_fn`` is a zero-argument callable returning the loss (a scalar tensor, or an object with ``.loss``
    such as a Hugging Face output); the audit runs backward itself. Parameters, buffers, gradients,
    optimizer state, RNG streams, ``training`` flags, the inputs' ``requires_grad`` and Accelerate's
    accumulation phase are restored bitwise, also when ``step_fn`` or a check raises. ``lr_scheduler``
    (optional) is looked ahead to catch a schedule that never leaves 0, and put back as it was. ``steps=N`` (optional) also runs N real optimizer steps on the
    one batch, at the schedule's peak lr, and checks that its loss falls (LOSS-009); everything is restored
    afterwards as well, and a progress line (tqdm when installed) shows the step and the time left unless
    ``verbose=False``. ``total_steps`` (optional) is the planned number of optimizer steps: the schedule is
    walked over the whole run at the cadence ``step_fn`` steps it. Without ``lr_scheduler=``, a scheduler
    attached to ``optimizer`` is found and walked the same way. ``run`` names the run in the events (default:
    ``GUARDTOWER_RUN`` or the active tracker run's name).
    """
    _validate_model(model)
    if not callable(step_fn):
        raise ConfigError("step_fn", f"expected a zero-argument callable, got {type(step_fn).__name__}",
                          "pass e.g. step_fn=lambda: loss_fn(model(x), y)")
    _validate_optimizer(optimizer)
    if lr_scheduler is not None and not callable(getattr(lr_scheduler, "step", None)):
        raise ConfigError("lr_scheduler", f"expected an LR scheduler with .step(), got {type(lr_scheduler).__name__}",
                          "pass the scheduler you step during training (e.g. get_linear_schedule_with_warmup(...)), "
                          "or leave it out")
    if scaler is not None and not (callable(getattr(scaler, "scale", None)) and callable(getattr(scaler, "unscale_", None))):
        raise ConfigError("scaler", f"expected a torch.amp.GradScaler, got {type(scaler).__name__}",
                          "pass the GradScaler your training loop uses, or leave it out")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ConfigError("steps", f"expected a whole number of overfitting steps >= 0, got {steps!r}",
                          "pass e.g. steps=30 to check that 30 steps on this batch drive its loss down, or leave it out")
    if total_steps is not None and (isinstance(total_steps, bool) or not isinstance(total_steps, int)
                                    or total_steps < 1):
        raise ConfigError("total_steps", f"expected the planned number of optimizer steps (a whole number >= 1), "
                          f"got {total_steps!r}", "pass e.g. total_steps=len(loader) * epochs // accumulation, "
                          "or leave it out")
    if run is not None and not isinstance(run, str):
        raise ConfigError("run", f"expected a str, got {type(run).__name__}", "pass a run name or None")
    verbose = flag("verbose", verbose)
    if steps and optimizer is None:
        raise ConfigError("steps", "overfitting one batch needs the optimizer",
                          "pass optimizer= together with steps=")
    specs = select_checks(checks)
    event_bus, owned = resolve_bus(bus, sinks)
    try:
        # torch.compile'd code runs eagerly under the audit: dynamo must not trace the audit's own hooks, and
        # the eager step is the same computation
        with torch.compiler.set_stance("force_eager"):
            if lr_scheduler is None and optimizer is not None:
                lr_scheduler = find_scheduler(base_optimizer(optimizer))
            lr_scheduler = base_scheduler(lr_scheduler)
            report = _audit(model, step_fn, optimizer, inputs, scaler, lr_scheduler, steps, total_steps, specs,
                            verbose)
        _publish(event_bus, report, run_name(run))
    finally:
        if owned:
            deadline = time.monotonic() + FLUSH_TIMEOUT_S
            event_bus.flush(FLUSH_TIMEOUT_S)
            event_bus.close(max(0.0, deadline - time.monotonic()))
    return report


def _audit(model: nn.Module, step_fn: Callable[[], Any], optimizer: Any, inputs: Any, scaler: Any,
           lr_scheduler: Any, steps: int, total_steps: int | None, specs: list[CheckSpec],
           verbose: bool = True) -> Report:
    ctx = AuditContext(model=model, optimizer=optimizer, inputs=inputs, scaler=scaler, params=unique_params(model),
                       lr_scheduler=lr_scheduler, total_steps=total_steps,
                       companions=companion_modules(step_fn, model))
    report = Report(checks_run=[s.name for s in specs])
    def counted_step() -> Any:  # counted: a step drawing next(iterator) consumes one batch per call
        report.step_fn_calls += 1
        return step_fn()

    needs = {n for s in specs for n in s.needs}
    state = TrainingState(model, optimizer, inputs, scaler)
    schedule = ScheduleState(lr_scheduler)  # a step_fn that steps the scheduler moves it: put it back too
    try:
        state.clear_grads()
        # a training step runs with autograd on, whatever context audit() was called from
        with torch.enable_grad(), state.isolated_optimizers():
            trace = run_step(ctx, counted_step, state.inputs, leak_analysis="leak" in needs)
        trace.unfrozen = _unfrozen(ctx, state)
        state.restore_values()
        if trace.phase == "step_fn" and trace.marked_inputs:
            # the model refuses inputs that require grad (wav2vec2 sets requires_grad on a view of its input):
            # the failure is the audit's own doing, so the step runs again as the user runs it
            report.notes.append(f"step_fn ran a second time, with the model's inputs left as given: the first run "
                                f"raised {type(trace.error).__name__} once the audit made them require grad")
            state.inputs.restore()
            state.restore_rng()
            state.clear_grads()
            with torch.enable_grad(), state.isolated_optimizers():
                trace = run_step(ctx, counted_step, state.inputs, leak_analysis="leak" in needs, mark_inputs=False)
            trace.unfrozen = _unfrozen(ctx, state)
            state.restore_values()
        if optimizer is not None and trace.backward and "update" in needs:
            for name, p in ctx.params.items():  # the trial step uses the audit's gradients
                p.grad = trace.grads.get(name)
            try:
                trace.update = measure_update(ctx)
            except Exception as exc:
                trace.update_error = exc
            state.restore_values()
        zero = zero_gradients(trace.grads) if "second_step" in needs and trace.error is None else []
        # a step that returns its loss needs the optimizer for the update; every rank would have to run it, or none
        if zero and (optimizer is not None or trace.user_backward) and not multi_rank():
            report.notes.append(f"step_fn ran twice more (then every value is put back): {len(zero)} tensor(s) got "
                                "an all-zero gradient, so the audit checked whether they get one once the step "
                                "has updated the weights")
            state.clear_grads()
            with state.isolated_optimizers():
                trace.flows_after_update = gradients_after_one_update(
                    counted_step, ctx.params, zero, state.restore_rng, optimizer, user_backward=trace.user_backward)
            state.restore_values()
        unread = (gradientless_candidates(model, trace.grads, trace.ran_with_grad, trace.ran)
                  if "value_reads" in needs and trace.error is None and not multi_rank() else [])
        if unread and isinstance(trace.loss, torch.Tensor):
            how = "with its own backward (weights put back)" if trace.user_backward else "without a backward"
            report.notes.append(f"step_fn ran {len(unread)} more time(s), {how}, each with the values of one "
                                "gradient-less module or parameter changed (and once unchanged, when the model holds "
                                "frozen copies the step may move itself): whether the loss reads them tells a cut "
                                "graph from values the step does not use")
            with state.isolated_optimizers():
                trace.unread = confirm_values_unread(model, counted_step, unread, trace.loss, state.restore_rng,
                                                     state.restore_weights)
            trace.value_checked = set(unread)
            state.restore_values()
        copies = (no_grad_only(ctx.params, trace.grads, trace.ran, trace.ran_with_grad)
                  if "self_updates" in needs and trace.error is None and trace.backward and not multi_rank() else [])
        if copies:
            report.notes.append(f"step_fn ran once more with the values of {len(copies)} gradient-less trainable "
                                "parameter(s) that ran only under no_grad changed (then put back): whether the step "
                                "updates them itself, as a momentum or EMA copy")
            with state.isolated_optimizers():
                trace.updated_by_step = confirm_updated_by_step(ctx.params, counted_step, copies, state.restore_rng)
            state.restore_values()
        cut = [t for t in ctx.probes.get("cut_terms", []) if t.dead_added]
        if cut and "cut_terms" in needs and trace.error is None and not multi_rank():
            report.notes.append(f"step_fn ran once more with the trained weights changed (then put back): {len(cut)} "
                                "term(s) without gradient are added to the loss, so the audit checked whether their "
                                "values move with the weights")
            with state.isolated_optimizers():
                mark_moving(ctx.probes["cut_terms"], [p for p in ctx.params.values() if p.requires_grad],
                            counted_step, state.restore_rng)
            state.restore_values()
        grads = trace.input_grads
        if ("input_independence" in needs and grads and all(not g for g in grads.values())
                and isinstance(trace.loss, torch.Tensor)):
            report.notes.append("step_fn ran a second time, without gradients and with the model's input replaced: "
                                "no gradient reached the input, so the audit checked whether the loss depends on it")
            with state.isolated_optimizers():
                trace.input_independent = confirm_input_independence(model, counted_step, trace.loss, state.restore_rng)
            state.restore_values()
        if ("input_independence" in needs and inputs is not None and isinstance(trace.loss, torch.Tensor)
                and trace.error is None and given_inputs_unused(inputs, trace.calls)):
            # a Lightning training_step calls the module's submodules, never the module itself: say that, not
            # that the batch did not reach the model
            why = ("no tensor of inputs= reached the model" if trace.calls else
                   "the model itself was never called (the step calls its submodules)")
            report.notes.append("step_fn ran once more, without gradients and with inputs= perturbed (then put back): "
                                f"{why}, so the audit checked whether the loss reads them")
            with state.isolated_optimizers():
                trace.given_inputs_ignored = confirm_given_inputs_ignored(counted_step, inputs, trace.loss,
                                                                          state.restore_rng)
            state.restore_values()
        if "future" in needs and trace.error is None and trace.backward and not is_causal_lm(model):
            # a library causal LM builds its own causal mask; a hand-written one may not
            trace.future_leak = measure_future_leak(ctx, state.restore_rng)
            if trace.future_leak is not None:
                report.notes.append("the model ran once more, in eval mode and without touching any weight: the "
                                    "loss predicts the next input token, so the audit checked that a prediction "
                                    "does not read later tokens")
            state.restore_values()
        probe = "leak" in needs and trace.user_backward
        if (probe or "eval_mode" in needs) and trace.error is None and trace.calls and not is_library_model(model):
            # dropout that ignores eval mode; and when step_fn ran the backward (its graph is gone), the
            # cross-sample probe on a graph of the audit's own
            leaks, trace.eval_dropouts = eval_pass(ctx, state.restore_rng, probe)
            if probe:
                trace.leak = leaks
                report.notes.append("the model ran once more, in eval mode and without touching any weight: step_fn "
                                    "runs backward itself, so the audit took its own gradient to check that each "
                                    "sample's prediction reads only its own input")
            state.restore_values()
        if "padding" in needs and trace.error is None and trace.calls and not is_library_model(model):
            # a library model applies its own mask; a hand-written one, or a wrapper's pooling, may not
            trace.padding_read = measure_padding_reads(ctx, state.restore_rng)
            if trace.padding_read is not None:
                report.notes.append("the model ran three more times on one padded row, in eval mode and without "
                                    "gradients: the batch marks padding, so the audit checked that cutting the "
                                    "padding off leaves the row's prediction unchanged")
            state.restore_values()
        if "packing" in needs and trace.error is None and trace.calls:
            trace.packing_read = measure_packing_reads(ctx, state.restore_rng)
            if trace.packing_read is not None:
                report.notes.append("the model ran twice more on the batch, in eval mode and without gradients: "
                                    "position_ids restart inside a row, so the audit checked that the row's later "
                                    "examples do not read its first one")
            state.restore_values()
        padding = labelled_padding(model, batch_mapping(inputs, trace.calls)) if "padded_labels" in needs else None
        if padding is not None and isinstance(trace.loss, torch.Tensor) and trace.error is None:
            how = "with its own backward (weights put back)" if trace.user_backward else "without gradients"
            report.notes.append(f"step_fn ran once more, {how} and with the labels on padding changed (then put "
                                "back): padding carries labels, so the audit checked whether the loss uses them")
            with state.isolated_optimizers():
                trace.padded_labels_ignored = confirm_padded_labels_ignored(counted_step, *padding, trace.loss,
                                                                            state.restore_rng,
                                                                            backward=trace.user_backward)
            state.restore_values()
        if steps and "overfit" in needs and trace.backward and trace.error is None:
            if trace.user_backward:
                report.notes.append(f"steps={steps} skipped: step_fn runs backward itself, so the audit cannot "
                                    "drive the overfitting steps")
            else:
                report.notes.append(f"step_fn ran {steps + 1} more times: steps={steps} overfits this batch with "
                                    "real optimizer steps (then every value is put back)")
                with state.isolated_optimizers():
                    trace.overfit_lrs = at_peak_lr(ctx)
                    trace.overfit_losses = overfit_losses(ctx, counted_step, steps, verbose=verbose)
                state.restore_values()
        # checks judge the model (and its schedule) as the user handed it over, not as the step left it
        schedule.restore()
        for spec in specs:
            report.findings.extend(_run_check(spec, ctx))
    finally:
        state.restore()
        schedule.restore()
    return report


def _unfrozen(ctx: AuditContext, state: TrainingState) -> set[str]:
    """The names of the parameters ``step_fn`` unfroze (read before the flags are put back)."""
    unfrozen = {id(p) for p in state.unfrozen()}
    return {name for name, p in ctx.params.items() if id(p) in unfrozen}


def _run_check(spec: CheckSpec, ctx: AuditContext) -> list[Finding]:
    """Run one check; a check that raises, or emits something that is not a catalogued finding it declared,
    becomes AUDIT-001."""
    try:
        findings = list(spec.fn(ctx))
        for f in findings:
            if not isinstance(f, Finding) or f.catalog_id not in CATALOG:
                raise TypeError(f"check emitted {f!r}, which is not a Finding with a catalog id")
            if f.catalog_id not in spec.emits:
                raise TypeError(f"check emitted {f.catalog_id}, which it does not declare in emits=")
        return findings
    except Exception as exc:
        where = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
        return [Finding(
            spec.name, Severity.ERROR,
            f"the {spec.name!r} check crashed ({type(exc).__name__}: {exc}); its verdict is unknown",
            "AUDIT-001",
            {"exception": type(exc).__name__, "error": str(exc)[:2000],
             "where": f"{where.filename}:{where.lineno} in {where.name}" if where else None},
        )]


def _publish(bus: EventBus, report: Report, run: str) -> None:
    for f in report.findings:
        bus.publish(FindingEvent(run=run, severity=f.severity, check=f.check, catalog_id=f.catalog_id, message=f.message,
                                 details=f.to_dict()["details"]))
    worst = max((f.severity for f in report.findings), default=Severity.INFO)
    bus.publish(PreflightEvent(
        run=run,
        severity=worst,
        status=report.status,
        errors=len(report.errors),
        warnings=len(report.warnings),
        infos=len(report.infos),
        error_ids=tuple(sorted({f.catalog_id for f in report.errors})),
        warning_ids=tuple(sorted({f.catalog_id for f in report.warnings})),
        info_ids=tuple(sorted({f.catalog_id for f in report.infos})),
        report=report.to_dict(),
    ))
