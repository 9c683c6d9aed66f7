"""Periodic snapshots of model and optimizer state in CPU memory, for ``nan_action="rollback"``.

A snapshot copies parameters, buffers and optimizer state tensors into preallocated CPU buffers
(``guardtower._readback``: pinned, asynchronous, fenced when the source is on an accelerator), every
``every`` steps, into one of ``keep`` slots that are reused round-robin: no allocation and no host wait in
steady state, and never a full copy per step. The wait happens only in ``restore``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
from torch import Tensor, nn

from guardtower._readback import Fence, host_copy

__all__ = ["Snapshot", "SnapshotStore"]


def _local(t: Tensor) -> Tensor:
    """The local shard of a DTensor (FSDP2), the tensor itself otherwise."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


@dataclass
class Snapshot:
    step: int
    tensors: list[Tensor] = field(default_factory=list)  # one per tracked model tensor
    # per optimizer param: None (no state yet) or {key: (cpu copy, device) | plain value}
    opt_state: list[dict[str, Any] | None] = field(default_factory=list)
    fence: Fence | None = None  # fences the asynchronous copies

    def wait(self) -> None:
        if self.fence is not None:
            self.fence.wait()


class SnapshotStore:
    """Keep the last ``keep`` snapshots, one every ``every`` steps."""

    def __init__(self, model: nn.Module | None, optimizer: torch.optim.Optimizer, every: int, keep: int) -> None:
        self.model = model
        self.optimizer = optimizer
        self.every = every
        self.keep = keep
        self.snapshots: list[Snapshot] = []  # oldest first

    def _tracked(self) -> list[Tensor]:
        seen: set[int] = set()
        out: list[Tensor] = []
        sources: list[Iterable[Tensor]] = [(p for g in self.optimizer.param_groups for p in g["params"])]
        if self.model is not None:
            sources = [self.model.parameters(), self.model.buffers(), *sources]
        for source in sources:
            for t in source:
                if id(t) not in seen:
                    seen.add(id(t))
                    out.append(t)
        return out

    def _params(self) -> list[Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def due(self, step: int) -> bool:
        return step % self.every == 0

    @torch.no_grad()
    def take(self, step: int) -> Snapshot:
        """Copy the current state into a recycled slot (the oldest) or a new one."""
        slot = self.snapshots.pop(0) if len(self.snapshots) >= self.keep else Snapshot(step)
        slot.step = step
        tracked = self._tracked()
        slot.tensors = [host_copy(_local(t), buf) for buf, t in _zip_longest_bufs(slot.tensors, tracked)]
        old_state = slot.opt_state
        slot.opt_state = []
        for i, p in enumerate(self._params()):
            state = self.optimizer.state.get(p)
            if not state:
                slot.opt_state.append(None)
                continue
            prev = old_state[i] if i < len(old_state) else None
            saved: dict[str, Any] = {}
            for key, value in state.items():
                if isinstance(value, Tensor):
                    prev_entry = prev.get(key) if prev else None
                    buf = prev_entry[0] if isinstance(prev_entry, tuple) else None
                    saved[key] = (host_copy(_local(value), buf), value.device)
                else:
                    saved[key] = copy.deepcopy(value)
            slot.opt_state.append(saved)
        cuda = next((t.device for t in tracked if t.device.type == "cuda"), None)
        slot.fence = Fence(cuda) if cuda is not None else None
        self.snapshots.append(slot)
        return slot

    def latest_before(self, step: int) -> Snapshot | None:
        """The newest snapshot taken strictly before ``step`` (a snapshot at the bad step itself is not clean)."""
        for snap in reversed(self.snapshots):
            if snap.step < step:
                return snap
        return None

    @torch.no_grad()
    def restore(self, snap: Snapshot) -> None:
        """Write ``snap`` back into the model and the optimizer state (waits for its copies first)."""
        snap.wait()
        for target, buf in zip(self._tracked(), snap.tensors):
            _local(target).copy_(buf, non_blocking=True)
        state = self.optimizer.state
        for p, saved in zip(self._params(), snap.opt_state):
            if saved is None:
                state.pop(p, None)
                continue
            current = state.get(p, {})
            restored: dict[str, Any] = {}
            for key, value in saved.items():
                if isinstance(value, tuple):
                    buf, device = value
                    cur = current.get(key)
                    if isinstance(cur, Tensor) and cur.shape == buf.shape and cur.dtype == buf.dtype:
                        _local(cur).copy_(buf, non_blocking=True)
                        restored[key] = cur
                    else:
                        restored[key] = buf.to(device, copy=True)
                else:
                    restored[key] = copy.deepcopy(value)
            state[p] = restored
        # drop later snapshots: they describe a future that no longer happened
        self.snapshots = [s for s in self.snapshots if s.step <= snap.step]

    def clear(self) -> None:
        self.snapshots = []


def _zip_longest_bufs(bufs: list[Tensor], sources: list[Tensor]) -> list[tuple[Tensor | None, Tensor]]:
    return [(bufs[i] if i < len(bufs) else None, t) for i, t in enumerate(sources)]

