"""Blind batch 37 (part c): silent training bugs outside language modelling, from public GitHub threads.

Collected by someone who does not write the audit's checks. Each case rebuilds the user's setup on tiny plain torch
modules (a tabular WGAN-GP, a DDPG agent, an item-based AutoRec recommender, a 3D-CNN pose scorer for docking and a
fully connected VAE), with the bug and with the thread's fix, and proves the bug without the audit on real tensors and
real steps. Nothing is downloaded.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw

# --------------------------------------------------------------------------------------------- case-01
# sdv-dev/CTGAN issue #158 (fixed in PR #160): in CTGANSynthesizer.fit, the discriminator step builds its fake input
# with `fake_cat = torch.cat([fakeact, c1], dim=1)` when there is a conditional vector, but in the other branch (a table
# with no discrete column, so no conditional vector) it wrote `fake_cat = fake`: the raw generator output, before the
# tanh / gumbel-softmax activations that turn it into a row of the transformed table. So the critic (and its gradient
# penalty) is trained to tell activated real rows from *unactivated* fake rows, while the generator step feeds it
# activated rows. Nothing fails: both losses move and samples come out; the critic just learns the wrong contrast (the
# maintainer: "It actually improves performance quite a bit"). Fix: `fake_cat = fakeact`.

_C01_SPANS = [(1, "tanh"), (3, "softmax"), (1, "tanh"), (3, "softmax")]  # two continuous columns, 3 modes each
_C01_DIM = sum(d for d, _ in _C01_SPANS)
_C01_EMB, _C01_BATCH, _C01_PAC = 8, 20, 10


def _c01_real_rows() -> torch.Tensor:
    g = _gen(3701)
    cols = []
    for d, kind in _C01_SPANS:
        if kind == "tanh":
            cols.append(torch.rand(64, 1, generator=g) * 1.8 - 0.9)
        else:
            cols.append(F.one_hot(torch.randint(0, d, (64,), generator=g), d).float())
    return torch.cat(cols, dim=1)


_C01_DATA = _c01_real_rows()


class _Residual(nn.Module):
    def __init__(self, i: int, o: int) -> None:
        super().__init__()
        self.fc = nn.Linear(i, o)
        self.bn = nn.BatchNorm1d(o)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([F.relu(self.bn(self.fc(x))), x], dim=1)


class _Generator(nn.Module):
    def __init__(self, emb: int, dims: tuple[int, ...], data_dim: int) -> None:
        super().__init__()
        seq: list[nn.Module] = []
        d = emb
        for item in dims:
            seq.append(_Residual(d, item))
            d += item
        seq.append(nn.Linear(d, data_dim))
        self.seq = nn.Sequential(*seq)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.seq(z)


class _Discriminator(nn.Module):
    def __init__(self, input_dim: int, dims: tuple[int, ...], pac: int) -> None:
        super().__init__()
        self.pac, self.pacdim = pac, input_dim * pac
        seq: list[nn.Module] = []
        d = self.pacdim
        for item in dims:
            seq += [nn.Linear(d, item), nn.LeakyReLU(0.2), nn.Dropout(0.5)]
            d = item
        seq.append(nn.Linear(d, 1))
        self.seq = nn.Sequential(*seq)

    def calc_gradient_penalty(self, real: torch.Tensor, fake: torch.Tensor, lambda_: float = 10.0) -> torch.Tensor:
        alpha = torch.rand(real.size(0) // self.pac, 1, 1).repeat(1, self.pac, real.size(1)).view(-1, real.size(1))
        inter = alpha * real + (1 - alpha) * fake
        out = self(inter)
        grads = torch.autograd.grad(out, inter, torch.ones_like(out), create_graph=True, retain_graph=True)[0]
        return ((grads.view(-1, self.pac * real.size(1)).norm(2, dim=1) - 1) ** 2).mean() * lambda_

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.seq(x.view(-1, self.pacdim))


class _CTGAN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.generator = _Generator(_C01_EMB, (16, 16), _C01_DIM)
        self.discriminator = _Discriminator(_C01_DIM, (16, 16), _C01_PAC)


def _c01_activate(data: torch.Tensor) -> torch.Tensor:
    out, st = [], 0
    for d, kind in _C01_SPANS:
        span = data[:, st:st + d]
        out.append(torch.tanh(span) if kind == "tanh" else F.gumbel_softmax(span, tau=0.2))
        st += d
    return torch.cat(out, dim=1)


def _c01_setup(bug: bool):
    torch.manual_seed(0)
    model = _CTGAN().train()
    gen, disc = model.generator, model.discriminator
    opt_g = torch.optim.Adam(gen.parameters(), lr=2e-4, betas=(0.5, 0.9), weight_decay=1e-6)
    opt_d = torch.optim.Adam(disc.parameters(), lr=2e-4, betas=(0.5, 0.9), weight_decay=1e-6)
    rows = _gen(3702)
    mean = torch.zeros(_C01_BATCH, _C01_EMB)
    std = mean + 1

    def step() -> torch.Tensor:
        # discriminator step (no discrete column: condvec is None)
        fakez = torch.normal(mean=mean, std=std)
        real = _C01_DATA[torch.randint(0, _C01_DATA.size(0), (_C01_BATCH,), generator=rows)]
        fake = gen(fakez)
        fakeact = _c01_activate(fake)
        real_cat = real
        fake_cat = fake if bug else fakeact
        y_fake = disc(fake_cat)
        y_real = disc(real_cat)
        pen = disc.calc_gradient_penalty(real_cat, fake_cat)
        loss_d = -(torch.mean(y_real) - torch.mean(y_fake))
        opt_d.zero_grad()
        pen.backward(retain_graph=True)
        loss_d.backward()
        opt_d.step()
        # generator step
        fakez = torch.normal(mean=mean, std=std)
        fakeact = _c01_activate(gen(fakez))
        loss_g = -torch.mean(disc(fakeact))
        opt_g.zero_grad()
        loss_g.backward()
        opt_g.step()
        return loss_d.detach()

    return model, opt_d, step


def _c01_build(bug: bool) -> Case:
    model, opt_d, step = _c01_setup(bug)
    return model, step, _kw(optimizer=opt_d, inputs={"x": _C01_DATA[:_C01_BATCH]})


def _c01_proof(bug: bool) -> bool:
    """Is the first batch the critic is trained on as 'fake' not a table row (its mode spans do not sum to one)?"""
    model, _, step = _c01_setup(bug)
    seen: list[torch.Tensor] = []
    handle = model.discriminator.register_forward_pre_hook(lambda _m, args: seen.append(args[0].detach().clone()))
    step()
    handle.remove()
    fake_in, st, off = seen[0], 0, False
    for d, kind in _C01_SPANS:
        if kind == "softmax":
            off |= not torch.allclose(fake_in[:, st:st + d].sum(-1), torch.ones(fake_in.size(0)), atol=1e-4)
        st += d
    return bool(off)


# --------------------------------------------------------------------------------------------- case-02
# kakaoenterprise/JORLDY issue #120 ("Missing to update target_actor of DDPG", labelled bug, closed): the DDPG agent's
# update_target_soft() Polyak-averaged only the target critic (`for t_p, p in zip(self.target_critic.parameters(),
# self.critic.parameters())`). The target actor, which picks next_action in the critic's TD target, stays at its
# initial weights forever. Training runs: the actor learns, the critic loss falls, but every TD target is computed with
# the untrained initial policy. Fix (in the repository's ddpg.py afterwards): a second loop soft-updates target_actor
# from actor with the same tau.

_C02_S, _C02_A, _C02_H, _C02_N = 3, 1, 16, 32
_C02_STATE = torch.randn(_C02_N, _C02_S, generator=_gen(3711))
_C02_ACTION = torch.rand(_C02_N, _C02_A, generator=_gen(3712)) * 2 - 1
_C02_REWARD = torch.randn(_C02_N, 1, generator=_gen(3713))
_C02_NEXT = torch.randn(_C02_N, _C02_S, generator=_gen(3714))
_C02_DONE = (torch.rand(_C02_N, 1, generator=_gen(3715)) < 0.1).float()


class _Actor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2, self.mu = nn.Linear(_C02_S, _C02_H), nn.Linear(_C02_H, _C02_H), nn.Linear(_C02_H, _C02_A)

    def forward(self, s: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.mu(F.relu(self.l2(F.relu(self.l1(s))))))


class _Critic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2, self.q = nn.Linear(_C02_S + _C02_A, _C02_H), nn.Linear(_C02_H, _C02_H), nn.Linear(_C02_H, 1)

    def forward(self, s: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        return self.q(F.relu(self.l2(F.relu(self.l1(torch.cat([s, a], dim=-1))))))


class _DDPG(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.actor, self.critic = _Actor(), _Critic()
        self.target_actor, self.target_critic = _Actor(), _Critic()
        self.target_actor.load_state_dict(self.actor.state_dict())
        self.target_critic.load_state_dict(self.critic.state_dict())


def _c02_setup(bug: bool):
    torch.manual_seed(0)
    agent = _DDPG()
    actor_opt = torch.optim.Adam(agent.actor.parameters(), lr=5e-4)
    critic_opt = torch.optim.Adam(agent.critic.parameters(), lr=1e-3)
    gamma, tau, run_step = 0.99, 1e-3, 1e6
    idx_gen = _gen(3716)
    state = {"step": 0}

    def update_target_soft() -> None:
        for t_p, p in zip(agent.target_critic.parameters(), agent.critic.parameters()):
            t_p.data.copy_(tau * p.data + (1 - tau) * t_p.data)
        if not bug:
            for t_p, p in zip(agent.target_actor.parameters(), agent.actor.parameters()):
                t_p.data.copy_(tau * p.data + (1 - tau) * t_p.data)

    def step() -> torch.Tensor:
        state["step"] += 1
        idx = torch.randint(0, _C02_N, (16,), generator=idx_gen)
        s, a, r, s2, d = _C02_STATE[idx], _C02_ACTION[idx], _C02_REWARD[idx], _C02_NEXT[idx], _C02_DONE[idx]
        with torch.no_grad():
            next_q = agent.target_critic(s2, agent.target_actor(s2))
            target_q = r + (1 - d) * gamma * next_q
        critic_loss = F.mse_loss(target_q, agent.critic(s, a))
        critic_opt.zero_grad()
        critic_loss.backward()
        critic_opt.step()
        actor_loss = -agent.critic(s, agent.actor(s)).mean()
        actor_opt.zero_grad()
        actor_loss.backward()
        actor_opt.step()
        weight = float(torch.cos(torch.tensor(torch.pi / 2 * state["step"] / run_step)))  # learning_rate_decay
        for opt in (actor_opt, critic_opt):
            for g in opt.param_groups:
                g["lr"] = opt.defaults["lr"] * weight
        update_target_soft()
        return critic_loss.detach()

    return agent, actor_opt, step


def _c02_build(bug: bool) -> Case:
    agent, actor_opt, step = _c02_setup(bug)
    return agent, step, _kw(optimizer=actor_opt, inputs={"state": _C02_STATE})


def _c02_proof(bug: bool) -> bool:
    """After three learning steps the actor has moved; is the target actor still bit-identical to its start?"""
    agent, _, step = _c02_setup(bug)
    before = [p.detach().clone() for p in agent.target_actor.parameters()]
    actor_before = [p.detach().clone() for p in agent.actor.parameters()]
    for _ in range(3):
        step()
    actor_moved = any(not torch.equal(p, b) for p, b in zip(agent.actor.parameters(), actor_before))
    frozen = all(torch.equal(p, b) for p, b in zip(agent.target_actor.parameters(), before))
    return bool(actor_moved and frozen)


# --------------------------------------------------------------------------------------------- case-03
# berkeley-reclab/RecLab PR #150 ("Fix autorec ..."): the item-based AutoRec loss added its L2 penalty as
# `lambda/2 * ||list(self.encoder.parameters())[1]||_F^2` (and the same for the decoder). For nn.Linear, parameters()
# yields weight then bias, so index [1] is the *bias*: the weight matrices the AutoRec objective regularizes were never
# penalized, only the two bias vectors were. Training converges and ratings come out; the model is just unregularized
# where it matters. The PR description: "Regularization now penalizes weight matrices, not biases. Whoops"; fix: index
# [0]. (The PR also switched the reconstruction term to a sum; only the regularizer fix differs between the sides
# here. RecLab's loop of the time never zeroed gradients; that is a separate defect, so both sides zero them.)

_C03_USERS, _C03_ITEMS, _C03_HIDDEN = 12, 10, 8


def _c03_ratings() -> torch.Tensor:
    g = _gen(3721)
    r = torch.randint(1, 6, (_C03_ITEMS, _C03_USERS), generator=g).float()
    return r * (torch.rand(_C03_ITEMS, _C03_USERS, generator=g) < 0.4).float()  # rows are items (item-based)


_C03_R = _c03_ratings()
_C03_MASK = _C03_R.clamp(0, 1)


class _AutoRec(nn.Module):
    def __init__(self, reg_index: int) -> None:
        super().__init__()
        self.reg_index = reg_index
        self.encoder = nn.Linear(_C03_USERS, _C03_HIDDEN, bias=True)
        self.dropout = nn.Dropout(p=0.05)
        self.decoder = nn.Linear(_C03_HIDDEN, _C03_USERS, bias=True)

    def loss(self, pred: torch.Tensor, test: torch.Tensor, mask: torch.Tensor, lambda_value: float = 1.0):
        mse = nn.MSELoss()(pred * mask, test)
        reg_enc = lambda_value / 2 * torch.square(list(self.encoder.parameters())[self.reg_index].norm(p="fro"))
        reg_dec = lambda_value / 2 * torch.square(list(self.decoder.parameters())[self.reg_index].norm(p="fro"))
        return mse + reg_enc + reg_dec

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.dropout(torch.sigmoid(self.encoder(x))))


def _c03_setup(bug: bool):
    torch.manual_seed(0)
    model = _AutoRec(reg_index=1 if bug else 0).train()
    opt = torch.optim.RMSprop(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.99)
    perm_gen = _gen(3722)

    def step() -> torch.Tensor:
        idx = torch.randperm(_C03_ITEMS, generator=perm_gen)  # batch_size > num_items: one batch of all items
        batch, mask = _C03_R[idx], _C03_MASK[idx]
        opt.zero_grad()
        loss = model.loss(model(batch), batch, mask, lambda_value=1.0)
        loss.backward()
        opt.step()
        sched.step()
        return loss.detach()

    return model, opt, sched, step


def _c03_build(bug: bool) -> Case:
    model, opt, sched, step = _c03_setup(bug)
    return model, step, _kw(optimizer=opt, inputs={"x": _C03_R}, lr_scheduler=sched)


def _c03_proof(bug: bool) -> bool:
    """With a perfect reconstruction only the penalty is left: does it put no pull at all on the weight matrices?"""
    model, _, _, _ = _c03_setup(bug)
    perfect = _C03_R.clone()
    reg_only = model.loss(perfect, perfect, torch.ones_like(perfect))
    g_enc, g_dec = torch.autograd.grad(reg_only, [model.encoder.weight, model.decoder.weight], allow_unused=True)
    return bool(all(g is None or g.abs().max() == 0 for g in (g_enc, g_dec)))


# --------------------------------------------------------------------------------------------- case-04
# RMeli/gnina-torch PR #57 (merged as "bugfix: change LR scheduler mode=max to mode=min"): with --lr_dynamic, the
# training script builds `ReduceLROnPlateau(optimizer, mode="max", factor=lr_reduce, patience=lr_patience, ...)` and
# steps it at the end of each test interval with the *training loss* (pose loss, + affinity loss). In "max" mode the
# scheduler counts a falling loss as no improvement, so while the CNN is learning well the learning rate is cut by 10x
# every patience+1 intervals, down to lr_min; a loss that rises would keep the rate up. Nothing errors and the loss still
# falls, just ever more slowly. Fix: mode="min".

_C04_GRID = torch.rand(8, 4, 8, 8, 8, generator=_gen(3731))
_C04_LABELS = torch.randint(0, 2, (8,), generator=_gen(3732))
_C04_BASE_LR = 0.01


class _PoseCNN(nn.Module):
    """A tiny gnina-style 3D CNN: pool, conv, pool, conv, dense, log-softmax pose score."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv3d(4, 8, 3, padding=1), nn.ReLU(), nn.MaxPool3d(2),
            nn.Conv3d(8, 8, 3, padding=1), nn.ReLU(), nn.MaxPool3d(2),
        )
        self.pose = nn.Linear(8 * 2 * 2 * 2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(self.pose(self.features(x).flatten(1)), dim=1)


def _c04_setup(bug: bool):
    torch.manual_seed(0)
    model = _PoseCNN()
    opt = torch.optim.SGD(model.parameters(), lr=_C04_BASE_LR, momentum=0.9, weight_decay=0.001)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(
        opt, mode="max" if bug else "min", factor=0.1, patience=5, min_lr=0.01 * 0.1**3)
    pose_loss = nn.NLLLoss()

    def step() -> torch.Tensor:
        # one training iteration (_train_step_pose) ...
        model.train()
        opt.zero_grad()
        loss = pose_loss(model(_C04_GRID), _C04_LABELS)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 10.0)
        opt.step()
        # ... then the end of the test interval: evaluate the training loss and step the scheduler on it
        model.eval()
        with torch.no_grad():
            train_loss = pose_loss(model(_C04_GRID), _C04_LABELS)
        sched.step(float(train_loss))
        return loss.detach()

    return model, opt, sched, step


def _c04_build(bug: bool) -> Case:
    model, opt, sched, step = _c04_setup(bug)
    return model, step, _kw(optimizer=opt, inputs={"x": _C04_GRID}, lr_scheduler=sched)


def _c04_proof(bug: bool) -> bool:
    """Over ten intervals in which the training loss keeps falling, has the scheduler cut the learning rate?"""
    _, opt, _, step = _c04_setup(bug)
    losses = [float(step()) for _ in range(10)]
    falling = losses[-1] < losses[0]
    return bool(falling and opt.param_groups[0]["lr"] < _C04_BASE_LR)


# --------------------------------------------------------------------------------------------- case-05
# rasbt/deep-learning-book issue #59 (fixed in PR #60, "add KL component back to Var AE"): the PyTorch variational
# autoencoder notebook trained with `cost = torch.nn.BCELoss()(decoded, features)`, the reconstruction term alone; the
# Kullback-Leibler term of the ELBO had been lost when the training loop was copied from the plain autoencoder. The
# encoder still samples z = mu + eps * exp(log_var / 2) and the cost falls nicely, but nothing pulls q(z|x) toward the
# N(0, I) prior, so it is an autoencoder with noise, not a VAE. Fix: `cost = kl_divergence + pixelwise_bce` with
# kl = 0.5 * sum(mu^2 + exp(log_var) - log_var - 1) and a summed binary cross-entropy.

_C05_FEATURES, _C05_HIDDEN, _C05_LATENT = 16, 8, 3
_C05_X = torch.rand(8, _C05_FEATURES, generator=_gen(3741))


class _VAE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.hidden_1 = nn.Linear(_C05_FEATURES, _C05_HIDDEN)
        self.z_mean = nn.Linear(_C05_HIDDEN, _C05_LATENT)
        self.z_log_var = nn.Linear(_C05_HIDDEN, _C05_LATENT)
        self.linear_3 = nn.Linear(_C05_LATENT, _C05_HIDDEN)
        self.linear_4 = nn.Linear(_C05_HIDDEN, _C05_FEATURES)

    def reparameterize(self, z_mu: torch.Tensor, z_log_var: torch.Tensor) -> torch.Tensor:
        eps = torch.randn(z_mu.size(0), z_mu.size(1))
        return z_mu + eps * torch.exp(z_log_var / 2.0)

    def forward(self, x: torch.Tensor):
        h = F.relu(self.hidden_1(x))
        z_mean, z_log_var = self.z_mean(h), self.z_log_var(h)
        encoded = self.reparameterize(z_mean, z_log_var)
        decoded = torch.sigmoid(self.linear_4(F.relu(self.linear_3(encoded))))
        return z_mean, z_log_var, encoded, decoded


def _c05_cost(bug: bool, z_mean, z_log_var, decoded, features) -> torch.Tensor:
    if bug:
        return nn.BCELoss()(decoded, features)
    kl_divergence = (0.5 * (z_mean**2 + torch.exp(z_log_var) - z_log_var - 1)).sum()
    pixelwise_bce = F.binary_cross_entropy(decoded, features, reduction="sum")
    return kl_divergence + pixelwise_bce


def _c05_setup(bug: bool):
    torch.manual_seed(123)
    model = _VAE()
    opt = torch.optim.Adam(model.parameters(), lr=0.001)

    def step() -> torch.Tensor:
        z_mean, z_log_var, _, decoded = model(_C05_X)
        cost = _c05_cost(bug, z_mean, z_log_var, decoded, _C05_X)
        opt.zero_grad()
        cost.backward()
        opt.step()
        return cost.detach()

    return model, opt, step


def _c05_build(bug: bool) -> Case:
    model, opt, step = _c05_setup(bug)
    return model, step, _kw(optimizer=opt, inputs={"x": _C05_X})


def _c05_proof(bug: bool) -> bool:
    """With the decoder made blind to z, is there no pull at all on the encoder's mean head (no prior term)?"""
    model, _, _ = _c05_setup(bug)
    with torch.no_grad():
        model.linear_3.weight.zero_()
    z_mean, z_log_var, _, decoded = model(_C05_X)
    cost = _c05_cost(bug, z_mean, z_log_var, decoded, _C05_X)
    (g,) = torch.autograd.grad(cost, [model.z_mean.weight], allow_unused=True)
    return bool(g is None or g.abs().max() == 0)


CASES: list[BlindCase] = [
    BlindCase("b37c-01", "https://github.com/sdv-dev/CTGAN/issues/158", "critic sees unactivated fakes",
              "With no discrete column the CTGAN critic step feeds the raw generator output instead of the activated "
              "rows, so the critic and its gradient penalty learn the wrong real/fake contrast.", _c01_build, _c01_proof,
              known_miss="the critic trained on fakes without their output activation: which activation a branch should apply is arithmetic inside the step"),
    BlindCase("b37c-02", "https://github.com/kakaoenterprise/JORLDY/issues/120", "target actor never updated",
              "The DDPG soft update only Polyak-averages the target critic, so the target actor that picks next "
              "actions for the TD target stays at its initial weights.", _c02_build, _c02_proof,
              known_miss="a DDPG target actor never soft-updated: a copy that is never written is not seen not to follow"),
    BlindCase("b37c-03", "https://github.com/berkeley-reclab/RecLab/pull/150", "L2 penalty on biases",
              "AutoRec's regularizer takes parameters()[1] of each Linear, the bias, so the weight matrices are never "
              "penalized.", _c03_build, _c03_proof,
              known_miss="an L2 penalty taken on biases only: which tensors a regulariser should read is arithmetic inside the loss"),
    BlindCase("b37c-04", "https://github.com/RMeli/gnina-torch/pull/57", "plateau scheduler mode inverted",
              "ReduceLROnPlateau runs in 'max' mode on the training loss, so a falling loss counts as no improvement "
              "and the learning rate is cut while the model is learning.", _c04_build, _c04_proof),
    BlindCase("b37c-05", "https://github.com/rasbt/deep-learning-book/issues/59", "VAE trained without KL",
              "The VAE's cost is the reconstruction BCE alone, so nothing pulls the approximate posterior toward the "
              "prior.", _c05_build, _c05_proof,
              known_miss="a VAE loss without its KL term: an absent term is not a measurable property of the step"),
]
