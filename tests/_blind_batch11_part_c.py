"""Blind batch 11, part c: silent training bugs from public forum threads and blog posts, each with its fixed twin.

Collected by someone who does not write the audit's checks, from discuss.pytorch.org, discuss.huggingface.co,
Stack Overflow and a blog post (no GitHub threads). Every case builds the user's setup on a tiny real model (a
DeepLab-style conv segmentation net with "frozen" BatchNorm, a CRNN text recogniser (conv + BiLSTM + CTC), a one-step
actor-critic agent, a transformers GPT-2 causal LM from a tiny config in code, and a small conv image classifier
trained in pure fp16; nothing is downloaded) and proves the bug without the audit on real runs and real tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw, _sgd_step

# --------------------------------------------------------------------------------------------- case-11
_C11_URL = "https://discuss.pytorch.org/t/frozen-batch-normalization-still-shows-different-performance-in-model-train-from-model-eval/25176"  # noqa: E501
# "frozen" BatchNorm: momentum=0 and requires_grad=False, but the model stays in train() so BN normalises every
# training batch with the batch's own statistics instead of the pretrained running statistics

_C11_X = torch.randn(4, 3, 16, 16, generator=_gen(1111)) * 2.0 + 0.7
_C11_Y = torch.randint(0, 4, (4, 16, 16), generator=_gen(1112))


class _SegNet(nn.Module):
    """A DeepLab-like segmentation net in miniature: conv-BN-ReLU blocks, one dilated, and a 1x1 classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16)
        self.conv2, self.bn2 = nn.Conv2d(16, 16, 3, padding=2, dilation=2, bias=False), nn.BatchNorm2d(16)
        self.classifier = nn.Conv2d(16, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn1(self.conv1(x)))
        return self.classifier(F.relu(self.bn2(self.conv2(h))))


def _c11_pretrained() -> _SegNet:
    """The model as loaded from a checkpoint: BN running statistics are the pretraining ones, not (0, 1)."""
    torch.manual_seed(0)
    model = _SegNet()
    g = _gen(1113)
    with torch.no_grad():
        for bn in (model.bn1, model.bn2):
            assert bn.running_mean is not None and bn.running_var is not None
            bn.running_mean.copy_(torch.randn(16, generator=g) * 0.5)
            bn.running_var.copy_(torch.rand(16, generator=g) * 2.0 + 0.5)
            bn.weight.copy_(torch.rand(16, generator=g) + 0.5)
            bn.bias.copy_(torch.randn(16, generator=g) * 0.1)
    return model


def _c11_build(bug: bool) -> Case:
    model = _c11_pretrained()
    bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    for bn in bns:  # the report's "frozen" BN: no running-stat update, no affine update
        bn.momentum = 0.0
        for p in bn.parameters():
            p.requires_grad = False
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-2, momentum=0.9)

    def step() -> torch.Tensor:
        model.train()
        if not bug:  # the answer: a frozen BN must also be in eval mode, so it uses its running statistics
            for bn in bns:
                bn.eval()
        opt.zero_grad()
        loss = F.cross_entropy(model(_C11_X), _C11_Y)
        loss.backward()
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=_C11_X)


def _c11_proof(bug: bool) -> bool:
    """During a real training step the first BN does not normalise with its (pretrained) running statistics."""
    model, step, _ = _c11_build(bug)
    assert isinstance(model, _SegNet)
    seen: dict[str, torch.Tensor] = {}

    def hook(mod: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        seen["x"], seen["y"] = args[0].detach(), out.detach()

    handle = model.bn1.register_forward_hook(hook)
    step()
    handle.remove()
    bn = model.bn1
    with torch.no_grad():
        frozen = F.batch_norm(seen["x"], bn.running_mean, bn.running_var, bn.weight, bn.bias, False, 0.0, bn.eps)
    return not torch.allclose(seen["y"], frozen, atol=1e-5)


# --------------------------------------------------------------------------------------------- case-12
# CRNN: the BiLSTM is switched to batch_first=True for TensorRT, but the conv features are still fed as [w, b, c]:
# the LSTM now runs its recurrence across the images of the batch and treats the width as the batch
_C12_URL = "https://discuss.pytorch.org/t/lstm-change-batch-first-true-loss-does-not-decrease/62364"

_C12_B, _C12_NCLASS = 3, 6  # class 0 is the CTC blank
_C12_IMG = torch.randn(_C12_B, 1, 16, 16, generator=_gen(1121))
_C12_TGT = torch.randint(1, _C12_NCLASS, (_C12_B, 3), generator=_gen(1122))


class _BidirectionalLSTM(nn.Module):
    def __init__(self, n_in: int, hidden: int, n_out: int, batch_first: bool) -> None:
        super().__init__()
        self.rnn = nn.LSTM(n_in, hidden, bidirectional=True, batch_first=batch_first)
        self.embedding = nn.Linear(hidden * 2, n_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        recurrent, _ = self.rnn(x)
        d0, d1, h = recurrent.size()
        return self.embedding(recurrent.reshape(d0 * d1, h)).view(d0, d1, -1)


class _CRNN(nn.Module):
    """meijieru/crnn.pytorch in miniature: conv stack down to height 1, then two BiLSTMs, output [T, b, nclass]."""

    def __init__(self, bug: bool) -> None:
        super().__init__()
        self.bug = bug
        self.cnn = nn.Sequential(
            nn.Conv2d(1, 16, 3, 1, 1), nn.ReLU(True), nn.MaxPool2d(2, 2),                          # 16x8x8
            nn.Conv2d(16, 32, 3, 1, 1), nn.BatchNorm2d(32), nn.ReLU(True), nn.MaxPool2d((2, 1)),   # 32x4x8
            nn.Conv2d(32, 32, 3, 1, 1), nn.ReLU(True), nn.MaxPool2d((2, 1)),                       # 32x2x8
            nn.Conv2d(32, 32, (2, 1)), nn.BatchNorm2d(32), nn.ReLU(True))                          # 32x1x8
        self.rnn = nn.Sequential(_BidirectionalLSTM(32, 16, 16, batch_first=True),
                                 _BidirectionalLSTM(16, 16, _C12_NCLASS, batch_first=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        conv = self.cnn(x).squeeze(2)                # [b, c, w]
        if self.bug:
            return self.rnn(conv.permute(2, 0, 1))   # [w, b, c] into a batch_first LSTM
        out = self.rnn(conv.permute(0, 2, 1))        # the fix: [b, w, c] for batch_first ...
        return out.permute(1, 0, 2)                  # ... and back to [T, b, nclass] for CTC


def _c12_loss(model: nn.Module, img: torch.Tensor) -> torch.Tensor:
    log_probs = model(img).log_softmax(2)            # [T, b, nclass]
    t = log_probs.size(0)
    return F.ctc_loss(log_probs, _C12_TGT, torch.full((_C12_B,), t, dtype=torch.long),
                      torch.full((_C12_B,), _C12_TGT.size(1), dtype=torch.long))


def _c12_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _CRNN(bug).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    return model, _sgd_step(model, opt, lambda: _c12_loss(model, _C12_IMG)), _kw(optimizer=opt, inputs=_C12_IMG)


def _c12_proof(bug: bool) -> bool:
    """In eval mode (no BN batch coupling), changing only image 1 changes the predictions for image 0."""
    model, step, _ = _c12_build(bug)
    step()
    model.eval()
    other = _C12_IMG.clone()
    other[1] = torch.randn(1, 16, 16, generator=_gen(1123))
    with torch.no_grad():
        a, b = model(_C12_IMG)[:, 0], model(other)[:, 0]
    return not torch.allclose(a, b, atol=1e-6)


# --------------------------------------------------------------------------------------------- case-13
# one-step actor-critic: the TD target r + gamma * V(s') is computed with gradients, so the critic also regresses
# V(s') toward V(s) (the "moving target" bug); the fix computes the next-state value under torch.no_grad()
_C13_URL = "https://singularityfeed.com/deep-reinforcement-learning-the-actor-critic-method"

_C13_BS, _C13_S, _C13_A, _C13_GAMMA = 32, 8, 4, 0.99
_C13_STATE = torch.randn(_C13_BS, _C13_S, generator=_gen(1131))
_C13_ACTION = torch.randint(0, _C13_A, (_C13_BS,), generator=_gen(1132))
_C13_REWARD = torch.randn(_C13_BS, generator=_gen(1133))
_C13_NEXT = _C13_STATE + 0.3 * torch.randn(_C13_BS, _C13_S, generator=_gen(1134))
_C13_DONE = (torch.rand(_C13_BS, generator=_gen(1135)) < 0.1).float()


class _ActorCritic(nn.Module):
    """Drone-landing agent in miniature: a categorical policy over thrust actions and a state-value critic."""

    def __init__(self) -> None:
        super().__init__()
        self.actor = nn.Sequential(nn.Linear(_C13_S, 64), nn.Tanh(), nn.Linear(64, _C13_A))
        self.critic = nn.Sequential(nn.Linear(_C13_S, 64), nn.Tanh(), nn.Linear(64, 1))

    def forward(self, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.actor(state), self.critic(state).squeeze(-1)


def _c13_losses(agent: _ActorCritic, bug: bool) -> tuple[torch.Tensor, torch.Tensor]:
    logits, value = agent(_C13_STATE)
    if bug:
        next_value = agent.critic(_C13_NEXT).squeeze(-1)
    else:
        with torch.no_grad():
            next_value = agent.critic(_C13_NEXT).squeeze(-1)
    td_target = _C13_REWARD + _C13_GAMMA * next_value * (1 - _C13_DONE)
    td_error = td_target - value
    critic_loss = td_error.pow(2).mean()
    log_prob = torch.distributions.Categorical(logits=logits).log_prob(_C13_ACTION)
    actor_loss = -(log_prob * td_error.detach()).mean()
    return actor_loss, critic_loss


def _c13_build(bug: bool) -> Case:
    torch.manual_seed(0)
    agent = _ActorCritic().train()
    opt = torch.optim.Adam([{"params": agent.actor.parameters(), "lr": 3e-4},
                            {"params": agent.critic.parameters(), "lr": 1e-3}])

    def step() -> torch.Tensor:
        opt.zero_grad()
        actor_loss, critic_loss = _c13_losses(agent, bug)
        loss = actor_loss + 0.5 * critic_loss
        loss.backward()
        opt.step()
        return loss

    return agent, step, _kw(optimizer=opt, inputs=_C13_STATE)


def _c13_proof(bug: bool) -> bool:
    """The critic gradient of the step is not the TD semi-gradient (target held fixed): V(s') is being trained too."""
    agent, _, _ = _c13_build(bug)
    assert isinstance(agent, _ActorCritic)
    params = list(agent.critic.parameters())
    _, critic_loss = _c13_losses(agent, bug)
    used = torch.autograd.grad(critic_loss, params)
    _, value = agent(_C13_STATE)
    with torch.no_grad():
        target = _C13_REWARD + _C13_GAMMA * agent.critic(_C13_NEXT).squeeze(-1) * (1 - _C13_DONE)
    semi = torch.autograd.grad((target - value).pow(2).mean(), params)
    return not all(torch.allclose(u, g, atol=1e-7) for u, g in zip(used, semi))


# --------------------------------------------------------------------------------------------- case-14
# GPT-2 fine-tuning with a custom Dataset that shifts the labels itself (labels = tokens[1:]): the model shifts them
# again inside forward, so every position is trained to predict the token two steps ahead
_C14_URL = "https://discuss.huggingface.co/t/where-does-the-transformers-do-the-target-text-shifting-in-causal-lm/32408"

_C14_TOK = torch.randint(3, 40, (4, 13), generator=_gen(1141))


def _c14_batch(bug: bool) -> dict[str, torch.Tensor]:
    """What the user's Dataset.__getitem__ returns, batched."""
    if bug:
        return {"input_ids": _C14_TOK[:, :-1], "labels": _C14_TOK[:, 1:]}
    ids = _C14_TOK[:, :-1]
    return {"input_ids": ids, "labels": ids.clone()}  # the answer: labels are a copy, the model shifts them


def _c14_build(bug: bool) -> Case:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=40, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2)
    model = GPT2LMHeadModel(cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=5e-4)
    batch = _c14_batch(bug)
    return model, _sgd_step(model, opt, lambda: model(**batch).loss), _kw(optimizer=opt, inputs=batch)


def _c14_proof(bug: bool) -> bool:
    """The loss the model reports is the cross-entropy against the token two positions ahead, not the next one."""
    model, _, _ = _c14_build(bug)
    batch = _c14_batch(bug)
    with torch.no_grad():
        out = model(**batch)
        logits = out.logits[:, :-1].reshape(-1, 40)  # input position t = token t of _C14_TOK
        two_ahead = F.cross_entropy(logits, _C14_TOK[:, 2:].reshape(-1))
        nxt = F.cross_entropy(logits, _C14_TOK[:, 1:-1].reshape(-1))
    return bool(torch.isclose(out.loss, two_ahead, rtol=1e-4)) and not bool(torch.isclose(out.loss, nxt, rtol=1e-4))


# --------------------------------------------------------------------------------------------- case-15
# "half precision training" by model.half() and inputs.half(): the weights themselves are fp16, so SGD updates that
# are smaller than half an fp16 ulp of the weight round away to nothing; the fix is autocast with fp32 weights
_C15_URL = "https://stackoverflow.com/questions/74092624/does-automatic-mixed-precision-amp-half-the-paramters-of-a-model"  # noqa: E501

_C15_X = torch.randn(8, 3, 16, 16, generator=_gen(1151))
_C15_Y = torch.randint(0, 10, (8,), generator=_gen(1152))


class _SmallConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                      nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1))
        self.fc = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x).flatten(1))


def _c15_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _SmallConvNet().train()
    if bug:
        model.half()
        x = _C15_X.half()
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        return model, _sgd_step(model, opt, lambda: F.cross_entropy(model(x), _C15_Y)), _kw(optimizer=opt, inputs=x)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu")

    def step() -> torch.Tensor:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(_C15_X), _C15_Y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss

    return model, step, _kw(optimizer=opt, inputs=_C15_X, scaler=scaler)


def _c15_proof(bug: bool) -> bool:
    """After one real step, most weights that received a non-zero gradient are bitwise unchanged."""
    model, step, _ = _c15_build(bug)
    before = [p.detach().clone() for p in model.parameters()]
    step()
    moved = lost = 0
    for b, p in zip(before, model.parameters()):
        assert p.grad is not None
        got = p.grad != 0
        moved += int(got.sum())
        lost += int((got & (p.detach() == b)).sum())
    return moved > 0 and lost / moved > 0.5


CASES: list[BlindCase] = [
    BlindCase("b11-case-11",
              _C11_URL, "BatchNorm train/eval mode",
              "BN layers are 'frozen' with momentum=0 and requires_grad=False but left in train mode: every training "
              "batch is normalised with its own batch statistics, not the pretrained running statistics that eval "
              "uses, so the net trains against a normalisation it never sees at test time", _c11_build, _c11_proof),
    BlindCase("b11-case-12", _C12_URL, "RNN layout / batch_first",
              "the CRNN's BiLSTMs are switched to batch_first=True while the conv features still arrive as "
              "[width, batch, channels]: the recurrence runs across the images of the batch, so each image's "
              "transcription depends on its batch neighbours and CTC trains on mixed-up sequences", _c12_build,
              _c12_proof),
    BlindCase("b11-case-13", _C13_URL, "RL / TD target not detached",
              "the critic's TD target r + gamma * V(s') keeps its graph: backprop also pushes V(s') toward V(s), "
              "the bootstrapped target moves with every update and the critic loss oscillates instead of "
              "converging", _c13_build, _c13_proof,
              known_miss="blind batch 11: a TD target computed by the trained critic itself is not judged (a target network, or a consistency loss, does that on purpose)"),
    BlindCase("b11-case-14", _C14_URL, "labels / target alignment",
              "the Dataset already shifts labels one token left and GPT2LMHeadModel shifts them again: the LM is "
              "trained to predict the token two positions ahead, and the loss barely goes down", _c14_build,
              _c14_proof),
    BlindCase("b11-case-15", _C15_URL, "mixed precision / fp16 master weights",
              "the model is trained after model.half(): parameters and their updates live in fp16, so most SGD "
              "updates fall below the fp16 resolution of the weights and are rounded away; the loss hardly moves "
              "while the same run under autocast with fp32 weights learns", _c15_build, _c15_proof),
]
