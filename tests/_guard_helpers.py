"""Shared fixtures for the GuardedOptimizer tests: a tiny model, a training step and state snapshots."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from guardtower.guard import GuardedOptimizer

torch.set_num_threads(1)  # 2 shared cores: oversubscribed intra-op threads make tiny ops slow


class TinyNet(nn.Module):
    """Two linear layers with a BatchNorm in between (buffers matter for rollback)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.norm = nn.BatchNorm1d(16)
        self.out = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.norm(self.inp(x))))


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "adamw_fused": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
    "adamw_foreach": lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=True),
    "adam_fused": lambda p: torch.optim.Adam(p, lr=1e-2, fused=True),
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9),
    "sgd_fused": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, fused=True),
}


def make(tmp_path: Path, opt: str = "adamw_fused", seed: int = 0, **kwargs: Any) -> tuple[TinyNet, GuardedOptimizer]:
    torch.manual_seed(seed)
    model = TinyNet()
    kwargs.setdefault("verbose", False)
    kwargs.setdefault("log_dir", tmp_path / "logs")
    guard = GuardedOptimizer(OPTIMIZERS[opt](model.parameters()), model, **kwargs)
    return model, guard


def backward(model: nn.Module, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(32, 8, generator=gen)
    y = torch.randn(32, 1, generator=gen)
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    return loss.detach()


def train(model: nn.Module, guard: GuardedOptimizer, steps: int, start: int = 0,
          corrupt: Callable[[int, nn.Module], None] | None = None) -> None:
    """Run ``steps`` guarded steps; ``corrupt(step_index, model)`` may edit gradients before the step."""
    for i in range(start, start + steps):
        guard.zero_grad()
        loss = backward(model, i)
        if corrupt is not None:
            corrupt(i, model)
        guard.step(loss=loss)


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer, buffers: bool = False) -> dict[str, Any]:
    """A deep copy of what an update may touch: params (and buffers), optimizer state and hyper-params.

    Buffers are left out by default: the forward pass of the step being judged already moved BatchNorm stats.
    """
    tensors = model.state_dict() if buffers else dict(model.named_parameters())
    return {
        "model": {k: v.detach().clone() for k, v in tensors.items()},
        "opt": {id(p): {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in s.items()}
                for p, s in optimizer.state.items()},
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
    }


def same_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a["groups"] != b["groups"] or a["model"].keys() != b["model"].keys() or a["opt"].keys() != b["opt"].keys():
        return False
    if not all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"]):
        return False
    for pid, state in a["opt"].items():
        other = b["opt"][pid]
        if state.keys() != other.keys():
            return False
        for k, v in state.items():
            w = other[k]
            if isinstance(v, torch.Tensor) != isinstance(w, torch.Tensor):
                return False
            if isinstance(v, torch.Tensor) and not torch.equal(v, w):
                return False
            if not isinstance(v, torch.Tensor) and v != w:
                return False
    return True


def scale_grad(name: str, factor: float) -> Callable[[nn.Module], None]:
    def corrupt(model: nn.Module) -> None:
        dict(model.named_parameters())[name].grad.mul_(factor)

    return corrupt


class SyncCounter:
    """Counts host reads of tensor values (``bool``, ``item``, ``float``, ``int``) while active."""

    NAMES = ("__bool__", "item", "__float__", "__int__")

    def __init__(self, monkeypatch: Any) -> None:
        self.calls = 0
        self.active = False
        for name in self.NAMES:
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._wrap(original))

    def _wrap(self, original: Any) -> Any:
        def wrapper(t: torch.Tensor, *args: Any) -> Any:
            if self.active:
                self.calls += 1
            return original(t, *args)

        return wrapper


def explain(detector: Any, verdict: Any, norms: torch.Tensor) -> Any:
    """The detector's host reading of a verdict, as the guard makes it from a step record."""
    report = torch.cat([t.to(torch.float32) for t in verdict.report]).cpu()
    return detector.explain(report, norms.tolist())


def same_detector_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], skip: tuple[str, ...] = ()) -> bool:
    """Equal detector states (NaN, an empty slot, equals NaN); ``skip`` names entries allowed to differ."""
    return a.keys() == b.keys() and all(
        torch.equal(torch.nan_to_num(a[k], nan=1234.5), torch.nan_to_num(b[k], nan=1234.5)) for k in a if k not in skip)
