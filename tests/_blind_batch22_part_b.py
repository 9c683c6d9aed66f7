"""Blind batch 22 (part b): silent training bugs from public GitHub threads, each with its fixed twin.

Focus: the generic plain-PyTorch training loop (EMA shadow weights, zero_grad ordering with a warmup scheduler,
frozen BatchNorm and train mode, gradient accumulation scaling, scheduler state on checkpoint resume). Every case
builds the user's setup on a tiny model built in code (nothing is downloaded) and proves the bug without the audit.
"""

from __future__ import annotations

import io
import math

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw

# --------------------------------------------------------------------------------------------- case-06
# A LoRA/diffusion training toolkit keeps an exponential moving average of the trainable weights and updates it
# after every optimizer step. A commit rewrote the update from ``tmp = s - p; tmp *= (1 - decay); s.sub_(tmp)`` to
# ``gap = s - p; s.add_(gap * (1 - decay))``, flipping the sign: the shadow is pushed away from the live weights
# (s_new = (1 + (1 - decay)) s - (1 - decay) p) instead of toward them. The live parameters and the loss curve look
# normal; the saved EMA weights diverge geometrically. Fix from the thread: go back to ``s -= (1 - decay) * (s - p)``.


class _ShadowEMA:
    """The toolkit's ExponentialMovingAverage: float shadow copies of the trainable parameters."""

    def __init__(self, params: list[nn.Parameter], decay: float, bug: bool) -> None:
        self.params = params
        self.decay = decay
        self.bug = bug
        self.shadow = [p.detach().clone().float() for p in params]

    @torch.no_grad()
    def update(self) -> None:
        one_minus_decay = 1.0 - self.decay
        for s_param, param in zip(self.shadow, self.params):
            param_float = param.detach().float()
            if self.bug:
                gap = s_param - param_float
                s_param.add_(gap * one_minus_decay)
            else:
                tmp = s_param - param_float
                tmp.mul_(one_minus_decay)
                s_param.sub_(tmp)


_C06_X = torch.randn(32, 8, generator=_gen(601))
_C06_Y = (_C06_X @ torch.randn(8, 1, generator=_gen(602))).tanh()


def _c06_parts(bug: bool) -> tuple[nn.Module, torch.optim.Optimizer, _ShadowEMA]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    ema = _ShadowEMA([p for p in model.parameters() if p.requires_grad], decay=0.9, bug=bug)
    return model, opt, ema


def _c06_step(model: nn.Module, opt: torch.optim.Optimizer, ema: _ShadowEMA):
    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = F.mse_loss(model(_C06_X), _C06_Y)
        loss.backward()
        opt.step()
        ema.update()
        return loss

    return step


def _c06_build(bug: bool) -> Case:
    """Regression MLP trained with AdamW, an EMA of its weights updated after every optimizer step."""
    model, opt, ema = _c06_parts(bug)
    return model, _c06_step(model, opt, ema), _kw(optimizer=opt, inputs=_C06_X)


def _c06_proof(bug: bool) -> bool:
    """A true EMA started at the initial weights is a convex combination of the weights seen so far, so every
    shadow element lies within that element's min/max over the trajectory. The flipped sign leaves that range."""
    model, opt, ema = _c06_parts(bug)
    step = _c06_step(model, opt, ema)
    lo = [p.detach().clone() for p in ema.params]
    hi = [p.detach().clone() for p in ema.params]
    for _ in range(30):
        step()
        for i, p in enumerate(ema.params):
            lo[i] = torch.minimum(lo[i], p.detach())
            hi[i] = torch.maximum(hi[i], p.detach())
    outside = [bool(((s < l - 1e-6) | (s > h + 1e-6)).any()) for s, l, h in zip(ema.shadow, lo, hi)]
    return any(outside)


# --------------------------------------------------------------------------------------------- case-07
# A user of a warmup-scheduler package reports that the learning rate does not seem to warm up / the model does not
# learn. Their per-batch code is ``loss.backward(); optimizer.zero_grad(); optimizer.step()`` followed by the warmup
# dampening and ``lr_scheduler.step()``. The maintainer answers that the code does not optimise the parameters at
# all, because ``optimizer.zero_grad()`` is called after ``loss.backward()`` and wipes the gradients before the step.
# Fix: call ``optimizer.zero_grad()`` before ``loss.backward()`` (zero_grad, backward, step, then scheduler step).

_C07_X = torch.randn(24, 10, generator=_gen(701))
_C07_Y = torch.randint(0, 3, (24,), generator=_gen(702))
_C07_WARMUP = 5
_C07_TOTAL = 40


def _c07_parts(bug: bool):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 3)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    warm = lambda s: min(1.0, (s + 1) / _C07_WARMUP)  # linear warmup, then the base schedule
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: warm(s) * 0.5 * (1 + math.cos(math.pi * min(s, _C07_TOTAL) / _C07_TOTAL)))

    def step() -> torch.Tensor:
        if not bug:
            opt.zero_grad()
        loss = F.cross_entropy(model(_C07_X), _C07_Y)
        loss.backward()
        if bug:
            opt.zero_grad()
        opt.step()
        sched.step()
        return loss

    return model, opt, sched, step


def _c07_build(bug: bool) -> Case:
    """Classifier trained with AdamW and a per-batch warmup+cosine schedule; the step ends with zero_grad placed
    between backward and optimizer.step."""
    model, opt, sched, step = _c07_parts(bug)
    return model, step, _kw(optimizer=opt, inputs=_C07_X, lr_scheduler=sched, total_steps=_C07_TOTAL)


def _c07_proof(bug: bool) -> bool:
    """At every optimizer.step the gradients it sees are all zero (recorded by a step pre-hook), so after ten
    steps the loss has not moved."""
    _, opt, _, step = _c07_parts(bug)
    seen: list[float] = []

    def pre_hook(optimizer, args, kwargs):
        seen.append(float(sum(p.grad.abs().sum() for g in optimizer.param_groups for p in g["params"]
                              if p.grad is not None)))

    handle = opt.register_step_pre_hook(pre_hook)
    first = float(step())
    for _ in range(9):
        last = float(step())
    handle.remove()
    return all(s == 0.0 for s in seen) and abs(first - last) < 1e-2


# --------------------------------------------------------------------------------------------- case-08
# A 3D-labelling repository fine-tunes a head on a pretrained ResNet backbone whose layers are meant to be frozen.
# It sets ``requires_grad=False`` and puts the BatchNorm layers in eval mode once, but the training loop calls
# ``model.train()``, which puts every BatchNorm back in training mode: the "frozen" backbone normalises with batch
# statistics and its pretrained running_mean/running_var are overwritten by the fine-tuning data. Fix from the PR:
# put the BN in eval mode and redefine ``train()`` on the backbone so the frozen part is put back in eval mode
# whenever ``model.train()`` is called.


class _FrozenBackbone(nn.Module):
    """Two conv+BN stages standing in for the pretrained ResNet; frozen for fine-tuning."""

    def __init__(self, keep_frozen_eval: bool) -> None:
        super().__init__()
        self.keep_frozen_eval = keep_frozen_eval
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(8)
        g = _gen(801)
        with torch.no_grad():  # "pretrained" statistics, different from the fine-tuning data
            for bn in (self.bn1, self.bn2):
                bn.running_mean.copy_(torch.randn(8, generator=g) * 0.5)
                bn.running_var.copy_(torch.rand(8, generator=g) + 0.5)
                bn.weight.copy_(torch.rand(8, generator=g) + 0.5)
                bn.bias.copy_(torch.randn(8, generator=g) * 0.1)

    def freeze(self) -> None:
        for p in self.parameters():
            p.requires_grad = False
        for m in self.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.eval()

    def train(self, mode: bool = True) -> _FrozenBackbone:
        super().train(mode)
        if self.keep_frozen_eval:  # the PR's fix: the frozen net stays in eval whenever model.train() is called
            for m in self.modules():
                if isinstance(m, nn.BatchNorm2d):
                    m.eval()
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(x)))


class _FineTuneNet(nn.Module):
    def __init__(self, bug: bool) -> None:
        super().__init__()
        self.backbone = _FrozenBackbone(keep_frozen_eval=not bug)
        self.backbone.freeze()
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x).mean((2, 3)))


_C08_X = torch.randn(6, 3, 12, 12, generator=_gen(802)) * 2.0 + 1.0
_C08_Y = torch.randint(0, 4, (6,), generator=_gen(803))


def _c08_parts(bug: bool):
    torch.manual_seed(0)
    model = _FineTuneNet(bug)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05, momentum=0.9)

    def step() -> torch.Tensor:
        model.train()  # the training loop's per-epoch call
        opt.zero_grad()
        loss = F.cross_entropy(model(_C08_X), _C08_Y)
        loss.backward()
        opt.step()
        return loss

    return model, opt, step


def _c08_build(bug: bool) -> Case:
    """Head fine-tuned on a frozen conv+BN backbone; the loop calls model.train() before every step."""
    model, opt, step = _c08_parts(bug)
    return model, step, _kw(optimizer=opt, inputs=_C08_X)


def _c08_proof(bug: bool) -> bool:
    """After three steps the frozen backbone's BatchNorm running statistics have moved away from the pretrained
    values (and the BN layers are in training mode)."""
    model, _, step = _c08_parts(bug)
    before = model.backbone.bn1.running_mean.clone()
    for _ in range(3):
        step()
    moved = float((model.backbone.bn1.running_mean - before).abs().max()) > 1e-4
    return moved and model.backbone.bn1.training


# --------------------------------------------------------------------------------------------- case-09
# A training library's gradient-accumulation callback lets the gradients of several micro-batches add up in
# ``.grad`` and steps the optimizer once they are accumulated, but never scales the loss by the number of
# accumulated batches. The summed gradient is that many times the mean gradient, so accumulation silently
# multiplies the effective learning rate (the docs even told users to lower the lr). Fix from the issue/PR: divide
# the loss by the number of batches accumulated before backward, so the update equals the large-batch one.

_C09_ACC = 4
_C09_X = torch.randn(_C09_ACC * 8, 12, generator=_gen(901))
_C09_Y = _C09_X @ torch.randn(12, 1, generator=_gen(902)) + 0.1 * torch.randn(_C09_ACC * 8, 1, generator=_gen(903))


def _c09_parts(bug: bool):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 1)).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def step() -> torch.Tensor:
        opt.zero_grad()
        total = torch.zeros(())
        for xb, yb in zip(_C09_X.chunk(_C09_ACC), _C09_Y.chunk(_C09_ACC)):
            loss = F.mse_loss(model(xb), yb)
            (loss if bug else loss / _C09_ACC).backward()
            total = total + loss.detach() / _C09_ACC
        opt.step()
        return total

    return model, opt, step


def _c09_build(bug: bool) -> Case:
    """Regression MLP with SGD and gradient accumulation over four micro-batches per optimizer step."""
    model, opt, step = _c09_parts(bug)
    return model, step, _kw(optimizer=opt, inputs=_C09_X[: len(_C09_X) // _C09_ACC])


def _c09_proof(bug: bool) -> bool:
    """The gradient the optimizer steps on is four times the full-batch mean gradient of the same samples."""
    model, opt, step = _c09_parts(bug)
    opt.zero_grad()
    F.mse_loss(model(_C09_X), _C09_Y).backward()
    ref = torch.cat([p.grad.flatten() for p in model.parameters()]).clone()
    grads: list[torch.Tensor] = []
    handle = opt.register_step_pre_hook(
        lambda o, a, k: grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]).clone()))
    step()
    handle.remove()
    ratio = float(grads[0].norm() / ref.norm())
    return abs(ratio - _C09_ACC) < 0.05 * _C09_ACC


# --------------------------------------------------------------------------------------------- case-10
# A scientific-ML benchmark's Trainer saves and loads the model and optimizer state in its checkpoints but not the
# lr_scheduler state. Resuming a run from a checkpoint therefore restarts the scheduler's warmup and cosine decay
# from step 0 on an already-trained model (the learning rate no longer matches the uninterrupted run). Fix from the
# PR: include ``lr_scheduler.state_dict()`` in save_model and load it in load_checkpoint.

_C10_X = torch.randn(16, 6, generator=_gen(1001))
_C10_Y = torch.randn(16, 2, generator=_gen(1002))
_C10_WARMUP, _C10_TOTAL, _C10_FIRST = 4, 20, 8


class _Trainer:
    """The benchmark's Trainer: model, AdamW, linear warmup then cosine (SequentialLR), per-step scheduling."""

    def __init__(self, save_scheduler: bool) -> None:
        torch.manual_seed(0)
        self.save_scheduler = save_scheduler
        self.model = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 2)).train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        warmup = torch.optim.lr_scheduler.LinearLR(self.optimizer, start_factor=0.1, total_iters=_C10_WARMUP)
        cosine = torch.optim.lr_scheduler.CosineAnnealingLR(self.optimizer, T_max=_C10_TOTAL - _C10_WARMUP)
        self.lr_scheduler = torch.optim.lr_scheduler.SequentialLR(self.optimizer, [warmup, cosine],
                                                                  milestones=[_C10_WARMUP])

    def train_step(self) -> torch.Tensor:
        self.optimizer.zero_grad()
        loss = F.mse_loss(self.model(_C10_X), _C10_Y)
        loss.backward()
        self.optimizer.step()
        self.lr_scheduler.step()
        return loss

    def save_model(self) -> bytes:
        state = {"model_state_dict": self.model.state_dict(), "optimizer_state_dict": self.optimizer.state_dict()}
        if self.save_scheduler:
            state["lr_scheduler_state_dict"] = self.lr_scheduler.state_dict()
        buf = io.BytesIO()
        torch.save(state, buf)
        return buf.getvalue()

    def load_checkpoint(self, blob: bytes) -> None:
        state = torch.load(io.BytesIO(blob), weights_only=False)
        self.model.load_state_dict(state["model_state_dict"])
        self.optimizer.load_state_dict(state["optimizer_state_dict"])
        if self.save_scheduler and "lr_scheduler_state_dict" in state:
            self.lr_scheduler.load_state_dict(state["lr_scheduler_state_dict"])


def _c10_resumed(bug: bool) -> _Trainer:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = _Trainer(save_scheduler=not bug)
        for _ in range(_C10_FIRST):
            first.train_step()
        blob = first.save_model()
        resumed = _Trainer(save_scheduler=not bug)
        resumed.load_checkpoint(blob)
    return resumed


def _c10_build(bug: bool) -> Case:
    """A run resumed from a mid-training checkpoint (after the warmup) and trained on with the same Trainer."""
    tr = _c10_resumed(bug)
    return tr.model, tr.train_step, _kw(optimizer=tr.optimizer, inputs=_C10_X, lr_scheduler=tr.lr_scheduler,
                                        total_steps=_C10_TOTAL - _C10_FIRST)


def _c10_proof(bug: bool) -> bool:
    """The learning rates of the resumed run's next steps differ from those of the uninterrupted run."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = _Trainer(save_scheduler=True)
        for _ in range(_C10_FIRST):
            ref.train_step()
        resumed = _c10_resumed(bug)
        ref_lrs, res_lrs = [], []
        for _ in range(6):
            ref_lrs.append(ref.optimizer.param_groups[0]["lr"])
            res_lrs.append(resumed.optimizer.param_groups[0]["lr"])
            ref.train_step()
            resumed.train_step()
    return any(abs(a - b) > 1e-9 * max(abs(a), 1e-12) + 1e-12 for a, b in zip(ref_lrs, res_lrs))


CASES: list[BlindCase] = [
    BlindCase("b22-case-06", "https://github.com/ostris/ai-toolkit/issues/1034", "EMA update sign",
              "The EMA shadow update adds (1 - decay) * (shadow - param) instead of subtracting it, so the EMA "
              "weights are pushed away from the live weights and diverge while training looks normal.",
              _c06_build, _c06_proof),
    BlindCase("b22-case-07", "https://github.com/Tony-Y/pytorch_warmup/issues/12", "zero_grad ordering",
              "optimizer.zero_grad() is called between loss.backward() and optimizer.step(), so every step sees "
              "zero gradients and the parameters are never optimised while the warmup schedule runs.",
              _c07_build, _c07_proof),
    BlindCase("b22-case-08", "https://github.com/TRI-ML/sdflabel/pull/8", "frozen BatchNorm / train mode",
              "The frozen backbone's BatchNorm layers are put in eval once, but model.train() in the loop puts them "
              "back in training mode, so their pretrained running statistics are overwritten during fine-tuning.",
              _c08_build, _c08_proof),
    BlindCase("b22-case-09", "https://github.com/fastai/fastai/issues/3023", "gradient accumulation scaling",
              "Gradient accumulation sums the micro-batch gradients without dividing the loss by the number of "
              "accumulated batches, silently multiplying the effective learning rate.", _c09_build, _c09_proof),
    BlindCase("b22-case-10", "https://github.com/PolymathicAI/the_well/pull/63", "scheduler state on resume",
              "Checkpoints hold the model and optimizer state but not the lr_scheduler state, so a resumed run "
              "restarts the warmup/cosine schedule and trains at the wrong learning rate.", _c10_build, _c10_proof),
]
