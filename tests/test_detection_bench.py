"""The detection benchmark's harness (bench/): the published rules as specified, fair replays, and a small
healthy benchmark with the real guard at its defaults."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from _healthy import CONFIGS  # noqa: E402
from _rules import LightningSpikeRule, MegatronRule, OLMoCoreRule, ZClipRule  # noqa: E402
from _trace import Incident, Trace, global_of, live, plan, replay  # noqa: E402

from guardtower.guard.detector import AutoDetector, Detector  # noqa: E402
from tests._guard_helpers import same_detector_state  # noqa: E402


def run(detector: Detector, norms: list[float], losses: list[float]) -> list[bool]:
    """One global norm (a single tensor) and a loss per step, judged then folded in as the guard does."""
    detector.resize(1, torch.device("cpu"))
    out = []
    for g, l in zip(norms, losses):
        x, loss = torch.tensor([g]), torch.tensor(l)
        verdict = detector.judge(x, global_of(x), loss)
        detector.update(x, global_of(x), loss, verdict.spike)
        out.append(bool(verdict.spike))
    return out


def wobble(steps: int, base: float = 1.0) -> list[float]:
    return [base * (1 + 0.05 * math.sin(s)) for s in range(steps)]


def test_olmo_core_waits_for_half_its_window_then_flags_6_sigma() -> None:
    norms = wobble(220)
    norms[40] = 1e3  # before 64 observations: not judged, but it enters the window (every step does)
    norms[120] = 1.6  # far beyond 6 std of a 0.05-wide series, hidden by the 1e3 still in the window
    norms[200] = 1.6  # the 1e3 has left the 128-step window
    flagged = run(OLMoCoreRule(), norms, wobble(220, 2.0))
    assert [s for s, f in enumerate(flagged) if f] == [200]


def test_zclip_warms_up_on_25_norms_then_flags_z_above_2_5() -> None:
    norms = wobble(60)
    norms[10], norms[50] = 1.5, 1.5  # the same excursion: inside the 25 warmup norms, then after them
    flagged = run(ZClipRule(), norms, wobble(60))
    assert [s for s, f in enumerate(flagged) if f] == [50]


def test_lightning_flags_a_loss_above_3x_the_mean_of_the_last_10() -> None:
    losses = wobble(40, 2.0)
    losses[20], losses[30] = 5.0, 7.0  # 2.5x: not a spike (rtol 2 means more than 3x); 3.5x: a spike
    flagged = run(LightningSpikeRule(), wobble(40), losses)
    assert [s for s, f in enumerate(flagged) if f] == [30]


def test_megatron_compares_with_10x_the_max_of_the_first_100() -> None:
    norms = wobble(150)
    norms[50] = 5.0  # within the first 100: raises the max, never flagged
    norms[120], norms[130] = 40.0, 60.0  # 40 < 10 x 5; 60 > 50
    flagged = run(MegatronRule(), norms, wobble(150))
    assert [s for s, f in enumerate(flagged) if f] == [130]


def test_a_replay_judges_incidents_without_applying_them() -> None:
    gen = torch.Generator().manual_seed(0)
    norms = torch.exp(torch.randn(80, 5, generator=gen) * 0.2)
    loss = torch.full((80,), 2.0)
    spike = norms[50].clone()
    spike[1] *= 1e3
    clean = Trace("t", [f"p{i}" for i in range(5)], norms, global_of(norms), loss)
    dirty = Trace("t", clean.names, norms, global_of(norms), loss,
                  [Incident(50, "x1e3-small", "late", spike, global_of(spike), loss[50])])
    a, b = AutoDetector(), AutoDetector()
    result, rejected = replay(a, dirty)
    replay(b, clean)
    assert result.caught == {("x1e3-small", "late"): True} and result.false_alarms == 0 and not any(rejected)
    assert same_detector_state(a.state_dict()["state"], b.state_dict()["state"])


def test_incidents_are_planned_early_and_late() -> None:
    steps = plan(300)
    early = [s for s, (_, phase) in steps.items() if phase == "early"]
    late = [s for s, (_, phase) in steps.items() if phase == "late"]
    assert len(early) == len(late) == 9 and all(15 <= s < 50 for s in early) and all(200 <= s < 300 for s in late)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama-adamw-const2e-3", "mlp-ln-wine-adamw-const", "cnn-bn-digits-sgd-cosine"])
def test_the_default_guard_leaves_healthy_runs_alone(name: str) -> None:
    """A small version of bench/detection.py: the real GuardedOptimizer at its defaults, 200 steps from step 0."""
    config = next(c for c in CONFIGS if c.name == name)
    result = live(config, seed=2, steps=200)
    assert result.stopped_at is None and result.steps == 200
    assert result.rejected <= 200 / 1000  # <= 1 false alarm per 1,000 steps
    assert result.final_loss < 0.5 * result.first_loss  # and it trained


def test_the_default_guard_leaves_a_deep_non_residual_layernorm_mlp_alone() -> None:
    """The real guard on a 16-layer Linear -> LayerNorm -> Tanh MLP at AdamW 1e-3, random labels (loss nearly
    flat): its global norm jumps x50 at step 245 of seed 1, with x20-x40 jumps before; the previous default
    rejected that step."""
    config = next(c for c in CONFIGS if c.name == "mlp-plain-ln-random-adamw-const1e-3")
    result = live(config, seed=1, steps=260)
    assert result.stopped_at is None and result.steps == 260 and result.rejected == 0


@pytest.mark.slow
def test_the_default_guard_leaves_a_plain_lora_loop_alone() -> None:
    """A peft LoRA GPT-2 at AdamW 1e-3 from step 0: layer 0's lora_A jumps x19 at step 175 of seed 1."""
    config = next(c for c in CONFIGS if c.name == "lora-gpt2-adamw-const1e-3")
    result = live(config, seed=1, steps=220)
    assert result.stopped_at is None and result.rejected == 0
