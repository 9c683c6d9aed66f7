"""Blind batch 12, part b: silent training bugs from public GitHub threads of research code, each with its fixed twin.

Collected by someone who does not write the audit's checks. Every case builds the user's setup on a tiny real
model in plain torch (a ReStyle/e4e StyleGAN-inversion encoder with a frozen generator and a latent
discriminator, a GRU text VAE with a CNN attribute discriminator (Hu et al.'s controlled generation), a YourTTS
style waveform generator with a frozen speaker encoder, a DDGM diffusion model of MLPs and an SRGAN super-
resolution generator); nothing is downloaded) and proves the bug without the audit on real runs and real tensors.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw, _sgd_step

# --------------------------------------------------------------------------------------------- case-06
# ReStyle e4e coach: the id-loss line reads `loss = ...` instead of `loss += ...`, so the adversarial latent loss
# and the delta regularisation added just before it are thrown away

_C06_NLAT, _C06_W = 4, 16
_C06_X = torch.rand(4, 3, 16, 16, generator=_gen(1201)) * 2 - 1
_C06_LAMBDA = {"w_discriminator": 0.1, "delta_norm": 2e-2, "id": 0.1, "l2": 1.0}


class _E4EEncoder(nn.Module):
    """A conv encoder giving a base w plus per-style-layer deltas (e4e's progressive latent codes)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1), nn.LeakyReLU(0.2), nn.Conv2d(16, 32, 3, 2, 1),
                                  nn.LeakyReLU(0.2), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.w0 = nn.Linear(32, _C06_W)
        self.deltas = nn.Linear(32, (_C06_NLAT - 1) * _C06_W)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        w0 = self.w0(h).unsqueeze(1)
        return torch.cat([w0, w0 + self.deltas(h).view(-1, _C06_NLAT - 1, _C06_W)], 1)


class _PSp(nn.Module):
    """The net: trainable encoder, frozen StyleGAN-like decoder from the latent codes to an image."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = _E4EEncoder()
        self.decoder = nn.Sequential(nn.Flatten(), nn.Linear(_C06_NLAT * _C06_W, 64), nn.LeakyReLU(0.2),
                                     nn.Linear(64, 3 * 16 * 16), nn.Tanh())
        for p in self.decoder.parameters():
            p.requires_grad = False

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        latent = self.encoder(x)
        return self.decoder(latent).view(-1, 3, 16, 16), latent


def _c06_parts() -> tuple[nn.Module, nn.Module]:
    disc = nn.Sequential(nn.Linear(_C06_W, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
    id_net = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
    for p in list(disc.parameters()) + list(id_net.parameters()):
        p.requires_grad = False
    return disc, id_net.eval()


def _c06_terms(net: _PSp, disc: nn.Module, id_net: nn.Module) -> dict[str, torch.Tensor]:
    y_hat, latent = net(_C06_X)
    adv = sum(F.softplus(-disc(latent[:, i, :])).mean() for i in range(_C06_NLAT)) / _C06_NLAT
    delta = sum(torch.norm(latent[:, i, :] - latent[:, 0, :], 2, dim=1).mean() for i in range(1, _C06_NLAT))
    ident = (1 - F.cosine_similarity(id_net(y_hat), id_net(_C06_X).detach(), dim=1)).mean()
    return {"w_discriminator": adv, "delta_norm": delta, "id": ident, "l2": F.mse_loss(y_hat, _C06_X)}


def _c06_calc_loss(terms: dict[str, torch.Tensor], bug: bool) -> torch.Tensor:
    loss: torch.Tensor | float = 0.0
    loss = loss + _C06_LAMBDA["w_discriminator"] * terms["w_discriminator"]
    loss = loss + _C06_LAMBDA["delta_norm"] * terms["delta_norm"]
    if bug:
        loss = terms["id"] * _C06_LAMBDA["id"]  # the report: `loss = loss_id * id_lambda`
    else:
        loss = loss + terms["id"] * _C06_LAMBDA["id"]
    loss = loss + terms["l2"] * _C06_LAMBDA["l2"]
    assert isinstance(loss, torch.Tensor)
    return loss


def _c06_build(bug: bool) -> Case:
    torch.manual_seed(0)
    net = _PSp().train()
    disc, id_net = _c06_parts()
    opt = torch.optim.Adam(list(net.encoder.parameters()), lr=1e-4)
    return net, _sgd_step(net, opt, lambda: _c06_calc_loss(_c06_terms(net, disc, id_net), bug)), \
        _kw(optimizer=opt, inputs=_C06_X)


def _c06_proof(bug: bool) -> bool:
    """The loss the encoder is trained on equals the id + l2 terms alone: the (non-zero) adversarial and delta
    terms computed before it do not reach it, and its gradient on the encoder is that of id + l2 only."""
    torch.manual_seed(0)
    net = _PSp().train()
    disc, id_net = _c06_parts()
    terms = _c06_terms(net, disc, id_net)
    loss = _c06_calc_loss(terms, bug)
    partial = _C06_LAMBDA["id"] * terms["id"] + _C06_LAMBDA["l2"] * terms["l2"]
    dropped = _C06_LAMBDA["w_discriminator"] * terms["w_discriminator"] + _C06_LAMBDA["delta_norm"] * terms["delta_norm"]
    params = list(net.encoder.parameters())
    g_loss = torch.autograd.grad(loss, params, retain_graph=True)
    g_part = torch.autograd.grad(partial, params, retain_graph=True)
    same_grad = all(torch.allclose(a, b, atol=1e-9) for a, b in zip(g_loss, g_part))
    return bool(float(dropped.detach()) > 1e-3 and torch.allclose(loss, partial) and same_grad)


# --------------------------------------------------------------------------------------------- case-07
# controlled text generation (Hu et al. 2017): the generator's optimizer is built on the encoder's parameters and
# the encoder's on the decoder's, so the attribute losses of eq. 8 update the encoder and never the decoder

_C07_V, _C07_H, _C07_Z, _C07_C, _C07_L, _C07_B = 30, 16, 8, 2, 7, 4
_C07_IDS = torch.randint(4, _C07_V, (_C07_L, _C07_B), generator=_gen(1211))  # seq_len x batch, as in the repo
_C07_IDS[0] = 2  # <start>
_C07_LABELS = torch.tensor([0, 1, 1, 0])
_C07_EPS = torch.randn(_C07_B, _C07_Z, generator=_gen(1212))
_C07_ZP = torch.randn(_C07_B, _C07_Z, generator=_gen(1213))
_C07_CP = torch.tensor([0, 1, 0, 1])


class _RNNVAE(nn.Module):
    """GRU encoder to (mu, logvar), GRU decoder fed [emb, z, c], Kim-CNN attribute discriminator."""

    def __init__(self) -> None:
        super().__init__()
        self.word_emb = nn.Embedding(_C07_V, _C07_H, 1)
        self.encoder = nn.GRU(_C07_H, _C07_H)
        self.q_mu, self.q_logvar = nn.Linear(_C07_H, _C07_Z), nn.Linear(_C07_H, _C07_Z)
        self.decoder = nn.GRU(_C07_H + _C07_Z + _C07_C, _C07_Z + _C07_C)
        self.decoder_fc = nn.Linear(_C07_Z + _C07_C, _C07_V)
        self.conv3 = nn.Conv2d(1, 8, (3, _C07_H))
        self.disc_fc = nn.Linear(8, _C07_C)
        self.discriminator = nn.ModuleList([self.conv3, self.disc_fc])

    def encoder_params(self) -> list[nn.Parameter]:
        return [*self.encoder.parameters(), *self.q_mu.parameters(), *self.q_logvar.parameters()]

    def decoder_params(self) -> list[nn.Parameter]:
        return [*self.decoder.parameters(), *self.decoder_fc.parameters()]

    def forward_encoder_embed(self, emb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        _, h = self.encoder(emb)
        return self.q_mu(h[-1]), self.q_logvar(h[-1])

    def forward_discriminator_embed(self, emb_bt: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.conv3(emb_bt.unsqueeze(1))).squeeze(3).max(2).values
        return self.disc_fc(h)

    def forward_decoder(self, emb: torch.Tensor, z: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        zc = torch.cat([z, c], 1)
        out, _ = self.decoder(torch.cat([emb, zc.unsqueeze(0).expand(emb.size(0), -1, -1)], 2), zc.unsqueeze(0))
        return self.decoder_fc(out)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """recon and KL losses with c ~ q(c|x) (the discriminator's softmax)."""
        emb = self.word_emb(ids)
        mu, logvar = self.forward_encoder_embed(emb)
        z = mu + torch.exp(0.5 * logvar) * _C07_EPS
        c = F.softmax(self.forward_discriminator_embed(emb.transpose(0, 1)), 1)
        logits = self.forward_decoder(emb[:-1], z, c)
        recon = F.cross_entropy(logits.reshape(-1, _C07_V), ids[1:].reshape(-1))
        kl = torch.mean(0.5 * torch.sum(torch.exp(logvar) + mu ** 2 - 1 - logvar, 1))
        return recon, kl

    def generate_soft_embed(self, temp: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Soft word embeddings (softmax(logits / temp) @ emb) decoded from z, c ~ p(z) p(c)."""
        c = F.one_hot(_C07_CP, _C07_C).float()
        zc = torch.cat([_C07_ZP, c], 1)
        h = zc.unsqueeze(0)
        word = self.word_emb(torch.full((1, _C07_B), 2, dtype=torch.long))
        embs = []
        for _ in range(_C07_L):
            out, h = self.decoder(torch.cat([word, zc.unsqueeze(0)], 2), h)
            word = (F.softmax(self.decoder_fc(out) / temp, -1) @ self.word_emb.weight)
            embs.append(word)
        return torch.cat(embs, 0).transpose(0, 1), _C07_ZP, _C07_CP


def _c07_loss_g(model: _RNNVAE) -> torch.Tensor:
    recon, kl = model(_C07_IDS)
    x_gen, target_z, target_c = model.generate_soft_embed(temp=0.5)
    y_z, _ = model.forward_encoder_embed(x_gen.transpose(0, 1))
    y_c = model.forward_discriminator_embed(x_gen)
    return recon + 1.0 * kl + 0.1 * F.cross_entropy(y_c, target_c) + 0.1 * F.mse_loss(y_z, target_z)


def _c07_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _RNNVAE().train()
    trainer_d = torch.optim.Adam(model.discriminator.parameters(), lr=1e-3)
    enc, dec = model.encoder_params(), model.decoder_params()
    trainer_g = torch.optim.Adam(enc if bug else dec, lr=1e-3)  # the report: G built on encoder_params
    trainer_e = torch.optim.Adam(dec if bug else enc, lr=1e-3)

    def step() -> torch.Tensor:
        # discriminator, eq. 11 (supervised part on the real batch)
        y_real = model.forward_discriminator_embed(model.word_emb(_C07_IDS).transpose(0, 1))
        F.cross_entropy(y_real, _C07_LABELS).backward()
        trainer_d.step()
        trainer_d.zero_grad()
        # generator, eq. 8
        loss_g = _c07_loss_g(model)
        loss_g.backward()
        torch.nn.utils.clip_grad_norm_(dec, 5)
        trainer_g.step()
        trainer_g.zero_grad()
        # encoder, eq. 4
        recon, kl = model(_C07_IDS)
        (recon + kl).backward()
        torch.nn.utils.clip_grad_norm_(enc, 5)
        trainer_e.step()
        trainer_e.zero_grad()
        return loss_g

    return model, step, _kw(optimizer=trainer_g, inputs=_C07_IDS)


def _c07_proof(bug: bool) -> bool:
    """The generator update (eq. 8: trainer_G.step() after loss_G.backward()) leaves every decoder weight as it
    was: the optimizer stepped on the generator objective does not hold the decoder's parameters."""
    model, _, kwargs = _c07_build(bug)
    trainer_g = kwargs["optimizer"]
    before = [p.detach().clone() for p in model.decoder_params()]
    _c07_loss_g(model).backward()
    trainer_g.step()
    return all(torch.equal(b, p) for b, p in zip(before, model.decoder_params()))


# --------------------------------------------------------------------------------------------- case-08
# YourTTS speaker consistency loss: the speaker encoder computes its spectrogram under torch.no_grad(), so the
# SCL term is a constant and sends no gradient to the generator

_C08_Z = torch.randn(2, 8, 16, generator=_gen(1221))
_C08_WAV = torch.randn(2, 1, 256, generator=_gen(1222)) * 0.3
_C08_SCL_ALPHA = 9.0


class _WaveGen(nn.Module):
    """A HiFi-GAN-like decoder: latent frames upsampled x16 to a waveform."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Conv1d(8, 32, 3, padding=1)
        self.up1 = nn.ConvTranspose1d(32, 16, 8, 4, 2)
        self.up2 = nn.ConvTranspose1d(16, 8, 8, 4, 2)
        self.post = nn.Conv1d(8, 1, 7, padding=3)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = F.leaky_relu(self.up1(F.leaky_relu(self.pre(z), 0.1)), 0.1)
        return torch.tanh(self.post(F.leaky_relu(self.up2(h), 0.1)))


class _SpeakerEncoder(nn.Module):
    """ResNet-speaker-encoder stand-in: torch spectrogram front-end, conv body, attentive pooling, fc."""

    def __init__(self, no_grad_frontend: bool) -> None:
        super().__init__()
        self.no_grad_frontend = no_grad_frontend
        self.register_buffer("window", torch.hann_window(64))
        self.instancenorm = nn.InstanceNorm1d(33)
        self.conv = nn.Conv1d(33, 32, 3, padding=1)
        self.attention = nn.Conv1d(32, 1, 1)
        self.fc = nn.Linear(32, 16)

    def torch_spec(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stft(x, 64, 16, window=self.window, return_complex=True).abs()

    def frontend(self, x: torch.Tensor) -> torch.Tensor:
        x = self.torch_spec(x.squeeze(1))
        return self.instancenorm((x + 1e-6).log())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.no_grad_frontend:
            with torch.no_grad():
                x = self.frontend(x)
        else:
            x = self.frontend(x)
        h = F.relu(self.conv(x))
        w = torch.softmax(self.attention(h), dim=2)
        return self.fc(torch.sum(h * w, dim=2))


class _YourTTSish(nn.Module):
    def __init__(self, bug: bool) -> None:
        super().__init__()
        self.waveform_decoder = _WaveGen()
        self.speaker_manager_encoder = _SpeakerEncoder(no_grad_frontend=bug).eval()
        for p in self.speaker_manager_encoder.parameters():
            p.requires_grad = False

    def train(self, mode: bool = True) -> _YourTTSish:
        super().train(mode)
        self.speaker_manager_encoder.eval()
        return self

    def forward(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        wav_hat = self.waveform_decoder(z)
        emb_hat = self.speaker_manager_encoder(wav_hat)
        emb_gt = self.speaker_manager_encoder(_C08_WAV)
        return wav_hat, emb_gt, emb_hat


def _c08_losses(model: _YourTTSish) -> tuple[torch.Tensor, torch.Tensor]:
    wav_hat, emb_gt, emb_hat = model(_C08_Z)
    recon = F.l1_loss(wav_hat, _C08_WAV)
    scl = -F.cosine_similarity(emb_gt, emb_hat).mean() * _C08_SCL_ALPHA
    return recon, scl


def _c08_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _YourTTSish(bug).train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-4, betas=(0.8, 0.99))

    def loss() -> torch.Tensor:
        recon, scl = _c08_losses(model)
        return recon + scl

    return model, _sgd_step(model, opt, loss), _kw(optimizer=opt, inputs=_C08_Z)


def _c08_proof(bug: bool) -> bool:
    """The speaker consistency term (a non-constant function of the generated waveform) has no autograd path to
    the generator: it does not require grad, so its gradient on the generator weights is zero."""
    model, _, _ = _c08_build(bug)
    _, scl = _c08_losses(model)
    if not scl.requires_grad:
        return True
    grads = torch.autograd.grad(scl, list(model.waveform_decoder.parameters()), allow_unused=True)
    return all(g is None or float(g.abs().max()) == 0.0 for g in grads)


# --------------------------------------------------------------------------------------------- case-09
# DDGM (diffusion-based deep generative model): the reverse-diffusion networks are kept in a plain python list,
# so model.parameters() and the optimizer see only the final decoder

_C09_D, _C09_M, _C09_T, _C09_BETA = 16, 32, 3, 0.9
_C09_X = torch.rand(8, _C09_D, generator=_gen(1231)) * 2 - 1
_LOG2PI = math.log(2 * math.pi)


def _c09_log_normal_diag(x: torch.Tensor, mu: torch.Tensor, log_var: torch.Tensor) -> torch.Tensor:
    return -0.5 * _LOG2PI - 0.5 * log_var - 0.5 * torch.exp(-log_var) * (x - mu) ** 2


def _c09_log_standard_normal(x: torch.Tensor) -> torch.Tensor:
    return -0.5 * _LOG2PI - 0.5 * x ** 2


class _DDGM(nn.Module):
    def __init__(self, p_dnns: list[nn.Module], decoder_net: nn.Module, bug: bool) -> None:
        super().__init__()
        self.p_dnns = p_dnns if bug else nn.ModuleList(p_dnns)  # the report: `self.p_dnns = p_dnns`
        self.decoder_net = decoder_net
        self.register_buffer("beta", torch.tensor([_C09_BETA]))

    def diffuse(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(1. - self.beta) * x + torch.sqrt(self.beta) * torch.randn_like(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        zs = [self.diffuse(x)]
        for _ in range(1, _C09_T):
            zs.append(self.diffuse(zs[-1]))
        mus, log_vars = [], []
        for i in range(len(self.p_dnns) - 1, -1, -1):
            mu_i, log_var_i = torch.chunk(self.p_dnns[i](zs[i + 1]), 2, dim=1)
            mus.append(mu_i)
            log_vars.append(log_var_i)
        mu_x = self.decoder_net(zs[0])
        re = _c09_log_standard_normal(x - mu_x).sum(-1)
        kl = (_c09_log_normal_diag(zs[-1], torch.sqrt(1. - self.beta) * zs[-1], torch.log(self.beta))
              - _c09_log_standard_normal(zs[-1])).sum(-1)
        for i in range(len(mus)):
            kl = kl + (_c09_log_normal_diag(zs[i], torch.sqrt(1. - self.beta) * zs[i], torch.log(self.beta))
                       - _c09_log_normal_diag(zs[i], mus[i], log_vars[i])).sum(-1)
        return -(re - kl).mean()


def _c09_build(bug: bool) -> Case:
    torch.manual_seed(0)
    p_dnns = [nn.Sequential(nn.Linear(_C09_D, _C09_M), nn.LeakyReLU(), nn.Linear(_C09_M, _C09_M), nn.LeakyReLU(),
                            nn.Linear(_C09_M, 2 * _C09_D)) for _ in range(_C09_T - 1)]
    decoder_net = nn.Sequential(nn.Linear(_C09_D, _C09_M * 2), nn.LeakyReLU(), nn.Linear(_C09_M * 2, _C09_D),
                                nn.Tanh())
    model = _DDGM(p_dnns, decoder_net, bug).train()
    opt = torch.optim.Adamax([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    return model, _sgd_step(model, opt, lambda: model(_C09_X)), _kw(optimizer=opt, inputs=_C09_X)


def _c09_proof(bug: bool) -> bool:
    """After a training step the reverse-diffusion networks received gradients but their weights did not move."""
    model, step, _ = _c09_build(bug)
    torch.manual_seed(1)
    p_dnn_params = [p for m in model.p_dnns for p in m.parameters()]
    before = [p.detach().clone() for p in p_dnn_params]
    step()
    got_grad = all(p.grad is not None and float(p.grad.abs().sum()) > 0 for p in p_dnn_params)
    return got_grad and all(torch.equal(b, p) for b, p in zip(before, p_dnn_params))


# --------------------------------------------------------------------------------------------- case-10
# SRGAN training: StepLR(step_size=epochs // 2, gamma=0.1) meant per epoch is stepped after every iteration, so
# the learning rate falls 10x every few batches and training stalls within the first epoch

_C10_EPOCHS, _C10_ITERS = 4, 6
_C10_LR_IMG = torch.rand(2, 3, 8, 8, generator=_gen(1241))
_C10_HR_IMG = F.interpolate(_C10_LR_IMG, scale_factor=2, mode="bilinear", align_corners=False) \
    + 0.05 * torch.randn(2, 3, 16, 16, generator=_gen(1242))


class _SRResBlock(nn.Module):
    def __init__(self, ch: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(ch, ch, 3, 1, 1, bias=False), nn.BatchNorm2d(ch), nn.PReLU(),
                                  nn.Conv2d(ch, ch, 3, 1, 1, bias=False), nn.BatchNorm2d(ch))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


class _SRGenerator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Sequential(nn.Conv2d(3, 16, 9, 1, 4), nn.PReLU())
        self.trunk = nn.Sequential(_SRResBlock(16), _SRResBlock(16))
        self.conv2 = nn.Sequential(nn.Conv2d(16, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16))
        self.up = nn.Sequential(nn.Conv2d(16, 64, 3, 1, 1), nn.PixelShuffle(2), nn.PReLU())
        self.conv3 = nn.Conv2d(16, 3, 9, 1, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(x)
        return self.conv3(self.up(h + self.conv2(self.trunk(h))))


def _c10_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _SRGenerator().train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.999))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=_C10_EPOCHS // 2, gamma=0.1)
    state = {"it": 0}

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = F.mse_loss(model(_C10_LR_IMG), _C10_HR_IMG)
        loss.backward()
        opt.step()
        state["it"] += 1
        if bug or state["it"] % _C10_ITERS == 0:  # the fix: step the scheduler once per epoch
            sched.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=_C10_LR_IMG, lr_scheduler=sched,
                            total_steps=_C10_EPOCHS * _C10_ITERS)


def _c10_proof(bug: bool) -> bool:
    """Within the first epoch (fewer iterations than one epoch) the learning rate has already decayed below the
    initial one: the epoch-sized StepLR is counting iterations."""
    _model, step, kwargs = _c10_build(bug)
    opt = kwargs["optimizer"]
    for _ in range(_C10_ITERS - 1):
        step()
    return bool(opt.param_groups[0]["lr"] < 1e-4 * 0.5)


CASES: list[BlindCase] = [
    BlindCase("b12-case-06", "https://github.com/yuval-alaluf/restyle-encoder/issues/40", "loss term overwritten",
              "the id-loss line assigns `loss = loss_id * id_lambda` instead of adding to it: the e4e adversarial "
              "latent loss and the delta regularisation accumulated before it are silently dropped from the "
              "encoder's objective", _c06_build, _c06_proof,
              known_miss="blind batch 12: the overwritten terms are computed with gradients but left out of the backward; a loss term computed and dropped is not judged (a metric computed with grad for logging looks the same)"),
    BlindCase("b12-case-07", "https://github.com/wiseodd/controlled-text-generation/issues/15",
              "optimizers on swapped parameter sets",
              "trainer_G is built on the encoder's parameters and trainer_E on the decoder's: the generator "
              "objective with its attribute losses moves the encoder, and the decoder never gets its eq. 8 update",
              _c07_build, _c07_proof,
              known_alarm=("LOOP-014", "OPT-001")),
    BlindCase("b12-case-08", "https://github.com/coqui-ai/TTS/issues/2348", "no_grad cuts a loss term",
              "the speaker encoder's spectrogram front-end runs under torch.no_grad(): the speaker consistency loss "
              "is added to the total but is a constant, so it sends no gradient to the generator", _c08_build,
              _c08_proof),
    BlindCase("b12-case-09", "https://github.com/jmtomczak/intro_dgm/issues/6", "unregistered submodules",
              "the reverse-diffusion networks p_dnns sit in a plain python list: model.parameters() and the "
              "optimizer see only the final decoder, and the denoising networks stay at their random init",
              _c09_build, _c09_proof),
    BlindCase("b12-case-10", "https://github.com/Lornatang/SRGAN-PyTorch/issues/1", "lr scheduler stepping",
              "StepLR(step_size=epochs // 2) is stepped after every iteration instead of every epoch: the "
              "learning rate drops 10x every two batches and the generator stops learning early in epoch one",
              _c10_build, _c10_proof),
]
