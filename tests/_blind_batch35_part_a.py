"""Blind batch 35 (part a): silent LLM fine-tuning and alignment bugs from public GitHub threads, each with its twin.

Collected by someone who does not write the audit's checks. Every case builds the user's setup on a tiny model
(transformers Llama models from tiny configs in code, a real fast tokenizer and chat template built in code, plain
torch DoRA layers; nothing is downloaded) and proves the bug without the audit on real tensors and real steps.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw


def _llama(seed: int = 0, **kw):
    from transformers import LlamaConfig, LlamaForCausalLM

    base = {"vocab_size": 48, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 64, "pad_token_id": 0,
            "bos_token_id": 1, "eos_token_id": 2, "use_cache": False}
    base.update(kw)
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**base)).train()


# --------------------------------------------------------------------------------------------- case-01
# huggingface/trl issue #1400 (fixed by PR #1509): SFTTrainer formats a conversational ("messages") dataset with
# `tokenizer.apply_chat_template(..., tokenize=False)`; the Llama chat template already writes `{{ bos_token }}`. The
# trainer then tokenizes that text again with the default `add_special_tokens=True`, and the Llama tokenizer's
# post-processor prepends a second BOS, so every training sequence starts `<s><s>[INST] ...`. Nothing fails and the
# loss falls normally; the model is simply trained on a doubled BOS it never sees at inference (and one label asks
# it to predict BOS after BOS). Fix in the PR: when a chat template formatted the data, tokenize with
# `add_special_tokens=False`.

_C01_WORDS = ["hello", "how", "are", "you", "fine", "thanks", "what", "is", "two", "plus", "four", "the", "sky",
              "blue", "yes", "no", "tell", "me", "a", "joke", "why", "not", "good", "day"]
_C01_CONVS = [
    [("hello how are you", "fine thanks")],
    [("what is two plus two", "four")],
    [("is the sky blue", "yes the sky is blue")],
    [("tell me a joke", "why not good day")],
]


def _c01_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    special = ["<pad>", "<s>", "</s>", "<unk>", "[INST]", "[/INST]"]
    vocab = {tok: i for i, tok in enumerate(special + _C01_WORDS)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.add_special_tokens(special)
    # Llama's tokenizer prepends BOS to every encoded text (add_bos_token=True)
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                      special_tokens=[("<s>", vocab["<s>"])])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                  unk_token="<unk>")
    tok.chat_template = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }}"
                         " [/INST]{% else %} {{ m['content'] }} {{ eos_token }}{% endif %}{% endfor %}")
    return tok


def _c01_batch(bug: bool) -> dict[str, torch.Tensor]:
    tok = _c01_tokenizer()
    texts = []
    for conv in _C01_CONVS:
        messages = []
        for user, assistant in conv:
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
        texts.append(tok.apply_chat_template(messages, tokenize=False))  # trl's conversations_formatting_function
    # SFTTrainer's _prepare_non_packed_dataloader: tokenizer(text, add_special_tokens=...) then the LM collator
    enc = [tok(t, add_special_tokens=bug)["input_ids"] for t in texts]
    width = max(len(e) for e in enc)
    ids = torch.full((len(enc), width), tok.pad_token_id, dtype=torch.long)
    for i, e in enumerate(enc):
        ids[i, : len(e)] = torch.tensor(e)
    mask = (ids != tok.pad_token_id).long()
    labels = ids.masked_fill(mask == 0, -100)  # DataCollatorForLanguageModeling(mlm=False)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _c01_build(bug: bool) -> Case:
    model = _llama(3501, vocab_size=len(_C01_WORDS) + 6)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-4)
    batch = _c01_batch(bug)

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=batch)


def _c01_proof(bug: bool) -> bool:
    """Does a training sequence start with two BOS tokens, so that one label trains 'BOS follows BOS'?"""
    batch = _c01_batch(bug)
    bos = _c01_tokenizer().bos_token_id
    ids, labels = batch["input_ids"], batch["labels"]
    return bool(((ids[:, 0] == bos) & (ids[:, 1] == bos) & (labels[:, 1] == bos)).any())


# --------------------------------------------------------------------------------------------- case-02
# pytorch/torchtitan PR #2755 ("Fix off-by-one masking for chat data"): ChatDataset builds `input_ids =
# full_tokens[:-1]` and `label_ids = full_tokens[1:]` (labels already shifted, the loss does not shift again) and then
# masks the prompt with `label_ids[:prompt_len] = IGNORE_INDEX`. Since the labels are shifted, position prompt_len-1
# is the one whose target is the first assistant token, and it is masked too: the first token of every answer never
# carries loss. Training runs and the loss falls. Fix in the PR: mask `label_ids[:prompt_len - 1]`.

_C02_PROMPTS = [[1, 5, 9, 14, 7, 3], [1, 11, 4, 3], [1, 8, 8, 12, 6, 10, 3], [1, 13, 5, 3]]  # BOS ... "assistant:"
_C02_ANSWERS = [[20, 21, 22, 2], [23, 24, 2], [25, 26, 27, 28, 2], [29, 30, 31, 2]]  # ... EOS
_C02_SEQ = 11


def _c02_batch(bug: bool) -> dict[str, torch.Tensor]:
    ids = torch.zeros(len(_C02_PROMPTS), _C02_SEQ, dtype=torch.long)
    labels = torch.full((len(_C02_PROMPTS), _C02_SEQ), -100, dtype=torch.long)
    for i, (p, a) in enumerate(zip(_C02_PROMPTS, _C02_ANSWERS)):
        full = p + a
        input_ids, label_ids = full[:-1], full[1:]
        prompt_len = len(p)
        mask_end = min(prompt_len, len(label_ids)) if bug else min(max(prompt_len - 1, 0), len(label_ids))
        label_ids[:mask_end] = [-100] * mask_end
        ids[i, : len(input_ids)] = torch.tensor(input_ids)
        labels[i, : len(label_ids)] = torch.tensor(label_ids)
    return {"input_ids": ids, "labels": labels}


def _c02_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(input_ids=batch["input_ids"]).logits
    # torchtitan's cross_entropy_loss: labels are pre-shifted, so logits and labels line up position by position
    loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(0, 1), ignore_index=-100)
    return loss, logits


def _c02_build(bug: bool) -> Case:
    model = _llama(3511)
    opt = torch.optim.AdamW(model.parameters(), lr=8e-4, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = 2
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
    batch = _c02_batch(bug)

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss, _ = _c02_loss(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=batch, lr_scheduler=sched, total_steps=20)


def _c02_proof(bug: bool) -> bool:
    """Is the gradient of the loss zero at every position whose target is the first token of the answer?"""
    model = _llama(3511)
    batch = _c02_batch(bug)
    loss, logits = _c02_loss(model, batch)
    logits.retain_grad()
    loss.backward()
    first = torch.tensor([len(p) - 1 for p in _C02_PROMPTS])
    g = logits.grad[torch.arange(len(first)), first].abs().sum(-1)
    return bool((g == 0).all())


# --------------------------------------------------------------------------------------------- case-03
# jingyaogong/minimind issue #541 (fixed in commit d7f4f4e "[fix] ppo mask"): train_ppo.py left-pads the prompts
# (`tokenizer.padding_side = 'left'`), generates, and reads the critic's value of each sequence at
# `last_indices = full_mask.sum(dim=1) - 1`. With left padding (and right padding after an early EOS) the count of
# real tokens minus one is not the index of the last real token, so the value that enters `advantages = rewards -
# values` and the value loss is read at a token in the middle of the response or inside the prompt. Training runs,
# the critic loss falls (it fits the reward at the wrong position), the advantages are silently wrong. Fix:
# `last_indices = (full_mask * torch.arange(full_mask.size(1))).argmax(dim=1)`, the rightmost non-pad position.

_C03_PAD, _C03_EOS = 0, 2
_C03_P, _C03_R = 6, 5


def _c03_rollout() -> torch.Tensor:
    g = _gen(3521)
    rows = []
    for n_prompt, n_resp, eos in [(6, 5, False), (4, 3, True), (3, 2, True)]:
        prompt = [_C03_PAD] * (_C03_P - n_prompt) + torch.randint(3, 48, (n_prompt,), generator=g).tolist()
        resp = torch.randint(3, 48, (n_resp,), generator=g).tolist() + ([_C03_EOS] if eos else [])
        resp = resp + [_C03_PAD] * (_C03_R - len(resp))
        rows.append(prompt + resp)
    return torch.tensor(rows)


_C03_GEN = _c03_rollout()
_C03_REWARDS = torch.tensor([0.8, -0.4, 1.2])  # stands in for the reward model's clipped scores


class _Critic(nn.Module):
    """minimind's CriticModel: the LM backbone with a one-output value head in place of lm_head."""

    def __init__(self, backbone: nn.Module) -> None:
        super().__init__()
        self.model = backbone
        self.value_head = nn.Linear(backbone.config.hidden_size, 1)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.value_head(hidden).squeeze(-1)


def _c03_last_indices(full_mask: torch.Tensor, bug: bool) -> torch.Tensor:
    if bug:
        return full_mask.sum(dim=1) - 1
    return (full_mask * torch.arange(full_mask.size(1))).argmax(dim=1)


def _c03_setup(bug: bool):
    actor = _llama(3522)
    old_actor = copy.deepcopy(actor).eval().requires_grad_(False)
    ref_model = copy.deepcopy(actor).eval().requires_grad_(False)
    torch.manual_seed(3523)
    critic = _Critic(_llama(3523).model).train()
    return actor, old_actor, ref_model, critic


def _c03_build(bug: bool) -> Case:
    actor, old_actor, ref_model, critic = _c03_setup(bug)
    lr, clip_eps, vf_coef, kl_coef, total = 1e-5, 0.1, 0.5, 0.02, 20  # lr scaled up from 8e-8 for the tiny model
    actor_opt = torch.optim.AdamW(actor.parameters(), lr=lr)
    critic_opt = torch.optim.AdamW(critic.parameters(), lr=lr)
    actor_sched = torch.optim.lr_scheduler.CosineAnnealingLR(actor_opt, T_max=total, eta_min=lr / 10)
    critic_sched = torch.optim.lr_scheduler.CosineAnnealingLR(critic_opt, T_max=total, eta_min=lr / 10)
    gen_out, rewards = _C03_GEN, _C03_REWARDS
    prompt_lengths = torch.full((gen_out.size(0),), _C03_P, dtype=torch.long)

    def seq_logp(model: nn.Module, full_mask: torch.Tensor, final_mask: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=gen_out, attention_mask=full_mask).logits
        labels = gen_out[:, 1:]
        logp = F.log_softmax(logits[:, :-1], dim=-1).gather(2, labels.unsqueeze(-1)).squeeze(-1)
        return (logp * final_mask).sum(dim=1)

    def step() -> torch.Tensor:
        full_mask = (gen_out != _C03_PAD).long()
        values_seq = critic(input_ids=gen_out, attention_mask=full_mask)
        last_indices = _c03_last_indices(full_mask, bug)
        values = values_seq[torch.arange(values_seq.size(0)), last_indices]
        advantages = rewards - values.detach()

        labels = gen_out[:, 1:]
        resp_mask = torch.arange(gen_out.size(1) - 1).unsqueeze(0) >= prompt_lengths.unsqueeze(1)
        final_mask = resp_mask & (~labels.eq(_C03_PAD))
        actor_logp = seq_logp(actor, full_mask, final_mask)
        with torch.no_grad():
            old_logp = seq_logp(old_actor, full_mask, final_mask)
            ref_logp = seq_logp(ref_model, full_mask, final_mask)
        kl_ref = (actor_logp - ref_logp).mean()
        ratio = torch.exp(actor_logp - old_logp)
        surr1 = ratio * advantages
        surr2 = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * advantages
        policy_loss = -torch.min(surr1, surr2).mean()
        value_loss = F.mse_loss(values, rewards)
        loss = policy_loss + vf_coef * value_loss + kl_coef * kl_ref
        loss.backward()
        torch.nn.utils.clip_grad_norm_(actor.parameters(), 1.0)
        torch.nn.utils.clip_grad_norm_(critic.parameters(), 1.0)
        actor_opt.step()
        critic_opt.step()
        actor_sched.step()
        critic_sched.step()
        actor_opt.zero_grad()
        critic_opt.zero_grad()
        return loss

    model = nn.ModuleDict({"actor": actor, "critic": critic})
    return model, step, _kw(optimizer=critic_opt, inputs={"input_ids": gen_out}, lr_scheduler=critic_sched,
                            total_steps=total)


def _c03_proof(bug: bool) -> bool:
    """Does the value loss put zero gradient on the critic's value at some sequence's last real token?"""
    _, _, _, critic = _c03_setup(bug)
    full_mask = (_C03_GEN != _C03_PAD).long()
    values_seq = critic(input_ids=_C03_GEN, attention_mask=full_mask)
    values_seq.retain_grad()
    values = values_seq[torch.arange(3), _c03_last_indices(full_mask, bug)]
    F.mse_loss(values, _C03_REWARDS).backward()
    true_last = torch.tensor([max(j for j in range(_C03_GEN.size(1)) if full_mask[i, j]) for i in range(3)])
    return bool((values_seq.grad[torch.arange(3), true_last] == 0).any())


# --------------------------------------------------------------------------------------------- case-04
# modelscope/ms-swift PR #10167 ("honor DPO loss type"): the Megatron DPO trainer stores `args.loss_type` on its
# DummyDPOTrainer but calls the shared `dpo_loss(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps)`
# without passing it, and that function dispatches on its own `loss_type` argument whose default is 'sigmoid'. A run
# configured with `--loss_type hinge` (or ipo) silently trains sigmoid DPO; the logged loss and reward margins look
# like any DPO run. Fix in the PR: pass `loss_type=args.loss_type`.

_C04_PROMPTS = [[1, 7, 12, 5], [1, 9, 4]]
_C04_CHOSEN = [[20, 21, 22, 2], [23, 24, 2]]
_C04_REJECTED = [[30, 31, 2], [32, 33, 34, 35, 2]]


def _c04_batch() -> dict[str, torch.Tensor]:
    seqs = [(p, r) for p, r in zip(_C04_PROMPTS, _C04_CHOSEN)] + [(p, r) for p, r in zip(_C04_PROMPTS, _C04_REJECTED)]
    width = max(len(p) + len(r) for p, r in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    for i, (p, r) in enumerate(seqs):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        labels[i, len(p): len(p) + len(r)] = torch.tensor(r)
    return {"input_ids": ids, "attention_mask": (ids != 0).long(), "labels": labels}


class _DummyDPO:
    """The shared DPO loss (sigmoid / hinge / ipo branches) with the trainer's stored settings."""

    def __init__(self, loss_type: str, beta: float) -> None:
        self.loss_type = loss_type
        self.beta = beta
        self.label_smoothing = 0.0

    def dpo_loss(self, chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, loss_type="sigmoid"):
        logits = (chosen_logps - rejected_logps) - (ref_chosen_logps - ref_rejected_logps)
        if loss_type == "sigmoid":
            losses = -F.logsigmoid(self.beta * logits)
        elif loss_type == "hinge":
            losses = torch.relu(1 - self.beta * logits)
        elif loss_type == "ipo":
            losses = (logits - 1 / (2 * self.beta)) ** 2
        else:
            raise ValueError(loss_type)
        chosen_rewards = self.beta * (chosen_logps - ref_chosen_logps).detach()
        rejected_rewards = self.beta * (rejected_logps - ref_rejected_logps).detach()
        return losses, chosen_rewards, rejected_rewards


def _c04_logps(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    labels = batch["labels"][:, 1:]
    mask = labels != -100
    per_token = torch.gather(logits.log_softmax(-1), 2, labels.clamp(min=0).unsqueeze(2)).squeeze(2)
    return (per_token * mask).sum(-1)


def _c04_setup(bug: bool):
    policy = _llama(3531)
    ref = copy.deepcopy(policy).eval().requires_grad_(False)
    dummy = _DummyDPO(loss_type="hinge", beta=0.1)  # --loss_type hinge --beta 0.1
    batch = _c04_batch()
    n = batch["input_ids"].size(0) // 2

    def loss_func() -> torch.Tensor:
        logps = _c04_logps(policy, batch)
        with torch.no_grad():
            ref_logps = _c04_logps(ref, batch)
        args = (logps[:n], logps[n:], ref_logps[:n], ref_logps[n:])
        if bug:
            loss, _, _ = dummy.dpo_loss(*args)
        else:
            loss, _, _ = dummy.dpo_loss(*args, loss_type=dummy.loss_type)
        return loss.mean()

    return policy, ref, dummy, batch, loss_func


def _c04_build(bug: bool) -> Case:
    policy, _, _, batch, loss_func = _c04_setup(bug)
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=5e-4)

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = loss_func()
        loss.backward()
        opt.step()
        return loss

    return policy, step, _kw(optimizer=opt, inputs=batch)


def _c04_proof(bug: bool) -> bool:
    """After a few real steps, is the loss being optimised the sigmoid DPO loss rather than the configured hinge?"""
    policy, ref, dummy, batch, loss_func = _c04_setup(bug)
    opt = torch.optim.AdamW(policy.parameters(), lr=5e-4)
    for _ in range(2):
        opt.zero_grad()
        loss_func().backward()
        opt.step()
    with torch.no_grad():
        trained = loss_func()
        lp, rlp = _c04_logps(policy, batch), _c04_logps(ref, batch)
        n = lp.size(0) // 2
        logits = (lp[:n] - lp[n:]) - (rlp[:n] - rlp[n:])
        hinge = torch.relu(1 - dummy.beta * logits).mean()
        sigmoid = (-F.logsigmoid(dummy.beta * logits)).mean()
    return bool(torch.allclose(trained, sigmoid, atol=1e-6) and not torch.allclose(trained, hinge, atol=1e-4))


# --------------------------------------------------------------------------------------------- case-05
# catid/dora PR #1 (rasbt, "fix lora init"): the DoRA layer dropped in for nn.Linear initialised both low-rank factors
# to zero (`lora_A = zeros(d_out, rank)`, `lora_B = zeros(rank, d_in)`). With A = B = 0 the gradient of each factor
# is the other factor times the upstream gradient, so both stay exactly zero forever; only the magnitude vector `m`
# trains. The loss still falls (the README's DoRA loss went down), but the directional low-rank update that DoRA is
# about never happens. Fix in the PR: `lora_A = randn(d_out, rank) / sqrt(rank)`, `lora_B` stays zero.

class _DoRALayer(nn.Module):
    def __init__(self, d_in: int, d_out: int, rank: int, weight: torch.Tensor, bias: torch.Tensor,
                 init_a: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = nn.Parameter(bias, requires_grad=False)
        self.m = nn.Parameter(self.weight.norm(p=2, dim=0, keepdim=True))
        if init_a:
            std_dev = 1 / math.sqrt(rank)
            self.lora_A = nn.Parameter(torch.randn(d_out, rank, generator=_gen(3541 + d_out + d_in)) * std_dev)
        else:
            self.lora_A = nn.Parameter(torch.zeros(d_out, rank))
        self.lora_B = nn.Parameter(torch.zeros(rank, d_in))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lora = torch.matmul(self.lora_A, self.lora_B)
        adapted = self.weight + lora
        column_norm = adapted.norm(p=2, dim=0, keepdim=True)
        norm_adapted = adapted / column_norm
        calc_weights = self.m * norm_adapted
        return F.linear(x, calc_weights, self.bias)


_C05_IDS = torch.randint(3, 48, (4, 12), generator=_gen(3542))


def _c05_model(bug: bool) -> nn.Module:
    model = _llama(3543)
    model.requires_grad_(False)
    for layer in model.model.layers:
        for name in ("q_proj", "v_proj"):
            lin = getattr(layer.self_attn, name)
            bias = torch.zeros(lin.out_features)  # the Llama projections have no bias
            setattr(layer.self_attn, name, _DoRALayer(lin.in_features, lin.out_features, 4,
                                                      lin.weight.data.clone(), bias, init_a=not bug))
    return model.train()


def _c05_build(bug: bool) -> Case:
    model = _c05_model(bug)
    opt = torch.optim.AdamW(filter(lambda p: p.requires_grad, model.parameters()), lr=1e-3)
    batch = {"input_ids": _C05_IDS, "labels": _C05_IDS}

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=batch)


def _c05_proof(bug: bool) -> bool:
    """After three real steps, are all low-rank DoRA factors still exactly zero (only the magnitudes moved)?"""
    model, step, _ = _c05_build(bug)
    for _ in range(3):
        step()
    factors = [p for n, p in model.named_parameters() if "lora_A" in n or "lora_B" in n]
    return all(bool((p == 0).all()) for p in factors)


CASES: list[BlindCase] = [
    BlindCase("b35a-01", "https://github.com/huggingface/trl/issues/1400", "doubled BOS from chat template",
              "The chat template already writes BOS and the text is tokenized again with special tokens, so every "
              "SFT sequence starts with two BOS tokens.", _c01_build, _c01_proof),
    BlindCase("b35a-02", "https://github.com/pytorch/torchtitan/pull/2755", "first answer token masked",
              "The prompt mask is applied to pre-shifted labels without subtracting one, so the label of the first "
              "assistant token is ignored in every example.", _c02_build, _c02_proof,
              known_miss="the label of the first answer token masked with the prompt: where an answer begins is template semantics the batch does not carry"),
    BlindCase("b35a-03", "https://github.com/jingyaogong/minimind/issues/541", "critic value read at padding",
              "With left-padded rollouts the critic's sequence value is read at count-minus-one rather than the "
              "last real token, so the value loss and advantages use a value from the wrong position.",
              _c03_build, _c03_proof,
              known_miss="a critic value read at count - 1 on left-padded rows: which real position a sequence value belongs to is not judged for a model inside a container of models"),
    BlindCase("b35a-04", "https://github.com/modelscope/ms-swift/pull/10167", "configured DPO loss ignored",
              "The trainer calls the shared DPO loss without the configured loss_type, so a hinge (or IPO) run "
              "silently trains the default sigmoid loss.", _c04_build, _c04_proof,
              known_miss="a configured loss type never passed to the loss function: which variant a call was meant to compute is not in the step"),
    BlindCase("b35a-05", "https://github.com/catid/dora/pull/1", "both LoRA factors zero-initialised",
              "Both DoRA low-rank factors start at zero, so neither ever receives a gradient and only the magnitude "
              "vector trains.", _c05_build, _c05_proof),
]
