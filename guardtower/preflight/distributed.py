"""Distributed-training checks: DDP / FSDP wiring that trains, but not the way the launch script intends.

All collectives live in ``dist_consistency``, which runs on every rank whenever a process group with more
than one rank exists (the decision depends only on the process group, so every rank takes the same path),
and exchanges two small tensors: a fixed-size header through ``all_gather`` and per-parameter checksums
through one ``all_reduce``. The audit step itself runs under ``DistributedDataParallel.no_sync()`` (probe
``dist_local_step``) so it launches no gradient all-reduce and leaves DDP's reducer exactly as it was, even
when a parameter is unused.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch import nn

from guardtower._dist import multi_rank, world_size
from guardtower.preflight._peft import unwrap_parallel
from guardtower.preflight._registry import AuditContext, check, probe
from guardtower.preflight._walk import iter_tensors
from guardtower.report import Finding
from guardtower.severity import Severity

__all__ = ["ConsistencyState", "WrapState", "is_data_parallel", "is_sharded"]

_DP_WRAPPERS = ("DistributedDataParallel", "FullyShardedDataParallel", "DeepSpeedEngine")
_SHARDED = ("FullyShardedDataParallel", "FSDPModule")
_LIST_LIMIT = 10
_RTOL = 1e-5


def _class_names(module: nn.Module) -> set[str]:
    return {cls.__name__ for cls in type(module).__mro__}


def is_data_parallel(model: nn.Module) -> bool:
    """True when the model is wrapped for data parallelism (DDP, FSDP1, FSDP2 ``fully_shard``, DeepSpeed)."""
    return _wrapper_kind(model) is not None


def is_sharded(model: nn.Module) -> bool:
    """True for FSDP (1 or 2): each rank holds different shards, so weight checksums legitimately differ."""
    return any(_class_names(m) & set(_SHARDED) for m in model.modules()) or any(
        type(p).__name__ in ("DTensor", "FlatParameter") for p in model.parameters()
    )


def _is_ddp(model: nn.Module) -> bool:
    """DDP by class name, as every wrapper here is recognised: a user's subclass, apex's
    ``DistributedDataParallel`` or a class moved between torch versions reduce gradients the same way."""
    return "DistributedDataParallel" in _class_names(model)


def _wrapper_kind(model: nn.Module) -> str | None:
    """The data-parallel wrapper's name as users know it, or None when the model is not wrapped."""
    names = _class_names(model)
    for wrapper in _DP_WRAPPERS:
        if wrapper in names:
            return wrapper
    if any(_class_names(m) & set(_SHARDED) for m in model.modules()):
        return "FSDP2 (fully_shard)"
    return None


@probe("dist_local_step")
@contextlib.contextmanager
def _local_step(ctx: AuditContext) -> Iterator[None]:
    """Run the audit step under DDP's ``no_sync()``: no gradient all-reduce, reducer state untouched."""
    no_sync = getattr(ctx.model, "no_sync", None) if _is_ddp(ctx.model) else None
    if callable(no_sync):
        with no_sync():
            yield None
    else:
        yield None


@dataclass
class WrapState:
    """How often the data-parallel wrapper and the module inside it ran during the step."""

    wrapper_calls: int = 0
    inner_calls: int = 0


@probe("dist_wrap")
@contextlib.contextmanager
def _wrap_probe(ctx: AuditContext) -> Iterator[WrapState | None]:
    inner = unwrap_parallel(ctx.model)
    if inner is ctx.model:
        yield None
        return
    state = WrapState()

    def outer_hook(module: nn.Module, args: Any) -> None:
        state.wrapper_calls += 1

    def inner_hook(module: nn.Module, args: Any) -> None:
        state.inner_calls += 1

    handles = [ctx.model.register_forward_pre_hook(outer_hook), inner.register_forward_pre_hook(inner_hook)]
    ctx.probes["dist_wrap"] = state
    try:
        yield state
    finally:
        for h in handles:
            h.remove()


@dataclass
class ConsistencyState:
    """Per-rank fingerprints taken when the step starts (weights) and at the first forward (inputs)."""

    weight_names: list[str] = field(default_factory=list)
    weight_stats: torch.Tensor | None = None
    """float64 [n, 3]: per-parameter element count, sum and sum of squares"""
    input_fp: torch.Tensor | None = None
    """float64 [4]: tensor count, element count, sum, position-weighted sum of the first forward's inputs"""


def _collective_device() -> torch.device:
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _weight_stats(model: nn.Module, device: torch.device) -> tuple[list[str], torch.Tensor]:
    if is_sharded(model):
        return [], torch.zeros(0, 3, dtype=torch.float64, device=device)
    names, rows = [], []
    for name, p in model.named_parameters():
        w = p.detach().to(torch.float64)
        count = torch.tensor(float(w.numel()), dtype=torch.float64, device=w.device)
        rows.append(torch.stack([count, w.sum(), (w * w).sum()]).to(device))
        names.append(name)
    if not rows:
        return [], torch.zeros(0, 3, dtype=torch.float64, device=device)
    return names, torch.stack(rows)


def _input_fingerprint(value: Any, device: torch.device) -> torch.Tensor | None:
    """Order-sensitive checksum of every tensor in ``value``; None when it holds no tensor."""
    fp = torch.zeros(4, dtype=torch.float64, device=device)
    found = False
    for t in iter_tensors(value):
        found = True
        x = t.detach().flatten().to(torch.float64)
        weights = torch.arange(x.numel(), device=x.device, dtype=torch.float64).remainder_(97).add_(1)
        one = torch.ones((), dtype=torch.float64, device=x.device)
        row = torch.stack([one, one * x.numel(), x.sum(), (x * weights).sum()])
        fp += row.to(device)
    return fp if found else None


@probe("dist_consistency")
@contextlib.contextmanager
def _consistency_probe(ctx: AuditContext) -> Iterator[ConsistencyState | None]:
    if not multi_rank():
        yield None
        return
    device = _collective_device()
    state = ConsistencyState()
    state.weight_names, state.weight_stats = _weight_stats(ctx.model, device)
    targets = [ctx.model] if unwrap_parallel(ctx.model) is ctx.model else [ctx.model, unwrap_parallel(ctx.model)]

    def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
        if state.input_fp is None:
            state.input_fp = _input_fingerprint((args, kwargs), device)

    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in targets]
    ctx.probes["dist_consistency"] = state
    try:
        yield state
    finally:
        for h in handles:
            h.remove()


@check("dist_setup", emits=("DDP-003", "DDP-007"), static=True)
def check_setup(ctx: AuditContext) -> Iterator[Finding]:
    """DDP-007 which data-parallel wrapper the audit found (its settings decide DDP-001); DDP-003 a multi-rank
    process group, but the model is not wrapped for data parallelism."""
    kind = _wrapper_kind(ctx.model)
    if kind is not None:
        settings = {key: getattr(ctx.model, key) for key in ("find_unused_parameters", "static_graph")
                    if isinstance(getattr(ctx.model, key, None), bool)}
        shown = ", ".join(f"{k}={v}" for k, v in settings.items())
        yield Finding(
            "dist_setup",
            Severity.INFO,
            f"{kind} detected ({world_size()} rank(s){', ' + shown if shown else ''}): the data-parallel checks "
            "apply",
            "DDP-007",
            {"wrapper": kind, "world_size": world_size(), **settings},
        )
    if not multi_rank() or kind is not None:
        return
    if not any(p.requires_grad for p in ctx.params.values()):
        return
    yield Finding(
        "dist_setup",
        Severity.WARN,
        f"a process group with {world_size()} ranks is initialised but the model is not wrapped in "
        "DistributedDataParallel / FSDP: gradients are never averaged and every rank trains its own model",
        "DDP-003",
        {"world_size": world_size(), "model": type(ctx.model).__name__},
    )


@check("dist_wrap", emits=("DDP-004",))
def check_wrap(ctx: AuditContext) -> Iterator[Finding]:
    """DDP-004: the step called ``ddp.module(...)``, bypassing the wrapper's gradient synchronisation."""
    state = ctx.probes.get("dist_wrap")
    if isinstance(state, WrapState) and state.inner_calls and not state.wrapper_calls:
        yield Finding(
            "dist_wrap",
            Severity.ERROR,
            f"the step ran {type(ctx.model).__name__}.module directly ({state.inner_calls} call(s)) and never the "
            "wrapper: DDP's gradient hooks are not armed, so gradients are not averaged across ranks",
            "DDP-004",
            {"wrapper": type(ctx.model).__name__, "inner_calls": state.inner_calls},
        )


@check("dist_unused", emits=("DDP-001",))
def check_unused(ctx: AuditContext) -> Iterator[Finding]:
    """DDP-001: trainable parameters without a gradient under DDP(find_unused_parameters=False)."""
    model, trace = ctx.model, ctx.trace
    if not _is_ddp(model) or trace is None or trace.error is not None:
        return
    if getattr(model, "find_unused_parameters", False) or getattr(model, "static_graph", False):
        return
    if not any(g is not None for g in trace.grads.values()):
        return
    unused = [n for n, p in ctx.params.items() if p.requires_grad and trace.grads.get(n) is None]
    if unused:
        yield Finding(
            "dist_unused",
            Severity.ERROR,
            f"{len(unused)} trainable parameter(s) got no gradient under DDP(find_unused_parameters=False): the "
            "reducer waits for them, so the next iteration will hang or crash ('Expected to have finished "
            "reduction in the prior iteration')",
            "DDP-001",
            {"params": sorted(unused)[:_LIST_LIMIT], "count": len(unused)},
        )


@check("dist_batchnorm", emits=("DDP-002",), static=True)
def check_batchnorm(ctx: AuditContext) -> Iterator[Finding]:
    """DDP-002: plain BatchNorm in a data-parallel model normalises with per-rank statistics."""
    if not (multi_rank() or is_data_parallel(ctx.model)):
        return
    plain = [
        name
        for name, m in ctx.model.named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and not isinstance(m, nn.SyncBatchNorm) and m.training
    ]
    if plain:
        yield Finding(
            "dist_batchnorm",
            Severity.WARN,
            f"{len(plain)} BatchNorm layer(s) are not synchronised across ranks: each rank normalises with its own "
            "small per-GPU batch statistics (use nn.SyncBatchNorm.convert_sync_batchnorm before wrapping)",
            "DDP-002",
            {"modules": plain[:_LIST_LIMIT], "count": len(plain)},
        )


@check("dist_consistency", emits=("DDP-005", "DDP-006"))
def check_consistency(ctx: AuditContext) -> Iterator[Finding]:
    """DDP-005 ranks hold different weights; DDP-006 every rank got the same batch. Runs collectives."""
    if not multi_rank():
        return
    import torch.distributed as dist

    device = _collective_device()
    state = ctx.probes.get("dist_consistency")
    if not isinstance(state, ConsistencyState):
        state = ConsistencyState()
        state.weight_names, state.weight_stats = _weight_stats(ctx.model, device)
        state.input_fp = _input_fingerprint(ctx.inputs, device) if ctx.inputs is not None else None
    stats = state.weight_stats if state.weight_stats is not None else torch.zeros(0, 3, dtype=torch.float64, device=device)

    has_input = state.input_fp is not None
    header = torch.cat(
        [
            torch.tensor([float(stats.shape[0]), float(has_input)], dtype=torch.float64, device=device),
            state.input_fp if state.input_fp is not None else torch.zeros(4, dtype=torch.float64, device=device),
        ]
    )
    gathered = [torch.empty_like(header) for _ in range(world_size())]
    dist.all_gather(gathered, header)
    rows = torch.stack(gathered).cpu()

    counts = rows[:, 0]
    if not bool((counts == counts[0]).all()):
        yield Finding(
            "dist_consistency",
            Severity.ERROR,
            f"the ranks hold different models: parameter counts per rank {[int(c) for c in counts.tolist()]}",
            "DDP-005",
            {"param_counts": [int(c) for c in counts.tolist()]},
        )
    elif int(counts[0]) > 0:
        both = torch.cat([stats, -stats])
        dist.all_reduce(both, op=dist.ReduceOp.MAX)
        n = stats.shape[0]
        high, low = both[:n].cpu(), -both[n:].cpu()
        # |sum| <= sqrt(numel * sumsq) bounds the sum's scale; the count must match exactly
        scale = torch.stack([torch.zeros_like(high[:, 0]), (high[:, 0] * high[:, 2]).sqrt(), high[:, 2]], dim=1)
        differ = ((high - low) > _RTOL * scale + 1e-12).any(dim=1)
        bad = [state.weight_names[i] for i in differ.nonzero().flatten().tolist()]
        if bad:
            yield Finding(
                "dist_consistency",
                Severity.ERROR,
                f"{len(bad)} parameter(s) differ across the {world_size()} ranks: the ranks start from different "
                "weights (seed, or a checkpoint loaded on one rank after wrapping) and never converge to one model",
                "DDP-005",
                {"params": bad[:_LIST_LIMIT], "count": len(bad)},
            )

    if bool((rows[:, 1] == 1).all()) and float(rows[0, 3]) > 0:
        fps = rows[:, 2:]
        tol = 1e-12 * fps[0].abs().clamp_min(1.0)
        if bool(((fps - fps[0]).abs() <= tol).all()):
            yield Finding(
                "dist_consistency",
                Severity.WARN,
                f"all {world_size()} ranks received the same batch: they compute identical gradients, so "
                f"{world_size() - 1} of {world_size()} devices add nothing (use a DistributedSampler or shard the data)",
                "DDP-006",
                {"world_size": world_size(), "input_elements": int(rows[0, 3])},
            )
