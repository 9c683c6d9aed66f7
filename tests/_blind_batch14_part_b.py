"""Blind batch 14, part b: silent training bugs from public forum, Q&A and blog pages, each with its fixed twin.

Collected by someone who does not write the audit's checks. Every case builds the user's setup on a tiny plain
torch model (nothing is downloaded) and proves the bug without the audit on real tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw, _sgd_step


# --------------------------------------------------------------------------------------------- case-05
# a text classifier's raw logits go straight into NLLLoss: no log_softmax, the loss is just -logit[target]

_C05_IDS = torch.randint(0, 50, (6, 10), generator=_gen(1401))
_C05_Y = torch.randint(0, 5, (6,), generator=_gen(1402))


class _BagClassifier(nn.Module):
    """Embedding bag text classifier: mean word vectors, one hidden layer, class scores."""

    def __init__(self, log_probs: bool) -> None:
        super().__init__()
        self.log_probs = log_probs
        self.emb = nn.EmbeddingBag(50, 16, mode="mean")
        self.hidden = nn.Linear(16, 32)
        self.out = nn.Linear(32, 5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        scores = self.out(torch.relu(self.hidden(self.emb(ids))))
        return F.log_softmax(scores, dim=-1) if self.log_probs else scores


def _c05_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _BagClassifier(log_probs=not bug).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = nn.NLLLoss()
    return model, _sgd_step(model, opt, lambda: crit(model(_C05_IDS), _C05_Y)), _kw(optimizer=opt, inputs=_C05_IDS)


def _c05_proof(bug: bool) -> bool:
    """What NLLLoss receives are not log-probabilities: each row's logsumexp is not 0 (and some entries are > 0)."""
    model, _, _ = _c05_build(bug)
    with torch.no_grad():
        out = model(_C05_IDS)
    return not torch.allclose(out.logsumexp(-1), torch.zeros(out.shape[0]), atol=1e-5)


# --------------------------------------------------------------------------------------------- case-06
# a binary CNN classifier ends in nn.Sigmoid() and is trained with BCEWithLogitsLoss: sigmoid applied twice

_C06_X = torch.randn(8, 1, 12, 12, generator=_gen(1411))
_C06_Y = (torch.rand(8, 1, generator=_gen(1412)) < 0.5).float()


class _BinaryCNN(nn.Module):
    def __init__(self, sigmoid_out: bool) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(),
                                   nn.Linear(32, 1)]
        if sigmoid_out:
            layers.append(nn.Sigmoid())
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _c06_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _BinaryCNN(sigmoid_out=bug).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = nn.BCEWithLogitsLoss()
    return model, _sgd_step(model, opt, lambda: crit(model(_C06_X), _C06_Y)), _kw(optimizer=opt, inputs=_C06_X)


def _c06_proof(bug: bool) -> bool:
    """BCEWithLogitsLoss gets values already in (0, 1): its effective probabilities are stuck in (0.5, 0.731)."""
    model, _, _ = _c06_build(bug)
    with torch.no_grad():
        out = model(_C06_X)
    return bool((out > 0).all() and (out < 1).all())


# --------------------------------------------------------------------------------------------- case-07
# an MLP ported from TensorFlow passes keep_prob=0.9 to nn.Dropout, whose p is the drop probability

_C07_X = torch.randn(16, 20, generator=_gen(1421))
_C07_Y = torch.randint(0, 4, (16,), generator=_gen(1422))
_C07_KEEP_PROB = 0.9


def _c07_build(bug: bool) -> Case:
    torch.manual_seed(0)
    p = _C07_KEEP_PROB if bug else 1 - _C07_KEEP_PROB
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Dropout(p), nn.Linear(64, 64), nn.ReLU(), nn.Dropout(p),
                          nn.Linear(64, 4)).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    crit = nn.CrossEntropyLoss()
    return model, _sgd_step(model, opt, lambda: crit(model(_C07_X), _C07_Y)), _kw(optimizer=opt, inputs=_C07_X)


def _c07_proof(bug: bool) -> bool:
    """In a training forward pass most hidden activations are zeroed: the dropout layer drops ~90%, not ~10%."""
    model, _, _ = _c07_build(bug)
    torch.manual_seed(1)
    with torch.no_grad():
        h = model[1](model[0](_C07_X))
        kept = (model[2](h) != 0).float().sum() / (h != 0).float().sum().clamp(min=1)
    return bool(kept < 0.5)


# --------------------------------------------------------------------------------------------- case-08
# an LSTM regressor calls clip_grad_norm_ before loss.backward(): it clips the zeroed grads, the step is unclipped

_C08_X = torch.randn(4, 15, 3, generator=_gen(1431)) * 6
_C08_Y = torch.randn(4, 1, generator=_gen(1432)) * 50
_C08_MAX_NORM = 0.5


class _LSTMRegressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(3, 16, batch_first=True)
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x)
        return self.head(out[:, -1])


def _c08_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _LSTMRegressor().train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    crit = nn.MSELoss()

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = crit(model(_C08_X), _C08_Y)
        if bug:
            torch.nn.utils.clip_grad_norm_(model.parameters(), _C08_MAX_NORM)
        loss.backward()
        if not bug:
            torch.nn.utils.clip_grad_norm_(model.parameters(), _C08_MAX_NORM)
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=_C08_X)


def _c08_proof(bug: bool) -> bool:
    """The gradients the optimizer applies have a norm far above max_norm: the clipping never touched them."""
    model, step, _ = _c08_build(bug)
    params = list(model.parameters())
    opt_step = torch.optim.SGD.step
    seen: list[float] = []

    def spy(self: torch.optim.SGD, *a: object, **k: object) -> object:  # record the gradient norm at the moment the update is applied
        seen.append(float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params if p.grad is not None]))))
        return opt_step(self, *a, **k)

    torch.optim.SGD.step = spy  # type: ignore[method-assign]
    try:
        step()
    finally:
        torch.optim.SGD.step = opt_step  # type: ignore[method-assign]
    return seen[0] > 2 * _C08_MAX_NORM


CASES: list[BlindCase] = [
    BlindCase("b14-case-05", "https://runebook.dev/en/docs/pytorch/generated/torch.nn.nllloss/torch.nn.NLLLoss",
              "NLLLoss on raw logits",
              "the classifier's raw scores are fed to NLLLoss without log_softmax: the loss is just minus the target "
              "logit, unbounded below, so it falls forever while the class probabilities are never normalised",
              _c05_build, _c05_proof),
    BlindCase("b14-case-06", "https://runebook.dev/ru/docs/pytorch/generated/torch.nn.bcewithlogitsloss",
              "sigmoid applied twice",
              "the model ends in nn.Sigmoid() and BCEWithLogitsLoss applies a second sigmoid: its probabilities are "
              "squashed into (0.5, 0.73), the loss stays high and the gradient is tiny", _c06_build, _c06_proof),
    BlindCase("b14-case-07", "https://discuss.pytorch.org/t/the-p-in-dropout/10698", "dropout keep/drop inversion",
              "a keep probability of 0.9 from the TensorFlow original is passed as nn.Dropout(p=0.9): 90% of the "
              "hidden units are zeroed every step and the survivors are scaled by 10", _c07_build, _c07_proof),
    BlindCase("b14-case-08", "https://runebook.dev/ru/docs/pytorch/generated/torch.nn.utils.clip_grads_with_norm_",
              "clipping before backward",
              "clip_grad_norm_ runs before loss.backward(), on the gradients zero_grad just cleared: the update uses "
              "the full unclipped gradient, so max_norm silently does nothing", _c08_build, _c08_proof),
]
