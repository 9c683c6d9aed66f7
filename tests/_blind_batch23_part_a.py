"""Blind batch 23 (part a): silent decoder-LM training bugs from public GitHub threads, each with its fixed twin.

Collected by someone who does not write the audit's checks. Every case builds the user's setup on a tiny model
(hand-written RoPE and packed-sequence decoders, a from-scratch GPT with hand-written LoRA layers, transformers
Llama students and teachers from tiny configs in code; nothing is downloaded) and proves the bug without the
audit on real tensors and real steps.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw, _llama_config, _sgd_step

# --------------------------------------------------------------------------------------------- case-01
# gpt-neox PR #1016: the rotary embedding keeps `inv_freq` as a float32 buffer, but `model.bfloat16()` casts that
# buffer to bf16, and the forward builds the positions with `t = arange(seq_len).type_as(inv_freq)`, so positions
# are bf16 too: above 256 neighbouring integer positions round to the same value (256 and 257 are one number) and
# tokens there get identical rotary phases. Training runs and the loss falls, but the model cannot tell those
# positions apart. Fix in the PR: force `inv_freq` and `t` to float32 when the rotary table is built, and cast
# only the resulting cos/sin to the activation dtype.


class _Rotary(nn.Module):
    def __init__(self, dim: int, fp32_fix: bool) -> None:
        super().__init__()
        self.fp32_fix = fp32_fix
        inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq)

    def forward(self, seq_len: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fp32_fix:
            t = torch.arange(seq_len, dtype=torch.float32)
            freqs = torch.einsum("i,j->ij", t, self.inv_freq.float())
        else:
            t = torch.arange(seq_len).type_as(self.inv_freq)
            freqs = torch.einsum("i,j->ij", t, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class _RopeLM(nn.Module):
    """One-block decoder LM with rotary attention, trained in pure bf16 (`model.bfloat16()`)."""

    def __init__(self, fp32_fix: bool, vocab: int = 32, d: int = 32, heads: int = 2) -> None:
        super().__init__()
        self.heads, self.hd = heads, d // heads
        self.tok = nn.Embedding(vocab, d)
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.rotary = _Rotary(self.hd, fp32_fix)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        b, t = ids.shape
        x = self.tok(ids)
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, self.hd).permute(2, 0, 3, 1, 4)
        cos, sin = self.rotary(t, x.dtype)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, -1))
        x = x + self.mlp(self.norm2(x))
        return self.head(x)


_C01_SEQ = torch.randint(0, 32, (2, 321), generator=_gen(2301))
_C01_IN, _C01_TGT = _C01_SEQ[:, :-1], _C01_SEQ[:, 1:]


def _c01_build(bug: bool) -> Case:
    """Rotary decoder cast to bf16 with model.bfloat16(), 320-token sequences, positions built with type_as(inv_freq)."""
    torch.manual_seed(0)
    model = _RopeLM(fp32_fix=not bug).bfloat16().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def loss_fn() -> torch.Tensor:
        logits = model(_C01_IN)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), _C01_TGT.reshape(-1))

    return model, _sgd_step(model, opt, loss_fn), _kw(optimizer=opt, inputs=_C01_IN)


def _c01_proof(bug: bool) -> bool:
    """After a training step, the rotary phases the model applies at positions 256 and 257 are identical."""
    model, step, _ = _c01_build(bug)
    step()
    with torch.no_grad():
        cos, sin = model.rotary(_C01_IN.shape[1], torch.bfloat16)
    return bool(torch.equal(cos[256], cos[257]) and torch.equal(sin[256], sin[257]))


# --------------------------------------------------------------------------------------------- case-02
# NVIDIA-BioNeMo/bionemo-recipes PR #1449: sequences are flattened into one packed row (THD layout) for a causal
# LM; attention and positions are per document, but the labels are the plain concatenation of the documents'
# input ids and the model shifts labels internally, so the last token of each document is trained to predict the
# first token of the next, unrelated document. Fix in the PR: the collator separates the documents' labels with a
# -100 at each document's first position (labels [0, 1, 2, -100, B, C] for inputs [0, 1, 2, A, B, C]).


class _PackedLM(nn.Module):
    """Tiny decoder LM over a packed row: positions restart per document, attention is block-diagonal causal."""

    def __init__(self, vocab: int = 30, d: int = 32, heads: int = 2, max_len: int = 32) -> None:
        super().__init__()
        self.heads, self.hd = heads, d // heads
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(max_len, d)
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor, position_ids: torch.Tensor, doc_ids: torch.Tensor) -> torch.Tensor:
        b, t = ids.shape
        x = self.tok(ids) + self.pos(position_ids)
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        mask = causal[None] & (doc_ids[:, :, None] == doc_ids[:, None, :])
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, self.hd).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, -1))
        x = x + self.mlp(self.norm2(x))
        return self.head(x)


def _causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """HF-style causal LM loss: the model shifts the labels itself."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                           ignore_index=-100)


_C02_DOCS = [torch.randint(1, 30, (n,), generator=_gen(2310 + i)) for i, n in enumerate((6, 8, 5))]


def _c02_collate(bug: bool) -> dict[str, torch.Tensor]:
    ids = torch.cat(_C02_DOCS)[None]
    pos = torch.cat([torch.arange(len(d)) for d in _C02_DOCS])[None]
    doc = torch.cat([torch.full((len(d),), i) for i, d in enumerate(_C02_DOCS)])[None]
    labels = ids.clone()
    if not bug:
        labels[pos == 0] = -100  # the fix: no document's first token is a target of the previous document
    return {"input_ids": ids, "position_ids": pos, "doc_ids": doc, "labels": labels}


def _c02_build(bug: bool) -> Case:
    """Packed (flattened) causal-LM pre-training batch with per-document positions and attention."""
    torch.manual_seed(0)
    model = _PackedLM().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = _c02_collate(bug)

    def loss_fn() -> torch.Tensor:
        logits = model(batch["input_ids"], batch["position_ids"], batch["doc_ids"])
        return _causal_lm_loss(logits, batch["labels"])

    inputs = (batch["input_ids"], batch["position_ids"], batch["doc_ids"])
    return model, _sgd_step(model, opt, loss_fn), _kw(optimizer=opt, inputs=inputs)


def _c02_proof(bug: bool) -> bool:
    """The packed loss differs from the token-weighted loss of the same documents run one by one."""
    model, _, _ = _c02_build(bug)
    batch = _c02_collate(bug)
    model.eval()
    with torch.no_grad():
        packed = float(_causal_lm_loss(model(batch["input_ids"], batch["position_ids"], batch["doc_ids"]),
                                       batch["labels"]))
        total, count = 0.0, 0
        for d in _C02_DOCS:
            ids = d[None]
            logits = model(ids, torch.arange(len(d))[None], torch.zeros_like(ids))
            total += float(_causal_lm_loss(logits, ids)) * (len(d) - 1)
            count += len(d) - 1
    return abs(packed - total / count) > 1e-4


# --------------------------------------------------------------------------------------------- case-03
# peremartra/optipfair issue #34: the distillation trainer builds `labels = inputs["input_ids"].clone()` with no
# masking of padding, and the logit-distillation KL is averaged over all positions, padding included. Right-padded
# variable-length batches dilute and bias both the task loss and the KL by the amount of padding; the author saw
# about 4 PPL better students once fixed. Fix in the issue: `labels[inputs["attention_mask"] == 0] = -100` in the
# trainer and the mask propagated through the loss components (KL averaged over real tokens only).

_C03_T = 2.0
_C03_ALPHA = 0.5


def _c03_batch(extra_pad: int = 0) -> dict[str, torch.Tensor]:
    lens = (9, 5, 3)
    width = max(lens) + extra_pad
    ids = torch.zeros(len(lens), width, dtype=torch.long)  # pad_token_id = 0
    mask = torch.zeros(len(lens), width, dtype=torch.long)
    for i, n in enumerate(lens):
        ids[i, :n] = torch.randint(3, 40, (n,), generator=_gen(2320 + i))
        mask[i, :n] = 1
    return {"input_ids": ids, "attention_mask": mask}


def _c03_loss(student: nn.Module, teacher: nn.Module, inputs: dict[str, torch.Tensor], bug: bool) -> torch.Tensor:
    labels = inputs["input_ids"].clone()
    if not bug:
        labels[inputs["attention_mask"] == 0] = -100
    out = student(**inputs, labels=labels)
    with torch.no_grad():
        t_logits = teacher(**inputs).logits
    kl = F.kl_div(F.log_softmax(out.logits / _C03_T, -1), F.softmax(t_logits / _C03_T, -1),
                  reduction="none").sum(-1)  # per-token KL
    if bug:
        kd = kl.mean()
    else:
        m = inputs["attention_mask"].float()
        kd = (kl * m).sum() / m.sum()
    return _C03_ALPHA * out.loss + (1 - _C03_ALPHA) * kd * _C03_T ** 2


def _c03_models() -> tuple[nn.Module, nn.Module]:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    teacher = LlamaForCausalLM(_llama_config(num_hidden_layers=2)).eval()
    student = LlamaForCausalLM(_llama_config(num_hidden_layers=1, intermediate_size=32)).train()
    return student, teacher


def _c03_build(bug: bool) -> Case:
    """Logit distillation of a Llama teacher into a smaller Llama student on right-padded batches."""
    student, teacher = _c03_models()
    opt = torch.optim.AdamW(student.parameters(), lr=5e-4)
    inputs = _c03_batch()
    step = _sgd_step(student, opt, lambda: _c03_loss(student, teacher, inputs, bug))
    return student, step, _kw(optimizer=opt, inputs=inputs)


def _c03_proof(bug: bool) -> bool:
    """Padding the same batch with four more pad columns changes the distillation loss."""
    student, teacher = _c03_models()
    student.eval()
    with torch.no_grad():
        a = float(_c03_loss(student, teacher, _c03_batch(), bug))
        b = float(_c03_loss(student, teacher, _c03_batch(extra_pad=4), bug))
    return abs(a - b) > 1e-4


# --------------------------------------------------------------------------------------------- case-04
# rasbt/LLMs-from-scratch issue #821 (fixed by PR #823): the hand-written LoRALayer used to fine-tune the GPT
# model returns `self.alpha * (x @ self.A @ self.B)`, without dividing by the rank; with the book's rank=16,
# alpha=16 every adapter's update is applied 16 times stronger than the LoRA convention (alpha / rank = 1), so the
# adapters move the frozen model far faster than configured. Fix: `self.alpha / self.rank * (x @ self.A @ self.B)`.


class _LoRALayer(nn.Module):
    def __init__(self, in_dim: int, out_dim: int, rank: int, alpha: float, scale_by_rank: bool) -> None:
        super().__init__()
        self.A = nn.Parameter(torch.empty(in_dim, rank))
        nn.init.kaiming_uniform_(self.A, a=math.sqrt(5))
        self.B = nn.Parameter(torch.zeros(rank, out_dim))
        self.alpha, self.rank, self.scale_by_rank = alpha, rank, scale_by_rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scale_by_rank:
            return self.alpha / self.rank * (x @ self.A @ self.B)
        return self.alpha * (x @ self.A @ self.B)


class _LinearWithLoRA(nn.Module):
    def __init__(self, linear: nn.Linear, rank: int, alpha: float, scale_by_rank: bool) -> None:
        super().__init__()
        self.linear = linear
        self.lora = _LoRALayer(linear.in_features, linear.out_features, rank, alpha, scale_by_rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + self.lora(x)


def _replace_linear_with_lora(model: nn.Module, rank: int, alpha: float, scale_by_rank: bool) -> None:
    for name, module in model.named_children():
        if isinstance(module, nn.Linear):
            setattr(model, name, _LinearWithLoRA(module, rank, alpha, scale_by_rank))
        else:
            _replace_linear_with_lora(module, rank, alpha, scale_by_rank)


class _GPTBlock(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads, self.hd = heads, d // heads
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.W_query, self.W_key, self.W_value = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False), \
            nn.Linear(d, d, bias=False)
        self.out_proj = nn.Linear(d, d)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.norm1(x)
        q, k, v = (w(h).view(b, t, self.heads, self.hd).transpose(1, 2)
                   for w in (self.W_query, self.W_key, self.W_value))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out_proj(a.transpose(1, 2).reshape(b, t, -1))
        return x + self.ff(self.norm2(x))


class _GPTClassifier(nn.Module):
    """From-scratch GPT backbone with its out_head replaced by a 2-class head (spam classification)."""

    def __init__(self, vocab: int = 50, d: int = 32, heads: int = 2, layers: int = 2, ctx: int = 16) -> None:
        super().__init__()
        self.tok_emb, self.pos_emb = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.trf_blocks = nn.Sequential(*[_GPTBlock(d, heads) for _ in range(layers)])
        self.final_norm = nn.LayerNorm(d)
        self.out_head = nn.Linear(d, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(ids) + self.pos_emb(torch.arange(ids.shape[1]))
        return self.out_head(self.final_norm(self.trf_blocks(x)))


_C04_X = torch.randint(0, 50, (8, 12), generator=_gen(2330))
_C04_Y = torch.randint(0, 2, (8,), generator=_gen(2331))
_C04_RANK, _C04_ALPHA = 16, 16


def _c04_build(bug: bool) -> Case:
    """LoRA fine-tuning (rank 16, alpha 16) of a from-scratch GPT classifier with hand-written LoRA layers."""
    torch.manual_seed(0)
    model = _GPTClassifier()
    for p in model.parameters():
        p.requires_grad = False
    _replace_linear_with_lora(model, _C04_RANK, _C04_ALPHA, scale_by_rank=not bug)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=5e-5, weight_decay=0.1)
    step = _sgd_step(model, opt, lambda: F.cross_entropy(model(_C04_X)[:, -1, :], _C04_Y))
    return model, step, _kw(optimizer=opt, inputs=_C04_X)


def _c04_proof(bug: bool) -> bool:
    """After two steps, every adapter adds more than (alpha / rank) * x A B to its layer's output."""
    model, step, _ = _c04_build(bug)
    step()
    step()
    x = torch.randn(4, 32, generator=_gen(2332))
    wrong = []
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, _LoRALayer) and m.A.shape[0] == 32:
                expected = _C04_ALPHA / _C04_RANK * (x @ m.A @ m.B)
                wrong.append(not torch.allclose(m(x), expected, rtol=1e-4, atol=1e-9))
    return bool(wrong) and all(wrong)


# --------------------------------------------------------------------------------------------- case-05
# wdndev/tiny-llm-zh issue #10: the pre-training dataset's __getitem__ returns `X = sample[:-1]` and
# `Y = sample[1:]` (labels already shifted), and the model's forward shifts again
# (`shift_logits = logits[..., :-1, :]`, `shift_labels = labels[..., 1:]`), so each position is trained to predict
# the token two ahead. The maintainer confirmed the duplicated shift; fix: the labels are a copy of the input ids,
# not shifted (the model's own shift does it).

_C05_SAMPLES = torch.randint(3, 40, (4, 13), generator=_gen(2340))


def _c05_batch(bug: bool) -> tuple[torch.Tensor, torch.Tensor]:
    x = _C05_SAMPLES[:, :-1]
    y = _C05_SAMPLES[:, 1:] if bug else x.clone()
    return x, y


def _c05_build(bug: bool) -> Case:
    """Llama pre-training where the dataset pre-shifts labels and LlamaForCausalLM shifts them again."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(_llama_config()).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    x, y = _c05_batch(bug)
    step = _sgd_step(model, opt, lambda: model(input_ids=x, labels=y).loss)
    return model, step, _kw(optimizer=opt, inputs=x)


def _c05_proof(bug: bool) -> bool:
    """The loss the model trains on differs from next-token cross-entropy on the same logits."""
    model, _, _ = _c05_build(bug)
    x, y = _c05_batch(bug)
    model.eval()
    with torch.no_grad():
        out = model(input_ids=x, labels=y)
        next_tok = F.cross_entropy(out.logits[:, :-1].reshape(-1, out.logits.shape[-1]), x[:, 1:].reshape(-1))
    return abs(float(out.loss) - float(next_tok)) > 1e-4


CASES: list[BlindCase] = [
    BlindCase("b23-case-01", "https://github.com/EleutherAI/gpt-neox/pull/1016", "RoPE / positional precision",
              "model.bfloat16() casts the rotary inv_freq buffer and the positions to bf16, so positions above 256 "
              "collide and get identical rotary phases.", _c01_build, _c01_proof,
              known_miss="model.bfloat16() casts the rotary inv_freq buffer, so positions above 256 collide: the precision of a position table is not measured",
              known_alarm=("AMP-002",)),
    BlindCase("b23-case-02", "https://github.com/NVIDIA-BioNeMo/bionemo-recipes/pull/1449",
              "sequence packing / label boundaries",
              "Packed documents' labels are concatenated without a -100 separator, so the last token of each "
              "document is trained to predict the next document's first token.", _c02_build, _c02_proof),
    BlindCase("b23-case-03", "https://github.com/peremartra/optipfair/issues/34", "distillation / padding mask",
              "Labels copy the input ids and the KL is averaged over all positions, so padding tokens enter both the "
              "task loss and the distillation loss.", _c03_build, _c03_proof),
    BlindCase("b23-case-04", "https://github.com/rasbt/LLMs-from-scratch/issues/821", "LoRA scaling",
              "The LoRA layer scales its update by alpha instead of alpha / rank, so with rank 16 every adapter "
              "acts 16 times stronger than configured.", _c04_build, _c04_proof,
              known_miss="a hand-written LoRA layer scales by alpha instead of alpha / r: the adapter's scale is read from peft configs only"),
    BlindCase("b23-case-05", "https://github.com/wdndev/tiny-llm-zh/issues/10", "label shifting",
              "Labels are shifted in the dataset and again inside the model, so the LM is trained to predict the "
              "token two positions ahead.", _c05_build, _c05_proof),
]
