"""``GuardedOptimizer``: a drop-in ``torch.optim.Optimizer`` that judges every step's gradients first.

Each ``step()`` measures every gradient tensor's L2 norm in one multi-tensor pass, compares the norms with
baselines of past *accepted* steps (``guardtower.guard.detector``), and rejects the step on NaN/Inf or a
spike. Everything up to the decision stays on the device. With a fused optimizer (``fused=True``) the
decision reaches the optimizer as its ``found_inf`` tensor, so a guarded step costs zero host syncs; any other
optimizer costs one (the decision flag is read once). ``nan_action="raise"``/``"rollback"`` also read the flag
once per step, because the host has to act before the next step.

Events (spike, skip, rollback, halt, summary) are built from a per-step record that reaches the host through
an asynchronous copy, at most two steps later (immediately for a step the host already had to read), and
are only *published* on the training thread; sinks (console box, spike-report files, trackers) run on the
bus's worker threads.
"""

from __future__ import annotations

import atexit
import collections
import functools
import math
import os
import weakref
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import Tensor, nn

from guardtower._jsonl import check_creatable_dir
from guardtower._runs import DEFAULT_ROOT, run_folder, run_name
from guardtower._dist import current_rank, is_distributed, world_size
from guardtower import _validate
from guardtower._validate import flag
from guardtower.bus import EventBus, Sink, adopt_log_dir, check_bus_args
from guardtower.errors import ConfigError, GradientSpikeError
from guardtower.events import (Event, HaltEvent, LrBackoffEvent, RollbackEvent, SkipBudgetEvent, SkipEvent, SpikeEvent,
                               StartEvent, SummaryEvent)
from guardtower.guard._accelerate import AcceleratedBase
from guardtower.guard._buffers import BufferGuard
from guardtower.guard._checks import check_base_state as _check_base_state
from guardtower.guard._checks import check_guard_state as _check_guard_state
from guardtower.guard._checks import check_params as _check_params
from guardtower.guard._checks import check_process_group as _check_process_group
from guardtower.guard._checks import decision_device as _decision_device
from guardtower.guard._measure import GradMeter
from guardtower.guard._ranks import RankSlots, RankValue, named_ranks, read_ranks, report_ranks
from guardtower.guard._records import Header, RecordQueue, StepRecord
from guardtower.guard.actions import (CLIP_MODES, ActionPolicy, LowerLR, RepeatTracker, clip_factor, device_skip,
                                      resolve_on_repeat, scaled_lr, supports_device_skip)
from guardtower.guard.budget import BudgetCounter, SkipBudget, resolve_skip_budget
from guardtower.guard.detector import Detector, Explanation, make_detector
from guardtower.guard.quarantine import (BatchRef, Quarantine, batch_identity, batch_ref, check_entries, make_entry,
                                         without_content, write_entry)
from guardtower.guard.reports import SpikeReportSink, report_filename
from guardtower.guard.snapshots import SnapshotStore
from guardtower.guard.triage import Outcome, RngState, capture_rng, retriage
from guardtower.guard.watch import LoopWatch, Watch, read_intent, resolve_watch
from guardtower.heartbeat import Heartbeat, check_stall_after
from guardtower.severity import Severity

__all__ = ["GuardedOptimizer"]

_HISTORY = 32
_TOP = 10
_WRAPPER_PARTS = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})
_RAISE_FLUSH_S = 5.0
_REPORT_WAIT_S = 2.0


def _clean_name(name: str, wrapped: bool) -> str:
    """A parameter name without the parts DDP (``wrapped``), FSDP, checkpointing and torch.compile add."""
    parts = [part for part in name.split(".") if part not in _WRAPPER_PARTS]
    if wrapped and parts and parts[0] == "module":
        parts = parts[1:]
    return ".".join(parts)


def _positive_int(value: Any, argument: str, example: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(argument, f"must be a positive int, got {value!r}", f"pass e.g. {argument}={example}")
    return value


def _replay_closure(closure: Callable[[], Any], first: Any) -> Callable[[], Any]:
    """A closure whose first call returns the loss already computed; later calls (LBFGS) re-evaluate."""
    pending = [first]

    def replay() -> Any:
        if pending:
            return pending.pop()
        with torch.enable_grad():
            return closure()

    return replay


class GuardedOptimizer(torch.optim.Optimizer):
    """Wrap ``base_optimizer``; skip, clip, roll back or raise on gradient spikes and NaN/Inf before the update.

    It shares ``param_groups``, ``state`` and ``defaults`` with the base optimizer, so LR schedulers,
    ``GradScaler``, Accelerate and the HF Trainer accept it. Counters (properties): ``step_count`` (calls to
    ``step``), ``total_spikes`` (judged spikes and non-finite steps), ``total_skips``, ``total_rollbacks``;
    reading one first hands over every step record that is ready without waiting, so on the CPU they always
    reflect the last ``step()`` (on an accelerator at most two steps behind; ``flush()`` waits for all).

    Arguments beyond the contract: ``detector`` (``"auto"``, ``"ratio"``, ``"zscore"`` or a ``Detector``),
    ``norm_floor`` (a tensor whose share of the gradient norm is below this fraction cannot trigger),
    ``clip`` (``"global"``: one factor for all gradients, or ``"per_tensor"``, for ``nan_action="clip"``),
    ``max_consecutive_skips``/``escalate_to`` (a run that keeps failing stops or rolls back instead of
    skipping forever), ``rollback_every``/``keep`` (snapshot period and count), ``on_rollback(from_step,
    to_step)`` (e.g. to skip the offending data), ``process_group`` (for the decision all-reduce), ``run`` (the
    name events, alerts, tracker tags and the log folder share; default ``GUARDTOWER_RUN``, else the active
    MLflow/W&B run's name, else ``default``: ``guardtower._runs``), ``log_dir`` (default: the run's own folder
    ``./sg_logs/<run>-<time>/``, which also gets the guard's ``events.jsonl``; a given one is used as is),
    ``stall_after`` (seconds without a step before a ``stall`` event; ``guardtower.heartbeat``), ``on_halt(error)``
    (called on the training thread right before ``GradientSpikeError`` is raised), ``watch`` (``True``: the
    loop watch of ``guardtower.guard.watch`` for the first 2,000 steps; ``Watch(...)`` to tune it; ``False``),
    ``triage`` (``True``: recompute a rejected ``step(closure)`` once with the RNG restored and label it
    ``transient`` or ``deterministic``; ``guardtower.guard.triage``). Each rejected step's batch (see
    ``observe_batch``) goes to ``quarantine-rank{rank}.jsonl`` in ``log_dir`` (``guardtower.guard.quarantine``);
    ``skip_budget`` (``True``: one ``skip_budget`` WARN when more than 1% of the last 1,000 steps were rejected;
    ``SkipBudget(share, window)`` to tune it; ``False``), ``on_repeat`` (what a rollback to the same snapshot as
    the one before does: ``"rollback"`` again, ``"raise"``, or ``"lower_lr"``/``LowerLR(factor, floor)``: a
    bounded learning-rate back-off, then a halt; ``guardtower.guard.actions``).

    Constructing validates and creates nothing: the bus's sinks, the console box, the stall watchdog and the
    ``log_dir`` (created with the first spike report) come with the first ``step()``.
    """

    def __init__(
        self,
        base_optimizer: torch.optim.Optimizer,
        model: nn.Module | None = None,
        *,
        spike_threshold: float = 10.0,
        nan_action: str = "skip",
        log_every: int = 50,
        log_dir: str | os.PathLike[str] | None = None,
        ema_alpha: float = 0.01,
        warmup_steps: int = 10,
        verbose: bool = True,
        sinks: Iterable[Sink] | None = None,
        bus: EventBus | None = None,
        detector: str | Detector = "auto",
        norm_floor: float = 1e-3,
        clip: str = "global",
        max_consecutive_skips: int | None = 20,
        escalate_to: str = "raise",
        rollback_every: int = 100,
        keep: int = 2,
        on_rollback: Callable[[int, int], Any] | None = None,
        process_group: Any = None,
        run: str | None = None,
        stall_after: float | None = None,
        on_halt: Callable[[GradientSpikeError], Any] | None = None,
        watch: bool | Watch = True,
        triage: bool = False,
        skip_budget: bool | SkipBudget | None = True,
        on_repeat: str | LowerLR = "rollback",
    ) -> None:
        # --- validate everything before touching anything ---
        if not isinstance(base_optimizer, torch.optim.Optimizer):
            raise ConfigError("base_optimizer", f"expected a torch.optim.Optimizer, got {type(base_optimizer).__name__}",
                              "pass e.g. torch.optim.AdamW(model.parameters())")
        if isinstance(base_optimizer, GuardedOptimizer):
            raise ConfigError("base_optimizer", "is already a GuardedOptimizer", "wrap the plain optimizer once")
        if model is not None and not isinstance(model, nn.Module):
            raise ConfigError("model", f"expected an nn.Module, got {type(model).__name__}", "pass the model or None")
        policy = ActionPolicy(nan_action, max_consecutive_skips, escalate_to)
        repeat_action = resolve_on_repeat(on_repeat, policy)
        budget = resolve_skip_budget(skip_budget)
        if clip not in CLIP_MODES:
            raise ConfigError("clip", f"unknown clip mode {clip!r}", f"pass one of {list(CLIP_MODES)}")
        found_detector = make_detector(detector, spike_threshold=spike_threshold, ema_alpha=ema_alpha,
                                       warmup_steps=warmup_steps, norm_floor=norm_floor)
        log_every = _positive_int(log_every, "log_every", "50")
        rollback_every = _positive_int(rollback_every, "rollback_every", "100")
        keep = _positive_int(keep, "keep", "2")
        stall_after = check_stall_after(stall_after)
        verbose = flag("verbose", verbose)
        if on_rollback is not None and not callable(on_rollback):
            raise ConfigError("on_rollback", "must be callable(from_step, to_step)", "pass a function or None")
        if run is not None and (not isinstance(run, str) or not run.strip()):
            raise ConfigError("run", f"expected a non-empty str, got {run!r}", "pass a run name or None")
        _check_process_group(process_group)
        if on_halt is not None and not callable(on_halt):
            raise ConfigError("on_halt", "must be callable(error)", "pass a function or None")
        watch_options = resolve_watch(watch)
        triage = flag("triage", triage)
        params = [p for g in base_optimizer.param_groups for p in g["params"]]
        names = self._param_names(base_optimizer, model)
        _check_params(params, names)
        given = _validate.path("log_dir", log_dir, allow_none=True)
        run = run_name(run)
        # no log_dir: this run's own folder under ./sg_logs, so runs never mix; a given log_dir is used as is
        log_path = run_folder(DEFAULT_ROOT, run) if given is None else given
        check_creatable_dir(log_path, "log_dir")
        user_sinks = check_bus_args(bus, sinks)

        # --- the Optimizer machinery, without Optimizer.__init__ (which would copy the param groups) ---
        self._base = base_optimizer
        self._accelerated = AcceleratedBase.of(base_optimizer)  # a guard around accelerator.prepare(opt)
        self._optimizer_step_pre_hooks = collections.OrderedDict()
        self._optimizer_step_post_hooks = collections.OrderedDict()
        self._optimizer_state_dict_pre_hooks = collections.OrderedDict()
        self._optimizer_state_dict_post_hooks = collections.OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = collections.OrderedDict()
        self._optimizer_load_state_dict_post_hooks = collections.OrderedDict()
        self._patch_step_function()
        # GradScaler reads this to hand us grad_scale/found_inf instead of unscaling and syncing itself
        self._step_supports_amp_scaling = supports_device_skip(base_optimizer)

        self.model = model
        self.spike_threshold = float(spike_threshold)
        self.policy = policy
        self.clip = clip
        self.log_every = log_every
        self.log_dir = log_path.resolve()
        self._own_folder = log_dir is None  # the run's own folder: the guard keeps its event log there too
        self.verbose = verbose
        self.on_rollback = on_rollback
        self.on_halt = on_halt
        self.process_group = process_group
        self.run = run  # resolved: run=, GUARDTOWER_RUN, or the active tracker run's name (guardtower._runs)
        self._run_kw: dict[str, Any] = {"run": run}
        self.detector = found_detector
        self._names = names
        self._params = params
        self._device = _decision_device(params)
        # constants the step reuses instead of allocating them every step
        self._absent_loss = torch.full((), self.detector.absent_loss, device=self._device)
        self._loss_buf = torch.zeros((), device=self._device)  # a loss given as a Python number
        self._zero = torch.zeros((), device=self._device)
        self._one = torch.ones((), device=self._device)
        self._meter = GradMeter(self._device)
        self._slots: RankSlots | None = None  # per-rank slots of the decision's all-reduce (which rank)
        self.detector.resize(len(params), self._device)
        self._buffers = BufferGuard(model) if model is not None else None
        self._records = RecordQueue()
        self._history: collections.deque[tuple[int, float, Tensor]] = collections.deque(maxlen=_HISTORY)
        # triage too: the host recomputes a rejected step before the next one
        self._host_decides = (not self._step_supports_amp_scaling or policy.nan_action in ("raise", "rollback")
                              or triage)
        self.triage = triage
        self._triaged: dict[int, Outcome] = {}  # step -> its triage, until the step's incident is reported
        self._pending_batch: BatchRef | None = None
        # observe_recompute, for triage: the closure, the RNG before the step's forward, the GradScaler it scales by
        self._pending_recompute: tuple[Callable[[], Any], RngState, Any] | None = None
        self._replaying = False  # skip_quarantined: the next step is a quarantined one, skipped unjudged
        self._batches: dict[int, BatchRef] = {}  # step -> the batch it stepped on, until its record is read
        self._quarantine: list[dict[str, Any]] = []  # this run's rejected batches (and those restored)
        self._snapshots = (SnapshotStore(model, base_optimizer, rollback_every, keep)
                           if policy.may_rollback else None)
        if self._snapshots is not None:
            self._snapshots.take(0)  # the state as handed to us, before any forward pass moves buffers
        self._step_count = 0
        self._total_spikes = 0
        self._total_skips = 0
        self._total_rollbacks = 0
        self._total_overflows = 0
        self._total_clips = 0
        self._total_level_shifts = 0  # slots re-baselined on a sustained level shift (a summary metric)
        self.consecutive_rejections = 0
        self._budget = BudgetCounter(budget) if budget is not None else None
        self._repeats = RepeatTracker(repeat_action)
        self._rolled_back_at = -1  # the step of the last rollback
        self._closed = False
        self._started = False
        self._pending_loss: Tensor | None = None
        self._last_report: str | None = None
        self._last_summary = -1  # the step of the last summary event
        self._watch_options = watch_options
        # what the loop means, before the loop can change it (an epoch's model.train(), a helper's lr writes)
        self._intent = read_intent(base_optimizer, model) if watch_options is not None else None
        self._loop: dict[str, Any] = {}  # what a trainer declared about the loop, for the watch
        self.watch: LoopWatch | None = None  # built by the first step; its ``findings`` stay after it ends

        # the bus exists now (no thread until a sink is added); sinks are attached by the first step
        self._user_bus = bus
        self._user_sinks = user_sinks
        self._owns_bus = bus is None
        self.bus = bus if bus is not None else EventBus()
        adopt_log_dir([*self._user_sinks, *self.bus.sinks], self.log_dir)  # sets spool paths, creates nothing
        self._report_sink: SpikeReportSink | None = None
        self.heartbeat = None if stall_after is None else Heartbeat(stall_after, self.bus.publish, run=run)

    def _start(self) -> None:
        """The first step: attach the sinks and the console box, and publish the ``start`` event."""
        self._started = True
        _unfinished.add(self)  # a run that dies on an exception still gets its final summary at exit
        for sink in self._user_sinks:
            self.bus.add_sink(sink)
        self._report_sink = SpikeReportSink(self.log_dir)
        self.bus.add_sink(self._report_sink)
        if self._own_folder:  # so `guardtower report sg_logs` finds this run, clean or not, as the latest
            from guardtower.sinks import JsonlSink

            self.bus.add_sink(JsonlSink(self.log_dir / "events.jsonl"))
        if self.verbose:
            from guardtower.sinks import ConsoleSink

            if not any(isinstance(s, ConsoleSink) for s in self.bus.sinks):
                self.bus.add_sink(ConsoleSink(min_severity=Severity.WARN))
        settings = {"ema_alpha": getattr(self.detector, "ema_alpha", None), "log_every": self.log_every,
                    "log_dir": str(self.log_dir), "clip": self.clip,
                    "max_consecutive_skips": self.policy.max_consecutive_skips,
                    "escalate_to": self.policy.escalate_to, "device": str(self._device),
                    "bn_buffers_protected": bool(self._buffers),
                    "skip_budget": None if self._budget is None else [self._budget.options.share,
                                                                     self._budget.options.window],
                    "on_repeat": str(self._repeats.on_repeat)}
        self._publish(StartEvent(
            **self._run_kw, step=self._step_count, optimizer=type(self._base).__name__, detector=self.detector.name,
            nan_action=self.policy.nan_action, spike_threshold=self.detector.threshold,
            warmup_steps=int(getattr(self.detector, "warmup_steps", 0)), tensors=len(self._params),
            parameters=sum(p.numel() for p in self._params), device_decides=not self._host_decides,
            settings=settings,
        ))
        if self._watch_options is not None:
            self.watch = LoopWatch(self._watch_options, self._base, self.model, self._publish, self._run_kw,
                                   holder=self, intent=self._intent, **self._loop)

    def declare_loop(self, *, schedulers: Iterable[Any] = (), accumulation: int | None = None,
                     total_steps: int | None = None) -> None:
        """Tell the watch what the trainer knows: its LR schedulers, gradient accumulation and planned length.

        The HF and Lightning callbacks call this; a plain loop may too (schedulers are otherwise found once,
        at the first step, among the objects that refer to the optimizer).
        """
        self._loop = {"schedulers": list(schedulers), "accumulation": accumulation, "total_steps": total_steps}
        if self.watch is not None:
            self.watch.declare(**self._loop)

    # ------------------------------------------------------------------ counters
    def _current(self) -> None:
        """Hand over every record that is ready without waiting (all of them on the CPU)."""
        if not self._closed:
            self._drain(block=False, wait_for_old=False)

    @property
    def step_count(self) -> int:
        """Calls to ``step()`` (the HF callback sets it to the Trainer's ``global_step``)."""
        return self._step_count

    @step_count.setter
    def step_count(self, value: int) -> None:
        self._step_count = int(value)

    @property
    def total_spikes(self) -> int:
        """Rejected steps: spikes (skipped, clipped, rolled back or raised) and non-finite gradients."""
        self._current()
        return self._total_spikes

    @property
    def total_skips(self) -> int:
        self._current()
        return self._total_skips

    @property
    def total_rollbacks(self) -> int:
        self._current()
        return self._total_rollbacks

    @property
    def total_clips(self) -> int:
        """Spikes applied scaled down by ``nan_action="clip"``."""
        self._current()
        return self._total_clips

    @property
    def total_overflows(self) -> int:
        """Steps a ``GradScaler`` skipped for overflow (not spikes)."""
        self._current()
        return self._total_overflows

    # ------------------------------------------------------------------ shared Optimizer state
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self._base.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self._base.param_groups = value

    @property
    def state(self) -> Any:
        return self._base.state

    @state.setter
    def state(self, value: Any) -> None:
        self._base.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self._base.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self._base.defaults = value

    @property
    def base_optimizer(self) -> torch.optim.Optimizer:
        return self._base

    def __repr__(self) -> str:
        return (f"GuardedOptimizer(nan_action={self.policy.nan_action!r}, spike_threshold={self.spike_threshold}, "
                f"detector={self.detector.name!r}) wrapping {self._base!r}")

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("GuardedOptimizer cannot be pickled; save state_dict() instead")

    # ------------------------------------------------------------------ pass-through API
    def zero_grad(self, set_to_none: bool = True) -> None:
        self._base.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the base optimizer; the new tensors get fresh baselines (and their own warmup)."""
        self._base.add_param_group(param_group)
        self._track_params()

    def _track_params(self) -> None:
        """Guard every tensor of the base optimizer, also those added to it after wrapping
        (``base.add_param_group``); O(groups) per step, no device work unless a group was added."""
        if sum(len(g["params"]) for g in self._base.param_groups) == len(self._params):
            return
        params = [p for g in self._base.param_groups for p in g["params"]]
        names = self._param_names(self._base, self.model)
        _check_params(params, names)
        self._params, self._names = params, names
        self.detector.resize(len(params), self._device)
        if self._snapshots is not None:
            self._snapshots.clear()  # a snapshot without the new tensors cannot restore them

    def state_dict(self) -> dict[str, Any]:
        """The base optimizer's state dict plus the guard's own state under the key ``"guardtower"``."""
        self._drain(block=True)
        state = self._base.state_dict()
        state["guardtower"] = {
            "version": 1,
            "step_count": self._step_count,
            "total_spikes": self._total_spikes,
            "total_skips": self._total_skips,
            "total_rollbacks": self._total_rollbacks,
            "total_overflows": self._total_overflows,
            "total_clips": self._total_clips,
            "consecutive_rejections": self.consecutive_rejections,
            "total_level_shifts": self._total_level_shifts,
            "world_size": world_size(),  # informative: a state loads under any world size (docs/guard.md)
            "detector": self.detector.state_dict(),
            "quarantine": [dict(entry) for entry in self._quarantine],
            "on_repeat": self._repeats.state_dict(),
        }
        if self._budget is not None:
            state["guardtower"]["skip_budget"] = self._budget.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a state dict from ``state_dict()``, or a plain base-optimizer one (guard state unchanged), or
        ``{"guardtower": state_dict()["guardtower"]}`` (the guard's state alone; the base optimizer's unchanged).

        Everything is checked first (``ConfigError`` naming what is wrong); on error nothing has changed.
        A state saved under another world size loads (docs/guard.md says what carries over).
        """
        if not isinstance(state_dict, Mapping):
            raise ConfigError("state_dict", f"expected a dict, got {type(state_dict).__name__}",
                              "pass the dict returned by optimizer.state_dict()")
        state = dict(state_dict)
        guard = state.pop("guardtower", None)
        guard_only = guard is not None and not state
        if not guard_only:
            _check_base_state(state, self._base)
        counters: dict[str, int] = {}
        if guard is not None:
            counters = _check_guard_state(guard, self.detector)
            quarantine = check_entries(guard.get("quarantine", []))
            for key, part in (("skip_budget", self._budget), ("on_repeat", self._repeats)):
                if part is not None and key in guard:
                    part.check_state_dict(guard[key])
        self._drain(block=True)
        try:
            if not guard_only:
                self._base.load_state_dict(state)
        except (ValueError, KeyError, TypeError, RuntimeError) as exc:
            raise ConfigError("state_dict", f"the base optimizer refused it ({exc})",
                              "load a state dict saved from the same optimizer and parameter groups") from None
        self._params = [p for g in self._base.param_groups for p in g["params"]]
        if guard is not None:
            self.detector.load_state_dict(guard["detector"])
            self._step_count = counters["step_count"]
            self._total_spikes = counters["total_spikes"]
            self._total_skips = counters["total_skips"]
            self._total_rollbacks = counters["total_rollbacks"]
            self._total_overflows = counters["total_overflows"]
            self._total_clips = counters["total_clips"]
            self.consecutive_rejections = counters["consecutive_rejections"]
            self._quarantine = quarantine
            self._total_level_shifts = counters["total_level_shifts"]
            if self._budget is not None and "skip_budget" in guard:
                self._budget.load_state_dict(guard["skip_budget"])
            if "on_repeat" in guard:
                self._repeats.load_state_dict(guard["on_repeat"])
        self._history.clear()
        if self._snapshots is not None:
            self._snapshots.clear()
        if self._buffers is not None:
            self._buffers.refresh()
        if self.watch is not None:
            self.watch.rebaseline()

    # ------------------------------------------------------------------ the step
    def observe_loss(self, loss: Any) -> None:
        """Give the loss of the step about to be taken, for loops that call ``step()`` without it (the HF
        callback does). Kept as a device tensor; used, then forgotten, by the next ``step()``."""
        self._pending_loss = loss

    def observe_batch(self, batch: Any = None, *, index: int | None = None, epoch: int | None = None,
                      indices: Any = None, micro_batches: int = 1) -> None:
        """Say which batch the next ``step()`` steps on: its position ``index`` in the ``epoch`` (what a resumed
        run replays the quarantine by), its sample ``indices`` when the sampler exposes them, and the batch
        itself (hashed into a fingerprint only if the step is rejected and no indices were given). Nothing is
        read or copied now; the batch is referenced until the step's record is read. Under gradient
        accumulation, ``index`` is the step's first loader batch and ``micro_batches`` how many it accumulated
        (``batch`` may then be the list of them); all are quarantined."""
        self._pending_batch = batch_ref(batch, index, epoch, indices, micro_batches)

    def observe_recompute(self, closure: Callable[[], Any], *, scaler: Any = None) -> None:
        """For loops whose ``step()`` gets no closure because forward and backward ran before it (the HF
        Trainer, ``scaler.step(guard)``): ``closure`` recomputes the next step's gradients (forward and backward
        of the same micro-batches, returning the loss) and the RNG state is copied now, so call this before the
        step's first forward. Under a ``GradScaler`` the closure backpropagates the scaled loss as the step did:
        pass the ``scaler`` so the recomputed gradients are judged unscaled (a fused base optimizer is handed
        the scale by ``scaler.step`` and needs no argument). ``triage=True`` calls it for a rejected step only;
        without triage nothing is kept."""
        if not callable(closure):
            raise ConfigError("closure", f"expected a callable, got {type(closure).__name__}",
                              "pass a function that runs forward and backward of the step's batches")
        if scaler is not None and not callable(getattr(scaler, "get_scale", None)):
            raise ConfigError("scaler", f"expected a torch.amp.GradScaler, got {type(scaler).__name__}",
                              "pass the GradScaler whose scale() the closure's backward uses, or leave it out")
        self._pending_recompute = (closure, capture_rng(), scaler) if self.triage else None

    def skip_quarantined(self) -> None:
        """The next ``step()`` steps on a quarantined batch (a resumed run replaying its quarantine, for trainers
        that must take every step): it is skipped without being judged (no measurement, no collective, nothing
        folded into the baselines, the update not applied), counted in ``step_count`` and ``total_skips``, and
        published as a ``skip`` event with reason ``"quarantined"``. Call it on every rank alike (the positions
        were agreed: ``Quarantine.agreed``). A closure given to that step still runs (the loop expects it)."""
        self._replaying = True

    @property
    def quarantine(self) -> Quarantine:
        """The rejected batches of this run (and those restored by ``load_state_dict``), for replay."""
        return Quarantine(self._quarantine)

    def step(self, closure: Callable[[], Any] | None = None, loss: Any = None) -> Any:
        """Judge the gradients (and the loss), then update, clip, skip, roll back or raise.

        Returns what the base returns. ``loss`` (a tensor or a number) is a signal for the detector and goes
        into spike reports and summaries; a tensor stays on the device. With a closure, the closure's loss
        is used and returned.
        """
        if self._closed or (self._accelerated is not None and not self._accelerated.steps):
            # closed, or an accumulation micro-step that Accelerate's wrapper does not step: nothing to judge
            return self._base.step(closure) if closure is not None else self._base.step()
        if self._replaying:
            return self._replay_step(closure)
        rng: RngState | None = None
        recompute: Callable[[], Any] | None = closure
        recompute_scaler: Any = None
        pending, self._pending_recompute = self._pending_recompute, None
        if self.triage:
            if closure is not None:
                rng = capture_rng()
            elif pending is not None:  # observe_recompute: the RNG was copied before the step's forward
                recompute, rng, recompute_scaler = pending
            else:
                raise ConfigError("closure", "triage=True recomputes a rejected step, so step() needs the closure "
                                  "that computes the loss and the gradients",
                                  "call guard.step(closure) (the closure zeroes the gradients, runs forward and "
                                  "backward, returns the loss), or guard.observe_recompute(closure) before the "
                                  "step's forward, or construct the guard with triage=False")
        if loss is None:
            loss = self._pending_loss
        self._pending_loss = None
        result: Any = None
        base_closure: Callable[[], Any] | None = None
        if closure is not None:
            with torch.enable_grad():
                result = closure()
            loss = result if loss is None else loss
            base_closure = _replay_closure(closure, result)
        step, watch = self._next_step()
        if self._pending_batch is not None:
            self._batches[step] = self._pending_batch
            self._pending_batch = None

        grad_scale: Tensor | None = getattr(self, "grad_scale", None)
        scaler_found_inf: Tensor | None = getattr(self, "found_inf", None)
        if self._accelerated is not None:  # Accelerate's wrapper holds the GradScaler: unscale before measuring
            scaler_found_inf = self._accelerated.unscale(self._device)
        with torch.no_grad():
            skip, found_inf = self._judge(step, loss, grad_scale, scaler_found_inf)

        out: Any = None
        if self._host_decides:
            # the one host sync of non-fused optimizers / raise / rollback (skip == reject unless clipping)
            if bool(skip):
                if rng is not None and recompute is not None:
                    scale = self._recompute_scale(grad_scale, recompute_scaler)
                    self._triaged[step] = retriage(recompute, rng, self._base.zero_grad,
                                                   functools.partial(self._reproduces, scale=scale),
                                                   self.process_group, self._distributed(), current_rank())
                self._drain(block=True)  # publishes this step's events; rolls back or raises
                if self._report_sink is not None and self._last_report is not None:
                    self._report_sink.wait_written(self._last_report, _REPORT_WAIT_S)  # on disk on return
                if self._accelerated is not None:
                    self._accelerated.skipped()
            else:
                out = self._base_step(found_inf, grad_scale, base_closure)
        else:
            out = self._base_step(found_inf, grad_scale, base_closure)
        self._after_step(step, watch)
        return result if closure is not None else out

    def _after_step(self, step: int, watch: LoopWatch | None) -> None:
        # a step that rolled back holds the snapshot it restored: not a new one (a repeat returns to the same)
        if self._snapshots is not None and self._snapshots.due(step) and self._rolled_back_at != step:
            self._snapshots.take(step)
        if self.heartbeat is not None:
            self.heartbeat.beat(step)
        if watch is not None:
            watch.after_step(step)  # device values only on its sample steps, read back asynchronously

    def _next_step(self) -> tuple[int, LoopWatch | None]:
        """Start on the first step, follow the parameters, read finished records, count this step, take the
        snapshot a rollback needs when there is none (after ``load_state_dict``), and hand the loop watch its host
        facts; returns the step and the active watch."""
        if not self._started:
            self._start()
        self._track_params()
        self._drain(block=False)
        self._step_count += 1
        step = self._step_count
        if self._snapshots is not None and not self._snapshots.snapshots:
            self._snapshots.take(step - 1)
        watch = self.watch if self.watch is not None and self.watch.active else None
        if watch is not None:
            watch.before_step(step)  # host facts only
        return step, watch

    def _replay_step(self, closure: Callable[[], Any] | None) -> Any:
        """A quarantined step (``skip_quarantined``): not judged, not applied, published as a ``skip``."""
        self._replaying = False
        self._pending_loss = self._pending_recompute = None
        result: Any = None
        if closure is not None:
            with torch.enable_grad():
                result = closure()
        step, watch = self._next_step()
        ref, self._pending_batch = self._pending_batch, None
        self._total_skips += 1
        self._publish(SkipEvent(**self._run_kw, step=step, severity=Severity.INFO, layer="", reason="quarantined",
                                total_skips=self._total_skips, consecutive_skips=self.consecutive_rejections,
                                batch=batch_identity(without_content(ref), step)))
        if self._accelerated is not None:
            self._accelerated.skipped()
        self._after_step(step, watch)
        return result

    def _recompute_scale(self, grad_scale: Tensor | None, scaler: Any) -> Tensor | float | None:
        """The loss scale a triage recompute's backward multiplies the gradients by: the one ``scaler.step``
        handed a fused optimizer, Accelerate's scaler's, or the scaler given to ``observe_recompute``."""
        if grad_scale is not None:
            return grad_scale
        if scaler is None and self._accelerated is not None:
            scaler = self._accelerated.scaler()
        return float(scaler.get_scale()) if scaler is not None and scaler.is_enabled() else None

    def _unscaled_norms(self, scale: Tensor | float | None) -> Tensor:
        """Each tensor's gradient norm, divided by the loss scale the gradients still carry under a GradScaler
        (a device tensor is never read on the host)."""
        norms = self._meter.norms(self._params)
        if isinstance(scale, Tensor):
            return norms / scale.to(self._device, torch.float32, non_blocking=True).reshape(())
        return norms if scale is None else norms / scale

    def _reproduces(self, loss: Any, scale: Tensor | float | None = None) -> Tensor:
        """bool 0-d: the gradients now in ``.grad`` (a triage recompute, still multiplied by ``scale`` under a
        GradScaler) would be rejected against the same baselines. Judging does not fold anything in: only
        ``update()`` changes the detector."""
        norms = self._unscaled_norms(scale)
        global_norm = torch.linalg.vector_norm(norms)
        _, loss_t = self._loss_tensor(loss)
        bad = (global_norm * 0.0) != 0.0
        if loss_t is not self._absent_loss:
            bad = bad | ((loss_t * 0.0) != 0.0)
        return self.detector.judge(norms, global_norm, loss_t).spike | bad

    def _base_step(self, found_inf: Tensor, grad_scale: Tensor | None, closure: Callable[[], Any] | None) -> Any:
        with scaled_lr(self._base, self._repeats.scale):  # 1.0 unless on_repeat lowered the learning rate
            if self._step_supports_amp_scaling:
                return device_skip(self._base, found_inf, grad_scale, closure)
            return self._base.step(closure) if closure is not None else self._base.step()

    def _judge(self, step: int, loss: Any, grad_scale: Tensor | None,
               scaler_found_inf: Tensor | None) -> tuple[Tensor, Tensor]:
        """Measure, decide and act on the device; queue the step's record.

        Returns ``skip`` (bool 0-d, agreed across ranks: the update is not applied) and the optimizer's
        ``found_inf`` (float 0/1). The op count of this method does not depend on the number of parameters,
        and the default path (auto detector, skip) adds no op it can leave out (bench/overhead.py counts them).
        """
        device = self._device
        detector = self.detector
        norms = self._unscaled_norms(grad_scale)
        global_norm = torch.linalg.vector_norm(norms)
        loss_value, loss_t = self._loss_tensor(loss)
        verdict = detector.judge(norms, global_norm, loss_t)
        clipping = self.policy.nan_action == "clip"
        reject = verdict.spike
        nonfinite: Tensor | None = None
        if clipping or not detector.judges_nonfinite:
            nonfinite = (global_norm * 0.0) != 0.0  # NaN or Inf: any non-finite norm makes the global one so
            reject = reject | nonfinite
        skip, scale, grad_spike = reject, self._one, reject
        if clipping:
            assert nonfinite is not None
            # clip applies a finite gradient spike scaled down; NaN/Inf and a loss-only spike are skipped
            grad_spike = detector.grad_spike()
            skip = nonfinite | (reject & ~grad_spike)
            scale = clip_factor(self.clip, norms, global_norm, *detector.limits())
        overflow = self._zero
        if scaler_found_inf is not None:  # an overflow step is the scaler's, not a spike
            overflow = scaler_found_inf.to(device, torch.float32, non_blocking=True).reshape(())
            clean = overflow == 0
            reject, skip = reject & clean, skip & clean
        detail: list[Tensor] = []
        if self._distributed():
            has_loss = loss_t is not self._absent_loss
            if scaler_found_inf is None:
                reject, skip, scale, detail = self._agree(reject, skip, grad_spike, scale, clipping, global_norm,
                                                          loss_t, has_loss)
            else:  # one rank's overflow (a NaN after the gradient all-reduce) stops every rank:
                # it rides on the decision's all-reduce as a held update that no rank rejected
                reject, held, scale, detail = self._agree(reject, skip | (overflow > 0), grad_spike, scale, clipping,
                                                          global_norm, loss_t, has_loss)
                skip = held & reject
                overflow = torch.maximum(overflow, (held & ~reject).to(torch.float32))
        # the record first: the verdict's report lives in the detector's buffers, which its update overwrites
        header = torch.stack([reject, skip, verdict.absorbed, overflow, global_norm, loss_t,
                              scale.amin() if scale.dim() else scale])  # stack promotes the flags to float32
        body = torch.cat([norms, *verdict.report, *detail])  # detail: every rank's slot, read for incidents only
        self._records.push(step, header, body, len(self._params), self._lr(), loss_value, isinstance(loss, Tensor),
                           tail=detail[0].shape[0] if detail else 0)
        unfolded = reject if scaler_found_inf is None else reject | (overflow > 0)  # kept out of the baselines
        detector.update(norms, global_norm, loss_t, unfolded)
        if self._buffers:
            self._buffers.settle(unfolded)
        if clipping:
            self._meter.scale(torch.where(skip, self._one, scale))
        # the header's skip entry is already the exact 0.0/1.0 float32 flag the fused optimizer reads
        found_inf = header[1] if scaler_found_inf is None else (skip | (overflow > 0)).to(torch.float32)
        if self._accelerated is not None:
            self._accelerated.agree(overflow)
        return skip, found_inf

    def _loss_tensor(self, loss: Any) -> tuple[float | None, Tensor]:
        """(the loss as a Python number if it was one, the loss as float32 0-d on the device; the detector's
        ``absent_loss`` when there is none)."""
        if isinstance(loss, Tensor):
            value = loss if loss.dim() == 0 else loss.mean()
            if value.dtype != torch.float32 or value.device != self._device:
                value = value.to(self._device, torch.float32, non_blocking=True)
            return None, value
        if isinstance(loss, (int, float)) and not isinstance(loss, bool):
            # one reused device scalar (stack/cat below copy it), not a fresh allocation per step
            return float(loss), self._loss_buf.fill_(float(loss))
        return None, self._absent_loss

    def _agree(self, reject: Tensor, skip: Tensor, grad_spike: Tensor, scale: Tensor, clipping: bool,
               global_norm: Tensor, loss: Tensor, loss_given: bool) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
        """One all-reduce: every rank rejects, skips and clips (by the smallest factor) together.

        ``reject`` and ``skip`` are combined (set on any rank); the detector's own marks stay this rank's.
        A clip needs the same gradients on every rank; when only some ranks' gradients tripped (a rank-local
        corruption), the step is skipped everywhere instead. The same reduce carries every rank's local
        verdict, grad norm and loss in per-rank slots (``guardtower.guard._ranks``), returned as the detail.
        """
        import torch.distributed as dist

        slots = self._rank_slots()
        parts = [torch.stack([reject, skip]).to(torch.float32),
                 *slots.parts(reject, global_norm, loss, loss_given)]
        if clipping:
            parts += [torch.stack([grad_spike, ~grad_spike]).to(torch.float32), -scale.reshape(-1)]
        packed = torch.cat(parts)
        dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=self.process_group)
        reject, skip = packed[0] > 0, packed[1] > 0
        end = 2 + slots.size
        if clipping:
            skip = skip | ((packed[end] > 0) & (packed[end + 1] > 0))  # some ranks tripped, others did not: skip
            scale = (-packed[end + 2:]).reshape(scale.shape)
        return reject, skip, scale, [packed[2:end]]

    def _rank_slots(self) -> RankSlots:
        """This rank's slots in the decision's all-reduce, made at the first distributed step."""
        if self._slots is None:
            import torch.distributed as dist

            group = self.process_group
            self._slots = RankSlots(dist.get_rank(group), dist.get_world_size(group), self._device)
        return self._slots

    def _distributed(self) -> bool:
        return self.process_group is not None or (is_distributed() and world_size() > 1)

    def _lr(self) -> float | None:
        lr = self._base.param_groups[0].get("lr") if self._base.param_groups else None
        if isinstance(lr, Tensor):
            return float(lr) if lr.device.type == "cpu" else None
        return float(lr) if isinstance(lr, (int, float)) else None

    # ------------------------------------------------------------------ host side: records -> events
    def _drain(self, block: bool, wait_for_old: bool = True) -> None:
        for record in self._records.ready(block, wait_for_old):
            self._handle(record)

    def _handle(self, record: StepRecord) -> None:
        head = record.header()
        ref = self._batches.pop(record.step, None)
        loss = record.loss if record.loss is not None else (head.loss if record.loss_on_device else None)
        self._history.append((record.step, head.global_norm, record.body))
        if head.overflow:
            self._total_overflows += 1
        elif head.reject:
            self._incident(record, head, loss, ref)
        else:
            self.consecutive_rejections = 0
            if head.absorbed:
                self._total_level_shifts += 1
        if record.step % self.log_every == 0:
            self._summary(record.step, head.global_norm, loss, record.lr, record)

    def _explain(self, record: StepRecord) -> tuple[list[float], Explanation]:
        """The step's per-tensor norms and the detector's reading of its verdict (host work, on demand)."""
        n = record.n
        norms = record.body[:n].tolist()
        return norms, self.detector.explain(record.body[n:record.body.shape[0] - record.tail], norms)

    def _summary(self, step: int, grad_norm: float, loss: float | None, lr: float | None,
                 record: StepRecord | None = None) -> None:
        self._last_summary = step
        metrics = {"overflow_steps": float(self._total_overflows), "clipped_steps": float(self._total_clips),
                   "consecutive_rejections": float(self.consecutive_rejections),
                   "level_shifts": float(self._total_level_shifts), "lr_scale": self._repeats.scale}
        if record is not None:
            _, seen = self._explain(record)
            metrics.update({"global_baseline": seen.global_baseline, "global_ratio": seen.global_ratio,
                            "max_layer_ratio": max((r for r in seen.ratios if math.isfinite(r)), default=0.0)})
        self._publish(SummaryEvent(
            **self._run_kw, step=step, grad_norm=grad_norm, loss=loss, lr=lr, total_spikes=self._total_spikes,
            total_skips=self._total_skips, total_rollbacks=self._total_rollbacks, metrics=metrics,
        ))

    def _incident(self, record: StepRecord, head: Header, loss: float | None, ref: BatchRef | None) -> None:
        n = record.n
        norms, seen = self._explain(record)
        ratios, baselines = seen.ratios, seen.baselines
        names = self._names
        nonfinite = [i for i in range(n) if not math.isfinite(norms[i])]
        candidates = [i for i in range(n) if seen.tripped[i]]
        loss_nonfinite = loss is not None and not math.isfinite(loss)
        reason = "nonfinite" if nonfinite or not math.isfinite(head.global_norm) or loss_nonfinite else "spike"
        trigger: int | None = None
        if nonfinite:
            trigger = nonfinite[0]
        elif candidates:
            trigger = max(candidates, key=lambda i: ratios[i])
        if trigger is not None:
            layer, norm, baseline = names[trigger], norms[trigger], baselines[trigger]
            ratio = math.inf if nonfinite else ratios[trigger]
        elif seen.loss_tripped and math.isfinite(head.global_norm) and not seen.global_tripped:
            layer, norm, baseline, ratio = "loss", head.global_norm, seen.global_baseline, seen.global_ratio
        else:  # the global norm alone tripped, or another rank rejected the step (its gradients differed)
            layer = "global" if seen.global_tripped or not math.isfinite(head.global_norm) else "peer-rank"
            norm, baseline, ratio = head.global_norm, seen.global_baseline, seen.global_ratio
        order = sorted(range(n), key=lambda i: -(math.inf if not math.isfinite(norms[i]) else ratios[i]))
        top = tuple((names[i], norms[i], ratios[i] if math.isfinite(norms[i]) else math.inf) for i in order[:_TOP])
        history = list(self._history)
        steps = tuple(s for s, _, _ in history)
        global_hist = tuple(g for _, g, _ in history)
        layer_hist = tuple((float(d[trigger]) if trigger is not None and d.shape[0] > trigger else g)
                           for _, g, d in history)

        self._total_spikes += 1
        if head.skip:
            self.consecutive_rejections += 1
            action = self.policy.action(self.consecutive_rejections)
        else:  # nan_action="clip" applied the step scaled down: the run moves on
            self.consecutive_rejections = 0
            action = "clip"
        rank = current_rank()
        loss_given = record.loss is not None or record.loss_on_device
        every_rank = read_ranks(record.body[-record.tail:].tolist(), loss_given) if record.tail else []
        named = named_ranks(every_rank) if every_rank else [
            RankValue(rank, True, reason == "nonfinite", head.global_norm, loss)]
        ranks = tuple(v.rank for v in named)
        rank_values = tuple((v.rank, "nonfinite" if v.nonfinite else "spike", v.grad_norm, v.loss) for v in named)
        batch = batch_identity(ref, record.step)
        outcome = self._triaged.pop(record.step, None)
        triage = outcome.label if outcome is not None else None
        report_path = self._last_report = str(self.log_dir / report_filename(record.step, rank))
        module = layer.rsplit(".", 1)[0] if "." in layer else ""
        # a NaN/Inf step is a failure wherever it shows (console, events, alerts, trackers); a finite spike a warning
        severity = Severity.ERROR if reason == "nonfinite" else Severity.WARN
        self._publish(SpikeEvent(
            **self._run_kw,
            step=record.step, severity=severity, layer=layer, module=module, reason=reason, norm=norm,
            baseline=baseline, ratio=ratio, threshold=self.detector.threshold, global_norm=head.global_norm,
            action=action, loss=loss, lr=record.lr, top_layers=top, share_ratios=self.detector.share_ratios,
            nonfinite_layers=tuple(names[i] for i in nonfinite), report_path=report_path,
            history_steps=steps, history_global_norms=global_hist, history_layer_norms=layer_hist,
            ranks=ranks, rank_values=rank_values, all_ranks=tuple(report_ranks(every_rank)), batch=batch,
            triage=triage, triage_ranks=outcome.ranks if outcome is not None else (),
        ))
        if action != "clip":  # a clipped step was applied: its batch trained, nothing to leave out
            world = self._rank_slots().world if self._distributed() else 1
            self._remember(make_entry(run=self.run, rank=rank, world_size=world, step=record.step, reason=reason,
                                      action=action, ranks=ranks, batch=batch, triage=triage), outcome)
        if action == "clip":
            self._total_clips += 1
        elif action == "skip":
            self._total_skips += 1
            self._publish(SkipEvent(**self._run_kw, step=record.step, severity=severity, layer=layer,
                                    reason=reason, total_skips=self._total_skips,
                                    consecutive_skips=self.consecutive_rejections, ranks=ranks, batch=batch))
        what = ("NaN/Inf in the gradient" if reason == "nonfinite"
                else f"ratio {ratio:.3g}, threshold {self.detector.threshold:g}")
        message = f"gradient spike at step {record.step} in {layer} ({what})"
        if action == "rollback":
            repeated = self._rollback(record.step, layer, reason)
            if repeated is not None:
                action = "raise"
                message += f" after {repeated}"
        elif action == "raise" and self.policy.nan_action != "raise":
            message += f" after {self.consecutive_rejections} rejected steps in a row"
        if action == "raise":
            self._publish(HaltEvent(**self._run_kw, step=record.step, severity=Severity.ERROR, layer=layer,
                                    reason=reason, ratio=ratio, message=message))
            self._summary(record.step, head.global_norm, loss, record.lr)  # the run's last record: it ends here
            self.bus.flush(_RAISE_FLUSH_S)
            error = GradientSpikeError(record.step, layer, ratio, message)
            if self.heartbeat is not None:  # training is stopping: its silence is not a stall
                self.heartbeat.pause()
            if self.on_halt is not None:  # e.g. an integration marks the tracker run failed
                self.on_halt(error)
            raise error
        if self._budget is not None:
            self._check_budget(record.step, action)

    def _remember(self, entry: dict[str, Any], outcome: Outcome | None) -> None:
        """Quarantine a rejected step's batch: in the guard's state and, one whole line, in this rank's file."""
        if outcome is not None:
            entry["triage_s"] = round(outcome.seconds, 6)
            entry["triage_ranks"] = list(outcome.ranks)
        self._quarantine.append(entry)
        try:
            write_entry(self.log_dir, entry)
        except OSError as exc:  # telemetry never crashes training: the entry stays in state_dict()
            import warnings

            warnings.warn(f"guardtower: could not write the quarantine entry of step {entry['step']}: {exc}",
                          RuntimeWarning, stacklevel=2)

    def _check_budget(self, step: int, action: str) -> None:
        """Count a rejected step; one ``skip_budget`` WARN when it takes the recent share over the budget."""
        assert self._budget is not None
        counts = self._budget.note(step, action)
        if counts is None:
            return
        message = (f"{counts['rejected']} of the last {counts['steps']:,} steps were rejected "
                   f"({counts['skipped']} skipped, {counts['clipped']} clipped, {counts['rolled_back']} rolled back); "
                   f"the budget is {counts['share']:.3g} of {counts['window']:,} steps")
        self._publish(SkipBudgetEvent(**self._run_kw, step=step, severity=Severity.WARN, message=message, **counts))

    def _rollback(self, from_step: int, layer: str, reason: str) -> str | None:
        """Restore the last clean snapshot. Returns why the run must halt instead of going on (``on_repeat``),
        else None; the snapshot is restored either way, so a halted run holds clean weights."""
        store = self._snapshots
        assert store is not None, "rollback requested without a snapshot store"
        snap = store.latest_before(from_step) or (store.snapshots[0] if store.snapshots else None)
        if snap is None:
            raise GradientSpikeError(from_step, layer, math.nan, f"rollback at step {from_step}: no snapshot")
        outcome = self._repeats.rollback(snap.step)
        self._rolled_back_at = from_step
        store.restore(snap)
        if self._buffers is not None:
            self._buffers.refresh()
        if self.watch is not None:
            self.watch.rebaseline()
        self._total_rollbacks += 1
        self.consecutive_rejections = 0
        self._publish(RollbackEvent(**self._run_kw, step=from_step, severity=Severity.ERROR, layer=layer,
                                    reason=reason, from_step=from_step, to_step=snap.step,
                                    total_rollbacks=self._total_rollbacks))
        repeats = self._repeats.repeats + 1
        if outcome == "raise":
            lowered = f", the learning rate already at {self._repeats.scale:.3g}x" if self._repeats.backoffs else ""
            return f"{repeats} rollbacks in a row to the snapshot of step {snap.step}{lowered}"
        if outcome == "lower_lr":
            options = self._repeats.on_repeat
            assert isinstance(options, LowerLR)
            lr = self._lr()
            scale = self._repeats.scale
            self._publish(LrBackoffEvent(
                **self._run_kw, step=from_step, severity=Severity.WARN, scale=scale, factor=options.factor,
                floor=options.floor, backoffs=self._repeats.backoffs, to_step=snap.step, repeats=repeats,
                lr=None if lr is None else lr * scale,
                message=(f"{repeats} rollbacks in a row to the snapshot of step {snap.step}: learning rate lowered "
                         f"to {scale:.3g}x the scheduled one (floor {options.floor:g}x)")))
        if self.on_rollback is not None:
            self.on_rollback(from_step, snap.step)
        return None

    def _publish(self, event: Event) -> None:
        self.bus.publish(event)

    # ------------------------------------------------------------------ lifecycle
    def flush(self, timeout: float | None = None) -> bool:
        """Hand every pending step record to the bus (waits for the device) and flush the bus."""
        self._drain(block=True)
        return self.bus.flush(timeout)

    def finish(self, timeout: float | None = 10.0) -> bool:
        """End of training, guard kept: publish what is pending and a final ``summary`` (unless the last step
        had one), then flush. The integrations call it when training ends or raises; ``close()`` does it too."""
        if self._closed:
            return True
        self._final_summary()
        return self.bus.flush(timeout)

    def _final_summary(self) -> None:
        """Publish what is pending and a ``summary`` of the last step, unless that step already had one."""
        self._drain(block=True)
        if self._started and self._last_summary != self._step_count:  # not twice for the same step
            last = self._history[-1][1] if self._history else math.nan
            self._summary(self._step_count, last, None, self._lr())

    def close(self, timeout: float | None = 10.0) -> None:
        """Publish what is pending and a final ``summary`` (unless the last step had one), close the bus if the
        guard made it. Idempotent.

        Afterwards ``step()`` passes straight through to the base optimizer, unguarded.
        """
        if self._closed:
            return
        if self.heartbeat is not None:
            self.heartbeat.stop()
        try:
            if self.watch is not None:
                self.watch.close()
            self._final_summary()
        finally:
            self._closed = True
            if self._owns_bus:
                self.bus.close(timeout)
            else:
                self.bus.flush(timeout)
            if self._report_sink is not None:
                self._report_sink.closed = True
            if self._snapshots is not None:
                self._snapshots.clear()
            self._records.clear()
            self._history.clear()
            self._batches.clear()
            self._triaged.clear()
            self._pending_batch = self._pending_recompute = None

    # ------------------------------------------------------------------ names
    @staticmethod
    def _param_names(optimizer: torch.optim.Optimizer, model: nn.Module | None) -> list[str]:
        """Parameter names from ``model`` in optimizer order; ``group{g}.param{i}`` for the others."""
        by_id: dict[int, str] = {}
        if model is not None:
            wrapped = isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel))
            by_id = {id(p): _clean_name(name, wrapped) for name, p in model.named_parameters(remove_duplicate=False)}
        names: list[str] = []
        found = 0
        for g, group in enumerate(optimizer.param_groups):
            for i, p in enumerate(group["params"]):
                name = by_id.get(id(p))
                found += name is not None
                names.append(name if name is not None else f"group{g}.param{i}")
        if model is not None and found == 0 and names:
            raise ConfigError("model", "none of the model's parameters is in the optimizer",
                              "pass the model whose parameters the optimizer updates (or model=None)")
        return names


_unfinished: "weakref.WeakSet[GuardedOptimizer]" = weakref.WeakSet()


def _summarise_at_exit() -> None:
    """At interpreter exit (after an exception too), give every open guard its final summary.

    Registered after the bus's own exit flush (``guardtower.bus`` is imported first), so it runs before it:
    the summaries published here are still delivered.
    """
    for guard in list(_unfinished):
        if not guard._closed:
            try:
                guard._final_summary()
            except Exception:  # noqa: BLE001 - exit must not fail on a guard that cannot finish
                pass


atexit.register(_summarise_at_exit)
