"""Blind batch 35 (part c): silent training bugs outside mainstream NLP/vision, each with its fixed twin.

Collected by someone who does not write the audit's checks. Every case builds the user's setup on a tiny model
(a BPR matrix-factorisation recommender, a PointNet-style point-cloud classifier resumed from a checkpoint, a
physics-informed network for the Helmholtz equation, a tabular LightningModule fine-tuned with Lightning's own
BackboneFinetuning callback, a Graphormer-style graph-attention regressor over a batch of graphs; plain torch
modules, nothing downloaded) and proves the bug without the audit on real tensors and real steps.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw

# --------------------------------------------------------------------------------------------- case-01
# hexiangnan/adversarial_personalized_ranking PR #8 ("fix bug on reg"): the MF-BPR / APR recommender added its L2
# regulariser as `reg * (reduce_sum(square(embedding_P)) + reduce_sum(square(embedding_Q)))`, i.e. over the WHOLE user
# and item embedding tables, on every mini-batch. Every step therefore shrinks the embeddings of all users and items,
# including the ones that are not in the batch and whose BPR gradient is zero; the BPR loss still falls and nothing
# crashes, the model just decays everything it is not looking at. Fix in the PR: regularise only the embeddings the
# batch looks up, `reg * reduce_mean(square(embed_p_pos) + square(embed_q_pos) + square(embed_q_neg))`.
# (The original is TensorFlow with Adagrad; reproduced in torch with Adagrad.)

_C01_USERS, _C01_ITEMS, _C01_DIM = 20, 30, 8
_C01_U = torch.randint(0, 8, (16,), generator=_gen(3501))          # users 8..19 are never in the batch
_C01_POS = torch.randint(0, 12, (16,), generator=_gen(3502))       # items 24..29 are never in the batch
_C01_NEG = torch.randint(12, 24, (16,), generator=_gen(3503))


class _MFBPR(nn.Module):
    """AMF.py's MF: output = (P[u] * Q[i]) @ h."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding_P = nn.Parameter(torch.randn(_C01_USERS, _C01_DIM, generator=_gen(3504)) * 0.1)
        self.embedding_Q = nn.Parameter(torch.randn(_C01_ITEMS, _C01_DIM, generator=_gen(3505)) * 0.1)
        self.h = nn.Parameter(torch.ones(_C01_DIM, 1))

    def inference(self, users: torch.Tensor, items: torch.Tensor):
        p = self.embedding_P[users]
        q = self.embedding_Q[items]
        return (p * q) @ self.h, p, q

    def forward(self, user: torch.Tensor, item_pos: torch.Tensor, item_neg: torch.Tensor) -> torch.Tensor:
        return self.inference(user, item_pos)[0] - self.inference(user, item_neg)[0]


def _c01_setup(bug: bool):
    torch.manual_seed(0)
    model = _MFBPR().train()
    opt = torch.optim.Adagrad(model.parameters(), lr=0.05)
    reg = 0.01
    batch = {"user": _C01_U, "item_pos": _C01_POS, "item_neg": _C01_NEG}

    def step() -> torch.Tensor:
        out, p_pos, q_pos = model.inference(_C01_U, _C01_POS)
        out_neg, _, q_neg = model.inference(_C01_U, _C01_NEG)
        result = torch.clamp(out - out_neg, -80.0, 1e8)
        loss = F.softplus(-result).sum()
        if bug:
            opt_loss = loss + reg * (model.embedding_P.square().sum() + model.embedding_Q.square().sum())
        else:
            opt_loss = loss + reg * (p_pos.square() + q_pos.square() + q_neg.square()).mean()
        opt.zero_grad()
        opt_loss.backward()
        opt.step()
        return opt_loss

    return model, opt, step, batch


def _c01_build(bug: bool) -> Case:
    model, opt, step, batch = _c01_setup(bug)
    return model, step, _kw(optimizer=opt, inputs=batch)


def _c01_proof(bug: bool) -> bool:
    """After two steps, have the embeddings of users and items that no batch looked up moved?"""
    model, _, step, _ = _c01_setup(bug)
    p0, q0 = model.embedding_P.detach().clone(), model.embedding_Q.detach().clone()
    for _ in range(2):
        step()
    moved_p = (model.embedding_P.detach()[8:] - p0[8:]).abs().max()
    moved_q = (model.embedding_Q.detach()[24:] - q0[24:]).abs().max()
    return bool(max(float(moved_p), float(moved_q)) > 1e-7)


# --------------------------------------------------------------------------------------------- case-02
# torch-points3d/torch-points3d PR #630 ("Fix LR Checkpoint Resuming"): on resume, the checkpoint code first built the
# optimizer and loaded its state (which restores the decayed learning rate), and only then instantiated the LR
# scheduler over it and loaded the scheduler's state. Constructing the (LambdaLR-based ExpLR) scheduler takes its
# initial step, which writes `initial_lr * lambda(0)` back into the optimizer, so the resumed run trains at the
# ORIGINAL learning rate until the scheduler's next (per-epoch) step. Loss still goes down; the resumed epoch is just
# run at e.g. 8x the intended lr. Fix in the PR: create the optimizer, create and load the schedulers, and load the
# optimizer's state dict last. Reproduced on a PointNet-style classifier with torch-points3d's ExpLR (a LambdaLR).

_C02_PTS = torch.randn(6, 32, 3, generator=_gen(3511))
_C02_Y = torch.randint(0, 4, (6,), generator=_gen(3512))
_C02_LR, _C02_GAMMA = 1e-2, 0.5


class _PointNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(3, 16), nn.ReLU(), nn.Linear(16, 32), nn.ReLU())
        self.cls = nn.Linear(32, 4)

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        return self.cls(self.mlp(pos).max(dim=1).values)


def _c02_exp_lr(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    # torch_points3d.core.schedulers.lr_schedulers.ExpLR(step_size=1, gamma=0.5): a LambdaLR
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _C02_GAMMA ** (s / 1))


def _c02_checkpoint():
    """The first run: three epochs (one batch each), the scheduler stepped at every epoch end, then saved."""
    torch.manual_seed(0)
    model = _PointNet().train()
    opt = torch.optim.Adam(model.parameters(), lr=_C02_LR)
    sched = _c02_exp_lr(opt)
    for _ in range(3):
        opt.zero_grad()
        F.cross_entropy(model(_C02_PTS), _C02_Y).backward()
        opt.step()
        sched.step()
    return copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()), copy.deepcopy(sched.state_dict())


def _c02_resume(bug: bool):
    weights, opt_state, sched_state = _c02_checkpoint()
    torch.manual_seed(1)
    model = _PointNet().train()
    model.load_state_dict(weights)
    opt = torch.optim.Adam(model.parameters(), lr=_C02_LR)
    if bug:  # Checkpoint.get_optimizer, then Checkpoint.get_schedulers
        opt.load_state_dict(opt_state)
        sched = _c02_exp_lr(opt)
        sched.load_state_dict(sched_state)
    else:  # load_optim_sched: schedulers first, optimizer state last
        sched = _c02_exp_lr(opt)
        sched.load_state_dict(sched_state)
        opt.load_state_dict(opt_state)
    return model, opt, sched, opt_state["param_groups"][0]["lr"]


def _c02_build(bug: bool) -> Case:
    model, opt, sched, _ = _c02_resume(bug)
    batch = {"pos": _C02_PTS}

    def step() -> torch.Tensor:  # scheduler updated on epoch end (update_scheduler_on="on_epoch"), not per batch
        opt.zero_grad()
        loss = F.cross_entropy(model(_C02_PTS), _C02_Y)
        loss.backward()
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=batch, lr_scheduler=sched)


def _c02_proof(bug: bool) -> bool:
    """Does the first resumed step run at a different learning rate than the checkpoint had reached?"""
    model, opt, _, saved_lr = _c02_resume(bug)
    opt.zero_grad()
    F.cross_entropy(model(_C02_PTS), _C02_Y).backward()
    used_lr = opt.param_groups[0]["lr"]
    opt.step()
    return bool(abs(used_lr - saved_lr) > 1e-9)


# --------------------------------------------------------------------------------------------- case-03
# prateekbhustali/Physics-Informed-Neural-Networks issue #4 (PyTorch Helmholtz notebook "predicted problem"): the PINN's
# PDE loss takes the second derivative as `u_xx = autograd.grad(u_x, g, torch.ones(x_to_train_f.shape), ...)`, where
# u_x holds both first derivatives [u_x1, u_x2]. Column 0 of the result is d(u_x1 + u_x2)/dx1 = u_x1x1 + u_x2x1, column 1
# is u_x1x2 + u_x2x2, so `u_xx_1 + u_xx_2` is the Laplacian PLUS twice the mixed derivative. The network is trained to
# a different PDE: the loss still goes down smoothly, the solution is just wrong. Fix given in the thread: take each
# second derivative from its own first-derivative column (u_xx1 = grad(u_x[:, [0]], g)[:, [0]], u_xx2 = grad(u_x[:,
# [1]], g)[:, [1]]).

_C03_A1 = _C03_A2 = 1.0
_C03_K = 1.0
_C03_LB = torch.tensor([-1.0, -1.0])
_C03_UB = torch.tensor([1.0, 1.0])
_C03_XF = torch.rand(64, 2, generator=_gen(3521)) * 2 - 1          # collocation points
_C03_T = torch.rand(16, generator=_gen(3522)) * 2 - 1
_C03_XU = torch.cat([torch.stack([_C03_T[:8], torch.ones(8)], 1),    # boundary points y = 1 and x = -1
                     torch.stack([-torch.ones(8), _C03_T[8:]], 1)])
_C03_U = torch.sin(_C03_A1 * torch.pi * _C03_XU[:, [0]]) * torch.sin(_C03_A2 * torch.pi * _C03_XU[:, [1]])


class _PINN(nn.Module):
    """The notebook's Sequentialmodel (layers [2, 32, 32, 1], tanh, Xavier normal, zero bias, feature scaling)."""

    def __init__(self, bug: bool) -> None:
        super().__init__()
        self.bug = bug
        layers = [2, 32, 32, 1]
        self.activation = nn.Tanh()
        self.loss_function = nn.MSELoss(reduction="mean")
        self.linears = nn.ModuleList([nn.Linear(layers[i], layers[i + 1]) for i in range(len(layers) - 1)])
        for lin in self.linears:
            nn.init.xavier_normal_(lin.weight.data, gain=1.0)
            nn.init.zeros_(lin.bias.data)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = (x - _C03_LB) / (_C03_UB - _C03_LB)
        for lin in self.linears[:-1]:
            a = self.activation(lin(a))
        return self.linears[-1](a)

    def laplacian_term(self, x_f: torch.Tensor):
        g = x_f.clone()
        g.requires_grad = True
        u = self.forward(g)
        u_x = torch.autograd.grad(u, g, torch.ones([x_f.shape[0], 1]), retain_graph=True, create_graph=True)[0]
        if self.bug:
            u_xx = torch.autograd.grad(u_x, g, torch.ones(x_f.shape), create_graph=True)[0]
            u_xx_1, u_xx_2 = u_xx[:, [0]], u_xx[:, [1]]
        else:
            u_x1, u_x2 = u_x[:, [0]], u_x[:, [1]]
            u_xx_1 = torch.autograd.grad(u_x1, g, torch.ones_like(u_x1), create_graph=True)[0][:, [0]]
            u_xx_2 = torch.autograd.grad(u_x2, g, torch.ones_like(u_x2), create_graph=True)[0][:, [1]]
        return u_xx_1 + u_xx_2, u

    def loss_PDE(self, x_f: torch.Tensor) -> torch.Tensor:
        lap, u = self.laplacian_term(x_f)
        q = (-(_C03_A1 * torch.pi) ** 2 - (_C03_A2 * torch.pi) ** 2 + _C03_K ** 2) \
            * torch.sin(_C03_A1 * torch.pi * x_f[:, [0]]) * torch.sin(_C03_A2 * torch.pi * x_f[:, [1]])
        f = lap + _C03_K ** 2 * u - q
        return self.loss_function(f, torch.zeros_like(f))

    def loss(self, x: torch.Tensor, y: torch.Tensor, x_f: torch.Tensor) -> torch.Tensor:
        return self.loss_function(self.forward(x), y) + self.loss_PDE(x_f)


def _c03_model(bug: bool) -> _PINN:
    torch.manual_seed(1234)
    return _PINN(bug).train()


def _c03_build(bug: bool) -> Case:
    model = _c03_model(bug)
    opt = torch.optim.Adam(model.parameters(), lr=0.001, betas=(0.9, 0.999), eps=1e-08, weight_decay=0, amsgrad=False)

    def step() -> torch.Tensor:
        loss = model.loss(_C03_XU, _C03_U, _C03_XF)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs={"x": _C03_XU, "x_f": _C03_XF})


def _c03_proof(bug: bool) -> bool:
    """Does the Laplacian the PDE residual uses differ from the true Laplacian (trace of each point's Hessian)?"""
    model = _c03_model(bug)
    lap, _ = model.laplacian_term(_C03_XF)
    true = torch.stack([torch.autograd.functional.hessian(lambda p: model(p[None])[0, 0], p).trace()
                        for p in _C03_XF])
    return bool((lap.detach().squeeze(1) - true).abs().max() > 1e-4)


# --------------------------------------------------------------------------------------------- case-04
# Lightning-AI/pytorch-lightning issue #13902 ("BackboneFinetuning - even with train_bn batch normalization is still
# learning"): `BackboneFinetuning(train_bn=False)` is meant to keep the backbone's BatchNorm layers fixed while the
# backbone is frozen, but `freeze_before_training` calls `self.freeze(pl_module.backbone)` without `train_bn`, and
# `freeze`'s default is `train_bn=True`. The BatchNorm weights and biases keep requires_grad=True, land in the optimizer
# that `configure_optimizers` builds from the trainable parameters, and are trained from the first epoch; the loss
# falls normally. Fix in the thread: pass it through, `self.freeze(pl_module.backbone, train_bn=self.train_bn)` (here as
# the users' subclass override). Reproduced with Lightning's own callback on a tabular MLP backbone.

_C04_X = torch.randn(16, 8, generator=_gen(3531))
_C04_Y = torch.randint(0, 3, (16,), generator=_gen(3532))


def _c04_module_cls():
    import lightning.pytorch as pl

    class TabularNet(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.backbone = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(),
                                          nn.Linear(32, 32), nn.BatchNorm1d(32), nn.ReLU())
            self.head = nn.Linear(32, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.backbone(x))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self(x), y)

        def configure_optimizers(self):
            return torch.optim.Adam(filter(lambda p: p.requires_grad, self.parameters()), lr=1e-2)

    return TabularNet


def _c04_callback(bug: bool):
    from lightning.pytorch.callbacks import BackboneFinetuning

    if bug:
        return BackboneFinetuning(unfreeze_backbone_at_epoch=10, train_bn=False)

    class FixedBackboneFinetuning(BackboneFinetuning):
        def freeze_before_training(self, pl_module) -> None:
            self.freeze(pl_module.backbone, train_bn=self.train_bn)

    return FixedBackboneFinetuning(unfreeze_backbone_at_epoch=10, train_bn=False)


def _c04_setup(bug: bool):
    torch.manual_seed(0)
    module = _c04_module_cls()().train()
    _c04_callback(bug).freeze_before_training(module)  # what BaseFinetuning.setup() does before configure_optimizers
    opt = module.configure_optimizers()
    return module, opt


def _c04_build(bug: bool) -> Case:
    module, opt = _c04_setup(bug)

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = module.training_step((_C04_X, _C04_Y), 0)
        loss.backward()
        opt.step()
        return loss

    return module, step, _kw(optimizer=opt, inputs={"x": _C04_X})


def _c04_proof(bug: bool) -> bool:
    """In the frozen phase, does a step move the backbone's BatchNorm weight or bias?"""
    module, opt = _c04_setup(bug)
    bn = module.backbone[1]
    before = torch.cat([bn.weight.detach(), bn.bias.detach()]).clone()
    for _ in range(2):
        opt.zero_grad()
        module.training_step((_C04_X, _C04_Y), 0).backward()
        opt.step()
    after = torch.cat([bn.weight.detach(), bn.bias.detach()])
    return bool((after - before).abs().max() > 1e-7)


# --------------------------------------------------------------------------------------------- case-05
# leffff/graphormer-pyg issue #14 ("softmax in GraphormerAttentionHead"): a batch of graphs is one big node matrix, and
# the attention head masked the scores of node pairs from different graphs by MULTIPLYING them with a 0/1 block mask,
# `a = (a + b + c) * batch_mask; softmax(a, dim=-1)`. A zeroed score is not a masked one: exp(0) still gets weight, so
# every node attends to the nodes of every other graph in the batch and each graph's prediction depends on which
# graphs it was batched with. Training runs and the loss falls. Fix (suggested in the thread and accepted by the
# maintainer): give cross-graph pairs a -1e6 score instead of 0 so the softmax gives them no weight.
# Reproduced with a Graphormer-style attention head (spatial/edge encodings left out) and a graph-level regressor.

_C05_SIZES = [4, 5, 3]
_C05_PTR = torch.tensor([0, 4, 9, 12])
_C05_BATCH = torch.repeat_interleave(torch.arange(3), torch.tensor(_C05_SIZES))
_C05_X = torch.randn(12, 6, generator=_gen(3541))
_C05_Y = torch.randn(3, 1, generator=_gen(3542))


class _GraphormerAttentionHead(nn.Module):
    def __init__(self, dim_in: int, dim_q: int, dim_k: int, bug: bool) -> None:
        super().__init__()
        self.bug = bug
        self.q = nn.Linear(dim_in, dim_q)
        self.k = nn.Linear(dim_in, dim_k)
        self.v = nn.Linear(dim_in, dim_k)

    def forward(self, x: torch.Tensor, ptr: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        same = torch.zeros(n, n, dtype=torch.bool)
        for i in range(len(ptr) - 1):
            same[ptr[i]:ptr[i + 1], ptr[i]:ptr[i + 1]] = True
        query, key, value = self.q(x), self.k(x), self.v(x)
        a = query.mm(key.transpose(0, 1)) / query.size(-1) ** 0.5
        if self.bug:
            a = a * same.float()
        else:
            a = a + torch.where(same, 0.0, -1e6)
        return torch.softmax(a, dim=-1).mm(value)


class _GraphRegressor(nn.Module):
    def __init__(self, bug: bool) -> None:
        super().__init__()
        self.node_in = nn.Linear(6, 16)
        self.attn = _GraphormerAttentionHead(16, 16, 16, bug)
        self.out = nn.Linear(16, 1)

    def node_embeddings(self, x: torch.Tensor, ptr: torch.Tensor) -> torch.Tensor:
        h = self.node_in(x)
        return h + self.attn(h, ptr)

    def forward(self, x: torch.Tensor, ptr: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
        h = self.node_embeddings(x, ptr)
        pooled = torch.zeros(len(ptr) - 1, h.shape[1]).index_add(0, batch, h)
        pooled = pooled / torch.bincount(batch).unsqueeze(1).float()
        return self.out(pooled)


def _c05_model(bug: bool) -> _GraphRegressor:
    torch.manual_seed(0)
    return _GraphRegressor(bug).train()


def _c05_build(bug: bool) -> Case:
    model = _c05_model(bug)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    batch = {"x": _C05_X, "ptr": _C05_PTR, "batch": _C05_BATCH}

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = F.mse_loss(model(**batch), _C05_Y)
        loss.backward()
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=batch)


def _c05_proof(bug: bool) -> bool:
    """Do the first graph's node embeddings change when only the second graph's node features change?"""
    model = _c05_model(bug)
    other = _C05_X.clone()
    other[4:9] = torch.randn(5, 6, generator=_gen(3543)) * 3
    with torch.no_grad():
        a = model.node_embeddings(_C05_X, _C05_PTR)[:4]
        b = model.node_embeddings(other, _C05_PTR)[:4]
    return bool((a - b).abs().max() > 1e-6)


CASES: list[BlindCase] = [
    BlindCase("b35c-01", "https://github.com/hexiangnan/adversarial_personalized_ranking/pull/8",
              "L2 reg on whole embedding tables",
              "The BPR recommender regularises the entire user and item embedding tables every step, so embeddings "
              "of users and items not in the batch keep shrinking.", _c01_build, _c01_proof,
              known_miss="an L2 term over the whole embedding tables: which rows a regulariser should read is arithmetic inside the loss"),
    BlindCase("b35c-02", "https://github.com/torch-points3d/torch-points3d/pull/630",
              "resume resets decayed learning rate",
              "On resume the scheduler is built after the optimizer state is loaded, and its initial step writes the "
              "original learning rate back, so the resumed epoch trains at the undecayed lr.", _c02_build, _c02_proof),
    BlindCase("b35c-03", "https://github.com/prateekbhustali/Physics-Informed-Neural-Networks/issues/4",
              "PINN Laplacian includes mixed derivatives",
              "The second derivative is taken of the sum of both first-derivative columns, so the PDE residual uses "
              "the Laplacian plus twice u_xy and the PINN fits a different equation.", _c03_build, _c03_proof,
              known_miss="a Laplacian with the mixed derivatives in it: the arithmetic of a PDE residual is outside the model"),
    BlindCase("b35c-04", "https://github.com/Lightning-AI/pytorch-lightning/issues/13902",
              "frozen backbone BatchNorm still trains",
              "BackboneFinetuning(train_bn=False) freezes the backbone with train_bn left at True, so its BatchNorm "
              "weights and biases are optimised during the frozen phase.", _c04_build, _c04_proof,
              known_miss="BatchNorm affine parameters left trainable in a frozen backbone: the callback's train_bn intent is in its argument, not in the setup"),
    BlindCase("b35c-05", "https://github.com/leffff/graphormer-pyg/issues/14",
              "attention leaks across batched graphs",
              "Cross-graph attention scores are multiplied by zero instead of masked, so every node attends to the "
              "nodes of the other graphs in the batch.", _c05_build, _c05_proof,
              known_miss="graphs of one batch attending one another through a multiplied (not masked) score: the graphs are nodes of one matrix, and which nodes form a sample is not known"),
]
