"""Modes and randomness: which parts of the model train, which are frozen, and whether the step treats each as
its setup intends.

A *frozen part* is a maximal submodule subtree whose parameters all have ``requires_grad=False`` or sit outside
the optimizer (its parent holds a trainable one). Eval mode inside a frozen part is a choice (a teacher, a
reference model, a frozen backbone), eval mode in a trainable part is not (``train_mode``, MODE-001). While the step runs, the
``frozen_parts`` probe measures, on the frozen parts only, whether their forward drew random numbers (their
outputs are random: dropout on in a frozen encoder, MODE-002) and whether their buffers moved (BatchNorm in
train mode updating running statistics of a frozen backbone, MODE-003). ``norm_momentum`` reads the
normalisation layers' momentum (MODE-004), ``dropout_rate`` the dropout layers' drop probability (MODE-007).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, cast

import torch
from torch import nn

from guardtower.preflight._registry import AuditContext, check, probe
from guardtower.preflight.positions import hf_config
from guardtower.preflight._step import MODE_SENSITIVE
from guardtower.preflight._util import fmt_names, iter_tensors, optimizer_tensors, reached_params, stepped_elsewhere
from guardtower.preflight.shadows import written_storage
from guardtower.report import Finding
from guardtower.severity import Severity

__all__ = ["frozen_parts", "FrozenPartsRecord"]

#: a momentum at or above this keeps little more than the last batch in the running statistics
_MOMENTUM_LIMIT = 0.5


def frozen_parts(ctx: AuditContext) -> dict[str, nn.Module]:
    """``name -> module`` of the frozen parts, computed once per audit (``ctx.memo``)."""
    cached = ctx.memo.get("frozen_parts")
    if cached is None:
        stepped = None if ctx.optimizer is None else {id(t) for _, t in optimizer_tensors(ctx.optimizer)}
        cached = ctx.memo["frozen_parts"] = _frozen_parts(ctx.model, stepped)
    return dict(cached)


def _frozen_parts(model: nn.Module, stepped: set[int] | None) -> dict[str, nn.Module]:
    """A parameter is frozen when it does not require grad, or when the optimizer (if given) does not hold it:
    a part kept out of the optimizer never trains either (OPT-001 says so when that looks unintended)."""
    found: dict[str, nn.Module] = {}

    def fixed(p: nn.Parameter) -> bool:
        return not p.requires_grad or (stepped is not None and id(p) not in stepped)

    def visit(name: str, module: nn.Module) -> tuple[bool, bool]:
        """(holds a parameter, all its parameters are frozen) for ``module``'s subtree."""
        own = list(module.parameters(recurse=False))
        has, frozen = bool(own), all(fixed(p) for p in own)
        kids = [(f"{name}.{n}" if name else n, m, visit(f"{name}.{n}" if name else n, m))
                for n, m in module.named_children()]
        has = has or any(h for _, _, (h, _) in kids)
        frozen = frozen and all(f for _, _, (_, f) in kids)
        if not (has and frozen):
            found.update({n: m for n, m, (h, f) in kids if h and f})
        return has, frozen

    visit("", model)
    return found


def _inside(name: str, parts: Iterable[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in parts)


def _top_level(model: nn.Module) -> str:
    """The prefix below which the user's own components sit: wrappers holding one child with parameters and none
    of their own (DDP's ``module``, peft's ``base_model.model``, a Lightning module's ``model``) are looked through."""
    prefix, module = "", model
    for _ in range(8):
        if list(module.parameters(recurse=False)):
            break
        holders = [(n, m) for n, m in module.named_children() if next(m.parameters(), None) is not None]
        if len(holders) != 1:
            break
        name, module = holders[0]
        prefix = f"{prefix}.{name}" if prefix else name
    return prefix


def _shape_of(module: nn.Module, depth: int = 3) -> tuple[Any, ...]:
    """A module's structure (types, recursively; widths ignored): members of one stack share it."""
    kids = tuple(_shape_of(m, depth - 1) for m in module.children()) if depth > 0 else ()
    return (type(module).__name__, kids)


def frozen_components(ctx: AuditContext) -> dict[str, nn.Module]:
    """Frozen parts that are components of their own (a backbone, a text encoder, a teacher: a top-level part of
    the model or a complete pretrained model), not fragments of a model that is fine-tuned around them (frozen
    lower layers of a stack whose other members train, the base of a LoRA block): a fragment's dropout and
    statistics are the fine-tune's own, computed once per audit (``ctx.memo``)."""
    cached = ctx.memo.get("frozen_components")
    if cached is not None:
        return dict(cached)
    top = _top_level(ctx.model)
    depth = top.count(".") + 1 if top else 0
    parent = ctx.model.get_submodule(top) if top else ctx.model
    stack = isinstance(parent, (nn.Sequential, nn.ModuleList))
    parts = frozen_parts(ctx)
    members = {} if not stack else {
        (f"{top}.{n}" if top else n): _shape_of(m) for n, m in parent.named_children()}
    trainable_shapes = {shape for name, shape in members.items() if name not in parts}
    found = {n: m for n, m in parts.items()
             if hf_config(m) is not None or (n.count(".") == depth and members.get(n) not in trainable_shapes)}
    ctx.memo["frozen_components"] = found
    return dict(found)


@dataclass
class FrozenPartsRecord:
    """What the frozen parts did while the step ran."""

    stochastic: list[str] = field(default_factory=list)
    """frozen components whose forward drew random numbers"""
    conducting: list[str] = field(default_factory=list)
    """frozen components whose input is computed from trainable tensors (soft prompts, an input projector): the
    loss gradient runs through them to what trains, so their dropout is the fine-tune's, as a LoRA base's is"""
    moved: dict[str, list[str]] = field(default_factory=dict)
    """frozen part -> its submodules whose buffers changed (running statistics)"""
    updated: list[str] = field(default_factory=list)
    """frozen parts whose weights the step itself changed in place: a momentum copy (EMA teacher, BYOL/MoCo
    target encoder) that follows the trained network, modes included"""
    idle_stats: dict[str, list[str]] = field(default_factory=dict)
    """frozen part -> its normalisation layers in eval mode whose running statistics the step left as they were,
    recorded only when the trained network's statistics moved"""
    companion_stats: dict[str, list[str]] = field(default_factory=dict)
    """module the step holds beside the model (``AuditContext.companions``) -> its normalisation layers whose
    running statistics the step left as they were, recorded only when the trained network's moved"""


def _rng_states(module: nn.Module) -> list[torch.Tensor]:
    """The generator states a forward of ``module`` would draw from: the CPU one, and the CUDA one of the device
    its first parameter lives on (host-side state, no device sync)."""
    states = [torch.random.get_rng_state()]
    p = next(module.parameters(), None)
    if p is not None and p.device.type == "cuda":
        states.append(torch.cuda.get_rng_state(p.device))
    return states


def _stat_layers(root: nn.Module, skip: dict[str, nn.Module] | None = None) -> list[tuple[str, nn.Module]]:
    """The normalisation layers under ``root`` that track running statistics, by their name under ``root``
    (those under ``skip``'s parts left out)."""
    skipped = {id(m) for part in (skip or {}).values() for m in part.modules()}
    return [(n, m) for n, m in root.named_modules() if isinstance(m, nn.modules.batchnorm._NormBase)
            and m.track_running_stats and isinstance(m.running_mean, torch.Tensor) and id(m) not in skipped]


def _running_stats(root: nn.Module, skip: dict[str, nn.Module] | None = None) -> list[tuple[str, torch.Tensor]]:
    """The running means of ``_stat_layers(root, skip)``, by their name under ``root``."""
    return [(f"{n}.running_mean" if n else "running_mean", _running_mean(m)) for n, m in _stat_layers(root, skip)]


def _running_mean(layer: nn.Module) -> torch.Tensor:
    return cast(torch.Tensor, layer.running_mean)


@probe("frozen_parts")
@contextlib.contextmanager
def _frozen_parts_probe(ctx: AuditContext) -> Iterator[FrozenPartsRecord]:
    record = FrozenPartsRecord()
    ctx.probes["frozen_parts"] = record
    parts = frozen_parts(ctx)
    components = frozen_components(ctx)
    before: dict[str, list[torch.Tensor]] = {}

    trainable = {id(p) for p in ctx.params.values() if p.requires_grad}

    def pre(name: str) -> Any:
        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            try:
                before[name] = _rng_states(module)
                if name not in record.conducting and any(
                        t.is_floating_point() and reached_params(t, trainable, first=True)
                        for _, t in iter_tensors((args, kwargs), depth=2)):
                    record.conducting.append(name)
            except Exception:  # observing must never change what the step does
                pass
        return hook

    def post(name: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            try:
                start = before.pop(name, None)
                if start is not None and name not in record.stochastic and any(
                        not torch.equal(a, b) for a, b in zip(start, _rng_states(module))):
                    record.stochastic.append(name)
            except Exception:
                pass
        return hook

    buffers = {(part, f"{part}.{n}" if n else part): b.detach().clone()
               for part, m in parts.items() for n, b in m.named_buffers()
               if b.dtype != torch.bool and b.device.type != "meta"}
    trained_stats = {n: b.detach().clone() for n, b in _running_stats(ctx.model, skip=parts)}
    companion_stats = {(c, n): (m, _running_mean(m).detach().clone()) for c, root in ctx.companions.items()
                       for n, m in _stat_layers(root)}
    handles = [h for n, m in components.items()
               for h in (m.register_forward_pre_hook(pre(n), with_kwargs=True), m.register_forward_hook(post(n)))]
    versions = {part: [p._version for p in m.parameters()] for part, m in parts.items()}  # in-place writes count up
    training = {f"{part}.{n}" if n else part: m.training for part, root in parts.items()
                for n, m in root.named_modules()}
    try:
        yield record
    finally:
        for h in handles:
            h.remove()
        record.updated = [part for part, m in parts.items()
                          if any(p._version != v for p, v in zip(m.parameters(), versions[part]))]
        current = {(part, f"{part}.{n}" if n else part): b for part, m in parts.items() for n, b in m.named_buffers()}
        current_training = {f"{part}.{n}" if n else part: m.training for part, root in parts.items()
                            for n, m in root.named_modules()}
        trained_moved = any(not torch.equal(b.detach(), trained_stats[n]) for n, b in _running_stats(ctx.model,
                                                                                              skip=parts))
        for (name, layer), (module, start) in companion_stats.items() if trained_moved else ():
            if torch.equal(_running_mean(module).detach(), start):  # not run in the step, or run in eval mode
                record.companion_stats.setdefault(name, []).append(f"{name}.{layer}" if layer else name)
        for part in parts if trained_moved else ():
            idle = [f"{part}.{n}".rsplit(".", 1)[0] for n, b in _running_stats(parts[part])
                    if torch.equal(b.detach(), buffers.get((part, f"{part}.{n}"), b))]
            idle = [n for n in idle if not (training.get(n, True) or current_training.get(n, True))]
            if idle:
                record.idle_stats[part] = sorted(set(idle))
        for (part, name), saved in buffers.items():
            now = current.get((part, name))
            owner = name.rsplit(".", 1)[0] if "." in name else name
            if not (training.get(owner, True) or current_training.get(owner, True)):
                continue  # in eval mode before and after: a copy (a mean teacher's EMA of the buffers) moved them
            if now is not None and (now.shape != saved.shape or not torch.equal(now.detach(), saved)):
                record.moved.setdefault(part, [])
                if owner not in record.moved[part]:
                    record.moved[part].append(owner)


@check("train_mode", emits=("MODE-001",))
def check_train_mode(ctx: AuditContext) -> Iterable[Finding]:
    """MODE-001: the model, or dropout/BatchNorm of a trainable part, in eval mode during the training step."""
    if ctx.trace is not None and ctx.trace.calls:
        training = ctx.trace.training_call().training
    else:
        training = {"": ctx.model.training, **{n: m.training for n, m in ctx.model.named_modules()
                                               if n and isinstance(m, MODE_SENSITIVE)}}
    if not training.get("", True):
        return [Finding(
            "train_mode", Severity.WARN,
            "the model is in eval mode during the training step: dropout is off and BatchNorm uses (and does not "
            "update) running statistics; call model.train() (from_pretrained() returns an eval-mode model)",
            "MODE-001", {"modules": [""], "root_training": False},
        )]
    frozen = frozen_parts(ctx)
    stuck = [n for n, t in training.items() if n and not t and not _inside(n, frozen)]
    kept = [n for n in stuck if _kept_in_eval(ctx.model, n)]
    findings = []
    if kept:
        # consequence: a train() of the user's own that puts these back in eval mode every time is the design
        # (frozen BatchNorm statistics under trainable affine weights, mmcv's norm_eval), not a leftover .eval()
        findings.append(Finding(
            "train_mode", Severity.INFO,
            f"{len(kept)} dropout/BatchNorm submodule(s) of trainable parts stay in eval mode through a train() "
            f"override of the model's own: {fmt_names(kept)} (their running statistics are frozen on purpose)",
            "MODE-001", {"modules": kept, "root_training": True, "kept_by_train_override": True},
        ))
        stuck = [n for n in stuck if n not in set(kept)]
    if stuck:
        return findings + [Finding(
            "train_mode", Severity.WARN,
            f"the model trains but {len(stuck)} dropout/BatchNorm submodule(s) of its trainable parts are in eval "
            f"mode: {fmt_names(stuck)} (a submodule's .eval() survives model.train() only if called after it; "
            "freeze a part on purpose with requires_grad=False as well)",
            "MODE-001", {"modules": stuck, "root_training": True},
        )]
    return findings


#: packages whose own train() overrides only pass the mode on (transformers, DDP): not the user's decision
_FRAMEWORKS = ("torch", "transformers", "peft", "lightning", "pytorch_lightning", "accelerate", "deepspeed")


def _kept_in_eval(model: nn.Module, name: str) -> bool:
    """Whether ``name`` sits in a module (the model included) whose class overrides ``nn.Module.train`` in the
    user's own code: that train() decides the mode of what is below it."""
    path = name.split(".")
    for depth in range(len(path)):
        owner = model.get_submodule(".".join(path[:depth])) if depth else model
        defining = next(c for c in type(owner).__mro__ if "train" in vars(c))
        if defining.__module__.split(".")[0] not in _FRAMEWORKS:
            return True
    return False


@check("copy_statistics", emits=("MODE-009",))
def check_copy_statistics(ctx: AuditContext) -> Iterable[Finding]:
    """MODE-009: a momentum copy whose weights the step updates keeps its normalisation statistics where they were
    (in eval mode, never copied), while the trained network's statistics move."""
    record = ctx.probes.get("frozen_parts")
    if not isinstance(record, FrozenPartsRecord) or not (record.idle_stats or record.companion_stats):
        return []
    written = written_storage(ctx)
    modules = dict(ctx.model.named_modules())
    parts = sorted(p for p in record.idle_stats if p in record.updated or (
        p in modules and any(t.data_ptr() in written for t in modules[p].parameters())))
    layers = [n for p in parts for n in record.idle_stats[p]]
    # a copy kept beside the model: its weights were written in place outside the optimizer step
    beside = sorted(c for c in record.companion_stats
                    if any(t.data_ptr() in written for t in ctx.companions[c].parameters()))
    parts += beside
    layers += [n for c in beside for n in record.companion_stats[c]]
    if not parts:
        return []
    return [Finding(
        "copy_statistics", Severity.WARN,
        f"the step updates the weights of {fmt_names(parts)} in place (a momentum copy: an EMA or mean teacher, a "
        f"target encoder), but the running statistics of its normalisation layers ({fmt_names(layers)}) stayed "
        "where they were while the trained network's moved: they run in eval mode and the update copies only the "
        "parameters, so the copy normalises with statistics that belong to no weights it has. Update the buffers "
        "too (EMA of the float buffers, copy of num_batches_tracked), e.g. zip(student.buffers(), teacher.buffers())",
        "MODE-009", {"modules": parts, "layers": layers},
    )]


@check("frozen_parts", emits=("MODE-002", "MODE-003"))
def check_frozen_parts(ctx: AuditContext) -> Iterable[Finding]:
    """MODE-002 a frozen part drew random numbers in the step; MODE-003 a frozen part's buffers moved."""
    record = ctx.probes.get("frozen_parts")
    if not isinstance(record, FrozenPartsRecord):
        return []
    findings = []
    # a part another optimizer of the step trains (a GAN's discriminator during the generator's update) is not frozen
    elsewhere = stepped_elsewhere(ctx)
    modules = dict(ctx.model.named_modules())
    # nor is a momentum copy the step updates itself: MoCo's key encoder and a mean teacher run in train mode
    trains = {n for n in (*record.stochastic, *record.moved)
              if n in modules and any(id(p) in elsewhere for p in modules[n].parameters())
              or any(n == u or n.startswith(u + ".") for u in record.updated)}
    # a frozen component the gradient runs through to what trains (prompt tuning) is the fine-tune's own, as a LoRA
    # base is: its dropout regularises what trains (its running statistics are still judged below)
    parts = [p for p in record.stochastic if p not in trains and p not in record.conducting]
    if parts:
        findings.append(Finding(
            "frozen_parts", Severity.WARN,
            f"frozen part(s) {fmt_names(parts)} (requires_grad=False) are stochastic in this step: their forward "
            "drew random numbers (dropout in train mode), so the features they hand on change at random every step "
            "although they do not learn; call .eval() on them after model.train() (or run them under "
            "torch.no_grad() in eval mode)",
            "MODE-002", {"modules": parts},
        ))
    components = frozen_components(ctx)
    for own in (True, False):
        parts = [p for p in record.moved if (p in components) == own and p not in trains]
        if not parts:
            continue
        layers = [n for p in parts for n in record.moved[p]]
        what = ("frozen part(s)" if own else
                "frozen layer(s) of a model fine-tuned around them (expected if their statistics are meant to adapt)")
        findings.append(Finding(
            "frozen_parts", Severity.WARN if own else Severity.INFO,
            f"{what} {fmt_names(parts)} (requires_grad=False) moved their running statistics in this step "
            f"({fmt_names(layers)}): BatchNorm in train mode keeps re-estimating the frozen features' statistics "
            "from each batch; call .eval() on them after model.train() (or replace BatchNorm with FrozenBatchNorm)",
            "MODE-003", {"modules": parts, "layers": layers, "component": own},
        ))
    return findings


@check("norm_momentum", emits=("MODE-004",))
def check_norm_momentum(ctx: AuditContext) -> Iterable[Finding]:
    """MODE-004: a normalisation layer's momentum keeps little more than the last batch's statistics."""
    names, momenta = _at_or_above(ctx.model, lambda m: float(m.momentum) if (
        isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats and m.training
        and m.momentum is not None) else None, _MOMENTUM_LIMIT)
    if not names:
        return []
    return [Finding(
        "norm_momentum", Severity.WARN,
        f"{len(names)} normalisation layer(s) use momentum {momenta}: {fmt_names(names)}; in PyTorch the running "
        "statistics become (1 - momentum) * old + momentum * batch, so they hold little more than the last batch "
        "and evaluation uses noisy statistics (Keras/TF momentum=0.99 means PyTorch momentum=0.01)",
        "MODE-004", {"modules": names, "momentum": momenta},
    )]


#: a drop probability at or above this zeroes most activations: a keep probability passed as PyTorch's p
_DROP_LIMIT = 0.8


@check("dropout_rate", emits=("MODE-007",), static=True)
def check_dropout_rate(ctx: AuditContext) -> Iterable[Finding]:
    """MODE-007: a dropout layer that drops most of its input (TensorFlow's keep_prob=0.9 passed as p=0.9)."""
    names, rates = _at_or_above(ctx.model, lambda m: float(m.p) if isinstance(m, nn.modules.dropout._DropoutNd)
                                else None, _DROP_LIMIT)
    if not names:
        return []
    return [Finding(
        "dropout_rate", Severity.WARN,
        f"{len(names)} dropout layer(s) drop with p={rates}: {fmt_names(names)}; PyTorch's p is the probability of "
        "zeroing an activation, so they keep a tenth of the signal or less in training (p=1 keeps nothing) "
        "(TensorFlow's keep_prob=0.9 means p=0.1)",
        "MODE-007", {"modules": names, "p": rates},
    )]


@check("eval_dropout", emits=("MODE-008",), needs=("eval_mode",))
def check_eval_dropout(ctx: AuditContext) -> Iterable[Finding]:
    """MODE-008: a functional dropout called with ``training=True`` (the default of ``F.dropout``) keeps dropping in
    eval mode: validation and inference are noisy and scored below what the model can do."""
    dropouts = ctx.trace.eval_dropouts if ctx.trace is not None else None
    if not dropouts:
        return []
    functions = sorted({name for name, _ in dropouts})
    rates = sorted({p for _, p in dropouts})
    return [Finding(
        "eval_dropout", Severity.WARN,
        f"with the whole model in eval mode, {len(dropouts)} call(s) of F.{', F.'.join(functions)} still dropped "
        f"activations (p={rates}): their training argument is True (F.dropout's default), not self.training, so "
        "evaluation and inference stay random and score below the model's real accuracy; pass "
        "training=self.training or use an nn.Dropout module (if this is deliberate Monte Carlo dropout, ignore)",
        "MODE-008", {"functions": functions, "p": rates, "calls": len(dropouts)},
    )]


def _at_or_above(model: nn.Module, value: Callable[[nn.Module], float | None], limit: float) -> tuple[list[str],
                                                                                                    list[float]]:
    """The submodules whose ``value`` (None: not judged) is at least ``limit``, and the distinct values."""
    found = [(n, v) for n, m in model.named_modules() if (v := value(m)) is not None and v >= limit]
    return [n for n, _ in found], sorted({v for _, v in found})
