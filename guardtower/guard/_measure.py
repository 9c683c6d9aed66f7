"""Per-tensor gradient norms in one multi-tensor pass per (device, dtype), kept on the device.

The same grouping scales the gradients for ``nan_action="clip"``: one multi-tensor multiply per group,
with the factor as a device tensor, so neither measuring nor clipping reads anything on the host.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

__all__ = ["GradMeter"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _dtensor_type() -> Any:
    try:
        from torch.distributed.tensor import DTensor
    except Exception:  # torch built without distributed
        return None
    return DTensor


class GradMeter:
    """Measure ``||p.grad||_2`` for every parameter, as float32 on ``device``, without a host sync.

    A parameter without a gradient measures 0. Half-precision gradients are accumulated in float32;
    float64 and complex ones are measured in their own precision (a complex norm is the norm of the
    magnitudes) and then cast. Gradients that are FSDP2 shards (DTensors with a ``Shard`` placement) are
    measured locally and their squares summed over the mesh dimensions they are sharded on, and only those:
    under HSDP (``Replicate`` x ``Shard``) a sum over every rank would count each shard once per replica.
    Every rank then sees the full norms.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._zero = torch.zeros((), dtype=torch.float32, device=device)
        self._dtensor = _dtensor_type()
        # (mesh id, placements) -> the process groups of the sharded mesh dimensions
        self._shard_groups: dict[tuple[int, tuple[Any, ...]], tuple[Any, ...]] = {}
        self._mask_key: tuple[tuple[tuple[Any, ...], tuple[int, ...]], ...] = ()
        self._masks: list[tuple[tuple[Any, ...], Tensor]] = []
        # the gradients of the last ``norms`` call, grouped, for ``scale``: (tensors, positions, device)
        self._groups: list[tuple[list[Tensor], list[int], torch.device]] = []
        self._sparse: list[tuple[Tensor, int]] = []
        self._index: dict[tuple[int, ...], Tensor] = {}
        self._layout_key: tuple[int, int, int] = (-1, 0, 0)
        self._plain = False
        self._all_positions: list[int] = []  # 0..n-1, made once per parameter list, not per step

    def norms(self, params: list[Tensor]) -> Tensor:
        grads = [p.grad for p in params]
        if self._plain_layout(params) and all(g is not None and g.layout == torch.strided for g in grads):
            # every parameter has a dense gradient (not a sparse one, e.g. Embedding(sparse=True)) of one
            # device and dtype: one multi-tensor pass, no regrouping
            tensors: list[Tensor] = grads  # type: ignore[assignment]
            device, dtype = tensors[0].device, tensors[0].dtype
            self._groups = [(tensors, self._all_positions, device)]
            self._sparse = []
            values = self._group_norms(tensors, dtype)
            norms = torch.stack(values)
            if device != self.device:
                norms = norms.to(self.device, non_blocking=True)
            return norms if norms.dtype == torch.float32 else norms.to(torch.float32)
        return self._norms_general(params, grads)

    def _plain_layout(self, params: list[Tensor]) -> bool:
        """All parameters dense, of one device and dtype, not DTensors (checked once per parameter list)."""
        key = (len(params), id(params[0]) if params else 0, id(params[-1]) if params else 0)
        if key != self._layout_key:
            self._layout_key = key
            self._all_positions = list(range(len(params)))
            first = params[0] if params else None
            self._plain = first is not None and all(
                p.device == first.device and p.dtype == first.dtype and p.layout == torch.strided
                and not (self._dtensor is not None and isinstance(p, self._dtensor)) for p in params)
        return self._plain

    def _norms_general(self, params: list[Tensor], all_grads: list[Tensor | None]) -> Tensor:
        grads: list[Tensor] = []
        positions: list[int] = []
        sharded: dict[tuple[Any, ...], list[int]] = {}
        self._sparse = []
        for i, g in enumerate(all_grads):
            if g is None:
                continue
            if self._dtensor is not None and isinstance(g, self._dtensor):
                over = self._groups_of(g)
                if over:
                    sharded.setdefault(over, []).append(i)
                g = g.to_local()
            if g.is_sparse:  # rare (sparse embeddings): measured and scaled on its own
                self._sparse.append((g, i))
                continue
            grads.append(g)  # under no_grad: a gradient is never part of a graph, no detach needed
            positions.append(i)
        ordered: list[Tensor] = [self._zero] * len(params)
        self._groups = []
        if grads:
            groups = _group_tensors_by_device_and_dtype([list[Tensor | None](grads)], True)
            for (device, dtype), ((tensors,), indices) in groups.items():
                at = [positions[k] for k in indices]
                self._groups.append((tensors, at, device))  # type: ignore[arg-type]
                values = self._group_norms(tensors, dtype)  # type: ignore[arg-type]
                if device != self.device:
                    values = list(torch.stack(values).to(self.device, non_blocking=True).unbind(0))
                for k, v in zip(at, values):
                    ordered[k] = v
        for g, i in self._sparse:
            value = self._group_norms([g.coalesce()._values()], g.dtype)[0]
            ordered[i] = value.to(self.device, non_blocking=True)
        norms = torch.stack(ordered) if ordered else torch.zeros(0, device=self.device)
        if norms.dtype != torch.float32:
            norms = norms.to(torch.float32)
        if sharded:
            norms = self._reduce_shards(norms, tuple((over, tuple(at)) for over, at in sharded.items()))
        return norms

    def _groups_of(self, grad: Any) -> tuple[Any, ...]:
        """The process groups of the mesh dimensions ``grad`` is sharded on (empty for a replicated DTensor)."""
        mesh, placements = grad.device_mesh, tuple(grad.placements)
        key = (id(mesh), placements)
        groups = self._shard_groups.get(key)
        if groups is None:
            groups = self._shard_groups[key] = tuple(
                mesh.get_group(dim) for dim, placement in enumerate(placements) if placement.is_shard())
        return groups

    @staticmethod
    def _group_norms(tensors: list[Tensor], dtype: torch.dtype) -> list[Tensor]:
        if dtype in _LOW_PRECISION:
            return list(torch._foreach_norm(tensors, 2, dtype=torch.float32))
        return list(torch._foreach_norm(tensors, 2))  # float32; float64/complex128 are cast once, after stacking

    @torch.no_grad()
    def scale(self, factor: Tensor) -> None:
        """Multiply the gradients measured last by ``factor``: a 0-d tensor, or one entry per parameter."""
        per_tensor = factor.dim() == 1
        for tensors, at, device in self._groups:
            if per_tensor:
                local = factor if device == self.device else factor.to(device, non_blocking=True)
                if len(at) != local.shape[0] or at != list(range(len(at))):
                    local = local.index_select(0, self._positions(tuple(at), device))
                torch._foreach_mul_(tensors, list(local.unbind(0)))
            else:
                local = factor if device == self.device else factor.to(device, non_blocking=True)
                torch._foreach_mul_(tensors, local)
        for g, i in self._sparse:
            g.mul_(factor[i] if per_tensor else factor)

    def _positions(self, at: tuple[int, ...], device: torch.device) -> Tensor:
        index = self._index.get(at)
        if index is None or index.device != device:
            index = self._index[at] = torch.tensor(at, dtype=torch.long, device=device)
        return index

    def _reduce_shards(self, norms: Tensor, layout: tuple[tuple[tuple[Any, ...], tuple[int, ...]], ...]) -> Tensor:
        """Sum the squared norms of each set of shards over its groups; one all-reduce per group (one for FSDP2)."""
        import torch.distributed as dist

        if layout != self._mask_key or any(mask.shape[0] != norms.shape[0] for _, mask in self._masks):
            # built once per layout (one small host-to-device copy per set), not per step
            self._masks = []
            for groups, at in layout:
                mask = torch.zeros(norms.shape[0], dtype=torch.bool)
                mask[list(at)] = True
                self._masks.append((groups, mask.to(self.device)))
            self._mask_key = layout
        squares = norms * norms
        summed = squares
        for groups, mask in self._masks:
            partial = torch.where(mask, squares, torch.zeros_like(squares))
            for group in groups:  # a 2-D sharding (FSDP x TP) sums over both dimensions
                dist.all_reduce(partial, op=dist.ReduceOp.SUM, group=group)
            summed = torch.where(mask, partial, summed)
        return torch.sqrt(summed)
