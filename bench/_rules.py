"""The rules published guards use, as ``Detector``s, so ``bench/detection.py`` judges them on the same traces.

Each follows its source's decision rule and defaults; all judge only the global norm and/or the loss (none
localizes a spike to a tensor), and all keep their state on the device.

- ``OLMoCoreRule`` (allenai/OLMo-core ``SkipStepOptimizer``): skip when the loss *or* the global norm exceeds
  mean + 6 std of the previous 128 observations (linear values, every step appended, skipped or not);
  inactive until 64 observations (half the window).
- ``ZClipRule`` (ZClip): EMA mean and variance of the global norm (alpha 0.97), initialised from the first 25
  norms; a spike is z > 2.5. ZClip clips instead of skipping and feeds the clipped norm back into the EMA;
  here a spike is what it would clip, and the clipped norm is folded in.
- ``LightningSpikeRule`` (Lightning Fabric ``SpikeDetection``): the loss is a spike when it exceeds the mean
  of the last 10 non-spike losses by more than rtol = 2 times that mean.
- ``MegatronRule`` (Megatron-LM rerun state machine, ``is_unexpectedly_large``): loss or global norm above
  10x the largest of the first 100 values.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from guardtower.guard.detector import Detector, Verdict

__all__ = ["OLMoCoreRule", "ZClipRule", "LightningSpikeRule", "MegatronRule", "RULES"]


def _global_verdict(rule: Detector, norms: Tensor, global_tripped: Tensor, global_ratio: Tensor,
                    global_baseline: Tensor, global_limit: Tensor, loss_tripped: Tensor) -> Verdict:
    """A verdict of a rule that never judges single tensors."""
    n = norms.shape[0]
    return rule._norm_verdict(torch.zeros(n, dtype=torch.bool, device=norms.device), torch.ones_like(norms),
                              torch.zeros_like(norms), torch.full_like(norms, math.inf), global_tripped,
                              global_ratio, global_baseline, global_limit, loss_tripped)


def _finite(x: Tensor) -> Tensor:
    return torch.isfinite(x)


class _Window:
    """A ring of the last ``size`` values of one scalar series (NaN = empty), on the device."""

    def __init__(self, size: int, device: torch.device) -> None:
        self.values = torch.full((size,), math.nan, device=device)
        self.pos = torch.zeros(1, dtype=torch.long, device=device)

    def stats(self) -> tuple[Tensor, Tensor, Tensor]:
        """(count, mean, unbiased std) of the filled slots."""
        filled = ~torch.isnan(self.values)
        count = filled.sum()
        vals = torch.where(filled, self.values, torch.zeros_like(self.values))
        mean = vals.sum() / count.clamp_min(1)
        var = torch.where(filled, (self.values - mean) ** 2, torch.zeros_like(self.values)).sum() / (count - 1).clamp_min(1)
        return count, mean, torch.sqrt(var)

    def push(self, x: Tensor, where: Tensor) -> None:
        old = self.values.index_select(0, self.pos)
        self.values.index_copy_(0, self.pos, torch.where(where, x.reshape(1), old))
        self.pos.copy_(torch.where(where, (self.pos + 1) % self.values.shape[0], self.pos))


class OLMoCoreRule(Detector):
    name = "olmo_core"

    def __init__(self, window: int = 128, sigmas: float = 6.0) -> None:
        super().__init__()
        self.window, self.threshold = window, sigmas
        self._loss = _Window(window, self.device)
        self._norm = _Window(window, self.device)

    def resize(self, n: int, device: torch.device) -> None:
        super().resize(n, device)
        self._loss, self._norm = _Window(self.window, device), _Window(self.window, device)

    def judge(self, norms: Tensor, global_norm: Tensor, loss: Tensor) -> Verdict:
        active = self._loss.stats()[0] >= max(2, self.window // 2)
        _, l_mean, l_std = self._loss.stats()
        count, g_mean, g_std = self._norm.stats()
        g_limit = g_mean + self.threshold * g_std
        loss_tripped = active & _finite(loss) & (loss - l_mean > self.threshold * l_std)
        g_tripped = (count >= max(2, self.window // 2)) & (global_norm > g_limit)
        return _global_verdict(self, norms, g_tripped, global_norm / g_mean.clamp_min(1e-30), g_mean,
                               torch.where(count >= self.window // 2, g_limit, torch.full_like(g_limit, math.inf)),
                               loss_tripped)

    def update(self, norms: Tensor, global_norm: Tensor, loss: Tensor, reject: Tensor) -> None:
        self._loss.push(loss, _finite(loss))  # OLMo-core appends every step's loss and norm, skipped or not
        self._norm.push(global_norm, _finite(global_norm))


class ZClipRule(Detector):
    name = "zclip"
    _scalars = {"mean": 0.0, "var": 0.0, "count": 0.0, "sum": 0.0, "sumsq": 0.0}

    def __init__(self, z: float = 2.5, alpha: float = 0.97, warmup: int = 25) -> None:
        super().__init__()
        self.threshold, self.alpha, self.warmup = z, alpha, warmup

    def _limit(self) -> tuple[Tensor, Tensor]:
        s = self._state
        warm = s["count"] >= self.warmup
        return warm, s["mean"] + self.threshold * torch.sqrt(s["var"])

    def judge(self, norms: Tensor, global_norm: Tensor, loss: Tensor) -> Verdict:
        warm, limit = self._limit()
        tripped = warm & (global_norm > limit)
        false = torch.zeros((), dtype=torch.bool, device=norms.device)
        return _global_verdict(self, norms, tripped, global_norm / self._state["mean"].clamp_min(1e-30), self._state["mean"],
                               torch.where(warm, limit, torch.full_like(limit, math.inf)), false)

    def update(self, norms: Tensor, global_norm: Tensor, loss: Tensor, reject: Tensor) -> None:
        accept = ~reject
        s = self._state
        ok = _finite(global_norm)
        g = torch.where(ok, global_norm, torch.zeros_like(global_norm))
        warm, limit = self._limit()
        # warmup: plain mean/variance of the first norms; then the EMA, fed with the clipped norm
        s["sum"].add_(torch.where(ok & ~warm, g, torch.zeros_like(g)))
        s["sumsq"].add_(torch.where(ok & ~warm, g * g, torch.zeros_like(g)))
        s["count"].add_(ok.to(torch.float32))
        c = s["count"].clamp_min(1)
        init_mean = s["sum"] / c
        init_var = (s["sumsq"] / c - init_mean ** 2).clamp_min(0)
        clipped = torch.minimum(g, limit)
        ema_mean = self.alpha * s["mean"] + (1 - self.alpha) * clipped
        ema_var = self.alpha * s["var"] + (1 - self.alpha) * (clipped - s["mean"]) ** 2
        still_warming = s["count"] <= self.warmup
        s["mean"].copy_(torch.where(ok, torch.where(still_warming, init_mean, torch.where(warm, ema_mean, s["mean"])),
                                    s["mean"]))
        s["var"].copy_(torch.where(ok, torch.where(still_warming, init_var, torch.where(warm, ema_var, s["var"])),
                                   s["var"]))


class LightningSpikeRule(Detector):
    name = "lightning_spike"

    def __init__(self, window: int = 10, rtol: float = 2.0) -> None:
        super().__init__()
        self.window, self.threshold = window, rtol
        self._loss = _Window(window, self.device)

    def resize(self, n: int, device: torch.device) -> None:
        super().resize(n, device)
        self._loss = _Window(self.window, device)

    def judge(self, norms: Tensor, global_norm: Tensor, loss: Tensor) -> Verdict:
        count, mean, _ = self._loss.stats()
        tripped = (count >= self.window) & _finite(loss) & (loss - mean >= self.threshold * mean.abs())
        false = torch.zeros((), dtype=torch.bool, device=norms.device)
        return _global_verdict(self, norms, false, global_norm.new_ones(()), global_norm.new_zeros(()),
                               global_norm.new_full((), math.inf), tripped)

    def update(self, norms: Tensor, global_norm: Tensor, loss: Tensor, reject: Tensor) -> None:
        accept = ~reject
        self._loss.push(loss, _finite(loss) & accept)


class MegatronRule(Detector):
    name = "megatron"
    _scalars = {"loss_max": 0.0, "norm_max": 0.0, "loss_count": 0.0, "norm_count": 0.0}

    def __init__(self, factor: float = 10.0, samples: int = 100) -> None:
        super().__init__()
        self.threshold, self.samples = factor, samples

    def judge(self, norms: Tensor, global_norm: Tensor, loss: Tensor) -> Verdict:
        s = self._state
        g_ready = s["norm_count"] >= self.samples
        g_limit = self.threshold * s["norm_max"]
        g_tripped = g_ready & (global_norm > g_limit)
        loss_tripped = (s["loss_count"] >= self.samples) & _finite(loss) & (loss > self.threshold * s["loss_max"])
        return _global_verdict(self, norms, g_tripped, global_norm / s["norm_max"].clamp_min(1e-30), s["norm_max"],
                               torch.where(g_ready, g_limit, torch.full_like(g_limit, math.inf)), loss_tripped)

    def update(self, norms: Tensor, global_norm: Tensor, loss: Tensor, reject: Tensor) -> None:
        accept = ~reject
        s = self._state
        for x, key, count in ((global_norm, "norm_max", "norm_count"), (loss, "loss_max", "loss_count")):
            take = _finite(x) & (s[count] < self.samples)
            s[key].copy_(torch.where(take, torch.maximum(s[key], x), s[key]))
            s[count].add_(take.to(torch.float32))


RULES = (OLMoCoreRule, ZClipRule, LightningSpikeRule, MegatronRule)
