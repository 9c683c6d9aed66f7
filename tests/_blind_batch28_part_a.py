"""Blind batch 28 (part a): silent language-model training bugs from public GitHub threads, each with its fixed twin.

Collected by someone who does not write the audit's checks. Every case builds the user's setup on a tiny model
(transformers Llama models from tiny configs in code, a real tokenizer and data collator over a vocabulary built in
code, a hand-written GPT; nothing is downloaded) and proves the bug without the audit on real tensors and real steps.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw, _llama_config, _sgd_step

_VOCAB = 40


def _llama(seed: int, **cfg: Any) -> nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(_llama_config(**cfg))


# --------------------------------------------------------------------------------------------- case-01
# huggingface/open-r1 PR #494 (issue #492): the SFT script sets `tokenizer.pad_token = tokenizer.eos_token` and trains
# with TRL's default language-modelling collator, which is transformers' DataCollatorForLanguageModeling(mlm=False).
# That collator copies input_ids to labels and sets every label equal to pad_token_id to -100, so with pad == eos the
# real end-of-turn token of every example is dropped from the loss as well. Training runs and the loss falls; the model
# just never learns to emit EOS and generates until max length. Fix in the PR: do not alias the pad token to EOS (keep
# the tokenizer's own, distinct pad token), so only the padding is masked and the EOS label is kept.

def _c01_tokenizer(bug: bool) -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "<|im_end|>": 2, **{f"w{i}": i for i in range(3, _VOCAB)}}
    raw = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w3"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="<|im_end|>", pad_token="<pad>")
    if bug:
        tok.pad_token = tok.eos_token  # the script's line
    return tok


def _c01_batch(bug: bool) -> dict[str, torch.Tensor]:
    from transformers import DataCollatorForLanguageModeling

    tok = _c01_tokenizer(bug)
    g = _gen(2801)
    texts = []
    for n in (9, 12, 6, 14):
        words = " ".join(f"w{int(i)}" for i in torch.randint(4, _VOCAB, (n,), generator=g))
        texts.append(f"<s> {words} <|im_end|>")
    collator = DataCollatorForLanguageModeling(tokenizer=tok, mlm=False)
    return collator([tok(t) for t in texts])


def _c01_build(bug: bool) -> Case:
    """Tiny Llama SFT step on a batch collated by DataCollatorForLanguageModeling(mlm=False)."""
    model = _llama(2801)
    model.train()
    batch = _c01_batch(bug)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = _sgd_step(model, opt, lambda: model(**batch).loss)
    return model, step, _kw(optimizer=opt, inputs=batch)


def _c01_proof(bug: bool) -> bool:
    """After a real step, back-propagate the SFT loss: does the position that should predict each real (attended) EOS
    token get any gradient? With pad = eos it gets none: the loss never asks for EOS."""
    model, step, kw = _c01_build(bug)
    step()
    batch = kw["inputs"]
    model.zero_grad()
    out = model(**batch)
    out.logits.retain_grad()
    out.loss.backward()
    real_eos = (batch["input_ids"] == 2) & (batch["attention_mask"] == 1)
    rows, cols = real_eos.nonzero(as_tuple=True)
    grad_at_eos = out.logits.grad[rows, cols - 1].abs().sum(-1)  # position t-1 predicts token t
    return bool((grad_at_eos == 0).any())


# --------------------------------------------------------------------------------------------- case-02
# alex-hh/profam PR #468 (and issue #495): documents are packed into one row (sequence packing, pack_to_max_tokens)
# and fed to the HF Llama model. The flag `pass_res_pos_in_doc_as_position_ids` defaulted to False, so the forward got
# no position_ids: the model sees one long causal sequence, the positions run on across document boundaries and every
# document attends to the documents packed before it. Training runs and the loss even looks better (later documents
# can copy from earlier ones). Fix in the PR: default to passing the document-relative position ids, from which the
# model builds the per-document (block-diagonal) causal mask.

_C02_DOCS = [[5, 7, 4], [6, 5, 5], [4, 4, 8]]  # document lengths inside each packed row of 16


def _c02_batch(seed: int = 2802) -> dict[str, torch.Tensor]:
    g = _gen(seed)
    ids, pos, labels = [], [], []
    for lengths in _C02_DOCS:
        row_ids, row_pos, row_lab = [], [], []
        for n in lengths:
            doc = [1] + torch.randint(3, _VOCAB, (n - 2,), generator=g).tolist() + [2]
            row_ids += doc
            row_pos += list(range(n))
            row_lab += [-100] + doc[1:]  # no target across the boundary into a new document
        ids.append(row_ids)
        pos.append(row_pos)
        labels.append(row_lab)
    return {"input_ids": torch.tensor(ids), "position_ids": torch.tensor(pos), "labels": torch.tensor(labels)}


def _c02_forward(model: nn.Module, batch: dict[str, torch.Tensor], bug: bool) -> Any:
    kw = {} if bug else {"position_ids": batch["position_ids"]}
    return model(input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False, **kw)


def _c02_build(bug: bool) -> Case:
    """Packed rows of three documents each (the batch holds the document-relative positions); the bug calls the model
    without them."""
    model = _llama(2802)
    model.train()
    batch = _c02_batch()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = _sgd_step(model, opt, lambda: _c02_forward(model, batch, bug).loss)
    return model, step, _kw(optimizer=opt, inputs=batch)


def _c02_proof(bug: bool) -> bool:
    """Change only the first document of each row: do the logits of the later documents move?"""
    model, step, _ = _c02_build(bug)
    step()
    model.eval()
    batch = _c02_batch()
    other = dict(batch)
    ids = batch["input_ids"].clone()
    g = _gen(99)
    for r, lengths in enumerate(_C02_DOCS):
        ids[r, 1:lengths[0] - 1] = torch.randint(3, _VOCAB, (lengths[0] - 2,), generator=g)
    other["input_ids"] = ids
    with torch.no_grad():
        a = _c02_forward(model, batch, bug).logits
        b = _c02_forward(model, other, bug).logits
    leak = max((a[r, lengths[0]:] - b[r, lengths[0]:]).abs().max().item() for r, lengths in enumerate(_C02_DOCS))
    return leak > 1e-5


# --------------------------------------------------------------------------------------------- case-03
# mosaicml/examples PR #11: the repo's GPT model (MosaicGPT) builds `transformer.wte` and a separate
# `lm_head = nn.Linear(d_model, vocab, bias=False)` and never ties them, although the GPT recipe it reproduces ties
# input embeddings and output projection (as GPT-2/OPT/BLOOM do through post_init). The reporter found
# `torch.sum(model.lm_head.weight - model.transformer.wte.weight) != 0`. Nothing fails: the model trains with an extra
# untied vocab x d_model matrix, the embedding never receives the output-side gradient. Fix (PR, implemented by the
# maintainers): `self.lm_head.weight = self.transformer.wte.weight`.

class _MosaicGPT(nn.Module):
    """A minimal GPT: token + learned position embedding, pre-LN causal blocks, LM head."""

    def __init__(self, tie: bool, vocab: int = _VOCAB, d: int = 32, n_layers: int = 2, max_len: int = 16) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict({
            "wte": nn.Embedding(vocab, d),
            "wpe": nn.Embedding(max_len, d),
            "blocks": nn.ModuleList([nn.TransformerEncoderLayer(d, 2, 64, dropout=0.0, batch_first=True,
                                                                norm_first=True) for _ in range(n_layers)]),
            "ln_f": nn.LayerNorm(d),
        })
        self.lm_head = nn.Linear(d, vocab, bias=False)
        if tie:
            self.lm_head.weight = self.transformer.wte.weight  # the fix

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[1]
        x = self.transformer.wte(input_ids) + self.transformer.wpe(torch.arange(t))
        mask = nn.Transformer.generate_square_subsequent_mask(t)
        for block in self.transformer.blocks:
            x = block(x, src_mask=mask, is_causal=True)
        return self.lm_head(self.transformer.ln_f(x))


_C03_IDS = torch.randint(0, _VOCAB, (4, 16), generator=_gen(2803))


def _c03_loss(model: nn.Module) -> torch.Tensor:
    logits = model(_C03_IDS)
    return F.cross_entropy(logits[:, :-1].reshape(-1, _VOCAB), _C03_IDS[:, 1:].reshape(-1))


def _c03_build(bug: bool) -> Case:
    torch.manual_seed(2803)
    model = _MosaicGPT(tie=not bug)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = _sgd_step(model, opt, lambda: _c03_loss(model))
    return model, step, _kw(optimizer=opt, inputs=_C03_IDS)


def _c03_proof(bug: bool) -> bool:
    """After a real step: is the output projection a different matrix from the input embedding?"""
    model, step, _ = _c03_build(bug)
    step()
    step()
    return not torch.equal(model.lm_head.weight, model.transformer.wte.weight)


# --------------------------------------------------------------------------------------------- case-04
# ServiceNow/Fast-LLM issue #542 (fixed by PR #545): parameters carry their own weight-decay flag, and the
# param-group builder puts every parameter whose flag is True into the decayed AdamW group. After a normalization
# refactor the RMSNorm/LayerNorm weights were created without `weight_decay=False`, fell back to the default True,
# and were decayed (0.01 by default) in every model. Nothing reports it: norm gains are slowly pulled toward 0. Fix:
# pass `weight_decay=False` for norm weights/biases (and other 1-D gains/biases) at creation. Reproduced on a tiny
# Llama whose parameters carry the same flag and a group builder written the same way.

def _c04_model(bug: bool) -> nn.Module:
    model = _llama(2804)
    for name, p in model.named_parameters():
        p.weight_decay = True  # ParameterConfig.get_parameter's default
        if not bug and "norm" in name:
            p.weight_decay = False  # the fix: norm weights are created with weight_decay=False
    return model


def _c04_optimizer(model: nn.Module, wd: float = 0.1, lr: float = 1e-3) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.weight_decay]
    no_decay = [p for p in model.parameters() if not p.weight_decay]
    groups = [{"params": decay, "weight_decay": wd}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


_C04_IDS = torch.randint(3, _VOCAB, (4, 16), generator=_gen(2804))


def _c04_build(bug: bool) -> Case:
    model = _c04_model(bug)
    model.train()
    opt = _c04_optimizer(model)
    step = _sgd_step(model, opt, lambda: model(input_ids=_C04_IDS, labels=_C04_IDS).loss)
    return model, step, _kw(optimizer=opt, inputs=_C04_IDS)


def _c04_proof(bug: bool) -> bool:
    """One optimizer step with zero gradients: does anything but weight decay move the norm gains? It cannot, so any
    change of an RMSNorm weight is decay applied to it."""
    model, step, _ = _c04_build(bug)
    step()
    opt = _c04_optimizer(model)
    norms = {n: p.detach().clone() for n, p in model.named_parameters() if "norm" in n}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    return any(not torch.equal(p, norms[n]) for n, p in model.named_parameters() if n in norms)


# --------------------------------------------------------------------------------------------- case-05
# EleutherAI/gpt-neox PR #1285: reward-model training reads each sequence's scalar reward from the per-token value
# head at the last position of the loss mask. That mask is the causal LM mask, aligned with the shifted labels (position
# t is on when token t+1 is real), so its last 1 sits one position before the EOS token: the reward was taken at the
# last content token, not at the EOS that the recipe scores. Training runs and the pairwise loss falls, but the reward
# is read where the model has not yet seen the end of the answer. Fix in the PR: take the index one further (the EOS
# position). Reproduced with a tiny Llama trunk and a scalar head, trained with the pairwise (Bradley-Terry) loss.

class _RewardModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from transformers import LlamaModel

        torch.manual_seed(2805)
        self.trunk = LlamaModel(_llama_config())
        self.v_head = nn.Linear(32, 1)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.trunk(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        return self.v_head(h).squeeze(-1)  # one value per token


def _c05_pairs() -> dict[str, torch.Tensor]:
    g = _gen(2805)
    rows, masks = [], []
    for n in (9, 12, 7, 10, 11, 8, 12, 6):  # chosen 0..3, rejected 4..7
        seq = [1] + torch.randint(3, _VOCAB, (n - 2,), generator=g).tolist() + [2]
        rows.append(seq + [0] * (12 - n))
        masks.append([1] * n + [0] * (12 - n))
    ids, att = torch.tensor(rows), torch.tensor(masks)
    loss_mask = torch.zeros_like(att)
    loss_mask[:, :-1] = att[:, 1:]  # causal LM mask: position t is on when token t+1 is real
    return {"input_ids": ids, "attention_mask": att, "loss_mask": loss_mask}


def _c05_end_index(batch: dict[str, torch.Tensor], bug: bool) -> torch.Tensor:
    last = batch["loss_mask"].sum(-1) - 1  # last position the mask covers
    return last if bug else last + 1  # the fix: one further, the EOS position


def _c05_rewards(model: nn.Module, batch: dict[str, torch.Tensor], bug: bool) -> torch.Tensor:
    values = model(batch["input_ids"], batch["attention_mask"])
    return values.gather(1, _c05_end_index(batch, bug)[:, None]).squeeze(1)


def _c05_loss(model: nn.Module, batch: dict[str, torch.Tensor], bug: bool) -> torch.Tensor:
    r = _c05_rewards(model, batch, bug)
    chosen, rejected = r[:4], r[4:]
    return -F.logsigmoid(chosen - rejected).mean()


def _c05_build(bug: bool) -> Case:
    model = _RewardModel()
    model.train()
    batch = _c05_pairs()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step = _sgd_step(model, opt, lambda: _c05_loss(model, batch, bug))
    return model, step, _kw(optimizer=opt, inputs=batch)


def _c05_proof(bug: bool) -> bool:
    """After a real step, replace each sequence's final EOS with another token: if the rewards do not move, they are
    read before the end of the sequence (a causal model's earlier positions cannot see it)."""
    model, step, kw = _c05_build(bug)
    step()
    model.eval()
    batch = kw["inputs"]
    other = dict(batch)
    ids = batch["input_ids"].clone()
    eos_pos = batch["attention_mask"].sum(-1) - 1
    ids[torch.arange(ids.shape[0]), eos_pos] = 7
    other["input_ids"] = ids
    with torch.no_grad():
        a = _c05_rewards(model, batch, bug)
        b = _c05_rewards(model, other, bug)
    return bool(torch.allclose(a, b, atol=0.0, rtol=0.0))


CASES: list[BlindCase] = [
    BlindCase("b28a-01", "https://github.com/huggingface/open-r1/pull/494", "EOS label masked (pad = eos)",
              "With the pad token aliased to EOS, the LM collator sets every EOS label to -100, so the model is "
              "never trained to end its answer.", _c01_build, _c01_proof),
    BlindCase("b28a-02", "https://github.com/alex-hh/profam/pull/468", "packed sequences without per-document positions",
              "Packed documents are fed without their document-relative position ids, so positions run on and each "
              "document attends to the documents packed before it.", _c02_build, _c02_proof,
              known_miss="documents packed into one row with no position_ids: nothing marks the packing (INPUT-012 reads packing from position ids that restart)"),
    BlindCase("b28a-03", "https://github.com/mosaicml/examples/pull/11", "LM head not tied to embeddings",
              "The GPT's lm_head is a separate matrix from the token embedding although the recipe ties them, so the "
              "two train apart and the embedding never gets the output-side gradient.", _c03_build, _c03_proof,
              known_miss="a hand-written GPT whose head is not tied to its embedding: nothing the model carries says the two should be tied"),
    BlindCase("b28a-04", "https://github.com/ServiceNow/Fast-LLM/issues/542", "weight decay on norm weights",
              "Norm weights are created with the default weight-decay flag, so the group builder decays the RMSNorm "
              "gains with AdamW.", _c04_build, _c04_proof,
              known_miss="norm gains decayed with no no-decay group at all: OPT-005 says so as INFO only (a run may decay them on purpose)"),
    BlindCase("b28a-05", "https://github.com/EleutherAI/gpt-neox/pull/1285", "reward read off by one (before EOS)",
              "The reward is gathered at the last position of the shifted causal loss mask, one token before the EOS, "
              "so the reward model scores a position that has not seen the end of the answer.", _c05_build, _c05_proof,
              known_miss="the reward read at the last content token instead of the EOS: both are real positions, and which one a score should be read at is not judged"),
]
