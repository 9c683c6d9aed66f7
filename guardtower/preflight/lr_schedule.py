"""``lr_schedule``: the learning rate over the whole planned run, at the cadence the step really runs the
scheduler. The schedule is walked on the real scheduler and optimizer (``_schedule.walk_schedule``) and put
back; the cadence is what ``step_fn`` did: how many ``scheduler.step()`` calls per ``optimizer.step()``."""

from __future__ import annotations

from typing import Any, Iterable

import torch

from guardtower.preflight._registry import AuditContext, check
from guardtower.preflight._schedule import MAX_WALK, Walk, walk_schedule
from guardtower.preflight._util import base_optimizer, base_scheduler
from guardtower.report import Finding
from guardtower.severity import Severity

__all__: list[str] = []

#: an lr at or below this share of the run's peak trains (close to) nothing
NEAR_ZERO = 1e-3
#: a schedule must not reach ~0 before this share of the planned run
EARLIEST_END = 0.9
#: the peak must be reached before this share of the planned run (else the run ends inside the warmup)
LATEST_PEAK = 0.9
#: a schedule is "per step" when its lr changes by more than this factor over the planned run
MOVES = 2.0
#: a schedule whose peak stays below this share of the optimizer's own lr never uses it (SCHED-005)
FAR_BELOW = 0.01
#: a schedule that never falls below this share of its peak after reaching it has hardly decayed (SCHED-006) ...
STILL_HIGH = 0.5
#: ... when walked on for this many times the planned run it does reach ~0
OUTLAST = 16
#: how far a restarted schedule is walked to see whether it moves, when neither the run nor the optimizer's
#: step count says more
_RESUME_HORIZON = 1000


def _planned(ctx: AuditContext) -> int | None:
    """The planned optimizer steps: ``total_steps=``, else a scheduler's own length (OneCycleLR)."""
    if ctx.total_steps:
        return ctx.total_steps
    own = getattr(ctx.lr_scheduler, "total_steps", None)
    return own if isinstance(own, int) and own > 1 else None


def _cadence(ctx: AuditContext) -> tuple[int | None, int]:
    """(scheduler steps per optimizer step that ``step_fn`` ran, optimizer steps it ran); (None, 0) when
    ``step_fn`` runs no optimizer step (the loop steps both outside it)."""
    events = ctx.trace.loop_events if ctx.trace is not None else []
    opt_steps = events.count("step")
    if not opt_steps:
        return None, 0
    return events.count("scheduler") // opt_steps, opt_steps


def _judge(walk: Walk, gi: int, base_lr: float | None = None) -> tuple[str, str, dict[str, object]] | None:
    lrs = walk.lrs[gi]
    peak = max(lrs)
    if peak <= 0:
        return None  # never above 0: OPT-004
    if base_lr is not None and base_lr > 0 and peak < FAR_BELOW * base_lr:
        return ("SCHED-005",
                f"param group {gi}'s lr peaks at {peak:.3g} over the {walk.planned:,} planned steps, "
                f"{base_lr / peak:.3g}x below the lr={base_lr:.3g} the optimizer was built with: the schedule's "
                "multiplier never comes near 1 (an lr_lambda that returns a learning rate instead of a factor "
                "multiplies the lr by itself)",
                {"group": gi, "peak_lr": peak, "base_lr": base_lr, "planned_steps": walk.planned})
    n = walk.planned
    top = next(k for k, lr in enumerate(lrs) if lr >= 0.99 * peak)
    low = [k for k, lr in enumerate(lrs) if k > top and lr <= NEAR_ZERO * peak]
    details: dict[str, object] = {"group": gi, "planned_steps": n, "walked_steps": len(lrs), "cadence": walk.cadence,
                                  "peak_lr": peak, "peak_step": top, "start_lr": lrs[0], "end_lr": lrs[-1]}
    if low and low[0] < EARLIEST_END * n:
        share = len(low) / n
        details.update(first_zero_step=low[0], zero_share=share)
        return ("SCHED-001",
                f"param group {gi}'s lr falls to ~0 at optimizer step {low[0]:,} of the {n:,} planned "
                f"({100 * share:.0f}% of the run at <= {NEAR_ZERO:g} x its peak {peak:.3g}): the schedule ends "
                "early (built for fewer steps than the run, or stepped faster than once per optimizer step)",
                details)
    if len(lrs) == n and top >= LATEST_PEAK * (n - 1) and lrs[-1] > lrs[0] * MOVES:
        return ("SCHED-002",
                f"param group {gi}'s lr is still rising at the end of the {n:,} planned optimizer steps "
                f"({lrs[0]:.3g} -> {lrs[-1]:.3g}, peak at step {top:,}): the run ends inside the warmup (warmup "
                "or schedule length counted in micro-batches or samples, not optimizer steps)", details)
    return None


def _outlasts(ctx: AuditContext, optimizer: torch.optim.Optimizer, walk: Walk,
              gi: int) -> tuple[str, str, dict[str, object]] | None:
    """SCHED-006: the lr stays near its peak over the whole run, on a schedule that decays to ~0 only well after
    it (a schedule that dips within the run and rises again is periodic, not sized for a longer run)."""
    lrs, n = walk.lrs[gi], walk.planned
    peak = max(lrs)
    if peak <= 0 or len(lrs) < n or n < 2 or n * OUTLAST * walk.cadence > MAX_WALK:
        return None
    risen = next(k for k, lr in enumerate(lrs) if lr > NEAR_ZERO * peak)
    if min(lrs[lrs.index(peak):]) < STILL_HIGH * peak or min(lrs[risen:]) <= NEAR_ZERO * peak:
        return None  # it decays within the run, or dips to ~0 and rises again (periodic, or resumed mid-run)
    longer = walk_schedule(ctx.lr_scheduler, optimizer, n * OUTLAST, walk.cadence)
    if longer is None or gi >= len(longer.lrs):
        return None
    later = longer.lrs[gi][n:]
    end = next((k for k, lr in enumerate(later, start=n) if lr <= NEAR_ZERO * peak), None)
    if end is None or end < 2 * n:  # a short run's last step sits high on a schedule that ends with it
        return None
    return ("SCHED-006",
            f"param group {gi}'s lr is still {lrs[-1]:.3g} ({100 * lrs[-1] / peak:.0f}% of its peak {peak:.3g}) at "
            f"the end of the {n:,} planned optimizer steps; the schedule reaches ~0 only at step {end:,}, "
            f"{end / n:.1f}x the run: its length is counted in micro-batches or samples, not optimizer steps, so "
            "the run never anneals",
            {"group": gi, "planned_steps": n, "end_lr": lrs[-1], "peak_lr": peak, "schedule_end_step": end})


#: schedules defined by a per-step factor or milestones alone, with no planned length that would tell their cadence
_NO_HORIZON = ("ExponentialLR", "StepLR", "MultiStepLR", "MultiplicativeLR")


@check("lr_schedule", emits=("SCHED-001", "SCHED-002", "SCHED-003", "SCHED-004", "SCHED-005", "SCHED-006"))
def check_lr_schedule(ctx: AuditContext) -> Iterable[Finding]:
    """SCHED-001 the lr reaches ~0 early, SCHED-002 the run ends inside the warmup, SCHED-003 a per-step
    schedule that the training step does not step once per optimizer step, SCHED-004 a schedule at its start
    driving an optimizer that has already trained (a resume that restored everything but the scheduler),
    SCHED-005 a schedule that never comes within 100x of the optimizer's own lr, SCHED-006 a schedule sized for
    a run several times longer than the planned one."""
    opt = base_optimizer(ctx.optimizer)
    if ctx.lr_scheduler is None or opt is None:
        return []
    restarted = _restarted(ctx.lr_scheduler, opt, _planned(ctx))
    if restarted is not None:
        return [restarted]
    planned = _planned(ctx)
    if planned is None:
        return []
    cadence, opt_steps = _cadence(ctx)
    if cadence == 0 and ctx.trace is not None and "scheduler" in ctx.trace.loop_events:
        # step_fn is several optimizer steps (an epoch) and steps the scheduler less often than the optimizer:
        # a per-epoch schedule stepped where it is meant to be; its horizon in epochs is unknown here
        return []
    findings: list[Finding] = []
    walk = walk_schedule(ctx.lr_scheduler, opt, planned, max(cadence or 1, 1))
    if walk is None:
        return []
    if cadence is not None and cadence != 1:
        per_step = walk_schedule(ctx.lr_scheduler, opt, planned, 1) if cadence == 0 else walk
        # a schedule not stepped by the step is judged per-step only when its horizon fits the planned run in
        # optimizer steps (walked once per step it moves, and neither ends early nor stays in warmup); one that
        # would end in a few percent of the run was planned per epoch, and stepping it elsewhere is right
        verdicts = [] if per_step is None else [_judge(per_step, gi) for gi in range(len(per_step.lrs))]
        fits = per_step is not None and all(v is None for v in verdicts)
        moves = fits and per_step is not None and any(
            max(s) > MOVES * max(min(s), 1e-30) or max(s) > 0 == min(s) for s in per_step.lrs)
        # a decay with no length of its own (ExponentialLR, StepLR) says nothing of its cadence: not stepped by a
        # step of one optimizer step, it may well be stepped per epoch outside; a step_fn that runs several
        # optimizer steps (an epoch) and no scheduler step leaves it unstepped
        horizon = type(ctx.lr_scheduler).__name__ not in _NO_HORIZON
        if cadence >= 2 or (moves and (horizon or opt_steps >= 2)):
            name = type(ctx.lr_scheduler).__name__
            findings.append(Finding(
                "lr_schedule", Severity.WARN,
                f"the training step ran {opt_steps} optimizer step(s) and {cadence * opt_steps} {name}.step() "
                f"call(s): a schedule planned in optimizer steps is stepped {cadence}x per optimizer step"
                + (" (it is not stepped with the optimizer: once per epoch, the run stays near its first lr "
                   f"{walk.lrs[0][0]:.3g})" if cadence == 0 else " (once per micro-batch?)"),
                "SCHED-003", {"scheduler_steps_per_optimizer_step": cadence, "optimizer_steps": opt_steps,
                              "scheduler": name},
            ))
        if cadence == 0:
            # how often the loop steps it outside step_fn is unknown; a warmup that outlasts the run stepped once
            # per optimizer step outlasts it at any slower cadence too (per epoch it stays near its first lr)
            warming = next((v for v in verdicts if v is not None and v[0] == "SCHED-002"), None)
            if warming is not None:  # then it does not fit: no SCHED-003 above
                cid, message, details = warming
                findings.append(Finding(
                    "lr_schedule", Severity.WARN,
                    message + f"; step_fn does not step the {type(ctx.lr_scheduler).__name__} with the optimizer, "
                    f"and stepped per epoch the lr stays near its first value {details['start_lr']:.3g}",
                    cid, {**details, "scheduler_steps_per_optimizer_step": 0}))
            return findings
    bases = [g.get("initial_lr") for g in opt.param_groups]
    for gi in range(len(walk.lrs)):
        base = bases[gi] if gi < len(bases) and isinstance(bases[gi], (int, float)) else None
        judged = _judge(walk, gi, float(base) if base is not None else None) or _outlasts(ctx, opt, walk, gi)
        if judged is not None:
            cid, message, details = judged
            findings.append(Finding("lr_schedule", Severity.WARN, message, cid, details))
            break  # one group tells; the others share the schedule
    return findings


#: schedulers that set every group's lr from their own arguments (``max_lr``, ``base_lr``), not from the group's
_OWN_LRS = ("OneCycleLR", "CyclicLR")


@check("schedule_groups", emits=("SCHED-007",), static=True)
def check_schedule_groups(ctx: AuditContext) -> Iterable[Finding]:
    """SCHED-007: a scheduler that writes each group's lr from its own argument, given one value for several param
    groups, which now hold the very same settings: a split into groups is made for settings that differ, and the
    scheduler's single value overwrote them."""
    opt = base_optimizer(ctx.optimizer)
    scheduler = base_scheduler(ctx.lr_scheduler) if ctx.lr_scheduler is not None else None
    name = type(scheduler).__name__
    if opt is None or name not in _OWN_LRS or len(opt.param_groups) < 2:
        return []
    settings = [{k: v for k, v in group.items() if k not in ("params", "name")} for group in opt.param_groups]
    if any(not group.get("params") for group in opt.param_groups) or any(s != settings[0] for s in settings[1:]):
        return []
    arg = "max_lr" if name == "OneCycleLR" else "base_lr and max_lr"
    return [Finding(
        "lr_schedule", Severity.WARN,
        f"{name} was given one {arg} for the optimizer's {len(opt.param_groups)} param groups, and every group now "
        f"holds the same settings (lr {float(settings[0].get('lr', 0.0)):.3g}, weight decay "
        f"{settings[0].get('weight_decay', 0.0)!r}): "
        f"{name} sets each group's lr from its own argument, so groups built with different lrs (a pretrained "
        f"backbone at lr/10) all train at one rate; pass one value per group ({arg.split()[0]}=[lr / 10, lr])",
        "SCHED-007", {"scheduler": name, "groups": len(opt.param_groups)},
    )]


#: a group's lr this far (relative) from the one its scheduler last set is not the schedule's
_LR_AGREES = 1e-2


def _behind_schedule(scheduler: Any, optimizer: torch.optim.Optimizer) -> Finding | None:
    """SCHED-004 on a resume that restored the scheduler and then let something write the lr back: the optimizer
    holds state (it has trained), the scheduler has stepped (``last_epoch > 0``), and a group's lr is not the one
    the scheduler last set (a scheduler built after ``optimizer.load_state_dict`` writes its first lr into the
    groups, and loading its own state afterwards does not write the restored one back)."""
    last = getattr(scheduler, "_last_lr", None)
    if not isinstance(last, list) or len(last) != len(optimizer.param_groups):
        return None
    if not any(isinstance(st, dict) and st for st in optimizer.state.values()):
        return None
    off = [(i, float(g["lr"]), float(want)) for i, (g, want) in enumerate(zip(optimizer.param_groups, last))
           if isinstance(want, (int, float))
           and abs(float(g["lr"]) - float(want)) > _LR_AGREES * max(abs(float(want)), 1e-30)]
    if not off:
        return None
    group, lr, want = off[0]
    return Finding(
        "lr_schedule", Severity.WARN,
        f"param group {group} trains at lr {lr:.3g}, but its {type(scheduler).__name__} (at step "
        f"{scheduler.last_epoch}) last set {want:.3g}: the resumed run starts at another learning rate "
        "than the schedule had reached (a scheduler built after optimizer.load_state_dict writes its first lr into "
        "the optimizer, and loading the scheduler's state does not write the restored one back); build and load "
        "the scheduler first and load the optimizer's state last",
        "SCHED-004", {"scheduler": type(scheduler).__name__, "group": group, "lr": lr, "scheduled_lr": want,
                      "last_epoch": scheduler.last_epoch},
    )


def _restarted(scheduler: Any, optimizer: torch.optim.Optimizer, planned: int | None) -> Finding | None:
    """SCHED-004: the scheduler has never stepped (``last_epoch == 0``) but the optimizer holds state from
    earlier steps (Adam's step count, momentum buffers), and the schedule moves: the run restarts its lr
    schedule (warmup again, decay from the top) while the weights and moments carry on."""
    if getattr(scheduler, "last_epoch", None) != 0:
        return _behind_schedule(scheduler, optimizer)
    states = [st for st in optimizer.state.values() if isinstance(st, dict) and st]
    if not states:
        return None
    counts = [float(st["step"]) for st in states if isinstance(st.get("step"), (int, float, torch.Tensor))]
    trained = int(max(counts)) if counts else None
    if trained == 0:
        return None
    walk = walk_schedule(scheduler, optimizer, max(planned or 0, trained or 0, _RESUME_HORIZON))
    if walk is None or not any(max(s) > MOVES * max(min(s), 1e-30) for s in walk.lrs):
        return None  # a constant schedule: starting it over changes nothing
    done = f"{trained:,} optimizer steps" if trained else "earlier steps (momentum buffers)"
    return Finding(
        "lr_schedule", Severity.WARN,
        f"{type(scheduler).__name__} is at its first step (last_epoch=0) while the optimizer already holds state "
        f"from {done}: a resumed run whose scheduler was not restored restarts the schedule (warmup and decay "
        "from the top) on trained weights; load the scheduler's state_dict with the optimizer's",
        "SCHED-004", {"scheduler": type(scheduler).__name__, "optimizer_steps": trained, "states": len(states)},
    )



@check("scheduler_binding", emits=("SCHED-008",))
def check_scheduler_binding(ctx: AuditContext) -> Iterable[Finding]:
    """SCHED-008: the step steps as many LR schedulers as optimizers, but one optimizer is driven by two of them and
    another by none: a scheduler built on the wrong optimizer (``get_linear_schedule_with_warmup(optimizer, ...)``
    where ``embedding_optimizer`` was meant), so one part trains at a constant lr with no warmup and no decay."""
    trace = ctx.trace
    if trace is None or trace.error is not None or len(trace.schedulers_stepped) < 2:
        return []
    stepped = [base_optimizer(o) for o in trace.stepped_optimizers]
    drivers: dict[int, list[Any]] = {}
    for scheduler in trace.schedulers_stepped:
        driven = base_optimizer(getattr(scheduler, "optimizer", None))
        if driven is not None:
            drivers.setdefault(id(driven), []).append(scheduler)
    if len(trace.schedulers_stepped) != len(stepped):
        return []
    twice = [o for o in stepped if o is not None and len(drivers.get(id(o), ())) >= 2]
    none = [o for o in stepped if o is not None and id(o) not in drivers]
    if not twice or not none:
        return []
    names = ", ".join(type(s).__name__ for s in drivers[id(twice[0])])
    unscheduled = ", ".join(f"{type(o).__name__} over {sum(len(g['params']) for g in o.param_groups)} tensors"
                            for o in none)
    return [Finding(
        "scheduler_binding", Severity.WARN,
        f"the step steps {len(stepped)} optimizers and {len(trace.schedulers_stepped)} LR schedulers, but two of "
        f"them ({names}) drive the same optimizer and {len(none)} optimizer(s) it steps ({unscheduled}) "
        "have none: a scheduler was built on the wrong optimizer, so those tensors train at their constant base lr "
        "(no warmup, no decay) while the other optimizer's lr is written twice; build each scheduler on the "
        "optimizer it is meant for",
        "SCHED-008", {"schedulers": len(trace.schedulers_stepped), "optimizers": len(stepped),
                      "unscheduled": len(none)},
    )]


@check("plateau_direction", emits=("SCHED-009",))
def check_plateau_direction(ctx: AuditContext) -> Iterable[Finding]:
    """SCHED-009: a ``ReduceLROnPlateau(mode="max")`` stepped with the value of a loss the step computed: a falling
    loss counts as no improvement, so the lr is cut while the model learns."""
    trace = ctx.trace
    if trace is None or trace.error is not None:
        return []
    losses = [c.value for c in ctx.probes.get("loss_calls", []) if c.value is not None]
    if isinstance(trace.loss, torch.Tensor) and trace.loss.numel() == 1:
        losses.append(float(trace.loss))
    for scheduler, metric in trace.plateau_metrics:
        if getattr(scheduler, "mode", "min") != "max" or metric == 0.0:
            continue
        if any(abs(metric - v) <= 1e-6 * abs(metric) for v in losses):
            return [Finding(
                "plateau_direction", Severity.WARN,
                f"ReduceLROnPlateau(mode='max') is stepped with {metric:.4g}, the value of a loss the step computed: "
                "in 'max' mode a falling loss counts as no improvement, so the lr is cut by its factor every "
                "patience + 1 steps while the model learns (and kept where it is when the loss rises); use "
                "mode='min' for a loss, 'max' for a score such as accuracy",
                "SCHED-009", {"metric": metric, "factor": getattr(scheduler, "factor", None)},
            )]
    return []
