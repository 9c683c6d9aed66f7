"""Blind batch 11, part c: silent training bugs from public forum threads and blog posts, each with its fixed twin.

Collected by someone who does not write the audit's checks, from discuss.pytorch.org, discuss.huggingface.co,
Stack Overflow and a blog post (no GitHub threads). Every case builds the user's setup on a tiny real model (a
DeepLab-style conv segmentation net with "frozen" BatchNorm, a CRNN text recogniser (conv + BiLSTM + CTC), a one-step
actor-critic agent, a transformers GPT-2 causal LM from a tiny config in code, and a small conv image classifier
trained in pure fp16; nothing is downloaded) and proves the bug without the audit on real runs and real tensors.
"""

from __future__ import annotations

import copy
from typing import Any

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


CASES: list[BlindCase] = [
    BlindCase("b11-case-11",
              _C11_URL, "BatchNorm train/eval mode",
              "BN layers are 'frozen' with momentum=0 and requires_grad=False but left in train mode: every training "
              "batch is normalised with its own batch statistics, not the pretrained running statistics that eval "
              "uses, so the net trains against a normalisation it never sees at test time", _c11_build, _c11_proof),
]
