"""Transient or deterministic: recompute a rejected step once, on the same batch, with the RNG restored.

With ``GuardedOptimizer(triage=True)`` every ``step(closure)`` keeps the RNG state from before its closure ran
(a host copy of the generators' state: no device work). When the step is rejected, the guard runs the
closure again from that state (same batch, same dropout masks) and judges the recomputed gradients against
the same baselines. If no rank reproduces the rejection, the incident is ``transient`` (suspect the hardware
or non-determinism on the ranks that tripped the first time); if any rank does, it is ``deterministic`` and
the batch is quarantined for replay. Either way the step stays skipped. The cost is one forward and backward
per incident (and under ``torch.distributed`` one small all-reduce so that every rank labels alike); none
otherwise.
"""

from __future__ import annotations

import time
from typing import Any, Callable, NamedTuple

import torch
from torch import Tensor

__all__ = ["TRANSIENT", "DETERMINISTIC", "RngState", "Outcome", "capture_rng", "restore_rng", "retriage"]

TRANSIENT = "transient"
DETERMINISTIC = "deterministic"


class RngState(NamedTuple):
    cpu: Tensor
    cuda: list[Tensor] | None


class Outcome(NamedTuple):
    """A triaged incident: its label, the ranks whose recompute reproduced it, and what the recompute took."""

    label: str
    ranks: tuple[int, ...]
    seconds: float


def capture_rng() -> RngState:
    """The CPU generator's state and, once CUDA is in use, every CUDA generator's (host copies)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return RngState(torch.get_rng_state(), cuda)


def restore_rng(state: RngState) -> None:
    torch.set_rng_state(state.cpu)
    if state.cuda is not None:
        torch.cuda.set_rng_state_all(state.cuda)


def retriage(closure: Callable[[], Any], rng: RngState, zero_grad: Callable[[], None],
             reproduces: Callable[[Any], Tensor], process_group: Any, distributed: bool, rank: int) -> Outcome:
    """Recompute once and label. ``reproduces(loss)`` judges the recomputed gradients (bool 0-d, this rank)."""
    start = time.perf_counter()
    after = capture_rng()  # the run continues from where the first computation left the generators
    zero_grad()
    restore_rng(rng)
    with torch.enable_grad():
        loss = closure()
    with torch.no_grad():
        local = reproduces(loss)
    if distributed:
        import torch.distributed as dist

        flags = torch.zeros(dist.get_world_size(process_group), device=local.device)
        flags[dist.get_rank(process_group)] = local.to(torch.float32)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=process_group)  # per incident, never per step
        ranks = tuple(r for r, flag in enumerate(flags.tolist()) if flag > 0)
    else:
        ranks = (rank,) if bool(local) else ()
    restore_rng(after)
    return Outcome(DETERMINISTIC if ranks else TRANSIENT, ranks, time.perf_counter() - start)
