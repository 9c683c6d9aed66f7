"""Blind batch 29 (part b): silent bugs in vision / tabular / classic deep-learning training code, each with its twin.

Collected by someone who does not write the audit's checks. Every case builds the user's setup on a tiny model
(small MLPs and CNNs with batch norm, torch's own AveragedModel / GradScaler / schedulers, Lightning modules where
the report used one; nothing is downloaded) and proves the bug without the audit on real tensors and real steps.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw

# --------------------------------------------------------------------------------------------- case-01
# yandex-research/tabm issue #20 (reported from dholzmueller/pytabkit#34; maintainer: "This is definitely a bug",
# fixed in commit 28e47ae): the TabM example's training loop zeroes the gradients, computes the loss, and then runs
# the gradient clipping block (`clip_grad_norm_(model.parameters(), gradient_clipping_norm)`) *before*
# `loss.backward()`. At that point every .grad is None (set_to_none zero_grad), so the clip is a no-op; backward then
# writes the full, unclipped gradient and AdamW steps on it. Nothing errors and the loss goes down: the configured
# gradient clipping is simply never applied. Fix: backward first, then clip, then step.

_C01_X = torch.randn(8, 12, generator=_gen(2901))
_C01_Y = 40.0 * torch.randn(8, generator=_gen(2902)) + 25.0  # un-normalised regression target: big gradients
_C01_CLIP = 1.0


class _TabMLP(nn.Module):
    """A tabular MLP regressor (numerical features in, one value out), the shape of the example's plain MLP."""

    def __init__(self, d_in: int = 12, d: int = 32) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(d_in, d), nn.ReLU(), nn.Dropout(0.1), nn.Linear(d, d), nn.ReLU())
        self.output = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(self.backbone(x)).squeeze(-1)


def _c01_build(bug: bool) -> Case:
    """The example's loop: zero_grad, loss, [clip before or after backward], step."""
    torch.manual_seed(0)
    model = _TabMLP().train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=3e-4)

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = F.mse_loss(model(_C01_X), _C01_Y)
        if bug:
            nn.utils.clip_grad.clip_grad_norm_(model.parameters(), _C01_CLIP)  # grads are None here
            loss.backward()
        else:
            loss.backward()
            nn.utils.clip_grad.clip_grad_norm_(model.parameters(), _C01_CLIP)
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=_C01_X)


def _c01_proof(bug: bool) -> bool:
    """The gradient AdamW stepped on (still in .grad after the step) has a norm far above the clipping norm."""
    model, step, _ = _c01_build(bug)
    step()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    return bool(norm > 2 * _C01_CLIP)

# --------------------------------------------------------------------------------------------- case-02
# pytorch/pytorch issue #84053, fixed by PR #84054 ("sync AveragedModel buffers when use_buffers=False"): an EMA of a
# model is kept with `torch.optim.swa_utils.AveragedModel(model, avg_fn=ema_avg)` and updated after every optimizer
# step. AveragedModel deep-copies the model once at construction and, with the default use_buffers=False, averaged
# only the parameters: the copy's buffers (BatchNorm running_mean / running_var, the reporter's running input-mean
# buffer) stayed at their construction values for the whole run, while the live model's buffers kept moving. The EMA
# model that is evaluated and saved normalises with stale statistics; nothing errors. Fix in the PR: when
# use_buffers=False, update_parameters copies the source model's buffers into the averaged copy on every update.
# The bug side is the pre-fix update_parameters (torch <= 1.12); the twin is torch's current AveragedModel.

_C02_X = torch.randn(8, 3, 8, 8, generator=_gen(2903)) * 2.0 + 1.5  # inputs far from zero mean / unit variance
_C02_Y = torch.randint(0, 4, (8,), generator=_gen(2904))


class _SmallBNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn(self.conv(x)))
        return self.fc(h.mean((2, 3)))


class _AveragedModelPre84054(torch.optim.swa_utils.AveragedModel):
    """AveragedModel.update_parameters as it was before PR #84054: parameters averaged, buffers never synced."""

    def update_parameters(self, model: nn.Module) -> None:
        frozen = [b.detach().clone() for b in self.module.buffers()]
        super().update_parameters(model)
        with torch.no_grad():
            for b, old in zip(self.module.buffers(), frozen):
                b.copy_(old)


def _c02_ema_avg(averaged: torch.Tensor, current: torch.Tensor, num_averaged: torch.Tensor) -> torch.Tensor:
    return 0.05 * averaged + 0.95 * current  # the reporter's ema_avg


def _c02_build(bug: bool) -> Case:
    """SGD training of a BN CNN with an AveragedModel EMA updated after every step."""
    torch.manual_seed(0)
    model = _SmallBNNet().train()
    cls = _AveragedModelPre84054 if bug else torch.optim.swa_utils.AveragedModel
    ema = cls(model, avg_fn=_c02_ema_avg)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(model(_C02_X), _C02_Y)
        loss.backward()
        opt.step()
        ema.update_parameters(model)
        return loss

    step.ema = ema  # type: ignore[attr-defined]
    return model, step, _kw(optimizer=opt, inputs=_C02_X)


def _c02_proof(bug: bool) -> bool:
    """After a few steps the EMA copy's BatchNorm running_mean is still the construction-time zeros."""
    model, step, _ = _c02_build(bug)
    for _ in range(3):
        step()
    ema = step.ema  # type: ignore[attr-defined]
    stale = torch.equal(ema.module.bn.running_mean, torch.zeros(8))
    moved = not torch.equal(model.bn.running_mean, torch.zeros(8))
    return stale and moved

# --------------------------------------------------------------------------------------------- case-03
# shariqfarooq123/AdaBins issue #44: train.py (default, `--same-lr` off) builds AdamW with two parameter groups, the
# pretrained encoder at lr/10 and the new decoder/bins head at lr, and then creates
# `OneCycleLR(optimizer, lr, epochs=..., steps_per_epoch=..., ...)` with the scalar max_lr. OneCycleLR broadcasts a
# scalar max_lr to every group and overwrites each group's lr with its own schedule (initial_lr = max_lr/div_factor),
# so the encoder silently trains at the decoder's rate for the whole run; printing the optimizer shows both groups
# with identical lr/initial_lr/max_lr. Nothing errors. Fix given in the issue: pass one max_lr per group,
# `max_lr=[lr / 10, lr]`, so the 10x ratio survives the schedule.

_C03_IMG = torch.rand(2, 3, 16, 16, generator=_gen(2905))
_C03_DEPTH = 0.5 + 9.5 * torch.rand(2, 1, 16, 16, generator=_gen(2906))
_C03_LR = 3.57e-4


class _TinyDepthNet(nn.Module):
    """Encoder (the pretrained part, 1x lr) and decoder head (10x lr), as AdaBins' get_1x / get_10x_lr_params."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                     nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32), nn.ReLU())
        self.decoder = nn.Sequential(nn.Upsample(scale_factor=4, mode="bilinear", align_corners=True),
                                     nn.Conv2d(32, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 1, 1))

    def get_1x_lr_params(self) -> Iterator[nn.Parameter]:
        return self.encoder.parameters()

    def get_10x_lr_params(self) -> Iterator[nn.Parameter]:
        return self.decoder.parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.softplus(self.decoder(self.encoder(x))) + 1e-3


def _c03_silog(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    g = torch.log(pred) - torch.log(target)
    return 10 * torch.sqrt(g.var() + 0.15 * g.mean() ** 2)


def _c03_build(bug: bool) -> Case:
    """AdaBins' optimizer / OneCycleLR setup and its train-loop body."""
    torch.manual_seed(0)
    model = _TinyDepthNet().train()
    lr, epochs, steps_per_epoch = _C03_LR, 25, 4
    params = [{"params": model.get_1x_lr_params(), "lr": lr / 10},
              {"params": model.get_10x_lr_params(), "lr": lr}]
    optimizer = torch.optim.AdamW(params, weight_decay=0.1, lr=lr)
    max_lr = lr if bug else [lr / 10, lr]
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr, epochs=epochs, steps_per_epoch=steps_per_epoch,
                                                    cycle_momentum=True, base_momentum=0.85, max_momentum=0.95,
                                                    div_factor=25, final_div_factor=100)

    def step() -> torch.Tensor:
        optimizer.zero_grad()
        pred = model(_C03_IMG)
        mask = _C03_DEPTH > 1e-3
        loss = _c03_silog(pred[mask], _C03_DEPTH[mask])
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        optimizer.step()
        scheduler.step()
        return loss

    return model, step, _kw(optimizer=optimizer, inputs=_C03_IMG, lr_scheduler=scheduler,
                            total_steps=epochs * steps_per_epoch)


def _c03_proof(bug: bool) -> bool:
    """Over the first steps the encoder group's lr equals the decoder group's instead of a tenth of it."""
    _, step, kw = _c03_build(bug)
    optimizer = kw["optimizer"]
    ratios = []
    for _ in range(3):
        enc, dec = (g["lr"] for g in optimizer.param_groups)
        ratios.append(enc / dec)
        step()
    return all(abs(r - 1.0) < 1e-9 for r in ratios)

# --------------------------------------------------------------------------------------------- case-04
# open-mmlab/mmpretrain (mmclassification) issue #983, fixed by PR #1058 ("Add loss_weight to LabelSmoothLoss"): the
# LabelSmoothLoss config takes `loss_weight` and stores it in __init__, but forward returns the inner soft
# CrossEntropyLoss, which was built without it (`CrossEntropyLoss(use_soft=True)`, loss_weight 1.0). A model that
# weights a label-smoothed head down (here an auxiliary classifier head, `loss_weight=0.4`, next to the main head's
# cross-entropy) silently trains that head at full weight: the loss balance the config asks for is never applied,
# and the loss value still looks like a normal cross-entropy. Fix in the PR: pass loss_weight to the inner loss.

_C04_X = torch.randn(8, 3, 12, 12, generator=_gen(2907))
_C04_Y = torch.randint(0, 5, (8,), generator=_gen(2908))


class _SoftCrossEntropy(nn.Module):
    """mmcls CrossEntropyLoss(use_soft=True): -sum(soft_label * log_softmax), mean over the batch, times loss_weight."""

    def __init__(self, loss_weight: float = 1.0) -> None:
        super().__init__()
        self.loss_weight = loss_weight

    def forward(self, cls_score: torch.Tensor, soft_label: torch.Tensor) -> torch.Tensor:
        loss = -(soft_label * F.log_softmax(cls_score, dim=-1)).sum(-1)
        return self.loss_weight * loss.mean()


class _LabelSmoothLoss(nn.Module):
    """mmcls LabelSmoothLoss, mode='original': (1 - eps) * one_hot + eps / K, then the soft cross-entropy."""

    def __init__(self, label_smooth_val: float, num_classes: int, loss_weight: float = 1.0, *, bug: bool) -> None:
        super().__init__()
        self.num_classes = num_classes
        self.loss_weight = loss_weight
        self._eps = label_smooth_val
        self.ce = _SoftCrossEntropy() if bug else _SoftCrossEntropy(loss_weight=loss_weight)

    def forward(self, cls_score: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        one_hot = F.one_hot(label, self.num_classes).float()
        smooth = one_hot * (1 - self._eps) + self._eps / self.num_classes
        return self.ce(cls_score, smooth)


class _TwoHeadClassifier(nn.Module):
    """A small CNN image classifier with a main head and an auxiliary head on the shared features."""

    def __init__(self, n_cls: int = 5) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                      nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(16, n_cls)
        self.aux_head = nn.Linear(16, n_cls)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        f = self.backbone(x)
        return self.head(f), self.aux_head(f)


_C04_AUX_WEIGHT = 0.4


def _c04_build(bug: bool) -> Case:
    """Main head: cross-entropy (weight 1). Aux head: LabelSmoothLoss(0.1, loss_weight=0.4). SGD, as mmcls configs."""
    torch.manual_seed(0)
    model = _TwoHeadClassifier().train()
    aux_loss = _LabelSmoothLoss(0.1, 5, loss_weight=_C04_AUX_WEIGHT, bug=bug)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)

    def step() -> torch.Tensor:
        opt.zero_grad()
        main, aux = model(_C04_X)
        loss = F.cross_entropy(main, _C04_Y) + aux_loss(aux, _C04_Y)
        loss.backward()
        opt.step()
        return loss

    step.aux_loss = aux_loss  # type: ignore[attr-defined]
    return model, step, _kw(optimizer=opt, inputs=_C04_X)


def _c04_proof(bug: bool) -> bool:
    """The aux head's gradient is that of the unweighted smoothed loss, not 0.4 times it."""
    model, step, _ = _c04_build(bug)
    step()
    got = model.aux_head.weight.grad.clone()
    torch.manual_seed(0)
    ref = _TwoHeadClassifier().train()
    _, aux = ref(_C04_X)
    one_hot = F.one_hot(_C04_Y, 5).float() * 0.9 + 0.1 / 5
    (_C04_AUX_WEIGHT * -(one_hot * F.log_softmax(aux, -1)).sum(-1).mean()).backward()
    want = ref.aux_head.weight.grad
    return not torch.allclose(got, want, atol=1e-6) and torch.allclose(got, want / _C04_AUX_WEIGHT, atol=1e-6)


# --------------------------------------------------------------------------------------------- case-05
# Lightning-AI/pytorch-lightning issue #21901 (fix proposed in PR #21902): a LightningModule is fine-tuned with the
# `BackboneFinetuning` callback (backbone frozen at first, unfrozen and added to the optimizer as a new param group at
# `unfreeze_backbone_at_epoch`), and the run is resumed from a checkpoint after the unfreeze epoch. On resume,
# `setup()` calls `freeze_before_training()` again (requires_grad=False on the backbone) and `on_fit_start()` restores
# the saved param groups, backbone group included, but never restores requires_grad; `finetune_function` only
# unfreezes on the exact unfreeze epoch. So the backbone sits in the optimizer with its learning rate and never gets
# a gradient again for the rest of training; no warning, the loss keeps going down through the head. Fix in the PR:
# on restart, set requires_grad back on the parameters of the param groups appended after configure_optimizers' own.
# The bug side is the real lightning BackboneFinetuning (2.6); the twin applies the PR's restore in on_fit_start.

_C05_X = torch.randn(16, 3, 8, 8, generator=_gen(2909))
_C05_Y = torch.randint(0, 4, (16,), generator=_gen(2910))


def _c05_classes() -> tuple[type, type]:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import BackboneFinetuning
    from torch.utils.data import DataLoader, TensorDataset

    class FinetuneNet(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.backbone = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                          nn.AdaptiveAvgPool2d(1), nn.Flatten())
            self.head = nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.backbone(x))

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            x, y = batch
            return F.cross_entropy(self(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            # the pattern BaseFinetuning's docs ask for: only the parameters trainable at this point
            return torch.optim.SGD(filter(lambda p: p.requires_grad, self.parameters()), lr=0.1, momentum=0.9)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(TensorDataset(_C05_X, _C05_Y), batch_size=8)

    class RestoringBackboneFinetuning(BackboneFinetuning):
        """PR #21902: after restoring the saved param groups, make the appended (unfrozen) groups trainable again."""

        def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            restarting = self._restarting
            n_configured = [len(o.param_groups) for o in trainer.optimizers]
            super().on_fit_start(trainer, pl_module)
            if restarting:
                for opt, n in zip(trainer.optimizers, n_configured):
                    for group in opt.param_groups[n:]:
                        for p in group["params"]:
                            p.requires_grad_(True)

    return FinetuneNet, RestoringBackboneFinetuning


def _c05_run(bug: bool) -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]:
    """Fit 2 epochs (backbone unfrozen at epoch 1), checkpoint, then resume the run for a 3rd epoch."""
    import logging
    import os
    import tempfile
    import warnings

    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import BackboneFinetuning

    net_cls, fixed_cls = _c05_classes()
    cb_cls = BackboneFinetuning if bug else fixed_cls

    def trainer(root: str, max_epochs: int) -> pl.Trainer:
        cb = cb_cls(unfreeze_backbone_at_epoch=1, train_bn=False)
        return pl.Trainer(max_epochs=max_epochs, callbacks=[cb], default_root_dir=root, logger=False,
                          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                          accelerator="cpu", devices=1)

    quiet = [logging.getLogger(n) for n in ("lightning.pytorch", "lightning.fabric")]
    levels = [lg.level for lg in quiet]
    for lg in quiet:
        lg.setLevel(logging.ERROR)
    try:
        with tempfile.TemporaryDirectory() as root, warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*LeafSpec.*")  # lightning/torch version noise, both sides
            torch.manual_seed(0)
            first = net_cls()
            t1 = trainer(root, 2)
            t1.fit(first)
            ckpt = os.path.join(root, "resume.ckpt")
            t1.save_checkpoint(ckpt)
            torch.manual_seed(0)
            model = net_cls()
            t2 = trainer(root, 3)
            t2.fit(model, ckpt_path=ckpt)
            at_resume = torch.load(ckpt, weights_only=False)["state_dict"]["backbone.0.weight"]
    finally:
        for lg, lvl in zip(quiet, levels):
            lg.setLevel(lvl)
    return model, t2.optimizers[0], at_resume


def _c05_build(bug: bool) -> Case:
    """The resumed run's module and optimizer; the step is Lightning's automatic-optimization step."""
    model, opt, _ = _c05_run(bug)
    model.train()
    batch = (_C05_X[:8], _C05_Y[:8])

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = model.training_step(batch, 0)
        loss.backward()
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=batch[0])


def _c05_proof(bug: bool) -> bool:
    """Through the resumed epoch the backbone conv weight, still in the optimizer with an lr, did not move."""
    model, opt, at_resume = _c05_run(bug)
    in_optimizer = any(p is model.backbone[0].weight for g in opt.param_groups for p in g["params"])
    return in_optimizer and torch.equal(model.backbone[0].weight.detach(), at_resume)


CASES: list[BlindCase] = [
    BlindCase("b29b-01", "https://github.com/yandex-research/tabm/issues/20", "gradient clipping order",
              "Gradient clipping runs before loss.backward(), when the gradients are still None, so it is a no-op and "
              "AdamW steps on the full unclipped gradient.", _c01_build, _c01_proof),
    BlindCase("b29b-02", "https://github.com/pytorch/pytorch/issues/84053", "EMA model buffers stale",
              "AveragedModel's EMA copy averages only the parameters, so its BatchNorm running statistics stay at the "
              "construction-time values while the trained model's move.", _c02_build, _c02_proof),
    BlindCase("b29b-03", "https://github.com/shariqfarooq123/AdaBins/issues/44", "scheduler overrides param-group lr",
              "OneCycleLR with a scalar max_lr overwrites both parameter groups' learning rates, so the encoder meant "
              "to train at a tenth of the decoder's rate trains at the same rate.", _c03_build, _c03_proof),
    BlindCase("b29b-04", "https://github.com/open-mmlab/mmpretrain/issues/983", "loss weight ignored",
              "LabelSmoothLoss stores loss_weight but its inner cross-entropy is built without it, so the auxiliary "
              "head's loss trains at full weight instead of the configured 0.4.", _c04_build, _c04_proof,
              known_miss="a loss weight stored and never applied inside a hand-written loss: the term's intended weight is not in the setup"),
    BlindCase("b29b-05", "https://github.com/Lightning-AI/pytorch-lightning/issues/21901", "frozen after resume",
              "Resuming a BackboneFinetuning run after the unfreeze epoch re-freezes the backbone: its parameters stay "
              "in the optimizer with a learning rate but have requires_grad=False and never update again.",
              _c05_build, _c05_proof),
]
