"""Which rank: each rank's local verdict and values, carried in per-rank slots of the decision's all-reduce.

The guard's decision is one ``MAX`` all-reduce. Each rank adds ``SLOT`` values of its own to it, in its own
slot of a ``[world * SLOT]`` stretch that every other rank fills with ``-inf``, so after the reduce every rank
holds every rank's values: no extra collective, no host sync. The host reads them only for an incident.
A NaN would not survive a ``MAX`` reduce reliably, so non-finite values travel as ``inf`` plus a flag.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = ["SLOT", "RankSlots", "RankValue", "read_ranks", "named_ranks", "report_ranks"]

SLOT = 4  # per rank: tripped (0/1), non-finite (0/1), local global grad norm, local loss
_CAP = 256  # ranks written into a report; an event carries only the tripped ones


class RankValue(NamedTuple):
    """One rank's local view of a step: its own verdict before the ranks agreed, and what it measured."""

    rank: int
    tripped: bool  # this rank's gradients (or loss) alone would have rejected the step
    nonfinite: bool  # its local gradient norm or loss was NaN/Inf
    grad_norm: float  # inf when non-finite
    loss: float | None  # None when the guard was given no loss; inf when non-finite


class RankSlots:
    """The per-rank stretch of the decision's all-reduce for one rank of ``world``."""

    def __init__(self, rank: int, world: int, device: torch.device) -> None:
        self.rank, self.world = rank, world
        self._before = torch.full((rank * SLOT,), -math.inf, device=device)
        self._after = torch.full(((world - rank - 1) * SLOT,), -math.inf, device=device)
        self._nan = torch.full((), math.nan, device=device)

    @property
    def size(self) -> int:
        return self.world * SLOT

    def parts(self, reject: Tensor, global_norm: Tensor, loss: Tensor, loss_given: bool) -> list[Tensor]:
        """Tensors to concatenate into the packed all-reduce input: ``-inf`` everywhere but this rank's slot."""
        bad = (global_norm * 0.0) != 0.0
        if loss_given:
            bad = bad | ((loss * 0.0) != 0.0)
        local = torch.stack([reject, bad, global_norm, loss if loss_given else self._nan]).to(torch.float32)
        # an absent loss stays NaN here and becomes inf: the host knows it was absent
        return [self._before, local.nan_to_num(nan=math.inf), self._after]


def read_ranks(values: list[float], loss_given: bool) -> list[RankValue]:
    """Decode the reduced slots (on the host) into one ``RankValue`` per rank."""
    out = []
    for rank in range(len(values) // SLOT):
        tripped, bad, norm, loss = values[rank * SLOT:(rank + 1) * SLOT]
        out.append(RankValue(rank, tripped > 0, bad > 0, norm, loss if loss_given else None))
    return out


def named_ranks(values: list[RankValue]) -> list[RankValue]:
    """The ranks an incident names: those whose local values tripped. When the gradient all-reduce spread one
    rank's bad gradients to all, every rank trips alike; the ranks whose own *loss* was non-finite (the loss is
    never reduced) are then the origin, and only they are named."""
    tripped = [v for v in values if v.tripped or v.nonfinite]
    origin = [v for v in tripped if v.loss is not None and not math.isfinite(v.loss)]
    if origin and len(origin) < len(tripped):
        return origin
    return tripped


def report_ranks(values: list[RankValue]) -> list[dict[str, object]]:
    """Every rank's values for a spike report (the first ``_CAP`` ranks)."""
    return [v._asdict() for v in values[:_CAP]]
