"""Blind batch 6: silent training bugs from public GitHub threads, each with its fixed twin.

Collected by someone who does not write the audit's checks; see docs/blind-batch6.md. Every case builds the user's
setup on a tiny real model (plain torch modules, and transformers BERT, ViT and Llama from tiny configs in code;
nothing is downloaded) and proves the bug without the audit on real runs and real tensors.
"""

from __future__ import annotations

import math
from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw, _sgd_step

# --------------------------------------------------------------------------------------------- case-01


class _PositionalEncoding(nn.Module):
    """Sinusoidal positions added to (T, B, d) embeddings, as in the PyTorch language-modelling tutorial."""

    pe: torch.Tensor

    def __init__(self, d: int, max_len: int = 64) -> None:
        super().__init__()
        pos = torch.arange(max_len).unsqueeze(1)
        div = torch.exp(torch.arange(0, d, 2) * (-math.log(10000.0) / d))
        pe = torch.zeros(max_len, 1, d)
        pe[:, 0, 0::2] = torch.sin(pos * div)
        pe[:, 0, 1::2] = torch.cos(pos * div)
        self.register_buffer("pe", pe)
        self.dropout = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(x + self.pe[: x.size(0)])


class _TutorialLM(nn.Module):
    """The tutorial's TransformerModel: embedding, positions, TransformerEncoder, linear decoder (sequence-first)."""

    def __init__(self, ntoken: int = 24, d: int = 32) -> None:
        super().__init__()
        self.d = d
        self.embedding = nn.Embedding(ntoken, d)
        self.pos_encoder = _PositionalEncoding(d)
        layer = nn.TransformerEncoderLayer(d, 2, 64, dropout=0.1)
        self.transformer_encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.linear = nn.Linear(d, ntoken)

    def forward(self, src: torch.Tensor, src_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self.pos_encoder(self.embedding(src) * math.sqrt(self.d))
        return self.linear(self.transformer_encoder(x, src_mask))


_LM_DATA = torch.randint(0, 24, (9, 4), generator=_gen(101))  # (T + 1, B), batchified as in the tutorial


def _c01_logits(model: _TutorialLM, src: torch.Tensor, bug: bool) -> torch.Tensor:
    mask = None if bug else nn.Transformer.generate_square_subsequent_mask(src.size(0))
    return model(src, mask)


def _c01_build(bug: bool) -> Case:
    """Next-token language model trained with the encoder called without a causal src_mask."""
    torch.manual_seed(0)
    model = _TutorialLM().train()
    opt = torch.optim.SGD(model.parameters(), lr=5.0)
    src, tgt = _LM_DATA[:-1], _LM_DATA[1:]

    def step() -> torch.Tensor:
        opt.zero_grad()
        out = _c01_logits(model, src, bug)
        loss = F.cross_entropy(out.view(-1, out.size(-1)), tgt.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=(src, tgt))


def _c01_proof(bug: bool) -> bool:
    """Changing the last input token changes the prediction at position 0: each position sees the future."""
    model = cast(_TutorialLM, _c01_build(bug)[0]).eval()
    src = _LM_DATA[:-1].clone()
    changed = src.clone()
    changed[-1] = (changed[-1] + 1) % 24
    with torch.no_grad():
        first = _c01_logits(model, src, bug)[0]
        other = _c01_logits(model, changed, bug)[0]
    return not torch.allclose(first, other, atol=1e-5)


# --------------------------------------------------------------------------------------------- case-02


class _Residual(nn.Module):
    def __init__(self, ch: int, res_ch: int) -> None:
        super().__init__()
        self._block = nn.Sequential(nn.ReLU(), nn.Conv2d(ch, res_ch, 3, padding=1, bias=False), nn.ReLU(),
                                    nn.Conv2d(res_ch, ch, 1, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self._block(x)


class _ResidualStack(nn.Module):
    def __init__(self, bug: bool, ch: int, res_ch: int, n: int) -> None:
        super().__init__()
        if bug:  # the list holds n references to one Residual
            self._layers = nn.ModuleList([_Residual(ch, res_ch)] * n)
        else:
            self._layers = nn.ModuleList([_Residual(ch, res_ch) for _ in range(n)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self._layers:
            x = layer(x)
        return F.relu(x)


class _VQVAEStandIn(nn.Module):
    """VQ-VAE encoder/decoder with residual stacks (the quantiser is left out; the stacks are the thread's code)."""

    def __init__(self, bug: bool, ch: int = 16) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(3, ch, 4, 2, 1), nn.ReLU(), nn.Conv2d(ch, ch, 3, padding=1))
        self.enc_res = _ResidualStack(bug, ch, 8, 2)
        self.dec = nn.Conv2d(ch, ch, 3, padding=1)
        self.dec_res = _ResidualStack(bug, ch, 8, 2)
        self.out = nn.ConvTranspose2d(ch, 3, 4, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.dec_res(self.dec(self.enc_res(self.enc(x)))))


_IMGS = torch.rand(4, 3, 16, 16, generator=_gen(201))


def _c02_build(bug: bool) -> Case:
    """Autoencoder whose residual stacks are built with list multiplication."""
    torch.manual_seed(0)
    model = _VQVAEStandIn(bug).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, amsgrad=False)
    variance = float(_IMGS.var())
    step = _sgd_step(model, opt, lambda: F.mse_loss(model(_IMGS), _IMGS) / variance)
    return model, step, _kw(optimizer=opt, inputs=_IMGS)


def _c02_proof(bug: bool) -> bool:
    """After real steps the two residual layers of a stack still hold identical weights."""
    built, step, _ = _c02_build(bug)
    for _ in range(3):
        step()
    layers = cast(_VQVAEStandIn, built).enc_res._layers
    a, b = (cast(nn.Conv2d, cast(_Residual, layer)._block[1]).weight for layer in layers)
    return bool(torch.equal(a, b))


# --------------------------------------------------------------------------------------------- case-03


class _DQN(nn.Module):
    def __init__(self, obs: int = 4, actions: int = 2) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(obs, 32), nn.ReLU(), nn.Linear(32, actions))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class _CentralControl:
    """The thread's DQN controller: a moving network trained on Bellman targets from a target network."""

    def __init__(self, bug: bool, gamma: float = 0.99) -> None:
        self.bug = bug
        self.target_nn = _DQN()
        self.moving_nn = _DQN()
        self.gamma = gamma
        self.optimizer = torch.optim.Adam(self.moving_nn.parameters(), lr=1e-3)

    def update_target(self) -> None:
        self.target_nn.load_state_dict(self.moving_nn.state_dict())
        if self.bug:
            self.target_nn = self.moving_nn

    def loss(self, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        states, actions, next_states, rewards, dones = batch
        q = self.moving_nn(states).gather(1, actions[:, None]).squeeze(-1)
        next_q = self.target_nn(next_states).max(1)[0].detach()
        expected = rewards + self.gamma * next_q * (1 - dones)
        return nn.MSELoss()(q, expected)

    def optimize(self, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        self.optimizer.zero_grad()
        loss = self.loss(batch)
        loss.backward()
        self.optimizer.step()
        return loss


_RL_BATCH = (torch.randn(16, 4, generator=_gen(301)), torch.randint(0, 2, (16,), generator=_gen(302)),
             torch.randn(16, 4, generator=_gen(303)), torch.rand(16, generator=_gen(304)),
             torch.zeros(16))


def _c03_controller(bug: bool) -> _CentralControl:
    torch.manual_seed(0)
    cc = _CentralControl(bug)
    cc.update_target()  # the periodic sync
    return cc


def _c03_build(bug: bool) -> Case:
    """DQN step after a target sync that also rebinds the target network to the moving one."""
    cc = _c03_controller(bug)
    return cc.moving_nn, lambda: cc.optimize(_RL_BATCH), _kw(optimizer=cc.optimizer, inputs=_RL_BATCH)


def _c03_proof(bug: bool) -> bool:
    """Between two syncs the target network's Q-values move with every optimizer step."""
    cc = _c03_controller(bug)
    with torch.no_grad():
        before = cc.target_nn(_RL_BATCH[2]).clone()
    for _ in range(3):
        cc.optimize(_RL_BATCH)
    with torch.no_grad():
        after = cc.target_nn(_RL_BATCH[2])
    return not torch.equal(before, after)


# --------------------------------------------------------------------------------------------- case-04


class _SimCLR(nn.Module):
    """SimCLR: a small CNN backbone and MLP neck; NT-Xent over the 2N views with a precomputed positive index."""

    def __init__(self, bug: bool, temperature: float = 0.1) -> None:
        super().__init__()
        self.bug = bug
        self.t = temperature
        self.backbone = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                      nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.neck = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))

    def buffers_for(self, n: int) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
        mask = 1 - torch.eye(n * 2, dtype=torch.uint8)
        rows = torch.arange(n * 2)
        if self.bug:  # positives assumed interleaved: (0, 1), (2, 3), ...
            cols = 2 * torch.arange(n).unsqueeze(1).repeat(1, 2).view(-1)
        else:  # the views are stacked view-major: the other view of row i is row (i + n) % 2n
            partner = (rows + n) % (2 * n)
            cols = partner - (partner > rows).long()  # its column once the diagonal is removed
        neg_mask = torch.ones((n * 2, n * 2 - 1), dtype=torch.uint8)
        neg_mask[rows, cols] = 0
        return mask, (rows, cols), neg_mask

    def forward(self, img: torch.Tensor) -> torch.Tensor:  # img: (N, 2, C, H, W)
        n = img.size(0)
        x = torch.cat(img.unbind(1), dim=0)  # views 0..N-1, then 0..N-1 again
        z = F.normalize(self.neck(self.backbone(x)), dim=1)
        s = z @ z.t()
        mask, pos_ind, neg_mask = self.buffers_for(n)
        s = torch.masked_select(s, mask == 1).reshape(2 * n, -1)
        positive = s[pos_ind].unsqueeze(1)
        negative = torch.masked_select(s, neg_mask == 1).reshape(2 * n, -1)
        logits = torch.cat([positive, negative], dim=1) / self.t
        return F.cross_entropy(logits, torch.zeros(2 * n, dtype=torch.long))


_VIEWS = torch.rand(6, 1, 3, 8, 8, generator=_gen(401)).repeat(1, 2, 1, 1, 1)
_VIEWS = _VIEWS + 0.05 * torch.randn(_VIEWS.shape, generator=_gen(402))


def _c04_build(bug: bool) -> Case:
    """SimCLR pretraining step on two augmented views per image."""
    torch.manual_seed(0)
    model = _SimCLR(bug).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9, weight_decay=1e-6)
    return model, _sgd_step(model, opt, lambda: model(_VIEWS)), _kw(optimizer=opt, inputs=_VIEWS)


def _c04_proof(bug: bool) -> bool:
    """The entry the loss treats as each view's positive is a view of a different image."""
    model = cast(_SimCLR, _c04_build(bug)[0])
    n = _VIEWS.size(0)
    ids = torch.cat([torch.arange(n), torch.arange(n)])
    rows, cols = model.buffers_for(n)[1]
    full_cols = cols + (cols >= rows).long()  # back to the column of the 2N x 2N similarity matrix
    return not bool((ids[full_cols] == ids[rows]).all())


# --------------------------------------------------------------------------------------------- case-05


def _to_tensor(pic: np.ndarray) -> torch.Tensor:
    """torchvision's ToTensor for a uint8 H x W (x C) array: to C x H x W float, divided by 255."""
    arr = pic[:, :, None] if pic.ndim == 2 else pic
    return torch.from_numpy(arr.transpose(2, 0, 1).copy()).float().div(255)


_SEG_RNG = np.random.default_rng(501)
_SEG_MASKS = _SEG_RNG.integers(0, 3, size=(4, 8, 8), dtype=np.uint8)  # class ids 0, 1, 2
_SEG_IMGS = _SEG_RNG.integers(0, 256, size=(4, 8, 8, 3), dtype=np.uint8)


def _c05_batch(bug: bool) -> tuple[torch.Tensor, torch.Tensor]:
    images = torch.stack([_to_tensor(im) for im in _SEG_IMGS])
    if bug:  # the mask goes through the image transform
        labels = torch.stack([_to_tensor(m).squeeze(0).long() for m in _SEG_MASKS])
    else:
        labels = torch.stack([torch.as_tensor(m, dtype=torch.long) for m in _SEG_MASKS])
    return images, labels


class _TinyFCN(nn.Module):
    def __init__(self, classes: int = 3) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                 nn.Conv2d(16, classes, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _c05_build(bug: bool) -> Case:
    """Semantic segmentation with the label mask converted by ToTensor."""
    torch.manual_seed(0)
    model = _TinyFCN().train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    images, labels = _c05_batch(bug)
    step = _sgd_step(model, opt, lambda: F.cross_entropy(model(images), labels))
    return model, step, _kw(optimizer=opt, inputs=(images, labels))


def _c05_proof(bug: bool) -> bool:
    """The masks hold three classes; the labels reaching the loss hold fewer."""
    _, labels = _c05_batch(bug)
    return len(labels.unique()) < len(np.unique(_SEG_MASKS))


# --------------------------------------------------------------------------------------------- case-06


def _crop(x: torch.Tensor, top: int, left: int, size: int) -> torch.Tensor:
    return x[..., top:top + size, left:left + size]


def _offsets(gen: torch.Generator, free: int) -> tuple[int, int]:
    top, left = torch.randint(0, free + 1, (2,), generator=gen).tolist()
    return top, left


def _c06_pairs(bug: bool, size: int = 12) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Target images with a bright object, its mask, and the object region after the random crop."""
    gen = _gen(601)
    images, masks, objects = [], [], []
    for i in range(4):
        image = 0.1 * torch.rand(3, 16, 16, generator=_gen(610 + i))
        obj = torch.zeros(1, 16, 16)
        obj[:, 3 + i:9 + i, 4:10] = 1.0
        image = image + obj
        mask = obj.clone()
        top, left = _offsets(gen, 16 - size)
        images.append(_crop(image, top, left, size))
        objects.append(_crop(obj, top, left, size))
        if bug:  # the mask gets its own RandomCrop draw
            top, left = _offsets(gen, 16 - size)
        masks.append(_crop(mask, top, left, size))
    return torch.stack(images), torch.stack(masks), torch.stack(objects)


class _Inpainter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(4, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 3, 3, padding=1))

    def forward(self, image: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([image * (1 - mask), mask], dim=1))


def _c06_build(bug: bool) -> Case:
    """Inpainting fine-tune: loss weighted by the target mask, image and mask randomly cropped."""
    torch.manual_seed(0)
    model = _Inpainter().train()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-4, weight_decay=1e-2)
    images, masks, _ = _c06_pairs(bug)

    def loss_fn() -> torch.Tensor:
        pred = model(images, masks)
        return ((pred - images) ** 2 * masks).sum() / masks.sum().clamp_min(1.0) / 3

    return model, _sgd_step(model, opt, loss_fn), _kw(optimizer=opt, inputs=(images, masks))


def _c06_proof(bug: bool) -> bool:
    """The cropped masks do not cover the object they were drawn for in the cropped images."""
    _, masks, objects = _c06_pairs(bug)
    return not torch.equal(masks, objects)


# --------------------------------------------------------------------------------------------- case-07


class _Image2ReverbStandIn(nn.Module):
    """Conditional GAN: the generator maps image features to a spectrogram; the discriminator judges the pair."""

    def __init__(self) -> None:
        super().__init__()
        self.g = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16))
        self.d = nn.Sequential(nn.Linear(16 + 8, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))

    def discriminate(self, spec: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
        return self.d(torch.cat([spec, f], dim=1))


_GAN_F = torch.randn(8, 8, generator=_gen(701))
_GAN_SPEC = torch.randn(8, 16, generator=_gen(702))


def _c07_g_losses(model: _Image2ReverbStandIn, bug: bool) -> tuple[torch.Tensor, torch.Tensor]:
    fake = model.g(_GAN_F)
    d_fake2 = model.discriminate(fake.detach() if bug else fake, _GAN_F)
    g_loss1 = F.mse_loss(d_fake2, torch.ones_like(d_fake2))
    g_loss2 = F.l1_loss(fake, _GAN_SPEC) * 100.0
    return g_loss1, g_loss2


def _c07_build(bug: bool) -> Case:
    """Generator step of the GAN: adversarial term plus L1 reconstruction, discriminator toggled off."""
    torch.manual_seed(0)
    model = _Image2ReverbStandIn().train()
    opt_g = torch.optim.Adam(model.g.parameters(), lr=4e-4, betas=(0.5, 0.999))

    def step() -> torch.Tensor:
        model.d.requires_grad_(False)  # what Lightning's toggle_optimizer does for the generator's optimizer
        opt_g.zero_grad()
        g_loss1, g_loss2 = _c07_g_losses(model, bug)
        loss = g_loss1 + g_loss2
        loss.backward()
        opt_g.step()
        model.d.requires_grad_(True)
        return loss

    return model, step, _kw(optimizer=opt_g, inputs=(_GAN_F, _GAN_SPEC))


def _c07_proof(bug: bool) -> bool:
    """The generator's gradient from the full loss equals the one from the L1 term alone."""
    model = cast(_Image2ReverbStandIn, _c07_build(bug)[0])
    params = list(model.g.parameters())
    g_loss1, g_loss2 = _c07_g_losses(model, bug)
    full = torch.autograd.grad(g_loss1 + g_loss2, params, retain_graph=True)
    l1_only = torch.autograd.grad(g_loss2, params)
    return all(torch.allclose(a, b, atol=1e-7) for a, b in zip(full, l1_only))


# --------------------------------------------------------------------------------------------- case-08

_PAD_INDEX = 0  # the tagger's pad index, also the id of the first tag ("O")


def _bert_tagger() -> Any:
    from transformers import BertConfig, BertForTokenClassification

    cfg = BertConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=32, pad_token_id=0)
    cfg.num_labels = 4
    return BertForTokenClassification(cfg)


def _c08_batch(bug: bool) -> dict[str, torch.Tensor]:
    ids = torch.randint(1, 40, (4, 10), generator=_gen(801))
    tags = torch.randint(0, 4, (4, 10), generator=_gen(802))
    tags[tags == 3] = 0  # most tokens are "O" (tag 0)
    lengths = torch.tensor([10, 8, 7, 5])
    pad = torch.arange(10)[None, :] >= lengths[:, None]
    ids[pad] = 0
    tags[pad] = _PAD_INDEX if bug else -100
    return {"input_ids": ids, "attention_mask": (~pad).long(), "labels": tags}


def _c08_loss(logits: torch.Tensor, labels: torch.Tensor, bug: bool) -> torch.Tensor:
    return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1),
                           ignore_index=_PAD_INDEX if bug else -100)


def _c08_build(bug: bool) -> Case:
    """BERT token tagger trained with cross entropy that ignores the pad index."""
    torch.manual_seed(0)
    model = _bert_tagger().train()
    opt = torch.optim.AdamW(model.parameters(), lr=5e-5)
    batch = _c08_batch(bug)

    def loss_fn() -> torch.Tensor:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        return _c08_loss(logits, batch["labels"], bug)

    return model, _sgd_step(model, opt, loss_fn), _kw(optimizer=opt, inputs=batch)


def _c08_proof(bug: bool) -> bool:
    """Real tokens tagged "O" get no gradient: the loss never teaches tag 0."""
    model, _, _ = _c08_build(bug)
    batch = _c08_batch(bug)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    (grad,) = torch.autograd.grad(_c08_loss(logits, batch["labels"], bug), logits)
    real_o = (batch["attention_mask"] == 1) & (_c08_batch(False)["labels"] == 0)
    return bool(grad[real_o].abs().max() == 0)


# --------------------------------------------------------------------------------------------- case-09


def _seg_net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 5, 1))


_DA_IMGS = torch.rand(2, 3, 8, 8, generator=_gen(901))
_DA_PSEUDO = torch.randint(0, 5, (2, 8, 8), generator=_gen(902))


def _c09_kd(student_out: torch.Tensor, teacher_out: torch.Tensor, bug: bool) -> torch.Tensor:
    student = F.softmax(student_out, dim=1) if bug else F.log_softmax(student_out, dim=1)
    teacher = F.softmax(teacher_out, dim=1)
    loss_kd = F.kl_div(student, teacher, reduction="none")
    mask = (teacher != 250).float()
    return (loss_kd * mask).sum() / mask.sum()


def _c09_build(bug: bool) -> Case:
    """Self-distillation stage: pseudo-label CE plus a KL term to the stage-1 teacher."""
    model = _seg_net(0).train()
    teacher = _seg_net(1).eval()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9, weight_decay=5e-4)

    def loss_fn() -> torch.Tensor:
        out = model(_DA_IMGS)
        with torch.no_grad():
            t_out = teacher(_DA_IMGS)
        return F.cross_entropy(out, _DA_PSEUDO) + 1.0 * _c09_kd(out, t_out, bug)

    return model, _sgd_step(model, opt, loss_fn), _kw(optimizer=opt, inputs=(_DA_IMGS, _DA_PSEUDO))


def _c09_proof(bug: bool) -> bool:
    """A student that already matches the teacher still gets a distillation gradient: the KL is not minimal there."""
    teacher_out = _seg_net(1)(_DA_IMGS).detach()
    student_out = teacher_out.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(_c09_kd(student_out, teacher_out, bug), student_out)
    return float(grad.abs().max()) > 1e-6


# --------------------------------------------------------------------------------------------- case-10


def _cnn(width: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, width, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(),
                         nn.Linear(4 * width, 10))


_CIFAR_X = torch.rand(8, 3, 8, 8, generator=_gen(1001))
_CIFAR_Y = torch.randint(0, 10, (8,), generator=_gen(1002))


def _c10_losses(output: torch.Tensor, large_logits: torch.Tensor, bug: bool,
                temperature: float = 5.0) -> tuple[torch.Tensor, torch.Tensor]:
    soft_targets = F.log_softmax(large_logits / temperature, dim=-1)
    soft_prob = F.log_softmax((large_logits if bug else output) / temperature, dim=-1)
    distill = nn.KLDivLoss(reduction="batchmean", log_target=True)(soft_prob, soft_targets)
    return F.cross_entropy(output, _CIFAR_Y), distill


def _c10_build(bug: bool) -> Case:
    """Knowledge distillation of a small CNN from a large one: hard-label CE plus a soft-target KL."""
    model = _cnn(8, 0).train()
    large = _cnn(32, 1).eval()
    opt = torch.optim.Adam(model.parameters(), lr=2.5e-4)

    def loss_fn() -> torch.Tensor:
        output = model(_CIFAR_X)
        with torch.no_grad():
            large_logits = large(_CIFAR_X)
        ce, distill = _c10_losses(output, large_logits, bug)
        return ce + 0.5 * distill

    return model, _sgd_step(model, opt, loss_fn), _kw(optimizer=opt, inputs=(_CIFAR_X, _CIFAR_Y))


def _c10_proof(bug: bool) -> bool:
    """The student's gradient with the distillation term equals its gradient without it."""
    model = _cnn(8, 0)
    large_logits = _cnn(32, 1)(_CIFAR_X).detach()
    params = list(model.parameters())
    ce, distill = _c10_losses(model(_CIFAR_X), large_logits, bug)
    with_kd = torch.autograd.grad(ce + 0.5 * distill, params, retain_graph=True)
    ce_only = torch.autograd.grad(ce, params)
    return all(torch.allclose(a, b, atol=1e-8) for a, b in zip(with_kd, ce_only))


# --------------------------------------------------------------------------------------------- case-11

_LVU_W = torch.randn(16, generator=_gen(1101))
_LVU_X = torch.randn(512, 16, generator=_gen(1102))
_LVU_Y = (_LVU_X @ _LVU_W > 0).long()
_LVU_VAL_X = torch.randn(1024, 16, generator=_gen(1103))
_LVU_VAL_Y = (_LVU_VAL_X @ _LVU_W > 0).long()


def _c11_setup(bug: bool) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    if bug:  # default mode='min', stepped with the validation accuracy
        sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.2, patience=1)
    else:
        sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="max", factor=0.2, patience=1)
    return model, opt, sched


def _c11_build(bug: bool) -> Case:
    """Classifier trained with ReduceLROnPlateau stepped on validation accuracy each epoch."""
    model, opt, sched = _c11_setup(bug)
    x, y = _LVU_X[:64], _LVU_Y[:64]
    step = _sgd_step(model, opt, lambda: F.cross_entropy(model(x), y))
    return model, step, _kw(optimizer=opt, inputs=(x, y), lr_scheduler=sched)


def _c11_proof(bug: bool) -> bool:
    """Over epochs in which validation accuracy only rises, the scheduler cuts the learning rate."""
    model, opt, sched = _c11_setup(bug)
    accs = []
    for _epoch in range(4):
        for i in range(0, 512, 64):
            opt.zero_grad()
            F.cross_entropy(model(_LVU_X[i:i + 64]), _LVU_Y[i:i + 64]).backward()
            opt.step()
        with torch.no_grad():
            acc = float((model(_LVU_VAL_X).argmax(1) == _LVU_VAL_Y).float().mean())
        accs.append(acc)
        sched.step(acc)
    rising = all(b > a for a, b in zip(accs, accs[1:]))
    return rising and opt.param_groups[0]["lr"] < 1e-3


# --------------------------------------------------------------------------------------------- case-12


class _I3DStandIn(nn.Module):
    """I3D's tail: 3-D conv features, average pool, dropout built from dropout_keep_prob, 1x1x1 conv logits."""

    def __init__(self, bug: bool, num_classes: int = 5, dropout_keep_prob: float = 1.0) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv3d(3, 16, 3, padding=1), nn.BatchNorm3d(16), nn.ReLU())
        self.avg_pool = nn.AdaptiveAvgPool3d(1)
        self.dropout = nn.Dropout(dropout_keep_prob if bug else 1 - dropout_keep_prob)
        self.conv3d_0c_1x1 = nn.Conv3d(16, num_classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.dropout(self.avg_pool(self.features(x)))
        return self.conv3d_0c_1x1(out).flatten(1)


_CLIPS = torch.rand(4, 3, 4, 8, 8, generator=_gen(1201))
_CLIP_Y = torch.tensor([0, 1, 2, 3])


def _c12_build(bug: bool) -> Case:
    """Action classifier trained with dropout constructed from a keep probability of 1.0."""
    torch.manual_seed(0)
    model = _I3DStandIn(bug).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = _sgd_step(model, opt, lambda: F.cross_entropy(model(_CLIPS), _CLIP_Y))
    return model, step, _kw(optimizer=opt, inputs=(_CLIPS, _CLIP_Y))


def _c12_proof(bug: bool) -> bool:
    """After real steps, the training-mode logits are the same for every clip: the features never reach them."""
    model, step, _ = _c12_build(bug)
    for _ in range(3):
        step()
    with torch.no_grad():
        logits = model(_CLIPS)
    return bool(torch.allclose(logits, logits[:1].expand_as(logits)))


# --------------------------------------------------------------------------------------------- case-13


def _llama(seed: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(cfg)


class _LitWrapper(nn.Module):
    """The Lightning module the checkpoint was saved from: the LM lives under ``self.model``."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.model = inner


def _c13_checkpoint() -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in _LitWrapper(_llama(1)).state_dict().items()}


_LM_IDS = torch.randint(3, 40, (4, 12), generator=_gen(1301))


def _c13_model(bug: bool) -> Any:
    model = _llama(0)
    state = _c13_checkpoint()
    if not bug:
        state = {k.removeprefix("model."): v for k, v in state.items()}
    model.load_state_dict(state, strict=False)
    return model


def _c13_build(bug: bool) -> Case:
    """Fine-tuning a causal LM from a checkpoint loaded with strict=False."""
    model = _c13_model(bug).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = {"input_ids": _LM_IDS, "attention_mask": torch.ones_like(_LM_IDS), "labels": _LM_IDS}
    return model, _sgd_step(model, opt, lambda: model(**batch).loss), _kw(optimizer=opt, inputs=batch)


def _c13_proof(bug: bool) -> bool:
    """The weights fine-tuning starts from are not the checkpoint's."""
    model = _c13_model(bug)
    ckpt = {k.removeprefix("model."): v for k, v in _c13_checkpoint().items()}
    return not all(torch.equal(v, ckpt[k]) for k, v in model.state_dict().items())


# --------------------------------------------------------------------------------------------- case-14


class _CLIPStandIn(nn.Module):
    """M3D-style CLIP: a ViT image tower and a BERT text tower, linear projections, a learnable logit scale."""

    def __init__(self, bug: bool) -> None:
        super().__init__()
        from transformers import BertConfig, BertModel, ViTConfig, ViTModel

        self.bug = bug
        self.vision = ViTModel(ViTConfig(image_size=16, patch_size=8, num_channels=1, hidden_size=32,
                                         num_hidden_layers=1, num_attention_heads=2, intermediate_size=64),
                               add_pooling_layer=False)
        self.text = BertModel(BertConfig(vocab_size=40, hidden_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, intermediate_size=64,
                                         max_position_embeddings=32), add_pooling_layer=False)
        self.mm_vision_proj = nn.Linear(32, 16)
        self.mm_language_proj = nn.Linear(32, 16)
        self.logit_scale = nn.Parameter(torch.ones([]) * np.log(1 / 0.07))

    def features(self, images: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        img = self.mm_vision_proj(self.vision(pixel_values=images).last_hidden_state[:, 0])
        txt = self.mm_language_proj(self.text(input_ids=ids).last_hidden_state[:, 0])
        return F.normalize(img, dim=-1), F.normalize(txt, dim=-1)

    def forward(self, images: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        img, txt = self.features(images, ids)
        scale = self.logit_scale if self.bug else self.logit_scale.exp()
        logits_per_image = scale * img @ txt.T
        labels = torch.arange(len(images))
        return (F.cross_entropy(logits_per_image, labels) + F.cross_entropy(logits_per_image.T, labels)) / 2


_SCANS = torch.rand(4, 1, 16, 16, generator=_gen(1401))
_REPORTS = torch.randint(1, 40, (4, 8), generator=_gen(1402))


def _c14_build(bug: bool) -> Case:
    """Image-text contrastive pretraining step."""
    torch.manual_seed(0)
    model = _CLIPStandIn(bug).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step = _sgd_step(model, opt, lambda: model(_SCANS, _REPORTS))
    return model, step, _kw(optimizer=opt, inputs=(_SCANS, _REPORTS))


def _c14_proof(bug: bool) -> bool:
    """The loss equals the contrastive loss at temperature log(1/0.07)^-1, not the intended 0.07."""
    model = cast(_CLIPStandIn, _c14_build(bug)[0]).eval()
    with torch.no_grad():
        img, txt = model.features(_SCANS, _REPORTS)
        labels = torch.arange(4)
        sims = img @ txt.T / 0.07
        intended = (F.cross_entropy(sims, labels) + F.cross_entropy(sims.T, labels)) / 2
        used = model(_SCANS, _REPORTS)
    return not torch.isclose(used, intended, rtol=1e-4)


# --------------------------------------------------------------------------------------------- case-15


_DIALOGUES = [
    [torch.randint(3, 30, (n1,), generator=_gen(1500 + i)),
     torch.randint(3, 30, (n2,), generator=_gen(1520 + i)),
     torch.randint(3, 30, (n3,), generator=_gen(1540 + i))]
    for i, (n1, n2, n3) in enumerate([(3, 6, 4), (7, 2, 5), (5, 4, 7), (4, 7, 2)])
]


def _pad(seqs: list[torch.Tensor]) -> torch.Tensor:
    return nn.utils.rnn.pad_sequence(seqs, batch_first=True)


def _longest_first(slot: int) -> list[int]:
    return sorted(range(len(_DIALOGUES)), key=lambda i: -len(_DIALOGUES[i][slot]))


def _c15_collate(bug: bool) -> tuple[list[torch.Tensor], list[torch.Tensor], list[list[int]]]:
    """HRED collate: each utterance slot padded; the batch sorted by length for pack_padded_sequence."""
    slots, lengths, owners = [], [], []
    order = _longest_first(0)
    for k in range(3):
        if bug:  # every slot sorted by its own lengths
            order = _longest_first(k)
        seqs = [_DIALOGUES[i][k] for i in order]
        slots.append(_pad(seqs))
        lengths.append(torch.tensor([len(s) for s in seqs]))
        owners.append(list(order))
    return slots, lengths, owners


class _HRED(nn.Module):
    """Hierarchical encoder-decoder: utterance GRU, context GRU over u1 and u2, decoder GRU generating u3."""

    def __init__(self, vocab: int = 30, d: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d, padding_idx=0)
        self.utt = nn.GRU(d, d, batch_first=True)
        self.ctx = nn.GRU(d, d, batch_first=True)
        self.dec = nn.GRU(d, d, batch_first=True)
        self.out = nn.Linear(d, vocab)

    def encode(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = nn.utils.rnn.pack_padded_sequence(self.emb(x), lengths, batch_first=True, enforce_sorted=False)
        return self.utt(packed)[1][0]

    def forward(self, slots: list[torch.Tensor], lengths: list[torch.Tensor]) -> torch.Tensor:
        u = torch.stack([self.encode(slots[0], lengths[0]), self.encode(slots[1], lengths[1])], dim=1)
        ctx = self.ctx(u)[1]
        tgt = slots[2]
        dec_in = F.pad(tgt[:, :-1], (1, 0), value=1)  # start token 1
        h, _ = self.dec(self.emb(dec_in), ctx)
        logits = self.out(h)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), tgt.reshape(-1), ignore_index=0)


def _c15_build(bug: bool) -> Case:
    """HRED trained on (u1, u2) -> u3 batches built by the collate function."""
    torch.manual_seed(0)
    model = _HRED().train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    slots, lengths, _ = _c15_collate(bug)
    step = _sgd_step(model, opt, lambda: model(slots, lengths))
    return model, step, _kw(optimizer=opt, inputs=(slots, lengths))


def _c15_proof(bug: bool) -> bool:
    """Row r of the context and row r of the response come from different dialogues."""
    _, _, owners = _c15_collate(bug)
    return not (owners[0] == owners[1] == owners[2])


CASES: list[BlindCase] = [
    BlindCase("b6-case-01", "https://github.com/pytorch/tutorials/issues/2478", "masks",
              "the language model's TransformerEncoder is called without a causal src_mask: each position sees "
              "the tokens it must predict", _c01_build, _c01_proof),
    BlindCase("b6-case-02", "https://github.com/zalandoresearch/pytorch-vq-vae/issues/2", "architecture / modules",
              "nn.ModuleList([Residual(...)] * n) holds n references to one layer: the residual stack shares "
              "its weights", _c02_build, _c02_proof),
    BlindCase("b6-case-03", "https://github.com/andri27-ts/Reinforcement-Learning/issues/14", "target network",
              "update_target copies the weights, then rebinds target_nn to moving_nn: the Bellman targets move "
              "with every step", _c03_build, _c03_proof,
              known_miss="held-out batch 6: the target network is the online network itself: no invariant compares a Bellman target's source with the trained model"),
    BlindCase("b6-case-04", "https://github.com/open-mmlab/mmselfsup/issues/159", "contrastive",
              "the views are stacked view-major but the positive index assumes interleaved pairs: SimCLR's "
              "positives are other images", _c04_build, _c04_proof,
              known_miss="held-out batch 6: the positive pairs' index is a layout convention of the batch; no invariant knows which rows are two views of one image"),
    BlindCase("b6-case-05", "https://github.com/pytorch/vision/issues/2497", "data / labels",
              "ToTensor on the class-id mask divides it by 255: after .long() every pixel's label is 0",
              _c05_build, _c05_proof),
    BlindCase("b6-case-06", "https://github.com/thuanz123/realfill/issues/4", "data / augmentation",
              "the target image and its mask get separate RandomCrop draws: the loss weighting is misaligned "
              "with the image", _c06_build, _c06_proof,
              known_miss="held-out batch 6: the misaligned crop is a data-pipeline draw; one step cannot tell an aligned weighting from a misaligned one"),
    BlindCase("b6-case-07", "https://github.com/nikhilsinghmus/image2reverb/issues/37", "GAN / gradient flow",
              "the generator step feeds fake.detach() to the discriminator: the adversarial term gives the "
              "generator no gradient", _c07_build, _c07_proof),
    BlindCase("b6-case-08", "https://github.com/nyu-mll/jiant/issues/925", "losses / ignore_index",
              "the tagger's cross entropy ignores the pad index 0, which is also the id of a real tag: that tag "
              "is never trained", _c08_build, _c08_proof),
    BlindCase("b6-case-09", "https://github.com/microsoft/ProDA/issues/20", "distillation loss",
              "F.kl_div gets the student's softmax instead of its log_softmax: the distillation term is not a KL "
              "divergence", _c09_build, _c09_proof),
    BlindCase("b6-case-10", "https://github.com/labmlai/annotated_deep_learning_paper_implementations/issues/66",
              "distillation loss", "both sides of the distillation KL are computed from the teacher's logits: "
              "the student gets no distillation signal", _c10_build, _c10_proof),
    BlindCase("b6-case-11", "https://github.com/md-mohaiminul/ViS4mer/issues/4", "lr schedule",
              "ReduceLROnPlateau at its default mode='min' is stepped with validation accuracy: the lr is cut "
              "while accuracy improves", _c11_build, _c11_proof,
              known_miss="held-out batch 6: ReduceLROnPlateau is stepped outside the step with a metric; its mode against the metric's direction is not judged"),
    BlindCase("b6-case-12", "https://github.com/hassony2/kinetics_i3d_pytorch/issues/6", "dropout",
              "nn.Dropout is given the keep probability 1.0 as p: in training every feature reaching the logits "
              "is zeroed", _c12_build, _c12_proof),
    BlindCase("b6-case-13", "https://github.com/pytorch/examples/issues/1029", "checkpoint loading",
              "a checkpoint whose keys carry a 'model.' prefix is loaded with strict=False: nothing loads and "
              "fine-tuning starts from random weights", _c13_build, _c13_proof,
              known_miss="held-out batch 6: a checkpoint loaded with strict=False happens before the audit; the audit sees randomly initialised weights as a fresh model"),
    BlindCase("b6-case-14", "https://github.com/BAAI-DCAI/M3D/issues/52", "contrastive",
              "the CLIP logits are scaled by logit_scale instead of logit_scale.exp(): the contrastive "
              "temperature is 1/2.66, not 0.07", _c14_build, _c14_proof,
              known_miss="held-out batch 6: the temperature is a learned scalar; logit_scale vs logit_scale.exp() is not judged"),
    BlindCase("b6-case-15", "https://github.com/hsgodhia/hred/issues/2", "data / batching",
              "the collate function sorts each utterance slot by its own lengths: contexts and responses in a "
              "row come from different dialogues", _c15_build, _c15_proof,
              known_miss="held-out batch 6: the per-slot sort mismatches rows across tensors; no invariant checks that a row's context and response belong together"),
]
