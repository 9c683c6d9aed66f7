"""``padding``: the batch against the model that receives it: the padding side against the position scheme, the
mask against the padding, the pad id against ``config.pad_token_id``.

The ``model_inputs`` probe records, for the outermost modules that carry a transformers config (the root for
Hugging Face models, a text encoder inside a user's model, a teacher and a student), the arguments of their
first call, and the output of their position embedding (``wpe``, ``position_embeddings``, ``embed_positions``).
Whether left padding shifts positions is then measured, not read from a list of architectures: the first real
token of a left-padded row must get the same position vector as the first token of an unpadded row (OPT and
RoBERTa derive positions from the mask or the pad ids and pass; GPT-2 and BERT without ``position_ids`` do not).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import torch
from torch import nn

from guardtower.preflight._batch import batch_mapping
from guardtower.preflight._padding_reads import CHANGED as PADDING_CHANGED
from guardtower.preflight._registry import AuditContext, check, probe
from guardtower.report import Finding
from guardtower.severity import Severity

__all__ = ["ModelCall", "ModelInputsRecord", "hf_config"]

#: names of the modules that embed absolute positions in transformers models
_POSITION_MODULES = frozenset({"wpe", "position_embeddings", "embed_positions", "position_embedding"})
_KEYS = ("input_ids", "attention_mask", "position_ids")
_CLASSIFIERS = ("ForSequenceClassification", "ForMultipleChoice")


@dataclass
class ModelCall:
    """The first call of one config-carrying model during the step."""

    name: str
    module: nn.Module
    arguments: dict[str, Any]
    """``input_ids``, ``attention_mask``, ``position_ids`` as the call received them (missing when not given)"""
    accepts_mask: bool
    positions: dict[str, torch.Tensor] = field(default_factory=dict)
    """position-embedding module name -> its output (first call)"""


@dataclass
class ModelInputsRecord:
    calls: list[ModelCall] = field(default_factory=list)


def hf_config(module: nn.Module) -> Any:
    """The transformers config a module carries (a complete pretrained model), told apart without importing it."""
    config = getattr(module, "config", None)
    return config if hasattr(config, "model_type") and hasattr(config, "to_dict") else None


def _outermost_models(model: nn.Module) -> list[tuple[str, nn.Module]]:
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if any(name == n or name.startswith(n + ".") or n == "" for n, _ in found):
            continue
        if hf_config(module) is not None:
            found.append((name, module))
    return found


def _bind(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """The call's ``input_ids``/``attention_mask``/``position_ids`` by name, and whether forward takes a mask."""
    try:
        sig = inspect.signature(module.forward)
    except (TypeError, ValueError):
        return {k: kwargs[k] for k in _KEYS if k in kwargs}, True
    accepts = "attention_mask" in sig.parameters or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())
    try:
        bound = dict(sig.bind_partial(*args, **kwargs).arguments)
    except TypeError:
        bound = dict(kwargs)
    for p in sig.parameters.values():
        if p.kind is inspect.Parameter.VAR_KEYWORD and isinstance(bound.get(p.name), Mapping):
            bound.update(bound.pop(p.name))
    return {k: bound[k] for k in _KEYS if bound.get(k) is not None}, accepts


@probe("model_inputs")
@contextlib.contextmanager
def _model_inputs_probe(ctx: AuditContext) -> Iterator[ModelInputsRecord]:
    record = ModelInputsRecord()
    ctx.probes["model_inputs"] = record
    models = _outermost_models(ctx.model)
    calls: dict[str, ModelCall] = {}

    def pre(name: str) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            try:
                if name not in calls:
                    arguments, accepts = _bind(module, args, kwargs)
                    calls[name] = ModelCall(name, module, arguments, accepts)
                    record.calls.append(calls[name])
            except Exception:  # observing must never change what the step does
                pass
        return hook

    def post(owner: str, name: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            call = calls.get(owner)
            if call is not None and name not in call.positions and isinstance(output, torch.Tensor):
                call.positions[name] = output.detach().clone()  # the model may add to it in place
        return hook

    handles = []
    for owner, module in models:
        handles.append(module.register_forward_pre_hook(pre(owner), with_kwargs=True))
        decoder_side = bool(getattr(hf_config(module), "is_encoder_decoder", False))
        for name, sub in module.named_modules():
            if name.rsplit(".", 1)[-1] in _POSITION_MODULES and not (decoder_side and "decoder" in name):
                handles.append(sub.register_forward_hook(post(owner, name)))
    try:
        yield record
    finally:
        for h in handles:
            h.remove()


def _ids_and_mask(call: ModelCall, fallback: Mapping[str, Any] | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    args = dict(call.arguments)
    if "input_ids" not in args and fallback is not None:
        args.update({k: fallback[k] for k in _KEYS if k in fallback})
    ids, mask = args.get("input_ids"), args.get("attention_mask")
    if not (isinstance(ids, torch.Tensor) and ids.dim() == 2 and not ids.is_floating_point()):
        return None, None
    if not (isinstance(mask, torch.Tensor) and mask.shape == ids.shape):
        mask = None
    return ids, mask


def _shifted_rows(mask: torch.Tensor, pos: torch.Tensor) -> list[int]:
    """Left-padded rows whose first real token gets another position vector than a row's first token would."""
    real = mask.bool()
    batch, seq = real.shape
    if pos.dim() == 2:
        pos = pos.unsqueeze(0)
    if pos.dim() != 3 or pos.shape[1] != seq or pos.shape[0] not in (1, batch):
        return []
    left = [r for r in range(batch) if not real[r, 0] and real[r].any()]
    if not left:
        return []
    first = real.int().argmax(1).tolist()

    def vec(row: int, k: int) -> torch.Tensor:
        return pos[row if pos.shape[0] > 1 else 0, k]

    unpadded = [r for r in range(batch) if real[r, 0]]
    if unpadded:
        ref = vec(unpadded[0], 0)
        return [r for r in left if not torch.equal(vec(r, first[r]), ref)]
    if any(not torch.equal(vec(r, first[r]), vec(left[0], first[left[0]])) for r in left):
        return left
    row = left[0]  # every row has the same pad count: numbered padding (0, 1, ...) means numbered from the start
    return left if first[row] >= 2 and not torch.equal(vec(row, 0), vec(row, 1)) else []


def _classifier_pools_first(module: nn.Module) -> bool:
    """An encoder sequence classifier (BERT-style CLS pooling, a ``classifier`` head, no last-token ``score``)."""
    for m in module.modules():
        name = type(m).__name__
        if name.endswith(_CLASSIFIERS) and not name.startswith("Peft"):
            return hasattr(m, "classifier") and not hasattr(m, "score")
    return False


def _last_token_classifier(module: nn.Module) -> bool:
    """A decoder sequence classifier: it pools the token before the first ``config.pad_token_id``."""
    for m in module.modules():
        name = type(m).__name__
        if name.endswith("ForSequenceClassification") and not name.startswith("Peft"):
            return hasattr(m, "score")
    return False


def _from_start(hit: torch.Tensor) -> torch.Tensor:
    """Per row, the positions of the run of True that starts the row."""
    return hit.int().cumprod(1).bool()


def _from_end(hit: torch.Tensor) -> torch.Tensor:
    """Per row, the positions of the run of True that ends the row."""
    return _from_start(hit.flip(1)).flip(1)


def _ids(value: Any) -> set[int]:
    if isinstance(value, int):
        return {value}
    if isinstance(value, (list, tuple)):
        return {v for v in value if isinstance(v, int)}
    return set()


def _judge(call: ModelCall, fallback: Mapping[str, Any] | None) -> list[Finding]:
    ids, mask = _ids_and_mask(call, fallback)
    if ids is None:
        return []
    config = hf_config(call.module)
    pad = getattr(config, "pad_token_id", None)
    where = f"{call.name or 'the model'} ({type(call.module).__name__})"
    findings: list[Finding] = []
    if mask is not None:
        left = [r for r in range(mask.shape[0]) if mask[r, 0] == 0 and bool(mask[r].any())]
        shifted = sorted({r for out in call.positions.values() for r in _shifted_rows(mask, out)})
        given = "position_ids" in call.arguments
        if shifted:
            findings.append(Finding(
                "padding", Severity.WARN,
                f"{len(shifted)} left-padded row(s) of the batch (rows {shifted[:8]}) reach {where}, whose absolute "
                f"position embedding ({', '.join(call.positions)}) gives their first real token another position than "
                f"an unpadded row's ({'the position_ids passed are numbered from the row start' if given else 'no position_ids passed'}): "
                "pass position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0), or pad on the right for training",
                "INPUT-003", {"rows": shifted[:64], "modules": list(call.positions), "position_ids": given},
            ))
        elif left and _classifier_pools_first(call.module):
            findings.append(Finding(
                "padding", Severity.WARN,
                f"{len(left)} row(s) are left padded (rows {left[:8]}) and {where} classifies from position 0 (CLS), "
                "which is padding in those rows: pad on the right (tokenizer.padding_side = 'right')",
                "INPUT-003", {"rows": left[:64], "pooling": "first"},
            ))
        dropped = mask == 0  # padding: the masked-out runs at a row's start or end, not masked tokens inside
        padded = _from_start(dropped) | _from_end(dropped)
        if bool(padded.any()):
            used = ids[padded].unique()
            if used.numel() == 1 and pad is not None and int(used) != pad:
                findings.append(Finding(
                    "padding", Severity.WARN,
                    f"the batch pads with id {int(used)} (every position the attention_mask drops holds it) but "
                    f"{where} has config.pad_token_id={pad}: it finds padding by that id (last-token pooling, "
                    "positions), so it reads padding as text; set model.config.pad_token_id = tokenizer.pad_token_id",
                    "INPUT-005", {"pad_id_used": int(used), "pad_token_id": pad},
                ))
            elif pad is None and _last_token_classifier(call.module):
                findings.append(Finding(
                    "padding", Severity.WARN,
                    f"the batch has padding but {where} has config.pad_token_id=None, so its classifier cannot find "
                    "each row's last real token; set model.config.pad_token_id = tokenizer.pad_token_id",
                    "INPUT-005", {"pad_id_used": int(used[0]) if used.numel() else None, "pad_token_id": None},
                ))
    if mask is None and call.accepts_mask:
        findings += _unmasked_foreign_padding(ids, pad, call.module, where)
    findings += _doubled_bos(ids, mask, config, where)
    if isinstance(pad, int):
        special = _ids(getattr(config, "eos_token_id", None)) | _ids(getattr(config, "bos_token_id", None))
        least = 2 if pad in special else 1  # a real EOS that shares the pad id is one token, padding is a run
        hit = ids == pad if mask is None else (ids == pad) & (mask != 0)
        # right padding cannot reach a causal model's real tokens: only what precedes them can
        runs = _from_start(hit).sum(1) if _is_causal(call.module) else torch.maximum(_from_start(hit).sum(1),
                                                                                      _from_end(hit).sum(1))
        rows = [int(r) for r in torch.nonzero(runs >= least).flatten()]
        if rows and (mask is not None or call.accepts_mask):
            how = ("the attention_mask marks them as real tokens" if mask is not None
                   else "no attention_mask reaches the model")
            findings.append(Finding(
                "padding", Severity.WARN,
                f"{len(rows)} row(s) (rows {rows[:8]}) start or end with a run of pad id {pad} and {how}: attention "
                f"reads the padding as text in {where}; pass the tokenizer's attention_mask"
                + (" (pad_token_id == eos_token_id: build it from the lengths, not from the ids)" if least == 2 else ""),
                "INPUT-004", {"rows": rows[:64], "pad_token_id": pad, "mask": mask is not None},
            ))
    return findings


def _is_causal(module: nn.Module) -> bool:
    """A decoder-only language model: right padding cannot reach the real tokens' outputs."""
    config = hf_config(module)
    if bool(getattr(config, "is_decoder", False)):
        return True
    if bool(getattr(config, "is_encoder_decoder", False)):
        return False  # its encoder reads the whole input
    return any(type(m).__name__.endswith(("ForCausalLM", "LMHeadModel")) or getattr(m, "is_causal", None) is True
               for m in module.modules())  # a base model (LlamaModel) is causal by its attention


def _unmasked_foreign_padding(ids: torch.Tensor, pad: Any, module: nn.Module, where: str) -> list[Finding]:
    """INPUT-004 for padding by another id than ``config.pad_token_id`` and no attention_mask: rows that start
    or end with runs of one id, of different lengths (padded to the longest row), an id no real text uses."""
    findings: list[Finding] = []
    sides = [("start", _from_start)] + ([] if _is_causal(module) else [("end", _from_end)])
    for side, run_of in sides:
        edge = ids[:, 0] if side == "start" else ids[:, -1]
        values = edge.unique()
        if values.numel() != 1 or ids.shape[0] < 2 or (isinstance(pad, int) and int(values) == pad):
            continue  # a run of the pad id itself is judged below, with the config's pad id
        filler = int(values)
        runs = run_of(ids == filler)
        lengths = runs.sum(1)
        elsewhere = bool(((ids == filler) & ~runs).any())
        if elsewhere or int(lengths.min()) < 2 or lengths.unique().numel() < 2:
            continue
        rows = ids.shape[0]
        findings.append(Finding(
            "padding", Severity.WARN,
            f"every row of the batch {side}s with a run of id {filler} ({int(lengths.min())}-{int(lengths.max())} "
            f"tokens: padding to the longest row) and no attention_mask reaches {where}, whose pad id is {pad}: "
            "attention reads that padding as text, so each row's output depends on how much padding it got; pad "
            "with the tokenizer's pad id and pass its attention_mask",
            "INPUT-004", {"rows": list(range(min(rows, 64))), "filler_id": filler, "pad_token_id": pad,
                          "mask": False, "side": side},
        ))
    return findings


def _doubled_bos(ids: torch.Tensor, mask: torch.Tensor | None, config: Any, where: str) -> list[Finding]:
    """INPUT-006: most rows' first real tokens are two BOS ids (a chat template that holds BOS, tokenized with
    add_special_tokens=True). A BOS that doubles as the pad id without a mask is left alone: that is padding."""
    bos = getattr(config, "bos_token_id", None)
    if not isinstance(bos, int) or ids.shape[1] < 3:
        return []
    if mask is None:
        if bos == getattr(config, "pad_token_id", None):
            return []
        first = torch.zeros(ids.shape[0], dtype=torch.long)
    else:
        first = (mask != 0).int().argmax(1)  # each row's first real position (left padding allowed)
    first = first.clamp(max=ids.shape[1] - 2)
    rows = torch.arange(ids.shape[0])
    doubled = (ids[rows, first] == bos) & (ids[rows, first + 1] == bos)
    if mask is not None:
        doubled &= mask[rows, first + 1] != 0
    if 2 * int(doubled.sum()) <= ids.shape[0]:
        return []
    hit = [int(r) for r in torch.nonzero(doubled).flatten()]
    return [Finding(
        "padding", Severity.WARN,
        f"{len(hit)} of {ids.shape[0]} rows reaching {where} start with BOS twice (id {bos} {bos} ...): the text "
        "already holds BOS (a chat template) and the tokenizer added another, so training sees a prefix inference "
        "never sends; tokenize templated text with add_special_tokens=False",
        "INPUT-006", {"rows": hit[:64], "bos_token_id": bos},
    )]


@check("attention_masks", emits=("INPUT-007",))
def check_attention_masks(ctx: AuditContext) -> Iterable[Finding]:
    """INPUT-007: a floating 0/1 mask handed to attention, which adds float masks to its scores."""
    if ctx.trace is None or not ctx.trace.binary_float_masks:
        return []
    where = sorted(set(ctx.trace.binary_float_masks))
    return [Finding(
        "attention_masks", Severity.WARN,
        f"attention got a floating mask of only 0s and 1s ({', '.join(where)}): a float mask is added to the "
        "attention scores, so a 0/1 keep-mask (1 = attend, the tokenizer's attention_mask) masks nothing and "
        "padding is attended as text; pass a bool mask (True = masked for nn.MultiheadAttention's "
        "key_padding_mask, True = attend for scaled_dot_product_attention) or an additive one (0 and -inf)",
        "INPUT-007", {"masks": where},
    )]


@check("padding", emits=("INPUT-003", "INPUT-004", "INPUT-005", "INPUT-006"))
def check_padding(ctx: AuditContext) -> Iterable[Finding]:
    """INPUT-003 left padding against absolute positions, INPUT-004 padding the mask does not cover, INPUT-005 a
    pad id other than config.pad_token_id, INPUT-006 sequences that start with BOS twice."""
    record = ctx.probes.get("model_inputs")
    if not isinstance(record, ModelInputsRecord) or ctx.trace is None:
        return []
    fallback = batch_mapping(ctx.inputs, ctx.trace.calls)
    findings: list[Finding] = []
    seen: set[str] = set()
    for call in record.calls:
        for f in _judge(call, fallback if call.name == "" else None):
            if f.catalog_id not in seen:  # one finding per id: a teacher and a student share the batch
                seen.add(f.catalog_id)
                findings.append(f)
    return findings


#: a packed row's later predictions that change by more than this (relative) read an earlier example
PACKING_CHANGED = 1e-4


@check("packing_reads", emits=("INPUT-012",), needs=("packing",))
def check_packing_reads(ctx: AuditContext) -> Iterable[Finding]:
    """INPUT-012: position ids restart inside a row (several examples packed into it), yet the predictions of the
    row's later examples change with its first example's tokens: attention crosses the packing boundaries."""
    read = ctx.trace.packing_read if ctx.trace is not None else None
    if read is None or read.change <= PACKING_CHANGED:
        return []
    return [Finding(
        "packing_reads", Severity.WARN,
        f"position_ids restart inside row {read.row} (a packed row: a new example starts at position "
        f"{read.boundary}), yet the predictions after position {read.boundary} change by {100 * read.change:.2g}% "
        "when only the first example's tokens change: the packed examples attend one another, so each trains on "
        "context from unrelated examples; let the model mask by position_ids (no 2-D all-ones attention_mask, "
        "use_cache=False, an attention implementation that supports packing), or pass a block-diagonal mask",
        "INPUT-012", {"row": read.row, "boundary": read.boundary, "change": read.change},
    )]


@check("padding_reads", emits=("INPUT-011",), needs=("padding",))
def check_padding_reads(ctx: AuditContext) -> Iterable[Finding]:
    """INPUT-011: the setup marks padding (a mask, a pad id), yet a padded row's prediction changes when its
    padding is cut off: the model reads the padding as input."""
    read = ctx.trace.padding_read if ctx.trace is not None else None
    if read is None or read.change <= PADDING_CHANGED:
        return []
    return [Finding(
        "padding_reads", Severity.WARN,
        f"row {read.row} has {read.padding} padding position(s) ({read.marked_by} marks them), and its prediction "
        f"changes by {100 * read.change:.2g}% when they are cut off: the model reads the padding as input, so each "
        "row's result depends on how much padding its batch gave it; apply the mask where attention or pooling "
        "runs (nn.MultiheadAttention's key_padding_mask is True at padding, an HF attention_mask is 1 at real "
        "tokens: one passed for the other is inverted), and pool or normalise over the real positions only",
        "INPUT-011", {"row": read.row, "real": read.real, "padding": read.padding, "marked_by": read.marked_by,
                      "change": read.change},
    )]


@check("rotary_config", emits=("INPUT-014",), static=True)
def check_rotary_config(ctx: AuditContext) -> Iterable[Finding]:
    """INPUT-014: a transformers rotary embedding whose frequencies, rebuilt from the config it reads now, differ
    from those it computed when the model was built: the RoPE scaling (or theta) was written into the config after
    construction, where nothing reads it again."""
    seen: set[tuple[type, int]] = set()  # one rebuild per rotary class and config (older models hold one per layer)
    for name, module in ctx.model.named_modules():
        built = getattr(module, "original_inv_freq", getattr(module, "inv_freq", None))
        config = getattr(module, "config", None)
        if not isinstance(built, torch.Tensor) or config is None or not hasattr(module, "rope_type"):
            continue
        if (type(module), id(config)) in seen:
            continue
        seen.add((type(module), id(config)))
        try:
            fresh = type(module)(config=config)
        except Exception:  # a rotary class that is not rebuilt from its config alone: nothing to compare
            continue
        now = getattr(fresh, "original_inv_freq", fresh.inv_freq)
        same_scale = getattr(fresh, "attention_scaling", None) == getattr(module, "attention_scaling", None)
        if now.shape == built.shape and same_scale and torch.allclose(now.float(), built.detach().float().cpu(),
                                                                     rtol=1e-5, atol=0.0):
            continue
        return [Finding(
            "rotary_config", Severity.WARN,
            f"{name or 'the model'}'s rotary embedding ({type(module).__name__}, rope_type "
            f"{getattr(module, 'rope_type', '?')!r}) still uses the frequencies of the config it was built with, "
            f"but its config now gives others (rope_type {getattr(fresh, 'rope_type', '?')!r}): the RoPE scaling or "
            "theta was set after the model was constructed, and transformers computes the rotary frequencies once, "
            "in __init__, so the long-context setting is never applied; put it into the config before building or "
            "loading the model (from_pretrained(..., rope_scaling=...))",
            "INPUT-014", {"module": name, "built_rope_type": getattr(module, "rope_type", None),
                          "config_rope_type": getattr(fresh, "rope_type", None)},
        )]
    return []
