"""Blind batch 13, part b: silent training bugs from public GitHub threads outside NLP, each with its fixed twin.

Collected by someone who does not write the audit's checks. Every case builds the user's setup on a tiny real
model in plain torch (MODELS_PLACEHOLDER; nothing is downloaded) and proves the bug without the audit on real
runs and real tensors.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw, _llama_config, _sgd_step

_ = (copy, Any, _llama_config)


# --------------------------------------------------------------------------------------------- case-06
# materials GNN energy regression: graph readout is (B,), labels come out of the pipeline as (B, 1); MSELoss
# broadcasts to (B, B) and every prediction is pulled toward every graph's label

_C06_NATOMS = [3, 5, 4, 6]
_C06_B, _C06_D = len(_C06_NATOMS), 8
_C06_BATCH = torch.cat([torch.full((n,), i) for i, n in enumerate(_C06_NATOMS)])
_C06_X = torch.randn(int(_C06_BATCH.numel()), _C06_D, generator=_gen(1301))


def _c06_edges() -> torch.Tensor:
    src, dst, start = [], [], 0
    for n in _C06_NATOMS:
        for i in range(n):
            for j in range(n):
                if i != j:
                    src.append(start + i)
                    dst.append(start + j)
        start += n
    return torch.tensor([src, dst])


_C06_EDGES = _c06_edges()
_C06_Y = torch.tensor([[-1.5], [2.0], [0.5], [3.0]])  # (B, 1): how the labels come out of the data pipeline


class _EnergyGNN(nn.Module):
    """Atoms as nodes, two sum-aggregation message-passing layers, per-atom energies summed per graph."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(_C06_D, 32)
        self.msg1, self.upd1 = nn.Linear(32, 32), nn.Linear(64, 32)
        self.msg2, self.upd2 = nn.Linear(32, 32), nn.Linear(64, 32)
        self.atom_energy = nn.Sequential(nn.Linear(32, 32), nn.SiLU(), nn.Linear(32, 1))

    def _mp(self, h: torch.Tensor, edges: torch.Tensor, msg: nn.Linear, upd: nn.Linear) -> torch.Tensor:
        m = torch.zeros_like(h).index_add_(0, edges[1], msg(h)[edges[0]])
        return h + F.silu(upd(torch.cat([h, m], dim=-1)))

    def forward(self, x: torch.Tensor, edges: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.embed(x))
        h = self._mp(h, edges, self.msg1, self.upd1)
        h = self._mp(h, edges, self.msg2, self.upd2)
        e_atom = self.atom_energy(h).squeeze(-1)
        n_graphs = int(batch.max()) + 1
        return torch.zeros(n_graphs).index_add_(0, batch, e_atom)  # (B,) graph energies


def _c06_loss(model: nn.Module, bug: bool) -> torch.Tensor:
    pred = model(_C06_X, _C06_EDGES, _C06_BATCH)
    if not bug:  # the fix: reshape the model outputs to the label shape before the loss
        pred = pred.reshape(_C06_Y.shape)
    return F.mse_loss(pred, _C06_Y)


def _c06_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _EnergyGNN().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, _sgd_step(model, opt, lambda: _c06_loss(model, bug)), \
        _kw(optimizer=opt, inputs=(_C06_X, _C06_EDGES, _C06_BATCH))


def _c06_proof(bug: bool) -> bool:
    """The gradient the loss sends to each graph's predicted energy is not 2/B * (pred_i - y_i), the per-graph
    MSE gradient: with the (B,) vs (B, 1) broadcast it is 2/B * (pred_i - mean(y)), so every graph is fitted to
    the batch-mean label."""
    model, _, _ = _c06_build(bug)
    pred = model(_C06_X, _C06_EDGES, _C06_BATCH).detach().requires_grad_(True)
    p = pred if bug else pred.reshape(_C06_Y.shape)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        F.mse_loss(p, _C06_Y).backward()
    assert pred.grad is not None
    want = 2.0 / _C06_B * (pred.detach() - _C06_Y.squeeze(-1))
    return not torch.allclose(pred.grad, want, atol=1e-6)


CASES: list[BlindCase] = [
    BlindCase("b13-case-06", "https://github.com/IntelLabs/matsciml/pull/347", "loss / shape broadcasting",
              "the graph-level energy readout is (B,) while the labels are (B, 1): MSELoss broadcasts to a (B, B) "
              "matrix and trains every graph toward the mean label of the batch instead of its own, with only a "
              "UserWarning in the log", _c06_build, _c06_proof),
]
