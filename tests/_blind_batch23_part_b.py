"""Blind batch 23 (part b): silent training bugs in generative and vision models from public GitHub threads.

Each case builds the reported bug and its fixed twin on a tiny model, and proves the bug without the audit.
"""

from __future__ import annotations

import math
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw

# --------------------------------------------------------------------------------------------- case-06
# A Recycle-GAN (video-to-video translation) reimplementation: the generator objective
# ``updateGenerator(true_x_tuple, fake_y_tuple, true_x_next, fake_y_next, ...)`` scores
# ``net_D(fake_y_next)`` with the adversarial loss, but both calls passed the *ground-truth* next frame
# of the other domain (``true_b_frame_list[i]`` / ``true_a_frame_list[i]``) as ``fake_y_next``. The
# discriminator then judges real frames inside the generator loss, so no adversarial gradient ever reaches
# the translation generators; only the recycle/prediction L2 terms train them. The author confirmed it was
# a mistake and fixed it by passing the generated frames (``fake_b_frame_list[i]`` / ``fake_a_frame_list[i]``).
# Reproduced with tiny conv generators/predictors/discriminators, T=3 frames, t=2, no replay buffer.


class _Conv(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(cin, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, cout, 3, padding=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.net(x))


class _Disc(nn.Module):
    def __init__(self, cin: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(cin, 8, 3, stride=2, padding=1), nn.LeakyReLU(0.2),
                                 nn.Conv2d(8, 1, 3, padding=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class _RecycleGAN(nn.Module):
    """Two spatial generators, two temporal predictors and two discriminators, with their two optimizers."""

    def __init__(self, bug: bool, c: int = 2, t: int = 2, T: int = 3) -> None:
        super().__init__()
        self.bug, self.t, self.T = bug, t, T
        self.G_A_to_B, self.G_B_to_A = _Conv(c, c), _Conv(c, c)
        self.P_A, self.P_B = _Conv(t * c, c), _Conv(t * c, c)
        self.D_A, self.D_B = _Disc(c), _Disc(c)
        self.optim_G = torch.optim.Adam(list(self.G_A_to_B.parameters()) + list(self.G_B_to_A.parameters())
                                        + list(self.P_A.parameters()) + list(self.P_B.parameters()), lr=2e-4)
        self.optim_D = torch.optim.Adam(list(self.D_A.parameters()) + list(self.D_B.parameters()), lr=1e-4)

    @staticmethod
    def adv(pred: torch.Tensor, real: bool) -> torch.Tensor:
        return F.mse_loss(pred, torch.full_like(pred, 1.0 if real else 0.0))

    def update_generator(self, true_x_tuple: torch.Tensor, fake_y_tuple: torch.Tensor, true_x_next: torch.Tensor,
                         fake_y_next: torch.Tensor, P_X: nn.Module, P_Y: nn.Module, net_Y_to_X: nn.Module,
                         net_D: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        fake_x_next = P_X(true_x_tuple)
        reco_x_next = net_Y_to_X(P_Y(fake_y_tuple))
        adv = self.adv(net_D(fake_y_next), True)
        return adv + F.mse_loss(reco_x_next, true_x_next) * 10.0 + F.mse_loss(fake_x_next, true_x_next) * 10.0, adv

    def update_discriminator(self, fake: torch.Tensor, true: torch.Tensor, net_D: nn.Module) -> torch.Tensor:
        return self.adv(net_D(true), True) + self.adv(net_D(fake.detach()), False)

    def losses(self, seq_a: torch.Tensor, seq_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        true_a = list(seq_a.unbind(1))
        true_b = list(seq_b.unbind(1))
        fake_b = [self.G_A_to_B(f) for f in true_a]
        fake_a = [self.G_B_to_A(f) for f in true_b]
        loss_G = seq_a.new_zeros(())
        loss_D = seq_a.new_zeros(())
        adv_total = seq_a.new_zeros(())
        for i in range(self.t, self.T):
            ta = torch.cat(true_a[i - self.t:i], 1).detach()
            fb = torch.cat(fake_b[i - self.t:i], 1).detach()
            tb = torch.cat(true_b[i - self.t:i], 1).detach()
            fa = torch.cat(fake_a[i - self.t:i], 1).detach()
            y_next_b = true_b[i] if self.bug else fake_b[i]
            y_next_a = true_a[i] if self.bug else fake_a[i]
            lg, adv = self.update_generator(ta, fb, true_a[i], y_next_b, self.P_A, self.P_B, self.G_B_to_A, self.D_B)
            loss_G, adv_total = loss_G + lg, adv_total + adv
            lg, adv = self.update_generator(tb, fa, true_b[i], y_next_a, self.P_B, self.P_A, self.G_A_to_B, self.D_A)
            loss_G, adv_total = loss_G + lg, adv_total + adv
            loss_D = loss_D + self.update_discriminator(fake_b[i], true_b[i], self.D_B)
            loss_D = loss_D + self.update_discriminator(fake_a[i], true_a[i], self.D_A)
        return loss_G, loss_D, adv_total


_C06_A = torch.rand(2, 3, 2, 8, 8, generator=_gen(601)) * 2 - 1
_C06_B = torch.rand(2, 3, 2, 8, 8, generator=_gen(602)) * 2 - 1


def _c06_build(bug: bool) -> Case:
    """Recycle-GAN generator step whose adversarial term is evaluated on the real next frame."""
    torch.manual_seed(0)
    model = _RecycleGAN(bug).train()

    def step() -> torch.Tensor:
        loss_G, loss_D, _ = model.losses(_C06_A, _C06_B)
        model.optim_G.zero_grad()
        loss_G.backward()
        model.optim_G.step()
        model.optim_D.zero_grad()
        loss_D.backward()
        model.optim_D.step()
        return loss_G

    return model, step, _kw(optimizer=model.optim_G, inputs=(_C06_A, _C06_B))


def _c06_proof(bug: bool) -> bool:
    """The adversarial part of the generator loss sends no gradient to any translation generator."""
    built, _, _ = _c06_build(bug)
    model = cast(_RecycleGAN, built)
    _, _, adv = model.losses(_C06_A, _C06_B)
    params = list(model.G_A_to_B.parameters()) + list(model.G_B_to_A.parameters())
    grads = torch.autograd.grad(adv, params, allow_unused=True)
    return all(g is None or float(g.abs().sum()) == 0.0 for g in grads)


# --------------------------------------------------------------------------------------------- case-07
# Frame interpolation + super-resolution training script (SAFA, WACV 2024): in ``train.py`` the high-res
# frames are scaled ``data_gpu / 255.`` but the low-res guidance frames ``lowres`` are passed to the model
# raw in [0, 255]; ``evaluate()`` divides both by 255. Users training from scratch got PSNR ~10 dB; a commenter
# found the missing normalisation and reported that dividing ``lowres`` by 255 in the training loop fixes it.
# Reproduced with a tiny fusion conv net predicting the middle frame from two high-res and two low-res frames.


class _InterpSR(nn.Module):
    """Predicts the middle frame from the two outer high-res frames and their two (upsampled) low-res views."""

    def __init__(self) -> None:
        super().__init__()
        self.hi = nn.Conv2d(6, 12, 3, padding=1)
        self.lo = nn.Conv2d(6, 12, 3, padding=1)
        self.out = nn.Sequential(nn.ReLU(), nn.Conv2d(12, 3, 3, padding=1))

    def forward(self, imgs: torch.Tensor, lowres: torch.Tensor) -> torch.Tensor:
        lo = F.interpolate(lowres, size=imgs.shape[-2:], mode="bilinear", align_corners=False)
        return torch.sigmoid(self.out(self.hi(imgs) + self.lo(lo)))


def _c07_clip(seed: int, n: int = 4, hw: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Three smooth frames in 0..255 (uint8-like floats) and their 2x-downsampled copies."""
    g = _gen(seed)
    base = torch.rand(n, 3, 4, 4, generator=g)
    shift = torch.rand(n, 3, 4, 4, generator=g) * 0.3
    frames = [F.interpolate((base + k * shift).clamp(0, 1), size=(hw, hw), mode="bilinear", align_corners=False)
              for k in range(3)]
    hi = torch.cat(frames, 1) * 255.0
    lo = F.avg_pool2d(hi, 2)
    return hi.round(), lo.round()


_C07_HI, _C07_LO = _c07_clip(701)
_C07_VHI, _C07_VLO = _c07_clip(702)


def _c07_batch(hi_raw: torch.Tensor, lo_raw: torch.Tensor, bug: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    data = hi_raw / 255.0
    lowres = torch.cat((lo_raw[:, :3], lo_raw[:, 6:9]), 1)
    if not bug:
        lowres = lowres / 255.0
    imgs = torch.cat((data[:, :3], data[:, 6:9]), 1)
    return imgs, lowres, data[:, 3:6]


def _c07_build(bug: bool) -> Case:
    """Interpolation/SR training step that feeds the low-res frames unnormalised while targets are in [0, 1]."""
    torch.manual_seed(0)
    model = _InterpSR().train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-4)
    imgs, lowres, gt = _c07_batch(_C07_HI, _C07_LO, bug)

    def step() -> torch.Tensor:
        pred = model(imgs, lowres)
        loss = (pred - gt).abs().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=(imgs, lowres))


def _c07_proof(bug: bool) -> bool:
    """After the same training, validation PSNR (inputs scaled as evaluate() does) is far below the twin's."""

    def val_psnr(b: bool) -> float:
        model, step, _ = _c07_build(b)
        for _ in range(40):
            step()
        imgs, lowres, gt = _c07_batch(_C07_VHI, _C07_VLO, bug=False)  # evaluate() divides both by 255
        with torch.no_grad():
            mse = float(((model(imgs, lowres) - gt) ** 2).mean())
        return -10 * math.log10(mse + 1e-10)

    return val_psnr(bug) < val_psnr(False) - 3.0


# --------------------------------------------------------------------------------------------- case-08
# Diffusion LoRA trainer (ostris/ai-toolkit): a commit flipped the sign of the EMA shadow update in
# ``ExponentialMovingAverage.update`` from ``s.sub_((s - p) * (1 - decay))`` to ``s.add_((s - p) * (1 - decay))``.
# The shadow is pushed away from the live weights each step (s <- 1.01 s - 0.01 p at decay 0.99), so it
# grows geometrically; the loss curve is normal and the saved EMA weights are garbage. Fixed by restoring
# ``sub_``. Reproduced with a tiny epsilon-prediction denoiser trained with a linear DDPM schedule and EMA.


class _Denoiser(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d + 1, 32), nn.SiLU(), nn.Linear(32, d))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([x, t[:, None].float() / 100.0], -1))


class _EMA:
    """Shadow copy of the trainable parameters, updated after each optimizer step."""

    def __init__(self, params: list[nn.Parameter], decay: float, bug: bool) -> None:
        self.params, self.decay, self.bug = params, decay, bug
        self.shadow = [p.detach().float().clone() for p in params]

    @torch.no_grad()
    def update(self) -> None:
        one_minus_decay = 1.0 - self.decay
        for s, p in zip(self.shadow, self.params):
            gap = s - p.detach().float()
            if self.bug:
                s.add_(gap * one_minus_decay)
            else:
                s.sub_(gap * one_minus_decay)


_C08_BETAS = torch.linspace(1e-4, 0.02, 100)
_C08_ABAR = torch.cumprod(1 - _C08_BETAS, 0)
_C08_X0 = torch.randn(16, 8, generator=_gen(801)) * 0.5
_C08_T = torch.randint(0, 100, (16,), generator=_gen(802))
_C08_NOISE = torch.randn(16, 8, generator=_gen(803))


def _c08_build(bug: bool) -> Case:
    """Epsilon-prediction diffusion step followed by an EMA update whose sign is flipped."""
    torch.manual_seed(0)
    model = _Denoiser().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ema = _EMA(list(model.parameters()), decay=0.99, bug=bug)
    a = _C08_ABAR[_C08_T][:, None]
    noisy = a.sqrt() * _C08_X0 + (1 - a).sqrt() * _C08_NOISE

    def step() -> torch.Tensor:
        loss = F.mse_loss(model(noisy, _C08_T), _C08_NOISE)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ema.update()
        return loss

    model.ema = ema  # type: ignore[assignment]  # the trainer keeps it beside the network
    return model, step, _kw(optimizer=opt, inputs=(noisy, _C08_T))


def _c08_proof(bug: bool) -> bool:
    """After 200 steps the EMA shadow has drifted far from (and grown past) the live weights."""
    model, step, _ = _c08_build(bug)
    for _ in range(200):
        step()
    ema: _EMA = model.ema  # type: ignore[assignment]
    live = torch.cat([p.detach().flatten() for p in model.parameters()])
    shadow = torch.cat([s.flatten() for s in ema.shadow])
    return float((shadow - live).norm()) > float(live.norm())


# --------------------------------------------------------------------------------------------- case-09
# DeepFill v2 inpainting reimplementation (zhaoyuzhi/deepfillv2): in the LSGAN trainer the discriminator
# block computes ``loss_D = 0.5 * (loss_fake + loss_true)`` and calls ``loss_D.backward()`` but never
# ``optimizer_d.step()``, so the discriminator keeps its initial weights for the whole run while the
# generator trains against it. The maintainer confirmed and added the missing ``optimizer_d.step()``.
# Reproduced with a tiny masked-image generator (coarse + refine outputs) and a patch discriminator.


class _Inpaint(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.coarse = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.ELU(), nn.Conv2d(8, 3, 3, padding=1))
        self.refine = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.ELU(), nn.Conv2d(8, 3, 3, padding=1))

    def forward(self, img: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = img * (1 - mask)
        first = torch.tanh(self.coarse(torch.cat([x, mask], 1)))
        x2 = img * (1 - mask) + first * mask
        second = torch.tanh(self.refine(torch.cat([x2, mask], 1)))
        return first, second


class _PatchD(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(4, 8, 4, stride=2, padding=1), nn.LeakyReLU(0.2),
                                 nn.Conv2d(8, 1, 4, stride=2, padding=1))

    def forward(self, img: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([img, mask], 1))


class _DeepFill(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.generator = _Inpaint()
        self.discriminator = _PatchD()


_C09_IMG = torch.rand(4, 3, 16, 16, generator=_gen(901)) * 2 - 1
_C09_MASK = torch.zeros(4, 1, 16, 16)
_C09_MASK[:, :, 4:12, 4:12] = 1.0


def _c09_build(bug: bool) -> Case:
    """LSGAN inpainting step whose discriminator loss is backpropagated but never applied."""
    torch.manual_seed(0)
    model = _DeepFill().train()
    gen, disc = model.generator, model.discriminator
    optimizer_g = torch.optim.Adam(gen.parameters(), lr=1e-4, betas=(0.5, 0.999))
    optimizer_d = torch.optim.Adam(disc.parameters(), lr=4e-4, betas=(0.5, 0.999))
    img, mask = _C09_IMG, _C09_MASK

    def step() -> torch.Tensor:
        valid = torch.ones(img.shape[0], 1, 4, 4)
        fake = torch.zeros(img.shape[0], 1, 4, 4)
        optimizer_d.zero_grad()
        first_out, second_out = gen(img, mask)
        first_whole = img * (1 - mask) + first_out * mask
        second_whole = img * (1 - mask) + second_out * mask
        fake_scalar = disc(second_whole.detach(), mask)
        true_scalar = disc(img, mask)
        loss_D = 0.5 * (F.mse_loss(fake_scalar, fake) + F.mse_loss(true_scalar, valid))
        loss_D.backward()
        if not bug:
            optimizer_d.step()
        optimizer_g.zero_grad()
        gan_loss = F.mse_loss(disc(second_whole, mask), valid)
        loss = F.l1_loss(first_whole, img) + F.l1_loss(second_whole, img) + 0.01 * gan_loss
        loss.backward()
        optimizer_g.step()
        return loss

    return model, step, _kw(optimizer=optimizer_g, inputs=(_C09_IMG, _C09_MASK))


def _c09_proof(bug: bool) -> bool:
    """After several training iterations the discriminator weights are exactly their initial values."""
    built, step, _ = _c09_build(bug)
    disc = cast(_DeepFill, built).discriminator
    before = [p.detach().clone() for p in disc.parameters()]
    for _ in range(5):
        step()
    return all(torch.equal(b, p.detach()) for b, p in zip(before, disc.parameters()))


# --------------------------------------------------------------------------------------------- case-10
# Self-supervised multi-frame depth (nianticlabs/manydepth): when ``epoch == freeze_teacher_epoch`` the
# trainer's ``freeze_teacher()`` rebuilds ``model_optimizer = Adam(encoder + depth params, learning_rate)``
# and a fresh ``StepLR(model_optimizer, scheduler_step_size, 0.1)``. The schedule restarts from epoch 0 at
# the initial learning rate; with the defaults (freeze at 15, step 15, 20 epochs) the lr never decays. The
# reporter fixed it so the rebuilt optimizer/scheduler keep the schedule position, and retrained (better
# sq_rel/rmse). Reproduced at scale: freeze at epoch 4, step size 4, 8 epochs, one batch per epoch.


class _DepthNets(nn.Module):
    """Teacher (mono depth) + pose nets and the multi-frame encoder/depth nets."""

    def __init__(self) -> None:
        super().__init__()
        self.mono = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 1, 3, padding=1))
        self.pose = nn.Sequential(nn.Conv2d(6, 8, 3, stride=2, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                                  nn.Flatten(), nn.Linear(8, 6))
        self.encoder = nn.Sequential(nn.Conv2d(6, 8, 3, padding=1), nn.ReLU())
        self.depth = nn.Conv2d(8, 1, 3, padding=1)

    def losses(self, cur: torch.Tensor, prev: torch.Tensor, train_teacher: bool) -> torch.Tensor:
        pair = torch.cat([cur, prev], 1)
        multi = torch.sigmoid(self.depth(self.encoder(pair)))
        mono = torch.sigmoid(self.mono(cur))
        pose = self.pose(pair)
        # stand-in for the photometric losses: both depth heads explain a brightness cue; consistency
        target = cur.mean(1, keepdim=True)
        loss = F.l1_loss(multi, target) + 0.1 * F.l1_loss(multi, mono.detach())
        if train_teacher:
            loss = loss + F.l1_loss(mono, target) + 1e-3 * pose.pow(2).mean()
        return loss


class _ManyDepthTrainer:
    LR, STEP, FREEZE, EPOCHS = 1e-4, 4, 4, 8

    def __init__(self, bug: bool) -> None:
        torch.manual_seed(0)
        self.bug = bug
        self.model = _DepthNets().train()
        self.train_teacher_and_pose = True
        self.model_optimizer = torch.optim.Adam(self.model.parameters(), self.LR)
        self.model_lr_scheduler = torch.optim.lr_scheduler.StepLR(self.model_optimizer, self.STEP, 0.1)
        self.cur = torch.rand(2, 3, 8, 8, generator=_gen(1001))
        self.prev = torch.rand(2, 3, 8, 8, generator=_gen(1002))

    def freeze_teacher(self) -> None:
        if not self.train_teacher_and_pose:
            return
        self.train_teacher_and_pose = False
        params = list(self.model.encoder.parameters()) + list(self.model.depth.parameters())
        old = self.model_lr_scheduler
        lr = self.LR if self.bug else old.get_last_lr()[0]
        self.model_optimizer = torch.optim.Adam(params, lr)
        self.model_lr_scheduler = torch.optim.lr_scheduler.StepLR(self.model_optimizer, self.STEP, 0.1)
        if not self.bug:  # keep the schedule's position instead of restarting it at epoch 0
            self.model_lr_scheduler.load_state_dict(old.state_dict())
        self.model.mono.eval()
        self.model.pose.eval()

    def process_batch(self) -> torch.Tensor:
        loss = self.model.losses(self.cur, self.prev, self.train_teacher_and_pose)
        self.model_optimizer.zero_grad()
        loss.backward()
        self.model_optimizer.step()
        return loss

    def run_epoch(self, epoch: int) -> float:
        if epoch == self.FREEZE:
            self.freeze_teacher()
        self.process_batch()
        lr = self.model_optimizer.param_groups[0]["lr"]
        self.model_lr_scheduler.step()
        return float(lr)


def _c10_build(bug: bool) -> Case:
    """Depth training resumed at the teacher-freeze epoch, where optimizer and StepLR were rebuilt."""
    trainer = _ManyDepthTrainer(bug)
    for epoch in range(trainer.FREEZE):
        trainer.run_epoch(epoch)
    trainer.freeze_teacher()

    def step() -> torch.Tensor:
        return trainer.process_batch()

    total = trainer.EPOCHS - trainer.FREEZE
    return trainer.model, step, _kw(optimizer=trainer.model_optimizer, lr_scheduler=trainer.model_lr_scheduler,
                                    inputs=(trainer.cur, trainer.prev), total_steps=total)


def _c10_proof(bug: bool) -> bool:
    """Over the whole run the learning rate never drops below its initial value despite StepLR(step=4)."""
    trainer = _ManyDepthTrainer(bug)
    lrs = [trainer.run_epoch(epoch) for epoch in range(trainer.EPOCHS)]
    return min(lrs) >= trainer.LR


CASES: list[BlindCase] = [
    BlindCase("b23-case-06", "https://github.com/SunnerLi/RecycleGAN/issues/2", "gan-adversarial-target",
              "the generator's adversarial loss scores the real next frame instead of the generated one, so no "
              "adversarial gradient reaches the generators", _c06_build, _c06_proof),
    BlindCase("b23-case-07", "https://github.com/hzwer/WACV2024-SAFA/issues/8", "input-normalization",
              "low-res guidance frames enter training in [0, 255] while targets and evaluation use [0, 1]",
              _c07_build, _c07_proof),
    BlindCase("b23-case-08", "https://github.com/ostris/ai-toolkit/issues/1034", "ema-update",
              "the EMA shadow update has its sign flipped, so the averaged weights diverge from the live ones",
              _c08_build, _c08_proof),
    BlindCase("b23-case-09", "https://github.com/zhaoyuzhi/deepfillv2/issues/6", "missing-optimizer-step",
              "the discriminator loss is backpropagated but optimizer_d.step() is never called, so D never trains",
              _c09_build, _c09_proof),
    BlindCase("b23-case-10", "https://github.com/nianticlabs/manydepth/issues/46", "lr-schedule-reset",
              "rebuilding the optimizer and StepLR at the teacher-freeze epoch restarts the schedule, so the lr "
              "never decays", _c10_build, _c10_proof,
              known_miss="the optimizer and StepLR are rebuilt mid-training, restarting the schedule: a rebuild outside the audited step"),
]
