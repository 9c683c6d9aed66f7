"""Record what the guard sees on a healthy run, replay detectors over it, and run the real guard live.

A trace holds, per optimizer step, every gradient tensor's norm (measured by the guard's own ``GradMeter``),
the global norm and the loss. Incident observations are recorded at chosen steps *without being applied*:
a gradient scaled on one tensor (the norms scale exactly, so they are computed from the healthy ones),
NaN/Inf in one gradient, and a corrupted batch (a real forward/backward whose gradients are then thrown
away, BatchNorm buffers restored). A replay feeds a detector the healthy steps exactly as the guard does
(judge, then update with accept = not rejected) and judges each incident against the state it would have met.
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor, nn

from guardtower.errors import GradientSpikeError
from guardtower.guard import GuardedOptimizer
from guardtower.guard._measure import GradMeter
from guardtower.guard.detector import Detector

__all__ = ["Incident", "Trace", "ReplayResult", "KINDS", "plan", "record", "replay", "live", "global_of"]

MAX_CONSECUTIVE = 20  # GuardedOptimizer's default max_consecutive_skips: the replay counts a run as stopped there
SCALES = {"x100": 1e2, "x1e3": 1e3, "x1e4": 1e4}
KINDS = tuple(f"{s}-{size}" for s in SCALES for size in ("small", "large")) + ("nan", "inf", "batch")


@dataclass
class Incident:
    step: int
    kind: str
    phase: str  # "early" (first 50 steps) or "late" (last third)
    norms: Tensor
    global_norm: Tensor
    loss: Tensor


@dataclass
class Trace:
    name: str
    names: list[str]
    norms: Tensor  # [T, n]
    global_norm: Tensor  # [T]
    loss: Tensor  # [T], NaN where no loss was seen
    incidents: list[Incident] = field(default_factory=list)
    final_loss: float = math.nan
    diverged: bool = False


def global_of(norms: Tensor) -> Tensor:
    return torch.linalg.vector_norm(norms, dim=-1)


def plan(steps: int, kinds: tuple[str, ...] = KINDS) -> dict[int, tuple[str, str]]:
    """Step -> (kind, phase): every kind once early (steps 15..49) and once late (the last third)."""
    out: dict[int, tuple[str, str]] = {}
    early = [15 + round(i * 34 / max(1, len(kinds) - 1)) for i in range(len(kinds))]
    start = (2 * steps) // 3
    late = [start + round(i * (steps - start - 2) / max(1, len(kinds) - 1)) for i in range(len(kinds))]
    for kind, e, lt in zip(kinds, early, late):
        out[e] = (kind, "early")
        out[lt] = (kind, "late")
    return out


def _targets(params: list[Tensor]) -> dict[str, int]:
    """The smallest and the largest trainable tensor (by element count)."""
    sizes = [(p.numel(), i) for i, p in enumerate(params) if p.requires_grad]
    return {"small": min(sizes)[1], "large": max(sizes)[1]}


def synthetic(kind: str, norms: Tensor, targets: dict[str, int]) -> Tensor:
    """The norms of a step whose gradient on one tensor was scaled, or made NaN/Inf."""
    out = norms.clone()
    if kind in ("nan", "inf"):
        out[targets["small"]] = math.nan if kind == "nan" else math.inf
    else:
        scale, size = kind.split("-")
        out[targets[size]] *= SCALES[scale]
    return out


def _buffers(model: nn.Module) -> list[Tensor]:
    return [b.detach().clone() for b in model.buffers()]


def _restore(model: nn.Module, saved: list[Tensor]) -> None:
    with torch.no_grad():
        for b, s in zip(model.buffers(), saved):
            b.copy_(s)


def param_names(model: nn.Module, params: list[Tensor]) -> list[str]:
    by_id = {id(p): n for n, p in model.named_parameters()}
    return [by_id.get(id(p), f"param{i}") for i, p in enumerate(params)]


def record(config: Any, seed: int = 0, incidents: dict[int, tuple[str, str]] | None = None,
           steps: int | None = None, event: Callable[[int, nn.Module, torch.optim.Optimizer], None] | None = None,
           ) -> Trace:
    """Train ``config`` unguarded and record what a guard would have judged at every step."""
    model, opt, lr_mult, batches = config.build(seed)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_mult)
    params = [p for g in opt.param_groups for p in g["params"]]
    meter = GradMeter(torch.device("cpu"))
    targets = _targets(params)
    total = steps or config.steps
    plan_ = incidents or {}
    rows, losses, found = [], [], []
    model.train()
    for step in range(total):
        if event is not None:
            event(step, model, opt)
        batch = next(batches)
        kind_phase = plan_.get(step)
        if kind_phase is not None and kind_phase[0] == "batch":
            saved = _buffers(model)
            bad_loss = config.loss(model, config.corrupt(model, batch))
            bad_loss.backward()
            bad = meter.norms(params).detach().clone()
            found.append(Incident(step, "batch", kind_phase[1], bad, global_of(bad), bad_loss.detach().float()))
            _restore(model, saved)
            opt.zero_grad(set_to_none=True)
        loss = config.loss(model, batch)
        loss.backward()
        norms = meter.norms(params).detach().clone()
        rows.append(norms)
        losses.append(loss.detach().float())
        if kind_phase is not None and kind_phase[0] != "batch":
            bad = synthetic(kind_phase[0], norms, targets)
            found.append(Incident(step, kind_phase[0], kind_phase[1], bad, global_of(bad), loss.detach().float()))
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if not math.isfinite(float(loss.detach())):
            break
    norms_t = torch.stack(rows)
    loss_t = torch.stack(losses)
    tail = loss_t[-20:]
    return Trace(config.name, param_names(model, params), norms_t, global_of(norms_t), loss_t, found,
                 float(tail.mean()), not bool(torch.isfinite(loss_t).all()))


@dataclass
class ReplayResult:
    steps: int
    false_alarms: int
    stopped_at: int | None
    absorbed: int
    caught: dict[tuple[str, str], bool]  # (kind, phase) -> rejected


def _decide(detector: Detector, norms: Tensor, global_norm: Tensor, loss: Tensor) -> tuple[Tensor, Any]:
    """As the guard decides: the verdict, plus a non-finite gradient unless the detector judges that itself."""
    if not math.isfinite(float(loss)):
        loss = torch.tensor(detector.absent_loss)  # the traces mark a missing loss with NaN
    verdict = detector.judge(norms, global_norm, loss)
    if detector.judges_nonfinite:
        return verdict.spike, verdict
    nonfinite = ~torch.isfinite(norms).all() | ~torch.isfinite(global_norm)
    return verdict.spike | nonfinite, verdict


def replay(detector: Detector, trace: Trace, use_loss: bool = True,
           override: dict[int, tuple[Tensor, Tensor]] | None = None) -> tuple[ReplayResult, list[bool]]:
    """Feed ``trace`` to ``detector`` as the guard would; ``override`` replaces some steps' observations.

    Returns the result and, per step, whether the step was rejected.
    """
    n = trace.norms.shape[1]
    detector.resize(n, torch.device("cpu"))
    nan = torch.tensor(math.nan)
    by_step: dict[int, list[Incident]] = {}
    for inc in trace.incidents:
        by_step.setdefault(inc.step, []).append(inc)
    false_alarms, consecutive, absorbed = 0, 0, 0
    stopped: int | None = None
    caught: dict[tuple[str, str], bool] = {}
    rejected: list[bool] = []
    for t in range(trace.norms.shape[0]):
        for inc in by_step.get(t, ()):
            reject, _ = _decide(detector, inc.norms, inc.global_norm, inc.loss if use_loss else nan)
            caught[(inc.kind, inc.phase)] = bool(reject)
        norms, global_norm = trace.norms[t], trace.global_norm[t]
        if override and t in override:
            norms, global_norm = override[t]
        loss = trace.loss[t] if use_loss else nan
        reject, verdict = _decide(detector, norms, global_norm, loss)
        detector.update(norms, global_norm, loss, reject)
        r = bool(reject)
        rejected.append(r)
        absorbed += int(bool(verdict.absorbed) and not r)  # a rejected step re-baselines nothing
        if r and not (override and t in override):
            false_alarms += 1
        consecutive = consecutive + 1 if r else 0
        if consecutive >= MAX_CONSECUTIVE and stopped is None:
            stopped = t
    return ReplayResult(trace.norms.shape[0], false_alarms, stopped, absorbed, caught), rejected


@dataclass
class LiveResult:
    steps: int
    rejected: int
    stopped_at: int | None
    final_loss: float
    caught: dict[tuple[str, str], bool]
    first_loss: float


def live(config: Any, seed: int = 0, incidents: dict[int, tuple[str, str]] | None = None, steps: int | None = None,
         event: Callable[[int, nn.Module, torch.optim.Optimizer], None] | None = None,
         **guard_kwargs: Any) -> LiveResult:
    """Train ``config`` through a real ``GuardedOptimizer`` (defaults unless ``guard_kwargs``), incidents applied."""
    model, opt, lr_mult, batches = config.build(seed)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_mult)
    params = [p for g in opt.param_groups for p in g["params"]]
    targets = _targets(params)
    plan_ = incidents or {}
    total = steps or config.steps
    caught: dict[tuple[str, str], bool] = {}
    losses: list[float] = []
    stopped: int | None = None
    with tempfile.TemporaryDirectory() as logs:
        guard = GuardedOptimizer(opt, model, verbose=False, log_dir=logs, **guard_kwargs)
        model.train()
        for step in range(total):
            if event is not None:
                event(step, model, guard)
            batch = next(batches)
            kind_phase = plan_.get(step)
            if kind_phase is not None and kind_phase[0] == "batch":
                batch = config.corrupt(model, batch)
            loss = config.loss(model, batch)
            loss.backward()
            if kind_phase is not None and kind_phase[0] != "batch":
                _apply(kind_phase[0], params, targets)
            before = guard.total_spikes
            try:
                guard.step(loss=loss.detach())
                guard.flush()
            except GradientSpikeError:
                stopped = step
                break
            finally:
                guard.zero_grad(set_to_none=True)
            if kind_phase is not None:
                caught[kind_phase] = guard.total_spikes > before
            sched.step()
            if kind_phase is None:  # the final loss is the run's, not an incident batch's
                losses.append(float(loss.detach()))
        rejected = guard.total_spikes
        guard.close()
    tail = [x for x in losses[-20:]]
    done = total if stopped is None else stopped
    return LiveResult(done, rejected, stopped, sum(tail) / max(1, len(tail)), caught,
                      sum(losses[:5]) / max(1, len(losses[:5])))


def _apply(kind: str, params: list[Tensor], targets: dict[str, int]) -> None:
    with torch.no_grad():
        if kind in ("nan", "inf"):
            grad = params[targets["small"]].grad
            assert grad is not None
            grad.view(-1)[0] = math.nan if kind == "nan" else math.inf
        else:
            scale, size = kind.split("-")
            grad = params[targets[size]].grad
            assert grad is not None
            grad.mul_(SCALES[scale])
