"""Blind batch 19 (part c): silent training bugs from public threads on training recipes (policy gradient,
Lightning-style manual accumulation, diffusion-prior guidance, a Lightning GAN, policy distillation), each with its
fixed twin. Every case is a tiny hand-written model; nothing is downloaded."""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw, _sgd_step

# --------------------------------------------------------------------------------------------- case-11
# Gymnasium's "Training using REINFORCE for Mujoco" tutorial (InvertedPendulum). The thread reports that `update()`
# first averages the episode's log-probabilities (`log_prob_mean = log_probs.mean()`) and then multiplies that single
# number by every discounted return (`loss = -torch.sum(log_prob_mean * deltas)`), so every action of the episode gets
# the same credit (the mean return) instead of its own return-to-go. The fix (PR #1337, accepted by the maintainer):
# `loss = -torch.sum(log_probs * deltas)`.


class _GaussianPolicy(nn.Module):
    """The tutorial's policy: a shared tanh MLP with a mean head and a softplus std head."""

    def __init__(self, obs_dim: int = 4, act_dim: int = 1, h1: int = 16, h2: int = 32) -> None:
        super().__init__()
        self.shared_net = nn.Sequential(nn.Linear(obs_dim, h1), nn.Tanh(), nn.Linear(h1, h2), nn.Tanh())
        self.policy_mean_net = nn.Linear(h2, act_dim)
        self.policy_stddev_net = nn.Linear(h2, act_dim)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        f = self.shared_net(x)
        return self.policy_mean_net(f), torch.log1p(torch.exp(self.policy_stddev_net(f)))


_C11_T = 12
_C11_OBS = torch.randn(_C11_T, 4, generator=_gen(1101))
_C11_ACT = torch.randn(_C11_T, 1, generator=_gen(1102))
_C11_REW = torch.ones(_C11_T)  # InvertedPendulum pays +1 per surviving step
_C11_GAMMA = 0.99


def _c11_returns() -> torch.Tensor:
    running_g, gs = 0.0, cast(list[float], [])
    for r in _C11_REW.tolist()[::-1]:
        running_g = r + _C11_GAMMA * running_g
        gs.insert(0, running_g)
    return torch.tensor(gs)


def _c11_log_probs(policy: _GaussianPolicy) -> torch.Tensor:
    mean, std = policy(_C11_OBS)
    dist = torch.distributions.Normal(mean[:, 0] + 1e-6, std[:, 0] + 1e-6)
    return dist.log_prob(_C11_ACT[:, 0])


def _c11_loss(log_probs: torch.Tensor, bug: bool) -> torch.Tensor:
    deltas = _c11_returns()
    if bug:
        log_prob_mean = log_probs.mean()
        return -torch.sum(log_prob_mean * deltas)
    return -torch.sum(log_probs * deltas)


def _c11_build(bug: bool) -> Case:
    """REINFORCE update on one stored episode: discounted returns times the episode's action log-probs."""
    torch.manual_seed(0)
    policy = _GaussianPolicy().train()
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-4)

    def update() -> torch.Tensor:
        loss = _c11_loss(_c11_log_probs(policy), bug)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    return policy, update, _kw(optimizer=opt, inputs=_C11_OBS)


def _c11_proof(bug: bool) -> bool:
    """The weight the loss puts on each step's log-probability is the same for every step (no per-step credit),
    although the returns-to-go differ from step to step."""
    policy = cast(_GaussianPolicy, _c11_build(bug)[0])
    log_probs = _c11_log_probs(policy).detach().requires_grad_(True)
    _c11_loss(log_probs, bug).backward()
    assert log_probs.grad is not None
    weights = log_probs.grad
    return float((weights - weights[0]).abs().max()) < 1e-6


# --------------------------------------------------------------------------------------------- case-12
# Lightning manual optimisation with gradient accumulation (issue #17957, from #12811). The documented recipe calls
# `self.manual_backward(loss)` on every batch and `opt.step(); opt.zero_grad()` every N batches, but never scales the
# loss, so the accumulated gradient is the SUM of N micro-batch gradients (N times the mean-loss gradient; with SGD
# the effective learning rate is N times too large). The fix (docs PR #17975, asked for by the maintainer): divide the
# loss by N before `manual_backward`.


class _Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


_C12_N = 4
_C12_X = torch.randn(_C12_N, 6, 8, generator=_gen(1201))
_C12_Y = torch.randn(_C12_N, 6, 1, generator=_gen(1202))


def _c12_build(bug: bool) -> Case:
    """Manual-optimisation training_step run over N=4 batches, stepping the optimizer on every 4th batch."""
    torch.manual_seed(0)
    model = _Regressor().train()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def run_accumulation_cycle() -> torch.Tensor:
        loss = torch.zeros(())
        for batch_idx in range(_C12_N):
            loss = F.mse_loss(model(_C12_X[batch_idx]), _C12_Y[batch_idx])
            if not bug:
                loss = loss / _C12_N
            loss.backward()  # self.manual_backward(loss)
            if (batch_idx + 1) % _C12_N == 0:
                opt.step()
                opt.zero_grad()
        return loss

    return model, run_accumulation_cycle, _kw(optimizer=opt, inputs=_C12_X[0])


def _c12_proof(bug: bool) -> bool:
    """The update applied after one accumulation cycle is N times the update of one SGD step on the mean loss over
    the same N batches."""
    model, step, _ = _c12_build(bug)
    ref = _Regressor()
    ref.load_state_dict(model.state_dict())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    before = [p.detach().clone() for p in model.parameters()]
    step()
    loss = torch.stack([F.mse_loss(ref(_C12_X[i]), _C12_Y[i]) for i in range(_C12_N)]).mean()
    ref_opt.zero_grad()
    loss.backward()
    ref_opt.step()
    got = torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before)])
    want = torch.cat([(p.detach() - b).flatten() for p, b in zip(ref.parameters(), before)])
    return abs(float(got.norm() / want.norm()) - _C12_N) < 1e-3


# --------------------------------------------------------------------------------------------- case-13
# DALLE2-pytorch issue #235: the diffusion prior's network is trained with `cond_drop_prob` for classifier-free
# guidance, and its forward builds `keep_mask = prob_mask_like((batch,), 1 - cond_drop_prob)` and folds it into an
# attention `mask`, but that mask is never handed to the transformer, so the text conditioning is never dropped and
# the unconditional branch the sampler later asks for is never trained. The maintainer confirmed it and fixed it
# (v1.9.0) with the null-token strategy: the text embedding of dropped samples is replaced by a learned null embedding.


class _PriorNet(nn.Module):
    """Tokens [text embed, time embed, noised image embed, learned query] through a causal transformer; the last
    token predicts the clean image embedding."""

    def __init__(self, bug: bool, dim: int = 16, timesteps: int = 50) -> None:
        super().__init__()
        self.bug = bug
        self.to_text_embeds = nn.Linear(dim, dim)
        self.to_image_embeds = nn.Linear(dim, dim)
        self.to_time_embeds = nn.Embedding(timesteps, dim)
        self.learned_query = nn.Parameter(torch.randn(dim) * 0.1)
        self.null_text_embed = nn.Parameter(torch.randn(1, 1, dim) * 0.1)
        layer = nn.TransformerEncoderLayer(dim, 2, 32, dropout=0.0, batch_first=True)
        self.causal_transformer = nn.TransformerEncoder(layer, 2)

    def forward(self, image_embed: torch.Tensor, t: torch.Tensor, text_embed: torch.Tensor,
                cond_drop_prob: float, gen: torch.Generator) -> torch.Tensor:
        b = image_embed.shape[0]
        text_tok = self.to_text_embeds(text_embed)[:, None]
        image_tok = self.to_image_embeds(image_embed)[:, None]
        time_tok = self.to_time_embeds(t)[:, None]
        keep_mask = torch.rand(b, generator=gen) < (1 - cond_drop_prob)  # prob_mask_like
        keep_mask = keep_mask[:, None, None]
        if not self.bug:
            text_tok = torch.where(keep_mask, text_tok, self.null_text_embed.to(text_tok.dtype))
        # (bug) keep_mask only ends up in an attention mask that is never passed to the transformer
        query = self.learned_query.expand(b, 1, -1)
        tokens = torch.cat((text_tok, time_tok, image_tok, query), dim=1)
        causal = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        return self.causal_transformer(tokens, mask=causal)[:, -1]


_C13_T = 50
_C13_BETAS = torch.linspace(1e-4, 0.02, _C13_T)
_C13_ACP = torch.cumprod(1 - _C13_BETAS, 0)
_C13_IMG = torch.randn(8, 16, generator=_gen(1301))
_C13_TXT = torch.randn(8, 16, generator=_gen(1302))


def _c13_build(bug: bool) -> Case:
    """Diffusion prior p_losses (predict x_start, l2) with cond_drop_prob=0.2 for classifier-free guidance."""
    torch.manual_seed(0)
    net = _PriorNet(bug).train()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    gen = _gen(1303)

    def p_losses() -> torch.Tensor:
        t = torch.randint(0, _C13_T, (_C13_IMG.shape[0],), generator=gen)
        noise = torch.randn(_C13_IMG.shape, generator=gen)
        a = _C13_ACP[t][:, None]
        x_noisy = a.sqrt() * _C13_IMG + (1 - a).sqrt() * noise
        pred = net(x_noisy, t, _C13_TXT, 0.2, gen)
        return F.mse_loss(pred, _C13_IMG)

    return net, _sgd_step(net, opt, p_losses), _kw(optimizer=opt, inputs=(_C13_IMG, _C13_TXT))


def _c13_proof(bug: bool) -> bool:
    """Asking the network to drop the condition for every sample (cond_drop_prob=1) gives exactly the same
    predictions as keeping it (cond_drop_prob=0): the unconditional branch does not exist in training."""
    net, _, _ = _c13_build(bug)
    net.eval()
    t = torch.arange(8) * 5
    with torch.no_grad():
        kept = net(_C13_IMG, t, _C13_TXT, 0.0, _gen(1))
        dropped = net(_C13_IMG, t, _C13_TXT, 1.0, _gen(1))
    return float((kept - dropped).abs().max()) == 0.0


# --------------------------------------------------------------------------------------------- case-14
# skillful_nowcasting (DGMR, a LightningModule GAN) issue #12: in `training_step` the generator's adversarial term is
# `loss_hinge_gen(torch.cat(generated_sequence, dim=0))`, i.e. the hinge loss is applied to the generated
# precipitation frames themselves instead of the discriminator's scores on them, so the generator is pushed to raise
# its output values and never receives any signal from the discriminator. The maintainer pushed the fix: score each
# generated sequence with the discriminator (concatenated with the real one) and apply loss_hinge_gen to the scores.


def _loss_hinge_disc(score_real: torch.Tensor, score_generated: torch.Tensor) -> torch.Tensor:
    return F.relu(1.0 - score_real).mean() + F.relu(1.0 + score_generated).mean()


def _loss_hinge_gen(score_generated: torch.Tensor) -> torch.Tensor:
    return -torch.mean(score_generated)


def _grid_cell_regularizer(generated_samples: torch.Tensor, batch_targets: torch.Tensor) -> torch.Tensor:
    gen_mean = torch.mean(generated_samples, dim=0)
    weights = torch.clip(batch_targets, 0.0, 24.0)
    return torch.mean(torch.abs(gen_mean - batch_targets) * weights)


class _NowcastGenerator(nn.Module):
    """Context frames (B, 4, 1, 8, 8) plus a latent noise map to 2 future frames (B, 2, 1, 8, 8)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear((4 + 1) * 64, 64), nn.ReLU(), nn.Linear(64, 2 * 64))

    def forward(self, images: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        x = torch.cat([images[:, :, 0], noise], dim=1).flatten(1)
        return F.softplus(self.net(x)).view(-1, 2, 1, 8, 8)


class _NowcastDiscriminator(nn.Module):
    """Scores a whole 6-frame sequence (context + future)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(6 * 64, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))

    def forward(self, seq: torch.Tensor) -> torch.Tensor:
        return self.net(seq[:, :, 0])


class _DGMR(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.generator = _NowcastGenerator()
        self.discriminator = _NowcastDiscriminator()


_C14_IMAGES = torch.rand(3, 4, 1, 8, 8, generator=_gen(1401)) * 4
_C14_FUTURE = torch.rand(3, 2, 1, 8, 8, generator=_gen(1402)) * 4


def _c14_generator_loss(model: _DGMR, gen: torch.Generator, bug: bool) -> torch.Tensor:
    images, future = _C14_IMAGES, _C14_FUTURE
    predictions = [model.generator(images, torch.randn(images.shape[0], 1, 8, 8, generator=gen)) for _ in range(2)]
    grid_cell_reg = _grid_cell_regularizer(torch.stack(predictions, dim=0), future)
    generated_sequence = [torch.cat([images, x], dim=1) for x in predictions]
    real_sequence = torch.cat([images, future], dim=1)
    if bug:
        generator_disc_loss = _loss_hinge_gen(torch.cat(generated_sequence, dim=0))
    else:
        generated_scores = []
        for g_seq in generated_sequence:
            concatenated_inputs = torch.cat([real_sequence, g_seq], dim=0)
            concatenated_outputs = model.discriminator(concatenated_inputs)
            _, score_generated = torch.split(concatenated_outputs, [real_sequence.shape[0], g_seq.shape[0]], dim=0)
            generated_scores.append(score_generated)
        generator_disc_loss = _loss_hinge_gen(torch.cat(generated_scores, dim=0))
    return generator_disc_loss + 20.0 * grid_cell_reg


def _c14_build(bug: bool) -> Case:
    """DGMR-style manual-optimisation GAN step: one hinge discriminator update, then one generator update."""
    torch.manual_seed(0)
    model = _DGMR().train()
    g_opt = torch.optim.Adam(model.generator.parameters(), lr=5e-5, betas=(0.0, 0.999))
    d_opt = torch.optim.Adam(model.discriminator.parameters(), lr=2e-4, betas=(0.0, 0.999))
    gen = _gen(1403)

    def training_step() -> torch.Tensor:
        images, future = _C14_IMAGES, _C14_FUTURE
        predictions = model.generator(images, torch.randn(images.shape[0], 1, 8, 8, generator=gen))
        generated_sequence = torch.cat([images, predictions.detach()], dim=1)
        real_sequence = torch.cat([images, future], dim=1)
        concatenated_outputs = model.discriminator(torch.cat([real_sequence, generated_sequence], dim=0))
        score_real, score_generated = torch.split(concatenated_outputs, [images.shape[0]] * 2, dim=0)
        discriminator_loss = _loss_hinge_disc(score_real, score_generated)
        d_opt.zero_grad()
        discriminator_loss.backward()
        d_opt.step()

        generator_loss = _c14_generator_loss(model, gen, bug)
        g_opt.zero_grad()
        generator_loss.backward()
        g_opt.step()
        return generator_loss

    return model, training_step, _kw(optimizer=g_opt, inputs=_C14_IMAGES)


def _c14_proof(bug: bool) -> bool:
    """The generator's gradient does not depend on the discriminator at all: re-initialising the discriminator
    leaves every generator gradient exactly the same."""
    model = cast(_DGMR, _c14_build(bug)[0])

    def g_grads() -> list[torch.Tensor]:
        model.zero_grad()
        _c14_generator_loss(model, _gen(7), bug).backward()
        return [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                for p in model.generator.parameters()]

    a = g_grads()
    with torch.no_grad():
        for p in model.discriminator.parameters():
            p.add_(torch.randn(p.shape, generator=_gen(8)))
    b = g_grads()
    return all(torch.equal(x, y) for x, y in zip(a, b))


# --------------------------------------------------------------------------------------------- case-15
# Imagination-Augmented-Agents (I2A, PyTorch notebooks) issue #7: after the A2C update of the agent, the distilled
# rollout policy is trained with `distil_optimizer.zero_grad(); distil_loss.backward(); optimizer.step()` -- the
# agent's optimizer is stepped instead of the distillation optimizer, so the distilled policy never moves from its
# random initialisation (and the agent takes a second RMSprop step on its stale gradients). The fix in the thread:
# `distil_optimizer.step()`. (Both sides write the distillation term as the standard cross-entropy to the agent's
# detached policy, so the twin is a healthy distillation.)


class _ActorCritic(nn.Module):
    def __init__(self, obs_dim: int = 10, n_actions: int = 5) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Linear(obs_dim, 32), nn.ReLU())
        self.actor = nn.Linear(32, n_actions)
        self.critic = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        f = self.features(x)
        return self.actor(f), self.critic(f)


class _I2AAgents(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.actor_critic = _ActorCritic()
        self.distil_policy = _ActorCritic()


_C15_STATES = torch.randn(16, 10, generator=_gen(1501))
_C15_ACTIONS = torch.randint(0, 5, (16,), generator=_gen(1502))
_C15_RETURNS = torch.randn(16, 1, generator=_gen(1503))


def _c15_build(bug: bool) -> Case:
    """A2C update of the agent followed by a distillation update of the rollout policy toward the agent's policy."""
    torch.manual_seed(0)
    model = _I2AAgents().train()
    optimizer = torch.optim.RMSprop(model.actor_critic.parameters(), 7e-4, eps=1e-5, alpha=0.99)
    distil_optimizer = torch.optim.Adam(model.distil_policy.parameters())

    def update() -> torch.Tensor:
        logit, values = model.actor_critic(_C15_STATES)
        log_probs = F.log_softmax(logit, dim=1)
        action_log_probs = log_probs.gather(1, _C15_ACTIONS[:, None])
        entropy = -(log_probs.exp() * log_probs).sum(1).mean()
        distil_logit, _ = model.distil_policy(_C15_STATES)
        distil_loss = 0.01 * -(F.softmax(logit, dim=1).detach() * F.log_softmax(distil_logit, dim=1)).sum(1).mean()

        advantages = _C15_RETURNS - values
        value_loss = advantages.pow(2).mean()
        action_loss = -(advantages.detach() * action_log_probs).mean()
        optimizer.zero_grad()
        loss = value_loss * 0.5 + action_loss - entropy * 0.01
        loss.backward()
        nn.utils.clip_grad_norm_(model.actor_critic.parameters(), 0.5)
        optimizer.step()

        distil_optimizer.zero_grad()
        distil_loss.backward()
        if bug:
            optimizer.step()
        else:
            distil_optimizer.step()
        return loss

    return model, update, _kw(optimizer=optimizer, inputs=_C15_STATES)


def _c15_proof(bug: bool) -> bool:
    """After three updates the distilled policy is bit-for-bit at its initialisation although it gets a nonzero
    distillation gradient every update."""
    built, update, _ = _c15_build(bug)
    model = cast(_I2AAgents, built)
    before = [p.detach().clone() for p in model.distil_policy.parameters()]
    grad_seen = 0.0
    for _ in range(3):
        update()
        grad_seen += sum(float(p.grad.abs().sum()) for p in model.distil_policy.parameters() if p.grad is not None)
    unchanged = all(torch.equal(b, p.detach()) for b, p in zip(before, model.distil_policy.parameters()))
    return unchanged and grad_seen > 0.0


CASES: list[BlindCase] = [
    BlindCase("b19-case-11", "https://github.com/Farama-Foundation/Gymnasium/issues/1336", "policy gradient credit",
              "The REINFORCE loss multiplies the episode's MEAN log-probability by each return, so every action "
              "gets the same credit instead of its own return-to-go.", _c11_build, _c11_proof,
              known_miss="REINFORCE with the episode's mean log-probability times each return: every action gets the same credit; per-sample credit in a policy-gradient loss is not measured"),
    BlindCase("b19-case-12", "https://github.com/Lightning-AI/pytorch-lightning/issues/17957",
              "gradient accumulation scaling",
              "Manual-optimisation gradient accumulation backpropagates the unscaled loss of each of the N "
              "batches, so every update uses N times the mean gradient.", _c12_build, _c12_proof),
    BlindCase("b19-case-13", "https://github.com/lucidrains/DALLE2-pytorch/issues/235",
              "classifier-free guidance dropout",
              "The condition-drop mask of the diffusion prior is built but never applied, so the text conditioning "
              "is never dropped and the unconditional branch is never trained.", _c13_build, _c13_proof),
    BlindCase("b19-case-14", "https://github.com/openclimatefix/skillful_nowcasting/issues/12",
              "GAN generator loss",
              "The generator's hinge loss is applied to its generated frames instead of the discriminator's scores, "
              "so the generator gets no adversarial signal.", _c14_build, _c14_proof,
              known_miss="the generator's hinge loss is applied to the generated frames instead of the discriminator's scores: the generator still gets a gradient, from a wrong objective that the audit cannot tell from a reconstruction term"),
    BlindCase("b19-case-15", "https://github.com/higgsfield/Imagination-Augmented-Agents/issues/7",
              "wrong optimizer stepped (distillation)",
              "After the distillation backward the agent's optimizer is stepped instead of the distillation "
              "optimizer, so the distilled policy never trains.", _c15_build, _c15_proof),
]
