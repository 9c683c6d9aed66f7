"""Blind batch 26 (part b): silent vision, speech and classic deep-learning training bugs from public GitHub threads,
each with its fixed twin.

Collected by someone who does not write the audit's checks. Every case builds the user's setup on a tiny model
(small hand-written CNNs, a segmentation head, a recurrent diarization model; nothing is downloaded) and proves the
bug without the audit on real tensors and real steps.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw, _sgd_step

# --------------------------------------------------------------------------------------------- case-01
# xudonmao/VMT issue #1 ("Mixup returns different combinations for labels and images"): the mixup layer shuffles
# the batch twice, once for the images and once for the (one-hot) labels, with two independent random shuffles. So
# sample i is mixed with image j but with the label of sample k: the soft targets describe a different pair than
# the pixels. Training runs and the loss goes down (the un-mixed part of each target is still right), it is just
# trained on partly wrong labels. Fix confirmed by the author: one permutation shared by images and labels ("after
# fixing this bug, the performance of VMT can be further improved for almost all the tasks").

_C01_Y = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])
# each image carries its class in the channel that is lit, so the mixed image shows which labels it holds
_C01_X = F.one_hot(_C01_Y, 4).float()[:, :, None, None].expand(8, 4, 8, 8) \
    + 0.05 * torch.randn(8, 4, 8, 8, generator=_gen(2611))


def _c01_net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))


def _c01_mixup(x: torch.Tensor, y: torch.Tensor, bug: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixup of a batch and its one-hot labels with lambda ~ Beta(1, 1), the way the user's mixup layer does it."""
    lam = float(torch.distributions.Beta(1.0, 1.0).sample())
    y1 = F.one_hot(y, 4).float()
    perm_x = torch.randperm(x.size(0))
    perm_y = torch.randperm(x.size(0)) if bug else perm_x   # bug: a second, independent shuffle for the labels
    return lam * x + (1 - lam) * x[perm_x], lam * y1 + (1 - lam) * y1[perm_y]


def _c01_build(bug: bool) -> Case:
    """A small CNN classifier trained on mixup batches with soft-target cross-entropy."""
    torch.manual_seed(0)
    model = _c01_net().train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def loss_fn() -> torch.Tensor:
        xm, ym = _c01_mixup(_C01_X, _C01_Y, bug)
        return torch.sum(-ym * F.log_softmax(model(xm), dim=-1), dim=-1).mean()

    return model, _sgd_step(model, opt, loss_fn), _kw(optimizer=opt, inputs=(_C01_X, _C01_Y))


def _c01_proof(bug: bool) -> bool:
    """The mixed images' lit channels (their true class mixture) differ from the mixed soft targets."""
    _model, step, _ = _c01_build(bug)
    worst = 0.0
    for _ in range(4):
        step()
        xm, ym = _c01_mixup(_C01_X, _C01_Y, bug)
        worst = max(worst, float((xm.mean(dim=(2, 3)) - ym).abs().max()))
    return worst > 0.1


# --------------------------------------------------------------------------------------------- case-02
# kornia/kornia issue #875 ("Bug about the weight factor alpha of focal loss"), fixed by PR #2393: the multi-class
# (softmax) focal loss multiplied the loss of every class by the same scalar alpha (`focal = -alpha * weight *
# log_input_soft`). The alpha of the focal-loss paper balances background against foreground; a uniform factor "is
# equal to just reduce lr, and cannot address the class imbalance issue". The user tuning alpha=0.25 for a
# background-heavy segmentation gets a smaller learning rate and no class balancing, with no error. Fix in the PR:
# alpha_fac = [1 - alpha] + [alpha] * (C - 1), a per-class factor (background 1 - alpha, foreground alpha).

_C02_IMG = torch.randn(4, 3, 8, 8, generator=_gen(2621))
_C02_MASK = torch.zeros(4, 8, 8, dtype=torch.long)
_C02_MASK[:, 2:4, 2:4] = 1
_C02_MASK[:, 5:7, 4:6] = 2


class _C02FocalLoss(nn.Module):
    """Softmax focal loss for dense prediction (kornia's formulation before and after PR #2393)."""

    def __init__(self, alpha: float | None, gamma: float, fixed: bool, reduction: str = "mean") -> None:
        super().__init__()
        self.alpha, self.gamma, self.fixed, self.reduction = alpha, gamma, fixed, reduction

    def forward(self, pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        n_cls = pred.shape[1]
        one_hot = F.one_hot(target, n_cls).permute(0, 3, 1, 2).to(pred.dtype)
        log_p = pred.log_softmax(1)
        loss = -torch.pow(1.0 - log_p.exp(), self.gamma) * log_p * one_hot
        if self.alpha is not None:
            if self.fixed:
                fac = torch.tensor([1 - self.alpha] + [self.alpha] * (n_cls - 1), dtype=pred.dtype)
                loss = fac.view(-1, 1, 1) * loss
            else:
                loss = self.alpha * loss   # bug: one scalar for every class
        loss = loss.sum(1)
        return loss if self.reduction == "none" else loss.mean()


def _c02_net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 3, 1))


def _c02_build(bug: bool) -> Case:
    """A tiny fully convolutional segmenter (class 0 = background) trained with focal loss, alpha=0.25, gamma=2."""
    torch.manual_seed(0)
    model = _c02_net().train()
    crit = _C02FocalLoss(alpha=0.25, gamma=2.0, fixed=not bug)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    step = _sgd_step(model, opt, lambda: crit(model(_C02_IMG), _C02_MASK))
    return model, step, _kw(optimizer=opt, inputs=(_C02_IMG, _C02_MASK))


def _c02_proof(bug: bool) -> bool:
    """After real steps, the alpha-weighted per-pixel loss is the unweighted focal loss times the same factor on
    background and foreground pixels: alpha balances no classes."""
    model, step, _ = _c02_build(bug)
    for _ in range(3):
        step()
    with torch.no_grad():
        pred = model(_C02_IMG)
        weighted = _C02FocalLoss(0.25, 2.0, fixed=not bug, reduction="none")(pred, _C02_MASK)
        plain = _C02FocalLoss(None, 2.0, fixed=not bug, reduction="none")(pred, _C02_MASK)
    ratio = weighted / plain
    bg, fg = ratio[_C02_MASK == 0].mean(), ratio[_C02_MASK > 0].mean()
    return bool(torch.isclose(bg, fg, rtol=1e-4))

# --------------------------------------------------------------------------------------------- case-03
# BUTSpeechFIT/EEND issue #3 ("about loss.py question"): end-to-end neural speaker diarization. The PIT loss drops
# padded frames with `loss[ts_roll == -1] = 0` and divides by the number of frames that are not -1, but the model
# pads the per-recording label matrices with zeros (`torch.cat((t, torch.zeros(...)), dim=1)`). So no frame is ever
# -1: the padding of every shorter recording is trained as "no speaker active" and counted in the normaliser. The
# loss looks normal and falls. The maintainer confirmed ("You are indeed right!"); the fix is to pad the labels with
# -1 (`-1 * torch.ones(...)`), so the mask the loss already has removes them.

_C03_LENS = [16, 12, 9, 6]
_C03_FEATS = torch.randn(4, 16, 8, generator=_gen(2631))
for _i, _n in enumerate(_C03_LENS):
    _C03_FEATS[_i, _n:] = 0.0
_C03_LABELS = [(torch.rand(n, 2, generator=_gen(2632 + i)) > 0.6).float() for i, n in enumerate(_C03_LENS)]
_C03_PAD = torch.arange(16)[None, :] >= torch.tensor(_C03_LENS)[:, None]   # True on padded frames


class _C03Eend(nn.Module):
    """A self-attentive diarization model: frame features -> per-frame speech activity logits of 2 speakers."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.enc = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.out = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        return self.out(self.enc(self.inp(x), src_key_padding_mask=pad))


def _c03_pad_labels(bug: bool) -> torch.Tensor:
    fill = 0.0 if bug else -1.0   # bug: zero padding, which the loss's -1 mask never finds
    return torch.stack([torch.cat((t, torch.full((16 - t.shape[0], 2), fill))) for t in _C03_LABELS])


def _c03_pit_loss(logits: torch.Tensor, ts: torch.Tensor) -> torch.Tensor:
    """Permutation-invariant BCE over the 2 speakers; frames labelled -1 are masked out and not counted."""
    valid = (ts != -1).float()
    per_perm = []
    for perm in ([0, 1], [1, 0]):
        t = ts[..., perm]
        loss = F.binary_cross_entropy_with_logits(logits, t.clamp(min=0.0), reduction="none") * valid[..., perm]
        per_perm.append(loss.sum(dim=(1, 2)) / valid.sum(dim=(1, 2)))
    return torch.stack(per_perm).min(dim=0).values.mean()


def _c03_build(bug: bool) -> Case:
    """Padded batch of 4 recordings of different lengths, PIT loss, Adam."""
    torch.manual_seed(0)
    model = _C03Eend().train()
    ts = _c03_pad_labels(bug)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    step = _sgd_step(model, opt, lambda: _c03_pit_loss(model(_C03_FEATS, _C03_PAD), ts))
    return model, step, _kw(optimizer=opt, inputs=(_C03_FEATS, _C03_PAD))


def _c03_proof(bug: bool) -> bool:
    """After a few real steps, the loss still sends gradient to the logits of padded frames."""
    model, step, _ = _c03_build(bug)
    for _ in range(3):
        step()
    logits = model(_C03_FEATS, _C03_PAD)
    logits.retain_grad()
    _c03_pit_loss(logits, _c03_pad_labels(bug)).backward()
    assert logits.grad is not None
    return bool(logits.grad[_C03_PAD].abs().max() > 0)

# --------------------------------------------------------------------------------------------- case-04
# FlyreelAI/sesemi issue #36 ("Batch norm weights not updated when using EMA in fully supervised mode", labelled bug):
# the EMA copy of the classifier is updated from `model.parameters()` only. BatchNorm running means and variances are
# buffers, so the EMA model keeps the running statistics it was created with (mean 0, variance 1) for the whole run,
# while its weights track the trained network. Training itself is unaffected and the loss falls; only the EMA model
# that gets evaluated and exported normalises with statistics that belong to no network. Expected behaviour in the
# issue: the EMA model's batch-norm statistics track the base model's; the twin averages the floating-point buffers
# with the same decay as the parameters (and copies the integer ones).

_C04_X = torch.randn(8, 3, 8, 8, generator=_gen(2641)) * 2.0 + 1.0
_C04_Y = torch.randint(0, 5, (8,), generator=_gen(2642))


def _c04_net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 5))


@torch.no_grad()
def _c04_ema_update(ema: nn.Module, model: nn.Module, decay: float, bug: bool) -> None:
    for e, p in zip(ema.parameters(), model.parameters()):
        e.mul_(decay).add_(p.detach(), alpha=1 - decay)
    if bug:
        return   # bug: parameters only, the BatchNorm running statistics are never carried over
    for e, b in zip(ema.buffers(), model.buffers()):
        if e.is_floating_point():
            e.mul_(decay).add_(b, alpha=1 - decay)
        else:
            e.copy_(b)


def _c04_setup(bug: bool) -> tuple[nn.Module, nn.Module, Case]:
    """Supervised CNN training with an EMA copy (decay 0.9) updated after every optimizer step."""
    torch.manual_seed(0)
    model = _c04_net().train()
    ema = copy.deepcopy(model).eval()
    for p in ema.parameters():
        p.requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(model(_C04_X), _C04_Y)
        loss.backward()
        opt.step()
        _c04_ema_update(ema, model, 0.9, bug)
        return loss

    return model, ema, (model, step, _kw(optimizer=opt, inputs=(_C04_X, _C04_Y)))


def _c04_build(bug: bool) -> Case:
    return _c04_setup(bug)[2]


def _c04_proof(bug: bool) -> bool:
    """After real steps the trained network's BatchNorm means have moved, the EMA model's are still all zero."""
    model, ema, (_, step, _) = _c04_setup(bug)
    for _ in range(5):
        step()
    bn, ema_bn = model[1], ema[1]
    assert isinstance(bn, nn.BatchNorm2d) and isinstance(ema_bn, nn.BatchNorm2d)
    moved = bool(bn.running_mean.abs().max() > 0.1)
    return moved and bool(torch.all(ema_bn.running_mean == 0))

# --------------------------------------------------------------------------------------------- case-05
# poppinace/indexnet_matting issue #35 ("freeze_bn seems to be an invalid option"): with `--freeze_bn` the network's
# constructor calls `freeze_bn()`, which puts every BatchNorm2d of the pretrained encoder into eval mode once. The
# training function then calls `net.train()` at the start of every epoch, and `nn.Module.train()` recurses into all
# children, so the BatchNorm layers are back in training mode: they normalise with the statistics of the small
# matting batches and overwrite the pretrained running mean/variance. Nothing fails and the loss falls; the reporter
# showed the running statistics changing in a fork that logs them. Fix named in the issue: re-apply freeze_bn()
# whenever the model is switched to train mode (a `train()` override), so the frozen layers stay in eval mode.

_C05_IMG = torch.randn(4, 4, 16, 16, generator=_gen(2651)) * 0.5 + 0.3   # RGB + trimap channel
_C05_ALPHA = torch.rand(4, 1, 16, 16, generator=_gen(2652))
_C05_MEAN = torch.linspace(-0.5, 0.5, 16)   # the encoder's "pretrained" BatchNorm statistics


class _C05Matting(nn.Module):
    """A small encoder-decoder matting network whose encoder BatchNorms come pretrained and are to stay frozen."""

    def __init__(self, freeze_bn: bool, fixed: bool) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Conv2d(4, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                     nn.Conv2d(16, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.decoder = nn.Sequential(nn.Upsample(scale_factor=2.0), nn.Conv2d(16, 8, 3, padding=1), nn.ReLU(),
                                     nn.Conv2d(8, 1, 1))
        with torch.no_grad():
            for m in self.encoder.modules():
                if isinstance(m, nn.BatchNorm2d):
                    m.running_mean.copy_(_C05_MEAN)
                    m.running_var.fill_(2.0)
        self.freeze_bn_flag, self.fixed = freeze_bn, fixed
        if freeze_bn:
            self.freeze_bn()

    def freeze_bn(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.eval()

    def train(self, mode: bool = True) -> _C05Matting:
        super().train(mode)
        if self.fixed and self.freeze_bn_flag:   # the fix: freezing survives every net.train()
            self.freeze_bn()
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.decoder(self.encoder(x)))


def _c05_build(bug: bool) -> Case:
    """--freeze_bn fine-tuning; the epoch loop calls net.train() before its steps."""
    torch.manual_seed(0)
    model = _C05Matting(freeze_bn=True, fixed=not bug)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step() -> torch.Tensor:
        model.train()   # start of the user's train() for the epoch
        opt.zero_grad()
        loss = F.l1_loss(model(_C05_IMG), _C05_ALPHA)
        loss.backward()
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=_C05_IMG)


def _c05_proof(bug: bool) -> bool:
    """After real steps the 'frozen' encoder BatchNorms are in training mode and their pretrained means moved."""
    model, step, _ = _c05_build(bug)
    for _ in range(3):
        step()
    bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    drifted = any(not torch.allclose(m.running_mean, _C05_MEAN) for m in bns)
    return drifted and all(m.training for m in bns)


CASES: list[BlindCase] = [
    BlindCase("b26b-01", "https://github.com/xudonmao/VMT/issues/1", "mixup pairing of images and labels",
              "Mixup shuffles images and labels with two independent permutations, so each mixed image is trained "
              "toward the label mixture of a different pair.", _c01_build, _c01_proof,
              known_miss="mixup pairs images and labels with two permutations: the pairing of mixed inputs and targets is not measured"),
    BlindCase("b26b-02", "https://github.com/kornia/kornia/issues/875", "focal loss class balancing",
              "The softmax focal loss multiplies every class's loss by the same scalar alpha, so alpha only rescales "
              "the learning rate and never down-weights the dominant background class.", _c02_build, _c02_proof,
              known_miss="one scalar alpha on every class of a focal loss: a class weight that weights nothing is not judged"),
    BlindCase("b26b-03", "https://github.com/BUTSpeechFIT/EEND/issues/3", "padding labels in the loss",
              "Diarization labels are padded with 0 while the PIT loss masks frames labelled -1, so every padded "
              "frame is trained as silence and counted in the loss normaliser.", _c03_build, _c03_proof,
              known_miss="padding labelled 0 where the loss masks -1, with no mask the model receives: padding nothing declares in a non-token target is not found"),
    BlindCase("b26b-04", "https://github.com/FlyreelAI/sesemi/issues/36", "EMA model misses BatchNorm buffers",
              "The EMA copy is averaged from the parameters only, so its BatchNorm running statistics stay at their "
              "initial values while its weights follow the trained network.", _c04_build, _c04_proof),
    BlindCase("b26b-05", "https://github.com/poppinace/indexnet_matting/issues/35", "frozen BatchNorm unfrozen by train()",
              "freeze_bn() puts the pretrained BatchNorms in eval mode once, but every epoch's net.train() turns them "
              "back to training mode, so they use batch statistics and overwrite the pretrained running statistics.",
              _c05_build, _c05_proof,
              known_miss="freeze_bn undone by net.train(): the intent to freeze the statistics is in a flag the audit cannot read"),
]
