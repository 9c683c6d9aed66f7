"""Blind batch 27 (part b): silent vision and speech training bugs from public GitHub threads, each with its fixed twin.

Collected by someone who does not write the audit's checks. Every case builds the user's setup on a tiny model
written in code (a heatmap pose network, a FastSpeech-style mel decoder, a BatchNorm image classifier with an EMA
copy, a CTC speech recogniser under a GradScaler, a small U-Net with a focal loss; nothing is downloaded) and proves
the bug without the audit on real tensors and real steps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw, _sgd_step

# --------------------------------------------------------------------------------------------- case-01
# robertklee/COCO-Human-Pose PR #29 ("Fix R/L bug in augmentation pipeline", merged): the pose trainer's
# augmentation mirrors the image and the keypoint x coordinates with a horizontal flip, but keeps every keypoint in
# its joint slot, so after a flip the person's right wrist is still labelled "left wrist" (and so on for every
# left/right pair). Training runs and the heatmap loss goes down; the network just gets contradictory targets for
# mirrored people (the joint on the image's left is "left" in half the batch and "right" in the other half). The
# fix in the PR: after the flip, swap the keypoints of each left/right pair.

_C01_N, _C01_HW = 8, 16
_C01_PAIRS = ((0, 1), (2, 3))  # (left wrist, right wrist), (left ankle, right ankle)


def _c01_people() -> torch.Tensor:
    """Eight people facing the camera: their left joints lie on the image's right (x as column, y as row)."""
    g = _gen(2711)
    kps = torch.zeros(_C01_N, 4, 2)
    kps[:, 0, 0] = torch.randint(10, 14, (_C01_N,), generator=g).float()  # left wrist x (image right)
    kps[:, 1, 0] = torch.randint(2, 6, (_C01_N,), generator=g).float()    # right wrist x (image left)
    kps[:, 2, 0] = torch.randint(9, 12, (_C01_N,), generator=g).float()   # left ankle x
    kps[:, 3, 0] = torch.randint(4, 7, (_C01_N,), generator=g).float()    # right ankle x
    kps[:, :2, 1] = torch.randint(3, 7, (_C01_N, 1), generator=g).float()
    kps[:, 2:, 1] = torch.randint(11, 15, (_C01_N, 1), generator=g).float()
    return kps


def _c01_gauss(kps: torch.Tensor, sigma: float = 1.0) -> torch.Tensor:
    """One Gaussian heatmap per keypoint: (..., K, H, W)."""
    ys = torch.arange(_C01_HW).float().view(-1, 1)
    xs = torch.arange(_C01_HW).float().view(1, -1)
    dx = xs - kps[..., 0, None, None]
    dy = ys - kps[..., 1, None, None]
    return torch.exp(-(dx ** 2 + dy ** 2) / (2 * sigma ** 2))


def _c01_augment(bug: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The user's data pipeline: render, random horizontal flip (seeded), heatmap targets."""
    kps = _c01_people()
    img = _c01_gauss(kps, sigma=1.5).sum(1, keepdim=True)  # (N, 1, H, W): the joints drawn as blobs
    flip = torch.rand(_C01_N, generator=_gen(2712)) < 0.5
    flip[0], flip[1] = False, True
    img = torch.where(flip.view(-1, 1, 1, 1), img.flip(-1), img)
    kps = kps.clone()
    kps[flip, :, 0] = (_C01_HW - 1) - kps[flip, :, 0]
    if not bug:  # the fix: a mirrored person's left joints are its right joints
        perm = list(range(kps.shape[1]))
        for a, b in _C01_PAIRS:
            perm[a], perm[b] = b, a
        kps[flip] = kps[flip][:, perm]
    return img, _c01_gauss(kps), flip


class _PoseNet(nn.Module):
    """A tiny heatmap pose estimator: image to one heatmap per joint."""

    def __init__(self, joints: int = 4, width: int = 16) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(1, width, 3, padding=1), nn.ReLU(),
                                  nn.Conv2d(width, width, 3, padding=1), nn.ReLU())
        self.head = nn.Conv2d(width, joints, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def _c01_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _PoseNet().train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    img, target, _ = _c01_augment(bug)
    step = _sgd_step(model, opt, lambda: F.mse_loss(model(img), target))
    return model, step, _kw(optimizer=opt, inputs=img)


def _c01_proof(bug: bool) -> bool:
    """Every person faces the camera, so the left wrist's heatmap peak must lie right of the right wrist's; a flipped
    sample whose target puts it on the left carries a contradictory label."""
    _, target, flip = _c01_augment(bug)
    peak_x = target.flatten(2).argmax(-1) % _C01_HW  # (N, K)
    contradictory = (peak_x[:, 0] < peak_x[:, 1]) | (peak_x[:, 2] < peak_x[:, 3])
    _, step, _ = _c01_build(bug)
    losses = [float(step().detach()) for _ in range(3)]  # the step trains without complaint either way
    assert all(torch.isfinite(torch.tensor(losses)))
    return bool(contradictory.any()) and bool(contradictory[flip].all())


# --------------------------------------------------------------------------------------------- case-02
# axelspringer/ForwardTacotron issue #21 (maintainer: "you are right, seems like a bug ... it simply does not mask
# anything"; fixed in PR #22): the model returns mels as (B, n_mels, T), but the masked L1 loss takes its max length
# from dim 1 (`max_len = target.size(1)`, i.e. n_mels) and expands the (B, n_mels) length mask over the last axis.
# Every real length is longer than n_mels, so the mask is all ones and the padded frames of the shorter utterances
# are trained towards the zero padding. Training runs and the loss falls. Fix: build the mask over the time axis
# (`target.size(2)`) and expand it over the mel bins.

_C02_MELS, _C02_T, _C02_VOCAB = 8, 16, 20
_C02_LENS = torch.tensor([16, 13, 11, 9])


def _c02_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Length-regulated phoneme ids (pad 0 after each length) and zero-padded target mels (B, n_mels, T)."""
    ids = torch.randint(1, _C02_VOCAB, (4, _C02_T), generator=_gen(2721))
    mel = torch.randn(4, _C02_MELS, _C02_T, generator=_gen(2722))
    valid = torch.arange(_C02_T)[None, :] < _C02_LENS[:, None]
    return ids * valid, mel * valid[:, None, :]


_C02_IDS, _C02_MEL = _c02_batch()


class _MelDecoder(nn.Module):
    """A FastSpeech-style decoder: frame-level phoneme ids to a mel spectrogram (B, n_mels, T)."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(_C02_VOCAB, dim, padding_idx=0)
        self.conv = nn.Conv1d(dim, dim, 3, padding=1)
        self.out = nn.Linear(dim, _C02_MELS)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv(self.emb(ids).transpose(1, 2))).transpose(1, 2)
        return self.out(h).transpose(1, 2)


def _c02_pad_mask(lens: torch.Tensor, max_len: int) -> torch.Tensor:
    return torch.arange(max_len)[None, :] < lens[:, None]


class _MaskedL1(nn.Module):
    def __init__(self, bug: bool) -> None:
        super().__init__()
        self.bug = bug

    def forward(self, x: torch.Tensor, target: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        if self.bug:  # the thread's code: length from dim 1 (n_mels), mask expanded over the time axis
            mask = _c02_pad_mask(lens, target.size(1)).unsqueeze(2).expand_as(x)
        else:  # the fix: mask over time, expanded over the mel bins
            mask = _c02_pad_mask(lens, target.size(2)).unsqueeze(1).expand_as(x)
        mask = mask.float()
        return F.l1_loss(x * mask, target * mask, reduction="sum") / mask.sum()


def _c02_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _MelDecoder().train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = _MaskedL1(bug)
    step = _sgd_step(model, opt, lambda: crit(model(_C02_IDS), _C02_MEL, _C02_LENS))
    return model, step, _kw(optimizer=opt, inputs=_C02_IDS)


def _c02_proof(bug: bool) -> bool:
    """The loss's gradient reaches the predicted frames past each utterance's length."""
    torch.manual_seed(0)
    model = _MelDecoder().train()
    out = model(_C02_IDS)
    out.retain_grad()
    _MaskedL1(bug)(out, _C02_MEL, _C02_LENS).backward()
    assert out.grad is not None
    padded = ~_c02_pad_mask(_C02_LENS, _C02_T)
    return bool(out.grad.abs().sum(1)[padded].gt(0).any())


# --------------------------------------------------------------------------------------------- case-03
# lucidrains/ema-pytorch issue #8 ("Implementation error", maintainer: "ah yes, thank you"): the EMA wrapper's
# buffer iterator walks `model.named_parameters()` and keeps the names found in its set of buffer names, so it yields
# nothing. The parameters are averaged, but no buffer is ever copied or averaged: the EMA copy of a BatchNorm network
# keeps its initial running statistics (mean 0, var 1) for the whole run while the online network's move. Training is
# unaffected and nothing warns; the EMA model used for evaluation normalises with the wrong statistics. Fix: iterate
# `model.named_buffers()`.

_C03_X = torch.randn(8, 3, 12, 12, generator=_gen(2731)) * 2.0 + 1.0
_C03_Y = torch.randint(0, 5, (8,), generator=_gen(2732))


class _BNClassifier(nn.Module):
    def __init__(self, width: int = 16, classes: int = 5) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
                                      nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU())
        self.fc = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x).mean((2, 3)))


class _EMA:
    """The library's EMA: parameter and buffer names fixed at construction, lerp towards the online model."""

    def __init__(self, model: nn.Module, bug: bool, beta: float = 0.99, update_after_step: int = 0,
                 update_every: int = 1) -> None:
        import copy

        self.online, self.bug, self.beta = model, bug, beta
        self.ema_model = copy.deepcopy(model).requires_grad_(False)
        self.parameter_names = {n for n, p in self.ema_model.named_parameters() if p.dtype == torch.float}
        self.buffer_names = {n for n, b in self.ema_model.named_buffers() if b.dtype == torch.float}
        self.update_after_step, self.update_every = update_after_step, update_every
        self.step, self.initted = 0, False

    def _params(self, model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        return ((n, p) for n, p in model.named_parameters() if n in self.parameter_names)

    def _buffers(self, model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        named = model.named_parameters() if self.bug else model.named_buffers()  # the bug: parameters, not buffers
        return ((n, b) for n, b in named if n in self.buffer_names)

    @torch.no_grad()
    def _copy(self) -> None:
        for (_, ma), (_, cur) in zip(self._params(self.ema_model), self._params(self.online)):
            ma.copy_(cur)
        for (_, ma), (_, cur) in zip(self._buffers(self.ema_model), self._buffers(self.online)):
            ma.copy_(cur)

    @torch.no_grad()
    def update(self) -> None:
        step, self.step = self.step, self.step + 1
        if step % self.update_every:
            return
        if step <= self.update_after_step or not self.initted:
            self._copy()
            self.initted = True
            return
        for (_, cur), (_, ma) in zip(self._params(self.online), self._params(self.ema_model)):
            ma.lerp_(cur, 1.0 - self.beta)
        for (_, cur), (_, ma) in zip(self._buffers(self.online), self._buffers(self.ema_model)):
            ma.lerp_(cur, 1.0 - self.beta)


def _c03_setup(bug: bool) -> tuple[nn.Module, torch.optim.Optimizer, _EMA]:
    torch.manual_seed(0)
    model = _BNClassifier().train()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, opt, _EMA(model, bug)


def _c03_step_fn(model: nn.Module, opt: torch.optim.Optimizer, ema: _EMA) -> Callable[[], torch.Tensor]:
    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(model(_C03_X), _C03_Y)
        loss.backward()
        opt.step()
        ema.update()
        return loss

    return step


def _c03_build(bug: bool) -> Case:
    model, opt, ema = _c03_setup(bug)
    return model, _c03_step_fn(model, opt, ema), _kw(optimizer=opt, inputs=_C03_X)


def _c03_proof(bug: bool) -> bool:
    """After a few steps the online BatchNorm statistics have moved, the EMA copy's are still the initial 0 / 1."""
    model, opt, ema = _c03_setup(bug)
    step = _c03_step_fn(model, opt, ema)
    for _ in range(4):
        step()
    bn_online = next(m for m in model.modules() if isinstance(m, nn.BatchNorm2d))
    bn_ema = next(m for m in ema.ema_model.modules() if isinstance(m, nn.BatchNorm2d))
    assert bn_online.running_mean is not None and bn_online.running_var is not None
    assert bn_ema.running_mean is not None and bn_ema.running_var is not None
    online_moved = bool(bn_online.running_mean.abs().max() > 1e-3)
    ema_untouched = torch.equal(bn_ema.running_mean, torch.zeros_like(bn_ema.running_mean)) and \
        torch.equal(bn_ema.running_var, torch.ones_like(bn_ema.running_var))
    return online_moved and ema_untouched


# --------------------------------------------------------------------------------------------- case-04
# rwth-i6/returnn PR #1595 ("Torch: unscale gradients before noise and clipping", merged, fixes #1590): the PyTorch
# engine of this speech-recognition toolkit, with mixed precision on (a GradScaler), clipped the gradients to the
# configured global norm while they were still multiplied by the loss scale (2**16 at the start), and only then let
# `scaler.step` unscale them. The clip threshold thus applies to the scaled norm: every step's update is cut to about
# max_norm / scale, thousands of times smaller than intended, and the CTC loss just creeps down. No inf/NaN, no
# warning. Fix in the PR: `scaler.unscale_(optimizer)` before clipping.

_C04_FEATS, _C04_T, _C04_TOKENS = 16, 16, 10
_C04_X = torch.randn(4, _C04_T, _C04_FEATS, generator=_gen(2741))
_C04_Y = torch.randint(1, _C04_TOKENS, (4, 5), generator=_gen(2742))
_C04_XLENS = torch.tensor([16, 15, 13, 12])
_C04_YLENS = torch.tensor([5, 4, 4, 3])
_C04_MAX_NORM = 1.0
_C04_LR = 0.1


class _CTCRecogniser(nn.Module):
    """Log-mel frames through a conv front end to per-frame token logits (blank = 0)."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.front = nn.Conv1d(_C04_FEATS, dim, 3, padding=1)
        self.enc = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, _C04_TOKENS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.front(x.transpose(1, 2))).transpose(1, 2)
        return self.out(torch.relu(self.enc(h)))


def _c04_setup(bug: bool) -> tuple[nn.Module, Callable[[], torch.Tensor], torch.optim.Optimizer,
                                   torch.amp.GradScaler]:
    torch.manual_seed(0)
    model = _CTCRecogniser().train()
    opt = torch.optim.SGD(model.parameters(), lr=_C04_LR)
    scaler = torch.amp.GradScaler("cpu")

    def step() -> torch.Tensor:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(_C04_X)
        log_probs = logits.float().log_softmax(-1).transpose(0, 1)  # (T, B, C)
        loss = F.ctc_loss(log_probs, _C04_Y, _C04_XLENS, _C04_YLENS, blank=0, zero_infinity=True)
        scaler.scale(loss).backward()
        if not bug:  # the fix: bring the gradients back to their true size before clipping
            scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), _C04_MAX_NORM)
        scaler.step(opt)
        scaler.update()
        return loss

    return model, step, opt, scaler


def _c04_build(bug: bool) -> Case:
    model, step, opt, scaler = _c04_setup(bug)
    return model, step, _kw(optimizer=opt, inputs=_C04_X, scaler=scaler)


def _c04_proof(bug: bool) -> bool:
    """The update SGD applies (change / lr) has norm min(true grad norm, max_norm); with the bug it is thousands of
    times smaller."""
    model, step, _, _ = _c04_setup(bug)
    torch.manual_seed(1)
    ref = _CTCRecogniser()
    ref.load_state_dict(model.state_dict())
    logits = ref(_C04_X)
    loss = F.ctc_loss(logits.log_softmax(-1).transpose(0, 1), _C04_Y, _C04_XLENS, _C04_YLENS, blank=0,
                      zero_infinity=True)
    loss.backward()
    true_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in ref.parameters()
                                                      if p.grad is not None]))
    before = [p.detach().clone() for p in model.parameters()]
    step()
    applied = torch.linalg.vector_norm(torch.stack([(b - p.detach()).norm() for b, p in
                                                    zip(before, model.parameters())])) / _C04_LR
    intended = min(float(true_norm), _C04_MAX_NORM)
    return float(applied) < 0.01 * intended


# --------------------------------------------------------------------------------------------- case-05
# qubvel/segmentation_models issue #258 (maintainer: "Thanks for pointing out about mistake in positional
# arguments!"; fixed in PR #259 "Fix positional arguments for focal loss"): the `CategoricalFocalLoss(alpha=0.25,
# gamma=2.0)` class calls the functional `categorical_focal_loss(gt, pr, gamma=2.0, alpha=0.25, ...)` with
# `self.alpha, self.gamma` passed positionally, so the loss runs with gamma=0.25 and alpha=2.0. Easy, well-classified
# pixels are hardly down-weighted any more and the whole loss is scaled by 8x; the segmentation network trains with a
# plain weighted cross-entropy instead of the focal loss the user configured. No error, a plausible falling loss.
# Fix in the PR: pass the hyperparameters by keyword.

_C05_CLASSES = 3
_C05_X = torch.randn(4, 3, 16, 16, generator=_gen(2751))
_C05_Y = torch.randint(0, _C05_CLASSES, (4, 16, 16), generator=_gen(2752))
_C05_GT = F.one_hot(_C05_Y, _C05_CLASSES).permute(0, 3, 1, 2).float()


class _TinyUNet(nn.Module):
    """A two-level U-Net: conv block, downsample, conv block, upsample, skip concat, per-pixel class scores."""

    def __init__(self, width: int = 16, classes: int = _C05_CLASSES) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(3, width, 3, padding=1), nn.ReLU())
        self.mid = nn.Sequential(nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU())
        self.up = nn.ConvTranspose2d(2 * width, width, 2, stride=2)
        self.dec = nn.Sequential(nn.Conv2d(2 * width, width, 3, padding=1), nn.ReLU())
        self.head = nn.Conv2d(width, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.enc(x)
        m = self.mid(F.max_pool2d(e, 2))
        return self.head(self.dec(torch.cat([e, self.up(m)], 1)))


def categorical_focal_loss(gt: torch.Tensor, pr: torch.Tensor, gamma: float = 2.0, alpha: float = 0.25,
                           eps: float = 1e-7) -> torch.Tensor:
    """The library's functional focal loss on one-hot targets and softmax probabilities."""
    pr = pr.clamp(eps, 1.0 - eps)
    return (-gt * (alpha * (1.0 - pr) ** gamma * torch.log(pr))).mean()


class CategoricalFocalLoss(nn.Module):
    def __init__(self, bug: bool, alpha: float = 0.25, gamma: float = 2.0) -> None:
        super().__init__()
        self.bug, self.alpha, self.gamma = bug, alpha, gamma

    def forward(self, gt: torch.Tensor, pr: torch.Tensor) -> torch.Tensor:
        if self.bug:  # the thread's call: positional, in the class's (alpha, gamma) order
            return categorical_focal_loss(gt, pr, self.alpha, self.gamma)
        return categorical_focal_loss(gt, pr, alpha=self.alpha, gamma=self.gamma)  # the fix


def _c05_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _TinyUNet().train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = CategoricalFocalLoss(bug)
    step = _sgd_step(model, opt, lambda: crit(_C05_GT, model(_C05_X).softmax(1)))
    return model, step, _kw(optimizer=opt, inputs=_C05_X)


def _c05_proof(bug: bool) -> bool:
    """On the network's real predictions, the configured loss's gradient is not the focal loss with the configured
    alpha=0.25, gamma=2 (it is the one with the two swapped)."""
    torch.manual_seed(0)
    model = _TinyUNet().train()
    grads = []
    for fn in (lambda gt, pr: CategoricalFocalLoss(bug)(gt, pr),
               lambda gt, pr: categorical_focal_loss(gt, pr, gamma=2.0, alpha=0.25)):
        logits = model(_C05_X).detach().requires_grad_(True)
        fn(_C05_GT, logits.softmax(1)).backward()
        assert logits.grad is not None
        grads.append(logits.grad)
    return not torch.allclose(grads[0], grads[1], rtol=1e-4, atol=1e-9)


CASES: list[BlindCase] = [
    BlindCase("b27b-01", "https://github.com/robertklee/COCO-Human-Pose/pull/29",
              "augmentation flips keypoints without swapping left/right",
              "A horizontal flip mirrors the image and keypoint x coordinates but keeps each joint's slot, so a "
              "mirrored person's right wrist is trained as its left wrist.", _c01_build, _c01_proof,
              known_miss="a horizontal flip that keeps left and right joints in their slots: the label semantics of an augmentation are not in the batch"),
    BlindCase("b27b-02", "https://github.com/axelspringer/ForwardTacotron/issues/21",
              "padding mask built on the wrong axis",
              "The mel L1 loss builds its length mask from the n_mels axis, so it masks nothing and the padded frames "
              "of shorter utterances are trained towards zero.", _c02_build, _c02_proof,
              known_miss="a length mask built on the n_mels axis masks nothing, and no mask reaches the model (lengths only): padding nothing declares in a regression target is not found"),
    BlindCase("b27b-03", "https://github.com/lucidrains/ema-pytorch/issues/8", "EMA copy never updates buffers",
              "The EMA's buffer iterator walks named_parameters(), so the EMA model's BatchNorm running statistics "
              "are never copied or averaged and stay at their initial values.", _c03_build, _c03_proof),
    BlindCase("b27b-04", "https://github.com/rwth-i6/returnn/pull/1595", "gradient clipping before AMP unscale",
              "With a GradScaler the gradients are clipped to max_norm while still multiplied by the loss scale, so "
              "every update is cut to about max_norm / scale.", _c04_build, _c04_proof),
    BlindCase("b27b-05", "https://github.com/qubvel/segmentation_models/issues/258",
              "loss hyperparameters swapped by positional arguments",
              "The focal loss class passes alpha and gamma positionally into a function that takes gamma first, so "
              "the segmentation net trains with gamma=0.25 and alpha=2 instead of alpha=0.25, gamma=2.",
              _c05_build, _c05_proof,
              known_miss="focal-loss alpha and gamma swapped by position: which value a hyper-parameter holds is not judged"),
]
