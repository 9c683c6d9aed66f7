"""Step records: one packed float32 vector per step, carried to the host without making it wait.

On CUDA each vector is copied with ``non_blocking=True`` into a pinned buffer of a small ring and fenced with
an event; ``ready()`` hands back the records whose event has completed, oldest first. On the CPU the vector
already lives in host memory. ``ready()`` waits only for records more than ``max_lag`` steps old, which
keeps the host at most ``max_lag`` steps ahead of its event reporting.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any, Iterator, NamedTuple

import torch
from torch import Tensor

__all__ = ["HEADER", "Header", "StepRecord", "RecordQueue"]

class Header(NamedTuple):
    """The fields at the start of every record; per-tensor norms, ratios, baselines, tripped flags follow.

    ``reject``, ``spike`` and ``nonfinite`` are agreed across ranks; ``global_tripped`` is this rank's.
    """

    reject: float
    spike: float
    nonfinite: float
    overflow: float
    global_norm: float
    global_baseline: float
    global_ratio: float
    loss: float
    global_tripped: float


HEADER = Header._fields


@dataclass
class StepRecord:
    step: int
    data: Tensor  # host float32 vector; valid once ``event`` (if any) has completed
    event: Any
    n: int
    lr: float | None
    loss: float | None  # a loss given as a Python number
    loss_on_device: bool  # the loss slot of ``data`` holds the loss tensor's value

    def header(self) -> Header:
        return Header(*self.data[:len(HEADER)].tolist())

    def done(self) -> bool:
        return self.event is None or bool(self.event.query())

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()


class RecordQueue:
    """Pending step records, in step order."""

    def __init__(self, max_lag: int = 2, ring_size: int = 40) -> None:
        self.max_lag = max_lag
        self._pending: collections.deque[StepRecord] = collections.deque()
        self._ring: list[Tensor | None] = [None] * ring_size
        self._next = 0

    def push(self, step: int, vec: Tensor, n: int, lr: float | None, loss: float | None,
             loss_on_device: bool) -> None:
        event = None
        if vec.device.type == "cpu":
            data = vec
        else:
            slot = self._next % len(self._ring)
            self._next += 1
            buf = self._ring[slot]
            if buf is None or buf.shape != vec.shape:
                buf = torch.empty(vec.shape, dtype=vec.dtype, pin_memory=True)
                self._ring[slot] = buf
            buf.copy_(vec, non_blocking=True)
            data = buf
            if vec.device.type == "cuda":
                event = torch.cuda.Event()
                event.record()
        self._pending.append(StepRecord(step, data, event, n, lr, loss, loss_on_device))

    def ready(self, block: bool = False) -> Iterator[StepRecord]:
        """Pop the records that can be read now (all of them when ``block``)."""
        while self._pending:
            record = self._pending[0]
            if not record.done():
                if not block and len(self._pending) <= self.max_lag:
                    return
                record.wait()
            yield self._pending.popleft()

    def __len__(self) -> int:
        return len(self._pending)

    def clear(self) -> None:
        self._pending.clear()
