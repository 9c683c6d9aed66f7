"""Blind batch 40 (part b): silent vision, audio and generative training bugs from public threads, each with its fix.

Collected by someone who does not write the audit's checks. Every case builds the user's setup on a tiny plain torch
model (a detector-style EMA, a GAN, a conv backbone with BatchNorm, a VAE, a CTC keyword spotter; nothing is
downloaded) and proves the bug without the audit on real tensors and real steps.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw

# --------------------------------------------------------------------------------------------- case-01
# roboflow/rf-detr PR #59 "ensure tau gets used when computing decay": the model EMA takes a `tau` warm-up constant,
# but the update used the bare `decay` (0.9997) from the first step on, so tau was never used. The EMA copy then sits
# at the initial weights for thousands of steps (early EMA checkpoints are essentially the untrained model) while the
# training loss of the live model falls normally. Fix in the PR: decay = decay * (1 - exp(-updates / tau)).

_C01_X = torch.randn(8, 12, generator=_gen(4001))
_C01_Y = torch.randint(0, 3, (8,), generator=_gen(4002))


class _ModelEma:
    def __init__(self, model: nn.Module, decay: float, tau: float, use_tau: bool):
        self.module = copy.deepcopy(model).eval()
        for p in self.module.parameters():
            p.requires_grad_(False)
        self.decay, self.tau, self.use_tau, self.updates = decay, tau, use_tau, 0

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        self.updates += 1
        d = self.decay * (1 - math.exp(-self.updates / self.tau)) if self.use_tau else self.decay
        for e, m in zip(self.module.state_dict().values(), model.state_dict().values()):
            if e.dtype.is_floating_point:
                e.mul_(d).add_(m.detach(), alpha=1 - d)


def _c01_setup(bug: bool):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 3)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ema = _ModelEma(model, decay=0.9997, tau=2000, use_tau=not bug)

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(model(_C01_X), _C01_Y)
        loss.backward()
        opt.step()
        ema.update(model)
        return loss

    return model, opt, ema, step


def _c01_build(bug: bool) -> Case:
    model, opt, _, step = _c01_setup(bug)
    return model, step, _kw(optimizer=opt, inputs={"x": _C01_X, "labels": _C01_Y})


def _c01_proof(bug: bool) -> bool:
    """After a few steps, does the EMA copy still sit at the initial weights while the model has moved?"""
    model, _, ema, step = _c01_setup(bug)
    w0 = model[0].weight.detach().clone()
    for _ in range(5):
        step()
    moved = (model[0].weight.detach() - w0).norm()
    ema_moved = (ema.module[0].weight - w0).norm()
    return bool(ema_moved < 0.1 * moved)


# --------------------------------------------------------------------------------------------- case-02
# Lightning-AI/pytorch-lightning issue #557: in the GAN template the generator step backpropagates the generator loss
# through the discriminator, and only the generator's optimizer is zeroed after its step. The discriminator's
# optimizer step then uses its own loss's gradients plus the leaked generator-loss gradients (which push D the wrong
# way). Both losses still move, nothing errors. Fix (#603 / #666): clear the discriminator's gradients before its own
# backward (zero_grad of D before the D step).

_C02_REAL = torch.randn(8, 6, generator=_gen(4011)) * 0.5 + 1.0
_C02_Z = torch.randn(8, 4, generator=_gen(4012))


def _c02_setup(bug: bool, probe: bool = False):
    torch.manual_seed(0)
    gan = nn.ModuleDict({"G": nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 6)),
                         "D": nn.Sequential(nn.Linear(6, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))}).train()
    opt_g = torch.optim.Adam(gan["G"].parameters(), lr=2e-3, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(gan["D"].parameters(), lr=2e-3, betas=(0.5, 0.999))
    ones, zeros = torch.ones(8, 1), torch.zeros(8, 1)
    seen: dict[str, list[torch.Tensor]] = {}

    def d_loss_fn() -> torch.Tensor:
        fake = gan["G"](_C02_Z).detach()
        return (F.binary_cross_entropy_with_logits(gan["D"](_C02_REAL), ones)
                + F.binary_cross_entropy_with_logits(gan["D"](fake), zeros)) / 2

    def step() -> torch.Tensor:
        # optimizer_i == 0: generator
        g_loss = F.binary_cross_entropy_with_logits(gan["D"](gan["G"](_C02_Z)), ones)
        g_loss.backward()
        opt_g.step()
        opt_g.zero_grad()
        # optimizer_i == 1: discriminator
        if not bug:
            opt_d.zero_grad()
        d_loss = d_loss_fn()
        if probe:  # the gradient of the discriminator's own loss at the weights its step sees
            seen["true"] = list(torch.autograd.grad(d_loss, list(gan["D"].parameters()), retain_graph=True))
        d_loss.backward()
        seen["d_grads"] = [p.grad.detach().clone() for p in gan["D"].parameters()]
        opt_d.step()
        opt_d.zero_grad()
        return d_loss

    return gan, opt_g, opt_d, step, d_loss_fn, seen


def _c02_build(bug: bool) -> Case:
    gan, opt_g, opt_d, step, _, _ = _c02_setup(bug)
    return gan, step, _kw(optimizer=opt_d, inputs={"real": _C02_REAL, "z": _C02_Z})


def _c02_proof(bug: bool) -> bool:
    """Does the discriminator's step use a gradient other than the gradient of its own loss?"""
    _, _, _, step, _, seen = _c02_setup(bug, probe=True)
    step()
    return any(bool((a - b).abs().max() > 1e-6) for a, b in zip(seen["d_grads"], seen["true"]))


# --------------------------------------------------------------------------------------------- case-03
# ultralytics/ultralytics PR #8753 "freeze bn in frozen layers": layers listed in `freeze` get requires_grad=False,
# but the whole model is put in train() mode every epoch, so the BatchNorm layers inside the frozen layers keep
# overwriting their pretrained running_mean / running_var with the new data's batch statistics. Weights stay frozen,
# the loss falls, but the "frozen" backbone's inference behaviour drifts. Fix in the thread: put the BatchNorm modules of
# the frozen layers in eval() mode (after model.train()) so their running statistics stay fixed.

_C03_X = torch.randn(6, 3, 8, 8, generator=_gen(4021)) * 2.0 + 0.7
_C03_Y = torch.randint(0, 4, (6,), generator=_gen(4022))


def _c03_setup(bug: bool):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.SiLU()),   # model.0 (frozen)
        nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.SiLU()),   # model.1 (trained)
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))
    freeze = ["0."]
    for name, p in model.named_parameters():
        if any(name.startswith(f) for f in freeze):
            p.requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05, momentum=0.9)

    def step() -> torch.Tensor:
        model.train()
        if not bug:
            for name, m in model.named_modules():
                if isinstance(m, nn.BatchNorm2d) and any(f"{name}.".startswith(f) for f in freeze):
                    m.eval()
        opt.zero_grad()
        loss = F.cross_entropy(model(_C03_X), _C03_Y)
        loss.backward()
        opt.step()
        return loss

    return model, opt, step


def _c03_build(bug: bool) -> Case:
    model, opt, step = _c03_setup(bug)
    return model, step, _kw(optimizer=opt, inputs={"images": _C03_X, "labels": _C03_Y})


def _c03_proof(bug: bool) -> bool:
    """Did the running statistics of the frozen layer's BatchNorm change during a training step?"""
    model, _, step = _c03_setup(bug)
    bn = model[0][1]
    mean0, var0 = bn.running_mean.clone(), bn.running_var.clone()
    step()
    return bool((bn.running_mean - mean0).abs().max() > 1e-6 or (bn.running_var - var0).abs().max() > 1e-6)


# --------------------------------------------------------------------------------------------- case-04
# deepchem/deepchem PR #4888 "Loss corrections - KL Divergence": VAE_KLDivergence treated the encoder's log-variance
# output as a standard deviation, computing 0.5 * mean(mu^2 + logvar^2 - log(logvar^2) - 1) instead of the closed-form
# Gaussian KL 0.5 * mean(mu^2 + exp(logvar) - logvar - 1). The term is still a positive number that training lowers, so
# the ELBO curve looks fine, but its minimum is not the prior (it pushes logvar to +-1 instead of 0) and its gradients
# are wrong throughout. Fix in the PR: the exp(logvar) - logvar form.

_C04_X = torch.randn(8, 16, generator=_gen(4031))


class _VAE(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(16, 8)
        self.dec = nn.Linear(4, 16)

    def forward(self, x, eps):
        mu, logvar = self.enc(x).chunk(2, dim=-1)
        z = mu + torch.exp(0.5 * logvar) * eps
        return self.dec(z), mu, logvar


def _c04_kl(bug: bool):
    if bug:
        def kl(mu, logvar):
            std = logvar  # the log-variance passed where a standard deviation is expected
            return 0.5 * torch.mean(mu.pow(2) + std.pow(2) - torch.log(1e-20 + std.pow(2)) - 1)
    else:
        def kl(mu, logvar):
            return 0.5 * torch.mean(mu.pow(2) + torch.exp(logvar) - logvar - 1)
    return kl


def _c04_setup(bug: bool):
    torch.manual_seed(0)
    model = _VAE().train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    kl = _c04_kl(bug)
    eps = torch.randn(8, 4, generator=_gen(4032))

    def step() -> torch.Tensor:
        opt.zero_grad()
        recon, mu, logvar = model(_C04_X, eps)
        loss = F.mse_loss(recon, _C04_X) + kl(mu, logvar)
        loss.backward()
        opt.step()
        return loss

    return model, opt, step, kl


def _c04_build(bug: bool) -> Case:
    model, opt, step, _ = _c04_setup(bug)
    return model, step, _kw(optimizer=opt, inputs={"x": _C04_X})


def _c04_proof(bug: bool) -> bool:
    """Is the KL term nonzero, or its gradient nonzero, at the prior itself (mu = 0, logvar = 0)?"""
    kl = _c04_kl(bug)
    mu = torch.zeros(8, 4, requires_grad=True)
    logvar = torch.full((8, 4), 1e-3, requires_grad=True)  # at (numerically next to) the prior
    val = kl(mu, logvar)
    g = torch.autograd.grad(val, logvar)[0]
    return bool(val.abs() > 1e-3 or g.abs().max() > 1e-3)


# --------------------------------------------------------------------------------------------- case-05
# castorini/howl PR #47 "Fix training with ctc loss": the keyword-spotting model's outputs are laid out as the n
# keyword labels first, then an out-of-vocabulary label, then a blank, but the CTC loss was called with the default
# blank=0, which is the first keyword's label. Every occurrence of that keyword in the targets is then the CTC blank:
# the loss still falls, but the model is never trained to emit keyword 0 and the true blank column is trained as an
# ordinary label. Fix in the PR: blank set to the last index (n + 1).

_C05_N_WORDS = 3
_C05_CLASSES = _C05_N_WORDS + 2  # keywords 0..n-1, oov n, blank n+1
_C05_FEATS = torch.randn(4, 20, 10, generator=_gen(4041))
_C05_TARGETS = torch.tensor([[0, 3, 1], [2, 0, 3], [1, 2, 0], [0, 1, 2]])
_C05_TARGET_LENS = torch.tensor([3, 3, 3, 3])
_C05_INPUT_LENS = torch.tensor([20, 20, 20, 20])


class _KWS(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(10, 24, batch_first=True)
        self.out = nn.Linear(24, _C05_CLASSES)

    def forward(self, x):
        return self.out(self.rnn(x)[0])


def _c05_setup(bug: bool):
    torch.manual_seed(0)
    model = _KWS().train()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    blank = 0 if bug else _C05_CLASSES - 1
    seen: dict[str, torch.Tensor] = {}

    def step() -> torch.Tensor:
        opt.zero_grad()
        log_probs = model(_C05_FEATS).log_softmax(-1).transpose(0, 1)  # (T, N, C)
        log_probs.retain_grad()
        loss = F.ctc_loss(log_probs, _C05_TARGETS, _C05_INPUT_LENS, _C05_TARGET_LENS, blank=blank,
                          zero_infinity=True)
        loss.backward()
        seen["grad"] = log_probs.grad.detach().clone()
        opt.step()
        return loss

    return model, opt, step, seen


def _c05_build(bug: bool) -> Case:
    model, opt, step, _ = _c05_setup(bug)
    return model, step, _kw(optimizer=opt, inputs={"features": _C05_FEATS, "targets": _C05_TARGETS})


def _c05_proof(bug: bool) -> bool:
    """Is the reserved blank output only ever pushed down (never the blank CTC aligns to), as with a plain unused label?"""
    _, _, step, seen = _c05_setup(bug)
    step()
    reserved = seen["grad"][..., _C05_CLASSES - 1]
    # with the true blank, CTC pulls the blank column up at many frames (negative loss gradient on its log-prob)
    return bool(reserved.min() >= 0)


CASES: list[BlindCase] = [
    BlindCase("b40b-01", "https://github.com/roboflow/rf-detr/pull/59", "EMA warm-up tau ignored",
              "The model EMA ignores its tau warm-up and uses decay 0.9997 from step one, so the EMA weights stay at "
              "the untrained initialisation while the live model trains.", _c01_build, _c01_proof,
              known_miss="an EMA warm-up whose tau is ignored: a copy's decay schedule is not walked"),
    BlindCase("b40b-02", "https://github.com/Lightning-AI/pytorch-lightning/issues/557",
              "GAN discriminator gradients leak",
              "The discriminator's gradients from the generator step are not cleared, so its update adds the "
              "generator loss's gradients to its own.", _c02_build, _c02_proof),
    BlindCase("b40b-03", "https://github.com/ultralytics/ultralytics/pull/8753", "frozen BatchNorm stats still update",
              "Frozen layers' BatchNorm modules run in train mode, so their running statistics are overwritten by the "
              "new data although their weights are frozen.", _c03_build, _c03_proof,
              known_miss="frozen BatchNorm statistics still updated: MODE-003 reports a frozen fragment's running statistics at INFO"),
    BlindCase("b40b-04", "https://github.com/deepchem/deepchem/pull/4888", "VAE KL formula wrong",
              "The KL term treats the log-variance as a standard deviation, so the VAE is regularised toward the "
              "wrong posterior with wrong gradients.", _c04_build, _c04_proof,
              known_miss="a VAE KL formula written wrongly: arithmetic inside the loss"),
    BlindCase("b40b-05", "https://github.com/castorini/howl/pull/47", "CTC blank index collides",
              "CTC uses the default blank=0, which is a real keyword label, so that keyword is never learned and the "
              "reserved blank output is never trained as blank.", _c05_build, _c05_proof,
              known_miss="a CTC blank index that collides with a real label: which id means blank is label semantics"),
]
