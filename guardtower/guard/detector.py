"""Spike detectors: judge one step's per-tensor gradient norms against baselines kept on the device.

A detector never leaves the device and never reads a value back to the host: ``judge`` returns tensors,
``update`` folds the step into the baselines with ``torch.where`` so that a rejected step changes nothing.
The guard calls ``judge`` first and ``update`` second, always in that order, so the step being judged is
never part of the baseline it is compared with.

``AutoDetector`` (the default) judges each tensor's share of the gradient, the global norm and the loss,
each against its own level, variance and recent peak, and absorbs a sustained level shift; it was chosen on
``bench/detection.py`` (healthy runs of several model families from step 0, injected incidents, the published
rules). ``RatioDetector`` (the old default) compares each norm with an EMA of past accepted log-norms (a
geometric mean); ``ZScoreDetector`` adds an EMA variance. The two others are the rules published guards use,
kept as real detectors for comparison: ``PreUpdateEMADetector`` updates its (linear) EMA with every step
*before* comparing, and ``RollingSigmaDetector`` flags a norm above the mean plus k standard deviations of a
rolling window.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any, NamedTuple

import torch
from torch import Tensor

from guardtower.errors import ConfigError

__all__ = [
    "Verdict",
    "Detector",
    "AutoDetector",
    "RatioDetector",
    "ZScoreDetector",
    "PreUpdateEMADetector",
    "RollingSigmaDetector",
    "DETECTORS",
    "make_detector",
]

_TINY = 1e-30


class Verdict(NamedTuple):
    """One step's judgement, all on the device. Non-finite norms are the guard's business, not the detector's."""

    tripped: Tensor  # bool [n]: this tensor alone would reject the step
    ratios: Tensor  # float32 [n]: norm / baseline, for reports
    baselines: Tensor  # float32 [n]
    global_tripped: Tensor  # bool 0-d
    global_ratio: Tensor  # float32 0-d
    global_baseline: Tensor  # float32 0-d
    limits: Tensor  # float32 [n]: the largest norm this tensor could have had and been accepted (inf: cannot trip)
    global_limit: Tensor  # float32 0-d: the same for the global norm (what nan_action="clip" scales down to)
    loss_tripped: Tensor  # bool 0-d: the loss alone would reject the step (False when the loss is NaN/absent)
    absorbed: Tensor  # bool 0-d: would have tripped, but accepted as a sustained level shift (re-baselined)

    @property
    def spike(self) -> Tensor:
        return self.tripped.any() | self.global_tripped | self.loss_tripped


class Detector(ABC):
    """Per-tensor and global baselines in device tensors.

    Subclasses list their per-tensor state in ``_per_tensor`` (attribute name -> initial value) and their
    global state in ``_scalars``; ``resize`` and ``state_dict`` are generic over those.
    """

    name: str = "detector"
    threshold: float = 10.0
    _per_tensor: dict[str, float] = {}
    _scalars: dict[str, float] = {}
    _global_slot: bool = False

    def __init__(self) -> None:
        self.n = 0
        self.device = torch.device("cpu")
        self._state: dict[str, Tensor] = {}

    def resize(self, n: int, device: torch.device) -> None:
        """Make room for ``n`` tensors on ``device``; existing baselines keep their positions.

        With ``_global_slot`` the per-tensor arrays have one more entry, last, for the global norm.
        """
        if n == self.n and device == self.device and self._state:
            return
        extra = int(self._global_slot)
        new: dict[str, Tensor] = {}
        for key, init in self._per_tensor.items():
            t = torch.full((n + extra,), init, dtype=torch.float32, device=device)
            old = self._state.get(key)
            if old is not None:
                keep = min(n, old.shape[0] - extra)
                t[:keep] = old[:keep].to(device)
                if extra:
                    t[-1] = old[-1].to(device)
            new[key] = t
        for key, init in self._scalars.items():
            old = self._state.get(key)
            new[key] = old.to(device) if old is not None else torch.full((), init, dtype=torch.float32, device=device)
        self._state = new
        self.n = n
        self.device = device

    @abstractmethod
    def judge(self, norms: Tensor, global_norm: Tensor, loss: Tensor) -> Verdict:
        """Compare this step's norms (and loss, float32 0-d, NaN when absent) with the baselines; no state change."""

    @abstractmethod
    def update(self, norms: Tensor, global_norm: Tensor, loss: Tensor, accept: Tensor) -> None:
        """Fold the step into the baselines where ``accept`` (bool 0-d) holds; a no-op otherwise."""

    def state_dict(self) -> dict[str, Any]:
        return {"name": self.name, "n": self.n, "state": {k: v.detach().cpu().clone() for k, v in self._state.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``; everything is checked first, so a bad dict changes nothing."""
        self.check_state_dict(state)
        saved = state["state"]
        self._state = {k: saved[k].to(self.device, torch.float32).clone() for k in self._state}

    def check_state_dict(self, state: Any) -> None:
        """Raise ``ConfigError`` unless ``state`` is a complete state dict of this detector at this size."""
        fix = "load a state dict saved from the same model, parameter groups and detector"
        if not isinstance(state, dict) or state.get("name") != self.name:
            found = state.get("name") if isinstance(state, dict) else type(state).__name__
            raise ConfigError("state_dict", f"guard state was saved with detector {found!r}, this guard uses "
                                            f"{self.name!r}", "construct the GuardedOptimizer with the same detector")
        if state.get("n") != self.n:
            raise ConfigError("state_dict", f"guard state covers {state.get('n')!r} gradient tensors, this "
                                            f"optimizer has {self.n}", fix)
        saved = state.get("state")
        if not isinstance(saved, dict) or set(saved) != set(self._state):
            keys = sorted(saved) if isinstance(saved, dict) else saved
            raise ConfigError("state_dict", f"detector state holds {keys!r}, expected {sorted(self._state)}", fix)
        for key, current in self._state.items():
            value = saved[key]
            if not isinstance(value, Tensor) or value.shape != current.shape:
                shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
                raise ConfigError("state_dict", f"detector state {key!r} is {shape}, expected "
                                                f"{tuple(current.shape)}", fix)


def _warm(count: Tensor, warmup: int) -> Tensor:
    return count >= warmup


def _limit(warm: Tensor, limit: Tensor) -> Tensor:
    """The accepted-norm ceiling where the detector can trip, ``inf`` where it cannot (still warming up)."""
    return torch.where(warm, limit, torch.full_like(limit, math.inf))


def _norm_verdict(tripped: Tensor, ratios: Tensor, baselines: Tensor, limits: Tensor, g_tripped: Tensor,
                  g_ratio: Tensor, g_baseline: Tensor, g_limit: Tensor) -> Verdict:
    """A verdict of a detector that judges the norms only: the loss never trips, nothing is absorbed."""
    false = torch.zeros((), dtype=torch.bool, device=tripped.device)
    return Verdict(tripped, ratios, baselines, g_tripped, g_ratio, g_baseline, limits, g_limit, false, false)


def _valid(norms: Tensor, accept: Tensor) -> Tensor:
    """Observations that may enter a baseline: accepted step, finite and non-zero norm."""
    return accept & torch.isfinite(norms) & (norms > 0)


def _check_common(threshold: float, ema_alpha: float, warmup_steps: int, threshold_arg: str) -> None:
    if not (isinstance(threshold, (int, float)) and not isinstance(threshold, bool) and math.isfinite(threshold)
            and threshold > 0):
        raise ConfigError(threshold_arg, f"must be a positive number, got {threshold!r}", f"pass e.g. {threshold_arg}=10.0")
    if not (isinstance(ema_alpha, (int, float)) and not isinstance(ema_alpha, bool) and 0 < ema_alpha < 1):
        raise ConfigError("ema_alpha", f"must lie strictly between 0 and 1, got {ema_alpha!r}", "pass e.g. ema_alpha=0.01")
    if not (isinstance(warmup_steps, int) and not isinstance(warmup_steps, bool) and warmup_steps >= 0):
        raise ConfigError("warmup_steps", f"must be a non-negative int, got {warmup_steps!r}", "pass e.g. warmup_steps=10")


class _LogEMA(Detector):
    """Shared state of the log-domain detectors: EMA of log-norms with a running-mean start.

    The step size is ``max(ema_alpha, 1/(count+1))``: a plain mean over the first ``1/ema_alpha`` accepted
    steps (so warmup ends with an unbiased baseline), then an EMA. The global norm rides along as the last
    slot of the per-tensor arrays, so each step costs a handful of vector ops whatever the model size.
    """

    _per_tensor = {"log_base": 0.0, "log_var": 0.0, "count": 0.0}
    _global_slot = True
    _track_var = True

    def __init__(self, threshold: float, ema_alpha: float, warmup_steps: int, floor: float) -> None:
        super().__init__()
        self.threshold = float(threshold)
        self.ema_alpha = float(ema_alpha)
        self.warmup_steps = int(warmup_steps)
        if not (isinstance(floor, (int, float)) and 0 <= floor < 1):
            raise ConfigError("norm_floor", f"must lie in [0, 1), got {floor!r}", "pass e.g. norm_floor=1e-3")
        self.floor = float(floor)

    def _ratios(self, norms: Tensor, global_norm: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """(x, ratios, baselines, effective baselines, warm) over the n tensors plus the global slot."""
        s = self._state
        x = torch.cat([norms, global_norm.reshape(1)])
        warm = (s["count"] >= self.warmup_steps) & (s["count"] > 0)
        base = torch.exp(s["log_base"]) * (s["count"] > 0)
        # a tensor whose baseline is below floor * global baseline is judged against that floor instead
        floor = base[-1:] * self.floor
        effective = torch.maximum(base, floor).clamp_min(_TINY)
        effective[-1:] = base[-1:].clamp_min(_TINY)
        return x, x / effective, base, effective, warm

    @staticmethod
    def _verdict(tripped: Tensor, ratios: Tensor, base: Tensor, limits: Tensor) -> Verdict:
        return _norm_verdict(tripped[:-1], ratios[:-1], base[:-1], limits[:-1], tripped[-1], ratios[-1], base[-1],
                             limits[-1])

    def update(self, norms: Tensor, global_norm: Tensor, loss: Tensor, accept: Tensor) -> None:
        s = self._state
        x = torch.cat([norms, global_norm.reshape(1)])
        valid = accept & torch.isfinite(x) & (x > 0)
        log_x = torch.log(torch.where(valid, x, torch.ones_like(x)))
        step = torch.clamp_min(1.0 / (s["count"] + 1.0), self.ema_alpha)
        delta = log_x - s["log_base"]
        if self._track_var:
            new_var = (1.0 - step) * (s["log_var"] + step * delta * delta)
            s["log_var"].copy_(torch.where(valid, new_var, s["log_var"]))
        s["log_base"].add_(torch.where(valid, step * delta, torch.zeros_like(delta)))
        s["count"].add_(valid.to(torch.float32))


class RatioDetector(_LogEMA):
    """Reject when a tensor's (or the global) norm exceeds ``threshold`` x its EMA baseline. The default."""

    name = "ratio"
    _track_var = False

    def __init__(self, threshold: float = 10.0, ema_alpha: float = 0.01, warmup_steps: int = 10,
                 floor: float = 1e-3) -> None:
        _check_common(threshold, ema_alpha, warmup_steps, "spike_threshold")
        super().__init__(threshold, ema_alpha, warmup_steps, floor)

    def judge(self, norms: Tensor, global_norm: Tensor, loss: Tensor) -> Verdict:
        _, ratios, base, effective, warm = self._ratios(norms, global_norm)
        return self._verdict(warm & (ratios > self.threshold), ratios, base, _limit(warm, effective * self.threshold))


class ZScoreDetector(_LogEMA):
    """Reject when a log-norm is more than ``z_threshold`` EMA standard deviations above its EMA mean.

    ``min_ratio`` keeps near-constant series (tiny variance) from tripping on small moves.
    """

    name = "zscore"

    def __init__(self, z_threshold: float = 6.0, ema_alpha: float = 0.01, warmup_steps: int = 10,
                 floor: float = 1e-3, min_ratio: float = 3.0) -> None:
        _check_common(z_threshold, ema_alpha, warmup_steps, "z_threshold")
        super().__init__(z_threshold, ema_alpha, warmup_steps, floor)
        self.min_ratio = float(min_ratio)

    def judge(self, norms: Tensor, global_norm: Tensor, loss: Tensor) -> Verdict:
        _, ratios, base, effective, warm = self._ratios(norms, global_norm)
        std = torch.sqrt(self._state["log_var"]).clamp_min(1e-3)
        z = torch.log(ratios.clamp_min(_TINY)) / std
        # tripping needs both z > threshold and ratio > min_ratio: the ceiling is the larger of the two bounds
        ceiling = effective * torch.maximum(torch.exp(self.threshold * std), torch.full_like(std, self.min_ratio))
        return self._verdict(warm & (z > self.threshold) & (ratios > self.min_ratio), ratios, base,
                             _limit(warm, ceiling))


class _AutoStep(NamedTuple):
    """One step as ``AutoDetector`` sees it, per slot; computed by ``judge`` and reused by ``update``."""

    log_x: Tensor
    robust: Tensor
    valid: Tensor
    tripped: Tensor
    absorb: Tensor
    run: Tensor
    run_sum: Tensor
    run_max: Tensor
    run_min: Tensor
    limit: Tensor
    ratio: Tensor
    base: Tensor


class AutoDetector(Detector):
    """The default: a step is a spike when a gradient norm (or the loss) leaves its own recent range.

    Slots: every gradient tensor's *share* (its norm over the norm of all other tensors, which cancels the
    common-mode swings that move every gradient together: batch difficulty, a loss near zero), the global
    norm, and the loss when given. Each slot keeps, over accepted steps only, a fast EMA level and a slow EMA
    variance of its log value and a peak envelope (the largest recent value, forgetting a factor 10 per 100
    accepted steps). A slot trips when its value exceeds

    - ``threshold`` x its peak envelope (heavy-tailed series: anything far beyond what was seen), **or**
    - ``threshold`` x its level (``loss_ratio`` x for the loss) *and* ``sigmas`` standard deviations above
      it in log space (stable series: a jump far outside their noise).

    Warmup is an effective sample count: the variance starts from a prior (log-std 0.5 with the weight of
    4 observations) that fades as accepted observations accumulate, and ``warmup_steps=0`` lets the first
    accepted observation seed the baseline. A tensor whose typical share is below ``floor`` is judged
    against that floor, so a negligible gradient cannot trip.

    A sustained level shift is absorbed: when a slot has tripped ``absorb_after`` times in a row with values
    within a factor ``threshold`` of each other, that step is accepted (``Verdict.absorbed``) and the slot
    re-baselined on them. Spikes that come and go, or keep growing, never qualify.
    """

    name = "auto"
    _per_tensor = {"mean": 0.0, "var": 0.0, "count": 0.0, "peak": 0.0, "run": 0.0, "run_sum": 0.0,
                   "run_max": 0.0, "run_min": 0.0}
    _LEVEL_ALPHA = 0.1  # the level follows trends within ~10 accepted steps; the variance uses ema_alpha
    # the variance prior: a series may move by e^0.5 per step until data says otherwise; a loss, once 10 of
    # its values are in (a handful of noisy losses says little about their spread), by e^0.1
    _PRIOR_STD, _LOSS_PRIOR_STD, _PRIOR_WEIGHT, _LOSS_PRIOR_AFTER = 0.5, 0.1, 4.0, 10
    _PEAK_DECAY = math.log(10.0) / 100  # per accepted step, in log units
    _WINSOR = 4.0

    def __init__(self, threshold: float = 10.0, *, sigmas: float = 6.0, loss_ratio: float = 1.5,
                 ema_alpha: float = 0.01, warmup_steps: int = 10, floor: float = 1e-3,
                 absorb_after: int = 8) -> None:
        super().__init__()
        _check_common(threshold, ema_alpha, warmup_steps, "spike_threshold")
        if not (isinstance(sigmas, (int, float)) and math.isfinite(sigmas) and sigmas > 0):
            raise ConfigError("sigmas", f"must be a positive number, got {sigmas!r}", "pass e.g. sigmas=6.0")
        if not (isinstance(loss_ratio, (int, float)) and math.isfinite(loss_ratio) and loss_ratio > 1):
            raise ConfigError("loss_ratio", f"must be a number above 1, got {loss_ratio!r}", "pass e.g. loss_ratio=1.5")
        if not (isinstance(floor, (int, float)) and 0 <= floor < 1):
            raise ConfigError("norm_floor", f"must lie in [0, 1), got {floor!r}", "pass e.g. norm_floor=1e-3")
        if not (isinstance(absorb_after, int) and not isinstance(absorb_after, bool) and absorb_after >= 2):
            raise ConfigError("absorb_after", f"must be an int >= 2, got {absorb_after!r}", "pass e.g. absorb_after=8")
        self.threshold = float(threshold)
        self.sigmas = float(sigmas)
        self.loss_ratio = float(loss_ratio)
        self.ema_alpha = float(ema_alpha)
        self.warmup_steps = int(warmup_steps)
        self.floor = float(floor)
        self.absorb_after = absorb_after
        self._log_ratio = torch.zeros(0)
        self._prior = torch.zeros(0)
        self._pending: tuple[Tensor, Tensor, Tensor, _AutoStep] | None = None

    def resize(self, n: int, device: torch.device) -> None:
        """Slots: the ``n`` tensors, then the global norm, then the loss (both kept at the end)."""
        if n == self.n and device == self.device and self._state:
            return
        new: dict[str, Tensor] = {}
        for key, init in self._per_tensor.items():
            t = torch.full((n + 2,), init, dtype=torch.float32, device=device)
            old = self._state.get(key)
            if old is not None:
                keep = min(n, old.shape[0] - 2)
                t[:keep] = old[:keep].to(device)
                t[-2:] = old[-2:].to(device)
            new[key] = t
        self._state = new
        self.n = n
        self.device = device
        gate = torch.full((n + 2,), math.log(self.threshold), device=device)
        gate[-1] = math.log(self.loss_ratio)
        self._log_ratio = gate
        prior = torch.full((n + 2,), self._PRIOR_WEIGHT * self._PRIOR_STD ** 2, device=device)
        prior[-1] = self._PRIOR_WEIGHT * self._LOSS_PRIOR_STD ** 2
        self._prior = prior
        self._pending = None

    def _step(self, norms: Tensor, global_norm: Tensor, loss: Tensor) -> _AutoStep:
        """Everything ``judge`` and ``update`` need about one step, on the device."""
        s = self._state
        g2 = global_norm * global_norm
        rest = torch.sqrt(torch.clamp_min(g2 - norms * norms, g2 * 1e-6))
        x = torch.cat([norms / rest, global_norm.reshape(1), loss.to(norms.dtype).reshape(1)])
        valid = torch.isfinite(x) & (x > 0)
        log_x = torch.log(torch.where(valid, x, torch.ones_like(x)))
        mean, count, run = s["mean"], s["count"], s["run"]
        log_base = mean.clone()
        log_base[:-2] = torch.clamp_min(mean[:-2], math.log(max(self.floor, _TINY)))
        n_eff = count.clamp_max(2.0 / self.ema_alpha)
        prior = torch.where(count >= self._LOSS_PRIOR_AFTER, self._prior, self._PRIOR_WEIGHT * self._PRIOR_STD ** 2)
        std = torch.sqrt((n_eff * s["var"] + prior) / (n_eff + self._PRIOR_WEIGHT))
        outlier = torch.maximum(log_base + self._log_ratio, mean + self.sigmas * std)
        beyond_peak = torch.maximum(s["peak"], log_base) + math.log(self.threshold)
        ceiling = torch.minimum(outlier, beyond_peak)
        seeded = count > 0
        warm = seeded & (count >= self.warmup_steps)
        raw = warm & valid & (log_x > ceiling)
        in_run = run > 0
        zero = torch.zeros_like(log_x)
        new_run = torch.where(raw, run + 1.0, zero)
        run_sum = torch.where(raw, torch.where(in_run, s["run_sum"], zero) + log_x, zero)
        run_max = torch.where(raw, torch.where(in_run, torch.maximum(s["run_max"], log_x), log_x), zero)
        run_min = torch.where(raw, torch.where(in_run, torch.minimum(s["run_min"], log_x), log_x), zero)
        absorb = raw & (new_run >= self.absorb_after) & (run_max - run_min <= math.log(self.threshold))
        # back from shares to norms for the limits and baselines the guard reports and clips to
        scale = torch.cat([rest, rest.new_ones(2)])
        limit = torch.where(warm, torch.exp(ceiling) * scale, torch.full_like(x, math.inf))
        base = torch.exp(log_base) * scale * seeded
        # what enters the baseline: winsorized at 4 std, so one accepted outlier (in warmup, or just below the
        # ceiling) moves the level, variance and envelope by a bounded amount
        robust = torch.where(seeded, mean + torch.clamp(log_x - mean, -self._WINSOR * std, self._WINSOR * std), log_x)
        return _AutoStep(log_x, robust, valid, raw & ~absorb, absorb, new_run, run_sum, run_max, run_min, limit,
                         x * scale / base.clamp_min(_TINY) * seeded, base)

    def judge(self, norms: Tensor, global_norm: Tensor, loss: Tensor) -> Verdict:
        step = self._step(norms, global_norm, loss)
        self._pending = (norms, global_norm, loss, step)  # a cache for update() of this same step, not state
        t = step.tripped
        return Verdict(t[:-2], step.ratio[:-2], step.base[:-2], t[-2], step.ratio[-2], step.base[-2],
                       step.limit[:-2], step.limit[-2], t[-1], step.absorb.any() & ~t.any())

    def update(self, norms: Tensor, global_norm: Tensor, loss: Tensor, accept: Tensor) -> None:
        pending = self._pending
        if pending is not None and pending[0] is norms and pending[1] is global_norm and pending[2] is loss:
            step = pending[3]
        else:
            step = self._step(norms, global_norm, loss)
        self._pending = None
        s = self._state
        fold = accept & step.valid & ~step.absorb
        rebase = accept & step.absorb
        first = 1.0 / (s["count"] + 1.0)
        rate = torch.clamp_min(first, self.ema_alpha)
        delta = step.robust - s["mean"]
        s["var"].copy_(torch.where(fold, (1.0 - rate) * (s["var"] + rate * delta * delta), s["var"]))
        level = s["mean"] + torch.clamp_min(first, self._LEVEL_ALPHA) * delta
        s["mean"].copy_(torch.where(fold, level, torch.where(rebase, step.run_sum / step.run, s["mean"])))
        decayed = torch.where(s["count"] > 0, s["peak"] - self._PEAK_DECAY, step.robust)
        s["peak"].copy_(torch.where(fold, torch.maximum(decayed, step.robust),
                                    torch.where(rebase, step.run_max, s["peak"])))
        s["count"].add_(fold.to(torch.float32))
        # the run of consecutive trips is counted on rejected steps too: that is what lets a shift be absorbed
        zero = torch.zeros_like(step.run)
        s["run"].copy_(torch.where(rebase, zero, step.run))
        s["run_sum"].copy_(torch.where(rebase, zero, step.run_sum))
        s["run_max"].copy_(torch.where(rebase, zero, step.run_max))
        s["run_min"].copy_(torch.where(rebase, zero, step.run_min))


class PreUpdateEMADetector(Detector):
    """The common published rule: a linear EMA updated with every finite step *before* the comparison.

    Kept for comparison only. Its ratio can never exceed ``1/ema_alpha``, and a spike it flags still enters
    the baseline, which then hides the next incidents until it decays.
    """

    name = "pre_update_ema"
    _per_tensor = {"ema": 0.0, "count": 0.0}
    _scalars = {"g_ema": 0.0, "g_count": 0.0}

    def __init__(self, threshold: float = 10.0, ema_alpha: float = 0.01, warmup_steps: int = 10) -> None:
        super().__init__()
        _check_common(threshold, ema_alpha, warmup_steps, "spike_threshold")
        self.threshold = float(threshold)
        self.ema_alpha = float(ema_alpha)
        self.warmup_steps = warmup_steps

    def _folded(self, x: Tensor, ema: Tensor, count: Tensor) -> tuple[Tensor, Tensor]:
        """(EMA, count) with ``x`` folded in wherever it is finite, whether the step is accepted or not."""
        finite = torch.isfinite(x)
        new = torch.where(count == 0, x, (1 - self.ema_alpha) * ema + self.ema_alpha * x)
        return torch.where(finite, new, ema), count + finite.to(count.dtype)

    def _ceiling(self, ema: Tensor, count: Tensor) -> Tensor:
        """Solve x = threshold * ((1 - alpha) * ema + alpha * x) for x: the largest norm that passes."""
        gain = 1.0 - self.threshold * self.ema_alpha
        ceiling = self.threshold * (1.0 - self.ema_alpha) * ema / gain if gain > 0 else torch.full_like(ema, math.inf)
        return _limit(_warm(count + 1, self.warmup_steps) & (count > 0), ceiling)

    def judge(self, norms: Tensor, global_norm: Tensor, loss: Tensor) -> Verdict:
        s = self._state
        ema, count = self._folded(norms, s["ema"], s["count"])
        g_ema, g_count = self._folded(global_norm, s["g_ema"], s["g_count"])
        ratios = norms / ema.clamp_min(_TINY)
        g_ratio = global_norm / g_ema.clamp_min(_TINY)
        tripped = _warm(count, self.warmup_steps) & (ratios > self.threshold)
        g_tripped = _warm(g_count, self.warmup_steps) & (g_ratio > self.threshold)
        return _norm_verdict(tripped, ratios, ema, self._ceiling(s["ema"], s["count"]), g_tripped, g_ratio, g_ema,
                             self._ceiling(s["g_ema"], s["g_count"]))

    def update(self, norms: Tensor, global_norm: Tensor, loss: Tensor, accept: Tensor) -> None:
        """Folds in every finite step, ``accept`` or not: that is the flaw this detector demonstrates."""
        s = self._state
        for x, ema_key, count_key in ((norms, "ema", "count"), (global_norm, "g_ema", "g_count")):
            ema, count = self._folded(x, s[ema_key], s[count_key])
            s[ema_key].copy_(ema)
            s[count_key].copy_(count)


class RollingSigmaDetector(Detector):
    """Flag a norm above mean + ``sigmas`` x std of the last ``window`` accepted steps."""

    name = "rolling_sigma"
    _per_tensor = {"count": 0.0}
    _scalars = {"g_count": 0.0}

    def __init__(self, window: int = 128, sigmas: float = 6.0, warmup_steps: int = 10) -> None:
        super().__init__()
        if not (isinstance(window, int) and window >= 2):
            raise ConfigError("window", f"must be an int >= 2, got {window!r}", "pass e.g. window=128")
        _check_common(sigmas, 0.5, warmup_steps, "sigmas")
        self.window = window
        self.threshold = float(sigmas)
        self.warmup_steps = max(2, warmup_steps)
        self._ring = torch.full((window, 0), float("nan"))
        self._g_ring = torch.full((window,), float("nan"))
        self._pos = torch.zeros(1, dtype=torch.long)

    def resize(self, n: int, device: torch.device) -> None:
        old = self._ring
        super().resize(n, device)
        ring = torch.full((self.window, n), float("nan"), device=device)
        keep = min(n, old.shape[1])
        ring[:, :keep] = old[:, :keep].to(device)
        self._ring = ring
        self._g_ring = self._g_ring.to(device)
        self._pos = self._pos.to(device)

    @staticmethod
    def _stats(ring: Tensor) -> tuple[Tensor, Tensor]:
        filled = ~torch.isnan(ring)
        count = filled.sum(0).clamp_min(1)
        values = torch.where(filled, ring, torch.zeros_like(ring))
        mean = values.sum(0) / count
        var = (torch.where(filled, ring - mean, torch.zeros_like(ring)) ** 2).sum(0) / count
        return mean, torch.sqrt(var)

    def judge(self, norms: Tensor, global_norm: Tensor, loss: Tensor) -> Verdict:
        s = self._state
        mean, std = self._stats(self._ring)
        g_mean, g_std = self._stats(self._g_ring.unsqueeze(1))
        g_mean, g_std = g_mean[0], g_std[0]
        warm, g_warm = _warm(s["count"], self.warmup_steps), _warm(s["g_count"], self.warmup_steps)
        limit, g_limit = mean + self.threshold * std, g_mean + self.threshold * g_std
        return _norm_verdict(warm & (norms > limit), norms / mean.clamp_min(_TINY), mean, _limit(warm, limit),
                             g_warm & (global_norm > g_limit), global_norm / g_mean.clamp_min(_TINY), g_mean,
                             _limit(g_warm, g_limit))

    def update(self, norms: Tensor, global_norm: Tensor, loss: Tensor, accept: Tensor) -> None:
        s = self._state
        valid = _valid(norms, accept)
        g_valid = _valid(global_norm, accept)
        # index_select/index_copy_ with a device index: indexing with a 0-d tensor would read it on the host
        row = self._ring.index_select(0, self._pos)[0]
        self._ring.index_copy_(0, self._pos, torch.where(valid, norms, row).unsqueeze(0))
        g_old = self._g_ring.index_select(0, self._pos)
        self._g_ring.index_copy_(0, self._pos, torch.where(g_valid, global_norm, g_old))
        s["count"].add_(valid.to(torch.float32))
        s["g_count"].add_(g_valid.to(torch.float32))
        self._pos.copy_(torch.where(accept, (self._pos + 1) % self.window, self._pos))

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["ring"] = self._ring.cpu().clone()
        state["g_ring"] = self._g_ring.cpu().clone()
        state["pos"] = self._pos.cpu().clone()
        return state

    def check_state_dict(self, state: Any) -> None:
        super().check_state_dict(state)
        for key, current in (("ring", self._ring), ("g_ring", self._g_ring), ("pos", self._pos)):
            value = state.get(key)
            if not isinstance(value, Tensor) or value.shape != current.shape:
                raise ConfigError("state_dict", f"rolling-window state {key!r} is missing or mis-shaped",
                                  "load a state dict saved from the same model, parameter groups and detector")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._ring = state["ring"].to(self.device)
        self._g_ring = state["g_ring"].to(self.device)
        self._pos = state["pos"].to(self.device)


DETECTORS: dict[str, type[Detector]] = {
    cls.name: cls for cls in (AutoDetector, RatioDetector, ZScoreDetector, PreUpdateEMADetector, RollingSigmaDetector)
}


def make_detector(detector: str | Detector, *, spike_threshold: float, ema_alpha: float, warmup_steps: int,
                  norm_floor: float) -> Detector:
    """The detector a ``GuardedOptimizer`` uses: an instance as given, or one built by name from its arguments."""
    if isinstance(detector, Detector):
        return detector
    if detector == "auto":
        return AutoDetector(spike_threshold, ema_alpha=ema_alpha, warmup_steps=warmup_steps, floor=norm_floor)
    if detector == "ratio":
        return RatioDetector(spike_threshold, ema_alpha, warmup_steps, norm_floor)
    if detector == "zscore":
        _check_common(spike_threshold, ema_alpha, warmup_steps, "spike_threshold")
        return ZScoreDetector(spike_threshold, ema_alpha=ema_alpha, warmup_steps=warmup_steps, floor=norm_floor)
    if detector == "pre_update_ema":
        return PreUpdateEMADetector(spike_threshold, ema_alpha, warmup_steps)
    if detector == "rolling_sigma":
        _check_common(spike_threshold, ema_alpha, warmup_steps, "spike_threshold")
        return RollingSigmaDetector(warmup_steps=warmup_steps)
    raise ConfigError("detector", f"unknown detector {detector!r}",
                      f"pass one of {sorted(DETECTORS)} or a guardtower.guard.detector.Detector instance")
