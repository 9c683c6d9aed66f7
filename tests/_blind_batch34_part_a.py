"""Blind batch 34 (part a): silent transformer training bugs from public GitHub threads, each with its fixed twin.

Collected by someone who does not write the audit's checks. Every case builds the user's setup on a tiny model
(transformers BERT, GPT-2, RoBERTa with a peft LoRA adapter, a BERT2BERT encoder-decoder and OPT, all from tiny
configs in code; nothing is downloaded) and proves the bug without the audit on real tensors and real steps.
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw


def _bert_config(**kw):
    from transformers import BertConfig

    base = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
            "intermediate_size": 64, "max_position_embeddings": 32, "pad_token_id": 0, "hidden_dropout_prob": 0.0,
            "attention_probs_dropout_prob": 0.0}
    base.update(kw)
    return BertConfig(**base)


# --------------------------------------------------------------------------------------------- case-01
# allenai/allennlp issue #2927 (fixed by PR #2932): `BertForClassification(trainable=False)` is meant to freeze the
# pretrained BERT and train only the final linear layer. The model did `self.bert_model.requires_grad = trainable`,
# which only sets a plain Python attribute on the nn.Module: no parameter's requires_grad changes. The trainer builds
# its optimizer from every parameter with requires_grad=True, so the whole BERT is fine-tuned anyway. Nothing errors
# and the loss falls (faster, even); the only trace is the "Number of trainable parameters" log line. Fix in the PR:
# loop over `self.bert_model.parameters()` and set `param.requires_grad = trainable` on each.

_C01_IDS = torch.randint(3, 60, (4, 12), generator=_gen(3401))
_C01_MASK = torch.ones_like(_C01_IDS)
_C01_MASK[2, 9:] = 0
_C01_IDS = _C01_IDS * _C01_MASK
_C01_Y = torch.randint(0, 3, (4,), generator=_gen(3402))


class _BertForClassification(nn.Module):
    """allennlp's BertForClassification: BERT's pooled output, dropout, one linear layer."""

    def __init__(self, num_labels: int, trainable: bool, bug: bool) -> None:
        super().__init__()
        from transformers import BertModel

        self.bert_model = BertModel(_bert_config())
        if bug:
            self.bert_model.requires_grad = trainable
        else:
            for param in self.bert_model.parameters():
                param.requires_grad = trainable
        self._dropout = nn.Dropout(p=0.0)
        self._classification_layer = nn.Linear(self.bert_model.config.hidden_size, num_labels)

    def forward(self, input_ids: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        input_mask = (input_ids != 0).long()
        pooled = self.bert_model(input_ids=input_ids, attention_mask=input_mask).pooler_output
        logits = self._classification_layer(self._dropout(pooled))
        return F.cross_entropy(logits, label.long().view(-1))


def _c01_setup(bug: bool):
    torch.manual_seed(0)
    model = _BertForClassification(num_labels=3, trainable=False, bug=bug).train()
    # allennlp's Trainer: the optimizer gets the parameters that require grad
    params = [p for _, p in model.named_parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=1e-3)
    batch = {"input_ids": _C01_IDS, "label": _C01_Y}

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = model(**batch)
        loss.backward()
        opt.step()
        return loss

    return model, opt, step, batch


def _c01_build(bug: bool) -> Case:
    model, opt, step, batch = _c01_setup(bug)
    return model, step, _kw(optimizer=opt, inputs=batch)


def _c01_proof(bug: bool) -> bool:
    """With trainable=False, does a BERT weight still move after two steps?"""
    model, _, step, _ = _c01_setup(bug)
    w = model.bert_model.encoder.layer[0].attention.self.query.weight
    before = w.detach().clone()
    step()
    step()
    return bool((w.detach() - before).abs().max() > 1e-7)


# --------------------------------------------------------------------------------------------- case-02
# huggingface/transformers PR #3532: in the language-model fine-tuning example (run_language_modeling.py, formerly
# run_lm_finetuning.py) `train()` built the AdamW parameter groups and the linear warmup scheduler first and only then
# called `model.resize_token_embeddings(len(tokenizer))`. When the tokenizer has added tokens the resize creates a new
# embedding Parameter (and re-ties the LM head to it), so the optimizer keeps the old, orphaned matrix and never
# updates the one the model uses. The rest of the model trains and the loss falls; the token embeddings and the tied
# LM head just never move. Fix in the PR: resize the embeddings before the optimizer is created.

_C02_VOCAB = 48
_C02_LEN_TOKENIZER = 50  # two tokens added to the tokenizer
_C02_IDS = torch.randint(0, _C02_LEN_TOKENIZER, (4, 12), generator=_gen(3411))


def _c02_resize_token_embeddings(model: nn.Module, new_num_tokens: int) -> None:
    """transformers 2.x `resize_token_embeddings`: a new nn.Embedding with the old rows copied, set on the model and
    re-tied to the LM head (today's transformers resizes the Parameter in place, which hides the bug)."""
    old = model.get_input_embeddings()
    new = nn.Embedding(new_num_tokens, old.weight.shape[1])
    model._init_weights(new)
    n = min(old.weight.shape[0], new_num_tokens)
    new.weight.data[:n, :] = old.weight.data[:n, :]
    model.set_input_embeddings(new)
    model.config.vocab_size = new_num_tokens
    model.tie_weights()


def _c02_setup(bug: bool):
    from transformers import GPT2Config, GPT2LMHeadModel, get_linear_schedule_with_warmup

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=_C02_VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(cfg).train()

    def make_opt():
        no_decay = ["bias", "LayerNorm.weight"]
        groups = [
            {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
             "weight_decay": 0.0},
            {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
             "weight_decay": 0.0},
        ]
        opt = torch.optim.AdamW(groups, lr=1e-3, eps=1e-8)
        return opt, get_linear_schedule_with_warmup(opt, num_warmup_steps=0, num_training_steps=100)

    if bug:
        opt, sched = make_opt()
        _c02_resize_token_embeddings(model, _C02_LEN_TOKENIZER)
    else:
        _c02_resize_token_embeddings(model, _C02_LEN_TOKENIZER)
        opt, sched = make_opt()
    model.zero_grad()
    batch = {"input_ids": _C02_IDS, "labels": _C02_IDS}

    def step() -> torch.Tensor:
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        model.zero_grad()
        return loss

    return model, opt, sched, step, batch


def _c02_build(bug: bool) -> Case:
    model, opt, sched, step, batch = _c02_setup(bug)
    return model, step, _kw(optimizer=opt, lr_scheduler=sched, inputs=batch, total_steps=100)


def _c02_proof(bug: bool) -> bool:
    """After two steps, is the (resized, tied) token embedding the model uses still exactly where it started?"""
    model, _, _, step, _ = _c02_setup(bug)
    wte = model.transformer.wte.weight
    before = wte.detach().clone()
    step()
    step()
    return bool(torch.equal(wte.detach(), before))


# --------------------------------------------------------------------------------------------- case-03
# huggingface/blog issue #1824: the "LoRA for sequence classification with RoBERTa/Llama/Mistral" blog wraps the
# classifier with peft LoRA (task_type=SEQ_CLS, r=2, alpha=16, so the classification head is a fully trained
# modules_to_save copy) and trains with `gradient_checkpointing=True`, which then meant torch's reentrant checkpoint.
# Every transformer block is checkpointed, and with the embeddings frozen no block input requires grad, so the
# reentrant checkpoint returns outputs detached from the LoRA weights inside the block: the LoRA matrices never get a
# gradient and stay at their init, only the classifier head is trained. The loss still falls (the head learns) and the
# run is even faster. Fix from the thread: enable checkpointing with `gradient_checkpointing_kwargs={"use_reentrant":
# False}` (the non-reentrant checkpoint does not need a grad-requiring input). transformers of that time enabled
# checkpointing as `_set_gradient_checkpointing(enable=True, gradient_checkpointing_func=partial(checkpoint, **kwargs))`
# without registering the input-grad hook for a get_peft_model model; the setup does the same (dropouts at 0 here,
# the blog's lora_dropout=0.1, only to keep the steps deterministic).

_C03_IDS = torch.randint(3, 64, (4, 12), generator=_gen(3421))
_C03_MASK = torch.ones_like(_C03_IDS)
_C03_MASK[1, 8:] = 0
_C03_IDS = _C03_IDS.masked_fill(_C03_MASK == 0, 1)  # RoBERTa pad id 1
_C03_Y = torch.tensor([0, 1, 0, 1])
_C03_CLASS_WEIGHTS = torch.tensor([0.6, 0.4])


def _c03_setup(bug: bool):
    from peft import LoraConfig, TaskType, get_peft_model
    from torch.utils.checkpoint import checkpoint
    from transformers import RobertaConfig, RobertaForSequenceClassification, get_constant_schedule_with_warmup

    torch.manual_seed(0)
    cfg = RobertaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=40, pad_token_id=1, bos_token_id=0,
                        eos_token_id=2, type_vocab_size=1, num_labels=2, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    base = RobertaForSequenceClassification(cfg)
    model = get_peft_model(base, LoraConfig(task_type=TaskType.SEQ_CLS, r=2, lora_alpha=16, lora_dropout=0.0,
                                            bias="none"))
    # TrainingArguments(gradient_checkpointing=True): the Trainer enables checkpointing on the model
    gc_kwargs = {"use_reentrant": True} if bug else {"use_reentrant": False}
    model.get_base_model()._set_gradient_checkpointing(
        enable=True, gradient_checkpointing_func=functools.partial(checkpoint, **gc_kwargs))
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, weight_decay=0.001)
    sched = get_constant_schedule_with_warmup(opt, num_warmup_steps=0)
    batch = {"input_ids": _C03_IDS, "attention_mask": _C03_MASK, "labels": _C03_Y}

    def step() -> torch.Tensor:
        opt.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "None of the inputs have requires_grad=True" (the user saw it too)
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        loss = F.cross_entropy(logits, batch["labels"], weight=_C03_CLASS_WEIGHTS)  # WeightedCELossTrainer
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.3)
        opt.step()
        sched.step()
        return loss

    return model, opt, sched, step, batch


def _c03_build(bug: bool) -> Case:
    model, opt, sched, step, batch = _c03_setup(bug)
    return model, step, _kw(optimizer=opt, lr_scheduler=sched, inputs=batch)


def _c03_proof(bug: bool) -> bool:
    """After two steps, are all LoRA matrices still exactly at their init while the classifier head has moved?"""
    model, _, _, step, _ = _c03_setup(bug)
    lora = {n: p for n, p in model.named_parameters() if "lora_" in n}
    head = {n: p for n, p in model.named_parameters() if "modules_to_save" in n and p.requires_grad}
    lora0 = {n: p.detach().clone() for n, p in lora.items()}
    head0 = {n: p.detach().clone() for n, p in head.items()}
    step()
    step()
    lora_frozen = all(torch.equal(p.detach(), lora0[n]) for n, p in lora.items())
    head_moved = any(not torch.equal(p.detach(), head0[n]) for n, p in head.items())
    return bool(lora_frozen and head_moved)


# --------------------------------------------------------------------------------------------- case-04
# huggingface/transformers issue #4293 (fixed by PR #4680): `EncoderDecoderModel.from_encoder_decoder_pretrained(
# "bert-base-uncased", "bert-base-uncased")` built the decoder from the plain BERT config and only afterwards set
# `decoder.config.is_decoder = True`. The layers had already been built as encoder layers, so the decoder has no
# cross-attention at all (and no causal mask): it never looks at the encoder output. Bert2Bert training runs and the
# loss falls (the decoder learns a target-side LM, even peeking at later target tokens), but the summary does not
# depend on the source and the encoder gets no gradient. The maintainer confirmed ("Training with the
# EncoderDecoderModel before this PR did not work because there were no cross attention layers") and fixed it by
# building the decoder from a config with is_decoder=True (and, from PR #6377 on, add_cross_attention=True).

_C04_SRC = torch.randint(3, 64, (4, 10), generator=_gen(3431))
_C04_SRC_OTHER = torch.randint(3, 64, (4, 10), generator=_gen(3432))
_C04_TGT = torch.randint(3, 64, (4, 8), generator=_gen(3433))


def _c04_model(bug: bool):
    from transformers import BertLMHeadModel, BertModel, EncoderDecoderModel

    torch.manual_seed(0)
    encoder = BertModel(_bert_config(), add_pooling_layer=False)
    if bug:
        decoder = BertLMHeadModel(_bert_config())
        decoder.config.is_decoder = True
    else:
        decoder = BertLMHeadModel(_bert_config(is_decoder=True, add_cross_attention=True))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = EncoderDecoderModel(encoder=encoder, decoder=decoder)
    model.config.decoder_start_token_id = 2
    model.config.pad_token_id = 0
    return model.train()


def _c04_build(bug: bool) -> Case:
    model = _c04_model(bug)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-4)
    batch = {"input_ids": _C04_SRC, "attention_mask": torch.ones_like(_C04_SRC), "labels": _C04_TGT}

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=batch)


def _c04_proof(bug: bool) -> bool:
    """Is the decoder's output exactly the same for two different source sentences (the encoder is ignored)?"""
    model = _c04_model(bug)
    with torch.no_grad():
        a = model(input_ids=_C04_SRC, labels=_C04_TGT).logits
        b = model(input_ids=_C04_SRC_OTHER, labels=_C04_TGT).logits
    return bool(torch.equal(a, b))


# --------------------------------------------------------------------------------------------- case-05
# deepspeedai/DeepSpeedExamples PR #819 (DeepSpeed-Chat step 1, supervised fine-tuning): each prompt+answer is
# tokenized with padding="max_length" and PromptDataset returns `labels = input_ids`, pad tokens included (OPT's pad id
# 1). The model's causal-LM loss therefore trains every position after the answer to predict <pad>: most of each row
# is padding, the loss falls quickly (pads are easy) and looks healthy while the answer tokens get a small share of the
# gradient. Fix in the PR (approved by the maintainers): set the labels of padded positions (attention_mask == 0) to
# -100 so CrossEntropyLoss ignores them.

_C05_MAXLEN = 16
_C05_LENS = [9, 12, 6, 16]
_C05_IDS = torch.randint(3, 64, (4, _C05_MAXLEN), generator=_gen(3441))
_C05_IDS[:, 0] = 2  # OPT's tokenizer starts every sequence with </s>
_C05_MASK = (torch.arange(_C05_MAXLEN)[None, :] < torch.tensor(_C05_LENS)[:, None]).long()
_C05_IDS = _C05_IDS.masked_fill(_C05_MASK == 0, 1)  # pad id 1, right padding


def _c05_labels(bug: bool) -> torch.Tensor:
    if bug:
        return _C05_IDS.clone()
    return _C05_IDS.masked_fill(_C05_MASK == 0, -100)


def _c05_model():
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    cfg = OPTConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=2,
                    max_position_embeddings=32, word_embed_proj_dim=32, pad_token_id=1, bos_token_id=2,
                    eos_token_id=2, dropout=0.0, attention_dropout=0.0)
    return OPTForCausalLM(cfg).train()


def _c05_build(bug: bool) -> Case:
    from transformers import get_scheduler

    model = _c05_model()
    no_decay = ["bias", "layer_norm.weight"]
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.95))
    sched = get_scheduler("cosine", optimizer=opt, num_warmup_steps=0, num_training_steps=100)
    batch = {"input_ids": _C05_IDS, "attention_mask": _C05_MASK, "labels": _c05_labels(bug)}

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = model(**batch, use_cache=False).loss
        loss.backward()
        opt.step()
        sched.step()
        return loss

    return model, step, _kw(optimizer=opt, lr_scheduler=sched, inputs=batch, total_steps=100)


def _c05_proof(bug: bool) -> bool:
    """Does the training loss change when the padded positions are excluded, i.e. do pad labels carry loss?"""
    model = _c05_model()
    with torch.no_grad():
        used = model(input_ids=_C05_IDS, attention_mask=_C05_MASK, labels=_c05_labels(bug)).loss
        real_only = model(input_ids=_C05_IDS, attention_mask=_C05_MASK,
                          labels=_C05_IDS.masked_fill(_C05_MASK == 0, -100)).loss
    return bool((used - real_only).abs() > 1e-6)


CASES: list[BlindCase] = [
    BlindCase("b34a-01", "https://github.com/allenai/allennlp/issues/2927", "freeze flag set on module",
              "trainable=False sets a plain attribute on the BERT module instead of each parameter's requires_grad, "
              "so the supposedly frozen BERT is fine-tuned with the classifier.", _c01_build, _c01_proof),
    BlindCase("b34a-02", "https://github.com/huggingface/transformers/pull/3532", "embeddings resized after optimizer",
              "The token embeddings are resized after the optimizer is built, so the new (tied) embedding matrix is "
              "not in the optimizer and never trains.", _c02_build, _c02_proof),
    BlindCase("b34a-03", "https://github.com/huggingface/blog/issues/1824", "LoRA cut off by checkpointing",
              "Reentrant gradient checkpointing with frozen embeddings detaches every block's output from its LoRA "
              "weights, so only the classifier head trains.", _c03_build, _c03_proof),
    BlindCase("b34a-04", "https://github.com/huggingface/transformers/issues/4293", "decoder lacks cross-attention",
              "The Bert2Bert decoder is built as an encoder and flagged is_decoder afterwards, so it has no "
              "cross-attention and trains without ever seeing the source.", _c04_build, _c04_proof),
    BlindCase("b34a-05", "https://github.com/deepspeedai/DeepSpeedExamples/pull/819", "padding tokens in labels",
              "SFT labels are the max-length-padded input_ids, so every pad position is trained to predict the pad "
              "token.", _c05_build, _c05_proof),
]
