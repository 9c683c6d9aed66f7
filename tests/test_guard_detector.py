"""Detectors on synthetic norm streams: judge before update, rejected steps never enter the baseline."""

from __future__ import annotations

import math

import pytest
import torch

from guardtower.errors import ConfigError
from guardtower.guard import PreUpdateEMADetector, RatioDetector, RollingSigmaDetector, ZScoreDetector
from guardtower.guard.detector import Detector


def feed(detector: Detector, norms: torch.Tensor) -> tuple[bool, torch.Tensor]:
    """One guarded step as the optimizer does it: judge, then update only when accepted."""
    global_norm = torch.linalg.vector_norm(norms)
    loss = torch.tensor(math.nan)
    verdict = detector.judge(norms, global_norm, loss)
    spike = verdict.spike
    detector.update(norms, global_norm, loss, ~spike)
    return bool(spike), verdict.ratios


def noisy(n: int, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(step)
    return torch.exp(torch.randn(n, generator=gen) * 0.2) * torch.tensor([1.0, 2.0, 0.5, 3.0])[:n]


ALL = [lambda: RatioDetector(10.0, 0.01, 10), lambda: ZScoreDetector(6.0, 0.01, 10),
       lambda: PreUpdateEMADetector(10.0, 0.01, 10), lambda: RollingSigmaDetector(128, 6.0, 10)]


@pytest.mark.parametrize("factory", ALL)
def test_every_detector_passes_noise_and_flags_a_large_spike(factory: object) -> None:
    detector = factory()  # type: ignore[operator]
    detector.resize(4, torch.device("cpu"))
    flagged = [feed(detector, noisy(4, s))[0] for s in range(200)]
    assert not any(flagged)
    spike = noisy(4, 200)
    spike[2] *= 1000
    assert feed(detector, spike)[0]


def test_ratio_detector_ignores_warmup_and_absorbs_nothing_rejected() -> None:
    detector = RatioDetector(10.0, 0.01, warmup_steps=5)
    detector.resize(4, torch.device("cpu"))
    early = noisy(4, 0) * 100
    assert not feed(detector, early)[0]  # warmup: builds the baseline only
    for s in range(1, 50):
        feed(detector, noisy(4, s))
    before = detector.state_dict()["state"]
    spike = noisy(4, 50)
    spike[0] *= 1e4
    flagged, ratios = feed(detector, spike)
    assert flagged and ratios[0] > 1000  # compared before the update: no 1/alpha cap
    after = detector.state_dict()["state"]
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_pre_update_ema_caps_its_ratio_and_keeps_the_spike_in_its_baseline() -> None:
    detector = PreUpdateEMADetector(10.0, 0.01, 5)
    detector.resize(4, torch.device("cpu"))
    for s in range(50):
        feed(detector, noisy(4, s))
    spike = noisy(4, 50)
    spike[0] *= 1e4
    _, ratios = feed(detector, spike)
    assert ratios[0] < 1 / 0.01
    follow = noisy(4, 51)
    follow[0] *= 100
    assert not feed(detector, follow)[0]  # the first spike inflated the baseline: this one passes


def test_a_non_finite_norm_never_enters_a_baseline() -> None:
    detector = RatioDetector(10.0, 0.01, 2)
    detector.resize(4, torch.device("cpu"))
    for s in range(10):
        feed(detector, noisy(4, s))
    bad = noisy(4, 10)
    bad[1] = math.nan
    detector.update(bad, torch.linalg.vector_norm(bad), torch.tensor(math.nan), torch.tensor(True))
    assert all(torch.isfinite(v).all() for v in detector.state_dict()["state"].values())


def test_resize_keeps_existing_baselines_and_the_global_slot() -> None:
    detector = RatioDetector(10.0, 0.01, 2)
    detector.resize(4, torch.device("cpu"))
    for s in range(10):
        feed(detector, noisy(4, s))
    before = detector.state_dict()["state"]["log_base"]
    detector.resize(6, torch.device("cpu"))
    after = detector.state_dict()["state"]["log_base"]
    assert torch.equal(after[:4], before[:4]) and after[-1] == before[-1] and after[4:6].eq(0).all()


def test_state_dict_round_trip_and_mismatch() -> None:
    a = ZScoreDetector()
    a.resize(4, torch.device("cpu"))
    for s in range(20):
        feed(a, noisy(4, s))
    b = ZScoreDetector()
    b.resize(4, torch.device("cpu"))
    b.load_state_dict(a.state_dict())
    assert all(torch.equal(a.state_dict()["state"][k], b.state_dict()["state"][k]) for k in a.state_dict()["state"])
    c = RatioDetector()
    c.resize(4, torch.device("cpu"))
    with pytest.raises(ConfigError):
        c.load_state_dict(a.state_dict())


def test_rolling_sigma_window_forgets_old_steps() -> None:
    detector = RollingSigmaDetector(window=8, sigmas=6.0, warmup_steps=2)
    detector.resize(1, torch.device("cpu"))
    for s in range(20):
        feed(detector, torch.tensor([1.0 + 0.01 * (s % 3)]))
    assert feed(detector, torch.tensor([5.0]))[0]


@pytest.mark.parametrize("factory", ALL)
def test_limits_are_the_largest_norms_that_pass(factory: object) -> None:
    detector = factory()  # type: ignore[operator]
    detector.resize(4, torch.device("cpu"))
    for s in range(60):
        feed(detector, noisy(4, s))
    norms = noisy(4, 60)
    nan = torch.tensor(math.nan)
    limits = detector.judge(norms, torch.linalg.vector_norm(norms), nan).limits
    assert torch.isfinite(limits).all()
    for i in range(4):
        for factor, trips in ((0.98, False), (1.02, True)):
            probe = norms.clone()
            probe[i] = limits[i] * factor
            # the global norm is held at its healthy value so only tensor i is judged against its limit
            assert bool(detector.judge(probe, torch.linalg.vector_norm(norms), nan).tripped[i]) is trips


@pytest.mark.parametrize("factory", ALL)
def test_limits_are_infinite_before_warmup(factory: object) -> None:
    detector = factory()  # type: ignore[operator]
    detector.resize(4, torch.device("cpu"))
    norms = noisy(4, 0)
    verdict = detector.judge(norms, torch.linalg.vector_norm(norms), torch.tensor(math.nan))
    assert torch.isinf(verdict.limits).all() and torch.isinf(verdict.global_limit)
    assert not bool(verdict.loss_tripped) and not bool(verdict.absorbed)
