"""Blind batch 12, part c: silent training bugs from public write-ups and Q&A threads, each with its fixed twin.

Collected by someone who does not write the audit's checks, from blog posts and question-and-answer pages (not
GitHub, not the PyTorch or Hugging Face forums). Every case builds the user's setup on a tiny real model (a plain
torch residual CNN image classifier with BatchNorm, an MLP regressor whose hidden blocks sit in a Python list, a
torch nn.TransformerEncoder text classifier over padded batches, a transformers BERT sequence classifier from a tiny
config in code, and a plain torch MLP variational autoencoder; nothing is downloaded) and proves the bug without the
audit on real runs and real tensors.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw, _sgd_step


# --------------------------------------------------------------------------------------------- case-11
# a CNN ported from Keras keeps Keras' BatchNorm momentum (0.99): in PyTorch that is the weight of the NEW batch

_C11_X = torch.randn(8, 3, 16, 16, generator=_gen(12111))
_C11_X2 = torch.randn(8, 3, 16, 16, generator=_gen(12112)) * 2.0 + 1.0
_C11_Y = torch.randint(0, 5, (8,), generator=_gen(12113))


class _ResBlock(nn.Module):
    def __init__(self, c: int, momentum: float) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(c, c, 3, padding=1), nn.Conv2d(c, c, 3, padding=1)
        self.bn1, self.bn2 = nn.BatchNorm2d(c, momentum=momentum), nn.BatchNorm2d(c, momentum=momentum)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + x)


class _SmallResNet(nn.Module):
    """Stem conv + BatchNorm, two residual blocks, global average pooling, a linear classifier."""

    def __init__(self, momentum: float) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16, momentum=momentum), nn.ReLU())
        self.blocks = nn.Sequential(_ResBlock(16, momentum), _ResBlock(16, momentum))
        self.head = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).mean(dim=(2, 3)))


def _c11_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _SmallResNet(momentum=0.99 if bug else 0.1).train()  # Keras' momentum=0.99 is PyTorch's 0.01 .. 0.1
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, _sgd_step(model, opt, lambda: F.cross_entropy(model(_C11_X), _C11_Y)), \
        _kw(optimizer=opt, inputs=_C11_X)


def _c11_proof(bug: bool) -> bool:
    """After training on one batch and then seeing a second, differently distributed batch, the stem BatchNorm's
    running mean is (almost) just the second batch's mean: the running statistics the model will be evaluated with
    forget everything but the last batch."""
    model, step, _ = _c11_build(bug)
    assert isinstance(model, _SmallResNet)
    step()
    bn, conv = model.stem[1], model.stem[0]
    assert isinstance(bn, nn.BatchNorm2d) and bn.running_mean is not None
    before = bn.running_mean.clone()
    with torch.no_grad():
        batch_mean = conv(_C11_X2).mean(dim=(0, 2, 3))
        model(_C11_X2)
    weight_of_last = ((bn.running_mean - before) / (batch_mean - before)).median()
    return bool(weight_of_last > 0.5)


# --------------------------------------------------------------------------------------------- case-12
# the hidden blocks of a regressor are kept in a plain Python list: model.parameters() never sees them

_C12_X = torch.randn(32, 10, generator=_gen(12121))
_C12_Y = (_C12_X[:, :3].sum(-1, keepdim=True) - _C12_X[:, 5:6] ** 2)


class _ListMLP(nn.Module):
    """Input projection, three hidden Linear+ReLU blocks (a Python list or an nn.ModuleList), an output layer."""

    def __init__(self, plain_list: bool) -> None:
        super().__init__()
        self.inp = nn.Linear(10, 32)
        blocks = [nn.Linear(32, 32) for _ in range(3)]
        self.hidden = blocks if plain_list else nn.ModuleList(blocks)
        self.out = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        for layer in self.hidden:
            h = torch.relu(layer(h))
        return self.out(h)


def _c12_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _ListMLP(plain_list=bug).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    return model, _sgd_step(model, opt, lambda: F.mse_loss(model(_C12_X), _C12_Y)), \
        _kw(optimizer=opt, inputs=_C12_X)


def _c12_proof(bug: bool) -> bool:
    """The hidden layers shape the output (their gradients are non-zero) yet after three steps their weights are
    bitwise unchanged: the optimizer built from model.parameters() never received them."""
    model, step, _ = _c12_build(bug)
    assert isinstance(model, _ListMLP)
    watched = [p for layer in model.hidden for p in layer.parameters()]
    before = [p.detach().clone() for p in watched]
    for _ in range(3):
        step()
    got_grad = all(p.grad is not None and p.grad.abs().sum() > 0 for p in watched)
    return got_grad and all(torch.equal(b, p) for b, p in zip(before, watched))


# --------------------------------------------------------------------------------------------- case-13
# nn.TransformerEncoder gets the tokenizer-style attention mask (1 = real token) as src_key_padding_mask,
# where True means "ignore": every real token is masked out and attention reads only the padding

_C13_V, _C13_T, _C13_PAD = 50, 12, 0
_C13_LENS = torch.tensor([5, 9, 7, 11, 6, 8])
_C13_IDS = torch.randint(1, _C13_V, (6, _C13_T), generator=_gen(12131))
_C13_ATTN = (torch.arange(_C13_T)[None, :] < _C13_LENS[:, None]).long()  # 1 for real tokens, 0 for padding
_C13_IDS = _C13_IDS * _C13_ATTN  # pad id 0 after each sequence
_C13_Y = torch.tensor([0, 1, 2, 1, 0, 2])


class _TfmClassifier(nn.Module):
    """Token + position embeddings, a 2-layer nn.TransformerEncoder, masked mean pooling, a linear head."""

    def __init__(self, invert_mask: bool) -> None:
        super().__init__()
        self.invert_mask = invert_mask
        self.emb = nn.Embedding(_C13_V, 32, padding_idx=_C13_PAD)
        self.pos = nn.Embedding(_C13_T, 32)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, 3)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.emb(input_ids) + self.pos(torch.arange(input_ids.shape[1]))[None]
        # the report's bug: attention_mask.bool() passed as is; the fix: True where the token is padding
        key_padding = attention_mask.bool() if self.invert_mask else attention_mask == 0
        h = self.encoder(h, src_key_padding_mask=key_padding)
        m = attention_mask.unsqueeze(-1).float()
        return self.head((h * m).sum(1) / m.sum(1))


def _c13_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _TfmClassifier(invert_mask=bug).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, _sgd_step(model, opt, lambda: F.cross_entropy(model(_C13_IDS, _C13_ATTN), _C13_Y)), \
        _kw(optimizer=opt, inputs=(_C13_IDS, _C13_ATTN))


def _c13_proof(bug: bool) -> bool:
    """Changing only the token ids at padding positions (which the model must ignore) changes the pooled prediction
    read from the real tokens."""
    model, _, _ = _c13_build(bug)
    other = torch.where(_C13_ATTN.bool(), _C13_IDS, torch.randint(1, _C13_V, _C13_IDS.shape, generator=_gen(12132)))
    with torch.no_grad():
        a, b = model(_C13_IDS, _C13_ATTN), model(other, _C13_ATTN)
    return not torch.allclose(a, b, atol=1e-5)


# --------------------------------------------------------------------------------------------- case-14
# BERT fine-tuning regularised with torch.optim.Adam(weight_decay=...): L2 folded into the gradient and then
# divided by sqrt(v), not the decoupled weight decay (AdamW) the user meant

_C14_IDS = torch.randint(3, 40, (4, 10), generator=_gen(12141))
_C14_Y = torch.tensor([0, 1, 1, 0])
_C14_LR, _C14_WD = 1e-3, 0.1


def _c14_bert() -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    cfg = BertConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=32,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    cfg.num_labels = 2
    return BertForSequenceClassification(cfg)


def _c14_head_weight(model: nn.Module) -> torch.Tensor:
    head = model.get_submodule("classifier")
    assert isinstance(head, nn.Linear)
    return head.weight.detach()


def _c14_opt(model: nn.Module, bug: bool, wd: float) -> torch.optim.Optimizer:
    cls = torch.optim.Adam if bug else torch.optim.AdamW
    return cls(model.parameters(), lr=_C14_LR, weight_decay=wd)


def _c14_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _c14_bert().train()
    opt = _c14_opt(model, bug, _C14_WD)
    return model, _sgd_step(model, opt, lambda: model(input_ids=_C14_IDS, labels=_C14_Y).loss), \
        _kw(optimizer=opt, inputs={"input_ids": _C14_IDS, "labels": _C14_Y})


def _c14_proof(bug: bool) -> bool:
    """Against the same step with weight_decay=0, the decay's share of one update of the classifier weight is not
    lr * wd * weight: the L2 term went through Adam's normalisation, so its size is set by the gradient's scale, not
    by the weight (on this first step it is about a hundred times lr * wd * weight)."""
    model, step, _ = _c14_build(bug)
    ref = copy.deepcopy(model)
    ref_opt = _c14_opt(ref, bug, 0.0)
    _sgd_step(ref, ref_opt, lambda: ref(input_ids=_C14_IDS, labels=_C14_Y).loss)()
    w0 = _c14_head_weight(model).clone()
    step()
    decay_part = _c14_head_weight(model) - _c14_head_weight(ref)
    expected = -_C14_LR * _C14_WD * w0
    ratio = decay_part.norm() / expected.norm()
    return bool(abs(ratio - 1.0) > 0.5)


# --------------------------------------------------------------------------------------------- case-15
# VAE reconstruction term averaged over pixels (per-pixel BCE) next to a per-sample KL: the KL dominates the ELBO
# and the posterior collapses, every input gets the same latent and the same reconstruction

_C15_B, _C15_D, _C15_Z = 16, 64, 4
_C15_POS = torch.randint(0, 8, (_C15_B,), generator=_gen(12151))
_C15_IMG = torch.zeros(_C15_B, 8, 8)
for _i, _p in enumerate(_C15_POS.tolist()):
    _C15_IMG[_i, :, _p] = 1.0
    _C15_IMG[_i, _p, :] = 0.8
_C15_X = (_C15_IMG * 0.9 + 0.05).view(_C15_B, _C15_D)  # 8x8 "cross" images, one per bar position


class _VAE(nn.Module):
    """MLP encoder to (mu, logvar), reparameterised sample, MLP decoder to pixel probabilities."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(_C15_D, 64), nn.ReLU())
        self.mu, self.logvar = nn.Linear(64, _C15_Z), nn.Linear(64, _C15_Z)
        self.dec = nn.Sequential(nn.Linear(_C15_Z, 64), nn.ReLU(), nn.Linear(64, _C15_D))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = self.enc(x)
        mu, logvar = self.mu(h), self.logvar(h)
        z = mu + torch.randn_like(mu) * (0.5 * logvar).exp()
        return torch.sigmoid(self.dec(z)), mu, logvar


def _c15_kl(mu: torch.Tensor, logvar: torch.Tensor) -> torch.Tensor:
    return (-0.5 * (1 + logvar - mu ** 2 - logvar.exp()).sum(-1)).mean()


def _c15_loss(model: nn.Module, bug: bool) -> torch.Tensor:
    recon, mu, logvar = model(_C15_X)
    if bug:  # the report: the mean BCE per pixel, without the "*= 28 * 28"
        rec = F.binary_cross_entropy(recon, _C15_X)
    else:  # the negative log-likelihood of a whole image, averaged over the batch
        rec = F.binary_cross_entropy(recon, _C15_X, reduction="sum") / _C15_B
    return rec + _c15_kl(mu, logvar)


def _c15_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _VAE().train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, _sgd_step(model, opt, lambda: _c15_loss(model, bug)), _kw(optimizer=opt, inputs=_C15_X)


def _c15_proof(bug: bool) -> bool:
    """After 30 steps on the batch the posterior has collapsed onto the prior: the mean KL per image is ~0 and the
    encoder gives (nearly) the same mu for every image, so the latent carries no information."""
    model, step, _ = _c15_build(bug)
    assert isinstance(model, _VAE)
    for _ in range(30):
        step()
    with torch.no_grad():
        _, mu, logvar = model(_C15_X)
        kl = _c15_kl(mu, logvar)
    return bool(kl < 0.1 and mu.std(0).mean() < 0.1)


CASES: list[BlindCase] = [
    BlindCase("b12-case-11", "http://ni4muraano.hatenablog.com/entry/2017/09/02/150412",
              "normalization / BatchNorm momentum convention",
              "a CNN ported from Keras passes momentum=0.99 to nn.BatchNorm2d, where PyTorch's momentum is the weight "
              "of the new batch: the running statistics used at evaluation are just the last batch's", _c11_build,
              _c11_proof),
    BlindCase("b12-case-12", "https://theflyingbirds.in/blog/pytorch-mysteries-lets-understand-nnmodule-nnparameter-modulelist-sequential-and-the-classic-layers-linear-activations-dropout",
              "module registration",
              "the hidden Linear blocks are stored in a plain Python list: they are not registered, the optimizer "
              "built from model.parameters() never gets them and they stay at their random init", _c12_build,
              _c12_proof),
    BlindCase("b12-case-13", "https://jkschin.com/blog/2024/src-key-padding-mask", "attention / padding mask",
              "the tokenizer-style attention mask (1 = real token) is passed as src_key_padding_mask, where True means "
              "ignore: the encoder attends only to padding tokens and the loss still goes down", _c13_build,
              _c13_proof),
    BlindCase("b12-case-14", "https://www.fast.ai/posts/2018-07-02-adam-weight-decay.html",
              "optimizer / weight decay vs L2",
              "BERT fine-tuning uses torch.optim.Adam(weight_decay=...): the decay is added to the gradient and then "
              "normalised by Adam, so it is not the decoupled weight decay (AdamW) the recipe asks for", _c14_build,
              _c14_proof,
              known_miss="blind batch 12: Adam with weight_decay is L2 regularisation by design in much correct code (GCNs use it); coupled vs decoupled decay is not judged"),
    BlindCase("b12-case-15", "https://stats.stackexchange.com/questions/485488/should-reconstruction-loss-be-computed-as-sum-or-average-over-input-for-variatio",
              "loss scaling / VAE ELBO terms",
              "the VAE reconstruction loss is the per-pixel mean BCE while the KL is per image: the KL outweighs the "
              "reconstruction by the pixel count, the posterior collapses and all reconstructions look the same",
              _c15_build, _c15_proof,
              known_miss="blind batch 12: the balance of a per-pixel mean against a per-image KL is arithmetic inside the loss; no invariant checks a sum of terms reduced differently"),
]
