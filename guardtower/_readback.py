"""Device-to-host copies that never make the host wait: pinned buffers fenced by a CUDA event.

The guard's step records, ``monitor()``'s per-pass flags and the rollback snapshots all move small device
tensors to host memory while training runs on. ``host_copy`` starts such a copy (into a reused buffer when
it fits); a ``Fence`` recorded after a batch of copies says when they have all landed. On the CPU there is
nothing to wait for: the copy is immediate and the fence is always done.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["host_copy", "Fence"]


def host_copy(src: Tensor, buf: Tensor | None = None) -> Tensor:
    """Copy ``src`` into host memory without waiting for the device; returns the host buffer.

    ``buf`` is reused when its shape and dtype fit, else a new buffer is made (pinned when ``src`` is on an
    accelerator, so the copy is truly asynchronous). The values are valid once a later ``Fence`` is done.
    """
    src = src.detach()
    accelerated = src.device.type != "cpu"
    if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
        buf = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=accelerated and _can_pin())
    buf.copy_(src, non_blocking=accelerated)
    return buf


def _can_pin() -> bool:
    return torch.cuda.is_available()


class Fence:
    """Marks every copy queued so far on the current CUDA stream; ``done()``/``wait()`` ask about them."""

    __slots__ = ("_event",)

    def __init__(self, device: torch.device | str | None) -> None:
        self._event: Any = None
        if device is not None and torch.device(device).type == "cuda":
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(torch.device(device)))

    def done(self) -> bool:
        """True when reading the copied values will not wait for the device."""
        return self._event is None or bool(self._event.query())

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()
