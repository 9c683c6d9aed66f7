"""The bookkeeping behind ``monitor()``: record module inputs/outputs cheaply, reduce them in one pass.

Forward hooks only *record references* to floating-point tensors (no kernels). The recorded tensors are
reduced in chunks with one multi-tensor ``torch._foreach_max`` per (device, dtype) group, which propagates
NaN and keeps +Inf, so "max is not < +Inf" is exactly "contains NaN or +Inf". The per-slot verdicts stay on
the device as small bool vectors; the references are released right after each chunk is reduced. Only when
the folded flag of a pass trips are the verdicts copied to the host to find the first bad module.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from guardtower._readback import Fence, host_copy

__all__ = ["Tracker", "PassResult", "Blame", "CHUNK_MAX_SLOTS", "CHUNK_MAX_BYTES", "MAX_LAG"]

#: reduce the pending tensors once this many are held ...
CHUNK_MAX_SLOTS = 256
#: ... or once they hold this many bytes, so recording never keeps much memory alive beyond autograd's own
CHUNK_MAX_BYTES = 512 * 2**20
#: on CUDA, how many finished forward passes may wait for their flag before the host waits for the oldest
MAX_LAG = 2
#: how deep tuples/lists/dicts (HF ModelOutput) in module inputs/outputs are walked
_MAX_DEPTH = 3
_INF = math.inf


@dataclass
class Blame:
    """The first module (in completion order) whose output held NaN/+Inf in one forward pass."""

    module: str
    input_nonfinite: bool
    step: int
    nonfinite_modules: list[str]
    mutated_in_place: bool


@dataclass
class PassResult:
    """A finished forward pass whose verdicts may still be in flight on the device."""

    step: int
    records: list[tuple[int, tuple[int, ...], tuple[int, ...]]]
    parts: list[tuple[torch.Tensor, list[int]]]
    stale: list[bool]
    flag: torch.Tensor | None = None
    fence: Fence | None = None

    def ready(self) -> bool:
        """True when reading ``flag`` will not wait for the device."""
        return self.fence is None or self.fence.done()

    def tripped(self) -> bool:
        """Read the pass flag (waits for the device only if ``ready()`` is False)."""
        if self.flag is None:
            return False
        if self.fence is not None:
            self.fence.wait()
        return bool(self.flag)

    def blame(self, names: Sequence[str]) -> Blame | None:
        """Slow path (host sync): the first module in completion order whose output went NaN/+Inf."""
        bad: set[int] = set()
        for verdicts, slots in self.parts:
            for slot, is_bad in zip(slots, verdicts.tolist()):
                if is_bad:
                    bad.add(slot)
        culprits = [(m, ins, outs) for m, ins, outs in self.records if any(s in bad for s in outs)]
        if not culprits:
            return None
        # a record whose output tensor was later changed in place shows that later state; prefer a fresh one
        fresh = [c for c in culprits if not any(self.stale[s] for s in c[2] if s in bad)]
        module, ins, outs = (fresh or culprits)[0]
        return Blame(
            module=names[module],
            input_nonfinite=any(s in bad for s in ins),
            step=self.step,
            nonfinite_modules=list(dict.fromkeys(names[m] for m, _, _ in culprits)),
            mutated_in_place=not fresh,
        )


@dataclass
class _Chunk:
    """Tensors recorded since the last reduction; ``slot_of`` maps id(tensor) to its slot (deduplication)."""

    tensors: list[torch.Tensor] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    slot_of: dict[int, int] = field(default_factory=dict)
    nbytes: int = 0


class Tracker:
    """Records one forward pass at a time and turns it into a ``PassResult``."""

    def __init__(self) -> None:
        self.step = 0
        self._reset()

    def _reset(self) -> None:
        self._chunk = _Chunk()
        self._base = 0
        self._records: list[tuple[int, tuple[int, ...], tuple[int, ...]]] = []
        self._parts: list[tuple[torch.Tensor, list[int]]] = []
        self._stale: list[bool] = []

    # -- hot path: Python only, no kernels ---------------------------------------------------------------
    def slots(self, obj: Any) -> tuple[int, ...]:
        """The slots of every floating-point tensor in ``obj`` (tensor, tuple/list, dict/ModelOutput)."""
        found: list[int] = []
        self._walk(obj, found, 0)
        return tuple(found)

    def _walk(self, obj: Any, found: list[int], depth: int) -> None:
        if isinstance(obj, torch.Tensor):
            if obj.is_floating_point() and obj.numel() > 0:
                found.append(self._slot(obj))
        elif depth < _MAX_DEPTH:
            if isinstance(obj, (tuple, list)):
                for item in obj:
                    self._walk(item, found, depth + 1)
            elif isinstance(obj, Mapping):
                for item in obj.values():
                    self._walk(item, found, depth + 1)

    def _slot(self, tensor: torch.Tensor) -> int:
        chunk = self._chunk
        version = -1 if tensor.is_inference() else tensor._version
        local = chunk.slot_of.get(id(tensor))
        if local is not None and chunk.versions[local] == version:
            return self._base + local
        local = len(chunk.tensors)
        chunk.tensors.append(tensor)
        chunk.versions.append(version)
        chunk.slot_of[id(tensor)] = local
        chunk.nbytes += tensor.nbytes
        return self._base + local

    def record(self, module: int, inputs: tuple[int, ...], outputs: tuple[int, ...]) -> None:
        """Remember that ``module`` read ``inputs`` and returned ``outputs`` (slots); reduce if the chunk is full."""
        self._records.append((module, inputs, outputs))
        if len(self._chunk.tensors) >= CHUNK_MAX_SLOTS or self._chunk.nbytes >= CHUNK_MAX_BYTES:
            self.reduce()

    # -- one multi-tensor pass per chunk -----------------------------------------------------------------
    def reduce(self) -> None:
        """Reduce the pending tensors to per-slot NaN/+Inf verdicts on their devices; drop the references."""
        chunk = self._chunk
        if not chunk.tensors:
            return
        self._stale.extend(
            (-1 if t.is_inference() else t._version) != v for t, v in zip(chunk.tensors, chunk.versions)
        )
        groups: dict[tuple[torch.device, torch.dtype], list[int]] = collections.defaultdict(list)
        for local, tensor in enumerate(chunk.tensors):
            groups[(tensor.device, tensor.dtype)].append(local)
        with torch.no_grad():
            for locals_ in groups.values():
                tensors = [chunk.tensors[i] for i in locals_]
                maxima = torch.stack(_foreach_max(tensors))
                # NaN < inf is False and inf < inf is False: exactly the NaN/+Inf entries are flagged
                self._parts.append((torch.lt(maxima, _INF).logical_not_(), [self._base + i for i in locals_]))
        self._base += len(chunk.tensors)
        self._chunk = _Chunk()

    def finish(self) -> PassResult:
        """Close the current pass: reduce what is left, fold the verdicts into one flag, start the next pass."""
        self.reduce()
        result = PassResult(step=self.step, records=self._records, parts=self._parts, stale=self._stale)
        if self._parts:
            device = self._parts[0][0].device
            with torch.no_grad():
                verdicts = torch.cat([v.to(device, non_blocking=True) for v, _ in self._parts])
                flag = verdicts.any()
            if device.type == "cpu":
                result.flag = flag
            else:
                result.flag, result.fence = host_copy(flag), Fence(device)
        self.step += 1
        self._reset()
        return result

    def discard(self) -> None:
        """Forget the current pass (its forward raised); the step counter still advances."""
        self.step += 1
        self._reset()


def _foreach_max(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per-tensor max with NaN propagation: one fused kernel per launch on CUDA where torch has it."""
    if hasattr(torch, "_foreach_max"):
        return list(torch._foreach_max(tensors))
    return [t.max() for t in tensors]
