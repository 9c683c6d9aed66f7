"""Blind batch 11, part b: silent training bugs outside LLM fine-tuning from public GitHub threads, each with its twin.

Collected by someone who does not write the audit's checks. Every case builds the user's setup on a tiny real
model in plain torch (a small ResNet under linear evaluation with a frozen backbone, an attention encoder with a
pointer decoder and a critic trained by REINFORCE on TSP tours, a MoCo v2 pair of tiny ViT encoders with
projection heads and a negative queue, an MLP diffusion policy over action chunks and a FastSpeech2-like
text-to-mel model; nothing is downloaded) and proves the bug without the audit on real runs and real tensors.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw, _sgd_step

# --------------------------------------------------------------------------------------------- case-06
# linear evaluation of a frozen pretrained ResNet: model.train() puts the frozen backbone's BatchNorm in train mode

_C06_X = torch.randn(8, 3, 8, 8, generator=_gen(1101))
_C06_Y = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2])
_C06_PRETRAIN = torch.randn(16, 3, 8, 8, generator=_gen(1102)) * 0.5 + 0.3


class _Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
        self.conv2, self.bn2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(h)) + self.short(x))


class _LinearEval(nn.Module):
    """A tiny ResNet visual backbone (frozen) and the linear classifier trained on its pooled features."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                                      _Block(8, 16, 2), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.fc = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.backbone(x))


def _c06_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _LinearEval()
    with torch.no_grad():  # stands in for pretraining: the backbone's BN statistics come from another data set
        model.train()
        for _ in range(2):
            model.backbone(_C06_PRETRAIN)
    for p in model.backbone.parameters():
        p.requires_grad = False
    opt = torch.optim.SGD(model.fc.parameters(), lr=0.1, momentum=0.9, weight_decay=0.0)

    def step() -> torch.Tensor:
        model.train()  # the training loop's mode switch, as in the report
        if not bug:  # the fix: the frozen backbone stays in eval mode, so its BN uses (and keeps) the pretrained stats
            model.backbone.eval()
        opt.zero_grad()
        loss = F.cross_entropy(model(_C06_X), _C06_Y)
        loss.backward()
        opt.step()
        return loss

    model.train()
    if not bug:
        model.backbone.eval()
    return model, step, _kw(optimizer=opt, inputs=_C06_X)


def _c06_proof(bug: bool) -> bool:
    """After two steps the BatchNorm running statistics of the fully frozen backbone are not the pretrained ones."""
    model, step, _ = _c06_build(bug)
    assert isinstance(model, _LinearEval)
    before = {n: b.detach().clone() for n, b in model.backbone.named_buffers() if "running" in n}
    for _ in range(2):
        step()
    after = dict(model.backbone.named_buffers())
    return any(not torch.equal(v, after[n]) for n, v in before.items())


# --------------------------------------------------------------------------------------------- case-07
# neural TSP solver trained by REINFORCE with a critic baseline: the critic value is not detached in the policy loss

_C07_B, _C07_N, _C07_D = 8, 6, 32
_C07_XY = torch.rand(_C07_B, _C07_N, 2, generator=_gen(1111))


class _TSPAgent(nn.Module):
    """Encode (self-attention over cities), attend and navigate (pointer decoder sampling a tour), plus a critic
    that predicts the tour length from its own encoding of the cities."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(2, _C07_D)
        self.encoder = nn.TransformerEncoderLayer(_C07_D, 4, 64, dropout=0.0, batch_first=True)
        self.query = nn.GRUCell(_C07_D, _C07_D)
        self.w_ref, self.w_q = nn.Linear(_C07_D, _C07_D, bias=False), nn.Linear(_C07_D, _C07_D, bias=False)
        self.v = nn.Parameter(torch.randn(_C07_D) * 0.1)
        self.start = nn.Parameter(torch.zeros(_C07_D))
        self.critic = nn.ModuleDict({"embed": nn.Linear(2, _C07_D),
                                     "encoder": nn.TransformerEncoderLayer(_C07_D, 4, 64, dropout=0.0,
                                                                           batch_first=True),
                                     "out": nn.Sequential(nn.Linear(_C07_D, _C07_D), nn.ReLU(),
                                                          nn.Linear(_C07_D, 1))})

    def forward(self, xy: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ref = self.encoder(self.embed(xy))
        b, n, _ = ref.shape
        h = self.start.expand(b, -1).contiguous()
        inp = ref.mean(1)
        visited = torch.zeros(b, n, dtype=torch.bool)
        tour, log_probs = [], []
        for _ in range(n):
            h = self.query(inp, h)
            scores = torch.tanh(self.w_ref(ref) + self.w_q(h).unsqueeze(1)) @ self.v
            logp = F.log_softmax(scores.masked_fill(visited, float("-inf")), -1)
            city = torch.multinomial(logp.exp().detach(), 1, generator=gen).squeeze(1)
            log_probs.append(logp.gather(1, city[:, None]).squeeze(1))
            tour.append(city)
            visited = visited | F.one_hot(city, n).bool()
            inp = ref[torch.arange(b), city]
        c = self.critic
        critique = c["out"](c["encoder"](c["embed"](xy)).mean(1)).squeeze(-1)
        return torch.stack(tour, 1), critique, torch.stack(log_probs, 1).sum(1)


def _c07_reward(xy: torch.Tensor, tour: torch.Tensor) -> torch.Tensor:
    """Length of the closed tour (the quantity minimised)."""
    ordered = xy.gather(1, tour.unsqueeze(-1).expand(-1, -1, 2))
    closed = torch.cat([ordered, ordered[:, :1]], 1)
    return (closed[:, 1:] - closed[:, :-1]).norm(dim=-1).sum(-1)


def _c07_losses(agent: _TSPAgent, gen: torch.Generator, bug: bool) -> tuple[torch.Tensor, torch.Tensor]:
    tour, critique, log_probs = agent(_C07_XY, gen)
    reward = _c07_reward(_C07_XY, tour)
    baseline = critique if bug else critique.detach()  # the fix: stop the policy gradient at the critic
    actor_loss = ((reward - baseline) * log_probs).mean()
    critic_loss = F.mse_loss(reward, critique)
    return actor_loss, critic_loss


def _c07_build(bug: bool) -> Case:
    torch.manual_seed(0)
    agent = _TSPAgent().train()
    gen = _gen(1112)
    opt = torch.optim.Adam(agent.parameters(), lr=1e-3)  # one optimizer for actor and critic, as in the report

    def step() -> torch.Tensor:
        opt.zero_grad()
        actor_loss, critic_loss = _c07_losses(agent, gen, bug)
        (actor_loss + critic_loss).backward()
        opt.step()
        return actor_loss + critic_loss

    return agent, step, _kw(optimizer=opt, inputs=_C07_XY)


def _c07_proof(bug: bool) -> bool:
    """The critic's gradient in the step is not the gradient of the critic loss alone: the policy loss reaches it."""
    agent, _, _ = _c07_build(bug)
    assert isinstance(agent, _TSPAgent)
    actor_loss, critic_loss = _c07_losses(agent, _gen(1113), bug)
    params = list(agent.critic.parameters())
    total = torch.autograd.grad(actor_loss + critic_loss, params, retain_graph=True, allow_unused=True)
    alone = torch.autograd.grad(critic_loss, params)
    return not all(t is not None and torch.allclose(t, a, rtol=1e-4, atol=1e-7) for t, a in zip(total, alone))


# --------------------------------------------------------------------------------------------- case-08
# MoCo v2 with a projection head outside the encoder: the momentum update moves the key encoder but not the key head

_C08_B, _C08_DIM, _C08_K, _C08_M, _C08_T = 8, 16, 32, 0.9, 0.2
_C08_IMG = torch.rand(_C08_B, 2, 3, 16, 16, generator=_gen(1121))  # two augmented views of every image
_C08_QUEUE = F.normalize(torch.randn(_C08_DIM, _C08_K, generator=_gen(1122)), dim=0)


class _TinyViT(nn.Module):
    """Patch embedding (4x4 patches), a class token, two pre-norm transformer layers; returns the class token."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, width, 4, 4)
        self.cls = nn.Parameter(torch.zeros(1, 1, width))
        self.pos = nn.Parameter(torch.randn(1, 17, width) * 0.02)
        self.blocks = nn.TransformerEncoder(nn.TransformerEncoderLayer(width, 4, 64, dropout=0.0, batch_first=True,
                                                                       norm_first=True), 2,
                                    enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.patch(x).flatten(2).transpose(1, 2)
        tokens = torch.cat([self.cls.expand(x.shape[0], -1, -1), tokens], 1) + self.pos
        return self.norm(self.blocks(tokens)[:, 0])


class _MoCo(nn.Module):
    queue: torch.Tensor
    queue_ptr: torch.Tensor

    def __init__(self, bug: bool) -> None:
        super().__init__()
        self.bug = bug
        self.encoder_q = _TinyViT()
        self.encoder_k = copy.deepcopy(self.encoder_q)
        self.head_q = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, _C08_DIM))
        self.head_k = copy.deepcopy(self.head_q)
        for p in [*self.encoder_k.parameters(), *self.head_k.parameters()]:
            p.requires_grad = False
        self.register_buffer("queue", _C08_QUEUE.clone())
        self.register_buffer("queue_ptr", torch.zeros((), dtype=torch.long))

    @torch.no_grad()
    def momentum_update(self) -> None:
        pairs = [(self.encoder_q, self.encoder_k)] + ([] if self.bug else [(self.head_q, self.head_k)])
        for online, key in pairs:
            for param_q, param_k in zip(online.parameters(), key.parameters()):
                param_k.data = param_k.data * _C08_M + param_q.data * (1.0 - _C08_M)

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = F.normalize(self.head_q(self.encoder_q(images[:, 0])), dim=1)
        with torch.no_grad():
            k = F.normalize(self.head_k(self.encoder_k(images[:, 1])), dim=1)
        return q, k

    def loss(self, images: torch.Tensor) -> torch.Tensor:
        q, k = self(images)
        logits = torch.cat([(q * k).sum(1, keepdim=True), q @ self.queue.clone().detach()], 1) / _C08_T
        loss = F.cross_entropy(logits, torch.zeros(logits.shape[0], dtype=torch.long))
        with torch.no_grad():  # dequeue and enqueue
            ptr = int(self.queue_ptr)
            self.queue[:, ptr:ptr + k.shape[0]] = k.T
            self.queue_ptr.fill_((ptr + k.shape[0]) % _C08_K)
        return loss


def _c08_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _MoCo(bug).train()
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim > 1]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim <= 1]
    opt = torch.optim.SGD([{"params": decay, "weight_decay": 1e-4}, {"params": no_decay, "weight_decay": 0.0}],
                          lr=0.03, momentum=0.9)

    def step() -> torch.Tensor:
        model.momentum_update()  # at the start of training_step, as in the report
        opt.zero_grad()
        loss = model.loss(_C08_IMG)
        loss.backward()
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=_C08_IMG)


def _c08_proof(bug: bool) -> bool:
    """After three steps the key projection head is bitwise its initial copy while the query head it should follow
    has moved."""
    model, step, _ = _c08_build(bug)
    assert isinstance(model, _MoCo)
    before = [p.detach().clone() for p in model.head_k.parameters()]
    q_before = [p.detach().clone() for p in model.head_q.parameters()]
    for _ in range(3):
        step()
    q_moved = any(not torch.equal(b, p) for b, p in zip(q_before, model.head_q.parameters()))
    return q_moved and all(torch.equal(b, p) for b, p in zip(before, model.head_k.parameters()))


# --------------------------------------------------------------------------------------------- case-09
# diffusion policy (epsilon prediction): the denoising loss compares the network output with x_noisy, not the noise

_C09_B, _C09_H, _C09_A, _C09_OBS, _C09_STEPS = 16, 4, 2, 6, 20
_C09_OBS_X = torch.randn(_C09_B, _C09_OBS, generator=_gen(1131))
_C09_ACT = torch.tanh(torch.randn(_C09_B, _C09_H, _C09_A, generator=_gen(1132)))  # expert action chunks


def _c09_time_embed(t: torch.Tensor, dim: int = 16) -> torch.Tensor:
    freqs = torch.exp(-math.log(10000.0) * torch.arange(dim // 2) / (dim // 2 - 1))
    args = t.float()[:, None] * freqs[None]
    return torch.cat([args.sin(), args.cos()], -1)


class _DiffusionMLP(nn.Module):
    """Predicts the noise in a noised action chunk from the chunk, the diffusion step and the observation."""

    def __init__(self) -> None:
        super().__init__()
        self.time_mlp = nn.Sequential(nn.Linear(16, 32), nn.Mish(), nn.Linear(32, 16))
        self.net = nn.Sequential(nn.Linear(_C09_H * _C09_A + 16 + _C09_OBS, 64), nn.Mish(), nn.Linear(64, 64),
                                 nn.Mish(), nn.Linear(64, _C09_H * _C09_A))

    def forward(self, x: torch.Tensor, t: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        h = torch.cat([x.flatten(1), self.time_mlp(_c09_time_embed(t)), cond], -1)
        return self.net(h).view_as(x)


_C09_BETAS = torch.linspace(1e-4, 0.2, _C09_STEPS)
_C09_ABAR = torch.cumprod(1 - _C09_BETAS, 0)


def _c09_loss(network: Callable[..., torch.Tensor], t: torch.Tensor, noise: torch.Tensor, bug: bool) -> torch.Tensor:
    abar = _C09_ABAR[t][:, None, None]
    x_noisy = abar.sqrt() * _C09_ACT + (1 - abar).sqrt() * noise  # q_sample
    x_recon = network(x_noisy, t, _C09_OBS_X)
    return F.mse_loss(x_recon, x_noisy if bug else noise)  # the fix: epsilon prediction regresses on the noise


def _c09_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _DiffusionMLP().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=1e-6)
    gen = _gen(1133)

    def loss_fn() -> torch.Tensor:
        t = torch.randint(0, _C09_STEPS, (_C09_B,), generator=gen)
        noise = torch.randn(_C09_ACT.shape, generator=gen)
        return _c09_loss(model, t, noise, bug)

    return model, _sgd_step(model, opt, loss_fn), _kw(optimizer=opt, inputs=(_C09_ACT, _C09_OBS_X))


def _c09_proof(bug: bool) -> bool:
    """The training loss is exactly zero for a 'denoiser' that returns its noisy input unchanged: the regression
    target is the network's own input, so it learns an identity map and no noise (it is about 1 for the twin)."""
    t = torch.randint(0, _C09_STEPS, (_C09_B,), generator=_gen(1134))
    noise = torch.randn(_C09_ACT.shape, generator=_gen(1135))
    identity = float(_c09_loss(lambda x, t, cond: x, t, noise, bug))
    model, _, _ = _c09_build(bug)
    with torch.no_grad():
        real = float(_c09_loss(model, t, noise, bug))
    return identity < 1e-12 < real


# --------------------------------------------------------------------------------------------- case-10
# FastSpeech2 mel loss: prediction and target multiplied by the frame mask, then MSE averaged over padded frames too

_C10_PH, _C10_MEL, _C10_D = 40, 8, 32
_C10_TEXT_LEN = torch.tensor([7, 5, 3, 6])
_C10_DUR = torch.randint(1, 4, (4, 7), generator=_gen(1141)) * (torch.arange(7)[None] < _C10_TEXT_LEN[:, None])
_C10_IDS = torch.randint(1, _C10_PH, (4, 7), generator=_gen(1142)) * (torch.arange(7)[None] < _C10_TEXT_LEN[:, None])
_C10_MEL_LEN = _C10_DUR.sum(1)
_C10_T = int(_C10_MEL_LEN.max())
_C10_FRAME_MASK = torch.arange(_C10_T)[None] < _C10_MEL_LEN[:, None]  # True on real frames
_C10_TARGET = torch.randn(4, _C10_T, _C10_MEL, generator=_gen(1143)) * _C10_FRAME_MASK[..., None]  # zero-padded


class _FastSpeech(nn.Module):
    """Phoneme encoder, length regulator with the ground-truth durations, mel decoder and a linear mel head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(_C10_PH, _C10_D, padding_idx=0)
        self.encoder = nn.TransformerEncoderLayer(_C10_D, 2, 64, dropout=0.0, batch_first=True)
        self.decoder = nn.TransformerEncoderLayer(_C10_D, 2, 64, dropout=0.0, batch_first=True)
        self.frame_pos = nn.Parameter(torch.randn(1, 64, _C10_D) * 0.02)
        self.mel = nn.Linear(_C10_D, _C10_MEL)

    def forward(self, ids: torch.Tensor, durations: torch.Tensor) -> torch.Tensor:
        text_pad = ids == 0
        h = self.encoder(self.embed(ids), src_key_padding_mask=text_pad)
        frames = [hb.repeat_interleave(db, 0) for hb, db in zip(h, durations)]
        t = max(f.shape[0] for f in frames)
        x = torch.stack([F.pad(f, (0, 0, 0, t - f.shape[0])) for f in frames]) + self.frame_pos[:, :t]
        lens = durations.sum(1)
        frame_pad = torch.arange(t)[None] >= lens[:, None]
        return self.mel(self.decoder(x, src_key_padding_mask=frame_pad))


def _c10_mel_loss(pred: torch.Tensor, target: torch.Tensor, frame_mask: torch.Tensor, bug: bool) -> torch.Tensor:
    m = frame_mask[..., None]
    if bug:  # the old loss: mask by multiplication, then average over every frame, padded ones included
        return F.mse_loss(pred * m, target * m)
    m = m.expand_as(pred)  # the fix: masked_select, so only real frames enter the mean
    return F.mse_loss(pred.masked_select(m), target.masked_select(m))


def _c10_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _FastSpeech().train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.98), eps=1e-9)
    return model, _sgd_step(model, opt, lambda: _c10_mel_loss(model(_C10_IDS, _C10_DUR), _C10_TARGET,
                                                              _C10_FRAME_MASK, bug)), \
        _kw(optimizer=opt, inputs=(_C10_IDS, _C10_DUR))


def _c10_proof(bug: bool) -> bool:
    """On the model's real predictions the training loss is not the mean squared error over the real frames: the
    padded frames (error 0 after masking) dilute it by real_frames / all_frames, so shorter utterances weigh less."""
    model, _, _ = _c10_build(bug)
    with torch.no_grad():
        pred = model(_C10_IDS, _C10_DUR)
        loss = _c10_mel_loss(pred, _C10_TARGET, _C10_FRAME_MASK, bug)
        real = ((pred - _C10_TARGET) ** 2)[_C10_FRAME_MASK].mean()
    return not torch.allclose(loss, real, rtol=1e-4)


CASES: list[BlindCase] = [
    BlindCase("b11-case-06", "https://github.com/kdexd/virtex/issues/16", "BatchNorm mode / frozen backbone",
              "linear evaluation freezes every backbone weight but calls model.train(): the frozen ResNet's "
              "BatchNorm layers normalise with batch statistics and overwrite the pretrained running mean and var "
              "every step", _c06_build, _c06_proof),
    BlindCase("b11-case-07", "https://github.com/astariul/encode-attend-navigate-pytorch/pull/3",
              "detach / actor-critic baseline",
              "the REINFORCE loss uses the critic's prediction as baseline without detaching it: the critic is "
              "trained by the policy loss as well as by its own MSE, pulling its estimate away from the tour length",
              _c07_build, _c07_proof,
              known_miss="blind batch 11: a baseline that is not detached in the policy loss is arithmetic inside the loss; like a TD target, which terms must be constants is not judged"),
    BlindCase("b11-case-08", "https://github.com/Lightning-Universe/lightning-bolts/issues/1059",
              "momentum encoder / EMA update incomplete",
              "the MoCo momentum update walks only the key encoder's parameters: the key projection head that "
              "produces the keys and the queue stays frozen at its initial copy while the query head trains",
              _c08_build, _c08_proof,
              known_miss="blind batch 11: the momentum update runs outside any optimizer; which parts a momentum copy must follow is not judged"),
    BlindCase("b11-case-09", "https://github.com/irom-princeton/dppo/issues/14", "loss target",
              "the epsilon-predicting diffusion policy is trained with mse_loss(x_recon, x_noisy): the network learns "
              "to reproduce its noised input instead of the noise, the loss still falls and sampling is useless",
              _c09_build, _c09_proof,
              known_miss="blind batch 11: the regression target is a real tensor of the right shape; that it should be the noise, not the noised input, is the loss's arithmetic"),
    BlindCase("b11-case-10", "https://github.com/EveryVoiceTTS/EveryVoice/pull/887", "loss masking / reduction",
              "the FastSpeech2 mel loss multiplies prediction and target by the frame mask and then takes the MSE "
              "over all frames: padded frames count as perfect predictions, scaling the loss and gradient down by "
              "the batch's padding", _c10_build, _c10_proof,
              known_miss="blind batch 11: masking by multiplying leaves every real frame the same weight; only the scale (divided by padded frames too) differs, which one step cannot tell from a loss weight"),
]
