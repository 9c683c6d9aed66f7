"""Blind batch 39 (part a): silent transformer training bugs from public GitHub threads, each with its fixed twin.

Collected by someone who does not write the audit's checks. Every case builds the user's setup on a tiny model
(transformers BERT, GPT-2 and Llama models from tiny configs in code, a real fast tokenizer over a vocabulary built in
code; nothing is downloaded) and proves the bug without the audit on real tensors and real steps.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

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
# deepset-ai/FARM issue #46 (fixed by #54, commit "Fix num of optimization steps for LR schedule"): the number of
# optimization steps handed to the warmup-linear schedule was `int(n_examples / batch_size / grad_acc_steps) *
# n_epochs`. The DataLoader keeps the last, smaller batch, so every epoch really has ceil(n_examples / batch_size)
# steps: the schedule's total is too small and the learning rate reaches 0 before training ends ("Training beyond
# specified 't_total'. Learning rate multiplier set to 0."). The loss keeps its plausible curve; the last steps of the
# run simply do not train. Fix: count the steps from the loader, `n_batches=len(data_silo.loaders["train"])`, times the
# epochs. (The user's BertAdam/WarmupLinearSchedule is reproduced with AdamW and transformers' linear schedule.)

_C01_N, _C01_BS, _C01_EPOCHS, _C01_WARMUP = 10, 4, 2, 0.1
_C01_IDS = torch.randint(3, 60, (_C01_N, 12), generator=_gen(3901))
_C01_Y = torch.randint(0, 2, (_C01_N,), generator=_gen(3902))
_C01_BATCHES = [(_C01_IDS[i:i + _C01_BS], _C01_Y[i:i + _C01_BS]) for i in range(0, _C01_N, _C01_BS)]
_C01_RUN_STEPS = len(_C01_BATCHES) * _C01_EPOCHS  # what the training loop really runs: 3 batches x 2 epochs


def _c01_setup(bug: bool):
    from transformers import BertForSequenceClassification, get_linear_schedule_with_warmup

    torch.manual_seed(0)
    model = BertForSequenceClassification(_bert_config(num_labels=2)).train()
    grad_acc_steps = 1
    if bug:
        t_total = int(_C01_N / _C01_BS / grad_acc_steps) * _C01_EPOCHS  # calculate_optimization_steps: 2 * 2 = 4
    else:
        t_total = int(len(_C01_BATCHES) / grad_acc_steps) * _C01_EPOCHS  # n_batches from the loader: 3 * 2 = 6
    no_decay = ["bias", "LayerNorm.bias", "LayerNorm.weight"]
    named = list(model.named_parameters())
    groups = [{"params": [p for n, p in named if not any(nd in n for nd in no_decay)], "weight_decay": 0.01},
              {"params": [p for n, p in named if any(nd in n for nd in no_decay)], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=1e-3)
    sched = get_linear_schedule_with_warmup(opt, num_warmup_steps=int(_C01_WARMUP * t_total),
                                            num_training_steps=t_total)
    state = {"i": 0}

    def step() -> torch.Tensor:
        ids, y = _C01_BATCHES[state["i"] % len(_C01_BATCHES)]
        state["i"] += 1
        opt.zero_grad()
        loss = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=y).loss
        loss.backward()
        opt.step()
        sched.step()
        return loss

    return model, opt, sched, step


def _c01_build(bug: bool) -> Case:
    model, opt, sched, step = _c01_setup(bug)
    ids, y = _C01_BATCHES[0]
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": y}
    return model, step, _kw(optimizer=opt, inputs=batch, lr_scheduler=sched, total_steps=_C01_RUN_STEPS)


def _c01_proof(bug: bool) -> bool:
    """Run the whole training (2 epochs of 3 batches): does any of its real steps leave the classifier unmoved?"""
    model, opt, _, step = _c01_setup(bug)
    w = model.classifier.weight
    for _ in range(_C01_RUN_STEPS):
        before = w.detach().clone()
        lr = opt.param_groups[0]["lr"]
        step()
        if lr == 0.0 or torch.equal(before, w.detach()):
            return True
    return False


# --------------------------------------------------------------------------------------------- case-02
# raphaelsty/neural-cherche issue #36 (fixed in commit "Fix #36"): `utils.freeze_layers(model, n_layers)` — what the
# models' `freeze_layers_except_last_n` calls — is documented to "freeze layers before the last n_layers", but it
# froze every parameter before the last hard-coded 5 (`index < trainable_layers - 5`), whatever n_layers said. A user
# who asks SPLADE to keep the last encoder layer and the MLM head trainable (n_layers=21 here) gets only the head's 5
# tensors trained; the ranking loss still falls a little, the encoder layer just never adapts. Fix: `index <
# trainable_layers - n_layers`.

_C02_N_LAYERS = 21  # the last BertLayer (16 tensors) and the MLM head (5 tensors) of the tiny BertForMaskedLM
_C02_Q = torch.randint(3, 60, (4, 8), generator=_gen(3911))
_C02_P = torch.randint(3, 60, (4, 12), generator=_gen(3912))
_C02_NEG = torch.randint(3, 60, (4, 12), generator=_gen(3913))


def _c02_freeze_layers(model, n_layers: int, bug: bool):
    trainable_layers = 0
    for _, param in model.named_parameters():
        if param.requires_grad:
            trainable_layers += 1
    keep = 5 if bug else n_layers
    for index, (_, param) in enumerate(model.named_parameters()):
        if index < (trainable_layers - keep):
            param.requires_grad = False
    return model


def _c02_splade(model, ids: torch.Tensor) -> torch.Tensor:
    mask = torch.ones_like(ids)
    logits = model(input_ids=ids, attention_mask=mask).logits
    return torch.amax(torch.log1p(torch.relu(logits * mask.unsqueeze(-1))), dim=1)  # sparse activations (B, V)


def _c02_setup(bug: bool):
    from transformers import BertForMaskedLM

    torch.manual_seed(0)
    model = BertForMaskedLM(_bert_config()).train()
    model = _c02_freeze_layers(model, n_layers=_C02_N_LAYERS, bug=bug)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> torch.Tensor:
        opt.zero_grad()
        anchor, positive, negative = _c02_splade(model, _C02_Q), _c02_splade(model, _C02_P), _c02_splade(model, _C02_NEG)
        scores = torch.stack([(anchor * positive).sum(-1), (anchor * negative).sum(-1)], dim=-1)
        loss = F.cross_entropy(scores, torch.zeros(scores.shape[0], dtype=torch.long))  # losses.Ranking
        loss.backward()
        opt.step()
        return loss

    return model, opt, step


def _c02_build(bug: bool) -> Case:
    model, opt, step = _c02_setup(bug)
    return model, step, _kw(optimizer=opt, inputs={"input_ids": _C02_Q})


def _c02_proof(bug: bool) -> bool:
    """After a step, has the last encoder layer (inside the last n_layers the user kept trainable) stayed put?"""
    model, _, step = _c02_setup(bug)
    w = model.bert.encoder.layer[-1].attention.self.query.weight
    before = w.detach().clone()
    step()
    return bool(torch.equal(before, w.detach()))


# --------------------------------------------------------------------------------------------- case-03
# huggingface/trl issue #558 (fixed by PR #566): the reward-trainer example loads the reward model with
# `AutoModelForSequenceClassification.from_pretrained(model_name)`, which builds a 2-label classification head. The
# RewardTrainer loss `-logsigmoid(rewards_chosen - rewards_rejected).mean()` broadcasts over the [batch, 2] logits, so
# training runs and the loss falls, but the "reward" is two independently trained numbers per sequence instead of one
# scalar (and whatever reads it later, e.g. PPO, has to pick one). Fix: `num_labels=1`.

_C03_CHOSEN = torch.randint(3, 60, (4, 10), generator=_gen(3921))
_C03_REJECTED = torch.randint(3, 60, (4, 10), generator=_gen(3922))
_C03_CHOSEN[1, 7:] = 0
_C03_REJECTED[2, 6:] = 0


def _c03_setup(bug: bool):
    from transformers import GPT2Config, GPT2ForSequenceClassification

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    if not bug:
        cfg.num_labels = 1
    model = GPT2ForSequenceClassification(cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = {"input_ids_chosen": _C03_CHOSEN, "attention_mask_chosen": (_C03_CHOSEN != 0).long(),
             "input_ids_rejected": _C03_REJECTED, "attention_mask_rejected": (_C03_REJECTED != 0).long()}

    def step() -> torch.Tensor:
        opt.zero_grad()
        rewards_chosen = model(input_ids=batch["input_ids_chosen"], attention_mask=batch["attention_mask_chosen"])[0]
        rewards_rejected = model(input_ids=batch["input_ids_rejected"],
                                 attention_mask=batch["attention_mask_rejected"])[0]
        loss = -F.logsigmoid(rewards_chosen - rewards_rejected).mean()
        loss.backward()
        opt.step()
        return loss

    return model, opt, step, batch


def _c03_build(bug: bool) -> Case:
    model, opt, step, batch = _c03_setup(bug)
    return model, step, _kw(optimizer=opt, inputs=batch)


def _c03_proof(bug: bool) -> bool:
    """After a training step, does the reward model still give more than one reward per sequence?"""
    model, _, step, batch = _c03_setup(bug)
    step()
    with torch.no_grad():
        rewards = model(input_ids=batch["input_ids_chosen"], attention_mask=batch["attention_mask_chosen"])[0]
    return rewards.shape[-1] != 1


# --------------------------------------------------------------------------------------------- case-04
# huggingface/course PR #26 ("Fix inequalities in answer spans for QA chapter", from a forum report): the course's
# SQuAD preprocessing labels a feature (0, 0) only when its context window lies wholly before or after the answer
# (`offset[context_start][0] > end_char or offset[context_end][1] < start_char`). A window that holds only part of the
# answer falls through to the span search, which runs off the context: the start or end label lands on the [SEP]
# token between question and context (or the one closing the window). Those features train the QA head to point at
# special tokens; the loss looks normal. Fix: `offset[context_start][0] > start_char or offset[context_end][1] <
# end_char` (the answer must be fully inside, as in run_qa.py).

_C04_QUESTION = "what did the cat eat ?"
_C04_CONTEXT = "on monday morning it ate a small red fish near the old river bank after the rain stopped"
_C04_ANSWER = "a small red fish"
_C04_ANSWER_START = _C04_CONTEXT.index(_C04_ANSWER)


def _c04_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3}
    for w in (_C04_QUESTION + " " + _C04_CONTEXT).split():
        vocab.setdefault(w, len(vocab))
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                                   sep_token="[SEP]")


def _c04_features(bug: bool):
    tokenizer = _c04_tokenizer()
    inputs = tokenizer([_C04_QUESTION], [_C04_CONTEXT], max_length=16, truncation="only_second", stride=4,
                       return_overflowing_tokens=True, return_offsets_mapping=True, padding="max_length")
    offset_mapping = inputs.pop("offset_mapping")
    inputs.pop("overflow_to_sample_mapping")
    start_char = _C04_ANSWER_START
    end_char = _C04_ANSWER_START + len(_C04_ANSWER)
    start_positions, end_positions, context_spans = [], [], []
    for i, offset in enumerate(offset_mapping):
        sequence_ids = inputs.sequence_ids(i)
        idx = 0
        while sequence_ids[idx] != 1:
            idx += 1
        context_start = idx
        while sequence_ids[idx] == 1:
            idx += 1
        context_end = idx - 1
        context_spans.append((context_start, context_end))
        if bug:
            outside = offset[context_start][0] > end_char or offset[context_end][1] < start_char
        else:
            outside = offset[context_start][0] > start_char or offset[context_end][1] < end_char
        if outside:
            start_positions.append(0)
            end_positions.append(0)
        else:
            idx = context_start
            while idx <= context_end and offset[idx][0] <= start_char:
                idx += 1
            start_positions.append(idx - 1)
            idx = context_end
            while idx >= context_start and offset[idx][1] >= end_char:
                idx -= 1
            end_positions.append(idx + 1)
    batch = {"input_ids": torch.tensor(inputs["input_ids"]), "attention_mask": torch.tensor(inputs["attention_mask"]),
             "start_positions": torch.tensor(start_positions), "end_positions": torch.tensor(end_positions)}
    return batch, context_spans, len(tokenizer)


def _c04_setup(bug: bool):
    from transformers import BertForQuestionAnswering

    batch, spans, vocab_size = _c04_features(bug)
    torch.manual_seed(0)
    model = BertForQuestionAnswering(_bert_config(vocab_size=vocab_size)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        return loss

    return model, opt, step, batch, spans


def _c04_build(bug: bool) -> Case:
    model, opt, step, batch, _ = _c04_setup(bug)
    return model, step, _kw(optimizer=opt, inputs=batch)


def _c04_proof(bug: bool) -> bool:
    """Does any feature the QA loss trains on carry a start/end label that is neither [CLS] nor a context token?"""
    _, _, _, batch, spans = _c04_setup(bug)
    for i, (cs, ce) in enumerate(spans):
        for pos in (int(batch["start_positions"][i]), int(batch["end_positions"][i])):
            if pos != 0 and not cs <= pos <= ce:
                return True
    return False


# --------------------------------------------------------------------------------------------- case-05
# fla-org/flash-linear-attention issue #1073 (fixed by PR #1076): `grpo_loss_with_old_logps` builds the per-token GRPO
# loss already negated, `token_loss = -(min(A * w, A * w_clipped) - beta * KL) * mask`, and then negates it again when
# reducing, `loss = -token_loss.sum() / mask.sum()`. Minimizing that maximizes the clipped surrogate's negative: the
# policy is pushed away from high-advantage completions (and towards more KL). Nothing crashes and the loss goes down
# step after step. Fix: `loss = token_loss.sum() / completion_mask.sum()`.

_C05_PROMPT = torch.randint(3, 40, (1, 5), generator=_gen(3941)).repeat(4, 1)
_C05_COMPLETIONS = torch.randint(3, 40, (4, 6), generator=_gen(3942))
_C05_COMPLETIONS[3, 4:] = 0
_C05_PAD_MASK = _C05_COMPLETIONS != 0
_C05_REWARDS = torch.tensor([1.0, 0.0, 0.5, 0.0])
_C05_L = _C05_COMPLETIONS.shape[1]


def _c05_logps(model, input_ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=input_ids).logits[:, -_C05_L - 1:-1]
    return torch.gather(logits.log_softmax(-1), 2, input_ids[:, -_C05_L:].unsqueeze(-1)).squeeze(-1)


def _c05_grpo_loss(logps, ref_logps, old_logps, pad_mask, logits_to_keep, rewards, bug: bool, beta=0.2,
                   epsilon=0.2):
    B = logps.shape[0]
    rewards_shaped = rewards.view(-1, B)
    advantages = (rewards_shaped - rewards_shaped.mean(dim=1, keepdim=True)) / (
        rewards_shaped.std(dim=1, keepdim=True) + 1e-8)
    advantages = advantages.view(-1)
    per_token_kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
    importance_weights = torch.exp(logps - old_logps)
    importance_weights_clipped = torch.clamp(importance_weights, 1 - epsilon, 1 + epsilon)
    completion_mask = torch.arange(logits_to_keep)[None, :] >= 0
    completion_mask = completion_mask & pad_mask
    advantages = advantages.unsqueeze(1)
    token_loss = -(torch.min(advantages * importance_weights, advantages * importance_weights_clipped)
                   - beta * per_token_kl) * completion_mask
    if bug:
        return -token_loss.sum() / completion_mask.sum()
    return token_loss.sum() / completion_mask.sum()


def _c05_setup(bug: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32, pad_token_id=0,
                      bos_token_id=1, eos_token_id=2)
    policy = LlamaForCausalLM(cfg).train()
    ref = copy.deepcopy(policy).eval().requires_grad_(False)
    input_ids = torch.cat([_C05_PROMPT, _C05_COMPLETIONS], dim=1)
    with torch.no_grad():
        ref_logps = _c05_logps(ref, input_ids)
        old_logps = _c05_logps(policy, input_ids)  # the rollout policy's log-probs, taken before the update
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-2)

    def step() -> torch.Tensor:
        opt.zero_grad()
        logps = _c05_logps(policy, input_ids)
        loss = _c05_grpo_loss(logps, ref_logps, old_logps, _C05_PAD_MASK, _C05_L, _C05_REWARDS, bug)
        loss.backward()
        opt.step()
        return loss

    return policy, opt, step, input_ids


def _c05_build(bug: bool) -> Case:
    policy, opt, step, input_ids = _c05_setup(bug)
    return policy, step, _kw(optimizer=opt, inputs={"input_ids": input_ids})


def _c05_proof(bug: bool) -> bool:
    """After one GRPO step, has the completion with the highest reward become less likely?"""
    policy, _, step, input_ids = _c05_setup(bug)
    best = int(_C05_REWARDS.argmax())

    def best_logp() -> float:
        with torch.no_grad():
            return float((_c05_logps(policy, input_ids)[best] * _C05_PAD_MASK[best]).sum())

    before = best_logp()
    step()
    return best_logp() < before


CASES: list[BlindCase] = [
    BlindCase("b39a-01", "https://github.com/deepset-ai/FARM/issues/46", "LR schedule total steps too short",
              "The warmup-linear schedule's total is computed with int(n_examples / batch_size) per epoch while the "
              "loader keeps the last partial batch, so the learning rate hits 0 and the last steps train nothing.",
              _c01_build, _c01_proof),
    BlindCase("b39a-02", "https://github.com/raphaelsty/neural-cherche/issues/36",
              "freeze ignores requested layer count",
              "freeze_layers keeps only the last 5 parameter tensors trainable whatever n_layers asks, so the encoder "
              "layer the user meant to fine-tune in SPLADE stays frozen.", _c02_build, _c02_proof,
              known_miss="a freeze that ignores the requested layer count: which layers were meant to be frozen is in the helper's argument, not the setup"),
    BlindCase("b39a-03", "https://github.com/huggingface/trl/issues/558", "reward head has two outputs",
              "The reward model is loaded with the default 2-label head, and the pairwise logsigmoid loss broadcasts "
              "over both columns, so it trains two rewards per sequence instead of one scalar.",
              _c03_build, _c03_proof,
              known_miss="a reward head with two outputs read at one of them: which output a score is read from is not judged"),
    BlindCase("b39a-04", "https://github.com/huggingface/course/pull/26", "QA span labels on special tokens",
              "Features whose context window holds only part of the answer are not labelled (0, 0); the span search "
              "runs off the context and puts the start/end label on a [SEP] token.", _c04_build, _c04_proof,
              known_miss="QA span labels on special tokens: which token a span label should name is data semantics"),
    BlindCase("b39a-05", "https://github.com/fla-org/flash-linear-attention/issues/1073", "GRPO loss negated twice",
              "The already-negated per-token GRPO loss is negated again when reduced, so minimizing it pushes the "
              "policy away from high-advantage completions.", _c05_build, _c05_proof,
              known_miss="a GRPO loss negated twice: the sign of a hand-written policy loss is not judged"),
]
