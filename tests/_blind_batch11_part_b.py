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

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw, _sgd_step  # noqa: F401


# --------------------------------------------------------------------------------------------- case-06
# linear evaluation of a frozen pretrained ResNet: model.train() puts the frozen backbone's BatchNorm in train mode

_C06_X = torch.randn(8, 3, 16, 16, generator=_gen(1101))
_C06_Y = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2])
_C06_PRETRAIN = torch.randn(32, 3, 16, 16, generator=_gen(1102)) * 0.5 + 0.3


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
                                      _Block(8, 16, 2), _Block(16, 32, 2), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.fc = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.backbone(x))


def _c06_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _LinearEval()
    with torch.no_grad():  # stands in for pretraining: the backbone's BN statistics come from another data set
        model.train()
        for _ in range(5):
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
    """After two steps the BatchNorm running statistics of the fully frozen backbone are no longer the pretrained ones."""
    model, step, _ = _c06_build(bug)
    assert isinstance(model, _LinearEval)
    before = {n: b.detach().clone() for n, b in model.backbone.named_buffers() if "running" in n}
    for _ in range(2):
        step()
    after = dict(model.backbone.named_buffers())
    return any(not torch.equal(v, after[n]) for n, v in before.items())


CASES: list[BlindCase] = [
    BlindCase("b11-case-06", "https://github.com/kdexd/virtex/issues/16", "BatchNorm mode / frozen backbone",
              "linear evaluation freezes every backbone weight but calls model.train(): the frozen ResNet's "
              "BatchNorm layers normalise with batch statistics and overwrite the pretrained running mean and var "
              "every step", _c06_build, _c06_proof),
]
