"""Blind batch 7: silent training bugs from public GitHub threads, each with its fixed twin.

Collected by someone who does not write the audit's checks. Every case builds the user's setup on a tiny real
model (plain torch modules, and transformers Llama, BERT and GPT-2 from tiny configs in code; nothing is
downloaded) and proves the bug without the audit on real runs and real tensors.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw, _sgd_step

# --------------------------------------------------------------------------------------------- case-01
# a softmax layer at the end of the classifier, then CrossEntropyLoss (which applies log_softmax again)

_C01_CLASSES = 4
_C01_X = torch.randn(64, 8, generator=_gen(701))
_C01_Y = (_C01_X[:, :_C01_CLASSES]).argmax(1)  # separable labels


class _GNNHead(nn.Module):
    def __init__(self, bug: bool) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, _C01_CLASSES))
        self.bug = bug

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.net(x)
        return torch.softmax(out, dim=-1) if self.bug else out


def _c01_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _GNNHead(bug).train()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    criterion = nn.CrossEntropyLoss()
    step = _sgd_step(model, opt, lambda: criterion(model(_C01_X), _C01_Y))
    return model, step, _kw(optimizer=opt, inputs=(_C01_X, _C01_Y))


def _c01_proof(bug: bool) -> bool:
    """After training to fit separable data, the loss cannot go below the floor log(1 + (C-1)/e)."""
    _, step, _ = _c01_build(bug)
    loss = math.inf
    for _ in range(40):
        loss = float(step().detach())
    floor = math.log(1 + (_C01_CLASSES - 1) / math.e)
    return loss > floor - 1e-3


# --------------------------------------------------------------------------------------------- case-02
# validation pass run with the model still in train mode: BatchNorm running stats learn the validation set

_C02_TRAIN = torch.randn(8, 3, 16, 16, generator=_gen(702))
_C02_TRAIN_T = torch.randn(8, 4, 16, 16, generator=_gen(703))
_C02_VAL = torch.randn(8, 3, 16, 16, generator=_gen(704)) * 3 + 2  # a differently distributed held-out batch
_C02_VAL_T = torch.randn(8, 4, 16, 16, generator=_gen(705))


class _Hourglass(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                 nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                 nn.Conv2d(16, 4, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _c02_validate(model: nn.Module, bug: bool) -> torch.Tensor:
    model.train() if bug else model.eval()
    with torch.no_grad():
        loss = F.mse_loss(model(_C02_VAL), _C02_VAL_T)
    model.train()
    return loss


def _c02_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _Hourglass().train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step() -> torch.Tensor:
        model.train()
        opt.zero_grad()
        loss = F.mse_loss(model(_C02_TRAIN), _C02_TRAIN_T)
        loss.backward()
        opt.step()
        _c02_validate(model, bug)  # the per-iteration validation of the thread's train loop
        return loss

    return model, step, _kw(optimizer=opt, inputs=(_C02_TRAIN, _C02_TRAIN_T))


def _c02_proof(bug: bool) -> bool:
    """The validation pass changes BatchNorm's running statistics."""
    model, step, _ = _c02_build(bug)
    step()
    bn = model.net[1]
    assert isinstance(bn, nn.BatchNorm2d) and bn.running_mean is not None
    before = bn.running_mean.clone()
    _c02_validate(model, bug)
    return not torch.allclose(before, bn.running_mean)


# --------------------------------------------------------------------------------------------- case-03
# LSTM built without batch_first=True, fed (batch, seq, feature): it runs over the batch as if it were time

_C03_X = torch.randn(6, 5, 16, generator=_gen(706))  # (batch, seq, feature) from the CNN
_C03_Q = torch.randn(6, 3, generator=_gen(707))


class _DRQN(nn.Module):
    def __init__(self, bug: bool) -> None:
        super().__init__()
        self.lstm = nn.LSTM(16, 32, 1, batch_first=not bug)
        self.head = nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x)
        return self.head(out[:, -1, :])  # meant: the last time step of each sample


def _c03_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _DRQN(bug).train()
    opt = torch.optim.RMSprop(model.parameters(), lr=1e-3)
    step = _sgd_step(model, opt, lambda: F.smooth_l1_loss(model(_C03_X), _C03_Q))
    return model, step, _kw(optimizer=opt, inputs=(_C03_X, _C03_Q))


def _c03_proof(bug: bool) -> bool:
    """Changing sample 0's input changes the Q-values of sample 3: the samples leak into each other."""
    model = _c03_build(bug)[0].eval()
    other = _C03_X.clone()
    other[0] += 1.0
    with torch.no_grad():
        a, b = model(_C03_X)[3], model(other)[3]
    return not torch.allclose(a, b, atol=1e-6)


# --------------------------------------------------------------------------------------------- case-04
# causal-LM pretraining on right-padded batches with labels = input_ids: the pad positions are trained on

_C04_PAD = 0
_C04_LENS = [12, 7, 4, 9]


def _c04_batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(1, 48, (4, 12), generator=_gen(708))
    mask = torch.zeros(4, 12, dtype=torch.long)
    for i, n in enumerate(_C04_LENS):
        mask[i, :n] = 1
    ids = ids.masked_fill(mask == 0, _C04_PAD)
    return ids, mask


_C04_IDS, _C04_MASK = _c04_batch()


def _c04_labels(bug: bool) -> torch.Tensor:
    labels = _C04_IDS.clone()
    if not bug:
        labels[_C04_MASK == 0] = -100
    return labels


def _c04_model() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32,
                      pad_token_id=_C04_PAD)
    return LlamaForCausalLM(cfg)


def _c04_build(bug: bool) -> Case:
    model = _c04_model().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    labels = _c04_labels(bug)
    step = _sgd_step(model, opt, lambda: model(input_ids=_C04_IDS, attention_mask=_C04_MASK, labels=labels).loss)
    return model, step, _kw(optimizer=opt, inputs={"input_ids": _C04_IDS, "attention_mask": _C04_MASK,
                                                     "labels": labels})


def _c04_proof(bug: bool) -> bool:
    """The model's loss differs from the mean next-token loss over the real (unpadded) tokens only."""
    model = _c04_model().eval()
    labels = _c04_labels(bug)
    with torch.no_grad():
        out = model(input_ids=_C04_IDS, attention_mask=_C04_MASK, labels=labels)
        logits = out.logits[:, :-1].reshape(-1, 48)
        target = _C04_IDS[:, 1:].reshape(-1)
        real = _C04_MASK[:, 1:].reshape(-1) == 1
        wanted = F.cross_entropy(logits[real], target[real])
    return not torch.allclose(out.loss, wanted, atol=1e-5)


# --------------------------------------------------------------------------------------------- case-05
# BERT NLI classifier fed padded batches with an attention mask of all ones: it attends to the [PAD] tokens

_C05_PAD = 0
_C05_LENS = [10, 6, 8, 4]
_C05_Y = torch.tensor([0, 1, 2, 1])


def _c05_batch(width: int) -> torch.Tensor:
    ids = torch.full((4, width), _C05_PAD, dtype=torch.long)
    g = _gen(709)
    for i, n in enumerate(_C05_LENS):
        ids[i, :n] = torch.randint(1, 40, (n,), generator=g)
    return ids


def _c05_mask(ids: torch.Tensor, bug: bool) -> torch.Tensor:
    return torch.ones_like(ids) if bug else (ids != _C05_PAD).long()


def _c05_model() -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=32, num_labels=3, pad_token_id=_C05_PAD)
    return BertForSequenceClassification(cfg)


def _c05_build(bug: bool) -> Case:
    model = _c05_model().train()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-5)
    ids = _c05_batch(12)
    mask = _c05_mask(ids, bug)
    step = _sgd_step(model, opt, lambda: model(input_ids=ids, attention_mask=mask, labels=_C05_Y).loss)
    return model, step, _kw(optimizer=opt, inputs={"input_ids": ids, "attention_mask": mask, "labels": _C05_Y})


def _c05_proof(bug: bool) -> bool:
    """The logits of the same sentences change when the batch is padded to a longer width."""
    model = _c05_model().eval()
    with torch.no_grad():
        short, long = _c05_batch(12), _c05_batch(20)
        a = model(input_ids=short, attention_mask=_c05_mask(short, bug)).logits
        b = model(input_ids=long, attention_mask=_c05_mask(long, bug)).logits
    return not torch.allclose(a, b, atol=1e-5)


# --------------------------------------------------------------------------------------------- case-06
# gradient accumulation over micro-batches without dividing each micro-batch loss by the number of steps

_C06_ACCUM = 4
_C06_IDS = torch.randint(0, 40, (8, 10), generator=_gen(710))


def _c06_model() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=40, n_positions=16, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


def _c06_accumulate(model: nn.Module, bug: bool) -> torch.Tensor:
    total = torch.zeros(())
    for micro in _C06_IDS.chunk(_C06_ACCUM):
        loss = model(input_ids=micro, labels=micro).loss
        if not bug:
            loss = loss / _C06_ACCUM
        loss.backward()
        total = total + loss.detach()
    return total


def _c06_build(bug: bool) -> Case:
    model = _c06_model().train()
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, weight_decay=0.1)

    def step() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        total = _c06_accumulate(model, bug)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return total

    return model, step, _kw(optimizer=opt, inputs={"input_ids": _C06_IDS, "labels": _C06_IDS})


def _c06_proof(bug: bool) -> bool:
    """The accumulated gradient is not the gradient of the whole batch's mean loss (it is ACCUM times it)."""
    model = _c06_model().train()
    model.zero_grad()
    _c06_accumulate(model, bug)
    acc = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    model.zero_grad()
    model(input_ids=_C06_IDS, labels=_C06_IDS).loss.backward()
    full = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return not torch.allclose(acc, full, rtol=1e-3, atol=1e-6)


CASES: list[BlindCase] = [
    BlindCase("b7-case-01", "https://github.com/mlelarge/graph_neural_net/pull/37", "loss / activations",
              "the model ends in a softmax and its output goes to CrossEntropyLoss, which applies log_softmax "
              "again: the loss has a floor and the gradients shrink", _c01_build, _c01_proof),
    BlindCase("b7-case-02", "https://github.com/princeton-vl/pytorch_stacked_hourglass/issues/44",
              "train / eval mode",
              "the validation pass runs with the model in train mode: BatchNorm's running statistics are "
              "updated from the validation batches", _c02_build, _c02_proof,
              known_miss="held-out batch 7: the validation pass is outside the audited training step"),
    BlindCase("b7-case-03", "https://github.com/AndersonJo/dqn-pytorch/issues/1", "shapes / layout",
              "the LSTM lacks batch_first=True but is fed (batch, seq, feature): it recurs over the batch and the "
              "samples leak into each other", _c03_build, _c03_proof),
    BlindCase("b7-case-04", "https://github.com/axolotl-ai-cloud/axolotl/pull/2227", "data / labels",
              "pretraining without sample packing copies input_ids to labels with the padding left in: the loss "
              "is computed over the pad tokens too", _c04_build, _c04_proof),
    BlindCase("b7-case-05", "https://github.com/yg211/bert_nli/pull/3", "masks",
              "the attention mask is all ones on padded batches: BERT attends to the [PAD] tokens and the "
              "outputs depend on the padding width", _c05_build, _c05_proof),
    BlindCase("b7-case-06", "https://github.com/karpathy/nanoGPT/issues/206", "gradient accumulation",
              "each micro-batch loss is backpropagated without dividing by the accumulation steps: the gradient "
              "is the steps' sum, not their mean", _c06_build, _c06_proof),
]
