"""Blind batch 15 (part b): silent training bugs from public threads, each with its fixed twin."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw, _sgd_step

# --------------------------------------------------------------------------------------------- case-06


class _DeepSet(nn.Module):
    """Permutation-invariant regressor: per-element feature extractor, sum pooling, MLP regressor -> (B, 1)."""

    def __init__(self, in_features: int, set_features: int = 12) -> None:
        super().__init__()
        self.feature_extractor = nn.Sequential(
            nn.Linear(in_features, 16), nn.ELU(inplace=True),
            nn.Linear(16, 16), nn.ELU(inplace=True),
            nn.Linear(16, set_features))
        self.regressor = nn.Sequential(
            nn.Linear(set_features, 12), nn.ELU(inplace=True),
            nn.Linear(12, 8), nn.ELU(inplace=True),
            nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.regressor(self.feature_extractor(x).sum(dim=1))


# a batch of 16 sets of 10 points in 2-d; the target is a per-set statistic, shape (16,) as the loader gives it
_C06_X = torch.randn(16, 10, 2, generator=_gen(1601))
_C06_Y = _C06_X[..., 0].var(dim=1)


def _c06_loss(model: _DeepSet, bug: bool) -> torch.Tensor:
    y_pred = model(_C06_X)                                # (16, 1)
    y = _C06_Y if bug else _C06_Y.view_as(y_pred)          # bug: (16,) target broadcasts to (16, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return nn.MSELoss()(y_pred, y)


def _c06_build(bug: bool) -> Case:
    """DeepSets population-statistics regression: MSELoss between a (B, 1) prediction and a (B,) target."""
    torch.manual_seed(16)
    model = _DeepSet(2).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    step = _sgd_step(model, opt, lambda: _c06_loss(model, bug))
    return model, step, _kw(optimizer=opt, inputs=_C06_X)


def _c06_proof(bug: bool) -> bool:
    """The gradient the loss sends to each prediction pulls it to the batch-mean target, not to its own target."""
    model, _, _ = _c06_build(bug)
    y_pred = model(_C06_X).detach().requires_grad_(True)
    y = _C06_Y if bug else _C06_Y.view_as(y_pred)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nn.MSELoss()(y_pred, y).backward()
    n = y_pred.shape[0]
    to_mean = 2.0 / n * (y_pred.detach() - _C06_Y.mean())      # pull towards the batch mean
    to_own = 2.0 / n * (y_pred.detach() - _C06_Y.view(-1, 1))  # pull towards each sample's own target
    g = y_pred.grad
    return bool(torch.allclose(g, to_mean, atol=1e-6)) and not bool(torch.allclose(g, to_own, atol=1e-6))

# --------------------------------------------------------------------------------------------- case-07


class _TransformerBinaryClassifier(nn.Module):
    """Dynamic-graph anomaly classifier: raw event features + GNN embeddings -> transformer -> masked mean -> score."""

    def __init__(self, squash: bool, raw_dim: int = 6, gnn_dim: int = 8, d: int = 16) -> None:
        super().__init__()
        self.squash = squash
        self.in_proj = nn.Linear(raw_dim + gnn_dim, d)
        layer = nn.TransformerEncoderLayer(d, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.classifier = nn.Linear(d, 1)
        self.sigmoid = nn.Sigmoid()

    def forward(self, raw_input: torch.Tensor, gnn_output: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.encoder(self.in_proj(torch.cat([raw_input, gnn_output], -1)), src_key_padding_mask=~mask)
        keep = mask.unsqueeze(-1).float()
        mean_output = (h * keep).sum(1) / keep.sum(1)
        logits = self.classifier(mean_output)
        if self.squash:  # the bug: probabilities are returned and then fed to a with-logits loss
            logits = self.sigmoid(logits)
        return logits.squeeze(-1)


_C07_RAW = torch.randn(8, 7, 6, generator=_gen(1701))
_C07_GNN = torch.randn(8, 7, 8, generator=_gen(1702))
_C07_MASK = torch.arange(7)[None, :] < torch.tensor([7, 5, 6, 7, 4, 7, 3, 6])[:, None]
_C07_Y = torch.tensor([0., 1., 0., 0., 1., 0., 0., 1.])


def _c07_criterion(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.mean(F.binary_cross_entropy_with_logits(logits, labels, reduction="none"))


def _c07_build(bug: bool) -> Case:
    """Binary classifier whose forward ends in a Sigmoid, trained with binary_cross_entropy_with_logits."""
    torch.manual_seed(17)
    model = _TransformerBinaryClassifier(squash=bug).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    step = _sgd_step(model, opt, lambda: _c07_criterion(model(_C07_RAW, _C07_GNN, _C07_MASK), _C07_Y))
    return model, step, _kw(optimizer=opt, inputs=(_C07_RAW, _C07_GNN, _C07_MASK))


def _c07_proof(bug: bool) -> bool:
    """Even a model driven to score every event as surely normal cannot get the negatives' loss under ln 2."""
    model, _, _ = _c07_build(bug)
    with torch.no_grad():
        model.classifier.weight.zero_()
        model.classifier.bias.fill_(-30.0)  # as confident as possible that nothing is an anomaly
        loss_neg = _c07_criterion(model(_C07_RAW, _C07_GNN, _C07_MASK), torch.zeros(8))
    return float(loss_neg) > 0.69

# --------------------------------------------------------------------------------------------- case-08


class _Expert(nn.Module):
    """Species-specific expert: maps that species' gene counts into / out of the shared hidden space."""

    def __init__(self, genes: int, hidden: int = 16) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(genes, hidden), nn.ReLU())
        self.decoder = nn.Sequential(nn.Linear(hidden, genes), nn.ReLU())


class _SharedVAE(nn.Module):
    """The VAE shared by all experts: encoder -> (mu, logvar) -> reparameterised z -> decoder."""

    def __init__(self, hidden: int = 16, latent: int = 4) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(hidden, 12), nn.ReLU())
        self.mu = nn.Linear(12, latent)
        self.logvar = nn.Linear(12, latent)
        self.decoder = nn.Sequential(nn.Linear(latent, 12), nn.ReLU(), nn.Linear(12, hidden), nn.ReLU())

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        e = self.encoder(h)
        mu, logvar = self.mu(e), self.logvar(e)
        z = mu + torch.randn_like(mu) * torch.exp(0.5 * logvar)
        return self.decoder(z), mu, logvar


_C08_GENES = {"human": 20, "mouse": 14}
_C08_X = {k: torch.rand(6, g, generator=_gen(1801 + i)) for i, (k, g) in enumerate(_C08_GENES.items())}


def _c08_build(bug: bool) -> Case:
    """Multi-expert VAE (manual optimisation): one optimizer per expert plus one for the shared VAE."""
    torch.manual_seed(18)
    experts = nn.ModuleDict({k: _Expert(g) for k, g in _C08_GENES.items()})
    vae = _SharedVAE().train()
    expert_opts = {k: torch.optim.Adam(experts[k].parameters(), lr=1e-3, weight_decay=1e-6) for k in experts}
    vae_params = vae.encoder.parameters() if bug else vae.parameters()  # bug: only the encoder is handed over
    vae_opt = torch.optim.Adam(vae_params, lr=1e-3, weight_decay=1e-6)
    state = {"i": 0}

    def step() -> torch.Tensor:
        expert_id = list(experts)[state["i"] % len(experts)]
        state["i"] += 1
        x = _C08_X[expert_id]
        vae_opt.zero_grad()
        expert_opts[expert_id].zero_grad()
        recon_h, mu, logvar = vae(experts[expert_id].encoder(x))
        x_hat = experts[expert_id].decoder(recon_h)
        recon = F.mse_loss(x_hat, x, reduction="sum") / x.shape[0]
        kl = -0.5 * torch.mean(torch.sum(1 + logvar - mu.pow(2) - logvar.exp(), dim=1))
        loss = recon + kl
        loss.backward()
        vae_opt.step()
        expert_opts[expert_id].step()
        return loss

    return vae, step, _kw(optimizer=vae_opt, inputs=_C08_X["human"])


def _c08_proof(bug: bool) -> bool:
    """After a few full steps the shared VAE's decoder weights are exactly where they started."""
    vae, step, _ = _c08_build(bug)
    before = [p.detach().clone() for p in vae.decoder.parameters()]
    for _ in range(4):
        step()
    got_grad = all(p.grad is not None and float(p.grad.abs().sum()) > 0 for p in vae.decoder.parameters())
    unchanged = all(torch.equal(b, p) for b, p in zip(before, vae.decoder.parameters()))
    return got_grad and unchanged

# --------------------------------------------------------------------------------------------- case-09


class _TinyDALLE(nn.Module):
    """DALL-E style decoder: text tokens then (VQ-VAE) image tokens in one causal transformer, one joint head."""

    def __init__(self, ignore_pad: bool, num_text_tokens: int = 20, num_image_tokens: int = 16,
                 text_seq_len: int = 6, image_seq_len: int = 4, d: int = 16) -> None:
        super().__init__()
        self.ignore_index = 0  # the tokenizer's pad id; defined, but only used when ignore_pad
        self.ignore_pad = ignore_pad
        self.num_text_tokens = num_text_tokens
        self.text_emb = nn.Embedding(num_text_tokens, d)
        self.image_emb = nn.Embedding(num_image_tokens, d)
        self.pos_emb = nn.Embedding(text_seq_len + image_seq_len, d)
        layer = nn.TransformerEncoderLayer(d, 2, 32, dropout=0.0, batch_first=True)
        self.transformer = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.to_logits = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, num_text_tokens + num_image_tokens))

    def logits(self, text: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
        tokens = torch.cat([self.text_emb(text), self.image_emb(image)], dim=1)[:, :-1]
        n = tokens.shape[1]
        tokens = tokens + self.pos_emb(torch.arange(n))[None]
        mask = nn.Transformer.generate_square_subsequent_mask(n)
        return self.to_logits(self.transformer(tokens, mask=mask, is_causal=True))

    def forward(self, text: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
        logits = self.logits(text, image)
        labels = torch.cat([text[:, 1:], image + self.num_text_tokens], dim=1)
        if self.ignore_pad:
            return F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=self.ignore_index)
        return F.cross_entropy(logits.transpose(1, 2), labels)  # pad targets are trained like real tokens


# captions right-padded with 0 to text_seq_len; image codes from a VQ-VAE
_C09_TEXT = torch.tensor([[3, 7, 5, 0, 0, 0], [4, 9, 11, 6, 2, 0], [8, 2, 0, 0, 0, 0], [5, 5, 13, 7, 0, 0]])
_C09_IMAGE = torch.randint(0, 16, (4, 4), generator=_gen(1901))


def _c09_build(bug: bool) -> Case:
    """Text-to-image transformer trained on padded captions + image codes with the joint next-token loss."""
    torch.manual_seed(19)
    model = _TinyDALLE(ignore_pad=not bug).train()
    opt = torch.optim.Adam(model.parameters(), lr=3e-4)
    step = _sgd_step(model, opt, lambda: model(_C09_TEXT, _C09_IMAGE))
    return model, step, _kw(optimizer=opt, inputs=(_C09_TEXT, _C09_IMAGE))


def _c09_proof(bug: bool) -> bool:
    """The loss sends gradient into the predictions whose target is a padding token."""
    model, _, _ = _c09_build(bug)
    logits = model.logits(_C09_TEXT, _C09_IMAGE).detach().requires_grad_(True)
    labels = torch.cat([_C09_TEXT[:, 1:], _C09_IMAGE + model.num_text_tokens], dim=1)
    if model.ignore_pad:
        loss = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=model.ignore_index)
    else:
        loss = F.cross_entropy(logits.transpose(1, 2), labels)
    loss.backward()
    pad = labels == 0
    return float(logits.grad[pad].abs().sum()) > 0.0

# --------------------------------------------------------------------------------------------- case-10


class _InvertedResidualBlock(nn.Module):
    """MobileNetV2 inverted residual block; stride 1 adds a skip, projected by a 1x1 conv when channels change."""

    def __init__(self, in_c: int, out_c: int, stride: int, expansion_factor: int = 6, deconvolve: bool = False,
                 dangling_skip: bool = False) -> None:
        super().__init__()
        self.stride, self.in_c, self.out_c = stride, in_c, out_c
        self.use_skip_connection = stride == 1
        self.dangling_skip = dangling_skip
        ex_c = int(in_c * expansion_factor)
        depthwise: nn.Module = (nn.ConvTranspose2d(ex_c, ex_c, 4, stride, 1, groups=ex_c, bias=False) if deconvolve
                                else nn.Conv2d(ex_c, ex_c, 3, stride, 1, groups=ex_c, bias=False))
        self.conv = nn.Sequential(
            nn.Conv2d(in_c, ex_c, 1, 1, 0, bias=False), nn.BatchNorm2d(ex_c), nn.ReLU6(inplace=True),
            depthwise, nn.BatchNorm2d(ex_c), nn.ReLU6(inplace=True),
            nn.Conv2d(ex_c, out_c, 1, 1, 0, bias=False), nn.BatchNorm2d(out_c))
        if self.use_skip_connection and in_c != out_c and not dangling_skip:
            self.skip = nn.Conv2d(in_c, out_c, 1, 1, 0, bias=False)  # the fix: a registered projection

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_skip_connection:
            out = self.conv(x)
            if self.in_c != self.out_c:
                if self.dangling_skip:  # the bug: a brand-new random conv on every call, invisible to the optimizer
                    x = nn.Conv2d(self.in_c, self.out_c, 1, 1, 0, bias=False)(x)
                else:
                    x = self.skip(x)
            return x + out
        return self.conv(x)


class _MobileUNet(nn.Module):
    """A two-level Mobile-UNet: depthwise-separable stem, inverted-residual encoder, deconvolving decoder."""

    def __init__(self, dangling_skip: bool) -> None:
        super().__init__()
        self.conv3x3 = nn.Sequential(
            nn.Conv2d(3, 3, 3, padding=1, groups=3, stride=2), nn.BatchNorm2d(3), nn.ReLU6(inplace=True),
            nn.Conv2d(3, 8, 1))
        self.irb_bottleneck1 = _InvertedResidualBlock(8, 4, 1, 1, dangling_skip=dangling_skip)
        self.irb_bottleneck2 = _InvertedResidualBlock(4, 6, 2, 6, dangling_skip=dangling_skip)
        self.D_irb1 = _InvertedResidualBlock(6, 4, 2, 6, deconvolve=True, dangling_skip=dangling_skip)
        self.DConv4x4 = nn.ConvTranspose2d(4, 4, 4, 2, 1, groups=4, bias=False)
        self.conv1x1_decode = nn.Conv2d(4, 3, kernel_size=1, stride=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1 = self.conv3x3(x)
        x2 = self.irb_bottleneck1(x1)
        x3 = self.irb_bottleneck2(x2)
        d1 = self.D_irb1(x3) + x2
        return self.conv1x1_decode(self.DConv4x4(d1))


_C10_X = torch.rand(2, 3, 16, 16, generator=_gen(2001))
_C10_T = torch.rand(2, 3, 16, 16, generator=_gen(2002))


def _c10_build(bug: bool) -> Case:
    """Mobile-UNet image-to-image model trained with MSE; one block projects its skip with a conv made in forward."""
    torch.manual_seed(20)
    model = _MobileUNet(dangling_skip=bug).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    step = _sgd_step(model, opt, lambda: F.mse_loss(model(_C10_X), _C10_T))
    return model, step, _kw(optimizer=opt, inputs=_C10_X)


def _c10_proof(bug: bool) -> bool:
    """In eval mode the same image gives a different output on each call (the skip weights are redrawn)."""
    model, _, _ = _c10_build(bug)
    model.eval()
    with torch.no_grad():
        a, b = model(_C10_X), model(_C10_X)
    return float((a - b).abs().max()) > 1e-6


CASES: list[BlindCase] = [
    BlindCase("b15-case-06", "https://github.com/manzilzaheer/DeepSets/pull/1", "loss shape broadcasting",
              "a (B,1) prediction against a (B,) target broadcasts the MSE to all BxB pairs, so every set's "
              "prediction is trained towards the batch-mean statistic instead of its own",
              _c06_build, _c06_proof),
    BlindCase("b15-case-07", "https://github.com/YXNTU/GeneralDyG/issues/6", "double sigmoid before with-logits loss",
              "the classifier already applies a sigmoid and the with-logits loss applies another, so the score "
              "the loss sees never drops below 0.5 and negatives can never be fit (loss floored at ln 2)",
              _c07_build, _c07_proof),
    BlindCase("b15-case-08", "https://github.com/zdebruine/MMVAE/issues/39", "optimizer missing parameters",
              "the shared VAE's optimizer is built from its encoder's parameters only, so the decoder gets "
              "gradients every step but is never updated and stays at its random initialisation",
              _c08_build, _c08_proof),
    BlindCase("b15-case-09", "https://github.com/lucidrains/DALLE-pytorch/issues/57", "padding not ignored in loss",
              "ignore_index is defined but never passed to the cross-entropy, so the padded tail of every caption "
              "is trained as real next-token targets and most of the text loss teaches the model to emit padding",
              _c09_build, _c09_proof,
              known_miss="the pad targets are scored inside a hand-written loss in forward, with no attention mask "
                         "or pad id the audit can read"),
    BlindCase("b15-case-10", "https://github.com/lafith/Mobile-UNet/issues/1", "layer created in forward",
              "the skip projection of a channel-changing inverted residual block is a new nn.Conv2d built inside "
              "forward, so its weights are redrawn at random every call, never trained and never saved",
              _c10_build, _c10_proof),
]
