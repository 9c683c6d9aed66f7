"""Blind batch 5: silent training bugs from public GitHub threads, each with its fixed twin.

Collected by someone who does not write the audit's checks; see docs/blind-batch5.md. Every case builds the user's
setup on a tiny real model (transformers Llama, BERT and GPT-2 from tiny configs in code, a real Llama tokenizer over
a vocabulary built in code, real optimizers and schedulers; nothing is downloaded) and proves the bug without the
audit on real runs.
"""

from __future__ import annotations

import inspect
import math
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


_sgd_step = sgd_step  # the batches' name for the shared plain training step


def _llama_config(**kw: Any) -> Any:
    from transformers import LlamaConfig

    base: dict[str, Any] = dict(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                                pad_token_id=0, bos_token_id=1, eos_token_id=2)
    base.update(kw)
    return LlamaConfig(**base)


# --------------------------------------------------------------------------------------------- case-01

class _FramePhonemeNet(nn.Module):
    """Frame-level phoneme recogniser: mel frames through a GRU to per-frame phoneme logits (blank = 0)."""

    def __init__(self, n_mels: int = 16, hidden: int = 32, n_ph: int = 12) -> None:
        super().__init__()
        self.inp = nn.Linear(n_mels, hidden)
        self.gru = nn.GRU(hidden, hidden, batch_first=True)
        self.ph_frame_logits = nn.Linear(hidden, n_ph)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        h, _ = self.gru(torch.relu(self.inp(mel)))
        return self.ph_frame_logits(h)  # (B, T, C)


_MEL = torch.randn(3, 20, 16, generator=_gen(11))
_PH = torch.randint(1, 12, (3, 6), generator=_gen(12))
_MEL_LENS = torch.tensor([20, 18, 16])
_PH_LENS = torch.tensor([6, 5, 4])


def _c01_ctc(logits: torch.Tensor, bug: bool) -> torch.Tensor:
    x = logits if bug else logits.log_softmax(-1)
    return F.ctc_loss(x.transpose(0, 1), _PH, _MEL_LENS, _PH_LENS, blank=0, zero_infinity=True)


def _c01_build(bug: bool) -> Case:
    """Phoneme CTC head trained on the frame logits passed straight to F.ctc_loss."""
    torch.manual_seed(0)
    model = _FramePhonemeNet().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = _sgd_step(model, opt, lambda: _c01_ctc(model(_MEL), bug))
    return model, step, _kw(optimizer=opt, inputs=_MEL)


def _c01_proof(bug: bool) -> bool:
    """Adding one constant to every logit leaves the softmax unchanged, yet the loss the run uses moves."""
    model, _, _ = _c01_build(bug)
    with torch.no_grad():
        logits = model(_MEL)
        return abs(float(_c01_ctc(logits, bug)) - float(_c01_ctc(logits + 2.0, bug))) > 1e-3


# --------------------------------------------------------------------------------------------- case-02

class _PointNetCls(nn.Module):
    """PointNet classifier: a shared per-point MLP, max pooling over points, an MLP head, log-softmax."""

    def __init__(self, bug: bool, k: int = 4) -> None:
        super().__init__()
        self.bug = bug
        self.conv1, self.conv2 = nn.Conv1d(3, 16, 1), nn.Conv1d(16, 32, 1)
        self.bn1, self.bn2 = nn.BatchNorm1d(16), nn.BatchNorm1d(32)
        self.fc1, self.fc2 = nn.Linear(32, 16), nn.Linear(16, k)

    def forward(self, points: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn2(self.conv2(F.relu(self.bn1(self.conv1(points))))))
        x = torch.max(x, 2)[0]
        x = self.fc2(F.relu(self.fc1(x)))
        return F.log_softmax(x, dim=0 if self.bug else 1)


_PTS = torch.randn(8, 3, 64, generator=_gen(21))
_PTS_Y = torch.randint(0, 4, (8,), generator=_gen(22))


def _c02_build(bug: bool) -> Case:
    """PointNet classification trained with nll_loss on a log_softmax taken over dim=0 (the batch)."""
    torch.manual_seed(0)
    model = _PointNetCls(bug).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.999))
    step = _sgd_step(model, opt, lambda: F.nll_loss(model(_PTS), _PTS_Y))
    return model, step, _kw(optimizer=opt, inputs=(_PTS, _PTS_Y))


def _c02_proof(bug: bool) -> bool:
    """The class probabilities the loss reads do not sum to one per point cloud."""
    model, _, _ = _c02_build(bug)
    with torch.no_grad():
        sums = model(_PTS).exp().sum(dim=1)
    return not torch.allclose(sums, torch.ones_like(sums), atol=1e-4)


# --------------------------------------------------------------------------------------------- case-03

class _AttnClassifier(nn.Module):
    """Binary text classifier: embeddings, a BiLSTM, additive attention over tokens, a linear decoder."""

    def __init__(self, vocab: int = 50, d: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d, padding_idx=0)
        self.lstm = nn.LSTM(d, d, batch_first=True, bidirectional=True)
        self.attn = nn.Linear(2 * d, 1)
        self.dec = nn.Linear(2 * d, 1)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, _ = self.lstm(self.emb(ids))
        scores = self.attn(torch.tanh(h)).squeeze(-1).masked_fill(ids == 0, -1e9)
        weights = torch.softmax(scores, dim=-1)
        return self.dec((weights.unsqueeze(-1) * h).sum(1)).squeeze(-1), weights


_ADV_IDS = torch.randint(1, 50, (6, 10), generator=_gen(31))
_BASE_ATTN = torch.softmax(torch.randn(6, 10, generator=_gen(32)) * 2, dim=-1)  # the trained model's attention
_BASE_PRED = torch.rand(6, generator=_gen(33))


def _c03_kl(adv_attn: torch.Tensor, bug: bool) -> torch.Tensor:
    kl = nn.KLDivLoss(reduction="batchmean")
    if bug:  # arguments swapped: (target, input)
        return kl(_BASE_ATTN.log(), adv_attn)
    return kl(adv_attn.clamp_min(1e-10).log(), _BASE_ATTN)


def _c03_build(bug: bool) -> Case:
    """Adversarial attention: the new model stays close to the base prediction while its attention departs."""
    torch.manual_seed(0)
    model = _AttnClassifier().train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=1e-5)

    def loss_fn() -> torch.Tensor:
        pred, adv_attn = model(_ADV_IDS)
        tvd = (torch.sigmoid(pred) - _BASE_PRED).abs().mean()
        return tvd - 0.5 * _c03_kl(adv_attn, bug)

    return model, _sgd_step(model, opt, loss_fn), _kw(optimizer=opt, inputs=_ADV_IDS)


def _c03_proof(bug: bool) -> bool:
    """The divergence the run maximises is KL(adversarial || base), not KL(base || adversarial)."""
    model, _, _ = _c03_build(bug)
    with torch.no_grad():
        _, q = model(_ADV_IDS)
        p = _BASE_ATTN
        kl_q_p = (q * (q.log() - p.log())).sum(-1).mean()
        used = _c03_kl(q, bug)
    return bool(torch.isclose(used, kl_q_p, rtol=1e-4))


# --------------------------------------------------------------------------------------------- case-04

class _GraphRNN(nn.Module):
    """Recurrent graph autoencoder: per-snapshot node features through a GRU, inner-product edge decoder."""

    def __init__(self, d_in: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.enc = nn.Linear(d_in, hidden)
        self.rnn = nn.GRU(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (T, N, d_in)
        h, _ = self.rnn(torch.relu(self.enc(x)))
        return torch.einsum("tnd,tmd->tnm", h, h)  # edge logits per snapshot


_SNAPS = torch.randn(4, 10, 8, generator=_gen(41))
_ADJ = (torch.rand(4, 10, 10, generator=_gen(42)) > 0.7).float()
_CLIP = 10.0


def _c04_build(bug: bool) -> Case:
    """Dynamic-graph training loop that calls clip_grad_norm_ after opt.step()."""
    torch.manual_seed(0)
    model = _GraphRNN().train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(model(_SNAPS), _ADJ, reduction="sum")
        loss.backward()
        if not bug:
            nn.utils.clip_grad_norm_(model.parameters(), _CLIP)
        opt.step()
        if bug:
            nn.utils.clip_grad_norm_(model.parameters(), _CLIP)
        return loss

    return model, step, _kw(optimizer=opt, inputs=_SNAPS)


def _c04_proof(bug: bool) -> bool:
    """The gradient the optimizer consumes has a norm above the clipping threshold."""
    model, step, kw = _c04_build(bug)
    seen: list[float] = []

    def record(_opt: Any, _a: Any, _k: Any) -> None:
        seen.append(float(torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None]).norm()))

    handle = kw["optimizer"].register_step_pre_hook(record)
    try:
        step()
    finally:
        handle.remove()
    return seen[0] > _CLIP * 1.01


# --------------------------------------------------------------------------------------------- case-05

_UNK, _PAD, _SOS, _EOS = 0, 1, 2, 3  # the vocabulary's special ids: <unk>=0, <pad>=1


class _TokenTransformer(nn.Module):
    """Transformer encoder LM head whose token embedding is built with ``padding_idx``."""

    def __init__(self, padding_idx: int, vocab: int = 30, d: int = 16) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, d, padding_idx=padding_idx)
        self.pos_emb = nn.Embedding(32, d)
        layer = nn.TransformerEncoderLayer(d, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.out = nn.Linear(d, vocab)

    def forward(self, src: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(src.size(1))
        x = self.tok_emb(src) + self.pos_emb(pos)
        return self.out(self.encoder(x, src_key_padding_mask=src == _PAD))


def _c05_batch() -> tuple[torch.Tensor, torch.Tensor]:
    src = torch.randint(4, 30, (4, 9), generator=_gen(51))
    src[:, 0] = _SOS
    src[0, 3] = src[2, 5] = src[3, 2] = _UNK  # out-of-vocabulary words
    src[1, 6:] = _PAD
    src[3, 7:] = _PAD
    tgt = src.roll(-1, dims=1)
    tgt[:, -1] = _PAD
    return src, tgt


_C05_SRC, _C05_TGT = _c05_batch()


def _c05_build(bug: bool) -> Case:
    """Translation-style encoder: the embedding's padding_idx is 0 while the vocabulary pads with 1."""
    torch.manual_seed(0)
    model = _TokenTransformer(padding_idx=0 if bug else _PAD).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.98), eps=5e-9, weight_decay=5e-4)
    vocab = model.out.out_features

    def loss_fn() -> torch.Tensor:
        return F.cross_entropy(model(_C05_SRC).reshape(-1, vocab), _C05_TGT.reshape(-1), ignore_index=_PAD)

    return model, _sgd_step(model, opt, loss_fn), _kw(optimizer=opt, inputs=_C05_SRC)


def _c05_proof(bug: bool) -> bool:
    """The <unk> token occurs in the batch, yet a real step leaves its embedding row at zero gradient."""
    model, step, _ = _c05_build(bug)
    step()
    grad = cast(_TokenTransformer, model).tok_emb.weight.grad
    assert grad is not None
    return bool(grad[_UNK].abs().sum() == 0)


# --------------------------------------------------------------------------------------------- case-06

class _Bleep(nn.Module):
    """Bi-modal contrastive model: image features and spot expression projected to one embedding space."""

    def __init__(self, d_img: int = 24, d_spot: int = 30, d: int = 16) -> None:
        super().__init__()
        self.image_projection = nn.Sequential(nn.Linear(d_img, d), nn.GELU(), nn.Linear(d, d), nn.LayerNorm(d))
        self.spot_projection = nn.Sequential(nn.Linear(d_spot, d), nn.GELU(), nn.Linear(d, d), nn.LayerNorm(d))

    def forward(self, image: torch.Tensor, spot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.image_projection(image), self.spot_projection(spot)


_TEMPERATURE = 0.5
_BLEEP_IMG = torch.randn(8, 24, generator=_gen(61))
_BLEEP_SPOT = torch.randn(8, 30, generator=_gen(62))


def _c06_loss(img: torch.Tensor, spot: torch.Tensor, bug: bool) -> tuple[torch.Tensor, torch.Tensor]:
    logits = spot @ img.T / _TEMPERATURE
    sim = (img @ img.T + spot @ spot.T) / 2
    targets = F.softmax(sim * _TEMPERATURE if bug else sim / _TEMPERATURE, dim=-1)
    spots_loss = (-targets * F.log_softmax(logits, dim=-1)).sum(1)
    images_loss = (-targets.T * F.log_softmax(logits.T, dim=-1)).sum(1)
    return ((images_loss + spots_loss) / 2.0).mean(), targets


def _c06_build(bug: bool) -> Case:
    """BLEEP-style contrastive training with soft targets, at temperature 0.5."""
    torch.manual_seed(0)
    model = _Bleep().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-3)

    def loss_fn() -> torch.Tensor:
        img, spot = model(_BLEEP_IMG, _BLEEP_SPOT)
        return _c06_loss(img, spot, bug)[0]

    return model, _sgd_step(model, opt, loss_fn), _kw(optimizer=opt, inputs=(_BLEEP_IMG, _BLEEP_SPOT))


def _c06_proof(bug: bool) -> bool:
    """The soft targets the loss uses are not softmax(similarity / temperature), the logits' own scale."""
    model, _, _ = _c06_build(bug)
    with torch.no_grad():
        img, spot = model(_BLEEP_IMG, _BLEEP_SPOT)
        _, used = _c06_loss(img, spot, bug)
        intended = F.softmax((img @ img.T + spot @ spot.T) / 2 / _TEMPERATURE, dim=-1)
    return not torch.allclose(used, intended, atol=1e-5)


# --------------------------------------------------------------------------------------------- case-07

class _BaselineBlock(nn.Module):
    """Pre-norm transformer block whose layer norm takes ``normalized_shape`` from the input."""

    def __init__(self, d: int, bug: bool) -> None:
        super().__init__()
        self.bug = bug
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, normalized_shape=x.shape[1:] if self.bug else x.shape[-1:])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm(x))


class _BaselineTransformer(nn.Module):
    def __init__(self, bug: bool, d_in: int = 6, d: int = 16) -> None:
        super().__init__()
        self.linear_in = nn.Linear(d_in, d)
        self.blocks = nn.ModuleList([_BaselineBlock(d, bug) for _ in range(2)])
        self.linear_out = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear_in(x)
        for block in self.blocks:
            h = block(h)
        return self.linear_out(h)


_ITEMS = torch.randn(4, 12, 6, generator=_gen(71)) * torch.linspace(0.2, 3.0, 12)[None, :, None]
_ITEMS_Y = torch.randn(4, 12, 1, generator=_gen(72))


def _c07_build(bug: bool) -> Case:
    """Baseline transformer regressing per-item targets (n-body style), with the items' layer norm."""
    torch.manual_seed(0)
    model = _BaselineTransformer(bug).train()
    opt = torch.optim.Adam(model.parameters(), lr=3e-4)
    step = _sgd_step(model, opt, lambda: F.mse_loss(model(_ITEMS), _ITEMS_Y))
    return model, step, _kw(optimizer=opt, inputs=_ITEMS)


def _c07_proof(bug: bool) -> bool:
    """In the real forward, the first block's normalised items do not each have unit variance over channels."""
    model, _, _ = _c07_build(bug)
    block = cast(_BaselineBlock, cast(_BaselineTransformer, model).blocks[0])
    with torch.no_grad():
        h = block.norm(cast(_BaselineTransformer, model).linear_in(_ITEMS))
    std = h.std(dim=-1, unbiased=False)
    return not torch.allclose(std, torch.ones_like(std), atol=0.05)


# --------------------------------------------------------------------------------------------- case-08

_WORDS = "### instruction : response give a word for small cat dog big kitten puppy the is".split()


def _llama_tokenizer(add_eos_token: bool) -> Any:
    """A real Llama tokenizer over a small word-level vocabulary built in code."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for w in _WORDS:
        vocab.setdefault(w, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = LlamaTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                             add_bos_token=True, add_eos_token=add_eos_token)
    tok.pad_token = tok.unk_token
    tok.padding_side = "right"
    return tok


_SFT_TEXTS = ["### instruction : give a word for small cat ### response : kitten",
              "### instruction : give a word for small dog ### response : puppy"]


def _c08_batch(bug: bool) -> tuple[dict[str, torch.Tensor], Any]:
    tok = _llama_tokenizer(add_eos_token=not bug)
    enc = tok(_SFT_TEXTS, padding=True, return_tensors="pt")
    labels = enc.input_ids.masked_fill(enc.attention_mask == 0, -100)
    return {"input_ids": enc.input_ids, "attention_mask": enc.attention_mask, "labels": labels}, tok


def _c08_build(bug: bool) -> Case:
    """Llama SFT on instruction/response texts tokenized by a tokenizer that adds no EOS."""
    from transformers import LlamaForCausalLM

    batch, tok = _c08_batch(bug)
    torch.manual_seed(0)
    model = LlamaForCausalLM(_llama_config(vocab_size=len(tok), pad_token_id=tok.pad_token_id)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1.41e-5)
    return model, _sgd_step(model, opt, lambda: model(**batch).loss), _kw(optimizer=opt, inputs=batch)


def _c08_proof(bug: bool) -> bool:
    """No supervised position of the batch holds the EOS id: the model is never taught to stop."""
    batch, tok = _c08_batch(bug)
    return not bool((batch["labels"] == tok.eos_token_id).any())


# --------------------------------------------------------------------------------------------- case-09

_C09_LR, _C09_STEPS, _C09_WARMUP = 2e-5, 100, 10
_C09_IDS = torch.randint(3, 40, (2, 12), generator=_gen(91))


def _c09_warmup(bug: bool, warmup_steps: int = _C09_WARMUP, warmup_ratio: float = 0.0) -> int:
    """The finetune script's warmup resolution (warmup_ratio defaults to 0.0)."""
    if (warmup_ratio >= 0) if bug else (warmup_ratio > 0):
        return int(_C09_STEPS * warmup_ratio)
    return warmup_steps


def _c09_build(bug: bool) -> Case:
    """Llama instruction tuning with --warmup_steps 10 and a linear schedule."""
    from transformers import LlamaForCausalLM, get_scheduler

    torch.manual_seed(0)
    model = LlamaForCausalLM(_llama_config()).train()
    opt = torch.optim.AdamW(model.parameters(), lr=_C09_LR, weight_decay=0.0)
    sched = get_scheduler("linear", optimizer=opt, num_warmup_steps=_c09_warmup(bug),
                          num_training_steps=_C09_STEPS)
    batch = {"input_ids": _C09_IDS, "labels": _C09_IDS}

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        sched.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=batch, lr_scheduler=sched, total_steps=_C09_STEPS)


def _c09_proof(bug: bool) -> bool:
    """The real scheduler applies the peak learning rate on the very first update: no warmup."""
    _, _, kw = _c09_build(bug)
    return math.isclose(kw["optimizer"].param_groups[0]["lr"], _C09_LR)


# --------------------------------------------------------------------------------------------- case-10

_C10_IDS = torch.randint(3, 40, (4, 10), generator=_gen(101))
_C10_TARGETS = [0.35, 1.8, 2.6, 0.9]  # similarity scores annotated as floats


def _c10_label_tensor(labels: list[float], bug: bool) -> torch.Tensor:
    """The dataset conversion: try long first (for classification ids), fall back to float."""
    if bug:
        try:
            return torch.tensor(labels, dtype=torch.long)
        except (TypeError, ValueError):
            pass
    return torch.tensor(labels, dtype=torch.float32)


def _c10_build(bug: bool) -> Case:
    """BERT regression head fine-tuned on float targets that the dataset turned into longs."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    settings: dict[str, Any] = dict(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                    intermediate_size=64, max_position_embeddings=32, pad_token_id=0,
                                    num_labels=1, problem_type="regression")
    cfg = BertConfig(**settings)
    model = BertForSequenceClassification(cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-5)
    batch = {"input_ids": _C10_IDS, "labels": _c10_label_tensor(_C10_TARGETS, bug).float()}
    return model, _sgd_step(model, opt, lambda: model(**batch).loss), _kw(optimizer=opt, inputs=batch)


def _c10_proof(bug: bool) -> bool:
    """The regression targets reaching the loss are not the annotated scores."""
    _, _, kw = _c10_build(bug)
    return not torch.allclose(kw["inputs"]["labels"], torch.tensor(_C10_TARGETS))


# --------------------------------------------------------------------------------------------- case-11

class _BF16Compute(nn.Module):
    """fp32 master weights, bf16 compute: each forward runs on bf16 casts of the parameters (FSDP2's policy)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        params = {n: p.to(torch.bfloat16) for n, p in self.inner.named_parameters()}
        out = torch.func.functional_call(self.inner, params, (input_ids,), {"use_cache": False})
        return cast(torch.Tensor, out.logits)


_C11_IDS = torch.randint(2, 500, (4, 24), generator=_gen(111))


def _c11_loss(logits: torch.Tensor, ids: torch.Tensor, bug: bool) -> torch.Tensor:
    shift_logits, shift_labels = logits[:, :-1], ids[:, 1:]
    flat = shift_logits.reshape(-1, shift_logits.size(-1))
    return F.cross_entropy(flat if bug else flat.float(), shift_labels.reshape(-1))


def _c11_build(bug: bool) -> Case:
    """GPT-2 pretraining under a bf16 parameter-cast policy: causal-LM cross entropy on the bf16 logits."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=512, n_positions=32, bos_token_id=1,
                     eos_token_id=1, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = _BF16Compute(GPT2LMHeadModel(cfg)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    step = _sgd_step(model, opt, lambda: _c11_loss(model(_C11_IDS), _C11_IDS, bug))
    return model, step, _kw(optimizer=opt, inputs=_C11_IDS)


def _c11_proof(bug: bool) -> bool:
    """The loss the run backpropagates differs from the float32 cross entropy of the very same logits."""
    model, _, _ = _c11_build(bug)
    with torch.no_grad():
        logits = model(_C11_IDS)
        used = _c11_loss(logits, _C11_IDS, bug)
        exact = _c11_loss(logits, _C11_IDS, bug=False)
    return used.dtype != torch.float32 and abs(float(used) - float(exact)) > 1e-4


# --------------------------------------------------------------------------------------------- case-12

class _BiSeNetLike(nn.Module):
    """Real-time segmentation: a context-path backbone (lr) and spatial path + heads (10x lr)."""

    def __init__(self, classes: int = 5) -> None:
        super().__init__()
        self.context_path = nn.Sequential(nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                          nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.spatial_path = nn.Sequential(nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.head = nn.Conv2d(32, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        feat = torch.cat([self.context_path(x), self.spatial_path(x)], dim=1)
        return F.interpolate(self.head(feat), size=x.shape[-2:], mode="bilinear", align_corners=False)


def _group_weight(module: nn.Module, lr: float) -> list[dict[str, Any]]:
    """Decay on conv weights, none on norms and biases (TorchSeg's group_weight)."""
    decay = [p for n, p in module.named_parameters() if n.endswith("weight") and p.dim() > 1]
    no_decay = [p for n, p in module.named_parameters() if not (n.endswith("weight") and p.dim() > 1)]
    return [{"params": decay, "lr": lr}, {"params": no_decay, "weight_decay": 0.0, "lr": lr}]


_C12_LR, _C12_NITERS = 1e-2, 200
_C12_IMG = torch.rand(2, 3, 16, 16, generator=_gen(121))
_C12_SEG = torch.randint(0, 5, (2, 16, 16), generator=_gen(122))


def _c12_build(bug: bool) -> Case:
    """BiSeNet training: a poly lr set by hand on each param group after every step."""
    torch.manual_seed(0)
    model = _BiSeNetLike().train()
    groups = _group_weight(model.context_path, _C12_LR)
    heads = nn.ModuleList([model.spatial_path, model.head])
    groups += _group_weight(heads, _C12_LR * 10)
    opt = torch.optim.SGD(groups, lr=_C12_LR, momentum=0.9, weight_decay=5e-4)
    it = [0]

    def step() -> torch.Tensor:
        loss = F.cross_entropy(model(_C12_IMG), _C12_SEG, ignore_index=255)
        opt.zero_grad()
        loss.backward()
        opt.step()
        it[0] += 1
        lr = _C12_LR * (1 - it[0] / _C12_NITERS) ** 0.9
        for i in range(2):
            opt.param_groups[0 if bug else i]["lr"] = lr
        for i in range(2, len(opt.param_groups)):
            opt.param_groups[i]["lr"] = lr * 10
        return loss

    return model, step, _kw(optimizer=opt, inputs=(_C12_IMG, _C12_SEG), total_steps=_C12_NITERS)


def _c12_proof(bug: bool) -> bool:
    """After real steps, the backbone's norm/bias group still holds the initial lr: it never decays."""
    _, step, kw = _c12_build(bug)
    for _ in range(5):
        step()
    groups = kw["optimizer"].param_groups
    return not math.isclose(groups[0]["lr"], groups[1]["lr"])


# --------------------------------------------------------------------------------------------- case-13

class _SegNet(nn.Module):
    """Semantic segmentation: a small conv backbone with batch norm and a 1x1 classifier."""

    def __init__(self, classes: int = 4) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                      nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.cls = nn.Conv2d(16, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.cls(self.backbone(x))


_IMAGENET_MEAN = torch.tensor([0.485, 0.456, 0.406])
_IMAGENET_STD = torch.tensor([0.229, 0.224, 0.225])


def _photos(seed: int, n: int = 2, hw: int = 16) -> torch.Tensor:
    """uint8 (N, H, W, 3) images with ImageNet-like channel statistics."""
    x = _IMAGENET_MEAN + _IMAGENET_STD * torch.randn(n, hw, hw, 3, generator=_gen(seed))
    return (x.clamp(0, 1) * 255).round().to(torch.uint8)


_C13_RAW = _photos(131)
_C13_SEG = torch.randint(0, 4, (2, 16, 16), generator=_gen(132))


def _c13_images(bug: bool) -> torch.Tensor:
    """The dataset's normalisation: image / 255, minus MEAN, divided by MEAN (bug) or STD."""
    image = _C13_RAW.float() / 255.0
    image = (image - _IMAGENET_MEAN) / (_IMAGENET_MEAN if bug else _IMAGENET_STD)
    return image.permute(0, 3, 1, 2).contiguous()


def _c13_build(bug: bool) -> Case:
    """EMANet-style segmentation fed images normalised with (image - MEAN) / MEAN."""
    torch.manual_seed(0)
    model = _SegNet().train()
    opt = torch.optim.SGD(model.parameters(), lr=9e-3, momentum=0.9, weight_decay=1e-4)
    images = _c13_images(bug)
    step = _sgd_step(model, opt, lambda: F.cross_entropy(model(images), _C13_SEG, ignore_index=255))
    return model, step, _kw(optimizer=opt, inputs=(images, _C13_SEG))


def _c13_proof(bug: bool) -> bool:
    """The normalised batch the model trains on does not have unit spread per channel."""
    _, _, kw = _c13_build(bug)
    images = kw["inputs"][0]
    std = images.transpose(0, 1).reshape(3, -1).std(dim=1)
    return bool((std - 1).abs().max() > 0.3)


# --------------------------------------------------------------------------------------------- case-14

class _KeypointDataset:
    """Pose dataset whose ``color_normalize`` subtracts the pixel means in 0..1 units."""

    def __init__(self, bug: bool, images: torch.Tensor) -> None:
        self.bug = bug
        self.images = images  # (N, 3, H, W) uint8
        self.pixel_means = torch.tensor([122.7717, 115.9465, 102.9801])  # BGR means, 0..255

    def color_normalize(self, x: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
        if self.bug:
            mean /= 255  # in place: the dataset's own pixel_means shrink on every call
            normalized_mean = mean
        else:
            normalized_mean = mean / 255
        for t, m in zip(x, normalized_mean):
            t.sub_(m)
        return x

    def __getitem__(self, i: int) -> torch.Tensor:
        img = self.images[i].float() / 255
        return self.color_normalize(img, self.pixel_means)


class _HeatmapNet(nn.Module):
    """Keypoint heatmap regressor: conv backbone with batch norm and a heatmap head."""

    def __init__(self, joints: int = 3) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                 nn.Conv2d(16, joints, 3, padding=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


_C14_RAW = _photos(141, n=4).permute(0, 3, 1, 2).contiguous()
_C14_HEAT = torch.rand(4, 3, 16, 16, generator=_gen(142))


def _c14_batch(bug: bool) -> torch.Tensor:
    ds = _KeypointDataset(bug, _C14_RAW)
    return torch.stack([ds[i] for i in range(len(_C14_RAW))])


def _c14_build(bug: bool) -> Case:
    """CPN keypoint training on a batch collated from the dataset's __getitem__."""
    torch.manual_seed(0)
    model = _HeatmapNet().train()
    opt = torch.optim.Adam(model.parameters(), lr=5e-4, weight_decay=1e-5)
    images = _c14_batch(bug)
    step = _sgd_step(model, opt, lambda: F.mse_loss(model(images), _C14_HEAT))
    return model, step, _kw(optimizer=opt, inputs=images)


def _c14_proof(bug: bool) -> bool:
    """Later samples of the same batch are not mean-subtracted: their mean is far from the first's."""
    images = _c14_batch(bug)
    means = images.mean(dim=(1, 2, 3))
    return float(means[1:].max() - means[0]) > 0.2


# --------------------------------------------------------------------------------------------- case-15

def _resize_to_float(image: torch.Tensor, hw: int) -> torch.Tensor:
    """skimage.transform.resize semantics for uint8 input: converts to float in [0, 1], then resizes."""
    x = image.permute(2, 0, 1)[None].float() / 255.0
    return F.interpolate(x, size=(hw, hw), mode="bilinear", align_corners=False)[0].permute(1, 2, 0)


_C15_RAW = _photos(151, hw=20)
_C15_MASK = torch.randint(0, 2, (2, 16, 16), generator=_gen(152)).float()


def _c15_images(bug: bool) -> torch.Tensor:
    """The train transforms: resize (already [0, 1]) and then the dataset's extra / 255 (bug), then normalise."""
    out = []
    for img in _C15_RAW:
        image = _resize_to_float(img, 16)
        if bug:
            image = image / 255.0
        image = (image - _IMAGENET_MEAN) / _IMAGENET_STD
        out.append(image.permute(2, 0, 1))
    return torch.stack(out)


class _MaskHead(nn.Module):
    """Building-mask segmentation: conv backbone with batch norm, a one-channel mask logit."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(),
                                 nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(1)


def _c15_build(bug: bool) -> Case:
    """Polygon/mask segmentation trained on images rescaled to [0, 1] twice."""
    torch.manual_seed(0)
    model = _MaskHead().train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, weight_decay=1e-4)
    images = _c15_images(bug)
    step = _sgd_step(model, opt, lambda: F.binary_cross_entropy_with_logits(model(images), _C15_MASK))
    return model, step, _kw(optimizer=opt, inputs=(images, _C15_MASK))


def _c15_proof(bug: bool) -> bool:
    """Within each normalised image the pixels barely vary: the photo's content is nearly gone."""
    images = _c15_images(bug)
    return float(images.flatten(2).std(dim=2).max()) < 0.1


CASES: list[BlindCase] = [
    BlindCase("b5-case-01", "https://github.com/gwx314/STARS/issues/9", "losses",
              "raw logits are passed to F.ctc_loss, which expects log-probabilities", _c01_build, _c01_proof),
    BlindCase("b5-case-02", "https://github.com/fxia22/pointnet.pytorch/issues/27", "losses",
              "log_softmax over dim=0 normalises across the batch, not the classes", _c02_build, _c02_proof),
    BlindCase("b5-case-03", "https://github.com/sarahwie/attention/issues/6", "losses",
              "KLDivLoss arguments swapped: the run optimises KL(adversarial || base)", _c03_build, _c03_proof),
    BlindCase("b5-case-04", "https://github.com/VGraphRNN/VGRNN/issues/4", "gradient clipping",
              "clip_grad_norm_ runs after optimizer.step(): updates use unclipped gradients", _c04_build,
              _c04_proof),
    BlindCase("b5-case-05", "https://github.com/hyunwoongko/transformer/pull/2", "embeddings",
              "padding_idx=0 while the vocabulary pads with 1: the <unk> embedding never trains",
              _c05_build, _c05_proof,
              # the stand-in trains an unmasked encoder on next-token targets (tgt = src rolled by one), so both
              # sides really read the token they predict: a true finding about the stand-in, written down
              known_alarm=("INPUT-010",)),
    BlindCase("b5-case-06", "https://github.com/bowang-lab/BLEEP/issues/5", "contrastive",
              "soft targets multiply by the temperature while the logits divide by it", _c06_build, _c06_proof,
              known_miss="held-out batch 5, measured once: no invariant of the audit covers it"),
    BlindCase("b5-case-07", "https://github.com/Qualcomm-AI-research/geometric-algebra-transformer/pull/8",
              "normalisation layers", "layer_norm normalises over items and channels together, not per item",
              _c07_build, _c07_proof,
              known_miss="held-out batch 5, measured once: no invariant of the audit covers it"),
    BlindCase("b5-case-08", "https://github.com/huggingface/trl/issues/734", "tokenization / labels",
              "the Llama tokenizer adds no EOS: the fine-tuned model is never taught to stop", _c08_build,
              _c08_proof,
              known_miss="held-out batch 5, measured once: no invariant of the audit covers it"),
    BlindCase("b5-case-09", "https://github.com/allenai/open-instruct/pull/579", "lr schedule",
              "the default warmup_ratio=0 overrides --warmup_steps: the run has no warmup", _c09_build,
              _c09_proof,
              known_miss="held-out batch 5, measured once: no invariant of the audit covers it"),
    BlindCase("b5-case-10", "https://github.com/deepset-ai/FARM/issues/395", "regression / labels",
              "float regression targets are converted to longs: the model trains on truncated scores",
              _c10_build, _c10_proof,
              known_miss="held-out batch 5, measured once: no invariant of the audit covers it"),
    BlindCase("b5-case-11", "https://github.com/Modalities/modalities/pull/464", "mixed precision",
              "cross entropy on bf16 logits: the loss and its stored tensors are quantised to bf16",
              _c11_build, _c11_proof),
    BlindCase("b5-case-12", "https://github.com/yu-changqian/TorchSeg/issues/84", "optimizer param groups",
              "the poly lr is written to param_groups[0] twice: group 1 keeps the initial lr", _c12_build,
              _c12_proof,
              known_miss="held-out batch 5, measured once: no invariant of the audit covers it"),
    BlindCase("b5-case-13", "https://github.com/XiaLiPKU/EMANet/issues/7", "data / normalisation",
              "images are normalised as (image - MEAN) / MEAN instead of / STD", _c13_build, _c13_proof,
              known_miss="held-out batch 5, measured once: no invariant of the audit covers it"),
    BlindCase("b5-case-14", "https://github.com/GengDavid/pytorch-cpn/pull/9", "data / normalisation",
              "color_normalize divides the dataset's pixel means in place: later samples are not centred",
              _c14_build, _c14_proof,
              known_miss="held-out batch 5, measured once: no invariant of the audit covers it"),
    BlindCase("b5-case-15", "https://github.com/SarahwXU/HiSup/issues/35", "data / normalisation",
              "images already rescaled to [0, 1] are divided by 255 again", _c15_build, _c15_proof),
]
