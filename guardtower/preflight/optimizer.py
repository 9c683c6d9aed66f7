"""Static optimizer checks: coverage (``optimizer_coverage``), frozen tensors (``frozen``) and
hyper-parameters (``optimizer_hparams``). Identity, not names, decides membership."""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from guardtower.preflight._registry import AuditContext, check
from guardtower.preflight._schedule import LOOKAHEAD_STEPS, peak_lrs
from guardtower.preflight._util import base_optimizer, fmt_names, master_copies_of, optimizer_tensors, trained_ids
from guardtower.report import Finding
from guardtower.severity import Severity

__all__: list[str] = []


@check("registration", emits=("OPT-016", "OPT-019"), static=True)
def check_registration(ctx: AuditContext) -> Iterable[Finding]:
    """OPT-016: submodules kept in a plain list, tuple or dict attribute, which nn.Module does not register;
    OPT-019: one module object listed at several positions of a container (``nn.ModuleList([block] * n)``)."""
    registered = {id(p) for p in ctx.model.parameters()}
    # after a step: a copy kept aside on purpose (an EMA model, a teacher held in a list so that state_dict and
    # the optimizer skip it) gets no gradient; layers that run in forward and miss the optimizer do
    stepped = ctx.trace is not None and ctx.trace.backward
    hidden = []
    findings = list(_repeated_children(ctx.model))
    for name, module in ctx.model.named_modules():
        for attribute, value in vars(module).items():
            items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
            if attribute.startswith("_") or not items:
                continue
            # a list of references to registered modules (kept for hooks, say) hides nothing
            held = [m for m in items if isinstance(m, nn.Module) and any(True for _ in m.parameters())
                    and not any(id(p) in registered for p in m.parameters())]
            trained = [m for m in held if not stepped or any(p.grad is not None for p in m.parameters())]
            if held and len(held) == len(items) and trained:
                hidden.append(f"{name}.{attribute}" if name else attribute)
    if hidden:
        findings.append(Finding(
            "registration", Severity.WARN,
            f"{len(hidden)} attribute(s) hold submodules in a plain Python list/tuple/dict: {fmt_names(hidden)}; "
            "nn.Module does not register them, so their parameters are missing from model.parameters() (the "
            "optimizer never updates them), from state_dict() (checkpoints drop them) and from .to(device); use "
            "nn.ModuleList / nn.ModuleDict",
            "OPT-016", {"attributes": hidden[:50]},
        ))
    return findings


def _repeated_children(model: nn.Module) -> Iterable[Finding]:
    """OPT-019 per container whose children repeat one module object (with parameters)."""
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        children = [(key, child) for key, child in module._modules.items() if child is not None]
        seen: dict[int, str] = {}
        repeats = []
        for key, child in children:
            if id(child) in seen and any(True for _ in child.parameters()):
                repeats.append(key)
            seen.setdefault(id(child), key)
        if repeats:
            where = name or "the model"
            yield Finding(
                "registration", Severity.WARN,
                f"{where} lists one module object at {len(repeats) + 1} positions (entries "
                f"{fmt_names([seen[id(module._modules[repeats[0]])], *repeats])}): [layer] * n repeats a reference, "
                "so the stack shares one set of weights instead of n; build each entry anew "
                "(nn.ModuleList(Block() for _ in range(n)), or copy.deepcopy)",
                "OPT-019", {"container": name, "entries": repeats[:50]},
            )


@check("optimizer_coverage", emits=("OPT-001", "OPT-003"), static=True)
def check_optimizer_coverage(ctx: AuditContext) -> Iterable[Finding]:
    """OPT-001 trainable parameters that neither the optimizer nor another one the step steps updates, OPT-003 a
    stale optimizer."""
    if ctx.optimizer is None:
        return []
    in_opt = optimizer_tensors(ctx.optimizer)
    stepped = trained_ids(ctx) or set()  # a GAN's discriminator optimizer updates its parameters
    all_model = {id(p) for p in ctx.model.parameters()}
    trainable = {n: p for n, p in ctx.params.items() if p.requires_grad}
    missing = [n for n, p in trainable.items() if id(p) not in stepped]
    masters = master_copies_of(ctx.optimizer, ctx.params)
    foreign = [] if masters is not None else [t for _, t in in_opt if id(t) not in all_model]
    findings = []
    mains = [t for _, t in in_opt]
    if masters is not None and all(p.shape == main.shape for p, main in zip(masters, mains)):
        names = {id(p): n for n, p in ctx.params.items()}
        behind = [names[id(p)] for p, main in zip(masters, mains)
                  if not torch.equal(main.detach().to(p.dtype), p.detach())]
        if behind:
            findings.append(Finding(
                "optimizer_coverage", Severity.ERROR,
                f"the optimizer steps float32 main copies of the model's 16-bit weights, but {len(behind)} of them "
                f"are not the model's values ({fmt_names(behind)}): weights loaded after the optimizer was built "
                "(a checkpoint) never reached the main copies, and its first step copies the stale ones back, so "
                "training restarts from them; re-sync the main weights after loading (reload_model_params())",
                "OPT-003", {"stale_main_weights": behind[:50], "count": len(behind)},
            ))
    stale_all = bool(trainable) and bool(in_opt) and len(missing) == len(trainable)
    if foreign or stale_all:
        reason = (f"{len(foreign)} of its {len(in_opt)} tensors are not parameters of this model"
                  if foreign else "it updates none of the model's trainable parameters")
        findings.append(Finding(
            "optimizer_coverage", Severity.ERROR,
            f"the optimizer is stale: {reason} (built before the model was wrapped, re-created, given a new "
            "head, passed through get_peft_model or materialised); build it from the final model",
            "OPT-003", {"foreign_tensors": len(foreign), "optimizer_tensors": len(in_opt),
                        "missing_trainable": missing[:50]},
        ))
    if missing and not stale_all and ctx.trace is not None and ctx.trace.backward:
        # consequence: a part that got no gradient either is not trained by anything, on purpose (GRAD-001 says so)
        ungraded = [n for n in missing if ctx.trace.grads.get(n) is None]
        if ungraded:
            findings.append(Finding(
                "optimizer_coverage", Severity.INFO,
                f"{len(ungraded)} parameter(s) are in no optimizer and got no gradient: {fmt_names(ungraded)}; "
                "nothing trains them (a target network, an EMA or teacher copy)",
                "OPT-001", {"params": ungraded, "ungraded": True},
            ))
            missing = [n for n in missing if n not in set(ungraded)]
    if missing and not stale_all:
        owners = dict(ctx.model.named_modules())
        resting = [n for n in missing if not owners.get(n.rpartition(".")[0], ctx.model).training]
        if len(resting) == len(missing):  # kept in eval mode and out of the optimizer: frozen on purpose
            findings.append(Finding(
                "optimizer_coverage", Severity.INFO,
                f"{len(missing)} parameter(s) of parts kept in eval mode are not in the optimizer: {fmt_names(missing)}; "
                "they stay fixed as a frozen part should, but still require grad, so backward computes their "
                "gradients for nothing (requires_grad_(False) saves that)",
                "OPT-001", {"params": missing, "eval_mode": True},
            ))
        else:
            findings.append(Finding(
                "optimizer_coverage", Severity.ERROR,
                f"{len(missing)} trainable parameter(s) are NOT in the optimizer (in no param group of any optimizer the step "
                "steps) and will never be "
                f"updated: {fmt_names(missing)}",
                "OPT-001", {"params": missing},
            ))
    return findings


@check("frozen", emits=("OPT-002", "OPT-006", "OPT-014"), static=True)
def check_frozen(ctx: AuditContext) -> Iterable[Finding]:
    """OPT-006 (info): which parameters are frozen; OPT-002: frozen parameters that still sit in the optimizer;
    OPT-014: a module flagged ``requires_grad = False`` as a plain attribute, whose parameters still train."""
    findings = []
    flagged = [name or type(ctx.model).__name__ for name, module in ctx.model.named_modules()
               if vars(module).get("requires_grad") is False
               and any(p.requires_grad for p in module.parameters())]
    if flagged:
        findings.append(Finding(
            "frozen", Severity.WARN,
            f"{len(flagged)} module(s) have requires_grad = False set as a plain attribute, but their parameters "
            f"still require grad and train: {fmt_names(flagged)}; nn.Module has no such flag, so nothing is frozen. "
            "Call module.requires_grad_(False) (with the trailing underscore) or set it on each parameter",
            "OPT-014", {"modules": flagged[:50]},
        ))
    all_frozen = [n for n, p in ctx.params.items() if not p.requires_grad]
    if all_frozen:
        numel = sum(ctx.params[n].numel() for n in all_frozen)
        total = sum(p.numel() for p in ctx.params.values())
        findings.append(Finding(
            "frozen", Severity.INFO,
            f"{len(all_frozen)} frozen parameter tensor(s) ({numel:,} of {total:,} elements, requires_grad=False) "
            f"will not train: {fmt_names(all_frozen)}",
            "OPT-006", {"params": all_frozen[:200], "count": len(all_frozen), "numel": numel},
        ))
    if ctx.optimizer is None:
        return findings
    names = {id(p): n for n, p in ctx.model.named_parameters()}
    frozen_tensors = [t for _, t in optimizer_tensors(ctx.optimizer) if id(t) in names and not t.requires_grad]
    if frozen_tensors:
        frozen = [names[id(t)] for t in frozen_tensors]
        state = getattr(base_optimizer(ctx.optimizer), "state", {})
        stale = [names[id(t)] for t in frozen_tensors if state.get(t)]
        # consequence: with optimizer state (momentum, moments) a zero gradient still moves them, and unfreezing
        # resumes stale moments; without, torch optimizers skip a tensor whose gradient is None
        severity = Severity.WARN if stale else Severity.INFO
        consequence = (f"{len(stale)} of them carry optimizer state (momentum/moments) from earlier steps, which "
                       "still moves them whenever their gradient is zero instead of None, and resumes stale on "
                       "unfreezing" if stale else "they are skipped while their gradient is None and cost only "
                       "optimizer memory")
        findings.append(Finding(
            "frozen", severity,
            f"{len(frozen)} frozen parameter(s) (requires_grad=False) are in the optimizer: {fmt_names(frozen)}; "
            f"{consequence}",
            "OPT-002", {"params": frozen, "with_state": stale},
        ))
    return findings


def _nonzero(grad: torch.Tensor | None) -> bool:
    return grad is not None and bool(grad.any())


@check("unfrozen_by_step", emits=("OPT-022",))
def check_unfrozen_by_step(ctx: AuditContext) -> Iterable[Finding]:
    """OPT-022: tensors frozen when the step began that the step itself left requiring grad, with a gradient,
    held by an optimizer: whatever froze them is undone every step (a context manager that re-enables them on
    exit, a helper's ``requires_grad_(True)``), so the part meant to stay fixed trains. A step that freezes a
    part for one phase and unfreezes it again (a GAN's discriminator) ends as it began: not a finding."""
    trained = trained_ids(ctx)
    if ctx.trace is None or not ctx.trace.unfrozen or trained is None:
        return []
    grads = ctx.trace.grads
    unfrozen = [n for n in ctx.params if n in ctx.trace.unfrozen and id(ctx.params[n]) in trained
                and _nonzero(grads.get(n))]
    if not unfrozen:
        return []
    return [Finding(
        "unfrozen_by_step", Severity.WARN,
        f"{len(unfrozen)} tensor(s) had requires_grad=False when the step began and require grad when it ends, got "
        f"a gradient and sit in the optimizer: {fmt_names(unfrozen)}; something the step calls unfreezes them "
        "(a context manager that re-enables gradients on exit, such as peft's disable_adapter() on an adapter "
        "loaded with inference_mode=True; a helper calling requires_grad_(True) on the whole model), so the part "
        "meant to stay frozen trains from the first step; freeze them again after that call, or keep them out of "
        "the optimizer",
        "OPT-022", {"params": unfrozen[:50], "count": len(unfrozen)},
    )]


@check("optimizer_hparams", emits=("OPT-004", "OPT-005", "OPT-007", "OPT-015", "OPT-017", "OPT-018"), static=True)
def check_optimizer_hparams(ctx: AuditContext) -> Iterable[Finding]:
    """OPT-004 learning rate zero, OPT-005/OPT-007 weight decay on biases and normalisation weights, OPT-015 a
    momentum the size of a weight decay, OPT-017 an empty group with its own lr, OPT-018 Adam's betas swapped."""
    if ctx.optimizer is None:
        return []
    names = {id(p): n for n, p in ctx.model.named_parameters()}
    findings = [*_tiny_momentum(ctx.optimizer), *_empty_groups(ctx.optimizer), *_swapped_betas(ctx.optimizer)]
    # a weight_decay=0 group next to decayed ones says the user meant to exclude the biases and norms from decay,
    # even when its name filter caught none of them (T5 names its norms layer_norm, not LayerNorm)
    no_decay_group = len(ctx.optimizer.param_groups) > 1 and any(
        not group.get("weight_decay", 0.0) for group in ctx.optimizer.param_groups)
    peaks = peak_lrs(ctx.lr_scheduler, base_optimizer(ctx.optimizer)) if ctx.lr_scheduler is not None else None
    for gi, group in enumerate(ctx.optimizer.param_groups):
        params = [p for p in group.get("params", ()) if isinstance(p, torch.Tensor)]
        trainable = [p for p in params if p.requires_grad]
        lr = group.get("lr")
        lr_value = float(lr) if isinstance(lr, (int, float, torch.Tensor)) else None
        if peaks is not None and gi < len(peaks):
            never = trainable and peaks[gi] == 0.0
            why = f"and the LR schedule keeps it at 0 for the next {LOOKAHEAD_STEPS} steps (0 total/warmup steps?)"
        else:
            initial = group.get("initial_lr")
            warming_up = isinstance(initial, (int, float, torch.Tensor)) and float(initial) > 0
            never = bool(trainable) and lr_value == 0.0 and not warming_up
            why = "and no scheduler raising it"
        if never:
            findings.append(Finding(
                "optimizer_hparams", Severity.WARN,
                f"param group {gi} has lr=0 for {len(trainable)} trainable tensor(s) {why}: nothing in it will train",
                "OPT-004", {"group": gi, "params": [names.get(id(p), "?") for p in trainable][:50],
                            "schedule_checked": peaks is not None},
            ))
        wd = group.get("weight_decay", 0.0)
        if isinstance(wd, (int, float)) and wd > 0:
            decayed = [names.get(id(p), "?") for p in trainable if p.dim() <= 1]
            if decayed and no_decay_group:
                findings.append(Finding(
                    "optimizer_hparams", Severity.WARN,
                    f"param group {gi} applies weight_decay={wd:g} to {len(decayed)} bias/normalisation tensor(s) "
                    f"although a group with weight_decay=0 is there for them: {fmt_names(decayed)} (the name filter "
                    "that builds the no-decay group missed them; it may match nothing at all)",
                    "OPT-007", {"group": gi, "weight_decay": wd, "params": decayed[:50]},
                ))
            elif decayed:
                findings.append(Finding(
                    "optimizer_hparams", Severity.INFO,
                    f"param group {gi} applies weight_decay={wd:g} to {len(decayed)} bias/normalisation tensor(s): "
                    f"{fmt_names(decayed)}; usual practice puts them in a group with weight_decay=0",
                    "OPT-005", {"group": gi, "weight_decay": wd, "params": decayed[:50]},
                ))
    return findings


#: a momentum (SGD/RMSprop ``momentum``, Adam's first beta) above 0 but below this keeps almost nothing of the
#: past gradient: nobody means that; it is a weight decay or epsilon value that landed in the momentum slot
_TINY_MOMENTUM = 0.05


def _tiny_momentum(optimizer: torch.optim.Optimizer) -> Iterable[Finding]:
    """OPT-015: per param group, a momentum in (0, 0.05), typically a positional argument one slot off."""
    for gi, group in enumerate(optimizer.param_groups):
        betas = group.get("betas")
        for key, value in (("momentum", group.get("momentum")),
                           ("betas[0]", betas[0] if isinstance(betas, (tuple, list)) and betas else None)):
            if isinstance(value, (int, float)) and 0 < value < _TINY_MOMENTUM:
                yield Finding(
                    "optimizer_hparams", Severity.WARN,
                    f"param group {gi} has {key}={value:g}: a momentum that small keeps almost none of the past "
                    "gradient (usual values 0.9-0.99, or 0 for none); it looks like a weight decay value passed "
                    "in the momentum's position (SGD(params, lr, momentum, dampening, weight_decay)): pass "
                    "momentum= and weight_decay= by keyword",
                    "OPT-015", {"group": gi, key: value, "weight_decay": group.get("weight_decay")},
                )


def _swapped_betas(optimizer: torch.optim.Optimizer) -> Iterable[Finding]:
    """OPT-018: betas=(b1, b2) with b1 > b2, e.g. (0.999, 0.9): the second-moment average forgets faster than the
    first, so the per-tensor step size follows the latest squared gradients and a spike is barely damped."""
    for gi, group in enumerate(optimizer.param_groups):
        betas = group.get("betas")
        if (isinstance(betas, (tuple, list)) and len(betas) == 2 and all(isinstance(b, float) for b in betas)
                and betas[0] > betas[1]):
            yield Finding(
                "optimizer_hparams", Severity.WARN,
                f"param group {gi} has betas={tuple(betas)}: the first-moment beta is larger than the second's, "
                "the reverse of every published setting ((0.9, 0.999), (0.9, 0.95)); the variance estimate then "
                f"averages over ~{1 / (1 - betas[1]):.0f} steps and the momentum over ~{1 / (1 - betas[0]):.0f}: "
                "swap them",
                "OPT-018", {"group": gi, "betas": list(betas)},
            )


def _empty_groups(optimizer: torch.optim.Optimizer) -> Iterable[Finding]:
    """OPT-017: a param group that holds no tensor but has its own learning rate: the filter that should have
    filled it (a backbone picked by name prefix) matched nothing, so those tensors train at another group's lr.
    An empty group with the others' lr (the Trainer's no-decay group of a LoRA model) changes nothing."""
    groups = optimizer.param_groups
    lrs = {float(g["lr"]) for g in groups if g.get("params") and isinstance(g.get("lr"), (int, float))}
    for gi, group in enumerate(groups):
        lr = group.get("lr")
        if not group.get("params") and isinstance(lr, (int, float)) and lrs and float(lr) not in lrs:
            yield Finding(
                "optimizer_hparams", Severity.WARN,
                f"param group {gi} (lr={lr:g}) holds no tensor: the tensors it was built for (a name prefix or "
                "filter that matched nothing) sit in another group and train at its lr "
                f"({', '.join(f'{v:g}' for v in sorted(lrs))}); check the names the filter tests against "
                "model.named_parameters()",
                "OPT-017", {"group": gi, "lr": lr, "other_lrs": sorted(lrs)},
            )

