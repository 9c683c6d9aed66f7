"""Blind batch 17 (part c): silent training bugs from public GitHub threads, each with its fixed twin."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw, _sgd_step

# --------------------------------------------------------------------------------------------- case-11


class _PGAgent(nn.Module):
    """A2C policy-gradient agent: shared MLP torso, policy-logits head, baseline (V) head, two optimizers."""

    def __init__(self, clip_wrong_head: bool, info_state_size: int = 6, num_actions: int = 3,
                 hidden: int = 16, max_global_gradient_norm: float = 0.5, entropy_cost: float = 0.01) -> None:
        super().__init__()
        self.clip_wrong_head = clip_wrong_head
        self.max_global_gradient_norm = max_global_gradient_norm
        self.entropy_cost = entropy_cost
        self.net_torso = nn.Sequential(nn.Linear(info_state_size, hidden), nn.ReLU())
        self.policy_logits_layer = nn.Linear(hidden, num_actions)
        self.baseline_layer = nn.Linear(hidden, 1)
        critic_network = nn.Sequential(self.net_torso, self.baseline_layer)
        pi_network = nn.Sequential(self.net_torso, self.policy_logits_layer)
        self.critic_optimizer = torch.optim.SGD(critic_network.parameters(), lr=0.01)
        self.pi_optimizer = torch.optim.SGD(pi_network.parameters(), lr=0.001)

    def minimize_with_clipping(self, model: nn.Module, optimizer: torch.optim.Optimizer, loss: torch.Tensor) -> None:
        optimizer.zero_grad()
        loss.backward()
        if self.max_global_gradient_norm is not None:
            nn.utils.clip_grad_norm_(model.parameters(), self.max_global_gradient_norm)
        optimizer.step()

    def critic_update(self, info_state: torch.Tensor, return_: torch.Tensor) -> torch.Tensor:
        baseline = torch.squeeze(self.baseline_layer(self.net_torso(info_state)), dim=1)
        critic_loss = torch.mean(F.mse_loss(baseline, return_))
        self.minimize_with_clipping(self.baseline_layer, self.critic_optimizer, critic_loss)
        return critic_loss

    def a2c_loss(self, policy_logits: torch.Tensor, baseline: torch.Tensor, actions: torch.Tensor,
                 returns: torch.Tensor) -> torch.Tensor:
        advantages = (returns - baseline).detach()
        policy_loss = F.cross_entropy(policy_logits, actions, reduction="none") * advantages
        total_loss = torch.mean(policy_loss, dim=0)
        probs = F.softmax(policy_logits, dim=1)
        entropy = -torch.sum(probs * F.log_softmax(policy_logits, dim=1), dim=1).mean()
        return total_loss - self.entropy_cost * entropy

    def pi_update(self, info_state: torch.Tensor, action: torch.Tensor, return_: torch.Tensor) -> torch.Tensor:
        torso_out = self.net_torso(info_state)
        policy_logits = self.policy_logits_layer(torso_out)
        baseline = torch.squeeze(self.baseline_layer(torso_out), dim=1)
        pi_loss = self.a2c_loss(policy_logits, baseline, action, return_)
        head = self.baseline_layer if self.clip_wrong_head else self.policy_logits_layer
        self.minimize_with_clipping(head, self.pi_optimizer, pi_loss)
        return pi_loss


_C11_STATES = torch.randn(16, 6, generator=_gen(1101))
_C11_ACTIONS = torch.randint(0, 3, (16,), generator=_gen(1102))
_C11_RETURNS = torch.randn(16, generator=_gen(1103)) * 20.0


def _c11_build(bug: bool) -> Case:
    """A2C learn step with max_global_gradient_norm: the pi update clips the baseline head's gradients."""
    torch.manual_seed(11)
    agent = _PGAgent(clip_wrong_head=bug).train()

    def step() -> torch.Tensor:
        agent.critic_update(_C11_STATES, _C11_RETURNS)
        return agent.pi_update(_C11_STATES, _C11_ACTIONS, _C11_RETURNS)

    return agent, step, _kw(optimizer=agent.pi_optimizer, inputs=_C11_STATES)


def _c11_proof(bug: bool) -> bool:
    """After the pi update, the policy head's gradient norm is far above max_global_gradient_norm (never clipped)."""
    agent, step, _ = _c11_build(bug)
    step()
    norm = torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(p.grad) for p in agent.policy_logits_layer.parameters()]))
    return float(norm) > agent.max_global_gradient_norm * 1.01



# --------------------------------------------------------------------------------------------- case-12


class _MemoryBankModule(nn.Module):
    """Memory bank of negatives: returns the bank as it was, then enqueues the new keys when asked to."""

    def __init__(self, size: int, dim: int) -> None:
        super().__init__()
        self.size = size
        bank = F.normalize(torch.randn(dim, size, generator=_gen(1201)), dim=0)
        self.register_buffer("bank", bank)
        self.register_buffer("bank_ptr", torch.zeros(1, dtype=torch.long))

    @torch.no_grad()
    def _dequeue_and_enqueue(self, batch: torch.Tensor) -> None:
        n = batch.shape[0]
        ptr = int(self.bank_ptr)
        if ptr + n >= self.size:
            self.bank[:, ptr:] = batch[: self.size - ptr].T.detach()
            self.bank_ptr[0] = 0
        else:
            self.bank[:, ptr:ptr + n] = batch.T.detach()
            self.bank_ptr[0] = ptr + n

    def forward(self, output: torch.Tensor, update: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        bank = self.bank.clone().detach()
        if update:
            self._dequeue_and_enqueue(output)
        return output, bank


class _NTXentLoss(_MemoryBankModule):
    """NT-Xent (InfoNCE) with a memory bank: positive = the other view's key, negatives = the bank."""

    def __init__(self, temperature: float = 0.1, memory_bank_size: int = 64, dim: int = 8) -> None:
        super().__init__(memory_bank_size, dim)
        self.temperature = temperature
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []  # (positives, negatives) of each call

    def forward(self, out0: torch.Tensor, out1: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        out0 = F.normalize(out0, dim=1)
        out1 = F.normalize(out1, dim=1)
        out1, negatives = super().forward(out1, update=out0.requires_grad)
        self.calls.append((out1.detach().clone(), negatives))
        sim_pos = torch.einsum("nc,nc->n", out0, out1).unsqueeze(-1)
        sim_neg = torch.einsum("nc,ck->nk", out0, negatives)
        logits = torch.cat([sim_pos, sim_neg], dim=1) / self.temperature
        labels = torch.zeros(logits.shape[0], dtype=torch.long)
        return F.cross_entropy(logits, labels)


class _MoCo(nn.Module):
    """MoCo: query backbone + projection head, momentum copies of both for the keys."""

    def __init__(self, m: float = 0.99) -> None:
        super().__init__()
        self.m = m
        self.backbone = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                                      nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.projection_head = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
        self.momentum_backbone = copy.deepcopy(self.backbone)
        self.momentum_projection_head = copy.deepcopy(self.projection_head)
        for p in list(self.momentum_backbone.parameters()) + list(self.momentum_projection_head.parameters()):
            p.requires_grad = False

    @torch.no_grad()
    def _momentum_update(self) -> None:
        for src, dst in ((self.backbone, self.momentum_backbone),
                         (self.projection_head, self.momentum_projection_head)):
            for p, pm in zip(src.parameters(), dst.parameters()):
                pm.data = pm.data * self.m + p.data * (1.0 - self.m)

    def forward(self, x0: torch.Tensor, x1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out0 = self.projection_head(self.backbone(x0))
        self._momentum_update()
        with torch.no_grad():
            out1 = self.momentum_projection_head(self.momentum_backbone(x1)).detach()
        return out0, out1


class _MocoModel(nn.Module):
    def __init__(self, symmetric: bool) -> None:
        super().__init__()
        self.symmetric = symmetric
        self.resnet_moco = _MoCo(m=0.99)
        self.criterion = _NTXentLoss(temperature=0.1, memory_bank_size=64, dim=8)

    def training_step(self, x0: torch.Tensor, x1: torch.Tensor) -> torch.Tensor:
        if self.symmetric:
            loss_1 = self.criterion(*self.resnet_moco(x0, x1))
            loss_2 = self.criterion(*self.resnet_moco(x1, x0))
            return 0.5 * (loss_1 + loss_2)
        return self.criterion(*self.resnet_moco(x0, x1))


_C12_IMG = torch.rand(8, 3, 8, 8, generator=_gen(1202))
_C12_X0 = (_C12_IMG + 0.1 * torch.randn(8, 3, 8, 8, generator=_gen(1203))).clamp(0, 1)
_C12_X1 = torch.flip(_C12_IMG, dims=[3]) * 0.9


def _c12_build(bug: bool) -> Case:
    """MoCo benchmark with a memory-bank NT-Xent loss, trained with the symmetric loss (x0,x1) then (x1,x0)."""
    torch.manual_seed(12)
    model = _MocoModel(symmetric=bug).train()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=6e-2, momentum=0.9,
                          weight_decay=5e-4)
    step = _sgd_step(model, opt, lambda: model.training_step(_C12_X0, _C12_X1))
    return model, step, _kw(optimizer=opt, inputs=(_C12_X0, _C12_X1))


def _c12_proof(bug: bool) -> bool:
    """Within one step, a key enqueued for this batch's images comes back as a negative for the same images."""
    model, step, _ = _c12_build(bug)
    step()
    calls = model.criterion.calls
    for i, (_, negatives) in enumerate(calls):
        for pos_prev, _ in calls[:i]:
            sim = pos_prev @ negatives  # (batch, bank): 1.0 where the earlier key sits in the bank
            if bool((sim.max(dim=1).values > 0.9999).all()):
                return True
    return False



# --------------------------------------------------------------------------------------------- case-13


class _BoltsVAE(nn.Module):
    """Standard VAE (Gaussian prior and posterior) with a kl_coeff hyper-parameter, as in a Lightning module."""

    def __init__(self, apply_kl_coeff: bool, input_dim: int = 48, enc_out_dim: int = 32, latent_dim: int = 4,
                 kl_coeff: float = 0.1) -> None:
        super().__init__()
        self.apply_kl_coeff = apply_kl_coeff
        self.kl_coeff = kl_coeff
        self.encoder = nn.Sequential(nn.Flatten(), nn.Linear(input_dim, enc_out_dim), nn.ReLU())
        self.decoder = nn.Sequential(nn.Linear(latent_dim, enc_out_dim), nn.ReLU(), nn.Linear(enc_out_dim, input_dim))
        self.fc_mu = nn.Linear(enc_out_dim, latent_dim)
        self.fc_var = nn.Linear(enc_out_dim, latent_dim)

    def sample(self, mu: torch.Tensor, log_var: torch.Tensor):
        std = torch.exp(log_var / 2)
        p = torch.distributions.Normal(torch.zeros_like(mu), torch.ones_like(std))
        q = torch.distributions.Normal(mu, std)
        z = q.rsample()
        return p, q, z

    def _run_step(self, x: torch.Tensor):
        h = self.encoder(x)
        mu = self.fc_mu(h)
        log_var = self.fc_var(h)
        p, q, z = self.sample(mu, log_var)
        return z, self.decoder(z), p, q

    def step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, _ = batch
        z, x_hat, p, q = self._run_step(x)
        recon_loss = F.mse_loss(x_hat, x.flatten(1), reduction="mean")
        log_qz = q.log_prob(z)
        log_pz = p.log_prob(z)
        kl = log_qz - log_pz
        kl = kl.mean()
        if self.apply_kl_coeff:
            kl = kl * self.kl_coeff
        return kl + recon_loss


_C13_X = torch.rand(16, 3, 4, 4, generator=_gen(1301))
_C13_Y = torch.randint(0, 10, (16,), generator=_gen(1302))


def _c13_build(bug: bool) -> Case:
    """Bolts-style VAE trained with kl_coeff=0.1 whose step adds the KL term unscaled."""
    torch.manual_seed(13)
    model = _BoltsVAE(apply_kl_coeff=not bug).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    step = _sgd_step(model, opt, lambda: model.step((_C13_X, _C13_Y)))
    return model, step, _kw(optimizer=opt, inputs=_C13_X)


def _c13_proof(bug: bool) -> bool:
    """The training loss differs from recon + kl_coeff * KL computed by hand on the same posterior sample."""
    model, _, _ = _c13_build(bug)
    torch.manual_seed(1303)
    loss = model.step((_C13_X, _C13_Y))
    torch.manual_seed(1303)
    z, x_hat, p, q = model._run_step(_C13_X)
    recon = F.mse_loss(x_hat, _C13_X.flatten(1))
    kl = (q.log_prob(z) - p.log_prob(z)).mean()
    expected = recon + model.kl_coeff * kl
    loss, expected = float(loss.detach()), float(expected.detach())
    return abs(loss - expected) > 1e-5 * max(1.0, abs(expected))



# --------------------------------------------------------------------------------------------- case-14


class _PointerNet(nn.Module):
    """Pointer network for TSP: LSTM encoder over city embeddings, LSTM decoder pointing at unvisited cities."""

    def __init__(self, input_dim: int = 2, emb: int = 16, hidden: int = 16) -> None:
        super().__init__()
        self.embedding = nn.Linear(input_dim, emb)
        self.encoder = nn.LSTM(emb, hidden, batch_first=True)
        self.decoder = nn.LSTMCell(emb, hidden)
        self.W_ref = nn.Linear(hidden, hidden, bias=False)
        self.W_q = nn.Linear(hidden, hidden, bias=False)
        self.v = nn.Parameter(torch.randn(hidden) * 0.1)
        self.dec_start = nn.Parameter(torch.randn(emb) * 0.1)

    def forward(self, cities: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        batch, n, _ = cities.shape
        emb = self.embedding(cities)
        enc, (h, c) = self.encoder(emb)
        h, c = h[0], c[0]
        dec_in = self.dec_start.expand(batch, -1)
        visited = torch.zeros(batch, n, dtype=torch.bool)
        log_probs, tour = [], []
        for _ in range(n):
            h, c = self.decoder(dec_in, (h, c))
            u = torch.tanh(self.W_ref(enc) + self.W_q(h)[:, None]) @ self.v
            u = u.masked_fill(visited, float("-inf"))
            logp = F.log_softmax(u, dim=1)
            idx = torch.multinomial(logp.exp().detach(), 1, generator=gen).squeeze(1)
            log_probs.append(logp.gather(1, idx[:, None]).squeeze(1))
            tour.append(idx)
            visited = visited.clone()
            visited[torch.arange(batch), idx] = True
            dec_in = emb[torch.arange(batch), idx]
        return torch.stack(tour, 1), torch.stack(log_probs, 1).sum(1)


class _Critic(nn.Module):
    """Critic: its own encoder over the cities, predicting the expected tour length (the baseline b)."""

    def __init__(self, input_dim: int = 2, emb: int = 16, hidden: int = 16) -> None:
        super().__init__()
        self.embedding = nn.Linear(input_dim, emb)
        self.encoder = nn.LSTM(emb, hidden, batch_first=True)
        self.head = nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, cities: torch.Tensor) -> torch.Tensor:
        enc, _ = self.encoder(self.embedding(cities))
        return self.head(enc.mean(1))


class _NCOModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pointer_net = _PointerNet()
        self.critic = _Critic()

    def forward(self, cities: torch.Tensor, gen: torch.Generator):
        tour, log_probs = self.pointer_net(cities, gen)
        ordered = cities.gather(1, tour[..., None].expand(-1, -1, cities.shape[-1]))
        L = (ordered - ordered.roll(-1, dims=1)).norm(dim=-1).sum(1)  # closed tour length
        b = self.critic(cities)
        return L, log_probs, tour, b


_C14_CITIES = torch.rand(8, 6, 2, generator=_gen(1401))


def _c14_losses(model: _NCOModel, bug: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    L, log_probs, _, b = model(_C14_CITIES, _gen(seed))
    log_probs = log_probs.view(-1)
    log_probs[(log_probs < -1000).detach()] = 0.0
    critic_loss = F.mse_loss(b.view(-1), L)
    advantage = L - b.view(-1) if bug else L - b.view(-1).detach()
    actor_loss = (advantage * log_probs).mean()
    return actor_loss + critic_loss, critic_loss


def _c14_build(bug: bool) -> Case:
    """REINFORCE with a critic baseline for TSP: one optimizer over pointer net and critic, loss = actor + critic."""
    torch.manual_seed(14)
    model = _NCOModel().train()
    opt = torch.optim.Adam(list(model.critic.parameters()) + list(model.pointer_net.parameters()), lr=1e-3)
    counter = [0]

    def step() -> torch.Tensor:
        counter[0] += 1
        loss, _ = _c14_losses(model, bug, 1402 + counter[0])
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(model.critic.parameters()) + list(model.pointer_net.parameters()),
                                       1.0, norm_type=2)
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=_C14_CITIES)


def _c14_proof(bug: bool) -> bool:
    """The critic's gradient from the total loss is not the gradient of its own MSE loss: the actor loss reaches it."""
    model, _, _ = _c14_build(bug)
    loss, critic_loss = _c14_losses(model, bug, 1402)
    params = list(model.critic.parameters())
    g_total = torch.autograd.grad(loss, params, retain_graph=True)
    g_critic = torch.autograd.grad(critic_loss, params)
    diff = max(float((a - b).abs().max()) for a, b in zip(g_total, g_critic))
    return diff > 1e-6



# --------------------------------------------------------------------------------------------- case-15


def _conv_block(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, 1, 1), nn.BatchNorm2d(cout), nn.LeakyReLU(0.2, inplace=True))


class _SinGenerator(nn.Module):
    """SinGAN single-scale generator: conv blocks on noise + upsampled previous scale, residual on prev."""

    def __init__(self, nc: int = 3, nfc: int = 8) -> None:
        super().__init__()
        self.head = _conv_block(nc, nfc)
        self.body = nn.Sequential(_conv_block(nfc, nfc), _conv_block(nfc, nfc))
        self.tail = nn.Sequential(nn.Conv2d(nfc, nc, 3, 1, 1), nn.Tanh())

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.tail(self.body(self.head(x))) + y


class _SinDiscriminator(nn.Module):
    """SinGAN patch discriminator (WGAN critic)."""

    def __init__(self, nc: int = 3, nfc: int = 8) -> None:
        super().__init__()
        self.head = _conv_block(nc, nfc)
        self.body = nn.Sequential(_conv_block(nfc, nfc))
        self.tail = nn.Conv2d(nfc, 1, 3, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tail(self.body(self.head(x)))


def _calc_gradient_penalty(netD: nn.Module, real: torch.Tensor, fake: torch.Tensor, lam: float,
                           gen: torch.Generator) -> torch.Tensor:
    alpha = torch.rand(1, 1, generator=gen).expand(real.size())
    interpolates = (alpha * real + (1 - alpha) * fake).requires_grad_(True)
    disc = netD(interpolates)
    grads = torch.autograd.grad(disc, interpolates, grad_outputs=torch.ones_like(disc), create_graph=True,
                                retain_graph=True, only_inputs=True)[0]
    return ((grads.norm(2, dim=1) - 1) ** 2).mean() * lam


class _SinGANScale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.netG = _SinGenerator()
        self.netD = _SinDiscriminator()


_C15_REAL = torch.rand(1, 3, 12, 12, generator=_gen(1501)) * 2 - 1
_C15_PREV = torch.zeros(1, 3, 12, 12)
_C15_ZOPT = torch.randn(1, 3, 12, 12, generator=_gen(1502))


def _c15_generator_losses(m: _SinGANScale, fake: torch.Tensor, noise: torch.Tensor, bug: bool,
                          alpha: float = 10.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One generator iteration; the 'fix for PyTorch 1.6' scores the old fake detached, the fix regenerates it."""
    if bug:
        output = m.netD(fake.detach())
    else:
        fake = m.netG(noise.detach(), _C15_PREV)
        output = m.netD(fake)
    errG = -output.mean()
    rec_loss = alpha * F.mse_loss(m.netG(_C15_ZOPT.detach(), _C15_PREV), _C15_REAL)
    return errG, rec_loss, fake


def _c15_build(bug: bool) -> Case:
    """SinGAN single-scale WGAN-GP step (Dsteps=3, Gsteps=3) with the generator's adversarial term on fake.detach()."""
    torch.manual_seed(15)
    m = _SinGANScale().train()
    optimizerD = torch.optim.Adam(m.netD.parameters(), lr=5e-4, betas=(0.5, 0.999))
    optimizerG = torch.optim.Adam(m.netG.parameters(), lr=5e-4, betas=(0.5, 0.999))
    gen = _gen(1503)

    def step() -> torch.Tensor:
        noise = torch.randn(1, 3, 12, 12, generator=gen)
        for _ in range(3):  # Dsteps
            m.netD.zero_grad()
            errD_real = -m.netD(_C15_REAL).mean()
            errD_real.backward(retain_graph=True)
            fake = m.netG(noise.detach(), _C15_PREV)
            errD_fake = m.netD(fake.detach()).mean()
            errD_fake.backward(retain_graph=True)
            gradient_penalty = _calc_gradient_penalty(m.netD, _C15_REAL, fake.detach(), 0.1, gen)
            gradient_penalty.backward()
            optimizerD.step()
        for _ in range(3):  # Gsteps
            m.netG.zero_grad()
            errG, rec_loss, fake = _c15_generator_losses(m, fake, noise, bug)
            errG.backward(retain_graph=True)
            rec_loss.backward(retain_graph=True)
            optimizerG.step()
        return errG + rec_loss

    return m, step, _kw(optimizer=optimizerG, inputs=(_C15_REAL, _C15_ZOPT))


def _c15_proof(bug: bool) -> bool:
    """The generator's adversarial loss errG has no gradient path to any generator weight."""
    m, _, _ = _c15_build(bug)
    noise = torch.randn(1, 3, 12, 12, generator=_gen(1504))
    fake = m.netG(noise, _C15_PREV)
    errG, _, _ = _c15_generator_losses(m, fake, noise, bug)
    params = list(m.netG.parameters())
    grads = torch.autograd.grad(errG, params, allow_unused=True)
    return all(g is None or float(g.abs().sum()) == 0.0 for g in grads)


CASES: list[BlindCase] = [
    BlindCase("b17-case-11", "https://github.com/google-deepmind/open_spiel/issues/827", "gradient clipping on the wrong parameters",
              "The policy update clips the gradients of the value head (which the detached policy loss never "
              "reaches) instead of the policy head, so max_global_gradient_norm never limits the policy step.",
              _c11_build, _c11_proof),
    BlindCase("b17-case-12", "https://github.com/lightly-ai/lightly/issues/564", "positive pair leaked into negatives",
              "With a symmetric MoCo loss, the first half enqueues the keys of x1 into the memory bank and the second "
              "half then scores the query of x1 against its own key as a negative, pushing each image away from itself.",
              _c12_build, _c12_proof,
              known_miss="not examined yet: batch 17 was measured at the end of round 7"),
    BlindCase("b17-case-13", "https://github.com/Lightning-Universe/lightning-bolts/issues/328", "hyper-parameter silently ignored",
              "The VAE stores kl_coeff but its loss adds the KL term unscaled, so the KL weight the user sets has no "
              "effect and the posterior is pulled to the prior ten times harder than asked.",
              _c13_build, _c13_proof,
              known_miss="not examined yet: batch 17 was measured at the end of round 7"),
    BlindCase("b17-case-14", "https://github.com/jingw2/neural-combinatorial-optimization-rl/issues/1", "baseline not detached in policy gradient",
              "The advantage L - b keeps the critic's graph, so the REINFORCE actor loss also backpropagates into the "
              "critic and drags the baseline away from the expected tour length it is meant to regress.",
              _c14_build, _c14_proof,
              known_miss="an undetached baseline sends the policy loss's gradient into the critic; which "
                         "objective trains which module is not measured"),
    BlindCase("b17-case-15", "https://github.com/tamarott/SinGAN/pull/117", "generator adversarial loss detached",
              "To silence an in-place autograd error the generator step scores fake.detach(), so the adversarial term "
              "sends no gradient to the generator and only the reconstruction loss trains it.",
              _c15_build, _c15_proof,
              known_miss="not examined yet: batch 17 was measured at the end of round 7"),
]
