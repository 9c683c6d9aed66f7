"""Per-tensor gradient norms in one multi-tensor pass per (device, dtype), kept on the device."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

__all__ = ["GradMeter"]


def _dtensor_type() -> Any:
    try:
        from torch.distributed.tensor import DTensor
    except Exception:  # torch built without distributed
        return None
    return DTensor


class GradMeter:
    """Measure ``||p.grad||_2`` for every parameter, in float32, on ``device``, without a host sync.

    A parameter without a gradient measures 0. Gradients that are FSDP2 shards (DTensors with a ``Shard``
    placement) are measured locally and their squares summed across ``process_group``, so every rank sees
    the full norms.
    """

    def __init__(self, device: torch.device, process_group: Any = None) -> None:
        self.device = device
        self.process_group = process_group
        self._zero = torch.zeros((), dtype=torch.float32, device=device)
        self._dtensor = _dtensor_type()
        self._mask_key: tuple[int, ...] = ()
        self._mask: Tensor | None = None

    def norms(self, params: list[Tensor]) -> Tensor:
        grads: list[Tensor] = []
        positions: list[int] = []
        sharded: list[int] = []
        for i, p in enumerate(params):
            g = p.grad
            if g is None:
                continue
            if self._dtensor is not None and isinstance(g, self._dtensor):
                if any(placement.is_shard() for placement in g.placements):
                    sharded.append(i)
                g = g.to_local()
            if g.is_sparse:
                g = g.coalesce()._values()
            grads.append(g.detach())
            positions.append(i)
        ordered: list[Tensor] = [self._zero] * len(params)
        if grads:
            groups = _group_tensors_by_device_and_dtype([list(grads)], True)
            for (device, dtype), ((tensors,), indices) in groups.items():
                if dtype == torch.float32:
                    values = list(torch._foreach_norm(tensors, 2))  # type: ignore[arg-type]
                else:  # accumulate low-precision gradients in float32
                    values = list(torch._foreach_norm(tensors, 2, dtype=torch.float32))  # type: ignore[arg-type]
                if device != self.device:
                    values = list(torch.stack(values).to(self.device, non_blocking=True).unbind(0))
                for k, v in zip(indices, values):
                    ordered[positions[k]] = v
        norms = torch.stack(ordered) if ordered else torch.zeros(0, device=self.device)
        if sharded:
            norms = self._reduce_shards(norms, tuple(sharded))
        return norms

    def _reduce_shards(self, norms: Tensor, sharded: tuple[int, ...]) -> Tensor:
        import torch.distributed as dist

        if self._mask is None or self._mask_key != sharded or self._mask.shape[0] != norms.shape[0]:
            # built once per layout (one small host-to-device copy), not per step
            mask = torch.zeros(norms.shape[0], dtype=torch.bool)
            mask[list(sharded)] = True
            self._mask = mask.to(self.device)
            self._mask_key = sharded
        squares = norms * norms
        partial = torch.where(self._mask, squares, torch.zeros_like(squares))
        dist.all_reduce(partial, op=dist.ReduceOp.SUM, group=self.process_group)
        return torch.sqrt(torch.where(self._mask, partial, squares))
