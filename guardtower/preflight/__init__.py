"""Pre-flight audit: ``audit()`` runs one instrumented training step and reports the silent bugs it reveals;
``lora_summary()`` runs the static LoRA/PEFT checks; ``is_peft_model()`` tells PEFT models apart without
importing peft.

Checks live one module per area and register themselves with ``guardtower.preflight._registry.check`` when
imported here.
"""

from __future__ import annotations


# check modules register their checks and probes on import (the report orders checks by name, not by this)
from guardtower.preflight import loss as _loss  # noqa: F401
from guardtower.preflight import inputs as _inputs  # noqa: F401
from guardtower.preflight import gradients as _gradients  # noqa: F401
from guardtower.preflight import optimizer as _optimizer  # noqa: F401
from guardtower.preflight import loop as _loop  # noqa: F401
from guardtower.preflight import checkpointing as _checkpointing  # noqa: F401
from guardtower.preflight import fitting as _fitting  # noqa: F401
from guardtower.preflight import numerics as _numerics  # noqa: F401
from guardtower.preflight import precision as _precision  # noqa: F401
from guardtower.preflight import modes as _modes  # noqa: F401
from guardtower.preflight import lr_schedule as _lr_schedule  # noqa: F401
from guardtower.preflight import supervision as _supervision  # noqa: F401
from guardtower.preflight import positions as _positions  # noqa: F401
from guardtower.preflight import layer_inputs as _layer_inputs  # noqa: F401
from guardtower.preflight import tying as _tying  # noqa: F401
from guardtower.preflight import distributed as _distributed  # noqa: F401
from guardtower.preflight import forward_weights as _forward_weights  # noqa: F401
from guardtower.preflight import shadows as _shadows  # noqa: F401
from guardtower.preflight import logprob_weights as _logprob_weights  # noqa: F401
from guardtower.preflight.lora import is_peft_model, lora_summary
from guardtower.preflight._runner import audit, run_static

__all__ = ["audit", "run_static", "lora_summary", "is_peft_model"]
