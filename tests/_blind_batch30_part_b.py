"""Blind batch 30 (part b): silent vision, diffusion, detection and speech training bugs from public GitHub threads.

Collected by someone who does not write the audit's checks. Every case rebuilds the user's setup in plain torch on a
tiny model (timm, torchvision, mmdet, diffusers and ESPnet are not installed, so the pieces the reports are about are
re-implemented as the repositories wrote them: a ResNet backbone with frozen stages, resnet_fpn_backbone's layer
freezing, a min-SNR-weighted diffusion loss, ESPnet's utterance_mvn, a flow-matching TTS trainer with an EMA copy;
nothing is downloaded) and proves the bug without the audit on real tensors and real steps.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw, _sgd_step

# --------------------------------------------------------------------------------------------- helpers


class _Block(nn.Module):
    """conv3x3 + BN + ReLU, standing in for one ResNet stage."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn = nn.BatchNorm2d(cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(x)))


# --------------------------------------------------------------------------------------------- case-01
# open-mmlab/mmdetection PR #560 ("Bug fix for freezing BN parameters"): the ResNet backbone with `frozen_stages=1`
# and BN not fixed (norm_eval=False, the setting for training with a large batch) froze the stem and the first stage
# only by setting `requires_grad=False` on their parameters. Their BatchNorm layers stayed in training mode, so every
# forward kept overwriting the running mean/var of the "frozen" pretrained stages with the statistics of the new
# data (and each step normalises with batch statistics), while the weights stayed put: the frozen part silently
# drifts away from the pretrained network it was meant to keep. Nothing errors, the loss trains normally. Fix in the
# PR: `_freeze_stages` also puts norm1 and the frozen layers in eval mode, and `train()` re-applies it after
# `super().train(mode)`, so the frozen stages' BN stays in eval mode for the whole run.


class _C01ResNet(nn.Module):
    """mmdet-style ResNet: stem (conv1 + norm1), layer1, layer2; frozen_stages and norm_eval as in mmdet."""

    def __init__(self, fixed: bool, frozen_stages: int = 1, norm_eval: bool = False) -> None:
        super().__init__()
        self.fixed = fixed
        self.frozen_stages = frozen_stages
        self.norm_eval = norm_eval
        self.conv1 = nn.Conv2d(3, 8, 3, 1, 1, bias=False)
        self.norm1 = nn.BatchNorm2d(8)
        self.layer1 = _Block(8, 8)
        self.layer2 = _Block(8, 16, stride=2)
        self._freeze_stages()

    def _freeze_stages(self) -> None:
        if self.frozen_stages >= 0:
            if self.fixed:
                self.norm1.eval()
            for m in (self.conv1, self.norm1):
                for p in m.parameters():
                    p.requires_grad = False
        for i in range(1, self.frozen_stages + 1):
            m = getattr(self, f"layer{i}")
            if self.fixed:
                m.eval()
            for p in m.parameters():
                p.requires_grad = False

    def train(self, mode: bool = True) -> _C01ResNet:
        super().train(mode)
        if self.fixed:
            self._freeze_stages()
        if mode and self.norm_eval:
            for m in self.modules():
                if isinstance(m, nn.BatchNorm2d):
                    m.eval()
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.norm1(self.conv1(x)))
        return self.layer2(self.layer1(x))


class _C01Detector(nn.Module):
    """Backbone + a dense classification head (a one-level RetinaNet-style head, per-cell class logits)."""

    def __init__(self, fixed: bool) -> None:
        super().__init__()
        self.backbone = _C01ResNet(fixed)
        self.cls_head = nn.Conv2d(16, 5, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.cls_head(self.backbone(x))


_C01_IMGS = torch.randn(4, 3, 16, 16, generator=_gen(3011)) * 2.0 + 0.5  # new-domain images, off the stem's stats
_C01_TGT = torch.randint(0, 5, (4, 8, 8), generator=_gen(3012))


def _c01_pretrained_stats(model: _C01Detector) -> None:
    """Pretend the backbone was loaded from a checkpoint: non-trivial running statistics in every BN."""
    g = _gen(3013)
    for m in model.backbone.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.1)
            m.running_var.copy_(torch.rand(m.num_features, generator=g) * 0.5 + 0.75)


def _c01_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _C01Detector(fixed=not bug)
    _c01_pretrained_stats(model)
    model.train()  # the runner calls model.train() at the start of every epoch
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.02, momentum=0.9,
                          weight_decay=1e-4)
    step = _sgd_step(model, opt, lambda: F.cross_entropy(model(_C01_IMGS), _C01_TGT))
    return model, step, _kw(optimizer=opt, inputs=_C01_IMGS)


def _c01_proof(bug: bool) -> bool:
    """After two training steps the running statistics of the frozen stem and stage-1 BN layers have moved."""
    model, step, _ = _c01_build(bug)
    frozen_bns = [model.backbone.norm1, model.backbone.layer1.bn]
    before = [bn.running_mean.clone() for bn in frozen_bns]
    step()
    step()
    return any(not torch.allclose(b, bn.running_mean) for b, bn in zip(before, frozen_bns))


# --------------------------------------------------------------------------------------------- case-02
# pytorch/vision issue #3394 (fixed by PR #3396, "Fix incorrectly frozen BN on ResNet FPN backbone"): a user trains a
# detector from scratch with `resnet_fpn_backbone('resnet50', pretrained=False, norm_layer=None,
# trainable_layers=5)`, where 5 is documented as "all backbone layers are trainable". The freezing code builds
# `layers_to_train = ['layer4', 'layer3', 'layer2', 'layer1', 'conv1'][:trainable_layers]` and freezes every
# parameter whose name starts with none of them, so the stem's `bn1.weight` and `bn1.bias` are silently frozen at
# their initial 1 and 0 although every layer was asked to train. Nothing errors; the loss goes down. Fix in the PR:
# when trainable_layers == 5, 'bn1' is appended to layers_to_train.


class _C02ResNet(nn.Module):
    """torchvision-style ResNet naming: conv1, bn1, layer1..layer4, fc."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.layer1 = _Block(8, 8)
        self.layer2 = _Block(8, 16, 2)
        self.layer3 = _Block(16, 16, 2)
        self.layer4 = _Block(16, 16, 2)
        self.fc = nn.Linear(16, 10)


class _C02BackboneWithFPN(nn.Module):
    """IntermediateLayerGetter over layer1..layer4 (fc dropped) + a tiny FPN summing the upsampled levels."""

    def __init__(self, body: _C02ResNet) -> None:
        super().__init__()
        self.body = body
        self.inner = nn.ModuleList([nn.Conv2d(c, 8, 1) for c in (8, 16, 16, 16)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = self.body
        x = torch.relu(b.bn1(b.conv1(x)))
        feats = []
        for layer in (b.layer1, b.layer2, b.layer3, b.layer4):
            x = layer(x)
            feats.append(x)
        out = self.inner[3](feats[3])
        for i in (2, 1, 0):
            out = self.inner[i](feats[i]) + F.interpolate(out, size=feats[i].shape[-2:], mode="nearest")
        return out


def _c02_resnet_fpn_backbone(trainable_layers: int, fixed: bool) -> _C02BackboneWithFPN:
    body = _C02ResNet()
    assert 0 <= trainable_layers <= 5
    layers_to_train = ["layer4", "layer3", "layer2", "layer1", "conv1"][:trainable_layers]
    if fixed and trainable_layers == 5:
        layers_to_train.append("bn1")
    for name, parameter in body.named_parameters():
        if all(not name.startswith(layer) for layer in layers_to_train):
            parameter.requires_grad_(False)
    return _C02BackboneWithFPN(body)


class _C02Detector(nn.Module):
    def __init__(self, fixed: bool) -> None:
        super().__init__()
        self.backbone = _c02_resnet_fpn_backbone(trainable_layers=5, fixed=fixed)
        self.head = nn.Conv2d(8, 4, 1)  # per-location objectness + 3 classes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))


_C02_IMGS = torch.randn(4, 3, 16, 16, generator=_gen(3021))
_C02_TGT = torch.randint(0, 4, (4, 16, 16), generator=_gen(3022))


def _c02_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _C02Detector(fixed=not bug).train()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.02, momentum=0.9)
    step = _sgd_step(model, opt, lambda: F.cross_entropy(model(_C02_IMGS), _C02_TGT))
    return model, step, _kw(optimizer=opt, inputs=_C02_IMGS)


def _c02_proof(bug: bool) -> bool:
    """With every layer asked to train, the stem BN's affine weights have not moved after two steps."""
    model, step, _ = _c02_build(bug)
    bn1 = model.backbone.body.bn1
    w0, b0 = bn1.weight.detach().clone(), bn1.bias.detach().clone()
    step()
    step()
    return torch.equal(w0, bn1.weight.detach()) and torch.equal(b0, bn1.bias.detach())


# --------------------------------------------------------------------------------------------- case-03
# lucidrains/recurrent-interface-network-pytorch issue #11 ("Min SNR weighting implemented as max SNR weighting"):
# with `min_snr_loss_weight=True` the per-sample diffusion loss weight was built from
# `maybe_clipped_snr.clamp_(min=self.min_snr_gamma)`, i.e. max(SNR, gamma) instead of min(SNR, gamma). For the eps
# objective the weight becomes max(SNR, gamma) / SNR: >= 1 everywhere and as large as gamma / SNR at the noisy
# timesteps, the opposite of Min-SNR (which caps the clean, high-SNR timesteps at gamma / SNR <= 1). The loss is a
# plausible weighted MSE and trains; the weighting is silently inverted. The maintainer confirmed it ("ugh i committed
# this error in a number of other repos too"); the fix is `clamp_(max=self.min_snr_gamma)`.


def _c03_gamma(t: torch.Tensor) -> torch.Tensor:
    """RIN's cosine gamma schedule: alpha^2 = gamma(t), sigma^2 = 1 - gamma(t)."""
    return torch.cos(t * math.pi / 2) ** 2


class _C03Denoiser(nn.Module):
    """Tiny conv eps-predictor with a time embedding added to the hidden features."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Conv2d(3, 16, 3, 1, 1)
        self.time = nn.Sequential(nn.Linear(1, 16), nn.SiLU(), nn.Linear(16, 16))
        self.out = nn.Conv2d(16, 3, 3, 1, 1)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h = self.inp(x) + self.time(t[:, None])[:, :, None, None]
        return self.out(F.silu(h))


_C03_IMGS = torch.rand(8, 3, 8, 8, generator=_gen(3031)) * 2 - 1
_C03_TIMES = torch.rand(8, generator=_gen(3032)).clamp(1e-3, 1 - 1e-3)
_C03_NOISE = torch.randn(8, 3, 8, 8, generator=_gen(3033))
_C03_GAMMA = 5.0


def _c03_loss_and_weight(model: _C03Denoiser, fixed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    img, times, noise = _C03_IMGS, _C03_TIMES, _C03_NOISE
    gamma = _c03_gamma(times)
    alpha, sigma = gamma.sqrt()[:, None, None, None], (1 - gamma).sqrt()[:, None, None, None]
    noised = alpha * img + sigma * noise
    pred = model(noised, times)
    loss = F.mse_loss(pred, noise, reduction="none").flatten(1).mean(1)
    snr = (alpha * alpha / (sigma * sigma)).flatten()
    maybe_clipped_snr = snr.clone()
    if fixed:
        maybe_clipped_snr.clamp_(max=_C03_GAMMA)
    else:
        maybe_clipped_snr.clamp_(min=_C03_GAMMA)
    loss_weight = maybe_clipped_snr / snr  # objective == 'eps'
    return (loss * loss_weight).mean(), loss_weight


def _c03_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _C03Denoiser().train()
    opt = torch.optim.Adam(model.parameters(), lr=3e-4)
    step = _sgd_step(model, opt, lambda: _c03_loss_and_weight(model, fixed=not bug)[0])
    return model, step, _kw(optimizer=opt, inputs=_C03_IMGS)


def _c03_proof(bug: bool) -> bool:
    """The eps-objective min-SNR weight must be min(SNR, gamma)/SNR <= 1; the buggy one exceeds 1 on noisy steps."""
    model, step, _ = _c03_build(bug)
    step()
    with torch.no_grad():
        _, weight = _c03_loss_and_weight(model, fixed=not bug)
    return bool((weight > 1.0 + 1e-6).any())


# --------------------------------------------------------------------------------------------- case-04
# espnet/espnet PR #6571 ("Exclude zero padding from utterance_mvn variance"): ESPnet2's UtteranceMVN with
# norm_means=True and norm_vars=True zero-pads the batch, takes the per-utterance mean over the valid frames, then
# subtracts it from the whole padded tensor, so the padded frames hold -mean; the variance sum then squares those
# frames too and divides by the valid length. The std is inflated by an amount that depends on how much padding the
# batch carries, so a short utterance in a long batch is normalised to a much smaller scale (the PR: std 0.35
# instead of 1.0), and the same utterance gets different features in different batches. Training runs normally.
# Fix in the PR: restore the zero padding right after the mean subtraction.


def _c04_pad_mask(ilens: torch.Tensor, t: int) -> torch.Tensor:
    return torch.arange(t)[None, :] >= ilens[:, None]  # (B, T) True on padding


def _c04_utterance_mvn(x: torch.Tensor, ilens: torch.Tensor, fixed: bool, eps: float = 1.0e-20) -> torch.Tensor:
    ilens_ = ilens.to(x.dtype).view(-1, 1, 1)
    pad = _c04_pad_mask(ilens, x.size(1))[:, :, None]
    x = x.masked_fill(pad, 0.0)
    mean = x.sum(dim=1, keepdim=True) / ilens_
    x = x - mean
    if fixed:
        x = x.masked_fill(pad, 0.0)
    var = x.pow(2).sum(dim=1, keepdim=True) / ilens_
    std = torch.clamp(var.sqrt(), min=eps)
    return x / std


class _C04CTCModel(nn.Module):
    """ESPnet2-style ASR: (frontend features) -> UtteranceMVN -> encoder -> CTC."""

    def __init__(self, fixed: bool, n_mels: int = 16, vocab: int = 10) -> None:
        super().__init__()
        self.fixed = fixed
        self.encoder = nn.GRU(n_mels, 32, batch_first=True)
        self.ctc_lo = nn.Linear(32, vocab)

    def normalize(self, feats: torch.Tensor, ilens: torch.Tensor) -> torch.Tensor:
        return _c04_utterance_mvn(feats, ilens, self.fixed)

    def forward(self, feats: torch.Tensor, ilens: torch.Tensor, ys: torch.Tensor, ylens: torch.Tensor) -> torch.Tensor:
        h, _ = self.encoder(self.normalize(feats, ilens))
        logp = self.ctc_lo(h).log_softmax(-1).transpose(0, 1)
        return F.ctc_loss(logp, ys, ilens, ylens, blank=0, reduction="sum", zero_infinity=True) / feats.size(0)


def _c04_batch() -> dict[str, torch.Tensor]:
    g = _gen(3041)
    ilens = torch.tensor([16, 12, 8, 5])
    feats = torch.randn(4, 16, 16, generator=g) * 1.5 - 6.0  # log-mel-like: strongly negative mean
    feats = feats.masked_fill(_c04_pad_mask(ilens, 16)[:, :, None], 0.0)
    ylens = torch.tensor([5, 4, 3, 2])
    ys = torch.randint(1, 10, (4, 5), generator=g)
    return {"feats": feats, "ilens": ilens, "ys": ys, "ylens": ylens}


_C04_BATCH = _c04_batch()


def _c04_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _C04CTCModel(fixed=not bug).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    step = _sgd_step(model, opt, lambda: model(**_C04_BATCH))
    return model, step, _kw(optimizer=opt, inputs=_C04_BATCH)


def _c04_proof(bug: bool) -> bool:
    """The shortest utterance, normalised inside the padded batch, differs from the same utterance on its own."""
    model, step, _ = _c04_build(bug)
    step()
    b = _C04_BATCH
    n = int(b["ilens"][3])
    in_batch = model.normalize(b["feats"], b["ilens"])[3, :n]
    alone = model.normalize(b["feats"][3:4, :n], b["ilens"][3:4])[0]
    return not torch.allclose(in_batch, alone, atol=1e-5)


# --------------------------------------------------------------------------------------------- case-05
# SWivid/F5-TTS issue #631 ("EMA Update independently from `grad_accumulation_steps`"): the trainer wraps the
# forward/backward/optimizer.step in `accelerator.accumulate(model)` but calls `self.ema_model.update()` outside it,
# once per dataloader batch. With grad_accumulation_steps=k the EMA is updated k times per optimizer step (k-1 of them
# towards weights that have not changed), so the EMA decays as beta^k per real step instead of beta and ends up a much
# shorter average than configured; the logged loss is unaffected. The maintainer: "there's no intuition here, just a
# bug lol", handled in PR #628: the EMA update runs only when an optimizer step happened (accelerator.sync_gradients).


class _C05FlowTTS(nn.Module):
    """Tiny flow-matching mel generator: predicts the velocity (x1 - x0) from the interpolated mel, text and time."""

    def __init__(self, n_mels: int = 16, vocab: int = 20, dim: int = 32) -> None:
        super().__init__()
        self.text_emb = nn.Embedding(vocab, dim)
        self.mel_in = nn.Linear(n_mels, dim)
        self.time = nn.Linear(1, dim)
        self.mid = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, n_mels)

    def forward(self, mel: torch.Tensor, text: torch.Tensor, lens: torch.Tensor,
                x0: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        xt = (1 - t[:, None, None]) * x0 + t[:, None, None] * mel
        h = self.mel_in(xt) + self.text_emb(text) + self.time(t[:, None])[:, None, :]
        pred = self.out(F.silu(self.mid(F.silu(h))))
        mask = (torch.arange(mel.size(1))[None, :] < lens[:, None]).float()[:, :, None]
        return ((pred - (mel - x0)) ** 2 * mask).sum() / (mask.sum() * mel.size(-1))


class _C05EMA:
    """ema_pytorch-style EMA: a frozen copy, ema = beta * ema + (1 - beta) * online on each update()."""

    def __init__(self, model: nn.Module, beta: float = 0.9) -> None:
        self.online = model
        self.ema_model = copy.deepcopy(model).requires_grad_(False)
        self.beta = beta
        self.updates = 0

    @torch.no_grad()
    def update(self) -> None:
        self.updates += 1
        for pe, po in zip(self.ema_model.parameters(), self.online.parameters()):
            pe.lerp_(po.detach(), 1 - self.beta)


_C05_ACCUM = 4


def _c05_micro_batches() -> list[dict[str, torch.Tensor]]:
    g = _gen(3051)
    out = []
    for _ in range(_C05_ACCUM):
        out.append({"mel": torch.randn(2, 16, 16, generator=g), "text": torch.randint(1, 20, (2, 16), generator=g),
                    "lens": torch.tensor([16, 11]), "x0": torch.randn(2, 16, 16, generator=g),
                    "t": torch.rand(2, generator=g)})
    return out


_C05_BATCHES = _c05_micro_batches()


def _c05_setup(bug: bool) -> tuple[_C05FlowTTS, torch.optim.Optimizer, _C05EMA, object]:
    torch.manual_seed(0)
    model = _C05FlowTTS().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ema = _C05EMA(model)

    def step() -> torch.Tensor:
        """One optimizer step = _C05_ACCUM dataloader batches, as the accumulate() loop runs them."""
        total = torch.zeros(())
        for i, batch in enumerate(_C05_BATCHES):
            sync_gradients = i == _C05_ACCUM - 1
            loss = model(**batch) / _C05_ACCUM
            loss.backward()
            total = total + loss.detach()
            if sync_gradients:
                opt.step()
                opt.zero_grad()
            if bug or sync_gradients:
                ema.update()
        return total

    return model, opt, ema, step


def _c05_build(bug: bool) -> Case:
    model, opt, _, step = _c05_setup(bug)
    return model, step, _kw(optimizer=opt, inputs=_C05_BATCHES[0])  # type: ignore[return-value]


def _c05_proof(bug: bool) -> bool:
    """After 3 optimizer steps the EMA has been updated more than 3 times and is not the per-step EMA of the weights."""
    model, _, ema, step = _c05_setup(bug)
    beta = ema.beta
    reference = [p.detach().clone() for p in model.parameters()]
    for _ in range(3):
        step()  # type: ignore[operator]
        for r, p in zip(reference, model.parameters()):
            r.lerp_(p.detach(), 1 - beta)
    same = all(torch.allclose(r, pe, atol=1e-6) for r, pe in zip(reference, ema.ema_model.parameters()))
    return ema.updates != 3 or not same


CASES: list[BlindCase] = [
    BlindCase("b30b-01", "https://github.com/open-mmlab/mmdetection/pull/560", "frozen stage BN in train mode",
              "Backbone stages frozen with frozen_stages=1 keep their BatchNorm layers in training mode, so the "
              "pretrained running statistics of the frozen stem and first stage are overwritten by the new data.",
              _c01_build, _c01_proof,
              known_miss="BatchNorm of frozen lower stages left in train mode: MODE-003 reports frozen fragments of a fine-tuned stack at INFO (their statistics may be meant to adapt)"),
    BlindCase("b30b-02", "https://github.com/pytorch/vision/issues/3394", "layers frozen despite trainable_layers",
              "resnet_fpn_backbone with trainable_layers=5 (all layers, training from scratch) still freezes the "
              "stem BatchNorm's weight and bias at their initial 1 and 0.", _c02_build, _c02_proof,
              known_miss="one normalisation layer frozen among trained ones: which layers were meant to train is in the helper's argument, not in the setup"),
    BlindCase("b30b-03", "https://github.com/lucidrains/recurrent-interface-network-pytorch/issues/11",
              "min-SNR loss weight inverted",
              "The min-SNR diffusion loss weight clamps SNR from below instead of above, so the eps-objective weight "
              "is max(SNR, gamma)/SNR >= 1 and up-weights the noisiest timesteps instead of capping the clean ones.",
              _c03_build, _c03_proof,
              known_miss="a per-timestep loss weight inverted: which weight a noise level should get is arithmetic outside the model"),
    BlindCase("b30b-04", "https://github.com/espnet/espnet/pull/6571", "normalisation stats include padding",
              "Utterance mean-variance normalisation squares the padded frames (holding -mean after subtraction) into "
              "the variance, so short utterances in padded batches are scaled down by a padding-dependent factor.",
              _c04_build, _c04_proof,
              known_miss="normalisation statistics computed over padded frames: a hand-written statistic over padding is not measured"),
    BlindCase("b30b-05", "https://github.com/SWivid/F5-TTS/issues/631", "EMA updated per micro-batch",
              "With gradient accumulation the EMA copy is updated on every micro-batch instead of once per optimizer "
              "step, so it decays k times faster than its configured beta.", _c05_build, _c05_proof),
]
