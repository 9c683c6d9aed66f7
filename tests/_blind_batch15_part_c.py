"""Blind batch 15 (part c): silent training bugs from public GitHub threads, each with its fixed twin."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw, _sgd_step

# --------------------------------------------------------------------------------------------- case-11
# A GCN node classifier on a graph loaded from an edge list; the loader never adds self-loops, so with
# symmetric normalisation each node's first-layer representation is built from its neighbours only.

_C11_N, _C11_F, _C11_C = 14, 8, 3


def _c11_edges() -> torch.Tensor:
    g = _gen(1511)
    src = list(range(_C11_N))
    dst = [(i + 1) % _C11_N for i in range(_C11_N)]  # a ring, so no node is isolated
    extra = torch.randint(0, _C11_N, (2, 10), generator=g)
    for a, b in extra.t().tolist():
        if a != b:
            src.append(a)
            dst.append(b)
    e = torch.tensor([src, dst])
    return torch.cat([e, e.flip(0)], 1)  # undirected


_C11_EDGES = _c11_edges()
_C11_X = torch.randn(_C11_N, _C11_F, generator=_gen(1512))
_C11_Y = torch.randint(0, _C11_C, (_C11_N,), generator=_gen(1513))
_C11_TRAIN = torch.arange(_C11_N) < 10


def _c11_norm_adj(edges: torch.Tensor, self_loops: bool) -> torch.Tensor:
    """Dense D^-1/2 A D^-1/2 of the loaded graph (DGL GraphConv, norm='both')."""
    a = torch.zeros(_C11_N, _C11_N)
    a[edges[1], edges[0]] = 1.0
    if self_loops:  # the fix: g = dgl.remove_self_loop(g); g = dgl.add_self_loop(g)
        a.fill_diagonal_(0.0)
        a = a + torch.eye(_C11_N)
    deg = a.sum(1).clamp(min=1)
    d = deg.pow(-0.5)
    return d[:, None] * a * d[None, :]


class _GraphConv(nn.Module):
    def __init__(self, fin: int, fout: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(fin, fout))
        self.bias = nn.Parameter(torch.zeros(fout))
        nn.init.xavier_uniform_(self.weight)

    def forward(self, adj: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return adj @ (h @ self.weight) + self.bias


class _GCN(nn.Module):
    def __init__(self, hidden: int = 16, dropout: float = 0.5) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_GraphConv(_C11_F, hidden), _GraphConv(hidden, _C11_C)])
        self.dropout = nn.Dropout(dropout)

    def forward(self, adj: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h = x
        for i, layer in enumerate(self.layers):
            if i:
                h = self.dropout(h)
            h = layer(adj, h)
            if i < len(self.layers) - 1:
                h = F.relu(h)
        return h


def _c11_build(bug: bool) -> Case:
    torch.manual_seed(0)
    adj = _c11_norm_adj(_C11_EDGES, self_loops=not bug)
    model = _GCN().train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=5e-4)
    step = _sgd_step(model, opt, lambda: F.cross_entropy(model(adj, _C11_X)[_C11_TRAIN], _C11_Y[_C11_TRAIN]))
    return model, step, _kw(optimizer=opt, inputs=(adj, _C11_X))


def _c11_proof(bug: bool) -> bool:
    """A node's own features have no effect on its first-layer representation (zero self-Jacobian)."""
    model, step, _ = _c11_build(bug)
    assert isinstance(model, _GCN)
    step()
    adj = _c11_norm_adj(_C11_EDGES, self_loops=not bug)
    x = _C11_X.clone().requires_grad_(True)
    h = model.layers[0](adj, x)
    own = [torch.autograd.grad(h[i].sum(), x, retain_graph=True)[0][i].abs().max().item() for i in range(_C11_N)]
    return max(own) == 0.0


# --------------------------------------------------------------------------------------------- case-12
# Binary segmentation with masks stored as 0 (background) / 255 (target) fed to a 2-class decode head whose
# cross-entropy ignores index 255: every target pixel is dropped from the loss and the head learns background.

_C12_IMG = torch.randn(2, 3, 16, 16, generator=_gen(1521))


def _c12_mask(bug: bool) -> torch.Tensor:
    m = torch.zeros(2, 16, 16, dtype=torch.long)
    m[0, 4:11, 3:9] = 1
    m[1, 8:15, 6:14] = 1
    return m * 255 if bug else m  # the fix: store the target class as 1, not 255


class _TinySegNet(nn.Module):
    """A small encoder-decoder (conv-BN-ReLU stem, stride-2 stage, upsampled 1x1 decode head)."""

    def __init__(self, n_cls: int = 2) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.stage = nn.Sequential(nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.decode = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.Dropout2d(0.1))
        self.conv_seg = nn.Conv2d(16, n_cls, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.decode(self.stage(self.stem(x)))
        return F.interpolate(self.conv_seg(h), size=x.shape[-2:], mode="bilinear", align_corners=False)


def _c12_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _TinySegNet().train()
    mask = _c12_mask(bug)
    criterion = nn.CrossEntropyLoss(ignore_index=255)  # the decode head's loss_decode default
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
    step = _sgd_step(model, opt, lambda: criterion(model(_C12_IMG), mask))
    return model, step, _kw(optimizer=opt, inputs=_C12_IMG)


def _c12_proof(bug: bool) -> bool:
    """The loss puts no gradient on the logits of any pixel of the target object."""
    torch.manual_seed(0)
    model = _TinySegNet().train()
    mask = _c12_mask(bug)
    logits = model(_C12_IMG)
    logits.retain_grad()
    nn.CrossEntropyLoss(ignore_index=255)(logits, mask).backward()
    assert logits.grad is not None
    fg = (mask > 0).unsqueeze(1).expand_as(logits)
    return bool(logits.grad[fg].abs().max().item() == 0.0)


# --------------------------------------------------------------------------------------------- case-13
# A GAN vocoder step: the generator output y_ is computed once, the generator is updated, then the
# discriminator is trained on that same (stale) y_, never on what the updated generator produces.

_C13_MEL = torch.randn(4, 8, 12, generator=_gen(1531))
_C13_WAV = torch.randn(4, 1, 48, generator=_gen(1532))


class _TinyGen(nn.Module):
    """Upsampling conv generator: mel (B, 8, T) -> waveform (B, 1, 4T)."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Conv1d(8, 16, 3, padding=1)
        self.up = nn.ConvTranspose1d(16, 8, 8, stride=4, padding=2)
        self.post = nn.Conv1d(8, 1, 3, padding=1)

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        h = F.leaky_relu(self.pre(c), 0.2)
        h = F.leaky_relu(self.up(h), 0.2)
        return torch.tanh(self.post(h))


class _TinyDisc(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv1d(1, 8, 5, padding=2), nn.LeakyReLU(0.2),
                                 nn.Conv1d(8, 8, 5, stride=2, padding=2), nn.LeakyReLU(0.2),
                                 nn.Conv1d(8, 1, 3, padding=1))

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return self.net(y)


def _c13_stft_loss(y_: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    win = torch.hann_window(16)
    s_ = torch.stft(y_.squeeze(1), 16, 4, window=win, return_complex=True).abs()
    s = torch.stft(y.squeeze(1), 16, 4, window=win, return_complex=True).abs()
    sc = torch.linalg.norm(s - s_) / torch.linalg.norm(s)
    mag = F.l1_loss(torch.log(s_.clamp(min=1e-7)), torch.log(s.clamp(min=1e-7)))
    return sc + mag


class _GANVocoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.generator = _TinyGen()
        self.discriminator = _TinyDisc()
        self.d_inputs: list[torch.Tensor] = []  # what the discriminator was shown as fake, per step


def _c13_build(bug: bool) -> Case:
    torch.manual_seed(0)
    m = _GANVocoder().train()
    g_opt = torch.optim.Adam(m.generator.parameters(), lr=1e-4, eps=1e-6)
    d_opt = torch.optim.Adam(m.discriminator.parameters(), lr=5e-5, eps=1e-6)
    lambda_adv = 4.0

    def step() -> torch.Tensor:
        x, y = _C13_MEL, _C13_WAV
        # generator
        y_ = m.generator(x)
        gen_loss = _c13_stft_loss(y_, y)
        p_ = m.discriminator(y_)
        gen_loss = gen_loss + lambda_adv * F.mse_loss(p_, torch.ones_like(p_))
        g_opt.zero_grad()
        gen_loss.backward()
        g_opt.step()
        # discriminator
        if not bug:  # the fix: re-compute y_ with the updated generator
            with torch.no_grad():
                y_ = m.generator(x)
        m.d_inputs.append(y_.detach().clone())
        p = m.discriminator(y)
        p_ = m.discriminator(y_.detach())
        dis_loss = F.mse_loss(p, torch.ones_like(p)) + F.mse_loss(p_, torch.zeros_like(p_))
        d_opt.zero_grad()
        dis_loss.backward()
        d_opt.step()
        return gen_loss

    return m, step, _kw(optimizer=g_opt, inputs=(_C13_MEL, _C13_WAV))


def _c13_proof(bug: bool) -> bool:
    """The fake batch the discriminator is trained on is not what the (already updated) generator outputs."""
    m, step, _ = _c13_build(bug)
    assert isinstance(m, _GANVocoder)
    step()
    with torch.no_grad():
        current = m.generator(_C13_MEL)
    return bool((m.d_inputs[-1] - current).abs().max().item() > 1e-7)


# --------------------------------------------------------------------------------------------- case-14
# A BYOL trainer whose loop calls optimizer.zero_grad() right before optimizer.step(): the gradients from
# backward are wiped each step, so the online network never moves (only the EMA target drifts to it).


def _c14_mlp(din: int, hidden: int, dout: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(din, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Linear(hidden, dout))


class _TinyBackbone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, 10)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn1(self.conv1(x)))
        return self.pool(F.relu(self.conv2(h))).flatten(1)  # the 'avgpool' hidden layer


class _BYOL(nn.Module):
    def __init__(self, net: _TinyBackbone, moving_average_decay: float = 0.99) -> None:
        super().__init__()
        self.net = net
        self.online_projector = _c14_mlp(16, 32, 8)
        self.online_predictor = _c14_mlp(8, 32, 8)
        self.target_net = copy.deepcopy(net).requires_grad_(False)
        self.target_projector = copy.deepcopy(self.online_projector).requires_grad_(False)
        self.beta = moving_average_decay

    @staticmethod
    def _loss_fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x, y = F.normalize(x, dim=-1, p=2), F.normalize(y, dim=-1, p=2)
        return 2 - 2 * (x * y).sum(dim=-1)

    @staticmethod
    def _augment(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        flip = torch.rand(x.size(0), 1, 1, 1, generator=g) < 0.5
        x = torch.where(flip, x.flip(-1), x)
        return x * (0.8 + 0.4 * torch.rand(x.size(0), 1, 1, 1, generator=g))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = _gen(1541)
        one, two = self._augment(x, g), self._augment(x, g)
        images = torch.cat([one, two])
        pred = self.online_predictor(self.online_projector(self.net.embed(images)))
        p1, p2 = pred.chunk(2)
        with torch.no_grad():
            t1, t2 = self.target_projector(self.target_net.embed(images)).detach().chunk(2)
        return (self._loss_fn(p1, t2) + self._loss_fn(p2, t1)).mean()

    @torch.no_grad()
    def update_moving_average(self) -> None:
        for tgt, on in ((self.target_net, self.net), (self.target_projector, self.online_projector)):
            for pt, po in zip(tgt.parameters(), on.parameters()):
                pt.mul_(self.beta).add_(po, alpha=1 - self.beta)


_C14_IMAGES = torch.randn(6, 3, 8, 8, generator=_gen(1542))


def _c14_build(bug: bool) -> Case:
    torch.manual_seed(0)
    byol = _BYOL(_TinyBackbone()).train()
    opt = torch.optim.Adam([p for p in byol.parameters() if p.requires_grad], lr=3e-4)

    def step() -> torch.Tensor:
        loss = byol(_C14_IMAGES)
        loss.backward()
        if bug:  # the trainer's loop as reported
            opt.zero_grad()
            opt.step()
        else:  # the fix
            opt.step()
            opt.zero_grad()
        byol.update_moving_average()
        return loss

    return byol, step, _kw(optimizer=opt, inputs=_C14_IMAGES)


def _c14_proof(bug: bool) -> bool:
    """After three training steps, no trainable weight of the online network/projector/predictor has moved."""
    byol, step, _ = _c14_build(bug)
    before = {n: p.detach().clone() for n, p in byol.named_parameters() if p.requires_grad}
    for _ in range(3):
        step()
    moved = [not torch.equal(before[n], p) for n, p in byol.named_parameters() if p.requires_grad]
    return not any(moved)


# --------------------------------------------------------------------------------------------- case-15
# LightGCN recommender trained with a BPR loss that averages the pair terms with .mean() and then divides
# by n_pairs again (and regularises every node's embedding, not the batch's): the ranking term is shrunk
# by the batch size, so the gradient is n_pairs times too small and the L2 term dominates.

_C15_USERS, _C15_ITEMS, _C15_DIM = 6, 8, 8


def _c15_graph() -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen(1551)
    u = torch.arange(_C15_USERS).repeat_interleave(3)
    i = torch.randint(0, _C15_ITEMS, (u.numel(),), generator=g) + _C15_USERS
    edge = torch.stack([u, i])
    neg = torch.randint(0, _C15_ITEMS, (u.numel(),), generator=_gen(1552)) + _C15_USERS
    return edge, neg


_C15_EDGE, _C15_NEG = _c15_graph()
_C15_N = _C15_USERS + _C15_ITEMS


def _c15_norm_adj() -> torch.Tensor:
    a = torch.zeros(_C15_N, _C15_N)
    a[_C15_EDGE[0], _C15_EDGE[1]] = 1.0
    a[_C15_EDGE[1], _C15_EDGE[0]] = 1.0
    d = a.sum(1).clamp(min=1).pow(-0.5)
    return d[:, None] * a * d[None, :]  # LGConv: gcn_norm without self-loops


_C15_ADJ = _c15_norm_adj()


class _LightGCN(nn.Module):
    def __init__(self, num_layers: int = 2) -> None:
        super().__init__()
        self.embedding = nn.Embedding(_C15_N, _C15_DIM)
        nn.init.xavier_uniform_(self.embedding.weight)
        self.num_layers = num_layers
        self.alpha = 1.0 / (num_layers + 1)

    def get_embedding(self) -> torch.Tensor:
        x = self.embedding.weight
        out = x * self.alpha
        for _ in range(self.num_layers):
            x = _C15_ADJ @ x
            out = out + x * self.alpha
        return out

    def forward(self, edge_label_index: torch.Tensor) -> torch.Tensor:
        out = self.get_embedding()
        return (out[edge_label_index[0]] * out[edge_label_index[1]]).sum(-1)


def _c15_bpr(bug: bool, pos: torch.Tensor, neg: torch.Tensor, params: torch.Tensor, lambda_reg: float) -> torch.Tensor:
    n_pairs = pos.size(0)
    log_prob = F.logsigmoid(pos - neg).mean() if bug else F.logsigmoid(pos - neg).sum()
    regularization = lambda_reg * params.norm(p=2).pow(2)
    return (-log_prob + regularization) / n_pairs


def _c15_loss(bug: bool, model: _LightGCN, lambda_reg: float = 1e-4) -> torch.Tensor:
    neg_index = torch.stack([_C15_EDGE[0], _C15_NEG])
    pos_rank, neg_rank = model(_C15_EDGE), model(neg_index)
    emb = model.embedding.weight
    if not bug:  # the fix also regularises only the nodes of the mini-batch
        node_id = torch.cat([_C15_EDGE[0], _C15_EDGE[1], _C15_NEG]).unique()
        emb = emb[node_id]
    return _c15_bpr(bug, pos_rank, neg_rank, emb, lambda_reg)


def _c15_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _LightGCN().train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    step = _sgd_step(model, opt, lambda: _c15_loss(bug, model))
    return model, step, _kw(optimizer=opt, inputs=(_C15_EDGE, _C15_NEG))


def _c15_proof(bug: bool) -> bool:
    """The loss differs from the hand-computed mean BPR loss (-mean log sigmoid(pos - neg) + reg / n_pairs)."""
    torch.manual_seed(0)
    model = _LightGCN()
    lam = 0.0  # compare the ranking term alone: it is the part the report says is divided twice
    with torch.no_grad():
        got = _c15_loss(bug, model, lambda_reg=lam).item()
        pos = model(_C15_EDGE)
        neg = model(torch.stack([_C15_EDGE[0], _C15_NEG]))
        want = -torch.log(torch.sigmoid(pos - neg)).mean().item()
    return abs(got - want) > 1e-6 * max(1.0, abs(want))


CASES: list[BlindCase] = [
    BlindCase("b15-case-11", "https://github.com/pmernyei/wiki-cs-dataset/issues/4", "graph construction: missing self-loops",
              "the GCN's graph has no self-loops, so every node's first-layer representation ignores its own features",
              _c11_build, _c11_proof,
              known_miss="a graph built without self-loops is data the step consumes correctly; nothing states the "
                         "intent"),
    BlindCase("b15-case-12", "https://github.com/open-mmlab/mmsegmentation/issues/1609",
              "label encoding collides with ignore_index",
              "target pixels labelled 255 are ignored by the cross-entropy, so the foreground class never gets a "
              "training signal and its IoU stays at zero",
              _c12_build, _c12_proof,
              known_miss="the ignored label 255 marks real foreground pixels; the audit does not measure which "
                         "classes the supervised targets cover"),
    BlindCase("b15-case-13", "https://github.com/kan-bayashi/ParallelWaveGAN/issues/131",
              "GAN: stale generator output for discriminator",
              "the discriminator is trained on the fake batch produced before the generator's update, not on the "
              "current generator's output",
              _c13_build, _c13_proof,
              known_miss="the discriminator reads fakes made before the generator's update; the order of tensors "
                         "across two optimizers' phases is not followed"),
    BlindCase("b15-case-14", "https://github.com/lucidrains/byol-pytorch/issues/93", "zero_grad before optimizer.step",
              "gradients are cleared just before the optimizer step, so the online BYOL network never updates",
              _c14_build, _c14_proof),
    BlindCase("b15-case-15", "https://github.com/pyg-team/pytorch_geometric/issues/7196", "loss double-averaged",
              "the BPR ranking term is averaged and then divided by the number of pairs again, shrinking its gradient "
              "by the batch size relative to the regulariser",
              _c15_build, _c15_proof,
              known_miss="a loss term divided twice by the batch size only changes its weight; no measurement of a "
                         "term's weight"),
]
