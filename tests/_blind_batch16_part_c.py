"""Blind batch 16 (part c): silent training bugs from public GitHub threads, each with its fixed twin."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw, _sgd_step


# --------------------------------------------------------------------------------------------- case-11


class _PatchEncoder(nn.Module):
    """Time-series patch encoder: 1-D conv embedding, a projection head for the triplet loss, and a pretext
    discriminator that tells temporally adjacent patch pairs from random ones."""

    def __init__(self, c: int = 1, d: int = 16) -> None:
        super().__init__()
        self.embedding = nn.Sequential(nn.Conv1d(c, 8, 3, padding=1), nn.ReLU(), nn.Conv1d(8, d, 3, padding=1),
                                       nn.ReLU(), nn.AdaptiveAvgPool1d(1), nn.Flatten())
        self.projection = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, 8))
        self.classifier = nn.Sequential(nn.Linear(2 * d, d), nn.ReLU(), nn.Linear(d, 1))


_C11_SERIES = torch.cumsum(torch.randn(1, 1, 200, generator=_gen(1101)), -1) * 0.1
_C11_STARTS = torch.randint(0, 200 - 24 - 4, (8,), generator=_gen(1102))


def _c11_patches() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    anchors = torch.stack([_C11_SERIES[0, :, s:s + 16] for s in _C11_STARTS.tolist()])
    positives = torch.stack([_C11_SERIES[0, :, s + 2:s + 18] for s in _C11_STARTS.tolist()])  # small shift
    pretext = torch.stack([_C11_SERIES[0, :, s + 8:s + 24] for s in _C11_STARTS.tolist()])  # adjacent patch
    return anchors, positives, pretext


_C11_A, _C11_P, _C11_N = _c11_patches()


def _c11_loss(model: _PatchEncoder, bug: bool) -> torch.Tensor:
    m = _C11_A.shape[0]
    h = model.embedding(torch.cat([_C11_A, _C11_P, _C11_N], 0))
    h_anchors, h_pos, h_pre = h[:m], h[m:2 * m], h[2 * m:]
    z_anchor = F.normalize(model.projection(h_anchors), dim=1)
    z_pos = F.normalize(model.projection(h_pos), dim=1)
    sim_ap = (z_anchor @ z_pos.T) / 1.0
    pos_sims = sim_ap.diag()
    sim_ap_f = sim_ap.clone()
    sim_ap_f.diagonal().fill_(-float("inf") if bug else float("inf"))  # bug: -inf becomes +inf distance
    neg_dists = 1 - sim_ap_f
    hard_neg_dists, _ = torch.max(neg_dists, dim=1)
    pos_dists = 1 - pos_sims
    triplet_loss = F.relu(pos_dists - hard_neg_dists + 0.5).mean()
    # temporal pretext task: adjacent pairs (label 1) vs shuffled pairs (label 0)
    unadj = h_anchors[torch.roll(torch.arange(m), 3)]
    logits = model.classifier(torch.cat([torch.cat([h_anchors, h_pre], 1), torch.cat([h_anchors, unadj], 1)], 0))
    labels = torch.cat([torch.ones(m, 1), torch.zeros(m, 1)])
    pretext_loss = F.binary_cross_entropy_with_logits(logits, labels)
    return triplet_loss + 0.5 * pretext_loss


def _c11_build(bug: bool) -> Case:
    """Patch triplet loss whose 'farthest negative' mask fills the diagonal of the similarity with -inf."""
    torch.manual_seed(11)
    model = _PatchEncoder().train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    step = _sgd_step(model, opt, lambda: _c11_loss(model, bug))
    return model, step, _kw(optimizer=opt, inputs=(_C11_A, _C11_P, _C11_N))


def _c11_proof(bug: bool) -> bool:
    """The diagonal (the positive itself) is always picked as the farthest negative, so the triplet term is 0
    and the projection head, trained by nothing else, gets an exactly zero gradient."""
    model, _, _ = _c11_build(bug)
    model.zero_grad()
    _c11_loss(model, bug).backward()
    return all(p.grad is None or float(p.grad.abs().sum()) == 0.0 for p in model.projection.parameters())


CASES: list[BlindCase] = [
    BlindCase("b16-case-11", "https://github.com/jinnnju/PaAno/issues/1", "masking sentinel sign / dead loss term",
              "The self-pair is masked with -inf in similarity space, which becomes +inf in distance space, so the "
              "hardest-negative max always picks it, the triplet loss is identically 0 and the projection head "
              "never trains.", _c11_build, _c11_proof),
]
