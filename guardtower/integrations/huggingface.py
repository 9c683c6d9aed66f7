"""Hugging Face ``Trainer`` callbacks: a pre-flight audit on the first real batch, and a guarded optimizer.

``GuardtowerCallback`` audits the model on the first training batch, before the first optimizer step. When
``on_train_begin`` is handed the model, optimizer and ``train_dataloader`` (the Trainer passes all three) it
audits there on the loader's first batch. Under mixed precision or several processes only the real step has
the Trainer's autocast and DDP/FSDP wrapper, so the callback hooks the model's forward once instead: the
first training-mode forward carries exactly the inputs ``compute_loss`` passes. The audit leaves every tensor as it found it, so the
real step then runs unchanged; with ``raise_on_error=True`` a failed pre-flight raises ``PreflightFailed``
out of ``trainer.train()`` before any weight has changed.

``StabilityGuardCallback`` puts a ``GuardedOptimizer`` inside the optimizer the Trainer steps (Accelerate's
``AcceleratedOptimizer`` holds the real optimizer in ``.optimizer``), so every update goes through the guard.
The Trainer clips gradients before it steps; clipped gradients hide a spike, so when ``max_grad_norm`` is
set the callback moves the clipping behind the guard's decision (same norm, applied only to accepted steps).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import sys
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

import torch
from torch import nn

from guardtower._dist import current_rank
from guardtower._runs import run_name
from guardtower._validate import flag, no_unknown_kwargs
from guardtower.bus import EventBus, Sink, check_bus_args
from guardtower.errors import ConfigError, MissingDependencyError, PreflightFailed
from guardtower.guard.quarantine import Quarantine
from guardtower.integrations._clip import deferred_clipper
from guardtower.integrations._preflight import PreflightCallbackBase
from guardtower.integrations._run_status import fail_mlflow_runs, failing_runs_on_halt

try:
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
except ImportError as exc:  # pragma: no cover - exercised in a subprocess without transformers
    raise MissingDependencyError("transformers", "hf") from exc

if TYPE_CHECKING:
    from guardtower.guard import GuardedOptimizer
    from guardtower.report import Report

__all__ = ["GuardtowerCallback", "StabilityGuardCallback"]

logger = logging.getLogger("guardtower.integrations.huggingface")

#: how far up the stack the first forward looks for the Trainer's DDP/FSDP wrapper
_MAX_FRAMES = 40
#: how long the final summary at the end of training (or on an exception) may take to reach the sinks
_FINISH_TIMEOUT_S = 10.0
#: the guard's own state in a Trainer checkpoint folder, one file per rank (the Trainer loads ``optimizer.pt``
#: into the plain optimizer before the callback wraps it, and saves it on rank 0 only)
_GUARD_FILE = "guardtower-rank{rank}.pt"


class GuardtowerCallback(PreflightCallbackBase, TrainerCallback):
    """Run ``guardtower.audit`` on the Trainer's first real batch, before the first optimizer step.

    ``raise_on_error=True`` stops ``trainer.train()`` with ``PreflightFailed`` when the audit finds a FAIL;
    otherwise the report is printed (``verbose``) and training goes on. The audit publishes its ``finding``
    and ``preflight`` events to ``sinks`` (e.g. an ``MLflowBridge`` tags the run). ``.report`` holds the
    last report, ``None`` before the first audit. On a failed pre-flight that stops training, the active
    MLflow run is ended FAILED with a ``guardtower.failure_reason`` tag unless ``fail_mlflow_run=False``.
    """

    def __init__(
        self,
        *,
        raise_on_error: bool = False,
        checks: str | Iterable[str] = "all",
        verbose: bool = True,
        sinks: Iterable[Sink] | None = None,
        bus: EventBus | None = None,
        fail_mlflow_run: bool = True,
    ) -> None:
        super().__init__(raise_on_error=raise_on_error, checks=checks, verbose=verbose, sinks=sinks, bus=bus,
                         fail_mlflow_run=fail_mlflow_run)
        self._handle: torch.utils.hooks.RemovableHandle | None = None
        self._optimizer: Any = None
        self._lr_scheduler: Any = None
        self._total_steps: int | None = None

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       model: nn.Module | None = None, optimizer: Any = None, train_dataloader: Any = None,
                       lr_scheduler: Any = None, **kwargs: Any) -> None:
        """Audit now on the first batch of ``train_dataloader`` when the Trainer handed over model, optimizer
        and data (as the original guardtower did); else, and whenever only the real step reproduces the setup
        (autocast, a DDP/FSDP wrapper), audit on the first real training forward."""
        if model is None:
            logger.warning("guardtower: the Trainer passed no model to on_train_begin; pre-flight skipped")
            return
        self._remove_hook()
        self._optimizer = optimizer
        self._lr_scheduler = lr_scheduler
        planned = getattr(state, "max_steps", None)
        self._total_steps = planned if isinstance(planned, int) and planned > 0 else None
        self.run = run_name(None, trainer=getattr(args, "run_name", None))
        if optimizer is not None and train_dataloader is not None and not _needs_real_step(args):
            batch = _first_batch(train_dataloader, model)
            if batch is not None:
                args_, kwargs_ = ((), dict(batch)) if isinstance(batch, Mapping) else (tuple(batch), {})
                self._finish(self.run_audit(model, args_, kwargs_))
                return
        self._handle = model.register_forward_pre_hook(self._first_forward, with_kwargs=True)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        self._remove_hook()
        self._optimizer = None
        self._bus.flush(5.0)

    def close(self) -> None:
        """Detach from the model and close the event bus if this callback created it."""
        self._remove_hook()
        super().close()

    def _remove_hook(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _first_forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Forward pre-hook: audit with this exact call, once, on the first training-mode forward."""
        if not module.training or not torch.is_grad_enabled():
            return None  # an evaluation before training (eval_on_start) is not the first training batch
        self._remove_hook()
        self._finish(self.run_audit(_calling_wrapper(module), args, kwargs))
        return None

    def _finish(self, report: Report | None) -> None:
        if report is not None and self.raise_on_error and not report.ok:
            self._bus.flush(10.0)  # the run's trackers get the failure before train() unwinds
            error = PreflightFailed(report)
            if self.fail_mlflow_run:
                fail_mlflow_runs(error)
            raise error

    def run_audit(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Report | None:
        """Audit ``model`` on one call's inputs with the Trainer's optimizer and scaler; keep and print the report."""
        optimizer = _innermost_optimizer(self._optimizer)
        scaler = getattr(self._optimizer, "scaler", None)

        def step_fn() -> Any:  # the loss exactly as Trainer.compute_loss gets it: model(**inputs).loss
            return model(*args, **kwargs)

        return self._audit(model, step_fn, optimizer=optimizer, inputs=kwargs or args, scaler=scaler,
                           lr_scheduler=self._lr_scheduler, total_steps=self._total_steps)


def _needs_real_step(args: Any) -> bool:
    """Mixed precision and multi-process runs: only the Trainer's own forward carries its autocast and wrapper."""
    if not isinstance(args, TrainingArguments):
        return False
    return bool(args.fp16 or args.bf16 or args.world_size > 1)


def _first_batch(dataloader: Any, model: nn.Module) -> Any:
    """The loader's first batch, on the model's device; the global RNG is put back, so drawing it changes
    neither the shuffling nor the dropout of the real run. None when the loader yields nothing usable."""
    rng = torch.get_rng_state()
    try:
        batch = next(iter(dataloader), None)
    finally:
        torch.set_rng_state(rng)
    if not isinstance(batch, (Mapping, list, tuple)):
        return None
    device = next((p.device for p in model.parameters()), torch.device("cpu"))

    def move(v: Any) -> Any:
        return v.to(device) if isinstance(v, torch.Tensor) else v

    return {k: move(v) for k, v in batch.items()} if isinstance(batch, Mapping) else [move(v) for v in batch]


def _caller_locals(matches: Callable[[Mapping[str, Any]], bool]) -> Mapping[str, Any] | None:
    """The local variables of the nearest frame up the call stack that ``matches``, else None: callbacks are not
    handed the Trainer, its DDP/FSDP wrapper or the checkpoint it resumes from, but all are on the stack that
    calls them."""
    frame: types.FrameType | None = sys._getframe(2)
    for _ in range(_MAX_FRAMES):
        if frame is None:
            break
        if matches(frame.f_locals):
            return frame.f_locals
        frame = frame.f_back
    return None


def _calling_wrapper(module: nn.Module) -> nn.Module:
    """The DDP/FSDP/DeepSpeed wrapper whose forward is calling ``module`` right now, else ``module`` itself.

    The Trainer calls its wrapped model, but callbacks only get the inner one. Auditing the wrapper lets the
    distributed checks see the real setup (no false "model not wrapped", and DDP's unused-parameter hang is
    caught); the wrapper is found on the call stack of this very forward, where it holds ``.module``.
    """
    found = _caller_locals(lambda f: isinstance(f.get("self"), nn.Module) and f["self"] is not module
                           and getattr(f["self"], "module", None) is module)
    return module if found is None else found["self"]


def _running_trainer() -> Any:
    """The ``Trainer`` whose ``train()`` is calling this callback."""
    from transformers import Trainer

    found = _caller_locals(lambda f: isinstance(f.get("self"), Trainer))
    return None if found is None else found["self"]


def _innermost_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    """The user's optimizer under Accelerate's wrapper and a GuardedOptimizer (the audit must not count steps)."""
    seen: set[int] = set()
    while optimizer is not None and id(optimizer) not in seen:
        seen.add(id(optimizer))
        inner = getattr(optimizer, "optimizer", None)
        if inner is None:
            inner = getattr(optimizer, "base_optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            break
        optimizer = inner
    return optimizer if isinstance(optimizer, torch.optim.Optimizer) else None


class StabilityGuardCallback(TrainerCallback):
    """Guard every optimizer step of a ``Trainer`` with a ``GuardedOptimizer``.

    Takes the ``GuardedOptimizer`` arguments (validated now, not at the first step; constructing creates no
    directory, thread or sink). In ``on_train_begin`` the optimizer inside Accelerate's wrapper is replaced
    by a ``GuardedOptimizer`` around it, so the Trainer's own ``optimizer.step()`` goes through the guard.
    Events carry the Trainer's ``global_step``; ``on_log`` adds ``guardtower/spikes``,
    ``guardtower/skipped_steps`` and ``guardtower/rollbacks``.

    The loss is a signal too: a forward hook on the model adds up, on the device, the ``loss`` of every
    training-mode forward (what ``Trainer.compute_loss`` uses, for models that return one), and
    ``on_pre_optimizer_step`` hands their mean over the accumulation window to the guard. No host sync.

    With ``max_grad_norm > 0`` the Trainer would clip before the guard sees the gradients, and a clipped
    spike looks normal. The callback therefore sets ``args.max_grad_norm = 0`` for the run (the Trainer still
    logs the unclipped norm) and clips with the same norm right before each accepted update; the value is
    restored at the end of training. ``clip_in_guard=False`` keeps the Trainer's clipping as it is.
    A halt (``nan_action="raise"``) ends the active MLflow run FAILED unless ``fail_mlflow_run=False``.

    Checkpoints: ``on_save`` writes each rank's guard state (baselines, counters, skip budget, lr back-off)
    next to the Trainer's, as ``guardtower-rank<r>.pt``; a run resumed with ``resume_from_checkpoint`` loads
    it, so the guard decides as if training had never stopped. A rank without a file of its own (more ranks
    than were saved) loads rank 0's.

    Batches: each optimizer step's batch reaches the guard (``observe_batch``) as the Trainer's epoch and the
    index of the step's first micro-batch in it (``micro_batches`` of them under gradient accumulation; the
    same numbering the Trainer resumes by), so a rejected step is named and quarantined. A resumed run replays
    the quarantine (the checkpoint's and the run folder's ``quarantine-rank*.jsonl``, agreed by every rank;
    entries recorded at another world size or per-device batch size are not replayed, with a warning):
    each micro-batch of a quarantined step is not computed (the wrapped ``training_step`` backpropagates a
    zero loss instead, so DDP, GradScaler and the Trainer's counting see an ordinary step) and the guard skips
    the step unjudged. The Trainer still counts it and steps its scheduler, as it did when the step was
    rejected. With ``triage=True`` the wrapped ``training_step`` keeps the step's micro-batches and gives the
    guard a closure that recomputes them with the RNG restored (``observe_recompute``).
    """

    def __init__(
        self,
        spike_threshold: float = 10.0,
        nan_action: str = "skip",
        *,
        clip_in_guard: bool = True,
        sinks: Iterable[Sink] | None = None,
        bus: EventBus | None = None,
        fail_mlflow_run: bool = True,
        **guard_kwargs: Any,
    ) -> None:
        from guardtower.guard import GuardedOptimizer

        for reserved in ("base_optimizer", "model"):
            if reserved in guard_kwargs:
                raise ConfigError(reserved, "is set by the callback from the Trainer",
                                  f"remove {reserved}= from StabilityGuardCallback(...)")
        if not isinstance(clip_in_guard, bool):
            raise ConfigError("clip_in_guard", f"expected True or False, got {clip_in_guard!r}",
                              "pass clip_in_guard=False to keep the Trainer's own clipping")
        flag("fail_mlflow_run", fail_mlflow_run)
        no_unknown_kwargs("StabilityGuardCallback", guard_kwargs,
                          [name for name in inspect.signature(GuardedOptimizer).parameters if name not in ("base_optimizer", "model")])
        user_sinks = check_bus_args(bus, sinks)
        self.guard_kwargs: dict[str, Any] = dict(spike_threshold=spike_threshold, nan_action=nan_action,
                                                 **guard_kwargs)
        self._sinks = user_sinks
        # a throwaway guard validates every argument now; constructing one has no side effect
        GuardedOptimizer(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.0), **self.guard_kwargs,
                         sinks=self._sinks).close()
        self.clip_in_guard = clip_in_guard
        if fail_mlflow_run:
            self.guard_kwargs["on_halt"] = failing_runs_on_halt(self.guard_kwargs.get("on_halt"))
        self._bus = bus
        self.guard: GuardedOptimizer | None = None
        self._holder: Any = None
        self._clip_handle: Any = None
        self._loss_handle: Any = None
        self._loss_sum: torch.Tensor | None = None
        self._loss_count = 0
        self._saved_max_grad_norm: float | None = None
        self._args: TrainingArguments | None = None
        self._trainer: Any = None  # the Trainer whose training_step is wrapped (batches, replay, triage, exceptions)
        self._steps_per_epoch: int | None = None  # optimizer steps per epoch (None: a loader without a length)
        self._batches_per_epoch = 0
        self._accumulation = 1
        self._batch_size: int | None = None  # the train loader's per-rank batch size, and its last batch's
        self._last_batch_size: int | None = None
        self._replay = Quarantine()  # the quarantined steps a resumed run leaves out
        self._current: _Step | None = None  # the optimizer step under way
        self._recomputing = False  # a triage recompute runs: its forwards' losses are not the step's
        self._step_fn: Callable[..., Any] | None = None  # the Trainer's own training_step, unwrapped

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       model: nn.Module | None = None, optimizer: Any = None, **kwargs: Any) -> None:
        from guardtower.guard import GuardedOptimizer

        holder = _step_holder(optimizer)
        if holder is None:
            raise ConfigError(
                "optimizer", f"the Trainer steps a {type(optimizer).__name__}, which holds no inner optimizer to guard",
                "use the Trainer's default Accelerate setup, or wrap your optimizer in GuardedOptimizer yourself",
            )
        inner = holder.optimizer
        if isinstance(inner, GuardedOptimizer):  # a second train() call: keep the guard and its baselines
            self.guard = inner
        else:
            guard_args = dict(self.guard_kwargs)
            guard_args.setdefault("run", run_name(None, trainer=getattr(args, "run_name", None)))
            self.guard = GuardedOptimizer(inner, model, **guard_args, sinks=self._sinks, bus=self._bus)
            _swap_inner_optimizer(holder, self.guard)
            if state.global_step > 0:  # resumed from a checkpoint: the guard goes on from its saved state
                self._restore_guard(args, state)
        # the loop watch judges the Trainer's own cadence: its scheduler, accumulation and planned length
        scheduler = kwargs.get("lr_scheduler")
        self.guard.declare_loop(schedulers=[scheduler] if scheduler is not None else [],
                                accumulation=int(args.gradient_accumulation_steps), total_steps=state.max_steps)
        self._holder = holder
        self._args = args
        self._accumulation = int(args.gradient_accumulation_steps)
        loader = kwargs.get("train_dataloader")
        self._batches_per_epoch, self._steps_per_epoch = _epoch_length(loader, self._accumulation)
        self._replay = Quarantine()
        trainer = _running_trainer()
        self._batch_size = _loader_batch_size(trainer, args)
        self._last_batch_size = _last_batch_size(loader, self._batch_size, self._batches_per_epoch)
        if state.global_step > 0:  # resumed: leave out what the checkpoint and the run folder quarantined
            self._replay = self.guard.quarantine.merged(Quarantine.read(self.guard.log_dir)).agreed(
                self.guard.process_group, batch_size=self._batch_size)
            if self._replay.positions() and getattr(args, "ignore_data_skip", False):
                logger.warning("guardtower: ignore_data_skip=True restarts the epoch from its first batch, so the "
                               "quarantine's positions do not name the same batches; nothing is replayed")
                self._replay = Quarantine()
        self._wrap_training_step(trainer)
        if model is not None and self._loss_handle is None:
            self._loss_handle = model.register_forward_hook(self._record_loss)
        if self.clip_in_guard and args.max_grad_norm and args.max_grad_norm > 0 and not _trainer_shards(args):
            self._saved_max_grad_norm = float(args.max_grad_norm)
            args.max_grad_norm = 0.0
            self._clip_handle = self.guard.base_optimizer.register_step_pre_hook(
                deferred_clipper(self.guard.base_optimizer, self._saved_max_grad_norm))

    def _wrap_training_step(self, trainer: Any) -> None:
        """Wrap this run's ``trainer.training_step`` (undone at the end of training or on an exception): it keeps
        the step's micro-batches (the batch identity, triage's recompute), computes nothing for a quarantined
        step, and on an exception out of a step (HF has no exception callback) still publishes the guard's final
        summary before it propagates."""
        if trainer is None or self._trainer is not None:
            return
        step = trainer.training_step
        guard = self.guard

        def training_step(model: nn.Module, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                current = self._current
                if current is None:
                    return step(model, inputs, *args, **kwargs)
                current.batches.append(inputs)
                if guard is not None and guard.triage:  # what triage's recompute calls again
                    current.calls.append((model, args, kwargs))
                if current.replayed:
                    return _zero_backward(trainer, model)
                return step(model, inputs, *args, **kwargs)
            except BaseException:
                self._unwrap_training_step()
                if guard is not None:
                    guard.finish(_FINISH_TIMEOUT_S)
                raise

        trainer.training_step = training_step
        self._trainer = trainer
        self._step_fn = step

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                      **kwargs: Any) -> None:
        """An optimizer step begins (before its first micro-batch's forward): name its batches for the guard,
        replay the quarantine, and give triage its recompute."""
        if self.guard is None or self._trainer is None:
            return
        current = self._current = _Step()
        epoch = first = None
        count = self._accumulation
        if self._steps_per_epoch is not None:  # the Trainer's own numbering: it resumes by the same arithmetic
            epoch, update = divmod(state.global_step, self._steps_per_epoch)
            first = update * self._accumulation
            count = max(1, min(self._accumulation, self._batches_per_epoch - first))
        self.guard.observe_batch(current.batches, index=first, epoch=epoch, micro_batches=count)
        # the size the step's first batch will have (the epoch's last may be short): a position recorded at
        # another one names other samples now
        size = self._last_batch_size if first == self._batches_per_epoch - 1 else self._batch_size
        if first is not None and self._replay.contains(first, epoch, micro_batches=count, batch_size=size):
            current.replayed = True
            self.guard.skip_quarantined()
        elif self.guard.triage:
            self.guard.observe_recompute(lambda: self._recompute(current))

    def _recompute(self, current: _Step) -> Any:
        """Triage's closure: forward and backward of the step's micro-batches again, synchronising gradients
        on the last one only, as the Trainer did; returns the step's loss."""
        assert self._trainer is not None and self._step_fn is not None
        total = None
        self._recomputing = True
        try:
            for k, (inputs, (model, args, kwargs)) in enumerate(zip(current.batches, current.calls)):
                last = k == len(current.batches) - 1
                with contextlib.nullcontext() if last else self._trainer.accelerator.no_sync(model=model):
                    loss = self._step_fn(model, inputs, *args, **kwargs)
                total = loss if total is None else total + loss
        finally:
            self._recomputing = False
        return total

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        self._current = None  # the guard keeps what it needs of the step (its batch, until the record is read)

    def _unwrap_training_step(self) -> None:
        if self._trainer is not None:
            vars(self._trainer).pop("training_step", None)
            self._trainer = None
        self._current = None

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        """Write this rank's guard state into the checkpoint folder the Trainer just wrote (atomically)."""
        if self.guard is None:
            return
        folder = _checkpoint_folder(args.output_dir, state.global_step)
        folder.mkdir(parents=True, exist_ok=True)  # another rank may not have created it yet
        target = folder / _GUARD_FILE.format(rank=current_rank())
        partial = target.with_suffix(".pt.partial")
        torch.save({"guardtower": self.guard.state_dict()["guardtower"]}, partial)
        os.replace(partial, target)

    def _restore_guard(self, args: TrainingArguments, state: TrainerState) -> None:
        assert self.guard is not None
        found = _resumed_from()
        folders = [Path(found)] if found else [_checkpoint_folder(args.output_dir, state.global_step)]
        for folder in folders:
            for rank in dict.fromkeys((current_rank(), 0)):
                path = folder / _GUARD_FILE.format(rank=rank)
                if path.is_file():
                    self.guard.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
                    return
        logger.warning("guardtower: resumed at step %d without a saved guard state in %s; the guard's baselines "
                       "start over", state.global_step, ", ".join(str(f) for f in folders))

    def _record_loss(self, module: nn.Module, args: Any, output: Any) -> None:
        """Forward hook: add a training forward's loss (a device tensor) to this accumulation window's sum."""
        if not module.training or not torch.is_grad_enabled() or self._recomputing:
            return
        loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            return
        loss = loss.detach().reshape(())
        self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss
        self._loss_count += 1

    def on_pre_optimizer_step(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                              **kwargs: Any) -> None:
        if self.guard is not None:
            # the guard numbers its steps from step_count; the Trainer's update is global_step + 1
            self.guard.step_count = state.global_step
            if self._loss_sum is not None:
                self.guard.observe_loss(self._loss_sum / self._loss_count)
        self._loss_sum, self._loss_count = None, 0

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if self.guard is None or logs is None:
            return
        counters = {
            "guardtower/spikes": self.guard.total_spikes,
            "guardtower/skipped_steps": self.guard.total_skips,
            "guardtower/rollbacks": self.guard.total_rollbacks,
        }
        logs.update(counters)
        history = state.log_history
        if history and history[-1].get("step") == state.global_step:  # Trainer.log stored a copy before on_log
            history[-1].update(counters)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        if self.guard is not None:
            self.guard.finish(_FINISH_TIMEOUT_S)  # the final summary: the log says how many steps the run took
            if self.guard.heartbeat is not None:  # the guard outlives train(); a finished run is not a stalled one
                self.guard.heartbeat.pause()
        self._remove_loss_hook()
        self._restore_clipping()
        self._unwrap_training_step()

    def close(self) -> None:
        """Restore the Trainer's optimizer and clipping, close the guard (and the bus it made)."""
        self._remove_loss_hook()
        self._restore_clipping()
        self._unwrap_training_step()
        if self.guard is not None and self._holder is not None and self._holder.optimizer is self.guard:
            _swap_inner_optimizer(self._holder, self.guard.base_optimizer)
        if self.guard is not None:
            self.guard.close()

    def _remove_loss_hook(self) -> None:
        if self._loss_handle is not None:
            self._loss_handle.remove()
            self._loss_handle = None
        self._loss_sum, self._loss_count = None, 0

    def _restore_clipping(self) -> None:
        if self._clip_handle is not None:
            self._clip_handle.remove()
            self._clip_handle = None
        if self._saved_max_grad_norm is not None and self._args is not None:
            self._args.max_grad_norm = self._saved_max_grad_norm
            self._saved_max_grad_norm = None


@dataclass
class _Step:
    """One optimizer step of the Trainer: its micro-batches and the arguments ``training_step`` got for each."""

    batches: list[Any] = field(default_factory=list)
    calls: list[tuple[nn.Module, tuple[Any, ...], dict[str, Any]]] = field(default_factory=list)
    replayed: bool = False  # quarantined: nothing computed, the guard skips it


def _epoch_length(loader: Any, accumulation: int) -> tuple[int, int | None]:
    """(micro-batches, optimizer steps) per epoch, as ``Trainer.set_initial_training_values`` counts them;
    (0, None) for a loader without a length (the steps are then named by their content only)."""
    try:
        batches = len(loader)
    except TypeError:
        return 0, None
    if batches < 1:
        return 0, None
    return batches, max(batches // accumulation + int(batches % accumulation > 0), 1)


def _last_batch_size(loader: Any, batch_size: int | None, batches: int) -> int | None:
    """The samples in the epoch's last batch of a one-process loader that keeps it (None: unknown, or several
    processes, whose Accelerate shards pad the last batches to full size by default)."""
    import torch.distributed as dist

    if batch_size is None or batches < 1 or (dist.is_available() and dist.is_initialized()
                                             and dist.get_world_size() > 1):
        return None
    try:
        samples = len(loader.dataset)
    except (TypeError, AttributeError):
        return None
    last = samples - (batches - 1) * batch_size
    return last if 0 < last <= batch_size else None


def _loader_batch_size(trainer: Any, args: TrainingArguments) -> int | None:
    """The per-rank batch size the Trainer's train loader batches by (what a replayed position is checked
    against): its ``_train_batch_size`` (``auto_find_batch_size`` lowers it; DataParallel multiplies
    ``per_device_train_batch_size`` by the GPUs), else ``args.train_batch_size``. Not the resumed
    ``state.train_batch_size``: that is the checkpoint's."""
    size = getattr(trainer, "_train_batch_size", None)
    if not isinstance(size, int) or isinstance(size, bool):
        size = getattr(args, "train_batch_size", None)
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None


def _zero_backward(trainer: Any, model: nn.Module) -> torch.Tensor:
    """A quarantined micro-batch: backpropagate a zero loss through every trainable parameter instead, so
    the gradients are zeros and GradScaler, DDP's no_sync and the Trainer see a step with gradients."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        return torch.zeros((), device=trainer.args.device)
    loss = torch.stack([p.sum().float() for p in params]).sum() * 0.0
    trainer.accelerator.backward(loss)
    return loss.detach()


def _resumed_from() -> str | None:
    """The checkpoint the Trainer is resuming from right now: ``resume_from_checkpoint`` of its training
    loop, found on the call stack of ``on_train_begin`` (callbacks are not handed it)."""
    from transformers import Trainer

    found = _caller_locals(lambda f: isinstance(f.get("self"), Trainer) and "resume_from_checkpoint" in f)
    checkpoint = None if found is None else found["resume_from_checkpoint"]
    return checkpoint if isinstance(checkpoint, str) else None


def _checkpoint_folder(output_dir: str | None, global_step: int) -> Path:
    """Where the Trainer writes the checkpoint of ``global_step`` (``Trainer._save_checkpoint``)."""
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    return Path(output_dir or ".") / f"{PREFIX_CHECKPOINT_DIR}-{global_step}"


def _step_holder(optimizer: Any) -> Any:
    """The innermost wrapper whose ``step`` calls ``self.optimizer.step`` (Accelerate's ``AcceleratedOptimizer``)."""
    holder = None
    current = optimizer
    while isinstance(getattr(current, "optimizer", None), torch.optim.Optimizer):
        holder = current
        current = current.optimizer
        if type(current).__name__ == "GuardedOptimizer":
            break
    return holder


def _swap_inner_optimizer(holder: Any, new: torch.optim.Optimizer) -> None:
    """Put ``new`` where ``holder`` keeps its optimizer, including Accelerate's GradScaler step patch."""
    holder.optimizer = new
    if getattr(holder, "scaler", None) is not None and hasattr(holder, "_optimizer_original_step_method"):
        from accelerate.optimizer import patch_optimizer_step

        holder._optimizer_original_step_method = new.step
        holder._optimizer_patched_step_method = patch_optimizer_step(holder, new.step)


def _trainer_shards(args: TrainingArguments) -> bool:
    """FSDP and DeepSpeed clip sharded gradients themselves; the guard then sees clipped gradients."""
    return bool(getattr(args, "fsdp", None)) or bool(getattr(args, "deepspeed", None))
