"""The batch as the checks see it: the ``inputs=`` mapping, else the keyword arguments of the model call, and
the label positions that sit on padding."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

import torch
from torch import nn

from guardtower.preflight._trace import RootCall

__all__ = ["batch_mapping", "labelled_padding", "confirm_padded_labels_ignored"]


def batch_mapping(inputs: Any, calls: list[RootCall]) -> Mapping[str, Any] | None:
    """``inputs`` when it is a mapping, else the keyword arguments of the first model call that got labels."""
    if isinstance(inputs, Mapping):
        return inputs
    for call in calls:
        if "labels" in call.kwargs:
            return call.kwargs
    return None


def labelled_padding(model: nn.Module, batch: Mapping[str, Any] | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(labels, padded & labelled)`` when some padding position carries a label, else None. Labels align with
    the decoder in encoder-decoder models, so only the decoder's mask says what is padding there."""
    if batch is None:
        return None
    config = getattr(model, "config", None)
    mask_key = "decoder_attention_mask" if getattr(config, "is_encoder_decoder", False) else "attention_mask"
    labels, mask = batch.get("labels"), batch.get(mask_key)
    if not (isinstance(labels, torch.Tensor) and isinstance(mask, torch.Tensor) and labels.shape == mask.shape
            and not labels.is_floating_point()):
        return None
    leaked = (mask == 0) & (labels != -100)
    return (labels, leaked) if bool(leaked.any()) else None


def confirm_padded_labels_ignored(step_fn: Callable[[], Any], labels: torch.Tensor, leaked: torch.Tensor,
                                  loss: torch.Tensor, rng: Callable[[], None], *, backward: bool) -> bool | None:
    """Re-run ``step_fn`` with the labels on padding changed in place (put back afterwards) and the same RNG
    stream; True when the loss is bitwise unchanged: the loss drops padding itself (ELECTRA, a CRF that masks).
    Without gradients, unless ``step_fn`` runs ``backward()`` itself (the caller puts the weights back)."""
    saved = labels.detach().clone()
    try:
        with torch.no_grad():
            top = int(labels[labels != -100].max()) + 1
            labels[leaked] = (labels[leaked] + 1) % max(top, 2)
        rng()
        with torch.set_grad_enabled(backward):
            out = step_fn()
    except Exception:
        return None
    finally:
        with torch.no_grad():
            labels.copy_(saved)
    other = out if isinstance(out, torch.Tensor) else getattr(out, "loss", None)
    if not isinstance(other, torch.Tensor) or other.shape != loss.shape:
        return None
    return bool(torch.equal(other.detach(), loss.detach()))
