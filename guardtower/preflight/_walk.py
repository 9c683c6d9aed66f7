"""Find the tensors inside a model call's arguments (nested tuples, lists, dicts, ``BatchEncoding``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Iterator

import torch

__all__ = ["iter_tensors"]


def iter_tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor in ``value``, in a deterministic order (mapping keys sorted)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for key in sorted(value, key=str):
            yield from iter_tensors(value[key])
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from iter_tensors(item)
