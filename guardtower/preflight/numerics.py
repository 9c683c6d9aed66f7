"""Numerics: non-finite values (``nonfinite``), dead ReLUs (``dead_relu``), saturated sigmoid/tanh
(``saturation``), fed by the ``activations`` probe.

The probe reads every module's output in a forward hook, right when it is produced: an in-place op later in
the forward (``nn.ReLU(inplace=True)`` overwrites its input) cannot change what was measured, and the hook
never modifies or keeps a tensor. Functional ``F.relu`` / ``torch.sigmoid`` / ``torch.tanh`` calls are
attributed to the module running them (skipped inside activation classes, whose own output is measured).

Non-finite rule (NAN-001): NaN and +Inf always count; -Inf does not, because additive attention masks
legitimately hold -Inf. The first module producing -Inf is recorded in the details as a hint.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from guardtower.preflight._registry import AuditContext, check, probe
from guardtower.preflight._util import fmt_names, iter_tensors
from guardtower.report import Finding
from guardtower.severity import Severity

__all__ = ["ActivationRecord", "DEAD_FRACTION", "SATURATED_FRACTION", "MIN_ROWS"]

#: a ReLU layer is reported when at least this fraction of its units is zero for every sample in the batch. When
#: the samples look alike (a random frozen backbone's pooled features, a small batch), a healthy zero-bias layer has
#: each unit negative on all of them with probability ~1/2, so half dead is the healthy ceiling, not a finding
DEAD_FRACTION = 0.75
#: and only when that many dead units would be this unlikely if each unit were dead with probability 1/2: 6 of a
#: GAN generator's 8 units dead on one batch happens one time in seven
DEAD_CHANCE = 1e-3
#: a sigmoid/tanh layer is reported when at least this fraction of its outputs is within 1% of the asymptotes
SATURATED_FRACTION = 0.5
#: dead units are only judged on at least this many rows (samples x positions) per unit
MIN_ROWS = 4
_MAX_MODULE_CALLS = 100_000


@dataclass
class ActivationRecord:
    """What the forward pass produced, per module call site."""

    module_calls: int = 0
    first_nonfinite: dict[str, Any] | None = None
    first_neginf: str | None = None
    max_abs: dict[str, float] = field(default_factory=dict)
    dead: dict[str, tuple[int, int]] = field(default_factory=dict)
    """site -> (dead units, units)"""
    saturated: dict[str, tuple[str, float]] = field(default_factory=dict)
    """site -> (kind, saturated fraction)"""


def _relu_like(module: nn.Module) -> bool:
    name = type(module).__name__.lower()
    return "relu" in name and not any(k in name for k in ("leaky", "prelu", "rrelu"))


def _sigmoid_like(module: nn.Module) -> str | None:
    if isinstance(module, nn.Sigmoid):
        return "sigmoid"
    if isinstance(module, nn.Tanh):
        return "tanh"
    return None


def _is_activation_class(module: nn.Module) -> bool:
    mod = type(module).__module__
    return mod.startswith("torch.nn.modules.activation") or mod.startswith("transformers.activations")


def _dead_units(out: torch.Tensor) -> tuple[int, int] | None:
    if out.dim() < 2 or out.numel() == 0:
        return None
    alive = out.detach() > 0
    alive = alive.transpose(0, 1).reshape(out.shape[1], -1) if out.dim() >= 4 else alive.reshape(-1, out.shape[-1]).T
    if alive.shape[1] < MIN_ROWS:
        return None
    dead = int((~alive.any(dim=1)).sum())
    return dead, int(alive.shape[0])


def _saturation(kind: str, out: torch.Tensor) -> float:
    y = out.detach().float()
    hit = (y < 0.01) | (y > 0.99) if kind == "sigmoid" else y.abs() > 0.99
    return float(hit.float().mean())


class _Recorder:
    def __init__(self, record: ActivationRecord) -> None:
        self.record = record
        self.stack: list[tuple[str, nn.Module]] = []
        self.calls: dict[str, int] = {}

    def site(self, name: str) -> str:
        n = self.calls.get(name, 0) + 1
        self.calls[name] = n
        return name if n == 1 else f"{name}#{n}"

    def pre(self, name: str, module: nn.Module, args: Any) -> None:
        self.stack.append((name, module))

    def post(self, name: str, module: nn.Module, args: Any, output: Any) -> None:
        if self.stack and self.stack[-1][1] is module:
            self.stack.pop()
        if self.record.module_calls >= _MAX_MODULE_CALLS:
            return
        self.record.module_calls += 1
        site = self.site(name or "<model>")
        with torch.no_grad():
            for path, t in iter_tensors(output, depth=3):
                if t.is_floating_point() and t.numel() > 0 and t.device.type != "meta":
                    self.observe(site, path, t, args)
            if isinstance(output, torch.Tensor) and output.is_floating_point() and output.device.type != "meta":
                if _relu_like(module):
                    self.dead_site(site, output)
                kind = _sigmoid_like(module)
                if kind:
                    self.record.saturated[site] = (kind, _saturation(kind, output))

    def observe(self, site: str, path: str, t: torch.Tensor, args: Any) -> None:
        magnitude = t.abs()
        peak = float(magnitude.max())  # NaN propagates, so one reduction settles the common all-finite case
        limit = torch.finfo(t.dtype).max / 2
        if math.isfinite(peak) and peak <= limit:
            self.record.max_abs[site] = max(self.record.max_abs.get(site, 0.0), peak)
            return
        finite = torch.isfinite(t)
        # values at the dtype's lowest are additive masks (finfo.min / -inf), not activations
        counted = finite & (t > -limit)
        value = float(torch.where(counted, magnitude, torch.zeros((), dtype=t.dtype, device=t.device)).max())
        if not bool(finite.all()):
            bad = bool(torch.isnan(t).any()) or bool(torch.isposinf(t).any())
            if bad and self.record.first_nonfinite is None:
                inputs_bad = any(
                    x.is_floating_point() and not bool(torch.isfinite(x).all())
                    for _, x in iter_tensors(args, depth=3) if x is not t
                )
                self.record.first_nonfinite = {
                    "module": site, "output": path or "output", "nan": bool(torch.isnan(t).any()),
                    "posinf": bool(torch.isposinf(t).any()), "input_nonfinite": inputs_bad,
                }
            elif not bad and self.record.first_neginf is None:
                self.record.first_neginf = site
        self.record.max_abs[site] = max(self.record.max_abs.get(site, 0.0), value)

    def dead_site(self, site: str, out: torch.Tensor) -> None:
        dead = _dead_units(out)
        if dead is not None:
            self.record.dead[site] = dead

    def current(self) -> tuple[str, nn.Module] | None:
        return self.stack[-1] if self.stack else None

    def functional(self, kind: str, out: Any) -> None:
        if not isinstance(out, torch.Tensor) or not out.is_floating_point() or out.device.type == "meta":
            return
        cur = self.current()
        if cur is not None and _is_activation_class(cur[1]):
            return
        if cur is None and kind == "relu":
            return  # a relu in the step's own arithmetic is a hinge or margin loss: zero is where it is satisfied
        site = self.site(f"{cur[0] if cur else '<step_fn>'}:{kind}")
        with torch.no_grad():
            if kind == "relu":
                self.dead_site(site, out)
            else:
                self.record.saturated[site] = (kind, _saturation(kind, out))


@probe("activations")
@contextlib.contextmanager
def _activations(ctx: AuditContext) -> Iterator[ActivationRecord]:
    record = ActivationRecord()
    ctx.probes["activations"] = record
    rec = _Recorder(record)
    handles = []
    for name, module in ctx.model.named_modules():
        handles.append(module.register_forward_pre_hook(functools.partial(rec.pre, name)))
        handles.append(module.register_forward_hook(functools.partial(rec.post, name)))
    patched: list[tuple[Any, str, Callable[..., Any]]] = [
        (F, "relu", F.relu), (torch, "sigmoid", torch.sigmoid), (torch, "tanh", torch.tanh),
    ]

    def wrap(kind: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            out = fn(*args, **kwargs)
            try:
                rec.functional(kind, out)
            except Exception:  # observing must never change what the step does
                pass
            return out

        return wrapper

    for owner, attr, fn in patched:
        setattr(owner, attr, wrap(attr, fn))
    try:
        yield record
    finally:
        for owner, attr, fn in patched:
            setattr(owner, attr, fn)
        for h in handles:
            h.remove()


def _record(ctx: AuditContext) -> ActivationRecord | None:
    rec = ctx.probes.get("activations")
    return rec if isinstance(rec, ActivationRecord) else None


def _nonfinite(named: list[tuple[str, torch.Tensor]]) -> list[str]:
    """The names of the floating tensors holding a NaN or an Inf: one max-abs pass per tensor (the infinity norm,
    which NaN and Inf both reach), batched per device and dtype, instead of a boolean copy of each."""
    groups: dict[tuple[torch.device, torch.dtype], list[tuple[str, torch.Tensor]]] = {}
    for name, t in named:
        if t.is_floating_point() and t.device.type != "meta" and t.numel() > 0:
            groups.setdefault((t.device, t.dtype), []).append((name, t))
    bad: set[str] = set()
    for members in groups.values():
        norms = torch.stack(torch._foreach_norm([t for _, t in members], float("inf"))).float()
        bad.update(name for (name, _), ok in zip(members, torch.isfinite(norms).tolist()) if not ok)
    return [name for name, _ in named if name in bad]


@check("nonfinite", emits=("NAN-001", "NAN-002", "NAN-003"))
def check_nonfinite(ctx: AuditContext) -> Iterable[Finding]:
    """NAN-003 parameters/buffers already non-finite, NAN-001 forward, NAN-002 gradients."""
    findings = []
    bad_state = _nonfinite([(n, t.detach()) for n, t in (*ctx.model.named_parameters(), *ctx.model.named_buffers())])
    if bad_state:
        findings.append(Finding(
            "nonfinite", Severity.ERROR,
            f"{len(bad_state)} parameter/buffer tensor(s) already hold NaN/Inf before training: {fmt_names(bad_state)} "
            "(uninitialised memory from to_empty/torch.empty, a bad checkpoint, or a previous diverged run)",
            "NAN-003", {"tensors": bad_state},
        ))
    rec = _record(ctx)
    if rec is not None and rec.first_nonfinite is not None:
        first = rec.first_nonfinite
        origin = "its input was already non-finite" if first["input_nonfinite"] else "its inputs were finite"
        findings.append(Finding(
            "nonfinite", Severity.ERROR,
            f"the forward pass went non-finite first in module {first['module']!r} ({origin})",
            "NAN-001", {**first, "modules": [first["module"]], "first_neginf": rec.first_neginf},
        ))
    trace = ctx.trace
    if trace is not None and trace.backward:
        bad = _nonfinite([(n, g) for n, g in trace.grads.items() if g is not None])
        if bad:
            findings.append(Finding(
                "nonfinite", Severity.ERROR,
                f"{len(bad)} gradient tensor(s) hold NaN/Inf: {fmt_names(bad)}",
                "NAN-002", {"params": bad},
            ))
    return findings


def _tail(k: int, n: int) -> float:
    """P(X >= k) for X ~ Binomial(n, 1/2)."""
    return sum(math.comb(n, i) for i in range(k, n + 1)) / 2 ** n


@check("dead_relu", emits=("RELU-001",))
def check_dead_relu(ctx: AuditContext) -> Iterable[Finding]:
    """RELU-001: ReLU layers whose units output zero for every sample of the batch."""
    rec = _record(ctx)
    if rec is None:
        return []
    dead = {site: d for site, d in rec.dead.items()
            if d[1] and d[0] / d[1] >= DEAD_FRACTION and _tail(d[0], d[1]) < DEAD_CHANCE}
    if not dead:
        return []
    desc = [f"{site} ({d[0]}/{d[1]})" for site, d in dead.items()]
    return [Finding(
        "dead_relu", Severity.WARN,
        f"{len(dead)} ReLU layer(s) have >= {DEAD_FRACTION:.0%} of units dead on this batch: {fmt_names(desc)} "
        "(large negative bias, bad init, unnormalised inputs, or a too-high learning rate)",
        "RELU-001", {"modules": list(dead), "dead_units": {s: d[0] for s, d in dead.items()},
                     "units": {s: d[1] for s, d in dead.items()}},
    )]


@check("saturation", emits=("ACT-001",))
def check_saturation(ctx: AuditContext) -> Iterable[Finding]:
    """ACT-001: sigmoid/tanh outputs pinned at their asymptotes, where the gradient vanishes."""
    rec = _record(ctx)
    if rec is None:
        return []
    sat = {site: v for site, v in rec.saturated.items() if v[1] >= SATURATED_FRACTION}
    if not sat:
        return []
    desc = [f"{site} ({v[0]}, {v[1]:.0%})" for site, v in sat.items()]
    return [Finding(
        "saturation", Severity.WARN,
        f"{len(sat)} sigmoid/tanh layer(s) are saturated (>= {SATURATED_FRACTION:.0%} of outputs within 1% of "
        f"the asymptotes): {fmt_names(desc)}; their gradient is ~0 (pre-activations too large: init or input scale)",
        "ACT-001", {"modules": list(sat), "fractions": {s: v[1] for s, v in sat.items()}},
    )]
