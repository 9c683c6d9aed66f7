"""Blind batch 33 (part b): silent bugs in vision and generative training from public GitHub threads, with fixed twins.

Collected by someone who does not write the audit's checks. Every case builds the user's setup on a tiny model in
plain PyTorch (VQ-VAEs, a ViT under DistributedDataParallel, a small U-Net with a Dice loss, a WGAN-GP critic;
nothing is downloaded) and proves the bug without the audit on real tensors and real steps.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw

# --------------------------------------------------------------------------------------------- case-01
# showlab/Olaf-World issue #8: `VectorQuantizer.forward` returns the straight-through output
# `z_q = x + (z - x).detach()` (x the encoder output, z the codebook lookup), and the model computes its codebook loss
# on it: `codebook_loss = F.mse_loss(z_q, z_e.detach())`. The lookup z only appears inside `.detach()`, so the codebook
# loss has no path to the codebook weight; it even pushes on the encoder instead. The codebook stays at its
# initialisation while the reconstruction loss still goes down, which is why it is easy to miss. Fix proposed in the
# thread: compute the codebook loss on the codebook lookup itself, `F.mse_loss(z, z_e.detach())`.

class _C01VQAE(nn.Module):
    """Tiny conv VQ autoencoder: conv encoder, nearest-code quantiser (straight-through), conv decoder."""

    def __init__(self, n_codes: int = 16, dim: int = 8) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, dim, 1))
        self.codebook = nn.Embedding(n_codes, dim)
        self.dec = nn.Sequential(nn.Conv2d(dim, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 3, 1))

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, c, h, w = x.shape
        flat = x.permute(0, 2, 3, 1).reshape(-1, c)
        idx = torch.cdist(flat, self.codebook.weight).argmin(dim=1)
        z = self.codebook(idx).view(b, h, w, c).permute(0, 3, 1, 2)
        z_q = x + (z - x).detach()
        return z_q, z


_C01_X = torch.randn(4, 3, 8, 8, generator=_gen(3301))


def _c01_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _C01VQAE().train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def loss_fn() -> torch.Tensor:
        z_e = model.enc(_C01_X)
        z_q, z = model.quantize(z_e)
        recon = F.mse_loss(model.dec(z_q), _C01_X)
        codebook_loss = F.mse_loss(z_q, z_e.detach()) if bug else F.mse_loss(z, z_e.detach())
        commit_loss = F.mse_loss(z_e, z.detach())
        return recon + codebook_loss + 0.25 * commit_loss

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = loss_fn()
        loss.backward()
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=_C01_X)


def _c01_proof(bug: bool) -> bool:
    """After a few training steps the codebook has not moved at all."""
    model, step, _ = _c01_build(bug)
    before = model.codebook.weight.detach().clone()
    for _ in range(3):
        step()
    return torch.equal(before, model.codebook.weight.detach())


# --------------------------------------------------------------------------------------------- case-02
# karpathy/deep-vector-quantization issue #2 (fixed in commit b39653a): the VQ-VAE's latent cost was written
# `diff = commitment_cost * (z_q - z_e.detach()).pow(2).mean() + (z_q.detach() - z_e).pow(2).mean()`, i.e. the
# commitment weight beta = 0.25 sits on the codebook term and the commitment term (the one that trains the encoder)
# has weight 1. The two terms have the same value, so the logged loss looks the same; only which tensor each gradient
# goes to is swapped: the encoder is pulled towards its codes 4x harder than intended and the codebook 4x more weakly.
# Fix: `commitment_cost * (z_q.detach() - z_e).pow(2).mean() + (z_q - z_e.detach()).pow(2).mean()`.

class _C02VQVAE(nn.Module):
    """Karpathy-style VQ-VAE: conv encoder, `VQVAEQuantize` with kld_scale, conv decoder."""

    def __init__(self, bug: bool, n_embed: int = 16, dim: int = 8) -> None:
        super().__init__()
        self.bug = bug
        self.kld_scale = 10.0
        self.encoder = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1))
        self.proj = nn.Conv2d(16, dim, 1)
        self.embed = nn.Embedding(n_embed, dim)
        self.decoder = nn.Sequential(nn.Conv2d(dim, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 3, 1))
        self.last: dict[str, torch.Tensor] = {}

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z_e = self.proj(self.encoder(x)).permute(0, 2, 3, 1)  # B, H, W, C
        b, h, w, c = z_e.shape
        flat = z_e.reshape(-1, c)
        dist = flat.pow(2).sum(1, keepdim=True) - 2 * flat @ self.embed.weight.t() \
            + self.embed.weight.pow(2).sum(1, keepdim=True).t()
        ind = (-dist).max(1)[1].view(b, h, w)
        z_q = F.embedding(ind, self.embed.weight)
        if z_e.requires_grad:
            z_e.retain_grad()
            z_q.retain_grad()
        self.last = {"z_e": z_e, "z_q": z_q}
        commitment_cost = 0.25
        if self.bug:
            diff = commitment_cost * (z_q - z_e.detach()).pow(2).mean() + (z_q.detach() - z_e).pow(2).mean()
        else:
            diff = commitment_cost * (z_q.detach() - z_e).pow(2).mean() + (z_q - z_e.detach()).pow(2).mean()
        diff = diff * self.kld_scale
        z_st = z_e + (z_q - z_e).detach()
        return self.decoder(z_st.permute(0, 3, 1, 2)), diff


_C02_X = torch.randn(4, 3, 8, 8, generator=_gen(3302))


def _c02_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _C02VQVAE(bug).train()
    opt = torch.optim.Adam(model.parameters(), lr=3e-4)

    def loss_fn() -> torch.Tensor:
        x_hat, latent_loss = model(_C02_X)
        return F.mse_loss(x_hat, _C02_X) + latent_loss

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = loss_fn()
        loss.backward()
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=_C02_X)


def _c02_proof(bug: bool) -> bool:
    """The latent cost pulls the encoder output harder than the code vectors (commitment weight on the wrong side)."""
    torch.manual_seed(0)
    model = _C02VQVAE(bug).train()
    _, diff = model(_C02_X)
    diff.backward()
    g_enc = model.last["z_e"].grad.norm()
    g_code = model.last["z_q"].grad.norm()
    return bool(g_enc > g_code)


# --------------------------------------------------------------------------------------------- case-03
# facebookresearch/deit issue #39 (fixed in PR #52): the optimizer is built with timm's `create_optimizer(args, model)`
# AFTER the model is wrapped in DistributedDataParallel. `create_optimizer` asks `hasattr(model, 'no_weight_decay')`
# to exclude `pos_embed` and `cls_token` from weight decay; the DDP wrapper has no such attribute, so the check is
# silently skipped and weight decay is applied to the position embedding and the class token. Training runs normally.
# Fix in the PR: `create_optimizer(args, model_without_ddp)`.

class _C03ViT(nn.Module):
    """Tiny ViT: conv patch embedding, class token, learned position embedding, one encoder block, head."""

    def __init__(self, dim: int = 32, n_classes: int = 5) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, kernel_size=4, stride=4)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, 5, dim) * 0.02)
        self.block = nn.TransformerEncoderLayer(dim, 2, dim_feedforward=64, dropout=0.0, batch_first=True,
                                                norm_first=True)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, n_classes)

    def no_weight_decay(self) -> set[str]:
        return {"pos_embed", "cls_token"}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        return self.head(self.norm(self.block(x))[:, 0])


def _c03_create_optimizer(model: nn.Module, lr: float = 5e-4, weight_decay: float = 0.05) -> torch.optim.Optimizer:
    """timm's `create_optimizer` (AdamW): biases, 1-D tensors and `model.no_weight_decay()` names get no decay."""
    skip: set[str] = set()
    if hasattr(model, "no_weight_decay"):
        skip = model.no_weight_decay()
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if len(param.shape) == 1 or name.endswith(".bias") or name in skip:
            no_decay.append(param)
        else:
            decay.append(param)
    groups = [{"params": no_decay, "weight_decay": 0.0}, {"params": decay, "weight_decay": weight_decay}]
    return torch.optim.AdamW(groups, lr=lr)


def _c03_ddp(module: nn.Module) -> nn.Module:
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return nn.parallel.DistributedDataParallel(module)


_C03_X = torch.randn(4, 3, 8, 8, generator=_gen(3303))
_C03_Y = torch.randint(0, 5, (4,), generator=_gen(3304))


def _c03_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model_without_ddp = _C03ViT().train()
    model = _c03_ddp(model_without_ddp)
    opt = _c03_create_optimizer(model if bug else model_without_ddp)

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(model(_C03_X), _C03_Y)
        loss.backward()
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=_C03_X)


def _c03_proof(bug: bool) -> bool:
    """With zero gradient on pos_embed (lr step on the head only), it still shrinks: weight decay acts on it."""
    model, step, kw = _c03_build(bug)
    step()
    vit = model.module
    opt = kw["optimizer"]
    wd = {id(p): g["weight_decay"] for g in opt.param_groups for p in g["params"]}
    # one more real step where only the decay can move the position embedding: zero its gradient by hand
    before = vit.pos_embed.detach().clone()
    opt.zero_grad()
    F.cross_entropy(model(_C03_X), _C03_Y).backward()
    vit.pos_embed.grad.zero_()
    vit.cls_token.grad.zero_()
    state = opt.state[vit.pos_embed]
    state["exp_avg"].zero_()
    opt.step()
    shrunk = bool(vit.pos_embed.detach().norm() < before.norm())
    return shrunk and wd[id(vit.pos_embed)] > 0 and wd[id(vit.cls_token)] > 0


# --------------------------------------------------------------------------------------------- case-04
# fastai/fastai PR #3439 (merged): fastai's `DiceLoss` summed the intersection and the union over ALL dimensions
# (batch, class, height, width) before forming one Dice score, so the large background class dominates. The user saw a
# very low loss while the segmentation net predicted everything as background. Fix in the PR: sum over the spatial
# dimensions only, giving one Dice per image and class, then take the mean over those.

class _C04UNet(nn.Module):
    """Two-level U-Net: down block, bottleneck, upsample with skip connection, 1x1 class head."""

    def __init__(self, n_classes: int = 3) -> None:
        super().__init__()
        self.down = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.bott = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.up = nn.ConvTranspose2d(16, 8, 2, stride=2)
        self.out = nn.Sequential(nn.Conv2d(16, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, n_classes, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = self.down(x)
        b = self.bott(F.max_pool2d(d, 2))
        return self.out(torch.cat([d, self.up(b)], dim=1))


class _C04DiceLoss:
    """fastai's DiceLoss (softmax over classes, one-hot target); `per_image_class` is the PR's change."""

    def __init__(self, per_image_class: bool, smooth: float = 1.0) -> None:
        self.per_image_class = per_image_class
        self.smooth = smooth

    def __call__(self, pred: torch.Tensor, targ: torch.Tensor) -> torch.Tensor:
        targ = F.one_hot(targ, pred.shape[1]).permute(0, 3, 1, 2).float()
        pred = pred.softmax(dim=1)
        sum_dims: Any = list(range(2, pred.dim())) if self.per_image_class else list(range(pred.dim()))
        inter = torch.sum(pred * targ, dim=sum_dims)
        union = torch.sum(pred + targ, dim=sum_dims)
        dice = (2.0 * inter + self.smooth) / (union + self.smooth)
        return (1 - dice).flatten().mean()


def _c04_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Mostly background (class 0), a small blob of class 1 and a single pixel patch of class 2 per image."""
    g = _gen(3305)
    x = torch.randn(4, 1, 8, 8, generator=g) * 0.1
    y = torch.zeros(4, 8, 8, dtype=torch.long)
    y[:, 2:4, 2:4] = 1
    y[:, 6, 6] = 2
    x = x + y.unsqueeze(1).float()
    return x, y


_C04_X, _C04_Y = _c04_batch()


def _c04_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _C04UNet().train()
    loss_func = _C04DiceLoss(per_image_class=not bug)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = loss_func(model(_C04_X), _C04_Y)
        loss.backward()
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=_C04_X)


def _c04_proof(bug: bool) -> bool:
    """A prediction of pure background (foreground Dice = 0) already gets a loss near zero from this loss."""
    loss_func = _C04DiceLoss(per_image_class=not bug)
    logits = torch.full((4, 3, 8, 8), -10.0)
    logits[:, 0] = 10.0
    all_background = loss_func(logits, _C04_Y).item()
    return all_background < 0.2


# --------------------------------------------------------------------------------------------- case-05
# LixiangHan/GANs-for-1D-Signal issue #7: the WGAN-GP training script computes the gradient penalty on interpolated
# samples (`grad_penalty = ...`) but never adds it to the critic loss: `loss_D = -D(real).mean() + D(fake).mean()`
# is back-propagated alone. No error, the critic trains, losses look like a WGAN's; the Lipschitz penalty the method
# depends on is simply not applied. Fix suggested in the thread: `loss_D = loss_D + grad_penalty` before backward.

class _C05Critic(nn.Module):
    """1-D conv critic for signals of length 16."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv1d(1, 8, 3, padding=1), nn.LeakyReLU(0.2), nn.Conv1d(8, 8, 3, padding=1),
                                 nn.LeakyReLU(0.2), nn.Flatten(), nn.Linear(8 * 16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class _C05Generator(nn.Module):
    def __init__(self, nz: int = 8) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(nz, 32), nn.ReLU(), nn.Linear(32, 16), nn.Tanh())

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.net(z).unsqueeze(1)


_C05_REAL = torch.sin(torch.linspace(0, 6.28, 16)).repeat(8, 1).unsqueeze(1) \
    + 0.05 * torch.randn(8, 1, 16, generator=_gen(3306))
_C05_Z = torch.randn(8, 8, generator=_gen(3307))
_C05_ALPHA = torch.rand(8, 1, 1, generator=_gen(3308))


def _c05_gradient_penalty(netD: nn.Module, real: torch.Tensor, fake: torch.Tensor) -> torch.Tensor:
    interp = (_C05_ALPHA * real + (1 - _C05_ALPHA) * fake).requires_grad_(True)
    out = netD(interp)
    grads = torch.autograd.grad(out, interp, grad_outputs=torch.ones_like(out), create_graph=True,
                                retain_graph=True)[0]
    return 10.0 * ((grads.flatten(1).norm(2, dim=1) - 1) ** 2).mean()


def _c05_parts(bug: bool) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    netD, netG = _C05Critic().train(), _C05Generator().train()
    optD = torch.optim.Adam(netD.parameters(), lr=1e-4, betas=(0.5, 0.9))
    return netD, netG, optD


def _c05_loss_d(bug: bool, netD: nn.Module, netG: nn.Module) -> torch.Tensor:
    fake = netG(_C05_Z).detach()
    loss_D = -netD(_C05_REAL).mean() + netD(fake).mean()
    grad_penalty = _c05_gradient_penalty(netD, _C05_REAL, fake)
    if not bug:
        loss_D = loss_D + grad_penalty
    return loss_D


def _c05_build(bug: bool) -> Case:
    netD, netG, optD = _c05_parts(bug)

    def step() -> torch.Tensor:
        optD.zero_grad()
        loss_D = _c05_loss_d(bug, netD, netG)
        loss_D.backward()
        optD.step()
        return loss_D

    return netD, step, _kw(optimizer=optD, inputs=_C05_REAL)


def _c05_proof(bug: bool) -> bool:
    """The critic's gradient is exactly the gradient of the Wasserstein term alone: the penalty contributes nothing."""
    netD, netG, _ = _c05_parts(bug)
    _c05_loss_d(bug, netD, netG).backward()
    used = [p.grad.clone() for p in netD.parameters()]
    netD.zero_grad()
    fake = netG(_C05_Z).detach()
    (-netD(_C05_REAL).mean() + netD(fake).mean()).backward()
    plain = [p.grad.clone() for p in netD.parameters()]
    return all(torch.allclose(a, b, atol=1e-7) for a, b in zip(used, plain))


CASES: list[BlindCase] = [
    BlindCase("b33b-01", "https://github.com/showlab/Olaf-World/issues/8", "VQ codebook gets no gradient",
              "The codebook loss is computed on the straight-through output, so it never reaches the codebook, "
              "which stays at its initialisation while reconstruction improves.", _c01_build, _c01_proof),
    BlindCase("b33b-02", "https://github.com/karpathy/deep-vector-quantization/issues/2",
              "VQ loss weights swapped",
              "The commitment weight multiplies the codebook term instead of the commitment term, so the encoder is "
              "pulled 4x harder and the codebook 4x more weakly than intended.", _c02_build, _c02_proof,
              known_miss="VQ commitment and codebook loss weights swapped: a term's weight is not measured"),
    BlindCase("b33b-03", "https://github.com/facebookresearch/deit/issues/39",
              "weight decay on position embeddings",
              "The optimizer is built from the DDP wrapper, which lacks no_weight_decay(), so pos_embed and cls_token "
              "are silently weight-decayed.", _c03_build, _c03_proof,
              known_miss="weight decay on position embeddings with no no-decay group for them: which tensors should decay is convention"),
    BlindCase("b33b-04", "https://github.com/fastai/fastai/pull/3439", "Dice reduced over batch and classes",
              "The Dice loss sums over batch and class dimensions into one score, so background dominates and an "
              "all-background prediction already gets a near-zero loss.", _c04_build, _c04_proof,
              known_miss="a Dice reduced over the batch and classes together: which reduction a hand-written loss should have is arithmetic"),
    BlindCase("b33b-05", "https://github.com/LixiangHan/GANs-for-1D-Signal/issues/7",
              "gradient penalty never added",
              "The WGAN-GP gradient penalty is computed but left out of the critic loss, so the critic trains without "
              "its Lipschitz penalty.", _c05_build, _c05_proof,
              known_miss="a gradient penalty computed and never added: an absent term is not a measurable property of the step"),
]
