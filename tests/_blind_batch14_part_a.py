"""Blind batch 14 (part a): silent training bugs from public GitHub threads, each with its fixed twin."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw, _sgd_step

# --------------------------------------------------------------------------------------------- case-01


class _LoraLinear(nn.Module):
    """A frozen base projection with a trainable low-rank adapter (B starts at zero)."""

    def __init__(self, d: int, r: int = 4) -> None:
        super().__init__()
        self.base = nn.Linear(d, d)
        self.base.requires_grad_(False)
        self.lora_A = nn.Parameter(torch.randn(r, d) * 0.1)
        self.lora_B = nn.Parameter(torch.zeros(d, r))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.lora_A.t() @ self.lora_B.t()


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.proj = _LoraLinear(d)
        self.norm.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.proj(self.norm(x)))


class _CkptLoraClassifier(nn.Module):
    """Frozen embedding, LoRA blocks run under activation checkpointing, trainable classifier head."""

    def __init__(self, reentrant: bool, vocab: int = 30, d: int = 16, n_cls: int = 3) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.embed = nn.Embedding(vocab, d)
        self.embed.requires_grad_(False)
        self.blocks = nn.ModuleList([_Block(d) for _ in range(2)])
        self.head = nn.Linear(d, n_cls)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for blk in self.blocks:
            h = checkpoint(blk, h, use_reentrant=self.reentrant)
        return self.head(h.mean(1))


_C01_IDS = torch.randint(0, 30, (4, 10), generator=_gen(101))
_C01_Y = torch.randint(0, 3, (4,), generator=_gen(102))


def _c01_build(bug: bool) -> Case:
    """LoRA fine-tune with activation checkpointing: reentrant checkpoint over blocks fed by a frozen embedding."""
    torch.manual_seed(0)
    model = _CkptLoraClassifier(reentrant=bug).train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    step = _sgd_step(model, opt, lambda: F.cross_entropy(model(_C01_IDS), _C01_Y))
    return model, step, _kw(optimizer=opt, inputs=_C01_IDS)


def _c01_proof(bug: bool) -> bool:
    """After one backward, no LoRA adapter weight inside the checkpointed blocks has a nonzero gradient."""
    import warnings

    model, step, _ = _c01_build(bug)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step()
    grads = [p.grad for n, p in model.named_parameters() if "lora_" in n]
    return all(g is None or float(g.abs().sum()) == 0.0 for g in grads)


# --------------------------------------------------------------------------------------------- case-02


class _TinyDecoderLM(nn.Module):
    """Decoder-only LM built from nn.TransformerDecoder over a memory, trained with next-token targets."""

    def __init__(self, causal: bool, vocab: int = 24, d: int = 16, max_len: int = 16) -> None:
        super().__init__()
        self.causal = causal
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(max_len, d)
        layer = nn.TransformerDecoderLayer(d, 2, 32, dropout=0.0, batch_first=True)
        self.dec = nn.TransformerDecoder(layer, 2)
        self.out = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        x = self.tok(ids) + self.pos(torch.arange(t))[None]
        mask = nn.Transformer.generate_square_subsequent_mask(t) if self.causal else None
        return self.out(self.dec(x, memory, tgt_mask=mask))


_C02_SEQ = torch.randint(0, 24, (3, 9), generator=_gen(201))
_C02_MEM = torch.randn(3, 5, 16, generator=_gen(202))
_C02_IN, _C02_TGT = _C02_SEQ[:, :-1], _C02_SEQ[:, 1:]


def _c02_loss(model: _TinyDecoderLM) -> torch.Tensor:
    logits = model(_C02_IN, _C02_MEM)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), _C02_TGT.reshape(-1))


def _c02_build(bug: bool) -> Case:
    """Autoregressive transformer decoder trained on shifted targets with no tgt_mask passed to the decoder."""
    torch.manual_seed(0)
    model = _TinyDecoderLM(causal=not bug).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    step = _sgd_step(model, opt, lambda: _c02_loss(model))
    return model, step, _kw(optimizer=opt, inputs=(_C02_IN, _C02_MEM))


def _c02_proof(bug: bool) -> bool:
    """Changing only the last input token changes the logits at position 0 (which should not see it)."""
    model, _, _ = _c02_build(bug)
    model.eval()
    alt = _C02_IN.clone()
    alt[:, -1] = (alt[:, -1] + 1) % 24
    with torch.no_grad():
        a = model(_C02_IN, _C02_MEM)[:, 0]
        b = model(alt, _C02_MEM)[:, 0]
    return float((a - b).abs().max()) > 1e-6


# --------------------------------------------------------------------------------------------- case-03


class _MyLinear(nn.Module):
    """Custom dense layer from a tutorial: ReLU(x W + b) with its own parameters."""

    def __init__(self, in_units: int, units: int, bug: bool) -> None:
        super().__init__()
        self.bug = bug
        self.weight = nn.Parameter(torch.randn(in_units, units) * 0.3)
        self.bias = nn.Parameter(torch.randn(units) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bug:
            return F.relu(torch.matmul(x, self.weight.data) + self.bias.data)
        return F.relu(torch.matmul(x, self.weight) + self.bias)


_C03_X = torch.randn(16, 20, generator=_gen(301))
_C03_Y = torch.randn(16, 1, generator=_gen(302))


def _c03_build(bug: bool) -> Case:
    """Regression net whose custom layers compute their forward from weight.data / bias.data."""
    torch.manual_seed(0)
    model = nn.Sequential(_MyLinear(20, 16, bug), _MyLinear(16, 8, bug), nn.Linear(8, 1)).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    step = _sgd_step(model, opt, lambda: F.mse_loss(model(_C03_X), _C03_Y))
    return model, step, _kw(optimizer=opt, inputs=_C03_X)


def _c03_proof(bug: bool) -> bool:
    """After one step the custom layers' weights are unchanged (they got no gradient), while the head moved."""
    model, step, _ = _c03_build(bug)
    before = model[0].weight.detach().clone()
    step()
    return torch.equal(before, model[0].weight.detach())


# --------------------------------------------------------------------------------------------- case-04


class _GatedFusionSeg(nn.Module):
    """Visual tokens plus a language-fused residual that passes through a learned tanh gate (bias-free MLP)."""

    def __init__(self, bug: bool, dim: int = 16, n_cls: int = 3) -> None:
        super().__init__()
        self.vis = nn.Linear(8, dim)
        self.fusion = nn.Linear(2 * dim, dim)
        self.res_gate = nn.Sequential(nn.Linear(dim, dim, bias=False), nn.ReLU(),
                                      nn.Linear(dim, dim, bias=False), nn.Tanh())
        if bug:
            nn.init.zeros_(self.res_gate[0].weight)
        nn.init.zeros_(self.res_gate[2].weight)
        self.head = nn.Linear(dim, n_cls)

    def forward(self, pix: torch.Tensor, lang: torch.Tensor) -> torch.Tensor:
        x = self.vis(pix)
        x_residual = self.fusion(torch.cat([x, lang[:, None].expand_as(x)], -1))
        x = x + self.res_gate(x_residual) * x_residual
        return self.head(x)


_C04_PIX = torch.randn(4, 12, 8, generator=_gen(401))
_C04_LANG = torch.randn(4, 16, generator=_gen(402))
_C04_Y = torch.randint(0, 3, (4, 12), generator=_gen(403))


def _c04_loss(model: _GatedFusionSeg) -> torch.Tensor:
    return F.cross_entropy(model(_C04_PIX, _C04_LANG).transpose(1, 2), _C04_Y)


def _c04_build(bug: bool) -> Case:
    """Per-token segmentation with a gated multimodal residual whose two gate layers are both zero-initialised."""
    torch.manual_seed(0)
    model = _GatedFusionSeg(bug).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = _sgd_step(model, opt, lambda: _c04_loss(model))
    return model, step, _kw(optimizer=opt, inputs=(_C04_PIX, _C04_LANG))


def _c04_proof(bug: bool) -> bool:
    """After three training steps the gate is still exactly at its initial values and the fusion layer behind it
    got exactly zero gradient (only weight decay touches it)."""
    model, step, _ = _c04_build(bug)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if n.startswith("res_gate")}
    fusion_grad = 0.0
    for _ in range(3):
        step()
        fusion_grad += float(sum(p.grad.abs().sum() for p in model.fusion.parameters()))
    params = dict(model.named_parameters())
    return fusion_grad == 0.0 and all(torch.equal(v, params[n].detach()) for n, v in before.items())

CASES: list[BlindCase] = [
    BlindCase("b14-case-01", "https://github.com/microsoft/LoRA/issues/120", "activation checkpointing",
              "Reentrant checkpointing over blocks whose input comes from a frozen embedding leaves every LoRA "
              "adapter inside them without gradients; only the head trains.", _c01_build, _c01_proof),
    BlindCase("b14-case-02", "https://github.com/alex-matton/causal-transformer-decoder/issues/1",
              "attention / causal mask",
              "The decoder is trained without a causal tgt_mask, so each position attends to the token it must "
              "predict and the loss falls by copying.", _c02_build, _c02_proof),
    BlindCase("b14-case-03", "https://github.com/d2l-ai/d2l-en/pull/2600", ".data detaches parameters",
              "Custom layers use weight.data and bias.data in forward, so autograd never reaches their "
              "parameters and they never update.", _c03_build, _c03_proof),
    BlindCase("b14-case-04", "https://github.com/yz93/LAVT-RIS/issues/25", "zero initialisation / dead gate",
              "Both bias-free layers of a residual gate are zero-initialised, so the gate and the fusion branch "
              "behind it get exactly zero gradient and stay off for the whole run.", _c04_build, _c04_proof),
]
