"""Blind batch 16 (part b): silent training bugs from public threads, each with its fixed twin."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

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


CASES: list[BlindCase] = [
    BlindCase("b16-case-06", "https://github.com/yalesong/pvse/issues/13", "bidirectional RNN final state",
              "The sentence embedding reads both GRU directions at the last valid output step, so the reverse "
              "direction contributes a state that has seen only the final word.",
              _c06_build, _c06_proof),
]
