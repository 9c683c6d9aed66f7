"""Blind batch 32 (part b): silent computer-vision and medical-imaging training bugs from public GitHub threads.

Collected by someone who does not write the audit's checks. Every case builds the user's setup on a tiny model
(small conv segmenters, a tiny anchor-based detection head, a tiny multi-frame super-resolution pair of fusion and
registration nets; plain PyTorch, nothing downloaded), with its fixed twin, and proves the bug without the audit on
real tensors and real steps.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw, _sgd_step


class _TinySeg(nn.Module):
    """A two-conv segmenter: image (B, c_in, H, W) to per-pixel logits (B, n_out, H, W)."""

    def __init__(self, c_in: int = 1, n_out: int = 1, hidden: int = 8) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, hidden, 3, padding=1)
        self.conv2 = nn.Conv2d(hidden, n_out, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv2(torch.relu(self.conv1(x)))


# --------------------------------------------------------------------------------------------- case-01
# Project-MONAI/MONAI issue #8655 (fixed by PR #8704, merged): a UNet is trained for binary segmentation with
# `MaskedDiceLoss(sigmoid=True)` and a mask of the region that should count (here a field-of-view disc). MaskedLoss
# multiplies the *logits* and the target by the mask and only then hands them to DiceLoss, which applies the sigmoid:
# every masked-out pixel becomes sigmoid(0) = 0.5, a half-confident false positive in the Dice denominator. The loss
# then depends on how much of the image is masked out, and the unmasked pixels are trained against that offset; the
# user only sees that MaskedDice trains worse than plain Dice. No error, no warning. Fix in the PR: apply the
# activation first and mask the probabilities (DiceLoss itself then runs with sigmoid=False).

def _c01_dice(p: torch.Tensor, t: torch.Tensor, smooth_nr: float = 1e-5, smooth_dr: float = 1e-5) -> torch.Tensor:
    """MONAI DiceLoss core on probabilities (B, C, H, W), reduced over the spatial axes, mean over batch and class."""
    inter = (p * t).sum(dim=(2, 3))
    den = p.sum(dim=(2, 3)) + t.sum(dim=(2, 3))
    return (1.0 - (2.0 * inter + smooth_nr) / (den + smooth_dr)).mean()


class _C01MaskedDiceLoss(nn.Module):
    """MaskedDiceLoss(sigmoid=True) as in MONAI before (bug) and after (fix) PR #8704."""

    def __init__(self, bug: bool) -> None:
        super().__init__()
        self.bug = bug

    def forward(self, logits: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if self.bug:  # MaskedLoss masks the raw input, then DiceLoss applies its sigmoid
            return _c01_dice(torch.sigmoid(logits * mask), target * mask)
        return _c01_dice(torch.sigmoid(logits) * mask, target * mask)


def _c01_data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = _gen(3201)
    x = torch.randn(4, 1, 16, 16, generator=g)
    target = (F.avg_pool2d(x, 3, 1, 1) > 0.2).float()
    yy, xx = torch.meshgrid(torch.arange(16.0), torch.arange(16.0), indexing="ij")
    fov = (((yy - 7.5) ** 2 + (xx - 7.5) ** 2) <= 6.5 ** 2).float()
    mask = fov.expand(4, 1, 16, 16).clone()
    return x, target, mask


_C01_X, _C01_Y, _C01_M = _c01_data()


def _c01_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _TinySeg(1, 1)
    loss_fn = _C01MaskedDiceLoss(bug)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    step = _sgd_step(model, opt, lambda: loss_fn(model(_C01_X), _C01_Y, _C01_M))
    return model, step, _kw(optimizer=opt, inputs=(_C01_X, _C01_Y, _C01_M))


def _c01_proof(bug: bool) -> bool:
    """After a few steps, pad the batch with extra masked-out pixels (the unmasked ones unchanged): the loss of a
    correct masked Dice cannot move, the buggy one does."""
    model, step, _ = _c01_build(bug)
    loss_fn = _C01MaskedDiceLoss(bug)
    for _ in range(3):
        step()
    with torch.no_grad():
        logits = model(_C01_X)
        base = loss_fn(logits, _C01_Y, _C01_M)
        pad = torch.full((4, 1, 16, 8), 3.0)
        padded = loss_fn(torch.cat([logits, pad], 3), torch.cat([_C01_Y, torch.zeros_like(pad)], 3),
                         torch.cat([_C01_M, torch.zeros_like(pad)], 3))
    return abs(float(padded) - float(base)) > 1e-4


# --------------------------------------------------------------------------------------------- case-02
# yqyao/SSD_Pytorch issue #32 (maintainer: "Yes, you are right", fixed in commit 6060bbb "fix bugs in
# focal_loss_sigmoid"): an SSD/RetinaNet-style detector is trained with the repo's FocalLossSigmoid on one-hot class
# targets per anchor. The negative term is written -(1-P)^gamma * log(1-P) instead of -P^gamma * log(1-P): the focal
# modulation is inverted for negatives: easy background anchors are not down-weighted, and once a background anchor's
# P passes ~0.4 its loss *falls* as P rises (to 0 at P -> 1), so gradient descent pushes confident false positives up
# instead of down. The loss is finite and falls; the detector just never learns to suppress its hard false
# positives. Fix: `torch.pow(P, self.gamma)` in the negative term.

class _C02FocalLossSigmoid(nn.Module):
    """FocalLossSigmoid from the repo (size_average=False), before (bug) and after (fix) commit 6060bbb."""

    def __init__(self, bug: bool, alpha: float = 0.25, gamma: float = 2.0) -> None:
        super().__init__()
        self.bug, self.alpha, self.gamma = bug, alpha, gamma

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        P = torch.sigmoid(inputs)
        alpha_mask = self.alpha * targets
        loss_pos = -1.0 * torch.pow(1 - P, self.gamma) * torch.log(P) * targets * alpha_mask
        neg_mod = torch.pow(1 - P, self.gamma) if self.bug else torch.pow(P, self.gamma)
        loss_neg = -1.0 * neg_mod * torch.log(1 - P) * (1 - targets) * (1 - alpha_mask)
        return (loss_neg + loss_pos).sum()


class _C02TinyDetector(nn.Module):
    """Backbone to a 4x4 feature map, then per-location class logits and box offsets for 2 anchors."""

    def __init__(self, n_cls: int = 3, n_anchor: int = 2) -> None:
        super().__init__()
        self.n_cls, self.n_anchor = n_cls, n_anchor
        self.backbone = nn.Sequential(nn.Conv2d(1, 16, 3, stride=2, padding=1), nn.ReLU(),
                                      nn.Conv2d(16, 16, 3, stride=2, padding=1), nn.ReLU())
        self.cls = nn.Conv2d(16, n_anchor * n_cls, 3, padding=1)
        self.loc = nn.Conv2d(16, n_anchor * 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        f = self.backbone(x)
        b = x.shape[0]
        conf = self.cls(f).permute(0, 2, 3, 1).reshape(b, -1, self.n_cls)
        loc = self.loc(f).permute(0, 2, 3, 1).reshape(b, -1, 4)
        return loc, conf


def _c02_data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = _gen(3202)
    x = torch.randn(4, 1, 16, 16, generator=g)
    labels = torch.zeros(4, 32, dtype=torch.long)  # 0 = background; matched anchors get classes 1..3
    pos = torch.rand(4, 32, generator=g) < 0.15
    labels[pos] = torch.randint(1, 4, (int(pos.sum()),), generator=g)
    loc_t = torch.randn(4, 32, 4, generator=g) * 0.5
    return x, labels, loc_t


_C02_X, _C02_LABELS, _C02_LOC = _c02_data()


def _c02_loss(model: nn.Module, focal: nn.Module) -> torch.Tensor:
    """MultiBoxLoss with the sigmoid focal confidence term: one-hot targets over the foreground classes."""
    loc, conf = model(_C02_X)
    pos = _C02_LABELS > 0
    onehot = F.one_hot(_C02_LABELS, 4)[..., 1:].float()  # background rows are all zero
    n = max(int(pos.sum()), 1)
    loss_c = focal(conf.reshape(-1, 3), onehot.reshape(-1, 3)) / n
    loss_l = F.smooth_l1_loss(loc[pos], _C02_LOC[pos], reduction="sum") / n
    return loss_l + loss_c


def _c02_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _C02TinyDetector()
    focal = _C02FocalLossSigmoid(bug)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9, weight_decay=5e-4)
    step = _sgd_step(model, opt, lambda: _c02_loss(model, focal))
    return model, step, _kw(optimizer=opt, inputs=(_C02_X, _C02_LABELS, _C02_LOC))


def _c02_proof(bug: bool) -> bool:
    """For a background anchor the loss must grow with its (false-positive) logit, so its gradient is positive at
    logits 0 and +5. The buggy negative term falls once P > 0.4: its gradient there is negative, so a gradient step
    raises the false-positive logit."""
    _c02_build(bug)[1]()
    focal = _C02FocalLossSigmoid(bug)
    z = torch.tensor([[0.0, 5.0, -5.0]], requires_grad=True)
    focal(z, torch.zeros(1, 3)).backward()
    g = z.grad[0]
    return bool(g[0] <= 0 or g[1] <= 0)


# --------------------------------------------------------------------------------------------- case-03
# Hsuxu/Loss_ToolBox-PyTorch issue #11 (maintainer: "It will cause apply twice activation function", fixed in commit
# a17b612 "add use_sigmoid option"): a multi-class segmenter is trained with the repo's DiceLoss on one-hot targets.
# DiceLoss takes a softmax over the classes and hands each class map to BinaryDiceLoss, which applies a sigmoid again:
# the probabilities the Dice sees are squeezed into [0.5, 0.73], so even a perfect prediction keeps a large loss and
# the gradient reaching the logits is attenuated and biased towards predicting every class everywhere. Training runs,
# the loss falls a little and plateaus high. Fix: DiceLoss calls BinaryDiceLoss with use_sigmoid=False.

class _C03BinaryDiceLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.smooth = 1

    def forward(self, output: torch.Tensor, target: torch.Tensor, use_sigmoid: bool = True) -> torch.Tensor:
        if use_sigmoid:
            output = torch.sigmoid(output)
        output = output.contiguous().view(output.shape[0], -1)
        target = target.contiguous().view(target.shape[0], -1).float()
        num = 2 * torch.sum(output * target, dim=1) + self.smooth
        den = torch.sum(output.pow(2) + target.pow(2), dim=1) + self.smooth
        return (1 - num / den).mean()


class _C03DiceLoss(nn.Module):
    """DiceLoss of the repo at commit 3dfeb8c (bug) and a17b612 (fix)."""

    def __init__(self, bug: bool) -> None:
        super().__init__()
        self.bug = bug
        self.ignore_index: list[int] = []

    def forward(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        assert output.shape == target.shape, "output & target shape do not match"
        dice = _C03BinaryDiceLoss()
        total_loss = 0
        output = F.softmax(output, dim=1)
        for i in range(target.shape[1]):
            if i not in self.ignore_index:
                total_loss = total_loss + dice(output[:, i], target[:, i], use_sigmoid=self.bug)
        return total_loss / (target.size(1) - len(self.ignore_index))


def _c03_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen(3203)
    x = torch.randn(4, 1, 16, 16, generator=g)
    sm = F.avg_pool2d(x, 3, 1, 1)
    labels = (sm > 0.15).long() + (sm > 0.45).long()  # 3 classes
    return x, F.one_hot(labels[:, 0], 3).permute(0, 3, 1, 2).float()


_C03_X, _C03_Y = _c03_data()


def _c03_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _TinySeg(1, 3)
    criterion = _C03DiceLoss(bug)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    step = _sgd_step(model, opt, lambda: criterion(model(_C03_X), _C03_Y))
    return model, step, _kw(optimizer=opt, inputs=(_C03_X, _C03_Y))


def _c03_proof(bug: bool) -> bool:
    """A perfect, confident prediction (logits 20 on the true class) must give a Dice loss near 0."""
    _c03_build(bug)[1]()
    perfect = 20.0 * _C03_Y
    return float(_C03DiceLoss(bug)(perfect, _C03_Y)) > 0.05


# --------------------------------------------------------------------------------------------- case-04
# ServiceNow/HighRes-net issue #8 (maintainer: "I can confirm that this is indeed a bug"): multi-frame
# super-resolution, HRNet fuses the low-res views and ShiftNet registers the super-resolved image to the high-res
# target by a predicted sub-pixel shift, trained jointly on -cPSNR plus a penalty meant to keep the shifts small
# (the paper's eq. 5: the L2 norm of the shifts). train.py writes the penalty as `torch.mean(shifts)**2`: the square
# of the batch-mean shift, so shifts of opposite sign cancel and any zero-mean set of shifts, however large, costs
# nothing. ShiftNet can absorb misregistration with large shifts; the loss looks normal. Fix (per the paper): penalise
# each shift's squared L2 norm, `torch.mean(torch.sum(shifts ** 2, dim=-1))`.

class _C04Fusion(nn.Module):
    """HRNet stand-in: n_views low-res frames (B, V, 8, 8) fused to one x2 super-resolved image (B, 1, 16, 16)."""

    def __init__(self, n_views: int = 3, hidden: int = 16) -> None:
        super().__init__()
        self.enc = nn.Conv2d(n_views, hidden, 3, padding=1)
        self.dec = nn.Conv2d(hidden, 4, 3, padding=1)

    def forward(self, lrs: torch.Tensor) -> torch.Tensor:
        return F.pixel_shuffle(self.dec(torch.relu(self.enc(lrs))), 2)


class _C04ShiftNet(nn.Module):
    """ShiftNet stand-in: a (reference, image) pair to a 2-vector translation in pixels."""

    def __init__(self, hidden: int = 8) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, hidden, 3, stride=2, padding=1)
        self.fc1 = nn.Linear(hidden * 8 * 8, 32)
        self.fc2 = nn.Linear(32, 2, bias=False)  # the repo zero-inits this; here the run is past its first steps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x - x.mean(dim=(2, 3), keepdim=True)
        h = torch.relu(self.conv(x)).flatten(1)
        return self.fc2(torch.relu(self.fc1(h)))

    def transform(self, theta: torch.Tensor, img: torch.Tensor) -> torch.Tensor:
        """Shift images (B, 1, H, W) by theta (B, 2) pixels (bilinear, differentiable; the repo uses Lanczos)."""
        b, _, h, w = img.shape
        aff = torch.zeros(b, 2, 3)
        aff[:, 0, 0] = 1.0
        aff[:, 1, 1] = 1.0
        aff[:, 0, 2] = -2.0 * theta[:, 0] / w
        aff[:, 1, 2] = -2.0 * theta[:, 1] / h
        grid = F.affine_grid(aff, list(img.shape), align_corners=False)
        return F.grid_sample(img, grid, align_corners=False, padding_mode="border")


class _C04Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fusion = _C04Fusion()
        self.regis = _C04ShiftNet()


def _c04_data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = _gen(3204)
    hrs = F.avg_pool2d(torch.rand(4, 1, 18, 18, generator=g), 3, 1)  # (4, 1, 16, 16)
    lrs = F.avg_pool2d(hrs, 2).repeat(1, 3, 1, 1) + 0.02 * torch.randn(4, 3, 8, 8, generator=g)
    hr_maps = (torch.rand(4, 16, 16, generator=g) > 0.1).float()  # clear-pixel status maps
    return lrs, hrs[:, 0], hr_maps


_C04_LRS, _C04_HRS, _C04_MAPS = _c04_data()
_C04_LAMBDA = 1e-2


def _c04_cpsnr(srs: torch.Tensor, hrs: torch.Tensor, hr_maps: torch.Tensor) -> torch.Tensor:
    """get_loss(metric='cPSNR') of the repo: brightness-corrected masked MSE as PSNR, per image."""
    nclear = hr_maps.sum(dim=(1, 2))
    bright = (hr_maps * (hrs - srs)).sum(dim=(1, 2)).detach() / nclear
    mse = (hr_maps * (srs + bright.view(-1, 1, 1) - hrs) ** 2).sum(dim=(1, 2)) / nclear
    return -10 * torch.log10(mse)


def _c04_shift_penalty(shifts: torch.Tensor, bug: bool) -> torch.Tensor:
    if bug:
        return torch.mean(shifts) ** 2
    return torch.mean(torch.sum(shifts ** 2, dim=-1))


def _c04_loss(model: _C04Model, bug: bool) -> torch.Tensor:
    srs = model.fusion(_C04_LRS)  # (B, 1, 16, 16)
    shifts = model.regis(torch.cat([_C04_HRS[:, None], srs], 1))[:, None]  # register_batch: (B, views=1, 2)
    srs_shifted = model.regis.transform(shifts.view(-1, 2), srs)[:, 0]
    loss = torch.mean(-_c04_cpsnr(srs_shifted, _C04_HRS, _C04_MAPS))
    return loss + _C04_LAMBDA * _c04_shift_penalty(shifts, bug)


def _c04_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _C04Model()
    opt = torch.optim.Adam(list(model.fusion.parameters()) + list(model.regis.parameters()), lr=1e-3)
    step = _sgd_step(model, opt, lambda: _c04_loss(model, bug))
    return model, step, _kw(optimizer=opt, inputs=(_C04_LRS, _C04_HRS, _C04_MAPS))


def _c04_proof(bug: bool) -> bool:
    """Take the shifts ShiftNet predicts after a few steps and remove their batch mean: the shifts are still non-zero,
    yet the buggy penalty on them is exactly zero (it only sees the mean shift)."""
    model, step, _ = _c04_build(bug)
    for _ in range(3):
        step()
    with torch.no_grad():
        srs = model.fusion(_C04_LRS)
        shifts = model.regis(torch.cat([_C04_HRS[:, None], srs], 1))[:, None]
        centred = shifts - shifts.mean()
        assert float(centred.abs().max()) > 1e-4
        return float(_c04_shift_penalty(centred, bug)) < 1e-10


# --------------------------------------------------------------------------------------------- case-05
# jeya-maria-jose/Medical-Transformer issue #22 (fixed by PR #31, merged): train.py builds
# `tf_train = JointTransform2D(crop=crop, p_flip=0.5, ...)` and `tf_val = JointTransform2D(crop=crop, p_flip=0, ...)`
# but then `train_dataset = ImageToImage2D(args.train_dataset, tf_val)`: the training set gets the validation
# transform, so the joint random flip of image and mask never happens and the model trains on the same un-augmented
# images every epoch (a medical segmentation set of a few dozen images, where the flip was the regulariser). Nothing
# fails; training loss just falls faster and validation is worse. Fix: pass tf_train to the training dataset.

class _C05JointTransform2D:
    """The repo's JointTransform2D with crop=None and no colour jitter: a joint random horizontal flip."""

    def __init__(self, p_flip: float) -> None:
        self.p_flip = p_flip

    def __call__(self, image: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if np.random.rand() < self.p_flip:
            image, mask = torch.flip(image, dims=[-1]), torch.flip(mask, dims=[-1])
        return image, mask


class _C05ImageToImage2D(torch.utils.data.Dataset):
    """Image/mask pairs (in memory instead of read from disk) passed through the joint transform."""

    def __init__(self, images: torch.Tensor, masks: torch.Tensor, joint_transform: _C05JointTransform2D) -> None:
        self.images, self.masks, self.joint_transform = images, masks, joint_transform

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, idx: int) -> tuple[torch.Tensor, torch.Tensor, str]:
        image, mask = self.joint_transform(self.images[idx], self.masks[idx])
        return image, mask, f"img{idx:03d}.png"


def _c05_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen(3205)
    images = torch.rand(8, 1, 16, 16, generator=g)
    images[:, :, :, :5] += 0.8  # a bright structure on the left, so a flip changes the image
    masks = (images[:, 0] > 0.9).long()
    return images, masks


_C05_IMAGES, _C05_MASKS = _c05_data()


def _c05_datasets(bug: bool) -> _C05ImageToImage2D:
    tf_train = _C05JointTransform2D(p_flip=0.5)
    tf_val = _C05JointTransform2D(p_flip=0)
    return _C05ImageToImage2D(_C05_IMAGES, _C05_MASKS, tf_val if bug else tf_train)


def _c05_build(bug: bool) -> Case:
    torch.manual_seed(0)
    np.random.seed(0)
    train_dataset = _c05_datasets(bug)
    loader = torch.utils.data.DataLoader(train_dataset, batch_size=4, shuffle=True,
                                         generator=torch.Generator().manual_seed(0))
    model = _TinySeg(1, 2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=1e-5)

    def batches():
        while True:
            yield from loader

    it = batches()
    first = next(it)

    def step() -> torch.Tensor:
        X_batch, y_batch, *_ = next(it)
        output = model(X_batch)
        loss = F.nll_loss(F.log_softmax(output, dim=1), y_batch)  # LogNLLLoss of the repo
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=(first[0], first[1]))


def _c05_proof(bug: bool) -> bool:
    """Draw every training image 10 times through the training dataset: with augmentation some draws come back
    flipped; the buggy set returns the raw image every time."""
    _model, step, _ = _c05_build(bug)
    step()
    np.random.seed(0)
    ds = _c05_datasets(bug)
    for _ in range(10):
        for i in range(len(ds)):
            image, mask, _ = ds[i]
            if not (torch.equal(image, _C05_IMAGES[i]) and torch.equal(mask, _C05_MASKS[i])):
                return False
    return True


CASES: list[BlindCase] = [
    BlindCase("b32b-01", "https://github.com/Project-MONAI/MONAI/issues/8655", "activation after masking in Dice",
              "MaskedDiceLoss masks the logits before its sigmoid, so masked-out pixels enter the Dice as 0.5 false "
              "positives and the loss depends on the masked-out area.", _c01_build, _c01_proof,
              known_miss="an activation applied after masking in a hand-written Dice loss: the order of mask and activation is arithmetic inside the loss"),
    BlindCase("b32b-02", "https://github.com/yqyao/SSD_Pytorch/issues/32", "inverted focal modulation on negatives",
              "The sigmoid focal loss weights negatives by (1-P)^gamma instead of P^gamma, so a background anchor's "
              "loss falls as its false-positive probability rises past ~0.4 and easy background is not down-weighted.", _c02_build, _c02_proof,
              known_miss="a focal modulation inverted on the negatives: a hand-written loss's weighting is not measured"),
    BlindCase("b32b-03", "https://github.com/Hsuxu/Loss_ToolBox-PyTorch/issues/11", "double activation in Dice loss",
              "DiceLoss applies softmax and BinaryDiceLoss applies a sigmoid on top, so the Dice sees probabilities "
              "squeezed into [0.5, 0.73] and a perfect prediction keeps a large loss.", _c03_build, _c03_proof),
    BlindCase("b32b-04", "https://github.com/ServiceNow/HighRes-net/issues/8", "regulariser on batch mean",
              "The shift regulariser squares the batch-mean shift instead of penalising each shift's norm, so opposite "
              "shifts cancel and large zero-mean shifts cost nothing.", _c04_build, _c04_proof,
              known_miss="a regulariser computed on the batch mean: which reduction a term should have is arithmetic inside the loss"),
    BlindCase("b32b-05", "https://github.com/jeya-maria-jose/Medical-Transformer/issues/22",
              "validation transform on training set",
              "The training dataset is built with the validation transform (p_flip=0), so the joint image/mask "
              "augmentation never runs during training.", _c05_build, _c05_proof,
              known_miss="the validation transform applied to the training set: which augmentation a split gets is data semantics"),
]
