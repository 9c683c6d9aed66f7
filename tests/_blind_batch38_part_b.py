"""Blind batch 38 (part b): silent bugs in vision, audio and generative training code, each with its fixed twin.

Collected by someone who does not write the audit's checks. Every case builds the user's setup on tiny plain torch
modules (a VQGAN-style autoencoder and patch discriminator, a Voicebox-style flow-matching speech model, a YOLO-style
detector with an EMA, an SD3-style flow-matching denoiser over a frozen VAE encoder, and a Keras-example VAE; nothing
is downloaded) and proves the bug without the audit on real tensors and real steps.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw

# --------------------------------------------------------------------------------------------- case-01
# Project-MONAI/GenerativeModels issue #102 (fixed by PR #121): the 2D VQGAN tutorial trains the autoencoder
# (generator) and a PatchDiscriminator with two Adam optimizers. The generator part calls
# `optimizer_g.zero_grad(set_to_none=True)`, runs the discriminator on the (non-detached) reconstruction for the
# adversarial term and steps the generator; the discriminator part then computes its least-squares loss and calls
# `loss_d.backward(); optimizer_d.step()` with no `optimizer_d.zero_grad()` before it. The discriminator's gradient is
# therefore the sum of its own loss's gradient, the gradient the generator's adversarial term pushed into it (which
# asks it to call fakes real) and everything left from all earlier iterations. No error, losses stay plausible; the
# discriminator just follows a stale, wrong-signed running sum. Fix in the PR: `optimizer_d.zero_grad(set_to_none=True)`
# at the start of the discriminator part. (A tiny conv autoencoder stands in for the VQVAE; the perceptual and
# quantization terms are left out.)

_C01_IMAGES = torch.rand(4, 1, 16, 16, generator=_gen(38101))


class _C01AutoEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Conv2d(1, 8, 4, 2, 1), nn.ReLU(), nn.Conv2d(8, 8, 3, 1, 1))
        self.decoder = nn.Sequential(nn.ConvTranspose2d(8, 8, 4, 2, 1), nn.ReLU(), nn.Conv2d(8, 1, 3, 1, 1))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(images))


class _C01PatchDiscriminator(nn.Module):
    """Returns every intermediate output, as MONAI's PatchDiscriminator does; the last one is the patch logits."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([
            nn.Sequential(nn.Conv2d(1, 8, 4, 2, 1), nn.LeakyReLU(0.2)),
            nn.Sequential(nn.Conv2d(8, 16, 4, 2, 1, bias=False), nn.BatchNorm2d(16), nn.LeakyReLU(0.2)),
            nn.Conv2d(16, 1, 3, 1, 1),
        ])

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        outs = []
        for block in self.blocks:
            x = block(x)
            outs.append(x)
        return outs


def _c01_setup(bug: bool):
    torch.manual_seed(0)
    model = _C01AutoEncoder().train()
    discriminator = _C01PatchDiscriminator().train()
    optimizer_g = torch.optim.Adam(params=model.parameters(), lr=1e-4)
    optimizer_d = torch.optim.Adam(params=discriminator.parameters(), lr=5e-4)
    adv_weight = 0.01

    def adv_loss(logits: torch.Tensor, target_is_real: bool) -> torch.Tensor:  # least-squares PatchAdversarialLoss
        target = torch.ones_like(logits) if target_is_real else torch.zeros_like(logits)
        return F.mse_loss(logits, target)

    def step() -> torch.Tensor:
        images = _C01_IMAGES
        optimizer_g.zero_grad(set_to_none=True)
        # generator part
        reconstruction = model(images)
        logits_fake = discriminator(reconstruction.contiguous().float())[-1]
        recons_loss = F.l1_loss(reconstruction.float(), images.float())
        generator_loss = adv_loss(logits_fake, target_is_real=True)
        loss_g = recons_loss + adv_weight * generator_loss
        loss_g.backward()
        optimizer_g.step()
        # discriminator part
        if not bug:
            optimizer_d.zero_grad(set_to_none=True)
        logits_fake = discriminator(reconstruction.contiguous().detach())[-1]
        loss_d_fake = adv_loss(logits_fake, target_is_real=False)
        logits_real = discriminator(images.contiguous().detach())[-1]
        loss_d_real = adv_loss(logits_real, target_is_real=True)
        discriminator_loss = (loss_d_fake + loss_d_real) * 0.5
        loss_d = adv_weight * discriminator_loss
        loss_d.backward()
        optimizer_d.step()
        return loss_g

    container = nn.ModuleDict({"model": model, "discriminator": discriminator})
    return container, discriminator, optimizer_g, optimizer_d, step


def _c01_build(bug: bool) -> Case:
    container, _, optimizer_g, _, step = _c01_setup(bug)
    return container, step, _kw(optimizer=optimizer_g, inputs={"images": _C01_IMAGES})


def _c01_proof(bug: bool) -> bool:
    """At the discriminator's optimizer step, is its .grad anything but the gradient of the discriminator loss?

    Tensor hooks on the discriminator's weights add up the gradients that arrive after the generator's step (i.e. from
    the discriminator loss's backward); a pre-hook on the discriminator's step compares .grad with that sum.
    """
    _, disc, optimizer_g, optimizer_d, step = _c01_setup(bug)
    params = list(disc.parameters())
    window = {"open": False}
    fresh = [torch.zeros_like(p) for p in params]
    stale = {"max": 0.0}

    def make_hook(i: int):
        def hook(g: torch.Tensor) -> None:
            if window["open"]:
                fresh[i] += g.detach()
        return hook

    for i, p in enumerate(params):
        p.register_hook(make_hook(i))

    def after_g_step(*_args) -> None:
        window["open"] = True
        for f in fresh:
            f.zero_()

    def before_d_step(*_args) -> None:
        window["open"] = False
        for p, f in zip(params, fresh):
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            stale["max"] = max(stale["max"], float((g - f).abs().max()))

    optimizer_g.register_step_post_hook(after_g_step)
    optimizer_d.register_step_pre_hook(before_d_step)
    for _ in range(2):
        step()
    return stale["max"] > 1e-9


# --------------------------------------------------------------------------------------------- case-02
# lucidrains/voicebox-pytorch PR #11 ("Apply mask to cond"): Voicebox is trained to in-fill masked audio frames
# with conditional flow matching; the README trains with `cfm_wrapper(x, phoneme_ids=..., cond=x, mask=mask)` and the
# loss is a masked mean over the masked frames only. But `VoiceBox.forward` never applied the mask to `cond`, so the
# network is fed, as its context, the clean frames of exactly the span it is scored on: with `w = (1-t) x0 + t x1` and
# `cond = x1` the flow target `x1 - x0` is recoverable from its own inputs. The loss falls fast and looks great while
# the model learns to copy instead of to in-fill (at inference the span is unknown). Fix in the PR:
# `cond = cond * rearrange(~mask, '... -> ... 1')` before the network sees it.

_C02_B, _C02_N, _C02_D, _C02_PH = 2, 12, 8, 10
_C02_X = torch.randn(_C02_B, _C02_N, _C02_D, generator=_gen(38201))
_C02_PHONEMES = torch.randint(0, _C02_PH, (_C02_B, _C02_N), generator=_gen(38202))
_C02_MASK = torch.randint(0, 2, (_C02_B, _C02_N), generator=_gen(38203)).bool()


class _C02AdaBlock(nn.Module):
    """Transformer block whose RMSNorm gains come from the time embedding (adaptive RMSNorm)."""

    def __init__(self, dim: int, time_dim: int) -> None:
        super().__init__()
        self.to_gamma1 = nn.Linear(time_dim, dim)
        self.to_gamma2 = nn.Linear(time_dim, dim)
        self.attn = nn.MultiheadAttention(dim, 2, batch_first=True)
        self.ff = nn.Sequential(nn.Linear(dim, dim * 2), nn.GELU(), nn.Linear(dim * 2, dim))

    @staticmethod
    def _norm(x: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
        return F.normalize(x, dim=-1) * math.sqrt(x.shape[-1]) * (gamma.unsqueeze(1) + 1)

    def forward(self, x: torch.Tensor, t_emb: torch.Tensor) -> torch.Tensor:
        h = self._norm(x, self.to_gamma1(t_emb))
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.ff(self._norm(x, self.to_gamma2(t_emb)))


class _C02VoiceBox(nn.Module):
    def __init__(self, bug: bool, dim: int = 16) -> None:
        super().__init__()
        self.bug = bug
        self.proj_in = nn.Linear(_C02_D, dim)
        self.time_weights = nn.Parameter(torch.randn(dim // 2))  # learned sinusoidal time embedding
        self.time_mlp = nn.Sequential(nn.Linear(dim + 1, dim * 2), nn.SiLU())
        self.to_phoneme_emb = nn.Embedding(_C02_PH + 1, dim)
        self.to_embed = nn.Linear(dim * 3, dim)
        self.conv_embed = nn.Conv1d(dim, dim, 3, padding=1, groups=dim)
        self.block = _C02AdaBlock(dim, dim * 2)
        self.to_pred = nn.Linear(dim, _C02_D, bias=False)

    def _time_emb(self, times: torch.Tensor) -> torch.Tensor:
        freqs = times[:, None] * self.time_weights[None] * 2 * math.pi
        return self.time_mlp(torch.cat((times[:, None], freqs.sin(), freqs.cos()), dim=-1))

    def forward(self, x, *, phoneme_ids, cond, times, target, mask):
        x, cond = self.proj_in(x), self.proj_in(cond)
        if not self.bug:
            cond = cond * (~mask).unsqueeze(-1)
        embed = torch.cat((x, self.to_phoneme_emb(phoneme_ids), cond), dim=-1)
        x = self.to_embed(embed)
        x = self.conv_embed(x.transpose(1, 2)).transpose(1, 2) + x
        x = self.block(x, self._time_emb(times))
        x = self.to_pred(x)
        loss = F.mse_loss(x, target, reduction="none").mean(-1)
        loss = loss.masked_fill(~mask, 0.0)
        num = loss.sum(-1)
        den = mask.sum(-1).clamp(min=1e-5)
        return (num / den).mean()


def _c02_setup(bug: bool):
    torch.manual_seed(0)
    voicebox = _C02VoiceBox(bug).train()
    opt = torch.optim.Adam(voicebox.parameters(), lr=3e-4)
    gen = _gen(38204)
    sigma = 0.0

    def cfm_loss(x1: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:  # ConditionalFlowMatcherWrapper.forward
        x0 = torch.randn(x1.shape, generator=gen)
        times = torch.rand((x1.shape[0],), generator=gen)
        t = times[:, None, None]
        w = (1 - (1 - sigma) * t) * x0 + t * x1
        flow = x1 - (1 - sigma) * x0
        return voicebox(w, phoneme_ids=_C02_PHONEMES, cond=cond, times=times, target=flow, mask=_C02_MASK)

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = cfm_loss(_C02_X, cond=_C02_X)
        loss.backward()
        opt.step()
        return loss

    return voicebox, opt, step, cfm_loss


def _c02_build(bug: bool) -> Case:
    voicebox, opt, step, _ = _c02_setup(bug)
    return voicebox, step, _kw(optimizer=opt, inputs={"x": _C02_X, "phoneme_ids": _C02_PHONEMES, "cond": _C02_X,
                                                      "mask": _C02_MASK})


def _c02_proof(bug: bool) -> bool:
    """After a step, does the in-filling loss depend on the conditioning frames inside the masked (scored) span?"""
    _, _, step, cfm_loss = _c02_setup(bug)
    step()
    cond = _C02_X.clone().requires_grad_(True)
    loss = cfm_loss(_C02_X, cond=cond)
    (grad,) = torch.autograd.grad(loss, cond)
    return bool(grad[_C02_MASK].abs().max() > 1e-8)


# --------------------------------------------------------------------------------------------- case-03
# MultimediaTechLab/YOLO issue #97 ("Critical EMA implementation bug, resulting in dead training"; fix in PR #104):
# with EMA enabled by default, `ModelTrainer` builds an `ExponentialMovingAverage` whose shadow is a copy of the
# initial weights, but `train_one_batch` never calls `ema.update()`. At every checkpoint `save_checkpoint` calls
# `ema.apply_shadow()` (copies the never-updated shadow, i.e. the initial weights, into the model) and then
# `ema.restore()`, which copies the model into the shadow instead of putting the trained weights back. Within an
# epoch the loss falls normally; at each epoch end all training is thrown away and the checkpoints hold the initial
# weights. Fix in the PR: call `ema.update()` after the optimizer step in `train_one_batch`, and make
# `apply_shadow` keep a backup of the model's weights that `restore` writes back.

_C03_IMAGES = torch.randn(4, 3, 16, 16, generator=_gen(38301))
_C03_OBJ = (torch.rand(4, 1, 8, 8, generator=_gen(38302)) < 0.2).float()
_C03_BOX = torch.rand(4, 4, 8, 8, generator=_gen(38303))


class _C03Detector(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, 2, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(8)
        self.head = nn.Conv2d(8, 5, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.silu(self.bn1(self.conv1(x)))
        x = F.silu(self.bn2(self.conv2(x)))
        return self.head(x)


class _C03EMA:
    """yolo/utils/model_utils.py ExponentialMovingAverage; `fixed` selects the PR's apply_shadow/restore."""

    def __init__(self, model: nn.Module, decay: float, fixed: bool) -> None:
        self.model, self.decay, self.fixed = model, decay, fixed
        self.shadow = {name: p.clone().detach() for name, p in model.named_parameters()}
        self.backup: dict[str, torch.Tensor] = {}

    def update(self) -> None:
        for name, param in self.model.named_parameters():
            new_average = (1.0 - self.decay) * param.data + self.decay * self.shadow[name]
            self.shadow[name] = new_average.clone()

    def apply_shadow(self) -> None:
        for name, param in self.model.named_parameters():
            if self.fixed:
                self.backup[name] = param.data.clone()
            param.data.copy_(self.shadow[name])

    def restore(self) -> None:
        for name, param in self.model.named_parameters():
            if self.fixed:
                param.data.copy_(self.backup[name])
            else:
                self.shadow[name].copy_(param.data)


def _c03_setup(bug: bool):
    torch.manual_seed(0)
    model = _C03Detector().train()
    named = list(model.named_parameters())
    bias_params = [p for n, p in named if "bias" in n]
    norm_params = [p for n, p in named if "weight" in n and "bn" in n]
    conv_params = [p for n, p in named if "weight" in n and "bn" not in n]
    optimizer = torch.optim.SGD([{"params": bias_params, "weight_decay": 0},
                                 {"params": conv_params},
                                 {"params": norm_params, "weight_decay": 0}],
                                lr=0.01, momentum=0.937, nesterov=True, weight_decay=5e-4)
    ema = _C03EMA(model, decay=0.995, fixed=not bug)

    def train_one_batch() -> torch.Tensor:
        optimizer.zero_grad()
        pred = model(_C03_IMAGES)
        obj_loss = F.binary_cross_entropy_with_logits(pred[:, :1], _C03_OBJ)
        box_loss = (F.l1_loss(pred[:, 1:].sigmoid(), _C03_BOX, reduction="none") * _C03_OBJ).sum() / _C03_OBJ.sum()
        loss = obj_loss + 5.0 * box_loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=10.0)
        optimizer.step()
        if not bug:
            ema.update()
        return loss

    def save_checkpoint() -> dict:
        checkpoint = {"model_state_dict": {k: v.clone() for k, v in model.state_dict().items()}}
        ema.apply_shadow()
        checkpoint["model_state_dict_ema"] = {k: v.clone() for k, v in model.state_dict().items()}
        ema.restore()
        return checkpoint

    return model, optimizer, train_one_batch, save_checkpoint


def _c03_build(bug: bool) -> Case:
    model, optimizer, step, _ = _c03_setup(bug)
    return model, step, _kw(optimizer=optimizer, inputs={"images": _C03_IMAGES})


def _c03_proof(bug: bool) -> bool:
    """After a few training steps and one end-of-epoch checkpoint, are the model's weights back at their init?"""
    model, _, step, save_checkpoint = _c03_setup(bug)
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    for _ in range(3):
        step()
    trained_moved = any(not torch.equal(p.detach(), init[n]) for n, p in model.named_parameters())
    save_checkpoint()
    reset = all(torch.equal(p.detach(), init[n]) for n, p in model.named_parameters())
    return trained_moved and reset


# --------------------------------------------------------------------------------------------- case-04
# huggingface/diffusers PR #8917 ("[Training] SD3 training fixes"; fixes issues #8887 and #8708): the SD3 DreamBooth
# training scripts encoded images with `model_input = vae.encode(pixel_values).latent_dist.sample()` and then
# `model_input = model_input * vae.config.scaling_factor`, but the SD3 VAE also has a `shift_factor` (0.0609) that
# the SD3 pipeline adds back when decoding (`latents / scaling_factor + shift_factor`). The transformer is therefore
# fine-tuned on latents offset by `shift_factor * scaling_factor` from the space it generates in at inference; the
# flow-matching loss decreases as usual, samples just come out washed/colour-shifted. Fix in the PR:
# `model_input = (model_input - vae.config.shift_factor) * vae.config.scaling_factor`.

_C04_PIXELS = torch.rand(2, 3, 16, 16, generator=_gen(38401)) * 2 - 1
_C04_POOLED = torch.randn(2, 16, generator=_gen(38402))  # the instance prompt's pooled embedding, precomputed
_C04_VAE_CONFIG = {"scaling_factor": 1.5305, "shift_factor": 0.0609}
_C04_NUM_TRAIN_TIMESTEPS = 1000


class _C04VAEEncoder(nn.Module):
    """Frozen encoder producing a diagonal Gaussian latent distribution (mean, logvar)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 4, 2, 1)

    def sample(self, pixels: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        mean, logvar = self.conv(pixels).chunk(2, dim=1)
        std = torch.exp(0.5 * logvar.clamp(-30.0, 20.0))
        return mean + std * torch.randn(mean.shape, generator=gen)


class _C04Transformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.t_mlp = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 16))
        self.pool_proj = nn.Linear(16, 16)
        self.conv_in = nn.Conv2d(4, 16, 3, 1, 1)
        self.conv_mid = nn.Conv2d(16, 16, 3, 1, 1)
        self.conv_out = nn.Conv2d(16, 4, 3, 1, 1)

    def forward(self, hidden_states, timestep, pooled_projections):
        half = torch.arange(8, dtype=torch.float32)
        freqs = torch.exp(-math.log(10000.0) * half / 8)[None] * timestep[:, None]
        temb = self.t_mlp(torch.cat((freqs.sin(), freqs.cos()), dim=-1)) + self.pool_proj(pooled_projections)
        h = F.silu(self.conv_in(hidden_states) + temb[:, :, None, None])
        h = F.silu(self.conv_mid(h))
        return self.conv_out(h)


def _c04_flow_match_sigmas(shift: float = 3.0) -> torch.Tensor:
    """FlowMatchEulerDiscreteScheduler(shift=3.0) training sigmas, indexed like scheduler.timesteps."""
    n = _C04_NUM_TRAIN_TIMESTEPS
    ts = torch.linspace(1, n, n).flip(0)
    s = ts / n
    return shift * s / (1 + (shift - 1) * s)


def _c04_setup(bug: bool):
    torch.manual_seed(0)
    vae = _C04VAEEncoder().eval().requires_grad_(False)
    transformer = _C04Transformer().train()
    optimizer = torch.optim.AdamW(transformer.parameters(), lr=1e-4, betas=(0.9, 0.999), weight_decay=1e-4, eps=1e-8)
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)  # get_scheduler("constant")
    sigmas_table = _c04_flow_match_sigmas()
    timesteps_table = sigmas_table * _C04_NUM_TRAIN_TIMESTEPS
    gen = _gen(38403)
    seen: dict[str, torch.Tensor] = {}

    def step() -> torch.Tensor:
        with torch.no_grad():
            raw = vae.sample(_C04_PIXELS, gen)
        if bug:
            model_input = raw * _C04_VAE_CONFIG["scaling_factor"]
        else:
            model_input = (raw - _C04_VAE_CONFIG["shift_factor"]) * _C04_VAE_CONFIG["scaling_factor"]
        seen["raw"], seen["model_input"] = raw, model_input
        noise = torch.randn(model_input.shape, generator=gen)
        bsz = model_input.shape[0]
        u = torch.sigmoid(torch.randn((bsz,), generator=gen))  # weighting_scheme="logit_normal"
        indices = (u * _C04_NUM_TRAIN_TIMESTEPS).long()
        timesteps = timesteps_table[indices]
        sigmas = sigmas_table[indices].view(-1, 1, 1, 1)
        noisy_model_input = (1.0 - sigmas) * model_input + sigmas * noise
        model_pred = transformer(noisy_model_input, timesteps, _C04_POOLED)
        model_pred = model_pred * (-sigmas) + noisy_model_input  # precondition outputs
        weighting = torch.ones_like(sigmas)  # compute_loss_weighting_for_sd3("logit_normal")
        target = model_input
        loss = torch.mean((weighting * (model_pred - target) ** 2).reshape(bsz, -1), 1).mean()
        loss.backward()
        optimizer.step()
        lr_scheduler.step()
        optimizer.zero_grad()
        return loss

    container = nn.ModuleDict({"transformer": transformer, "vae": vae})
    return container, optimizer, lr_scheduler, step, seen


def _c04_build(bug: bool) -> Case:
    container, optimizer, lr_scheduler, step, _ = _c04_setup(bug)
    return container, step, _kw(optimizer=optimizer, lr_scheduler=lr_scheduler, inputs={"pixel_values": _C04_PIXELS})


def _c04_proof(bug: bool) -> bool:
    """Do the latents the transformer is trained to produce decode (pipeline: /scaling + shift) to other latents than
    the VAE gave?"""
    _, _, _, step, seen = _c04_setup(bug)
    step()
    decoded = seen["model_input"] / _C04_VAE_CONFIG["scaling_factor"] + _C04_VAE_CONFIG["shift_factor"]
    return bool((decoded - seen["raw"]).abs().max() > 1e-4)


# --------------------------------------------------------------------------------------------- case-05
# keras-team/keras PR #4211 ("changed VAE sampling variance to 1", merged): the variational autoencoder example drew
# the reparameterization noise as `K.random_normal(..., mean=0., std=epsilon_std)` with `epsilon_std = 0.01`, then
# `z = z_mean + K.exp(z_log_var / 2) * epsilon`, while its loss used the standard-normal KL term. The sampled z is
# then 100x closer to z_mean than the posterior it claims, so the reconstruction term hardly sees the posterior
# variance and the objective is not the variational lower bound (the PR: ~60 nats where MNIST should give 90-100).
# Training runs and the loss falls, just to the wrong objective. Fix in the PR: `epsilon_std = 1.0`.

_C05_X = (torch.rand(16, 64, generator=_gen(38501)) > 0.5).float()
_C05_ORIGINAL_DIM, _C05_LATENT_DIM = 64, 2


class _C05VAE(nn.Module):
    def __init__(self, epsilon_std: float) -> None:
        super().__init__()
        self.epsilon_std = epsilon_std
        self.h = nn.Linear(_C05_ORIGINAL_DIM, 32)
        self.z_mean = nn.Linear(32, _C05_LATENT_DIM)
        self.z_log_var = nn.Linear(32, _C05_LATENT_DIM)
        self.decoder_h = nn.Linear(_C05_LATENT_DIM, 32)
        self.decoder_mean = nn.Linear(32, _C05_ORIGINAL_DIM)
        self.gen = _gen(38502)

    def forward(self, x: torch.Tensor):
        h = F.relu(self.h(x))
        z_mean, z_log_var = self.z_mean(h), self.z_log_var(h)
        epsilon = torch.randn(z_mean.shape, generator=self.gen) * self.epsilon_std
        z = z_mean + torch.exp(z_log_var / 2) * epsilon
        x_decoded_mean = torch.sigmoid(self.decoder_mean(F.relu(self.decoder_h(z))))
        return x_decoded_mean, z, z_mean, z_log_var


def _c05_setup(bug: bool):
    torch.manual_seed(0)
    vae = _C05VAE(epsilon_std=0.01 if bug else 1.0).train()
    opt = torch.optim.RMSprop(vae.parameters(), lr=1e-3, alpha=0.9, eps=1e-7)  # Keras 'rmsprop'

    def vae_loss(x, x_decoded_mean, z_mean, z_log_var):
        xent_loss = _C05_ORIGINAL_DIM * F.binary_cross_entropy(x_decoded_mean, x, reduction="none").mean(-1)
        kl_loss = -0.5 * torch.sum(1 + z_log_var - z_mean.pow(2) - z_log_var.exp(), dim=-1)
        return (xent_loss + kl_loss).mean()

    def step() -> torch.Tensor:
        opt.zero_grad()
        x_decoded_mean, _, z_mean, z_log_var = vae(_C05_X)
        loss = vae_loss(_C05_X, x_decoded_mean, z_mean, z_log_var)
        loss.backward()
        opt.step()
        return loss

    return vae, opt, step


def _c05_build(bug: bool) -> Case:
    vae, opt, step = _c05_setup(bug)
    return vae, step, _kw(optimizer=opt, inputs={"x": _C05_X})


def _c05_proof(bug: bool) -> bool:
    """After a step, is the sampled z's deviation from z_mean, in units of the posterior std, far from N(0, 1)?"""
    vae, _, step = _c05_setup(bug)
    step()
    with torch.no_grad():
        _, z, z_mean, z_log_var = vae(_C05_X)
        standardized = (z - z_mean) / torch.exp(z_log_var / 2)
    return bool(standardized.std() < 0.5)


CASES: list[BlindCase] = [
    BlindCase("b38b-01", "https://github.com/Project-MONAI/GenerativeModels/issues/102",
              "discriminator gradients never zeroed",
              "The VQGAN tutorial never zeroes the discriminator's gradients, so each discriminator step applies its "
              "own loss's gradient plus the generator's adversarial gradient and all earlier ones.",
              _c01_build, _c01_proof),
    BlindCase("b38b-02", "https://github.com/lucidrains/voicebox-pytorch/pull/11", "in-filling target leaks through cond",
              "The in-filling mask restricts the loss but is never applied to the conditioning audio, so the model "
              "sees the clean frames it is scored on and learns to copy them.", _c02_build, _c02_proof,
              known_miss="the in-filling target visible through the conditioning outside its mask: a partial copy of the target in the input is not measured"),
    BlindCase("b38b-03", "https://github.com/MultimediaTechLab/YOLO/issues/97", "EMA never updated, restore broken",
              "ema.update() is never called and restore() copies the model into the shadow, so every checkpoint "
              "resets the model to its initial weights.", _c03_build, _c03_proof,
              known_miss="an EMA never updated: a copy that is never written is not seen not to follow"),
    BlindCase("b38b-04", "https://github.com/huggingface/diffusers/pull/8917", "VAE latent shift factor missing",
              "SD3 training scales the VAE latents but never subtracts the VAE's shift_factor, so the transformer is "
              "trained in a latent space offset from the one the pipeline decodes.", _c04_build, _c04_proof,
              known_miss="a VAE latent shift factor missing: the target's arithmetic is outside the model"),
    BlindCase("b38b-05", "https://github.com/keras-team/keras/pull/4211", "reparameterization noise std 0.01",
              "The VAE draws its reparameterization noise with std 0.01 instead of 1, so z barely samples the "
              "posterior and the loss is not the ELBO.", _c05_build, _c05_proof,
              known_miss="reparameterisation noise with std 0.01: the sampling arithmetic is outside the model"),
]
