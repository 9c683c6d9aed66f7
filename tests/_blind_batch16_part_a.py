"""Blind batch 16 (part a): silent training bugs from public GitHub threads, each with its fixed twin."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw, _sgd_step

# --------------------------------------------------------------------------------------------- case-01


class _TinySentenceEncoder(nn.Module):
    """A bi-encoder: token embedding, one transformer layer, attention-masked mean pooling."""

    def __init__(self, vocab: int = 40, d: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d, padding_idx=0)
        self.layer = nn.TransformerEncoderLayer(d, 2, 32, dropout=0.0, batch_first=True)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = ids != 0
        h = self.layer(self.embed(ids), src_key_padding_mask=~mask)
        m = mask.unsqueeze(-1).float()
        return (h * m).sum(1) / m.sum(1).clamp(min=1.0)


class _SoftmaxLoss(nn.Module):
    """sentence-transformers' SoftmaxLoss: classifier over concat(u, v, |u - v|) for NLI pair labels.

    It holds the sentence model and its own classifier, which is part of the loss, not of the model."""

    def __init__(self, model: _TinySentenceEncoder, dim: int, num_labels: int) -> None:
        super().__init__()
        self.model = model
        self.classifier = nn.Linear(3 * dim, num_labels)

    def forward(self, ids_a: torch.Tensor, ids_b: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        u, v = self.model(ids_a), self.model(ids_b)
        logits = self.classifier(torch.cat([u, v, (u - v).abs()], -1))
        return F.cross_entropy(logits, labels)


_C01_A = torch.randint(1, 40, (8, 7), generator=_gen(1601))
_C01_B = torch.randint(1, 40, (8, 7), generator=_gen(1602))
_C01_A[:, 5:] = 0
_C01_B[:, 6:] = 0
_C01_Y = torch.randint(0, 3, (8,), generator=_gen(1603))


def _c01_build(bug: bool) -> Case:
    """NLI pair-class training with SoftmaxLoss; the trainer builds its optimizer from the model's parameters
    only (bug) instead of from the parameters of the loss, which include the classifier (fix)."""
    torch.manual_seed(0)
    st_model = _TinySentenceEncoder()
    loss_model = _SoftmaxLoss(st_model, 16, 3).train()
    params = st_model.parameters() if bug else loss_model.parameters()
    opt = torch.optim.AdamW(params, lr=2e-3)
    step = _sgd_step(loss_model, opt, lambda: loss_model(_C01_A, _C01_B, _C01_Y))
    return loss_model, step, _kw(optimizer=opt, inputs=(_C01_A, _C01_B, _C01_Y))


def _c01_proof(bug: bool) -> bool:
    """After three steps the SoftmaxLoss classifier, which gets a nonzero gradient, is still at its random init."""
    model, step, _ = _c01_build(bug)
    before = model.classifier.weight.detach().clone()
    for _ in range(3):
        step()
    got_grad = model.classifier.weight.grad is not None and float(model.classifier.weight.grad.abs().sum()) > 0
    return got_grad and torch.equal(before, model.classifier.weight.detach())

# --------------------------------------------------------------------------------------------- case-02


def _c02_tokenize_row(prompt: list[int], steps: list[list[int]], step_labels: list[bool]) -> list[int]:
    """trl's PRMTrainer.tokenize_row: only the last token of each step carries its (0/1) label, the rest -100."""
    labels = [-100] * len(prompt)
    for ids, lab in zip(steps, step_labels):
        labels += [-100] * (len(ids) - 1) + [int(lab)]
    return labels


_C02_ROWS = [([3, 4, 5], [[6, 7, 8], [9, 10]], [True, False]),
             ([11, 4, 12], [[13, 14], [15, 16, 17]], [False, True]),
             ([5, 6, 18], [[19, 20, 21], [22, 23]], [True, True]),
             ([24, 25, 3], [[26, 27], [28, 29, 30]], [False, False])]
_C02_IDS = torch.tensor([p + sum(s, []) for p, s, _ in _C02_ROWS])
_C02_MASK = torch.ones_like(_C02_IDS)
_C02_TRUE = torch.tensor([_c02_tokenize_row(*r) for r in _C02_ROWS])


def _c02_labels(bug: bool) -> torch.Tensor:
    """The `labels` column after `dataset.map(tokenize_row)`: in the bug the column keeps the dataset's original
    bool feature type, so the ints are cast back to bool (-100 -> True, 0 -> False, 1 -> True)."""
    rows = [_c02_tokenize_row(*r) for r in _C02_ROWS]
    if bug:
        rows = [[bool(x) for x in row] for row in rows]
    return torch.tensor(rows).long()


def _c02_model() -> nn.Module:
    from transformers import Qwen2Config, Qwen2ForTokenClassification

    cfg = Qwen2Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32, num_labels=2,
                      pad_token_id=0)
    return Qwen2ForTokenClassification(cfg)


def _c02_build(bug: bool) -> Case:
    """Process reward model (token classification) trained on step-end labels prepared by PRM tokenization."""
    torch.manual_seed(0)
    model = _c02_model().train()
    labels = _c02_labels(bug)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = _sgd_step(model, opt, lambda: model(input_ids=_C02_IDS, attention_mask=_C02_MASK, labels=labels).loss)
    return model, step, _kw(optimizer=opt, inputs=(_C02_IDS, _C02_MASK, labels))


def _c02_proof(bug: bool) -> bool:
    """The loss the model trains on differs from the cross-entropy over the step-end tokens only (the intended
    objective): every prompt and mid-step token is supervised as a positive step."""
    model, _, _ = _c02_build(bug)
    with torch.no_grad():
        out = model(input_ids=_C02_IDS, attention_mask=_C02_MASK, labels=_c02_labels(bug))
        keep = _C02_TRUE != -100
        ref = F.cross_entropy(out.logits[keep], _C02_TRUE[keep])
    return abs(float(out.loss) - float(ref)) > 1e-6


CASES: list[BlindCase] = [
    BlindCase("b16-case-01", "https://github.com/huggingface/sentence-transformers/issues/2872",
              "parameters missing from optimizer",
              "The optimizer is built from the sentence model's parameters only, so the SoftmaxLoss classifier "
              "stays at its random init and the encoder is fitted to a fixed random projection.",
              _c01_build, _c01_proof),
    BlindCase("b16-case-02", "https://github.com/huggingface/trl/pull/2127", "ignore-index labels corrupted",
              "The -100 ignore labels are cast to bool by the dataset's original label feature, so every prompt "
              "and mid-step token becomes a positive target and the reward model learns to say 'correct' everywhere.",
              _c02_build, _c02_proof),
]
