"""PyTorch Lightning callbacks: a pre-flight audit on the first real batch, and a guarded optimizer.

``GuardtowerPreflight`` audits the first training batch before the first optimizer step, with the module's
own ``training_step`` (through the strategy, so DDP's wrapper and the Trainer's precision/autocast apply),
the Trainer's optimizer and its GradScaler. The audit leaves every tensor as it found it, so the real step
then runs unchanged; with ``raise_on_error=True`` a failed pre-flight raises ``PreflightFailed`` out of
``trainer.fit()`` before any weight has changed.

``GuardtowerGuard`` replaces each optimizer of the strategy by a ``GuardedOptimizer`` around it in
``on_fit_start`` (before a checkpoint is restored, so the guard's own state comes back with it). Lightning
calls ``optimizer.step(closure)`` with automatic and manual optimization alike, so every update goes
through the guard; counters are logged with ``pl_module.log`` and show up in whatever logger is set.
Lightning clips gradients inside that closure, before the guard would see them, and a clipped spike looks
normal: the callback turns the Trainer's clipping off for the run and clips with the same setting right
before each accepted update.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Iterable, Iterator

import torch

from guardtower._runs import run_name
from guardtower._validate import flag
from guardtower.bus import EventBus, Sink, resolve_bus
from guardtower.errors import ConfigError, GradientSpikeError, MissingDependencyError, PreflightFailed
from guardtower.guard.quarantine import Quarantine, leading_size
from guardtower.integrations._clip import deferred_clipper
from guardtower.integrations._preflight import PreflightCallbackBase
from guardtower.integrations._run_status import fail_mlflow_runs

try:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback
except ImportError as exc:  # pragma: no cover - exercised in a subprocess without lightning
    raise MissingDependencyError("lightning", "lightning") from exc

if TYPE_CHECKING:
    from guardtower.guard import GuardedOptimizer
    from guardtower.report import Report

__all__ = ["GuardtowerPreflight", "GuardtowerGuard"]

logger = logging.getLogger("guardtower.integrations.lightning")

#: the metric names the guard's counters are logged under
COUNTER_KEYS = ("guardtower/spikes", "guardtower/skipped_steps", "guardtower/rollbacks")
#: the checkpoint key of every rank's guard states (a list over ranks of a list over optimizers)
_RANKS_KEY = "guardtower_ranks"


class GuardtowerPreflight(PreflightCallbackBase, Callback):
    """Run ``guardtower.audit`` on the Trainer's first training batch, before the first optimizer step.

    ``raise_on_error=True`` stops ``trainer.fit()`` with ``PreflightFailed`` when the audit finds a FAIL;
    otherwise the report is printed (``verbose``) and training goes on. Events go to ``sinks``/``bus``.
    ``.report`` holds the last report (None before). On a failed pre-flight that stops training, the MLflow
    runs (the active one and the Trainer's ``MLFlowLogger``) are set FAILED with a ``guardtower.failure_reason``
    tag unless ``fail_mlflow_run=False``. Manual optimization is not audited: its ``training_step`` steps
    the optimizer itself.
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
        self._pending = False

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._pending = True
        self.run = run_name(None, trainer=logger_run_name(trainer))

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if not self._pending:
            return
        self._pending = False
        if not pl_module.automatic_optimization:
            logger.warning("guardtower: pre-flight skipped: manual optimization steps inside training_step")
            return
        report = self.run_audit(trainer, pl_module, batch, batch_idx)
        if report is not None and self.raise_on_error and not report.ok:
            self._bus.flush(10.0)  # the run's trackers get the failure before fit() unwinds
            raise PreflightFailed(report)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if isinstance(exception, PreflightFailed) and self.fail_mlflow_run:
            fail_mlflow_runs(exception, _mlflow_logger_runs(trainer))

    def run_audit(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                  batch_idx: int) -> Report | None:
        """Audit one ``training_step`` on ``batch`` with the Trainer's optimizer and scaler; keep and print."""
        optimizer = _base_optimizer(trainer.optimizers[0]) if trainer.optimizers else None
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        model = trainer.strategy.model if isinstance(trainer.strategy.model, torch.nn.Module) else pl_module

        def step_fn() -> Any:  # the loss exactly as the training loop gets it, under the Trainer's precision
            out = trainer.strategy.training_step(batch, batch_idx)
            return out["loss"] if isinstance(out, Mapping) else out

        with _no_logging(pl_module):
            return self._audit(model, step_fn, optimizer=optimizer, inputs=batch, scaler=scaler,
                               **_schedule(trainer))


def _schedule(trainer: pl.Trainer) -> dict[str, Any]:
    """The per-step LR scheduler the Trainer steps and the planned optimizer steps, for the audit to walk; a
    per-epoch schedule is left out (the audit walks schedules per optimizer step)."""
    configs = [c for c in getattr(trainer, "lr_scheduler_configs", []) if c.interval == "step" and c.frequency == 1]
    total = _planned_steps(trainer)
    if not configs or total is None:
        return {}
    return {"lr_scheduler": configs[0].scheduler, "total_steps": total}


def _resumable_loader(trainer: pl.Trainer) -> bool:
    """Lightning resumes the train loader mid-epoch itself (every loader has ``state_dict``/``load_state_dict``), as
    its training loop judges it; otherwise a resumed epoch restarts the loader from its first batch."""
    from lightning.fabric.utilities.types import _Stateful

    combined = getattr(trainer.fit_loop, "_combined_loader", None)
    return combined is not None and all(isinstance(loader, _Stateful) for loader in combined.flattened)


def _loader_batch_size(trainer: pl.Trainer) -> int | None:
    """The train loader's per-rank batch size, what a replayed position is checked against (None: several
    loaders, or one batched by its own batch sampler)."""
    loader = trainer.train_dataloader
    size = loader.batch_size if isinstance(loader, torch.utils.data.DataLoader) else None
    return size if isinstance(size, int) and size > 0 else None


class GuardtowerGuard(Callback):
    """Guard every optimizer step of a Lightning ``Trainer`` with a ``GuardedOptimizer``.

    Takes the ``GuardedOptimizer`` arguments (validated now, not at the first step). ``.guards`` holds one
    guard per optimizer of the strategy. The counters are logged every training batch as
    ``guardtower/spikes``, ``guardtower/skipped_steps`` and ``guardtower/rollbacks`` (``log_counters=False``
    turns that off). Each batch's epoch and index reach the guard (``observe_batch``), so a rejected step's
    batch is named and quarantined; Lightning's closure lets ``triage=True`` recompute a rejected step, at every
    precision (under ``16-mixed`` at the GradScaler's scale).
    ``clip_in_guard=False`` leaves Lightning's gradient clipping before the guard. A halt
    (``nan_action="raise"``) sets the MLflow runs FAILED unless ``fail_mlflow_run=False``.

    Under gradient accumulation a step is named by its first batch's index and ``micro_batches``. A run
    resumed with ``fit(ckpt_path=...)`` replays the quarantine (the checkpoint's and the run folder's
    ``quarantine-rank*.jsonl``, agreed by every rank): each batch of a quarantined step is not computed (the
    module's ``training_step`` returns a zero loss over its parameters, so Lightning's backward, DDP and its
    step counting see an ordinary step) and the guards skip the step unjudged; with manual optimization the
    step runs and the guards skip it. The positions are the loader's ``(current_epoch, batch index)``, replayed
    only at the world size and train loader batch size they were recorded at (else they are kept, not replayed,
    with a warning). A loader Lightning cannot resume (a plain ``DataLoader``) starts a mid-epoch resume's data
    over from its first batch while ``batch_idx`` goes on from the checkpoint's (Lightning warns): the callback
    counts positions from that restart, so a quarantined batch is skipped where the loader brings it again.

    Checkpoints: Lightning saves rank 0's optimizer states, so ``on_save_checkpoint`` (which runs on every
    rank) gathers every rank's guard state into the checkpoint, and a resumed rank restores its own (rank 0's
    when it has none: more ranks than were saved).
    """

    def __init__(
        self,
        spike_threshold: float = 10.0,
        nan_action: str = "skip",
        *,
        clip_in_guard: bool = True,
        log_counters: bool = True,
        sinks: Iterable[Sink] | None = None,
        bus: EventBus | None = None,
        fail_mlflow_run: bool = True,
        **guard_kwargs: Any,
    ) -> None:
        from guardtower.guard import GuardedOptimizer

        for reserved in ("base_optimizer", "model"):
            if reserved in guard_kwargs:
                raise ConfigError(reserved, "is set by the callback from the Trainer",
                                  f"remove {reserved}= from GuardtowerGuard(...)")
        for name, value in (("clip_in_guard", clip_in_guard), ("log_counters", log_counters),
                            ("fail_mlflow_run", fail_mlflow_run)):
            flag(name, value)
        self.guard_kwargs: dict[str, Any] = dict(spike_threshold=spike_threshold, nan_action=nan_action,
                                                 **guard_kwargs)
        # build a throwaway guard now so a bad argument fails here, not after the Trainer has started
        probe = GuardedOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0), **self.guard_kwargs)
        probe.close()
        self.clip_in_guard = bool(clip_in_guard)
        self.log_counters = bool(log_counters)
        self.fail_mlflow_run = bool(fail_mlflow_run)
        self._bus, self._owns_bus = resolve_bus(bus, sinks)
        self.guards: list[GuardedOptimizer] = []
        self._clip_handles: list[Any] = []
        self._saved_clip: tuple[Any, Any] | None = None
        self._counters_bridged = False
        self._own_state: list[dict[str, Any]] | None = None  # this rank's guard states from the checkpoint
        self._replay = Quarantine()  # the quarantined steps a resumed run leaves out
        self._batches: list[Any] = []  # the batches of the optimizer step under way
        self._replaying = False  # that step is quarantined
        self._patched: list[tuple[Any, str]] = []  # (object, method) replaced for the fit: training_step, ...
        # (epoch, batch_idx of the loader's first batch in that epoch); None: a resume restarted the loader, and the
        # next batch is its first
        self._offset: tuple[int, int] | None = (0, 0)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from guardtower.guard import GuardedOptimizer

        kwargs = dict(self.guard_kwargs)
        kwargs.setdefault("run", run_name(None, trainer=logger_run_name(trainer)))
        self.guards = [opt if isinstance(opt, GuardedOptimizer)
                       else GuardedOptimizer(opt, pl_module, **kwargs, bus=self._bus)
                       for opt in trainer.strategy.optimizers]
        trainer.strategy.optimizers = list(self.guards)  # also rebuilds the LightningOptimizer wrappers
        schedulers = [config.scheduler for config in trainer.lr_scheduler_configs]
        for guard in self.guards:  # the loop watch judges the Trainer's own cadence
            guard.declare_loop(schedulers=schedulers, accumulation=int(trainer.accumulate_grad_batches),
                               total_steps=_planned_steps(trainer))
        # a TensorBoardBridge on the logger's own writer writes these tags at the guard's steps: not twice
        self._counters_bridged = _bridged_writer(self._bus, trainer)
        self._wrap_training_step(pl_module)
        if any(guard.triage for guard in self.guards):
            self._hand_over_recomputes(trainer.precision_plugin)
        clip_val = trainer.gradient_clip_val
        if self.clip_in_guard and clip_val:
            algorithm = getattr(trainer.gradient_clip_algorithm, "value", None) or "norm"
            self._saved_clip = (clip_val, trainer.gradient_clip_algorithm)
            trainer.gradient_clip_val = None
            self._clip_handles = [guard.base_optimizer.register_step_pre_hook(
                deferred_clipper(guard.base_optimizer, float(clip_val), algorithm)) for guard in self.guards]

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        if len(self.guards) == 1 and optimizer is self.guards[0]:
            # the guard numbers its steps from step_count; this update is the Trainer's global_step + 1
            self.guards[0].step_count = trainer.global_step

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """After Lightning restored the checkpoint: this rank's own guard state, and the quarantine to replay."""
        if self._own_state is not None:
            for guard, section in zip(self.guards, self._own_state):
                guard.load_state_dict({"guardtower": section})
            self._own_state = None
        self._replay = Quarantine()
        # a loader Lightning cannot resume starts the resumed epoch over from its first batch while batch_idx goes
        # on from the checkpoint's: the offset is measured at the first batch (on_train_batch_start)
        restarted = trainer.ckpt_path is not None and not _resumable_loader(trainer)
        self._offset = None if restarted else (trainer.current_epoch, 0)
        if trainer.ckpt_path is not None and self.guards:  # resumed: every rank calls this, so agreeing is safe
            found = Quarantine()
            for guard in self.guards:
                found = found.merged(guard.quarantine).merged(Quarantine.read(guard.log_dir))
            self._replay = found.agreed(self.guards[0].process_group, batch_size=_loader_batch_size(trainer))

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        # the step's identity, by reference: read only if it is rejected (its epoch and first batch's position in
        # the loader, else a fingerprint), and into the quarantine then
        accumulation = max(1, int(trainer.accumulate_grad_batches))
        epoch = trainer.current_epoch
        if self._offset is None:  # the first batch after a resume that restarted the loader is its batch 0
            self._offset = (epoch, batch_idx)
        position = batch_idx - self._offset[1] if epoch == self._offset[0] else batch_idx
        if batch_idx % accumulation == 0 or not self._batches:  # the first batch of an optimizer step
            left = trainer.num_training_batches - batch_idx
            count = int(min(accumulation, left)) if left >= 1 else accumulation
            self._batches = []
            self._replaying = self._replay.contains(position, epoch, micro_batches=count,
                                                    batch_size=leading_size(batch))
            for guard in self.guards:
                guard.observe_batch(self._batches, index=position, epoch=epoch, micro_batches=count)
                if self._replaying:
                    guard.skip_quarantined()
        self._batches.append(batch)

    def _wrap_training_step(self, pl_module: pl.LightningModule) -> None:
        """Wrap the module's ``training_step`` (undone at the end of fit): a quarantined step's batches are not
        computed under automatic optimization; a zero loss over the trainable parameters takes their place."""
        if any(name == "training_step" for _, name in self._patched):
            return
        step = pl_module.training_step

        @functools.wraps(step)
        def training_step(*args: Any, **kwargs: Any) -> Any:
            if self._replaying and pl_module.automatic_optimization:
                return _zero_loss(pl_module)
            return step(*args, **kwargs)

        self._patch(pl_module, "training_step", training_step)

    def _patch(self, owner: Any, name: str, replacement: Any) -> None:
        """Replace ``owner.name`` by an instance attribute for the fit (``_finish`` removes it again)."""
        setattr(owner, name, replacement)
        self._patched.append((owner, name))

    def _hand_over_recomputes(self, plugin: Any) -> None:
        """Wrap the precision plugin's ``optimizer_step`` (undone at the end of fit) so triage gets the step's
        closure whatever the precision. Under a GradScaler (``16-mixed``) the plugin runs the closure itself and
        calls ``scaler.step(guard)`` with none: the guard is handed the closure and the scaler beforehand
        (``observe_recompute``), so a rejected step is recomputed at the loss scale it was computed at. A manual
        ``optimizer.step()`` without a closure cannot be recomputed: a ``ConfigError`` at that first step, before
        anything ran, instead of a recompute that does nothing and labels every incident transient."""
        from lightning.pytorch.core.optimizer import do_nothing_closure

        step = plugin.optimizer_step
        scaler = getattr(plugin, "scaler", None)

        @functools.wraps(step)
        def optimizer_step(optimizer: Any, model: Any, closure: Any, **kwargs: Any) -> Any:
            guard = next((g for g in self.guards if g is optimizer and g.triage), None)
            if guard is not None:
                if closure is do_nothing_closure:
                    raise ConfigError("triage", "manual optimization called optimizer.step() without a closure, "
                                      "so a rejected step cannot be recomputed",
                                      "pass the step's forward and backward as opt.step(closure=...), or "
                                      "construct GuardtowerGuard(triage=False)")
                if scaler is not None:
                    guard.observe_recompute(closure, scaler=scaler)
            return step(optimizer, model=model, closure=closure, **kwargs)

        self._patch(plugin, "optimizer_step", optimizer_step)

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        """Every rank's guard states into the checkpoint that rank 0 writes (this runs on every rank: one
        ``all_gather_object`` per checkpoint, none per step)."""
        own = [guard.state_dict()["guardtower"] for guard in self.guards]
        gathered: list[Any] = [own]
        if torch.distributed.is_available() and torch.distributed.is_initialized() and trainer.world_size > 1:
            gathered = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(gathered, own)
        checkpoint[_RANKS_KEY] = gathered

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        """Keep this rank's guard states (rank 0's when the checkpoint has fewer ranks) for ``on_train_start``:
        Lightning loads the optimizer states, rank 0's, after this."""
        saved = checkpoint.get(_RANKS_KEY)
        if not isinstance(saved, list) or not saved:
            return
        own = saved[trainer.global_rank] if trainer.global_rank < len(saved) else saved[0]
        self._own_state = list(own) if isinstance(own, list) else None

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.log_counters and self.guards and not self._counters_bridged:
            pl_module.log_dict(self.counters(), on_step=True, on_epoch=False, batch_size=1)

    def counters(self) -> dict[str, float]:
        """Spikes, skipped steps and rollbacks so far, summed over the guards."""
        totals = (sum(g.total_spikes for g in self.guards), sum(g.total_skips for g in self.guards),
                  sum(g.total_rollbacks for g in self.guards))
        return {key: float(value) for key, value in zip(COUNTER_KEYS, totals)}

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._finish(trainer)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._finish(trainer)
        if isinstance(exception, GradientSpikeError) and self.fail_mlflow_run:
            fail_mlflow_runs(exception, _mlflow_logger_runs(trainer))

    def _finish(self, trainer: pl.Trainer) -> None:
        """Publish what is pending, stop the guards' watchdogs, give the Trainer its clipping, and the module and the
        precision plugin the methods replaced for the fit, back."""
        for owner, name in self._patched:
            vars(owner).pop(name, None)
        self._patched = []
        self._batches, self._replaying = [], False
        for handle in self._clip_handles:
            handle.remove()
        self._clip_handles = []
        if self._saved_clip is not None:
            trainer.gradient_clip_val, trainer.gradient_clip_algorithm = self._saved_clip
            self._saved_clip = None
        for guard in self.guards:
            guard.close()

    def close(self) -> None:
        """Close the guards, and the event bus if this callback created it."""
        for guard in self.guards:
            guard.close()
        if self._owns_bus:
            self._bus.close(5.0)


def _zero_loss(module: torch.nn.Module) -> torch.Tensor:
    """Zero, with a gradient path through every trainable parameter (DDP expects a gradient for each)."""
    params = [p for p in module.parameters() if p.requires_grad]
    return torch.stack([p.sum().float() for p in params]).sum() * 0.0


def _planned_steps(trainer: pl.Trainer) -> int | None:
    """The optimizer steps the Trainer plans (None when it cannot say: an unbounded run)."""
    try:
        steps = trainer.estimated_stepping_batches
    except Exception:  # noqa: BLE001 - a loader without a length: the watch does without
        return None
    return int(steps) if isinstance(steps, (int, float)) and math.isfinite(steps) and steps > 0 else None


def logger_run_name(trainer: pl.Trainer) -> str | None:
    """The run name of the Trainer's first logger: W&B's and MLflow's run name, else ``<name>-<version>``
    (TensorBoard, CSV: ``lightning_logs-version_0``); None without a logger."""
    found = trainer.logger
    if found is None:
        return None
    try:
        for attr in ("_run_name", "run_name"):
            value = getattr(found, attr, None)
            if isinstance(value, str) and value:
                return value
        experiment_name = getattr(getattr(found, "_experiment", None), "name", None)
        if isinstance(experiment_name, str) and experiment_name and type(found).__name__ == "WandbLogger":
            return experiment_name
        name, version = found.name, found.version
    except Exception:  # a logger that cannot say its name is not worth failing a run for
        return None
    if not name:
        return None
    if version is None:
        return str(name)
    return f"{name}-version_{version}" if isinstance(version, int) else f"{name}-{version}"


def _bridged_writer(bus: EventBus, trainer: pl.Trainer) -> bool:
    """A ``TensorBoardBridge`` on ``bus`` writes to a logger's own ``SummaryWriter`` (``logger.experiment``)."""
    writers = {id(getattr(sink, "_writer", None)) for sink in bus.sinks if type(sink).__name__ == "TensorBoardBridge"}
    for found in trainer.loggers:
        experiment = getattr(found, "_experiment", None)
        if experiment is not None and id(experiment) in writers:
            return True
    return False


def _base_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    """The user's optimizer under a GuardedOptimizer (the audit must not count a guarded step)."""
    inner = getattr(optimizer, "base_optimizer", optimizer)
    return inner if isinstance(inner, torch.optim.Optimizer) else None


def _mlflow_logger_runs(trainer: pl.Trainer) -> list[tuple[Any, str]]:
    """(client, run id) of each ``MLFlowLogger`` of the Trainer whose run exists."""
    from lightning.pytorch.loggers import MLFlowLogger

    runs = []
    for found in trainer.loggers:
        if isinstance(found, MLFlowLogger) and found.run_id is not None:
            runs.append((found.experiment, found.run_id))
    return runs


@contextlib.contextmanager
def _no_logging(pl_module: pl.LightningModule) -> Iterator[None]:
    """Silence ``self.log`` while the audit runs ``training_step``: its metrics are not a training step's."""

    def ignore(*args: Any, **kwargs: Any) -> None:
        return None

    pl_module.log, pl_module.log_dict = ignore, ignore  # type: ignore[method-assign]
    try:
        yield
    finally:
        del pl_module.log, pl_module.log_dict
