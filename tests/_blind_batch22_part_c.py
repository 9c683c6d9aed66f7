"""Blind batch 22 (part c): silent training bugs from public threads on NLP and speech models outside decoder-only
LMs (seq2seq summarisation, T5 fine-tuning, token classification / NER, dense retrieval embeddings, CTC speech
recognition), each with its fixed twin. Every model is built from a tiny config or by hand; nothing is downloaded."""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw, _sgd_step

# --------------------------------------------------------------------------------------------- case-11
# An abstractive summariser (BERT-style encoder, transformer decoder) trained with a hand-written label-smoothing
# loss. The PR reports that the earlier loss (borrowed from OpenNMT) ignored the padding positions of the target,
# but the current LabelSmoothingLoss "simply calculate[s] loss with smoothing and does not consider the padding",
# so every padded target slot is trained towards a smoothed distribution around the pad token and dilutes the
# loss of the real tokens. Fix (the PR): compute the smoothed loss only on the valid (non-pad) target positions.

_C11_PAD, _C11_V = 0, 30


def _c11_model() -> nn.Module:
    from transformers import BartConfig, BartForConditionalGeneration

    cfg = BartConfig(vocab_size=_C11_V, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                     decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32,
                     pad_token_id=_C11_PAD, bos_token_id=1, eos_token_id=2, decoder_start_token_id=2,
                     dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    return BartForConditionalGeneration(cfg)


def _c11_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = _gen(1101)
    src = torch.randint(3, _C11_V, (4, 10), generator=g)
    src_mask = torch.ones_like(src)
    src[2:, 7:] = _C11_PAD
    src_mask[2:, 7:] = 0
    tgt = torch.randint(3, _C11_V, (4, 9), generator=g)
    for i, n in enumerate([9, 6, 4, 3]):  # summaries of different lengths, right-padded
        tgt[i, n - 1] = 2
        tgt[i, n:] = _C11_PAD
    return src, src_mask, tgt


_C11_SRC, _C11_SRC_MASK, _C11_TGT = _c11_batch()


class _LabelSmoothingLoss(nn.Module):
    def __init__(self, smoothing: float, vocab: int, pad: int, mask_pad: bool) -> None:
        super().__init__()
        self.confidence, self.smoothing, self.vocab, self.pad = 1.0 - smoothing, smoothing, vocab, pad
        self.mask_pad = mask_pad

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logp = logits.log_softmax(-1).reshape(-1, self.vocab)
        target = target.reshape(-1)
        true_dist = torch.full_like(logp, self.smoothing / (self.vocab - 1))
        true_dist.scatter_(1, target[:, None], self.confidence)
        per_tok = -(true_dist * logp).sum(-1)
        if self.mask_pad:
            valid = target != self.pad
            return per_tok[valid].mean()
        return per_tok.mean()


def _c11_decoder_inputs(tgt: torch.Tensor) -> torch.Tensor:
    dec = torch.full_like(tgt, 2)
    dec[:, 1:] = tgt[:, :-1]
    return dec


def _c11_logits(model: nn.Module) -> torch.Tensor:
    out = model(input_ids=_C11_SRC, attention_mask=_C11_SRC_MASK, decoder_input_ids=_c11_decoder_inputs(_C11_TGT),
                decoder_attention_mask=(_C11_TGT != _C11_PAD).long())
    return out.logits


def _c11_build(bug: bool) -> Case:
    """Summariser trained with a label-smoothing loss that does (twin) or does not (bug) skip padded targets."""
    torch.manual_seed(0)
    model = _c11_model().train()
    crit = _LabelSmoothingLoss(0.1, _C11_V, _C11_PAD, mask_pad=not bug)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    step = _sgd_step(model, opt, lambda: crit(_c11_logits(model), _C11_TGT))
    return model, step, _kw(optimizer=opt, inputs=(_C11_SRC, _C11_SRC_MASK, _C11_TGT))


def _c11_proof(bug: bool) -> bool:
    """The loss sends gradient into the logits of padded target positions (which must not be trained)."""
    model, _, _ = _c11_build(bug)
    crit = _LabelSmoothingLoss(0.1, _C11_V, _C11_PAD, mask_pad=not bug)
    logits = _c11_logits(model)
    (g,) = torch.autograd.grad(crit(logits, _C11_TGT), logits)
    pad = _C11_TGT == _C11_PAD
    return float(g[pad].abs().sum()) > 0.0


# --------------------------------------------------------------------------------------------- case-12
# The official summarisation example (run_summarization_no_trainer.py) fine-tunes T5 with AdamW parameter groups
# built from no_decay = ["bias", "LayerNorm.weight"]. T5's norm layers are named `layer_norm` / `final_layer_norm`
# (and T5 has no biases), so no parameter matches and every T5 layer norm weight is silently decayed towards zero
# with the rest of the weights. Fix (the PR): add "layer_norm.weight" to the no_decay list.

_C12_WD = 0.1


def _c12_model() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    kw: dict[str, Any] = {"vocab_size": 32, "d_model": 16, "d_kv": 8, "d_ff": 32, "num_layers": 1,
                          "num_decoder_layers": 1, "num_heads": 2, "dropout_rate": 0.0, "pad_token_id": 0,
                          "eos_token_id": 1, "decoder_start_token_id": 0}
    cfg = T5Config(**kw)
    return T5ForConditionalGeneration(cfg)


_C12_SRC = torch.randint(2, 32, (4, 8), generator=_gen(1201))
_C12_LABELS = torch.randint(2, 32, (4, 5), generator=_gen(1202))


def _c12_groups(model: nn.Module, bug: bool) -> list[dict]:
    no_decay = ["bias", "LayerNorm.weight"] if bug else ["bias", "LayerNorm.weight", "layer_norm.weight"]
    return [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": _C12_WD},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]


def _c12_build(bug: bool) -> Case:
    """T5 summarisation fine-tune whose AdamW no_decay list does (twin) or does not (bug) match T5's layer norms."""
    from transformers import get_linear_schedule_with_warmup

    torch.manual_seed(0)
    model = _c12_model().train()
    opt = torch.optim.AdamW(_c12_groups(model, bug), lr=1e-3)
    sched = get_linear_schedule_with_warmup(opt, num_warmup_steps=2, num_training_steps=50)

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = model(input_ids=_C12_SRC, labels=_C12_LABELS).loss
        loss.backward()
        opt.step()
        sched.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=(_C12_SRC, _C12_LABELS), lr_scheduler=sched, total_steps=50)


def _c12_proof(bug: bool) -> bool:
    """Some T5 layer norm weight sits in a parameter group with nonzero weight decay."""
    model = _c12_model()
    opt = torch.optim.AdamW(_c12_groups(model, bug), lr=1e-3)
    ln = {id(p) for n, p in model.named_parameters() if "layer_norm" in n}
    return any(g["weight_decay"] > 0 and any(id(p) in ln for p in g["params"]) for g in opt.param_groups)


# --------------------------------------------------------------------------------------------- case-13
# The NER example sets pad_token_label_id = 0 and num_labels = len(labels) + 1 but builds the label map straight
# from the label list, so the first real label gets index 0 too. Padding, sub-word continuations and every token
# tagged with the first label are all encoded as 0, and the loss (which drops positions whose label equals
# pad_token_label_id) never trains that entity class. Fix (the PR): put a placeholder "[PAD]" label at index 0 of
# the label list so every real label shifts up by one and no longer collides with pad_token_label_id.

_C13_LABELS = ["B-LOC", "I-LOC", "B-PER", "I-PER", "O"]
_C13_PAD_LABEL_ID = 0
# word-level tags for 4 sentences of 10 tokens (-1 = padding position)
_C13_TAGS: list[list[str | None]] = [
    ["O", "B-LOC", "I-LOC", "O", "B-PER", "I-PER", "O", "O", "B-LOC", "O"],
    ["B-PER", "O", "O", "B-LOC", "O", "O", "O", None, None, None],
    ["O", "O", "B-LOC", "I-LOC", "I-LOC", "O", "B-PER", "O", None, None],
    ["B-LOC", "O", "B-PER", "I-PER", "O", None, None, None, None, None],
]


def _c13_encode(bug: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    labels = list(_C13_LABELS) if bug else ["[PAD]"] + list(_C13_LABELS)
    label_map = {lab: i for i, lab in enumerate(labels)}
    num_labels = len(_C13_LABELS) + 1
    ids = torch.randint(3, 40, (4, 10), generator=_gen(1301))
    mask = torch.ones(4, 10, dtype=torch.long)
    y = torch.full((4, 10), _C13_PAD_LABEL_ID, dtype=torch.long)
    for i, row in enumerate(_C13_TAGS):
        for j, tag in enumerate(row):
            if tag is None:
                ids[i, j], mask[i, j] = 0, 0
            else:
                y[i, j] = label_map[tag]
    return ids, mask, y, num_labels


def _c13_build(bug: bool) -> Case:
    """Token classifier whose label map does (bug) or does not (twin) give a real tag the pad label id."""
    from transformers import BertConfig, BertForTokenClassification

    ids, mask, y, num_labels = _c13_encode(bug)
    torch.manual_seed(0)
    kw: dict[str, Any] = {"vocab_size": 40, "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                          "intermediate_size": 64, "max_position_embeddings": 32, "num_labels": num_labels,
                          "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    cfg = BertConfig(**kw)
    model = BertForTokenClassification(cfg).train()
    opt = torch.optim.Adam(model.parameters(), lr=5e-4)

    def loss_fn() -> torch.Tensor:
        logits = model(input_ids=ids, attention_mask=mask).logits
        active = y.view(-1) != _C13_PAD_LABEL_ID
        return F.cross_entropy(logits.view(-1, num_labels)[active], y.view(-1)[active])

    return model, _sgd_step(model, opt, loss_fn), _kw(optimizer=opt, inputs=(ids, mask, y))


def _c13_proof(bug: bool) -> bool:
    """Tokens tagged B-LOC contribute nothing to the loss: their logits get exactly zero gradient."""
    ids, mask, y, num_labels = _c13_encode(bug)
    model, _, _ = _c13_build(bug)
    logits = model(input_ids=ids, attention_mask=mask).logits
    active = y.view(-1) != _C13_PAD_LABEL_ID
    loss = F.cross_entropy(logits.view(-1, num_labels)[active], y.view(-1)[active])
    (g,) = torch.autograd.grad(loss, logits)
    loc = torch.tensor([[t == "B-LOC" for t in row] for row in _C13_TAGS])
    return float(g[loc].abs().sum()) == 0.0


# --------------------------------------------------------------------------------------------- case-14
# Embedding fine-tuning (bi-encoder, CLS pooling, temperature 0.02) with use_inbatch_neg=False: each query should be
# scored only against its own group (1 positive + hard negatives) with target 0. The code computed
# compute_similarity(q_reps, p_reps.view(B, group_size, -1)); the report points out this yields (B, B, G) rather than
# (B, G), i.e. still an in-batch score table. After .view(B, -1) with target zeros, row j scores group j's passages
# against every query and its target is query 0 with group j's positive: every positive is pulled towards query 0,
# and every other query's own positive is treated as a negative. The maintainers corrected it to score each query
# against its own group only: compute_similarity(q_reps[:, None, :], p_reps.view(B, G, -1)).squeeze(1) -> (B, G).

_C14_B, _C14_G, _C14_TEMP = 4, 3, 0.02


class _BiEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from transformers import BertConfig, BertModel

        cfg = BertConfig(vocab_size=40, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                         attention_probs_dropout_prob=0.0)
        self.model = BertModel(cfg, add_pooling_layer=False)

    def encode(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.model(input_ids=ids, attention_mask=(ids != 0).long()).last_hidden_state[:, 0]
        return F.normalize(h, dim=-1)

    @staticmethod
    def compute_similarity(q: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        return torch.matmul(q, p.transpose(-2, -1))


_C14_Q = torch.randint(1, 40, (_C14_B, 6), generator=_gen(1401))
_C14_P = torch.randint(1, 40, (_C14_B * _C14_G, 8), generator=_gen(1402))


def _c14_loss(enc: _BiEncoder, bug: bool, q_reps: torch.Tensor, p_reps: torch.Tensor) -> torch.Tensor:
    b = q_reps.size(0)
    if bug:
        scores = enc.compute_similarity(q_reps, p_reps.view(b, _C14_G, -1)) / _C14_TEMP
    else:
        scores = enc.compute_similarity(q_reps[:, None, :], p_reps.view(b, _C14_G, -1)).squeeze(1) / _C14_TEMP
    scores = scores.view(b, -1)
    target = torch.zeros(b, dtype=torch.long)
    return F.cross_entropy(scores, target)


def _c14_build(bug: bool) -> Case:
    """Bi-encoder trained on (query, positive, hard negatives) groups without in-batch negatives."""
    torch.manual_seed(0)
    enc = _BiEncoder().train()
    opt = torch.optim.AdamW(enc.parameters(), lr=1e-4)
    step = _sgd_step(enc, opt, lambda: _c14_loss(enc, bug, enc.encode(_C14_Q), enc.encode(_C14_P)))
    return enc, step, _kw(optimizer=opt, inputs=(_C14_Q, _C14_P))


def _c14_proof(bug: bool) -> bool:
    """For queries 1..B-1 the loss gradient pushes each query away from its own positive passage (the gradient on
    the query embedding points along its positive, so a descent step lowers their similarity)."""
    enc = cast(_BiEncoder, _c14_build(bug)[0])
    q = enc.encode(_C14_Q).detach().requires_grad_(True)
    p = enc.encode(_C14_P).detach().requires_grad_(True)
    (gq,) = torch.autograd.grad(_c14_loss(enc, bug, q, p), q)
    pushes_away = [float(gq[i].detach() @ p[i * _C14_G].detach()) > 0 for i in range(1, _C14_B)]
    return all(pushes_away)


# --------------------------------------------------------------------------------------------- case-15
# Joint CTC/attention ASR: the text pipeline appends <eos> (id 1) to every transcript for the attention decoder, and
# the same padded label tensor and its lengths (non-pad count, eos included) are passed to the CTC loss. CTC then
# learns to emit an <eos> symbol at the end of every utterance, which is not part of the CTC target alphabet. Fix
# (the PR): the CTC target length must be reduced by 1 so that the trailing <eos> is excluded from the CTC targets.

_C15_BLANK, _C15_EOS, _C15_V = 0, 1, 12


class _CtcAsr(nn.Module):
    def __init__(self, n_feat: int = 16, hidden: int = 32) -> None:
        super().__init__()
        self.enc = nn.GRU(n_feat, hidden, batch_first=True, bidirectional=True)
        self.ctc = nn.Linear(2 * hidden, _C15_V)

    def forward(self, feat: torch.Tensor) -> torch.Tensor:
        return self.ctc(self.enc(feat)[0])


def _c15_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = _gen(1501)
    feat = torch.randn(3, 24, 16, generator=g)
    feat_len = torch.tensor([24, 20, 16])
    txt = torch.zeros(3, 7, dtype=torch.long)
    for i, n in enumerate([6, 4, 3]):
        txt[i, :n] = torch.randint(2, _C15_V, (n,), generator=g)
        txt[i, n] = _C15_EOS
    return feat, feat_len, txt


_C15_FEAT, _C15_FEAT_LEN, _C15_TXT = _c15_batch()


def _c15_loss(model: _CtcAsr, bug: bool) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(_C15_FEAT)
    log_probs = logits.log_softmax(-1)
    txt_len = torch.sum(_C15_TXT != 0, dim=-1)
    if not bug:
        txt_len = txt_len - 1
    loss = F.ctc_loss(log_probs.transpose(0, 1), _C15_TXT, _C15_FEAT_LEN, txt_len, blank=_C15_BLANK,
                      zero_infinity=True)
    return loss, logits


def _c15_build(bug: bool) -> Case:
    """CTC branch of an ASR model fed transcripts that carry a trailing <eos>, with or without it in the target."""
    torch.manual_seed(0)
    model = _CtcAsr().train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    step = _sgd_step(model, opt, lambda: _c15_loss(model, bug)[0])
    return model, step, _kw(optimizer=opt, inputs=(_C15_FEAT, _C15_FEAT_LEN, _C15_TXT))


def _c15_proof(bug: bool) -> bool:
    """The CTC loss rewards emitting <eos>: at some frame the gradient on the <eos> logit is negative (a target
    symbol), whereas a symbol outside the CTC targets only ever gets pushed down (positive gradient)."""
    model = cast(_CtcAsr, _c15_build(bug)[0])
    loss, logits = _c15_loss(model, bug)
    (g,) = torch.autograd.grad(loss, logits)
    valid = torch.arange(logits.shape[1])[None] < _C15_FEAT_LEN[:, None]
    return float(g[..., _C15_EOS][valid].min()) < 0.0


CASES: list[BlindCase] = [
    BlindCase("b22-case-11", "https://github.com/k-tahiro/bert-summarizer/pull/41", "loss over padding",
              "A summariser's label-smoothing loss is computed over every target slot, padding included, so padded "
              "positions are trained and dilute the loss of the real tokens.", _c11_build, _c11_proof),
    BlindCase("b22-case-12", "https://github.com/huggingface/transformers/pull/18002", "weight decay on norms",
              "A no_decay list written for BERT names matches none of T5's layer_norm weights, so AdamW decays every "
              "T5 layer norm during fine-tuning.", _c12_build, _c12_proof),
    BlindCase("b22-case-13", "https://github.com/huggingface/transformers/pull/2575", "label id collision",
              "The pad label id equals the first real tag's id, so the masked token-classification loss never "
              "trains that entity class.", _c13_build, _c13_proof,
              known_miss="the first real tag shares the pad label id and is filtered out by a boolean mask before the loss: a class never supervised is not compared with the label map"),
    BlindCase("b22-case-14", "https://github.com/FlagOpen/FlagEmbedding/issues/450", "contrastive target misaligned",
              "Without in-batch negatives the query-vs-group scores broadcast into an all-pairs table while the "
              "target stays 0, so every positive is pulled towards the first query and every other query is "
              "pushed away from its own positive.", _c14_build, _c14_proof,
              known_miss="query-vs-group scores broadcast to an all-pairs table with target 0: the candidate layout of a score matrix is not compared with the groups"),
    BlindCase("b22-case-15", "https://github.com/Alexander-H-Liu/End-to-end-ASR-Pytorch/pull/57", "CTC target",
              "CTC target lengths include the attention decoder's trailing <eos>, so CTC is trained to emit an "
              "<eos> symbol at the end of every utterance.", _c15_build, _c15_proof,
              known_miss="CTC target lengths include the decoder's EOS: which symbols a CTC target should hold is label semantics"),
]
