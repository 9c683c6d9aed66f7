"""Blind batch 25 (part b): silent vision and speech training bugs from public GitHub threads, each with its fixed twin.

Collected by someone who does not write the audit's checks. Every case builds the user's setup on a tiny model written
in code (small CNNs with BatchNorm, a per-pixel segmentation net, a conv + GRU CTC recogniser; nothing is downloaded;
the real lightning ``BaseFinetuning`` where the report used it) and proves the bug without the audit on real tensors
and real steps.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw


class _BNConvNet(nn.Module):
    """Tiny image classifier: conv -> BatchNorm -> ReLU -> conv -> BatchNorm -> ReLU -> global pool -> linear."""

    def __init__(self, classes: int = 4) -> None:
        super().__init__()
        self.backbone = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
            nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))


class _TinySegNet(nn.Module):
    """Per-pixel classifier: two 3x3 convs, logits of shape (N, C, H, W)."""

    def __init__(self, classes: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, classes, 3, padding=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _bn_buffers(module: object) -> dict[str, torch.Tensor]:
    assert isinstance(module, nn.Module)
    return {n: b.detach().clone() for n, b in module.named_buffers() if "running" in n}


# --------------------------------------------------------------------------------------------- case-01
# pytorch/ignite issue #2590 (fixed by PR #2592, `handle_buffers`): a mean-teacher sound/image classifier with
# BatchNorm uses ignite's EMAHandler as the teacher. The handler deep-copies the student, puts the copy in eval mode
# and, on every iteration, moves *every* floating state_dict entry towards the student with the EMA momentum
# (2e-4 by default) -- the BatchNorm running mean/var buffers included. The teacher's eval-mode forward normalises with
# those buffers, which therefore stay essentially at their initial 0/1 while the student's statistics move: the
# consistency target comes from a network whose normalisation does not match its weights. Training runs, the loss
# goes down, the result is much worse (F1 40 vs 60 in the report). The fix (PR #2592) adds `handle_buffers="copy"`
# (the new default): the EMA model's buffers are copied from the student after each update.

_C01_X = torch.randn(8, 3, 8, 8, generator=_gen(2511)) * 2.0 + 1.5
_C01_Y = torch.randint(0, 4, (4,), generator=_gen(2512))   # the first 4 images are labelled, the rest are not
_C01_MOMENTUM = 2e-4


def _c01_ema_update(ema: nn.Module, model: nn.Module, bug: bool) -> None:
    """ignite EMAHandler._update_ema_model: before the fix every float entry is averaged; after it buffers are copied."""
    with torch.no_grad():
        for ema_p, p in zip(ema.parameters(), model.parameters()):
            ema_p.mul_(1.0 - _C01_MOMENTUM).add_(p.data, alpha=_C01_MOMENTUM)
        for ema_b, b in zip(ema.buffers(), model.buffers()):
            if bug and b.dtype.is_floating_point:
                ema_b.mul_(1.0 - _C01_MOMENTUM).add_(b.data, alpha=_C01_MOMENTUM)
            else:
                ema_b.copy_(b.data)


def _c01_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _BNConvNet().train()
    ema = copy.deepcopy(model)
    for p in ema.parameters():
        p.detach_()
    ema.eval()  # the handler keeps the EMA model in eval mode
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def step() -> torch.Tensor:
        opt.zero_grad()
        logits = model(_C01_X)
        with torch.no_grad():
            teacher = ema(_C01_X)
        loss = F.cross_entropy(logits[:4], _C01_Y) + 1.0 * F.mse_loss(logits.softmax(-1), teacher.softmax(-1))
        loss.backward()
        opt.step()
        _c01_ema_update(ema, model, bug)  # Events.ITERATION_COMPLETED
        return loss

    step.ema_model = ema  # type: ignore[attr-defined]  # the handler holds it, outside the trained module
    return model, step, _kw(optimizer=opt, inputs=_C01_X)


def _c01_proof(bug: bool) -> bool:
    """After a few steps the teacher's BatchNorm running mean lags far behind the student's."""
    model, step, _ = _c01_build(bug)
    for _ in range(6):
        step()
    ema = step.ema_model  # type: ignore[attr-defined]
    student, teacher = _bn_buffers(model.backbone), _bn_buffers(ema.backbone)
    gap = max(float((student[k] - teacher[k]).abs().max()) for k in student)
    return gap > 0.05


# --------------------------------------------------------------------------------------------- case-02
# Lightning-AI/pytorch-lightning issue #15062 (fixed by PR #15063): a pretrained CNN backbone is frozen for
# fine-tuning with `BaseFinetuning.freeze(backbone, train_bn=False)`, expecting the BatchNorm layers to be frozen too.
# Before the fix, freezing a BatchNorm only set `requires_grad=False` on its weight and bias; the Trainer still puts
# the whole LightningModule in train mode, so every training forward keeps overwriting the pretrained running_mean and
# running_var with the new data's batch statistics. Nothing fails and the head trains; the "frozen" backbone behaves
# differently at evaluation than it did before training. The fix makes `freeze_module` set
# `track_running_stats=False` on frozen BatchNorm layers (and `make_trainable` sets it back), so the buffers stay put.

_C02_X = torch.randn(8, 3, 8, 8, generator=_gen(2521)) * 1.5 + 0.7
_C02_Y = torch.randint(0, 4, (8,), generator=_gen(2522))


def _c02_freeze_prefix(modules: nn.Module, train_bn: bool = True) -> None:
    """BaseFinetuning.freeze as it was before PR #15063: BatchNorm layers only lose requires_grad."""
    from lightning.pytorch.callbacks import BaseFinetuning
    from torch.nn.modules.batchnorm import _BatchNorm

    for mod in BaseFinetuning.flatten_modules(modules):
        if isinstance(mod, _BatchNorm) and train_bn:
            BaseFinetuning.make_trainable(mod)
        else:
            for param in mod.parameters(recurse=False):
                param.requires_grad = False


def _c02_build(bug: bool) -> Case:
    from lightning.pytorch.callbacks import BaseFinetuning

    torch.manual_seed(0)
    model = _BNConvNet()
    with torch.no_grad():  # "pretrained" statistics
        for m in model.backbone.modules():
            if isinstance(m, nn.BatchNorm2d):
                assert m.running_mean is not None and m.running_var is not None
                m.running_mean.uniform_(-0.5, 0.5, generator=_gen(2523))
                m.running_var.uniform_(0.5, 2.0, generator=_gen(2524))
    if bug:
        _c02_freeze_prefix(model.backbone, train_bn=False)
    else:
        BaseFinetuning.freeze(model.backbone, train_bn=False)
    model.train()  # what the Trainer does at the start of the fit loop
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(model(_C02_X), _C02_Y)
        loss.backward()
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=(_C02_X, _C02_Y))


def _c02_proof(bug: bool) -> bool:
    """The frozen backbone's BatchNorm running statistics move during training steps."""
    model, step, _ = _c02_build(bug)
    before = _bn_buffers(model.backbone)
    for _ in range(3):
        step()
    after = _bn_buffers(model.backbone)
    return any(not torch.equal(before[k], after[k]) for k in before)


# --------------------------------------------------------------------------------------------- case-03
# fastai/fastai PR #3189 (merged): `LabelSmoothingCrossEntropy` took the class count from `output.size()[-1]` and ran
# `log_softmax` / the smoothing sum over `dim=-1`. For a segmentation model (logits N x C x H x W, targets N x H x W)
# the last axis is the image width, so the "class" softmax normalises across pixels of a row instead of across
# classes, and `nll_loss` then picks those wrongly normalised values at the target class. Shapes line up, the loss is
# finite and decreases, but the per-pixel class distribution the model is trained on does not sum to one and the
# smoothing term uses W instead of C. The fix uses the class dimension 1 for the count, the log_softmax and the sum.

_C03_CLASSES = 5
_C03_X = torch.randn(4, 3, 8, 8, generator=_gen(2531))
_C03_Y = torch.randint(0, _C03_CLASSES, (4, 8, 8), generator=_gen(2532))


class _LabelSmoothingCE(nn.Module):
    """fastai's LabelSmoothingCrossEntropy; `axis` is -1 before PR #3189 and 1 after it."""

    def __init__(self, eps: float = 0.1, axis: int = 1) -> None:
        super().__init__()
        self.eps, self.axis = eps, axis

    def forward(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        c = output.size()[self.axis]
        log_preds = F.log_softmax(output, dim=self.axis)
        loss = (-log_preds.sum(dim=self.axis)).mean()
        return loss * self.eps / c + (1 - self.eps) * F.nll_loss(log_preds, target.long())


def _c03_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _TinySegNet(_C03_CLASSES).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_func = _LabelSmoothingCE(0.1, axis=-1 if bug else 1)

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = loss_func(model(_C03_X), _C03_Y)
        loss.backward()
        opt.step()
        return loss

    step.loss_func = loss_func  # type: ignore[attr-defined]
    return model, step, _kw(optimizer=opt, inputs=(_C03_X, _C03_Y))


def _c03_proof(bug: bool) -> bool:
    """The loss differs from label-smoothed cross-entropy over the class axis (PyTorch's own)."""
    model, step, _ = _c03_build(bug)
    with torch.no_grad():
        out = model(_C03_X)
        mine = step.loss_func(out, _C03_Y)  # type: ignore[attr-defined]
        ref = F.cross_entropy(out, _C03_Y, label_smoothing=0.1)
    step()
    return not torch.allclose(mine, ref, atol=1e-5)


# --------------------------------------------------------------------------------------------- case-04
# mdbloice/Augmentor issue #209 (fixed by the maintainer in the release after it): a segmentation pipeline passes an
# image and its ground-truth mask together to `ZoomRandom`. A commit had moved the drawing of the random crop offsets
# into the inner `do(image)` function that is applied to each image of the pair, so the image and its mask were
# zoomed into different windows. Nothing fails, shapes and dtypes are right, the loss still decreases, but the
# network is trained against masks that are shifted relative to their images. The fix draws the offsets once,
# outside `do()`, so every image of the pair gets the same crop. Reproduced here as an on-the-fly tensor augmentation
# applied in the training step (crop a random window of half the area, resize back, nearest neighbour).

_C04_MASK = (torch.rand(4, 16, 16, generator=_gen(2541)) > 0.5).long()
_C04_MASK = (F.avg_pool2d(_C04_MASK.float().unsqueeze(1), 3, 1, 1).squeeze(1) > 0.5).long()
_C04_IMG = torch.cat([(_C04_MASK.float() * 2 - 1).unsqueeze(1),
                      torch.randn(4, 2, 16, 16, generator=_gen(2542)) * 0.3], dim=1)


class _ZoomRandom:
    """Augmentor's ZoomRandom on a (image, mask) pair; `per_image_offsets` is the bug of issue #209."""

    def __init__(self, percentage_area: float, per_image_offsets: bool, seed: int) -> None:
        self.area, self.per_image = percentage_area, per_image_offsets
        self.gen = _gen(seed)

    def _offsets(self, h: int, w: int, ch: int, cw: int) -> tuple[int, int]:
        top = int(torch.randint(0, h - ch + 1, (1,), generator=self.gen))
        left = int(torch.randint(0, w - cw + 1, (1,), generator=self.gen))
        return top, left

    def __call__(self, images: list[torch.Tensor]) -> list[torch.Tensor]:
        h, w = images[0].shape[-2:]
        ch, cw = round(h * self.area ** 0.5), round(w * self.area ** 0.5)
        shared = self._offsets(h, w, ch, cw)

        def do(image: torch.Tensor) -> torch.Tensor:
            top, left = self._offsets(h, w, ch, cw) if self.per_image else shared
            crop = image[..., top:top + ch, left:left + cw].float().unsqueeze(0)
            if crop.dim() == 3:
                crop = crop.unsqueeze(0)
            out = F.interpolate(crop, size=(h, w), mode="nearest")[0]
            return out.to(image.dtype) if image.dim() == 3 else out[0].to(image.dtype)

        return [do(image) for image in images]


def _c04_augment(zoom: _ZoomRandom) -> tuple[torch.Tensor, torch.Tensor]:
    pairs = [zoom([img, mask]) for img, mask in zip(_C04_IMG, _C04_MASK)]
    return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])


def _c04_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _TinySegNet(2).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    zoom = _ZoomRandom(0.5, per_image_offsets=bug, seed=2543)

    def step() -> torch.Tensor:
        x, y = _c04_augment(zoom)  # the augmented batch the DataLoader yields
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    step.zoom = zoom  # type: ignore[attr-defined]
    return model, step, _kw(optimizer=opt, inputs=(_C04_IMG, _C04_MASK))


def _c04_proof(bug: bool) -> bool:
    """Channel 0 of every image encodes its mask; after the augmentation the two no longer agree."""
    _, step, _ = _c04_build(bug)
    step()
    x, y = _c04_augment(step.zoom)  # type: ignore[attr-defined]
    agree = float(((x[:, 0] > 0).long() == y).float().mean())
    return agree < 0.99


# --------------------------------------------------------------------------------------------- case-05
# NVIDIA-NeMo/Speech (formerly NVIDIA/NeMo) issue #3298, confirmed by the maintainer ("Good catch, that's a bug") and fixed right after:
# the batched SpecAugment used with Conformer-CTC draws a random start and a random width for every time mask, but then
# builds the tensors with `time_starts = torch.cat(time_lengths, 0)`, so each mask starts at its own width. All time
# masks land in the first ~2*time_width frames of every utterance; the rest of the utterance is never time-masked.
# Training runs and the CTC loss goes down, the augmentation is just much weaker than configured and always hits the
# same region. The fix concatenates `time_starts`.

_C05_B, _C05_D, _C05_T, _C05_V = 4, 16, 32, 6
_C05_SPEC = torch.randn(_C05_B, _C05_D, _C05_T, generator=_gen(2551)) + 3.0   # log-mel stand-in, never exactly 0
_C05_LEN = torch.tensor([32, 28, 24, 20])
_C05_TGT = torch.randint(1, _C05_V, (_C05_B, 6), generator=_gen(2552))
_C05_TGT_LEN = torch.tensor([6, 5, 4, 4])
_C05_TIME_WIDTH = 4


class _SpecAugment(nn.Module):
    """SpecAugment (frequency and time masks, mask value 0) with NeMo's batched time-mask construction."""

    def __init__(self, bug: bool, freq_masks: int = 2, time_masks: int = 2, freq_width: int = 4,
                 time_width: int = _C05_TIME_WIDTH, seed: int = 2553) -> None:
        super().__init__()
        self.bug, self.freq_masks, self.time_masks = bug, freq_masks, time_masks
        self.freq_width, self.time_width = freq_width, time_width
        self.gen = _gen(seed)

    def _randint(self, low: int, high: int) -> int:
        return int(torch.randint(low, max(low + 1, high), (1,), generator=self.gen))

    @torch.no_grad()
    def forward(self, spec: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
        spec = spec.clone()
        b, d, _ = spec.shape
        for idx in range(b):
            for _ in range(self.freq_masks):
                start = self._randint(0, d - self.freq_width)
                spec[idx, start:start + self._randint(0, self.freq_width + 1)] = 0.0
        time_starts: list[torch.Tensor] = []
        time_lengths: list[torch.Tensor] = []
        for idx in range(b):
            for _ in range(self.time_masks):
                width = self._randint(0, self.time_width + 1)
                time_starts.append(torch.tensor([self._randint(0, int(length[idx]) - width)]))
                time_lengths.append(torch.tensor([width]))
        starts = torch.cat(time_lengths if self.bug else time_starts, 0)
        lengths = torch.cat(time_lengths, 0)
        for k in range(starts.numel()):
            idx = k // self.time_masks
            spec[idx, :, int(starts[k]):int(starts[k]) + int(lengths[k])] = 0.0
        return spec


class _CTCRecognizer(nn.Module):
    """Tiny acoustic model: conv front end, one GRU layer, per-frame token logits (blank = 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(_C05_D, 32, 3, padding=1)
        self.rnn = nn.GRU(32, 32, batch_first=True)
        self.out = nn.Linear(32, _C05_V)

    def forward(self, spec: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.conv(spec)).transpose(1, 2)
        return self.out(self.rnn(h)[0])


def _c05_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _CTCRecognizer().train()
    spec_augmentation = _SpecAugment(bug)
    model.spec_augmentation = spec_augmentation  # a submodule of the ASR model, as in NeMo
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> torch.Tensor:
        opt.zero_grad()
        spec = spec_augmentation(_C05_SPEC, _C05_LEN)
        log_probs = model(spec).log_softmax(-1).transpose(0, 1)
        loss = F.ctc_loss(log_probs, _C05_TGT, _C05_LEN, _C05_TGT_LEN, blank=0, zero_infinity=True)
        loss.backward()
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=(_C05_SPEC, _C05_LEN, _C05_TGT, _C05_TGT_LEN))


def _c05_proof(bug: bool) -> bool:
    """Over 20 augmented batches no time mask ever reaches past frame 2*time_width, though utterances are 20-32 long."""
    aug: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = _SpecAugment(bug)
    last = -1
    for _ in range(20):
        spec = aug(_C05_SPEC, _C05_LEN)
        masked_frames = (spec == 0).all(dim=1)  # (B, T): the frames a time mask covered
        idx = masked_frames.nonzero()
        if idx.numel():
            last = max(last, int(idx[:, 1].max()))
    return last < 2 * _C05_TIME_WIDTH


CASES: list[BlindCase] = [
    BlindCase("b25b-01", "https://github.com/pytorch/ignite/issues/2590", "EMA teacher buffers stale",
              "The EMA teacher (kept in eval mode) averages BatchNorm running statistics with the tiny EMA momentum, "
              "so its normalisation stays near the initial 0/1 while the student's statistics move.",
              _c01_build, _c01_proof,
              known_miss="a teacher's BatchNorm statistics averaged with the EMA's momentum: how fast a copy's buffers follow is not measured"),
    BlindCase("b25b-02", "https://github.com/Lightning-AI/pytorch-lightning/issues/15062",
              "frozen BatchNorm statistics still update",
              "BaseFinetuning.freeze(train_bn=False) only removes requires_grad from BatchNorm layers, so in train "
              "mode the frozen backbone's pretrained running statistics are overwritten by every forward.",
              _c02_build, _c02_proof),
    BlindCase("b25b-03", "https://github.com/fastai/fastai/pull/3189", "softmax over the wrong axis in a custom loss",
              "Label-smoothing cross-entropy normalises over the last axis, which for N x C x H x W segmentation "
              "logits is the image width, so the model is trained on a per-pixel distribution that is not over "
              "classes.", _c03_build, _c03_proof),
    BlindCase("b25b-04", "https://github.com/mdbloice/Augmentor/issues/209", "image and mask augmented differently",
              "Random zoom draws its crop offsets separately for the image and for its ground-truth mask, so the "
              "segmentation model trains on masks misaligned with their images.", _c04_build, _c04_proof,
              known_miss="image and mask augmented with different offsets: a data pipeline's pairing is outside one step on one batch"),
    BlindCase("b25b-05", "https://github.com/NVIDIA-NeMo/Speech/issues/3298", "SpecAugment masks misplaced",
              "Batched SpecAugment uses the mask widths as the mask start positions, so every time mask of the CTC "
              "model's input falls in the first few frames and the rest of each utterance is never masked.",
              _c05_build, _c05_proof,
              known_miss="SpecAugment's masks start within the first frames: where an augmentation masks is not measured"),
]
