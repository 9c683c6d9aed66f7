"""Blind batch 13, part c: silent training bugs from public forum, Q&A and blog reports, each with its fixed twin.

Collected by someone who does not write the audit's checks. Every case builds the user's setup on a tiny real
model (a transformers BERT sequence classifier and a GPT-2 causal LM, both from tiny configs in code; a plain
torch ASPP segmentation head, a tabular MLP regressor and an LSTM sequence regressor;
nothing is downloaded) and proves the bug without the audit on real runs and real tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw, _sgd_step

# --------------------------------------------------------------------------------------------- case-11
# BERT classifier trained while still in eval mode (from_pretrained returns eval(); the loop never calls train())

_C11_IDS = torch.randint(3, 40, (4, 12), generator=_gen(1311))
_C11_MASK = torch.ones(4, 12, dtype=torch.long)
_C11_Y = torch.tensor([0, 1, 1, 0])


def _c11_bert() -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    cfg = BertConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=32,
                     hidden_dropout_prob=0.3, attention_probs_dropout_prob=0.3)
    cfg.num_labels = 2
    return BertForSequenceClassification(cfg)


def _c11_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _c11_bert()
    model.eval()  # what from_pretrained hands back
    if not bug:
        model.train()  # the fix: switch to training mode before fitting
    opt = torch.optim.AdamW(model.parameters(), lr=2e-5)
    batch = {"input_ids": _C11_IDS, "attention_mask": _C11_MASK, "labels": _C11_Y}
    step = _sgd_step(model, opt, lambda: model(**batch).loss)
    return model, step, _kw(optimizer=opt, inputs=batch)


def _c11_proof(bug: bool) -> bool:
    """During the training step dropout does nothing: two forwards of the same batch give identical logits."""
    model, step, _ = _c11_build(bug)
    step()
    with torch.no_grad():
        a = model(input_ids=_C11_IDS, attention_mask=_C11_MASK).logits
        b = model(input_ids=_C11_IDS, attention_mask=_C11_MASK).logits
    return bool(torch.equal(a, b))


# --------------------------------------------------------------------------------------------- case-12
# ASPP branches kept in a plain Python list: they run in forward but are not registered, so never trained

_C12_X = torch.randn(2, 8, 16, 16, generator=_gen(1321))
_C12_Y = torch.randint(0, 4, (2, 16, 16), generator=_gen(1322))


class _ASPPConv(nn.Sequential):
    def __init__(self, cin: int, cout: int, rate: int) -> None:
        super().__init__(nn.Conv2d(cin, cout, 3, padding=rate, dilation=rate, bias=False),
                         nn.BatchNorm2d(cout), nn.ReLU())


class _WAB(nn.Module):
    """Atrous branches at several rates, concatenated, projected, then a per-pixel classifier."""

    def __init__(self, registered: bool, cin: int = 8, cout: int = 16, rates: tuple[int, ...] = (1, 2, 3)) -> None:
        super().__init__()
        modules = [_ASPPConv(cin, cin // 2, r) for r in rates]
        if registered:
            self.convlist = nn.ModuleList(modules)
        else:
            self.convlist = modules  # type: ignore[assignment]
        self.project = nn.Sequential(nn.Conv2d(len(rates) * (cin // 2), cout, 1, bias=False),
                                     nn.BatchNorm2d(cout), nn.ReLU())
        self.classifier = nn.Conv2d(cout, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.project(torch.cat([conv(x) for conv in self.convlist], dim=1)))


def _c12_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _WAB(registered=not bug).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    step = _sgd_step(model, opt, lambda: F.cross_entropy(model(_C12_X), _C12_Y))
    return model, step, _kw(optimizer=opt, inputs=_C12_X)


def _c12_proof(bug: bool) -> bool:
    """After two training steps the atrous branch weights are exactly what they were at construction."""
    model, step, _ = _c12_build(bug)
    assert isinstance(model, _WAB)
    weights = [w for conv in model.convlist for w in conv.parameters() if w.dim() == 4]
    before = [w.detach().clone() for w in weights]
    step()
    step()
    return all(torch.equal(b, w) for b, w in zip(before, weights))


# --------------------------------------------------------------------------------------------- case-13
# squared loss between y_hat of shape [n, 1] and y of shape [n]: broadcast to [n, n], every output fits every label

_C13_N, _C13_F = 16, 6
_C13_X = torch.randn(_C13_N, _C13_F, generator=_gen(1331))
_C13_W = torch.randn(_C13_F, generator=_gen(1332))
_C13_Y = _C13_X @ _C13_W + 0.1 * torch.randn(_C13_N, generator=_gen(1333))  # shape [n], as the loader yields it


def _c13_squared_loss(y_hat: torch.Tensor, y: torch.Tensor, bug: bool) -> torch.Tensor:
    if bug:
        return ((y_hat - y) ** 2 / 2).mean()
    return ((y_hat - y.view(y_hat.size())) ** 2 / 2).mean()


def _c13_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(_C13_F, 32), nn.ReLU(), nn.Linear(32, 1)).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.03)
    step = _sgd_step(model, opt, lambda: _c13_squared_loss(model(_C13_X), _C13_Y, bug))
    return model, step, _kw(optimizer=opt, inputs=_C13_X)


def _c13_proof(bug: bool) -> bool:
    """The gradient reaching each prediction is not its own residual: it is the residual against the batch mean."""
    model, _, _ = _c13_build(bug)
    y_hat = model(_C13_X).detach().requires_grad_(True)
    (g,) = torch.autograd.grad(_c13_squared_loss(y_hat, _C13_Y, bug), [y_hat])
    own = (y_hat.detach() - _C13_Y.view(-1, 1)) / _C13_N
    return not torch.allclose(g, own, atol=1e-6)


# --------------------------------------------------------------------------------------------- case-14
# GPT-2 fine-tune with pad_token = eos_token: masking pad positions to -100 also masks every real EOS label

_C14_EOS, _C14_PAD_NEW = 2, 3  # the fix adds a distinct [PAD] token (id 3 here)
_C14_LENS = (9, 6, 11, 7)
_C14_T = 12


def _c14_batch(pad_id: int) -> dict[str, torch.Tensor]:
    g = _gen(1341)
    ids = torch.full((len(_C14_LENS), _C14_T), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(_C14_LENS):
        ids[i, : n - 1] = torch.randint(4, 40, (n - 1,), generator=g)
        ids[i, n - 1] = _C14_EOS
        mask[i, :n] = 1
    labels = ids.clone()
    labels[labels == pad_id] = -100  # the usual collator line
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _c14_build(bug: bool) -> Case:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    pad_id = _C14_EOS if bug else _C14_PAD_NEW
    cfg = GPT2Config(vocab_size=40, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=1,
                     eos_token_id=_C14_EOS, pad_token_id=pad_id)
    model = GPT2LMHeadModel(cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=5e-4)
    batch = _c14_batch(pad_id)
    step = _sgd_step(model, opt, lambda: model(**batch).loss)
    return model, step, _kw(optimizer=opt, inputs=batch)


def _c14_proof(bug: bool) -> bool:
    """No position of the batch the model trains on has EOS as its label: the model is never taught to stop."""
    _, _, kw = _c14_build(bug)
    labels = kw["inputs"]["labels"] if "inputs" in kw else _c14_batch(_C14_EOS if bug else _C14_PAD_NEW)["labels"]
    return not bool((labels == _C14_EOS).any())


# --------------------------------------------------------------------------------------------- case-15
# LSTM churn model: clip_grad_norm_ is called after optimizer.step(), so the step applies the unclipped gradient

_C15_X = torch.randn(8, 20, 5, generator=_gen(1351)) * 3.0
_C15_Y = torch.randn(8, 1, generator=_gen(1352)) * 5.0
_C15_MAX_NORM, _C15_LR = 0.5, 0.05


class _SeqRegressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(5, 32, batch_first=True)
        self.head = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x)
        return self.head(out[:, -1])


def _c15_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _SeqRegressor().train()
    opt = torch.optim.SGD(model.parameters(), lr=_C15_LR)

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = F.mse_loss(model(_C15_X), _C15_Y)
        loss.backward()
        if bug:
            opt.step()
            torch.nn.utils.clip_grad_norm_(model.parameters(), _C15_MAX_NORM)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), _C15_MAX_NORM)
            opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=_C15_X)


def _c15_proof(bug: bool) -> bool:
    """Plain SGD moved the weights by lr * the raw gradient: the update's norm is far above lr * max_norm."""
    model, step, _ = _c15_build(bug)
    before = [p.detach().clone() for p in model.parameters()]
    step()
    delta = torch.linalg.vector_norm(torch.stack([(p.detach() - b).norm() for p, b in zip(model.parameters(), before)]))
    return bool(delta > 1.5 * _C15_LR * _C15_MAX_NORM)


CASES: list[BlindCase] = [
    BlindCase("b13-case-11", "https://blog.gitcode.com/aaf1a3e9256e4b90362e3f2bdf3e7018.html",
              "train/eval mode",
              "the pretrained BERT classifier comes back from from_pretrained in eval mode and the training loop never "
              "calls train(): it fine-tunes with dropout switched off", _c11_build, _c11_proof),
    BlindCase("b13-case-12", "https://chang-ai-study.notion.site/nn-ModuleList-vs-list-eebcbafc98014668a92778ba31ec1928",
              "unregistered submodules",
              "the atrous conv branches are kept in a plain Python list instead of nn.ModuleList: they run in forward "
              "but are missing from model.parameters(), so the optimizer never updates them", _c12_build, _c12_proof),
    BlindCase("b13-case-13", "http://hk.javashuo.com/article/p-mrjxlmph-gd.html", "loss shape broadcasting",
              "the squared loss subtracts labels of shape [n] from predictions of shape [n, 1]: the residual broadcasts "
              "to [n, n] and every prediction is pulled toward the batch mean label instead of its own", _c13_build,
              _c13_proof,
              known_miss="blind batch 13: the broadcasting subtraction is hand-written in step_fn, not a torch loss call; LOSS-005 reads loss calls only"),
    BlindCase("b13-case-14",
              "https://codemia.io/knowledge-hub/path/how_does_one_set_the_pad_token_correctly_not_to_eos_during_"
              "fine-tuning_to_avoid_model_not_predicting_eos",
              "special-token label masking",
              "with pad_token set to eos_token, the collator's labels[labels == pad_id] = -100 also masks each "
              "sequence's real EOS: the causal LM is never trained to emit EOS and generates without stopping",
              _c14_build, _c14_proof),
    BlindCase("b13-case-15", "https://theneuralbase.com/pytorch/learn/intermediate/gradient-exploding-gradient-clipping/",
              "gradient clipping order",
              "clip_grad_norm_ runs after optimizer.step(): the step has already applied the raw, unclipped gradient, "
              "so clipping never limits any update of the LSTM", _c15_build, _c15_proof),
]
