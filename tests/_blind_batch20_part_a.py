"""Blind batch 20 (part a): silent training bugs in NLP beyond chat fine-tuning (embedding / retrieval, masked-LM
pre-training, knowledge distillation of LMs, token classification, MLM collators), from public GitHub threads, each
with its fixed twin. Tiny transformers BERT and Llama models built from configs in code; nothing is downloaded."""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw, _llama_config, _sgd_step


def _bert_config(**kw: Any) -> Any:
    from transformers import BertConfig

    base: dict[str, Any] = {"vocab_size": 40, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
                            "intermediate_size": 64, "max_position_embeddings": 32, "hidden_dropout_prob": 0.0,
                            "attention_probs_dropout_prob": 0.0, "pad_token_id": 0}
    base.update(kw)
    return BertConfig(**base)


# --------------------------------------------------------------------------------------------- case-01
# sentence-transformers #3189: training a bi-encoder with MultipleNegativesRankingLoss on (query, passage) pairs
# where the corpus is much smaller than the set of pairs, so the same passage appears as the positive of several
# anchors in one batch. For anchor i the loss then treats positive_j == positive_i as an in-batch negative: the
# target column and the "negative" column hold identical scores, the softmax target can never exceed 1/2, and the
# gradient pushes the anchor away from its own positive. Fix (maintainer): use the ``no_duplicates`` batch sampler
# (BatchSamplers.NO_DUPLICATES) so no text occurs twice in a batch.


class _MeanPoolEncoder(nn.Module):
    """Sentence-transformers style bi-encoder: tiny BERT + mean pooling over the attention mask."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import BertModel

        self.bert = BertModel(_bert_config(), add_pooling_layer=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = (ids != 0).float()
        h = self.bert(input_ids=ids, attention_mask=mask.long()).last_hidden_state
        return (h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)


def _c01_texts() -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen(1101)
    anchors = torch.randint(3, 40, (6, 7), generator=g)
    corpus = torch.randint(3, 40, (8, 7), generator=g)
    return anchors, corpus


_C01_ANCHORS, _C01_CORPUS = _c01_texts()
# the pairs' positives: with duplicates the batch sampler lets passage 0 and passage 1 appear twice each
_C01_POS_BUG = torch.tensor([0, 1, 2, 0, 3, 1])
_C01_POS_FIX = torch.tensor([0, 1, 2, 4, 3, 5])  # no_duplicates: the duplicate pairs are deferred, others fill in


def _mnrl(model: _MeanPoolEncoder, anchors: torch.Tensor, positives: torch.Tensor,
          reduce: bool = True) -> torch.Tensor:
    a = F.normalize(model(anchors), dim=-1)
    p = F.normalize(model(positives), dim=-1)
    scores = a @ p.t() * 20.0
    target = torch.arange(scores.shape[0])
    return F.cross_entropy(scores, target, reduction="mean" if reduce else "none")


def _c01_build(bug: bool) -> Case:
    """Bi-encoder trained with in-batch-negatives ranking loss on a batch of (anchor, positive) pairs."""
    torch.manual_seed(0)
    model = _MeanPoolEncoder().train()
    positives = _C01_CORPUS[_C01_POS_BUG if bug else _C01_POS_FIX]
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    step = _sgd_step(model, opt, lambda: _mnrl(model, _C01_ANCHORS, positives))
    return model, step, _kw(optimizer=opt, inputs=(_C01_ANCHORS, positives))


def _c01_proof(bug: bool) -> bool:
    """After 12 steps on the batch, some anchor's loss is still stuck at or above log 2: its own positive also sits
    in another column as a 'negative' with an identical score, so it can never be ranked first alone. The twin
    drives every row's loss well below log 2."""
    model, step, _ = _c01_build(bug)
    positives = _C01_CORPUS[_C01_POS_BUG if bug else _C01_POS_FIX]
    for _ in range(12):
        step()
    model.eval()
    with torch.no_grad():
        rows = _mnrl(cast(_MeanPoolEncoder, model), _C01_ANCHORS, positives, reduce=False)
    return bool(rows.max() >= torch.log(torch.tensor(2.0)) - 1e-4)


# --------------------------------------------------------------------------------------------- case-02
# codertimo/BERT-pytorch #49: BERT pre-training from scratch (masked LM + next-sentence prediction). The trainer
# uses one criterion, nn.NLLLoss(ignore_index=0), for both heads; ignore_index=0 is meant for the MLM labels (0 =
# not masked / pad) but it also drops every NSP example whose label is 0 ("not next"), so the NSP head only ever
# sees "is next" targets; NSP loss goes very low while NSP accuracy stays near 50%. Fix (thread, acknowledged by
# the author): use a separate criterion without ignore_index for next-sentence prediction.


class _BertPretrain(nn.Module):
    """BERT with an MLM head and an NSP head emitting log-probabilities, as in the repo's BERTLM."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import BertModel

        cfg = _bert_config()
        self.bert = BertModel(cfg)
        self.mlm = nn.Linear(cfg.hidden_size, cfg.vocab_size)
        self.nsp = nn.Linear(cfg.hidden_size, 2)

    def forward(self, ids: torch.Tensor, segs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.bert(input_ids=ids, token_type_ids=segs, attention_mask=(ids != 0).long())
        h = out.last_hidden_state
        return F.log_softmax(self.nsp(h[:, 0]), -1), F.log_softmax(self.mlm(h), -1)


def _c02_batch() -> dict[str, torch.Tensor]:
    g = _gen(1201)
    ids = torch.randint(4, 40, (8, 12), generator=g)
    ids[:, 0] = 1  # [CLS]
    segs = torch.zeros_like(ids)
    segs[:, 6:] = 1
    mask = torch.rand(ids.shape, generator=g) < 0.25
    mask[:, 0] = False
    mask[:, 1] = True  # at least one masked token per row
    bert_label = torch.where(mask, ids, torch.zeros_like(ids))  # 0 = not a prediction target
    bert_input = torch.where(mask, torch.full_like(ids, 3), ids)  # 3 = [MASK]
    is_next = torch.tensor([1, 0, 1, 0, 0, 1, 0, 1])
    return {"bert_input": bert_input, "segment_label": segs, "bert_label": bert_label, "is_next": is_next}


_C02_BATCH = _c02_batch()


def _c02_losses(model: _BertPretrain, bug: bool) -> tuple[torch.Tensor, torch.Tensor]:
    criterion = nn.NLLLoss(ignore_index=0)
    nsp_criterion = criterion if bug else nn.NLLLoss()
    b = _C02_BATCH
    next_out, mlm_out = model(b["bert_input"], b["segment_label"])
    next_loss = nsp_criterion(next_out, b["is_next"])
    mask_loss = criterion(mlm_out.transpose(1, 2), b["bert_label"])
    return next_loss, mask_loss


def _c02_build(bug: bool) -> Case:
    """BERT pre-training step: NSP loss + MLM loss, both through the trainer's NLLLoss criterion."""
    torch.manual_seed(0)
    model = _BertPretrain().train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.999), weight_decay=0.01)

    def loss_fn() -> torch.Tensor:
        next_loss, mask_loss = _c02_losses(model, bug)
        return next_loss + mask_loss

    step = _sgd_step(model, opt, loss_fn)
    return model, step, _kw(optimizer=opt, inputs=(_C02_BATCH["bert_input"], _C02_BATCH["segment_label"]))


def _c02_proof(bug: bool) -> bool:
    """The NSP loss gives exactly zero gradient to the NSP log-probs of every 'not next' (label 0) example."""
    model, _, _ = _c02_build(bug)
    b = _C02_BATCH
    next_out, _ = model(b["bert_input"], b["segment_label"])
    next_out.retain_grad()
    nsp_criterion = nn.NLLLoss(ignore_index=0) if bug else nn.NLLLoss()
    nsp_criterion(next_out, b["is_next"]).backward()
    assert next_out.grad is not None
    neg = b["is_next"] == 0
    return float(next_out.grad[neg].abs().sum()) == 0.0


# --------------------------------------------------------------------------------------------- case-03
# jxiw/MambaInLlama #11: distilling a Llama teacher into a student LM with a token-level KL term computed as
# F.kl_div(log_softmax(student_logits), teacher_probs, reduction='batchmean') over every position of the padded
# batch, although the pseudo-labels mark prompt and padding positions with -100. The student is thus also trained
# to match the teacher on positions that should be ignored (padding, prompt). Fix (agreed by the maintainer): use
# the -100 positions of the labels as a mask and compute the KL only on the remaining tokens.


_C03_IDS = torch.randint(3, 40, (3, 12), generator=_gen(1301))
_C03_LABELS = _C03_IDS.clone()
_C03_LABELS[:, :4] = -100  # prompt
_C03_IDS[1, 9:] = 0  # right padding on rows 1 and 2
_C03_IDS[2, 7:] = 0
_C03_LABELS[1, 9:] = -100
_C03_LABELS[2, 7:] = -100
_C03_ATTN = (_C03_IDS != 0).long()


def _c03_models() -> tuple[nn.Module, nn.Module]:
    from transformers import LlamaForCausalLM

    torch.manual_seed(1)
    teacher = LlamaForCausalLM(_llama_config(hidden_size=48, intermediate_size=96, num_hidden_layers=3)).eval()
    teacher.requires_grad_(False)
    torch.manual_seed(0)
    student = LlamaForCausalLM(_llama_config(num_hidden_layers=1)).train()
    return teacher, student


def _c03_kd_loss(student: nn.Module, teacher: nn.Module, bug: bool) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        t_logits = teacher(input_ids=_C03_IDS, attention_mask=_C03_ATTN).logits
    s_logits = student(input_ids=_C03_IDS, attention_mask=_C03_ATTN).logits
    s_logits.retain_grad()
    targets = F.softmax(t_logits, dim=-1)
    if bug:
        kl = F.kl_div(F.log_softmax(s_logits, dim=-1), targets, reduction="batchmean")
    else:
        keep = _C03_LABELS != -100
        kl = F.kl_div(F.log_softmax(s_logits[keep], dim=-1), targets[keep], reduction="batchmean")
    return kl, s_logits


def _c03_build(bug: bool) -> Case:
    """Logit distillation of a Llama student from a frozen Llama teacher on a padded batch with -100 labels."""
    teacher, student = _c03_models()
    opt = torch.optim.AdamW(student.parameters(), lr=1e-3)
    step = _sgd_step(student, opt, lambda: _c03_kd_loss(student, teacher, bug)[0])
    return student, step, _kw(optimizer=opt, inputs={"input_ids": _C03_IDS, "attention_mask": _C03_ATTN,
                                                      "labels": _C03_LABELS})


def _c03_proof(bug: bool) -> bool:
    """The distillation loss sends gradient into the student's logits at positions labelled -100 (prompt and
    padding); in the fixed twin those positions get exactly zero gradient."""
    teacher, student = _c03_models()
    kl, s_logits = _c03_kd_loss(student, teacher, bug)
    kl.backward()
    assert s_logits.grad is not None
    ignored = _C03_LABELS == -100
    return float(s_logits.grad[ignored].abs().sum()) > 0.0


# --------------------------------------------------------------------------------------------- case-04
# huggingface/notebooks #250: the token-classification notebook's tokenize_and_align_labels, with
# label_all_tokens=True, copies the word's label to every sub-word token, so the second piece of a "B-ORG" word is
# also labelled "B-ORG": the model is trained that an entity starts again inside a word (two entities where there
# is one). Fix (as in run_ner.py): map a B- label to its I- label (b_to_i_label) for the non-first sub-tokens.

_C04_LABELS = ["O", "B-ORG", "I-ORG", "B-PER", "I-PER"]
_C04_B_TO_I = [0, 2, 2, 4, 4]
_C04_WORDS = [["huggingface", "is", "in", "paris"], ["clement", "delangue", "leads", "huggingface"]]
_C04_TAGS = [[1, 0, 0, 0], [3, 4, 0, 1]]
_C04_VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hugging", "##face", "is", "in", "paris", "clem",
              "##ent", "del", "##ang", "##ue", "leads"]


def _c04_tokenizer() -> Any:
    """A real fast WordPiece BERT tokenizer over a vocabulary built in code."""
    from transformers import BertTokenizerFast  # type: ignore[attr-defined]

    return BertTokenizerFast(vocab={w: i for i, w in enumerate(_C04_VOCAB)}, do_lower_case=True)


def _c04_encode(bug: bool) -> dict[str, torch.Tensor]:
    """The notebook's tokenize_and_align_labels (label_all_tokens=True), with or without b_to_i_label."""
    tok = _c04_tokenizer()
    enc = tok(_C04_WORDS, is_split_into_words=True, padding=True, return_tensors="pt")
    all_labels = []
    for i, tags in enumerate(_C04_TAGS):
        word_ids = enc.word_ids(batch_index=i)
        prev = None
        row = []
        for w in word_ids:
            if w is None:
                row.append(-100)
            elif w != prev:
                row.append(tags[w])
            else:
                row.append(tags[w] if bug else _C04_B_TO_I[tags[w]])
            prev = w
        all_labels.append(row)
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
            "labels": torch.tensor(all_labels)}


def _c04_build(bug: bool) -> Case:
    """BERT token classification (NER) fine-tuning on sub-word-aligned BIO labels."""
    from transformers import BertForTokenClassification

    torch.manual_seed(0)
    batch = _c04_encode(bug)
    model = BertForTokenClassification(_bert_config(vocab_size=len(_C04_VOCAB), num_labels=len(_C04_LABELS))).train()
    opt = torch.optim.AdamW(model.parameters(), lr=5e-4)
    step = _sgd_step(model, opt, lambda: model(**batch).loss)
    return model, step, _kw(optimizer=opt, inputs=batch)


def _c04_proof(bug: bool) -> bool:
    """A sub-word token that continues a word is labelled B- (an entity beginning inside a word)."""
    tok = _c04_tokenizer()
    enc = tok(_C04_WORDS, is_split_into_words=True, padding=True)
    labels = _c04_encode(bug)["labels"]
    for i in range(len(_C04_WORDS)):
        word_ids = enc.word_ids(batch_index=i)
        for j in range(1, len(word_ids)):
            continues = word_ids[j] is not None and word_ids[j] == word_ids[j - 1]
            if continues and _C04_LABELS[int(labels[i, j])].startswith("B-"):
                return True
    return False


# --------------------------------------------------------------------------------------------- case-05
# huggingface/transformers #11155: after a refactor of DataCollatorForLanguageModeling the three lines that zero
# the masking probability on padding positions were dropped, so with padded batches [PAD] tokens are picked for
# masking: they become [MASK]/random tokens in the input and prediction targets ([PAD]) in the labels, and the MLM
# loss trains the model to predict padding. Fix (the and the follow-up PR's): restore
# ``probability_matrix.masked_fill_(labels.eq(tokenizer.pad_token_id), value=0.0)``.

_C05_PAD, _C05_CLS, _C05_SEP, _C05_MASK = 0, 1, 2, 3


def _c05_padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen(1501)
    lens = [14, 9, 6, 5]
    ids = torch.zeros(4, 16, dtype=torch.long)
    special = torch.zeros(4, 16, dtype=torch.bool)
    for i, n in enumerate(lens):
        ids[i, 0] = _C05_CLS
        ids[i, 1:n - 1] = torch.randint(4, 40, (n - 2,), generator=g)
        ids[i, n - 1] = _C05_SEP
        special[i, 0] = special[i, n - 1] = True
    return ids, special


def _c05_mask_tokens(ids: torch.Tensor, special: torch.Tensor, bug: bool,
                     g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """DataCollatorForLanguageModeling.mask_tokens (special_tokens_mask given by the tokenizer, pads not in it)."""
    labels = ids.clone()
    inputs = ids.clone()
    prob = torch.full(labels.shape, 0.15)
    prob.masked_fill_(special, value=0.0)
    if not bug:
        prob.masked_fill_(labels.eq(_C05_PAD), value=0.0)
    masked = torch.bernoulli(prob, generator=g).bool()
    labels[~masked] = -100
    replaced = torch.bernoulli(torch.full(labels.shape, 0.8), generator=g).bool() & masked
    inputs[replaced] = _C05_MASK
    rand = torch.bernoulli(torch.full(labels.shape, 0.5), generator=g).bool() & masked & ~replaced
    inputs[rand] = torch.randint(40, labels.shape, generator=g)[rand]
    return inputs, labels


def _c05_collate(bug: bool) -> dict[str, torch.Tensor]:
    ids, special = _c05_padded_batch()
    inputs, labels = _c05_mask_tokens(ids, special, bug, _gen(1502))
    return {"input_ids": inputs, "attention_mask": (ids != _C05_PAD).long(), "labels": labels}


def _c05_build(bug: bool) -> Case:
    """Masked-LM training of a tiny BERT on a padded batch produced by the MLM data collator."""
    from transformers import BertForMaskedLM

    torch.manual_seed(0)
    batch = _c05_collate(bug)
    model = BertForMaskedLM(_bert_config()).train()
    opt = torch.optim.AdamW(model.parameters(), lr=5e-4)
    step = _sgd_step(model, opt, lambda: model(**batch).loss)
    return model, step, _kw(optimizer=opt, inputs=batch)


def _c05_proof(bug: bool) -> bool:
    """The collated batch asks the MLM head to predict [PAD] at padding positions (labels == pad id there)."""
    ids, _ = _c05_padded_batch()
    labels = _c05_collate(bug)["labels"]
    pad = ids == _C05_PAD
    return bool((labels[pad] == _C05_PAD).any())


CASES: list[BlindCase] = [
    BlindCase("b20-case-01", "https://github.com/huggingface/sentence-transformers/issues/3189",
              "in-batch negatives / duplicate positives",
              "A ranking-loss batch holds the same passage as positive for two anchors, so each anchor's own positive "
              "is also an in-batch negative and its loss can never fall below log 2.", _c01_build, _c01_proof),
    BlindCase("b20-case-02", "https://github.com/codertimo/BERT-pytorch/issues/49", "loss ignore_index",
              "One NLLLoss(ignore_index=0) serves both MLM and NSP, so every 'not next' NSP example (label 0) is "
              "ignored and the NSP head never learns the negative class.", _c02_build, _c02_proof),
    BlindCase("b20-case-03", "https://github.com/jxiw/MambaInLlama/issues/11", "distillation loss mask",
              "The token-level KL distillation term is computed over prompt and padding positions that the labels "
              "mark -100, so the student is trained on positions that should be ignored.", _c03_build, _c03_proof),
    BlindCase("b20-case-04", "https://github.com/huggingface/notebooks/issues/250", "label alignment (BIO)",
              "Sub-word label alignment copies B- tags to continuation pieces, so the NER model is taught that an "
              "entity begins again inside a word.", _c04_build, _c04_proof,
              known_miss="B- tags copied to continuation sub-words: what a tag should be inside a word is label semantics the batch does not carry"),
    BlindCase("b20-case-05", "https://github.com/huggingface/transformers/issues/11155", "MLM collator / padding",
              "The MLM collator no longer excludes padding from masking, so [PAD] positions become prediction "
              "targets and the masked-LM loss trains the model to predict padding.", _c05_build, _c05_proof),
]
