"""Gradient checks: connectivity (``grad_connectivity``), magnitude (``grad_norms``) and the size of one
optimizer update relative to the weights (``update_ratio``)."""

from __future__ import annotations

import math
import re
import statistics
from typing import Callable, Iterable

import torch
from torch import nn

from guardtower.preflight._registry import AuditContext, check
from guardtower.preflight._second_step import zero_gradients
from guardtower.preflight._trace import UpdateStats
from guardtower.preflight._util import fmt_names, is_library_model, is_lora_factor, trained_ids
from guardtower.report import Finding
from guardtower.severity import Severity

__all__ = [
    "EXPLODING_GLOBAL_NORM",
    "EXPLODING_RATIO",
    "VANISHING_RATIO",
    "VANISHING_GLOBAL_NORM",
    "UPDATE_RATIO_HIGH",
    "UPDATE_RATIO_LOW",
]

#: a global gradient norm above this is exploding whatever the weights
EXPLODING_GLOBAL_NORM = 1e4
#: ``||grad|| / ||param||`` above this for a tensor: one SGD step at lr=0.01 would move it by more than itself
EXPLODING_RATIO = 1e2
#: ``||grad|| / ||param||`` below this for a weight matrix: it will not move in any realistic number of steps
VANISHING_RATIO = 1e-8
VANISHING_GLOBAL_NORM = 1e-8
#: median ``||update|| / ||weight||`` over weight matrices after one step; ~1e-3 is healthy
UPDATE_RATIO_HIGH = 0.5
UPDATE_RATIO_LOW = 1e-6


def _grads_ready(ctx: AuditContext) -> bool:
    return ctx.trace is not None and ctx.trace.backward


@check("grad_connectivity", emits=("GRAD-001", "GRAD-004"), needs=("second_step", "value_reads", "self_updates"))
def check_grad_connectivity(ctx: AuditContext) -> Iterable[Finding]:
    """GRAD-001 trainable parameters without a gradient, GRAD-004 gradients that are exactly zero."""
    if not _grads_ready(ctx):
        return []
    assert ctx.trace is not None
    grads = ctx.trace.grads
    trainable = [n for n, p in ctx.params.items() if p.requires_grad]
    missing = [n for n in trainable if grads.get(n) is None]
    trained, updated_by_step = trained_ids(ctx), ctx.trace.updated_by_step
    # each explanation, in turn, takes the parameters it accounts for out of ``missing`` as an INFO finding (the
    # consequence is by design); what none accounts for is a failure
    explanations: list[tuple[Callable[[list[str]], list[str]], Callable[[list[str]], str], str]] = [
        (lambda names: _skipped_by_design(ctx, names),
         lambda names: f"{len(names)} trainable parameter(s) got no gradient in this step because their layer or "
         f"expert did not run (the model drops layers at random or routes tokens to experts): {fmt_names(names)}; "
         "they get gradients in other steps", "conditional"),
        (lambda names: _unused_parts(ctx, names),
         lambda names: f"{len(names)} trainable parameter(s) of parts the step does not use got no gradient (their "
         f"module never ran, or the loss does not use what it computes): {fmt_names(names)} (an unused pooler, a "
         "backbone's head the step skips, cross-attention a decoder-only use never calls); if the loss should use "
         "them, wire them in, else freeze them", "unused_part"),
        # no optimizer holds them either, so nothing was meant to train them (a target network, an EMA or teacher
        # copy left requiring grad); a gradient would change nothing
        (lambda names: [n for n in names if trained is not None and id(ctx.params[n]) not in trained],
         lambda names: f"{len(names)} parameter(s) that require grad got no gradient and are in no optimizer the "
         f"step steps: {fmt_names(names)}; nothing trains them, as a target network or an EMA/teacher copy should "
         "be (requires_grad_(False) says so)", "untrained"),
        # the step keeps them up to date itself (a MoCo key encoder, a BYOL/DINO target), so no gradient was needed;
        # a copy that should follow and never changes is the failure below
        (lambda names: [n for n in names if n in updated_by_step],
         lambda names: f"{len(names)} trainable parameter(s) ran only under no_grad and got no gradient, and "
         f"step_fn updates them itself: {fmt_names(names)} (a momentum or EMA copy of what learns); "
         "requires_grad_(False) says so", "updated_by_step"),
    ]
    findings = []
    for select, say, kind in explanations:
        explained = select(missing)
        if explained:
            findings.append(Finding("grad_connectivity", Severity.INFO, say(explained), "GRAD-001",
                                    {"params": explained, kind: True}))
            missing = [n for n in missing if n not in set(explained)]
    if missing:
        findings.append(Finding(
            "grad_connectivity", Severity.ERROR,
            f"{len(missing)} trainable parameter(s) got NO gradient: {fmt_names(missing)} (unused in forward, "
            "used under no_grad/detach, or replaced after the graph was built)",
            "GRAD-001", {"params": missing},
        ))
    # LoRA factors: the random one has a zero gradient at step 1 by design; the LoRA checks judge them
    zero = [n for n in zero_gradients(grads) if ctx.params[n].requires_grad and not is_lora_factor(n)]
    flows = ctx.trace.flows_after_update or set()
    late = [n for n in zero if n in flows]
    flat = [path or "the output" for call in ctx.trace.calls[:1] for path, pulled in call.output_grads.items()
            if not pulled]
    if late:
        extra: dict[str, object]
        if flat:
            # an output of the model that the loss reads got an exactly zero gradient, so no gate inside the model
            # holds these back: the loss is at its minimum in that output for the weights as they are, its target
            # is that very prediction (value targets built from the old values)
            severity, extra = Severity.WARN, {"flat_outputs": flat}
            why = (f"the model output {', '.join(flat)} that the loss reads got an exactly zero gradient, so the loss "
                   "is at its minimum in that output for the weights as they are: its target equals the prediction "
                   "(a target computed from the model's own output at these weights, such as returns built from zero "
                   "advantages plus the old values), and they learn only as far as other terms move the prediction "
                   "away from it; build the target from what the output should predict")
        else:
            # a zero-initialised layer downstream (a gate, a zero-init projection) moved in the first update, and
            # from the second step on these learn: the design of a gated or zero-init branch
            severity, extra = Severity.INFO, {"first_step_only": True}
            why = ("after one update they get one (a zero-initialised layer after them, such as a gate or a zero-init "
                   "projection, passes no gradient until it has moved)")
        findings.append(Finding(
            "grad_connectivity", severity,
            f"{len(late)} trainable parameter(s) got an all-zero gradient in the first step only: {fmt_names(late)}; "
            f"{why}", "GRAD-004", {"params": late, **extra},
        ))
        zero = [n for n in zero if n not in flows]
    if zero:
        # consequence: a weight that cannot learn is a finding; a bias or norm shift alone with no gradient is
        # usually a symmetry of the loss (a pairwise loss cancels a shared shift)
        weights = [n for n in zero if _effective_dims(ctx.params[n]) >= 2]
        findings.append(Finding(
            "grad_connectivity", Severity.WARN if weights else Severity.INFO,
            f"{len(zero)} trainable parameter(s) got an all-zero gradient: {fmt_names(zero)} (dead ReLUs or "
            "clamps upstream, a zero-initialised layer in between, or masked-out outputs)",
            "GRAD-004", {"params": zero},
        ))
    return findings


def _unused_parts(ctx: AuditContext, missing: list[str]) -> list[str]:
    """The gradient-less parameters of parts the step does not use: a module that never ran inside a module
    whose own forward never ran either (a backbone's classifier head when the step calls its feature layers), or
    a part of a library model that never ran or whose output nothing used (an unused pooler or post-layernorm,
    ``embed_tokens`` under ``inputs_embeds``, the cross-attention of a decoder used alone) while the rest of that
    library model got gradients, or a module or parameter of the user's that took part but whose values the loss
    does not read (changed, the loss stays bitwise equal: an output the step discards, the last bias of an energy
    model trained on forces only). Not cut: a part that ran only under ``no_grad`` stays
    a failure, and so do a library model none of which got a gradient (its output detached), a user's head that
    its parent's forward never calls (wired to nothing) and an adapter factor (an adapter that never trains is the
    bug itself)."""
    assert ctx.trace is not None
    ran, in_graph = ctx.trace.ran, ctx.trace.ran_with_grad
    if not ran:
        return []
    modules = dict(ctx.model.named_modules())
    learning = [name for name, g in ctx.trace.grads.items() if g is not None]
    idle = []
    for n in missing:
        owner = n.rpartition(".")[0]
        if owner not in modules or (owner in ran and owner not in in_graph) or is_lora_factor(n) or "lora_" in n:
            continue
        parent = owner.rpartition(".")[0]
        if n in ctx.trace.unread or any(n.startswith(f"{m}.") for m in ctx.trace.unread):
            idle.append(n)  # the loss does not read it (a policy's unused critic, a bias a force loss drops)
            continue
        if owner not in ran and parent not in ran:
            if n in ctx.trace.value_checked:
                continue  # a parameter of its own that the loss reads, through a method: its gradient was cut
            idle.append(n)  # the step used the enclosing module only through its parts, never its forward
            continue
        library = _library_root(modules, owner)
        # a head attached to the root is the user's; a library model that got no gradient at all was cut
        scope = f"{library}." if library else ""
        if library is not None and any(g.startswith(scope) for g in learning):
            idle.append(n)
    return idle


def _library_root(modules: dict[str, torch.nn.Module], owner: str) -> str | None:
    """The prefix of the outermost library (transformers, peft) model that holds ``owner`` as one of its own parts
    ("" for the audited model itself), or None: a module the user attached to a library model is the user's."""
    if owner == "":
        return "" if is_library_model(modules[""]) else None  # a library model's own parameter (CLIP's logit_scale)
    path = owner.split(".")
    for i in range(1, len(path)):
        prefix = ".".join(path[:i])
        if is_library_model(modules.get(prefix)):
            return prefix
    inner = [modules.get(".".join(path[:i])) for i in range(1, len(path) + 1)]
    if is_library_model(modules[""]) and any(is_library_model(m) and not hasattr(m, "base_model_prefix") for m in inner):
        return ""  # the library model is the audited one: its own inner module (BertPooler), not one added to it
    return None


#: config fields that make a layer or expert skip a step by design (layerdrop, mixture-of-experts routing)
_STOCHASTIC_DEPTH = ("layerdrop", "encoder_layerdrop", "decoder_layerdrop")
_EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def _skipped_by_design(ctx: AuditContext, missing: list[str]) -> list[str]:
    """The gradient-less parameters that sit in one entry of a layer or expert list whose siblings did get a
    gradient, in a model that drops layers (layerdrop) or routes tokens to experts: skipped this step, not
    disconnected. Empty when the model does neither."""
    config = getattr(ctx.model, "config", None)
    conditional = any(_number(getattr(config, k, 0)) > 0 for k in _STOCHASTIC_DEPTH) or any(
        _number(getattr(config, k, 0)) > 1 for k in _EXPERTS)
    if not missing or not conditional:
        return []
    assert ctx.trace is not None
    with_grad = [n for n, g in ctx.trace.grads.items() if g is not None]
    lists = [name for name, m in ctx.model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 1]
    skipped = []
    for n in missing:
        entry = next((f"{prefix}.{n[len(prefix) + 1:].split('.')[0]}." for prefix in lists
                      if prefix and n.startswith(prefix + ".")), None)
        if entry is None:
            continue
        prefix = entry.rsplit(".", 2)[0] + "."
        if any(w.startswith(prefix) and not w.startswith(entry) for w in with_grad):
            skipped.append(n)
    return skipped


def _effective_dims(t: torch.Tensor) -> int:
    """Dimensions of size > 1: a (1, 1, d) class token is a vector, not a matrix."""
    return sum(1 for size in t.shape if size > 1)


def _number(value: object) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def _norms(ctx: AuditContext) -> list[tuple[str, float, float, int]]:
    """(name, grad norm, param norm, effective ndim) for finite gradients."""
    assert ctx.trace is not None
    out = []
    with torch.no_grad():
        for name, g in ctx.trace.grads.items():
            p = ctx.params.get(name)
            if g is None or p is None or g.numel() == 0:
                continue
            gn = float(g.float().norm())
            if not math.isfinite(gn):
                continue
            out.append((name, gn, float(p.detach().float().norm()), _effective_dims(p)))
    return out


@check("grad_norms", emits=("GRAD-002", "GRAD-003"))
def check_grad_norms(ctx: AuditContext) -> Iterable[Finding]:
    """GRAD-002 exploding and GRAD-003 vanishing gradients, judged absolutely and relative to the weights."""
    if not _grads_ready(ctx):
        return []
    norms = _norms(ctx)
    if not norms:
        return []
    total = math.sqrt(sum(gn * gn for _, gn, _, _ in norms))
    findings = []
    # the ratio is judged on weight matrices only: a bias initialised at (or near) zero has a tiny norm, so any
    # healthy gradient is "100x its weight"
    # nor on embedding tables: a table of a few rows (token types, positions) sums the gradient of every token
    tables = {f"{n}.weight" if n else "weight" for n, m in ctx.model.named_modules() if isinstance(m, nn.Embedding)}
    exploding = [(n, gn, pn) for n, gn, pn, nd in norms
                 if nd >= 2 and pn > 0 and gn / pn > EXPLODING_RATIO and n not in tables]
    if total > EXPLODING_GLOBAL_NORM or exploding:
        worst = max(exploding, key=lambda e: e[1] / e[2], default=None)
        findings.append(Finding(
            "grad_norms", Severity.WARN,
            f"exploding gradients: global gradient norm {total:.3g}"
            + (f"; {len(exploding)} tensor(s) with ||grad||/||param|| > {EXPLODING_RATIO:g}, worst {worst[0]} "
               f"({worst[1] / worst[2]:.3g})" if worst else "")
            + " (unnormalised inputs/targets, bad init, or a loss scaled up)",
            "GRAD-002", {"global_norm": total, "params": [e[0] for e in exploding],
                         "ratios": {e[0]: e[1] / e[2] for e in exploding[:20]}},
        ))
    vanishing = [(n, gn, pn) for n, gn, pn, nd in norms
                 if nd >= 2 and pn > 0 and 0 < gn and gn / pn < VANISHING_RATIO]
    if 0 < total < VANISHING_GLOBAL_NORM or vanishing:
        findings.append(Finding(
            "grad_norms", Severity.WARN,
            f"vanishing gradients: global norm {total:.3g}"
            + (f"; {len(vanishing)} weight tensor(s) with ||grad||/||param|| < {VANISHING_RATIO:g}: "
               f"{fmt_names([e[0] for e in vanishing])}" if vanishing else "")
            + " (saturating activations in a deep stack, missing residuals/normalisation, or a tiny loss scale)",
            "GRAD-003", {"global_norm": total, "params": [e[0] for e in vanishing],
                         "ratios": {e[0]: e[1] / e[2] for e in vanishing[:20]}},
        ))
    return findings


def _finite_grad(ctx: AuditContext, name: str) -> bool:
    assert ctx.trace is not None
    g = ctx.trace.grads.get(name)
    return g is not None and bool(torch.isfinite(g).all())


#: names of learned position tables: ``pos_emb``, ``positional_encodings``, ``position_embeddings``, ``wpe``
_POSITION_TABLE = re.compile(r"pos(ition)?(al)?_?(emb|enc)|positional|(^|\.)wpe(\.|$)", re.IGNORECASE)


@check("position_rows", emits=("GRAD-007",))
def check_position_rows(ctx: AuditContext) -> Iterable[Finding]:
    """GRAD-007: a learned position table whose gradient reached one position only, and not the first: every
    position of the batch read the same row (``pe[n]`` where ``pe[:n]`` was meant, position ids all equal), so
    the model is told nothing about order. A batch of one position reads row 0 and is left alone."""
    if ctx.trace is None:
        return []
    found: list[tuple[str, int, int]] = []
    for name in ctx.params:
        grad = ctx.trace.grads.get(name)
        if not _POSITION_TABLE.search(name) or grad is None or grad.is_sparse or grad.dim() < 2:
            continue
        axis = next((d for d in range(grad.dim() - 1) if grad.shape[d] > 1), None)  # the positions' axis
        if axis is None:
            continue
        with torch.no_grad():
            reached = grad.movedim(axis, 0).reshape(grad.shape[axis], -1).ne(0).any(1).nonzero().flatten().tolist()
        if len(reached) == 1 and reached[0] > 0:
            found.append((name, reached[0], grad.shape[axis]))
    return [Finding(
        "position_rows", Severity.WARN,
        f"the gradient reached one row of the position table {name} only (row {row} of {rows}): every position "
        "the step ran read that same row, so the model gets one vector added everywhere and learns nothing about "
        "order; index the first positions (pe[:n], not pe[n]) or pass position ids that count up",
        "GRAD-007", {"param": name, "row": row, "rows": rows},
    ) for name, row, rows in found[:4]]


@check("update_ratio", emits=("GRAD-005", "NAN-004"), needs=("update",))
def check_update_ratio(ctx: AuditContext) -> Iterable[Finding]:
    """GRAD-005: one real optimizer step (undone afterwards) moves the weights far more or less than ~1e-3;
    NAN-004: that step turns finite weights non-finite."""
    if ctx.trace is None:
        return []
    error = ctx.trace.update_error
    if error is not None:
        raise RuntimeError(f"the trial optimizer step failed: {type(error).__name__}: {error}")
    stats: dict[str, UpdateStats] = ctx.trace.update
    broken = [n for n, s in stats.items() if not s.finite and _finite_grad(ctx, n)]
    if broken:
        dtypes = sorted({stats[n].dtype for n in broken})
        return [Finding(
            "update_ratio", Severity.ERROR,
            f"one optimizer step turns {len(broken)} finite {'/'.join(dtypes)} weight tensor(s) with finite "
            f"gradients into NaN/Inf: {fmt_names(broken)} (fp16 weights under Adam: eps underflows; keep "
            "trainable weights in fp32)",
            "NAN-004", {"params": broken, "dtypes": dtypes},
        )]
    ratios = {n: s.ratio for n, s in stats.items()
              if s.has_grad and s.ndim >= 2 and math.isfinite(s.ratio) and not is_lora_factor(n)}
    if not ratios:
        return []
    median = statistics.median(ratios.values())
    lrs = sorted({float(g["lr"]) for g in getattr(ctx.optimizer, "param_groups", []) if "lr" in g})
    if lrs and max(lrs) == 0.0:
        return []  # a warmup that starts at 0 (or an lr that stays 0: OPT-004 judges that, with the schedule)
    if median > UPDATE_RATIO_HIGH:
        verdict = f"far above ~1e-3: the first steps will overwrite the initialisation (lr {lrs} too high?)"
    elif median < UPDATE_RATIO_LOW:
        verdict = f"far below ~1e-3: the weights will barely move (lr {lrs} too low, or gradients vanishing?)"
    else:
        return []
    top = sorted(ratios.items(), key=lambda kv: kv[1], reverse=median > UPDATE_RATIO_HIGH)[:10]
    return [Finding(
        "update_ratio", Severity.WARN,
        f"one optimizer step changes the weights by a median {median:.3g} of their norm, {verdict}",
        "GRAD-005", {"median_ratio": median, "lr": lrs, "ratios": dict(top)},
    )]


@check("update_effect", emits=("OPT-008",), needs=("update",))
def check_update_effect(ctx: AuditContext) -> Iterable[Finding]:
    """OPT-008: an optimizer step moves tensors that got no gradient, or rows whose gradient the step zeroed
    after backward: weight decay or momentum moving what the user froze, zeroed or cut from the graph. Judged on the audit's trial step
    and, when ``step_fn`` steps the optimizer itself, on that step."""
    if ctx.trace is None:
        return []
    moved = {n: s.moved_without_grad for n, s in ctx.trace.update.items() if s.moved_without_grad is not None}
    moved.update(ctx.trace.user_update)
    if not moved:
        return []
    whole = [n for n, m in moved.items() if m.whole]
    rows = {n: m.rows for n, m in moved.items() if not m.whole}
    parts = []
    if whole:
        parts.append(f"{len(whole)} tensor(s) with no gradient (None): {fmt_names(whole)}")
    if rows:
        parts.append(" and ".join(f"{count} row(s) of {name} whose gradient the step zeroed after backward"
                                  for name, count in list(rows.items())[:3]))
    return [Finding(
        "update_effect", Severity.WARN,
        f"one optimizer step moves {'; and '.join(parts)}: weight decay or momentum changes what the gradient left "
        "alone, so tensors meant to stay fixed (frozen by no_grad, by zeroing their gradient, by a mask) drift "
        "every step; set requires_grad=False and leave them out of the optimizer, or restore them after the step",
        "OPT-008", {"params": whole[:50], "rows": rows},
    )]


@check("symmetric_units", emits=("INIT-001",))
def check_symmetric_units(ctx: AuditContext) -> Iterable[Finding]:
    """INIT-001: a weight whose rows (output units) are all equal and get equal gradients. Gradient descent keeps
    equal rows equal, so the layer acts as one unit however wide it is (a constant or zero initialisation of two
    consecutive layers, ``nn.init.constant_``); a zero-initialised output layer is fine: its rows' gradients
    differ."""
    if not _grads_ready(ctx):
        return []
    assert ctx.trace is not None
    stuck = []
    for name, p in ctx.params.items():
        grad = ctx.trace.grads.get(name)
        if (not p.requires_grad or grad is None or p.dim() < 2 or p.shape[0] < 2 or p.numel() < 8
                or is_lora_factor(name)):
            continue
        w, g = p.detach().reshape(p.shape[0], -1), grad.reshape(p.shape[0], -1)
        if not torch.equal(w[0], w[1]) or not bool(g.any()):  # one row settles a random init; zero is GRAD-004's
            continue
        if torch.equal(w, w[:1].expand_as(w)) and torch.equal(g, g[:1].expand_as(g)):
            stuck.append(name)
    if not stuck:
        return []
    return [Finding(
        "symmetric_units", Severity.WARN,
        f"every output unit (row) of {fmt_names(stuck)} starts identical and receives an identical gradient: "
        "training keeps them identical, so the layer behaves as a single unit; initialise with random values "
        "(the module's default reset_parameters, or nn.init.kaiming_uniform_/normal_)",
        "INIT-001", {"params": stuck},
    )]
