"""Blind batch 36 (part b): silent training bugs from public threads on generative and vision models, each with its
fixed twin.

Collected by someone who does not write the audit's checks. Every case builds the user's setup on a tiny plain torch
model (a WGAN-GP critic and generator, a VQ-VAE, a conditional flow-matching velocity field, a depth-supervised
radiance field, a CutMix image classifier; nothing is downloaded) and proves the bug without the audit on real tensors
and real steps.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw

# --------------------------------------------------------------------------------------------- case-01
# Zeleni9/pytorch-wgan issue #40: the WGAN-GP critic's gradient penalty is `((gradients.norm(2, dim=1) - 1) ** 2)
# .mean()`, where `gradients` (the critic's gradient w.r.t. the interpolated images) has shape [B, 1, 32, 32]. With one
# channel, the norm over dim 1 is the absolute value of each pixel's gradient, so the penalty pushes every pixel's
# gradient toward magnitude 1 instead of each sample's whole-image gradient norm: the Lipschitz constraint WGAN-GP is
# meant to impose is not the one imposed (the image gradient norm is driven to ~32). Nothing fails; the critic and
# generator losses move as usual. Fix in the thread (confirmed there): flatten per sample first,
# `gradients.view(B, -1)` and take the norm over that (`.norm(2, dim=1)` of the flattened tensor).

_C01_B, _C01_Z = 6, 8
_C01_REAL = torch.rand(_C01_B, 1, 8, 8, generator=_gen(3601)) * 2 - 1
_C01_LAMBDA = 10.0


class _C01Gan(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.G = nn.Sequential(nn.Linear(_C01_Z, 64), nn.Tanh(), nn.Unflatten(1, (1, 8, 8)))
        self.D = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.LeakyReLU(0.2), nn.Flatten(), nn.Linear(256, 1))


def _c01_penalty(D: nn.Module, real: torch.Tensor, fake: torch.Tensor, eta: torch.Tensor, bug: bool) -> torch.Tensor:
    """calculate_gradient_penalty as the repository writes it (bug) or with the per-sample flattened norm (fix)."""
    eta = eta.expand(real.size(0), real.size(1), real.size(2), real.size(3))
    interpolated = (eta * real + (1 - eta) * fake).detach().requires_grad_(True)
    prob = D(interpolated)
    gradients = torch.autograd.grad(outputs=prob, inputs=interpolated, grad_outputs=torch.ones_like(prob),
                                    create_graph=True, retain_graph=True)[0]
    if bug:
        norms = gradients.norm(2, dim=1)
    else:
        norms = gradients.view(gradients.size(0), -1).norm(2, dim=1)
    return ((norms - 1) ** 2).mean() * _C01_LAMBDA


def _c01_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _C01Gan().train()
    G, D = model.G, model.D
    d_opt = torch.optim.Adam(D.parameters(), lr=1e-4, betas=(0.5, 0.999))
    g_opt = torch.optim.Adam(G.parameters(), lr=1e-4, betas=(0.5, 0.999))
    gen = _gen(3602)
    one = torch.tensor(1.0)
    mone = one * -1

    def step() -> torch.Tensor:
        # critic update
        for p in D.parameters():
            p.requires_grad = True
        D.zero_grad()
        d_loss_real = D(_C01_REAL).mean()
        d_loss_real.backward(mone)
        z = torch.randn(_C01_B, _C01_Z, generator=gen)
        fake_images = G(z)
        d_loss_fake = D(fake_images).mean()
        d_loss_fake.backward(one)
        eta = torch.rand(_C01_B, 1, 1, 1, generator=gen)
        gradient_penalty = _c01_penalty(D, _C01_REAL.data, fake_images.data, eta, bug)
        gradient_penalty.backward()
        d_loss = d_loss_fake - d_loss_real + gradient_penalty
        d_opt.step()
        # generator update
        for p in D.parameters():
            p.requires_grad = False
        G.zero_grad()
        z = torch.randn(_C01_B, _C01_Z, generator=gen)
        g_loss = D(G(z)).mean()
        g_loss.backward(mone)
        g_opt.step()
        return d_loss.detach()

    return model, step, _kw(optimizer=d_opt, inputs=_C01_REAL)


def _c01_proof(bug: bool) -> bool:
    """A critic that is exactly 1-Lipschitz (linear, unit-norm weight: every image's input gradient has norm 1) must
    get no penalty. Does the step's penalty still charge it?"""
    torch.manual_seed(0)
    critic = nn.Sequential(nn.Flatten(), nn.Linear(64, 1, bias=False))
    with torch.no_grad():
        critic[1].weight.div_(critic[1].weight.norm())
    fake = torch.rand(_C01_B, 1, 8, 8, generator=_gen(3603)) * 2 - 1
    eta = torch.rand(_C01_B, 1, 1, 1, generator=_gen(3604))
    gp = _c01_penalty(critic, _C01_REAL, fake, eta, bug)
    return bool(gp.item() > 1e-4)


# --------------------------------------------------------------------------------------------- case-02
# andylolu2/jax-vqvae-gpt issue #2: the VQ-VAE quantizer applies the straight-through estimator
# (`quantize = inputs + stop_gradient(quantize - inputs)`) BEFORE computing its two VQ losses. After that line
# `quantize` carries the gradient of the encoder output, not of the codebook, so the loss meant to pull the codebook
# vectors toward the encoder outputs (`mean((quantize - stop_gradient(inputs))**2)`) sends its gradient to the encoder
# instead, and no loss term reaches the codebook at all: the codebook stays at its initialisation while the
# reconstruction loss still falls (encoder and decoder adapt around a frozen random codebook). Fix (commit 38c057e,
# acknowledged in the thread): compute both VQ losses from the raw codebook lookup first, then apply the
# straight-through estimator for the decoder input. Reproduced in torch on a tiny MLP encoder/decoder.

_C02_X = torch.rand(16, 12, generator=_gen(3611))
_C02_K, _C02_D, _C02_BETA = 8, 4, 0.25


class _C02VqVae(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 2 * _C02_D))
        self.decoder = nn.Sequential(nn.Linear(2 * _C02_D, 16), nn.ReLU(), nn.Linear(16, 12))
        self.codebook = nn.Parameter(torch.randn(_C02_K, _C02_D, generator=_gen(3612)) * 0.5)

    def quantize(self, inputs: torch.Tensor, bug: bool) -> tuple[torch.Tensor, torch.Tensor]:
        flat = inputs.reshape(-1, _C02_D)
        distances = (flat ** 2).sum(-1, keepdim=True) - 2 * flat @ self.codebook.T + (self.codebook ** 2).sum(-1)
        indices = distances.argmin(-1)
        quantize = self.codebook[indices].reshape(inputs.shape)
        if bug:
            quantize = inputs + (quantize - inputs).detach()  # straight-through estimator first
            encoding_loss = ((quantize.detach() - inputs) ** 2).mean()
            commit_loss = ((quantize - inputs.detach()) ** 2).mean()
        else:
            encoding_loss = ((quantize.detach() - inputs) ** 2).mean()
            commit_loss = ((quantize - inputs.detach()) ** 2).mean()
            quantize = inputs + (quantize - inputs).detach()
        return quantize, encoding_loss + _C02_BETA * commit_loss


def _c02_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _C02VqVae().train()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)

    def step() -> torch.Tensor:
        opt.zero_grad()
        z_e = model.encoder(_C02_X)
        z_q, codebook_loss = model.quantize(z_e, bug)
        x_pred = model.decoder(z_q)
        loss = F.mse_loss(x_pred, _C02_X) + codebook_loss
        loss.backward()
        opt.step()
        return loss.detach()

    return model, step, _kw(optimizer=opt, inputs=_C02_X)


def _c02_proof(bug: bool) -> bool:
    """After a few real training steps, has the codebook stayed exactly at its initialisation?"""
    model, step, _ = _c02_build(bug)
    before = model.codebook.detach().clone()
    for _ in range(3):
        step()
    return bool(torch.equal(model.codebook.detach(), before))


# --------------------------------------------------------------------------------------------- case-03
# theislab/CellFlow PR #305: the GENOT solver learns a conditional flow from a latent (noise) sample to the target,
# conditioned on the source. Its training loss builds the path x_t from `latent` to `target`, but regresses the velocity
# field onto `compute_ut(t, x_t, source, target)` = target - source, not the velocity of that path, target - latent.
# Source and latent have the same shape, so nothing raises and the loss falls; a perfectly trained field then lands at
# latent + (target - source), off by latent - source on every sample. Fix in the PR: `compute_ut(t, x_t, latent,
# target)`. Reproduced in torch on a tiny MLP velocity field (the repository is JAX).

_C03_N, _C03_DIM = 16, 4
_C03_SOURCE = torch.randn(_C03_N, _C03_DIM, generator=_gen(3621))
_C03_TARGET = _C03_SOURCE * 0.5 + 2.0 + 0.1 * torch.randn(_C03_N, _C03_DIM, generator=_gen(3622))


class _C03VelocityField(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2 * _C03_DIM + 1, 32), nn.SiLU(), nn.Linear(32, 32), nn.SiLU(),
                                 nn.Linear(32, _C03_DIM))

    def forward(self, t: torch.Tensor, x_t: torch.Tensor, condition: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([x_t, t[:, None], condition], dim=-1))


def _c03_path(t: torch.Tensor, latent: torch.Tensor, source: torch.Tensor, target: torch.Tensor,
              bug: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """compute_xt (linear path latent -> target) and the velocity the loss regresses onto."""
    x_t = (1 - t[:, None]) * latent + t[:, None] * target
    u_t = target - source if bug else target - latent
    return x_t, u_t


def _c03_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _C03VelocityField().train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    gen = _gen(3623)

    def step() -> torch.Tensor:
        opt.zero_grad()
        t = torch.rand(_C03_N, generator=gen)
        latent = torch.randn(_C03_N, _C03_DIM, generator=gen)
        x_t, u_t = _c03_path(t, latent, _C03_SOURCE, _C03_TARGET, bug)
        v_t = model(t, x_t, _C03_SOURCE)
        loss = ((v_t - u_t) ** 2).mean()
        loss.backward()
        opt.step()
        return loss.detach()

    return model, step, _kw(optimizer=opt, inputs={"source": _C03_SOURCE, "target": _C03_TARGET})


def _c03_proof(bug: bool) -> bool:
    """Is the regression target the time derivative of the path the step samples x_t from (autograd on t)?"""
    gen = _gen(3624)
    t = torch.rand(_C03_N, generator=gen).requires_grad_(True)
    latent = torch.randn(_C03_N, _C03_DIM, generator=gen)
    x_t, u_t = _c03_path(t, latent, _C03_SOURCE, _C03_TARGET, bug)
    dxdt = torch.stack([torch.autograd.grad(x_t[:, j].sum(), t, retain_graph=True)[0] for j in range(_C03_DIM)], -1)
    return bool((dxdt - u_t).abs().max() > 1e-4)


# --------------------------------------------------------------------------------------------- case-04
# nerfstudio-project/nerfstudio issue #1214 (fixed by PR #1373, "Add support for sparse depth maps"): depth-nerfacto's
# depth supervision (`ds_nerf_depth_loss`) is computed on every sampled ray, including rays whose lidar depth image is 0
# (no return: unknown depth). Those rays are trained as if the surface sat at depth 0, pulling their ray weights toward
# the first samples; with sparse lidar most rays are such rays. The RGB and depth losses still fall. Fix in PR #1373:
# `depth_mask = termination_depth > 0` and the per-ray loss multiplied by it. Reproduced on a tiny radiance field MLP
# with volume rendering along fixed rays.

_C04_RAYS, _C04_SAMPLES = 8, 8
_C04_ORIGINS = torch.randn(_C04_RAYS, 3, generator=_gen(3631)) * 0.1
_C04_DIRS = F.normalize(torch.randn(_C04_RAYS, 3, generator=_gen(3632)), dim=-1)
_C04_BINS = torch.linspace(0.05, 2.0, _C04_SAMPLES + 1)
_C04_STEPS = ((_C04_BINS[1:] + _C04_BINS[:-1]) / 2).expand(_C04_RAYS, _C04_SAMPLES)[..., None]
_C04_LENGTHS = (_C04_BINS[1:] - _C04_BINS[:-1]).expand(_C04_RAYS, _C04_SAMPLES)[..., None]
_C04_RGB = torch.rand(_C04_RAYS, 3, generator=_gen(3633))
_C04_DEPTH = torch.rand(_C04_RAYS, 1, generator=_gen(3634)) * 1.5 + 0.3
_C04_DEPTH[::2] = 0.0  # sparse lidar: no return on half of the rays
_C04_SIGMA, _C04_DEPTH_MULT = 0.01, 1e-1


class _C04Field(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(3, 32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, points: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.mlp(points)
        return F.softplus(out[..., :1]), torch.sigmoid(out[..., 1:])


def _c04_render(field: _C04Field) -> tuple[torch.Tensor, torch.Tensor]:
    points = _C04_ORIGINS[:, None, :] + _C04_DIRS[:, None, :] * _C04_STEPS
    density, rgb = field(points)
    delta_density = density * _C04_LENGTHS
    alphas = 1 - torch.exp(-delta_density)
    transmittance = torch.cumsum(delta_density[..., :-1, :], dim=-2)
    transmittance = torch.cat([torch.zeros_like(transmittance[..., :1, :]), transmittance], dim=-2)
    weights = alphas * torch.exp(-transmittance)
    return weights, (weights * rgb).sum(dim=-2)


def _c04_depth_loss(weights: torch.Tensor, termination_depth: torch.Tensor, bug: bool) -> torch.Tensor:
    """ds_nerf_depth_loss before (bug) and after (fix) PR #1373."""
    loss = -torch.log(weights + 1e-7) * torch.exp(-((_C04_STEPS - termination_depth[:, None]) ** 2)
                                                  / (2 * _C04_SIGMA)) * _C04_LENGTHS
    loss = loss.sum(-2)
    if not bug:
        loss = loss * (termination_depth > 0)
    return loss.mean()


def _c04_build(bug: bool) -> Case:
    torch.manual_seed(0)
    field = _C04Field().train()
    opt = torch.optim.Adam(field.parameters(), lr=1e-2, eps=1e-15)

    def step() -> torch.Tensor:
        opt.zero_grad()
        weights, rgb = _c04_render(field)
        loss = F.mse_loss(rgb, _C04_RGB) + _C04_DEPTH_MULT * _c04_depth_loss(weights, _C04_DEPTH, bug)
        loss.backward()
        opt.step()
        return loss.detach()

    return field, step, _kw(optimizer=opt, inputs={"origins": _C04_ORIGINS, "directions": _C04_DIRS})


def _c04_proof(bug: bool) -> bool:
    """Does the depth loss send a gradient to the ray weights of rays with no depth measurement (depth 0)?"""
    field, _, _ = _c04_build(bug)
    weights, _ = _c04_render(field)
    weights.retain_grad()
    _c04_depth_loss(weights, _C04_DEPTH, bug).backward()
    missing = (_C04_DEPTH[:, 0] == 0)
    return bool(weights.grad[missing].abs().max() > 0)


# --------------------------------------------------------------------------------------------- case-05
# clovaai/CutMix-PyTorch issue #1 ("True lambda"): train.py samples lam ~ Beta(1, 1), cuts a box of area (1 - lam) with
# rand_bbox and pastes the shuffled images into it, then weights the two targets by lam and 1 - lam. rand_bbox clips the
# box at the image border, so near an edge the pasted area is smaller than 1 - lam and the label mix no longer matches
# the pixel mix: the second image's label gets more weight than its share of the pixels. Training runs normally. Fix
# (agreed by the author, merged): recompute `lam = 1 - ((bbx2 - bbx1) * (bby2 - bby1) / (W * H))` from the clipped
# box before the loss.

_C05_X = torch.rand(8, 3, 8, 8, generator=_gen(3641))
_C05_Y = torch.randint(0, 5, (8,), generator=_gen(3642))
_C05_BETA, _C05_SEED = 1.0, 16


def _c05_rand_bbox(size: torch.Size, lam: float, rng: np.random.RandomState) -> tuple[int, int, int, int]:
    W, H = size[2], size[3]
    cut_rat = np.sqrt(1.0 - lam)
    cut_w, cut_h = int(W * cut_rat), int(H * cut_rat)
    cx, cy = rng.randint(W), rng.randint(H)
    bbx1 = int(np.clip(cx - cut_w // 2, 0, W))
    bby1 = int(np.clip(cy - cut_h // 2, 0, H))
    bbx2 = int(np.clip(cx + cut_w // 2, 0, W))
    bby2 = int(np.clip(cy + cut_h // 2, 0, H))
    return bbx1, bby1, bbx2, bby2


def _c05_cutmix(images: torch.Tensor, target: torch.Tensor, rng: np.random.RandomState, gen: torch.Generator,
                bug: bool):
    images = images.clone()
    lam = float(rng.beta(_C05_BETA, _C05_BETA))
    rand_index = torch.randperm(images.size(0), generator=gen)
    target_a, target_b = target, target[rand_index]
    bbx1, bby1, bbx2, bby2 = _c05_rand_bbox(images.size(), lam, rng)
    images[:, :, bbx1:bbx2, bby1:bby2] = images[rand_index, :, bbx1:bbx2, bby1:bby2]
    if not bug:
        lam = 1 - ((bbx2 - bbx1) * (bby2 - bby1) / (images.size()[-1] * images.size()[-2]))
    return images, target_a, target_b, lam, rand_index


def _c05_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(8, 5)).train()
    criterion = nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    rng = np.random.RandomState(_C05_SEED)
    gen = _gen(3643)

    def step() -> torch.Tensor:
        images, target_a, target_b, lam, _ = _c05_cutmix(_C05_X, _C05_Y, rng, gen, bug)
        output = model(images)
        loss = criterion(output, target_a) * lam + criterion(output, target_b) * (1.0 - lam)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()

    return model, step, _kw(optimizer=opt, inputs=_C05_X)


def _c05_proof(bug: bool) -> bool:
    """Does the weight the first step gives the pasted images' labels (1 - lam) differ from the share of pixels that
    really came from them (measured on the mixed batch)?"""
    images, _, _, lam, rand_index = _c05_cutmix(_C05_X, _C05_Y, np.random.RandomState(_C05_SEED), _gen(3643), bug)
    i = int((rand_index != torch.arange(len(rand_index))).nonzero()[0])
    pasted = (images[i] != _C05_X[i]).any(dim=0).float().mean().item()
    return bool(abs((1.0 - lam) - pasted) > 1e-6)


CASES: list[BlindCase] = [
    BlindCase("b36b-01", "https://github.com/Zeleni9/pytorch-wgan/issues/40", "gradient penalty over wrong dim",
              "The WGAN-GP penalty takes the gradient norm over the single channel dimension, so it constrains each "
              "pixel's gradient to magnitude 1 instead of each image's gradient norm.", _c01_build, _c01_proof,
              known_miss="a gradient penalty normed over the wrong dimension: arithmetic inside the loss"),
    BlindCase("b36b-02", "https://github.com/andylolu2/jax-vqvae-gpt/issues/2", "VQ codebook gets no gradient",
              "The VQ losses are computed after the straight-through estimator, so the codebook term's gradient goes to "
              "the encoder and the codebook never trains.", _c02_build, _c02_proof),
    BlindCase("b36b-03", "https://github.com/theislab/CellFlow/pull/305", "flow matching wrong velocity target",
              "The flow-matching loss regresses onto target - source while the path runs from the latent sample to the "
              "target, so the field learns the wrong velocity.", _c03_build, _c03_proof,
              known_miss="a flow-matching target built from the wrong endpoint: the target's arithmetic is outside the model"),
    BlindCase("b36b-04", "https://github.com/nerfstudio-project/nerfstudio/issues/1214", "missing depth supervised as zero",
              "The depth loss is not masked where the lidar depth is 0 (unknown), so those rays are trained toward a "
              "surface at depth zero.", _c04_build, _c04_proof,
              known_miss="missing depth encoded as 0 and supervised: which targets are observed is data semantics"),
    BlindCase("b36b-05", "https://github.com/clovaai/CutMix-PyTorch/issues/1", "CutMix label weight mismatched",
              "The label mixing weight comes from the sampled lambda, not the clipped box actually pasted, so the "
              "labels are mixed in a different ratio than the pixels.", _c05_build, _c05_proof,
              known_miss="a CutMix label weight from the unclipped box: the mixing weight's arithmetic is outside the model"),
]
