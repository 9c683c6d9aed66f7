"""Blind batch 38 (part a): silent NLP / LLM training bugs from public GitHub threads, each with its fixed twin.

Collected by someone who does not write the audit's checks. Every case builds the user's setup on a tiny model
(transformers Llama, GPT-2 and T5 models from tiny configs in code, a real fast tokenizer over a vocabulary built in
code, peft LoRA on a small checkpointed decoder in plain torch; nothing is downloaded) and proves the bug without the
audit on real tensors and real steps.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw, _llama_config

# --------------------------------------------------------------------------------------------- case-01
# bingreeky/MemGen PR #33 ("fix: erase_after_first_eos 用 pad_token_id 填充，修复 GRPO loss 恒为 0"): the GRPO rollout
# helper `erase_after_first_eos` overwrote every token after a completion's first EOS with `eos_token_id`, while
# `create_attention_mask` (and with it the completion mask the GRPO loss is averaged over) only treats
# `!= pad_token_id` as padding. Every post-EOS slot therefore counted as a real completion token: each completion's
# mask length became the batch's longest generation, the policy-gradient term was applied to (and averaged over) a
# run of repeated EOS tokens that were never generated, and the model was pushed to emit EOS again after EOS. Nothing
# fails: the loss is a normal-looking number (with BNPO and one iteration it even reads 0). Fix in the PR: fill the
# post-EOS positions with `pad_token_id`, so the completion mask stops at each sample's own EOS.

_C01_PAD, _C01_EOS = 0, 2
_C01_G = 4  # completions per prompt
_C01_PROMPTS = torch.randint(3, 40, (2, 5), generator=_gen(3801)).repeat_interleave(_C01_G, dim=0)
_C01_RAW = torch.randint(3, 40, (8, 8), generator=_gen(3802))  # sampled tokens, garbage after an EOS included
for _row, _pos in enumerate([2, 4, 7, 3, 1, 5, 6, 2]):
    if _row != 2:  # row 2 never stops: it runs to the length limit
        _C01_RAW[_row, _pos] = _C01_EOS
_C01_REWARDS = torch.tensor([1.0, 0.0, 0.5, 0.2, 0.0, 1.0, 0.3, 0.8])


def _c01_erase_after_first_eos(completion_ids: torch.Tensor, fill: int) -> torch.Tensor:
    is_eos = completion_ids == _C01_EOS
    first_eos = torch.argmax(is_eos.int(), dim=1)
    cols = torch.arange(completion_ids.size(1))
    replace = (cols > first_eos.unsqueeze(1)) & is_eos.any(dim=1).unsqueeze(1)
    out = completion_ids.clone()
    out[replace] = fill
    return out


def _c01_batch(bug: bool) -> dict[str, torch.Tensor]:
    completion = _c01_erase_after_first_eos(_C01_RAW, _C01_EOS if bug else _C01_PAD)
    completion_mask = (completion != _C01_PAD).long()  # create_attention_mask: != pad_token_id
    prompt_mask = torch.ones_like(_C01_PROMPTS)
    grouped = _C01_REWARDS.view(-1, _C01_G)
    adv = (grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)
    return {"input_ids": torch.cat([_C01_PROMPTS, completion], 1),
            "attention_mask": torch.cat([prompt_mask, completion_mask], 1),
            "completion_mask": completion_mask, "advantages": adv.view(-1)}


def _c01_loss(model: nn.Module, batch: dict[str, torch.Tensor], keep_logits: list | None = None) -> torch.Tensor:
    p = _C01_PROMPTS.size(1)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    if keep_logits is not None:
        logits.retain_grad()
        keep_logits.append(logits)
    comp_logits = logits[:, p - 1:-1]
    comp_ids = batch["input_ids"][:, p:]
    logps = torch.log_softmax(comp_logits, -1).gather(-1, comp_ids.unsqueeze(-1)).squeeze(-1)
    ratio = torch.exp(logps - logps.detach())  # one iteration: old policy == current policy
    per_token = -ratio * batch["advantages"].unsqueeze(1)
    mask = batch["completion_mask"].float()
    return (per_token * mask).sum() / mask.sum()  # BNPO: normalised by the batch's completion tokens


def _c01_setup(bug: bool):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(_llama_config()).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt, _c01_batch(bug)


def _c01_build(bug: bool) -> Case:
    model, opt, batch = _c01_setup(bug)

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = _c01_loss(model, batch)
        loss.backward()
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=batch)


def _c01_proof(bug: bool) -> bool:
    """Do the logits that predict the slots after a completion's first EOS get a policy-gradient?"""
    model, _, batch = _c01_setup(bug)
    kept: list = []
    _c01_loss(model, batch, kept).backward()
    grad = kept[0].grad
    p = _C01_PROMPTS.size(1)
    is_eos = _C01_RAW == _C01_EOS
    first = torch.argmax(is_eos.int(), 1)
    total = 0.0
    for row in range(_C01_RAW.size(0)):
        if not bool(is_eos[row].any()):
            continue
        for t in range(int(first[row]) + 1, _C01_RAW.size(1)):
            total += float(grad[row, p + t - 1].abs().sum())
    return total > 1e-8


# --------------------------------------------------------------------------------------------- case-02
# JulesBelveze/bert-squeeze PR #80 ("refactor(seq2seq): improve Seq2Seq data collation and logging"): the seq2seq
# data module tokenized the target texts with the tokenizer's own padding, so `labels` came out padded with the
# tokenizer's pad token id (0 for T5) instead of the ignore index. The T5 loss only ignores -100, so every padded target
# position was trained as a real token: the model learns to emit <pad> after </s>, and the loss (dominated by easy pad
# targets on short summaries) falls nicely. Fix in the PR: tokenize targets unpadded and collate with
# `DataCollatorForSeq2Seq`, which pads labels with -100 (label_pad_token_id) and builds the decoder inputs.

_C02_VOCAB = 48
_C02_SRC = ["w5 w9 w12 w7 w30 </s>", "w8 w8 w21 </s>", "w40 w3 w17 w26 w11 w6 w9 </s>", "w13 w14 </s>"]
_C02_TGT = ["w9 w12 </s>", "w8 w21 w22 w23 w24 w25 w26 </s>", "w17 </s>", "w14 w13 w44 </s>"]
_C02_MAX_TGT = 8  # the longest target has 8 tokens, so both sides give labels of the same shape


def _c02_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2}
    for i in range(3, _C02_VOCAB):
        vocab[f"w{i}"] = i
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def _c02_model():
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    cfg = T5Config(vocab_size=_C02_VOCAB, d_model=32, d_kv=16, d_ff=64, num_layers=1, num_decoder_layers=1,
                   num_heads=2, dropout_rate=0.0, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    return T5ForConditionalGeneration(cfg).train()


def _c02_batch(bug: bool, model: nn.Module) -> dict[str, torch.Tensor]:
    from transformers import DataCollatorForSeq2Seq

    tok = _c02_tokenizer()
    feats = []
    for src, tgt in zip(_C02_SRC, _C02_TGT):
        enc = tok(src)
        if bug:  # targets padded by the tokenizer itself: pad id 0 lands in the labels
            enc["labels"] = tok(tgt, padding="max_length", max_length=_C02_MAX_TGT)["input_ids"]
        else:
            enc["labels"] = tok(tgt)["input_ids"]
        feats.append(dict(enc))
    if bug:
        batch = tok.pad(feats, return_tensors="pt")
    else:
        batch = DataCollatorForSeq2Seq(tok, model=model, label_pad_token_id=-100, return_tensors="pt")(feats)
    return dict(batch)


def _c02_setup(bug: bool):
    model = _c02_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt, _c02_batch(bug, model)


def _c02_build(bug: bool) -> Case:
    model, opt, batch = _c02_setup(bug)

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=batch)


def _c02_proof(bug: bool) -> bool:
    """Do the decoder logits at target positions past each summary's </s> (padding) carry loss gradient?"""
    model, _, batch = _c02_setup(bug)
    out = model(**batch)
    out.logits.retain_grad()
    out.loss.backward()
    tgt_lens = torch.tensor([len(t.split()) for t in _C02_TGT])
    past_end = torch.arange(_C02_MAX_TGT).unsqueeze(0) >= tgt_lens.unsqueeze(1)
    return bool(out.logits.grad[past_end].abs().sum() > 1e-8)


# --------------------------------------------------------------------------------------------- case-03
# locuslab/open-unlearning issue #178 ("PEFT LoRA transformer layers not trained when gradient_checkpointing=True —
# enable_input_require_grads() missing"): LoRA unlearning runs with gradient checkpointing enabled produced adapters
# whose lora_B matrices inside the transformer layers were still all zero after training. With the reentrant
# torch.utils.checkpoint the blocks are wrapped in, a checkpointed block's output only requires grad if one of its
# *inputs* does; the frozen embedding's output does not, so backward never enters the blocks and their LoRA weights
# get no gradient at all. The adapter outside the checkpointed blocks (here on the output head) still trains, so the
# loss goes down and nothing errors (torch only warns). Fix in the thread: call `model.enable_input_require_grads()`
# (a forward hook that makes the embedding output require grad) before training with gradient checkpointing.

_C03_V, _C03_D = 40, 32
_C03_IDS = torch.randint(1, _C03_V, (4, 12), generator=_gen(3831))


class _C03Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d, d) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = self.norm1(h)
        att = self.q_proj(x) @ self.k_proj(x).transpose(1, 2) / math.sqrt(x.size(-1))
        causal = torch.ones(h.size(1), h.size(1), dtype=torch.bool).tril()
        att = att.masked_fill(~causal, float("-inf")).softmax(-1)
        h = h + self.o_proj(att @ self.v_proj(x))
        return h + self.fc2(F.gelu(self.fc1(self.norm2(h))))


class _C03Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(_C03_V, _C03_D)
        self.layers = nn.ModuleList(_C03Block(_C03_D) for _ in range(2))
        self.norm = nn.LayerNorm(_C03_D)
        self.lm_head = nn.Linear(_C03_D, _C03_V, bias=False)
        self.gradient_checkpointing = True

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            if self.gradient_checkpointing and self.training:
                h = checkpoint(layer, h, use_reentrant=True)  # the Trainer's default at the time
            else:
                h = layer(h)
        return self.lm_head(self.norm(h))


def _c03_setup(bug: bool):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = _C03Decoder()
    cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "fc1", "fc2", "lm_head"])
    model = get_peft_model(base, cfg).train()
    if not bug:  # model.enable_input_require_grads()
        base.embed_tokens.register_forward_hook(lambda _m, _i, out: out.requires_grad_(True))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    return model, opt


def _c03_step(model: nn.Module, opt: torch.optim.Optimizer) -> torch.Tensor:
    opt.zero_grad()
    logits = model(_C03_IDS[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, _C03_V), _C03_IDS[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    return loss


def _c03_build(bug: bool) -> Case:
    model, opt = _c03_setup(bug)
    return model, lambda: _c03_step(model, opt), _kw(optimizer=opt, inputs={"input_ids": _C03_IDS})


def _c03_proof(bug: bool) -> bool:
    """After two real steps, is every lora_B inside the checkpointed transformer blocks still exactly zero?"""
    model, opt = _c03_setup(bug)
    for _ in range(2):
        _c03_step(model, opt)
    inner = [p for n, p in model.named_parameters() if "layers." in n and "lora_B" in n]
    return all(float(p.detach().abs().max()) == 0.0 for p in inner)


# --------------------------------------------------------------------------------------------- case-04
# fw-ai/cookbook PR #388 ("fix(sft/dpo/orpo): 7 data-integrity and loss bugs found in review"), first bug:
# `make_batch_dpo_loss_fn` summed the per-token logprobs of each sequence from `response_starts[i]`, the full-sequence
# index of the first response token. The logprobs are shifted by one (logprob[j] scores token[j + 1]), so the slice
# `[rs:]` silently drops the logprob of the *first* response token, for the policy and for the reference alike; that
# token is often where chosen and rejected diverge. Its logit never gets a DPO gradient; when it is the only
# difference the margin is 0 and the pair is dead. The loss still falls on the other tokens. Fix in the PR:
# slice from `lp_start = max(0, rs - 1)`, as the ORPO and batched SFT losses already did.

_C04_PROMPT = torch.randint(3, 40, (2, 5), generator=_gen(3841))
_C04_CHOSEN = torch.randint(3, 40, (2, 4), generator=_gen(3842))
_C04_REJECTED = torch.randint(3, 40, (2, 4), generator=_gen(3843))
_C04_REJECTED[:, 0] = (_C04_CHOSEN[:, 0] + 7) % 37 + 3  # the pair diverges on the first response token
_C04_BETA = 0.1


def _c04_seqs() -> torch.Tensor:
    """Datums arranged [chosen_0, rejected_0, chosen_1, rejected_1]."""
    rows = []
    for i in range(_C04_PROMPT.size(0)):
        rows.append(torch.cat([_C04_PROMPT[i], _C04_CHOSEN[i]]))
        rows.append(torch.cat([_C04_PROMPT[i], _C04_REJECTED[i]]))
    return torch.stack(rows)


def _c04_token_logprobs(model: nn.Module, ids: torch.Tensor, keep: list | None = None) -> torch.Tensor:
    logits = model(input_ids=ids).logits
    if keep is not None:
        logits.retain_grad()
        keep.append(logits)
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def _c04_setup(bug: bool):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=40, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2)
    model = GPT2LMHeadModel(cfg).train()
    ref = copy.deepcopy(model).eval().requires_grad_(False)
    ids = _c04_seqs()
    with torch.no_grad():
        ref_lp = _c04_token_logprobs(ref, ids)  # ref_chosen_list / ref_rejected_list
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt, ids, ref_lp


def _c04_loss(model, ids, ref_lp, bug: bool, keep: list | None = None) -> torch.Tensor:
    lp = _c04_token_logprobs(model, ids, keep)
    rs = _C04_PROMPT.size(1)  # response_starts[i]: full-sequence index of the first response token
    start = rs if bug else max(0, rs - 1)
    losses = []
    for i in range(_C04_PROMPT.size(0)):
        pi_c, pi_r = lp[2 * i][start:].sum(), lp[2 * i + 1][start:].sum()
        rc, rr = ref_lp[2 * i][start:].sum(), ref_lp[2 * i + 1][start:].sum()
        margin = (pi_c - rc) - (pi_r - rr)
        losses.append(-F.logsigmoid(_C04_BETA * margin))
    return torch.stack(losses).mean()


def _c04_build(bug: bool) -> Case:
    model, opt, ids, ref_lp = _c04_setup(bug)

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = _c04_loss(model, ids, ref_lp, bug)
        loss.backward()
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs={"input_ids": ids})


def _c04_proof(bug: bool) -> bool:
    """Is the logit row that scores the first response token (chosen vs rejected) left without any gradient?"""
    model, _, ids, ref_lp = _c04_setup(bug)
    kept: list = []
    _c04_loss(model, ids, ref_lp, bug, kept).backward()
    row = _C04_PROMPT.size(1) - 1  # logits at rs - 1 predict the first response token
    return bool(kept[0].grad[:, row].abs().sum() == 0)


# --------------------------------------------------------------------------------------------- case-05
# modelscope/ms-swift PR #10100 ("fix(loss): preserve token weights in custom cross entropy"): with
# `--loss_type cross_entropy`, Seq2SeqTrainer.compute_loss pops the per-token `loss_scale` weights, aligns them with the
# shifted labels and hands them to the selected loss callback, but `CustomCrossEntropyLoss.__call__(outputs, labels,
# *, num_items_in_batch=None, loss_scale=None)` recomputed the per-token cross entropy and summed it without ever
# using `loss_scale`. Non-uniform weights stopped changing the objective and tokens weighted 0 (content the user
# wanted excluded from the loss) were trained at full weight; the loss looks like any SFT loss. Fix in the PR: apply
# `loss_scale` to the per-token loss before reducing it, keeping the same valid-token denominator.

_C05_IDS = torch.randint(3, 40, (2, 12), generator=_gen(3851))
_C05_LABELS = _C05_IDS.clone()
_C05_LABELS[:, :4] = -100  # the prompt
_C05_SCALE = torch.ones(2, 12)
_C05_SCALE[:, 4:7] = 0.0  # e.g. an empty <think></think> block the user weighted out
_C05_SCALE[:, 10:] = 2.0  # the final answer tokens weighted up


def _c05_per_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    shifted = torch.roll(labels, shifts=-1, dims=-1).view(-1)
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), shifted, ignore_index=-100, reduction="none")


def _c05_custom_ce(bug: bool):
    def loss_fn(outputs, labels, *, num_items_in_batch=None, loss_scale=None, **_kw):
        token_loss = _c05_per_token_loss(outputs.logits, labels)
        if not bug and loss_scale is not None:
            token_loss = token_loss * loss_scale
        if num_items_in_batch is None:
            num_items_in_batch = (labels[:, 1:] != -100).sum()
        return token_loss.sum() / num_items_in_batch

    return loss_fn


def _c05_compute_loss(model, inputs: dict, loss_func, keep: list | None = None) -> torch.Tensor:
    inputs = dict(inputs)
    labels = inputs.pop("labels")
    loss_scale = inputs.pop("loss_scale")
    outputs = model(**inputs)
    if keep is not None:
        outputs.logits.retain_grad()
        keep.append(outputs.logits)
    loss_scale = torch.roll(loss_scale, shifts=-1, dims=-1).view(-1)  # aligned with the shifted labels
    return loss_func(outputs, labels, num_items_in_batch=None, loss_scale=loss_scale)


def _c05_setup(bug: bool):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(_llama_config()).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    inputs = {"input_ids": _C05_IDS, "attention_mask": torch.ones_like(_C05_IDS), "labels": _C05_LABELS,
              "loss_scale": _C05_SCALE}
    return model, opt, inputs, _c05_custom_ce(bug)


def _c05_build(bug: bool) -> Case:
    model, opt, inputs, loss_func = _c05_setup(bug)

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = _c05_compute_loss(model, inputs, loss_func)
        loss.backward()
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=inputs)


def _c05_proof(bug: bool) -> bool:
    """Do the logits that predict tokens the user weighted 0 still get a gradient?"""
    model, _, inputs, loss_func = _c05_setup(bug)
    kept: list = []
    _c05_compute_loss(model, inputs, loss_func, kept).backward()
    # logits at position t predict token t + 1: the zero-weight tokens 4..6 are scored at positions 3..5
    return bool(kept[0].grad[:, 3:6].abs().sum() > 1e-8)


CASES: list[BlindCase] = [
    BlindCase("b38a-01", "https://github.com/bingreeky/MemGen/pull/33", "post-EOS tokens in GRPO mask",
              "Tokens after a completion's first EOS are overwritten with EOS instead of pad, so the completion mask "
              "keeps them and the GRPO loss trains and averages over never-generated repeated EOS tokens.",
              _c01_build, _c01_proof,
              known_miss="generated tokens after EOS left in the loss mask: they are real tokens the mask marks, and packed rows legitimately train across an EOS"),
    BlindCase("b38a-02", "https://github.com/JulesBelveze/bert-squeeze/pull/80", "seq2seq labels padded with pad id",
              "Target texts are padded by the tokenizer, so the T5 labels carry pad id 0 instead of -100 and every "
              "padded target position is trained as a real token.", _c02_build, _c02_proof),
    BlindCase("b38a-03", "https://github.com/locuslab/open-unlearning/issues/178",
              "LoRA gets no grad under checkpointing",
              "With reentrant gradient checkpointing and a frozen embedding, no checkpointed block input requires "
              "grad, so the LoRA weights inside the transformer blocks never receive a gradient.",
              _c03_build, _c03_proof),
    BlindCase("b38a-04", "https://github.com/fw-ai/cookbook/pull/388", "DPO drops first response token",
              "The DPO loss slices the shifted per-token logprobs from the first response token's sequence index, "
              "dropping that token's logprob, so where chosen and rejected diverge gets no gradient.",
              _c04_build, _c04_proof,
              known_miss="the first response token dropped from the DPO log-probabilities: where a response begins is template semantics"),
    BlindCase("b38a-05", "https://github.com/modelscope/ms-swift/pull/10100", "per-token loss weights ignored",
              "The custom cross-entropy loss callback receives the aligned per-token loss_scale but never applies it, "
              "so zero-weight tokens are trained at full weight and the weighting has no effect.",
              _c05_build, _c05_proof,
              known_miss="per-token loss weights computed and never applied: an absent factor is not measurable"),
]
