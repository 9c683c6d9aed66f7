"""LoRA / PEFT checks: the wiring mistakes that let a fine-tune run for hours while training nothing useful.

Static checks (``lora_summary`` runs them without a forward pass) read ``requires_grad`` flags, optimizer
membership, dtypes, adapter scaling and peft's ``modules_to_save`` wrappers. ``lora_gradient_flow`` and the
``lora_state`` probe look at the one instrumented step: which LoRA layers ran with their adapter active and
which factors got a gradient. Nothing here imports peft.
"""

from __future__ import annotations

import re

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import torch
from torch import nn

from guardtower.preflight._checkpoint import reentrant_layers, watch_checkpointing
from guardtower.preflight._peft import (
    AdapterPair,
    adapter_pairs,
    block_lists,
    head_modules,
    is_adapter_param,
    is_peft_model,
    is_saved_param,
    lora_layers,
    peft_components,
    peft_config,
    saved_wrappers,
    storage_key,
    unwrap_parallel,
)
from guardtower.preflight._registry import AuditContext, check, probe
from guardtower.preflight._util import fmt_names
from guardtower.errors import ConfigError
from guardtower.report import Finding, Report
from guardtower.severity import Severity

__all__ = ["LoraStepState", "is_peft_model", "lora_summary"]

TRAINABLE_PCT_HIGH = 10.0
"""percent of all parameters above which a LoRA run is hardly parameter-efficient any more (LORA-005)"""
MIN_PARAMS_FOR_SHARE = 10_000
"""below this many parameters any rank is a large share and memory is no concern: LORA-005 stays silent"""
SCALING_RANGE = (0.1, 8.0)
"""alpha/r (alpha/sqrt(r) with rsLoRA) outside this range shrinks or blows up the update (LORA-011)"""
_LIST_LIMIT = 10


@dataclass
class LoraStepState:
    """What the ``lora_state`` probe saw while the user's step ran."""

    zero_factors: set[str] = field(default_factory=set)
    """factors that were all zero when the step started (lora_B / lora_embedding_A at init)"""
    active_calls: dict[str, int] = field(default_factory=dict)
    """LoRA layer -> forwards with an adapter active and unmerged"""
    inactive_calls: dict[str, int] = field(default_factory=dict)
    """LoRA layer -> forwards with adapters disabled or merged into the base weight"""
    reentrant: list[str] = field(default_factory=list)
    """layers holding LoRA that run reentrant gradient checkpointing"""
    starved_checkpoints: list[str] = field(default_factory=list)
    """those of them whose inputs would not require grad in a real step (their LoRA factors get no gradient)"""


def _adapter_active(module: nn.Module) -> bool:
    if bool(getattr(module, "disable_adapters", False)) or bool(getattr(module, "merged", False)):
        return False
    active = getattr(module, "active_adapters", None)
    if active is None:
        return True
    names = [active] if isinstance(active, str) else list(active)
    factors = getattr(module, "lora_A", None)
    embedding = getattr(module, "lora_embedding_A", None)
    owned = set(factors.keys()) if isinstance(factors, nn.ModuleDict) else set()
    owned |= set(embedding.keys()) if isinstance(embedding, nn.ParameterDict) else set()
    return any(n in owned for n in names)


@probe("lora_state")
@contextlib.contextmanager
def _lora_state_probe(ctx: AuditContext) -> Iterator[LoraStepState | None]:
    """Record which factors start at zero and whether each LoRA layer ran with its adapter active."""
    if not _is_peft(ctx):
        yield None
        return
    state = LoraStepState()
    for pair in adapter_pairs(ctx.model):
        a_zero = not bool(pair.a.detach().count_nonzero())
        b_zero = not bool(pair.b.detach().count_nonzero())
        if a_zero != b_zero:
            state.zero_factors.add(pair.a_name if a_zero else pair.b_name)
        elif a_zero:  # both zero: each factor's gradient is the other's value times the upstream, so both stay 0
            state.zero_factors |= {pair.a_name, pair.b_name}

    def record(name: str, module: nn.Module, args: Any) -> None:
        calls = state.active_calls if _adapter_active(module) else state.inactive_calls
        calls[name] = calls.get(name, 0) + 1

    handles = [m.register_forward_pre_hook(functools.partial(record, n)) for n, m in lora_layers(ctx.model)]
    checkpointed = [(n, m) for n, m in reentrant_layers(ctx.model) if any(True for _ in lora_layers(m))]
    state.reentrant = [n for n, _ in checkpointed]
    ctx.probes["lora_state"] = state
    try:
        with watch_checkpointing(ctx.model, checkpointed) as watch:
            yield state
        state.starved_checkpoints = list(watch.starved)
    finally:
        for h in handles:
            h.remove()


def _names(items: Iterable[str]) -> list[str]:
    return sorted(items)[:_LIST_LIMIT]


def _active_pairs(ctx: AuditContext) -> list[AdapterPair]:
    """Pairs of the adapters each layer has active (inactive adapters are frozen on purpose)."""
    layers = dict(lora_layers(ctx.model))
    pairs = []
    for pair in adapter_pairs(ctx.model):
        active = getattr(layers[pair.layer], "active_adapters", None)
        names = [active] if isinstance(active, str) else list(active) if active is not None else [pair.adapter]
        if pair.adapter in names:
            pairs.append(pair)
    return pairs


def _is_peft(ctx: AuditContext) -> bool:
    """``is_peft_model`` walks the parameters; the LoRA checks ask once per audit."""
    if "is_peft" not in ctx.memo:
        ctx.memo["is_peft"] = is_peft_model(ctx.model)
    return bool(ctx.memo["is_peft"])


def _peft_base_unfrozen(ctx: AuditContext) -> dict[str, nn.Parameter]:
    """With peft everything the user means to train besides the adapters is declared (``modules_to_save``,
    ``bias=``, trainable tokens), so any other trainable parameter is base left unfrozen."""
    bias = str(getattr(peft_config(ctx.model), "bias", "none") or "none")
    return {
        name: p
        for name, p in ctx.params.items()
        if p.requires_grad
        and not is_adapter_param(name)
        and not is_saved_param(name)
        and "trainable_tokens" not in name
        and not (bias != "none" and name.endswith("bias"))
    }


def _hand_rolled_base_unfrozen(ctx: AuditContext) -> dict[str, nn.Parameter]:
    """Hand-rolled LoRA declares nothing: a head, biases (loralib's ``bias="lora_only"``), norms or embeddings
    trained next to the adapters are common choices. Only the weight matrices LoRA exists to leave alone count:
    those of the adapted layers themselves and of the other layers in the blocks that hold them (what a
    forgotten ``loralib.mark_only_lora_as_trainable`` leaves trainable)."""
    scopes = [name for name, _ in lora_layers(ctx.model)]
    for stack, blocks in block_lists(ctx.model):
        scopes += [f"{stack}.{i}" for i, block in enumerate(blocks) if any(True for _ in lora_layers(block))]
    unfrozen: dict[str, nn.Parameter] = {}
    owners = dict(ctx.model.named_modules())
    for name, p in ctx.params.items():
        owner, _, leaf = name.rpartition(".")
        in_scope = any(owner == s or owner.startswith(f"{s}.") or not s for s in scopes)
        module = owners.get(owner)
        if (
            p.requires_grad
            and in_scope
            and leaf != "bias"
            and sum(size > 1 for size in p.shape) >= 2  # a matrix: a vector (DoRA's magnitude, a gate) is chosen
            and not is_adapter_param(name)
            and not isinstance(module, nn.Embedding)
            and "norm" not in type(module).__name__.lower()
        ):
            unfrozen[name] = p
    return unfrozen


@check("lora_base_frozen", emits=("LORA-001",), static=True)
def check_base_frozen(ctx: AuditContext) -> Iterator[Finding]:
    """LORA-001: base weights still trainable next to the adapters."""
    if not _is_peft(ctx) or not any(True for _ in lora_layers(ctx.model)):
        return
    hand_rolled = peft_config(ctx.model) is None
    unfrozen = _hand_rolled_base_unfrozen(ctx) if hand_rolled else _peft_base_unfrozen(ctx)
    if unfrozen:
        numel = sum(p.numel() for p in unfrozen.values())
        where = "in the LoRA-adapted layers and blocks " if hand_rolled else ""
        saving = "saving only the LoRA weights (loralib.lora_state_dict)" if hand_rolled else "save_pretrained()"
        yield Finding(
            "lora_base_frozen",
            Severity.ERROR,
            f"the BASE model is not fully frozen: {len(unfrozen)} base parameter(s) {where}({numel:,} values) are "
            f"trainable next to the LoRA adapters: this is a full fine-tune, and {saving} keeps only the adapter, "
            "dropping those updates",
            "LORA-001",
            {"params": _names(unfrozen), "count": len(unfrozen), "numel": numel},
        )


def _frozen_backbone(ctx: AuditContext) -> Finding | None:
    """LORA-002 at INFO for a peft model held, whole and frozen, inside a model whose own parts train (a LoRA
    policy under a value head, a reference model): a frozen component kept on purpose, not a frozen adapter."""
    parts = peft_components(ctx.model)
    prefixes = tuple(f"{name}." for name, _ in parts)
    outside = [n for n, p in ctx.params.items() if p.requires_grad and not n.startswith(prefixes)]
    if not parts or not outside:
        return None
    modes = {name: bool(getattr(peft_config(part), "inference_mode", False)) for name, part in parts}
    return Finding(
        "lora_adapter", Severity.INFO,
        f"the peft model(s) {', '.join(modes)} are frozen whole, adapters included"
        f"{' (loaded with inference_mode=True)' if all(modes.values()) else ''}, while {len(outside)} tensor(s) "
        f"outside them train ({fmt_names(outside, 3)}): a fixed backbone; if its adapter should train, load it with "
        "is_trainable=True",
        "LORA-002", {"components": list(modes), "trains": outside[:50]},
    )


@check("lora_adapter", emits=("LORA-002", "LORA-007", "LORA-011", "LORA-013"), static=True)
def check_adapter(ctx: AuditContext) -> Iterator[Finding]:
    """LORA-002 frozen adapters, LORA-007 adapters merged/disabled, LORA-011 alpha/r scaling out of range,
    LORA-013 what the audit found (trainable adapter tensors and their share), so a count off from the
    config stands out."""
    if not _is_peft(ctx):
        return
    pairs = _active_pairs(ctx)
    factors = [(pair.a_name, pair.a) for pair in pairs] + [(pair.b_name, pair.b) for pair in pairs]
    frozen = [name for name, p in factors if not p.requires_grad]
    if frozen:
        every = len(frozen) == len(factors)
        backbone = _frozen_backbone(ctx) if every else None
        if backbone is not None:
            yield backbone
        else:
            inference = bool(getattr(peft_config(ctx.model), "inference_mode", False))
            hint = " (the adapter was loaded with inference_mode=True)" if inference else ""
            count = f"the adapters are ALL frozen: all {len(frozen)}" if every else f"{len(frozen)} of {len(factors)}"
            yield Finding(
                "lora_adapter",
                Severity.ERROR,
                f"{count} active LoRA factor(s) have requires_grad=False{hint}: the adapter will not train",
                "LORA-002",
                {"params": _names(frozen), "count": len(frozen)},
            )
    trainable = {n: p for n, p in ctx.params.items() if p.requires_grad and is_adapter_param(n)}
    if trainable:
        numel = sum(p.numel() for p in trainable.values())
        total = sum(p.numel() for p in ctx.params.values())
        yield Finding(
            "lora_adapter",
            Severity.INFO,
            f"{len(trainable)} trainable adapter tensor(s) on {len({p.layer for p in pairs})} LoRA layer(s): "
            f"{numel:,} values, {100.0 * numel / total:.3f}% of the model's {total:,} (e.g. {next(iter(trainable))})",
            "LORA-013",
            {"params": _names(trainable), "count": len(trainable), "numel": numel, "total": total},
        )

    layers = dict(lora_layers(ctx.model))
    inactive: dict[str, str] = {}
    for name, module in layers.items():
        if bool(getattr(module, "merged", False)):
            inactive[name] = "merged"
        elif bool(getattr(module, "disable_adapters", False)):
            inactive[name] = "disabled"
    state = ctx.probes.get("lora_state")
    if isinstance(state, LoraStepState):
        for name, calls in state.inactive_calls.items():
            if calls and not state.active_calls.get(name):
                inactive.setdefault(name, "disabled or merged during the step")
    if inactive:
        reasons = sorted(set(inactive.values()))
        yield Finding(
            "lora_adapter",
            Severity.ERROR,
            f"{len(inactive)} LoRA layer(s) ran without their adapter ({', '.join(reasons)}): "
            "the forward uses only the base weights, so the adapter gets no gradient",
            "LORA-007",
            {"modules": _names(inactive), "count": len(inactive), "reasons": reasons},
        )

    low, high = SCALING_RANGE
    odd: dict[tuple[Any, ...], list[str]] = {}
    for name, module in layers.items():
        scaling = getattr(module, "scaling", None)
        if not isinstance(scaling, dict):
            continue
        ranks = getattr(module, "r", {})
        alphas = getattr(module, "lora_alpha", {})
        rslora = getattr(module, "use_rslora", {})
        for adapter, value in scaling.items():
            if isinstance(value, (int, float)) and not low <= value <= high:
                key = (adapter, ranks.get(adapter), alphas.get(adapter), bool(rslora.get(adapter, False)), float(value))
                odd.setdefault(key, []).append(name)
    for (adapter, r, alpha, rslora, value), names in sorted(odd.items(), key=lambda kv: str(kv[0])):
        formula = "alpha/sqrt(r)" if rslora else "alpha/r"
        advice = "raise lora_alpha or use use_rslora=True" if value < low else "lower lora_alpha"
        yield Finding(
            "lora_adapter",
            Severity.WARN,
            f"adapter {adapter!r}: scaling {formula} = {alpha}/{r}{'^0.5' if rslora else ''} = {value:.3g} is outside "
            f"[{low}, {high}] on {len(names)} layer(s): the update is {'shrunk' if value < low else 'amplified'} "
            f"{'' if value < low else 'by '}{value:.3g}x ({advice})",
            "LORA-011",
            {"adapter": adapter, "r": r, "lora_alpha": alpha, "use_rslora": rslora, "scaling": value, "modules": _names(names)},
        )


@check("lora_optimizer", emits=("LORA-003",), static=True)
def check_optimizer(ctx: AuditContext) -> Iterator[Finding]:
    """LORA-003: trainable adapter factors the optimizer does not hold."""
    if ctx.optimizer is None or not _is_peft(ctx):
        return
    held = {id(p) for group in ctx.optimizer.param_groups for p in group["params"]}
    adapters = {n: p for n, p in ctx.params.items() if p.requires_grad and is_adapter_param(n)}
    missing = [n for n, p in adapters.items() if id(p) not in held]
    if not missing:
        return
    if len(missing) == len(adapters):
        message = (
            f"all {len(adapters)} trainable LoRA factor(s) are NOT in the optimizer: it was probably built "
            "before get_peft_model(), so optimizer.step() never updates the adapter"
        )
    else:
        message = f"{len(missing)} of {len(adapters)} trainable LoRA factor(s) are NOT in the optimizer"
    yield Finding("lora_optimizer", Severity.ERROR, message, "LORA-003", {"params": _names(missing), "count": len(missing)})


@check("lora_trainable_pct", emits=("LORA-005",), static=True)
def check_trainable_pct(ctx: AuditContext) -> Iterator[Finding]:
    """LORA-005: the adapters are a large share of the model. ``modules_to_save`` copies are excluded: the user
    asked for those whole modules to train, so their size is a choice, not a rank accident."""
    if not _is_peft(ctx):
        return
    saved_names = {n for n, p in ctx.params.items() if is_saved_param(n)}
    # the share is of the model proper: the saved copies and the originals they shadow are not counted
    total = sum(p.numel() for n, p in ctx.params.items() if n not in saved_names and ".original_module." not in n)
    adapters = {n: p for n, p in ctx.params.items() if p.requires_grad and is_adapter_param(n) and n not in saved_names}
    trainable = sum(p.numel() for p in adapters.values())
    pct = 100.0 * trainable / total if total else 0.0
    if pct > TRAINABLE_PCT_HIGH and total >= MIN_PARAMS_FOR_SHARE:
        saved = sum(ctx.params[n].numel() for n in saved_names if ctx.params[n].requires_grad)
        yield Finding(
            "lora_trainable_pct",
            Severity.INFO,  # nothing fails: it costs memory, it does not train wrong (severity from consequence)
            f"the adapters make up {pct:.1f}% of the parameters ({trainable:,} of {total:,}; modules_to_save, "
            f"{saved:,} more, not counted): memory and optimizer state approach a full fine-tune (rank too high?)",
            "LORA-005",
            {"trainable": trainable, "total": total, "percent": pct, "modules_to_save_numel": saved},
        )


@check("lora_dtype", emits=("LORA-010",), static=True)
def check_dtype(ctx: AuditContext) -> Iterator[Finding]:
    """LORA-010: trainable adapter weights stored in fp16/bf16."""
    if not _is_peft(ctx):
        return
    layers = dict(lora_layers(ctx.model))
    half: dict[str, str] = {}
    for pair in _active_pairs(ctx):
        base = getattr(layers[pair.layer], "base_layer", None)
        weight = getattr(base, "weight", None)
        base_dtype = getattr(base, "compute_dtype", None) or (weight.dtype if isinstance(weight, torch.Tensor) else None)
        for name, p in ((pair.a_name, pair.a), (pair.b_name, pair.b)):
            if p.requires_grad and p.dtype in (torch.float16, torch.bfloat16):
                half[name] = f"{p.dtype} (base layer computes in {base_dtype})"
    if half:
        dtypes = sorted({v.split(" ")[0] for v in half.values()})
        yield Finding(
            "lora_dtype",
            Severity.WARN,
            f"{len(half)} trainable LoRA factor(s) are stored in {'/'.join(dtypes)}: small optimizer updates round "
            "away and the adapter barely moves; keep adapter weights in float32 and use autocast",
            "LORA-010",
            {"params": _names(half), "dtypes": {k: half[k] for k in _names(half)}, "count": len(half)},
        )


@check("lora_gradient_flow", emits=("LORA-004", "LORA-006"))
def check_gradient_flow(ctx: AuditContext) -> Iterator[Finding]:
    """LORA-006 zero-init factor got no gradient (ERROR); LORA-004 random factor's zero gradient (expected)."""
    state = ctx.probes.get("lora_state")
    trace = ctx.trace
    if not isinstance(state, LoraStepState):
        return
    # judged from the forward alone: a checkpointed block whose input would not require grad in a real step
    blocked = [
        pair
        for pair in _active_pairs(ctx)
        if any(pair.layer.startswith(f"{c}.") for c in state.starved_checkpoints) and pair.b.requires_grad
    ]
    starved = [p.b_name if p.b_name in state.zero_factors else p.a_name for p in blocked]
    blocked_layers = {p.layer for p in blocked}
    expected_zero: list[str] = []
    both_zero: list[str] = []  # layers whose two factors both start at zero
    step_grads = trace.grads if trace is not None and trace.error is None else {}
    if not any(g is not None for g in step_grads.values()):
        step_grads = {}  # no backward reached any parameter: the loss checks explain why
    for pair in _active_pairs(ctx) if step_grads else []:
        if pair.layer in blocked_layers or not state.active_calls.get(pair.layer):
            continue  # judged above, or never ran with its adapter (LORA-007 / GRAD-001)
        if not (pair.a.requires_grad and pair.b.requires_grad):
            continue  # frozen (LORA-002)
        grads = {pair.a_name: step_grads.get(pair.a_name), pair.b_name: step_grads.get(pair.b_name)}
        zero_grad = {n: g is None or not bool(g.count_nonzero()) for n, g in grads.items()}
        if pair.a_name in state.zero_factors and pair.b_name in state.zero_factors:
            if all(zero_grad.values()):
                starved.extend(grads)
                both_zero.append(pair.layer)
        elif pair.a_name in state.zero_factors or pair.b_name in state.zero_factors:
            zero = pair.a_name if pair.a_name in state.zero_factors else pair.b_name
            rand = pair.b_name if zero == pair.a_name else pair.a_name
            if zero_grad[zero]:
                starved.append(zero)
            elif grads[rand] is not None and zero_grad[rand]:
                expected_zero.append(rand)
        elif all(g is None for g in grads.values()):
            starved.extend(grads)
    if starved:
        reentrant = state.starved_checkpoints or state.reentrant
        hint = (
            f"; {len(reentrant)} block(s) use reentrant gradient checkpointing, which drops every gradient inside "
            "when the block's input does not require grad (call model.enable_input_require_grads() or use "
            "use_reentrant=False)"
            if reentrant
            else f"; both factors of {len(both_zero)} layer(s) start at zero, so each one's gradient (the other "
            "factor times the upstream gradient) is zero too: initialise lora_A randomly and keep lora_B at zero"
            if both_zero
            else ""
        )
        yield Finding(
            "lora_gradient_flow",
            Severity.ERROR,
            f"{len(starved)} zero-initialised LoRA factor(s) got no gradient although their layer ran: the adapter "
            f"stays a no-op for the whole run{hint}",
            "LORA-006",
            {"params": _names(starved), "count": len(starved), "reentrant_checkpointing": _names(reentrant),
             "both_zero": _names(both_zero)},
        )
    if expected_zero:
        yield Finding(
            "lora_gradient_flow",
            Severity.INFO,
            f"{len(expected_zero)} LoRA factor(s) (lora_A) have an all-zero gradient at step 1; expected, their "
            "partner lora_B starts at zero and they receive gradient once lora_B has moved",
            "LORA-004",
            {"params": _names(expected_zero), "count": len(expected_zero)},
        )


@check("lora_head", emits=("LORA-008",), static=True)
def check_head(ctx: AuditContext) -> Iterator[Finding]:
    """LORA-008: the new classification head is frozen, so it stays at its random initialisation."""
    if not _is_peft(ctx):
        return
    frozen = [name for name, head in head_modules(ctx.model) if not any(p.requires_grad for p in head.parameters())]
    if frozen:
        yield Finding(
            "lora_head",
            Severity.ERROR,
            f"classification head {', '.join(frozen)} is frozen: it keeps its random initialisation for the "
            "whole run (set task_type='SEQ_CLS' or add it to modules_to_save)",
            "LORA-008",
            {"modules": frozen},
        )


@check("lora_coverage", emits=("LORA-009", "LORA-014"), static=True)
def check_coverage(ctx: AuditContext) -> Iterator[Finding]:
    """LORA-009: target_modules matched only some of the transformer blocks; LORA-014: entries of
    target_modules that match no module (peft only raises when none of them matches)."""
    config = peft_config(ctx.model)
    # hand-rolled LoRA (no config) has no target_modules pattern to get wrong: adapting some blocks is a choice
    if not _is_peft(ctx) or config is None:
        return
    targets = getattr(config, "target_modules", None)
    if isinstance(targets, (list, tuple, set, frozenset)):
        # peft's wrappers insert path parts (a modules_to_save copy, a LoRA layer's base_layer): drop them
        names = [re.sub(r"\.(original_module|base_layer|modules_to_save\.[^.]+)(?=\.|$)", "", n)
                 for n, _ in ctx.model.named_modules()]
        unmatched = sorted(str(key) for key in targets if isinstance(key, str)
                           and not any(n == key or n.endswith("." + key) for n in names))
        if unmatched:
            yield Finding(
                "lora_coverage",
                Severity.WARN,
                f"{len(unmatched)} of the {len(targets)} target_modules entries match no module of the model: "
                f"{', '.join(unmatched[:_LIST_LIMIT])}; peft skips them silently when another entry matches, so "
                "those layers get no adapter (name the module itself, e.g. 'ff.net.0.proj' not 'ff.0': see "
                "model.named_modules())",
                "LORA-014",
                {"unmatched": unmatched, "target_modules": sorted(str(t) for t in targets)},
            )
    if getattr(config, "layers_to_transform", None) is not None:
        return
    for stack, blocks in block_lists(unwrap_parallel(ctx.model)):
        covered = [i for i, b in enumerate(blocks) if any(True for _ in lora_layers(b))]
        if covered and len(covered) < len(blocks):
            missing = [i for i in range(len(blocks)) if i not in covered]
            yield Finding(
                "lora_coverage",
                Severity.WARN,
                f"LoRA adapts {len(covered)} of {len(blocks)} blocks of {stack}; blocks {missing[:_LIST_LIMIT]} have "
                "no adapter (check the target_modules pattern, or set layers_to_transform if intended)",
                "LORA-009",
                {"stack": stack, "covered": covered, "missing": missing, "target_modules": getattr(config, "target_modules", None)},
            )


@check("lora_tied", emits=("LORA-012",), static=True)
def check_tied(ctx: AuditContext) -> Iterator[Finding]:
    """LORA-012: a tied embedding / lm_head pair split by modules_to_save, so the copies drift apart."""
    if not _is_peft(ctx):
        return
    wrappers = list(saved_wrappers(ctx.model))
    if not wrappers:
        return
    owners: dict[tuple[int, tuple[int, ...]], list[str]] = {}
    for name, p in ctx.model.named_parameters(remove_duplicate=False):
        owners.setdefault(storage_key(p), []).append(name)
    copy_of: dict[str, tuple[tuple[int, tuple[int, ...]], ...]] = {
        name: tuple(storage_key(p) for p in copy.parameters()) if copy is not None else ()
        for name, _, _, copy in wrappers
    }
    split: list[str] = []
    for name, _, original, _ in wrappers:
        for p in original.parameters():
            for partner in owners.get(storage_key(p), []):
                if partner.startswith(f"{name}."):
                    continue
                other = next((w for w in copy_of if partner.startswith(f"{w}.")), None)
                if other is None or copy_of[other] != copy_of[name]:
                    split.append(f"{name} / {partner.rsplit('.', 1)[0]}")
    if split:
        pairs = sorted(set(split))
        yield Finding(
            "lora_tied",
            Severity.WARN,
            f"modules_to_save unties tied weights ({'; '.join(pairs)}): the trainable copy moves while its tied "
            "partner stays frozen (use ensure_weight_tying=True or save both modules)",
            "LORA-012",
            {"modules": pairs},
        )


def lora_summary(model: nn.Module, *, optimizer: torch.optim.Optimizer | None = None) -> Report:
    """Run every static check (no forward pass, nothing modified), typically right after ``get_peft_model``.

    The report's title carries the trainable-parameter count, the number people look for first.
    """
    from guardtower.preflight._runner import run_static  # the package imports this module: import at call time

    if not isinstance(model, nn.Module):
        raise ConfigError("model", f"expected a torch.nn.Module, got {type(model).__name__}", "pass the (peft) model")
    return run_static(model, optimizer, title=_summary_title(dict(model.named_parameters())))


def _summary_title(params: dict[str, nn.Parameter]) -> str:
    total = sum(p.numel() for p in params.values())
    trainable = sum(p.numel() for p in params.values() if p.requires_grad)
    pct = 100.0 * trainable / total if total else 0.0
    return f"guardtower LoRA summary ({trainable:,} of {total:,} params trainable, {pct:.3f}%)"
