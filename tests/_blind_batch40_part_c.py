"""Blind batch 40 (part c): silent training bugs from other domains (RL, recommendation, graphs, tabular, time
series) and training-loop plumbing (resume, AMP clipping), each with its fixed twin.

Every case builds the user's setup on a tiny plain-torch model (nothing downloaded) and proves the bug without the
audit on real tensors and real steps.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw

# --------------------------------------------------------------------------------------------- case-01
# cyoon1729/deep-Q-networks PR #5 ("Fix perdqn's loss by adding done_mask"): the prioritized-replay DQN computes its TD
# target as `reward + gamma * max_a Q_target(next_state, a)` for every sampled transition, terminal ones included, so
# the value of a state after which the episode ended is bootstrapped from a meaningless next state. The loss is an
# ordinary MSE that falls as usual; the Q-function just learns wrong values near episode ends. Fix in the PR: multiply
# the bootstrap by `(1 - done)` so a terminal transition's target is the reward alone.

_C01_S = torch.randn(16, 4, generator=_gen(4001))
_C01_S2 = torch.randn(16, 4, generator=_gen(4002))
_C01_A = torch.randint(0, 2, (16,), generator=_gen(4003))
_C01_R = torch.randn(16, generator=_gen(4004))
_C01_DONE = (torch.arange(16) % 4 == 3).float()
_C01_GAMMA = 0.99


def _c01_setup(bug: bool):
    torch.manual_seed(0)
    q_net = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 2))
    target_net = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 2))
    target_net.load_state_dict(q_net.state_dict())
    target_net.requires_grad_(False)
    opt = torch.optim.Adam(q_net.parameters(), lr=1e-3)

    def td_target() -> torch.Tensor:
        with torch.no_grad():
            next_q = target_net(_C01_S2).max(dim=1).values
        if bug:
            return _C01_R + _C01_GAMMA * next_q
        return _C01_R + _C01_GAMMA * next_q * (1 - _C01_DONE)

    def step() -> torch.Tensor:
        opt.zero_grad()
        q = q_net(_C01_S).gather(1, _C01_A.unsqueeze(1)).squeeze(1)
        loss = F.mse_loss(q, td_target())
        loss.backward()
        opt.step()
        return loss

    return q_net, opt, step, td_target


def _c01_build(bug: bool) -> Case:
    model, opt, step, _ = _c01_setup(bug)
    return model, step, _kw(optimizer=opt, inputs={"state": _C01_S})


def _c01_proof(bug: bool) -> bool:
    """After a step, is the TD target of a terminal transition anything other than its reward?"""
    _, _, step, td_target = _c01_setup(bug)
    step()
    term = _C01_DONE.bool()
    return bool((td_target()[term] - _C01_R[term]).abs().max() > 1e-6)


# --------------------------------------------------------------------------------------------- case-02
# datawhalechina/torch-rechub PR #176 (fixes issue #114): sequence features (a user's item history) are padded with id
# 0, but the embedding initializers built `nn.Embedding` without `padding_idx`, so id 0 is an ordinary, randomly
# initialised and trained item. Sum/mean pooling of the history then mixes a learned "padding item" into every short
# user's representation, and the padding row is updated by every batch. Nothing errors; CTR training proceeds. Fix in
# the PR: pass `padding_idx` through to the embedding layer and zero that row.

_C02_ITEMS = 30
_C02_HIST = torch.randint(1, _C02_ITEMS, (8, 6), generator=_gen(4011))
for _i, _n in enumerate([6, 3, 2, 5, 1, 4, 2, 3]):
    _C02_HIST[_i, _n:] = 0
_C02_TARGET = torch.randint(1, _C02_ITEMS, (8,), generator=_gen(4012))
_C02_Y = torch.randint(0, 2, (8,), generator=_gen(4013)).float()


class _HistPoolCTR(nn.Module):
    """YouTube-DNN-style tower: sum-pooled history embedding dotted with the target item's embedding."""

    def __init__(self, padding_idx: int | None) -> None:
        super().__init__()
        self.item_emb = nn.Embedding(_C02_ITEMS, 16, padding_idx=padding_idx)
        self.user_mlp = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))

    def forward(self, hist: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        user = self.user_mlp(self.item_emb(hist).sum(dim=1))
        return (user * self.item_emb(target)).sum(dim=-1)


def _c02_setup(bug: bool):
    torch.manual_seed(0)
    model = _HistPoolCTR(padding_idx=None if bug else 0).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(model(_C02_HIST, _C02_TARGET), _C02_Y)
        loss.backward()
        opt.step()
        return loss

    return model, opt, step


def _c02_build(bug: bool) -> Case:
    model, opt, step = _c02_setup(bug)
    return model, step, _kw(optimizer=opt, inputs={"hist": _C02_HIST, "target": _C02_TARGET})


def _c02_proof(bug: bool) -> bool:
    """Does the padding id receive gradient, i.e. does padding move the model's output?"""
    model, _, step = _c02_setup(bug)
    step()
    model.zero_grad()
    F.binary_cross_entropy_with_logits(model(_C02_HIST, _C02_TARGET), _C02_Y).backward()
    return bool(model.item_emb.weight.grad[0].abs().max() > 0 or model.item_emb.weight[0].abs().max() > 0)


# --------------------------------------------------------------------------------------------- case-03
# pyg-team/pytorch_geometric issue #1104: TAGConv normalised its adjacency with GCNConv.norm, which adds self-loops,
# while TAGConv's formula (and its own, unused, norm function) propagates with D^-1/2 A D^-1/2 and no self-loops. Every
# hop k then mixes each node's own features back in: a different operator than the paper's, trained without any error.
# Fix (master, per the maintainer): normalise without self-loops. Reproduced as a dense plain-torch TAGConv (K=2).

_C03_N = 6
_C03_EDGES = [(i, (i + 1) % _C03_N) for i in range(_C03_N)]
_C03_X = torch.randn(_C03_N, 8, generator=_gen(4021))
_C03_Y = torch.randint(0, 3, (_C03_N,), generator=_gen(4022))


def _c03_adj() -> torch.Tensor:
    a = torch.zeros(_C03_N, _C03_N)
    for i, j in _C03_EDGES:
        a[i, j] = a[j, i] = 1.0
    return a


class _DenseTAGConv(nn.Module):
    def __init__(self, adj: torch.Tensor, add_self_loops: bool, k: int = 2) -> None:
        super().__init__()
        a = adj + torch.eye(adj.shape[0]) if add_self_loops else adj
        d = a.sum(dim=1).pow(-0.5)
        self.register_buffer("a_norm", d[:, None] * a * d[None, :])
        self.lins = nn.ModuleList(nn.Linear(8, 3, bias=(i == 0)) for i in range(k + 1))

    def hop(self, x: torch.Tensor) -> torch.Tensor:
        return self.a_norm @ x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lins[0](x)
        for lin in self.lins[1:]:
            x = self.hop(x)
            out = out + lin(x)
        return out


def _c03_setup(bug: bool):
    torch.manual_seed(0)
    model = _DenseTAGConv(_c03_adj(), add_self_loops=bug).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=5e-4)

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(model(_C03_X), _C03_Y)
        loss.backward()
        opt.step()
        return loss

    return model, opt, step


def _c03_build(bug: bool) -> Case:
    model, opt, step = _c03_setup(bug)
    return model, step, _kw(optimizer=opt, inputs={"x": _C03_X})


def _c03_proof(bug: bool) -> bool:
    """On a graph without self-loops, does a node's one-hop feature depend on its own input features?"""
    model, _, step = _c03_setup(bug)
    step()
    x = _C03_X.clone().requires_grad_(True)
    model.hop(x)[0].sum().backward()
    return bool(x.grad[0].abs().max() > 1e-8)


# --------------------------------------------------------------------------------------------- case-04
# NVIDIA-NeMo/Automodel issue #763: after a refactor of checkpointing, resuming from a checkpoint restored the model
# weights but never called load_state_dict on the optimizer (and the step scheduler's counter came back at 0). The run
# continues with fresh Adam moments and the learning rate back at the schedule's step 0 (re-warmup on a trained model);
# the loss only wobbles. Fix in PR #764: restore optimizer and scheduler state on resume. Reproduced on a tabular MLP
# with AdamW and a linear warmup/decay LambdaLR.

_C04_X = torch.randn(32, 10, generator=_gen(4031))
_C04_Y = torch.randn(32, 1, generator=_gen(4032))
_C04_WARMUP, _C04_TOTAL, _C04_DONE_STEPS = 5, 50, 12


def _c04_lambda(step: int) -> float:
    if step < _C04_WARMUP:
        return (step + 1) / _C04_WARMUP
    return max(0.0, (_C04_TOTAL - step) / (_C04_TOTAL - _C04_WARMUP))


def _c04_parts():
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _c04_lambda)
    return model, opt, sched


def _c04_make_step(model, opt, sched):
    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = F.mse_loss(model(_C04_X), _C04_Y)
        loss.backward()
        opt.step()
        sched.step()
        return loss

    return step


_C04_CKPT: dict = {}


def _c04_checkpoint() -> dict:
    if not _C04_CKPT:
        torch.manual_seed(0)
        model, opt, sched = _c04_parts()
        step = _c04_make_step(model, opt, sched)
        for _ in range(_C04_DONE_STEPS):
            step()
        _C04_CKPT.update(model=model.state_dict(), optimizer=opt.state_dict(), scheduler=sched.state_dict(),
                         lr=opt.param_groups[0]["lr"])
    return _C04_CKPT


def _c04_setup(bug: bool):
    ckpt = _c04_checkpoint()
    torch.manual_seed(1)
    model, opt, sched = _c04_parts()
    model.load_state_dict(ckpt["model"])
    if not bug:
        opt.load_state_dict(ckpt["optimizer"])
        sched.load_state_dict(ckpt["scheduler"])
    return model, opt, sched, _c04_make_step(model, opt, sched), ckpt


def _c04_build(bug: bool) -> Case:
    model, opt, sched, step, _ = _c04_setup(bug)
    return model, step, _kw(optimizer=opt, inputs={"x": _C04_X}, lr_scheduler=sched, total_steps=_C04_TOTAL)


def _c04_proof(bug: bool) -> bool:
    """Does the resumed run start at another learning rate, or with empty Adam moments, than the checkpoint had?"""
    _, opt, _, _, ckpt = _c04_setup(bug)
    lr_off = not math.isclose(opt.param_groups[0]["lr"], ckpt["lr"], rel_tol=1e-9)
    return bool(lr_off or len(opt.state) == 0)


# --------------------------------------------------------------------------------------------- case-05
# Lightning-AI/pytorch-lightning issue #9599: with native AMP and gradient_clip_val, Lightning clipped the gradients
# right after backward, while they were still multiplied by the GradScaler's scale, and only unscaled them later in
# the optimizer step. Clipping the scaled norm to 1.0 and then dividing by the scale (65536) leaves an update ~1e5
# times too small; the loss just converges "very slowly". Fix (release 1.4.9): scaler.unscale_(optimizer) before
# clip_grad_norm_. Reproduced on a GRU time-series forecaster with CPU autocast and torch.amp.GradScaler.

_C05_X = torch.randn(8, 12, 3, generator=_gen(4041))
_C05_Y = torch.randn(8, 1, generator=_gen(4042))
_C05_CLIP = 1.0


class _GRUForecaster(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(3, 16, batch_first=True)
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.gru(x)
        return self.head(out[:, -1])


def _c05_setup(bug: bool):
    torch.manual_seed(0)
    model = _GRUForecaster().train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)

    def step() -> torch.Tensor:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            pred = model(_C05_X)
        loss = F.mse_loss(pred.float(), _C05_Y)
        scaler.scale(loss).backward()
        if not bug:
            scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), _C05_CLIP)
        scaler.step(opt)
        scaler.update()
        return loss

    return model, opt, step


def _c05_build(bug: bool) -> Case:
    model, opt, step = _c05_setup(bug)
    return model, step, _kw(optimizer=opt, inputs={"x": _C05_X})


def _c05_proof(bug: bool) -> bool:
    """After the step, is the gradient the optimizer applied far below both the clip value and the true gradient?"""
    model, _, step = _c05_setup(bug)
    step()
    applied = torch.sqrt(sum(p.grad.pow(2).sum() for p in model.parameters()))
    ref = _GRUForecaster()
    ref.load_state_dict(model.state_dict())
    F.mse_loss(ref(_C05_X), _C05_Y).backward()
    true = torch.sqrt(sum(p.grad.pow(2).sum() for p in ref.parameters()))
    return bool(applied < 1e-2 * min(float(true), _C05_CLIP))


CASES: list[BlindCase] = [
    BlindCase("b40c-01", "https://github.com/cyoon1729/deep-Q-networks/pull/5", "TD target ignores done",
              "The DQN's TD target bootstraps from the next state even on terminal transitions, so Q-values near "
              "episode ends are trained toward wrong targets.", _c01_build, _c01_proof,
              known_miss="a TD target that ignores the done flag: the estimator's arithmetic is outside the model"),
    BlindCase("b40c-02", "https://github.com/datawhalechina/torch-rechub/pull/176", "padding item embedding trained",
              "The history embedding lacks padding_idx, so the padding id 0 is a learned item pooled into every short "
              "user's representation and updated each batch.", _c02_build, _c02_proof,
              known_miss="a padding item embedding that trains: padding nothing declares in the item ids (no padding_idx, no mask) is not found"),
    BlindCase("b40c-03", "https://github.com/pyg-team/pytorch_geometric/issues/1104", "spurious self-loops in propagation",
              "TAGConv normalises with self-loops added, so every hop mixes each node's own features back in, unlike "
              "the operator it is meant to be.", _c03_build, _c03_proof,
              known_miss="spurious self-loops in message passing: arithmetic inside the model"),
    BlindCase("b40c-04", "https://github.com/NVIDIA-NeMo/Automodel/issues/763", "resume drops optimizer/scheduler state",
              "Resuming restores only the weights, so training continues with fresh Adam moments and the learning rate "
              "reset to the schedule's start.", _c04_build, _c04_proof,
              known_miss="a resume that drops the optimizer and scheduler state: a fresh optimizer and a scheduler at step 0 are what a new run has too",
              known_alarm=("SCHED-001",)),
    BlindCase("b40c-05", "https://github.com/Lightning-AI/pytorch-lightning/issues/9599", "clipping scaled AMP gradients",
              "Gradients are clipped while still multiplied by the AMP loss scale and unscaled afterwards, so updates "
              "are orders of magnitude too small.", _c05_build, _c05_proof),
]
