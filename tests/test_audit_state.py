"""audit() leaves the training state bitwise identical, for every model family, also when things raise."""

from __future__ import annotations

import random
from typing import Any, Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from guardtower.preflight import _registry, audit
from guardtower.report import Finding

from tests._audit_core_helpers import (
    SmallCNN,
    bert_mlm,
    fingerprint,
    gpt2,
    llama,
    mlp,
    regression_batch,
    token_batch,
    train_a_bit,
)

Setup = tuple[nn.Module, torch.optim.Optimizer, Callable[[], Any], Any]


def _mlp() -> Setup:
    m = mlp()
    x, y = regression_batch()
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    return m, opt, lambda: F.mse_loss(m(x), y), (x, y)


def _cnn() -> Setup:
    m = SmallCNN()
    x = torch.randn(4, 3, 8, 8)
    y = torch.arange(4) % 5
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    return m, opt, lambda: F.cross_entropy(m(x), y), (x, y)


def _hf(build: Callable[[], nn.Module]) -> Callable[[], Setup]:
    def setup() -> Setup:
        m = build()
        batch = token_batch(pad_last=2)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        return m, opt, lambda: m(**batch), batch

    return setup


FAMILIES = {"mlp": _mlp, "cnn_batchnorm": _cnn, "gpt2": _hf(gpt2), "llama": _hf(llama), "bert": _hf(bert_mlm)}


def _prepare(family: str) -> Setup:
    model, opt, step, inputs = FAMILIES[family]()
    train_a_bit(model, opt, step)  # Adam/momentum state exists, BatchNorm stats moved
    opt.zero_grad(set_to_none=True)
    loss = step()
    getattr(loss, "loss", loss).backward()  # some .grad set ...
    first = next(iter(model.parameters()))
    first.grad = None  # ... and some None
    model.train()
    # freeze nothing, but leave one submodule in eval to see flags restored exactly
    next(m for m in model.modules() if m is not model).eval()
    random.seed(123)
    np.random.seed(123)
    return model, opt, step, inputs


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_state_is_bitwise_identical(family: str) -> None:
    model, opt, step, inputs = _prepare(family)
    before = fingerprint(model, opt, inputs)
    report = audit(model, step, optimizer=opt, inputs=inputs)
    assert report.checks_run
    assert fingerprint(model, opt, inputs) == before


@pytest.mark.parametrize("family", ["mlp", "gpt2"])
def test_state_restored_when_step_fn_raises(family: str) -> None:
    model, opt, step, inputs = _prepare(family)
    before = fingerprint(model, opt, inputs)

    def exploding_step() -> Any:
        out = step()
        opt.step()  # damage everything a step can damage ...
        torch.rand(3)
        random.random()
        model.eval()
        torch.set_grad_enabled(False)
        raise RuntimeError("CUDA error: device-side assert triggered")

    try:
        report = audit(model, exploding_step, optimizer=opt, inputs=inputs)
    finally:
        torch.set_grad_enabled(True)
    (finding,) = report.by_id("LOSS-006")
    assert "device-side assert" in finding.message
    assert fingerprint(model, opt, inputs) == before


def test_state_restored_when_a_check_raises_after_mutating(monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt, step, inputs = _prepare("cnn_batchnorm")
    before = fingerprint(model, opt, inputs)

    def vandal(ctx: _registry.AuditContext) -> list[Finding]:
        with torch.no_grad():
            next(ctx.model.parameters()).add_(1.0)
        ctx.model.eval()
        raise ValueError("boom")

    monkeypatch.setitem(_registry.CHECKS, "vandal", _registry.CheckSpec("vandal", vandal, False))
    report = audit(model, step, optimizer=opt, inputs=inputs)
    (finding,) = report.by_id("AUDIT-001")
    assert finding.check == "vandal" and "ValueError: boom" in finding.message
    assert fingerprint(model, opt, inputs) == before


def test_float_inputs_requires_grad_and_grad_restored() -> None:
    model = mlp()
    x, y = regression_batch()
    x_with_grad = x.clone().requires_grad_(True)
    x_with_grad.grad = torch.ones_like(x)
    for inp in (x, x_with_grad):
        snapshot = (inp.requires_grad, None if inp.grad is None else inp.grad.clone())
        audit(model, lambda inp=inp: F.mse_loss(model(inp), y), inputs=(inp, y))
        assert inp.requires_grad == snapshot[0]
        assert (inp.grad is None) == (snapshot[1] is None)
        if snapshot[1] is not None:
            assert torch.equal(inp.grad, snapshot[1])


def test_step_fn_that_runs_its_own_backward_and_optimizer_step() -> None:
    model, opt, step, inputs = _prepare("mlp")
    before = fingerprint(model, opt, inputs)

    def full_step() -> torch.Tensor:
        opt.zero_grad()
        loss = step()
        loss.backward()
        opt.step()
        return loss

    report = audit(model, full_step, optimizer=opt, inputs=inputs)
    assert not report.errors, str(report)
    assert fingerprint(model, opt, inputs) == before


def test_accelerates_accumulation_phase_is_put_back_so_the_next_update_syncs_on_its_last_micro_batch() -> None:
    from accelerate import Accelerator

    accelerator = Accelerator(gradient_accumulation_steps=2, cpu=True)
    model = mlp()
    x, y = regression_batch()
    base = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = accelerator.prepare(model, base)
    synced: list[bool] = []

    def step() -> torch.Tensor:  # one update = two micro-batches, copied out: inputs= never reaches the model itself
        total = torch.zeros(())
        for i in range(2):
            with accelerator.accumulate(model):
                loss = F.mse_loss(model(x[i::2].contiguous()), y[i::2])
                accelerator.backward(loss)
                synced.append(accelerator.sync_gradients)
                opt.step()
                opt.zero_grad()
            total = total + loss.detach()
        return total / 2

    report = audit(model, step, optimizer=base, inputs=(x, y))
    assert report.step_fn_calls >= 2 and any("inputs= perturbed" in n for n in report.notes), report.notes
    assert accelerator.step == 0 and accelerator.sync_gradients
    synced.clear()
    step()
    assert synced == [False, True]  # the user's first update after the audit accumulates both micro-batches


def test_scaler_state_restored() -> None:
    model = mlp()
    x, y = regression_batch()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)

    def step() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(model(x).float(), y)
        scaler.scale(loss)  # lazily creates the scale tensor
        return loss

    before = dict(vars(scaler))
    audit(model, step, scaler=scaler)
    assert set(vars(scaler)) == set(before)
    assert scaler._scale is None and before["_scale"] is None


class _CountingWrapper(torch.optim.Optimizer):
    """Like Accelerate's / a guard's wrapper: shares the base's groups and state, has its own step bookkeeping."""

    def __init__(self, base: torch.optim.Optimizer) -> None:
        self.optimizer = base
        self.steps = 0

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property  # type: ignore[override]
    def state(self) -> Any:
        return self.optimizer.state

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        self.steps += 1
        return self.optimizer.step(closure)


def test_trial_update_bypasses_wrappers_and_step_hooks() -> None:
    model, base, step, inputs = _prepare("mlp")
    hook_calls: list[int] = []
    base.register_step_post_hook(lambda *a: hook_calls.append(1))  # e.g. an EMA update
    wrapped = _CountingWrapper(base)
    before = fingerprint(model, base, inputs)
    report = audit(model, step, optimizer=wrapped, inputs=inputs, checks=["update_ratio", "optimizer_coverage"])
    assert not report.findings, str(report)
    assert wrapped.steps == 0 and not hook_calls
    assert fingerprint(model, base, inputs) == before


def test_audit_called_under_no_grad_still_audits_the_training_step() -> None:
    model, opt, step, inputs = _prepare("mlp")
    with torch.no_grad():
        report = audit(model, step, optimizer=opt, inputs=inputs)
    assert not report.by_id("LOSS-001") and not report.errors


def test_lora_audit_clones_only_trainable_tensors_and_restores_exactly() -> None:
    from peft import LoraConfig, get_peft_model

    from guardtower.preflight._state import TrainingState

    model = get_peft_model(gpt2(), LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    batch = token_batch()
    train_a_bit(model, opt, lambda: model(**batch))
    trainable = [p for p in model.parameters() if p.requires_grad]
    state = TrainingState(model, opt, batch)
    assert {id(p) for p, _ in state.params} == {id(p) for p in trainable}
    cloned_bytes = sum(saved.numel() * saved.element_size() for _, saved in state.params)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert cloned_bytes < 0.1 * model_bytes
    before = fingerprint(model, opt, batch)
    audit(model, lambda: model(**batch), optimizer=opt, inputs=batch)
    assert fingerprint(model, opt, batch) == before


def test_in_place_change_of_a_frozen_parameter_is_warned_about() -> None:
    model = _BackboneFrozen()
    x, y = regression_batch()

    def step() -> torch.Tensor:
        with torch.no_grad():
            model.backbone.weight.mul_(0.5)  # e.g. a hand-rolled weight renormalisation
        return F.mse_loss(model(x), y)

    with pytest.warns(RuntimeWarning, match="frozen parameter"):
        audit(model, step)


class _BackboneFrozen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Linear(8, 16).requires_grad_(False)
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.backbone(x)))


def test_optimizer_state_is_isolated_not_copied() -> None:
    """The Adam moments (2x the trainable parameters) are never cloned: step_fn sees an empty state dict,
    the trial update saves one tensor's state at a time, and the very same dict object comes back."""
    model, opt, step, inputs = _prepare("mlp")
    real_state = opt.state
    seen: list[int] = []

    def step_fn() -> torch.Tensor:
        seen.append(len(opt.state))
        return step()

    from guardtower.preflight._state import TrainingState

    snapshot = TrainingState(model, opt, inputs)
    held = [v for o in snapshot.optimizers for g, _ in o.groups for v in g.values() if isinstance(v, torch.Tensor)]
    assert not held  # hyper-parameters only (Adam keeps its moments in opt.state)
    audit(model, step_fn, optimizer=opt, inputs=inputs)
    assert seen == [0] and opt.state is real_state and len(real_state) == len(list(model.parameters()))


def test_a_guarded_optimizer_counts_no_step_and_keeps_its_baselines(tmp_path: Any) -> None:
    import guardtower

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    x, y = torch.randn(16, 4), torch.randn(16, 2)
    guard = guardtower.GuardedOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-3), m, verbose=False,
                                        log_dir=str(tmp_path), warmup_steps=0)
    for _ in range(3):  # a few real guarded steps, so the guard has baselines and a count
        guard.zero_grad()
        F.mse_loss(m(x), y).backward()
        guard.step()
    before = guard.state_dict()

    def step() -> torch.Tensor:  # a full training step that calls the guard, as a user's loop would
        guard.zero_grad()
        loss = F.mse_loss(m(x), y)
        loss.backward()
        guard.step()
        return loss

    audit(m, step, optimizer=guard)
    after = guard.state_dict()
    assert guard.step_count == 3
    assert _same_state(before, after)
    guard.close()


def _same_state(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):  # bitwise, NaN (an empty detector slot) equal to NaN
        return (isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a.isnan(), b.isnan())
                and torch.equal(torch.where(a.isnan(), 0, a), torch.where(b.isnan(), 0, b)))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b))
    return bool(a == b) or (a != a and b != b)
