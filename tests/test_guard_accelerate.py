"""The guard under Hugging Face Accelerate: both wrapping orders, gradient accumulation, bf16 and a GradScaler.

One real 2-process launch (gloo, 127.0.0.1; Accelerate wraps the model in DDP) runs every scenario of
tests/_guard_accel_worker.py; a fast single-process test covers the order Accelerate does not handle itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from guardtower.guard import GuardedOptimizer
from tests._dist_launch import run_two_ranks

WORKER = Path(__file__).with_name("_guard_accel_worker.py")
SPIKE, NAN, OVERFLOW = 12, 20, 16  # the worker's optimizer steps with incidents


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_two_ranks(WORKER, tmp_path_factory.mktemp("accelerate"))


@pytest.mark.slow
@pytest.mark.parametrize("order", ["inside", "around"])
def test_accelerate_accumulation_judges_real_steps_and_ranks_agree(ranks: list[dict[str, Any]], order: str) -> None:
    r0, r1 = ranks
    healthy, hurt = r0[order], r0[f"{order}-incidents"]
    assert healthy["counters"] == [30, 0, 0, 0]  # 60 micro-batches, 30 judged steps, no rejection
    assert hurt["skips"] == [SPIKE, NAN]  # the accumulated spike of rank 1, the NaN only rank 0 saw
    assert hurt["counters"] == [30, 2, 2, 0] and hurt["unchanged"] == {str(SPIKE): True, str(NAN): True}
    assert hurt["saved_skips"] == 2  # the guard's state comes through Accelerate's wrapper
    for name in (order, f"{order}-incidents"):
        assert r0[name] == r1[name]  # same skips, counters, and bitwise the same weights on both ranks
        assert r0[name]["finite"]


@pytest.mark.slow
def test_accelerate_save_state_and_load_state_carry_the_guard(ranks: list[dict[str, Any]]) -> None:
    assert ranks[0]["inside-incidents"]["resumed"] == ranks[1]["inside-incidents"]["resumed"] == [30, 2, 2]


@pytest.mark.slow
def test_accelerate_grad_scaler_overflow_is_not_a_spike_on_any_rank(ranks: list[dict[str, Any]]) -> None:
    r0, r1 = ranks
    for name in ("inside-scaler", "around-scaler"):
        assert r0[name] == r1[name] and r0[name]["counters"] == [30, 0, 0, 0] and r0[name]["scale"] == 1024.0
    inside, around = r0["inside-scaler-incidents"], r0["around-scaler-incidents"]
    assert r1["inside-scaler-incidents"] == inside and r1["around-scaler-incidents"] == around
    # inside: the overflow at step 16 halves the scale, the spike is skipped
    assert inside["skips"] == [SPIKE] and inside["counters"] == [30, 1, 1, 1] and inside["scale"] == 512.0
    # around: also rank 0's lone NaN after the all-reduce is an overflow every rank's scaler agrees on
    assert around["skips"] == [SPIKE] and around["counters"] == [30, 1, 1, 2] and around["scale"] == 256.0
    assert around["unchanged"] == {str(SPIKE): True, str(NAN): True}
    assert inside["finite"] and around["finite"]


def test_guard_around_accelerate_skips_micro_steps_and_unscales(tmp_path: Path) -> None:
    """``GuardedOptimizer(accelerator.prepare(opt))``: micro-steps pass through unjudged, and a GradScaler's
    overflow is the scaler's (its scale halves), not a NaN spike of still-scaled gradients; gradients that
    ``accelerator.clip_grad_norm_`` already unscaled are not unscaled twice."""
    import accelerate

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)  # Accelerate gives none on the CPU
    model, prepared = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    guard = GuardedOptimizer(prepared, model, log_dir=tmp_path, verbose=False)
    for micro in range(24):
        gen = torch.Generator().manual_seed(micro)
        with accelerator.accumulate(model):
            loss = ((model(torch.randn(8, 8, generator=gen)) - torch.randn(8, 1, generator=gen)) ** 2).mean()
            accelerator.backward(loss * (1e38 if micro == 15 else 1.0))  # overflows optimizer step 8
            if accelerator.sync_gradients and micro % 4 == 1:  # unscales first: the guard must not unscale again
                accelerator.clip_grad_norm_(model.parameters(), 1e9)
            guard.step()
            guard.zero_grad()
    assert guard.step_count == 12 and guard.total_overflows == 1 and guard.total_spikes == 0
    assert accelerator.scaler.get_scale() == 512.0
    guard.close()


def test_triage_around_accelerate_judges_the_recompute_at_the_scalers_scale(tmp_path: Path) -> None:
    """Triage's recompute runs ``accelerator.backward`` again, which scales: the guard divides by the wrapper's
    scaler's scale, so a one-off spike is transient and a bad batch deterministic."""
    import accelerate

    from guardtower.events import SpikeEvent
    from guardtower.testing import InMemorySink

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    accelerator = accelerate.Accelerator(cpu=True)
    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1000)
    model, prepared = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    sink = InMemorySink()
    guard = GuardedOptimizer(prepared, model, log_dir=tmp_path, verbose=False, sinks=[sink], triage=True)
    for step in range(1, 19):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 8, generator=gen) * (1e3 if step == 16 else 1.0), torch.randn(8, 1, generator=gen)

        def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
            guard.zero_grad()
            loss = ((model(x) - y) ** 2).mean()
            accelerator.backward(loss)
            return loss

        guard.observe_recompute(closure)
        closure()
        if step == 12:
            next(model.parameters()).grad.mul_(1e4)  # a one-off fault on the first computation only
        guard.step()
    guard.flush()
    found = {e.step: e.triage for e in sink.events if isinstance(e, SpikeEvent)}
    assert found == {12: "transient", 16: "deterministic"}
    assert guard.total_overflows == 0 and accelerator.scaler.get_scale() == 2.0**10
    guard.close()
