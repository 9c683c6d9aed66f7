"""Blind batch 31 (part b): silent bugs in GAN, VAE, BYOL and Q-learning training loops from public GitHub threads.

Collected by someone who does not write the audit's checks. Every case builds the user's setup on a tiny plain
PyTorch model (a GAN's generator and discriminator, a VAE, a BYOL online/momentum pair, Q-networks for PQN and
masked-action DQN; nothing is downloaded) with its fixed twin, and proves the bug without the audit on real tensors
and real steps.
"""

from __future__ import annotations

import copy
import itertools
import math

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw

# --------------------------------------------------------------------------------------------- case-01
# Adversarial-Deep-Learning/code-soup issue #69 (fixed by PR #74, "added zero_grad() method on discriminator"): the
# GAN class's `step()` (DCGAN recipe) backpropagates the discriminator's real and fake losses and steps
# `discriminator.optimizer`, then zeroes only the generator's gradients before `errG.backward()`. The discriminator's
# gradients are never cleared: each step's D update applies the sum of every earlier step's D gradients plus the
# generator loss's gradient on D (which pushes D to call fakes real). Nothing raises, both losses print plausible
# numbers. Fix in the PR: `self.discriminator.zero_grad()` at the top of `step()`.

_C01_REAL = torch.tanh(torch.randn(8, 16, generator=_gen(3101)))


class _C01Net(nn.Module):
    def __init__(self, d_in: int, hidden: int, d_out: int, out_act: nn.Module, lr: float) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_in, hidden), nn.LeakyReLU(0.2), nn.Linear(hidden, d_out), out_act)
        self.optimizer = torch.optim.Adam(self.parameters(), lr=lr, betas=(0.5, 0.999))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class _C01GAN(nn.Module):
    """code-soup's GAN: a generator and a discriminator, each holding its own optimizer."""

    def __init__(self, bug: bool) -> None:
        super().__init__()
        self.bug = bug
        self.latent_dims = 8
        self.generator = _C01Net(8, 32, 16, nn.Tanh(), 2e-4)
        self.discriminator = _C01Net(16, 32, 1, nn.Sigmoid(), 2e-4)
        self.criterion = nn.BCELoss()
        self.real_label, self.fake_label = 1.0, 0.0
        self.d_grads_at_step: list[list[torch.Tensor]] = []

    def step(self, real_image: torch.Tensor) -> tuple[float, float, torch.Tensor, float, torch.Tensor]:
        batch_size = real_image.shape[0]
        label = torch.full((batch_size,), self.real_label, dtype=torch.float)
        if not self.bug:
            self.discriminator.zero_grad()
        output = self.discriminator(real_image).view(-1)
        errD_real = self.criterion(output, label)
        errD_real.backward()
        D_x = output.mean().item()
        noise = torch.randn(batch_size, self.latent_dims)
        fake = self.generator(noise)
        label.fill_(self.fake_label)
        output = self.discriminator(fake.detach()).view(-1)
        errD_fake = self.criterion(output, label)
        errD_fake.backward()
        D_G_z1 = output.mean().item()
        errD = errD_real + errD_fake
        self.d_grads_at_step.append([p.grad.detach().clone() for p in self.discriminator.parameters()])
        self.discriminator.optimizer.step()

        self.generator.zero_grad()
        label.fill_(self.real_label)
        output = self.discriminator(fake).view(-1)
        errG = self.criterion(output, label)
        errG.backward()
        D_G_z2 = output.mean().item()
        self.generator.optimizer.step()
        return D_x, D_G_z1, errD, D_G_z2, errG


def _c01_build(bug: bool) -> Case:
    torch.manual_seed(0)
    gan = _C01GAN(bug)
    real = _C01_REAL.clone()

    def step() -> torch.Tensor:
        return gan.step(real)[2]

    return gan, step, _kw(optimizer=gan.discriminator.optimizer, inputs=real)


def _c01_proof(bug: bool) -> bool:
    """Step 2's D update applies a gradient that is not step 2's D-loss gradient (leftovers from step 1)."""
    gan, step, _ = _c01_build(bug)
    torch.manual_seed(1)
    step()
    # the D-loss gradient step 2 should apply, on the weights and noise step 2 will see
    probe = copy.deepcopy(gan)
    rng = torch.get_rng_state()
    step()
    torch.set_rng_state(rng)
    probe.bug = False
    probe.discriminator.zero_grad()
    probe.step(_C01_REAL)
    applied, fresh = gan.d_grads_at_step[1], probe.d_grads_at_step[-1]
    return any(not torch.allclose(a, f, atol=1e-7) for a, f in zip(applied, fresh))


# --------------------------------------------------------------------------------------------- case-02
# vwxyzjn/cleanrl PR #494 ("PQN needs to mask the return computation if next state is done"): cleanrl's PQN builds
# Q(lambda) targets backwards over the rollout as
#     returns[t] = r[t] + gamma * (lambda * returns[t+1] + (1 - lambda) * next_value * nextnonterminal)
# so only the bootstrap value is cut at an episode boundary: the lambda-weighted return of the NEXT episode (a reset
# in the vector env) still flows into the last transition of the finished one. Training runs, the TD loss falls, the
# targets are just wrong at every boundary. Fix in the PR: multiply the whole bracket by `nextnonterminal`.

_C02_T, _C02_E, _C02_OBS, _C02_ACT = 8, 2, 4, 2
_C02_GAMMA, _C02_LAMBDA = 0.99, 0.65


def _c02_rollout() -> dict[str, torch.Tensor]:
    g = _gen(3102)
    dones = torch.zeros(_C02_T, _C02_E)
    dones[3, 0] = 1.0  # obs[3] of env 0 is the first of a new episode: transition 2 ended one
    dones[6, 1] = 1.0
    return {
        "obs": torch.randn(_C02_T, _C02_E, _C02_OBS, generator=g),
        "actions": torch.randint(0, _C02_ACT, (_C02_T, _C02_E), generator=g).float(),
        "rewards": torch.rand(_C02_T, _C02_E, generator=g),
        "dones": dones,
        "next_obs": torch.randn(_C02_E, _C02_OBS, generator=g),
        "next_done": torch.zeros(_C02_E),
    }


class _C02QNetwork(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.network = nn.Sequential(nn.Linear(_C02_OBS, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, _C02_ACT))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.network(x)


def _c02_returns(q_network: nn.Module, ro: dict[str, torch.Tensor], bug: bool) -> torch.Tensor:
    with torch.no_grad():
        values = q_network(ro["obs"]).max(dim=-1).values  # stored during the rollout in cleanrl
        rewards, dones = ro["rewards"], ro["dones"]
        returns = torch.zeros_like(rewards)
        for t in reversed(range(_C02_T)):
            if t == _C02_T - 1:
                next_value, _ = torch.max(q_network(ro["next_obs"]), dim=-1)
                nextnonterminal = 1.0 - ro["next_done"]
                returns[t] = rewards[t] + _C02_GAMMA * next_value * nextnonterminal
            else:
                nextnonterminal = 1.0 - dones[t + 1]
                next_value = values[t + 1]
                if bug:
                    returns[t] = rewards[t] + _C02_GAMMA * (
                        _C02_LAMBDA * returns[t + 1] + (1 - _C02_LAMBDA) * next_value * nextnonterminal)
                else:
                    returns[t] = rewards[t] + _C02_GAMMA * (
                        _C02_LAMBDA * returns[t + 1] + (1 - _C02_LAMBDA) * next_value) * nextnonterminal
    return returns


def _c02_build(bug: bool) -> Case:
    torch.manual_seed(0)
    q_network = _C02QNetwork()
    optimizer = torch.optim.RAdam(q_network.parameters(), lr=2.5e-4)
    ro = _c02_rollout()

    def step() -> torch.Tensor:
        returns = _c02_returns(q_network, ro, bug)
        b_obs = ro["obs"].reshape(-1, _C02_OBS)
        b_actions = ro["actions"].reshape(-1)
        b_returns = returns.reshape(-1)
        old_val = q_network(b_obs).gather(1, b_actions.unsqueeze(-1).long()).squeeze()
        loss = F.mse_loss(b_returns, old_val)
        optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(q_network.parameters(), 10.0)
        optimizer.step()
        return loss

    return q_network, step, _kw(optimizer=optimizer, inputs=ro)


def _c02_proof(bug: bool) -> bool:
    """The target of an episode's last transition carries the next episode's return instead of just its reward."""
    q_network, _, _ = _c02_build(bug)
    ro = _c02_rollout()
    returns = _c02_returns(q_network, ro, bug)
    last = [(2, 0), (5, 1)]  # transitions followed by dones[t + 1] == 1
    return any(not torch.isclose(returns[t, e], ro["rewards"][t, e]) for t, e in last)


# --------------------------------------------------------------------------------------------- case-03
# thu-ml/tianshou issue #309 (fixed by PR #310, "fix qvalue mask_action error for obs_next"): a DQN on an environment
# with an action mask (legal actions per state, `obs.mask`). The mask was applied when choosing actions for `obs`, but
# the TD target `_target_q` took `logits.max(dim=1)` over Q(obs_next) with no mask, so the bootstrap value is the value
# of an action that cannot be taken in the next state. Maintainer: "That's indeed a bug". Training runs and the loss
# falls; the Q-values are just pulled towards illegal actions' estimates. Fix in the PR: `compute_q_value(logits,
# mask)` pushes masked actions below every legal one and the target takes the Q of the masked argmax.

_C03_B, _C03_OBS, _C03_ACT, _C03_GAMMA = 8, 6, 4, 0.99


def _c03_batch() -> dict[str, torch.Tensor]:
    g = _gen(3103)
    mask_next = torch.zeros(_C03_B, _C03_ACT, dtype=torch.bool)
    legal = torch.rand(_C03_B, _C03_ACT, generator=g).argsort(dim=1)[:, :2]  # two legal actions per next state
    mask_next.scatter_(1, legal, True)
    return {
        "obs": torch.randn(_C03_B, _C03_OBS, generator=g),
        "act": torch.randint(0, _C03_ACT, (_C03_B,), generator=g),
        "rew": torch.rand(_C03_B, generator=g),
        "done": torch.zeros(_C03_B),
        "obs_next": torch.randn(_C03_B, _C03_OBS, generator=g),
        "mask_next": mask_next,
    }


def _c03_compute_q_value(logits: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    if mask is not None:
        min_value = logits.min() - logits.max() - 1.0
        logits = logits + (1 - mask.float()) * min_value
    return logits


def _c03_target_q(model: nn.Module, batch: dict[str, torch.Tensor], bug: bool) -> torch.Tensor:
    with torch.no_grad():
        logits = model(batch["obs_next"])
        if bug:
            return logits.max(dim=1)[0]
        act = _c03_compute_q_value(logits, batch["mask_next"]).max(dim=1)[1]
        return logits[torch.arange(len(act)), act]


def _c03_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(_C03_OBS, 32), nn.ReLU(), nn.Linear(32, _C03_ACT))
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    batch = _c03_batch()

    def step() -> torch.Tensor:
        target_q = _c03_target_q(model, batch, bug)
        returns = batch["rew"] + _C03_GAMMA * (1 - batch["done"]) * target_q
        optim.zero_grad()
        q = model(batch["obs"])[torch.arange(_C03_B), batch["act"]]
        td = returns - q
        loss = td.pow(2).mean()
        loss.backward()
        optim.step()
        return loss

    return model, step, _kw(optimizer=optim, inputs=batch)


def _c03_proof(bug: bool) -> bool:
    """Some TD target bootstraps from an action that is illegal in the next state."""
    model, _, _ = _c03_build(bug)
    batch = _c03_batch()
    target_q = _c03_target_q(model, batch, bug)
    with torch.no_grad():
        logits = model(batch["obs_next"])
    best_legal = logits.masked_fill(~batch["mask_next"], float("-inf")).max(dim=1).values
    return bool((~torch.isclose(target_q, best_legal)).any())


# --------------------------------------------------------------------------------------------- case-04
# vturrisi/solo-learn issue #248 (fixed by PR #247, "fix momentum tau"): BYOL's momentum coefficient tau is annealed
# from base_tau to 1 with a cosine over the whole run, `update_tau(cur_step, max_steps)`. A refactor passed
# `max_steps=self.num_training_steps`, which is the number of steps in ONE epoch, so tau reaches 1.0 at the end of
# the first epoch (the target network is frozen for that step), then falls back to base_tau and oscillates every
# epoch instead of rising once. Loss curves look normal; the maintainers' reply: all momentum baselines trained in
# those days were wrong. Fix in the PR: `max_steps=self.max_epochs * self.num_training_steps`.

_C04_STEPS_PER_EPOCH, _C04_MAX_EPOCHS = 4, 5
_C04_X = torch.randn(8, 16, generator=_gen(3104))
_C04_NOISE = torch.randn(2, 8, 16, generator=_gen(31041)) * 0.1


class _C04MomentumUpdater:
    def __init__(self, base_tau: float = 0.99, final_tau: float = 1.0) -> None:
        self.base_tau = base_tau
        self.cur_tau = base_tau
        self.final_tau = final_tau

    @torch.no_grad()
    def update(self, online_net: nn.Module, momentum_net: nn.Module) -> None:
        for op, mp in zip(online_net.parameters(), momentum_net.parameters()):
            mp.data = self.cur_tau * mp.data + (1 - self.cur_tau) * op.data

    def update_tau(self, cur_step: int, max_steps: int) -> None:
        self.cur_tau = (self.final_tau - (self.final_tau - self.base_tau)
                        * (math.cos(math.pi * cur_step / max_steps) + 1) / 2)


class _C04BYOL(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
        self.projector = nn.Linear(32, 16)
        self.predictor = nn.Linear(16, 16)
        self.momentum_backbone = copy.deepcopy(self.backbone)
        self.momentum_projector = copy.deepcopy(self.projector)
        for p in list(self.momentum_backbone.parameters()) + list(self.momentum_projector.parameters()):
            p.requires_grad = False

    def forward(self, v1: torch.Tensor, v2: torch.Tensor) -> torch.Tensor:
        p1 = self.predictor(self.projector(self.backbone(v1)))
        p2 = self.predictor(self.projector(self.backbone(v2)))
        with torch.no_grad():
            z1 = self.momentum_projector(self.momentum_backbone(v1))
            z2 = self.momentum_projector(self.momentum_backbone(v2))
        loss = (2 - 2 * F.cosine_similarity(p1, z2.detach(), dim=-1)).mean()
        return loss + (2 - 2 * F.cosine_similarity(p2, z1.detach(), dim=-1)).mean()


def _c04_setup(bug: bool) -> tuple[_C04BYOL, torch.optim.Optimizer, _C04MomentumUpdater, dict[str, int], list[float]]:
    torch.manual_seed(0)
    model = _C04BYOL()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05, momentum=0.9)
    return model, opt, _C04MomentumUpdater(), {"global_step": 0}, []


def _c04_make_step(bug: bool, model: _C04BYOL, opt: torch.optim.Optimizer, updater: _C04MomentumUpdater,
                   state: dict[str, int], taus: list[float]):
    num_training_steps = _C04_STEPS_PER_EPOCH  # solo-learn's property: steps in one epoch

    def step() -> torch.Tensor:
        v1, v2 = _C04_X + _C04_NOISE[0], _C04_X + _C04_NOISE[1]
        loss = model(v1, v2)
        opt.zero_grad()
        loss.backward()
        opt.step()
        state["global_step"] += 1
        # on_train_batch_end
        updater.update(model.backbone, model.momentum_backbone)
        updater.update(model.projector, model.momentum_projector)
        taus.append(updater.cur_tau)
        max_steps = num_training_steps if bug else _C04_MAX_EPOCHS * num_training_steps
        updater.update_tau(cur_step=state["global_step"], max_steps=max_steps)
        return loss

    return step


def _c04_build(bug: bool) -> Case:
    model, opt, updater, state, taus = _c04_setup(bug)
    step = _c04_make_step(bug, model, opt, updater, state, taus)
    return model, step, _kw(optimizer=opt, inputs=(_C04_X + _C04_NOISE[0], _C04_X + _C04_NOISE[1]))


def _c04_proof(bug: bool) -> bool:
    """Over two epochs the target network stops moving for a step (tau == 1) and tau then falls back down."""
    model, opt, updater, state, taus = _c04_setup(bug)
    step = _c04_make_step(bug, model, opt, updater, state, taus)
    frozen = False
    for _ in range(2 * _C04_STEPS_PER_EPOCH):
        before = [p.clone() for p in model.momentum_backbone.parameters()]
        step()
        if all(torch.equal(b, p) for b, p in zip(before, model.momentum_backbone.parameters())):
            frozen = True
    falls = any(b < a - 1e-12 for a, b in itertools.pairwise(taus))
    return frozen or falls


# --------------------------------------------------------------------------------------------- case-05
# facebookresearch/irmae issue #1 (fixed in commit 05feed7, "fix bug missing beta"): the VAE baseline of IRMAE
# (`AE(args)` with `--vae`, default beta 0.1) computed only `F.binary_cross_entropy(x_hat, x)` in forward; the KL term
# had been dropped in an update. The encoder still outputs mu and logvar and samples with the reparameterisation, so
# the "VAE" trains, its loss falls, but nothing pulls the posterior to the prior (logvar is free to collapse, mu to
# drift): it is an autoencoder with noise. The maintainer confirmed: "It's a mistake in our last update". Fix: subtract
# `beta * mean(1 + logvar - mu^2 - exp(logvar))` from the loss.

_C05_N = 4
_C05_X = torch.rand(8, 16, generator=_gen(3105))


def _c05_reparametrization(mu: torch.Tensor, logvar: torch.Tensor) -> torch.Tensor:
    std = torch.exp(0.5 * logvar)
    eps = torch.randn_like(std)
    return mu + eps * std


class _C05AE(nn.Module):
    def __init__(self, bug: bool, beta: float = 0.1) -> None:
        super().__init__()
        self.bug, self.beta, self.n = bug, beta, _C05_N
        self.enc = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2 * _C05_N))
        self.dec = nn.Sequential(nn.Linear(_C05_N, 32), nn.ReLU(), nn.Linear(32, 16), nn.Sigmoid())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.enc(x)
        mu = z[:, :self.n]
        logvar = z[:, self.n:]
        z_bar = _c05_reparametrization(mu, logvar)
        x_hat = self.dec(z_bar)
        loss = F.binary_cross_entropy(x_hat, x)
        if not self.bug:
            loss = loss - self.beta * torch.mean(1 + logvar - mu.pow(2) - logvar.exp())
        return loss


def _c05_build(bug: bool) -> Case:
    torch.manual_seed(0)
    net = _C05AE(bug)
    optimizer = torch.optim.Adam(net.parameters(), 1e-4)
    x = _C05_X.clone()

    def step() -> torch.Tensor:
        optimizer.zero_grad()
        loss = net(x)
        loss.backward()
        optimizer.step()
        return loss

    return net, step, _kw(optimizer=optimizer, inputs=x)


def _c05_proof(bug: bool) -> bool:
    """The training loss equals the reconstruction term alone although the posterior is far from the prior."""
    net, _, _ = _c05_build(bug)
    with torch.no_grad():
        net.enc[2].bias[_C05_N:].fill_(-2.0)  # a posterior clearly unlike N(0, 1)
    torch.manual_seed(5)
    loss = net(_C05_X)
    torch.manual_seed(5)
    z = net.enc(_C05_X)
    mu, logvar = z[:, :_C05_N], z[:, _C05_N:]
    recon = F.binary_cross_entropy(net.dec(_c05_reparametrization(mu, logvar)), _C05_X)
    kl = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp(), dim=1).mean()
    return bool(kl > 0.5) and bool(torch.isclose(loss, recon))


CASES: list[BlindCase] = [
    BlindCase("b31b-01", "https://github.com/Adversarial-Deep-Learning/code-soup/issues/69",
              "discriminator gradients never zeroed",
              "The GAN step zeroes only the generator's gradients, so each discriminator update applies the "
              "accumulated gradients of all earlier steps plus the generator loss's gradient on D.",
              _c01_build, _c01_proof),
    BlindCase("b31b-02", "https://github.com/vwxyzjn/cleanrl/pull/494", "Q(lambda) return not masked at done",
              "PQN's Q(lambda) targets cut only the bootstrap value at an episode end, so the next episode's "
              "lambda-return leaks into the last transition of the finished one.", _c02_build, _c02_proof,
              known_miss="a Q(lambda) return not masked at episode ends: the return's arithmetic is outside the model"),
    BlindCase("b31b-03", "https://github.com/thu-ml/tianshou/issues/309", "TD target ignores next action mask",
              "The DQN target takes the max of Q(obs_next) over all actions, ignoring the next state's action "
              "mask, so targets bootstrap from actions that cannot be taken.", _c03_build, _c03_proof,
              known_miss="a TD target that ignores the action mask: which actions are legal is environment semantics"),
    BlindCase("b31b-04", "https://github.com/vturrisi/solo-learn/issues/248", "EMA momentum schedule length wrong",
              "BYOL's cosine tau schedule is given one epoch's steps as the whole run, so tau hits 1 (target "
              "frozen) after the first epoch and then oscillates every epoch.", _c04_build, _c04_proof,
              known_miss="an EMA momentum schedule sized for another length: the copy's schedule is not walked"),
    BlindCase("b31b-05", "https://github.com/facebookresearch/irmae/issues/1", "VAE loss missing KL term",
              "The VAE's loss is the reconstruction term alone, so the encoder samples with the reparameterisation "
              "but nothing pulls the posterior towards the prior.", _c05_build, _c05_proof,
              known_miss="a VAE loss missing its KL term: an absent term is not a measurable property of the step"),
]
