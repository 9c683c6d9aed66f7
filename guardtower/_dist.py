"""Where this process sits in a torch.distributed job, without importing anything heavy."""

from __future__ import annotations

import os

__all__ = ["current_rank", "world_size", "is_distributed", "multi_rank"]


def is_distributed() -> bool:
    """True when a default process group is initialised."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def multi_rank() -> bool:
    """True when a process group with more than one rank is initialised."""
    return is_distributed() and world_size() > 1


def current_rank() -> int:
    """The global rank: from the process group when one is initialised, else ``RANK``, else 0."""
    if is_distributed():
        import torch.distributed as dist

        return dist.get_rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def world_size() -> int:
    """The number of ranks: from the process group, else ``WORLD_SIZE``, else 1."""
    if is_distributed():
        import torch.distributed as dist

        return dist.get_world_size()
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1
