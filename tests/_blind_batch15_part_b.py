"""Blind batch 15 (part b): silent training bugs from public threads, each with its fixed twin."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw, _sgd_step

# --------------------------------------------------------------------------------------------- case-06


class _DeepSet(nn.Module):
    """Permutation-invariant regressor: per-element feature extractor, sum pooling, MLP regressor -> (B, 1)."""

    def __init__(self, in_features: int, set_features: int = 12) -> None:
        super().__init__()
        self.feature_extractor = nn.Sequential(
            nn.Linear(in_features, 16), nn.ELU(inplace=True),
            nn.Linear(16, 16), nn.ELU(inplace=True),
            nn.Linear(16, set_features))
        self.regressor = nn.Sequential(
            nn.Linear(set_features, 12), nn.ELU(inplace=True),
            nn.Linear(12, 8), nn.ELU(inplace=True),
            nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.regressor(self.feature_extractor(x).sum(dim=1))


# a batch of 16 sets of 10 points in 2-d; the target is a per-set statistic, shape (16,) as the loader gives it
_C06_X = torch.randn(16, 10, 2, generator=_gen(1601))
_C06_Y = _C06_X[..., 0].var(dim=1)


def _c06_loss(model: _DeepSet, bug: bool) -> torch.Tensor:
    y_pred = model(_C06_X)                                # (16, 1)
    y = _C06_Y if bug else _C06_Y.view_as(y_pred)          # bug: (16,) target broadcasts to (16, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return nn.MSELoss()(y_pred, y)


def _c06_build(bug: bool) -> Case:
    """DeepSets population-statistics regression: MSELoss between a (B, 1) prediction and a (B,) target."""
    torch.manual_seed(16)
    model = _DeepSet(2).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    step = _sgd_step(model, opt, lambda: _c06_loss(model, bug))
    return model, step, _kw(optimizer=opt, inputs=_C06_X)


def _c06_proof(bug: bool) -> bool:
    """The gradient the loss sends to each prediction pulls it to the batch-mean target, not to its own target."""
    model, _, _ = _c06_build(bug)
    y_pred = model(_C06_X).detach().requires_grad_(True)
    y = _C06_Y if bug else _C06_Y.view_as(y_pred)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nn.MSELoss()(y_pred, y).backward()
    n = y_pred.shape[0]
    to_mean = 2.0 / n * (y_pred.detach() - _C06_Y.mean())      # pull towards the batch mean
    to_own = 2.0 / n * (y_pred.detach() - _C06_Y.view(-1, 1))  # pull towards each sample's own target
    g = y_pred.grad
    return bool(torch.allclose(g, to_mean, atol=1e-6)) and not bool(torch.allclose(g, to_own, atol=1e-6))


CASES: list[BlindCase] = [
    BlindCase("b15-case-06", "https://github.com/manzilzaheer/DeepSets/pull/1", "loss shape broadcasting",
              "a (B,1) prediction against a (B,) target broadcasts the MSE to all BxB pairs, so every set's "
              "prediction is trained towards the batch-mean statistic instead of its own",
              _c06_build, _c06_proof),
]
