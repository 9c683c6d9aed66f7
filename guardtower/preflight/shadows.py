"""Copies of the weights kept beside them: an EMA shadow, a mean teacher, a target network, an SWA average.

Each update of such a copy moves it toward the live weights (``s -= (1 - decay) * (s - p)``, ``lerp_``, a hard
``copy_``), whatever the decay. A flipped sign or a missing term pushes it away instead: the loss curve is that of
the live model and looks normal, while the copy that gets evaluated and saved drifts off. The probe sees the
in-place writes ``step_fn`` makes outside any optimizer step once an optimizer has stepped, keeps the value each
written tensor had before, and at the end of ``step_fn`` compares both with the trainable tensor it copies. It also
counts the micro-batch windows (backward passes run so far) each copy is written in, before the optimizer step as
well: an average is updated once per optimizer step, not once per micro-batch.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from guardtower.preflight._registry import AuditContext, check, probe
from guardtower.preflight._util import patched
from guardtower.report import Finding
from guardtower.severity import Severity

#: the in-place writes an update of a copy is spelled with
_METHODS = ("mul_", "add_", "sub_", "div_", "lerp_", "copy_")
_FOREACH = tuple(name for name in ("_foreach_mul_", "_foreach_add_", "_foreach_sub_", "_foreach_lerp_",
                                   "_foreach_copy_") if hasattr(torch, name))
#: elements of written tensors kept (their value before the write), at most
_MAX_ELEMENTS = 1 << 24
#: a written tensor is a copy of the trainable tensor nearest to it when it was this close (relative) before
_COPY_DISTANCE = 0.5
#: the update moved the copy back along its gap to the tensor (cosine at most minus this), or scaled it toward
#: zero (a decay whose ``(1 - decay) * p`` term is missing: the update is minus the copy itself, nearly exactly)
_AWAY_COSINE = 0.9
_SHRINK_COSINE = 0.99
#: an update smaller than this share of the copy is rounding, not a direction
_MIN_CHANGE = 1e-6


@dataclass
class Drift:
    """A copy the step moved away from the trainable tensor it copies."""

    param: str
    before: float
    """distance from the copy to the tensor (the tensor's value at the end of ``step_fn``) before its update"""
    after: float


@dataclass
class ShadowRecord:
    saved: dict[tuple[int, tuple[int, ...]], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    """(storage address, shape) of each tensor written -> (the tensor, its value before the first write)"""
    storage: set[int] = field(default_factory=set)
    """storage addresses of every tensor written (kept after ``saved`` is released)"""
    early: dict[tuple[int, tuple[int, ...]], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    """the same for tensors first written before any optimizer step ran (judged for their cadence only)"""
    windows: dict[tuple[int, tuple[int, ...]], set[int]] = field(default_factory=dict)
    """each tensor written -> the backward passes that had run at each of its writes (its micro-batch windows)"""
    optimizer_steps: int = 0
    written: int = 0
    """copies judged (written tensors that were near a trainable tensor of their shape)"""
    drifts: list[Drift] = field(default_factory=list)
    too_often: list[tuple[str, int]] = field(default_factory=list)
    """copies written in more micro-batch windows than the step ran optimizer steps: (tensor copied, windows)"""


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    na, nb = float(a.norm()), float(b.norm())
    return float((a * b).sum()) / (na * nb) if na > 0 and nb > 0 else 0.0


def _nearest(before: torch.Tensor, candidates: dict[torch.Size, list[tuple[str, torch.Tensor]]]
             ) -> tuple[float, str, torch.Tensor] | None:
    """(distance, name, value) of the trainable tensor of ``before``'s shape it is a near copy of, if any."""
    before = before.float()
    dist, name, live = min(((float((before - p.detach().float()).norm()), n, p.detach().float())
                            for n, p in candidates[before.shape]), key=lambda c: c[0])
    return (dist, name, live) if dist <= _COPY_DISTANCE * float(live.norm()) else None


def _judge(record: ShadowRecord, candidates: dict[torch.Size, list[tuple[str, torch.Tensor]]]) -> None:
    """Pair each written tensor with the trainable tensor of its shape it was nearest to, and keep those that
    ended farther from it, moved back along their gap (a sign flip) or toward zero (a decay missing a term), and
    those written in more micro-batch windows than the step ran optimizer steps (an EMA updated per micro-batch:
    it decays k times per step, k - 1 of them toward weights that have not changed)."""
    for key, (_, first) in {**record.saved, **record.early}.items():  # a tensor's value before its first write
        windows = record.windows.get(key, set())
        if len(windows) >= 2 and len(windows) > record.optimizer_steps:
            near = _nearest(first, candidates)
            if near is not None:
                record.too_often.append((near[1], len(windows)))
    for tensor, before in record.saved.values():
        after = tensor.detach().float()
        before = before.float()
        near = _nearest(before, candidates)
        if near is None:
            continue
        dist, name, live = near
        record.written += 1
        delta = after - before
        moved = float((after - live).norm())
        if moved > dist and float(delta.norm()) > _MIN_CHANGE * float(before.norm()) and (
                _cosine(delta, live - before) < -_AWAY_COSINE or _cosine(delta, before) < -_SHRINK_COSINE):
            record.drifts.append(Drift(name, dist, moved))


@probe("shadows")
@contextlib.contextmanager
def _shadows_probe(ctx: AuditContext) -> Iterator[ShadowRecord]:
    record = ShadowRecord()
    ctx.probes["shadows"] = record
    candidates: dict[torch.Size, list[tuple[str, torch.Tensor]]] = {}
    for n, p in ctx.params.items():
        if p.requires_grad and p.dim() >= 2 and p.is_floating_point():
            candidates.setdefault(p.shape, []).append((n, p))
    own = {p.data_ptr() for _, ps in candidates.items() for _, p in ps}
    steps = [0, 0]  # optimizer steps finished, optimizer steps running (a subclass's step runs both hooks)
    room = [_MAX_ELEMENTS]

    def note(t: Any) -> None:
        if steps[1] or not isinstance(t, torch.Tensor) or t.shape not in candidates:
            return
        if not t.is_floating_point() or t.is_sparse or t.device.type == "meta":
            return
        ptr = t.data_ptr()
        key = (ptr, tuple(t.shape))
        if ptr in own or any(p.grad is not None and p.grad.data_ptr() == ptr for _, p in candidates[t.shape]):
            return  # a trainable tensor, or a gradient rescaled by hand: not a copy
        if key in record.windows or t.numel() <= room[0]:
            trace = ctx.trace
            record.windows.setdefault(key, set()).add(trace.backward_calls if trace is not None else 0)
        kept = record.saved if steps[0] else record.early
        if key in record.saved or key in kept or t.numel() > room[0]:
            return
        room[0] -= t.numel()
        kept[key] = (t, t.detach().clone())
        if steps[0]:
            record.storage.add(ptr)

    def method(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                note(self)
            except Exception:  # observing must never change what the step does
                pass
            return original(self, *args, **kwargs)

        return wrapper

    def foreach(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def wrapper(targets: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                for t in targets:
                    note(t)
            except Exception:
                pass
            return original(targets, *args, **kwargs)

        return wrapper

    def began(*_: Any) -> None:
        steps[1] += 1

    def ended(*_: Any) -> None:
        steps[1] -= 1
        if steps[1] == 0:
            steps[0] += 1

    if not candidates:
        yield record
        return
    patches: list[tuple[Any, str, Callable[[Any], Any]]] = [(torch.Tensor, name, method) for name in _METHODS]
    patches += [(torch, name, foreach) for name in _FOREACH]
    handles = [register_optimizer_step_pre_hook(began), register_optimizer_step_post_hook(ended)]
    try:
        with patched(patches):
            yield record
    finally:
        for h in handles:
            h.remove()
        record.optimizer_steps = steps[0]
        try:
            with torch.no_grad():
                _judge(record, candidates)  # now: the audit may put the weights back before the checks run
        finally:
            record.saved.clear()
            record.early.clear()


def written_storage(ctx: AuditContext) -> set[int]:
    """Storage addresses of the tensors of a trainable tensor's shape that ``step_fn`` wrote in place outside any
    optimizer step, after one had run (``.data`` writes included: they bump no version counter)."""
    record: ShadowRecord | None = ctx.probes.get("shadows")
    return record.storage if record is not None else set()


@check("shadows", emits=("OPT-021", "OPT-023"))
def check_shadows(ctx: AuditContext) -> Iterable[Finding]:
    """OPT-021: a copy of the weights that the step updates (an EMA shadow, a mean teacher, a target network)
    moved away from the weights it copies; OPT-023: such a copy updated once per micro-batch."""
    record: ShadowRecord | None = ctx.probes.get("shadows")
    if record is None:
        return []
    findings = []
    if record.too_often:
        name, windows = record.too_often[0]
        findings.append(Finding(
            "shadows", Severity.WARN,
            f"a copy of {name} that step_fn keeps beside the weights (an EMA shadow, a teacher, a target network) "
            f"is updated in {windows} micro-batch windows (between backward passes) of a step that runs "
            f"{record.optimizer_steps} optimizer step(s): an average updated per micro-batch decays {windows} "
            "times per real step, most of them toward weights that have not changed, so its effective decay "
            "depends on the accumulation; update it once per optimizer step (when sync_gradients is True)",
            "OPT-023", {"param": name, "windows": windows, "optimizer_steps": record.optimizer_steps,
                        "copies": len(record.too_often)},
        ))
    if not record.drifts:
        return findings
    shown = ", ".join(f"{d.param} ({d.before:.3g} -> {d.after:.3g})" for d in record.drifts[:3])
    return [Finding(
        "shadows", Severity.WARN,
        f"{len(record.drifts)} of {record.written} tensor(s) step_fn keeps beside the weights (an EMA shadow, a "
        f"mean teacher, a target network) moved away from the weights they copy in this step: {shown} (distance "
        "to the weights before -> after the update). An average moves toward its weights at every update, "
        "whatever the decay; check the sign and both terms of the update (s -= (1 - decay) * (s - p), or "
        "s.lerp_(p, 1 - decay))",
        "OPT-021", {"params": [d.param for d in record.drifts[:8]], "judged": record.written},
    ), *findings]
