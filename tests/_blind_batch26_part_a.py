"""Blind batch 26 (part a): silent language-model training bugs from public GitHub threads, each with its fixed twin.

Collected by someone who does not write the audit's checks. Every case builds the user's setup on a tiny model
(hand-written GPT blocks, transformers BERT and Llama models from tiny configs in code, a real fast tokenizer over a
vocabulary built in code, real optimizers, schedulers and data collators; nothing is downloaded) and proves the bug
without the audit on real tensors and real steps.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw, _llama_config, _sgd_step

# --------------------------------------------------------------------------------------------- case-01
# NVIDIA/Megatron-LM PR #411 ("bug fix: when eval, dropout_p turns to 0 forever"; the same fix was carried to
# deepspeedai/Megatron-DeepSpeed PR #295): GPT pre-training with FlashSelfAttention and attention dropout, with the
# usual periodic validation pass in eval mode. The eval branch of FlashSelfAttention.forward wrote `self.dropout_p = 0`
# into the module, so after the first validation the attention dropout stays off for the rest of training, although
# model.train() is called again and every other dropout comes back. Nothing errors, the loss just trains without the
# configured regularisation. Fix in the PR: keep the attribute and pass `self.dropout_p if self.training else 0`.

class _FlashSelfAttention(nn.Module):
    """Megatron's FlashSelfAttention shape: dropout probability held on the module, causal attention."""

    def __init__(self, attention_dropout: float, bug: bool) -> None:
        super().__init__()
        self.dropout_p = attention_dropout
        self.bug = bug

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.bug:
            if not self.training:
                self.dropout_p = 0  # the bug: written into the module, never restored
            dropout_p = self.dropout_p
        else:
            dropout_p = self.dropout_p if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)


class _MegatronBlock(nn.Module):
    def __init__(self, d: int, heads: int, bug: bool) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.core = _FlashSelfAttention(0.3, bug)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.proj(self.core(q, k, v).transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class _MegatronGPT(nn.Module):
    def __init__(self, bug: bool, vocab: int = 40, d: int = 32, n_ctx: int = 16) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(n_ctx, d)
        self.blocks = nn.ModuleList([_MegatronBlock(d, 2, bug) for _ in range(2)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


_C01_TRAIN = torch.randint(0, 40, (4, 16), generator=_gen(2601))
_C01_VALID = torch.randint(0, 40, (4, 16), generator=_gen(2602))


def _c01_lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def _c01_build(bug: bool) -> Case:
    """Tiny GPT with flash-style attention dropout; one validation pass has run before this training step."""
    torch.manual_seed(0)
    model = _MegatronGPT(bug)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.eval()  # the periodic evaluate() of the training loop
    with torch.no_grad():
        _c01_lm_loss(model, _C01_VALID)
    model.train()
    step = _sgd_step(model, opt, lambda: _c01_lm_loss(model, _C01_TRAIN))
    return model, step, _kw(optimizer=opt, inputs=_C01_TRAIN)


def _c01_proof(bug: bool) -> bool:
    """Back in train mode after the validation pass, two forwards of the same batch agree: attention dropout is off."""
    model, _, _ = _c01_build(bug)
    torch.manual_seed(1)
    with torch.no_grad():
        a = model(_C01_TRAIN)
        b = model(_C01_TRAIN)
    return model.training and torch.allclose(a, b)

# --------------------------------------------------------------------------------------------- case-02
# shirley-wu/cross-doc-misinfo-detection issue #1: the training script builds
# `get_linear_schedule_with_warmup(optimizer, num_training_steps, num_warmup_steps)` positionally, with the two step
# counts swapped. The "warmup" then lasts the whole run and the learning rate rises linearly from 0 until the very last
# step instead of warming up for a few steps and decaying. Training still runs and the loss still falls, just under the
# wrong schedule. The author confirmed both this and a miscount of the steps and fixed the call to
# `num_warmup_steps=warmup, num_training_steps=total`.

_C02_TOTAL, _C02_WARMUP = 10, 1
_C02_IDS = torch.randint(5, 60, (4, 12), generator=_gen(2603))
_C02_Y = torch.tensor([0, 1, 1, 0])


def _bert_config(**kw: object) -> object:
    from transformers import BertConfig

    base: dict[str, object] = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
                               "intermediate_size": 64, "max_position_embeddings": 32, "num_labels": 2}
    base.update(kw)
    return BertConfig(**base)


def _c02_setup(bug: bool) -> tuple[nn.Module, torch.optim.Optimizer, object, dict[str, torch.Tensor]]:
    """BERT-style sequence classifier, AdamW and a linear warmup/decay schedule built with the step counts swapped."""
    from transformers import (
        BertForSequenceClassification,
        get_linear_schedule_with_warmup,
    )

    torch.manual_seed(0)
    model = BertForSequenceClassification(_bert_config()).train()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-4)
    if bug:
        sched = get_linear_schedule_with_warmup(opt, _C02_TOTAL, _C02_WARMUP)
    else:
        sched = get_linear_schedule_with_warmup(opt, num_warmup_steps=_C02_WARMUP, num_training_steps=_C02_TOTAL)
    batch = {"input_ids": _C02_IDS, "attention_mask": torch.ones_like(_C02_IDS), "labels": _C02_Y}
    return model, opt, sched, batch


def _c02_step(model: nn.Module, opt: torch.optim.Optimizer, sched: object,
              batch: dict[str, torch.Tensor]) -> Callable[[], torch.Tensor]:
    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        sched.step()  # type: ignore[attr-defined]
        return loss

    return step


def _c02_build(bug: bool) -> Case:
    model, opt, sched, batch = _c02_setup(bug)
    step = _c02_step(model, opt, sched, batch)
    return model, step, _kw(optimizer=opt, inputs=batch, lr_scheduler=sched, total_steps=_C02_TOTAL)


def _c02_proof(bug: bool) -> bool:
    """Over the configured run the learning rate is still climbing in the second half and peaks at the last step."""
    model, opt, sched, batch = _c02_setup(bug)
    step = _c02_step(model, opt, sched, batch)
    lrs = []
    for _ in range(_C02_TOTAL):
        lrs.append(opt.param_groups[0]["lr"])
        step()
    half = _C02_TOTAL // 2
    return lrs[-1] > lrs[half] and max(lrs) == lrs[-1]


# --------------------------------------------------------------------------------------------- case-03
# karpathy/minGPT issue #23 (PRs #16, #18; fixed in commit bbbdac7): the trainer split the parameters into decay and
# no-decay groups by name with `no_decay = ["bias", "LayerNorm.weight"]`, a list carried over from HuggingFace BERT.
# minGPT names its norms `ln1`, `ln2` and `ln_f`, so no LayerNorm weight matches and every LayerNorm gain is decayed
# towards zero by AdamW along with the Linear weights. Nothing errors and the loss trains. Fix in the commit: build the
# groups by module type, decaying only Linear weights and leaving biases, LayerNorm and Embedding weights undecayed.

class _MinGPTBlock(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.ln2 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        causal = torch.triu(torch.ones(t, t, dtype=torch.bool), 1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=causal, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class _MinGPT(nn.Module):
    def __init__(self, vocab: int = 40, d: int = 32, n_ctx: int = 16) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, d)
        self.pos_emb = nn.Parameter(torch.zeros(1, n_ctx, d))
        self.blocks = nn.Sequential(*[_MinGPTBlock(d, 2) for _ in range(2)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(ids) + self.pos_emb[:, : ids.shape[1]]
        return self.head(self.ln_f(self.blocks(x)))


def _c03_groups(model: nn.Module, bug: bool, weight_decay: float) -> list[dict[str, object]]:
    if bug:  # the trainer's name-based split
        no_decay = ["bias", "LayerNorm.weight"]
        decay = [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)]
        nodecay = [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)]
    else:  # the fix: by module type
        decay_names = set()
        for mn, m in model.named_modules():
            for pn, _ in m.named_parameters(recurse=False):
                full = f"{mn}.{pn}" if mn else pn
                if pn.endswith("weight") and isinstance(m, (nn.Linear, nn.MultiheadAttention)):
                    decay_names.add(full)
        decay = [p for n, p in model.named_parameters() if n in decay_names]
        nodecay = [p for n, p in model.named_parameters() if n not in decay_names]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": nodecay, "weight_decay": 0.0}]


_C03_IDS = torch.randint(0, 40, (4, 16), generator=_gen(2604))


def _c03_build(bug: bool) -> Case:
    """minGPT with AdamW(weight_decay=0.1) over the trainer's decay / no-decay groups."""
    torch.manual_seed(0)
    model = _MinGPT().train()
    opt = torch.optim.AdamW(_c03_groups(model, bug, 0.1), lr=3e-4, betas=(0.9, 0.95))
    step = _sgd_step(model, opt, lambda: _c01_lm_loss(model, _C03_IDS))
    return model, step, _kw(optimizer=opt, inputs=_C03_IDS)


def _c03_proof(bug: bool) -> bool:
    """An AdamW step in which every gradient is zero still shrinks the LayerNorm gains: they are being decayed."""
    model, _, kw = _c03_build(bug)
    opt = kw["optimizer"]
    gains = [m.weight for m in model.modules() if isinstance(m, nn.LayerNorm)]
    before = [g.detach().clone() for g in gains]
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    return any(bool((g.detach() < b).all()) for g, b in zip(gains, before))


# --------------------------------------------------------------------------------------------- case-04
# huggingface/trl issue #1623 ("Learning to generate EOS tokens", opened by the maintainers after SFT models never
# learned to stop): a causal LM is fine-tuned with `tokenizer.pad_token = tokenizer.eos_token` and
# `DataCollatorForLanguageModeling(tokenizer, mlm=False)`. The collator turns every position whose token id is the pad
# id into -100 in the labels, and with pad == eos that includes each sequence's real EOS: the loss never has a target
# of EOS, so the model is never taught to stop. The loss looks normal. Fix (TRL's later SFT collator): mask the labels
# of the padding positions (attention mask 0) instead of every token equal to the pad id, so the real EOS stays a target.

_C04_TEXTS = ["w1 w2 w3", "w4 w5 w6 w7 w8 w9", "w10 w11", "w12 w13 w14 w15"]


def _c04_tokenizer() -> object:
    """A real fast tokenizer over a word vocabulary built in code: <unk>=0, <s>=1, </s>=2, w0..w36; BOS/EOS added."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(37)]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.post_processor = processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 2)])
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tok.pad_token = tok.eos_token  # the common recipe for a model without a pad token
    return tok


def _c04_batch(bug: bool) -> dict[str, torch.Tensor]:
    from transformers import DataCollatorForLanguageModeling

    tok = _c04_tokenizer()
    batch = dict(DataCollatorForLanguageModeling(tok, mlm=False)([tok(t) for t in _C04_TEXTS]))  # type: ignore[operator]
    if not bug:  # the fix: only padding positions are ignored
        batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    return batch


def _c04_build(bug: bool) -> Case:
    """Tiny Llama SFT step on the collated batch (right padding, pad token = EOS)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(_llama_config(pad_token_id=2)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = _c04_batch(bug)
    step = _sgd_step(model, opt, lambda: model(**batch).loss)
    return model, step, _kw(optimizer=opt, inputs=batch)


def _c04_proof(bug: bool) -> bool:
    """No label in the batch is EOS, although every sequence ends in a real (attended) EOS token."""
    batch = _c04_batch(bug)
    ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
    real_eos = (ids == 2) & (mask == 1)
    assert int(real_eos.sum()) == len(_C04_TEXTS)
    return not bool((labels[real_eos] == 2).any())

# --------------------------------------------------------------------------------------------- case-05
# EleutherAI/aria PR #40 ("Ignore padding loss while training"): the MIDI language model is pre-trained on batches of
# sequences right-padded to the context length, and the loss was `nn.CrossEntropyLoss()` over every position, so the
# padding targets (predict <P> after <P>) enter the mean: short sequences are dominated by trivially learnable padding,
# the reported loss is deflated and the gradient is spent on predicting padding. Silent: the loss falls quickly. Fix in
# the PR: exclude the padding targets from the loss, `nn.CrossEntropyLoss(ignore_index=pad_id)`.

_C05_PAD = 0
_C05_LENS = [16, 6, 10, 4]


def _c05_batch() -> torch.Tensor:
    g = _gen(2605)
    rows = []
    for n in _C05_LENS:
        row = torch.full((16,), _C05_PAD)
        row[:n] = torch.randint(3, 40, (n,), generator=g)
        rows.append(row)
    return torch.stack(rows)


_C05_IDS = _c05_batch()


def _c05_parts(bug: bool) -> tuple[nn.Module, torch.optim.Optimizer, nn.Module]:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(_llama_config()).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    crit = nn.CrossEntropyLoss() if bug else nn.CrossEntropyLoss(ignore_index=_C05_PAD)
    return model, opt, crit


def _c05_loss(model: nn.Module, crit: nn.Module, logits: torch.Tensor | None = None) -> torch.Tensor:
    src, tgt = _C05_IDS[:, :-1], _C05_IDS[:, 1:]
    if logits is None:
        logits = model(input_ids=src).logits
    return crit(logits.transpose(1, 2), tgt)


def _c05_build(bug: bool) -> Case:
    """Tiny Llama pre-training step on right-padded sequences with the trainer's own cross-entropy."""
    model, opt, crit = _c05_parts(bug)
    step = _sgd_step(model, opt, lambda: _c05_loss(model, crit))
    return model, step, _kw(optimizer=opt, inputs=_C05_IDS)


def _c05_proof(bug: bool) -> bool:
    """The loss has gradient at positions whose target is padding: the padding is being trained on."""
    model, _, crit = _c05_parts(bug)
    logits = model(input_ids=_C05_IDS[:, :-1]).logits.detach().requires_grad_(True)
    (grad,) = torch.autograd.grad(_c05_loss(model, crit, logits), logits)
    pad_target = _C05_IDS[:, 1:] == _C05_PAD
    return bool(grad[pad_target].abs().sum() > 0)


CASES: list[BlindCase] = [
    BlindCase("b26a-01", "https://github.com/NVIDIA/Megatron-LM/pull/411", "dropout switched off by an eval pass",
              "The flash attention module zeroes its own dropout probability on the first eval-mode forward, so after "
              "the first validation pass attention dropout stays off for the rest of training.", _c01_build, _c01_proof,
              known_miss="attention dropout zeroed by an eval pass, in the module's own attribute: a dropout probability that eval mode rewrites is not seen in one training step"),
    BlindCase("b26a-02", "https://github.com/shirley-wu/cross-doc-misinfo-detection/issues/1",
              "warmup and total steps swapped",
              "get_linear_schedule_with_warmup gets the total step count as warmup and the warmup count as the run "
              "length, so the learning rate rises from zero through the whole run instead of warming up and decaying.",
              _c02_build, _c02_proof),
    BlindCase("b26a-03", "https://github.com/karpathy/minGPT/issues/23", "weight decay on LayerNorm gains",
              "The no-decay list names HuggingFace's 'LayerNorm.weight', which matches none of minGPT's ln1/ln2/ln_f, "
              "so AdamW decays every LayerNorm gain towards zero along with the Linear weights.",
              _c03_build, _c03_proof),
    BlindCase("b26a-04", "https://github.com/huggingface/trl/issues/1623", "EOS masked out of the labels",
              "With pad_token = eos_token the language-modeling collator sets every EOS label to -100, so the loss "
              "never targets the real end-of-sequence token and the model never learns to stop.",
              _c04_build, _c04_proof),
    BlindCase("b26a-05", "https://github.com/EleutherAI/aria/pull/40", "padding targets in the loss",
              "The cross-entropy has no ignore_index, so right-padding targets of short sequences are averaged into "
              "the loss and trained on, deflating the loss and spending the gradient on predicting padding.",
              _c05_build, _c05_proof),
]
