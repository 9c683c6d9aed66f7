"""Blind batch 18 (part c): silent training bugs from public GitHub threads, each with its fixed twin."""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw, _sgd_step

# --------------------------------------------------------------------------------------------- case-11


class _Byol(nn.Module):
    """Online encoder + projector + predictor; a target encoder + projector kept as a moving average."""

    def __init__(self, d_in: int = 12, d: int = 16, tau: float = 0.9) -> None:
        super().__init__()
        self.online = nn.Sequential(nn.Linear(d_in, d), nn.ReLU(), nn.Linear(d, d))
        self.predictor = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, d))
        self.target = copy.deepcopy(self.online)
        self.target.requires_grad_(False)
        self.tau = tau

    @torch.no_grad()
    def update_moving_average(self) -> None:
        for pt, po in zip(self.target.parameters(), self.online.parameters()):
            pt.mul_(self.tau).add_(po, alpha=1 - self.tau)

    def forward(self, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        def loss_fn(p: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
            return (2 - 2 * F.cosine_similarity(p, z.detach(), dim=-1)).mean()

        p1, p2 = self.predictor(self.online(x1)), self.predictor(self.online(x2))
        with torch.no_grad():
            z1, z2 = self.target(x1), self.target(x2)
        return loss_fn(p1, z2) + loss_fn(p2, z1)


_C11_X = torch.randn(8, 12, generator=_gen(12211))
_C11_N1 = 0.1 * torch.randn(8, 12, generator=_gen(12212))
_C11_N2 = 0.1 * torch.randn(8, 12, generator=_gen(12213))


def _c11_build(bug: bool) -> Case:
    """BYOL training loop: the momentum update of the target network is defined but never called in the loop."""
    torch.manual_seed(11)
    model = _Byol().train()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05, momentum=0.9)
    x1, x2 = _C11_X + _C11_N1, _C11_X + _C11_N2

    def step() -> float:
        opt.zero_grad()
        loss = model(x1, x2)
        loss.backward()
        opt.step()
        if not bug:
            model.update_moving_average()
        return float(loss.detach())

    return model, step, _kw(optimizer=opt, inputs=(x1, x2))


def _c11_proof(bug: bool) -> bool:
    """After five steps the target network is still bit-identical to its initial copy."""
    model, step, _ = _c11_build(bug)
    init = [p.detach().clone() for p in model.target.parameters()]
    for _ in range(5):
        step()
    return all(torch.equal(a, p) for a, p in zip(init, model.target.parameters()))


# --------------------------------------------------------------------------------------------- case-12


class _ValueNorm(nn.Module):
    """Running mean/var normaliser of returns (the critic learns normalised values)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(()))
        self.register_buffer("var", torch.ones(()))

    def fit(self, x: torch.Tensor) -> None:
        self.mean.copy_(x.mean())
        self.var.copy_(x.var())

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.var.sqrt()

    def denormalize(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.var.sqrt() + self.mean


class _ActorCritic(nn.Module):
    def __init__(self, d: int = 4, n_act: int = 3) -> None:
        super().__init__()
        self.actor = nn.Sequential(nn.Linear(d, 16), nn.Tanh(), nn.Linear(16, n_act))
        self.critic = nn.Linear(d, 1)
        self.value_normalizer = _ValueNorm()


_C12_S = torch.randn(64, 4, generator=_gen(12221))
_C12_A = torch.randint(0, 3, (64,), generator=_gen(12222))
_C12_W = torch.tensor([3.0, -2.0, 1.0, 0.5])
_C12_V = 20.0 + 4.0 * (_C12_S @ _C12_W)  # state value: large offset, well-spread
_C12_RET = _C12_V + torch.randn(64, generator=_gen(12223))  # returns: value + small action effect/noise


def _c12_setup() -> tuple[_ActorCritic, torch.Tensor, torch.Tensor]:
    torch.manual_seed(12)
    model = _ActorCritic().train()
    model.value_normalizer.fit(_C12_RET)
    # a critic that already predicts the normalised state value well (least squares fit)
    x = torch.cat([_C12_S, torch.ones(64, 1)], 1)
    sol = torch.linalg.lstsq(x, model.value_normalizer.normalize(_C12_V)[:, None]).solution
    with torch.no_grad():
        model.critic.weight.copy_(sol[:4].t())
        model.critic.bias.copy_(sol[4])
        value_preds = model.critic(_C12_S).squeeze(-1)  # stored in the buffer, normalised scale
        old_logp = F.log_softmax(model.actor(_C12_S), -1).gather(1, _C12_A[:, None]).squeeze(1)
    return model, value_preds, old_logp


def _c12_advantages(model: _ActorCritic, value_preds: torch.Tensor, bug: bool) -> torch.Tensor:
    if bug:  # MAPPO: only the popart branch denormalises, the value-norm run subtracts normalised preds
        adv = _C12_RET - value_preds
    else:
        adv = _C12_RET - model.value_normalizer.denormalize(value_preds)
    return (adv - adv.mean()) / (adv.std() + 1e-5)


def _c12_build(bug: bool) -> Case:
    """MAPPO with value normalisation: advantages = raw returns minus *normalised* value predictions."""
    model, value_preds, old_logp = _c12_setup()
    opt = torch.optim.Adam(model.parameters(), lr=5e-4)
    adv = _c12_advantages(model, value_preds, bug)
    target_v = model.value_normalizer.normalize(_C12_RET)

    def loss_fn() -> torch.Tensor:
        logp = F.log_softmax(model.actor(_C12_S), -1).gather(1, _C12_A[:, None]).squeeze(1)
        ratio = torch.exp(logp - old_logp)
        pol = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv).mean()
        val = F.mse_loss(model.critic(_C12_S).squeeze(-1), target_v)
        return pol + 0.5 * val

    step = _sgd_step(model, opt, loss_fn)
    return model, step, _kw(optimizer=opt, inputs=_C12_S)


def _c12_proof(bug: bool) -> bool:
    """The advantages fed to the policy loss barely correlate with the true advantage (return minus value)."""
    model, value_preds, _ = _c12_setup()
    used = _c12_advantages(model, value_preds, bug)
    true = _C12_RET - _C12_V
    corr = torch.corrcoef(torch.stack([used, true]))[0, 1]
    return bool(corr < 0.5)


# --------------------------------------------------------------------------------------------- case-13


class _TokenPolicy(nn.Module):
    def __init__(self, vocab: int = 20, d: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.emb(ids)))


_C13_IDS = torch.randint(0, 20, (6, 10), generator=_gen(12231))
_C13_LEN = torch.tensor([10, 3, 4, 2, 9, 3])
_C13_MASK = (torch.arange(10)[None, :] < _C13_LEN[:, None]).float()
_C13_ADV = (1.5 + torch.randn(6, 10, generator=_gen(12232))) * _C13_MASK  # padding positions hold 0


def _c13_normalize(bug: bool) -> torch.Tensor:
    with torch.no_grad():
        adv, mask = _C13_ADV, _C13_MASK
        n = mask.sum()
        mean = adv.mean() if bug else (adv * mask).sum() / n  # the bug: mean over padding too
        var = ((adv - mean).pow(2) * mask).sum() / n
        return (adv - mean) * var.clamp(min=1e-8).rsqrt()


def _c13_build(bug: bool) -> Case:
    """Token-level PPO: advantage normalisation takes an unmasked mean (padding zeros included) but a masked var."""
    torch.manual_seed(13)
    model = _TokenPolicy().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    adv = _c13_normalize(bug)
    with torch.no_grad():
        old = F.log_softmax(model(_C13_IDS), -1).gather(2, _C13_IDS[..., None]).squeeze(-1)

    def loss_fn() -> torch.Tensor:
        logp = F.log_softmax(model(_C13_IDS), -1).gather(2, _C13_IDS[..., None]).squeeze(-1)
        ratio = torch.exp(logp - old)
        pg = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
        return (pg * _C13_MASK).sum() / _C13_MASK.sum()

    step = _sgd_step(model, opt, loss_fn)
    return model, step, _kw(optimizer=opt, inputs=_C13_IDS)


def _c13_proof(bug: bool) -> bool:
    """Over the real (unpadded) tokens the 'normalised' advantages are far from zero mean."""
    adv = _c13_normalize(bug)
    masked_mean = (adv * _C13_MASK).sum() / _C13_MASK.sum()
    return bool(masked_mean.abs() > 0.3)


# --------------------------------------------------------------------------------------------- case-14

_C14_H, _C14_W = 6, 8
_C14_IMGS = torch.rand(4, 3, _C14_H, _C14_W, generator=_gen(12241))
_C14_UV = torch.stack([torch.randint(0, _C14_W, (5,), generator=_gen(12242)),
                       torch.randint(0, _C14_H, (5,), generator=_gen(12243))], -1)  # projected points (u, v)


def _c14_sample(i: int, bug: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Dataset __getitem__ with a horizontal flip: the intrinsics (u) are mirrored, the image is np.fliplr'd."""
    import numpy as np

    img = _C14_IMGS[i].permute(1, 2, 0).numpy().copy()  # H, W, C
    uv = _C14_UV.clone()
    if i % 2 == 0:  # flip_image_prob hit
        if bug:
            np.fliplr(img)  # result discarded: the image is not flipped
        else:
            img = np.fliplr(img).copy()
        uv[:, 0] = _C14_W - 1 - uv[:, 0]  # K[0, 2] = scale_w - K[0, 2]
    return torch.from_numpy(img).permute(2, 0, 1).contiguous(), uv


class _PixelPointNet(nn.Module):
    """Image branch whose features at each point's pixel are distilled to the point's own (3-D) feature."""

    def __init__(self) -> None:
        super().__init__()
        self.img = nn.Conv2d(3, 8, 3, padding=1)
        self.pts = nn.Linear(3, 8)

    def forward(self, img: torch.Tensor, uv: torch.Tensor, pts: torch.Tensor) -> torch.Tensor:
        f = self.img(img)  # B, 8, H, W
        b = torch.arange(img.shape[0])[:, None]
        pix = f[b, :, uv[..., 1], uv[..., 0]]  # B, P, 8
        return F.mse_loss(pix, self.pts(pts))


def _c14_batch(bug: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    imgs, uvs = zip(*[_c14_sample(i, bug) for i in range(4)])
    # each point's own signal: the colour of the surface it hits, i.e. the original image at its pixel
    pts = torch.stack([_C14_IMGS[i][:, _C14_UV[:, 1], _C14_UV[:, 0]].t() for i in range(4)])
    return torch.stack(imgs), torch.stack(uvs), pts


def _c14_build(bug: bool) -> Case:
    """Image-to-LiDAR pretraining with flip augmentation whose np.fliplr result is thrown away."""
    torch.manual_seed(14)
    model = _PixelPointNet().train()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    img, uv, pts = _c14_batch(bug)
    step = _sgd_step(model, opt, lambda: model(img, uv, pts))
    return model, step, _kw(optimizer=opt, inputs=(img, uv, pts))


def _c14_proof(bug: bool) -> bool:
    """In flipped samples the pixel each point projects to no longer shows that point's surface."""
    img, uv, pts = _c14_batch(bug)
    b = torch.arange(4)[:, None]
    seen = img[b, :, uv[..., 1], uv[..., 0]]  # B, P, 3
    return bool((seen - pts).abs().max() > 1e-6)


# --------------------------------------------------------------------------------------------- case-15


def _c15_priors(bug: bool, conv_size: int = 4, max_size: int = 64) -> torch.Tensor:
    """YOLACT make_priors: one prior per (cell, scale, aspect ratio) in (cx, cy, w, h)."""
    scales, ars = [24], [1, 0.5, 2]
    out = []
    for j in range(conv_size):
        for i in range(conv_size):
            x, y = (i + 0.5) / conv_size, (j + 0.5) / conv_size
            for scale in scales:
                for ar in ars:
                    ar = math.sqrt(ar)
                    w = scale * ar / max_size
                    h = scale * ar / max_size if bug else scale / ar / max_size
                    out.append([x, y, w, h])
    return torch.tensor(out)


class _BoxHead(nn.Module):
    def __init__(self, n_anchor: int = 3) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 8, 3, padding=1)
        self.loc = nn.Conv2d(8, 4 * n_anchor, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.loc(F.relu(self.conv(x))).permute(0, 2, 3, 1).reshape(x.shape[0], -1, 4)


_C15_X = torch.randn(2, 4, 4, 4, generator=_gen(12251))
_C15_GT = torch.tensor([[0.30, 0.40, 0.30, 0.12], [0.60, 0.55, 0.10, 0.35]])  # cx cy w h: wide and tall objects


def _c15_targets(priors: torch.Tensor) -> torch.Tensor:
    """Match every prior to the gt box nearest its centre and encode offsets (SSD/YOLACT variances 0.1, 0.2)."""
    d = torch.cdist(priors[:, :2], _C15_GT[:, :2])
    gt = _C15_GT[d.argmin(1)]
    g_cxcy = (gt[:, :2] - priors[:, :2]) / (0.1 * priors[:, 2:])
    g_wh = torch.log(gt[:, 2:] / priors[:, 2:]) / 0.2
    return torch.cat([g_cxcy, g_wh], 1)


def _c15_build(bug: bool) -> Case:
    """YOLACT anchors: the prior height multiplies by sqrt(aspect ratio) like the width, so all priors are square."""
    torch.manual_seed(15)
    model = _BoxHead().train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    tgt = _c15_targets(_c15_priors(bug))
    step = _sgd_step(model, opt, lambda: F.smooth_l1_loss(model(_C15_X), tgt.expand(2, -1, -1)))
    return model, step, _kw(optimizer=opt, inputs=_C15_X)


def _c15_proof(bug: bool) -> bool:
    """Every prior box has width equal to height, whatever aspect ratio it was configured with."""
    p = _c15_priors(bug)
    return bool(torch.allclose(p[:, 2], p[:, 3]))


CASES: list[BlindCase] = [
    BlindCase("b18-case-11", "https://github.com/PatrickHua/SimSiam/issues/26", "momentum target never updated",
              "The BYOL target network's moving-average update is never called, so the online net chases a frozen "
              "random target.", _c11_build, _c11_proof,
              known_miss="not examined yet: batch 18 was measured once at the end of round 7"),
    BlindCase("b18-case-12", "https://github.com/marlbenchmark/on-policy/pull/13", "advantage scale mismatch",
              "With value normalisation on, advantages subtract normalised value predictions from raw returns, so the "
              "policy gradient follows the returns instead of the advantage.", _c12_build, _c12_proof,
              known_miss="not examined yet: batch 18 was measured once at the end of round 7"),
    BlindCase("b18-case-13", "https://github.com/NovaSky-AI/SkyRL/issues/1305", "masked mean over padding",
              "Advantage normalisation takes its mean over padded positions too, shifting every real token's "
              "advantage away from zero mean.", _c13_build, _c13_proof,
              known_miss="not examined yet: batch 18 was measured once at the end of round 7"),
    BlindCase("b18-case-14", "https://github.com/Eaphan/NCLR/issues/10", "augmentation result discarded",
              "The flip's np.fliplr result is thrown away while the intrinsics are mirrored, so points are paired "
              "with the wrong pixels in flipped samples.", _c14_build, _c14_proof,
              known_miss="not examined yet: batch 18 was measured once at the end of round 7"),
    BlindCase("b18-case-15", "https://github.com/dbolya/yolact/issues/19", "anchor aspect ratio ignored",
              "Prior heights multiply by the aspect ratio instead of dividing, so every anchor is square and box "
              "regression targets are encoded against the wrong shapes.", _c15_build, _c15_proof,
              known_miss="not examined yet: batch 18 was measured once at the end of round 7"),
]
