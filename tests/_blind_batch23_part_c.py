"""Blind batch 23 (part c): silent training bugs from public threads (RL, GNN, time series, meta-learning, PINN),
each with its fixed twin.

Collected by someone who does not write the audit's checks. Every case is a tiny hand-written model on seeded data;
nothing is downloaded. Each proof shows the bug on real steps without the audit.
"""

from __future__ import annotations

import warnings
from typing import cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw, _sgd_step

# --------------------------------------------------------------------------------------------- case-11
# jayroxis/PINNs issue #6 (Burgers.ipynb): the Net's ``loss_func`` closure, passed to ``self.adam.step(...)`` (and
# to L-BFGS), computes the data loss plus the PDE residual loss and calls ``loss.backward()`` but never zeroes the
# gradients first, so every step's gradient is added onto all the previous ones. The author confirmed the bug and
# fixed it by adding ``self.adam.zero_grad()`` at the top of the closure.


class _BurgersPINN(nn.Module):
    """u(t, x) by a tanh MLP, trained on initial/boundary data plus the Burgers residual u_t + u u_x - nu u_xx."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                                 nn.Linear(width, 1))

    def forward(self, t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([t, x], dim=1))


_C11_TX_U = torch.rand(24, 2, generator=_gen(1101)) * torch.tensor([0.0, 2.0]) - torch.tensor([0.0, 1.0])
_C11_U = -torch.sin(torch.pi * _C11_TX_U[:, 1:2])
_C11_TX_F = torch.rand(48, 2, generator=_gen(1102)) * torch.tensor([1.0, 2.0]) - torch.tensor([0.0, 1.0])
_C11_NU = 0.01 / torch.pi


def _c11_loss(model: _BurgersPINN) -> torch.Tensor:
    u_pred = model(_C11_TX_U[:, :1], _C11_TX_U[:, 1:])
    mse_u = F.mse_loss(u_pred, _C11_U)
    t = _C11_TX_F[:, :1].clone().requires_grad_(True)
    x = _C11_TX_F[:, 1:].clone().requires_grad_(True)
    u = model(t, x)
    u_t, u_x = torch.autograd.grad(u.sum(), (t, x), create_graph=True)
    u_xx = torch.autograd.grad(u_x.sum(), x, create_graph=True)[0]
    f = u_t + u * u_x - _C11_NU * u_xx
    return mse_u + (f ** 2).mean()


def _c11_build(bug: bool) -> Case:
    """Burgers PINN trained with Adam through a closure that calls backward (zero_grad missing in the bug)."""
    torch.manual_seed(0)
    model = _BurgersPINN().train()
    adam = torch.optim.Adam(model.parameters(), lr=1e-3)

    def loss_func() -> torch.Tensor:
        if not bug:
            adam.zero_grad()
        loss = _c11_loss(model)
        loss.backward()
        return loss

    def step() -> torch.Tensor:
        return adam.step(loss_func)

    return model, step, _kw(optimizer=adam, inputs=(_C11_TX_F[:, :1], _C11_TX_F[:, 1:]))


def _c11_proof(bug: bool) -> bool:
    """After the second step the gradient Adam used is not the gradient of the second step's loss: it still holds
    the first step's gradient added on top."""
    built, step, _ = _c11_build(bug)
    model = cast(_BurgersPINN, built)
    step()
    params = list(model.parameters())
    fresh = torch.autograd.grad(_c11_loss(model), params)
    step()
    return any(p.grad is not None and float((p.grad - g).abs().max()) > 1e-6 for p, g in zip(params, fresh))


# --------------------------------------------------------------------------------------------- case-12
# waittim/graph-fraud-detection issue #3: the node-classification training loop (GCN over a transaction graph)
# computes ``l = loss(pred, labels)`` over every node of the graph, so the labels of the test_mask nodes are trained
# on and the reported test score is inflated. The maintainer agreed it is a bug: the loss should only be computed on
# the training mask (``loss(pred[train_mask], labels[train_mask])``).


class _DenseGCN(nn.Module):
    """Two-layer GCN over a fixed, symmetrically normalised adjacency (with self-loops)."""

    def __init__(self, adj_norm: torch.Tensor, d_in: int = 8, hidden: int = 16, n_cls: int = 2) -> None:
        super().__init__()
        self.register_buffer("adj", adj_norm)
        self.lin1 = nn.Linear(d_in, hidden)
        self.lin2 = nn.Linear(hidden, n_cls)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.adj @ self.lin1(x))
        return self.adj @ self.lin2(h)


def _c12_graph() -> torch.Tensor:
    n = 30
    a = (torch.rand(n, n, generator=_gen(1201)) < 0.15).float()
    a = ((a + a.t()) > 0).float()
    a.fill_diagonal_(1.0)
    d = a.sum(1).rsqrt()
    return d[:, None] * a * d[None, :]


_C12_ADJ = _c12_graph()
_C12_X = torch.randn(30, 8, generator=_gen(1202))
_C12_Y = torch.randint(0, 2, (30,), generator=_gen(1203))
_C12_PERM = torch.randperm(30, generator=_gen(1204))
_C12_TRAIN = torch.zeros(30, dtype=torch.bool)
_C12_TRAIN[_C12_PERM[:18]] = True
_C12_TEST = ~_C12_TRAIN


def _c12_loss(model: _DenseGCN, bug: bool, labels: torch.Tensor) -> torch.Tensor:
    pred = model(_C12_X)
    if bug:
        return F.cross_entropy(pred, labels)
    return F.cross_entropy(pred[_C12_TRAIN], labels[_C12_TRAIN])


def _c12_build(bug: bool) -> Case:
    """Full-graph GCN node classification whose loss is taken over all nodes (test nodes included) in the bug."""
    torch.manual_seed(0)
    model = _DenseGCN(_C12_ADJ).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    step = _sgd_step(model, opt, lambda: _c12_loss(model, bug, _C12_Y))
    return model, step, _kw(optimizer=opt, inputs=_C12_X)


def _c12_proof(bug: bool) -> bool:
    """Flipping only the test nodes' labels changes the training gradient: test labels feed the update."""
    model = cast(_DenseGCN, _c12_build(bug)[0])
    flipped = _C12_Y.clone()
    flipped[_C12_TEST] = 1 - flipped[_C12_TEST]
    params = list(model.parameters())
    g_a = torch.autograd.grad(_c12_loss(model, bug, _C12_Y), params)
    g_b = torch.autograd.grad(_c12_loss(model, bug, flipped), params)
    return any(float((a - b).abs().max()) > 1e-7 for a, b in zip(g_a, g_b))


# --------------------------------------------------------------------------------------------- case-13
# jameswniu/multi-agent-rl-mapf-drone-navigation pull request #33 ("Fix three learning defects"): in the
# actor-critic update the advantages (returns - values) were never detached, so the policy-gradient loss
# back-propagated through the value head and pushed the critic by the policy objective instead of only the value
# loss. The fix detaches the advantage used by the policy term.


class _ActorCritic(nn.Module):
    """Shared trunk with a categorical policy head and a state-value head."""

    def __init__(self, obs_dim: int = 9, n_act: int = 5, hidden: int = 32) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(obs_dim, hidden), nn.Tanh())
        self.policy = nn.Linear(hidden, n_act)
        self.value = nn.Linear(hidden, 1)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.trunk(obs)
        return self.policy(h), self.value(h).squeeze(-1)


_C13_OBS = torch.randn(12, 9, generator=_gen(1301))
_C13_ACT = torch.randint(0, 5, (12,), generator=_gen(1302))
_C13_REW = torch.where(torch.rand(12, generator=_gen(1303)) < 0.2, 10.0, -0.1)


def _c13_returns(rewards: torch.Tensor, gamma: float = 0.99) -> torch.Tensor:
    out, running = [], 0.0
    for r in reversed(rewards.tolist()):
        running = r + gamma * running
        out.append(running)
    ret = torch.tensor(list(reversed(out)))
    return (ret - ret.mean()) / (ret.std() + 1e-8)


_C13_RET = _c13_returns(_C13_REW)


def _c13_losses(model: _ActorCritic, bug: bool) -> tuple[torch.Tensor, torch.Tensor]:
    logits, values = model(_C13_OBS)
    log_probs = torch.distributions.Categorical(logits=logits).log_prob(_C13_ACT)
    advantages = _C13_RET - values
    adv_pg = advantages if bug else advantages.detach()
    policy_loss = -(log_probs * adv_pg).mean()
    value_loss = advantages.pow(2).mean()
    return policy_loss, value_loss


def _c13_build(bug: bool) -> Case:
    """One actor-critic update on an episode; the policy term uses an undetached advantage in the bug."""
    torch.manual_seed(0)
    model = _ActorCritic().train()
    opt = torch.optim.Adam(model.parameters(), lr=3e-4)

    def loss_fn() -> torch.Tensor:
        policy_loss, value_loss = _c13_losses(model, bug)
        return policy_loss + 0.5 * value_loss

    step = _sgd_step(model, opt, loss_fn)
    return model, step, _kw(optimizer=opt, inputs=_C13_OBS)


def _c13_proof(bug: bool) -> bool:
    """The policy-gradient term alone reaches the value head's weights (it should give them no gradient)."""
    model = cast(_ActorCritic, _c13_build(bug)[0])
    policy_loss, _ = _c13_losses(model, bug)
    g = torch.autograd.grad(policy_loss, list(model.value.parameters()), allow_unused=True)
    return any(x is not None and float(x.abs().max()) > 0.0 for x in g)


# --------------------------------------------------------------------------------------------- case-14
# jsboige/CoursIA pull request #926: the forecasting training scripts (Mamba / iTransformer / PatchTST / TFT) with
# ``pred_len=1`` feed ``criterion(pred, y_batch)`` a prediction of shape (B, 1) and a target of shape (B,);
# ``nn.MSELoss`` broadcasts them to a (B, B) matrix, so each prediction is regressed towards every target in the
# batch (only a UserWarning, training goes on). The fix reshapes the target first: ``y_batch.view_as(pred)``.


class _GRUForecaster(nn.Module):
    """Look-back window of a multivariate series -> next value of the target channel (pred_len = 1)."""

    def __init__(self, n_feat: int = 3, hidden: int = 16, pred_len: int = 1) -> None:
        super().__init__()
        self.gru = nn.GRU(n_feat, hidden, batch_first=True)
        self.head = nn.Linear(hidden, pred_len)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.gru(x)
        return self.head(h[:, -1])


def _c14_data() -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.arange(200, dtype=torch.float32)
    g = _gen(1401)
    series = torch.stack([torch.sin(t / 6.0), torch.cos(t / 11.0), 0.1 * torch.randn(200, generator=g)], dim=1)
    starts = torch.randint(0, 200 - 13, (16,), generator=_gen(1402))
    x = torch.stack([series[s:s + 12] for s in starts.tolist()])
    y = torch.stack([series[s + 12, 0] for s in starts.tolist()])
    return x, y


_C14_X, _C14_Y = _c14_data()
_C14_CRIT = nn.MSELoss()


def _c14_loss(model: _GRUForecaster, bug: bool, y: torch.Tensor) -> torch.Tensor:
    pred = model(_C14_X)
    return _C14_CRIT(pred, y) if bug else _C14_CRIT(pred, y.view_as(pred))


def _c14_build(bug: bool) -> Case:
    """One-step-ahead GRU forecaster trained with MSELoss on (B, 1) predictions against (B,) targets in the bug."""
    torch.manual_seed(0)
    model = _GRUForecaster().train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    step = _sgd_step(model, opt, lambda: _c14_loss(model, bug, _C14_Y))
    return model, step, _kw(optimizer=opt, inputs=_C14_X)


def _c14_proof(bug: bool) -> bool:
    """Shuffling which target belongs to which window leaves the loss unchanged: the pairing is never used."""
    model = cast(_GRUForecaster, _c14_build(bug)[0])
    shuffled = _C14_Y[torch.randperm(_C14_Y.numel(), generator=_gen(1403))]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a = float(_c14_loss(model, bug, _C14_Y))
        b = float(_c14_loss(model, bug, shuffled))
    return abs(a - b) < 1e-6


# --------------------------------------------------------------------------------------------- case-15
# dragen1860/MAML-Pytorch pull request #8 ("bugfix: random label assignment"): the episode builder maps the N sampled
# classes to target labels 0..N-1 by iterating ``np.unique(support_y)``, which sorts them, so a class with a low
# global id almost always gets a low target label. The meta-learner learns this fixed class->label mapping (30%
# pre-update accuracy on 5-way instead of 20%) instead of learning to adapt. The fix shuffles ``unique`` before the
# relabelling (``random.shuffle(unique)``).

_C15_N_CLASSES, _C15_WAY, _C15_SHOT, _C15_QUERY, _C15_DIM = 20, 5, 2, 3, 8
_C15_CLASS_MEANS = torch.randn(_C15_N_CLASSES, _C15_DIM, generator=_gen(1501)) * 2.0


def _c15_episode(rng: np.random.Generator, bug: bool) -> tuple[torch.Tensor, ...]:
    classes = rng.choice(_C15_N_CLASSES, _C15_WAY, replace=False)
    support_cls = np.repeat(classes, _C15_SHOT)
    query_cls = np.repeat(classes, _C15_QUERY)
    unique = np.unique(support_cls)
    if not bug:
        rng.shuffle(unique)
    support_y = np.zeros(len(support_cls), dtype=np.int64)
    query_y = np.zeros(len(query_cls), dtype=np.int64)
    for idx, c in enumerate(unique):
        support_y[support_cls == c] = idx
        query_y[query_cls == c] = idx
    noise = torch.from_numpy(rng.standard_normal((len(support_cls) + len(query_cls), _C15_DIM))).float()
    xs = _C15_CLASS_MEANS[torch.from_numpy(support_cls)] + noise[:len(support_cls)]
    xq = _C15_CLASS_MEANS[torch.from_numpy(query_cls)] + noise[len(support_cls):]
    return (xs, torch.from_numpy(support_y), xq, torch.from_numpy(query_y),
            torch.from_numpy(support_cls), torch.from_numpy(query_cls))


class _MetaMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(_C15_DIM, 32), nn.ReLU(), nn.Linear(32, _C15_WAY))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _c15_maml_loss(model: _MetaMLP, episodes: list[tuple[torch.Tensor, ...]], inner_lr: float = 0.4) -> torch.Tensor:
    from torch.func import functional_call

    params: dict[str, torch.Tensor] = dict(model.named_parameters())
    total = torch.zeros(())
    for xs, ys, xq, yq, _, _ in episodes:
        inner = F.cross_entropy(functional_call(model, params, (xs,)), ys)
        grads = torch.autograd.grad(inner, list(params.values()), create_graph=True)
        fast = {k: v - inner_lr * g for (k, v), g in zip(params.items(), grads)}
        total = total + F.cross_entropy(functional_call(model, fast, (xq,)), yq)
    return total / len(episodes)


def _c15_build(bug: bool) -> Case:
    """5-way 2-shot MAML meta-step on episodes whose class->label mapping follows sorted class ids in the bug."""
    torch.manual_seed(0)
    model = _MetaMLP().train()
    meta_opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    rng = np.random.default_rng(1502)
    state = {"episodes": [_c15_episode(rng, bug) for _ in range(4)]}

    def loss_fn() -> torch.Tensor:
        loss = _c15_maml_loss(model, state["episodes"])
        state["episodes"] = [_c15_episode(rng, bug) for _ in range(4)]
        return loss

    step = _sgd_step(model, meta_opt, loss_fn)
    xs = state["episodes"][0][0]
    return model, step, _kw(optimizer=meta_opt, inputs=xs)


def _c15_proof(bug: bool) -> bool:
    """Across many sampled episodes the target label is strongly rank-correlated with the global class id (a
    shuffled assignment has no such correlation), so labels carry class identity the learner can memorise."""
    rng = np.random.default_rng(1503)
    cls_ids, labels = [], []
    for _ in range(300):
        _, ys, _, _, cs, _ = _c15_episode(rng, bug)
        cls_ids.append(cs.numpy())
        labels.append(ys.numpy())
    c = np.concatenate(cls_ids).astype(float)
    y = np.concatenate(labels).astype(float)
    corr = float(np.corrcoef(c, y)[0, 1])
    return abs(corr) > 0.3


CASES: list[BlindCase] = [
    BlindCase("b23-case-11", "https://github.com/jayroxis/PINNs/issues/6", "missing zero_grad in closure",
              "The PINN's optimizer closure calls backward without zeroing gradients, so every Adam step uses the "
              "sum of all gradients so far instead of the current one.", _c11_build, _c11_proof),
    BlindCase("b23-case-12", "https://github.com/waittim/graph-fraud-detection/issues/3", "loss over wrong node mask",
              "The GCN node-classification loss is taken over every node, so test-node labels are trained on and "
              "the test score is inflated.", _c12_build, _c12_proof,
              known_miss="the node-classification loss covers the test nodes: which nodes are held out is not known to the step"),
    BlindCase("b23-case-13", "https://github.com/jameswniu/multi-agent-rl-mapf-drone-navigation/pull/33",
              "advantage not detached",
              "The actor-critic policy loss uses an undetached advantage, so the policy objective back-propagates "
              "into the value head and corrupts the critic.", _c13_build, _c13_proof),
    BlindCase("b23-case-14", "https://github.com/jsboige/CoursIA/pull/926", "loss shape broadcasting",
              "MSELoss on (B, 1) predictions against (B,) targets broadcasts to (B, B), so each forecast is pulled "
              "towards the batch mean target instead of its own.", _c14_build, _c14_proof),
    BlindCase("b23-case-15", "https://github.com/dragen1860/MAML-Pytorch/pull/8", "episode label assignment",
              "Episode labels follow the sorted global class ids instead of a random permutation, so the "
              "meta-learner can memorise a class->label mapping rather than learn to adapt.", _c15_build,
              _c15_proof, known_miss="episode labels follow the sorted class ids: label semantics across episodes"),
]
