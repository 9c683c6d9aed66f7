"""Blind batch 19 (part b): silent training bugs from public threads (plain PyTorch loops outside LLMs: vision,
tabular, recommenders, detection/re-id), each with its fixed twin."""

from __future__ import annotations

import math
from itertools import pairwise
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw, _sgd_step

# --------------------------------------------------------------------------------------------- case-06
# facebookresearch/clevr-iep PR #22: the training loop calls check_accuracy() every few iterations to monitor
# train/val accuracy; check_accuracy() puts the models into eval mode (set_mode('eval', ...)) and never puts them
# back, so every later training iteration runs with BatchNorm using (and no longer updating) its running stats and
# with dropout switched off. Fix (merged): call set_mode('train', ...) again at the end of check_accuracy().


class _ConvNet(nn.Module):
    """A small conv classifier with BatchNorm and dropout, like the thread's CNN + classifier."""

    def __init__(self, n_cls: int = 4) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(8)
        self.drop = nn.Dropout(0.5)
        self.fc = nn.Linear(8, n_cls)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn1(self.conv1(x)))
        h = F.relu(self.bn2(self.conv2(h)))
        return self.fc(self.drop(h.mean((2, 3))))


_C06_X = torch.randn(8, 3, 8, 8, generator=_gen(601)) * 2.0 + 1.0
_C06_Y = torch.randint(0, 4, (8,), generator=_gen(602))
_C06_VX = torch.randn(8, 3, 8, 8, generator=_gen(603))
_C06_VY = torch.randint(0, 4, (8,), generator=_gen(604))


def _c06_check_accuracy(model: nn.Module, bug: bool) -> float:
    model.eval()
    with torch.no_grad():
        acc = float((model(_C06_VX).argmax(1) == _C06_VY).float().mean())
    if not bug:
        model.train()
    return acc


def _c06_build(bug: bool) -> Case:
    """Training resumes right after the periodic accuracy check, which left the model in eval mode."""
    torch.manual_seed(0)
    model = _ConvNet().train()
    opt = torch.optim.Adam(model.parameters(), lr=5e-4)
    _c06_check_accuracy(model, bug)
    step = _sgd_step(model, opt, lambda: F.cross_entropy(model(_C06_X), _C06_Y))
    return model, step, _kw(optimizer=opt, inputs=_C06_X)


def _c06_proof(bug: bool) -> bool:
    """Two training steps after the check leave BatchNorm's running mean exactly at its initial zeros."""
    model, step, _ = _c06_build(bug)
    for _ in range(2):
        step()
    running_mean = cast(torch.Tensor, cast(_ConvNet, model).bn1.running_mean)
    return bool(torch.equal(running_mean, torch.zeros(8)))


# --------------------------------------------------------------------------------------------- case-07
# NaJaeMin92/pytorch-DANN issue #7: the DANN label classifier and domain discriminator both end in a Softmax layer,
# and their outputs go to nn.CrossEntropyLoss, which applies log-softmax itself; the reporter says the extra softmax
# makes the models hard to train. Fix (maintainer updated the code): remove the final Softmax layers, the heads
# output raw logits.


class _GradReverse(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, alpha: float) -> torch.Tensor:
        ctx.alpha = alpha
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return -ctx.alpha * grad, None


class _DANN(nn.Module):
    def __init__(self, bug: bool, n_cls: int = 10) -> None:
        super().__init__()
        self.extractor = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 32), nn.ReLU())
        cls: list[nn.Module] = [nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, n_cls)]
        dom: list[nn.Module] = [nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 2)]
        if bug:
            cls.append(nn.Softmax(dim=1))
            dom.append(nn.Softmax(dim=1))
        self.classifier = nn.Sequential(*cls)
        self.discriminator = nn.Sequential(*dom)

    def forward(self, x: torch.Tensor, alpha: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
        f = self.extractor(x)
        return self.classifier(f), self.discriminator(_GradReverse.apply(f, alpha))


_C07_SRC = torch.randn(16, 3, 8, 8, generator=_gen(701))
_C07_TGT = torch.randn(16, 3, 8, 8, generator=_gen(702)) + 0.5
_C07_Y = torch.arange(16) % 10
_C07_IN = torch.cat([_C07_SRC, _C07_TGT])
_C07_DOM = torch.cat([torch.zeros(16, dtype=torch.long), torch.ones(16, dtype=torch.long)])


def _c07_loss(model: _DANN) -> torch.Tensor:
    crit = nn.CrossEntropyLoss()
    cls_out, dom_out = model(_C07_IN)
    return crit(cls_out[:16], _C07_Y) + crit(dom_out, _C07_DOM)


def _c07_build(bug: bool) -> Case:
    """Domain-adversarial training whose class and domain heads end in Softmax before CrossEntropyLoss."""
    torch.manual_seed(0)
    model = _DANN(bug).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    step = _sgd_step(model, opt, lambda: _c07_loss(model))
    return model, step, _kw(optimizer=opt, inputs=_C07_IN)


def _c07_proof(bug: bool) -> bool:
    """After 60 steps the source classification loss still sits above the floor that cross-entropy over
    probabilities can never go below (log(1 + 9/e) for 10 classes); the logit twin drops far below it."""
    model, step, _ = _c07_build(bug)
    for _ in range(60):
        step()
    with torch.no_grad():
        cls_loss = float(F.cross_entropy(model(_C07_IN)[0][:16], _C07_Y))
    return cls_loss >= math.log(1 + 9 / math.e) - 1e-4


# --------------------------------------------------------------------------------------------- case-08
# automl/Auto-PyTorch issue #211: the trainer steps every learning-rate scheduler after every batch, but
# CosineAnnealingWarmRestarts is configured with T_0 in epochs (0..20), so the learning rate runs through whole
# cosine cycles and restarts inside one epoch. Fix (labelled bug, fixed from the cocktail branch): give each scheduler
# a step unit and step epoch-wise schedulers such as CosineAnnealingWarmRestarts once per epoch.

_C08_X = torch.randn(32, 12, generator=_gen(801))
_C08_Y = (_C08_X[:, :3].sum(1) > 0).long()
_C08_BATCHES = 8
_C08_BS = 4


def _c08_make(bug: bool) -> tuple[nn.Module, Any, torch.optim.Optimizer, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 2)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=2, T_mult=1)
    state = {"i": 0}

    def step() -> torch.Tensor:
        i = state["i"] % _C08_BATCHES
        state["i"] += 1
        xb = _C08_X[i * _C08_BS:(i + 1) * _C08_BS]
        yb = _C08_Y[i * _C08_BS:(i + 1) * _C08_BS]
        opt.zero_grad()
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        opt.step()
        if bug:
            sched.step()  # per batch; the fix steps it once at the end of each epoch
        return loss

    return model, step, opt, sched


def _c08_build(bug: bool) -> Case:
    """Tabular MLP; CosineAnnealingWarmRestarts(T_0=2 epochs) stepped by the trainer after each batch."""
    model, step, opt, sched = _c08_make(bug)
    return model, step, _kw(optimizer=opt, inputs=_C08_X[:_C08_BS], lr_scheduler=sched,
                            total_steps=10 * _C08_BATCHES)


def _c08_proof(bug: bool) -> bool:
    """Within the first epoch the learning rate already falls and jumps back to its base value (a restart)."""
    _, step, opt, _ = _c08_make(bug)
    lrs = []
    for _ in range(_C08_BATCHES):
        step()
        lrs.append(opt.param_groups[0]["lr"])
    restarts = sum(1 for a, b in pairwise(lrs) if b > a)
    return restarts >= 1 and min(lrs) < 1e-2


# --------------------------------------------------------------------------------------------- case-09
# ifzhang/FairMOT issue #223 (also #99, #125): the re-ID classifier (self.classifier = nn.Linear(emb_dim, nID))
# and the learnable loss-balancing weights s_det / s_id live in MotLoss, but the optimizer is built as
# torch.optim.Adam(model.parameters(), lr), so they are never optimized: the ID classifier stays at its random init
# and the id loss barely falls. Fix (author, base_trainer.py): add the loss module's parameters to the optimizer
# (optimizer.add_param_group({'params': self.loss.parameters()})).


class _TinyMOTNet(nn.Module):
    """A detector backbone with a centre heatmap head and a re-ID embedding head."""

    def __init__(self, emb_dim: int = 16) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1),
                                      nn.ReLU())
        self.hm = nn.Conv2d(16, 1, 1)
        self.id = nn.Conv2d(16, emb_dim, 1)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        f = self.backbone(x)
        return {"hm": self.hm(f), "id": self.id(f)}


class _MotLoss(nn.Module):
    def __init__(self, emb_dim: int = 16, n_id: int = 12) -> None:
        super().__init__()
        self.classifier = nn.Linear(emb_dim, n_id)
        self.emb_scale = math.sqrt(2) * math.log(n_id - 1)
        self.s_det = nn.Parameter(-1.85 * torch.ones(1))
        self.s_id = nn.Parameter(-1.05 * torch.ones(1))

    def forward(self, out: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> torch.Tensor:
        hm_loss = F.binary_cross_entropy_with_logits(out["hm"], batch["hm"])
        emb = out["id"].flatten(2).transpose(1, 2)  # B, HW, D
        emb = emb.gather(1, batch["ind"][..., None].expand(-1, -1, emb.shape[-1])).reshape(-1, emb.shape[-1])
        emb = self.emb_scale * F.normalize(emb, dim=1)
        id_loss = F.cross_entropy(self.classifier(emb), batch["ids"].reshape(-1))
        return torch.exp(-self.s_det) * hm_loss + torch.exp(-self.s_id) * id_loss + (self.s_det + self.s_id) * 0.5


class _ModelWithLoss(nn.Module):
    def __init__(self, model: nn.Module, loss: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.loss = loss

    def forward(self, x: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.loss(self.model(x), batch)


_C09_X = torch.randn(2, 3, 8, 8, generator=_gen(901))
_C09_BATCH = {
    "hm": (torch.rand(2, 1, 8, 8, generator=_gen(902)) > 0.9).float(),
    "ind": torch.randint(0, 64, (2, 3), generator=_gen(903)),
    "ids": torch.randint(0, 12, (2, 3), generator=_gen(904)),
}


def _c09_build(bug: bool) -> Case:
    """Joint detection + re-ID training; the optimizer is built from the network only, not the loss module."""
    torch.manual_seed(0)
    model = _TinyMOTNet()
    loss = _MotLoss()
    mwl = _ModelWithLoss(model, loss).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    if not bug:
        opt.add_param_group({"params": loss.parameters()})
    step = _sgd_step(mwl, opt, lambda: mwl(_C09_X, _C09_BATCH))
    return mwl, step, _kw(optimizer=opt, inputs=(_C09_X, _C09_BATCH))


def _c09_proof(bug: bool) -> bool:
    """After three steps the re-ID classifier and the loss weights are bit-identical to their initial values,
    although they received gradients."""
    mwl, step, _ = _c09_build(bug)
    loss = mwl.loss
    assert isinstance(loss, _MotLoss)
    before = [p.detach().clone() for p in loss.parameters()]
    for _ in range(3):
        step()
    got_grad = loss.classifier.weight.grad is not None and float(loss.classifier.weight.grad.abs().sum()) > 0
    return got_grad and all(torch.equal(b, p.detach()) for b, p in zip(before, loss.parameters()))


# --------------------------------------------------------------------------------------------- case-10
# tanatosuu/GDE issue #3 / PR #2: in GDE's forward the plain BPR branch (loss_type other than 'adaptive') computes
# out = ((final_user*final_pos).sum(1) - (final_pos*final_nega).sum(1)).sigmoid(), scoring the negative item against
# the positive item instead of against the user, so the user-negative score never enters the BPR loss. Fix (merged
# PR #2): out = ((final_user*final_pos).sum(1) - (final_user*final_nega).sum(1)).sigmoid().

_C10_U, _C10_I, _C10_D = 16, 24, 8


def _c10_rate() -> torch.Tensor:
    g = _gen(1001)
    groups_u = torch.arange(_C10_U) % 4
    groups_i = torch.arange(_C10_I) % 4
    rate = (groups_u[:, None] == groups_i[None, :]).float()
    noise = (torch.rand(_C10_U, _C10_I, generator=g) < 0.08).float()
    return (rate + noise).clamp(max=1.0)


_C10_RATE = _c10_rate()


class _GDE(nn.Module):
    """GDE's graph-filtered embeddings on a tiny interaction matrix (filters from its singular vectors)."""

    L_u: torch.Tensor
    L_i: torch.Tensor

    def __init__(self, bug: bool, beta: float = 5.0, reg: float = 0.01, batch_size: int = 16) -> None:
        super().__init__()
        self.bug = bug
        self.reg = reg
        self.batch_size = batch_size
        self.user_embed = nn.Embedding(_C10_U, _C10_D)
        self.item_embed = nn.Embedding(_C10_I, _C10_D)
        nn.init.xavier_normal_(self.user_embed.weight)
        nn.init.xavier_normal_(self.item_embed.weight)
        r = _C10_RATE
        norm = r / (r.sum(1, keepdim=True).sqrt() * r.sum(0, keepdim=True).sqrt() + 1e-8)
        u, s, v = torch.linalg.svd(norm, full_matrices=False)
        k = 6
        w = torch.exp(beta * s[:k] ** 2)
        l_u = (u[:, :k] * w) @ u[:, :k].t()
        l_i = (v[:k].t() * w) @ v[:k]
        self.register_buffer("L_u", l_u / l_u.abs().max())  # rescaled for the tiny matrix
        self.register_buffer("L_i", l_i / l_i.abs().max())

    def forward(self, user: torch.Tensor, pos: torch.Tensor, nega: torch.Tensor) -> torch.Tensor:
        fu = self.L_u[user].mm(self.user_embed.weight)
        fp = self.L_i[pos].mm(self.item_embed.weight)
        fn = self.L_i[nega].mm(self.item_embed.weight)
        neg_score = (fp * fn).sum(1) if self.bug else (fu * fn).sum(1)
        out = ((fu * fp).sum(1) - neg_score).sigmoid()
        reg_term = self.reg * (fu ** 2 + fp ** 2 + fn ** 2).sum()
        return (-torch.log(out).sum() + reg_term) / self.batch_size


def _c10_sample(g: torch.Generator, n: int = 16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    u = torch.randint(0, _C10_U, (n,), generator=g)
    p = torch.multinomial(_C10_RATE[u], 1, True, generator=g).squeeze(1)
    nega = torch.multinomial(1 - _C10_RATE[u], 1, True, generator=g).squeeze(1)
    return u, p, nega


def _c10_build(bug: bool) -> Case:
    """Graph-filter recommender trained with the plain BPR loss branch over sampled (user, pos, neg) triples."""
    torch.manual_seed(0)
    model = _GDE(bug).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.03)
    g = _gen(1002)
    batch = _c10_sample(g)

    def step() -> torch.Tensor:
        u, p, nega = _c10_sample(g)
        loss = model(u, p, nega)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return model, step, _kw(optimizer=opt, inputs=batch)


def _c10_auc(model: _GDE) -> float:
    with torch.no_grad():
        fu = model.L_u.mm(model.user_embed.weight)
        fi = model.L_i.mm(model.item_embed.weight)
        scores = fu @ fi.t()
    hits, total = 0.0, 0
    for u in range(_C10_U):
        pos = scores[u][_C10_RATE[u] > 0]
        neg = scores[u][_C10_RATE[u] == 0]
        hits += float((pos[:, None] > neg[None, :]).float().sum())
        total += pos.numel() * neg.numel()
    return hits / total


def _c10_proof(bug: bool) -> bool:
    """Trained on the same sampled triples, the bug's model ranks a user's items clearly worse on the training
    interactions (pairwise AUC near chance, about 0.54, against about 0.9 for the fixed BPR loss after 200 steps),
    while its own loss value is lower."""
    model, step, _ = _c10_build(bug)
    for _ in range(200):
        step()
    return _c10_auc(cast(_GDE, model)) < 0.75


CASES: list[BlindCase] = [
    BlindCase("b19-case-06", "https://github.com/facebookresearch/clevr-iep/pull/22", "train/eval mode",
              "A periodic accuracy check switches the model to eval mode and never switches it back, so later "
              "training steps run with frozen BatchNorm statistics and no dropout.", _c06_build, _c06_proof),
    BlindCase("b19-case-07", "https://github.com/NaJaeMin92/pytorch-DANN/issues/7", "softmax before cross-entropy",
              "Both DANN heads end in Softmax and feed CrossEntropyLoss, so the loss sees probabilities as logits, "
              "gets a floor it cannot pass and weak gradients.", _c07_build, _c07_proof),
    BlindCase("b19-case-08", "https://github.com/automl/Auto-PyTorch/issues/211", "LR scheduler step unit",
              "An epoch-unit CosineAnnealingWarmRestarts is stepped after every batch, so the learning rate cycles "
              "and restarts several times inside one epoch.", _c08_build, _c08_proof,
              known_miss="CosineAnnealingWarmRestarts(T_0=2) planned in epochs restarts every two optimizer steps stepped per batch; a cycle length is not judged (only ends, warmups and horizons are)"),
    BlindCase("b19-case-09", "https://github.com/ifzhang/FairMOT/issues/223", "parameters missing from optimizer",
              "The re-ID classifier and loss weights live in the loss module, but the optimizer only gets the "
              "network's parameters, so they never update.", _c09_build, _c09_proof),
    BlindCase("b19-case-10", "https://github.com/tanatosuu/GDE/issues/3", "wrong loss term",
              "The BPR loss scores the negative item against the positive item instead of the user, so the "
              "user-negative score never enters the ranking objective.", _c10_build, _c10_proof,
              known_miss="the BPR loss scores the negative item against the positive item instead of the user; which embedding each score should read is a modelling choice the audit does not measure"),
]
