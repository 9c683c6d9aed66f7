"""Blind batch 28 (part b): silent vision, medical-imaging and speech training bugs from public GitHub threads.

Collected by someone who does not write the audit's checks. Every case builds the user's setup on a tiny model
(small hand-written CNN segmenters, classifiers, a grid detector and a conv-subsampling CTC encoder; the users'
losses and augmentations written as small modules and functions; nothing is downloaded) and proves the bug without
the audit on real tensors and real steps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw

# --------------------------------------------------------------------------------------------- case-01
# qubvel-org/segmentation_models.pytorch PR #366 ("make ignore_index in DiceLoss work", merged by the maintainer):
# a user trains a binary medical segmenter with `DiceLoss("binary", ignore_index=255)`, the unannotated region of
# each mask marked 255. DiceLoss stored `ignore_index` but forward never used it, so the 255 pixels went into the
# soft-dice sums as a target of 255: the unannotated region gets gradient pushing its prediction up (towards
# "foreground") and the dice value is distorted. Nothing fails: the loss is a finite number that falls. The fix in
# the PR masks prediction and target with `y_true != ignore_index` before the dice sums.

_C01_X = torch.randn(4, 1, 16, 16, generator=_gen(2801))
_C01_Y = (torch.rand(4, 16, 16, generator=_gen(2802)) > 0.6).float()
_C01_Y[:, :, 11:] = 255.0  # the annotator left the right-hand strip of every slice unlabelled


class _SoftDiceLoss(nn.Module):
    """The binary-mode DiceLoss as in the thread; ``apply_ignore`` is the PR's masking."""

    def __init__(self, ignore_index: int | None, apply_ignore: bool, eps: float = 1e-7) -> None:
        super().__init__()
        self.ignore_index = ignore_index
        self.apply_ignore = apply_ignore
        self.eps = eps

    def forward(self, y_pred: torch.Tensor, y_true: torch.Tensor) -> torch.Tensor:
        y_pred = F.logsigmoid(y_pred).exp()
        bs = y_true.size(0)
        y_true = y_true.view(bs, 1, -1)
        y_pred = y_pred.view(bs, 1, -1)
        if self.apply_ignore and self.ignore_index is not None:
            mask = y_true != self.ignore_index
            y_pred = y_pred * mask
            y_true = y_true * mask
        y_true = y_true.type_as(y_pred)
        dims = (0, 2)
        inter = torch.sum(y_pred * y_true, dim=dims)
        card = torch.sum(y_pred + y_true, dim=dims)
        score = (2.0 * inter) / card.clamp_min(self.eps)
        loss = 1.0 - score
        loss = loss * (y_true.sum(dims) > 0).to(loss.dtype)
        return loss.mean()


def _c01_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 1, 1))


def _c01_build(bug: bool) -> Case:
    model = _c01_net().train()
    crit = _SoftDiceLoss(ignore_index=255, apply_ignore=not bug)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = crit(model(_C01_X), _C01_Y)
        loss.backward()
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=(_C01_X,))


def _c01_proof(bug: bool) -> bool:
    """Do the pixels marked ignore_index get gradient through the loss?"""
    model = _c01_net().train()
    crit = _SoftDiceLoss(ignore_index=255, apply_ignore=not bug)
    logits = model(_C01_X).detach().requires_grad_(True)
    crit(logits, _C01_Y).backward()
    assert logits.grad is not None
    ignored = (_C01_Y == 255).unsqueeze(1)
    return bool(logits.grad[ignored].abs().max() > 1e-8)

# --------------------------------------------------------------------------------------------- case-02
# TorchSSL/TorchSSL PR #59 ("fix bug in gradient clipping", merged): the FixMatch-style trainers run with AMP
# (`scaler.scale(total_loss).backward()`) and clip with `torch.nn.utils.clip_grad_norm_(model.parameters(), clip)`
# straight after the backward, then `scaler.step(optimizer)`. The clip sees gradients still multiplied by the loss
# scale (2**16), so it always fires and cuts them to norm `clip`; `scaler.step` then divides by the scale again, and
# the step applied is about 1/65536 of the intended clipped step. Training runs, the loss moves very slowly, no
# warning. The fix in the PR calls `scaler.unscale_(optimizer)` before the clip.

_C02_XL = torch.randn(4, 3, 16, 16, generator=_gen(2811))
_C02_YL = torch.tensor([0, 1, 2, 3])
_C02_XU = torch.randn(8, 3, 16, 16, generator=_gen(2812))
_C02_XU_STRONG = _C02_XU + 0.3 * torch.randn(8, 3, 16, 16, generator=_gen(2813))
_C02_CLIP = 1.0


def _c02_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(8, 4))


def _c02_setup(bug: bool):
    model = _c02_net().train()
    opt = torch.optim.SGD(model.parameters(), lr=0.03, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)

    def step() -> torch.Tensor:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(torch.cat([_C02_XL, _C02_XU, _C02_XU_STRONG]))
            logits_x = logits[:4].float()
            logits_w, logits_s = logits[4:].float().chunk(2)
            sup = F.cross_entropy(logits_x, _C02_YL)
            probs = logits_w.detach().softmax(-1)
            conf, pseudo = probs.max(-1)
            mask = (conf >= 0.0).float()  # threshold low: the tiny model is unsure
            unsup = (F.cross_entropy(logits_s, pseudo, reduction="none") * mask).mean()
            total = sup + 1.0 * unsup
        scaler.scale(total).backward()
        if not bug:
            scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), _C02_CLIP)
        scaler.step(opt)
        scaler.update()
        return total.detach()

    return model, opt, scaler, step


def _c02_build(bug: bool) -> Case:
    model, opt, scaler, step = _c02_setup(bug)
    return model, step, _kw(optimizer=opt, inputs=(torch.cat([_C02_XL, _C02_XU, _C02_XU_STRONG]),), scaler=scaler)


def _c02_proof(bug: bool) -> bool:
    """Is the first SGD step (momentum buffer empty: update = lr * grad) far smaller than lr * the clipped norm?"""
    ref, _, _, _ = _c02_setup(bug)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = ref(torch.cat([_C02_XL, _C02_XU, _C02_XU_STRONG]))
        logits_w, logits_s = logits[4:].float().chunk(2)
        total = F.cross_entropy(logits[:4].float(), _C02_YL) + F.cross_entropy(
            logits_s, logits_w.detach().softmax(-1).argmax(-1))
    total.backward()
    true_norm = float(torch.sqrt(sum((p.grad.float() ** 2).sum() for p in ref.parameters())))
    intended = 0.03 * min(_C02_CLIP, true_norm)

    model, _, _, step = _c02_setup(bug)
    before = [p.detach().clone() for p in model.parameters()]
    step()
    moved = float(torch.sqrt(sum(((p.detach() - b) ** 2).sum() for p, b in zip(model.parameters(), before))))
    return moved < 1e-3 * intended
# --------------------------------------------------------------------------------------------- case-03
# yatengLG/Focal-Loss-Pytorch issue #9 ("alpha bug", closed; fix proposed there and in PR #16): the repo's
# multi-class `focal_loss` keeps the per-class weights in `self.alpha` (alpha for the background class 0, 1 - alpha
# for the others, to counter class imbalance in detection/classification) and in forward writes
# `self.alpha = self.alpha.gather(0, labels.view(-1))`. The first call replaces the per-class table with the first
# batch's per-sample weights; from the second batch on, the "class weights" are read from that stale per-sample
# vector, so the rare classes get whatever weight the previous batch's samples had. With batch size >= number of
# classes nothing fails. The fix gathers into a local `alpha` and leaves `self.alpha` untouched.

_C03_NC = 4
_C03_BATCHES = [(torch.randn(8, 3, 16, 16, generator=_gen(2820 + i)),
                 torch.randint(0, _C03_NC, (8,), generator=_gen(2830 + i))) for i in range(2)]
_C03_BATCHES[0][1][:] = torch.tensor([0, 0, 0, 0, 0, 0, 1, 2])  # a background-heavy first batch


class _FocalLoss(nn.Module):
    """The repo's focal_loss: alpha for class 0, 1 - alpha for the rest; ``stateful`` is the thread's bug."""

    def __init__(self, alpha: float = 0.25, gamma: float = 2.0, num_classes: int = _C03_NC,
                 stateful: bool = True) -> None:
        super().__init__()
        self.alpha = torch.zeros(num_classes)
        self.alpha[0] += alpha
        self.alpha[1:] += 1 - alpha
        self.gamma = gamma
        self.stateful = stateful

    def forward(self, preds: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        preds = preds.view(-1, preds.size(-1))
        self.alpha = self.alpha.to(preds.device)
        soft = F.softmax(preds, dim=1)
        logsoft = torch.log(soft)
        soft = soft.gather(1, labels.view(-1, 1))
        logsoft = logsoft.gather(1, labels.view(-1, 1))
        if self.stateful:
            self.alpha = self.alpha.gather(0, labels.view(-1))
            alpha = self.alpha
        else:
            alpha = self.alpha.gather(0, labels.view(-1))
        loss = -torch.mul(torch.pow(1 - soft, self.gamma), logsoft)
        loss = torch.mul(alpha, loss.t())
        return loss.mean()


def _c03_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(8, _C03_NC))


def _c03_setup(bug: bool):
    model = _c03_net().train()
    crit = _FocalLoss(stateful=bug)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def make_step(batch):
        def step() -> torch.Tensor:
            opt.zero_grad()
            loss = crit(model(batch[0]), batch[1])
            loss.backward()
            opt.step()
            return loss
        return step

    make_step(_C03_BATCHES[0])()  # the run is under way: the first batch has been trained on
    return model, crit, opt, make_step(_C03_BATCHES[1])


def _c03_build(bug: bool) -> Case:
    model, _, opt, step = _c03_setup(bug)
    return model, step, _kw(optimizer=opt, inputs=(_C03_BATCHES[1][0],))


def _c03_proof(bug: bool) -> bool:
    """On the second batch, does the loss weight each sample by something other than alpha[its class]?"""
    model, crit, _, _ = _c03_setup(bug)
    x, y = _C03_BATCHES[1]
    with torch.no_grad():
        logits = model(x)
        got = crit(logits, y)
        table = torch.tensor([0.25] + [0.75] * (_C03_NC - 1))
        soft = logits.softmax(-1).gather(1, y.view(-1, 1)).squeeze(1)
        want = (table[y] * -(1 - soft) ** 2 * soft.log()).mean()
    return bool((got - want).abs() > 1e-6)

# --------------------------------------------------------------------------------------------- case-04
# openspeech-team/openspeech issue #76 (labelled BUG, confirmed by the maintainers): `Conv2dSubsampling.forward`
# takes the output lengths its parent already computed for the two stride-2 convolutions (about T/4) and then does
# `output_lengths = input_lengths >> 2; output_lengths -= 1` again. The CTC loss of an ASR model is therefore given
# lengths of about T/16: only the first quarter of each utterance's encoder frames is aligned to the transcript and
# the rest of the speech gets no gradient at all. As long as the shortened lengths still exceed the target lengths
# CTC returns finite, falling losses and nothing warns. The fix drops the two extra lines.

_C04_FEAT = 16
_C04_X = torch.randn(4, 96, _C04_FEAT, generator=_gen(2841))
_C04_LENS = torch.tensor([96, 88, 80, 72])
for _i, _n in enumerate(_C04_LENS.tolist()):
    _C04_X[_i, _n:] = 0.0  # zero padding after each utterance
_C04_TARGETS = torch.tensor([[1, 2, 3], [4, 1, 5], [2, 3, 0], [5, 4, 0]])
_C04_TLENS = torch.tensor([3, 3, 2, 2])


class _Conv2dSubsampling(nn.Module):
    """Two 3x3 stride-2 convolutions over (time, feature), then a CTC projection; ``double_shift`` is the bug."""

    def __init__(self, double_shift: bool, out_channels: int = 8, vocab: int = 6) -> None:
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(1, out_channels, 3, stride=2), nn.Hardtanh(0, 20),
                                  nn.Conv2d(out_channels, out_channels, 3, stride=2), nn.Hardtanh(0, 20))
        self.double_shift = double_shift
        factor = ((_C04_FEAT - 1) // 2 - 1) // 2
        self.fc = nn.Linear(out_channels * factor, vocab)

    def get_output_lengths(self, seq_lengths: torch.Tensor) -> torch.Tensor:
        for module in self.conv:
            if isinstance(module, nn.Conv2d):
                numerator = seq_lengths + 2 * module.padding[1] - module.dilation[1] * (module.kernel_size[1] - 1) - 1
                seq_lengths = (numerator.float() / float(module.stride[1])).int() + 1
        return seq_lengths.int()

    def forward(self, inputs: torch.Tensor, input_lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        outputs = self.conv(inputs.unsqueeze(1).transpose(2, 3))  # (B, C, F', T')
        b, c, d, t = outputs.size()
        outputs = outputs.permute(0, 3, 1, 2).reshape(b, t, c * d)
        output_lengths = self.get_output_lengths(input_lengths)
        if self.double_shift:
            output_lengths = output_lengths >> 2
            output_lengths -= 1
        return self.fc(outputs).log_softmax(-1), output_lengths


def _c04_model(bug: bool) -> nn.Module:
    torch.manual_seed(0)
    return _Conv2dSubsampling(double_shift=bug).train()


def _c04_loss(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    log_probs, out_lens = model(_C04_X, _C04_LENS)
    log_probs.retain_grad()
    loss = F.ctc_loss(log_probs.transpose(0, 1), _C04_TARGETS, out_lens, _C04_TLENS, blank=0,
                      reduction="mean", zero_infinity=True)
    return loss, log_probs, out_lens


def _c04_build(bug: bool) -> Case:
    model = _c04_model(bug)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = _c04_loss(model)[0]
        loss.backward()
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=(_C04_X, _C04_LENS))


def _c04_proof(bug: bool) -> bool:
    """Do encoder frames that hold real speech (inside the true conv output length) get no CTC gradient?"""
    model = _c04_model(bug)
    loss, log_probs, _ = _c04_loss(model)
    assert torch.isfinite(loss)
    loss.backward()
    assert log_probs.grad is not None
    true_lens = _Conv2dSubsampling(double_shift=False).get_output_lengths(_C04_LENS)
    starved = [float(log_probs.grad[i, : int(true_lens[i])].abs().sum(-1).min()) for i in range(4)]
    return min(starved) == 0.0

# --------------------------------------------------------------------------------------------- case-05
# MultimediaTechLab/YOLO issue #105 ("Mixup augmentation bug, yielding wrong targets", labelled bug; maintainer
# thanked the reporter and the fix went in through WongKinYiu/YOLO PR #110): the MixUp transform blends two images
# with `lam` and then also blends their box tensors, `torch.cat([lam * boxes, (1 - lam) * boxes2])`, where each row
# is `[class_id, x1, y1, x2, y2]`. Class ids and box corners are multiplied by lam: after the loader's `.long()` a
# class 3 object becomes class 1 or 2, and every box shrinks towards the image origin (a different grid cell). The
# detector trains on these targets without any error and the loss falls. The fix concatenates the two box sets
# unchanged (the images are mixed, the objects are simply all present).

_C05_NC = 5
_C05_GRID = 4


def _c05_sources() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = _gen(2851)
    out = []
    for _ in range(8):
        img = 0.1 * torch.randn(3, 32, 32, generator=g)
        rows = []
        for _ in range(2):
            cls = int(torch.randint(1, _C05_NC, (1,), generator=g))
            x1, y1 = (torch.rand(2, generator=g) * 0.5).tolist()
            w, h = (0.2 + torch.rand(2, generator=g) * 0.3).tolist()
            rows.append([float(cls), x1, y1, x1 + w, y1 + h])
            img[cls % 3, int(y1 * 32):int((y1 + h) * 32), int(x1 * 32):int((x1 + w) * 32)] += 1.0
        out.append((img, torch.tensor(rows)))
    return out


_C05_SRC = _c05_sources()
_C05_LAMS = torch.tensor([0.62, 0.41, 0.77, 0.55])  # the transform's lam draws for this batch


def _c05_mixup(image: torch.Tensor, boxes: torch.Tensor, image2: torch.Tensor, boxes2: torch.Tensor, lam: float,
               bug: bool) -> tuple[torch.Tensor, torch.Tensor]:
    mixed_image = lam * image + (1 - lam) * image2
    if bug:
        mixed_boxes = torch.cat([lam * boxes, (1 - lam) * boxes2])
    else:
        mixed_boxes = torch.cat((boxes, boxes2))
    return mixed_image, mixed_boxes


def _c05_batch(bug: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    imgs, targets = [], []
    for i in range(4):
        (a, ba), (b, bb) = _C05_SRC[i], _C05_SRC[i + 4]
        img, boxes = _c05_mixup(a, ba, b, bb, float(_C05_LAMS[i]), bug)
        imgs.append(img)
        targets.append(boxes)
    return torch.stack(imgs), targets


def _c05_assign(targets: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Grid assignment as the loader/loss does: the cell holding the box centre, class id cast with .long()."""
    obj = torch.zeros(len(targets), _C05_GRID, _C05_GRID)
    cls = torch.full((len(targets), _C05_GRID, _C05_GRID), -100, dtype=torch.long)
    box = torch.zeros(len(targets), _C05_GRID, _C05_GRID, 4)
    for i, t in enumerate(targets):
        for row in t:
            c = row[0].long()
            cx, cy = float(row[1] + row[3]) / 2, float(row[2] + row[4]) / 2
            gx, gy = min(int(cx * _C05_GRID), _C05_GRID - 1), min(int(cy * _C05_GRID), _C05_GRID - 1)
            obj[i, gy, gx] = 1.0
            cls[i, gy, gx] = c
            box[i, gy, gx] = row[1:]
    return obj, cls, box


class _GridDetector(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1), nn.BatchNorm2d(16), nn.SiLU(),
                                      nn.Conv2d(16, 16, 3, 2, 1), nn.BatchNorm2d(16), nn.SiLU(),
                                      nn.Conv2d(16, 32, 3, 2, 1), nn.SiLU())
        self.head = nn.Conv2d(32, 1 + _C05_NC + 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x)).permute(0, 2, 3, 1)  # (B, G, G, 1 + C + 4)


def _c05_loss(model: nn.Module, images: torch.Tensor, targets: list[torch.Tensor]) -> torch.Tensor:
    obj, cls, box = _c05_assign(targets)
    out = model(images)
    pos = obj > 0
    l_obj = F.binary_cross_entropy_with_logits(out[..., 0], obj)
    l_cls = F.cross_entropy(out[..., 1:1 + _C05_NC][pos], cls[pos])
    l_box = F.l1_loss(out[..., 1 + _C05_NC:].sigmoid()[pos], box[pos])
    return l_obj + l_cls + 5.0 * l_box


def _c05_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _GridDetector().train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.937, nesterov=True)
    images, targets = _c05_batch(bug)

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = _c05_loss(model, images, targets)
        loss.backward()
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=(images,))


def _c05_proof(bug: bool) -> bool:
    """Do the class ids and boxes the detector is trained on differ from the objects annotated in the two images?"""
    _, targets = _c05_batch(bug)
    for i, t in enumerate(targets):
        annotated = torch.cat((_C05_SRC[i][1], _C05_SRC[i + 4][1]))
        if not torch.equal(t[:, 0].long(), annotated[:, 0].long()) or not torch.allclose(t[:, 1:], annotated[:, 1:]):
            return True
    return False


CASES: list[BlindCase] = [
    BlindCase("b28b-01", "https://github.com/qubvel-org/segmentation_models.pytorch/pull/366",
              "ignore label not masked in a custom loss",
              "A binary DiceLoss built with ignore_index=255 never applies it, so the unlabelled 255 pixels enter the "
              "dice sums as targets and get gradient.", _c01_build, _c01_proof,
              known_miss="an ignore label scored by a hand-written loss: which class id means 'ignore' is label semantics the batch does not carry"),
    BlindCase("b28b-02", "https://github.com/TorchSSL/TorchSSL/pull/59", "AMP clipping on scaled gradients",
              "Gradients are clipped while still multiplied by the GradScaler's scale, so the clip always fires and "
              "the step applied after unscaling is ~1/65536 of the intended one.", _c02_build, _c02_proof),
    BlindCase("b28b-03", "https://github.com/yatengLG/Focal-Loss-Pytorch/issues/9",
              "class weights overwritten by loss state",
              "The focal loss overwrites its per-class alpha table with the first batch's per-sample weights, so every "
              "later batch weights its classes from stale, wrong values.", _c03_build, _c03_proof,
              known_miss="class weights overwritten by the loss's own state from the second batch on: one audited step sees the first weights only"),
    BlindCase("b28b-04", "https://github.com/openspeech-team/openspeech/issues/76", "wrong CTC output lengths",
              "The conv subsampler divides the already-subsampled lengths by 4 again, so CTC aligns the transcript to "
              "only the first quarter of each utterance's frames and the rest get no gradient.", _c04_build,
              _c04_proof,
              known_miss="CTC output lengths computed wrongly: which lengths a CTC call should get is arithmetic outside the model's inputs"),
    BlindCase("b28b-05", "https://github.com/MultimediaTechLab/YOLO/issues/105", "augmentation corrupts detection labels",
              "MixUp multiplies the [class, x1, y1, x2, y2] rows of both images' boxes by lam and 1 - lam, so the "
              "detector trains on wrong class ids and shrunken, misplaced boxes.", _c05_build, _c05_proof,
              known_miss="an augmentation that corrupts box labels: it runs in the data pipeline, before the step"),
]
