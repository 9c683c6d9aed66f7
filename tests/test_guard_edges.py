"""Guard edge cases (issue 21): sparse gradients, parameter groups added after wrapping, and state dicts
that must be refused at ``load_state_dict`` with nothing changed."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from guardtower.errors import ConfigError
from guardtower.guard import GuardedOptimizer


def _guard(optimizer: torch.optim.Optimizer, tmp_path: Path, model: nn.Module | None = None, **kw: Any) -> GuardedOptimizer:
    return GuardedOptimizer(optimizer, model, verbose=False, log_dir=tmp_path, warmup_steps=0, **kw)


@pytest.mark.parametrize("opt", ["SparseAdam", "SGD", "Adagrad"])
def test_sparse_gradients_are_guarded(tmp_path: Path, opt: str) -> None:
    torch.manual_seed(0)
    emb = nn.Embedding(20, 4, sparse=True)
    guard = _guard(getattr(torch.optim, opt)(emb.parameters(), lr=0.1), tmp_path, emb)
    for _ in range(4):
        guard.zero_grad()
        emb(torch.tensor([1, 2, 3])).sum().backward()
        guard.step()
    weight = emb.weight.detach().clone()
    guard.zero_grad()
    emb(torch.tensor([1, 2])).sum().backward()
    assert emb.weight.grad is not None and emb.weight.grad.is_sparse
    emb.weight.grad = emb.weight.grad * float("nan")
    guard.step()
    assert guard.step_count == 5 and guard.total_skips == 1
    assert torch.equal(emb.weight.detach(), weight)
    guard.close()


@pytest.mark.parametrize("via", ["base", "guard"])
def test_a_param_group_added_after_wrapping_is_guarded(tmp_path: Path, via: str) -> None:
    torch.manual_seed(0)
    a, b = nn.Linear(3, 3), nn.Linear(3, 3)
    base = torch.optim.SGD(a.parameters(), lr=0.1)
    guard = _guard(base, tmp_path)
    x = torch.randn(4, 3)
    for _ in range(3):
        guard.zero_grad()
        a(x).sum().backward()
        guard.step()
    (base if via == "base" else guard).add_param_group({"params": list(b.parameters())})
    for _ in range(3):
        guard.zero_grad()
        (a(x).sum() + b(x).sum()).backward()
        guard.step()
    weight = b.weight.detach().clone()
    guard.zero_grad()
    (a(x).sum() + b(x).sum()).backward()
    assert b.weight.grad is not None
    b.weight.grad.fill_(float("nan"))
    guard.step()
    assert guard.total_skips == 1 and torch.equal(b.weight.detach(), weight)
    guard.close()


def _trained(tmp_path: Path) -> tuple[nn.Module, GuardedOptimizer]:
    torch.manual_seed(0)
    model = nn.Linear(3, 3)
    guard = _guard(torch.optim.Adam(model.parameters(), lr=0.01), tmp_path, model)
    for _ in range(3):
        guard.zero_grad()
        model(torch.randn(2, 3)).sum().backward()
        guard.step()
    return model, guard


def _wrong_shape(sd: dict[str, Any]) -> None:
    sd["state"][0]["exp_avg"] = torch.zeros(7)


def _nan_baseline(sd: dict[str, Any]) -> None:
    sd["guardtower"]["detector"]["state"]["state"][0, 0] = float("nan")


@pytest.mark.parametrize("damage", [_wrong_shape, _nan_baseline])
def test_a_bad_state_dict_is_refused_at_load_and_changes_nothing(tmp_path: Path, damage: Any) -> None:
    model, guard = _trained(tmp_path)
    before = copy.deepcopy(guard.state_dict())
    bad = copy.deepcopy(before)
    damage(bad)
    with pytest.raises(ConfigError) as info:
        guard.load_state_dict(bad)
    assert info.value.argument == "state_dict"
    after = guard.state_dict()
    assert torch.equal(after["state"][0]["exp_avg"], before["state"][0]["exp_avg"])
    assert torch.equal(after["guardtower"]["detector"]["state"]["state"], before["guardtower"]["detector"]["state"]["state"])
    guard.zero_grad()
    model(torch.randn(2, 3)).sum().backward()
    guard.step()  # still trains: no raw RuntimeError, no rejection of every step
    assert guard.total_skips == 0
    guard.close()
