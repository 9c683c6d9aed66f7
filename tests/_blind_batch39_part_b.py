"""Blind batch 39 (part b): silent training bugs in vision, audio and generative models, each with its fixed twin.

Collected by someone who does not write the audit's checks. Every case builds the user's setup on a tiny model
(plain torch VAEs, GANs, an object-centric MONet, a singing-voice duration predictor, a diffusion denoiser over the
embeddings of a transformers CLIP text encoder from a tiny config in code; nothing is downloaded) and proves the bug
without the audit on real tensors and real steps.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw

# --------------------------------------------------------------------------------------------- case-01
# dev4488/VAE_gumble_softmax issue #1: the Gumbel-softmax VAE's loss was `BCE + KLD` with
# `KLD = -torch.sum(qy * (log_qy - g))`, g = log(1/categorical_dim). qy * (log qy - log(1/K)) summed is already the KL
# divergence of the posterior from the uniform prior, so the extra minus makes the loss reward a large KL: the
# regulariser pushes every categorical posterior away from uniform instead of toward it. Nothing crashes and the loss
# keeps falling (it can go below the reconstruction term, the KL term being negative). The maintainer confirmed it and
# removed the minus (`KLD = torch.sum(qy * (log_qy - g), dim=-1).mean()`). Here the posterior softmax is taken per
# latent variable; the encoder, straight-through Gumbel sampling and Adam(lr=1e-3) follow the script.

_C01_LAT, _C01_CAT = 4, 5
_C01_X = (torch.rand(16, 24, generator=_gen(3901)) > 0.5).float()


class _GumbelVAE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(24, 32)
        self.fc2 = nn.Linear(32, _C01_LAT * _C01_CAT)
        self.fc3 = nn.Linear(_C01_LAT * _C01_CAT, 32)
        self.fc4 = nn.Linear(32, 24)

    def forward(self, x: torch.Tensor, temp: float, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        q = F.relu(self.fc2(F.relu(self.fc1(x))))
        q_y = q.view(q.size(0), _C01_LAT, _C01_CAT)
        u = torch.rand(q_y.shape, generator=g)
        y = F.softmax((q_y - torch.log(-torch.log(u + 1e-20) + 1e-20)) / temp, dim=-1)
        y_hard = F.one_hot(y.argmax(-1), _C01_CAT).float()
        z = ((y_hard - y).detach() + y).view(-1, _C01_LAT * _C01_CAT)  # straight-through Gumbel-softmax
        recon = torch.sigmoid(self.fc4(F.relu(self.fc3(z))))
        return recon, F.softmax(q_y, dim=-1).view(q.size(0), -1)


def _c01_loss(bug: bool, recon: torch.Tensor, x: torch.Tensor, qy: torch.Tensor) -> torch.Tensor:
    bce = F.binary_cross_entropy(recon, x, reduction="sum")
    g = math.log(1.0 / _C01_CAT)
    kld = torch.sum(qy * (torch.log(qy + 1e-20) - g), dim=-1).mean()
    return bce - kld if bug else bce + kld


def _c01_setup(bug: bool):
    torch.manual_seed(0)
    model = _GumbelVAE().train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = _gen(3902)

    def step() -> torch.Tensor:
        opt.zero_grad()
        recon, qy = model(_C01_X, 1.0, g)
        loss = _c01_loss(bug, recon, _C01_X, qy)
        loss.backward()
        opt.step()
        return loss

    return model, opt, step


def _c01_build(bug: bool) -> Case:
    model, opt, step = _c01_setup(bug)
    return model, step, _kw(optimizer=opt, inputs=_C01_X)


def _c01_proof(bug: bool) -> bool:
    """After two real steps, does the regulariser the loss adds equal minus the (non-negative) KL, i.e. is it < 0?"""
    model, _, step = _c01_setup(bug)
    step()
    step()
    with torch.no_grad():
        recon, qy = model(_C01_X, 1.0, _gen(3903))
        reg = _c01_loss(bug, recon, _C01_X, qy) - F.binary_cross_entropy(recon, _C01_X, reduction="sum")
        kl = torch.sum(qy * (torch.log(qy) - math.log(1.0 / _C01_CAT)), dim=-1).mean()
    return bool(kl > 1e-6 and reg < 0)


# --------------------------------------------------------------------------------------------- case-02
# huggingface/diffusers issue #3913 (fixed by PR #4395, "train dreambooth fix pre encode class prompt"): with
# --pre_compute_text_embeddings the DreamBooth script encodes only the instance prompt, and the dataset then hands that
# instance embedding out as `class_prompt_ids` for every class (prior-preservation) image. The prior-preservation half
# of each batch is therefore denoised under the instance prompt ("a photo of sks dog") instead of the class prompt
# ("a photo of dog"): the prior loss still falls, but it teaches the new token on generic class images rather than
# preserving the class prior. Fix: also pre-compute the class prompt embedding and use it for the class images.
# Tiny here: a CLIP text encoder (frozen, as pre-computation requires), a small cross-attention denoiser over 4x8x8
# latents, a 100-step DDPM noise schedule, MSE on the noise with prior_loss_weight=1.0, AdamW.

_C02_INST_IDS = torch.tensor([[1, 5, 9, 17, 23, 2, 0, 0]])  # "a photo of sks dog"
_C02_CLASS_IDS = torch.tensor([[1, 5, 9, 23, 2, 0, 0, 0]])  # "a photo of dog"
_C02_INST_LAT = torch.randn(2, 4, 8, 8, generator=_gen(3911))
_C02_CLASS_LAT = torch.randn(2, 4, 8, 8, generator=_gen(3912))
_C02_T = 100


class _TinyCondUNet(nn.Module):
    def __init__(self, ch: int = 16, ctx: int = 16) -> None:
        super().__init__()
        self.conv_in = nn.Conv2d(4, ch, 3, padding=1)
        self.time = nn.Linear(ch, ch)
        self.attn = nn.MultiheadAttention(ch, 2, kdim=ctx, vdim=ctx, batch_first=True)
        self.conv_out = nn.Conv2d(ch, 4, 3, padding=1)
        self.ch = ch

    def forward(self, x: torch.Tensor, t: torch.Tensor, encoder_hidden_states: torch.Tensor) -> torch.Tensor:
        half = self.ch // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half) / half)
        temb = self.time(torch.cat([torch.sin(t[:, None] * freqs), torch.cos(t[:, None] * freqs)], dim=-1))
        h = F.silu(self.conv_in(x) + temb[:, :, None, None])
        b, c, hh, ww = h.shape
        seq = h.flatten(2).transpose(1, 2)
        seq = seq + self.attn(seq, encoder_hidden_states, encoder_hidden_states, need_weights=False)[0]
        return self.conv_out(seq.transpose(1, 2).reshape(b, c, hh, ww))


def _c02_embeddings() -> tuple[torch.Tensor, torch.Tensor]:
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(0)
    cfg = CLIPTextConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, max_position_embeddings=8, pad_token_id=0, bos_token_id=1,
                         eos_token_id=2)
    text_encoder = CLIPTextModel(cfg).eval().requires_grad_(False)
    with torch.no_grad():  # compute_text_embeddings(prompt)
        inst = text_encoder(_C02_INST_IDS).last_hidden_state
        cls = text_encoder(_C02_CLASS_IDS).last_hidden_state
    return inst, cls


def _c02_setup(bug: bool):
    inst_emb, cls_emb = _c02_embeddings()
    # the dataset: `class_prompt_ids` is the pre-computed *instance* embedding in the bug, the class one after the fix
    class_prompt_emb = inst_emb if bug else cls_emb
    pixel = torch.cat([_C02_INST_LAT, _C02_CLASS_LAT])  # collate_fn: instance examples, then class examples
    ehs = torch.cat([inst_emb.expand(2, -1, -1), class_prompt_emb.expand(2, -1, -1)])
    torch.manual_seed(1)
    unet = _TinyCondUNet().train()
    opt = torch.optim.AdamW(unet.parameters(), lr=5e-4, weight_decay=1e-2)
    acp = torch.cumprod(1 - torch.linspace(1e-4, 0.02, _C02_T), 0)
    g = _gen(3913)

    def step() -> torch.Tensor:
        opt.zero_grad()
        noise = torch.randn(pixel.shape, generator=g)
        timesteps = torch.randint(0, _C02_T, (pixel.shape[0],), generator=g)
        a = acp[timesteps].view(-1, 1, 1, 1)
        noisy = a.sqrt() * pixel + (1 - a).sqrt() * noise
        model_pred = unet(noisy, timesteps.float(), ehs)
        model_pred, model_pred_prior = torch.chunk(model_pred, 2, dim=0)
        target, target_prior = torch.chunk(noise, 2, dim=0)
        loss = F.mse_loss(model_pred, target) + 1.0 * F.mse_loss(model_pred_prior, target_prior)
        loss.backward()
        opt.step()
        return loss

    return unet, opt, step, ehs, inst_emb


def _c02_build(bug: bool) -> Case:
    unet, opt, step, ehs, _ = _c02_setup(bug)
    return unet, step, _kw(optimizer=opt, inputs={"latents": torch.cat([_C02_INST_LAT, _C02_CLASS_LAT]),
                                                  "encoder_hidden_states": ehs})


def _c02_proof(bug: bool) -> bool:
    """In a real step, is the prior-preservation half of the batch conditioned on the instance prompt's embedding?"""
    unet, _, step, _, inst_emb = _c02_setup(bug)
    seen: list[torch.Tensor] = []
    handle = unet.register_forward_hook(lambda m, args, out: seen.append(args[2].detach().clone()))
    step()
    handle.remove()
    prior_cond = seen[0][2:]
    return bool(torch.allclose(prior_cond, inst_emb.expand_as(prior_cond)))


# --------------------------------------------------------------------------------------------- case-03
# GaParmar/img2img-turbo issue #56 (fixed by PR #62): in train_cyclegan_turbo.py the generator's adversarial loss
# `net_disc_a(fake_b, for_G=True)` is backpropagated through the discriminator too; the script then steps and zeroes
# only optimizer_gen, so the discriminator keeps those gradients and its next step (on the detached fakes) applies the
# generator's objective as well: the discriminator is partly trained to call the fakes real. Losses stay plausible.
# Fix in the PR: `optimizer_disc.zero_grad()` right after the generator's step. Tiny here: one direction (a -> b) of
# the CycleGAN, a conv generator and a patch discriminator with the vision-aided BCE objective; the cycle and identity
# objectives, which never reach the discriminator, are left out. Adam(lr=1e-3, betas=(0.5, 0.999)), constant schedules,
# grad clipping as in the script.

_C03_A = torch.rand(2, 3, 8, 8, generator=_gen(3921)) * 2 - 1
_C03_B = torch.rand(2, 3, 8, 8, generator=_gen(3922)) * 2 - 1


class _PatchDisc(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.LeakyReLU(0.2),
                                 nn.Conv2d(8, 1, 3, stride=2, padding=1))

    def forward(self, x: torch.Tensor, for_real: bool = True, for_G: bool = False) -> torch.Tensor:
        logits = self.net(x)
        target = torch.ones_like(logits) if (for_G or for_real) else torch.zeros_like(logits)
        return F.binary_cross_entropy_with_logits(logits, target)


class _CycleGANTurbo(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gen = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 3, 3, padding=1), nn.Tanh())
        self.net_disc_a = _PatchDisc()


def _c03_setup(bug: bool):
    torch.manual_seed(0)
    model = _CycleGANTurbo().train()
    gen, disc = model.gen, model.net_disc_a
    optimizer_gen = torch.optim.Adam(gen.parameters(), lr=1e-3, betas=(0.5, 0.999))
    optimizer_disc = torch.optim.Adam(disc.parameters(), lr=1e-3, betas=(0.5, 0.999))
    lr_scheduler_gen = torch.optim.lr_scheduler.LambdaLR(optimizer_gen, lambda s: 1.0)
    lr_scheduler_disc = torch.optim.lr_scheduler.LambdaLR(optimizer_disc, lambda s: 1.0)
    lambda_gan, max_grad_norm = 0.5, 10.0

    def run(probe: Optional[Callable[[torch.Tensor], None]] = None) -> torch.Tensor:
        # Generator objective (GAN) for a -> b
        fake_b = gen(_C03_A)
        loss_gan_a = disc(fake_b, for_G=True) * lambda_gan
        loss_gan_a.backward()
        torch.nn.utils.clip_grad_norm_(gen.parameters(), max_grad_norm)
        optimizer_gen.step()
        lr_scheduler_gen.step()
        optimizer_gen.zero_grad()
        if not bug:
            optimizer_disc.zero_grad()
        # Discriminator on the fakes
        loss_d_fake = disc(fake_b.detach(), for_real=False) * lambda_gan * 0.5
        loss_d_fake.backward()
        torch.nn.utils.clip_grad_norm_(disc.parameters(), max_grad_norm)
        if probe is not None:
            probe(fake_b.detach())
        optimizer_disc.step()
        lr_scheduler_disc.step()
        optimizer_disc.zero_grad()
        # Discriminator on the reals
        loss_d_real = disc(_C03_B, for_real=True) * lambda_gan * 0.5
        loss_d_real.backward()
        torch.nn.utils.clip_grad_norm_(disc.parameters(), max_grad_norm)
        optimizer_disc.step()
        lr_scheduler_disc.step()
        optimizer_disc.zero_grad()
        return loss_gan_a + loss_d_fake + loss_d_real

    return model, optimizer_disc, lr_scheduler_disc, run, lambda_gan


def _c03_build(bug: bool) -> Case:
    model, opt_d, sched_d, run, _ = _c03_setup(bug)
    return model, lambda: run(), _kw(optimizer=opt_d, lr_scheduler=sched_d, inputs=(_C03_A, _C03_B))


def _c03_proof(bug: bool) -> bool:
    """At the discriminator's step on the fakes, is its gradient anything other than that of its own fake loss?"""
    model, _, _, run, lambda_gan = _c03_setup(bug)
    disc = model.net_disc_a
    found: list[bool] = []

    def probe(fake: torch.Tensor) -> None:
        params = list(disc.parameters())
        applied = [p.grad.detach().clone() for p in params]
        ref = torch.autograd.grad(disc(fake, for_real=False) * lambda_gan * 0.5, params)
        norm = torch.sqrt(sum((r ** 2).sum() for r in ref))
        scale = min(1.0, 10.0 / (float(norm) + 1e-6))  # the clip the step applied
        found.append(any((a - r * scale).abs().max() > 1e-6 for a, r in zip(applied, ref)))

    run(probe)
    return found[0]


# --------------------------------------------------------------------------------------------- case-04
# stelzner/monet issue #1 (fixed in commit f4cbd96, "Fix mask transpose"): MONet's mask-reconstruction term compares the
# attention masks with the component decoders' mask logits, `kl_divergence(Categorical(probs=tr_masks),
# Categorical(logits=torch.stack(mask_preds, 3)))`. The logits are N x H x W x K, but `tr_masks =
# torch.transpose(masks, 1, 3)` is N x W x H x K, so each pixel's predicted mask is trained toward the attention mask of
# the pixel mirrored across the diagonal. On square images (CLEVR, sprites) the shapes agree, nothing errors and the
# loss falls. Fix: `tr_masks = masks.permute(0, 2, 3, 1)`. Tiny here: 3 slots, 8x8 images, a conv attention net with the
# stick-breaking scope, a component VAE with a spatial-broadcast decoder, beta=0.5, gamma=0.25, RMSprop(lr=1e-4),
# the batch-mean of MONet's per-image loss.

_C04_K, _C04_Z, _C04_HW = 3, 4, 8
_C04_X = torch.rand(2, 3, _C04_HW, _C04_HW, generator=_gen(3931))


class _Monet(nn.Module):
    def __init__(self, bug: bool) -> None:
        super().__init__()
        self.bug = bug
        self.attention = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 2, 1))
        self.encoder = nn.Sequential(nn.Conv2d(4, 8, 3, stride=2, padding=1), nn.ReLU(), nn.Flatten(),
                                     nn.Linear(8 * 4 * 4, 2 * _C04_Z))
        self.decoder = nn.Sequential(nn.Conv2d(_C04_Z + 2, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 4, 1))
        ys, xs = torch.meshgrid(torch.linspace(-1, 1, _C04_HW), torch.linspace(-1, 1, _C04_HW), indexing="ij")
        self.register_buffer("coord_map", torch.stack((ys, xs)).unsqueeze(0))
        self.beta, self.gamma = 0.5, 0.25
        self.bg_sigma, self.fg_sigma = 0.09, 0.11
        self.last: dict[str, torch.Tensor] = {}

    def forward(self, x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        scope = torch.ones_like(x[:, 0:1])
        masks = []
        for _ in range(_C04_K - 1):
            alpha = torch.softmax(self.attention(torch.cat((x, scope), 1)), 1)
            masks.append(scope * alpha[:, 0:1])
            scope = scope * alpha[:, 1:2]
        masks.append(scope)
        loss = torch.zeros_like(x[:, 0, 0, 0])
        mask_preds = []
        for i, mask in enumerate(masks):
            q = self.encoder(torch.cat((x, mask), 1))
            means = torch.sigmoid(q[:, :_C04_Z]) * 6 - 3
            sigmas = torch.sigmoid(q[:, _C04_Z:]) * 3
            z = means + (sigmas * torch.randn(means.shape, generator=g)).detach()  # Normal(0, sigmas).sample()
            kl_z = torch.distributions.kl_divergence(torch.distributions.Normal(means, sigmas),
                                                     torch.distributions.Normal(0.0, 1.0)).sum(1)
            tiled = z[:, :, None, None].expand(-1, -1, _C04_HW, _C04_HW)
            out = self.decoder(torch.cat((tiled, self.coord_map.expand(x.shape[0], -1, -1, -1)), 1))
            x_recon = torch.sigmoid(out[:, :3])
            sigma = self.bg_sigma if i == 0 else self.fg_sigma
            p_x = (torch.distributions.Normal(x_recon, sigma).log_prob(x) * mask).sum([1, 2, 3])
            mask_preds.append(out[:, 3])
            loss = loss + (-p_x + self.beta * kl_z)
        masks_t = torch.cat(masks, 1)
        tr_masks = torch.transpose(masks_t, 1, 3) if self.bug else masks_t.permute(0, 2, 3, 1)
        logits = torch.stack(mask_preds, 3)
        if logits.requires_grad:
            logits.retain_grad()
        self.last = {"masks": masks_t, "logits": logits}
        kl_masks = torch.distributions.kl_divergence(torch.distributions.Categorical(probs=tr_masks),
                                                     torch.distributions.Categorical(logits=logits)).sum([1, 2])
        return loss + self.gamma * kl_masks


def _c04_setup(bug: bool):
    torch.manual_seed(0)
    model = _Monet(bug).train()
    opt = torch.optim.RMSprop(model.parameters(), lr=1e-4)
    g = _gen(3932)

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = model(_C04_X, g).mean()
        loss.backward()
        opt.step()
        return loss

    return model, opt, step


def _c04_build(bug: bool) -> Case:
    model, opt, step = _c04_setup(bug)
    return model, step, _kw(optimizer=opt, inputs=_C04_X)


def _c04_proof(bug: bool) -> bool:
    """From the gradient a real step puts on the mask logits, which target did each pixel's mask get trained toward?"""
    model, _, step = _c04_setup(bug)
    step()
    logits, masks = model.last["logits"], model.last["masks"].detach()
    # d/dlogits of gamma * KL(q || softmax(logits)), batch-mean: gamma / N * (softmax(logits) - q)
    q_used = torch.softmax(logits.detach(), -1) - logits.grad * _C04_X.shape[0] / model.gamma
    return not bool(torch.allclose(q_used, masks.permute(0, 2, 3, 1), atol=1e-5))


# --------------------------------------------------------------------------------------------- case-05
# espnet/espnet PR #6105 ("VISinger2 Duration Loss Quick Fix"): VISinger2's duration predictor has two output channels,
# phoneme-level durations (channel 0) and score-level (note) durations (channel 1). In espnet2/gan_svs/vits/vits.py
# both losses used the phoneme durations as target: `score_dur_loss = self.mse_loss(pred_dur[:, 1, :].squeeze(1),
# gt_dur.float())`, so the score channel was trained to duplicate the phoneme channel. The generator trains normally.
# Fix in the PR: the score channel's target is `score_dur`. Tiny here: the duration predictor over phoneme and note-pitch
# embeddings (a conv stack with two output channels), lambda_dur=0.1, AdamW.

_C05_PH = torch.randint(3, 40, (4, 10), generator=_gen(3941))
_C05_NOTE = torch.randint(1, 30, (4, 10), generator=_gen(3942))
_C05_GT_DUR = torch.randint(1, 8, (4, 10), generator=_gen(3943))
_C05_SCORE_DUR = torch.randint(8, 20, (4, 10), generator=_gen(3944))
_C05_LAMBDA = 0.1


class _DurationPredictor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ph_emb = nn.Embedding(40, 16)
        self.note_emb = nn.Embedding(30, 16)
        self.convs = nn.Sequential(nn.Conv1d(16, 16, 3, padding=1), nn.ReLU(), nn.Conv1d(16, 16, 3, padding=1),
                                   nn.ReLU())
        self.proj = nn.Conv1d(16, 2, 1)
        self.last: Optional[torch.Tensor] = None

    def forward(self, phones: torch.Tensor, notes: torch.Tensor) -> torch.Tensor:
        h = (self.ph_emb(phones) + self.note_emb(notes)).transpose(1, 2)
        pred_dur = self.proj(self.convs(h))  # B x 2 x T
        if pred_dur.requires_grad:
            pred_dur.retain_grad()
        self.last = pred_dur
        return pred_dur


def _c05_setup(bug: bool):
    torch.manual_seed(0)
    model = _DurationPredictor().train()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-4, betas=(0.8, 0.99))
    score_target = _C05_GT_DUR if bug else _C05_SCORE_DUR

    def step() -> torch.Tensor:
        opt.zero_grad()
        pred_dur = model(_C05_PH, _C05_NOTE)
        phoneme_dur_loss = F.mse_loss(pred_dur[:, 0, :].squeeze(1), _C05_GT_DUR.float())
        score_dur_loss = F.mse_loss(pred_dur[:, 1, :].squeeze(1), score_target.float())
        loss = phoneme_dur_loss * _C05_LAMBDA + score_dur_loss * _C05_LAMBDA
        loss.backward()
        opt.step()
        return loss

    return model, opt, step


def _c05_build(bug: bool) -> Case:
    model, opt, step = _c05_setup(bug)
    return model, step, _kw(optimizer=opt, inputs={"phones": _C05_PH, "notes": _C05_NOTE})


def _c05_proof(bug: bool) -> bool:
    """From the gradient a real step puts on the score-duration channel, is its target anything but the score durations?"""
    model, _, step = _c05_setup(bug)
    step()
    pred = model.last
    assert pred is not None and pred.grad is not None
    n = pred[:, 1, :].numel()
    # d/dpred of lambda * mean((pred - target)^2) = 2 * lambda / n * (pred - target)
    target_used = pred[:, 1, :].detach() - pred.grad[:, 1, :] * n / (2 * _C05_LAMBDA)
    return not bool(torch.allclose(target_used, _C05_SCORE_DUR.float(), atol=1e-3))


CASES: list[BlindCase] = [
    BlindCase("b39b-01", "https://github.com/dev4488/VAE_gumble_softmax/issues/1", "KL term sign flipped",
              "The Gumbel-softmax VAE subtracts its KL divergence from the loss, so the regulariser drives every "
              "posterior away from the uniform prior.", _c01_build, _c01_proof,
              known_miss="a KL term with its sign flipped: the sign of a regulariser is not judged"),
    BlindCase("b39b-02", "https://github.com/huggingface/diffusers/issues/3913",
              "prior images get instance prompt",
              "With pre-computed text embeddings, DreamBooth's prior-preservation images are conditioned on the "
              "instance prompt's embedding instead of the class prompt's.", _c02_build, _c02_proof,
              known_miss="prior-preservation images given the instance prompt: which prompt an image pairs with is data semantics"),
    BlindCase("b39b-03", "https://github.com/GaParmar/img2img-turbo/issues/56",
              "generator loss leaks into discriminator",
              "Gradients of the generator's adversarial loss stay on the discriminator, whose next step applies them "
              "and so partly trains it to call the fakes real.", _c03_build, _c03_proof),
    BlindCase("b39b-04", "https://github.com/stelzner/monet/issues/1", "mask target spatially transposed",
              "MONet's mask-reconstruction KL pairs each pixel's predicted mask with the attention mask of the "
              "transposed pixel (square images hide the shape mismatch).", _c04_build, _c04_proof,
              known_miss="a mask target spatially transposed: which layout a target has is data semantics",
              known_alarm=("GRAD-002",)),
    BlindCase("b39b-05", "https://github.com/espnet/espnet/pull/6105", "auxiliary head given wrong target",
              "VISinger2's score-duration channel is trained on the phoneme durations, duplicating the phoneme "
              "channel instead of learning the note durations.", _c05_build, _c05_proof,
              known_miss="an auxiliary head given the wrong target: which target a head should fit is label semantics"),
]
