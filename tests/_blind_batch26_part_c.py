"""Blind batch 26 (part c): silent training bugs outside language and vision, from public GitHub threads, each with its
fixed twin.

Collected by someone who does not write the audit's checks. Every case builds the user's setup on a tiny model in
plain PyTorch (a RealNVP-style normalizing flow, a VAE decoder for temporal point processes, a triplet-loss face
embedder, a PPO Gaussian policy, a DDPM U-Net attention block; nothing is downloaded) and proves the bug without the
audit on real tensors and real steps.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw

# --------------------------------------------------------------------------------------------- case-01
# VincentStimper/normalizing-flows PR #28 (resolves issue #27): `NormalizingFlow.forward_and_log_det` accumulated the
# per-layer log-determinants with `log_det -= log_d`, although each layer's forward already returns
# log|det dz'/dz| of its own forward map (`inverse_and_log_det` adds them correctly). A user who fits the flow to a
# target density by the reverse KL, pushing base samples forward with `forward_and_log_det` and using
# KL = E[log q0(z) - log_det - log p(x)], optimises a loss whose volume term has the wrong sign: the flow is rewarded
# for contracting space, training runs and the loss falls, but the fitted density is wrong. Fix in the PR:
# `log_det += log_d`.


class _C01Coupling(nn.Module):
    """Affine coupling (RealNVP): the second half is scaled and shifted by a net of the first half; forward returns
    the new point and log|det J| of this forward map, as normflows' flows do."""

    def __init__(self, dim: int, flip: bool) -> None:
        super().__init__()
        self.flip = flip
        self.half = dim // 2
        self.net = nn.Sequential(nn.Linear(self.half, 16), nn.Tanh(), nn.Linear(16, 2 * (dim - self.half)))

    def forward(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.flip:
            z = z.flip(-1)
        z1, z2 = z[:, :self.half], z[:, self.half:]
        s, t = self.net(z1).chunk(2, dim=-1)
        s = torch.tanh(s)
        z2 = z2 * torch.exp(s) + t
        out = torch.cat([z1, z2], dim=-1)
        if self.flip:
            out = out.flip(-1)
        return out, s.sum(-1)


class _C01Flow(nn.Module):
    """normflows' NormalizingFlow: a standard-normal base and a list of flows, with its forward_and_log_det."""

    def __init__(self, dim: int, bug: bool) -> None:
        super().__init__()
        self.dim = dim
        self.bug = bug
        self.flows = nn.ModuleList([_C01Coupling(dim, flip=bool(i % 2)) for i in range(2)])

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        for flow in self.flows:
            z, _ = flow(z)
        return z

    def forward_and_log_det(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        log_det = torch.zeros(len(z))
        for flow in self.flows:
            z, log_d = flow(z)
            if self.bug:
                log_det -= log_d  # the released code
            else:
                log_det += log_d  # the PR's fix
        return z, log_det


_C01_DIM = 4
_C01_Z = torch.randn(8, _C01_DIM, generator=_gen(2601))
_C01_TARGET = torch.distributions.Independent(
    torch.distributions.Normal(torch.tensor([1.5, -1.0, 0.5, 2.0]), torch.tensor([0.5, 2.0, 1.0, 0.3])), 1)
_C01_BASE = torch.distributions.Independent(
    torch.distributions.Normal(torch.zeros(_C01_DIM), torch.ones(_C01_DIM)), 1)


def _c01_build(bug: bool) -> Case:
    """Reverse-KL fit of a 2-layer coupling flow to a Gaussian target, pushing base samples through forward_and_log_det."""
    torch.manual_seed(0)
    model = _C01Flow(_C01_DIM, bug)
    for p in model.parameters():  # a non-trivial start so the layers really scale space
        nn.init.normal_(p, std=0.5)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    def step() -> torch.Tensor:
        opt.zero_grad()
        x, log_det = model.forward_and_log_det(_C01_Z)
        loss = (_C01_BASE.log_prob(_C01_Z) - log_det - _C01_TARGET.log_prob(x)).mean()
        loss.backward()
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=_C01_Z)


def _c01_proof(bug: bool) -> bool:
    """The log-determinant forward_and_log_det reports is not log|det| of the flow's Jacobian at that point."""
    model, _, _ = _c01_build(bug)
    z = _C01_Z[:1]
    _, log_det = model.forward_and_log_det(z)
    jac = torch.autograd.functional.jacobian(lambda v: model(v.unsqueeze(0)).squeeze(0), z.squeeze(0))
    true = torch.linalg.slogdet(jac).logabsdet
    assert abs(true.item()) > 1e-2  # the flow really changes volume here
    return not torch.allclose(log_det.squeeze(0).detach(), true, atol=1e-4)


# --------------------------------------------------------------------------------------------- case-02
# EDAPINENUT/GNTPP issue #4 (VAE decoder of a neural temporal point process, models/prob_decoders/vae_modules/vae.py):
# the per-event KL term was written `(-0.5 * torch.sum(1 + log_var - mean.pow(2) - log_var.exp())) * seq_onehots`.
# Without `dim=-1` the sum collapses the whole [batch, seq, event_type, latent] tensor to one scalar, which the one-hot
# event mask then broadcasts back: every real event carries the KL of the entire batch, including the padded
# positions and the event types that did not occur. No exception (a scalar times the mask has the right shape), the
# loss trains, but the KL weight is multiplied by the number of events and padding is regularised. The maintainer
# fixed it with `torch.sum(..., dim=-1)`.


class _C02VAEDecoder(nn.Module):
    """GNTPP's history encoder (here a GRU over the inter-event times plus a per-type embedding) and its VAEDecoder:
    encoder MLP -> (mean, log_var), reparameterised z, decoder MLP -> normalised inter-event time."""

    def __init__(self, bug: bool, embed: int = 16, types: int = 3) -> None:
        super().__init__()
        self.bug = bug
        self.types = types
        self.history = nn.GRU(1, embed, batch_first=True)
        self.type_emb = nn.Embedding(types, embed)
        self.enc_t = nn.Linear(1, embed)
        self.enc_h = nn.Linear(embed, embed)
        self.enc = nn.Linear(embed, embed)
        self.mean_network = nn.Linear(embed, embed)
        self.var_network = nn.Linear(embed, embed)
        self.dec_z = nn.Linear(embed, embed)
        self.dec_h = nn.Linear(embed, embed)
        self.dec = nn.Linear(embed, embed)
        self.out_network = nn.Linear(embed, 1)
        self.act = nn.GELU()

    def forward(self, seq_dts: torch.Tensor, seq_onehots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The summed reconstruction + KL loss over the batch (GNTPP's log_loss), and the encoder means."""
        hist, _ = self.history(torch.log(seq_dts.clamp(1e-8)).unsqueeze(-1))
        history_embedding = hist.unsqueeze(2) + self.type_emb.weight  # [B, L, K, E]
        t = torch.log(seq_dts.clamp(1e-8)).unsqueeze(-1).expand(-1, -1, self.types)  # [B, L, K]
        hidden = self.act(self.enc(self.enc_t(t.unsqueeze(-1)) + self.enc_h(history_embedding)))
        mean, log_var = self.mean_network(hidden), self.var_network(hidden)
        z = mean + torch.exp(0.5 * log_var) * torch.randn_like(log_var)
        t_hat = self.out_network(self.act(self.dec(self.dec_z(z) + self.dec_h(history_embedding)))).squeeze(-1)
        rec_loss = (t - t_hat) ** 2 * seq_onehots
        if self.bug:
            kl_loss = (-0.5 * torch.sum(1 + log_var - mean.pow(2) - log_var.exp())) * seq_onehots
        else:
            kl_loss = (-0.5 * torch.sum(1 + log_var - mean.pow(2) - log_var.exp(), dim=-1)) * seq_onehots
        return (rec_loss + kl_loss).sum(), mean


def _c02_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """4 padded event sequences of length 10: inter-event times and one-hot event types (all zero on padding)."""
    g = _gen(2602)
    dts = torch.rand(4, 10, generator=g) * 2 + 0.05
    types = torch.randint(0, 3, (4, 10), generator=g)
    lengths = torch.tensor([10, 7, 5, 3])
    valid = torch.arange(10).unsqueeze(0) < lengths.unsqueeze(1)
    onehots = F.one_hot(types, 3).float() * valid.unsqueeze(-1)
    return dts * valid, onehots


_C02_DTS, _C02_ONEHOTS = _c02_batch()


def _c02_build(bug: bool) -> Case:
    """One Adam step on the event-normalised VAE loss of a padded batch."""
    torch.manual_seed(0)
    model = _C02VAEDecoder(bug)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step() -> torch.Tensor:
        opt.zero_grad()
        log_loss, _ = model(_C02_DTS, _C02_ONEHOTS)
        loss = log_loss / _C02_ONEHOTS.sum()
        loss.backward()
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=(_C02_DTS, _C02_ONEHOTS))


def _c02_proof(bug: bool) -> bool:
    """The loss has gradient on the latent means of padded events and of event types that did not occur."""
    model, _, _ = _c02_build(bug)
    torch.manual_seed(1)
    log_loss, mean = model(_C02_DTS, _C02_ONEHOTS)
    mean.retain_grad()
    log_loss.backward()
    assert mean.grad is not None
    off = _C02_ONEHOTS == 0
    return bool(mean.grad[off].abs().max() > 1e-6)


# --------------------------------------------------------------------------------------------- case-03
# liorshk/facenet_pytorch issue #6 (train_triplet.py): the hard triplets are selected by going through numpy,
# `out_selected_a = Variable(torch.from_numpy(out_a.cpu().data.numpy()[hard_triplets]).cuda())` (same for p and n),
# and the triplet loss is computed on those copies. They are new leaf tensors with no history, so the triplet term
# contributes a number to the logged loss but no gradient: `loss = cross_entropy_loss + triplet_loss` still
# back-propagates (through the classifier term), so nothing raises and both losses are logged, while the embedding
# is trained by the classification loss alone. The fix in the thread: index the outputs themselves,
# `out_a[hard_triplets]`, so the selection keeps the graph.


class _C03FaceModel(nn.Module):
    """FaceModel: an embedding net whose L2-normalised output is scaled by alpha, and a classifier on top of it."""

    def __init__(self, in_dim: int = 16, embedding_size: int = 8, num_classes: int = 4) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(in_dim, 32), nn.ReLU(), nn.Linear(32, embedding_size))
        self.classifier = nn.Linear(embedding_size, num_classes)
        self.alpha = 10.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.body(x), dim=1) * self.alpha

    def forward_classifier(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.forward(x))


class _C03TripletMarginLoss:
    """The script's triplet loss: mean of clamp(margin + d(a, p) - d(a, n), min=0)."""

    def __init__(self, margin: float) -> None:
        self.margin = margin
        self.pdist = nn.PairwiseDistance(2)

    def forward(self, anchor: torch.Tensor, positive: torch.Tensor, negative: torch.Tensor) -> torch.Tensor:
        d_p = self.pdist(anchor, positive)
        d_n = self.pdist(anchor, negative)
        return torch.mean(torch.clamp(self.margin + d_p - d_n, min=0.0))


def _c03_batch() -> tuple[torch.Tensor, ...]:
    g = _gen(2603)
    data_a, data_p, data_n = (torch.randn(8, 16, generator=g) for _ in range(3))
    label_p = torch.randint(0, 4, (8,), generator=g)
    label_n = (label_p + 1) % 4
    return data_a, data_p, data_n, label_p, label_n


_C03_BATCH = _c03_batch()
_C03_MARGIN = 5.0


def _c03_losses(model: _C03FaceModel, bug: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The script's loss for one batch: (cross_entropy_loss, triplet_loss) on the selected hard triplets."""
    data_a, data_p, data_n, label_p, label_n = _C03_BATCH
    l2_dist = nn.PairwiseDistance(2)
    out_a, out_p, out_n = model(data_a), model(data_p), model(data_n)
    d_p = l2_dist(out_a, out_p)
    d_n = l2_dist(out_a, out_n)
    hard = (d_n - d_p < _C03_MARGIN).cpu().data.numpy().flatten()
    hard_triplets = np.where(hard == 1)
    if bug:
        out_selected_a = torch.from_numpy(out_a.cpu().data.numpy()[hard_triplets])
        out_selected_p = torch.from_numpy(out_p.cpu().data.numpy()[hard_triplets])
        out_selected_n = torch.from_numpy(out_n.cpu().data.numpy()[hard_triplets])
    else:
        idx = torch.from_numpy(hard_triplets[0])
        out_selected_a, out_selected_p, out_selected_n = out_a[idx], out_p[idx], out_n[idx]
    idx_np = hard_triplets
    selected_data_a = torch.from_numpy(data_a.numpy()[idx_np])
    selected_data_p = torch.from_numpy(data_p.numpy()[idx_np])
    selected_data_n = torch.from_numpy(data_n.numpy()[idx_np])
    selected_label_p = torch.from_numpy(label_p.numpy()[idx_np])
    selected_label_n = torch.from_numpy(label_n.numpy()[idx_np])
    triplet_loss = _C03TripletMarginLoss(_C03_MARGIN).forward(out_selected_a, out_selected_p, out_selected_n)
    cls_a = model.forward_classifier(selected_data_a)
    cls_p = model.forward_classifier(selected_data_p)
    cls_n = model.forward_classifier(selected_data_n)
    predicted_labels = torch.cat([cls_a, cls_p, cls_n])
    true_labels = torch.cat([selected_label_p, selected_label_p, selected_label_n])
    cross_entropy_loss = nn.CrossEntropyLoss()(predicted_labels, true_labels)
    return cross_entropy_loss, triplet_loss


def _c03_build(bug: bool) -> Case:
    """One Adagrad step on cross_entropy_loss + triplet_loss, as train_triplet.py does."""
    torch.manual_seed(0)
    model = _C03FaceModel()
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1, lr_decay=1e-4)

    def step() -> torch.Tensor:
        cross_entropy_loss, triplet_loss = _c03_losses(model, bug)
        loss = cross_entropy_loss + triplet_loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=_C03_BATCH)


def _c03_proof(bug: bool) -> bool:
    """The triplet term is positive but the embedding's gradient is exactly the classification loss's gradient."""
    model, _, _ = _c03_build(bug)
    ce, trip = _c03_losses(model, bug)
    assert trip.item() > 0
    w = model.body[0].weight
    g_total = torch.autograd.grad(ce + trip, w, retain_graph=True)[0]
    g_ce = torch.autograd.grad(ce, w)[0]
    return torch.allclose(g_total, g_ce)


# --------------------------------------------------------------------------------------------- case-04
# pytorch/rl PR #1033 ("Advantage normalisation in ClipPPOLoss is done after computing gain1"): with
# `normalize_advantage=True`, ClipPPOLoss computed `gain1 = log_weight.exp() * advantage` with the raw advantage,
# then normalised the advantage, then `gain2 = log_weight_clip.exp() * advantage` with the normalised one, and took
# min(gain1, gain2). The two branches of the clipped objective see different advantages, so the min picks between
# incomparable numbers: the clipping no longer does what PPO's does, and the objective depends on the raw advantage
# scale the normalisation was meant to remove. Training runs, the loss is finite. The merged fix normalises the
# advantage at the beginning of the loss, before both gains.


class _C04Policy(nn.Module):
    """Gaussian policy: an MLP mean and a state-independent log-std."""

    def __init__(self, obs: int = 4, act: int = 2) -> None:
        super().__init__()
        self.mean = nn.Sequential(nn.Linear(obs, 16), nn.Tanh(), nn.Linear(16, act))
        self.log_std = nn.Parameter(torch.full((act,), -0.5))

    def dist(self, obs: torch.Tensor) -> torch.distributions.Distribution:
        return torch.distributions.Independent(torch.distributions.Normal(self.mean(obs), self.log_std.exp()), 1)


def _c04_clip_ppo_loss(policy: _C04Policy, batch: dict[str, torch.Tensor], bug: bool,
                       clip_epsilon: float = 0.2) -> torch.Tensor:
    """ClipPPOLoss(normalize_advantage=True).forward's objective, released (bug) or fixed."""
    advantage = batch["advantage"]
    if not bug and advantage.numel() > 1:
        loc = advantage.mean().item()
        scale = advantage.std().clamp_min(1e-6).item()
        advantage = (advantage - loc) / scale
    log_weight = policy.dist(batch["observation"]).log_prob(batch["action"]) - batch["sample_log_prob"]
    clip_bounds = (math.log1p(-clip_epsilon), math.log1p(clip_epsilon))
    gain1 = log_weight.exp() * advantage
    log_weight_clip = log_weight.clamp(*clip_bounds)
    if bug and advantage.numel() > 1:
        loc = advantage.mean().item()
        scale = advantage.std().clamp_min(1e-6).item()
        advantage = (advantage - loc) / scale
    gain2 = log_weight_clip.exp() * advantage
    gain = torch.stack([gain1, gain2], -1).min(dim=-1)[0]
    return -gain.mean()


def _c04_batch(adv_scale: float = 1.0, adv_shift: float = 0.0) -> dict[str, torch.Tensor]:
    """8 transitions collected by an older copy of the policy, with raw (un-normalised) GAE-like advantages."""
    g = _gen(2604)
    obs = torch.randn(8, 4, generator=g)
    torch.manual_seed(4)
    old = _C04Policy()
    with torch.no_grad():
        action = old.dist(obs).sample()
        logp = old.dist(obs).log_prob(action)
    advantage = 3.0 + 4.0 * torch.randn(8, generator=g)
    return {"observation": obs, "action": action, "sample_log_prob": logp,
            "advantage": advantage * adv_scale + adv_shift}


_C04_BATCH = _c04_batch()


def _c04_build(bug: bool) -> Case:
    """One Adam step on the clipped PPO objective with normalize_advantage=True."""
    torch.manual_seed(0)
    policy = _C04Policy()
    opt = torch.optim.Adam(policy.parameters(), lr=3e-4)

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = _c04_clip_ppo_loss(policy, _C04_BATCH, bug)
        loss.backward()
        opt.step()
        return loss

    return policy, step, _kw(optimizer=opt, inputs=_C04_BATCH)


def _c04_proof(bug: bool) -> bool:
    """With normalised advantages the update cannot depend on the advantages' scale and offset; here it does."""
    policy, _, _ = _c04_build(bug)
    grads = []
    for batch in (_C04_BATCH, _c04_batch(adv_scale=10.0, adv_shift=5.0)):
        policy.zero_grad()
        _c04_clip_ppo_loss(policy, batch, bug).backward()
        grads.append(torch.cat([p.grad.flatten() for p in policy.parameters()]))
    return not torch.allclose(grads[0], grads[1], atol=1e-6)


# --------------------------------------------------------------------------------------------- case-05
# labmlai/annotated_deep_learning_paper_implementations issue #146 (labml_nn/diffusion/ddpm/unet.py, AttentionBlock):
# the scores are `attn = torch.einsum("bihd,bjhd->bijh", q, k) * scale` and then `attn = attn.softmax(dim=1)`, which
# normalises over the query index i instead of the key index j. Each query's weights over the keys no longer sum to
# one, so the block mixes values with weights that are not an attention distribution; the DDPM still trains and the
# loss falls (the reporter even measured similar FID), so nothing looks wrong. The maintainer confirmed it ("a typo
# and a big bug") and fixed it to `attn.softmax(dim=2)`.


class _C05AttentionBlock(nn.Module):
    """labml's U-Net AttentionBlock on a [B, C, H, W] map, with the softmax axis as released or fixed."""

    def __init__(self, n_channels: int, bug: bool, n_heads: int = 1, d_k: int | None = None) -> None:
        super().__init__()
        d_k = d_k or n_channels
        self.bug = bug
        self.projection = nn.Linear(n_channels, n_heads * d_k * 3)
        self.output = nn.Linear(n_heads * d_k, n_channels)
        self.scale = d_k ** -0.5
        self.n_heads = n_heads
        self.d_k = d_k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch_size, n_channels, height, width = x.shape
        x = x.view(batch_size, n_channels, -1).permute(0, 2, 1)
        qkv = self.projection(x).view(batch_size, -1, self.n_heads, 3 * self.d_k)
        q, k, v = torch.chunk(qkv, 3, dim=-1)
        attn = torch.einsum("bihd,bjhd->bijh", q, k) * self.scale
        attn = attn.softmax(dim=1) if self.bug else attn.softmax(dim=2)
        res = torch.einsum("bijh,bjhd->bihd", attn, v)
        res = res.reshape(batch_size, -1, self.n_heads * self.d_k)
        res = self.output(res)
        res = res + x
        return res.permute(0, 2, 1).reshape(batch_size, n_channels, height, width)


class _C05EpsModel(nn.Module):
    """A one-level U-Net-ish noise predictor: conv in, time embedding, residual conv, attention, conv out."""

    def __init__(self, bug: bool, ch: int = 16) -> None:
        super().__init__()
        self.ch = ch
        self.image_proj = nn.Conv2d(1, ch, 3, padding=1)
        self.time_emb = nn.Sequential(nn.Linear(ch, ch), nn.SiLU(), nn.Linear(ch, ch))
        self.res = nn.Sequential(nn.GroupNorm(4, ch), nn.SiLU(), nn.Conv2d(ch, ch, 3, padding=1))
        self.attn = _C05AttentionBlock(ch, bug)
        self.final = nn.Conv2d(ch, 1, 3, padding=1)

    def _t_embed(self, t: torch.Tensor) -> torch.Tensor:
        half = self.ch // 2
        freqs = torch.exp(torch.arange(half) * -(math.log(10_000) / (half - 1)))
        emb = t[:, None].float() * freqs[None]
        return self.time_emb(torch.cat([emb.sin(), emb.cos()], dim=1))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h = self.image_proj(x) + self._t_embed(t)[:, :, None, None]
        h = h + self.res(h)
        return self.final(self.attn(h))


_C05_T = 100
_C05_BETA = torch.linspace(1e-4, 0.02, _C05_T)
_C05_ALPHA_BAR = torch.cumprod(1.0 - _C05_BETA, dim=0)
_C05_X0 = torch.randn(4, 1, 4, 4, generator=_gen(2605)).tanh()


def _c05_build(bug: bool) -> Case:
    """One DDPM step: sample t and noise, noise the images, regress the predicted noise on the true noise."""
    torch.manual_seed(0)
    model = _C05EpsModel(bug)
    opt = torch.optim.Adam(model.parameters(), lr=2e-4)
    g = _gen(26050)

    def step() -> torch.Tensor:
        t = torch.randint(0, _C05_T, (_C05_X0.shape[0],), generator=g)
        noise = torch.randn(_C05_X0.shape, generator=g)
        ab = _C05_ALPHA_BAR[t].view(-1, 1, 1, 1)
        xt = ab.sqrt() * _C05_X0 + (1 - ab).sqrt() * noise
        opt.zero_grad()
        loss = F.mse_loss(model(xt, t), noise)
        loss.backward()
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=_C05_X0)


class _C05SoftmaxRecorder(TorchFunctionMode):
    """Records the outputs of every softmax called while active."""

    def __init__(self) -> None:
        super().__init__()
        self.outputs: list[torch.Tensor] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if getattr(func, "__name__", "") == "softmax":
            self.outputs.append(out.detach())
        return out


def _c05_proof(bug: bool) -> bool:
    """Each query's attention weights over the keys (the j axis of 'bijh') do not sum to one."""
    model, _, _ = _c05_build(bug)
    t = torch.tensor([10, 40, 70, 99])
    with _C05SoftmaxRecorder() as rec:
        model(_C05_X0, t)
    assert len(rec.outputs) == 1
    attn = rec.outputs[0]  # [b, i, j, h]
    return not torch.allclose(attn.sum(dim=2), torch.ones(()), atol=1e-5)


CASES: list[BlindCase] = [
    BlindCase("b26c-01", "https://github.com/VincentStimper/normalizing-flows/pull/28",
              "wrong sign of a log-determinant",
              "forward_and_log_det subtracts the layers' forward log-determinants, so a reverse-KL fit rewards the "
              "flow for contracting space instead of penalising it.", _c01_build, _c01_proof,
              known_miss="a flow's log-determinant subtracted instead of added: the sign of a volume term is not judged"),
    BlindCase("b26c-02", "https://github.com/EDAPINENUT/GNTPP/issues/4", "reduction over the wrong dimensions",
              "The VAE's KL is summed without dim=-1, so one batch-wide scalar (padding and absent event types "
              "included) is broadcast onto every real event.", _c02_build, _c02_proof),
    BlindCase("b26c-03", "https://github.com/liorshk/facenet_pytorch/issues/6", "loss term cut from the graph",
              "The hard triplets are copied through numpy before the triplet loss, so that term is logged but gives "
              "no gradient and the embedding trains on the classification loss alone.", _c03_build, _c03_proof,
              known_alarm=("GRAD-005",)),
    BlindCase("b26c-04", "https://github.com/pytorch/rl/pull/1033", "normalisation applied to one branch only",
              "ClipPPOLoss normalises the advantage after the unclipped gain is formed, so min() compares a raw-"
              "advantage gain with a normalised one and the update depends on the advantage scale.",
              _c04_build, _c04_proof),
    BlindCase("b26c-05", "https://github.com/labmlai/annotated_deep_learning_paper_implementations/issues/146",
              "softmax over the wrong axis",
              "The DDPM U-Net's attention normalises its scores over the queries instead of the keys, so each "
              "query mixes the values with weights that do not sum to one.", _c05_build, _c05_proof,
              known_miss="attention softmax over the queries: a softmax axis inside the model (not at a loss) is not judged"),
]
