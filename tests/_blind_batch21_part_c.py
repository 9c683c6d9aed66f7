"""Blind batch 21 (part c): silent training bugs from public threads in scientific and structured-data deep
learning (reinforcement learning, tabular regression, mixed precision on a weather-style model, molecular
force fields), each with its fixed twin."""

from __future__ import annotations

import copy
import math
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw, _sgd_step

# --------------------------------------------------------------------------------------------- case-11
# tambetm/gym-minecraft issue #4: a DQN example keeps a target network, soft-updates its weights with tau at
# every step, but computes the bootstrap values qpost with the online model instead of target_model, so the
# target network is never used (tuning tau did nothing). Fix: qpost = target_model.predict(poststates).


class _QNet(nn.Module):
    def __init__(self, obs: int = 6, n_act: int = 3) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(obs, 32), nn.ReLU(), nn.Linear(32, n_act))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


_C11_PRE = torch.randn(16, 6, generator=_gen(1101))
_C11_POST = torch.randn(16, 6, generator=_gen(1102))
_C11_ACT = torch.randint(0, 3, (16,), generator=_gen(1103))
_C11_REW = torch.randn(16, generator=_gen(1104))
_C11_DONE = (torch.rand(16, generator=_gen(1105)) < 0.2).float()
_C11_GAMMA, _C11_TAU = 0.99, 0.01


class _C11Agent:
    def __init__(self, bug: bool) -> None:
        torch.manual_seed(0)
        self.bug = bug
        self.model = _QNet().train()
        self.target_model = copy.deepcopy(self.model)
        self.target_model.requires_grad_(False)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-2)
        self.last_target = torch.zeros(16)

    def step(self) -> torch.Tensor:
        with torch.no_grad():
            qpost = (self.model if self.bug else self.target_model)(_C11_POST)
            y = _C11_REW + _C11_GAMMA * (1 - _C11_DONE) * qpost.max(1).values
        self.last_target = y
        self.opt.zero_grad()
        q = self.model(_C11_PRE).gather(1, _C11_ACT[:, None]).squeeze(1)
        loss = F.mse_loss(q, y)
        loss.backward()
        self.opt.step()
        with torch.no_grad():
            for t, s in zip(self.target_model.parameters(), self.model.parameters()):
                t.mul_(1 - _C11_TAU).add_(_C11_TAU * s)
        return loss


def _c11_build(bug: bool) -> Case:
    """DQN update with a soft-updated target network; the bootstrap value comes from the online net."""
    agent = _C11Agent(bug)
    return agent.model, agent.step, _kw(optimizer=agent.opt, inputs=_C11_PRE)


def _c11_proof(bug: bool) -> bool:
    """After a few updates (online and target nets now differ) the TD target used in the step does not equal
    r + gamma * max_a Q_target(s', a)."""
    agent = _C11Agent(bug)
    for _ in range(3):
        agent.step()
    with torch.no_grad():
        expected = _C11_REW + _C11_GAMMA * (1 - _C11_DONE) * agent.target_model(_C11_POST).max(1).values
    agent.step()
    return float((agent.last_target - expected).abs().max()) > 1e-6


# --------------------------------------------------------------------------------------------- case-12
# LAMDA-Tabular/TALENT pull request #92: the tabular regression loss calls F.mse_loss on a prediction of shape
# (n, 1) and a target of shape (n,); broadcasting makes an (n, n) matrix, so the model minimises the distance
# between every prediction and every target and converges to predicting the mean. Fix: reshape so both are (n,).

_C12_X = torch.randn(64, 8, generator=_gen(1201))
_C12_Y = _C12_X @ torch.randn(8, generator=_gen(1202)) + 0.05 * torch.randn(64, generator=_gen(1203))


def _c12_loss(model: nn.Module, bug: bool) -> torch.Tensor:
    pred = model(_C12_X)
    if not bug:
        pred = pred.view_as(_C12_Y)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return F.mse_loss(pred, _C12_Y)


def _c12_build(bug: bool) -> Case:
    """Tabular MLP regressor whose (n, 1) output meets an (n,) target in F.mse_loss."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1)).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    step = _sgd_step(model, opt, lambda: _c12_loss(model, bug))
    return model, step, _kw(optimizer=opt, inputs=_C12_X)


def _c12_proof(bug: bool) -> bool:
    """After 150 steps the per-sample error is still about the target variance (the model predicts the mean)."""
    model, step, _ = _c12_build(bug)
    for _ in range(150):
        step()
    with torch.no_grad():
        err = float(((model(_C12_X).squeeze(-1) - _C12_Y) ** 2).mean())
    return err > 0.5 * float(_C12_Y.var())


# --------------------------------------------------------------------------------------------- case-13
# tensorflow/agents issue #651: PPO trained on a batch holding one episode ([1, T] advantages) does not learn:
# the advantages are normalised with moments over axis 0 only (the batch axis of size one), which makes every
# normalised advantage exactly zero, so the actor gets no gradient. Fix: normalise over axes (0, 1).

_C13_OBS = torch.randn(1, 20, 5, generator=_gen(1301))
_C13_ACT = torch.randint(0, 4, (1, 20), generator=_gen(1302))
_C13_RET = torch.randn(1, 20, generator=_gen(1303)).cumsum(1)


class _ActorCritic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.actor = nn.Sequential(nn.Linear(5, 32), nn.Tanh(), nn.Linear(32, 4))
        self.critic = nn.Sequential(nn.Linear(5, 32), nn.Tanh(), nn.Linear(32, 1))

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.actor(obs), self.critic(obs).squeeze(-1)


def _c13_loss(model: _ActorCritic, old_logp: torch.Tensor, bug: bool) -> torch.Tensor:
    logits, values = model(_C13_OBS)
    logp = torch.log_softmax(logits, -1).gather(-1, _C13_ACT[..., None]).squeeze(-1)
    adv = (_C13_RET - values).detach()
    dims = (0,) if bug else (0, 1)
    mean = adv.mean(dim=dims, keepdim=True)
    var = adv.var(dim=dims, unbiased=False, keepdim=True)
    adv = (adv - mean) / torch.sqrt(var + 1e-8)
    ratio = torch.exp(logp - old_logp)
    pg = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv).mean()
    return pg + 0.5 * F.mse_loss(values, _C13_RET)


def _c13_build(bug: bool) -> Case:
    """PPO actor-critic update on one episode with advantages normalised over the batch axis only."""
    torch.manual_seed(0)
    model = _ActorCritic().train()
    with torch.no_grad():
        old_logp = torch.log_softmax(model(_C13_OBS)[0], -1).gather(-1, _C13_ACT[..., None]).squeeze(-1)
    opt = torch.optim.Adam(model.parameters(), lr=3e-4)
    step = _sgd_step(model, opt, lambda: _c13_loss(model, old_logp, bug))
    return model, step, _kw(optimizer=opt, inputs=_C13_OBS)


def _c13_proof(bug: bool) -> bool:
    """After one update the actor's parameters have exactly zero gradient (only the critic learns)."""
    model, step, _ = _c13_build(bug)
    step()
    return all(p.grad is None or float(p.grad.abs().sum()) == 0.0 for p in model.actor.parameters())


# --------------------------------------------------------------------------------------------- case-14
# NCAR/miles-credit pull request #141: the weather-model trainer uses a GradScaler and clips the gradient norm
# on the still-scaled gradients (no scaler.unscale_ before clip_grad_norm_), so the clip acts on gradients
# 65536x too large and after the scaler unscales them the update is about 65536x too small.
# Fix: scaler.unscale_(optimizer) before clipping.


class _TinyWeatherNet(nn.Module):
    """Gridded fields (channels x lat x lon) to the next step's fields through a small conv net."""

    def __init__(self, ch: int = 3) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(ch, 16, 3, padding=1), nn.GELU(), nn.Conv2d(16, ch, 3, padding=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.net(x)


_C14_X = torch.randn(4, 3, 8, 16, generator=_gen(1401))
_C14_Y = _C14_X.roll(1, -1) + 0.1 * torch.randn(4, 3, 8, 16, generator=_gen(1402))


def _c14_build(bug: bool) -> Case:
    """Mixed-precision step with GradScaler that clips the gradient norm before unscaling."""
    torch.manual_seed(0)
    model = _TinyWeatherNet().train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")

    def step() -> torch.Tensor:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.mse_loss(model(_C14_X).float(), _C14_Y)
        scaler.scale(loss).backward()
        if not bug:
            scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        return loss

    return model, step, _kw(optimizer=opt, inputs=_C14_X)


def _c14_proof(bug: bool) -> bool:
    """The parameter update of one step is far below lr * min(true grad norm, clip) (what clipping allows)."""
    model, step, _ = _c14_build(bug)
    ref = copy.deepcopy(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        F.mse_loss(ref(_C14_X).float(), _C14_Y).backward()
    gnorm = float(torch.sqrt(sum((p.grad.float() ** 2).sum() for p in ref.parameters())))
    before = [p.detach().clone() for p in model.parameters()]
    step()
    moved = float(torch.sqrt(sum(((p.detach() - b) ** 2).sum() for p, b in zip(model.parameters(), before))))
    return moved < 0.01 * 0.1 * min(gnorm, 1.0)


# --------------------------------------------------------------------------------------------- case-15
# torchmd/torchmd-net pull request #13: the GraphNormMSE force loss for batched molecules is meant to divide
# each molecule's squared force error by its number of atoms, but multiplied by the graph size instead, so
# large molecules dominate the loss by n^2 and the loss is not the per-atom MSE. Fix: divide by the size.

_C15_SIZES = torch.tensor([3, 5, 12, 20])
_C15_BATCH = torch.repeat_interleave(torch.arange(4), _C15_SIZES)
_C15_N = int(_C15_SIZES.sum())
_C15_Z = torch.randint(0, 5, (_C15_N,), generator=_gen(1501))
_C15_POS = torch.randn(_C15_N, 3, generator=_gen(1502))
_C15_F = torch.randn(_C15_N, 3, generator=_gen(1503))


class _AtomForceNet(nn.Module):
    """Per-atom energy from element embedding and position; forces as -dE/dpos."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(5, 16)
        self.mlp = nn.Sequential(nn.Linear(19, 32), nn.SiLU(), nn.Linear(32, 1))

    def forward(self, z: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        pos = pos.detach().requires_grad_(True)
        energy = self.mlp(torch.cat([self.emb(z), pos], -1)).sum()
        return -torch.autograd.grad(energy, pos, create_graph=True)[0]


def _graph_norm_mse(pred: torch.Tensor, target: torch.Tensor, bug: bool) -> torch.Tensor:
    sq = ((pred - target) ** 2).sum(-1)
    per_graph = torch.zeros(4).index_add(0, _C15_BATCH, sq)
    sizes = _C15_SIZES.float()
    per_graph = per_graph * sizes if bug else per_graph / sizes
    return per_graph.mean()


def _c15_build(bug: bool) -> Case:
    """Force-field training on a batch of molecules with a graph-size-normalised force MSE."""
    torch.manual_seed(0)
    model = _AtomForceNet().train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    step = _sgd_step(model, opt, lambda: _graph_norm_mse(model(_C15_Z, _C15_POS), _C15_F, bug))
    return model, step, _kw(optimizer=opt, inputs=(_C15_Z, _C15_POS))


def _c15_proof(bug: bool) -> bool:
    """The step's loss is not the mean over molecules of the per-atom squared force error."""
    model, step, _ = _c15_build(bug)
    pred = model(_C15_Z, _C15_POS).detach()
    sq = ((pred - _C15_F) ** 2).sum(-1)
    expected = torch.stack([sq[_C15_BATCH == g].mean() for g in range(4)]).mean()
    loss = step().item()
    return abs(loss - float(expected)) > 1e-3 * float(expected)


CASES: list[BlindCase] = [
    BlindCase("b21-case-11", "https://github.com/tambetm/gym-minecraft/issues/4", "RL target network unused",
              "The DQN bootstrap values come from the online network, so the soft-updated target network is "
              "never used and the TD target chases itself.", _c11_build, _c11_proof,
              known_miss="the DQN bootstrap uses the online network: the target network lives outside the audited model and the step"),
    BlindCase("b21-case-12", "https://github.com/LAMDA-Tabular/TALENT/pull/92", "loss shape broadcasting",
              "An (n, 1) prediction against an (n,) target broadcasts the MSE to an (n, n) matrix, so the "
              "regressor learns to predict the mean.", _c12_build, _c12_proof),
    BlindCase("b21-case-13", "https://github.com/tensorflow/agents/issues/651", "advantage normalisation axis",
              "Advantages of a one-episode batch are normalised over the batch axis of size one, which zeroes "
              "them all, so the PPO actor never gets a gradient.", _c13_build, _c13_proof),
    BlindCase("b21-case-14", "https://github.com/NCAR/miles-credit/pull/141", "mixed precision clipping order",
              "Gradient-norm clipping runs on GradScaler-scaled gradients, so after unscaling every update is "
              "thousands of times smaller than intended.", _c14_build, _c14_proof),
    BlindCase("b21-case-15", "https://github.com/torchmd/torchmd-net/pull/13", "loss normalisation by graph size",
              "The per-molecule force error is multiplied by the atom count instead of divided by it, so large "
              "molecules dominate the force loss by n squared.", _c15_build, _c15_proof,
              known_miss="the force error is weighted by the atom count instead of divided: per-graph loss weights inside the loss arithmetic are not measured"),
]
