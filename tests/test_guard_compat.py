"""GuardedOptimizer as a drop-in Optimizer: schedulers, GradScaler, accumulation, closures, state dicts, hooks."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any
import pytest
import torch

from guardtower.errors import ConfigError
from guardtower.events import SpikeEvent
from guardtower.guard import GuardedOptimizer
from guardtower.testing import capture_events
from tests._guard_helpers import (TinyNet, backward, full_state, make, same_detector_state, same_state, scale_grad,
                                   train)


def test_is_an_optimizer_sharing_groups_state_and_defaults(tmp_path: Path) -> None:
    model, guard = make(tmp_path)
    base = guard.base_optimizer
    assert isinstance(guard, torch.optim.Optimizer)
    assert guard.param_groups is base.param_groups and guard.state is base.state
    assert guard.defaults is base.defaults
    train(model, guard, 2)
    guard.load_state_dict(guard.state_dict())  # torch replaces the base's lists and dicts here
    assert guard.param_groups is base.param_groups and guard.state is base.state


def test_lr_scheduler_drives_the_guarded_optimizer_without_warnings(tmp_path: Path) -> None:
    model, guard = make(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scheduler = torch.optim.lr_scheduler.StepLR(guard, step_size=2, gamma=0.5)
        for i in range(4):
            guard.zero_grad()
            backward(model, i)
            guard.step()
            scheduler.step()
    assert guard.base_optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.25)


def test_lr_scheduler_keeps_stepping_on_skipped_steps(tmp_path: Path) -> None:
    """Skipping an update is the guard's call; the schedule is the caller's and is not paused."""
    model, guard = make(tmp_path)
    scheduler = torch.optim.lr_scheduler.LambdaLR(guard, lambda s: 1.0 / (1 + s))
    for i in range(3):
        guard.zero_grad()
        backward(model, i)
        model.inp.weight.grad.fill_(float("nan"))
        guard.step()
        scheduler.step()
    assert scheduler.last_epoch == 3


@pytest.mark.parametrize("fused", [True, False])
def test_grad_scaler_overflow_is_not_a_spike_and_does_not_poison_the_next_step(tmp_path: Path, fused: bool) -> None:
    torch.manual_seed(0)
    model = TinyNet()
    guard = GuardedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused), model,
                             log_dir=tmp_path, verbose=False)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    assert guard._step_supports_amp_scaling is fused

    def scaled_step(i: int, overflow: bool = False) -> None:
        guard.zero_grad()
        gen = torch.Generator().manual_seed(i)
        x, y = torch.randn(32, 8, generator=gen), torch.randn(32, 1, generator=gen)
        scaler.scale(((model(x) - y) ** 2).mean()).backward()
        if overflow:
            model.out.weight.grad[0, 0] = float("inf")
        scaler.step(guard)
        scaler.update()

    for i in range(20):
        scaled_step(i)
    detector_before = {k: v.clone() for k, v in guard.detector.state_dict()["state"].items()}
    before = full_state(model, guard)
    scale_before = scaler.get_scale()
    with capture_events() as events:
        scaled_step(20, overflow=True)
        guard.flush()
    assert scaler.get_scale() == scale_before / 2  # the scaler saw and handled the overflow
    assert same_state(before, full_state(model, guard))
    assert guard.total_spikes == 0 and not any(isinstance(e, SpikeEvent) for e in events)
    detector_after = guard.detector.state_dict()["state"]
    # the ring of recent trips records every judged step (an overflow breaks a run of trips); nothing else moves
    assert same_detector_state(detector_before, detector_after, skip=("ring",))
    with capture_events() as events:
        for i in range(21, 25):
            scaled_step(i)
        guard.flush()
    assert guard.total_spikes == 0 and not same_state(before, full_state(model, guard))


def test_grad_scaler_with_fused_optimizer_still_catches_a_real_spike(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TinyNet()
    guard = GuardedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True), model,
                             log_dir=tmp_path, verbose=False)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    for i in range(25):
        guard.zero_grad()
        gen = torch.Generator().manual_seed(i)
        x, y = torch.randn(32, 8, generator=gen), torch.randn(32, 1, generator=gen)
        scaler.scale(((model(x) - y) ** 2).mean()).backward()
        if i == 22:
            model.out.weight.grad.mul_(1e3)  # finite, so the scaler lets it through
            before = full_state(model, guard)
        scaler.step(guard)
        scaler.update()
        if i == 22:
            assert same_state(before, full_state(model, guard))
    guard.flush()
    assert guard.total_spikes == 1


def test_grad_scaler_unscale_then_clip_then_step_with_a_fused_optimizer(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TinyNet()
    guard = GuardedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True), model,
                             log_dir=tmp_path, verbose=False)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    with capture_events() as events:
        for i in range(20):
            guard.zero_grad()
            gen = torch.Generator().manual_seed(i)
            x, y = torch.randn(32, 8, generator=gen), torch.randn(32, 1, generator=gen)
            scaler.scale(((model(x) - y) ** 2).mean()).backward()
            scaler.unscale_(guard)
            if i == 15:
                model.out.weight.grad.mul_(1e3)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e6)
            scaler.step(guard)
            scaler.update()
        guard.flush()
    spikes = [e for e in events if isinstance(e, SpikeEvent)]
    assert [(e.step, e.layer) for e in spikes] == [(16, "out.weight")]
    assert spikes[0].baseline < 10  # measured on unscaled gradients (the scale is 4096)


def test_gradient_accumulation_is_judged_once_per_optimizer_step(tmp_path: Path) -> None:
    model, guard = make(tmp_path)
    for step in range(15):
        guard.zero_grad()
        for micro in range(4):
            backward(model, 10 * step + micro)
            if step == 12 and micro == 2:
                model.out.weight.grad.mul_(1e3)
        guard.step()
    guard.flush()
    assert guard.step_count == 15 and guard.total_spikes == 1


def test_closure_loss_is_returned_recorded_and_evaluated_once(tmp_path: Path) -> None:
    model, guard = make(tmp_path, "adamw_foreach")
    calls = []

    def closure() -> torch.Tensor:
        calls.append(1)
        guard.zero_grad()
        return backward(model, len(calls))

    for _ in range(12):
        out = guard.step(closure)
    assert isinstance(out, torch.Tensor) and len(calls) == 12

    def bad_closure() -> torch.Tensor:
        loss = closure()
        model.inp.weight.grad.fill_(float("nan"))
        return loss * 0 + 7.5

    with capture_events() as events:
        assert float(guard.step(bad_closure)) == 7.5
        guard.flush()
    assert next(e for e in events if isinstance(e, SpikeEvent)).loss == 7.5


def test_lbfgs_closure_can_be_re_evaluated(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TinyNet().eval()
    guard = GuardedOptimizer(torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=4), model, log_dir=tmp_path,
                             verbose=False)
    x, y = torch.randn(32, 8), torch.randn(32, 1)

    def closure() -> torch.Tensor:
        guard.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        return loss

    first = closure().item()
    for _ in range(3):
        guard.step(closure)
    assert closure().item() < first


def test_multiple_param_groups_and_add_param_group(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TinyNet()
    base = torch.optim.AdamW([{"params": model.inp.parameters(), "lr": 1e-2},
                              {"params": model.norm.parameters(), "lr": 1e-3}], fused=True)
    guard = GuardedOptimizer(base, model, log_dir=tmp_path, verbose=False, warmup_steps=3)
    train(model, guard, 12)
    guard.add_param_group({"params": model.out.parameters(), "lr": 5e-3})
    assert len(guard.param_groups) == 3 and guard.detector.n == 6
    train(model, guard, 6, start=12)  # the new tensors warm up
    before = full_state(model, guard)
    with capture_events() as events:
        train(model, guard, 1, start=18, corrupt=lambda i, m: scale_grad("out.weight", 1e3)(m))
        guard.flush()
    assert same_state(before, full_state(model, guard))
    assert next(e for e in events if isinstance(e, SpikeEvent)).layer == "out.weight"


def test_state_dict_round_trip_carries_baselines_and_counters(tmp_path: Path) -> None:
    model, guard = make(tmp_path)
    train(model, guard, 20, corrupt=lambda i, m: m.out.bias.grad.fill_(float("nan")) if i == 15 else None)
    saved = copy.deepcopy(guard.state_dict())  # as after torch.save/torch.load: no tensors shared
    assert "guardtower" in saved and saved["guardtower"]["total_spikes"] == 1
    other_model, other = make(tmp_path, seed=1)
    other_model.load_state_dict(model.state_dict())
    other.load_state_dict(saved)
    assert (other.step_count, other.total_spikes, other.total_skips) == (20, 1, 1)
    a, b = guard.detector.state_dict()["state"], other.detector.state_dict()["state"]
    assert same_detector_state(a, b)
    # both continue identically
    train(model, guard, 3, start=20)
    train(other_model, other, 3, start=20)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), other_model.parameters()))


def test_load_state_dict_accepts_a_plain_base_optimizer_state_dict(tmp_path: Path) -> None:
    model, guard = make(tmp_path)
    train(model, guard, 12)
    plain = guard.base_optimizer.state_dict()
    _, other = make(tmp_path)
    other.load_state_dict(plain)
    assert other.step_count == 0
    assert other.base_optimizer.state_dict()["state"].keys() == plain["state"].keys()


def test_load_state_dict_from_another_model_is_refused_without_changes(tmp_path: Path) -> None:
    model, guard = make(tmp_path)
    train(model, guard, 3)
    saved = guard.state_dict()
    saved["guardtower"]["detector"]["n"] = 99
    before = full_state(model, guard)
    with pytest.raises(ConfigError):
        guard.load_state_dict(saved)
    assert same_state(before, full_state(model, guard)) and guard.step_count == 3


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_passes_through(tmp_path: Path, set_to_none: bool) -> None:
    model, guard = make(tmp_path)
    backward(model, 0)
    guard.zero_grad(set_to_none=set_to_none)
    grads = [p.grad for p in model.parameters()]
    assert all(g is None for g in grads) if set_to_none else all(g is not None and not g.any() for g in grads)


def test_step_hooks_registered_on_the_guard_run_once_per_step(tmp_path: Path) -> None:
    model, guard = make(tmp_path)
    seen: list[str] = []
    guard.register_step_pre_hook(lambda opt, args, kwargs: seen.append("pre"))
    guard.register_step_post_hook(lambda opt, args, kwargs: seen.append("post"))
    train(model, guard, 2)
    assert seen == ["pre", "post", "pre", "post"]


def test_accelerate_prepares_and_steps_the_guarded_optimizer(tmp_path: Path) -> None:
    import accelerate

    model, guard = make(tmp_path)
    accelerator = accelerate.Accelerator(cpu=True)
    model, prepared = accelerator.prepare(model, guard)
    for i in range(15):
        prepared.zero_grad()
        gen = torch.Generator().manual_seed(i)
        x, y = torch.randn(32, 8, generator=gen), torch.randn(32, 1, generator=gen)
        accelerator.backward(((model(x) - y) ** 2).mean())
        if i == 13:
            model.out.weight.grad.fill_(float("nan"))
        prepared.step()
    guard.flush()
    assert guard.step_count == 15 and guard.total_spikes == 1
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.slow
def test_hf_trainer_accepts_the_guarded_optimizer(tmp_path: Path) -> None:
    from torch.utils.data import Dataset
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2,
                                       bos_token_id=0, eos_token_id=0))

    class Tokens(Dataset):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return 64

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            ids = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids}

    guard = GuardedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), model,
                             log_dir=tmp_path / "logs", verbose=False, warmup_steps=3)

    class Corrupt(TrainerCallback):  # type: ignore[misc]
        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == 8:
                model.transformer.h[0].mlp.c_fc.weight.grad.fill_(float("nan"))

    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=12, per_device_train_batch_size=4,
                             report_to=[], save_strategy="no", logging_strategy="no", use_cpu=True,
                             dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), optimizers=(guard, None),
                      callbacks=[Corrupt()])
    trainer.train()
    guard.flush()
    assert guard.step_count == 12 and guard.total_skips == 1
    assert all(torch.isfinite(p).all() for p in model.parameters())
