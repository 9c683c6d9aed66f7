"""Precision and placement: ``mixed_precision`` (autocast, GradScaler, low-precision weights, fp16 headroom)
and ``device_dtype`` (meta / scattered devices, float64 weights)."""

from __future__ import annotations

from typing import Any, Iterable

import torch

from guardtower.preflight._registry import AuditContext, check
from guardtower.preflight._trace import RootCall, UpdateStats
from guardtower.preflight._util import fmt_names
from guardtower.preflight.numerics import ActivationRecord
from guardtower.report import Finding
from guardtower.severity import Severity

__all__ = ["FP16_MAX", "FP16_HEADROOM", "STUCK_FRACTION"]

FP16_MAX = 65504.0
#: activations above FP16_MAX / FP16_HEADROOM leave less than 3 bits of range before fp16 overflows
FP16_HEADROOM = 8.0
#: AMP-002 fires when at least this fraction of elements with a non-zero gradient did not move in one step
STUCK_FRACTION = 0.5


def _calls(ctx: AuditContext) -> list[RootCall]:
    return ctx.trace.calls if ctx.trace is not None else []


def _scaler_enabled(scaler: Any) -> bool:
    if scaler is None:
        return False
    is_enabled = getattr(scaler, "is_enabled", None)
    return bool(is_enabled()) if callable(is_enabled) else True


@check("mixed_precision", emits=("AMP-001", "AMP-002", "AMP-003"), needs=("update",))
def check_mixed_precision(ctx: AuditContext) -> Iterable[Finding]:
    """AMP-001 fp16 autocast without a GradScaler, AMP-002 updates rounded away in fp16/bf16 weights,
    AMP-003 activations close to the fp16 maximum."""
    findings = []
    fp16_devices = sorted({dev for call in _calls(ctx) for dev, dt in call.autocast.items() if dt == torch.float16})
    if fp16_devices and not _scaler_enabled(ctx.scaler):
        findings.append(Finding(
            "mixed_precision", Severity.ERROR,
            f"the step runs under float16 autocast on {', '.join(fp16_devices)} without an enabled GradScaler: "
            "small gradients underflow to zero in fp16; use torch.amp.GradScaler (and pass it as scaler=) or bf16",
            "AMP-001", {"devices": fp16_devices},
        ))
    stats: dict[str, UpdateStats] = ctx.trace.update if ctx.trace is not None else {}
    stuck = {n: s.stuck_fraction for n, s in stats.items()
             if s.dtype in ("float16", "bfloat16") and s.stuck_fraction >= STUCK_FRACTION}
    if stuck:
        # consequence: most of the low-precision weights frozen is a run that cannot train; a few tensors (norm
        # gains at 1.0, the rows of rare tokens) are a quality gap in a run that does
        sizes = {n: ctx.params[n].numel() for n in stats if n in ctx.params}
        low = sum(sizes.get(n, 0) for n, s in stats.items() if s.dtype in ("float16", "bfloat16"))
        held = sum(sizes.get(n, 0) for n in stuck)
        findings.append(Finding(
            "mixed_precision", Severity.ERROR if held >= 0.5 * low else Severity.WARN,
            f"{len(stuck)} trainable {', '.join(sorted({stats[n].dtype for n in stuck}))} tensor(s) did not move "
            f"in one optimizer step although their gradient was non-zero: {fmt_names(list(stuck))}; lr*update is "
            "below the dtype's resolution. Keep fp32 master weights (autocast, or an fp32 optimizer copy)",
            "AMP-002", {"params": list(stuck), "stuck_fraction": stuck},
        ))
    rec = ctx.probes.get("activations")
    fp16_weights = any(p.dtype == torch.float16 for p in ctx.params.values())
    if isinstance(rec, ActivationRecord) and rec.max_abs and (fp16_devices or fp16_weights):
        site, peak = max(rec.max_abs.items(), key=lambda kv: kv[1])
        if peak >= FP16_MAX / FP16_HEADROOM and peak <= FP16_MAX:
            findings.append(Finding(
                "mixed_precision", Severity.WARN,
                f"activations reach {peak:.4g} in {site!r}, within {FP16_HEADROOM:g}x of the fp16 maximum "
                f"{FP16_MAX:g}; a little growth in training overflows to Inf (normalise inputs, scale residuals, "
                "or use bf16)",
                "AMP-003", {"module": site, "max_abs": peak, "modules": [site]},
            ))
    return findings


@check("device_dtype", emits=("DEV-001", "DEV-002"), static=True)
def check_device_dtype(ctx: AuditContext) -> Iterable[Finding]:
    """DEV-001 tensors on the meta device or scattered across devices, DEV-002 float64 weights."""
    findings = []
    named = [*ctx.model.named_parameters(), *ctx.model.named_buffers()]
    meta = [n for n, t in named if t.device.type == "meta"]
    devices = sorted({str(t.device) for _, t in named if t.device.type != "meta"})
    device_map = getattr(ctx.model, "hf_device_map", None)
    if meta:
        findings.append(Finding(
            "device_dtype", Severity.ERROR,
            f"{len(meta)} tensor(s) are on the meta device (never materialised or loaded): {fmt_names(meta)}",
            "DEV-001", {"meta": meta, "devices": devices},
        ))
    elif len(devices) > 1 and not device_map:
        findings.append(Finding(
            "device_dtype", Severity.ERROR,
            f"parameters/buffers are spread over {devices} without a device map: part of the model was not moved",
            "DEV-001", {"meta": [], "devices": devices},
        ))
    f64 = [n for n, p in ctx.params.items() if p.requires_grad and p.dtype == torch.float64]
    if f64:
        findings.append(Finding(
            "device_dtype", Severity.WARN,
            f"{len(f64)} trainable parameter(s) are float64: {fmt_names(f64)} (twice the memory, and GPUs run "
            "fp64 many times slower); usually torch.set_default_dtype(torch.float64) or .double() by accident",
            "DEV-002", {"params": f64},
        ))
    return findings
