"""Keep BatchNorm running statistics out of a rejected step.

A step's forward pass updates ``running_mean``/``running_var``/``num_batches_tracked`` before the guard has
judged its gradients, so skipping the update alone would leave the bad batch in the statistics (a batch
with one NaN sample makes evaluation return NaN). ``BufferGuard`` keeps one flat device copy per
(device, dtype) of those buffers as they were after the last accepted step, and after each decision runs
``copy = where(reject, copy, current)`` then ``current = copy``: a rejected step puts the statistics back as
they were before its forward pass, an accepted one refreshes the copy. Three tensor ops per group, whatever
the number of BatchNorm layers, and no host sync.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _NormBase

__all__ = ["BufferGuard"]

_STATS = ("running_mean", "running_var", "num_batches_tracked")


class _Group:
    """The buffers of one (device, dtype): flat 1-d views of each, and the saved copy with matching views."""

    def __init__(self, buffers: list[Tensor]) -> None:
        self.views = [b.view(-1) for b in buffers]
        self.saved = torch.cat(self.views)
        self.saved_views = list(self.saved.split([v.numel() for v in self.views]))

    @torch.no_grad()
    def settle(self, reject: Tensor) -> None:
        torch.where(reject.to(self.saved.device, non_blocking=True), self.saved, torch.cat(self.views),
                    out=self.saved)
        torch._foreach_copy_(self.views, self.saved_views)

    @torch.no_grad()
    def refresh(self) -> None:
        torch._foreach_copy_(self.saved_views, self.views)


class BufferGuard:
    """The running statistics of every BatchNorm/InstanceNorm layer of ``model`` that tracks them."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._slots = [(module, name) for module in model.modules()
                       if isinstance(module, _NormBase) and module.track_running_stats for name in _STATS
                       if isinstance(module._buffers.get(name), Tensor)]
        self._buffers: list[Tensor] = []
        self._groups: list[_Group] = []
        self._build()

    def _current(self) -> list[Tensor | None]:
        return [module._buffers.get(name) for module, name in self._slots]

    def _build(self) -> None:
        self._buffers = [b for b in self._current() if b is not None]
        by_kind: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
        for b in self._buffers:
            if b.device.type != "meta":
                by_kind.setdefault((b.device, b.dtype), []).append(b)
        self._groups = [_Group(buffers) for buffers in by_kind.values()]

    def __bool__(self) -> bool:
        return bool(self._groups)

    def settle(self, reject: Tensor) -> None:
        """After a step's decision: restore the statistics if ``reject`` (bool 0-d), else save them."""
        current = self._current()
        if len(current) != len(self._buffers) or any(a is not b for a, b in zip(current, self._buffers)):
            self._build()  # the model was moved or its buffers replaced: start from what it holds now
            return
        for group in self._groups:
            group.settle(reject)

    def refresh(self) -> None:
        """Take the statistics as they are now as the clean ones (after a rollback or a state load)."""
        for group in self._groups:
            group.refresh()
