"""Blind batch 27 (part c): silent training bugs outside language and vision, each with its fixed twin.

Collected by someone who does not write the audit's checks. Every case builds the user's setup on a tiny model in
plain PyTorch (a physics-informed MLP, a siamese embedding net, a two-level VAE, a DQN agent, a two-layer GCN;
nothing is downloaded) and proves the bug without the audit on real tensors and real steps.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw

# --------------------------------------------------------------------------------------------- case-01
# pytorch/pytorch issue #31984: a network is trained to fit a function AND its derivative (the physics-informed /
# Sobolev-training pattern). The user takes the input derivative with `torch.autograd.grad(output.sum(), x,
# retain_graph=True)` and adds `MSE(grad_x, z)` to the loss. Without `create_graph=True` the derivative is a constant
# leaf (`loss_z.grad_fn is None`), so the derivative term is in the printed loss, but contributes no gradient: the
# model trains on the value term alone while loss_z is reported as part of the objective. No error, no warning.
# Fix (the answer in the thread): `grad(output.sum(), x, create_graph=True)`, so the derivative term back-propagates
# into the weights.


class _C01Net(nn.Module):
    """The user's net: 3 inputs, one hidden ReLU layer, one output."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(3, 30)
        self.lin2 = nn.Linear(30, 1)

    def forward(self, p: torch.Tensor) -> torch.Tensor:
        return self.lin2(torch.relu(self.lin1(p)))


_C01_X = torch.randn(8, 3, generator=_gen(2701))
_C01_Y = (5 * torch.sin(_C01_X) + 3 * torch.cos(_C01_X)).sum(dim=-1, keepdim=True)
_C01_Z = (5 * torch.cos(_C01_X) - 3 * torch.sin(_C01_X)).sum(dim=-1, keepdim=True)


def _c01_losses(model: nn.Module, x: torch.Tensor, bug: bool) -> tuple[torch.Tensor, torch.Tensor]:
    output = model(x)
    if bug:
        grad_x = torch.autograd.grad(output.sum(), x, retain_graph=True)[0]
    else:
        grad_x = torch.autograd.grad(output.sum(), x, create_graph=True)[0]
    loss_y = nn.MSELoss()(output, _C01_Y)
    loss_z = nn.MSELoss()(grad_x.sum(dim=-1).unsqueeze(-1), _C01_Z)
    return loss_y, loss_z


def _c01_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _C01Net().train()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    x = _C01_X.clone().requires_grad_(True)

    def step() -> torch.Tensor:
        optimizer.zero_grad()
        loss_y, loss_z = _c01_losses(model, x, bug)
        loss = loss_y + loss_z
        loss.backward(retain_graph=True)
        optimizer.step()
        return loss

    return model, step, _kw(optimizer=optimizer, inputs={"x": x, "y": _C01_Y, "z": _C01_Z})


def _c01_proof(bug: bool) -> bool:
    """Train the user's objective (value + derivative) and the value term alone from the same init for 3 steps: with
    the bug the two runs end bit-identical, so the derivative term never moved a weight."""
    model, step, _ = _c01_build(bug)
    value_only = copy.deepcopy(model)
    opt_v = torch.optim.Adam(value_only.parameters(), lr=3e-3)
    x = _C01_X.clone().requires_grad_(True)
    for _ in range(3):
        step()
        opt_v.zero_grad()
        loss_y, _ = _c01_losses(value_only, x, bug)
        loss_y.backward()
        opt_v.step()
    return all(torch.equal(a, b) for a, b in zip(model.parameters(), value_only.parameters()))


# --------------------------------------------------------------------------------------------- case-02
# adambielski/siamese-triplet issue #3 (fixed in PR #4): online contrastive loss with a `HardNegativePairSelector`
# that should pick, for every positive pair, one of the *hardest* negative pairs (the closest embeddings of different
# classes). It picked the negatives with the LARGEST distances instead, i.e. the easiest ones, which already sit
# beyond the margin and give zero hinge loss. Training runs and the loss goes down quickly, but the negatives that
# actually violate the margin are never pushed apart. Fix in the PR: take the negative pairs with the smallest
# distances.

_C02_X = torch.randn(8, 16, generator=_gen(2702))
_C02_LABELS = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
_C02_MARGIN = 1.0


class _C02EmbeddingNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.PReLU(), nn.Linear(32, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _c02_pairs(embeddings: torch.Tensor, labels: torch.Tensor, bug: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """HardNegativePairSelector.get_pairs: all positive pairs, and as many negative pairs chosen by distance."""
    n = len(labels)
    all_pairs = torch.combinations(torch.arange(n), 2)
    same = labels[all_pairs[:, 0]] == labels[all_pairs[:, 1]]
    positive_pairs, negative_pairs = all_pairs[same], all_pairs[~same]
    distances = torch.cdist(embeddings, embeddings).pow(2).detach()
    negative_distances = distances[negative_pairs[:, 0], negative_pairs[:, 1]]
    k = len(positive_pairs)
    top = torch.topk(negative_distances, k, largest=bug).indices
    return positive_pairs, negative_pairs[top]


def _c02_loss(embeddings: torch.Tensor, labels: torch.Tensor, bug: bool) -> torch.Tensor:
    """OnlineContrastiveLoss."""
    positive_pairs, negative_pairs = _c02_pairs(embeddings, labels, bug)
    positive_loss = (embeddings[positive_pairs[:, 0]] - embeddings[positive_pairs[:, 1]]).pow(2).sum(1)
    negative_dist = (embeddings[negative_pairs[:, 0]] - embeddings[negative_pairs[:, 1]]).pow(2).sum(1).sqrt()
    negative_loss = F.relu(_C02_MARGIN - negative_dist).pow(2)
    return torch.cat([positive_loss, negative_loss], dim=0).mean()


def _c02_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _C02EmbeddingNet().train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = _C02_X.clone()

    def step() -> torch.Tensor:
        optimizer.zero_grad()
        loss = _c02_loss(model(x), _C02_LABELS, bug)
        loss.backward()
        optimizer.step()
        return loss

    return model, step, _kw(optimizer=optimizer, inputs={"x": x, "target": _C02_LABELS})


def _c02_proof(bug: bool) -> bool:
    """On the model's real embeddings: the selected negative pairs give no hinge loss while the closest negative pairs
    (the ones inside the margin) are left out of the loss."""
    model, _, _ = _c02_build(bug)
    with torch.no_grad():
        emb = model(_C02_X)
    _, chosen = _c02_pairs(emb, _C02_LABELS, bug)
    _, hardest = _c02_pairs(emb, _C02_LABELS, False)

    def hinge(pairs: torch.Tensor) -> float:
        d = (emb[pairs[:, 0]] - emb[pairs[:, 1]]).pow(2).sum(1).sqrt()
        return float(F.relu(_C02_MARGIN - d).pow(2).sum())

    chosen_set = {tuple(p) for p in chosen.tolist()}
    hardest_set = {tuple(p) for p in hardest.tolist()}
    return chosen_set != hardest_set and hinge(chosen) < hinge(hardest)


# --------------------------------------------------------------------------------------------- case-03
# GlassyWing/nvae issue #3 (maintainer: "I did lose `dim` in torch.sum", fixed): the hierarchical VAE's relative KL
# for the lower latent, `kl_2(delta_mu, delta_log_var, mu, log_var)`, computes
# `loss = -0.5 * torch.sum(1 + delta_log_var - delta_mu ** 2 / var - delta_var)` and returns `torch.mean(loss, dim=0)`.
# The sum has no `dim`, so it adds up the whole batch into one number and the mean over dim 0 of a scalar is the
# scalar itself: the KL term is the batch SUM while the reconstruction and the first KL are per-sample means. The lower
# latent's KL is silently weighted by the batch size (and changes with it). Fix in the thread: sum over the latent
# dimensions per sample (`loss.flatten(start_dim=1).sum(dim=-1)`), then take the mean over the batch.

_C03_X = torch.randn(8, 16, generator=_gen(2703))


def _c03_kl(mu: torch.Tensor, log_var: torch.Tensor) -> torch.Tensor:
    """The first KL (to a standard normal), correct: per-sample sum, batch mean."""
    return (-0.5 * torch.sum(1 + log_var - mu ** 2 - log_var.exp(), dim=-1)).mean(dim=0)


def _c03_kl_2(delta_mu: torch.Tensor, delta_log_var: torch.Tensor, mu: torch.Tensor, log_var: torch.Tensor,
              bug: bool) -> torch.Tensor:
    var = torch.exp(log_var)
    delta_var = torch.exp(delta_log_var)
    if bug:
        loss = -0.5 * torch.sum(1 + delta_log_var - delta_mu ** 2 / var - delta_var)
        return torch.mean(loss, dim=0)
    loss = -0.5 * (1 + delta_log_var - delta_mu ** 2 / var - delta_var)
    return loss.flatten(start_dim=1).sum(dim=-1).mean(dim=0)


class _C03HierVAE(nn.Module):
    """Two latent levels: z1 ~ N(0, I) and z2 whose prior comes from z1; the posterior of z2 is a residual
    (delta_mu, delta_log_var) on top of that prior, as in NVAE."""

    def __init__(self, d: int = 16, h: int = 32, z: int = 4) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(d, h), nn.ReLU())
        self.q1 = nn.Linear(h, 2 * z)
        self.p2 = nn.Linear(z, 2 * z)
        self.q2 = nn.Linear(h + z, 2 * z)
        self.dec = nn.Sequential(nn.Linear(2 * z, h), nn.ReLU(), nn.Linear(h, d))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = self.enc(x)
        mu1, log_var1 = self.q1(h).chunk(2, dim=-1)
        z1 = mu1 + torch.randn_like(mu1) * torch.exp(0.5 * log_var1)
        mu2, log_var2 = self.p2(z1).chunk(2, dim=-1)
        delta_mu, delta_log_var = self.q2(torch.cat([h, z1], dim=-1)).chunk(2, dim=-1)
        z2 = mu2 + delta_mu + torch.randn_like(mu2) * torch.exp(0.5 * (log_var2 + delta_log_var))
        recon = self.dec(torch.cat([z1, z2], dim=-1))
        return recon, mu1, log_var1, delta_mu, delta_log_var, mu2, log_var2


def _c03_terms(model: _C03HierVAE, x: torch.Tensor, bug: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    recon, mu1, log_var1, delta_mu, delta_log_var, mu2, log_var2 = model(x)
    recon_loss = F.mse_loss(recon, x, reduction="none").sum(dim=-1).mean()
    return recon_loss, _c03_kl(mu1, log_var1), _c03_kl_2(delta_mu, delta_log_var, mu2, log_var2, bug)


def _c03_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _C03HierVAE().train()
    optimizer = torch.optim.Adamax(model.parameters(), lr=1e-3)
    x = _C03_X.clone()

    def step() -> torch.Tensor:
        optimizer.zero_grad()
        recon_loss, kl1, kl2 = _c03_terms(model, x, bug)
        loss = recon_loss + kl1 + kl2
        loss.backward()
        optimizer.step()
        return loss

    return model, step, _kw(optimizer=optimizer, inputs=x)


def _c03_proof(bug: bool) -> bool:
    """On the model's real posterior and prior of one batch: the KL term the loss uses is the batch size times the
    per-sample mean KL (the scale of the other terms), and halving the batch halves it."""
    model, _, _ = _c03_build(bug)
    torch.manual_seed(1)
    with torch.no_grad():
        _, _, _, delta_mu, delta_log_var, mu2, log_var2 = model(_C03_X)
    used = _c03_kl_2(delta_mu, delta_log_var, mu2, log_var2, bug)
    per_sample = _c03_kl_2(delta_mu, delta_log_var, mu2, log_var2, False)
    half = _c03_kl_2(delta_mu[:4], delta_log_var[:4], mu2[:4], log_var2[:4], bug)
    half_per_sample = _c03_kl_2(delta_mu[:4], delta_log_var[:4], mu2[:4], log_var2[:4], False)
    ratio, half_ratio = float(used / per_sample), float(half / half_per_sample)
    return abs(ratio - len(_C03_X)) < 1e-3 * len(_C03_X) and abs(half_ratio - 4) < 4e-3


# --------------------------------------------------------------------------------------------- case-04
# sebtheiler/tutorials issue #6 (maintainer: "Thank you for spotting this!", fixed on the dqn-fix branch): the DQN
# Breakout tutorial learns every UPDATE_FREQ frames and should copy the online network into the target network only
# every TARGET_UPDATE_FREQ frames, but the copy sat under the same `frame_number % UPDATE_FREQ == 0` condition as the
# learning step. The target network is refreshed after every gradient step, so the TD target is computed from the
# network being trained: the "frozen" target the algorithm relies on for stability does not exist, with no error.
# Fix: copy the weights under `frame_number % TARGET_UPDATE_FREQ == 0`.

_C04_UPDATE_FREQ = 4
_C04_TARGET_UPDATE_FREQ = 1000
_C04_GAMMA = 0.99
_g04 = _gen(2704)
_C04_BATCH = {
    "states": torch.randn(8, 16, generator=_g04),
    "actions": torch.randint(0, 4, (8,), generator=_g04),
    "rewards": torch.randn(8, generator=_g04).clamp(-1, 1),
    "new_states": torch.randn(8, 16, generator=_g04),
    "terminal_flags": (torch.rand(8, generator=_g04) < 0.2).float(),
}


class _C04QNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, s: torch.Tensor) -> torch.Tensor:
        return self.net(s)


class _C04Agent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dqn = _C04QNet()
        self.target_dqn = _C04QNet()
        self.target_dqn.load_state_dict(self.dqn.state_dict())
        self.target_dqn.requires_grad_(False)


def _c04_build(bug: bool) -> Case:
    torch.manual_seed(0)
    agent = _C04Agent().train()
    optimizer = torch.optim.Adam(agent.dqn.parameters(), lr=1e-3)
    b = _C04_BATCH
    state = {"frame_number": 0}

    def step() -> torch.Tensor:
        # one learning step of the agent loop: UPDATE_FREQ frames have passed since the last one
        state["frame_number"] += _C04_UPDATE_FREQ
        frame_number = state["frame_number"]
        with torch.no_grad():
            target_q = agent.target_dqn(b["new_states"]).max(dim=1).values
            target = b["rewards"] + _C04_GAMMA * target_q * (1 - b["terminal_flags"])
        q = agent.dqn(b["states"]).gather(1, b["actions"].unsqueeze(1)).squeeze(1)
        loss = F.smooth_l1_loss(q, target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if frame_number % (_C04_UPDATE_FREQ if bug else _C04_TARGET_UPDATE_FREQ) == 0:
            agent.target_dqn.load_state_dict(agent.dqn.state_dict())
        return loss

    return agent, step, _kw(optimizer=optimizer, inputs=b)


def _c04_proof(bug: bool) -> bool:
    """Three learning steps (12 frames, far from the 1000-frame target period): with the bug the target network is
    identical to the online network after each of them, so it is not a lagged copy at all."""
    agent, step, _ = _c04_build(bug)
    init_target = copy.deepcopy(agent.target_dqn.state_dict())
    same_every_step = True
    for _ in range(3):
        step()
        same_every_step &= all(torch.equal(agent.dqn.state_dict()[k], v)
                               for k, v in agent.target_dqn.state_dict().items())
    target_moved = any(not torch.equal(init_target[k], v) for k, v in agent.target_dqn.state_dict().items())
    return same_every_step and target_moved


# --------------------------------------------------------------------------------------------- case-05
# pyg-team/pytorch_geometric issue #48 (maintainer rusty1s: "there was a small normalization bug. I was computing
# D^-0.5 (A + I) D^-0.5 instead of (D + 1)^-0.5 (A + I) (D + 1)^-0.5", fixed in commit 06f4a4d): the GCN layer adds
# self-loops to the adjacency but normalises with the degrees counted BEFORE the self-loops were added. The
# propagation matrix is then no longer the symmetric-normalised D~^-1/2 A~ D~^-1/2 of the GCN paper: its spectral
# radius exceeds 1 (low-degree nodes are amplified by up to 1 + 1/deg), so every layer rescales node features
# unevenly. Training runs and the loss falls; the user only saw clearly worse accuracy than the paper. Fix: count the
# degree on A + I. Written here in plain PyTorch as the user's layer.

_C05_EDGES = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0], [3, 4], [4, 5], [5, 6], [6, 7], [2, 7]])
_C05_EDGE_INDEX = torch.cat([_C05_EDGES.t(), _C05_EDGES.t().flip(0)], dim=1)
_C05_X = torch.randn(8, 16, generator=_gen(2705))
_C05_Y = torch.tensor([0, 0, 1, 1, 2, 2, 0, 1])
_C05_TRAIN = torch.tensor([True, True, True, False, True, True, False, True])


def _c05_propagation(edge_index: torch.Tensor, n: int, bug: bool) -> torch.Tensor:
    """The dense propagation matrix the layer uses: self-loops added, degree-normalised on both sides."""
    adj = torch.zeros(n, n)
    adj[edge_index[0], edge_index[1]] = 1.0
    deg = adj.sum(dim=1)  # degree without self-loops
    adj_hat = adj + torch.eye(n)
    if not bug:
        deg = adj_hat.sum(dim=1)
    d_inv_sqrt = deg.pow(-0.5)
    return d_inv_sqrt[:, None] * adj_hat * d_inv_sqrt[None, :]


class _C05GCNConv(nn.Module):
    def __init__(self, d_in: int, d_out: int, bug: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(d_in, d_out)
        self.bug = bug

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        return _c05_propagation(edge_index, x.size(0), self.bug) @ self.lin(x)


class _C05GCN(nn.Module):
    def __init__(self, bug: bool) -> None:
        super().__init__()
        self.conv1 = _C05GCNConv(16, 16, bug)
        self.conv2 = _C05GCNConv(16, 3, bug)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        h = F.dropout(F.relu(self.conv1(x, edge_index)), p=0.5, training=self.training)
        return self.conv2(h, edge_index)


def _c05_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _C05GCN(bug).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=5e-4)

    def step() -> torch.Tensor:
        optimizer.zero_grad()
        out = model(_C05_X, _C05_EDGE_INDEX)
        loss = F.cross_entropy(out[_C05_TRAIN], _C05_Y[_C05_TRAIN])
        loss.backward()
        optimizer.step()
        return loss

    return model, step, _kw(optimizer=optimizer,
                            inputs={"x": _C05_X, "edge_index": _C05_EDGE_INDEX, "y": _C05_Y, "train_mask": _C05_TRAIN})


def _c05_proof(bug: bool) -> bool:
    """The layer's real propagation (read off by pushing the identity through conv1 with an identity weight) has
    spectral radius above 1, which a symmetric-normalised GCN propagation never has."""
    model, _, _ = _c05_build(bug)
    conv = model.conv1
    n = _C05_X.size(0)
    probe = _C05GCNConv(n, n, conv.bug)
    with torch.no_grad():
        probe.lin.weight.copy_(torch.eye(n))
        probe.lin.bias.zero_()
        prop = probe(torch.eye(n), _C05_EDGE_INDEX)
    radius = float(torch.linalg.eigvalsh(prop).abs().max())
    return radius > 1 + 1e-4


CASES: list[BlindCase] = [
    BlindCase("b27c-01", "https://github.com/pytorch/pytorch/issues/31984", "derivative term without create_graph",
              "The input derivative is taken with autograd.grad without create_graph, so the derivative-matching loss "
              "term is a constant that never reaches the weights; only the value term trains.", _c01_build,
              _c01_proof),
    BlindCase("b27c-02", "https://github.com/adambielski/siamese-triplet/issues/3", "inverted hard-negative mining",
              "The hard-negative pair selector takes the farthest negative pairs instead of the closest, so the "
              "contrastive loss only sees easy negatives beyond the margin and never pushes apart the violating ones.",
              _c02_build, _c02_proof,
              known_miss="a miner that picks the farthest negatives: which pairs a loss is given is not judged"),
    BlindCase("b27c-03", "https://github.com/GlassyWing/nvae/issues/3", "KL reduced over the batch axis",
              "The hierarchical VAE's second KL sums over the whole batch instead of per sample, so that term is the "
              "batch sum while the other terms are per-sample means: it is silently weighted by the batch size.",
              _c03_build, _c03_proof,
              known_miss="a KL term summed over the batch as well: a term's weight against the others (a factor of the batch size) is not measured"),
    BlindCase("b27c-04", "https://github.com/sebtheiler/tutorials/issues/6", "DQN target network not held fixed",
              "The target network is copied from the online network under the learning-step condition, i.e. after "
              "every gradient step, so the TD target comes from the network being trained instead of a lagged copy.",
              _c04_build, _c04_proof,
              known_miss="the target network is copied from the online one every step: a copy's sync cadence is not seen in one step"),
    BlindCase("b27c-05", "https://github.com/pyg-team/pytorch_geometric/issues/48", "GCN degree normalization",
              "The GCN layer adds self-loops but normalises with the degree counted without them, so the propagation "
              "matrix has spectral radius above 1 and rescales low-degree nodes' features at every layer.",
              _c05_build, _c05_proof,
              known_miss="a GCN normalised with the degree counted before its self-loops: arithmetic inside the model's forward"),
]
