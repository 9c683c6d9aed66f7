"""audit(steps=N): overfitting the one batch catches what one step cannot, and leaves no trace."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from guardtower.errors import ConfigError
from guardtower.preflight import audit
from guardtower.severity import Severity

from tests._audit_core_helpers import gpt2, token_batch

_X = torch.randn(32, 8, generator=torch.Generator().manual_seed(4))
_Y = torch.randint(0, 4, (32,), generator=torch.Generator().manual_seed(5))


def _classifier() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))


def _setup(bug: str) -> tuple[nn.Module, Callable[[], Any], torch.optim.Optimizer]:
    m = _classifier()
    lr = 1e-9 if bug == "tiny_lr" else 1e-2
    opt = torch.optim.Adam(m.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(6)

    def step() -> torch.Tensor:
        logits = m(_X)
        if bug == "wrong_labels":  # labels drawn again on every call: they do not belong to the inputs
            return F.cross_entropy(logits, torch.randint(0, 4, (32,), generator=gen))
        if bug == "wrong_loss":  # the loss is measured on a detached copy; the graph only carries a zero term
            return F.cross_entropy(logits.detach(), _Y) + 0.0 * logits.sum()
        return F.cross_entropy(logits, _Y)

    return m, step, opt


@pytest.mark.parametrize("bug", ["wrong_labels", "wrong_loss", "tiny_lr"])
def test_a_batch_that_cannot_be_overfit_fails_loss_009(bug: str) -> None:
    m, step, opt = _setup(bug)
    report = audit(m, step, optimizer=opt, steps=20)
    (finding,) = report.by_id("LOSS-009")
    assert finding.severity is Severity.ERROR and len(finding.details["losses"]) == 21
    assert not audit(m, step, optimizer=opt).by_id("LOSS-009")  # the one-step audit alone cannot see it


def test_a_correct_setup_overfits_and_passes() -> None:
    m, step, opt = _setup("none")
    report = audit(m, step, optimizer=opt, steps=20)
    assert report.ok and not report.by_id("LOSS-009"), str(report)
    assert report.step_fn_calls == 22 and any("steps=20" in n for n in report.notes)


def test_a_tiny_gpt_overfits_its_batch() -> None:
    m = gpt2()
    batch = token_batch()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    report = audit(m, lambda: m(**batch), optimizer=opt, steps=10)
    assert not report.by_id("LOSS-009") and not report.errors, str(report)


def test_overfitting_leaves_the_state_bitwise_as_it_was() -> None:
    m, step, opt = _setup("none")
    for _ in range(2):  # Adam has moments
        opt.zero_grad()
        step().backward()
        opt.step()
    params = [p.detach().clone() for p in m.parameters()]
    moments = [{k: v.clone() for k, v in opt.state[p].items()} for p in m.parameters()]
    rng = torch.get_rng_state()
    audit(m, step, optimizer=opt, steps=15)
    assert all(torch.equal(a, b) for a, b in zip(params, m.parameters()))
    for saved, p in zip(moments, m.parameters()):
        assert all(torch.equal(saved[k], opt.state[p][k]) for k in saved)
    assert torch.equal(rng, torch.get_rng_state())


@pytest.mark.parametrize("steps", [-1, 2.5, True, "10"])
def test_steps_must_be_a_whole_number(steps: Any) -> None:
    m, step, opt = _setup("none")
    with pytest.raises(ConfigError, match="steps"):
        audit(m, step, optimizer=opt, steps=steps)


def test_steps_needs_the_optimizer() -> None:
    m, step, _ = _setup("none")
    with pytest.raises(ConfigError, match="optimizer"):
        audit(m, step, steps=5)
