"""Blind batch 18 (part b): silent training bugs from public forum threads and posts, each with its fixed twin."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw, _sgd_step

# --------------------------------------------------------------------------------------------- case-06


class _SoftmaxHeadNet(nn.Module):
    """A small classifier whose forward ends in a softmax when ``softmax_out`` is set (as in the report)."""

    def __init__(self, softmax_out: bool, d_in: int = 6, d_h: int = 16, n_cls: int = 3) -> None:
        super().__init__()
        self.softmax_out = softmax_out
        self.fc1 = nn.Linear(d_in, d_h)
        self.fc2 = nn.Linear(d_h, n_cls)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fc2(F.relu(self.fc1(x)))
        return F.softmax(out, dim=1) if self.softmax_out else out


_C06_X = torch.randn(24, 6, generator=_gen(1806))
_C06_Y = (_C06_X[:, 0] > 0).long() + (_C06_X[:, 1] > 0.5).long()


def _c06_build(bug: bool) -> Case:
    """Softmax probabilities are fed to nn.CrossEntropyLoss, which applies log_softmax again."""
    torch.manual_seed(6)
    model = _SoftmaxHeadNet(softmax_out=bug).train()
    criterion = nn.CrossEntropyLoss()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    step = _sgd_step(model, opt, lambda: criterion(model(_C06_X), _C06_Y))
    return model, step, _kw(optimizer=opt, inputs=_C06_X)


def _c06_proof(bug: bool) -> bool:
    """After 200 steps the training loss cannot get under the double-softmax floor log(1 + 2/e) ~ 0.55."""
    _, step, _ = _c06_build(bug)
    for _ in range(200):
        loss = step()
    return float(loss.detach()) > 0.5


# --------------------------------------------------------------------------------------------- case-07


class _FunctionalDropoutNet(nn.Module):
    """MLP using functional dropout; the bug side leaves ``training`` at its default (True)."""

    def __init__(self, pass_training: bool, d_in: int = 8, d_h: int = 32) -> None:
        super().__init__()
        self.pass_training = pass_training
        self.fc1 = nn.Linear(d_in, d_h)
        self.fc2 = nn.Linear(d_h, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.fc1(x))
        if self.pass_training:
            h = F.dropout(h, p=0.5, training=self.training)
        else:
            h = F.dropout(h, p=0.5)
        return self.fc2(h)


_C07_X = torch.randn(16, 8, generator=_gen(1807))
_C07_Y = _C07_X[:, :1] * 2.0 - _C07_X[:, 1:2]


def _c07_build(bug: bool) -> Case:
    """F.dropout(x, p) in forward without training=self.training: dropout stays on after model.eval()."""
    torch.manual_seed(7)
    model = _FunctionalDropoutNet(pass_training=not bug).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    step = _sgd_step(model, opt, lambda: F.mse_loss(model(_C07_X), _C07_Y))
    return model, step, _kw(optimizer=opt, inputs=_C07_X)


def _c07_proof(bug: bool) -> bool:
    """After training, two eval-mode forwards of the same batch give different predictions."""
    model, step, _ = _c07_build(bug)
    for _ in range(5):
        step()
    model.eval()
    with torch.no_grad():
        a, b = model(_C07_X), model(_C07_X)
    return not torch.allclose(a, b)


# --------------------------------------------------------------------------------------------- case-08


class _SigmoidHeadNet(nn.Module):
    """A multi-class classifier whose forward squashes its scores with a sigmoid when ``sigmoid_out``."""

    def __init__(self, sigmoid_out: bool, d_in: int = 5, d_h: int = 16, n_cls: int = 4) -> None:
        super().__init__()
        self.sigmoid_out = sigmoid_out
        self.body = nn.Sequential(nn.Linear(d_in, d_h), nn.Tanh(), nn.Linear(d_h, n_cls))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.body(x)
        return torch.sigmoid(out) if self.sigmoid_out else out


_C08_X = torch.randn(32, 5, generator=_gen(1808))
_C08_Y = _C08_X[:, :4].argmax(1)


def _c08_build(bug: bool) -> Case:
    """Sigmoid outputs are passed to nn.CrossEntropyLoss for a 4-class task instead of raw logits."""
    torch.manual_seed(8)
    model = _SigmoidHeadNet(sigmoid_out=bug).train()
    criterion = nn.CrossEntropyLoss()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    step = _sgd_step(model, opt, lambda: criterion(model(_C08_X), _C08_Y))
    return model, step, _kw(optimizer=opt, inputs=_C08_X)


def _c08_proof(bug: bool) -> bool:
    """After 200 steps the loss stays above the sigmoid-squashed floor log(1 + 3/e) ~ 0.74."""
    _, step, _ = _c08_build(bug)
    for _ in range(200):
        loss = step()
    return float(loss.detach()) > 0.7


CASES: list[BlindCase] = [
    BlindCase("b18-case-06", "https://discuss.pytorch.org/t/cross-entropy-loss-is-not-decreasing/43814/16",
              "softmax before CrossEntropyLoss",
              "The model's softmax output is fed to CrossEntropyLoss, so the loss plateaus near chance and the "
              "gradients shrink while training reports no error.", _c06_build, _c06_proof),
    BlindCase("b18-case-07", "https://e-com-net.com/article/1601294049287897088.htm",
              "functional dropout ignores eval mode",
              "F.dropout is called without training=self.training, so dropout keeps zeroing activations after "
              "model.eval() and validation predictions are random.", _c07_build, _c07_proof),
    BlindCase("b18-case-08", "https://runebook.dev/en/docs/pytorch/generated/torch.nn.functional.sigmoid",
              "sigmoid before CrossEntropyLoss",
              "Sigmoid-squashed scores are passed to CrossEntropyLoss as logits, so the loss cannot fall below a "
              "floor and the classifier learns slowly and stays unconfident.", _c08_build, _c08_proof),
]
