"""Blind batch 21 (part b): silent vision / self-supervised training bugs from public threads, each with its twin."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw, _sgd_step

# --------------------------------------------------------------------------------------------- case-06
# Sllambias/asparagus PR #12: masked-image-modelling pretraining with ``rec_loss_masked_only``. The mask is True
# for kept (visible) voxels and False for masked-out ones, but the loss was computed on ``pred[mask]``-style
# selection of the visible voxels, so the model is only asked to reproduce what it already sees. Fix: compute
# the reconstruction loss on ``pred[~mask], y[~mask]`` (the masked voxels).


class _TinyRecon3d(nn.Module):
    """A tiny 3D conv encoder-decoder that reconstructs a volume from its masked copy."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Conv3d(1, 4, 3, padding=1)
        self.dec = nn.Conv3d(4, 1, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dec(torch.relu(self.enc(x)))


_C06_X = torch.randn(2, 1, 6, 6, 6, generator=_gen(2106))
_C06_MASK = torch.rand(2, 1, 6, 6, 6, generator=_gen(2107)) > 0.6  # True = visible, False = masked out


def _c06_rec_loss(pred: torch.Tensor, y: torch.Tensor, mask: torch.Tensor, bug: bool) -> torch.Tensor:
    sel = mask if bug else ~mask
    return F.mse_loss(pred[sel], y[sel])


def _c06_build(bug: bool) -> Case:
    """Masked reconstruction pretraining whose masked-only loss selects the visible voxels."""
    torch.manual_seed(0)
    model = _TinyRecon3d().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = _sgd_step(model, opt,
                     lambda: _c06_rec_loss(model(_C06_X * _C06_MASK), _C06_X, _C06_MASK, bug))
    return model, step, _kw(optimizer=opt, inputs=_C06_X * _C06_MASK)


def _c06_proof(bug: bool) -> bool:
    """The loss has zero gradient on the predictions of every masked-out voxel (the ones to be inpainted)."""
    model, _, _ = _c06_build(bug)
    pred = model(_C06_X * _C06_MASK).detach().requires_grad_(True)
    _c06_rec_loss(pred, _C06_X, _C06_MASK, bug).backward()
    assert pred.grad is not None
    return float(pred.grad[~_C06_MASK].abs().max()) == 0.0


# --------------------------------------------------------------------------------------------- case-07
# mengcius/Surface-Defect-Detection issue #3: the segmentation network's last layer ends in a ReLU, and its
# output is trained with ``BCEWithLogitsLoss``. The logits are clamped to >= 0, so sigmoid(logit) >= 0.5 for
# every pixel: the net can never predict "no defect" and training hardly converges. Fix (thread): the last
# layer of the segmentation head is a plain conv with no activation.


class _DefectSeg(nn.Module):
    def __init__(self, relu_out: bool) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                                  nn.ReLU())
        self.head = nn.Conv2d(8, 1, 1)
        self.relu_out = relu_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.head(self.body(x))
        return torch.relu(out) if self.relu_out else out


def _c07_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen(2171)
    img = torch.randn(4, 1, 12, 12, generator=g) * 0.3
    mask = torch.zeros(4, 1, 12, 12)
    mask[:, :, 3:7, 4:9] = 1.0  # a small defect; most pixels are background
    img = img + mask
    return img, mask


_C07_IMG, _C07_MASK = _c07_batch()


def _c07_build(bug: bool) -> Case:
    """Defect segmentation: the head's output passes a ReLU before BCEWithLogitsLoss."""
    torch.manual_seed(0)
    model = _DefectSeg(relu_out=bug).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    crit = nn.BCEWithLogitsLoss()
    step = _sgd_step(model, opt, lambda: crit(model(_C07_IMG), _C07_MASK))
    return model, step, _kw(optimizer=opt, inputs=_C07_IMG)


def _c07_proof(bug: bool) -> bool:
    """After 30 steps no background pixel gets a probability below 0.5: background can never be predicted."""
    model, step, _ = _c07_build(bug)
    for _ in range(30):
        step()
    with torch.no_grad():
        prob = torch.sigmoid(model(_C07_IMG))
    return bool((prob[_C07_MASK == 0] >= 0.5).all())


# --------------------------------------------------------------------------------------------- case-08
# kornia PR #1630: in an augmentation pipeline applied to both image and mask, the geometric augmentations
# (crop + resize) resample the segmentation mask with the default bilinear interpolation, like the image. Class
# ids get averaged at boundaries, producing labels that do not exist there (e.g. classes 1 and 2 between a 0
# region and a 3 region). Fix: masks are resampled with nearest-neighbour interpolation.


def _c08_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen(2181)
    img = torch.rand(2, 3, 8, 8, generator=g)
    mask = torch.zeros(2, 1, 8, 8)
    mask[:, :, :, 4:] = 3.0  # only classes 0 and 3 are present
    return img, mask


_C08_IMG, _C08_MASK = _c08_batch()


def _c08_augment(img: torch.Tensor, mask: torch.Tensor, bug: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Crop the central 6x6 region and resize to 16x16 (a fixed RandomResizedCrop draw)."""
    img_c, mask_c = img[:, :, 1:7, 1:7], mask[:, :, 1:7, 1:7]
    img_r = F.interpolate(img_c, size=(16, 16), mode="bilinear", align_corners=False)
    if bug:
        mask_r = F.interpolate(mask_c, size=(16, 16), mode="bilinear", align_corners=False)
    else:
        mask_r = F.interpolate(mask_c, size=(16, 16), mode="nearest")
    return img_r, mask_r[:, 0].long()


class _TinySeg4(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _c08_build(bug: bool) -> Case:
    """Semantic segmentation whose crop/resize augmentation resamples the label mask bilinearly."""
    torch.manual_seed(0)
    model = _TinySeg4().train()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    img, target = _c08_augment(_C08_IMG, _C08_MASK, bug)
    step = _sgd_step(model, opt, lambda: F.cross_entropy(model(img), target))
    return model, step, _kw(optimizer=opt, inputs=img)


def _c08_proof(bug: bool) -> bool:
    """The augmented training targets contain class ids that appear nowhere in the original mask."""
    _, target = _c08_augment(_C08_IMG, _C08_MASK, bug)
    present = set(_C08_MASK.long().unique().tolist())
    return bool(set(target.unique().tolist()) - present)


# --------------------------------------------------------------------------------------------- case-09
# opengeos/geoai issue #765: SemanticSegmentationDataset normalises multiclass masks with
# ``np.clip(label_mask, 0, num_classes - 1)``, so no-data / ignore pixels (-100) are clipped to class 0 and
# trained as background, and the loss is a plain CrossEntropyLoss. Fix (proposed there): keep ignored pixels at
# ignore_index during normalisation and use ``CrossEntropyLoss(ignore_index=ignore_index)``.

_C09_IGNORE = -100
_C09_NCLS = 3


def _c09_raw_masks() -> torch.Tensor:
    g = _gen(2191)
    mask = torch.randint(0, _C09_NCLS, (2, 10, 10), generator=g)
    mask[:, :, 6:] = _C09_IGNORE  # a large no-data strip (e.g. outside the scene footprint)
    return mask


_C09_IMG = torch.randn(2, 4, 10, 10, generator=_gen(2192))
_C09_RAW = _c09_raw_masks()


def _c09_labels(raw: torch.Tensor, bug: bool) -> torch.Tensor:
    if bug:
        return raw.clamp(0, _C09_NCLS - 1)
    out = raw.clamp(0, _C09_NCLS - 1)
    out[raw == _C09_IGNORE] = _C09_IGNORE
    return out


def _c09_criterion(bug: bool) -> nn.Module:
    return nn.CrossEntropyLoss() if bug else nn.CrossEntropyLoss(ignore_index=_C09_IGNORE)


def _c09_build(bug: bool) -> Case:
    """Multispectral segmentation whose no-data pixels are clipped to class 0 and trained as background."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, _C09_NCLS, 1)).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    target = _c09_labels(_C09_RAW, bug)
    crit = _c09_criterion(bug)
    step = _sgd_step(model, opt, lambda: crit(model(_C09_IMG), target))
    return model, step, _kw(optimizer=opt, inputs=_C09_IMG)


def _c09_proof(bug: bool) -> bool:
    """The loss sends gradient through the no-data pixels, pushing them towards class 0."""
    model, _, _ = _c09_build(bug)
    logits = model(_C09_IMG).detach().requires_grad_(True)
    _c09_criterion(bug)(logits, _c09_labels(_C09_RAW, bug)).backward()
    assert logits.grad is not None
    nodata = (_C09_RAW == _C09_IGNORE).unsqueeze(1).expand_as(logits)
    return float(logits.grad[nodata].abs().max()) > 0.0


# --------------------------------------------------------------------------------------------- case-10
# catalyst-team/catalyst PR #1278 (review): the SimCLR example's ContrastiveRunner computes
# ``emb1 = self.model(batch["aug1"])`` and ``emb2 = self.model(batch["aug1"])``: both embeddings come from the
# same augmented view, so every positive pair is an image with itself and the NT-Xent loss teaches no
# augmentation invariance. Fix (review, accepted): ``emb2 = self.model(batch["aug2"])``.


class _SimCLRNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.ReLU(),
                                     nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.projector = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.projector(self.encoder(x))


def _c10_views() -> dict[str, torch.Tensor]:
    g = _gen(2101)
    base = torch.rand(6, 3, 12, 12, generator=g)
    aug1 = (base + 0.1 * torch.randn(base.shape, generator=g)).clamp(0, 1)
    aug2 = (base.flip(-1) * (0.8 + 0.4 * torch.rand(6, 1, 1, 1, generator=g))).clamp(0, 1)
    return {"aug1": aug1, "aug2": aug2}


_C10_BATCH = _c10_views()


def _nt_xent(z1: torch.Tensor, z2: torch.Tensor, tau: float = 0.5) -> torch.Tensor:
    z = F.normalize(torch.cat([z1, z2]), dim=1)
    n = z1.shape[0]
    sim = z @ z.t() / tau
    sim = sim.masked_fill(torch.eye(2 * n, dtype=torch.bool), float("-inf"))
    targets = torch.cat([torch.arange(n, 2 * n), torch.arange(0, n)])
    return F.cross_entropy(sim, targets)


def _c10_embeddings(model: nn.Module, bug: bool) -> tuple[torch.Tensor, torch.Tensor]:
    emb1 = model(_C10_BATCH["aug1"])
    emb2 = model(_C10_BATCH["aug1"] if bug else _C10_BATCH["aug2"])
    return emb1, emb2


def _c10_build(bug: bool) -> Case:
    """SimCLR step whose second embedding is computed from the first augmented view again."""
    torch.manual_seed(0)
    model = _SimCLRNet().train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    step = _sgd_step(model, opt, lambda: _nt_xent(*_c10_embeddings(model, bug)))
    return model, step, _kw(optimizer=opt, inputs=_C10_BATCH["aug1"])


def _c10_proof(bug: bool) -> bool:
    """Both embeddings of each positive pair are identical: each image is contrasted with itself."""
    model, _, _ = _c10_build(bug)
    with torch.no_grad():
        e1, e2 = _c10_embeddings(model, bug)
    return bool(torch.equal(e1, e2))


CASES: list[BlindCase] = [
    BlindCase("b21-case-06", "https://github.com/Sllambias/asparagus/pull/12", "inverted loss mask",
              "The masked-only reconstruction loss selects the visible voxels instead of the masked ones, so "
              "the model is trained to copy its input and never to inpaint.", _c06_build, _c06_proof,
              known_miss="the masked-reconstruction loss selects the visible patches instead of the masked ones: copying is measured for token ids and whole-window values, not for masked patches"),
    BlindCase("b21-case-07", "https://github.com/mengcius/Surface-Defect-Detection/issues/3",
              "activation before logits loss",
              "A ReLU on the segmentation head's output feeds BCEWithLogitsLoss, so every pixel's probability "
              "stays at or above 0.5 and background can never be predicted.", _c07_build, _c07_proof),
    BlindCase("b21-case-08", "https://github.com/kornia/kornia/pull/1630", "mask interpolation in augmentation",
              "Crop/resize augmentation resamples the label mask bilinearly, so boundary pixels get averaged "
              "class ids that are not present and are trained on wrong targets.", _c08_build, _c08_proof,
              known_miss="bilinear resampling of the label mask invents in-between class ids at boundaries: label semantics the batch does not carry"),
    BlindCase("b21-case-09", "https://github.com/opengeos/geoai/issues/765", "ignore label clipped to a class",
              "No-data pixels (-100) are clipped to class 0 and the loss has no ignore_index, so large no-data "
              "areas are trained as background.", _c09_build, _c09_proof,
              known_miss="no-data pixels clipped to class 0 with no ignore_index: a large share of class 0 is not judged against what the data marks as missing"),
    BlindCase("b21-case-10", "https://github.com/catalyst-team/catalyst/pull/1278", "contrastive views",
              "Both SimCLR embeddings are computed from the same augmented view, so each positive pair is an "
              "image with itself and no augmentation invariance is learned.", _c10_build, _c10_proof),
]
