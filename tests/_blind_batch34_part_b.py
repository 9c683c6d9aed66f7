"""Blind batch 34 (part b): silent vision and generative training bugs from public GitHub threads, each with its twin.

Collected by someone who does not write the audit's checks. Every case builds the user's setup on a tiny model
(plain torch detectors, GANs, a denoising network with an EMA copy, a vision transformer and a segmentation net,
all built in code; nothing is downloaded) and proves the bug without the audit on real tensors and real steps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw

# --------------------------------------------------------------------------------------------- case-01
# kuangliu/pytorch-retinanet PR #19 ("Clone boxes tensor to avoid mutating ground truth"): ListDataset.__getitem__
# took `boxes = self.boxes[idx]`, the tensor that holds the annotation itself, and handed it to random_flip and
# random_crop, which edit it in place (`boxes[:, 0] = xmin`, `boxes -= torch.Tensor([x, y, x, y])`, `clamp_`). Every
# time an image is loaded its stored ground truth is flipped / shifted / clamped again, so the boxes drift epoch after
# epoch until they collapse to zero width; nothing errors, the loc loss just heads for 0 ("no iou matches and loc loss
# would go to 0"). Fix in the PR (merged: "Wow, that's a big one"): `boxes = self.boxes[idx].clone()`.

_C01_IMGS = torch.rand(2, 3, 32, 32, generator=_gen(3401))


class _C01Dataset:
    """ListDataset with the repository's random_flip / random_crop / resize box transforms (seeded)."""

    def __init__(self, bug: bool) -> None:
        self.bug = bug
        self.imgs = _C01_IMGS
        self.boxes = [torch.tensor([[4.0, 6.0, 20.0, 26.0], [14.0, 2.0, 30.0, 12.0]]),
                      torch.tensor([[2.0, 3.0, 12.0, 15.0], [10.0, 16.0, 28.0, 30.0]])]
        self.labels = [torch.tensor([1, 2]), torch.tensor([0, 2])]
        self.g = _gen(3402)

    def __len__(self) -> int:
        return len(self.boxes)

    def _random_flip(self, img, boxes):
        if torch.rand(1, generator=self.g).item() < 0.5:
            img = img.flip(-1)
            w = img.shape[-1]
            xmin = w - boxes[:, 2]
            xmax = w - boxes[:, 0]
            boxes[:, 0] = xmin
            boxes[:, 2] = xmax
        return img, boxes

    def _random_crop(self, img, boxes):
        w = h = 28
        x = int(torch.randint(1, 5, (1,), generator=self.g))
        y = int(torch.randint(1, 5, (1,), generator=self.g))
        img = img[:, y:y + h, x:x + w]
        boxes -= torch.tensor([x, y, x, y], dtype=boxes.dtype)
        boxes[:, 0::2].clamp_(min=0, max=w - 1)
        boxes[:, 1::2].clamp_(min=0, max=h - 1)
        return img, boxes

    def _resize(self, img, boxes, size: int = 32):
        sw = size / img.shape[-1]
        sh = size / img.shape[-2]
        img = F.interpolate(img[None], size=(size, size), mode="bilinear", align_corners=False)[0]
        return img, boxes * torch.tensor([sw, sh, sw, sh])

    def __getitem__(self, idx: int):
        img = self.imgs[idx]
        boxes = self.boxes[idx] if self.bug else self.boxes[idx].clone()
        labels = self.labels[idx]
        img, boxes = self._random_flip(img, boxes)
        img, boxes = self._random_crop(img, boxes)
        img, boxes = self._resize(img, boxes)
        return img, boxes, labels


class _C01Detector(nn.Module):
    """A tiny single-shot head: two box slots, each regressing normalised xyxy and classifying over 3 classes."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.ReLU(),
                                  nn.Conv2d(8, 8, 3, stride=2, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2),
                                  nn.Flatten())
        self.loc = nn.Linear(32, 2 * 4)
        self.cls = nn.Linear(32, 2 * 3)

    def forward(self, x: torch.Tensor):
        h = self.body(x)
        return self.loc(h).view(-1, 2, 4), self.cls(h).view(-1, 2, 3)


def _c01_setup(bug: bool):
    torch.manual_seed(0)
    model = _C01Detector().train()
    dataset = _C01Dataset(bug)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9, weight_decay=1e-4)

    def collate():
        items = [dataset[i] for i in range(len(dataset))]
        imgs = torch.stack([it[0] for it in items])
        loc_targets = torch.stack([it[1] for it in items]) / 32.0  # encode: normalised boxes
        cls_targets = torch.stack([it[2] for it in items])
        return imgs, loc_targets, cls_targets

    def step() -> torch.Tensor:
        imgs, loc_targets, cls_targets = collate()  # one pass over the dataset per step
        opt.zero_grad()
        loc_preds, cls_preds = model(imgs)
        loss = F.smooth_l1_loss(loc_preds, loc_targets) + F.cross_entropy(cls_preds.reshape(-1, 3),
                                                                          cls_targets.reshape(-1))
        loss.backward()
        opt.step()
        return loss

    return model, opt, step, dataset


def _c01_build(bug: bool) -> Case:
    model, opt, step, _ = _c01_setup(bug)
    return model, step, _kw(optimizer=opt, inputs={"x": _C01_IMGS})


def _c01_proof(bug: bool) -> bool:
    """After three training steps (three passes over the data), do the dataset's stored annotations still hold?"""
    _, _, step, dataset = _c01_setup(bug)
    original = [b.clone() for b in dataset.boxes]
    for _ in range(3):
        step()
    return any(not torch.equal(b, o) for b, o in zip(dataset.boxes, original))


# --------------------------------------------------------------------------------------------- case-02
# ajbrock/BigGAN-PyTorch issue #25 ("Any reason you don't zero optimizer between Discriminator training steps?"):
# GAN_training_function zeroes D's gradients once at the top of train() and then loops `for step_index in
# range(config['num_D_steps'])`, doing backward and D.optim.step() each time, with no zero_grad inside the loop. With
# num_D_steps > 1 (the CIFAR launch script uses 4) every D step after the first applies the sum of all previous D
# steps' gradients as well; training runs and losses look like a GAN's. The author: "Good catch--this was a typo!
# Fixed with the most recent commit" (commit b70f16c adds `D.optim.zero_grad()` at the top of each D step).

_C02_BS = 4
_C02_D_STEPS = 2
_C02_X = torch.randn(_C02_BS * _C02_D_STEPS, 16, generator=_gen(3411))


class _C02G(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16), nn.Tanh())

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.net(z)


class _C02D(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class _C02GD(nn.Module):
    """BigGAN's G_D wrapper: G's forward runs without grad unless train_G; fake and real go through D together."""

    def __init__(self, G: nn.Module, D: nn.Module) -> None:
        super().__init__()
        self.G = G
        self.D = D

    def forward(self, z, x=None, train_G: bool = False):
        with torch.set_grad_enabled(train_G):
            G_z = self.G(z)
        D_input = G_z if x is None else torch.cat([G_z, x], 0)
        D_out = self.D(D_input)
        if x is None:
            return D_out
        return torch.split(D_out, [G_z.shape[0], x.shape[0]])


def _toggle_grad(model: nn.Module, on: bool) -> None:
    for p in model.parameters():
        p.requires_grad = on


def _c02_setup(bug: bool):
    torch.manual_seed(0)
    G, D = _C02G(), _C02D()
    GD = _C02GD(G, D).train()
    G_optim = torch.optim.Adam(G.parameters(), lr=2e-4, betas=(0.0, 0.999), eps=1e-6)
    D_optim = torch.optim.Adam(D.parameters(), lr=2e-4, betas=(0.0, 0.999), eps=1e-6)
    gz = _gen(3412)

    def train() -> torch.Tensor:
        G_optim.zero_grad()
        D_optim.zero_grad()
        x = torch.split(_C02_X, _C02_BS)
        counter = 0
        _toggle_grad(D, True)
        _toggle_grad(G, False)
        for _step_index in range(_C02_D_STEPS):
            if not bug:
                D_optim.zero_grad()
            for _accumulation_index in range(1):  # num_D_accumulations
                z_ = torch.randn(_C02_BS, 8, generator=gz)
                D_fake, D_real = GD(z_, x[counter], train_G=False)
                D_loss_real = F.relu(1.0 - D_real).mean()  # hinge loss
                D_loss_fake = F.relu(1.0 + D_fake).mean()
                D_loss = (D_loss_real + D_loss_fake) / 1.0
                D_loss.backward()
                counter += 1
            D_optim.step()
        _toggle_grad(D, False)
        _toggle_grad(G, True)
        G_optim.zero_grad()
        z_ = torch.randn(_C02_BS, 8, generator=gz)
        D_fake = GD(z_, train_G=True)
        G_loss = -D_fake.mean()
        G_loss.backward()
        G_optim.step()
        return G_loss

    return GD, D_optim, G_optim, train


def _c02_build(bug: bool) -> Case:
    GD, D_optim, _, train = _c02_setup(bug)
    return GD, train, _kw(optimizer=D_optim, inputs={"x": _C02_X})


def _c02_proof(bug: bool) -> bool:
    """When D's second step of one iteration runs its forward, does D still hold the first step's gradient?"""
    GD, _, _, train = _c02_setup(bug)
    seen: list[float] = []

    def pre_hook(module, args):
        seen.append(sum(float(p.grad.abs().sum()) for p in module.parameters() if p.grad is not None))

    handle = GD.D.register_forward_pre_hook(pre_hook)
    train()
    handle.remove()
    return seen[1] > 0.0  # calls: D step 1, D step 2, G step


# --------------------------------------------------------------------------------------------- case-03
# huggingface/diffusers issue #5783 ("train_text_to_image_sdxl.py ema not working"): with --use_ema the SDXL
# fine-tuning script builds `ema_unet = EMAModel(unet.parameters(), ...)`, trains, and at the end saves the EMA weights
# as the final model, but its loop never calls `ema_unet.step(unet.parameters())` after the optimizer step (the SD 1.x
# script does). The loss goes down normally; the EMA checkpoint is the untouched pretrained UNet ("the EMA checkpoint
# never changed"). Fix: PR #7048 ("Fixes #5783") adds `if args.use_ema: ema_unet.step(unet.parameters())` inside
# `if accelerator.sync_gradients:` (and moves ema_unet to the device).

_C03_LATENTS = torch.randn(4, 4, 8, 8, generator=_gen(3421))
_C03_COND = torch.randn(4, 16, generator=_gen(3422))
_C03_T = 1000
_C03_BETAS = torch.linspace(0.00085 ** 0.5, 0.012 ** 0.5, _C03_T) ** 2  # scaled_linear
_C03_ALPHAS_CUMPROD = torch.cumprod(1.0 - _C03_BETAS, 0)


class _C03UNet(nn.Module):
    """A two-conv denoiser conditioned on the timestep and a pooled text embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.conv_in = nn.Conv2d(4, 16, 3, padding=1)
        self.time_emb = nn.Linear(1, 16)
        self.cond_emb = nn.Linear(16, 16)
        self.conv_out = nn.Conv2d(16, 4, 3, padding=1)

    def forward(self, sample, timesteps, encoder_hidden_states):
        t = self.time_emb(timesteps.float()[:, None] / _C03_T) + self.cond_emb(encoder_hidden_states)
        h = F.silu(self.conv_in(sample) + t[:, :, None, None])
        return self.conv_out(h)


class _C03EMAModel:
    """diffusers.training_utils.EMAModel's update: decay = min(decay, (1 + step) / (10 + step))."""

    def __init__(self, parameters, decay: float = 0.9999) -> None:
        self.shadow_params = [p.clone().detach() for p in parameters]
        self.decay = decay
        self.optimization_step = 0

    def get_decay(self, optimization_step: int) -> float:
        step = max(0, optimization_step - 1)
        if step <= 0:
            return 0.0
        return min(self.decay, (1 + step) / (10 + step))

    @torch.no_grad()
    def step(self, parameters) -> None:
        self.optimization_step += 1
        one_minus_decay = 1 - self.get_decay(self.optimization_step)
        for s_param, param in zip(self.shadow_params, parameters):
            if param.requires_grad:
                s_param.sub_(one_minus_decay * (s_param - param))
            else:
                s_param.copy_(param)


def _c03_setup(bug: bool):
    torch.manual_seed(0)
    unet = _C03UNet().train()
    ema_unet = _C03EMAModel(unet.parameters())
    optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-3, betas=(0.9, 0.999), weight_decay=1e-2, eps=1e-8)
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)  # "constant"
    g = _gen(3423)

    def step() -> torch.Tensor:
        noise = torch.randn(_C03_LATENTS.shape, generator=g)
        timesteps = torch.randint(0, _C03_T, (_C03_LATENTS.shape[0],), generator=g)
        a = _C03_ALPHAS_CUMPROD[timesteps].sqrt()[:, None, None, None]
        s = (1 - _C03_ALPHAS_CUMPROD[timesteps]).sqrt()[:, None, None, None]
        noisy_model_input = a * _C03_LATENTS + s * noise  # noise_scheduler.add_noise
        model_pred = unet(noisy_model_input, timesteps, _C03_COND)
        loss = F.mse_loss(model_pred.float(), noise.float(), reduction="mean")  # epsilon target
        loss.backward()
        torch.nn.utils.clip_grad_norm_(unet.parameters(), 1.0)
        optimizer.step()
        lr_scheduler.step()
        optimizer.zero_grad()
        # if accelerator.sync_gradients:
        if not bug:
            ema_unet.step(unet.parameters())
        return loss

    return unet, ema_unet, optimizer, lr_scheduler, step


def _c03_build(bug: bool) -> Case:
    unet, _, optimizer, lr_scheduler, step = _c03_setup(bug)
    return unet, step, _kw(optimizer=optimizer, lr_scheduler=lr_scheduler,
                           inputs={"sample": _C03_LATENTS, "encoder_hidden_states": _C03_COND})


def _c03_proof(bug: bool) -> bool:
    """After three steps in which the UNet moved, are the EMA weights (the saved model) still the initial ones?"""
    unet, ema_unet, _, _, step = _c03_setup(bug)
    init = [p.clone() for p in ema_unet.shadow_params]
    start = [p.detach().clone() for p in unet.parameters()]
    for _ in range(3):
        step()
    moved = any(not torch.equal(p.detach(), s) for p, s in zip(unet.parameters(), start))
    ema_same = all(torch.equal(e, i) for e, i in zip(ema_unet.shadow_params, init))
    return moved and ema_same


# --------------------------------------------------------------------------------------------- case-04
# labmlai/annotated_deep_learning_paper_implementations issue #133 ("ViT and the positional econding", labelled bug):
# LearnedPositionalEmbeddings.forward did `pe = self.positional_encodings[x.shape[0]]`, which indexes ONE row (the
# one at position n_patches) instead of slicing the first n_patches rows, so the same vector is added to every patch.
# The ViT trains (CIFAR-10 accuracy is merely poor) but the transformer gets no positional information at all. The
# maintainer: "Fixed it" in commit 0bfb2106 (`pe = self.positional_encodings[:x.shape[0]]`).

_C04_IMGS = torch.randn(4, 3, 16, 16, generator=_gen(3431))
_C04_Y = torch.randint(0, 10, (4,), generator=_gen(3432))
_C04_PATCH = 4
_C04_N = (16 // _C04_PATCH) ** 2


class _C04PatchEmbeddings(nn.Module):
    def __init__(self, d_model: int, patch_size: int, in_channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, d_model, patch_size, stride=patch_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)
        bs, c, h, w = x.shape
        x = x.permute(2, 3, 0, 1)
        return x.reshape(h * w, bs, c)  # [patches, batch_size, d_model]


class _C04LearnedPositionalEmbeddings(nn.Module):
    def __init__(self, d_model: int, bug: bool, max_len: int = 5_000) -> None:
        super().__init__()
        self.bug = bug
        self.positional_encodings = nn.Parameter(torch.zeros(max_len, 1, d_model), requires_grad=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bug:
            pe = self.positional_encodings[x.shape[0]]
        else:
            pe = self.positional_encodings[:x.shape[0]]
        return x + pe


class _C04VisionTransformer(nn.Module):
    def __init__(self, bug: bool, d_model: int = 32) -> None:
        super().__init__()
        self.patch_emb = _C04PatchEmbeddings(d_model, _C04_PATCH, 3)
        self.pos_emb = _C04LearnedPositionalEmbeddings(d_model, bug)
        self.classification = nn.Sequential(nn.Linear(d_model, 64), nn.ReLU(), nn.Linear(64, 10))
        self.transformer_layers = nn.ModuleList([
            nn.TransformerEncoderLayer(d_model, 2, dim_feedforward=64, dropout=0.0) for _ in range(2)])
        self.cls_token_emb = nn.Parameter(torch.randn(1, 1, d_model), requires_grad=True)
        self.ln = nn.LayerNorm([d_model])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_emb(x)
        x = self.pos_emb(x)  # (order of the time: positions added before [CLS] is concatenated)
        cls_token_emb = self.cls_token_emb.expand(-1, x.shape[1], -1)
        x = torch.cat([cls_token_emb, x])
        for layer in self.transformer_layers:
            x = layer(x)
        x = self.ln(x[0])
        return self.classification(x)


def _c04_setup(bug: bool):
    torch.manual_seed(0)
    model = _C04VisionTransformer(bug).train()
    opt = torch.optim.Adam(model.parameters(), lr=2.5e-4)

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(model(_C04_IMGS), _C04_Y)
        loss.backward()
        opt.step()
        return loss

    return model, opt, step


def _c04_build(bug: bool) -> Case:
    model, opt, step = _c04_setup(bug)
    return model, step, _kw(optimizer=opt, inputs={"x": _C04_IMGS})


def _c04_proof(bug: bool) -> bool:
    """After a real step, did the position rows of the patches (0 .. n_patches-1) get no gradient at all?"""
    model, _, step = _c04_setup(bug)
    step()
    grad = model.pos_emb.positional_encodings.grad
    return bool(grad[:_C04_N].abs().sum() == 0)


# --------------------------------------------------------------------------------------------- case-05
# tensorflow/docs PR #2159 ("Use NEAREST NEIGHBOR method when resizing image mask", merged): the image segmentation
# tutorial's load_image resized the Oxford-IIIT pet trimap with `tf.image.resize(mask, (128, 128))`, whose default
# is bilinear, then did `input_mask -= 1` and trained a U-Net with sparse categorical cross-entropy. Where two classes
# meet, the resized mask holds in-between values (1.9995..., 0.5, ...) which the loss casts to an integer class, so
# boundary pixels between "pet" and "border" are trained as a third class that is not there; training converges.
# Fix in the PR: `tf.image.resize(mask, (128, 128), method=tf.image.ResizeMethod.NEAREST_NEIGHBOR)`. Reproduced with
# torch's F.interpolate (bilinear, half-pixel centres as TF's resize) and the `.long()` a torch user casts with.

_C05_IMG = torch.rand(2, 3, 32, 32, generator=_gen(3441))


def _c05_trimap() -> torch.Tensor:
    """Pet (1) inside a border ring (3) on background (2); edges on odd rows/columns so 2x2 blocks straddle them."""
    mask = torch.full((2, 1, 32, 32), 2.0)
    mask[0, :, 5:27, 7:25] = 3.0
    mask[0, :, 7:25, 9:23] = 1.0
    mask[1, :, 3:21, 11:29] = 3.0
    mask[1, :, 5:19, 13:27] = 1.0
    return mask


_C05_MASK = _c05_trimap()


def _c05_load(bug: bool):
    input_image = F.interpolate(_C05_IMG, size=(16, 16), mode="bilinear", align_corners=False)
    if bug:
        input_mask = F.interpolate(_C05_MASK, size=(16, 16), mode="bilinear", align_corners=False)
    else:
        input_mask = F.interpolate(_C05_MASK, size=(16, 16), mode="nearest")
    input_mask = input_mask - 1
    return input_image, input_mask


def _c05_setup(bug: bool):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(),
                          nn.Conv2d(16, 3, 1)).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    used: dict[str, torch.Tensor] = {}

    def step() -> torch.Tensor:
        image, mask = _c05_load(bug)
        target = mask.squeeze(1).long()  # sparse categorical cross-entropy's integer labels
        used["target"] = target
        opt.zero_grad()
        loss = F.cross_entropy(model(image), target)
        loss.backward()
        opt.step()
        return loss

    return model, opt, step, used


def _c05_build(bug: bool) -> Case:
    model, opt, step, _ = _c05_setup(bug)
    image, _ = _c05_load(bug)
    return model, step, _kw(optimizer=opt, inputs={"input": image})


def _c05_proof(bug: bool) -> bool:
    """In a real step, is some pixel trained toward a class that occurs nowhere in the 2x2 block it was resized from?"""
    _, _, step, used = _c05_setup(bug)
    step()
    target = used["target"]
    blocks = (_C05_MASK.squeeze(1) - 1).long().unfold(1, 2, 2).unfold(2, 2, 2).reshape(2, 16, 16, 4)
    present = (blocks == target[..., None]).any(-1)
    return bool((~present).any())


CASES: list[BlindCase] = [
    BlindCase("b34b-01", "https://github.com/kuangliu/pytorch-retinanet/pull/19", "augmentation mutates ground truth",
              "The dataset hands its stored annotation tensor to in-place flip/crop transforms, so the ground-truth "
              "boxes drift every epoch and collapse while training runs.", _c01_build, _c01_proof,
              known_miss="the dataset's stored boxes edited in place by its transforms: the data pipeline's copy semantics are outside one step's tensors"),
    BlindCase("b34b-02", "https://github.com/ajbrock/BigGAN-PyTorch/issues/25", "discriminator gradients not zeroed",
              "With several D steps per iteration and no zero_grad between them, every D step after the first also "
              "applies the previous steps' gradients.", _c02_build, _c02_proof),
    BlindCase("b34b-03", "https://github.com/huggingface/diffusers/issues/5783", "EMA weights never updated",
              "The SDXL script never calls ema_unet.step(), so the EMA weights saved as the final model stay the "
              "initial UNet while the trained UNet moves.", _c03_build, _c03_proof,
              known_miss="an EMA object whose step() is never called: a copy the audit is not given cannot be seen not to follow"),
    BlindCase("b34b-04", "https://github.com/labmlai/annotated_deep_learning_paper_implementations/issues/133",
              "one position embedding for all patches",
              "The ViT indexes a single row of the learned position table instead of slicing it, so every patch gets "
              "the same position vector and the model has no positional information.", _c04_build, _c04_proof),
    BlindCase("b34b-05", "https://github.com/tensorflow/docs/pull/2159", "segmentation mask resized bilinearly",
              "The trimap is resized with bilinear interpolation, so boundary pixels get in-between values that are "
              "cast to a class absent there and trained as such.", _c05_build, _c05_proof,
              known_miss="a mask resized bilinearly and cast to classes: which values a target may hold is data semantics"),
]
