"""Blind batch 33 (part a): silent transformer training bugs from public GitHub threads, each with its fixed twin.

Collected by someone who does not write the audit's checks. Every case builds the user's setup on a tiny model
(transformers BERT, CLIP text, OpenAI GPT and Whisper models from tiny configs in code, plain torch heads; nothing
is downloaded) and proves the bug without the audit on real tensors and real steps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw

# --------------------------------------------------------------------------------------------- case-01
# dhlee347/pytorchic-bert PR #22: the BERT fine-tuning optimizer builds its two parameter groups with
# `n not in no_decay` / `n in no_decay`, where `n` is a full parameter name ("encoder.layer.0...LayerNorm.weight") and
# `no_decay` a list of short names. The list-membership test is never true, so every parameter, LayerNorm weights and
# all biases included, lands in the weight_decay=0.01 group and the no-decay group is empty. Training runs normally; the
# norms and biases are just silently decayed. Fix in the PR: the substring test `not any(nd in n for nd in no_decay)`
# as in the original (Hugging Face) implementation.

_C01_IDS = torch.randint(3, 60, (4, 12), generator=_gen(3301))
_C01_Y = torch.randint(0, 3, (4,), generator=_gen(3302))


def _bert_config(**kw):
    from transformers import BertConfig

    base = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
            "intermediate_size": 64, "max_position_embeddings": 32, "pad_token_id": 0, "hidden_dropout_prob": 0.0,
            "attention_probs_dropout_prob": 0.0}
    base.update(kw)
    return BertConfig(**base)


def _c01_setup(bug: bool):
    from transformers import BertForSequenceClassification

    torch.manual_seed(0)
    model = BertForSequenceClassification(_bert_config(num_labels=3)).train()
    no_decay = ["bias", "LayerNorm.bias", "LayerNorm.weight"]
    named = list(model.named_parameters())
    if bug:
        groups = [{"params": [p for n, p in named if n not in no_decay], "weight_decay": 0.01},
                  {"params": [p for n, p in named if n in no_decay], "weight_decay": 0.0}]
    else:
        groups = [{"params": [p for n, p in named if not any(nd in n for nd in no_decay)], "weight_decay": 0.01},
                  {"params": [p for n, p in named if any(nd in n for nd in no_decay)], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=1e-2)
    return model, opt


def _c01_build(bug: bool) -> Case:
    model, opt = _c01_setup(bug)
    batch = {"input_ids": _C01_IDS, "attention_mask": torch.ones_like(_C01_IDS), "labels": _C01_Y}

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=batch)


def _c01_proof(bug: bool) -> bool:
    """With every gradient zero, Adam moves nothing; only weight decay does. Does a LayerNorm weight shrink?"""
    model, opt = _c01_setup(bug)
    ln = model.bert.embeddings.LayerNorm.weight
    before = ln.detach().clone()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    return bool((ln.detach() - before).abs().max() > 1e-6)


# --------------------------------------------------------------------------------------------- case-02
# huggingface/diffusers issue #1009: textual inversion trains one new placeholder token. The script hands the whole
# token-embedding matrix to AdamW (adam_weight_decay=1e-2) and "freezes" every other row by zeroing its gradient after
# backward. Adam's update is zero for those rows, but the decoupled weight decay is not, so the pretrained embeddings
# of the whole vocabulary keep shrinking toward zero while the loss looks fine. Fix (later in the script): keep a copy
# of the original embeddings and write the rows of every other token back after each optimizer step.

_C02_VOCAB = 50
_C02_PLACEHOLDER = _C02_VOCAB - 1
_C02_IDS = torch.randint(3, _C02_VOCAB - 1, (4, 10), generator=_gen(3311))
_C02_IDS[:, 3] = _C02_PLACEHOLDER
_C02_TARGET = torch.randn(4, 10, 32, generator=_gen(3312))


def _c02_setup(bug: bool):
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(0)
    cfg = CLIPTextConfig(vocab_size=_C02_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, max_position_embeddings=16, pad_token_id=0, bos_token_id=1,
                         eos_token_id=2)
    text_encoder = CLIPTextModel(cfg).train()
    text_encoder.requires_grad_(False)
    emb = text_encoder.get_input_embeddings()
    emb.weight.requires_grad_(True)
    opt = torch.optim.AdamW(emb.parameters(), lr=5e-3, betas=(0.9, 0.999), weight_decay=1e-2, eps=1e-8)
    orig = emb.weight.detach().clone()
    index_no_updates = torch.arange(_C02_VOCAB) != _C02_PLACEHOLDER

    def step() -> torch.Tensor:
        hidden = text_encoder(input_ids=_C02_IDS).last_hidden_state
        loss = F.mse_loss(hidden, _C02_TARGET)  # stands in for the UNet noise-prediction loss
        loss.backward()
        grads = emb.weight.grad
        grads.data[index_no_updates, :] = grads.data[index_no_updates, :].fill_(0)
        opt.step()
        opt.zero_grad()
        if not bug:
            with torch.no_grad():
                emb.weight[index_no_updates] = orig[index_no_updates]
        return loss

    return text_encoder, opt, step, orig, index_no_updates


def _c02_build(bug: bool) -> Case:
    model, opt, step, _, _ = _c02_setup(bug)
    return model, step, _kw(optimizer=opt, inputs={"input_ids": _C02_IDS})


def _c02_proof(bug: bool) -> bool:
    """After a few steps, have the embeddings of tokens other than the placeholder moved?"""
    model, _, step, orig, keep = _c02_setup(bug)
    for _ in range(3):
        step()
    w = model.get_input_embeddings().weight.detach()
    return bool((w[keep] - orig[keep]).abs().max() > 1e-6)


# --------------------------------------------------------------------------------------------- case-03
# huggingface/transformers PR #562 (from issue #473): the RocStories fine-tuning example for OpenAI GPT built its LM
# labels already shifted (`lm_labels[..., :len(seq) - 1] = seq[1:]`), but the model's LM loss shifts logits and labels
# by one itself. Shifted twice, position t is trained to predict token t + 2 instead of t + 1: the loss still falls
# (the model learns something) but it is not next-token language modelling. Fix in the PR: pass the unshifted sequence
# as the labels (`lm_labels[..., :len(seq)] = seq`), padding still at -100 (-1 at the time).

_C03_LENS = [12, 10, 12, 8]
_C03_IDS = torch.randint(3, 40, (4, 12), generator=_gen(3321))
for _i, _n in enumerate(_C03_LENS):
    _C03_IDS[_i, _n:] = 0


def _c03_labels(bug: bool) -> torch.Tensor:
    labels = torch.full_like(_C03_IDS, -100)
    for i, n in enumerate(_C03_LENS):
        if bug:
            labels[i, : n - 1] = _C03_IDS[i, 1:n]
        else:
            labels[i, :n] = _C03_IDS[i, :n]
    return labels


def _c03_model():
    from transformers import OpenAIGPTConfig, OpenAIGPTLMHeadModel

    torch.manual_seed(0)
    cfg = OpenAIGPTConfig(vocab_size=40, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                          embd_pdrop=0.0, attn_pdrop=0.0)
    return OpenAIGPTLMHeadModel(cfg).train()


def _c03_build(bug: bool) -> Case:
    model = _c03_model()
    opt = torch.optim.Adam(model.parameters(), lr=6.25e-5)
    batch = {"input_ids": _C03_IDS, "labels": _c03_labels(bug)}

    def step() -> torch.Tensor:
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return model, step, _kw(optimizer=opt, inputs=batch)


def _c03_proof(bug: bool) -> bool:
    """Is the loss the model trains on the cross-entropy of predicting the token two ahead rather than the next?"""
    model = _c03_model()
    with torch.no_grad():
        out = model(input_ids=_C03_IDS, labels=_c03_labels(bug))
        logits = out.logits
        mask = torch.arange(12)[None, :] < torch.tensor(_C03_LENS)[:, None]

        def ce(k: int) -> torch.Tensor:
            tgt = _C03_IDS[:, k:].masked_fill(~mask[:, k:], -100)
            return F.cross_entropy(logits[:, :-k].reshape(-1, 40), tgt.reshape(-1), ignore_index=-100)

        return bool(torch.allclose(out.loss, ce(2), atol=1e-5) and not torch.allclose(out.loss, ce(1), atol=1e-5))


# --------------------------------------------------------------------------------------------- case-04
# huggingface/distil-whisper PR #126: the distillation script gained a `freeze_decoder` option that sets
# requires_grad=False on every decoder parameter. Whisper ties the decoder's embed_tokens to the output projection
# proj_out (which is not part of the decoder), so freezing the decoder silently freezes the LM head as well; training
# runs (the encoder still learns) but the output layer never moves. Fix in the PR: after freezing the decoder, set
# requires_grad=True on proj_out again (and with it the tied word embeddings).

_C04_FEATS = torch.randn(2, 8, 32, generator=_gen(3331))
_C04_LABELS = torch.randint(3, 64, (2, 6), generator=_gen(3332))


def _c04_setup(bug: bool):
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    torch.manual_seed(0)
    cfg = WhisperConfig(vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8,
                        max_source_positions=16, max_target_positions=16, pad_token_id=0, bos_token_id=1,
                        eos_token_id=2, decoder_start_token_id=1, dropout=0.0)
    student = WhisperForConditionalGeneration(cfg).train()
    for p in student.model.decoder.parameters():  # --freeze_decoder
        p.requires_grad = False
    if not bug:
        for p in student.proj_out.parameters():
            p.requires_grad = True
    opt = torch.optim.AdamW([p for p in student.parameters() if p.requires_grad], lr=1e-3)
    batch = {"input_features": _C04_FEATS, "labels": _C04_LABELS}

    def step() -> torch.Tensor:
        loss = student(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return student, opt, step, batch


def _c04_build(bug: bool) -> Case:
    model, opt, step, batch = _c04_setup(bug)
    return model, step, _kw(optimizer=opt, inputs=batch)


def _c04_proof(bug: bool) -> bool:
    """After two steps, is the output projection (the LM head) still exactly where it started?"""
    model, _, step, _ = _c04_setup(bug)
    before = model.proj_out.weight.detach().clone()
    step()
    step()
    return bool(torch.equal(model.proj_out.weight.detach(), before))


# --------------------------------------------------------------------------------------------- case-05
# BitVoyage/FastBERT issue #14: FastBERT's classifier head (one per layer; the teacher head on the last layer is
# trained with the backbone first) narrows the hidden states, runs its own self-attention over the sequence and
# classifies from the [CLS] position. The backbone gets the attention mask, but the head's self-attention is called
# without it, so [CLS] attends to padding and the logits depend on how much padding a batch has; training still
# converges. The maintainer confirmed it as a bug and fixed it by passing the attention mask to the head.

_C05_IDS = torch.randint(3, 60, (4, 12), generator=_gen(3341))
_C05_MASK = torch.ones_like(_C05_IDS)
_C05_MASK[1, 7:] = 0
_C05_MASK[3, 5:] = 0
_C05_IDS = _C05_IDS * _C05_MASK  # pad id 0
_C05_Y = torch.randint(0, 3, (4,), generator=_gen(3342))


class _FastBertClassifier(nn.Module):
    """FastBERT's per-layer head: narrow, self-attention, [CLS], dense, classify."""

    def __init__(self, hidden: int = 32, cls_hidden: int = 16, heads: int = 2, n_class: int = 3,
                 use_mask: bool = True) -> None:
        super().__init__()
        self.use_mask = use_mask
        self.dense_narrow = nn.Linear(hidden, cls_hidden)
        self.self_attn = nn.MultiheadAttention(cls_hidden, heads, batch_first=True)
        self.dense_prelogits = nn.Linear(cls_hidden, cls_hidden)
        self.dense_logits = nn.Linear(cls_hidden, n_class)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        x = self.dense_narrow(hidden_states)
        pad = (attention_mask == 0) if self.use_mask else None
        x, _ = self.self_attn(x, x, x, key_padding_mask=pad, need_weights=False)
        pooled = x[:, 0]
        return self.dense_logits(torch.tanh(self.dense_prelogits(pooled)))


class _FastBert(nn.Module):
    def __init__(self, use_mask: bool) -> None:
        super().__init__()
        from transformers import BertModel

        self.bert = BertModel(_bert_config(), add_pooling_layer=False)
        self.teacher = _FastBertClassifier(use_mask=use_mask)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.teacher(h, attention_mask)


def _c05_model(bug: bool) -> _FastBert:
    torch.manual_seed(0)
    return _FastBert(use_mask=not bug).train()


def _c05_build(bug: bool) -> Case:
    model = _c05_model(bug)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-5)
    batch = {"input_ids": _C05_IDS, "attention_mask": _C05_MASK}

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(model(**batch), _C05_Y)
        loss.backward()
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=batch)


def _c05_proof(bug: bool) -> bool:
    """Do the logits of a padded row change when only the token ids under its padding change?"""
    model = _c05_model(bug)
    other = _C05_IDS.clone()
    other[_C05_MASK == 0] = 7
    with torch.no_grad():
        a = model(_C05_IDS, _C05_MASK)
        b = model(other, _C05_MASK)
    return bool((a - b).abs().max() > 1e-5)


CASES: list[BlindCase] = [
    BlindCase("b33a-01", "https://github.com/dhlee347/pytorchic-bert/pull/22", "weight decay on norms and biases",
              "The no-decay grouping tests full parameter names for list membership, which never matches, so LayerNorm "
              "weights and biases are all weight-decayed.", _c01_build, _c01_proof),
    BlindCase("b33a-02", "https://github.com/huggingface/diffusers/issues/1009", "weight decay moves frozen rows",
              "Embedding rows frozen by zeroing their gradient are still shrunk by AdamW's decoupled weight decay, so "
              "the pretrained vocabulary drifts during textual inversion.", _c02_build, _c02_proof),
    BlindCase("b33a-03", "https://github.com/huggingface/transformers/pull/562", "LM labels shifted twice",
              "The example pre-shifts the LM labels while the model shifts them again, so each position is trained "
              "to predict the token two ahead.", _c03_build, _c03_proof),
    BlindCase("b33a-04", "https://github.com/huggingface/distil-whisper/pull/126", "tied LM head frozen",
              "Freezing the decoder also freezes the output projection tied to its embeddings, so the LM head never "
              "trains.", _c04_build, _c04_proof,
              known_miss="a tied LM head frozen by a name filter: which tensors a freeze means is in the filter, not the setup"),
    BlindCase("b33a-05", "https://github.com/BitVoyage/FastBERT/issues/14", "classifier attends to padding",
              "The classifier head's self-attention runs without the attention mask, so [CLS] attends to padding "
              "and the logits depend on the padding.", _c05_build, _c05_proof),
]
