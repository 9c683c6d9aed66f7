"""The loop watch: invariants of the real training loop, judged across steps from inside the guard.

The pre-flight sees one step; bugs such as an optimizer rebuilt every epoch, an ``adjust_learning_rate``
that writes one lr into every group, a per-step schedule stepped per epoch, or ``model.train()`` waking a
frozen BatchNorm only exist across steps. ``LoopWatch`` sits in ``GuardedOptimizer.step`` for the first
``Watch.steps`` steps and judges:

- host facts every step (optimizer state and step counts seen through a global optimizer step hook, group
  lrs against the scheduler and each other, scheduler cadence, module ``training`` flags, backward calls
  and gradient clearing seen through two hooks on one parameter): no tensor op at all;
- device values on a schedule dense at the start (watch steps 1, 2, 4, 8, ... and every ``Watch.every``):
  one norm per frozen tensor and per running statistic of a frozen eval-mode module, copied to the host
  asynchronously (``guardtower._readback``) and compared with the first sample when the copy has landed.

Each broken invariant is published once as a ``finding`` event (check ``"watch"``) at WARN, with the step,
what was expected and what was observed.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
from torch import Tensor, nn

from guardtower._readback import Fence, host_copy
from guardtower._schedulers import schedulers_of
from guardtower.errors import ConfigError, LoopInvariantError
from guardtower.events import FindingEvent
from guardtower.severity import Severity

__all__ = ["Watch", "LoopWatch", "Intent", "WATCH_IDS", "read_intent", "resolve_watch"]

#: the catalog ids the watch emits
WATCH_IDS = ("OPT-009", "OPT-010", "OPT-011", "OPT-012", "OPT-013", "LOOP-003", "LOOP-006", "LOOP-007",
             "LOOP-008", "MODE-005", "MODE-006", "DRIFT-001", "DRIFT-002", "TIE-003")

_ZERO_LR_STEPS = 20  # consecutive steps at lr 0 (outside a warmup) before OPT-013
_REL = 1e-6


@dataclass(frozen=True)
class Watch:
    """Options of the loop watch (``GuardedOptimizer(watch=Watch(...))``; ``watch=True`` is ``Watch()``).

    ``steps``: how many guarded steps are watched (the first part of the run, where loop bugs show).
    ``every``: after the dense start (steps 1, 2, 4, 8, ...), device values are sampled every ``every`` steps.
    ``ignore``: catalog ids never published (e.g. ``("LOOP-006",)``). ``strict``: raise ``LoopInvariantError``
    after publishing a finding. ``total_steps``/``accumulation``: the planned run length and the declared
    gradient accumulation, for loops whose trainer does not say them (the callbacks pass the trainer's).
    """

    steps: int = 2000
    every: int = 100
    ignore: tuple[str, ...] = ()
    strict: bool = False
    total_steps: int | None = None
    accumulation: int | None = None

    def __post_init__(self) -> None:
        for name in ("steps", "every"):
            _positive("watch." + name, getattr(self, name))
        for name in ("total_steps", "accumulation"):
            if getattr(self, name) is not None:
                _positive("watch." + name, getattr(self, name))
        if not isinstance(self.strict, bool):
            raise ConfigError("watch.strict", f"expected True or False, got {self.strict!r}", "pass a bool")
        ignore = (self.ignore,) if isinstance(self.ignore, str) else self.ignore
        if not isinstance(ignore, (tuple, list, set, frozenset)) or not all(isinstance(i, str) for i in ignore):
            raise ConfigError("watch.ignore", f"expected catalog ids, got {self.ignore!r}",
                              'pass e.g. ignore=("LOOP-006",)')
        unknown = sorted(set(ignore) - set(WATCH_IDS))
        if unknown:
            raise ConfigError("watch.ignore", f"{unknown} are not ids the watch emits",
                              f"pass some of {list(WATCH_IDS)}")
        object.__setattr__(self, "ignore", tuple(ignore))


def _positive(argument: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(argument, f"must be a positive int, got {value!r}", f"pass e.g. {argument.split('.')[-1]}=2000")


def resolve_watch(value: Any) -> Watch | None:
    """``True`` -> ``Watch()``, ``False``/``None`` -> off, a ``Watch`` as it is; anything else is a ConfigError."""
    if value is True:
        return Watch()
    if value is False or value is None:
        return None
    if isinstance(value, Watch):
        return value
    raise ConfigError("watch", f"expected True, False or a Watch(...), got {value!r}",
                      "pass watch=False to turn it off, or watch=Watch(steps=2000)")


# ---------------------------------------------------------------------------------- optimizer continuity
@dataclass
class _Seen:
    """What the last optimizer to step a parameter left behind."""

    param: weakref.ref[Tensor]
    optimizer: weakref.ref[torch.optim.Optimizer]
    had_state: bool
    step: Any  # the state's step counter object (a tensor is kept, not read, unless it gets replaced)


_WATCHERS: dict[int, weakref.ref[LoopWatch]] = {}  # id(first param of a group) -> the watch that owns it
_SEEN: dict[int, _Seen] = {}
_HOOKS: list[Any] = []


def _is_wrapper(opt: Any) -> bool:
    """A GuardedOptimizer or Accelerate's wrapper: the optimizer it holds fires the hook itself."""
    return hasattr(opt, "base_optimizer") or isinstance(getattr(opt, "optimizer", None), torch.optim.Optimizer)


def _step_of(state: Any) -> Any:
    return state.get("step") if isinstance(state, dict) else None


def _went_back(old: Any, new: Any) -> tuple[float, float] | None:
    """(old, new) step counts when ``new`` is lower. A tensor counter only grows in place, so its value is
    read only when the optimizer holds a different tensor now (a state dict was loaded), and only on the host."""
    if isinstance(old, Tensor) or isinstance(new, Tensor):
        if old is new or not (isinstance(old, Tensor) and isinstance(new, Tensor)):
            return None
        if old.device.type != "cpu" or new.device.type != "cpu" or old.numel() != 1 or new.numel() != 1:
            return None
        a, b = float(old), float(new)
    elif isinstance(old, (int, float)) and isinstance(new, (int, float)):
        a, b = float(old), float(new)
    else:
        return None
    return (a, b) if b < a else None


def _firsts(opt: torch.optim.Optimizer) -> list[Tensor]:
    return [g["params"][0] for g in opt.param_groups if g["params"]]


def _pre_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if _is_wrapper(opt):
        return
    for p in _firsts(opt):
        owner = _WATCHERS.get(id(p))
        watch = owner() if owner is not None else None
        seen = _SEEN.get(id(p))
        if watch is None or seen is None or seen.param() is not p or not seen.had_state:
            continue
        state = opt.state.get(p)
        previous = seen.optimizer()
        if previous is not opt:
            if not state:
                watch.found("OPT-009", "a new optimizer took over parameters another one had stepped, with empty state",
                            expected="the optimizer that stepped them, with its moments and step counts",
                            observed=f"a new {type(opt).__name__} with no state for them")
        elif not state:
            watch.found("OPT-010", "the optimizer's state was emptied during training",
                        expected="per-parameter state kept between steps", observed="empty state")
        else:
            back = _went_back(seen.step, _step_of(state))
            if back is not None:
                watch.found("OPT-010", "the optimizer's step count went backwards",
                            expected=f"step count >= {back[0]:g}", observed=f"step count {back[1]:g}")


def _post_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if _is_wrapper(opt):
        return
    for p in _firsts(opt):
        if id(p) in _WATCHERS:
            state = opt.state.get(p)
            _SEEN[id(p)] = _Seen(weakref.ref(p), weakref.ref(opt), bool(state), _step_of(state))


def _install_hooks() -> None:
    if not _HOOKS:
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        _HOOKS.extend([register_optimizer_step_pre_hook(_pre_step), register_optimizer_step_post_hook(_post_step)])


def _release_hooks() -> None:
    for key in [k for k, ref in _WATCHERS.items() if ref() is None]:
        del _WATCHERS[key]
    for key in [k for k, seen in _SEEN.items() if seen.param() is None]:
        del _SEEN[key]
    if not _WATCHERS:  # what was seen stays: the next guard's first step compares against it (OPT-009)
        for handle in _HOOKS:
            handle.remove()
        _HOOKS.clear()


# ---------------------------------------------------------------------------------- the watch
def _lr(group: dict[str, Any]) -> float | None:
    lr = group.get("lr")
    if isinstance(lr, Tensor):
        return float(lr) if lr.device.type == "cpu" and lr.numel() == 1 else None
    return float(lr) if isinstance(lr, (int, float)) else None


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= _REL * max(abs(a), abs(b), 1e-30)


def _horizon(scheduler: Any) -> int | None:
    """How many scheduler steps the schedule lasts, when it says (OneCycle, cosine, linear, polynomial)."""
    for attr in ("total_steps", "T_max", "total_iters"):
        value = getattr(scheduler, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


@dataclass
class _Schedule:
    scheduler: Any
    start_epoch: int
    start_step: int
    increments: int = 0
    last_epoch: int = 0

    def __post_init__(self) -> None:
        self.last_epoch = self.start_epoch


@dataclass
class _Sample:
    step: int
    values: Tensor
    order: list[int]
    fence: Fence | None
    generation: int


@dataclass
class _Grads:
    """Backward calls seen on one parameter and whether its gradient was cleared in between."""

    param: Tensor
    last: tuple[int, int] | None = None  # (id, _version) of its .grad after the last backward or step
    window: int = 0  # backward calls whose gradients the next step applies
    carried: bool | None = None  # the first backward after the last step found its gradient uncleared
    handles: list[Any] = field(default_factory=list)

    def cleared(self) -> bool:
        grad = self.param.grad
        return grad is None or self.last is None or (id(grad), grad._version) != self.last

    def mark(self) -> None:
        grad = self.param.grad
        self.last = None if grad is None else (id(grad), grad._version)


class LoopWatch:
    """The watch of one guard; built at the guard's first step, active for ``options.steps`` steps."""

    def __init__(self, options: Watch, optimizer: torch.optim.Optimizer, model: nn.Module | None,
                 publish: Callable[[FindingEvent], None], run_kw: dict[str, Any], *,
                 schedulers: Iterable[Any] = (), accumulation: int | None = None,
                 total_steps: int | None = None, holder: Any = None, intent: Intent | None = None) -> None:
        self.options = options
        self.findings: list[FindingEvent] = []
        self.active = True
        self._opt = optimizer
        self._model = model
        self._publish = publish
        self._run_kw = run_kw
        self._raised: set[str] = set()
        self._seen_steps = 0
        self._step = 0
        self.accumulation = accumulation if accumulation is not None else options.accumulation
        self.total_steps = total_steps if total_steps is not None else options.total_steps
        found = list(schedulers) or _discover(optimizer, holder)
        self._schedules = [_Schedule(s, int(getattr(s, "last_epoch", 0)), 0) for s in _top_level(found, optimizer)]
        # learning rates
        self._distinct = intent is not None and _distinct(intent.lrs)
        self._max_lr = [0.0] * len(optimizer.param_groups)
        self._zero_run = [0] * len(optimizer.param_groups)
        # modes, ties, frozen tensors
        self._root_training = model.training if model is not None else False
        self._eval_frozen: list[tuple[str, nn.Module]] = []
        self._stat_names: list[str] = []
        self._stats: list[Tensor] = []
        self._ties: list[list[tuple[str, nn.Module, str]]] = []
        if model is not None:
            self._intent(model, intent)
        self._frozen_key: tuple[int, ...] = ()
        self._frozen: list[tuple[str, Tensor]] = []
        self._generation = 0
        self._baseline: list[float] | None = None
        self._samples: list[_Sample] = []
        # gradients of one parameter
        self._grads = self._hook_grads(optimizer)
        self._carried_steps = 0
        self._accum_mismatch = 0
        self._accum_match = 0
        # continuity
        self._firsts = _firsts(optimizer)
        ref = weakref.ref(self)
        for p in self._firsts:
            _WATCHERS[id(p)] = ref
        _install_hooks()

    # ------------------------------------------------------------------ setup
    def _intent(self, model: nn.Module, intent: Intent | None) -> None:
        """What the run means: frozen eval-mode modules (and their statistics) as the guard's construction saw
        them (or, if the model was in eval mode then, as the first step sees them), tied parameters."""
        frozen = intent.eval_frozen if intent is not None and intent.eval_frozen is not None else \
            eval_frozen_modules(model)
        self._eval_frozen = frozen or []
        for name, module in self._eval_frozen:
            for sub_name, buf in module.named_buffers():
                if buf.is_floating_point() and buf.device.type != "meta":
                    self._stat_names.append(f"{name}.{sub_name}" if name else sub_name)
                    self._stats.append(buf)
        slots = intent.ties if intent is not None else tied_slots(model)
        self._ties = slots

    def _hook_grads(self, optimizer: torch.optim.Optimizer) -> _Grads | None:
        param = next((p for g in optimizer.param_groups for p in g["params"] if p.requires_grad), None)
        if param is None:
            return None
        grads = _Grads(param)

        def before(grad: Tensor) -> None:
            if not self.active:
                return
            cleared = grads.cleared()
            if grads.carried is None:
                grads.carried = not cleared
            grads.window = 1 if cleared else grads.window + 1

        def after(p: Tensor) -> None:
            grads.mark()

        grads.handles = [param.register_hook(before), param.register_post_accumulate_grad_hook(after)]
        grads.mark()
        grads.carried = None
        return grads

    def declare(self, *, schedulers: Iterable[Any] = (), accumulation: int | None = None,
                total_steps: int | None = None) -> None:
        """What the trainer says about the loop (the callbacks call this)."""
        found = _top_level(list(schedulers), self._opt)
        if found:
            self._schedules = [_Schedule(s, int(getattr(s, "last_epoch", 0)), self._seen_steps) for s in found]
        if accumulation is not None:
            self.accumulation = accumulation
        if total_steps is not None and total_steps > 0 and math.isfinite(total_steps):
            self.total_steps = int(total_steps)

    # ------------------------------------------------------------------ findings
    def found(self, catalog_id: str, message: str, *, expected: str, observed: str, **details: Any) -> None:
        """Publish one finding per catalog id (then, with ``strict``, raise)."""
        if catalog_id in self._raised or catalog_id in self.options.ignore:
            return
        self._raised.add(catalog_id)
        event = FindingEvent(**self._run_kw, step=self._step, severity=Severity.WARN, check="watch",
                             catalog_id=catalog_id, message=f"{message} (step {self._step})",
                             details={"expected": expected, "observed": observed, "step": self._step,
                                      **{k: _plain(v) for k, v in details.items()}})
        self.findings.append(event)
        self._publish(event)
        if self.options.strict:
            raise LoopInvariantError(event)

    # ------------------------------------------------------------------ the step
    def before_step(self, step: int) -> None:
        """Host facts of the step about to be applied: lrs, schedulers, modes, accumulation."""
        if not self.active:
            return
        self._step = step
        self._seen_steps += 1
        self._judge_lrs()
        self._judge_schedules()
        self._judge_modes()
        self._judge_grads()

    def after_step(self, step: int) -> None:
        """After the update: mark the gradient, sample device values when due, read landed samples."""
        if not self.active:
            return
        if self._grads is not None:
            self._grads.mark()
            self._grads.carried = None
            self._grads.window = 0
        n = self._seen_steps
        if n & (n - 1) == 0 or n % self.options.every == 0:
            self._judge_ties()
            self._sample(step)
        self._read(block=False)
        if n >= self.options.steps:
            self.close()

    def _judge_lrs(self) -> None:
        groups = self._opt.param_groups
        lrs = [_lr(g) for g in groups]
        if len(self._max_lr) != len(groups):  # a group was added: start over
            self._max_lr, self._zero_run, self._distinct = [0.0] * len(groups), [0] * len(groups), False
        expected: list[float] | None = None
        for s in self._schedules:
            last = getattr(s.scheduler, "_last_lr", None)
            if isinstance(last, list) and len(last) == len(groups):
                expected = [float(v) for v in last] if expected is None else expected
                if all(lr is None or _close(lr, float(v)) for lr, v in zip(lrs, last)):
                    expected = [float(v) for v in last]
                    break
        known = [lr for lr in lrs if lr is not None]
        distinct_now = _distinct(lrs)
        collapsed = len(known) > 1 and min(known) > 0 and all(_close(known[0], v) for v in known)
        if expected is not None:
            want_distinct = len(expected) > 1 and not all(_close(expected[0], v) for v in expected)
            if collapsed and want_distinct:
                self.found("OPT-011", "the param groups' learning rates collapsed to one value",
                           expected=f"lrs {expected} (the scheduler's)", observed=f"lrs {lrs}")
            elif any(lr is not None and not _close(lr, v) for lr, v in zip(lrs, expected)):
                self.found("OPT-012", "a learning rate was written outside the scheduler",
                           expected=f"lrs {expected} (the scheduler's last)", observed=f"lrs {lrs}")
        else:
            if collapsed and self._distinct:
                self.found("OPT-011", "the param groups' learning rates collapsed to one value",
                           expected="groups keep their different lrs", observed=f"lrs {lrs}")
        self._distinct = self._distinct or distinct_now
        for i, (group, lr) in enumerate(zip(groups, lrs)):
            if lr is None:
                continue
            self._max_lr[i] = max(self._max_lr[i], lr)
            zero = lr == 0.0 or lr < _REL * self._max_lr[i]
            trains = any(p.requires_grad for p in group["params"][:1])
            self._zero_run[i] = self._zero_run[i] + 1 if zero and trains else 0
            if self._zero_run[i] >= _ZERO_LR_STEPS:
                self.found("OPT-013", f"param group {i}'s learning rate has been 0 for {self._zero_run[i]} steps",
                           expected="a learning rate above 0 outside a warmup",
                           observed=f"lr {lr:g} (max so far {self._max_lr[i]:g})", group=i)

    def _judge_schedules(self) -> None:
        steps = self._seen_steps
        for s in self._schedules:
            epoch = int(getattr(s.scheduler, "last_epoch", 0))
            delta = epoch - s.last_epoch
            if delta > 0:  # SequentialLR resets a child to 0: only forward moves count
                s.increments += delta
            s.last_epoch = epoch
            opt_steps = steps - s.start_step
            if opt_steps < 8 or s.increments < 1:
                continue
            cadence = s.increments / opt_steps
            name = type(s.scheduler).__name__
            if cadence >= 1.1 and s.increments - opt_steps >= 2:
                self.found("LOOP-007", f"{name} is stepped more than once per optimizer step",
                           expected="1 scheduler step per optimizer step",
                           observed=f"{s.increments} scheduler steps in {opt_steps} optimizer steps")
            horizon = _horizon(s.scheduler)
            if horizon is None or cadence >= 0.75:
                continue
            if self.total_steps is not None:
                at_end = epoch + cadence * max(self.total_steps - self._step, 0)
                if at_end < 0.5 * horizon:
                    self.found("LOOP-006", f"{name} is stepped too rarely to get through its schedule",
                               expected=f"{horizon} scheduler steps by the planned end (step {self.total_steps})",
                               observed=f"{cadence:.3g} scheduler steps per optimizer step: about {at_end:.0f} "
                                        f"at the end")
            elif name == "OneCycleLR" and horizon * cadence >= 1:
                self.found("LOOP-006", "OneCycleLR (a per-step schedule) is stepped once per epoch",
                           expected=f"1 scheduler step per optimizer step ({horizon} in all)",
                           observed=f"{cadence:.3g} scheduler steps per optimizer step")

    def _judge_modes(self) -> None:
        model = self._model
        if model is None:
            return
        if self._root_training and not model.training:
            self.found("MODE-006", "the model is in eval mode during training steps",
                       expected="model.training is True, as at the start of the run",
                       observed="model.training is False (model.train() not called again after evaluation?)")
        for name, module in self._eval_frozen:
            if module.training and all(not p.requires_grad for p in module.parameters()):
                self.found("MODE-005", f"the frozen eval-mode module {name} is back in training mode",
                           expected=f"{name} stays in eval mode (frozen, eval at the start)",
                           observed=f"{name}.training is True", module=name)
                break

    def _judge_grads(self) -> None:
        grads = self._grads
        if grads is None or grads.window == 0:
            return
        if grads.carried:
            self._carried_steps += 1
            if self._carried_steps >= 2:
                self.found("LOOP-003", "gradients are never cleared between optimizer steps",
                           expected="zero_grad() between optimizer steps",
                           observed=f"gradients carried over into {self._carried_steps} steps")
        if self.accumulation is not None:
            if grads.window == self.accumulation:
                self._accum_match += 1
            else:
                self._accum_mismatch += 1
            if self._accum_mismatch >= 3 and self._accum_mismatch > self._accum_match:
                self.found("LOOP-008", "backward calls per optimizer step differ from the declared accumulation",
                           expected=f"{self.accumulation} backward calls accumulated per step",
                           observed=f"{grads.window} at this step ({self._accum_mismatch} steps off)")

    def _judge_ties(self) -> None:
        for slots in self._ties:
            current = [getattr(module, attr, None) for _, module, attr in slots]
            first = current[0]
            if any(c is not first and not (isinstance(c, Tensor) and isinstance(first, Tensor)
                                            and c.data_ptr() == first.data_ptr()) for c in current):
                names = [f"{n}.{a}" if n else a for n, _, a in slots]
                self.found("TIE-003", f"tied parameters {names} no longer share storage",
                           expected="one tensor shared by " + ", ".join(names),
                           observed="separate tensors", params=names)
                return

    # ------------------------------------------------------------------ device samples
    def _watched(self) -> tuple[list[str], list[Tensor]]:
        """Frozen parameters (now) and the statistics of frozen eval-mode modules."""
        model = self._model
        if model is None:
            return [], []
        key = tuple(id(p) for p in model.parameters() if not p.requires_grad)
        if key != self._frozen_key:
            self._frozen_key = key
            self._frozen = [(n, p) for n, p in model.named_parameters() if not p.requires_grad
                            and p.is_floating_point() and p.device.type != "meta"]
            self._generation += 1
            self._baseline = None
        return ([n for n, _ in self._frozen] + self._stat_names, [p for _, p in self._frozen] + self._stats)

    @torch.no_grad()
    def _sample(self, step: int) -> None:
        names, tensors = self._watched()
        if not tensors:
            return
        values, order = _norms(tensors)
        self._samples.append(_Sample(step, host_copy(values), order, Fence(values.device), self._generation))

    def _read(self, block: bool) -> None:
        while self._samples:
            sample = self._samples[0]
            if sample.fence is not None and not sample.fence.done():
                if not block:
                    return
                sample.fence.wait()
            self._samples.pop(0)
            self._judge_sample(sample)

    def _judge_sample(self, sample: _Sample) -> None:
        if sample.generation != self._generation:
            return
        values = [0.0] * len(sample.order)
        for value, i in zip(sample.values.tolist(), sample.order):
            values[i] = value
        names = [n for n, _ in self._frozen] + self._stat_names
        if self._baseline is None or len(self._baseline) != len(values):
            self._baseline = values
            return
        n_frozen = len(self._frozen)
        for i, (old, new) in enumerate(zip(self._baseline, values)):
            if old == new or (math.isnan(old) and math.isnan(new)):
                continue
            if i < n_frozen:
                if not self._frozen[i][1].requires_grad:
                    self.found("DRIFT-001", f"the frozen tensor {names[i]} changed",
                               expected=f"{names[i]} (requires_grad=False) unchanged (norm {old:.6g})",
                               observed=f"norm {new:.6g} at step {sample.step}", tensor=names[i])
            else:
                self.found("DRIFT-002", f"running statistics {names[i]} of a frozen eval-mode module changed",
                           expected=f"unchanged (norm {old:.6g})", observed=f"norm {new:.6g} at step {sample.step}",
                           tensor=names[i])

    # ------------------------------------------------------------------ lifecycle
    def rebaseline(self) -> None:
        """The guard rolled back or loaded a state dict: what was seen before is no reference any more."""
        for p in self._firsts:
            _SEEN.pop(id(p), None)
        for s in self._schedules:
            s.last_epoch = int(getattr(s.scheduler, "last_epoch", 0))

    def close(self) -> None:
        """Stop watching: read what is pending, remove the hooks. Idempotent."""
        if not self.active:
            return
        try:
            self._read(block=True)
        finally:
            self.active = False
            if self._grads is not None:
                for handle in self._grads.handles:
                    handle.remove()
                self._grads = None
            for p in self._firsts:
                ref = _WATCHERS.get(id(p))
                if ref is not None and ref() is self:
                    del _WATCHERS[id(p)]
            _release_hooks()


@dataclass
class Intent:
    """What the loop means, read when the guard is constructed (before the loop can change it)."""

    lrs: list[float | None]
    eval_frozen: list[tuple[str, nn.Module]] | None  # None: the model was in eval mode, ask at the first step
    ties: list[list[tuple[str, nn.Module, str]]]


def read_intent(optimizer: torch.optim.Optimizer, model: nn.Module | None) -> Intent:
    """Flags and lrs only: reading them changes nothing."""
    return Intent([_lr(g) for g in optimizer.param_groups],
                  eval_frozen_modules(model) if model is not None and model.training else None,
                  tied_slots(model) if model is not None else [])


def eval_frozen_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost modules in eval mode with every parameter frozen, inside a model in training mode."""
    if not model.training:
        return []
    found: list[tuple[str, nn.Module]] = []
    covered: set[int] = set()
    for name, module in model.named_modules():
        if module.training or id(module) in covered:
            continue
        if all(not p.requires_grad for p in module.parameters()):
            found.append((name or type(module).__name__, module))
            covered.update(id(m) for m in module.modules())
    return found


def tied_slots(model: nn.Module) -> list[list[tuple[str, nn.Module, str]]]:
    """Each parameter held by more than one (module, attribute) slot: its slots."""
    names = {id(m): n for n, m in model.named_modules()}
    by_id: dict[int, list[tuple[str, nn.Module, str]]] = {}
    for module in model.modules():
        for attr, p in module._parameters.items():
            if p is not None:
                by_id.setdefault(id(p), []).append((names.get(id(module), "?"), module, attr))
    return [slots for slots in by_id.values() if len(slots) > 1]


def _distinct(lrs: list[float | None]) -> bool:
    known = [lr for lr in lrs if lr is not None]
    return len(known) > 1 and min(known) > 0 and not all(_close(known[0], v) for v in known)


def _norms(tensors: list[Tensor]) -> tuple[Tensor, list[int]]:
    """One float32 norm per tensor (one foreach pass per (device, dtype) group, then one cat) and which
    tensor each value belongs to."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    device = tensors[0].device
    parts: list[Tensor] = []
    order: list[int] = []
    for idx in groups.values():
        norms = torch._foreach_norm([tensors[i] for i in idx])  # under no_grad: no detach op per tensor
        part = torch.stack(norms).to(device=device, dtype=torch.float32, non_blocking=True)
        parts.append(part)
        order += idx
    return (parts[0] if len(parts) == 1 else torch.cat(parts)), order


def _discover(optimizer: torch.optim.Optimizer, holder: Any) -> list[Any]:
    """The LR schedulers built on this optimizer (or on the guard around it): one referrer scan, at start
    (it walks the heap, ~0.1-0.5 s in a large process, so only when a scheduler has marked the groups)."""
    if not any("initial_lr" in g for g in optimizer.param_groups):  # every LRScheduler sets it: none was built
        return []
    found: list[Any] = []
    for target in [optimizer] + ([holder] if holder is not None else []):
        found += [s for s in schedulers_of(target) if all(s is not f for f in found)]
    return found


def _top_level(schedulers: list[Any], optimizer: torch.optim.Optimizer) -> list[Any]:
    """Unwrap Accelerate's scheduler, keep those stepping this optimizer's groups, drop SequentialLR children."""
    out = []
    for s in schedulers:
        s = getattr(s, "scheduler", s)
        opt = getattr(s, "optimizer", None)
        if opt is None or getattr(opt, "param_groups", None) is not optimizer.param_groups:
            continue
        if s not in out:
            out.append(s)
    children = {id(c) for s in out for c in getattr(s, "_schedulers", ())}
    return [s for s in out if id(s) not in children]


def _plain(value: Any) -> Any:
    return value if isinstance(value, (str, int, float, bool, type(None))) else [str(v) for v in value] \
        if isinstance(value, (list, tuple)) else str(value)
