"""Detectors on synthetic norm streams: judge before update, rejected steps never enter the baseline."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from guardtower.errors import ConfigError
from guardtower.guard import GuardedOptimizer, PreUpdateEMADetector, RatioDetector, RollingSigmaDetector, ZScoreDetector
from guardtower.guard.detector import AutoDetector, Detector, make_detector
from tests._guard_helpers import explain, same_detector_state


def decide(detector: Detector, norms: torch.Tensor, global_norm: torch.Tensor, loss: torch.Tensor) -> Any:
    """judge() as the guard uses it: (reject, verdict); a non-finite norm rejects unless the detector says so."""
    verdict = detector.judge(norms, global_norm, loss)
    reject = verdict.spike if detector.judges_nonfinite else verdict.spike | ~torch.isfinite(global_norm)
    return reject, verdict


def feed(detector: Detector, norms: torch.Tensor) -> tuple[bool, list[float]]:
    """One guarded step as the optimizer does it: judge, then update (which folds only an accepted step)."""
    global_norm = torch.linalg.vector_norm(norms)
    loss = torch.tensor(detector.absent_loss)
    reject, verdict = decide(detector, norms, global_norm, loss)
    detector.update(norms, global_norm, loss, reject)
    return bool(reject), explain(detector, verdict, norms).ratios


def noisy(n: int, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(step)
    return torch.exp(torch.randn(n, generator=gen) * 0.2) * torch.tensor([1.0, 2.0, 0.5, 3.0])[:n]


ALL = [lambda: AutoDetector(), lambda: RatioDetector(10.0, 0.01, 10), lambda: ZScoreDetector(6.0, 0.01, 10),
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
    detector.update(bad, torch.linalg.vector_norm(bad), torch.tensor(math.nan), torch.tensor(False))
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


@pytest.mark.parametrize("factory", ALL[1:])  # AutoDetector: test_limits_follow_shares_back_to_norms
def test_limits_are_the_largest_norms_that_pass(factory: object) -> None:
    detector = factory()  # type: ignore[operator]
    detector.resize(4, torch.device("cpu"))
    for s in range(60):
        feed(detector, noisy(4, s))
    norms = noisy(4, 60)
    nan = torch.tensor(math.nan)
    detector.judge(norms, torch.linalg.vector_norm(norms), nan)
    limits = detector.limits()[0]
    assert torch.isfinite(limits).all()
    for i in range(4):
        for factor, trips in ((0.98, False), (1.02, True)):
            probe = norms.clone()
            probe[i] = limits[i] * factor
            # the global norm is held at its healthy value so only tensor i is judged against its limit
            verdict = detector.judge(probe, torch.linalg.vector_norm(norms), nan)
            assert explain(detector, verdict, probe).tripped[i] is trips


@pytest.mark.parametrize("factory", ALL)
def test_limits_are_infinite_before_warmup(factory: object) -> None:
    detector = factory()  # type: ignore[operator]
    detector.resize(4, torch.device("cpu"))
    norms = noisy(4, 0)
    verdict = detector.judge(norms, torch.linalg.vector_norm(norms), torch.tensor(detector.absent_loss))
    limits, global_limit = detector.limits()
    assert torch.isinf(limits).all() and torch.isinf(global_limit)
    assert not explain(detector, verdict, norms).loss_tripped and not bool(verdict.absorbed)


# ---------------------------------------------------------------- the default: AutoDetector
def stream(detector: Detector, steps: range, n: int = 4, scale: dict[int, float] | None = None,
           tensor: int | None = 2, loss: dict[int, float] | None = None) -> list[tuple[bool, bool]]:
    """Feed noisy steps (``scale[step]`` multiplies ``tensor``, or every norm when None); (rejected, absorbed)."""
    out = []
    for s in steps:
        norms = noisy(n, s)
        factor = (scale or {}).get(s)
        if factor is not None:
            if tensor is None:
                norms = norms * factor
            else:
                norms[tensor] *= factor
        global_norm = torch.linalg.vector_norm(norms)
        value = torch.tensor((loss or {}).get(s, 2.0 * (1 + 0.02 * math.sin(s))))
        reject, verdict = decide(detector, norms, global_norm, value)
        detector.update(norms, global_norm, value, reject)
        out.append((bool(reject), bool(verdict.absorbed) and not bool(reject)))  # as the guard counts it
    return out


def auto(n: int = 4, **kwargs: object) -> AutoDetector:
    detector = AutoDetector(**kwargs)  # type: ignore[arg-type]
    detector.resize(n, torch.device("cpu"))
    return detector


def test_the_guard_uses_the_auto_detector_by_default(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 2)
    guard = GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, verbose=False, log_dir=tmp_path)
    assert isinstance(guard.detector, AutoDetector) and guard.detector.threshold == 10.0


def test_warmup_zero_lets_the_first_observation_seed_the_baseline() -> None:
    detector = auto(warmup_steps=0)
    first = noisy(4, 0) * 1e3  # whatever the first step looks like, there is nothing to compare it with
    verdict = detector.judge(first, torch.linalg.vector_norm(first), torch.tensor(2.0))
    assert not bool(verdict.spike) and torch.isinf(detector.limits()[0]).all()
    detector.update(first, torch.linalg.vector_norm(first), torch.tensor(2.0), verdict.spike)
    detector.judge(first, torch.linalg.vector_norm(first), torch.tensor(2.0))
    assert torch.isfinite(detector.limits()[0]).all()
    # from the second step on it judges: ordinary noise passes, a x1e4 jump on one tensor does not
    assert stream(detector, range(1, 30), scale={20: 1e4}) == [(s == 20, False) for s in range(1, 30)]


def test_warmup_zero_guard_trains_and_updates_from_the_first_step(tmp_path: Path) -> None:
    from tests._guard_helpers import make, train

    model, guard = make(tmp_path, warmup_steps=0)
    before = model.inp.weight.detach().clone()
    train(model, guard, 1)
    assert not torch.equal(before, model.inp.weight)
    train(model, guard, 29, start=1)
    guard.flush()
    assert guard.total_spikes == 0 and guard.step_count == 30


def test_a_sustained_level_shift_is_absorbed_after_absorb_after_rejections() -> None:
    detector = auto(absorb_after=8)
    shifted = {s: 30.0 for s in range(100, 300)}  # e.g. the loss reduction changed from mean to sum
    out = stream(detector, range(300), scale=shifted, tensor=None)
    rejected = [s for s, (r, _) in zip(range(300), out) if r]
    absorbed = [s for s, (_, a) in zip(range(300), out) if a]
    assert rejected == list(range(100, 107)) and absorbed == [107]  # 7 skipped, the 8th accepted
    assert not any(r for r, _ in out[108:])  # the new level is the baseline now


def test_repeated_spikes_are_never_absorbed() -> None:
    every_50 = {s: 1e3 for s in range(60, 400, 50)}
    out = stream(auto(), range(400), scale=every_50)
    assert [s for s, (r, _) in zip(range(400), out) if r] == sorted(every_50)
    for run in (3, 7):  # up to absorb_after - 1 in a row: all rejected
        spikes = {s: 1e3 for s in range(100, 100 + run)}
        out = stream(auto(), range(150), scale=spikes)
        assert [s for s, (r, _) in zip(range(150), out) if r] == sorted(spikes)
    # a run that keeps growing is no level shift: rejected for as long as it lasts
    growing = {100 + k: 100.0 * 3 ** k for k in range(15)}
    out = stream(auto(), range(130), scale=growing)
    assert [s for s, (r, _) in zip(range(130), out) if r] == sorted(growing) and not any(a for _, a in out)


def test_a_loss_spike_is_caught_with_unchanged_gradients() -> None:
    detector = auto()
    out = stream(detector, range(80), loss={60: 4.5})
    assert [s for s, (r, _) in zip(range(80), out) if r] == [60]
    norms = noisy(4, 80)
    verdict = detector.judge(norms, torch.linalg.vector_norm(norms), torch.tensor(30.0))
    seen = explain(detector, verdict, norms)
    assert seen.loss_tripped and not any(seen.tripped) and not seen.global_tripped


@pytest.mark.parametrize("loss", [AutoDetector.absent_loss, -3.0])  # absent, or negative (a log-likelihood)
def test_a_missing_or_negative_loss_neither_trips_nor_enters_the_baseline(loss: float) -> None:
    detector = auto()
    stream(detector, range(50))
    before = detector.state_dict()["state"]["state"].clone()
    norms = noisy(4, 50)
    verdict = detector.judge(norms, torch.linalg.vector_norm(norms), torch.tensor(loss))
    assert not explain(detector, verdict, norms).loss_tripped and not bool(verdict.spike)
    detector.update(norms, torch.linalg.vector_norm(norms), torch.tensor(loss), verdict.spike)
    after = detector.state_dict()["state"]["state"]
    assert torch.equal(before[:, -1], after[:, -1])  # the loss slot (last) is untouched
    assert not torch.equal(before[:, :-1], after[:, :-1])  # the gradient slots took the step in


def test_a_nan_loss_is_rejected_and_so_is_a_nan_gradient_from_the_first_step() -> None:
    detector = auto()
    norms = noisy(4, 0)
    assert bool(detector.judge(norms, torch.linalg.vector_norm(norms), torch.tensor(math.nan)).spike)
    norms[1] = math.nan
    assert bool(detector.judge(norms, torch.linalg.vector_norm(norms), torch.tensor(2.0)).spike)


def test_an_all_zero_gradient_is_not_a_spike() -> None:
    detector = auto()
    stream(detector, range(30))
    zero = torch.zeros(4)
    verdict = detector.judge(zero, torch.linalg.vector_norm(zero), torch.tensor(2.0))
    assert not bool(verdict.spike)


def test_spike_threshold_is_honoured() -> None:
    spike = {60: 6.0}  # every gradient x6: a common-mode jump only the global norm sees
    assert not any(r for r, _ in stream(auto(threshold=10.0), range(80), scale=spike, tensor=None))
    assert [s for s, (r, _) in zip(range(80), stream(auto(threshold=3.0), range(80), scale=spike, tensor=None))
            if r] == [60]
    assert make_detector("zscore", spike_threshold=3.0, ema_alpha=0.01, warmup_steps=10, norm_floor=1e-3).threshold == 3.0
    assert make_detector("auto", spike_threshold=4.0, ema_alpha=0.01, warmup_steps=10, norm_floor=1e-3).threshold == 4.0


def test_the_zscore_guard_uses_the_spike_threshold_it_was_given(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 2)
    guard = GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, detector="zscore",
                             spike_threshold=3.0, verbose=False, log_dir=tmp_path)
    assert guard.detector.threshold == 3.0


def test_limits_follow_shares_back_to_norms() -> None:
    detector = auto()
    stream(detector, range(60))
    norms = noisy(4, 60)
    detector.judge(norms, torch.linalg.vector_norm(norms), torch.tensor(2.0))
    limits = detector.limits()[0].clone()
    for i in range(4):
        for factor, trips in ((0.98, False), (1.02, True)):
            probe = norms.clone()
            probe[i] = limits[i] * factor
            verdict = detector.judge(probe, torch.linalg.vector_norm(probe), torch.tensor(2.0))
            assert explain(detector, verdict, probe).tripped[i] is trips


def test_auto_state_dict_round_trip_continues_identically() -> None:
    a = auto()
    stream(a, range(70), scale={40: 1e3, 50: 30.0})
    b = auto()
    b.load_state_dict(a.state_dict())
    assert stream(a, range(70, 120), scale={100: 1e3}) == stream(b, range(70, 120), scale={100: 1e3})


def test_extra_judges_before_or_after_an_update_change_nothing() -> None:
    """A step's trip-ring row is written by judge(): judging other norms again (before the update, which then
    re-judges the step's own; after it, as a triage recompute does) only rewrites the row the next step's judge
    writes before it reads the ring."""
    plain, judged = auto(), auto()
    loss = torch.tensor(plain.absent_loss)
    absorbed = []
    for s in range(90):
        norms = noisy(4, s)
        norms[2] *= 30.0 if 40 <= s < 60 else 1.0  # trips, then is absorbed: the ring decides
        other = noisy(4, 1000 + s) * 1e3
        reject, verdict = decide(plain, norms, torch.linalg.vector_norm(norms), loss)
        absorbed.append(bool(verdict.absorbed))
        plain.update(norms, torch.linalg.vector_norm(norms), loss, reject)
        judged.judge(other, torch.linalg.vector_norm(other), loss)
        again, _ = decide(judged, norms, torch.linalg.vector_norm(norms), loss)
        judged.judge(other, torch.linalg.vector_norm(other), loss)
        judged.update(norms, torch.linalg.vector_norm(norms), loss, again)
        judged.judge(other, torch.linalg.vector_norm(other), loss)
        assert bool(again) == bool(reject)
    assert any(absorbed)
    assert same_detector_state(plain.state_dict()["state"], judged.state_dict()["state"], skip=("ring",))
    assert stream(plain, range(90, 130), scale={100: 1e3}) == stream(judged, range(90, 130), scale={100: 1e3})


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda s: s.pop("state"),
        lambda s: s["state"].pop("ring"),
        lambda s: s["state"].update(state=torch.zeros(4, 3)),
        lambda s: s["state"].update(ring=[0.0] * 6),
        lambda s: s.update(n=5),
        lambda s: s.update(name="ratio"),
        lambda s: s.update(tick=-1),
    ],
)
def test_load_state_dict_validates_everything_before_changing_anything(corrupt: Any) -> None:
    detector = auto()
    stream(detector, range(30))
    before = {k: v.clone() for k, v in detector.state_dict()["state"].items()}
    saved = detector.state_dict()
    corrupt(saved)
    with pytest.raises(ConfigError) as info:
        detector.load_state_dict(saved)
    assert info.value.argument == "state_dict"
    assert same_detector_state(before, detector.state_dict()["state"])


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"threshold": 0.0}, "spike_threshold"),
        ({"threshold": float("inf")}, "spike_threshold"),
        ({"sigmas": -1.0}, "sigmas"),
        ({"loss_ratio": 1.0}, "loss_ratio"),
        ({"absorb_after": 1}, "absorb_after"),
        ({"absorb_after": 2.5}, "absorb_after"),
        ({"floor": 1.5}, "norm_floor"),
        ({"ema_alpha": 0.0}, "ema_alpha"),
        ({"warmup_steps": -1}, "warmup_steps"),
    ],
)
def test_auto_bad_arguments_name_the_argument(kwargs: dict[str, Any], argument: str) -> None:
    with pytest.raises(ConfigError) as info:
        AutoDetector(**kwargs)
    assert info.value.argument == argument and "Fix:" in str(info.value)


def test_auto_judge_and_update_never_read_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests._guard_helpers import SyncCounter

    detector = auto()
    stream(detector, range(20))
    counter = SyncCounter(monkeypatch)
    norms = noisy(4, 20)
    global_norm = torch.linalg.vector_norm(norms)
    counter.active = True
    verdict = detector.judge(norms, global_norm, torch.tensor(2.0))
    detector.update(norms, global_norm, torch.tensor(2.0), verdict.spike)
    counter.active = False
    assert counter.calls == 0


@pytest.mark.parametrize("seed", [5, 6, 10, 11, 13])  # seeds on which a tight loss prior from step 1 tripped
def test_warmup_zero_with_noisy_small_batch_losses_raises_no_alarm(tmp_path: Path, seed: int) -> None:
    """A handful of noisy losses says little about their spread: no rejection while the loss prior is wide."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    guard = GuardedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3), model, spike_threshold=100.0,
                             warmup_steps=0, verbose=False, log_dir=tmp_path)
    for _ in range(20):
        loss = torch.nn.functional.mse_loss(model(torch.randn(4, 8)), torch.randn(4, 4))
        loss.backward()
        guard.step(loss=loss.item())
        guard.zero_grad()
    guard.flush()
    assert guard.total_spikes == 0 and guard.step_count == 20


def test_the_guard_absorbs_a_sustained_shift_and_its_summary_counts_it(tmp_path: Path) -> None:
    """Every gradient x30 from step 40 on (a loss summed instead of averaged): rejected until absorbed."""
    from guardtower.events import SummaryEvent
    from guardtower.testing import capture_events
    from tests._guard_helpers import make, train

    def times_30(step: int, model: torch.nn.Module) -> None:
        if step >= 40:
            for p in model.parameters():
                assert p.grad is not None
                p.grad.mul_(30.0)

    model, guard = make(tmp_path, log_every=10)
    with capture_events() as events:
        train(model, guard, 80, corrupt=times_30)
        guard.flush()
    assert 1 <= guard.total_skips < guard.detector.absorb_after  # rejected until the 8th, then accepted
    summaries = [e for e in events if isinstance(e, SummaryEvent)]
    assert summaries[-1].metrics["level_shifts"] >= 1 and summaries[0].metrics["level_shifts"] == 0
    guard.close()


def test_a_heavy_tailed_series_is_judged_against_its_own_peak() -> None:
    """A tensor whose healthy steps jump x6 now and then may then jump x25 (a LoRA factor, a deep
    non-residual net's global norm): within threshold x its peak envelope. x200 is still a spike (beyond
    threshold^2 x its level). The previous default rejected the x25 step."""
    for seed in range(3):
        detector = AutoDetector()
        detector.resize(2, torch.device("cpu"))
        gen = torch.Generator().manual_seed(seed)
        jumps = {60: 6.0, 100: 6.0, 110: 25.0, 140: 200.0}
        flagged = {}
        for step in range(200):
            norms = torch.exp(torch.randn(2, generator=gen) * torch.tensor([0.05, 0.5]))
            norms[1] *= jumps.get(step, 1.0)
            global_norm, loss = torch.linalg.vector_norm(norms), torch.tensor(2.0)
            verdict = detector.judge(norms, global_norm, loss)
            detector.update(norms, global_norm, loss, verdict.spike)
            if step in jumps:
                flagged[step] = bool(verdict.spike)
        assert flagged == {60: False, 100: False, 110: False, 140: True}
