"""Blind batch 20 (part c): silent training bugs in less common setups (continual learning, meta-learning,
reinforcement learning, graph networks, time-series forecasting) from public GitHub threads, each with its twin.

Every case builds the user's setup on a tiny hand-written model (nothing is downloaded), and proves the bug without
the audit: ``proof(True)`` is True for the bug and ``proof(False)`` is False for the fixed twin.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw


def _train_step(opt: torch.optim.Optimizer, loss_fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """The user's loop body: zero the grads, compute the loss, backward, step."""

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = loss_fn()
        loss.backward()
        opt.step()
        return loss

    return step


# --------------------------------------------------------------------------------------------- case-11
# The thread reports that the EWC plugin's penalty is always 0: inside the loop over (current, saved, importance)
# the code slices the *saved* parameter into ``cur_param`` (``cur_param = saved_param[:n_units]``), so the
# penalty is (saved - saved)^2 = 0 and the regulariser never pulls the weights back: training on the second
# experience is plain fine-tuning and the first task is forgotten. Fix (maintainer): ``cur_param =
# cur_param[:n_units]``.


class _EWCMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(10, 24)
        self.fc2 = nn.Linear(24, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


_C11_XA = torch.randn(32, 10, generator=_gen(1101))
_C11_YA = torch.randint(0, 4, (32,), generator=_gen(1102))
_C11_XB = torch.randn(32, 10, generator=_gen(1103)) + 1.0
_C11_YB = torch.randint(0, 4, (32,), generator=_gen(1104))
_C11_LAMBDA = 50.0


def _c11_penalty(model: nn.Module, saved: list[tuple[str, torch.Tensor]], imps: list[tuple[str, torch.Tensor]],
                 bug: bool) -> torch.Tensor:
    penalty = torch.tensor(0).float()
    for (_, cur_param), (_, saved_param), (_, imp) in zip(model.named_parameters(), saved, imps):
        # dynamic models may add new units; new units are ignored by the regularisation
        n_units = saved_param.shape[0]
        cur_param = saved_param[:n_units] if bug else cur_param[:n_units]
        penalty += (imp * (cur_param - saved_param).pow(2)).sum()
    return penalty


def _c11_setup(bug: bool, ewc_lambda: float) -> tuple[nn.Module, torch.optim.Optimizer, Callable[[], torch.Tensor]]:
    torch.manual_seed(0)
    model = _EWCMLP().train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # experience 0: train on task A, then store params and diagonal-Fisher importances (after_training_exp)
    for _ in range(20):
        opt.zero_grad()
        F.cross_entropy(model(_C11_XA), _C11_YA).backward()
        opt.step()
    saved = [(n, p.detach().clone()) for n, p in model.named_parameters()]
    imps = [(n, torch.zeros_like(p)) for n, p in model.named_parameters()]
    for i in range(0, 32, 8):
        model.zero_grad()
        F.cross_entropy(model(_C11_XA[i:i + 8]), _C11_YA[i:i + 8]).backward()
        for (_, imp), p in zip(imps, model.parameters()):
            imp += p.grad.detach().pow(2) / 4
    model.zero_grad()

    # experience 1: loss on task B plus the EWC penalty (before_backward)
    def loss_fn() -> torch.Tensor:
        loss = F.cross_entropy(model(_C11_XB), _C11_YB)
        return loss + ewc_lambda * _c11_penalty(model, saved, imps, bug)

    return model, opt, loss_fn


def _c11_build(bug: bool) -> Case:
    """EWC continual learning: second experience trained with CE plus the EWC penalty over the saved params."""
    model, opt, loss_fn = _c11_setup(bug, _C11_LAMBDA)
    return model, _train_step(opt, loss_fn), _kw(optimizer=opt, inputs=_C11_XB)


def _c11_proof(bug: bool) -> bool:
    """Five steps on the second experience leave the weights exactly where plain fine-tuning (lambda=0) leaves
    them: the penalty contributes nothing, although the weights have moved away from the saved ones."""
    model, opt, loss_fn = _c11_setup(bug, _C11_LAMBDA)
    ref, ref_opt, ref_loss = _c11_setup(bug, 0.0)
    start = [p.detach().clone() for p in model.parameters()]
    for _ in range(5):
        _train_step(opt, loss_fn)()
        _train_step(ref_opt, ref_loss)()
    moved = any(not torch.equal(a, p) for a, p in zip(start, model.parameters()))
    same = all(torch.allclose(p, q, atol=1e-7) for p, q in zip(model.parameters(), ref.parameters()))
    return moved and same


# --------------------------------------------------------------------------------------------- case-12
# Meta-learning (OML/MRCL): the inner loop adapts the prediction head with
# ``grad = torch.autograd.grad(loss, fast_weights)`` with no ``create_graph=True``, so the inner gradients are
# constants and the meta-gradient of the representation network is only the first-order approximation - the
# maintainer says the second-order term was never computed. Fix (maintainer): ``torch.autograd.grad(loss,
# get_adaptation_parameters(fast_weights), create_graph=True)`` - only the adapted head's weights, with the graph.


class _OMLNet(nn.Module):
    """Representation network (meta-learned, fixed in the inner loop) and a prediction head (adapted inline)."""

    def __init__(self) -> None:
        super().__init__()
        self.rln = nn.Linear(6, 16)
        self.pln = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, vars: list[torch.Tensor] | None = None) -> torch.Tensor:
        w1, b1, w2, b2 = list(self.parameters()) if vars is None else vars
        return F.linear(torch.tanh(F.linear(x, w1, b1)), w2, b2)


_C12_XS = torch.randn(10, 6, generator=_gen(1201))
_C12_YS = torch.randint(0, 3, (10,), generator=_gen(1202))
_C12_XQ = torch.randn(10, 6, generator=_gen(1203))
_C12_YQ = torch.randint(0, 3, (10,), generator=_gen(1204))
_C12_INNER_LR = 1.0
_C12_STEPS = 3


def _c12_meta_loss(net: _OMLNet, bug: bool, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    xs, xq = _C12_XS.to(dtype), _C12_XQ.to(dtype)
    fast_weights = list(net.parameters())
    adapt = [False, False, True, True]  # only the head is adapted in the inner loop
    for _ in range(_C12_STEPS):
        loss = F.cross_entropy(net(xs, fast_weights), _C12_YS)
        if bug:
            grad = torch.autograd.grad(loss, fast_weights)
            fast_weights = [w - _C12_INNER_LR * g if a else w for g, w, a in zip(grad, fast_weights, adapt)]
        else:
            head = [w for w, a in zip(fast_weights, adapt) if a]
            grad = iter(torch.autograd.grad(loss, head, create_graph=True))
            fast_weights = [w - _C12_INNER_LR * next(grad) if a else w for w, a in zip(fast_weights, adapt)]
    return F.cross_entropy(net(xq, fast_weights), _C12_YQ)


def _c12_build(bug: bool) -> Case:
    """OML-style meta-training step: inner-loop adaptation of the head, meta-update of all weights on the query."""
    torch.manual_seed(0)
    net = _OMLNet().train()
    meta_opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    step = _train_step(meta_opt, lambda: _c12_meta_loss(net, bug))
    return net, step, _kw(optimizer=meta_opt, inputs=_C12_XQ)


def _c12_proof(bug: bool) -> bool:
    """The meta-gradient of the representation weights disagrees with the finite-difference derivative of the
    meta-loss (inner loop included), in float64: the second-order term through the adaptation is missing."""
    torch.manual_seed(0)
    net = _OMLNet().double()
    net.zero_grad()
    _c12_meta_loss(net, bug, torch.float64).backward()
    grad = net.rln.weight.grad.detach().clone()
    d = torch.randn(net.rln.weight.shape, generator=_gen(1205), dtype=torch.float64)
    eps = 1e-5
    base = net.rln.weight.detach().clone()
    vals = []
    for s in (1.0, -1.0):
        with torch.no_grad():
            net.rln.weight.copy_(base + s * eps * d)
        vals.append(float(_c12_meta_loss(net, False, torch.float64).detach()))
    fd = (vals[0] - vals[1]) / (2 * eps)
    analytic = float((grad * d).sum())
    return abs(analytic - fd) > 1e-3 * max(1.0, abs(fd))


# --------------------------------------------------------------------------------------------- case-13
# Dueling double DQN in PyTorch: ``learn()`` builds ``q_target = rewards + gamma * q_next[indices, max_actions]``
# and only afterwards runs ``q_next[dones] = 0.0``, so the terminal mask never reaches the target: terminal
# transitions are bootstrapped from the next state's value as if the episode went on. Fix (thread): put
# ``q_next[dones] = 0.0`` before ``q_target`` is calculated.


class _DuelingQNet(nn.Module):
    def __init__(self, n_actions: int = 3, in_dim: int = 5, hidden: int = 32) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_dim, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.V = nn.Linear(hidden, 1)
        self.A = nn.Linear(hidden, n_actions)

    def forward(self, state: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.fc2(torch.relu(self.fc1(state))))
        a = self.A(x)
        return self.V(x) + (a - a.mean(dim=1, keepdim=True))


_C13_S = torch.randn(16, 5, generator=_gen(1301))
_C13_A = torch.randint(0, 3, (16,), generator=_gen(1302))
_C13_R = torch.randn(16, generator=_gen(1303))
_C13_S2 = torch.randn(16, 5, generator=_gen(1304))
_C13_DONE = torch.rand(16, generator=_gen(1305)) < 0.4
_C13_GAMMA = 0.99


def _c13_agent(bug: bool) -> tuple[_DuelingQNet, torch.optim.Optimizer, Callable[[], torch.Tensor], dict[str, Any]]:
    torch.manual_seed(0)
    q_eval = _DuelingQNet().train()
    torch.manual_seed(1)
    q_next_net = _DuelingQNet().train()
    q_next_net.load_state_dict(q_eval.state_dict())
    opt = torch.optim.Adam(q_eval.parameters(), lr=3e-4)
    crit = nn.MSELoss()
    seen: dict[str, Any] = {}
    indices = torch.arange(16)

    def learn() -> torch.Tensor:
        q_pred = q_eval(_C13_S)[indices, _C13_A]
        q_next = q_next_net(_C13_S2)
        max_actions = torch.argmax(q_eval(_C13_S2), dim=1)
        if not bug:
            q_next[_C13_DONE] = 0.0
        q_target = _C13_R + _C13_GAMMA * q_next[indices, max_actions]
        if bug:
            q_next[_C13_DONE] = 0.0
        seen["q_target"] = q_target.detach().clone()
        opt.zero_grad()
        loss = crit(q_target, q_pred)
        loss.backward()
        opt.step()
        return loss

    return q_eval, opt, learn, seen


def _c13_build(bug: bool) -> Case:
    """Dueling double-DQN learn() step on a replay batch with terminal transitions masked via q_next[dones]."""
    q_eval, opt, learn, _ = _c13_agent(bug)
    return q_eval, learn, _kw(optimizer=opt, inputs=_C13_S)


def _c13_proof(bug: bool) -> bool:
    """The TD targets of terminal transitions are not their rewards: they still carry gamma * Q(s', a')."""
    _, _, learn, seen = _c13_agent(bug)
    learn()
    terminal = seen["q_target"][_C13_DONE]
    return bool(_C13_DONE.any()) and not torch.allclose(terminal, _C13_R[_C13_DONE])


# --------------------------------------------------------------------------------------------- case-14
# PyG's DeepGCNLayer with the 'res' / 'dense' / 'plain' blocks computes ``h = self.conv(x, ...)`` and then
# ``h = self.norm(x)``: the normalisation is applied to the layer input, so the graph convolution's output is
# thrown away and its weights never get a gradient; the "deep GCN" is a stack of norm+ReLU residuals. Fix
# (thread, applied by the maintainer): ``h = self.norm(h)``.


class _GCNConv(nn.Module):
    """Symmetric-normalised GCN convolution over an edge list (self-loops added)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim, bias=False)
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        loops = torch.arange(n)
        src = torch.cat([edge_index[0], loops])
        dst = torch.cat([edge_index[1], loops])
        deg = torch.zeros(n).index_add_(0, dst, torch.ones(dst.shape[0]))
        norm = deg[src].rsqrt() * deg[dst].rsqrt()
        h = self.lin(x)
        out = torch.zeros_like(h).index_add_(0, dst, h[src] * norm[:, None])
        return out + self.bias


class _DeepGCNLayer(nn.Module):
    def __init__(self, conv: nn.Module, norm: nn.Module, act: nn.Module, bug: bool, block: str = "res") -> None:
        super().__init__()
        self.conv, self.norm, self.act, self.block, self.bug = conv, norm, act, block, bug

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        h = self.conv(x, edge_index)
        h = self.norm(x) if self.bug else self.norm(h)
        h = self.act(h)
        return x + h


class _DeeperGCN(nn.Module):
    def __init__(self, bug: bool, in_dim: int = 8, dim: int = 16, n_cls: int = 3, layers: int = 3) -> None:
        super().__init__()
        self.enc = nn.Linear(in_dim, dim)
        self.layers = nn.ModuleList([_DeepGCNLayer(_GCNConv(dim), nn.LayerNorm(dim), nn.ReLU(), bug)
                                     for _ in range(layers)])
        self.head = nn.Linear(dim, n_cls)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        h = self.enc(x)
        for layer in self.layers:
            h = layer(h, edge_index)
        return self.head(h)


def _c14_graph() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = _gen(1401)
    x = torch.randn(20, 8, generator=g)
    src = torch.randint(0, 20, (40,), generator=g)
    dst = torch.randint(0, 20, (40,), generator=g)
    keep = src != dst
    edge_index = torch.stack([torch.cat([src[keep], dst[keep]]), torch.cat([dst[keep], src[keep]])])
    y = torch.randint(0, 3, (20,), generator=g)
    return x, edge_index, y


_C14_X, _C14_EI, _C14_Y = _c14_graph()


def _c14_build(bug: bool) -> Case:
    """Node classification with a residual DeepGCN stack (block='res': conv -> norm -> act -> res)."""
    torch.manual_seed(0)
    model = _DeeperGCN(bug).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    step = _train_step(opt, lambda: F.cross_entropy(model(_C14_X, _C14_EI), _C14_Y))
    return model, step, _kw(optimizer=opt, inputs=(_C14_X, _C14_EI))


def _c14_proof(bug: bool) -> bool:
    """After a training step no graph-convolution weight has a gradient and none has moved."""
    model, step, _ = _c14_build(bug)
    before = [p.detach().clone() for layer in model.layers for p in layer.conv.parameters()]
    step()
    convs = [p for layer in model.layers for p in layer.conv.parameters()]
    no_grad = all(p.grad is None or float(p.grad.abs().sum()) == 0.0 for p in convs)
    return no_grad and all(torch.equal(a, p.detach()) for a, p in zip(before, convs))


# --------------------------------------------------------------------------------------------- case-15
# Probabilistic forecasting notebook: the target column is shifted forward (``shift(1)``) instead of backward,
# so each label is the *previous* value of the series, which already sits in the input window: the model learns
# to copy an input ("predict the past") and the training loss looks excellent. Fix (thread, acknowledged and
# fixed by the author): shift the target the other way (``shift(-1)``) so the label is the next, unseen value.

_C15_W = 8


def _c15_dataset(bug: bool) -> tuple[torch.Tensor, torch.Tensor]:
    series = torch.cumsum(torch.randn(80, generator=_gen(1501)), 0) * 0.1
    xs, ys = [], []
    for t in range(_C15_W, len(series) - 1):
        xs.append(series[t - _C15_W + 1:t + 1])  # features: the window ending at t
        ys.append(series[t - 1] if bug else series[t + 1])  # label: shift(1) vs shift(-1) of the target
    return torch.stack(xs)[:, :, None], torch.stack(ys)[:, None]


class _GRUForecaster(nn.Module):
    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.gru = nn.GRU(1, hidden, batch_first=True)
        self.out = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.gru(x)
        return self.out(h[:, -1])


def _c15_build(bug: bool) -> Case:
    """One-step-ahead GRU forecaster trained with MSE on sliding windows of a random-walk series."""
    x, y = _c15_dataset(bug)
    torch.manual_seed(0)
    model = _GRUForecaster().train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    step = _train_step(opt, lambda: F.mse_loss(model(x), y))
    return model, step, _kw(optimizer=opt, inputs=x)


def _c15_proof(bug: bool) -> bool:
    """Every label is exactly one of the values in its own input window (the label leaks into the features)."""
    x, y = _c15_dataset(bug)
    in_window = (x[:, :, 0] == y).any(dim=1)
    return bool(in_window.all())


CASES: list[BlindCase] = [
    BlindCase("b20-case-11", "https://github.com/ContinualAI/avalanche/issues/1099", "continual learning / EWC",
              "The EWC penalty slices the saved parameter instead of the current one, so it is identically zero and "
              "the second experience is trained as plain fine-tuning.", _c11_build, _c11_proof,
              known_miss="the EWC penalty is identically zero (it slices the saved parameter): a zero term added to the loss looks like a total that starts from zero"),
    BlindCase("b20-case-12", "https://github.com/kjaved0/mrcl/issues/15", "meta-learning / second-order gradient",
              "The inner-loop gradients are taken without create_graph, so the meta-gradient misses the term "
              "through the adaptation and is only first-order.", _c12_build, _c12_proof,
              known_miss="inner-loop gradients without create_graph give a first-order meta-gradient: the order of the meta-gradient is not measured"),
    BlindCase("b20-case-13", "https://github.com/awill139/d3qn_pytorch/issues/1", "RL / terminal masking",
              "The terminal mask is applied to q_next after the TD target was built, so terminal transitions are "
              "bootstrapped from the next state.", _c13_build, _c13_proof,
              known_miss="the terminal mask is applied after the TD target was built: arithmetic of the target, whose gradient has the usual shape"),
    BlindCase("b20-case-14", "https://github.com/pyg-team/pytorch_geometric/issues/1561", "GNN / discarded layer output",
              "The residual DeepGCN block normalises its input instead of the convolution output, so every graph "
              "convolution is dead weight with no gradient.", _c14_build, _c14_proof,
              known_miss="the convolutions' outputs are computed and discarded: a user's module whose output the loss "
                         "does not read is an unused part (INFO) by design; the earlier FAIL came from value-read "
                         "runs that did not start from the same weights (round 13)"),
    BlindCase("b20-case-15", "https://github.com/KIC/pandas-ml-quant/issues/25", "time series / label leakage",
              "The target is shifted the wrong way, so each label is a past value already in the input window and "
              "the forecaster learns to copy it.", _c15_build, _c15_proof),
]
