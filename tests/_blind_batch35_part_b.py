"""Blind batch 35 (part b): silent vision, audio and multimodal training bugs from public GitHub threads, each with its fixed twin.

Collected by someone who does not write the audit's checks. Every case builds the user's setup on a tiny model (an
EDSR super-resolution net, a CLIP model from a tiny transformers config with an A-CLIP SimCLR head, a SoundStream-style
audio codec with its discriminator, a DINO student/teacher pair, a Faster R-CNN style box head; nothing is downloaded)
and proves the bug without the audit on real tensors and real steps.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw

# --------------------------------------------------------------------------------------------- case-01
# sanghyun-son/EDSR-PyTorch issue #80: EDSR's MeanShift layer (a fixed 1x1 conv that subtracts / adds the dataset RGB
# mean) is "frozen" with `self.requires_grad = False`. That only sets a plain attribute on the nn.Module; its weight and
# bias Parameters keep requires_grad=True, so make_optimizer's `filter(lambda x: x.requires_grad, ...)` hands them to
# Adam and the mean-shift layers are learned along with the network. The L1 loss falls as usual, so nothing looks wrong;
# the reporter found the sub_mean/add_mean weights changed after training. Fix (maintainer, in the thread): freeze the
# parameters themselves, `for p in self.parameters(): p.requires_grad = False`.

_C01_LR = torch.rand(2, 3, 8, 8, generator=_gen(3501))
_C01_HR = F.interpolate(_C01_LR, scale_factor=2, mode="bilinear", align_corners=False) \
    + 0.05 * torch.randn(2, 3, 16, 16, generator=_gen(3502))


class _MeanShift(nn.Conv2d):
    def __init__(self, rgb_range: float, sign: int, fixed: bool,
                 rgb_mean=(0.4488, 0.4371, 0.4040), rgb_std=(1.0, 1.0, 1.0)):
        super().__init__(3, 3, kernel_size=1)
        std = torch.tensor(rgb_std)
        self.weight.data = torch.eye(3).view(3, 3, 1, 1) / std.view(3, 1, 1, 1)
        self.bias.data = sign * rgb_range * torch.tensor(rgb_mean) / std
        if fixed:
            for p in self.parameters():
                p.requires_grad = False
        else:
            self.requires_grad = False  # the bug: an attribute on the module, not on its parameters


class _ResBlock(nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(n, n, 3, padding=1), nn.ReLU(True), nn.Conv2d(n, n, 3, padding=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x) * 0.1


class _EDSR(nn.Module):
    def __init__(self, bug: bool, n_feats: int = 16, scale: int = 2, rgb_range: float = 1.0):
        super().__init__()
        self.sub_mean = _MeanShift(rgb_range, -1, fixed=not bug)
        self.add_mean = _MeanShift(rgb_range, 1, fixed=not bug)
        self.head = nn.Conv2d(3, n_feats, 3, padding=1)
        self.body = nn.Sequential(_ResBlock(n_feats), nn.Conv2d(n_feats, n_feats, 3, padding=1))
        self.tail = nn.Sequential(nn.Conv2d(n_feats, n_feats * scale * scale, 3, padding=1), nn.PixelShuffle(scale),
                                  nn.Conv2d(n_feats, 3, 3, padding=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.head(self.sub_mean(x))
        x = x + self.body(x)
        return self.add_mean(self.tail(x))


def _c01_setup(bug: bool):
    torch.manual_seed(0)
    model = _EDSR(bug).train()
    trainable = filter(lambda p: p.requires_grad, model.parameters())  # EDSR utility.make_optimizer
    opt = torch.optim.Adam(trainable, lr=1e-3, betas=(0.9, 0.999), eps=1e-8)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[200], gamma=0.5)

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = F.l1_loss(model(_C01_LR), _C01_HR)
        loss.backward()
        opt.step()
        sched.step()
        return loss

    return model, opt, sched, step


def _c01_build(bug: bool) -> Case:
    model, opt, sched, step = _c01_setup(bug)
    return model, step, _kw(optimizer=opt, inputs=_C01_LR, lr_scheduler=sched)


def _c01_proof(bug: bool) -> bool:
    """After two training steps, has the mean-shift layer (meant to be a fixed transform) moved?"""
    model, _, _, step = _c01_setup(bug)
    w0 = model.sub_mean.weight.detach().clone()
    b0 = model.add_mean.bias.detach().clone()
    step()
    step()
    moved_w = (model.sub_mean.weight.detach() - w0).abs().max()
    moved_b = (model.add_mean.bias.detach() - b0).abs().max()
    return bool(max(moved_w, moved_b) > 1e-6)


# --------------------------------------------------------------------------------------------- case-02
# microsoft/A-CLIP pull request #4: A-CLIP adds a SimCLR loss between the self-supervised embeddings of two augmented
# views to the CLIP image-text loss. ACLIPLoss builds the SimCLR inputs as `aug1_embed = image_ssl_embed[:bs]` and
# `aug2_embed = image_ssl_embed[:bs]`: both "views" are the first view, so every positive pair is an embedding with
# itself. The SimCLR term is trivially satisfied (it only pushes the first-view embeddings apart from each other) and
# the second view's SSL embedding gets no gradient from it; the total loss still falls because the CLIP terms train
# normally. Fix in the PR: `aug2_embed = image_ssl_embed[bs:]`. (The reproduction keeps A-CLIP's two CLIP terms and the
# SimCLR term on a tiny transformers CLIP model and leaves out its BYOL term.)

_C02_B = 4
_C02_IMG = torch.rand(_C02_B, 3, 16, 16, generator=_gen(3511))
_C02_VIEW1 = _C02_IMG + 0.1 * torch.randn(_C02_B, 3, 16, 16, generator=_gen(3512))
_C02_VIEW2 = torch.flip(_C02_IMG, dims=[3]) + 0.1 * torch.randn(_C02_B, 3, 16, 16, generator=_gen(3513))
_C02_IDS = torch.randint(3, 60, (_C02_B, 8), generator=_gen(3514))
_C02_IDS[:, 0] = 1
_C02_IDS[:, -1] = 2


class _SIMCLRLoss(nn.Module):
    """A-CLIP's SIMCLRLoss on one process (rank 0, world size 1)."""

    def __init__(self, temperature: float = 0.1):
        super().__init__()
        self.tau = temperature

    def forward(self, q_a: torch.Tensor, q_b: torch.Tensor) -> torch.Tensor:
        q_a = F.normalize(q_a, dim=-1, p=2)
        q_b = F.normalize(q_b, dim=-1, p=2)
        n = q_a.size(0)
        labels = torch.arange(n)
        masks = F.one_hot(labels, n) * 1e9
        logits_aa = q_a @ q_a.t() / self.tau - masks
        logits_bb = q_b @ q_b.t() / self.tau - masks
        logits_ab = q_a @ q_b.t() / self.tau
        logits_ba = q_b @ q_a.t() / self.tau
        loss_a = F.cross_entropy(torch.cat([logits_ab, logits_aa], dim=1), labels)
        loss_b = F.cross_entropy(torch.cat([logits_ba, logits_bb], dim=1), labels)
        return (loss_a + loss_b) / 2


class _ACLIP(nn.Module):
    def __init__(self):
        super().__init__()
        from transformers import CLIPConfig, CLIPModel

        cfg = CLIPConfig(
            text_config=dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=2, max_position_embeddings=16, pad_token_id=0, bos_token_id=1,
                             eos_token_id=2),
            vision_config=dict(image_size=16, patch_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=2, num_channels=3),
            projection_dim=16)
        self.clip = CLIPModel(cfg)
        self.image_mlp = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))  # SLIP's SSL projection

    def forward(self, views: torch.Tensor, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        pooled = self.clip.vision_model(pixel_values=views).pooler_output
        text = self.clip.text_model(input_ids=input_ids).pooler_output
        return {"image_embed": self.clip.visual_projection(pooled), "text_embed": self.clip.text_projection(text),
                "image_ssl_embed": self.image_mlp(pooled), "logit_scale": self.clip.logit_scale.exp()}


def _c02_loss(out: dict[str, torch.Tensor], bug: bool, simclr: _SIMCLRLoss) -> tuple[torch.Tensor, torch.Tensor]:
    text_embed = out["text_embed"]
    bs = text_embed.shape[0]
    ssl = out["image_ssl_embed"]
    aug1, aug2 = ssl[:bs], (ssl[:bs] if bug else ssl[bs:])
    simclr_loss = simclr(aug1, aug2)
    labels = torch.arange(bs)
    image_embed = F.normalize(out["image_embed"], dim=-1, p=2)
    text_embed = F.normalize(text_embed, dim=-1, p=2)
    scale = out["logit_scale"]
    contra = []
    for img in (image_embed[:bs], image_embed[bs:]):
        contra.append((F.cross_entropy(scale * img @ text_embed.t(), labels)
                       + F.cross_entropy(scale * text_embed @ img.t(), labels)) / 2)
    return 0.5 * contra[0] + 0.5 * contra[1] + simclr_loss, simclr_loss


def _c02_setup(bug: bool):
    torch.manual_seed(0)
    model = _ACLIP().train()
    simclr = _SIMCLRLoss(temperature=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-4, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.1)
    views = torch.cat([_C02_VIEW1, _C02_VIEW2], dim=0)
    inputs = {"views": views, "input_ids": _C02_IDS}

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss, _ = _c02_loss(model(**inputs), bug, simclr)
        loss.backward()
        opt.step()
        return loss

    return model, opt, simclr, inputs, step


def _c02_build(bug: bool) -> Case:
    model, opt, _, inputs, step = _c02_setup(bug)
    return model, step, _kw(optimizer=opt, inputs=inputs)


def _c02_proof(bug: bool) -> bool:
    """Does the SimCLR term give the second augmented view's SSL embedding no gradient at all?"""
    model, _, simclr, inputs, step = _c02_setup(bug)
    step()
    out = model(**inputs)
    ssl = out["image_ssl_embed"]
    _, simclr_loss = _c02_loss(out, bug, simclr)
    (grad,) = torch.autograd.grad(simclr_loss, ssl)
    return bool(grad[_C02_B:].abs().max() == 0)


# --------------------------------------------------------------------------------------------- case-03
# lucidrains/audiolm-pytorch issue #48: SoundStreamTrainer.train_step first updates the codec (generator), whose loss
# includes the adversarial term through the discriminator, so backward also leaves gradients on the discriminator.
# The generator optimizer only zeroes the generator's parameters; the discriminator optimizer's zero_grad ran after its
# own step. So the discriminator's backward adds onto the generator-loss gradients and the discriminator steps on a
# mixture of its own objective and the generator's (opposite-signed) one. Nothing crashes and the losses move; the
# discriminator just learns the wrong thing. Fix in commit 5058cc4 (closing the issue): call
# `self.discr_optim.zero_grad()` before the discriminator's backward instead of after its step.

_C03_WAVE = torch.sin(torch.linspace(0, 40, 256)).repeat(2, 1, 1) \
    + 0.1 * torch.randn(2, 1, 256, generator=_gen(3521))


def _hinge_discr_loss(fake: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    return (F.relu(1 + fake) + F.relu(1 - real)).mean()


def _hinge_gen_loss(fake: torch.Tensor) -> torch.Tensor:
    return -fake.mean()


class _SoundStream(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Conv1d(1, 8, 7, padding=3), nn.ELU(), nn.Conv1d(8, 16, 4, stride=2, padding=1),
                                     nn.ELU(), nn.Conv1d(16, 16, 3, padding=1))
        self.decoder = nn.Sequential(nn.ConvTranspose1d(16, 8, 4, stride=2, padding=1), nn.ELU(),
                                     nn.Conv1d(8, 1, 7, padding=3))
        self.stft_discriminator = nn.Sequential(nn.Conv2d(2, 8, 3, padding=1), nn.LeakyReLU(0.1),
                                                nn.Conv2d(8, 1, 3, padding=1))

    def non_discr_parameters(self):
        return [*self.encoder.parameters(), *self.decoder.parameters()]

    def _stft_logits(self, wave: torch.Tensor) -> torch.Tensor:
        spec = torch.stft(wave.squeeze(1), n_fft=32, hop_length=8, window=torch.hann_window(32), return_complex=True)
        return self.stft_discriminator(torch.view_as_real(spec).permute(0, 3, 1, 2))

    def forward(self, wave: torch.Tensor, return_discr_loss: bool = False) -> torch.Tensor:
        recon = self.decoder(self.encoder(wave))
        if return_discr_loss:
            return _hinge_discr_loss(self._stft_logits(recon.detach()), self._stft_logits(wave))
        recon_loss = F.mse_loss(recon, wave)
        return recon_loss + _hinge_gen_loss(self._stft_logits(recon))


def _c03_setup(bug: bool):
    torch.manual_seed(0)
    model = _SoundStream().train()
    optim = torch.optim.Adam(model.non_discr_parameters(), lr=2e-4, betas=(0.5, 0.9))
    discr_optim = torch.optim.Adam(model.stft_discriminator.parameters(), lr=2e-4, betas=(0.5, 0.9))
    seen: dict[str, list[torch.Tensor]] = {}

    def _record(opt, args, kwargs):  # the gradients the discriminator step is about to apply, and the state it is at
        seen["grads"] = [p.grad.detach().clone() for p in model.stft_discriminator.parameters()]
        seen["state"] = copy.deepcopy(model.state_dict())

    discr_optim.register_step_pre_hook(_record)

    def step() -> torch.Tensor:
        # update vae (generator)
        loss = model(_C03_WAVE)
        loss.backward()
        optim.step()
        optim.zero_grad()
        # update discriminator
        if not bug:
            discr_optim.zero_grad()
        discr_loss = model(_C03_WAVE, return_discr_loss=True)
        discr_loss.backward()
        discr_optim.step()
        if bug:
            discr_optim.zero_grad()
        return loss

    return model, optim, discr_optim, seen, step


def _c03_build(bug: bool) -> Case:
    model, optim, _, _, step = _c03_setup(bug)
    return model, step, _kw(optimizer=optim, inputs=_C03_WAVE)


def _c03_proof(bug: bool) -> bool:
    """Do the gradients the discriminator steps on differ from the gradient of the discriminator loss alone?"""
    model, _, _, seen, step = _c03_setup(bug)
    step()
    probe = _SoundStream()
    probe.load_state_dict(seen["state"])  # generator already updated, discriminator not yet stepped
    clean = torch.autograd.grad(probe(_C03_WAVE, return_discr_loss=True), list(probe.stft_discriminator.parameters()))
    return bool(max((a - b).abs().max() for a, b in zip(seen["grads"], clean)) > 1e-6)


# --------------------------------------------------------------------------------------------- case-04
# lightly-ai/lightly-train issue #968: with gradient accumulation, DINO's training_step runs once per micro-batch and
# every call does the teacher EMA update (`update_momentum(student, teacher, m)`) and the DINO loss's center EMA. With
# four micro-batches per optimizer step, the teacher moves four times toward a student that has not changed, and later
# micro-batches of the same effective batch see a different teacher and center than earlier ones; the effective
# momentum silently depends on the accumulation setting. Training runs and the loss falls. Fix (PR #969, "update
# teacher and center once per accumulation window"): update the teacher once at the start of each window, keep teacher
# and center fixed across its micro-batches, and commit the center from the whole window at the optimizer boundary.

_C04_ACCUM = 4
_C04_X = torch.randn(_C04_ACCUM, 2, 2, 24, generator=_gen(3531))  # micro-batch, two views, batch of 2, features


class _DINOHead(nn.Module):
    def __init__(self, dim: int = 24, out_dim: int = 32):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(dim, 32), nn.GELU(), nn.Linear(32, 32))
        self.head = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))


class _DINO(nn.Module):
    def __init__(self):
        super().__init__()
        self.student = _DINOHead()
        self.teacher = copy.deepcopy(self.student)
        self.teacher.requires_grad_(False)
        self.register_buffer("center", torch.zeros(1, 32))


@torch.no_grad()
def _update_momentum(student: nn.Module, teacher: nn.Module, m: float) -> None:
    for ps, pt in zip(student.parameters(), teacher.parameters()):
        pt.data = pt.data * m + ps.data * (1.0 - m)


def _dino_loss(student_out: torch.Tensor, teacher_out: torch.Tensor, center: torch.Tensor) -> torch.Tensor:
    t = F.softmax((teacher_out - center) / 0.04, dim=-1)
    s = F.log_softmax(student_out / 0.1, dim=-1)
    # views: teacher view v against student view 1 - v
    n = student_out.shape[0] // 2
    return (-(t[:n] * s[n:]).sum(-1).mean() - (t[n:] * s[:n]).sum(-1).mean()) / 2


def _c04_setup(bug: bool):
    torch.manual_seed(0)
    model = _DINO().train()
    opt = torch.optim.AdamW(model.student.parameters(), lr=5e-3, weight_decay=0.04)
    momentum, center_momentum = 0.9, 0.9
    teacher_seen: list[torch.Tensor] = []

    def _teacher_vec() -> torch.Tensor:
        return torch.cat([p.detach().flatten() for p in model.teacher.parameters()]).clone()

    def step() -> torch.Tensor:
        teacher_seen.clear()
        opt.zero_grad()
        total = torch.zeros(())
        window_outs = []
        for i in range(_C04_ACCUM):
            if bug or i == 0:
                _update_momentum(model.student, model.teacher, momentum)
            x = _C04_X[i].reshape(-1, 24)
            with torch.no_grad():
                teacher_out = model.teacher(x)
            teacher_seen.append(torch.cat([_teacher_vec(), model.center.flatten().clone()]))
            loss = _dino_loss(model.student(x), teacher_out, model.center)
            with torch.no_grad():
                if bug:  # DINOLoss.forward's center EMA on every call
                    model.center.mul_(center_momentum).add_(teacher_out.mean(0, keepdim=True) * (1 - center_momentum))
                else:
                    window_outs.append(teacher_out)
            (loss / _C04_ACCUM).backward()
            total = total + loss.detach() / _C04_ACCUM
        opt.step()
        if not bug:
            with torch.no_grad():
                batch_center = torch.cat(window_outs).mean(0, keepdim=True)
                model.center.mul_(center_momentum).add_(batch_center * (1 - center_momentum))
        return total

    return model, opt, teacher_seen, step


def _c04_build(bug: bool) -> Case:
    model, opt, _, step = _c04_setup(bug)
    return model, step, _kw(optimizer=opt, inputs=_C04_X[0].reshape(-1, 24))


def _c04_proof(bug: bool) -> bool:
    """Within one optimizer step, do the micro-batches see different teacher weights or centers?"""
    model, _, teacher_seen, step = _c04_setup(bug)
    step()  # the teacher starts as a copy of the student; after one step they differ
    step()
    first = teacher_seen[0]
    return bool(max((v - first).abs().max() for v in teacher_seen[1:]) > 1e-7)


# --------------------------------------------------------------------------------------------- case-05
# microsoft/computervision-recipes pull request #315: the detection dataset built its label list as
# `labels = ["__background__"] + <every box's label name>` and then `self.labels = list(set(labels))`, and gave each box
# `label_idx = self.labels.index(name)`. set() does not keep order, so "__background__" is not index 0 and one real
# class (the one set() put first) gets label 0, which torchvision's Faster R-CNN treats as background: its boxes are
# trained as background and never get a box-regression target, so that class is never detected while the loss falls
# and the other classes look fine. Fix in the PR: no background entry in the list, `label_idx = index + 1`, and the
# model built with `len(labels) + 1` classes. (set() order depends on the string hash seed; the bug side pins one order
# a run gave so the reproduction is deterministic.)

_C05_NAMES = ["carton", "milk_bottle", "can", "water_bottle"]
_C05_SET_ORDER = ["carton", "__background__", "milk_bottle", "water_bottle", "can"]  # list(set(labels)) in one run
_C05_IMAGES = torch.rand(2, 3, 32, 32, generator=_gen(3541))
_C05_ANNOS = [  # (x1, y1, x2, y2, name) in pixels, per image
    [(2.0, 3.0, 14.0, 16.0, "carton"), (17.0, 4.0, 30.0, 15.0, "milk_bottle")],
    [(3.0, 17.0, 15.0, 30.0, "can"), (16.0, 16.0, 29.0, 31.0, "water_bottle")],
]


def _c05_dataset(bug: bool) -> tuple[list[str], list[dict[str, torch.Tensor]]]:
    labels = ["__background__"] + [n for annos in _C05_ANNOS for *_, n in annos] if bug \
        else [n for annos in _C05_ANNOS for *_, n in annos]
    labels = sorted(set(labels), key=_C05_SET_ORDER.index)
    offset = 0 if bug else 1
    targets = []
    for annos in _C05_ANNOS:
        boxes = torch.tensor([a[:4] for a in annos])
        idx = torch.tensor([labels.index(a[4]) + offset for a in annos])
        targets.append({"boxes": boxes, "labels": idx})
    return labels, targets


def _box_iou(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    lt = torch.max(a[:, None, :2], b[None, :, :2])
    rb = torch.min(a[:, None, 2:], b[None, :, 2:])
    inter = (rb - lt).clamp(min=0).prod(-1)
    area = lambda x: (x[:, 2] - x[:, 0]) * (x[:, 3] - x[:, 1])  # noqa: E731
    return inter / (area(a)[:, None] + area(b)[None, :] - inter)


def _encode(ref: torch.Tensor, prop: torch.Tensor, w=(10.0, 10.0, 5.0, 5.0)) -> torch.Tensor:
    pw, ph = prop[:, 2] - prop[:, 0], prop[:, 3] - prop[:, 1]
    px, py = prop[:, 0] + 0.5 * pw, prop[:, 1] + 0.5 * ph
    gw, gh = ref[:, 2] - ref[:, 0], ref[:, 3] - ref[:, 1]
    gx, gy = ref[:, 0] + 0.5 * gw, ref[:, 1] + 0.5 * gh
    return torch.stack([w[0] * (gx - px) / pw, w[1] * (gy - py) / ph, w[2] * torch.log(gw / pw),
                        w[3] * torch.log(gh / ph)], dim=1)


class _TinyFasterRCNN(nn.Module):
    """A Faster R-CNN box head on fixed proposals, with torchvision's roi_heads sampling and fastrcnn_loss."""

    def __init__(self, num_classes: int):
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 16, 3, padding=1),
                                      nn.ReLU())
        self.box_head = nn.Sequential(nn.Flatten(), nn.Linear(16 * 4 * 4, 32), nn.ReLU())
        self.cls_score = nn.Linear(32, num_classes)  # FastRCNNPredictor
        self.bbox_pred = nn.Linear(32, num_classes * 4)

    @staticmethod
    def proposals(gt: torch.Tensor) -> torch.Tensor:
        jitter = torch.tensor([[0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0], [-1.0, 0.0, 0.0, 1.0]])
        near = (gt[:, None, :] + jitter[None]).reshape(-1, 4)
        far = torch.tensor([[0.0, 0.0, 6.0, 6.0], [24.0, 0.0, 31.0, 3.0], [0.0, 26.0, 4.0, 31.0]])
        return torch.cat([near, far])

    def forward(self, images: torch.Tensor, targets: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        feats = self.backbone(images)
        rois, labels, reg = [], [], []
        for i, t in enumerate(targets):
            props = self.proposals(t["boxes"])
            iou = _box_iou(props, t["boxes"])
            best, gt_idx = iou.max(dim=1)
            lab = t["labels"][gt_idx].clone()
            lab[best < 0.5] = 0  # background
            reg.append(_encode(t["boxes"][gt_idx], props))
            labels.append(lab)
            for b in props:
                x1, y1 = int(b[0].clamp(0, 31)), int(b[1].clamp(0, 31))
                x2, y2 = max(int(b[2].clamp(0, 32)), x1 + 1), max(int(b[3].clamp(0, 32)), y1 + 1)
                rois.append(F.adaptive_avg_pool2d(feats[i:i + 1, :, y1:y2, x1:x2], 4))
        x = self.box_head(torch.cat(rois))
        class_logits, box_regression = self.cls_score(x), self.bbox_pred(x)
        labels_t, reg_t = torch.cat(labels), torch.cat(reg)
        # torchvision.models.detection.roi_heads.fastrcnn_loss
        classification_loss = F.cross_entropy(class_logits, labels_t)
        pos = torch.where(labels_t > 0)[0]
        box_regression = box_regression.reshape(labels_t.shape[0], -1, 4)
        box_loss = F.smooth_l1_loss(box_regression[pos, labels_t[pos]], reg_t[pos], beta=1 / 9,
                                    reduction="sum") / labels_t.numel()
        return {"loss_classifier": classification_loss, "loss_box_reg": box_loss}


def _c05_setup(bug: bool):
    torch.manual_seed(0)
    labels, targets = _c05_dataset(bug)
    model = _TinyFasterRCNN(len(labels) if bug else len(labels) + 1).train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.005, momentum=0.9, weight_decay=0.0005)

    def step() -> torch.Tensor:
        loss_dict = model(_C05_IMAGES, targets)
        losses = sum(loss for loss in loss_dict.values())
        opt.zero_grad()
        losses.backward()
        opt.step()
        return losses

    return model, opt, targets, step


def _c05_build(bug: bool) -> Case:
    model, opt, _, step = _c05_setup(bug)
    return model, step, _kw(optimizer=opt, inputs=_C05_IMAGES)


def _c05_proof(bug: bool) -> bool:
    """After a training step, is some annotated class's box regressor left without any gradient?"""
    model, _, targets, step = _c05_setup(bug)
    step()
    grad = model.bbox_pred.weight.grad
    used = sorted({int(i) for t in targets for i in t["labels"]})
    return any(bool(grad[4 * c:4 * c + 4].abs().max() == 0) for c in used)


CASES: list[BlindCase] = [
    BlindCase("b35b-01", "https://github.com/sanghyun-son/EDSR-PyTorch/issues/80", "module requires_grad attribute no-op",
              "EDSR's MeanShift sets requires_grad on the module instead of its parameters, so the fixed mean-shift "
              "convolutions stay trainable and Adam learns them.", _c01_build, _c01_proof),
    BlindCase("b35b-02", "https://github.com/microsoft/A-CLIP/pull/4", "SimCLR views duplicated",
              "The SimCLR term is fed the first augmented view twice, so each positive pair is an embedding with "
              "itself and the second view gets no gradient from it.", _c02_build, _c02_proof),
    BlindCase("b35b-03", "https://github.com/lucidrains/audiolm-pytorch/issues/48", "discriminator steps on generator gradients",
              "The discriminator's gradients are cleared after its step instead of before its backward, so it steps "
              "on the generator loss's gradients plus its own.", _c03_build, _c03_proof),
    BlindCase("b35b-04", "https://github.com/lightly-ai/lightly-train/issues/968", "EMA teacher updated per micro-batch",
              "Under gradient accumulation the DINO teacher EMA and center update on every micro-batch, so the "
              "teacher moves several times per optimizer step and changes inside one effective batch.",
              _c04_build, _c04_proof,
              known_miss="an EMA teacher updated on every micro-batch: the copy's update cadence against the optimizer's is not measured"),
    BlindCase("b35b-05", "https://github.com/microsoft/computervision-recipes/pull/315", "real class mapped to background",
              "Building the label list with set() puts a real class at index 0, the background label, so its boxes "
              "are trained as background and never regressed.", _c05_build, _c05_proof,
              known_miss="a real class mapped to the background id: which id a class should get is label semantics"),
]
