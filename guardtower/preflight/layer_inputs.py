"""What the model's first layers receive: ``embedding_padding`` (a real token whose embedding row can never train),
``input_scale`` (features far from the scale a first layer is initialised for) and ``batch_diversity`` (a batch
of copies of one sample).

The ``layer_inputs`` probe watches, while the step runs, the first call of each trainable ``nn.Embedding`` that
has a ``padding_idx`` (its ids) and the first call of the first linear, convolutional or recurrent layer to run
on a floating input (summary statistics of that input only). Measuring at the first layer, not at ``model(...)``,
leaves a model that normalises its raw input itself (a BatchNorm or an image processor inside) quiet.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import torch
from torch import nn

from guardtower.preflight._batch import batch_mapping
from guardtower.preflight._registry import AuditContext, check, probe
from guardtower.preflight._util import NOT_INPUT_KEYS, iter_tensors
from guardtower.report import Finding
from guardtower.severity import Severity

__all__ = ["LayerInputs", "FirstLayerInput"]

_FIRST_LAYERS = (nn.Linear, nn.modules.conv._ConvNd, nn.RNNBase)
#: a first-layer input whose spread is below this share of its magnitude is nearly constant
_CONSTANT_SPREAD = 1e-2
#: raw, unscaled features: root-mean-square and largest magnitude above these
_RAW_RMS, _RAW_MAX = 20.0, 100.0


@dataclass(frozen=True)
class FirstLayerInput:
    """Summary of the input the first linear/conv/recurrent layer received."""

    name: str
    shape: tuple[int, ...]
    rms: float
    std: float
    """the spread within each feature channel (pooled over channels): what tells one sample from another"""
    max_abs: float
    integral: bool


@dataclass
class LayerInputs:
    padding_ids: dict[str, tuple[int, torch.Tensor]] = field(default_factory=dict)
    """embedding name -> (padding_idx, the ids of its first call)"""
    first: FirstLayerInput | None = None


def _summary(name: str, x: torch.Tensor, channel_dim: int) -> FirstLayerInput:
    with torch.no_grad():
        v = x.detach().float()
        if not bool(torch.isfinite(v).all()) or v.dim() == 0:
            return FirstLayerInput(name, tuple(x.shape), 0.0, 0.0, 0.0, False)
        channels = v.movedim(channel_dim, 0).reshape(v.shape[channel_dim], -1)
        within = float(channels.var(dim=1, unbiased=False).mean().sqrt()) if channels.shape[1] > 1 else 0.0
        return FirstLayerInput(name, tuple(x.shape), float(v.square().mean().sqrt()), within,
                               float(v.abs().max()), bool((v == v.round()).all()))


@probe("layer_inputs")
@contextlib.contextmanager
def _layer_inputs(ctx: AuditContext) -> Iterator[LayerInputs]:
    seen = LayerInputs()
    ctx.probes["layer_inputs"] = seen

    def padding_hook(name: str, padding_idx: int) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            ids = args[0] if args else None
            if name not in seen.padding_ids and isinstance(ids, torch.Tensor) and ids.device.type != "meta":
                seen.padding_ids[name] = (padding_idx, ids.detach().clone())

        return hook

    def first_hook(name: str, channel_dim: int) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0] if args else None
            if (seen.first is None and isinstance(x, torch.Tensor) and x.is_floating_point()
                    and x.device.type != "meta" and x.numel() > 0 and x.dim() > max(channel_dim, 0)):
                seen.first = _summary(name, x, channel_dim)

        return hook

    handles = []
    for name, m in ctx.model.named_modules():
        if isinstance(m, nn.Embedding) and m.padding_idx is not None and m.weight.requires_grad:
            handles.append(m.register_forward_pre_hook(padding_hook(name, m.padding_idx)))
        elif isinstance(m, _FIRST_LAYERS):  # features: dim 1 of a convolution's input, the last dim otherwise
            conv = isinstance(m, nn.modules.conv._ConvNd)
            handles.append(m.register_forward_pre_hook(first_hook(name, 1 if conv else -1)))
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


def _longest_run(hits: torch.Tensor) -> int:
    longest = run = 0
    for hit in hits.tolist():
        run = run + 1 if hit else 0
        longest = max(longest, run)
    return longest


def _interior(ids: torch.Tensor, pad: int) -> torch.Tensor:
    """Positions holding ``pad`` with a different token both before and after them in their row: a real token,
    not left or right padding."""
    rows = ids.reshape(-1, ids.shape[-1]) if ids.dim() >= 1 else ids.reshape(1, 1)
    is_pad = rows == pad
    other = (~is_pad).int()
    before = other.cumsum(-1) > 0
    after = other.flip(-1).cumsum(-1).flip(-1) > 0
    return is_pad & before & after


def _padded_with(ids: torch.Tensor, mask: Any) -> set[int]:
    """The ids the batch visibly pads with: the commonest under ``attention_mask == 0``, else those of trailing runs
    (two rows ending in a run of one id, or one row ending in three or more)."""
    if isinstance(mask, torch.Tensor) and mask.shape == ids.shape and bool((mask == 0).any()):
        return {int(ids[mask == 0].mode().values)}
    rows = ids.reshape(-1, ids.shape[-1])
    runs: dict[int, list[int]] = {}
    for row in rows:
        last = row[-1]
        length = int((row.flip(0) != last).int().cumsum(0).eq(0).sum())
        if length >= 2:
            runs.setdefault(int(last), []).append(length)
    return {q for q, lengths in runs.items() if len(lengths) >= 2 or max(lengths) >= 3}


#: in a 1-d lookup, the padding id counts as a real id when it is at most this share of the ids, never 3 in a row
_PER_SAMPLE_PAD_SHARE = 0.5


@check("embedding_padding", emits=("INPUT-008",))
def check_embedding_padding(ctx: AuditContext) -> Iterable[Finding]:
    """INPUT-008: an embedding's ``padding_idx`` is a token the batch uses inside its sequences while it pads
    with another id. The row of ``padding_idx`` gets no gradient by construction, so that token (an ``<unk>``, a
    separator) never trains. Without visible padding the audit cannot tell a real token from a random test id, except
    in a lookup of one id per sample (no sequence axis), which has no padding at all."""
    seen: LayerInputs | None = ctx.probes.get("layer_inputs")
    batch = batch_mapping(ctx.inputs, ctx.trace.calls if ctx.trace is not None else [])
    mask = batch.get("attention_mask") if batch is not None else None
    findings = []
    for name, (pad, ids) in (seen.padding_ids.items() if seen else ()):
        if ids.is_floating_point() or ids.dim() == 0 or ids.shape[-1] < 3:
            continue
        if ids.dim() == 1:  # one id per sample (an entity, a user, a relation): no sequence, so no padding
            hits = ids == pad
            count = int(hits.sum())
            if count and count <= _PER_SAMPLE_PAD_SHARE * ids.numel() and _longest_run(hits) < 3:
                findings.append(Finding(
                    "embedding_padding", Severity.WARN,
                    f"{name} has padding_idx={pad} and is looked up with one id per sample, {count} of which are "
                    f"{pad}: a batch of single ids has no padding, so id {pad} is a real entity whose row never gets "
                    "a gradient and never trains; drop padding_idx (or shift the ids by one)",
                    "INPUT-008", {"module": name, "padding_idx": pad, "inside": count, "pads_with": []},
                ))
            continue
        interior = _interior(ids, pad)
        if isinstance(mask, torch.Tensor) and mask.shape == ids.shape:
            interior &= (mask != 0).reshape(interior.shape)  # a real token is one the mask attends to
        inside = int(interior.sum())
        padded_with = _padded_with(ids, mask) - {pad}
        if inside and padded_with:
            findings.append(Finding(
                "embedding_padding", Severity.WARN,
                f"{name} has padding_idx={pad}, yet the batch pads with {sorted(padded_with)} and id {pad} occurs "
                f"{inside} time(s) inside its sequences: the padding row never gets a gradient, so that real "
                f"token's embedding never trains; set padding_idx to the id the batch pads with",
                "INPUT-008", {"module": name, "padding_idx": pad, "inside": inside, "pads_with": sorted(padded_with)},
            ))
    return findings


@check("input_scale", emits=("INPUT-009",))
def check_input_scale(ctx: AuditContext) -> Iterable[Finding]:
    """INPUT-009: the first layer's input is unscaled (raw pixels, raw measurements) or nearly constant (a
    normalisation applied twice): a layer initialised for unit-scale inputs then saturates or learns nothing."""
    seen: LayerInputs | None = ctx.probes.get("layer_inputs")
    first = seen.first if seen else None
    if first is None or first.rms == 0.0:
        return []
    details = {"module": first.name, "shape": list(first.shape), "rms": first.rms, "std": first.std,
               "max_abs": first.max_abs}
    if first.rms > _RAW_RMS and first.max_abs > _RAW_MAX:
        kind = " whole numbers (raw pixel values or counts?)" if first.integral else ""
        return [Finding(
            "input_scale", Severity.WARN,
            f"the first layer {first.name} receives unscaled input{kind}: root-mean-square {first.rms:.3g}, largest "
            f"|value| {first.max_abs:.3g}; layers are initialised for inputs of about unit scale, so activations "
            "and gradients start orders of magnitude off; standardise the features (or divide pixels by 255 and "
            "normalise)",
            "INPUT-009", details,
        )]
    numel = 1
    for s in first.shape:
        numel *= s
    if numel >= 64 and 0.0 < first.std < _CONSTANT_SPREAD * first.rms:
        return [Finding(
            "input_scale", Severity.WARN,
            f"the first layer {first.name} receives a nearly constant input: its spread within each feature (std "
            f"{first.std:.3g}) is {first.std / first.rms:.2%} of its magnitude ({first.rms:.3g}); the samples and "
            "positions barely differ, as when a "
            "normalisation is applied twice (pixels divided by 255 twice); check the preprocessing",
            "INPUT-009", details,
        )]
    return []


@check("batch_diversity", emits=("DATA-012",))
def check_batch_diversity(ctx: AuditContext) -> Iterable[Finding]:
    """DATA-012: every sample of the batch is the same: each input tensor of the model's first call (masks and
    labels aside) has identical rows. A dataset whose ``__getitem__`` ignores its index, or a batch built by
    ``expand`` from one example, trains on one sample while the loss falls fast."""
    if ctx.trace is None or not ctx.trace.calls:
        return []
    first = ctx.trace.training_call()
    tensors = [(path, t) for path, t in iter_tensors((first.args, first.kwargs), skip_keys=NOT_INPUT_KEYS)
               if t.dim() >= 1 and t.device.type != "meta" and not t.is_complex()]
    batch = {t.shape[0] for _, t in tensors}
    if len(batch) != 1 or min(batch) < 2:
        return []
    if not all(torch.equal(t, t[:1].expand_as(t)) for _, t in tensors):
        return []
    if all(bool((t == t.reshape(-1)[0]).all()) for _, t in tensors):
        return []  # one value everywhere (torch.ones): a placeholder batch, not copies of a real sample
    return [Finding(
        "batch_diversity", Severity.WARN,
        f"all {min(batch)} samples of the batch are identical ({', '.join(p or 'input' for p, _ in tensors[:4])}): "
        "the step trains on one example repeated; check that the dataset's __getitem__ uses its index and "
        "that the collator stacks different items",
        "DATA-012", {"batch": min(batch), "inputs": [p for p, _ in tensors[:8]]},
    )]
