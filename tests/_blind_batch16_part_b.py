"""Blind batch 16 (part b): silent training bugs from public threads, each with its fixed twin."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw, _sgd_step

# --------------------------------------------------------------------------------------------- case-06


class _EncoderText(nn.Module):
    """A PVSE-style sentence encoder: word embedding, bidirectional GRU over the packed batch, a final state."""

    def __init__(self, final_from_output: bool, vocab: int = 20, word_dim: int = 8, embed_size: int = 8) -> None:
        super().__init__()
        self.final_from_output = final_from_output
        self.embed_size = embed_size
        self.embed = nn.Embedding(vocab, word_dim)
        self.rnn = nn.GRU(word_dim, embed_size // 2, bidirectional=True, batch_first=True)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        wemb_out = self.embed(x)
        packed = pack_padded_sequence(wemb_out, lengths, batch_first=True)
        rnn_out, h_n = self.rnn(packed)
        if self.final_from_output:
            padded = pad_packed_sequence(rnn_out, batch_first=True)
            # the "*final* output": both directions read at the last valid step
            idx = lengths.expand(self.embed_size, 1, -1).permute(2, 1, 0) - 1
            out = torch.gather(padded[0], 1, idx).squeeze(1)
        else:
            out = torch.cat([h_n[0], h_n[1]], dim=1)  # the fix: each direction's own final hidden state
        return F.normalize(out, dim=-1)


class _VSE(nn.Module):
    def __init__(self, final_from_output: bool) -> None:
        super().__init__()
        self.txt = _EncoderText(final_from_output)
        self.img = nn.Linear(6, 8)

    def forward(self, img: torch.Tensor, ids: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return F.normalize(self.img(img), dim=-1), self.txt(ids, lengths)


def _vse_hinge(im: torch.Tensor, s: torch.Tensor, margin: float = 0.2) -> torch.Tensor:
    scores = im @ s.t()
    d = scores.diag().view(-1, 1)
    eye = torch.eye(scores.size(0), dtype=torch.bool)
    cost_s = (margin + scores - d).clamp(min=0).masked_fill(eye, 0)
    cost_im = (margin + scores - d.t()).clamp(min=0).masked_fill(eye, 0)
    return cost_s.sum() + cost_im.sum()


_C06_LEN = torch.tensor([7, 6, 4, 3])
_C06_IDS = torch.randint(1, 20, (4, 7), generator=_gen(1601))
_C06_IDS[torch.arange(7).unsqueeze(0) >= _C06_LEN.unsqueeze(1)] = 0
_C06_IMG = torch.randn(4, 6, generator=_gen(1602))


def _c06_build(bug: bool) -> Case:
    """Image-text embedding with a bidirectional GRU sentence encoder; the sentence vector is the padded output
    gathered at lengths-1 (bug) or the concatenated final hidden states h_n (fix)."""
    torch.manual_seed(16)
    model = _VSE(final_from_output=bug).train()
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    step = _sgd_step(model, opt, lambda: _vse_hinge(*model(_C06_IMG, _C06_IDS, _C06_LEN)))
    return model, step, _kw(optimizer=opt, inputs=(_C06_IMG, _C06_IDS, _C06_LEN))


def _c06_proof(bug: bool) -> bool:
    """Replacing every word but the last one leaves the backward half of each sentence vector unchanged: the
    reverse direction's half has only read one word."""
    model, step, _ = _c06_build(bug)
    step()
    ids2 = _C06_IDS.clone()
    for b, n in enumerate(_C06_LEN.tolist()):
        ids2[b, : n - 1] = (ids2[b, : n - 1] + 7) % 19 + 1
    with torch.no_grad():
        a = model.txt(_C06_IDS, _C06_LEN)
        b2 = model.txt(ids2, _C06_LEN)
    # undo the normalisation scale by comparing directions of the backward half only
    half = model.txt.embed_size // 2
    ra = F.normalize(a[:, half:], dim=-1)
    rb = F.normalize(b2[:, half:], dim=-1)
    return bool(torch.allclose(ra, rb, atol=1e-6))

# --------------------------------------------------------------------------------------------- case-07


def _rotate(img: torch.Tensor, degrees: tuple[float, float]) -> torch.Tensor:
    """``transforms.RandomRotation(degrees)`` on a (C, H, W) tensor: angle drawn from torch's global generator,
    nearest interpolation, zero fill."""
    angle = float(torch.empty(1).uniform_(float(degrees[0]), float(degrees[1])).item())
    a = torch.tensor(angle * torch.pi / 180.0)
    theta = torch.stack([torch.stack([a.cos(), -a.sin(), torch.tensor(0.0)]),
                         torch.stack([a.sin(), a.cos(), torch.tensor(0.0)])]).unsqueeze(0)
    grid = F.affine_grid(theta, [1, *img.shape], align_corners=False)
    return F.grid_sample(img.unsqueeze(0), grid, mode="nearest", padding_mode="zeros", align_corners=False)[0]


def _jitter(img: torch.Tensor, brightness: float = 0.4, contrast: float = 0.4) -> torch.Tensor:
    """``transforms.ColorJitter(brightness, contrast)``: factors drawn from torch's global generator."""
    b = float(torch.empty(1).uniform_(1 - brightness, 1 + brightness))
    c = float(torch.empty(1).uniform_(1 - contrast, 1 + contrast))
    img = (img * b).clamp(0, 1)
    return ((img - img.mean()) * c + img.mean()).clamp(0, 1)


class _SegDataset(torch.utils.data.Dataset):
    """``Images_Dataset_folder``: the image gets CenterCrop, RandomRotation((-10, 10)), ColorJitter, Normalize;
    the label gets CenterCrop (and, in the fix, the same RandomRotation under the same reseeded generator)."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, synced: bool) -> None:
        self.images, self.labels, self.synced = images, labels, synced

    def __len__(self) -> int:
        return len(self.images)

    def tx(self, img: torch.Tensor) -> torch.Tensor:
        img = img[:, 2:-2, 2:-2]  # CenterCrop
        img = _rotate(img, (-10, 10))
        img = _jitter(img)
        return (img - 0.5) / 0.5  # Normalize(mean=.5, std=.5)

    def lx(self, lab: torch.Tensor) -> torch.Tensor:
        lab = lab[:, 2:-2, 2:-2]
        if self.synced:
            lab = _rotate(lab, (-10, 10))
        return lab

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.synced:
            return self.tx(self.images[i]), self.lx(self.labels[i])
        seed = int(torch.randint(0, 2**31 - 1, (1,)))  # one seed for both transforms
        torch.manual_seed(seed)
        img = self.tx(self.images[i])
        torch.manual_seed(seed)
        return img, self.lx(self.labels[i])


def _c07_shapes() -> tuple[torch.Tensor, torch.Tensor]:
    """Eight 28x28 scenes, each a bright off-centre bar on a dark background; the label is the bar."""
    g = _gen(1701)
    labels = torch.zeros(8, 1, 28, 28)
    for k in range(8):
        r, c = int(torch.randint(5, 12, (1,), generator=g)), int(torch.randint(4, 10, (1,), generator=g))
        labels[k, 0, r : r + 12, c : c + 4] = 1.0
    images = (labels.repeat(1, 3, 1, 1) * 0.8 + 0.1).clamp(0, 1)
    return images, labels


_C07_IMAGES, _C07_LABELS = _c07_shapes()


def _c07_batch(synced: bool) -> tuple[torch.Tensor, torch.Tensor]:
    ds = _SegDataset(_C07_IMAGES, _C07_LABELS, synced)
    torch.manual_seed(1702)
    loader = torch.utils.data.DataLoader(ds, batch_size=8, shuffle=False)
    return next(iter(loader))


class _TinyUNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())
        self.down = nn.Sequential(nn.MaxPool2d(2), nn.Conv2d(8, 16, 3, padding=1), nn.ReLU())
        self.up = nn.ConvTranspose2d(16, 8, 2, stride=2)
        self.out = nn.Conv2d(16, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.enc(x)
        return self.out(torch.cat([e, self.up(self.down(e))], 1))


def _dice_bce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    bce = F.binary_cross_entropy_with_logits(logits, target)
    p = torch.sigmoid(logits)
    dice = 1 - (2 * (p * target).sum() + 1) / (p.sum() + target.sum() + 1)
    return bce * 0.5 + dice * 0.5


def _c07_build(bug: bool) -> Case:
    """U-Net segmentation whose dataset rotates the image at random but not its mask (bug), or reseeds the
    generator so the mask gets the same rotation (fix)."""
    x, y = _c07_batch(synced=not bug)
    torch.manual_seed(17)
    model = _TinyUNet().train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    step = _sgd_step(model, opt, lambda: _dice_bce(model(x), y))
    return model, step, _kw(optimizer=opt, inputs=(x, y))


def _c07_proof(bug: bool) -> bool:
    """The bar visible in each augmented image (pixels brighter than the image mean) disagrees with the mask
    the loader pairs it with on more than 0.5% of pixels."""
    x, y = _c07_batch(synced=not bug)
    seen = (x[:, 0] > x[:, 0].mean(dim=(1, 2), keepdim=True)).float()
    mismatch = (seen != y[:, 0]).float().mean().item()
    return mismatch > 0.005

# --------------------------------------------------------------------------------------------- case-08


class _EmbedVector(nn.Module):
    """KEQA's predicate/entity representation learner: embedding, BiLSTM, word-level attention over
    [word; BiLSTM output], a tag MLP, mean over words, L2-normalised vector regressed onto a KG embedding."""

    def __init__(self, softmax_dim: int, words_num: int = 30, words_dim: int = 8, hidden: int = 6,
                 target: int = 5) -> None:
        super().__init__()
        self.softmax_dim = softmax_dim
        self.embed = nn.Embedding(words_num, words_dim)
        self.lstm = nn.LSTM(input_size=words_dim, hidden_size=hidden, num_layers=1, bidirectional=True)
        self.nonlinear = nn.Tanh()
        self.attn = nn.Sequential(nn.Linear(hidden * 2 + words_dim, hidden), self.nonlinear, nn.Linear(hidden, 1))
        self.hidden2tag = nn.Sequential(
            nn.Linear(hidden * 2 + words_dim, hidden * 2), nn.BatchNorm1d(hidden * 2), self.nonlinear,
            nn.Dropout(0.0), nn.Linear(hidden * 2, target))

    def forward(self, text: torch.Tensor) -> torch.Tensor:
        x = self.embed(text)  # (sequence length, batch, words_dim)
        num_word, batch_size, words_dim = x.size()
        outputs, _ = self.lstm(x)
        outputs = outputs.view(-1, outputs.size(2))
        x = x.view(-1, words_dim)
        attn_weights = F.softmax(self.attn(torch.cat((x, outputs), 1)), dim=self.softmax_dim)
        attn_applied = torch.bmm(torch.diag(attn_weights[:, 0]).unsqueeze(0), outputs.unsqueeze(0))
        outputs = torch.cat((x, attn_applied.squeeze(0)), 1)
        tags = self.hidden2tag(outputs).view(num_word, batch_size, -1)
        return F.normalize(torch.mean(tags, dim=0), dim=1)


_C08_TEXT = torch.randint(0, 30, (7, 6), generator=_gen(1801))
_C08_TARGET = F.normalize(torch.randn(6, 5, generator=_gen(1802)), dim=1)


def _c08_build(bug: bool) -> Case:
    """KEQA-style question encoder whose attention softmax runs over dim=1 of a (words*batch, 1) score tensor
    (bug) or over dim=0 as the author's fix has it."""
    torch.manual_seed(18)
    model = _EmbedVector(softmax_dim=1 if bug else 0).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    step = _sgd_step(model, opt, lambda: F.mse_loss(model(_C08_TEXT), _C08_TARGET))
    return model, step, _kw(optimizer=opt, inputs=_C08_TEXT)


def _c08_proof(bug: bool) -> bool:
    """Every attention weight is exactly 1 and the attention scorer gets an all-zero gradient: it never learns."""
    model, step, _ = _c08_build(bug)
    step()
    with torch.no_grad():
        x = model.embed(_C08_TEXT).view(-1, 8)
        out, _ = model.lstm(model.embed(_C08_TEXT))
        w = F.softmax(model.attn(torch.cat((x, out.view(-1, 12)), 1)), dim=model.softmax_dim)
    grads = [p.grad for p in model.attn.parameters()]
    dead = all(g is None or float(g.abs().max()) == 0.0 for g in grads)
    return dead and bool(torch.all(w == 1.0))

# --------------------------------------------------------------------------------------------- case-09


class _ResBlock(nn.Module):
    def __init__(self, n_chans: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(n_chans, n_chans, kernel_size=3, padding=1, bias=False)
        self.batch_norm = nn.BatchNorm2d(num_features=n_chans)
        nn.init.kaiming_normal_(self.conv.weight, nonlinearity="relu")
        nn.init.constant_(self.batch_norm.weight, 0.5)
        nn.init.zeros_(self.batch_norm.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.batch_norm(self.conv(x)))
        return out + x


class _NetResDeep(nn.Module):
    """The book's deep residual CIFAR-2 classifier (chapter 8), narrowed."""

    def __init__(self, repeat_one: bool, n_chans1: int = 8, n_blocks: int = 5) -> None:
        super().__init__()
        self.n_chans1 = n_chans1
        self.conv1 = nn.Conv2d(3, n_chans1, kernel_size=3, padding=1)
        if repeat_one:
            self.resblocks = nn.Sequential(*(n_blocks * [_ResBlock(n_chans=n_chans1)]))
        else:
            self.resblocks = nn.Sequential(*[_ResBlock(n_chans=n_chans1) for _ in range(n_blocks)])
        self.fc1 = nn.Linear(8 * 8 * n_chans1, 32)
        self.fc2 = nn.Linear(32, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.max_pool2d(torch.relu(self.conv1(x)), 2)
        out = self.resblocks(out)
        out = F.max_pool2d(out, 2)
        out = out.view(-1, 8 * 8 * self.n_chans1)
        out = torch.relu(self.fc1(out))
        return self.fc2(out)


_C09_X = torch.randn(6, 3, 32, 32, generator=_gen(1901))
_C09_Y = torch.randint(0, 2, (6,), generator=_gen(1902))


def _c09_build(bug: bool) -> Case:
    """NetResDeep with its residual stack built as ``n_blocks * [ResBlock(...)]`` (bug) or from a list
    comprehension of fresh blocks (fix)."""
    torch.manual_seed(19)
    model = _NetResDeep(repeat_one=bug).train()
    opt = torch.optim.SGD(model.parameters(), lr=3e-3)
    step = _sgd_step(model, opt, lambda: F.cross_entropy(model(_C09_X), _C09_Y))
    return model, step, _kw(optimizer=opt, inputs=_C09_X)


def _c09_proof(bug: bool) -> bool:
    """After a training step every residual block still holds exactly the same convolution weights: the
    "deep" stack is one block applied five times, with a fifth of the parameters the model claims."""
    model, step, _ = _c09_build(bug)
    step()
    ws = [blk.conv.weight for blk in model.resblocks]
    return all(torch.equal(ws[0], w) for w in ws[1:])

# --------------------------------------------------------------------------------------------- case-10


class _CTCModel(nn.Module):
    """A speech recogniser on packed mel spectrograms: a bidirectional GRU and a per-frame character
    classifier applied to the packed data (outputs stay packed, T x B x vocab once padded)."""

    def __init__(self, n_mels: int = 10, nhidden: int = 8, vocab: int = 7) -> None:
        super().__init__()
        self.rnn = nn.GRU(n_mels, nhidden, num_layers=2, bidirectional=True)
        self.charlin = nn.Linear(2 * nhidden, vocab)

    def forward(self, packed: PackedSequence) -> PackedSequence:
        out, _ = self.rnn(packed)
        return PackedSequence(self.charlin(out.data), out.batch_sizes, out.sorted_indices, out.unsorted_indices)


def _wrap_ctc_args(log_softmax: bool):
    def wrap(packed_predictions: PackedSequence, packed_targets: PackedSequence):
        unpacked_predictions, lens_predictions = pad_packed_sequence(packed_predictions)  # T, B, vocab
        if log_softmax:
            unpacked_predictions = unpacked_predictions.log_softmax(dim=2)
        unpacked_targets, lens_targets = pad_packed_sequence(packed_targets)  # T, B
        return unpacked_predictions, unpacked_targets.transpose(0, 1), lens_predictions, lens_targets
    return wrap


_C10_SLEN = torch.tensor([20, 18, 15, 12])
_C10_SPECTRO = torch.randn(20, 4, 10, generator=_gen(2001))
_C10_TLEN = torch.tensor([5, 4, 4, 3])
_C10_TRANS = torch.randint(1, 7, (5, 4), generator=_gen(2002))


def _c10_batch() -> tuple[PackedSequence, PackedSequence]:
    return (pack_padded_sequence(_C10_SPECTRO, _C10_SLEN, enforce_sorted=False),
            pack_padded_sequence(_C10_TRANS, _C10_TLEN, enforce_sorted=False))


def _c10_build(bug: bool) -> Case:
    """CTC training whose loss wrapper has the ``log_softmax(dim=2)`` line commented out (bug), so CTCLoss gets
    raw logits, or keeps it (fix)."""
    torch.manual_seed(20)
    model = _CTCModel().train()
    baseloss = nn.CTCLoss(blank=0, reduction="mean", zero_infinity=True)
    wrap = _wrap_ctc_args(log_softmax=not bug)
    spectro, transcripts = _c10_batch()
    opt = torch.optim.Adam(model.parameters(), lr=5e-4)
    step = _sgd_step(model, opt, lambda: baseloss(*wrap(model(spectro), transcripts)))
    return model, step, _kw(optimizer=opt, inputs=(_C10_SPECTRO, _C10_TRANS))


def _c10_proof(bug: bool) -> bool:
    """Adding the same constant to every character logit leaves every frame's distribution unchanged, yet it
    lowers the training loss: the objective rewards inflating logits rather than predicting characters."""
    model, _, _ = _c10_build(bug)
    baseloss = nn.CTCLoss(blank=0, reduction="mean", zero_infinity=True)
    wrap = _wrap_ctc_args(log_softmax=not bug)
    spectro, transcripts = _c10_batch()
    with torch.no_grad():
        before = float(baseloss(*wrap(model(spectro), transcripts)))
        model.charlin.bias += 1.0
        after = float(baseloss(*wrap(model(spectro), transcripts)))
    return after < before - 1e-3


CASES: list[BlindCase] = [
    BlindCase("b16-case-06", "https://github.com/yalesong/pvse/issues/13", "bidirectional RNN final state",
              "The sentence embedding reads both GRU directions at the last valid output step, so the reverse "
              "direction contributes a state that has seen only the final word.",
              _c06_build, _c06_proof),
    BlindCase("b16-case-07", "https://github.com/bigmb/Unet-Segmentation-Pytorch-Nest-of-Unets/pull/30",
              "augmentation not applied to target",
              "The segmentation dataset randomly rotates each input image but not its mask, so the network is "
              "trained against masks that no longer line up with the pixels it sees.",
              _c07_build, _c07_proof,
              known_miss="the augmentation that misaligns image and mask runs in the dataset, before the step"),
    BlindCase("b16-case-08", "https://github.com/DEEP-PolyU/KEQA_WSDM19/issues/2", "softmax over wrong dimension",
              "The word attention takes softmax over a size-1 dimension, so every weight is 1.0 and the attention "
              "scorer gets no gradient: the model trains with no attention at all.",
              _c08_build, _c08_proof,
              known_alarm=('INPUT-002',)),
    BlindCase("b16-case-09", "https://github.com/deep-learning-with-pytorch/dlwpt-code/issues/89",
              "module repeated by list multiplication",
              "The residual stack is built by multiplying a one-element list, so all blocks are the same module "
              "and the network trains one shared block instead of n_blocks independent ones.",
              _c09_build, _c09_proof),
    BlindCase("b16-case-10", "https://github.com/jeremyfix/deeplearning-lectures/issues/22",
              "loss fed logits instead of log-probabilities",
              "CTCLoss receives raw logits because the log_softmax line is commented out, so the loss it "
              "minimises is not the sequence likelihood and can be lowered just by inflating all logits.",
              _c10_build, _c10_proof),
]
