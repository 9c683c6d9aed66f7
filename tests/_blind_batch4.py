"""Blind batch 4: silent training bugs from public GitHub threads, each with its fixed twin.

Collected by someone who does not write the audit's checks; see docs/blind-batch4.md. Every case builds the user's
setup on a tiny real model (transformers models from tiny configs in code, real peft LoRA, real optimizers and
schedulers, real autocast; nothing is downloaded) and proves the bug without the audit on real runs.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import tempfile
from functools import partial
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from guardtower.preflight import audit
from tests._audit_core_helpers import sgd_step
from tests._blind import BlindCase, Case

_AUDIT_PARAMS = set(inspect.signature(audit).parameters)


def _kw(**kwargs: Any) -> dict[str, Any]:
    """The audit arguments a user passes, less any this ``audit()`` does not take."""
    return {k: v for k, v in kwargs.items() if k in _AUDIT_PARAMS}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


_sgd_step = sgd_step  # the batches' name for the shared plain training step


# --------------------------------------------------------------------------------------------- case-01

class _PositionalEncoding(nn.Module):
    """Sinusoidal encoding; ``seq_first`` stores it (max_len, 1, d) as in the PyTorch tutorial it came from."""

    pe: torch.Tensor

    def __init__(self, d_model: int, seq_first: bool, max_len: int = 64) -> None:
        super().__init__()
        position = torch.arange(max_len, dtype=torch.float).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2).float() * (-math.log(10000.0) / d_model))
        pe = torch.zeros(max_len, d_model)
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        self.seq_first = seq_first
        self.register_buffer("pe", pe.unsqueeze(1) if seq_first else pe.unsqueeze(0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + (self.pe[: x.size(0)] if self.seq_first else self.pe[:, : x.size(1)])


class _NextPOITransformer(nn.Module):
    """Next-POI model: check-in embeddings (batch, seq, embed) through a causal transformer encoder."""

    def __init__(self, bug: bool, embed: int = 16, num_poi: int = 20, num_cat: int = 5) -> None:
        super().__init__()
        self.bug = bug
        self.pos_encoder = _PositionalEncoding(embed, seq_first=bug)
        layer = nn.TransformerEncoderLayer(embed, 2, 32, dropout=0.1, batch_first=not bug)
        self.transformer_encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.decoder_poi = nn.Linear(embed, num_poi)
        self.decoder_cat = nn.Linear(embed, num_cat)
        self.embed = embed

    @staticmethod
    def square_subsequent_mask(size: int) -> torch.Tensor:
        return torch.triu(torch.full((size, size), float("-inf")), diagonal=1)

    def forward(self, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # the training script builds the causal mask from the batch size (right for (seq, batch, embed) input)
        mask = self.square_subsequent_mask(src.size(0) if self.bug else src.size(1))
        x = self.pos_encoder(src * math.sqrt(self.embed))
        x = self.transformer_encoder(x, mask)
        return self.decoder_poi(x), self.decoder_cat(x)


_POI_X = torch.randn(4, 6, 16, generator=_gen(1))  # padded (batch, seq, embed), pad_sequence(batch_first=True)
_POI_Y = torch.randint(0, 20, (4, 6), generator=_gen(2))
_CAT_Y = torch.randint(0, 5, (4, 6), generator=_gen(3))


def _c01_build(bug: bool) -> Case:
    """GETNext-style trajectory model fed batch-first tensors, built for (seq, batch, embed)."""
    torch.manual_seed(0)
    model = _NextPOITransformer(bug).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=5e-4)

    def loss_fn() -> torch.Tensor:
        poi, cat = model(_POI_X)
        return F.cross_entropy(poi.transpose(1, 2), _POI_Y, ignore_index=-1) + \
            F.cross_entropy(cat.transpose(1, 2), _CAT_Y, ignore_index=-1)

    return model, _sgd_step(model, opt, loss_fn), _kw(optimizer=opt, inputs=_POI_X)


def _c01_proof(bug: bool) -> bool:
    """A trajectory's predictions change when another trajectory of the batch changes: samples mix."""
    model, _, _ = _c01_build(bug)
    model.eval()
    other = _POI_X.clone()
    other[0] = torch.randn(6, 16, generator=_gen(4))
    with torch.no_grad():
        return not torch.allclose(model(_POI_X)[0][1:], model(other)[0][1:], atol=1e-5)


# --------------------------------------------------------------------------------------------- case-02

class _ResMLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.relu(self.fc1(x)))


class _ResMLPs(nn.Module):
    """Implicit image function: several residual MLPs mixed by weights predicted from the coordinates."""

    def __init__(self, bug: bool, d: int = 16, n: int = 4) -> None:
        super().__init__()
        mlps = [_ResMLP(d) for _ in range(n)]
        self.mlps: list[_ResMLP] | nn.ModuleList = mlps if bug else nn.ModuleList(mlps)  # a list registers nothing
        self.coord_mlp = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, n))
        self.out = nn.Linear(d, 3)

    def forward(self, feat: torch.Tensor, coord: torch.Tensor) -> torch.Tensor:
        weights = torch.softmax(self.coord_mlp(coord), dim=-1)
        mixed = sum(weights[:, i:i + 1] * mlp(feat) for i, mlp in enumerate(self.mlps))
        return self.out(mixed)


_FEAT = torch.randn(32, 16, generator=_gen(21))
_COORD = torch.rand(32, 2, generator=_gen(22)) * 2 - 1
_RGB = torch.rand(32, 3, generator=_gen(23))


def _c02_build(bug: bool) -> Case:
    """Super-resolution head whose residual MLPs sit in a Python list instead of an nn.ModuleList."""
    torch.manual_seed(0)
    model = _ResMLPs(bug).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    step = _sgd_step(model, opt, lambda: F.l1_loss(model(_FEAT, _COORD), _RGB))
    return model, step, _kw(optimizer=opt, inputs=(_FEAT, _COORD))


def _c02_proof(bug: bool) -> bool:
    """The residual MLPs shape every output, yet real optimizer steps leave their weights bitwise unchanged."""
    model, step, _ = _c02_build(bug)
    mlps = list(cast(_ResMLPs, model).mlps)
    before = [p.detach().clone() for mlp in mlps for p in mlp.parameters()]
    step()
    step()
    after = [p.detach() for mlp in mlps for p in mlp.parameters()]
    return all(torch.equal(b, a) for b, a in zip(before, after))


# --------------------------------------------------------------------------------------------- case-03

def _gpt2(seed: int = 0, n_embd: int = 32) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=2, n_embd=n_embd, n_head=2, vocab_size=40, n_positions=32, bos_token_id=1,
                     eos_token_id=1, pad_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


_MAX_LR, _MIN_LR, _WARMUP, _CYCLE = 3e-4, 3e-5, 10, 100


def _cosine_lr(it: int, *, max_lr: float, min_lr: float, warmup: int, cycle: int) -> float:
    """Cosine schedule with linear warmup, returning the learning rate itself (not a factor)."""
    if it < warmup:
        return it / max(1, warmup) * max_lr
    if it <= cycle:
        progress = (it - warmup) / (cycle - warmup)
        return min_lr + 0.5 * (max_lr - min_lr) * (1 + math.cos(math.pi * progress))
    return min_lr


def _cosine_factor(it: int, **kw: float) -> float:
    return _cosine_lr(it, **kw) / kw["max_lr"]  # type: ignore[arg-type]


_LM_IDS = torch.randint(2, 40, (4, 12), generator=_gen(31))


def _c03_build(bug: bool) -> Case:
    """GPT-2 pretraining: LambdaLR given a function that returns the learning rate, not a multiplier."""
    model = _gpt2(seed=3).train()
    opt = torch.optim.AdamW(model.parameters(), lr=_MAX_LR, weight_decay=0.1)
    fn = _cosine_lr if bug else _cosine_factor
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, partial(fn, max_lr=_MAX_LR, min_lr=_MIN_LR, warmup=_WARMUP, cycle=_CYCLE))
    batch = {"input_ids": _LM_IDS, "labels": _LM_IDS}

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        sched.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=batch, lr_scheduler=sched, total_steps=_CYCLE)


def _c03_proof(bug: bool) -> bool:
    """Walk the real scheduler over the planned run: the peak lr stays ~max_lr**2, far below max_lr."""
    _, _, kw = _c03_build(bug)
    opt, sched = kw["optimizer"], kw["lr_scheduler"]
    peak = 0.0
    for _ in range(_CYCLE):
        opt.step()
        sched.step()
        peak = max(peak, opt.param_groups[0]["lr"])
    return peak < 0.01 * _MAX_LR


# --------------------------------------------------------------------------------------------- case-04

class _TabularNet(nn.Module):
    """Tabular classifier with batch norm on the raw features and after each hidden layer."""

    def __init__(self, bn_momentum: float, d_in: int = 8, hidden: int = 32, classes: int = 3) -> None:
        super().__init__()
        self.input_bn = nn.BatchNorm1d(d_in, momentum=bn_momentum)
        self.fc1 = nn.Linear(d_in, hidden)
        self.bn1 = nn.BatchNorm1d(hidden, momentum=bn_momentum)
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.bn1(self.fc1(self.input_bn(x)))))


_TAB_X = 3.0 + torch.randn(64, 8, generator=_gen(41))
_TAB_Y = torch.randint(0, 3, (64,), generator=_gen(42))


def _c04_build(bug: bool) -> Case:
    """TabNet-style config: bn_momentum 0.95 in TensorFlow's convention, handed to torch's BatchNorm1d."""
    torch.manual_seed(0)
    model = _TabularNet(bn_momentum=0.95 if bug else 0.05).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    step = _sgd_step(model, opt, lambda: F.cross_entropy(model(_TAB_X), _TAB_Y))
    return model, step, _kw(optimizer=opt, inputs=(_TAB_X, _TAB_Y))


def _c04_proof(bug: bool) -> bool:
    """After one real step the running mean has moved most of the way to that one batch's mean."""
    model, step, _ = _c04_build(bug)
    step()
    running_mean = cast(_TabularNet, model).input_bn.running_mean
    assert running_mean is not None
    moved = running_mean.norm() / _TAB_X.mean(0).norm()
    return float(moved) > 0.5


# --------------------------------------------------------------------------------------------- case-05

def _bert(hidden: int = 32, vocab: int = 40, seed: int = 0) -> nn.Module:
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=32, pad_token_id=0,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertModel(cfg)


class _ReduceDim(nn.Module):
    def __init__(self, d_in: int, d_out: int, bug: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(d_in, d_out)
        self.bug = bug

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.fc(x)
        return F.normalize(x) if self.bug else F.normalize(x, dim=-1)  # default dim=1 is time here


class _VideoTextRetrieval(nn.Module):
    """Video experts (batch, time, feat) reduced, then a BERT over time; a BERT over the caption."""

    def __init__(self, bug: bool, d_expert: int = 24, d: int = 32) -> None:
        super().__init__()
        self.video_dim_reduce = _ReduceDim(d_expert, d, bug)
        self.vid_bert = _bert(d, seed=51)
        self.txt_bert = _bert(d, seed=52)

    def forward(self, feats: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        vid = self.vid_bert(inputs_embeds=self.video_dim_reduce(feats)).last_hidden_state[:, 0]
        txt = self.txt_bert(input_ids=ids, attention_mask=mask).last_hidden_state[:, 0]
        return F.normalize(txt, dim=-1) @ F.normalize(vid, dim=-1).T  # caption x video similarities


def _max_margin_loss(sims: torch.Tensor, margin: float = 0.05) -> torch.Tensor:
    pos = sims.diag()
    cost_t = (margin + sims - pos[:, None]).clamp(min=0)
    cost_v = (margin + sims - pos[None, :]).clamp(min=0)
    off = ~torch.eye(sims.size(0), dtype=torch.bool)
    return (cost_t[off].mean() + cost_v[off].mean()) / 2


_VID = torch.randn(4, 6, 24, generator=_gen(53))
_CAP = torch.randint(2, 40, (4, 7), generator=_gen(54))
_CAP_MASK = torch.ones_like(_CAP)


def _c05_build(bug: bool) -> Case:
    """Multi-modal retrieval: the expert features are L2-normalised with F.normalize's default dim."""
    torch.manual_seed(0)
    model = _VideoTextRetrieval(bug).train()
    opt = torch.optim.Adam(model.parameters(), lr=5e-5)
    step = _sgd_step(model, opt, lambda: _max_margin_loss(model(_VID, _CAP, _CAP_MASK)))
    batch = {"feats": _VID, "ids": _CAP, "mask": _CAP_MASK}
    return model, step, _kw(optimizer=opt, inputs=batch)


def _c05_proof(bug: bool) -> bool:
    """The reduced expert tokens are not unit vectors: each was divided by a norm taken across the clip's time."""
    model = cast(_VideoTextRetrieval, _c05_build(bug)[0])
    with torch.no_grad():
        norms = model.video_dim_reduce(_VID).norm(dim=-1)
    return not torch.allclose(norms, torch.ones_like(norms), atol=1e-4)


# --------------------------------------------------------------------------------------------- case-06

class _FlowDenoiser(nn.Module):
    """Class-conditional velocity predictor on latents (a tiny stand-in for the DiT)."""

    def __init__(self, d: int = 8, classes: int = 4, hidden: int = 32) -> None:
        super().__init__()
        self.y_embed = nn.Embedding(classes, hidden)
        self.t_embed = nn.Linear(1, hidden)
        self.inp = nn.Linear(d, hidden)
        self.out = nn.Sequential(nn.SiLU(), nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, d))

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.out(self.inp(x) + self.t_embed(t[:, None]) + self.y_embed(y))


def _flow_loss(model: nn.Module, mb: dict[str, torch.Tensor]) -> torch.Tensor:
    t = mb["t"][:, None]
    xt = (1 - t) * mb["z"] + t * mb["noise"]
    return F.mse_loss(model(xt, mb["t"], mb["y"]), mb["noise"] - mb["z"])


def _flow_microbatches(k: int = 4, n: int = 8) -> list[dict[str, torch.Tensor]]:
    """Latents from the frozen encoder with their sampled noise and times, fixed so runs repeat."""
    g = _gen(61)
    return [{"z": torch.randn(n, 8, generator=g), "noise": torch.randn(n, 8, generator=g),
             "t": torch.rand(n, generator=g), "y": torch.randint(0, 4, (n,), generator=g)} for _ in range(k)]


def _c06_build(bug: bool) -> Case:
    """Latent flow-matching loop with grad_accum_steps=4 that calls zero_grad on every micro-batch."""
    torch.manual_seed(0)
    model = _FlowDenoiser().train()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-4, weight_decay=0.0)
    mbs = _flow_microbatches()
    accum = len(mbs)

    def step() -> torch.Tensor:  # one optimizer step = grad_accum_steps loader steps
        if not bug:
            opt.zero_grad(set_to_none=True)
        for mb in mbs:
            if bug:
                opt.zero_grad(set_to_none=True)
            loss = _flow_loss(model, mb)
            (loss / accum).backward()
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=mbs[0], total_steps=1000)


def _c06_proof(bug: bool) -> bool:
    """The gradient the step applies differs from the mean gradient over the accumulation window."""
    model, step, kw = _c06_build(bug)
    mbs = _flow_microbatches()
    model.zero_grad()
    torch.stack([_flow_loss(model, mb) for mb in mbs]).mean().backward()
    ref = _grads(model)
    model.zero_grad()
    opt = kw["optimizer"]
    saved = opt.step
    opt.step = lambda *a, **k: None  # keep the accumulated gradient
    try:
        step()
    finally:
        opt.step = saved
    got = _grads(model)
    return any(not torch.allclose(got[n], ref[n], rtol=1e-4, atol=1e-7) for n in ref)


# --------------------------------------------------------------------------------------------- case-07

class _ACT(nn.Module):
    """Action-chunking transformer: an image backbone, a transformer encoder, an action head."""

    def __init__(self, d: int = 32, chunk: int = 4, action_dim: int = 6) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                      nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.input_proj = nn.Conv2d(16, d, 1)
        self.state_proj = nn.Linear(action_dim, d)
        layer = nn.TransformerEncoderLayer(d, 2, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.queries = nn.Embedding(chunk, d)
        self.action_head = nn.Linear(d, action_dim)

    def forward(self, image: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        feat = self.input_proj(self.backbone(image)).flatten(2).transpose(1, 2)  # (B, HW, d)
        tokens = torch.cat([self.state_proj(state)[:, None], feat,
                            self.queries.weight[None].expand(image.size(0), -1, -1)], dim=1)
        out = self.encoder(tokens)
        return self.action_head(out[:, -self.queries.num_embeddings:])


class _ACTPolicy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = _ACT()

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        pred = self.model(batch["observation.image"], batch["observation.state"])
        return F.l1_loss(pred, batch["action"])


_LR, _LR_BACKBONE = 1e-4, 1e-5
_ACT_BATCH = {"observation.image": torch.rand(2, 3, 16, 16, generator=_gen(71)),
              "observation.state": torch.randn(2, 6, generator=_gen(72)),
              "action": torch.randn(2, 4, 6, generator=_gen(73))}


def _c07_build(bug: bool) -> Case:
    """ACT training: the backbone's own learning rate is keyed on a name prefix that no parameter has."""
    torch.manual_seed(0)
    policy = _ACTPolicy().train()
    prefix = "backbone" if bug else "model.backbone"
    groups: list[dict[str, Any]] = [
        {"params": [p for n, p in policy.named_parameters() if not n.startswith(prefix) and p.requires_grad]},
        {"params": [p for n, p in policy.named_parameters() if n.startswith(prefix) and p.requires_grad],
         "lr": _LR_BACKBONE},
    ]
    opt = torch.optim.AdamW(groups, lr=_LR, weight_decay=1e-4)
    return policy, _sgd_step(policy, opt, lambda: policy(_ACT_BATCH)), _kw(optimizer=opt, inputs=_ACT_BATCH)


def _c07_proof(bug: bool) -> bool:
    """After a real step the backbone's weights sit in the group stepping at the main lr, not lr_backbone."""
    policy, step, kw = _c07_build(bug)
    step()
    weight = cast(nn.Conv2d, cast(_ACTPolicy, policy).model.backbone[0]).weight
    group = next(g for g in kw["optimizer"].param_groups if any(p is weight for p in g["params"]))
    return group["lr"] != _LR_BACKBONE


# --------------------------------------------------------------------------------------------- case-08

_CTC_TEXTS = ["the cat sat.", "a dog ran.", "we see it."]


def _ctc_tokenizer(do_lower_case: bool) -> Any:
    """A character CTC tokenizer over a lowercase vocabulary, written to a temporary file."""
    from transformers import Wav2Vec2CTCTokenizer

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, "|": 4}
    for i, ch in enumerate("abcdefghijklmnopqrstuvwxyz'."):
        vocab[ch] = 5 + i
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "vocab.json")
        with open(path, "w") as f:
            json.dump(vocab, f)
        return Wav2Vec2CTCTokenizer(path, do_lower_case=do_lower_case)


def _ctc_labels(do_lower_case: bool) -> tuple[torch.Tensor, Any]:
    tok = _ctc_tokenizer(do_lower_case)
    enc = tok(_CTC_TEXTS, padding=True, return_tensors="pt")
    labels = enc.input_ids.masked_fill(enc.attention_mask == 0, -100)
    return labels, tok


def _c08_build(bug: bool) -> Case:
    """wav2vec2 CTC fine-tuning: do_lower_case=True on a lowercase vocabulary (it upper-cases the text)."""
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

    labels, tok = _ctc_labels(do_lower_case=bug)
    torch.manual_seed(0)
    cfg = Wav2Vec2Config(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
                         num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2, mask_time_prob=0.0,
                         layerdrop=0.0, hidden_dropout=0.0, attention_dropout=0.0, feat_proj_dropout=0.0,
                         pad_token_id=tok.pad_token_id, ctc_loss_reduction="mean")
    model = Wav2Vec2ForCTC(cfg).train()
    batch = {"input_values": torch.randn(3, 1600, generator=_gen(81)), "labels": labels}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, _sgd_step(model, opt, lambda: model(**batch).loss), _kw(optimizer=opt, inputs=batch)


def _c08_proof(bug: bool) -> bool:
    """Most letters of the transcripts reach the CTC loss as the <unk> id."""
    labels, tok = _ctc_labels(do_lower_case=bug)
    letters = sum(ch.isalpha() for text in _CTC_TEXTS for ch in text)
    unk = int((labels == tok.unk_token_id).sum())
    return unk > letters // 2


# --------------------------------------------------------------------------------------------- case-09

def _flow_policy_parts(bug: bool) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    """Online RL fine-tuning of a flow policy: fp32 master weights, bf16 autocast, several updates per call."""
    torch.manual_seed(0)
    model = _FlowDenoiser().train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)

    def autocast() -> Any:
        return torch.autocast("cpu", dtype=torch.bfloat16)

    def optimize(minibatches: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        losses = []
        if bug:
            with autocast():  # one context around the whole inner loop
                for mb in minibatches:
                    loss = _flow_loss(model, mb)
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    losses.append(loss.detach())
        else:
            for mb in minibatches:
                with autocast():  # a context per forward
                    loss = _flow_loss(model, mb)
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.detach())
        return losses

    return model, opt, optimize


def _c09_build(bug: bool) -> Case:
    model, opt, optimize = _flow_policy_parts(bug)
    mbs = _flow_microbatches(k=2)
    return model, lambda: optimize(mbs)[-1], _kw(optimizer=opt, inputs=mbs[0])


def _c09_proof(bug: bool) -> bool:
    """The same minibatch twice: the second forward's last layer computes with the weights before the update."""
    model, _, optimize = _flow_policy_parts(bug)
    layer = cast(nn.Linear, cast(_FlowDenoiser, model).out[3])
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    hook = layer.register_forward_hook(lambda _m, inp, out: seen.append((inp[0].detach(), out.detach())))
    old = nn.Linear(layer.in_features, layer.out_features)
    old.load_state_dict(layer.state_dict())
    mb = _flow_microbatches(k=1)[0]
    try:
        optimize([mb, mb])
    finally:
        hook.remove()
    new = nn.Linear(layer.in_features, layer.out_features)
    new.load_state_dict(layer.state_dict())
    x, out = seen[1]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        stale, fresh = old(x), new(x)
    return torch.equal(out, stale) and not torch.equal(out, fresh)


# --------------------------------------------------------------------------------------------- case-10

class _FeedForward(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.net = nn.ModuleList([_GELUProj(d, 2 * d), nn.Dropout(0.0), nn.Linear(2 * d, d)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.net:
            x = layer(x)
        return x


class _GELUProj(nn.Module):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d_in, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.proj(x), approximate="tanh")


class _JointAttention(nn.Module):
    """Image and text streams attend jointly; module names follow diffusers' Flux attention."""

    def __init__(self, d: int, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.to_q, self.to_k, self.to_v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.add_q_proj, self.add_k_proj, self.add_v_proj = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.to_out = nn.ModuleList([nn.Linear(d, d), nn.Dropout(0.0)])
        self.to_add_out = nn.Linear(d, d)

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.size(0), x.size(1), self.heads, -1).transpose(1, 2)

    def forward(self, img: torch.Tensor, txt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = torch.cat([self.add_q_proj(txt), self.to_q(img)], dim=1)
        k = torch.cat([self.add_k_proj(txt), self.to_k(img)], dim=1)
        v = torch.cat([self.add_v_proj(txt), self.to_v(img)], dim=1)
        out = F.scaled_dot_product_attention(self._split(q), self._split(k), self._split(v))
        out = out.transpose(1, 2).reshape(q.shape)
        txt_out, img_out = out[:, :txt.size(1)], out[:, txt.size(1):]
        return self.to_out[1](self.to_out[0](img_out)), self.to_add_out(txt_out)


class _FluxLikeTransformer(nn.Module):
    """One dual-stream block (attention, then ff / ff_context) and an output projection."""

    def __init__(self, d: int = 16, d_latent: int = 8) -> None:
        super().__init__()
        self.x_embedder = nn.Linear(d_latent, d)
        self.attn = _JointAttention(d)
        self.norm1, self.norm1_context = nn.LayerNorm(d), nn.LayerNorm(d)
        self.norm2, self.norm2_context = nn.LayerNorm(d), nn.LayerNorm(d)
        self.ff, self.ff_context = _FeedForward(d), _FeedForward(d)
        self.proj_out = nn.Linear(d, d_latent)

    def forward(self, latents: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        img = self.x_embedder(latents)
        a_img, a_txt = self.attn(self.norm1(img), self.norm1_context(text))
        img, txt = img + a_img, text + a_txt
        img = img + self.ff(self.norm2(img))
        txt = txt + self.ff_context(self.norm2_context(txt))
        return self.proj_out(img)


_FLUX_TARGETS_BUG = ["to_k", "to_q", "to_v", "add_k_proj", "add_q_proj", "add_v_proj", "to_out.0", "to_add_out.0",
                     "ff.0", "ff.2", "ff_context.0", "ff_context.2"]
_FLUX_TARGETS_FIX = ["to_k", "to_q", "to_v", "add_k_proj", "add_q_proj", "add_v_proj", "to_out.0", "to_add_out",
                     "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2"]
_FLUX_BATCH = {"latents": torch.randn(2, 6, 8, generator=_gen(101)),
               "text": torch.randn(2, 3, 16, generator=_gen(102)),
               "noise": torch.randn(2, 6, 8, generator=_gen(103)),
               "t": torch.rand(2, generator=_gen(104))}


def _c10_build(bug: bool) -> Case:
    """LoRA on a Flux-style transformer with target names ('ff.0', 'to_add_out.0') that match no module."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = _FluxLikeTransformer()
    cfg = LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian",
                     target_modules=_FLUX_TARGETS_BUG if bug else _FLUX_TARGETS_FIX)
    model = get_peft_model(base, cfg).train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, weight_decay=1e-2)
    b = _FLUX_BATCH
    t = b["t"][:, None, None]

    def loss_fn() -> torch.Tensor:
        noisy = (1 - t) * b["latents"] + t * b["noise"]
        return F.mse_loss(model(noisy, b["text"]), b["noise"] - b["latents"])

    return model, _sgd_step(model, opt, loss_fn), _kw(optimizer=opt, inputs=b)


def _c10_proof(bug: bool) -> bool:
    """In the real peft model the feed-forward layers and the text output projection carry no adapter."""
    from peft.tuners.lora import LoraLayer

    model, _, _ = _c10_build(bug)
    adapted = {name for name, m in model.named_modules() if isinstance(m, LoraLayer)}
    wanted = ("attn.to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2")
    return not all(any(name.endswith(w) for name in adapted) for w in wanted)


# --------------------------------------------------------------------------------------------- case-11

def _cnn(width: int, seed: int, classes: int = 10) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(4 * width, classes))


_KD_ALPHA, _KD_T = 0.9, 4.0
_KD_X = torch.randn(8, 3, 8, 8, generator=_gen(111))
_KD_Y = torch.randint(0, 10, (8,), generator=_gen(112))


def _kd_loss(outputs: torch.Tensor, labels: torch.Tensor, teacher_outputs: torch.Tensor,
             bug: bool) -> torch.Tensor:
    kl = nn.KLDivLoss() if bug else nn.KLDivLoss(reduction="batchmean")
    soft = kl(F.log_softmax(outputs / _KD_T, dim=1), F.softmax(teacher_outputs / _KD_T, dim=1))
    return soft * (_KD_ALPHA * _KD_T * _KD_T) + F.cross_entropy(outputs, labels) * (1.0 - _KD_ALPHA)


def _c11_build(bug: bool) -> Case:
    """Knowledge distillation with nn.KLDivLoss() at its default reduction='mean'."""
    import warnings

    teacher = _cnn(16, seed=113).eval()
    student = _cnn(8, seed=114).train()
    opt = torch.optim.SGD(student.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)

    def loss_fn() -> torch.Tensor:
        with torch.no_grad():
            teacher_out = teacher(_KD_X)
        with warnings.catch_warnings():  # torch notes 'mean' will change; the run goes on as before
            warnings.simplefilter("ignore")
            return _kd_loss(student(_KD_X), _KD_Y, teacher_out, bug)

    return student, _sgd_step(student, opt, loss_fn), _kw(optimizer=opt, inputs=(_KD_X, _KD_Y))


def _c11_proof(bug: bool) -> bool:
    """The distillation term the real loss uses is the batch KL divided again by the number of classes."""
    import warnings

    student, _, _ = _c11_build(bug)
    teacher = _cnn(16, seed=113).eval()
    with torch.no_grad():
        s, t = student(_KD_X), teacher(_KD_X)
        p = F.softmax(t / _KD_T, dim=1)
        true_kl = (p * (p.log() - F.log_softmax(s / _KD_T, dim=1))).sum(1).mean()
        ce = F.cross_entropy(s, _KD_Y) * (1.0 - _KD_ALPHA)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            used = (_kd_loss(s, _KD_Y, t, bug) - ce) / (_KD_ALPHA * _KD_T * _KD_T)
    return float(used / true_kl) < 0.5


# --------------------------------------------------------------------------------------------- case-12

class _MVSNet(nn.Module):
    """Multi-view depth: a pretrained image backbone, a feature shrinker and a depth head."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                      nn.Conv2d(16, 24, 3, stride=2, padding=1), nn.BatchNorm2d(24), nn.ReLU())
        self.feat_shrinker = nn.Conv2d(24, 8, 1)
        self.depth_head = nn.Sequential(nn.Conv2d(16, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 1, 1))

    def forward(self, ref: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        f_ref = self.feat_shrinker(self.backbone(ref))
        f_src = self.feat_shrinker(self.backbone(src))
        return self.depth_head(torch.cat([f_ref, f_src], dim=1)).squeeze(1)


_MVS_REF = torch.rand(2, 3, 16, 16, generator=_gen(121))
_MVS_SRC = torch.rand(2, 3, 16, 16, generator=_gen(122))
_MVS_DEPTH = torch.rand(2, 8, 8, generator=_gen(123)) * 3 + 0.5


def _c12_build(bug: bool) -> Case:
    """The paper freezes the backbone; the code only calls backbone.eval() and optimizes every parameter."""
    torch.manual_seed(0)
    model = _MVSNet().train()
    model.backbone.eval()  # "frozen"
    if bug:
        params = [{"params": model.parameters()}]
    else:
        params = [{"params": model.feat_shrinker.parameters()}, {"params": model.depth_head.parameters()}]
    opt = torch.optim.Adam(params, lr=1e-3)
    step = _sgd_step(model, opt, lambda: F.smooth_l1_loss(model(_MVS_REF, _MVS_SRC), _MVS_DEPTH))
    return model, step, _kw(optimizer=opt, inputs=(_MVS_REF, _MVS_SRC))


def _c12_proof(bug: bool) -> bool:
    """The backbone meant to stay frozen moves in a real step."""
    model, step, _ = _c12_build(bug)
    conv = cast(nn.Conv2d, cast(_MVSNet, model).backbone[0])
    before = conv.weight.detach().clone()
    step()
    return not torch.equal(before, conv.weight.detach())


# --------------------------------------------------------------------------------------------- case-13

_EOS = 1
_DOCS = [[[5, 6, 7, 8, _EOS], [9, 10, 11, _EOS]], [[12, 13, _EOS], [14, 15, 16, 17, 18, _EOS]]]


def _llama(seed: int = 0) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                      bos_token_id=2, eos_token_id=_EOS, pad_token_id=0)
    return LlamaForCausalLM(cfg)


def _packed_batch(docs: list[list[list[int]]], bug: bool) -> dict[str, Any]:
    """Documents concatenated into rows; the fix restarts position_ids at each document (flattening collator)."""
    ids = torch.tensor([[t for d in row for t in d] for row in docs])
    if bug:
        return {"input_ids": ids, "labels": ids.clone()}
    pos = torch.tensor([[i for d in row for i in range(len(d))] for row in docs])
    labels = ids.clone()
    labels[pos == 0] = -100  # a document's first token is not predicted from the one before
    return {"input_ids": ids, "position_ids": pos, "labels": labels}


def _c13_build(bug: bool) -> Case:
    """Packed causal-LM fine-tuning: documents share a row and attend across their boundaries."""
    model = _llama(seed=131).train()
    model.config.use_cache = False  # type: ignore[union-attr]  # as fine-tuning scripts set it
    batch = _packed_batch(_DOCS, bug)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-4)
    return model, _sgd_step(model, opt, lambda: model(**batch).loss), _kw(optimizer=opt, inputs=batch)


def _c13_proof(bug: bool) -> bool:
    """A document's logits change when the document packed before it in the row changes."""
    model, _, _ = _c13_build(bug)
    model.eval()
    other = [[[t + 20 for t in row[0][:-1]] + [_EOS], row[1]] for row in _DOCS]
    with torch.no_grad():
        a = model(**{k: v for k, v in _packed_batch(_DOCS, bug).items() if k != "labels"}).logits
        b = model(**{k: v for k, v in _packed_batch(other, bug).items() if k != "labels"}).logits
    second = torch.tensor([[len(row[0]) <= i for i in range(a.size(1))] for row in _DOCS])
    return not torch.allclose(a[second], b[second], atol=1e-5)


# --------------------------------------------------------------------------------------------- case-14

class _PositionEncodingSine(nn.Module):
    """2-D sinusoidal encoding of a feature map: channels cycle sin x, cos x, sin y, cos y."""

    pe: torch.Tensor

    def __init__(self, d_model: int, bug: bool, max_shape: tuple[int, int] = (16, 16)) -> None:
        super().__init__()
        pe = torch.zeros((d_model, *max_shape))
        y = torch.ones(max_shape).cumsum(0).unsqueeze(0)
        x = torch.ones(max_shape).cumsum(1).unsqueeze(0)
        steps = torch.arange(0, d_model // 2, 2).float()
        if bug:  # operator precedence: (-log(1e4) / d_model) // 2 == -1.0
            div_term = torch.exp(steps * (-math.log(10000.0) / d_model // 2))
        else:
            div_term = torch.exp(steps * (-math.log(10000.0) / (d_model // 2)))
        div_term = div_term[:, None, None]
        pe[0::4], pe[1::4] = torch.sin(x * div_term), torch.cos(x * div_term)
        pe[2::4], pe[3::4] = torch.sin(y * div_term), torch.cos(y * div_term)
        self.register_buffer("pe", pe.unsqueeze(0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.pe[:, :, :x.size(2), :x.size(3)]


class _CoarseMatcher(nn.Module):
    """LoFTR-style coarse matching: CNN features + position encoding, self/cross attention, dual softmax."""

    def __init__(self, bug: bool, d: int = 32) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(1, 16, 3, stride=2, padding=1), nn.ReLU(),
                                      nn.Conv2d(16, d, 3, stride=2, padding=1))
        self.pos_encoding = _PositionEncodingSine(d, bug)
        self.self_attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.cross_attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.temperature = 0.1

    def _feat(self, img: torch.Tensor) -> torch.Tensor:
        f = self.pos_encoding(self.backbone(img)).flatten(2).transpose(1, 2)
        return f + self.self_attn(f, f, f, need_weights=False)[0]

    def forward(self, img0: torch.Tensor, img1: torch.Tensor) -> torch.Tensor:
        f0, f1 = self._feat(img0), self._feat(img1)
        f0 = f0 + self.cross_attn(f0, f1, f1, need_weights=False)[0]
        f1 = f1 + self.cross_attn(f1, f0, f0, need_weights=False)[0]
        sim = torch.einsum("bnc,bmc->bnm", f0, f1) / (f0.size(-1) * self.temperature)
        return sim.softmax(1) * sim.softmax(2)  # confidence matrix


_IMG0 = torch.rand(2, 1, 32, 32, generator=_gen(141))
_IMG1 = torch.roll(_IMG0, shifts=4, dims=3)  # shifted by one coarse cell (stride 4)


def _gt_matches(h: int = 8, w: int = 8) -> torch.Tensor:
    """Coarse cell i of image 0 lands on cell i + 1 (same row) of image 1; the wrapped column has none."""
    gt = torch.zeros(h * w, h * w)
    for r in range(h):
        for c in range(w - 1):
            gt[r * w + c, r * w + c + 1] = 1.0
    return gt


def _c14_build(bug: bool) -> Case:
    """Coarse matcher whose sine position encoding has an operator-precedence error in its frequencies."""
    torch.manual_seed(0)
    model = _CoarseMatcher(bug).train()
    opt = torch.optim.AdamW(model.parameters(), lr=6e-3, weight_decay=0.1)
    gt = _gt_matches()

    def loss_fn() -> torch.Tensor:
        conf = model(_IMG0, _IMG1).clamp(1e-6, 1 - 1e-6)
        return -(gt * conf.log()).sum((1, 2)).mean() / gt.sum()

    return model, _sgd_step(model, opt, loss_fn), _kw(optimizer=opt, inputs=(_IMG0, _IMG1))


def _c14_proof(bug: bool) -> bool:
    """Most channels of the real encoding are (almost) constant over the feature map: they carry no position."""
    model = cast(_CoarseMatcher, _c14_build(bug)[0])
    pe = model.pos_encoding.pe[0, :, :8, :8].flatten(1)
    spread = pe.max(dim=1).values - pe.min(dim=1).values
    return float((spread < 0.05).float().mean()) > 0.5


# --------------------------------------------------------------------------------------------- case-15

class _LabelAttentionClassifier(nn.Module):
    """Token embeddings pooled per label by cross-attention (labels are the queries), one logit per label."""

    def __init__(self, bug: bool, vocab: int = 40, d: int = 16, classes: int = 4, heads: int = 2) -> None:
        super().__init__()
        self.bug, self.heads, self.classes = bug, heads, classes
        self.token_embed = nn.Embedding(vocab, d, padding_idx=0)
        self.label_embeds = nn.Embedding(classes, d)
        self.c_q, self.c_k, self.c_v = (nn.Linear(d, d, bias=False) for _ in range(3))
        self.c_proj = nn.Linear(d, d, bias=False)
        self.head = nn.Linear(d, 1)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        b, t = input_ids.shape
        tokens = self.token_embed(input_ids)
        labels = self.label_embeds.weight[None].expand(b, -1, -1)

        def split(x: torch.Tensor) -> torch.Tensor:
            return x.view(b, x.size(1), self.heads, -1).transpose(1, 2)

        q, k, v = split(self.c_q(labels)), split(self.c_k(tokens)), split(self.c_v(tokens))
        # scaled_dot_product_attention's boolean mask is True where attention is allowed
        keep = (attention_mask == 0) if self.bug else (attention_mask == 1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :])
        y = self.c_proj(y.transpose(1, 2).reshape(b, self.classes, -1))
        return self.head(y).squeeze(-1)  # (batch, classes)


def _text_batch(seed: int) -> dict[str, torch.Tensor]:
    """Texts tokenized and padded to max_length 10 (every text is shorter, so every row has padding)."""
    g = _gen(seed)
    lengths = [6, 4, 8, 5]
    ids = torch.zeros(4, 10, dtype=torch.long)
    for r, n in enumerate(lengths):
        ids[r, :n] = torch.randint(1, 40, (n,), generator=g)
    return {"input_ids": ids, "attention_mask": (ids != 0).long()}


_TXT_Y = torch.tensor([0, 1, 2, 3])


def _c15_build(bug: bool) -> Case:
    """Label-attention text classifier: the padding mask is inverted on its way to SDPA."""
    torch.manual_seed(0)
    model = _LabelAttentionClassifier(bug).train()
    batch = _text_batch(151)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    step = _sgd_step(model, opt, lambda: F.cross_entropy(model(**batch), _TXT_Y))
    return model, step, _kw(optimizer=opt, inputs=batch)


def _c15_proof(bug: bool) -> bool:
    """The logits do not change when the real tokens of the texts change: only padding is attended."""
    model, _, _ = _c15_build(bug)
    a, b = _text_batch(151), _text_batch(152)
    with torch.no_grad():
        return torch.allclose(model(**a), model(**b), atol=1e-6)


CASES: list[BlindCase] = [
    BlindCase("b4-case-01", "https://github.com/songyangco/GETNext/issues/2", "inputs vs model",
              "batch-first trajectories reach a sequence-first transformer: attention, the causal mask and the "
              "position encoding run over the batch", _c01_build, _c01_proof,
              known_miss="no invariant ties a sequence-first encoder's dimension order to the batch (batch_first=False fed (batch, seq, d))"),
    BlindCase("b4-case-02", "https://github.com/LianpoWang/SLIIF/issues/13", "optimizer wiring",
              "sub-networks kept in a Python list are not registered: the optimizer never updates them",
              _c02_build, _c02_proof),
    BlindCase("b4-case-03", "https://github.com/gao-hongnan/omniverse/issues/82", "lr schedule",
              "LambdaLR is given a function returning the learning rate, so the lr is max_lr times itself",
              _c03_build, _c03_proof),
    BlindCase("b4-case-04", "https://github.com/ludwig-ai/ludwig/pull/2100", "normalisation layers",
              "a TensorFlow-convention batch-norm momentum (0.95) makes the running statistics follow the last "
              "batch", _c04_build, _c04_proof),
    BlindCase("b4-case-05", "https://github.com/gabeur/mmt/issues/1", "normalisation layers",
              "F.normalize's default dim=1 normalises (batch, time, feature) experts across time, not features",
              _c05_build, _c05_proof,
              known_miss="no invariant checks which dimension F.normalize normalises against the features"),
    BlindCase("b4-case-06", "https://github.com/bytetriper/RAE/issues/67", "gradient accumulation",
              "zero_grad runs on every micro-batch, so each update holds only the last micro-batch's gradient",
              _c06_build, _c06_proof),
    BlindCase("b4-case-07", "https://github.com/huggingface/lerobot/pull/280", "optimizer param groups",
              "the backbone's param group is selected by a name prefix no parameter has: the backbone trains at "
              "the main lr", _c07_build, _c07_proof),
    BlindCase("b4-case-08", "https://github.com/sanchit-gandhi/seq2seq-speech/issues/23", "tokenization / labels",
              "do_lower_case=True on a lowercase CTC vocabulary maps every letter of the targets to <unk>",
              _c08_build, _c08_proof,
              known_miss="no invariant reads the CTC targets against the vocabulary (every letter mapped to <unk>)"),
    BlindCase("b4-case-09", "https://github.com/X-GenGroup/Flow-Factory/pull/186", "mixed precision",
              "one autocast context around several optimizer steps reuses stale cached bf16 weight casts",
              _c09_build, _c09_proof,
              known_miss="no invariant sees forwards that reuse one autocast region's cached weight casts across optimizer steps"),
    BlindCase("b4-case-10", "https://github.com/bghira/SimpleTuner/issues/766", "LoRA/PEFT",
              "LoRA target names that match no module are skipped silently: the feed-forward layers get no "
              "adapter", _c10_build, _c10_proof,
              # the stand-in model's text stream ends unused (in Flux it feeds the next block), so the twin's
              # adapters on to_add_out / ff_context really get no gradient: true of this model, not of Flux
              known_alarm=('GRAD-001', 'LORA-006')),
    BlindCase("b4-case-11", "https://github.com/haitongli/knowledge-distillation-pytorch/issues/48", "losses",
              "nn.KLDivLoss() at reduction='mean' divides the distillation term by the number of classes too",
              _c11_build, _c11_proof),
    BlindCase("b4-case-12", "https://github.com/alexrich021/3dvnet/issues/11", "freezing",
              "the backbone is 'frozen' with .eval() only; its weights are in the optimizer and keep training",
              _c12_build, _c12_proof),
    BlindCase("b4-case-13", "https://github.com/huggingface/nanoVLM/pull/204", "data / masks",
              "packed documents keep running positions and full causal attention: each attends to the ones before "
              "it", _c13_build, _c13_proof,
              known_miss="no invariant sees packed documents attending to each other (one causal mask per row)"),
    BlindCase("b4-case-14", "https://github.com/zju3dv/LoFTR/issues/41", "embeddings",
              "an operator-precedence error makes the sine position encoding's frequencies decay e-fold per "
              "channel pair", _c14_build, _c14_proof,
              known_miss="no invariant judges a hand-written position encoding's frequencies"),
    BlindCase("b4-case-15", "https://github.com/InseeFrLab/torchTextClassifiers/pull/92", "masks",
              "the padding mask is inverted for scaled_dot_product_attention: labels attend to padding only",
              _c15_build, _c15_proof),
]
