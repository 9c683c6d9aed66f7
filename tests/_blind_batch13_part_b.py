"""Blind batch 13, part b: silent training bugs from public GitHub threads outside NLP, each with its fixed twin.

Collected by someone who does not write the audit's checks. Every case builds the user's setup on a tiny real
model in plain torch (a message-passing GNN regressing graph energies, a capsule network with dynamic routing, a
small conv classifier pruned and sped up before fine-tuning, an A2C actor-critic on batched env rollouts with GAE, and
an ESRGAN-style RRDB generator with a VGG-style discriminator under a GradScaler; nothing is downloaded) and proves
the bug without the audit on real runs and real tensors.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw, _llama_config, _sgd_step  # noqa: F401

# --------------------------------------------------------------------------------------------- case-06
# materials GNN energy regression: graph readout is (B,), labels come out of the pipeline as (B, 1); MSELoss
# broadcasts to (B, B) and every prediction is pulled toward every graph's label

_C06_NATOMS = [3, 5, 4, 6]
_C06_B, _C06_D = len(_C06_NATOMS), 8
_C06_BATCH = torch.cat([torch.full((n,), i) for i, n in enumerate(_C06_NATOMS)])
_C06_X = torch.randn(int(_C06_BATCH.numel()), _C06_D, generator=_gen(1301))


def _c06_edges() -> torch.Tensor:
    src, dst, start = [], [], 0
    for n in _C06_NATOMS:
        for i in range(n):
            for j in range(n):
                if i != j:
                    src.append(start + i)
                    dst.append(start + j)
        start += n
    return torch.tensor([src, dst])


_C06_EDGES = _c06_edges()
_C06_Y = torch.tensor([[-1.5], [2.0], [0.5], [3.0]])  # (B, 1): how the labels come out of the data pipeline


class _EnergyGNN(nn.Module):
    """Atoms as nodes, two sum-aggregation message-passing layers, per-atom energies summed per graph."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(_C06_D, 32)
        self.msg1, self.upd1 = nn.Linear(32, 32), nn.Linear(64, 32)
        self.msg2, self.upd2 = nn.Linear(32, 32), nn.Linear(64, 32)
        self.atom_energy = nn.Sequential(nn.Linear(32, 32), nn.SiLU(), nn.Linear(32, 1))

    def _mp(self, h: torch.Tensor, edges: torch.Tensor, msg: nn.Linear, upd: nn.Linear) -> torch.Tensor:
        m = torch.zeros_like(h).index_add_(0, edges[1], msg(h)[edges[0]])
        return h + F.silu(upd(torch.cat([h, m], dim=-1)))

    def forward(self, x: torch.Tensor, edges: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.embed(x))
        h = self._mp(h, edges, self.msg1, self.upd1)
        h = self._mp(h, edges, self.msg2, self.upd2)
        e_atom = self.atom_energy(h).squeeze(-1)
        n_graphs = int(batch.max()) + 1
        return torch.zeros(n_graphs).index_add_(0, batch, e_atom)  # (B,) graph energies


def _c06_loss(model: nn.Module, bug: bool) -> torch.Tensor:
    pred = model(_C06_X, _C06_EDGES, _C06_BATCH)
    if not bug:  # the fix: reshape the model outputs to the label shape before the loss
        pred = pred.reshape(_C06_Y.shape)
    return F.mse_loss(pred, _C06_Y)


def _c06_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _EnergyGNN().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, _sgd_step(model, opt, lambda: _c06_loss(model, bug)), \
        _kw(optimizer=opt, inputs=(_C06_X, _C06_EDGES, _C06_BATCH))


def _c06_proof(bug: bool) -> bool:
    """The gradient the loss sends to each graph's predicted energy is not 2/B * (pred_i - y_i), the per-graph
    MSE gradient: with the (B,) vs (B, 1) broadcast it is 2/B * (pred_i - mean(y)), so every graph is fitted to
    the batch-mean label."""
    model, _, _ = _c06_build(bug)
    pred = model(_C06_X, _C06_EDGES, _C06_BATCH).detach().requires_grad_(True)
    p = pred if bug else pred.reshape(_C06_Y.shape)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        F.mse_loss(p, _C06_Y).backward()
    assert pred.grad is not None
    want = 2.0 / _C06_B * (pred.detach() - _C06_Y.squeeze(-1))
    return not torch.allclose(pred.grad, want, atol=1e-6)


# --------------------------------------------------------------------------------------------- case-07
# CapsNet dynamic routing: F.softmax(b_ij.unsqueeze(0)) without dim normalises over the input capsules, not over
# the output capsules each input capsule routes to

_C07_B, _C07_CLASSES = 6, 5
_C07_IMG = torch.rand(_C07_B, 1, 12, 12, generator=_gen(1311))
_C07_Y = torch.tensor([0, 1, 2, 3, 4, 0])


def _c07_squash(s: torch.Tensor, dim: int) -> torch.Tensor:
    n2 = (s ** 2).sum(dim=dim, keepdim=True)
    return n2 / (1 + n2) * s / torch.sqrt(n2 + 1e-9)


class _DigitCaps(nn.Module):
    def __init__(self, in_caps: int, in_size: int, out_caps: int, out_size: int, implicit_dim: bool) -> None:
        super().__init__()
        self.in_caps, self.out_caps, self.implicit_dim = in_caps, out_caps, implicit_dim
        self.W = nn.Parameter(torch.empty(in_caps, out_caps, out_size, in_size).uniform_(-in_caps ** -0.5,
                                                                                          in_caps ** -0.5))
        self.last_c: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, iters: int = 3) -> torch.Tensor:
        b = x.size(0)
        x = torch.stack([x] * self.out_caps, dim=2)  # [B, in, out, in_size]
        u_hat = torch.matmul(self.W.unsqueeze(0), x.unsqueeze(4))  # [B, in, out, out_size, 1]
        u_det = u_hat.detach()
        b_ij = torch.zeros(self.in_caps, self.out_caps, 1)
        v_j = u_hat.new_zeros(())
        for it in range(iters):
            if self.implicit_dim:
                c_ij = F.softmax(b_ij.unsqueeze(0))  # the report: implicit dim picks dim 1 (input capsules)
            else:
                c_ij = F.softmax(b_ij.unsqueeze(0), dim=2)  # the fix: over the output capsules
            self.last_c = c_ij.detach()
            c_ij = torch.cat([c_ij] * b, dim=0).unsqueeze(4)
            if it == iters - 1:
                v_j = _c07_squash((c_ij * u_hat).sum(dim=1, keepdim=True), dim=3)
            else:
                v_j = _c07_squash((c_ij * u_det).sum(dim=1, keepdim=True), dim=3)
                b_ij = b_ij + torch.matmul(u_det.transpose(3, 4), v_j).squeeze(4).mean(dim=0)
        return v_j.squeeze(4).squeeze(1)  # [B, out_caps, out_size]


class _CapsNet(nn.Module):
    def __init__(self, implicit_dim: bool) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 5)  # 12 -> 8
        self.primary = nn.Conv2d(16, 4 * 8, 3, stride=2)  # 8 -> 3: 4 capsule maps of 8-D capsules
        self.digit = _DigitCaps(4 * 3 * 3, 8, _C07_CLASSES, 8, implicit_dim)

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.conv1(img))
        u = self.primary(h).view(img.size(0), 4, 8, 3, 3).permute(0, 1, 3, 4, 2).reshape(img.size(0), -1, 8)
        return self.digit(_c07_squash(u, dim=-1))


def _c07_margin_loss(v: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    length = v.norm(dim=-1)
    t = F.one_hot(y, _C07_CLASSES).float()
    loss = t * F.relu(0.9 - length) ** 2 + 0.5 * (1 - t) * F.relu(length - 0.1) ** 2
    return loss.sum(dim=1).mean()


def _c07_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _CapsNet(implicit_dim=bug).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    return model, _sgd_step(model, opt, lambda: _c07_margin_loss(model(_C07_IMG), _C07_Y)), \
        _kw(optimizer=opt, inputs=_C07_IMG)


def _c07_proof(bug: bool) -> bool:
    """The routing coupling coefficients of each input capsule should be a distribution over the output capsules
    (sum to 1 over dim 2); with the implicit softmax dim they sum to 1 over the input capsules instead."""
    model, _, _ = _c07_build(bug)
    with torch.no_grad():
        model(_C07_IMG)
    c = cast(_CapsNet, model).digit.last_c
    assert c is not None
    return not torch.allclose(c.sum(dim=2), torch.ones_like(c.sum(dim=2)), atol=1e-5)


# --------------------------------------------------------------------------------------------- case-08
# channel pruning with model speedup: the pruned layers are replaced by smaller new modules, but fine-tuning keeps
# the optimizer built before speedup, which still holds the old (now orphaned) parameters

_C08_IMG = torch.randn(8, 3, 16, 16, generator=_gen(1321))
_C08_Y = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])


class _SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.conv2, self.bn2 = nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32)
        self.fc = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.relu(self.bn2(self.conv2(x)))
        return self.fc(x.mean(dim=(2, 3)))


def _c08_speedup(model: _SmallCNN, keep: int) -> None:
    """Physically remove the conv1 filters with the smallest L1 norm: new, smaller conv1 / bn1 / conv2 modules
    with the kept weights copied in (what a pruning tool's model speedup does)."""
    idx = model.conv1.weight.detach().abs().sum(dim=(1, 2, 3)).argsort(descending=True)[:keep].sort().values
    c1, b1, c2 = nn.Conv2d(3, keep, 3, padding=1), nn.BatchNorm2d(keep), nn.Conv2d(keep, 32, 3, padding=1)
    def t(x: Any) -> torch.Tensor:
        return cast(torch.Tensor, x)

    with torch.no_grad():
        c1.weight.copy_(model.conv1.weight[idx])
        t(c1.bias).copy_(t(model.conv1.bias)[idx])
        b1.weight.copy_(model.bn1.weight[idx])
        b1.bias.copy_(model.bn1.bias[idx])
        t(b1.running_mean).copy_(t(model.bn1.running_mean)[idx])
        t(b1.running_var).copy_(t(model.bn1.running_var)[idx])
        c2.weight.copy_(model.conv2.weight[:, idx])
        t(c2.bias).copy_(t(model.conv2.bias))
    model.conv1, model.bn1, model.conv2 = c1, b1, c2


def _c08_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _SmallCNN().train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
    _sgd_step(model, opt, lambda: F.cross_entropy(model(_C08_IMG), _C08_Y))()  # (pre-)training before pruning
    _c08_speedup(model, keep=10)
    if not bug:  # the fix: a new optimizer over the sped-up model's parameters for fine-tuning
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
    return model, _sgd_step(model, opt, lambda: F.cross_entropy(model(_C08_IMG), _C08_Y)), \
        _kw(optimizer=opt, inputs=_C08_IMG)


def _c08_proof(bug: bool) -> bool:
    """After a fine-tuning step the replaced layers (conv1, bn1, conv2) have gradients but their weights are
    exactly unchanged: the optimizer steps the orphaned pre-speedup tensors instead."""
    model, step, _ = _c08_build(bug)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if n.split(".")[0] in ("conv1", "conv2")}
    step()
    params = dict(model.named_parameters())
    grads = [params[n].grad for n in before if n.endswith("weight")]
    has_grad = all(g is not None and float(g.abs().sum()) > 0 for g in grads)
    return has_grad and all(torch.equal(params[n].detach(), v) for n, v in before.items())


# --------------------------------------------------------------------------------------------- case-09
# vectorised-env A2C with GAE: the critic loss is advantages.pow(2).mean() with the advantages built from the
# value predictions with gradients on, so the critic is trained through its own bootstrapped targets

_C09_T, _C09_ENVS, _C09_OBS, _C09_ACT = 6, 3, 8, 4
_C09_STATES = torch.randn(_C09_T * _C09_ENVS, _C09_OBS, generator=_gen(1331))
_C09_ACTIONS = torch.randint(0, _C09_ACT, (_C09_T, _C09_ENVS), generator=_gen(1332))
_C09_REWARDS = torch.randn(_C09_T, _C09_ENVS, generator=_gen(1333))
_C09_MASKS = (torch.rand(_C09_T, _C09_ENVS, generator=_gen(1334)) > 0.15).float()  # 0 where an episode ended
_C09_GAMMA, _C09_LAM, _C09_ENT = 0.999, 0.95, 0.01


class _A2C(nn.Module):
    """Separate actor and critic MLPs over the batched env states."""

    def __init__(self) -> None:
        super().__init__()
        self.critic = nn.Sequential(nn.Linear(_C09_OBS, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                                    nn.Linear(32, 1))
        self.actor = nn.Sequential(nn.Linear(_C09_OBS, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                                   nn.Linear(32, _C09_ACT))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.critic(x).squeeze(-1), self.actor(x)


def _c09_losses(value_preds: torch.Tensor, log_probs: torch.Tensor, entropy: torch.Tensor,
                bug: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    advantages = torch.zeros(_C09_T, _C09_ENVS)
    gae: Any = 0.0
    for t in reversed(range(_C09_T - 1)):
        td_error = _C09_REWARDS[t] + _C09_GAMMA * _C09_MASKS[t] * value_preds[t + 1] - value_preds[t]
        gae = td_error + _C09_GAMMA * _C09_LAM * _C09_MASKS[t] * gae
        if not bug:
            gae = gae.detach()
        advantages[t] = gae
    if bug:  # the tutorial: regress the advantages themselves to zero, through the whole GAE chain
        critic_loss = advantages.pow(2).mean()
    else:  # the fix: regress V(s_t) to a fixed target
        value_targets = advantages + value_preds.detach()
        critic_loss = (value_targets - value_preds).pow(2).mean()
    actor_loss = -(advantages.detach() * log_probs).mean() - _C09_ENT * entropy.mean()
    return critic_loss, actor_loss, advantages


def _c09_forward(model: _A2C) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    values, logits = model(_C09_STATES)
    dist = torch.distributions.Categorical(logits=logits.view(_C09_T, _C09_ENVS, _C09_ACT))
    return values.view(_C09_T, _C09_ENVS), dist.log_prob(_C09_ACTIONS), dist.entropy()


def _c09_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _A2C().train()
    # one optimizer, the tutorial's two learning rates as parameter groups (critic 5e-3, actor 1e-3)
    opt = torch.optim.RMSprop([{"params": model.critic.parameters(), "lr": 5e-3},
                               {"params": model.actor.parameters(), "lr": 1e-3}])

    def loss_fn() -> torch.Tensor:
        critic_loss, actor_loss, _ = _c09_losses(*_c09_forward(model), bug)
        return critic_loss + actor_loss

    return model, _sgd_step(model, opt, loss_fn), _kw(optimizer=opt, inputs=_C09_STATES)


def _c09_proof(bug: bool) -> bool:
    """The critic-loss gradient on each value prediction is not the TD semi-gradient -2/N * A_t (regressing V(s_t)
    toward a fixed target): it also flows into V(s_{t+1}) through the bootstrapped targets."""
    model, _, _ = _c09_build(bug)
    values, log_probs, entropy = _c09_forward(cast(_A2C, model))
    values = values.detach().requires_grad_(True)
    critic_loss, _, adv = _c09_losses(values, log_probs.detach(), entropy.detach(), bug)
    (grad,) = torch.autograd.grad(critic_loss, values)
    want = -2.0 / values.numel() * adv.detach()
    return not torch.allclose(grad, want, atol=1e-7)


# --------------------------------------------------------------------------------------------- case-10
# ESRGAN super-resolution GAN under AMP: the epoch loop passes g_optimizer in the d_optimizer slot, so the
# discriminator step steps the generator's optimizer again and the discriminator is never updated

_C10_LR = torch.rand(4, 3, 8, 8, generator=_gen(1341))
_C10_GT = F.interpolate(_C10_LR, scale_factor=2, mode="bicubic", align_corners=False).clamp(0, 1) \
    + 0.05 * torch.randn(4, 3, 16, 16, generator=_gen(1342))


class _RDB(nn.Module):
    def __init__(self, nf: int, gc: int) -> None:
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(nf, gc, 3, padding=1), nn.Conv2d(nf + gc, gc, 3, padding=1)
        self.c3 = nn.Conv2d(nf + 2 * gc, nf, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1 = F.leaky_relu(self.c1(x), 0.2)
        x2 = F.leaky_relu(self.c2(torch.cat([x, x1], 1)), 0.2)
        return x + 0.2 * self.c3(torch.cat([x, x1, x2], 1))


class _RRDBNet(nn.Module):
    """A two-block residual-in-residual dense generator with x2 nearest-neighbour upsampling."""

    def __init__(self, nf: int = 16) -> None:
        super().__init__()
        self.conv_first = nn.Conv2d(3, nf, 3, padding=1)
        self.trunk = nn.Sequential(_RDB(nf, 8), _RDB(nf, 8))
        self.conv_trunk = nn.Conv2d(nf, nf, 3, padding=1)
        self.up = nn.Conv2d(nf, nf, 3, padding=1)
        self.conv_last = nn.Conv2d(nf, 3, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = self.conv_first(x)
        f = f + self.conv_trunk(self.trunk(f))
        f = F.leaky_relu(self.up(F.interpolate(f, scale_factor=2, mode="nearest")), 0.2)
        return self.conv_last(f)


class _VGGDisc(nn.Module):
    def __init__(self, nf: int = 16) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, nf, 3, padding=1), nn.LeakyReLU(0.2),
            nn.Conv2d(nf, nf, 4, 2, 1, bias=False), nn.BatchNorm2d(nf), nn.LeakyReLU(0.2),
            nn.Conv2d(nf, 2 * nf, 3, padding=1, bias=False), nn.BatchNorm2d(2 * nf), nn.LeakyReLU(0.2),
            nn.Conv2d(2 * nf, 2 * nf, 4, 2, 1, bias=False), nn.BatchNorm2d(2 * nf), nn.LeakyReLU(0.2))
        self.classifier = nn.Sequential(nn.Linear(2 * nf * 4 * 4, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).flatten(1))


class _ESRGAN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.g_model, self.d_model = _RRDBNet(), _VGGDisc()

    def forward(self, lr: torch.Tensor) -> torch.Tensor:
        return self.g_model(lr)


class _ContentLoss(nn.Module):
    """Feature-space L1 on a frozen conv feature extractor (stands in for the frozen VGG19 layers)."""

    def __init__(self) -> None:
        super().__init__()
        self.fe = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1)).eval()
        for p in self.fe.parameters():
            p.requires_grad = False

    def forward(self, sr: torch.Tensor, gt: torch.Tensor) -> torch.Tensor:
        return F.l1_loss(self.fe(sr), self.fe(gt))


def _c10_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _ESRGAN().train()
    g_model, d_model = model.g_model, model.d_model
    content_criterion = _ContentLoss()
    adversarial_criterion = nn.BCEWithLogitsLoss()
    g_optimizer = torch.optim.Adam(g_model.parameters(), lr=1e-4, betas=(0.9, 0.99))
    d_optimizer = torch.optim.Adam(d_model.parameters(), lr=1e-4, betas=(0.9, 0.99))
    scaler = torch.amp.GradScaler("cpu")
    real_label, fake_label = torch.ones(4, 1), torch.zeros(4, 1)
    pixel_w, content_w, adv_w = 0.01, 1.0, 0.005
    # the report: train(..., g_optimizer, g_optimizer, ...); the fix passes d_optimizer in the second slot
    d_opt_used = g_optimizer if bug else d_optimizer

    def step() -> torch.Tensor:
        lr, gt = _C10_LR, _C10_GT
        for p in d_model.parameters():
            p.requires_grad = False
        g_model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            sr = g_model(lr)
            gt_output = d_model(gt.detach().clone())
            sr_output = d_model(sr)
            pixel_loss = F.l1_loss(sr.float(), gt)
            content_loss = content_criterion(sr, gt)
            d_loss_gt = adversarial_criterion(gt_output - torch.mean(sr_output), fake_label) * 0.5
            d_loss_sr = adversarial_criterion(sr_output - torch.mean(gt_output), real_label) * 0.5
            g_loss = pixel_w * pixel_loss + content_w * content_loss + adv_w * (d_loss_gt + d_loss_sr)
        scaler.scale(g_loss).backward()
        scaler.step(g_optimizer)
        scaler.update()

        for p in d_model.parameters():
            p.requires_grad = True
        d_model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            gt_output = d_model(gt)
            sr_output = d_model(sr.detach().clone())
            d_loss_gt = adversarial_criterion(gt_output - torch.mean(sr_output), real_label) * 0.5
        scaler.scale(d_loss_gt).backward(retain_graph=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            sr_output = d_model(sr.detach().clone())
            d_loss_sr = adversarial_criterion(sr_output - torch.mean(gt_output), fake_label) * 0.5
        scaler.scale(d_loss_sr).backward()
        scaler.step(d_opt_used)
        scaler.update()
        return g_loss

    return model, step, _kw(optimizer=g_optimizer, inputs=_C10_LR, scaler=scaler)


def _c10_proof(bug: bool) -> bool:
    """After a full generator + discriminator iteration the discriminator has non-zero gradients from its loss
    but not one of its weights has changed: no optimizer over its parameters is ever stepped."""
    model, step, _ = _c10_build(bug)
    d_model = cast(_ESRGAN, model).d_model
    before = [p.detach().clone() for p in d_model.parameters()]
    step()
    grads = [p.grad for p in d_model.parameters()]
    has_grad = all(g is not None for g in grads) and sum(float(g.abs().sum()) for g in grads if g is not None) > 0
    unchanged = all(torch.equal(b, p.detach()) for b, p in zip(before, d_model.parameters()))
    return has_grad and unchanged


CASES: list[BlindCase] = [
    BlindCase("b13-case-06", "https://github.com/IntelLabs/matsciml/pull/347", "loss / shape broadcasting",
              "the graph-level energy readout is (B,) while the labels are (B, 1): MSELoss broadcasts to a (B, B) "
              "matrix and trains every graph toward the mean label of the batch instead of its own, with only a "
              "UserWarning in the log", _c06_build, _c06_proof),
    BlindCase("b13-case-07", "https://github.com/motokimura/capsnet_pytorch/pull/1", "softmax over the wrong dim",
              "the dynamic-routing softmax is called without dim and normalises the coupling coefficients over the "
              "input capsules instead of over the output capsules, so routing weights are tiny and do not form a "
              "distribution per input capsule while the margin loss still trains", _c07_build, _c07_proof,
              known_miss="blind batch 13: the routing softmax normalises over the wrong axis of an intermediate tensor; no invariant knows which axis a softmax inside the model must normalise"),
    BlindCase("b13-case-08", "https://github.com/microsoft/nni/issues/4521", "optimizer holds stale parameters",
              "after pruning speedup swaps conv1/bn1/conv2 for smaller new modules, fine-tuning reuses the optimizer "
              "created before the swap: the new layers get gradients but are never updated, only the untouched "
              "head trains and the loss still moves", _c08_build, _c08_proof),
    BlindCase("b13-case-09", "https://github.com/Farama-Foundation/Gymnasium/issues/1494", "RL / target not detached",
              "the A2C critic loss is the squared GAE advantage with the value predictions still attached inside the "
              "bootstrapped targets, so the critic is pushed to move V(s_{t+1}) toward V(s_t) as well as fitting "
              "returns, instead of regressing V(s_t) to a fixed target", _c09_build, _c09_proof,
              known_miss="blind batch 13: a TD target computed by the trained critic itself is not judged (see b11-case-13)"),
    BlindCase("b13-case-10", "https://github.com/Lornatang/ESRGAN-PyTorch/issues/39", "GAN / wrong optimizer stepped",
              "the training loop is called with g_optimizer for both the generator and the discriminator slot: "
              "the discriminator step re-steps the generator and the discriminator is never updated, while both "
              "losses keep printing plausible values", _c10_build, _c10_proof),
]
