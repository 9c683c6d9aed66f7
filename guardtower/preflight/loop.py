"""``loop_order``: when ``step_fn`` is a whole training step (it runs backward and ``optimizer.step()``
itself), are ``zero_grad``, ``backward`` and ``step`` in an order that trains?"""

from __future__ import annotations

from typing import Iterable, Sequence

from guardtower.preflight._registry import AuditContext, check
from guardtower.preflight._trace import StepTrace
from guardtower.preflight._util import fmt_names
from guardtower.report import Finding
from guardtower.severity import Severity

__all__: list[str] = []


@check("loop_order", emits=("LOOP-001", "LOOP-002", "LOOP-003", "LOOP-009", "LOOP-010", "LOOP-012", "LOOP-013",
                            "AMP-004"))
def check_loop_order(ctx: AuditContext) -> Iterable[Finding]:
    """LOOP-001 gradients cleared between backward and step, LOOP-002 step before backward, LOOP-003 gradients
    never cleared, LOOP-009 two optimizer steps on one backward's gradients, LOOP-010 gradients computed and
    thrown away without a step, LOOP-012 a micro-batch's gradients cleared before the step, LOOP-013 gradient
    clipping that no step uses, AMP-004 gradients clipped while still scaled by a GradScaler."""
    trace = ctx.trace
    if trace is None:
        return []
    if "step" not in trace.loop_events:
        return _never_stepped(ctx)
    dropped = _cleared_before_use(trace.loop_events, trace.backward_versions, trace.backward_leaves, trace.cleared_at)
    if dropped:
        return [Finding(
            "loop_order", Severity.WARN,
            f"the gradients of {dropped} backward pass(es) are cleared before any optimizer step used them "
            f"({' -> '.join(trace.loop_events)}): zero_grad() inside the accumulation loop keeps only the last "
            "micro-batch's gradient, so each update sees one micro-batch (scaled by 1/K); call zero_grad() once "
            "per optimizer step, right after it",
            "LOOP-012", {"order": trace.loop_events, "dropped_backwards": dropped},
        )]
    doubled = _steps_without_backward(trace.loop_events)
    if doubled:
        return [Finding(
            "loop_order", Severity.WARN,
            f"optimizer.step() runs {doubled + 1} times on the gradients of one backward() "
            f"({' -> '.join(trace.loop_events)}): every batch is applied {doubled + 1} times (the moments and step "
            "count advance twice), e.g. a leftover optimizer.step() after scaler.step(optimizer); step once per "
            "backward window",
            "LOOP-009", {"order": trace.loop_events},
        )]
    others = [{id(p) for g in o.param_groups for p in g["params"]} for o in trace.stepped_optimizers]
    reach = _clip_reach(trace.loop_events, trace.clip_params, trace.step_params, others, trace.backward_leaves,
                        trace.cleared_at)
    if reach == "elsewhere":
        return [Finding(
            "loop_order", Severity.WARN,
            f"the step clips gradients between backward() and optimizer.step(), but none of the tensors it clips "
            f"is one that step updates ({' -> '.join(trace.loop_events)}): the clip edits another module's "
            "gradients (those another optimizer steps), so every update of the stepped "
            "tensors is unclipped; pass the parameters the optimizer steps to clip_grad_norm_",
            "LOOP-013", {"order": trace.loop_events, "clipped_tensors": sorted(map(len, trace.clip_params))},
        )]
    if reach == "never":
        return [Finding(
            "loop_order", Severity.WARN,
            f"the step clips gradients, but no optimizer.step() follows a clip of its own gradients "
            f"({' -> '.join(trace.loop_events)}): clipping after step() (or before backward()) changes gradients "
            "that are cleared before use, so every update is unclipped and a spike goes straight into the "
            "weights; clip after the last backward() and before step()",
            "LOOP-013", {"order": trace.loop_events},
        )]
    clipped = _clipped_while_scaled(trace.loop_events) if trace.scaled_backward else False
    if clipped:
        return [Finding(
            "loop_order", Severity.WARN,
            f"the step clips gradients while they are still multiplied by the GradScaler's scale "
            f"({' -> '.join(trace.loop_events)}): the clip threshold applies to the scaled norm, so every update "
            "is ~1/scale of the intended one; call scaler.unscale_(optimizer) before clip_grad_norm_",
            "AMP-004", {"order": trace.loop_events},
        )]
    events = trace.loop_events
    first_step = events.index("step")
    before, after = events[:first_step], events[first_step + 1:]
    order = " -> ".join(events)
    details = {"order": events, "tensors_with_gradient_at_step": trace.step_grads}
    if trace.step_grads and trace.step_grads[0] == 0 and "backward" in before:
        return [Finding(
            "loop_order", Severity.ERROR,
            f"optimizer.step() ran when no trainable tensor had a gradient ({order}): zero_grad() between "
            "backward() and step() throws the gradients away, so the weights never change; call zero_grad() "
            "before backward()",
            "LOOP-001", details,
        )]
    if "backward" not in before and "backward" in after:
        return [Finding(
            "loop_order", Severity.ERROR,
            f"optimizer.step() runs before backward() ({order}): each update uses the previous batch's gradients "
            "(none at all on the first step); call backward() and then step()",
            "LOOP-002", details,
        )]
    if "zero_grad" not in events and "backward" in events:
        return [Finding(
            "loop_order", Severity.WARN,
            f"the step runs backward() and optimizer.step() but never zero_grad() ({order}): gradients add up "
            "across steps, so every update is the running sum of all past gradients; call "
            "optimizer.zero_grad() every step (gradient accumulation clears them right after its step)",
            "LOOP-003", details,
        )]
    return _optimizer_never_cleared(ctx, details)


def _optimizer_never_cleared(ctx: AuditContext, details: dict[str, object]) -> list[Finding]:
    """LOOP-003 for one optimizer of several: the step clears some gradients, but none of the tensors one stepped
    optimizer holds (a GAN that zeroes the generator and not the discriminator)."""
    trace = ctx.trace
    assert trace is not None
    if "backward" not in trace.loop_events:
        return []
    names = {id(p): n for n, p in ctx.params.items()}
    stale = [held for held in trace.step_params if held and not held & trace.cleared]
    if not stale:
        return _reapplied(trace, details)
    tensors = sorted(names[i] for i in stale[0] if i in names)
    return [Finding(
        "loop_order", Severity.WARN,
        f"the step clears gradients, but never those of an optimizer it steps ({len(stale[0])} tensors: "
        f"{fmt_names(tensors)}): that optimizer's gradients add up across steps (and collect what the other "
        "objectives' backward passes leave on its tensors), so each of its updates is the running sum of all past "
        "gradients; call its zero_grad() every step",
        "LOOP-003", {**details, "never_cleared": tensors[:50]},
    )]


def _reapplied(trace: StepTrace, details: dict[str, object]) -> list[Finding]:
    """LOOP-003 inside one step: an optimizer steps again on gradients its earlier step already applied (several
    discriminator steps per generator step with one zero_grad before the loop), or a step run inside a wrapper's
    step (SAM, LookSAM) applies a gradient the wrapper's second backward added onto instead of replacing."""
    if trace.restepped:
        step, tensors = trace.restepped[0]
        story = (f"optimizer step {step + 1} of the step applies gradients of {fmt_names(tensors)} that still hold "
                 "what an earlier step of the same tensors applied: nothing cleared them between the two steps, so "
                 "the later update applies the earlier batches' gradients again (the first batch once per step); "
                 "call zero_grad() at the top of each of these steps")
        key = "applied_again"
    elif trace.stacked:
        step, tensors = trace.stacked[0]
        story = (f"the optimizer step that runs inside another optimizer's step (step {step + 1}: a wrapper such as "
                 f"SAM calling its base optimizer) applies gradients of {fmt_names(tensors)} that still hold the "
                 "gradient that was there when the wrapper's step began: the wrapper's own backward added onto it "
                 "instead of replacing it, so the update is the sum of both (for SAM: g(w) + g(w + e) instead of "
                 "the perturbed gradient); clear the gradients before the wrapper's second backward")
        key = "stacked"
    else:
        return []
    return [Finding("loop_order", Severity.WARN, story, "LOOP-003",
                    {**details, "step": step, key: tensors[:50], "count": len(tensors)})]


def _clip_reach(events: list[str], clips: list[set[int]], steps: list[set[int]], optimizers: list[set[int]],
                leaves: Sequence[frozenset[int]] = (), cleared_at: Sequence[set[int]] = ()) -> str | None:
    """None when some ``step`` has a ``clip`` of some of its own tensors between it and the last ``backward``
    (or no clip ran); ``"elsewhere"`` when clips precede steps but only of tensors another of the stepped
    ``optimizers`` holds (tensors no optimizer holds may be the model's half-precision copies of an optimizer's
    fp32 master weights, whose gradients are copied over after the clip); ``"never"`` when no clip precedes any
    step."""
    if "clip" not in events:
        return None
    clipped: set[int] | None = None
    outcome = "never"
    clip_i = step_i = back_i = zero_i = 0
    for event in events:
        if event in ("backward", "zero_grad"):
            # a clip stands for the tensors this pass leaves alone (another part's backward, another optimizer's
            # zero_grad), not for those it writes or clears
            touched = (leaves[back_i] if event == "backward" and back_i < len(leaves) else
                       cleared_at[zero_i] if event == "zero_grad" and zero_i < len(cleared_at) else None)
            back_i, zero_i = back_i + (event == "backward"), zero_i + (event == "zero_grad")
            clipped = None if clipped is None or not touched else (clipped - touched) or None
        elif event == "clip":
            clipped = (clipped or set()) | (clips[clip_i] if clip_i < len(clips) else set())
            clip_i += 1
        elif event == "step":
            held = steps[step_i] if step_i < len(steps) else set()
            step_i += 1
            if clipped is not None:
                if not clipped or clipped & held or not held or not any(clipped <= other for other in optimizers):
                    return None
                outcome = "elsewhere"
    return outcome


def _clipped_while_scaled(events: list[str]) -> bool:
    """A ``clip`` after a (scaled) backward with no ``unscale`` in between."""
    scaled = False
    for event in events:
        if event == "backward":
            scaled = True
        elif event == "unscale":
            scaled = False
        elif event == "clip" and scaled:
            return True
    return False


def _steps_without_backward(events: list[str]) -> int:
    """How many optimizer steps follow another with no backward in between (the same gradients again)."""
    repeats, stepped = 0, False
    for event in events:
        if event == "backward":
            stepped = False
        elif event == "step":
            repeats += stepped
            stepped = True
    return repeats


def _never_stepped(ctx: AuditContext) -> list[Finding]:
    """LOOP-010: step_fn runs backward itself and advances the schedule or clears gradients, but the optimizer
    it was handed never steps: the gradients are computed and thrown away (a step_fn that only computes the
    loss, or a micro-step of an accumulation window, clears nothing and steps no schedule)."""
    trace = ctx.trace
    assert trace is not None
    events = trace.loop_events
    if ctx.optimizer is None or not trace.user_backward or "backward" not in events:
        return []
    if trace.scaled_backward or "unscale" in events:  # a GradScaler skips the step of an overflowing batch
        return []
    cleared_first = "zero_grad" in events[:events.index("backward")]
    if "scheduler" not in events and not cleared_first:
        return []
    evidence = "steps the lr scheduler" if "scheduler" in events else "clears the gradients first"
    return [Finding(
        "loop_order", Severity.WARN,
        f"the step runs backward() and {evidence} but never calls optimizer.step() ({' -> '.join(events)}): "
        "the gradients are thrown away and no weight moves (e.g. optimizer.step() in the else branch of "
        "'if scheduler:'); call optimizer.step() after every backward window",
        "LOOP-010", {"order": events},
    )]


def _cleared_before_use(events: list[str], versions: list[int], leaves: list[frozenset[int]],
                        cleared_at: list[set[int]]) -> int:
    """How many backward passes had their gradients cleared by a zero_grad before a later backward, with no
    optimizer step in between and no weight changed in place (SAM-style two-pass steps perturb the weights
    between their backwards: those are not counted). A zero_grad that clears none of the tensors that backward
    reached (another optimizer's, each part zeroed before its own backward) throws nothing of it away."""
    dropped = 0
    unused: int | None = None  # the last backward whose gradients no step has used yet
    cleared: int | None = None  # ... and that a zero_grad then threw away
    k = z = -1
    for event in events:
        if event == "backward":
            k += 1
            if cleared is not None and k < len(versions) and versions[k] == versions[cleared]:
                dropped += 1
            unused, cleared = k, None
        elif event == "zero_grad":
            z += 1
            reached = leaves[unused] if unused is not None and unused < len(leaves) else None
            if unused is not None and (reached is None or z >= len(cleared_at) or cleared_at[z] & reached
                                       or not reached):
                cleared, unused = unused, None
        elif event == "step":
            unused = cleared = None
    return dropped


@check("optimizer_phases", emits=("LOOP-014",))
def check_optimizer_phases(ctx: AuditContext) -> Iterable[Finding]:
    """LOOP-014: a step_fn with one optimizer per part (a GAN's generator and discriminator) clears each
    optimizer's gradients only after its own step, so one part's update applies what the other phase's backward
    (another objective) left on its tensors."""
    trace = ctx.trace
    if trace is None or not trace.cross_phase:
        return []
    step, tensors = trace.cross_phase[0]
    return [Finding(
        "optimizer_phases", Severity.WARN,
        f"optimizer step {step + 1} of the step applies gradients of {fmt_names(tensors)} that were accumulated "
        "both before and after another optimizer's step: the earlier phase's backward (another loss, e.g. the "
        "generator's through the discriminator) left gradients on these tensors and nothing cleared them, so this "
        "update also follows that objective; call this optimizer's zero_grad() right before its own backward",
        "LOOP-014", {"step": step, "tensors": tensors[:16], "count": len(tensors)},
    )]
