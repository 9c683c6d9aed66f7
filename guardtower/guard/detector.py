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
    "Explanation",
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
    """One step's judgement, on the device; what the host needs to explain it travels in ``report``.

    ``report`` holds 1-d tensors that the guard copies into its step record as they are (no extra op), before
    it calls ``update``: they may be the detector's own buffers, which ``update`` overwrites. The host reads
    them back with ``Detector.explain`` only when an incident or a summary needs the detail.
    """

    spike: Tensor  # bool 0-d: a gradient series or the loss tripped: the step is rejected
    absorbed: Tensor  # bool 0-d: a slot tripped once too often at one level: re-baselined if the step is accepted
    report: tuple[Tensor, ...]


class Explanation(NamedTuple):
    """A recorded verdict, read on the host."""

    tripped: list[bool]  # per tensor: this tensor alone would reject the step
    ratios: list[float]  # per tensor: norm / baseline (0 before the baseline has a value)
    baselines: list[float]
    global_tripped: bool
    global_ratio: float
    global_baseline: float
    loss_tripped: bool


class Detector(ABC):
    """Per-tensor and global baselines in device tensors.

    Subclasses list their per-tensor state in ``_per_tensor`` (attribute name -> initial value) and their
    global state in ``_scalars``; ``resize`` and ``state_dict`` are generic over those.
    ``judges_nonfinite``: the verdict's ``spike`` already holds for a NaN/Inf global norm, so the guard need
    not test for it on the device. ``absent_loss``: the value the guard passes when no loss was given.
    """

    #: state entries that may hold NaN/Inf by design; every other one must be finite to be loaded
    may_be_nonfinite: frozenset[str] = frozenset()
    name: str = "detector"
    threshold: float = 10.0
    #: a tensor's ratio compares its share of the gradient (norm over the others' norm) with its usual share,
    #: not its norm with a baseline norm (the console box and alerts name it so)
    share_ratios: bool = False
    judges_nonfinite: bool = False
    absent_loss: float = math.nan
    _per_tensor: dict[str, float] = {}
    _scalars: dict[str, float] = {}
    _global_slot: bool = False

    def __init__(self) -> None:
        self.n = 0
        self.device = torch.device("cpu")
        self._state: dict[str, Tensor] = {}
        self._limits: tuple[Tensor, Tensor] | None = None
        self._grad_spike: Tensor | None = None

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
        """Compare this step's norms (and loss, float32 0-d, ``absent_loss`` when absent) with the baselines."""

    @abstractmethod
    def update(self, norms: Tensor, global_norm: Tensor, loss: Tensor, reject: Tensor) -> None:
        """Fold the step judged last into the baselines unless ``reject`` (bool 0-d) holds."""

    def limits(self) -> tuple[Tensor, Tensor]:
        """(per tensor, global): the largest norms the step judged last could have had and been accepted
        (``inf``: cannot trip). What ``nan_action="clip"`` scales a spike down to."""
        if self._limits is None:
            raise RuntimeError("limits() is only defined after judge()")
        return self._limits

    def grad_spike(self) -> Tensor:
        """bool 0-d: a gradient series (not only the loss) tripped in the step judged last."""
        if self._grad_spike is None:
            raise RuntimeError("grad_spike() is only defined after judge()")
        return self._grad_spike

    def explain(self, report: Tensor, norms: list[float]) -> Explanation:
        """Read a recorded ``Verdict.report`` (the concatenated tensors, on the host); ``norms`` per tensor."""
        n = self.n
        values = report.tolist()
        ratios, baselines, tripped = values[:n + 1], values[n + 1:2 * n + 2], values[2 * n + 2:3 * n + 3]
        return Explanation([bool(t) for t in tripped[:n]], ratios[:n], baselines[:n], bool(tripped[n]), ratios[n],
                           baselines[n], bool(values[3 * n + 3]))

    def _norm_verdict(self, tripped: Tensor, ratios: Tensor, baselines: Tensor, limits: Tensor, g_tripped: Tensor,
                      g_ratio: Tensor, g_baseline: Tensor, g_limit: Tensor, loss_tripped: Tensor | None = None) -> Verdict:
        """The verdict of a detector that judges per-tensor norms and the global norm (and maybe the loss)."""
        self._limits = (limits, g_limit)
        false = torch.zeros((), dtype=torch.bool, device=tripped.device)
        loss_tripped = false if loss_tripped is None else loss_tripped
        self._grad_spike = tripped.any() | g_tripped
        spike = self._grad_spike | loss_tripped
        report = (ratios, g_ratio.reshape(1), baselines, g_baseline.reshape(1), tripped, g_tripped.reshape(1),
                  loss_tripped.reshape(1))
        return Verdict(spike, false, report)

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
            if key not in self.may_be_nonfinite and not bool(torch.isfinite(value).all()):  # load time, not a step
                raise ConfigError("state_dict", f"detector state {key!r} holds NaN or Inf (it would reject every "
                                                "step)", fix)


def _warm(count: Tensor, warmup: int) -> Tensor:
    return count >= warmup


def _limit(warm: Tensor, limit: Tensor) -> Tensor:
    """The accepted-norm ceiling where the detector can trip, ``inf`` where it cannot (still warming up)."""
    return torch.where(warm, limit, torch.full_like(limit, math.inf))


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

    def _verdict(self, tripped: Tensor, ratios: Tensor, base: Tensor, limits: Tensor) -> Verdict:
        return self._norm_verdict(tripped[:-1], ratios[:-1], base[:-1], limits[:-1], tripped[-1], ratios[-1],
                                  base[-1], limits[-1])

    def update(self, norms: Tensor, global_norm: Tensor, loss: Tensor, reject: Tensor) -> None:
        s = self._state
        x = torch.cat([norms, global_norm.reshape(1)])
        valid = ~reject & torch.isfinite(x) & (x > 0)
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


class _Judged(NamedTuple):
    """What ``AutoDetector.judge`` hands to ``update``/``limits``/``grad_spike`` of the same step."""

    norms: Tensor  # the step's own norms (identifies it)
    absorb: Tensor
    rest: Tensor  # per tensor: the squared norm of all the others
    tripped: Tensor


class AutoDetector(Detector):
    """The default: a step is a spike when a gradient norm (or the loss) leaves its own recent range.

    Slots: every gradient tensor's *share* (its norm over the norm of all other tensors, which cancels the
    common-mode swings that move every gradient together: batch difficulty, a loss near zero), the global
    norm, and the loss when given. Each slot keeps, over accepted steps only, a fast EMA level and a slow EMA
    spread (mean absolute deviation) of its log value, and a peak envelope (the largest recent value,
    forgetting a factor 10 per 100 accepted steps). A slot trips when its value exceeds

    - ``threshold`` x its peak envelope (heavy-tailed series: anything far beyond what was seen), **or**
    - ``threshold`` x its level (``loss_ratio`` x for the loss) *and* ``sigmas`` standard deviations above
      it in log space (stable series: a jump far outside their noise),

    and a value within ``threshold`` x its peak envelope (``loss_ratio`` x for the loss), up to ``threshold``^2
    x its level, never trips: a series whose healthy steps jump x15-x50 now and then (a LoRA ``lora_A``, the
    global norm of a deep non-residual net) has a heavy tail, which a Gaussian sigma bound does not describe,
    and is judged against what it has shown.

    Warmup is an effective sample count: the spread starts from a prior (log-std 0.5 with the weight of
    4 observations) that fades as accepted observations accumulate, and ``warmup_steps=0`` lets the first
    accepted observation seed the baseline; the loss is judged once 10 of its values are in. A tensor whose
    typical share is below ``floor`` is judged against that floor, so a negligible gradient cannot trip.
    What enters a baseline is capped at the ceiling (from the second value on, warmup included).

    The scale of the problem: the global norm's level counts as no lower than a tenth of its all-time
    largest accepted value, the loss's as no lower than a third. A run that memorises its data ends with a
    loss 1,000x below its start; a hard batch then lifts loss and gradient x50-x500 above the easy batches'
    level, yet stays well inside what the run saw at its start: that is no spike.

    A sustained level shift is absorbed: when a slot has tripped ``absorb_after`` times in a row with values
    within a factor ``threshold`` of each other, that step is accepted (``Verdict.absorbed``) and the slot
    re-baselined on it. Spikes that come and go, or keep growing, never qualify.

    Cost: a fixed number of vector ops per step whatever the number of tensors (``bench/overhead.py``
    counts them). Norm slots are kept as log(x^2), which saves a square root; the constants are per slot.
    A NaN/Inf anywhere trips (``judges_nonfinite``); an absent loss is 0, whose log never trips nor enters.
    """

    name = "auto"
    may_be_nonfinite = frozenset({"ring"})  # NaN/Inf marks a slot that did not trip
    share_ratios = True
    judges_nonfinite = True
    absent_loss = 0.0
    _LEVEL_ALPHA = 0.1  # the level follows trends within ~10 accepted steps; the spread uses ema_alpha
    # the spread prior: a series may move by e^0.5 per step until data says otherwise; a loss by e^0.1,
    # judged only once 10 of its values are in (a handful of noisy losses says little about their spread)
    _PRIOR_STD, _LOSS_PRIOR_STD, _PRIOR_WEIGHT, _LOSS_WARMUP = 0.5, 0.1, 4.0, 10
    _PEAK_DECAY = math.log(10.0) / 100  # per accepted step, in log units
    _SCALE_FLOORS = (10.0, 3.0)  # the global norm's and the loss's level count as at least their scale over these
    _LOSS_SIGMA_SHARE = 0.8  # the loss, a smoother series than any norm, is judged at 0.8 x ``sigmas``
    _MAD_TO_STD = math.sqrt(math.pi / 2)  # std / mean absolute deviation of a normal distribution
    _SHARE_EPS = 1e-6  # a tensor holding all of the gradient has share 1/sqrt(eps), not inf
    _BIG = 1e30  # "cannot trip" / "no cap" in log space: finite, so an Inf value still compares above it

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
        self._tick = 0  # steps judged: picks the row of the trip ring (a host int, never read from the device)
        self._pending: _Judged | None = None

    # -- layout -------------------------------------------------------------------------------------------

    def resize(self, n: int, device: torch.device) -> None:
        """Slots: the ``n`` tensors, then the global norm, then the loss (both kept at the end)."""
        if n == self.n and device == self.device and self._state:
            return
        m = n + 2
        unit = torch.full((m,), 2.0)  # norm slots hold log(x^2), the loss slot log(loss)
        unit[-1] = 1.0
        log_t = math.log(self.threshold)
        self._margin = (unit * log_t).to(device)  # beyond the peak; the width of an absorbable run
        gate = unit * log_t
        gate[-1] = math.log(self.loss_ratio)
        self._gate = gate.to(device)
        self._decay = torch.stack([unit * self._PEAK_DECAY, torch.zeros(m)]).to(device)  # peak, scale
        # a tensor's share is judged no lower than ``floor``; the global norm and the loss no lower than their
        # all-time scale (the ``scale`` row) over _SCALE_FLOORS
        floor = torch.full((m,), 2 * math.log(self.floor) if self.floor > 0 else -self._BIG)
        floor[-2] = -2 * math.log(self._SCALE_FLOORS[0])
        floor[-1] = -math.log(self._SCALE_FLOORS[1])
        self._floor = floor.to(device)
        from_scale = torch.zeros(m)
        from_scale[-2:] = 1.0
        sigma = torch.full((m,), self.sigmas * self._MAD_TO_STD)
        sigma[-1] *= self._LOSS_SIGMA_SHARE
        self._sigma_from_scale = torch.stack([sigma, from_scale]).to(device)  # pairs with rows (spread, scale)
        self._margin_gate = torch.stack([self._margin, self._gate])
        self._tiny = torch.full((), _TINY, device=device)
        # a slot is judged once count >= start
        start = torch.full((m,), float(max(self.warmup_steps, 1)))
        start[-1] = max(self.warmup_steps, self._LOSS_WARMUP)
        self._start_at = torch.stack([torch.ones(m), start]).to(device)  # rows: capped from, judged from
        self._nan = torch.full((), math.nan, device=device)
        self._big = torch.full((), self._BIG, device=device)
        self._rate_offset = torch.tensor([[1.0], [1.0 + self._PRIOR_WEIGHT]], device=device)
        self._rate_floor = torch.tensor([[self._LEVEL_ALPHA], [self.ema_alpha]], device=device)
        prior = unit * self._PRIOR_STD / self._MAD_TO_STD
        prior[-1] = self._LOSS_PRIOR_STD / self._MAD_TO_STD
        state = torch.stack([torch.zeros(m), prior, torch.full((m,), -self._BIG), torch.zeros(m),
                             torch.full((m,), -self._BIG)]).to(device)
        ring = torch.full((self.absorb_after, m), math.nan, device=device)
        old, old_ring = self._state.get("state"), self._state.get("ring")
        if old is not None and old_ring is not None:
            keep = min(n, old.shape[1] - 2)
            for new_t, old_t in ((state, old), (ring, old_ring)):
                new_t[:, :keep] = old_t[:, :keep].to(device)
                new_t[:, -2:] = old_t[:, -2:].to(device)
        self.n = n
        self.device = device
        self._set_state(state, ring)

    def _set_state(self, state: Tensor, ring: Tensor) -> None:
        """Adopt ``state`` and ``ring`` and make the views and buffers every step writes into.

        The state is updated in place from now on, so views made here stay valid; each step writes its
        intermediate and derived values into these buffers (``out=``) instead of allocating and stacking new
        tensors, and the buffers are laid out so that operands that pair up are rows of one tensor (one op for
        both). That keeps the step at a fixed, small number of ops (``bench/overhead.py``).
        """
        m = state.shape[1]
        device = state.device
        # the state's rows, then the (constant) floor: rows (level, floor) pair with (spread, scale) in _derive
        store = torch.cat([state, self._floor.reshape(1, m)])
        state = store[:5]
        self._state = {"state": state, "ring": ring}
        self._level_floor, self._spread_scale = store[0::5], store[1::3]
        self._rows = state.unbind(0)  # level, spread, peak, count, scale
        self._ring_rows = ring.unbind(0)
        self._moving = state[0:2]  # level and spread: each moves toward its target by its rate
        self._enveloped = state[2::2]  # peak and scale: each the maximum of its (decayed) self and the value
        self._candidate = torch.empty_like(state)
        self._candidate_moving, self._candidate_enveloped = self._candidate[0:2], self._candidate[2::2]
        self._counted = self._candidate[3:5]  # count + 1 (the count's candidate), then scratch
        # what an absorbed slot takes (rates 1 and 0: jump the level, keep the spread; its value uncapped) and
        # what any other slot takes (its rates; its value capped), rows alike; then the chosen ones and the
        # deviation from the level
        self._absorbed = torch.stack([torch.ones(m), torch.zeros(m), torch.zeros(m)]).to(device)
        self._x = self._absorbed[2]  # this step's log values, judged in place
        self._x_shares, self._x_g2, self._x_loss = self._x[:-2], self._x[-2], self._x[-1]
        self._usual = torch.empty((3, m), device=device)
        self._usual_rates, self._capped = self._usual[0:2], self._usual[2]
        self._chosen = torch.empty((4, m), device=device)  # rates (2 rows), value, |value - level|
        self._rates, self._targets, self._rates_value = self._chosen[0:2], self._chosen[2:4], self._chosen[0:3]
        self._value, self._deviation = self._chosen[2], self._chosen[3]
        self._flags = torch.zeros(2 * m, dtype=torch.bool, device=device)  # tripped, absorb
        self._flag_rows = self._flags.view(2, m)
        self._tripped, self._absorb = self._flag_rows.unbind(0)
        self._bounds = torch.empty((2, m), device=device)
        self._cap, self._ceiling = self._bounds.unbind(0)
        self._base = torch.empty(m, device=device)
        self._shifted = torch.empty((2, m), device=device)  # level + sigma x spread; the floor from the scale
        self._outlier_at, self._scale_floor = self._shifted.unbind(0)
        self._envelopes = torch.empty((2, m), device=device)  # max(peak, base) + margin; min(peak, gated) + gate
        self._above_peak, self._heavy_tail = self._envelopes.unbind(0)
        self._count = self._rows[3]
        self._derive()
        self._pending = None

    def _derive(self) -> None:
        """What the next step is judged against, from the state (computed once, after each update)."""
        level, _, peak, count, _ = self._rows
        torch.addcmul(self._level_floor, self._spread_scale, self._sigma_from_scale, out=self._shifted)
        base = torch.maximum(level, self._scale_floor, out=self._base)
        gated = base + self._gate
        outlier = torch.maximum(gated, self._outlier_at)
        # within threshold x the peak envelope (up to threshold^2 x the base): a heavy tail it has shown
        torch.maximum(peak, base, out=self._above_peak)
        torch.minimum(peak, gated, out=self._heavy_tail)
        self._envelopes.add_(self._margin_gate)
        ceiling = torch.maximum(torch.minimum(outlier, self._above_peak), self._heavy_tail)
        # what enters a baseline is capped at the ceiling from the second value on (warmup included), so one
        # outlier accepted early moves it by a bounded amount; it is judged only once warm
        torch.where(count < self._start_at, self._big, ceiling, out=self._bounds)  # rows: cap, ceiling

    # -- the step -----------------------------------------------------------------------------------------

    def judge(self, norms: Tensor, global_norm: Tensor, loss: Tensor) -> Verdict:
        """The verdict; its report's tensors are this detector's buffers, valid until the next ``judge``.

        This step's row of the trip ring (the current tick's) is written here; ``update`` moves the tick on,
        so a second judge of the same step, or one after the update (triage), only rewrites the row that the
        next step's judge writes again before reading the ring.
        """
        n2 = norms * norms
        # never 0: no 0/0 when every gradient is zero
        g2 = torch.addcmul(self._tiny, global_norm, global_norm, out=self._x_g2)
        rest = torch.sub(g2, n2, alpha=1.0 - self._SHARE_EPS)  # the others' norm^2; > 0 wherever n2 > 0
        torch.div(n2, rest, out=self._x_shares)
        # a negative loss (a log-likelihood, a reward) has no log: clamped to 0, its log -inf never trips
        torch.clamp_min(loss, 0.0, out=self._x_loss)
        x = self._x.log_()
        ok = x <= self._ceiling  # NaN is not ok: it trips
        # the trip ring: this step's value where the slot tripped, NaN elsewhere; a slot whose last
        # ``absorb_after`` values all tripped, within the margin of each other, has shifted its level
        torch.where(ok, self._nan, x, out=self._ring_rows[self._tick % self.absorb_after])
        low, high = torch.aminmax(self._state["ring"], dim=0)
        absorb = torch.le(high - low, self._margin, out=self._absorb)  # implies a trip now
        tripped = torch.eq(ok, absorb, out=self._tripped)  # tripped and not absorbed
        spike, absorbed = self._flag_rows.any(dim=1).unbind(0)
        self._pending = _Judged(norms, absorb, rest, tripped)
        return Verdict(spike, absorbed, (x, self._base, self._count, self._flags))

    def update(self, norms: Tensor, global_norm: Tensor, loss: Tensor, reject: Tensor) -> None:
        pending = self._pending
        if pending is None or pending.norms is not norms:
            self.judge(norms, global_norm, loss)
            pending = self._pending
        assert pending is not None
        x, absorb = self._x, pending.absorb
        self._pending = None
        self._tick += 1  # the ring keeps this step's row: the run of trips counts rejected steps too
        state = self._state["state"]
        level, count = self._rows[0], self._rows[3]
        fold = (x > -math.inf) > reject  # finite and non-zero (Inf only comes with a rejected step)
        torch.clamp_max(x, self._cap, out=self._capped)
        # the count's candidate is count + 1 (the first rate offset); the row after it is scratch until the
        # scale's candidate is written below
        counted = torch.add(count, self._rate_offset, out=self._counted)
        torch.reciprocal(counted, out=self._usual_rates).clamp_min_(self._rate_floor)
        torch.where(absorb, self._absorbed, self._usual, out=self._rates_value)
        # the targets: the value for the level, |deviation| for the spread
        torch.abs(self._value - level, out=self._deviation)
        torch.lerp(self._moving, self._targets, self._rates, out=self._candidate_moving)
        torch.maximum(self._enveloped - self._decay, self._value, out=self._candidate_enveloped)
        torch.where(fold, self._candidate, state, out=state)
        self._derive()

    def limits(self) -> tuple[Tensor, Tensor]:
        """Back from shares to norms: a tensor's limit is its ceiling share times the norm of the others."""
        if self._pending is None:
            raise RuntimeError("limits() is only defined between judge() and update()")
        limit = torch.exp(self._ceiling[:-1] * 0.5)  # a ceiling at _BIG gives inf: cannot trip
        return limit[:-1] * torch.sqrt(self._pending.rest), limit[-1]

    def grad_spike(self) -> Tensor:
        """bool 0-d: a gradient series (not only the loss) tripped in the step judged last."""
        if self._pending is None:
            raise RuntimeError("grad_spike() is only defined between judge() and update()")
        return self._pending.tripped[:-1].any()

    def explain(self, report: Tensor, norms: list[float]) -> Explanation:
        """Ratios of the slots' values to their levels; a baseline norm is the norm over its ratio."""
        n = self.n
        m = n + 2
        x, base, count, tripped, _ = report.reshape(5, m).unbind(0)
        half = torch.full((m,), 0.5)
        half[-1] = 1.0
        seen = torch.where(count > 0, torch.exp((x - base) * half), 0.0)  # no baseline yet: ratio 0
        ratios: list[float] = seen.nan_to_num(0.0, posinf=math.inf, neginf=0.0).tolist()
        global_norm = math.exp(0.5 * float(x[n])) if math.isfinite(float(x[n])) else float("nan")
        values = [*norms, global_norm]
        baselines = [v / r if r > 0 and math.isfinite(r) else 0.0 for v, r in zip(values, ratios)]
        flags = [bool(t) for t in tripped.tolist()]
        return Explanation(flags[:n], ratios[:n], baselines[:n], flags[n], ratios[n], baselines[n], flags[n + 1])

    # -- persistence --------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["tick"] = self._tick
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state_dict(state)
        tick = state.get("tick")
        if not isinstance(tick, int) or isinstance(tick, bool) or tick < 0:
            raise ConfigError("state_dict", f"auto detector state 'tick' must be a non-negative int, got {tick!r}",
                              "load a state dict saved from the same model, parameter groups and detector")
        saved = state["state"]
        self._tick = tick
        self._set_state(saved["state"].to(self.device, torch.float32).clone(),
                        saved["ring"].to(self.device, torch.float32).clone())


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
        return self._norm_verdict(tripped, ratios, ema, self._ceiling(s["ema"], s["count"]), g_tripped, g_ratio, g_ema,
                             self._ceiling(s["g_ema"], s["g_count"]))

    def update(self, norms: Tensor, global_norm: Tensor, loss: Tensor, reject: Tensor) -> None:
        """Folds in every finite step, rejected or not: that is the flaw this detector demonstrates."""
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
        return self._norm_verdict(warm & (norms > limit), norms / mean.clamp_min(_TINY), mean, _limit(warm, limit),
                             g_warm & (global_norm > g_limit), global_norm / g_mean.clamp_min(_TINY), g_mean,
                             _limit(g_warm, g_limit))

    def update(self, norms: Tensor, global_norm: Tensor, loss: Tensor, reject: Tensor) -> None:
        s = self._state
        accept = ~reject
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
