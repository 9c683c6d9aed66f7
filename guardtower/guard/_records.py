"""Step records: one packed float32 vector per step, carried to the host without making it wait.

On an accelerator each vector is copied into a pinned buffer of a small ring and fenced
(``guardtower._readback``); ``ready()`` hands back the records whose fence is done, oldest first. On the CPU
the vector already lives in host memory and is ready at once. ``ready()`` waits only for records more than ``max_lag`` steps old, which
keeps the host at most ``max_lag`` steps ahead of its event reporting.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Iterator, NamedTuple

from torch import Tensor

from guardtower._readback import Fence, host_copy

__all__ = ["HEADER", "Header", "StepRecord", "RecordQueue"]

class Header(NamedTuple):
    """A record's header, read every step; its body (per-tensor norms, then the detector's report) is read
    only when an incident or a summary needs it.

    ``reject`` (spike or non-finite) and ``skip`` (the update was not applied) are agreed across ranks (set if
    set on any rank); ``absorbed`` (the detector re-baselined a level shift) is this rank's. ``scale`` is the
    factor ``nan_action="clip"`` multiplied the gradients by (the smallest one per tensor).
    """

    reject: float
    skip: float
    absorbed: float
    overflow: float
    global_norm: float
    loss: float
    scale: float


HEADER = Header._fields


@dataclass
class StepRecord:
    step: int
    head: Tensor  # host float32 vectors; valid once ``fence`` is done
    body: Tensor
    fence: Fence | None
    n: int
    lr: float | None
    loss: float | None  # a loss given as a Python number
    loss_on_device: bool  # the loss slot of ``head`` holds the loss tensor's value
    tail: int = 0  # the body's last ``tail`` values: every rank's slots (``guardtower.guard._ranks``)

    def header(self) -> Header:
        return Header(*self.head.tolist())

    def done(self) -> bool:
        return self.fence is None or self.fence.done()

    def wait(self) -> None:
        if self.fence is not None:
            self.fence.wait()


class RecordQueue:
    """Pending step records, in step order."""

    def __init__(self, max_lag: int = 2, ring_size: int = 40) -> None:
        self.max_lag = max_lag
        self._pending: collections.deque[StepRecord] = collections.deque()
        self._ring: list[tuple[Tensor | None, Tensor | None]] = [(None, None)] * ring_size
        self._next = 0

    def push(self, step: int, head: Tensor, body: Tensor, n: int, lr: float | None, loss: float | None,
             loss_on_device: bool, tail: int = 0) -> None:
        """Queue a step's record: on the CPU the tensors as they are, else host copies fenced together."""
        fence = None
        device = head.device
        if device.type != "cpu":
            slot = self._next % len(self._ring)
            self._next += 1
            old_head, old_body = self._ring[slot]
            head, body = host_copy(head, old_head), host_copy(body, old_body)
            self._ring[slot] = (head, body)
            fence = Fence(device)
        self._pending.append(StepRecord(step, head, body, fence, n, lr, loss, loss_on_device, tail))

    def ready(self, block: bool = False, wait_for_old: bool = True) -> Iterator[StepRecord]:
        """Pop the records that can be read now, oldest first.

        ``block`` waits for all of them; otherwise a record more than ``max_lag`` steps old is waited for
        (``wait_for_old``), or never waited for at all.
        """
        while self._pending:
            record = self._pending[0]
            if not record.done():
                if not block and (not wait_for_old or len(self._pending) <= self.max_lag):
                    return
                record.wait()
            yield self._pending.popleft()

    def __len__(self) -> int:
        return len(self._pending)

    def clear(self) -> None:
        self._pending.clear()
