"""Blind batch 22 (part a): silent fine-tuning bugs from public threads on the Hugging Face stack, each with its
fixed twin.

Collected by someone who does not write the audit's checks. Every case builds the user's setup on a tiny real model
from a config in code (transformers GPT-2, Llama and BERT, PEFT LoRA, a word-level tokenizer built in code and the
transformers language-modelling collator; nothing is downloaded) and proves the bug without the audit on real runs
and real tensors.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw, _llama_config

# --------------------------------------------------------------------------------------------- shared helpers


def _gpt2(seed: int = 0) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=40, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return GPT2LMHeadModel(cfg)


def _seq_logps(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of the log-probabilities of the completion tokens (mask 1) of each row, as DPO computes them."""
    logits = model(input_ids=ids, use_cache=False).logits[:, :-1]
    tgt, m = ids[:, 1:], mask[:, 1:].float()
    lp = torch.gather(F.log_softmax(logits.float(), -1), 2, tgt.unsqueeze(-1)).squeeze(-1)
    return (lp * m).sum(-1)


def _dpo_loss(beta: float, pc: torch.Tensor, pr: torch.Tensor, rc: torch.Tensor, rr: torch.Tensor) -> torch.Tensor:
    """The sigmoid DPO loss: -log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))."""
    logits = (pc - rc) - (pr - rr)
    return -F.logsigmoid(beta * logits).mean()


def _pref_batch(seed: int, n: int, prompt: int = 4, comp: int = 5, vocab: int = 40) -> tuple[torch.Tensor, ...]:
    """Prompt + chosen and prompt + rejected token rows, with a mask that is 1 on completion tokens only."""
    g = _gen(seed)
    p = torch.randint(3, vocab, (n, prompt), generator=g)
    c = torch.randint(3, vocab, (n, comp), generator=g)
    r = torch.randint(3, vocab, (n, comp), generator=g)
    mask = torch.cat([torch.zeros(n, prompt, dtype=torch.long), torch.ones(n, comp, dtype=torch.long)], 1)
    return torch.cat([p, c], 1), torch.cat([p, r], 1), mask


# --------------------------------------------------------------------------------------------- case-01
# trl #1627: DPO loss stays at 0.6931 from the first step and every reward (chosen, rejected, margin) is stuck at
# 0.0. The reporter found they had run DPOTrainer with ref_model=None and beta=0.0; beta multiplies the
# log-ratio margin, so with beta 0 the loss is log 2 whatever the policy does and its gradient is exactly zero.
# Fix from the thread: set beta to a positive value (0.1).

_C01_CH, _C01_RJ, _C01_MASK = _pref_batch(2201, 4)


def _c01_build(bug: bool) -> Case:
    """GPT-2 policy trained with the DPO sigmoid loss against a frozen reference copy; beta is 0.0 on the bug side."""
    beta = 0.0 if bug else 0.1
    policy = _gpt2(0).train()
    ref = copy.deepcopy(policy).eval().requires_grad_(False)
    opt = torch.optim.AdamW(policy.parameters(), lr=5e-4, weight_decay=0.0)

    def step() -> torch.Tensor:
        opt.zero_grad()
        with torch.no_grad():
            rc = _seq_logps(ref, _C01_CH, _C01_MASK)
            rr = _seq_logps(ref, _C01_RJ, _C01_MASK)
        pc = _seq_logps(policy, _C01_CH, _C01_MASK)
        pr = _seq_logps(policy, _C01_RJ, _C01_MASK)
        loss = _dpo_loss(beta, pc, pr, rc, rr)
        loss.backward()
        opt.step()
        return loss

    return policy, step, _kw(optimizer=opt, inputs=(_C01_CH, _C01_RJ, _C01_MASK))


def _c01_proof(bug: bool) -> bool:
    """Over four DPO steps the loss stays exactly log 2, every policy gradient is exactly zero and the policy's
    weights never change."""
    model, step, _ = _c01_build(bug)
    before = [p.detach().clone() for p in model.parameters()]
    losses, gsum = [], 0.0
    for _ in range(4):
        losses.append(float(step().detach()))
        gsum += sum(float(p.grad.abs().sum()) for p in model.parameters() if p.grad is not None)
    flat = all(abs(v - math.log(2)) < 1e-6 for v in losses)
    frozen = all(torch.equal(b, p.detach()) for b, p in zip(before, model.parameters()))
    return flat and gsum == 0.0 and frozen


# --------------------------------------------------------------------------------------------- case-02
# transformers #35856 (fixed in trl PR #2615): DPO with a LoRA adapter and gradient_accumulation_steps=8 gives a
# loss and gradients that are gradient_accumulation_steps times too large after transformers 4.48.1: the Trainer
# only divides the loss by the accumulation steps when the model does not "accept loss kwargs", and DPOTrainer
# computes its own per-micro-batch mean loss, so each micro-batch's mean loss is backpropagated unscaled and the
# update is the sum, not the mean, over the accumulation window. Fix: DPOTrainer sets
# self.model_accepts_loss_kwargs = False so the Trainer divides each micro-batch loss by the accumulation steps.

_C02_GA = 4
_C02_MB = [_pref_batch(2210 + i, 2) for i in range(_C02_GA)]


def _c02_model() -> nn.Module:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    base = LlamaForCausalLM(_llama_config())
    cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                     task_type="CAUSAL_LM")
    model = get_peft_model(base, cfg)
    torch.manual_seed(1)
    for n, p in model.named_parameters():  # a LoRA adapter partway through training (B no longer zero)
        if "lora_B" in n:
            p.data.normal_(0.0, 0.05)
    return model.train()


def _c02_micro_loss(model: Any, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    ch, rj, mask = batch
    with torch.no_grad(), model.disable_adapter():  # ref_model=None with PEFT: the reference is the base model
        rc, rr = _seq_logps(model, ch, mask), _seq_logps(model, rj, mask)
    return _dpo_loss(0.1, _seq_logps(model, ch, mask), _seq_logps(model, rj, mask), rc, rr)


def _c02_accumulate(model: Any, bug: bool) -> list[torch.Tensor]:
    """One accumulation window as Trainer.training_step runs it: backward on each micro-batch's loss, divided by
    the accumulation steps only on the fixed side."""
    losses = []
    for mb in _C02_MB:
        loss = _c02_micro_loss(model, mb)
        (loss if bug else loss / _C02_GA).backward()
        losses.append(loss.detach())
    return losses


def _c02_build(bug: bool) -> Case:
    """LoRA DPO on a tiny Llama with gradient_accumulation_steps=4; the bug side never divides the micro-batch loss."""
    model = _c02_model()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-4, weight_decay=0.0)

    def step() -> torch.Tensor:
        opt.zero_grad()
        losses = _c02_accumulate(model, bug)
        opt.step()
        return torch.stack(losses).mean()

    return model, step, _kw(optimizer=opt, inputs=_C02_MB[0])


def _c02_proof(bug: bool) -> bool:
    """The accumulated LoRA gradient is about 4x the gradient of the same 8 pairs' mean DPO loss taken in one batch
    (it should equal it)."""
    model, _, _ = _c02_build(bug)
    params = [p for p in model.parameters() if p.requires_grad]
    _c02_accumulate(model, bug)
    acc = torch.cat([p.grad.flatten() for p in params])
    for p in params:
        p.grad = None
    full = tuple(torch.cat([mb[i] for mb in _C02_MB]) for i in range(3))
    _c02_micro_loss(model, full).backward()
    ref = torch.cat([p.grad.flatten() for p in params])
    ratio = float(acc.norm() / ref.norm())
    return abs(ratio - _C02_GA) < 0.1


# --------------------------------------------------------------------------------------------- case-03
# accelerate #963: with gradient accumulation the learning-rate scheduler moves at every micro-batch even when no
# optimizer step was taken. The user sized a cosine-with-warmup schedule in optimizer updates
# (len(dataloader) * epochs / gradient_accumulation_steps), so warmup ends and the cosine decays
# gradient_accumulation_steps times too early: the lr reaches zero a quarter of the way through training. Fix
# (accelerate PR #999): step the scheduler only when gradients are synchronised, i.e. when the optimizer steps.

_C03_GA, _C03_UPDATES, _C03_WARMUP = 4, 40, 10
_C03_IDS = torch.randint(3, 40, (_C03_GA, 2, 10), generator=_gen(2231))
_C03_Y = torch.randint(0, 2, (_C03_GA, 2), generator=_gen(2232))


def _c03_build(bug: bool) -> Case:
    """BERT classifier, 4-step gradient accumulation, cosine schedule with warmup sized in optimizer updates."""
    from transformers import BertConfig, BertForSequenceClassification, get_cosine_schedule_with_warmup

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=32, num_labels=2,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = BertForSequenceClassification(cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = get_cosine_schedule_with_warmup(opt, num_warmup_steps=_C03_WARMUP, num_training_steps=_C03_UPDATES)

    def step() -> torch.Tensor:
        total = torch.zeros(())
        for i in range(_C03_GA):
            loss = model(input_ids=_C03_IDS[i], labels=_C03_Y[i]).loss / _C03_GA
            loss.backward()
            total = total + loss.detach()
            sync = i == _C03_GA - 1
            if sync:
                opt.step()
                opt.zero_grad()
            if bug or sync:
                sched.step()
        return total

    step.sched = sched  # type: ignore[attr-defined]
    return model, step, _kw(optimizer=opt, inputs=_C03_IDS[0], lr_scheduler=sched, total_steps=_C03_UPDATES)


def _c03_proof(bug: bool) -> bool:
    """After 5 optimizer updates the scheduler has advanced 20 steps: warmup (10 updates) is already over and the lr
    is on the cosine decay instead of halfway up the warmup."""
    _, step, _ = _c03_build(bug)
    updates = 5
    for _ in range(updates):
        step()
    sched = step.sched  # type: ignore[attr-defined]
    lr = sched.get_last_lr()[0]
    return sched.last_epoch == updates * _C03_GA and lr < 1e-3 and sched.last_epoch > _C03_WARMUP


# --------------------------------------------------------------------------------------------- case-04
# unsloth #416: a Llama 3 fine-tune never generates EOS, it runs to max_new_tokens even though EOS was appended to
# every training example. The notebook set tokenizer.pad_token = tokenizer.eos_token, and the language-modelling
# collator masks every pad-id position in the labels to -100, which also masks the real EOS at the end of each
# example: EOS is never a training target. Fix from the thread: give the tokenizer a distinct pad token
# (<|reserved_special_token_0|>), set model.config.pad_token_id to it, pad on the right.

_C04_WORDS = [f"w{i}" for i in range(33)]
_C04_SPECIAL = ["<|begin_of_text|>", "<|eot_id|>", "<|reserved_special_token_0|>", "<unk>"]


def _c04_tokenizer(bug: bool) -> Any:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(_C04_SPECIAL + _C04_WORDS)}
    tk = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                                  unk_token="<unk>")
    tok.padding_side = "right"
    tok.pad_token = tok.eos_token if bug else "<|reserved_special_token_0|>"
    return tok


def _c04_texts() -> list[str]:
    g = _gen(2241)
    out = []
    for n in (5, 8, 6, 9):
        words = " ".join(_C04_WORDS[int(i)] for i in torch.randint(0, 33, (n,), generator=g))
        out.append(f"<|begin_of_text|> {words} <|eot_id|>")
    return out


def _c04_batch(bug: bool) -> tuple[Any, dict[str, torch.Tensor]]:
    from transformers import DataCollatorForLanguageModeling

    tok = _c04_tokenizer(bug)
    feats = [{"input_ids": tok(t, add_special_tokens=False)["input_ids"]} for t in _c04_texts()]
    return tok, DataCollatorForLanguageModeling(tokenizer=tok, mlm=False)(feats)


def _c04_build(bug: bool) -> Case:
    """Llama SFT batch built by DataCollatorForLanguageModeling(mlm=False) with pad_token = eos_token on the bug side."""
    from transformers import LlamaForCausalLM

    tok, batch = _c04_batch(bug)
    torch.manual_seed(0)
    model = LlamaForCausalLM(_llama_config(vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                                           bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=batch)


def _c04_proof(bug: bool) -> bool:
    """Every example ends with a real EOS, yet none of those EOS positions is a training target (label -100), so
    the loss never asks the model to emit EOS."""
    tok, batch = _c04_batch(bug)
    eos = tok.eos_token_id
    ends = [int(m.sum()) - 1 for m in batch["attention_mask"]]
    assert all(int(batch["input_ids"][i, e]) == eos for i, e in enumerate(ends))
    return all(int(batch["labels"][i, e]) == -100 for i, e in enumerate(ends))


# --------------------------------------------------------------------------------------------- case-05
# transformers PR #46634: packed-sequence training (several examples concatenated in one row, boundaries given by
# position_ids that restart at 0) silently attends across examples when a 2D all-ones attention_mask is also
# passed: the mask builder only looks for packed sequences in position_ids when attention_mask is None, so SDPA
# takes the plain causal path and tokens of a later packed example attend the earlier ones. Loss still falls, so
# it goes unnoticed. Fix: packed detection must not depend on the 2D mask (the PR drops the attention_mask-is-None
# gate); the equivalent user-side fix is to not pass the all-ones attention_mask with packed position_ids.

_C05_SEG = (6, 5, 7)
_C05_IDS = torch.randint(3, 40, (2, sum(_C05_SEG)), generator=_gen(2251))
_C05_POS = torch.cat([torch.arange(n) for n in _C05_SEG]).unsqueeze(0).expand(2, -1).contiguous()
_C05_LAB = _C05_IDS.clone()
_C05_LAB[:, [0, _C05_SEG[0], _C05_SEG[0] + _C05_SEG[1]]] = -100  # no target across a boundary


def _c05_inputs(bug: bool, ids: torch.Tensor) -> dict[str, Any]:
    kw: dict[str, Any] = dict(input_ids=ids, position_ids=_C05_POS, use_cache=False)
    if bug:
        kw["attention_mask"] = torch.ones_like(ids)
    return kw


def _c05_build(bug: bool) -> Case:
    """Tiny Llama (SDPA) trained on packed rows with restarting position_ids, plus an all-ones 2D mask on the bug side."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(_llama_config(attn_implementation="sdpa")).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = model(**_c05_inputs(bug, _C05_IDS), labels=_C05_LAB).loss
        loss.backward()
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=_c05_inputs(bug, _C05_IDS))


def _c05_proof(bug: bool) -> bool:
    """Changing one token of the first packed example changes the logits of the second and third examples."""
    model, _, _ = _c05_build(bug)
    alt = _C05_IDS.clone()
    alt[:, 2] = (alt[:, 2] - 3 + 1) % 37 + 3
    with torch.no_grad():
        a = model(**_c05_inputs(bug, _C05_IDS)).logits[:, _C05_SEG[0]:]
        b = model(**_c05_inputs(bug, alt)).logits[:, _C05_SEG[0]:]
    return float((a - b).abs().max()) > 1e-5


CASES: list[BlindCase] = [
    BlindCase("b22-case-01", "https://github.com/huggingface/trl/issues/1627", "loss hyperparameter zeroes gradient",
              "DPO is run with beta=0.0, so the loss is log 2 whatever the policy does, rewards stay at 0 and the "
              "policy gets exactly zero gradient.", _c01_build, _c01_proof),
    BlindCase("b22-case-02", "https://github.com/huggingface/transformers/issues/35856",
              "gradient accumulation scaling",
              "LoRA DPO with gradient accumulation backpropagates each micro-batch's mean loss undivided, so every "
              "update is the accumulation-steps-times larger sum instead of the mean.", _c02_build, _c02_proof),
    BlindCase("b22-case-03", "https://github.com/huggingface/accelerate/issues/963", "lr schedule / accumulation",
              "With gradient accumulation the scheduler steps at every micro-batch while the schedule is sized in "
              "optimizer updates, so warmup and decay run accumulation-steps times too fast.", _c03_build, _c03_proof),
    BlindCase("b22-case-04", "https://github.com/unslothai/unsloth/issues/416", "labels / special tokens",
              "pad_token is set to eos_token and the LM collator masks pad ids in the labels, so the real EOS of "
              "every example is never a target and the model never learns to stop.", _c04_build, _c04_proof),
    BlindCase("b22-case-05", "https://github.com/huggingface/transformers/pull/46634", "packing / attention mask",
              "Packed rows with restarting position_ids plus an all-ones 2D attention_mask disable packed-sequence "
              "masking, so each packed example attends the examples before it.", _c05_build, _c05_proof),
]
