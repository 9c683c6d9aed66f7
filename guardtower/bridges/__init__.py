"""Experiment-tracker bridges: bus sinks that forward guardtower events to W&B, MLflow and TensorBoard.

Names resolve lazily, and the bridge modules import ``wandb``/``mlflow``/``tensorboard`` only when a bridge
is constructed, so ``import guardtower.bridges`` stays cheap and works without any of them installed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["WandBBridge", "MLflowBridge", "TensorBoardBridge"]

_EXPORTS: dict[str, str] = {
    "WandBBridge": "guardtower.bridges.wandb",
    "MLflowBridge": "guardtower.bridges.mlflow",
    "TensorBoardBridge": "guardtower.bridges.tensorboard",
}

if TYPE_CHECKING:
    from guardtower.bridges.mlflow import MLflowBridge
    from guardtower.bridges.tensorboard import TensorBoardBridge
    from guardtower.bridges.wandb import WandBBridge


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'guardtower.bridges' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
