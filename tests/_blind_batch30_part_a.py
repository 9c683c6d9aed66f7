"""Blind batch 30 (part a): silent bugs in language-model training beyond plain SFT, each with its fixed twin.

Collected by someone who does not write the audit's checks. The reports cover a pre-training loop's auxiliary loss,
KTO's KL reference point, a chat template's assistant header in the completion mask, PPO advantages for language
models and a pairwise reward-model loss. Every case builds the user's setup on a tiny model (transformers Llama and
GPT-2 models from tiny configs in code, a real fast tokenizer over a vocabulary built in code; nothing is
downloaded) and proves the bug without the audit on real tensors and real steps.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw, _llama_config

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _token_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token log-probabilities of ``labels`` under ``logits`` (same length)."""
    return torch.gather(logits.log_softmax(-1), 2, labels.unsqueeze(-1)).squeeze(-1)


# --------------------------------------------------------------------------------------------- case-01
# allenai/OLMo PR #634 ("Fix Z-loss calculation"): OLMo's pre-training Trainer splits each batch into micro-batches,
# runs the forward with loss_reduction="sum", and divides the summed cross-entropy by the batch size in tokens. The
# auxiliary softmax Z-loss (1e-4 * logsumexp(logits)^2, also summed over tokens) was divided by the number of
# micro-batches instead, so it was a sum over each micro-batch's tokens rather than a per-token average: the Z-loss
# term is (tokens per micro-batch) times stronger than configured. Training runs, the logged CE loss looks normal;
# the auxiliary term just silently dominates the logit scale. Fix in the PR: divide the Z-loss by
# batch_size_in_tokens, exactly like the CE loss.

_C01_IDS = torch.randint(3, 40, (4, 16), generator=_gen(3001))
_C01_MICRO = 2


def _c01_ce_z(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """OLMo's model_forward + cross_entropy_loss with reduction='sum' and compute_z_loss=True."""
    logits = model(input_ids=ids).logits[..., :-1, :].contiguous()
    logits = logits.view(-1, logits.size(-1))
    labels = ids[..., 1:].contiguous().view(-1)
    ce = F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")
    z_squared = (logits.logsumexp(-1).pow(2) * (labels != -100)).sum()
    return ce, 1e-4 * z_squared


def _c01_terms(model: nn.Module, bug: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    micro_batches = _C01_IDS.split(_C01_IDS.size(0) // _C01_MICRO)
    batch_size_in_tokens = _C01_IDS.numel()
    num_micro_batches = len(micro_batches)
    out = []
    for mb in micro_batches:
        ce, z = _c01_ce_z(model, mb)
        ce = ce / batch_size_in_tokens
        z = z / num_micro_batches if bug else z / batch_size_in_tokens
        out.append((ce, z))
    return out


def _c01_build(bug: bool) -> Case:
    """Tiny Llama pre-trained with OLMo's micro-batched train_batch and the softmax auxiliary (Z) loss."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(_llama_config()).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)

    def step() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        ce_batch_loss = torch.tensor(0.0)
        micro_batches = _C01_IDS.split(_C01_IDS.size(0) // _C01_MICRO)
        batch_size_in_tokens = _C01_IDS.numel()
        for mb in micro_batches:
            ce, z = _c01_ce_z(model, mb)
            ce = ce / batch_size_in_tokens
            z = z / len(micro_batches) if bug else z / batch_size_in_tokens
            loss = ce + z
            ce_batch_loss += ce.detach()
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return ce_batch_loss

    return model, step, _kw(optimizer=opt, inputs=_C01_IDS)


def _c01_proof(bug: bool) -> bool:
    """The Z-loss the step back-propagates is many times 1e-4 * mean-over-tokens of logsumexp^2 (its definition)."""
    model, _, _ = _c01_build(bug)
    with torch.no_grad():
        used = sum(float(z) for _, z in _c01_terms(model, bug))
        logits = model(input_ids=_C01_IDS).logits[..., :-1, :]
        intended = float(1e-4 * logits.logsumexp(-1).pow(2).mean())
    return used / intended > 1.5


# --------------------------------------------------------------------------------------------- case-02
# huggingface/trl issue #1911 (fixed by PR #1970): KTOTrainer estimates the KL reference point z0 from *mismatched*
# (prompt, completion) pairs, built per batch by reversing the order of the completions (`answer_input_ids[::-1]`).
# With an odd batch size the middle example is paired with its own completion, so the "mismatched" KL batch holds a
# matched pair and the KL baseline every example's loss is measured against is biased toward the policy's own
# training pairs. Nothing errors; the loss just uses a wrong reference point. Fix in the PR: rotate the completions by
# one (`[answer[-1]] + answer[:-1]`), which never pairs a prompt with its own completion.

_C02_B, _C02_P, _C02_C = 5, 6, 6
_C02_PROMPTS = torch.randint(3, 40, (_C02_B, _C02_P), generator=_gen(3021))
_C02_ANSWERS = torch.randint(3, 40, (_C02_B, _C02_C), generator=_gen(3022))
_C02_LABEL = torch.tensor([True, False, True, True, False])  # desirable / undesirable
_C02_BETA = 0.1


def _c02_kl_answers(bug: bool) -> torch.Tensor:
    """The trainer's _get_kl_dataset on one batch of completions."""
    answers = list(_C02_ANSWERS)
    kl = answers[::-1] if bug else [answers[-1]] + answers[:-1]
    return torch.stack(kl)


def _c02_logps(model: nn.Module, prompts: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
    """Summed log-probability of the completion tokens given the prompt."""
    ids = torch.cat([prompts, answers], dim=1)
    logits = model(input_ids=ids).logits[:, :-1]
    tok = _token_logps(logits, ids[:, 1:])
    return tok[:, prompts.size(1) - 1:].sum(-1)


def _c02_build(bug: bool) -> Case:
    """Tiny Llama trained with the KTO loss against a frozen reference copy, batch size 5."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(_llama_config()).train()
    ref = copy.deepcopy(model).eval().requires_grad_(False)
    with torch.no_grad():  # some steps into training: the policy has moved away from the reference
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    opt = torch.optim.AdamW(model.parameters(), lr=5e-4)
    kl_answers = _c02_kl_answers(bug)
    batch = torch.cat([_C02_PROMPTS, _C02_ANSWERS], dim=1)

    def step() -> torch.Tensor:
        opt.zero_grad()
        with torch.no_grad():
            kl_logps = _c02_logps(model, _C02_PROMPTS, kl_answers)
            ref_kl_logps = _c02_logps(ref, _C02_PROMPTS, kl_answers)
            ref_logps = _c02_logps(ref, _C02_PROMPTS, _C02_ANSWERS)
        kl = (kl_logps - ref_kl_logps).mean().clamp(min=0)
        logratios = _c02_logps(model, _C02_PROMPTS, _C02_ANSWERS) - ref_logps
        chosen = 1 - torch.sigmoid(_C02_BETA * (logratios[_C02_LABEL] - kl))
        rejected = 1 - torch.sigmoid(_C02_BETA * (kl - logratios[~_C02_LABEL]))
        loss = torch.cat([chosen, rejected]).mean()
        loss.backward()
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=batch)


def _c02_proof(bug: bool) -> bool:
    """The KL batch, meant to hold only mismatched pairs, contains a (prompt, completion) pair from the data."""
    kl_answers = _c02_kl_answers(bug)
    matched = (kl_answers == _C02_ANSWERS).all(-1)
    return bool(matched.any())


# --------------------------------------------------------------------------------------------- case-03
# huggingface/trl issue #4147 (fixed by PR #4201): SFTTrainer on a conversational prompt-completion dataset tokenizes
# the prompt with apply_chat_template(prompt) *without* add_generation_prompt=True, then sets
# completion_mask = [0] * len(prompt_ids) + [1] * (rest). The assistant turn header the template emits before the
# answer ("<|im_start|> assistant") therefore lands in the completion part and is trained on as if the model had to
# generate it, although at inference the generation prompt supplies it. Training runs normally; the supervised token
# set is silently wrong. Fix in the PR: tokenize the prompt with add_generation_prompt=True.

_C03_TEMPLATE = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")
_C03_DATA = [
    ("w1 w2 w3", "w4 w5"),
    ("w6 w7", "w8 w9 w10 w11"),
    ("w12 w13 w14 w15", "w16"),
    ("w17", "w18 w19 w20"),
]


def _c03_tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "user", "assistant", "system"]
    words += [f"w{i}" for i in range(32)]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    tok.chat_template = _C03_TEMPLATE
    return tok


def _c03_batch(bug: bool) -> dict[str, torch.Tensor]:
    """SFTTrainer's prompt-completion tokenize_fn, then the collator's completion-only labels and right padding."""
    tok = _c03_tokenizer()
    rows = []
    for prompt_text, completion_text in _C03_DATA:
        prompt = [{"role": "user", "content": prompt_text}]
        completion = [{"role": "assistant", "content": completion_text}]
        extra = {} if bug else {"add_generation_prompt": True}
        prompt_ids = tok.apply_chat_template(prompt, tokenize=True, return_dict=True, **extra)["input_ids"]
        pc_ids = tok.apply_chat_template(prompt + completion, tokenize=True, return_dict=True)["input_ids"]
        completion_mask = [0] * len(prompt_ids) + [1] * (len(pc_ids) - len(prompt_ids))
        rows.append((pc_ids, completion_mask))
    width = max(len(r[0]) for r in rows)
    ids = torch.full((len(rows), width), tok.pad_token_id)
    att = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full((len(rows), width), -100)
    for i, (pc, m) in enumerate(rows):
        ids[i, :len(pc)] = torch.tensor(pc)
        att[i, :len(pc)] = 1
        lab = torch.tensor(pc)
        lab[torch.tensor(m) == 0] = -100
        labels[i, :len(pc)] = lab
    return {"input_ids": ids, "attention_mask": att, "labels": labels}


def _c03_build(bug: bool) -> Case:
    """Tiny Llama SFT on conversational prompt-completion pairs with completion-only loss."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(_llama_config()).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = _c03_batch(bug)

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=batch)


def _c03_proof(bug: bool) -> bool:
    """The assistant turn header tokens (which the generation prompt supplies at inference) carry loss labels."""
    tok = _c03_tokenizer()
    batch = _c03_batch(bug)
    header = {tok.convert_tokens_to_ids("<|im_start|>"), tok.convert_tokens_to_ids("assistant")}
    supervised = set(batch["labels"][batch["labels"] != -100].tolist())
    return bool(header & supervised)


# --------------------------------------------------------------------------------------------- case-04
# natolambert/rlhf-book PR #216 ("Fix PPO implementation bugs: returns and KL masking"): the book's PPO loss for
# language models computed `advantages = rewards - values.detach()` and `vf_loss = 0.5 * (rewards - values)^2` from
# the per-token rewards (KL penalty everywhere, the reward model's score only on the last completion token), i.e.
# A_t = r_t - V(s_t) instead of G_t - V(s_t). The sequence score never reaches any token but the last one: every other
# token's advantage is the KL penalty alone, and the value head learns per-token rewards instead of returns. The loss
# is finite and decreases. Fix in the PR: compute returns by a backward pass (gamma = 1) masked by completion_mask and
# use them for both the advantages and the value target.

_C04_B, _C04_P, _C04_L = 4, 4, 8
_C04_PROMPTS = torch.randint(3, 40, (_C04_B, _C04_P), generator=_gen(3041))
_C04_COMPL = torch.randint(3, 40, (_C04_B, _C04_L), generator=_gen(3042))
_C04_LENS = torch.tensor([8, 6, 7, 5])
_C04_MASK = (torch.arange(_C04_L)[None] < _C04_LENS[:, None]).float()
_C04_COMPL = torch.where(_C04_MASK.bool(), _C04_COMPL, torch.zeros_like(_C04_COMPL))  # pad id 0
_C04_SCORES = torch.tensor([1.0, -0.5, 0.3, -1.2])
_C04_BETA, _C04_GAMMA, _C04_EPS, _C04_VF = 0.05, 1.0, 0.2, 0.1


class _C04Policy(nn.Module):
    """Policy LM with a scalar value head on its hidden states."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import LlamaForCausalLM

        self.lm = LlamaForCausalLM(_llama_config())
        self.value_head = nn.Linear(32, 1)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.lm(input_ids=ids, output_hidden_states=True)
        values = self.value_head(out.hidden_states[-1]).squeeze(-1)
        return out.logits, values


def _c04_completion_stats(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits, values = model(ids)
    logps = _token_logps(logits[:, _C04_P - 1:-1], ids[:, _C04_P:])
    return logps, values[:, _C04_P - 1:-1]


def _c04_advantages(rewards: torch.Tensor, values: torch.Tensor, bug: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages before whitening, value target) as the book's PPO loss computes them."""
    if bug:
        return rewards - values.detach(), rewards
    returns = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0], dtype=rewards.dtype)
    for t in reversed(range(rewards.shape[1])):
        running = (rewards[:, t] + _C04_GAMMA * running) * _C04_MASK[:, t]
        returns[:, t] = running
    return returns - values.detach(), returns


def _c04_rewards(per_token_kl: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    rewards = torch.zeros_like(per_token_kl)
    rewards[torch.arange(_C04_B), _C04_LENS - 1] = scores  # reward model score on the last completion token
    return rewards - _C04_BETA * per_token_kl


def _c04_setup() -> tuple[_C04Policy, nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = _C04Policy().train()
    ref = copy.deepcopy(model.lm).eval().requires_grad_(False)
    with torch.no_grad():  # the sampler's policy was a slightly different snapshot
        for p in model.lm.parameters():
            p.add_(0.01 * torch.randn_like(p))
    ids = torch.cat([_C04_PROMPTS, _C04_COMPL], dim=1)
    return model, ref, ids


def _c04_build(bug: bool) -> Case:
    """Tiny Llama policy with a value head, one PPO update on sampled completions scored by a reward model."""
    model, ref, ids = _c04_setup()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    with torch.no_grad():
        per_token_logps, _ = _c04_completion_stats(model, ids)  # old logprobs at sampling time
        ref_logps = _token_logps(ref(input_ids=ids).logits[:, _C04_P - 1:-1], ids[:, _C04_P:])
    per_token_kl = per_token_logps - ref_logps
    rewards = _c04_rewards(per_token_kl, _C04_SCORES)

    def step() -> torch.Tensor:
        opt.zero_grad()
        new_per_token_logps, values = _c04_completion_stats(model, ids)
        advantages, target = _c04_advantages(rewards, values, bug)
        advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
        ratio = torch.exp(new_per_token_logps - per_token_logps)
        pg1 = -advantages * ratio
        pg2 = -advantages * torch.clamp(ratio, 1.0 - _C04_EPS, 1.0 + _C04_EPS)
        vf_loss = 0.5 * ((target - values) ** 2)
        per_token_loss = torch.max(pg1, pg2) + _C04_VF * vf_loss
        loss = ((per_token_loss * _C04_MASK).sum(dim=1) / _C04_MASK.sum(dim=1)).mean()
        loss.backward()
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=ids)


def _c04_proof(bug: bool) -> bool:
    """Changing the reward model's scores leaves the advantage of every token but the last one unchanged."""
    model, ref, ids = _c04_setup()
    with torch.no_grad():
        logps, values = _c04_completion_stats(model, ids)
        ref_logps = _token_logps(ref(input_ids=ids).logits[:, _C04_P - 1:-1], ids[:, _C04_P:])
    kl = logps - ref_logps
    adv_a, _ = _c04_advantages(_c04_rewards(kl, _C04_SCORES), values, bug)
    adv_b, _ = _c04_advantages(_c04_rewards(kl, -_C04_SCORES + 2.0), values, bug)
    early = _C04_MASK.clone()
    early[torch.arange(_C04_B), _C04_LENS - 1] = 0
    return bool(torch.allclose(adv_a[early.bool()], adv_b[early.bool()]))


# --------------------------------------------------------------------------------------------- case-05
# pytorch/rl PR #3886 ("Normalize reward loss over valid pairs"): GPT2RewardModel.compute_reward_loss skips
# chosen/rejected pairs that are identical (no preference signal; after truncation this happens often), but the
# final loss was still divided by the original batch size. Every batch with skipped pairs silently scales the loss
# and its gradient down by (valid pairs / batch size), a per-batch random shrink of the learning rate. Fix in the PR:
# count the pairs that contribute and divide by that count.

_C05_PAD = 0
_C05_CHOSEN = torch.tensor([
    [5, 6, 7, 8, 9, 10, 11, 0],
    [12, 13, 14, 15, 16, 0, 0, 0],
    [17, 18, 19, 20, 21, 22, 23, 24],
    [25, 26, 27, 28, 29, 30, 0, 0],
])
_C05_REJECTED = torch.tensor([
    [5, 6, 7, 31, 32, 0, 0, 0],
    [12, 13, 14, 15, 16, 0, 0, 0],  # identical to chosen (truncated)
    [17, 18, 19, 20, 21, 22, 23, 24],  # identical to chosen (truncated)
    [25, 26, 33, 34, 35, 36, 37, 0],
])


class _C05RewardModel(nn.Module):
    """GPT2RewardModel: GPT-2 transformer with a 1-output head in place of the LM head."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2Model

        cfg = GPT2Config(vocab_size=40, n_embd=32, n_layer=2, n_head=2, n_positions=16, bos_token_id=1,
                         eos_token_id=2, pad_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        self.transformer = GPT2Model(cfg)
        self.lm_head = nn.Linear(32, 1, bias=False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.transformer(input_ids=input_ids, attention_mask=attention_mask)[0]
        return self.lm_head(hidden).squeeze(-1)


def _c05_loss(chosen_ids: torch.Tensor, rejected_ids: torch.Tensor, chosen_rewards: torch.Tensor,
              rejected_rewards: torch.Tensor, bug: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """compute_reward_loss with identical pairs skipped; returns the loss and the per-pair terms."""
    bs = chosen_rewards.shape[0]
    loss = chosen_rewards.sum() * 0.0
    terms = []
    for i in range(bs):
        c_inds = (chosen_ids[i] == _C05_PAD).nonzero()
        c_ind = c_inds[0].item() if len(c_inds) > 0 else chosen_ids.shape[1]
        r_inds = (rejected_ids[i] == _C05_PAD).nonzero()
        r_ind = r_inds[0].item() if len(r_inds) > 0 else rejected_ids.shape[1]
        end_ind = max(c_ind, r_ind)
        divergence = (chosen_ids[i] != rejected_ids[i]).nonzero()
        if len(divergence) == 0:
            continue  # identical pair: no preference signal
        divergence_ind = divergence[0].item()
        c_trunc = chosen_rewards[i][divergence_ind:end_ind]
        r_trunc = rejected_rewards[i][divergence_ind:end_ind]
        term = -F.logsigmoid(c_trunc - r_trunc).mean()
        terms.append(term)
        loss = loss + term
    denom = bs if bug else max(len(terms), 1)
    return loss / denom, terms


def _c05_build(bug: bool) -> Case:
    """Tiny GPT-2 reward model trained on pairwise comparisons, two of four pairs identical after truncation."""
    torch.manual_seed(0)
    model = _C05RewardModel().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    c_att = (_C05_CHOSEN != _C05_PAD).long()
    r_att = (_C05_REJECTED != _C05_PAD).long()

    def step() -> torch.Tensor:
        opt.zero_grad()
        chosen_rewards = model(_C05_CHOSEN, c_att)
        rejected_rewards = model(_C05_REJECTED, r_att)
        loss, _ = _c05_loss(_C05_CHOSEN, _C05_REJECTED, chosen_rewards, rejected_rewards, bug)
        loss.backward()
        opt.step()
        return loss

    batch = {"chosen_input_ids": _C05_CHOSEN, "chosen_attention_mask": c_att,
             "rejected_input_ids": _C05_REJECTED, "rejected_attention_mask": r_att}
    return model, step, _kw(optimizer=opt, inputs=batch)


def _c05_proof(bug: bool) -> bool:
    """The loss (hence the gradient) is smaller than the mean over the pairs that carry a preference."""
    torch.manual_seed(0)
    model = _C05RewardModel().eval()
    with torch.no_grad():
        cr = model(_C05_CHOSEN, (_C05_CHOSEN != _C05_PAD).long())
        rr = model(_C05_REJECTED, (_C05_REJECTED != _C05_PAD).long())
        loss, terms = _c05_loss(_C05_CHOSEN, _C05_REJECTED, cr, rr, bug)
        mean_valid = torch.stack(terms).mean()
    return not torch.allclose(loss, mean_valid, rtol=1e-4)


CASES: list[BlindCase] = [
    BlindCase("b30a-01", "https://github.com/allenai/OLMo/pull/634", "auxiliary loss normalization",
              "The summed softmax Z-loss is divided by the number of micro-batches instead of the batch's token "
              "count, so the auxiliary term is tokens-per-micro-batch times stronger than configured.",
              _c01_build, _c01_proof,
              known_miss="an auxiliary z-loss normalised by the wrong count: a term's weight against the batch is arithmetic inside the loss"),
    BlindCase("b30a-02", "https://github.com/huggingface/trl/issues/1911", "KTO KL pairs not mismatched",
              "The KL batch is built by reversing the completions, so with an odd batch size the middle prompt is "
              "paired with its own completion and the KL reference point is biased.", _c02_build, _c02_proof,
              known_miss="KL reference pairs built from matched prompt/completion pairs: which pairs a KL estimate should mismatch is data semantics"),
    BlindCase("b30a-03", "https://github.com/huggingface/trl/issues/4147", "chat template header supervised",
              "The prompt is tokenized without the generation prompt, so the assistant turn header falls inside the "
              "completion mask and is trained on.", _c03_build, _c03_proof,
              known_miss="chat-template header tokens left in the labels: which tokens of a turn are template is tokenizer semantics the batch does not carry"),
    BlindCase("b30a-04", "https://github.com/natolambert/rlhf-book/pull/216", "PPO advantages from rewards",
              "Advantages and value targets use per-token rewards instead of returns, so the reward model's score "
              "only reaches the last completion token.", _c04_build, _c04_proof,
              known_miss="PPO advantages computed from raw rewards: the estimator's arithmetic is outside the model"),
    BlindCase("b30a-05", "https://github.com/pytorch/rl/pull/3886", "reward loss normalization",
              "Identical chosen/rejected pairs are skipped but the loss is still divided by the full batch size, so "
              "the gradient shrinks with the number of skipped pairs.", _c05_build, _c05_proof,
              known_miss="a pairwise loss divided by the batch size where only the valid pairs count: a term weight is not measured",
              # a true finding: the twin keeps the original code's reading of the rejected rewards past its end
              # (end_ind is the longer of the two lengths), which the fix in the thread does not change
              known_alarm=("DATA-005",)),
]
