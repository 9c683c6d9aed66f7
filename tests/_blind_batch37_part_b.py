"""Blind batch 37 (part b): silent perception-model training bugs from public GitHub threads, each with its fixed twin.

Collected by someone who does not write the audit's checks. Every case builds the user's setup on a tiny plain torch
model (an image classifier trained with mixup, a masked autoencoder, a U-Net for nuclei segmentation, a speech
downstream head with attentive pooling over a frozen upstream, a PointNet with a feature transform; nothing is
downloaded) and proves the bug without the audit on real tensors and real steps.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw

# --------------------------------------------------------------------------------------------- case-01
# huggingface/pytorch-image-models issue #50: the mixup path of train.py (used when the prefetcher / fast collate is
# off) mixed the batch in place with `input.mul_(lam).add_(1 - lam, input.flip(0))`. The in-place `mul_` runs before
# `input.flip(0)` is evaluated, so the partner images are taken from the already-scaled batch: the network sees
# lam * x + (1 - lam) * lam * x_flip (with lam = 0 a black picture) while the soft target still says lam / (1 - lam).
# Nothing crashes and the soft-target loss falls; the images just do not match their mixed labels. Fix (rwightman in
# the thread): compute the flipped, (1 - lam)-scaled copy first, then `input.mul_(lam).add_(input_flipped)`.

_C01_X = torch.rand(8, 3, 8, 8, generator=_gen(3701))
_C01_Y = torch.randint(0, 4, (8,), generator=_gen(3702))
_C01_CLASSES = 4


class _TinyConvNet(nn.Module):
    def __init__(self, num_classes: int = _C01_CLASSES) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.conv(x)))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


def _c01_one_hot(x: torch.Tensor, num_classes: int, on_value: float, off_value: float) -> torch.Tensor:
    x = x.long().view(-1, 1)
    return torch.full((x.size(0), num_classes), off_value).scatter_(1, x, on_value)


def _c01_mixup_target(target: torch.Tensor, lam: float, smoothing: float) -> torch.Tensor:
    off_value = smoothing / _C01_CLASSES
    on_value = 1.0 - smoothing + off_value
    y1 = _c01_one_hot(target, _C01_CLASSES, on_value, off_value)
    y2 = _c01_one_hot(target.flip(0), _C01_CLASSES, on_value, off_value)
    return lam * y1 + (1.0 - lam) * y2


def _c01_setup(bug: bool):
    torch.manual_seed(0)
    model = _TinyConvNet().train()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4)
    rng = np.random.RandomState(3703)
    lams: list[float] = []

    def step() -> torch.Tensor:
        input = _C01_X.clone()  # a fresh batch from the loader
        target = _C01_Y.clone()
        lam = float(rng.beta(0.4, 0.4))
        lams.append(lam)
        if bug:
            input.mul_(lam).add_(input.flip(0), alpha=1 - lam)  # flip() sees the batch already scaled by lam
        else:
            input_flipped = input.flip(0).mul_(1 - lam)
            input.mul_(lam).add_(input_flipped)
        target = _c01_mixup_target(target, lam, smoothing=0.1)
        output = model(input)
        loss = torch.sum(-target * F.log_softmax(output, dim=-1), dim=-1).mean()  # SoftTargetCrossEntropy
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    return model, opt, step, lams


def _c01_build(bug: bool) -> Case:
    model, opt, step, _ = _c01_setup(bug)
    return model, step, _kw(optimizer=opt, inputs=_C01_X)


def _c01_proof(bug: bool) -> bool:
    """In one real step, is the image the network sees lam * x + (1 - lam) * x.flip(0), as its soft target says?"""
    model, _, step, lams = _c01_setup(bug)
    seen: list[torch.Tensor] = []
    model.register_forward_pre_hook(lambda _m, args: seen.append(args[0].detach().clone()))
    step()
    lam = lams[0]
    expected = lam * _C01_X + (1 - lam) * _C01_X.flip(0)
    return bool((seen[0] - expected).abs().max() > 1e-4)


# --------------------------------------------------------------------------------------------- case-02
# IcarusWizard/MAE issue #17: the MAE decoder marks the patches to reconstruct with `mask[T:] = 1`, where T counts the
# encoder's output tokens, the cls token included. In the shuffled order the first T - 1 rows are the visible patches,
# so the first masked patch (row T - 1) is left at mask 0: in every image one masked patch gets no reconstruction loss
# (`loss = mean((pred - img) ** 2 * mask) / mask_ratio`). Pre-training runs and the loss falls; the objective just
# drops one masked patch per image. Fix (commit 11c21fc, "Fix a bug pointed out by @Hong753 in #17"): `mask[T-1:] = 1`.

_C02_IMG = torch.rand(4, 3, 8, 8, generator=_gen(3711)) * 2 - 1  # Normalize(0.5, 0.5) images
_C02_PATCH = 2
_C02_RATIO = 0.75


def _c02_take(sequences: torch.Tensor, indexes: torch.Tensor) -> torch.Tensor:
    return torch.gather(sequences, 0, indexes.unsqueeze(-1).expand(-1, -1, sequences.shape[-1]))


class _PatchShuffle(nn.Module):
    def __init__(self, ratio: float, seed: int) -> None:
        super().__init__()
        self.ratio = ratio
        self.rng = np.random.RandomState(seed)

    def forward(self, patches: torch.Tensor):
        t, b, _ = patches.shape
        remain_t = int(t * (1 - self.ratio))
        fwd = np.stack([self.rng.permutation(t) for _ in range(b)], axis=-1)
        bwd = np.argsort(fwd, axis=0)
        forward_indexes = torch.as_tensor(fwd, dtype=torch.long)
        backward_indexes = torch.as_tensor(bwd, dtype=torch.long)
        patches = _c02_take(patches, forward_indexes)[:remain_t]
        return patches, forward_indexes, backward_indexes


def _c02_block(dim: int) -> nn.Module:
    return nn.TransformerEncoderLayer(dim, 2, dim * 2, dropout=0.0, batch_first=True, norm_first=True)


class _TinyMAE(nn.Module):
    def __init__(self, bug: bool, image_size: int = 8, patch: int = _C02_PATCH, dim: int = 16) -> None:
        super().__init__()
        self.bug = bug
        self.hp = image_size // patch
        self.patch = patch
        n = self.hp ** 2
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.enc_pos = nn.Parameter(torch.randn(n, 1, dim) * 0.02)
        self.shuffle = _PatchShuffle(_C02_RATIO, seed=3712)
        self.patchify = nn.Conv2d(3, dim, patch, patch)
        self.encoder = _c02_block(dim)
        self.enc_norm = nn.LayerNorm(dim)
        self.mask_token = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.dec_pos = nn.Parameter(torch.randn(n + 1, 1, dim) * 0.02)
        self.decoder = _c02_block(dim)
        self.head = nn.Linear(dim, 3 * patch ** 2)

    def _patch2img(self, x: torch.Tensor) -> torch.Tensor:  # '(h w) b (c p1 p2) -> b c (h p1) (w p2)'
        h = w = self.hp
        p = self.patch
        b = x.shape[1]
        x = x.reshape(h, w, b, 3, p, p).permute(2, 3, 0, 4, 1, 5)
        return x.reshape(b, 3, h * p, w * p)

    def forward(self, img: torch.Tensor):
        patches = self.patchify(img).flatten(2).permute(2, 0, 1) + self.enc_pos
        patches, _, backward_indexes = self.shuffle(patches)
        patches = torch.cat([self.cls_token.expand(-1, patches.shape[1], -1), patches], dim=0)
        features = self.enc_norm(self.encoder(patches.transpose(0, 1))).transpose(0, 1)

        t = features.shape[0]
        backward_indexes = torch.cat([torch.zeros(1, backward_indexes.shape[1], dtype=torch.long),
                                      backward_indexes + 1], dim=0)
        features = torch.cat([features, self.mask_token.expand(backward_indexes.shape[0] - t, features.shape[1], -1)],
                             dim=0)
        features = _c02_take(features, backward_indexes) + self.dec_pos
        features = self.decoder(features.transpose(0, 1)).transpose(0, 1)[1:]  # drop the cls token
        out = self.head(features)
        mask = torch.zeros_like(out)
        if self.bug:
            mask[t:] = 1
        else:
            mask[t - 1:] = 1
        mask = _c02_take(mask, backward_indexes[1:] - 1)
        return self._patch2img(out), self._patch2img(mask)


def _c02_setup(bug: bool):
    torch.manual_seed(0)
    model = _TinyMAE(bug).train()
    batch_size, base_lr, warmup, total = 4096, 1.5e-4, 200, 2000
    opt = torch.optim.AdamW(model.parameters(), lr=base_lr * batch_size / 256, betas=(0.9, 0.95), weight_decay=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lr_lambda=lambda e: min((e + 1) / (warmup + 1e-8), 0.5 * (math.cos(e / total * math.pi) + 1)))
    masks: list[torch.Tensor] = []

    def step() -> torch.Tensor:
        predicted_img, mask = model(_C02_IMG)
        masks.append(mask.detach())
        loss = torch.mean((predicted_img - _C02_IMG) ** 2 * mask) / _C02_RATIO
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        return loss

    return model, opt, sched, step, masks


def _c02_build(bug: bool) -> Case:
    model, opt, sched, step, _ = _c02_setup(bug)
    return model, step, _kw(optimizer=opt, inputs=_C02_IMG, lr_scheduler=sched, total_steps=2000)


def _c02_proof(bug: bool) -> bool:
    """In a real step, does the loss mask cover every masked patch (16 patches, 4 visible: 12 per image)?"""
    _, _, _, step, masks = _c02_setup(bug)
    step()
    per_image = masks[0][:, 0].sum(dim=(1, 2)) / (_C02_PATCH ** 2)
    n_patches = (8 // _C02_PATCH) ** 2
    n_masked = n_patches - int(n_patches * (1 - _C02_RATIO))
    return bool((per_image != n_masked).any())


# --------------------------------------------------------------------------------------------- case-03
# 4uiiurz1/pytorch-nested-unet issue #62: train.py ends its albumentations pipeline with `transforms.Normalize()`,
# which already scales by max_pixel_value=255 ((img - mean * 255) / (std * 255)), and dataset.py then does
# `img = img.astype('float32') / 255` again. The U-Net sees inputs ~255x too small (std ~0.004 instead of ~1); the
# BatchNorm layers soak most of it up, so BCE-Dice still falls, but the model is trained on a different input scale
# than the one it is exported or run with (the reporter lost a day to it under TensorRT/ONNX). Fix in the issue:
# divide by 255 only once (drop the second division of the image; the mask keeps its /255).

_C03_MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
_C03_STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)
_C03_RAW = (torch.rand(4, 16, 16, 3, generator=_gen(3721)) * 255).to(torch.uint8).numpy()
_C03_MASK = ((torch.rand(4, 16, 16, generator=_gen(3722)) > 0.6).to(torch.uint8) * 255).numpy()


def _c03_albu_normalize(img: np.ndarray, max_pixel_value: float = 255.0) -> np.ndarray:
    mean = _C03_MEAN * max_pixel_value
    denominator = np.reciprocal(_C03_STD * max_pixel_value)
    return (img.astype(np.float32) - mean) * denominator


def _c03_batch(bug: bool) -> tuple[torch.Tensor, torch.Tensor]:
    imgs, masks = [], []
    for img, mask in zip(_C03_RAW, _C03_MASK):
        img = _c03_albu_normalize(img)  # transforms.Normalize() at the end of train_transform
        if bug:
            img = img.astype('float32') / 255  # dataset.py divides again
        img = img.astype('float32').transpose(2, 0, 1)
        mask = mask.astype('float32')[None] / 255
        imgs.append(torch.from_numpy(np.ascontiguousarray(img)))
        masks.append(torch.from_numpy(mask))
    return torch.stack(imgs), torch.stack(masks)


class _VGGBlock(nn.Module):
    def __init__(self, in_ch: int, mid_ch: int, out_ch: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, mid_ch, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(mid_ch)
        self.conv2 = nn.Conv2d(mid_ch, out_ch, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(out_ch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


class _TinyUNet(nn.Module):
    def __init__(self, num_classes: int = 1, input_channels: int = 3) -> None:
        super().__init__()
        self.conv0_0 = _VGGBlock(input_channels, 8, 8)
        self.conv1_0 = _VGGBlock(8, 16, 16)
        self.conv0_1 = _VGGBlock(8 + 16, 8, 8)
        self.pool = nn.MaxPool2d(2, 2)
        self.up = nn.Upsample(scale_factor=2, mode='bilinear', align_corners=True)
        self.final = nn.Conv2d(8, num_classes, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x0_0 = self.conv0_0(x)
        x1_0 = self.conv1_0(self.pool(x0_0))
        return self.final(self.conv0_1(torch.cat([x0_0, self.up(x1_0)], 1)))


class _BCEDiceLoss(nn.Module):
    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        bce = F.binary_cross_entropy_with_logits(input, target)
        smooth = 1e-5
        input = torch.sigmoid(input)
        num = target.size(0)
        input = input.view(num, -1)
        target = target.view(num, -1)
        intersection = input * target
        dice = (2.0 * intersection.sum(1) + smooth) / (input.sum(1) + target.sum(1) + smooth)
        dice = 1 - dice.sum() / num
        return 0.5 * bce + dice


def _c03_setup(bug: bool):
    torch.manual_seed(0)
    model = _TinyUNet().train()
    criterion = _BCEDiceLoss()
    opt = torch.optim.SGD(filter(lambda p: p.requires_grad, model.parameters()), lr=1e-3, momentum=0.9,
                          nesterov=False, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=100, eta_min=1e-5)
    input, target = _c03_batch(bug)

    def step() -> torch.Tensor:
        output = model(input)
        loss = criterion(output, target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()  # one batch per epoch here
        return loss

    return model, opt, sched, step, input


def _c03_build(bug: bool) -> Case:
    model, opt, sched, step, input = _c03_setup(bug)
    return model, step, _kw(optimizer=opt, inputs=input, lr_scheduler=sched, total_steps=100)


def _c03_proof(bug: bool) -> bool:
    """In a real step, is the image the U-Net receives standardized (per-channel std near 1) or ~255x too small?"""
    model, _, _, step, _ = _c03_setup(bug)
    seen: list[torch.Tensor] = []
    model.register_forward_pre_hook(lambda _m, args: seen.append(args[0].detach().clone()))
    step()
    std = seen[0].transpose(0, 1).flatten(1).std(dim=1)
    return bool((std < 0.05).all())


# --------------------------------------------------------------------------------------------- case-04
# s3prl/s3prl issue #579: the utterance-level downstream head's AttentivePoolingModule builds a boolean length mask
# (True on real frames, False on padding) and then does `att_logits = att_mask + att_logits`. Adding a bool adds 1 to
# real frames and 0 to padded ones, so the softmax still gives the padded frames (the upstream's outputs over the zero
# padding of the waveform) a large share of the attention: short utterances in a batch are pooled partly from padding
# and the logits depend on how much padding the batch added. Training (speaker ID, emotion) runs and the loss falls.
# Fix in the issue: push padded logits to -inf, `att_logits = att_logits + (~att_mask) * (-1e9)` (or masked_fill).

_C04_LENS = [400, 250, 330, 160]
_C04_WAV = torch.randn(4, 400, generator=_gen(3731)) * 0.1
for _i, _n in enumerate(_C04_LENS):
    _C04_WAV[_i, _n:] = 0.0  # zero padding from the collate function
_C04_Y = torch.tensor([0, 1, 2, 3])


class _AttentivePoolingModule(nn.Module):
    def __init__(self, input_dim: int, bug: bool) -> None:
        super().__init__()
        self.W_a = nn.Linear(input_dim, input_dim)
        self.W = nn.Linear(input_dim, 1)
        self.act_fn = nn.ReLU()
        self.bug = bug

    def forward(self, batch_rep: torch.Tensor, att_mask: torch.Tensor):
        att_logits = self.W(self.act_fn(self.W_a(batch_rep))).squeeze(-1)
        if self.bug:
            att_logits = att_mask + att_logits
        else:
            att_logits = att_logits + (~att_mask) * (-1e9)
        att_w = F.softmax(att_logits, dim=-1).unsqueeze(-1)
        utter_rep = torch.sum(batch_rep * att_w, dim=1)
        return utter_rep, att_w


class _UtteranceLevel(nn.Module):
    def __init__(self, input_dim: int, output_dim: int, bug: bool) -> None:
        super().__init__()
        self.sap_layer = _AttentivePoolingModule(input_dim, bug)
        self.linear = nn.Linear(input_dim, output_dim)  # post_net FrameLevel without hiddens

    def forward(self, hidden_state: torch.Tensor, features_len: torch.Tensor) -> torch.Tensor:
        len_masks = torch.lt(torch.arange(features_len.max()).unsqueeze(0), features_len.unsqueeze(1))
        pooled, _ = self.sap_layer(hidden_state, len_masks)
        return self.linear(pooled)


class _S3prlExpert(nn.Module):
    """A frozen upstream (conv feature encoder over the padded waveform) and the trainable downstream head."""

    def __init__(self, bug: bool, dim: int = 16, n_classes: int = 4) -> None:
        super().__init__()
        self.upstream = nn.Sequential(nn.Conv1d(1, dim, kernel_size=10, stride=5), nn.GELU())
        self.upstream.requires_grad_(False)
        self.downstream = _UtteranceLevel(dim, n_classes, bug)

    def forward(self, wavs: torch.Tensor, wav_lens: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            feats = self.upstream(wavs.unsqueeze(1)).transpose(1, 2)
        features_len = (wav_lens - 10) // 5 + 1
        return self.downstream(feats, features_len)


def _c04_setup(bug: bool):
    torch.manual_seed(0)
    model = _S3prlExpert(bug).train()
    opt = torch.optim.AdamW(model.downstream.parameters(), lr=1e-3)
    lens = torch.tensor(_C04_LENS)

    def step() -> torch.Tensor:
        logits = model(_C04_WAV, lens)
        loss = F.cross_entropy(logits, _C04_Y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    return model, opt, step


def _c04_build(bug: bool) -> Case:
    model, opt, step = _c04_setup(bug)
    return model, step, _kw(optimizer=opt, inputs={"wavs": _C04_WAV, "wav_lens": torch.tensor(_C04_LENS)})


def _c04_proof(bug: bool) -> bool:
    """In a real step, do the attention weights of the pooling put any mass on padded frames?"""
    model, _, step = _c04_setup(bug)
    weights: list[torch.Tensor] = []
    model.downstream.sap_layer.register_forward_hook(lambda _m, _a, out: weights.append(out[1].detach()))
    step()
    att_w = weights[0].squeeze(-1)
    features_len = (torch.tensor(_C04_LENS) - 10) // 5 + 1
    padded = torch.arange(att_w.shape[1]).unsqueeze(0) >= features_len.unsqueeze(1)
    return bool((att_w * padded).sum(dim=1).max() > 1e-3)


# --------------------------------------------------------------------------------------------- case-05
# yanx27/Pointnet_Pointnet2_pytorch issue #59 (the same line was confirmed and fixed in fxia22/pointnet.pytorch #40):
# PointNet's feature-transform regularizer is written
# `torch.norm(torch.bmm(trans, trans.transpose(2, 1) - I), dim=(1, 2))`, i.e. ||A (A^T - I)||, with the `- I` inside
# the bmm. The paper's term is ||A A^T - I||, which pulls the learned feature transform towards an orthogonal matrix
# so it cannot throw information away; the written one is zero for any projection, including A = 0, and penalizes
# orthogonal transforms other than I. Classification trains and the total loss falls; the regularizer just pushes the
# wrong way. Fix in the issue: `torch.norm(torch.bmm(trans, trans.transpose(2, 1)) - I, dim=(1, 2))`.

_C05_PTS = torch.randn(8, 3, 32, generator=_gen(3741))
_C05_Y = torch.randint(0, 4, (8,), generator=_gen(3742))
_C05_K = 8


class _STN(nn.Module):
    def __init__(self, k: int) -> None:
        super().__init__()
        self.k = k
        self.conv1 = nn.Conv1d(k, 16, 1)
        self.conv2 = nn.Conv1d(16, 32, 1)
        self.fc1 = nn.Linear(32, 16)
        self.fc3 = nn.Linear(16, k * k)
        self.bn1 = nn.BatchNorm1d(16)
        self.bn2 = nn.BatchNorm1d(32)
        self.bn4 = nn.BatchNorm1d(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = x.size(0)
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        x = torch.max(x, 2)[0]
        x = self.fc3(F.relu(self.bn4(self.fc1(x))))
        iden = torch.eye(self.k).flatten().view(1, self.k * self.k).repeat(b, 1)
        return (x + iden).view(-1, self.k, self.k)


class _PointNetCls(nn.Module):
    def __init__(self, k: int = 4, channel: int = 3) -> None:
        super().__init__()
        self.stn = _STN(channel)
        self.conv1 = nn.Conv1d(channel, _C05_K, 1)
        self.conv2 = nn.Conv1d(_C05_K, 16, 1)
        self.conv3 = nn.Conv1d(16, 32, 1)
        self.bn1 = nn.BatchNorm1d(_C05_K)
        self.bn2 = nn.BatchNorm1d(16)
        self.bn3 = nn.BatchNorm1d(32)
        self.fstn = _STN(_C05_K)
        self.fc1 = nn.Linear(32, 16)
        self.bn4 = nn.BatchNorm1d(16)
        self.fc2 = nn.Linear(16, k)

    def forward(self, x: torch.Tensor):
        trans = self.stn(x)
        x = torch.bmm(x.transpose(2, 1), trans).transpose(2, 1)
        x = F.relu(self.bn1(self.conv1(x)))
        trans_feat = self.fstn(x)
        x = torch.bmm(x.transpose(2, 1), trans_feat).transpose(2, 1)
        x = F.relu(self.bn2(self.conv2(x)))
        x = torch.max(self.bn3(self.conv3(x)), 2)[0]
        x = self.fc2(F.relu(self.bn4(self.fc1(x))))
        return F.log_softmax(x, dim=1), trans_feat


def _c05_regularizer(trans: torch.Tensor, bug: bool) -> torch.Tensor:
    d = trans.size()[1]
    eye = torch.eye(d)[None, :, :]
    if bug:
        return torch.mean(torch.norm(torch.bmm(trans, trans.transpose(2, 1) - eye), dim=(1, 2)))
    return torch.mean(torch.norm(torch.bmm(trans, trans.transpose(2, 1)) - eye, dim=(1, 2)))


def _c05_setup(bug: bool):
    torch.manual_seed(0)
    model = _PointNetCls().train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=20, gamma=0.7)

    def step() -> torch.Tensor:
        opt.zero_grad()
        pred, trans_feat = model(_C05_PTS)
        loss = F.nll_loss(pred, _C05_Y) + _c05_regularizer(trans_feat, bug) * 0.001  # get_loss
        loss.backward()
        opt.step()
        sched.step()  # one batch per epoch here
        return loss

    return model, opt, sched, step


def _c05_build(bug: bool) -> Case:
    model, opt, sched, step = _c05_setup(bug)
    return model, step, _kw(optimizer=opt, inputs=_C05_PTS, lr_scheduler=sched, total_steps=200)


def _c05_proof(bug: bool) -> bool:
    """After a real step, let the feature T-Net output an orthogonal permutation, then the all-zero matrix (which
    wipes every point feature): does the training loss's regularizer charge the orthogonal one more?"""
    model, _, _, step = _c05_setup(bug)
    step()
    k = _C05_K
    perm = torch.eye(k)[torch.roll(torch.arange(k), 1)]
    regs = []
    for target in (perm, torch.zeros(k, k)):
        with torch.no_grad():
            model.fstn.fc3.weight.zero_()
            model.fstn.fc3.bias.copy_((target - torch.eye(k)).flatten())
            _, trans_feat = model(_C05_PTS)
            regs.append(float(_c05_regularizer(trans_feat, bug)))
    return regs[0] > regs[1]


CASES: list[BlindCase] = [
    BlindCase("b37b-01", "https://github.com/huggingface/pytorch-image-models/issues/50", "in-place mixup scales partner",
              "The in-place mixup scales the batch by lam before flipping it, so the partner images enter at "
              "(1 - lam) * lam instead of (1 - lam) and the inputs no longer match their mixed soft targets.",
              _c01_build, _c01_proof,
              known_miss="an in-place mixup that scales the partner it reads: the data transform's in-place order is outside the model"),
    BlindCase("b37b-02", "https://github.com/IcarusWizard/MAE/issues/17", "MAE loss mask off by one",
              "The decoder's loss mask starts one row late (the cls token is counted), so one masked patch per image "
              "gets no reconstruction loss.", _c02_build, _c02_proof,
              known_miss="the MAE loss mask off by one patch: which patches are masked is data semantics"),
    BlindCase("b37b-03", "https://github.com/4uiiurz1/pytorch-nested-unet/issues/62", "image divided by 255 twice",
              "albumentations Normalize already divides by 255 and the dataset divides again, so the U-Net trains on "
              "inputs about 255x too small.", _c03_build, _c03_proof,
              known_miss="images divided by 255 twice: an input of scale 0.004 is not judged too small (waveforms and small-unit features are legitimately small)"),
    BlindCase("b37b-04", "https://github.com/s3prl/s3prl/issues/579", "attentive pooling attends padding",
              "The pooling adds the boolean length mask to the attention logits instead of masking them, so padded "
              "frames keep a share of the attention and leak into the utterance embedding.", _c04_build, _c04_proof,
              known_miss="attentive pooling whose bool mask is added, not applied: padding read inside a hand-written pooling of a downstream head is not probed"),
    BlindCase("b37b-05", "https://github.com/yanx27/Pointnet_Pointnet2_pytorch/issues/59",
              "misplaced identity in regularizer",
              "The feature-transform regularizer computes ||A(A^T - I)|| instead of ||AA^T - I||, so it does not pull "
              "the transform towards orthogonal and leaves a collapsed transform unpenalized.", _c05_build, _c05_proof,
              known_miss="an identity misplaced in an orthogonality regulariser: arithmetic inside the loss"),
]
