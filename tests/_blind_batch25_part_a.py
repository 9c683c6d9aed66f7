"""Blind batch 25 (part a): silent LLM fine-tuning bugs from public GitHub threads, each with its fixed twin.

Collected by someone who does not write the audit's checks. Every case builds the user's setup on a tiny model
(transformers Llama and GPT-2 models from tiny configs in code, a frozen reference copy for DPO, accelerate's
gradient accumulation with a transformers schedule; nothing is downloaded) and proves the bug without the audit on
real tensors and real steps.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw, _llama_config, _sgd_step


def _right_padded(lengths: list[int], width: int, seed: int, pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (3..39) right-padded with ``pad`` to ``width``, and their attention mask."""
    ids = torch.randint(3, 40, (len(lengths), width), generator=_gen(seed))
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    return ids.masked_fill(mask == 0, pad), mask


# --------------------------------------------------------------------------------------------- case-01
# OpenRLHF/OpenRLHF issue #294 ("maybe data bug with dpo trainer"): DPOTrainer.concatenated_inputs stacks the chosen
# and the rejected sequences into one batch of 2B rows, but returned the B prompt lengths unchanged. _get_batch_logps
# masks the prompt with `for mask, source_len in zip(loss_masks, prompt_id_lens)`, and zip stops after the first B
# rows, so only the chosen prompts are masked: the rejected log-probs sum over prompt and response. Training runs, the
# DPO loss falls and the reward accuracy rises, but the rejected term now carries the prompt's log-likelihood ratio, so
# the policy is also pushed to make the prompt itself less likely. Fix in OpenRLHF: concatenated_inputs returns
# `prompt_id_lens * 2`, one prompt length for each of the 2B rows.

_C01_CHOSEN, _C01_CMASK = _right_padded([12, 10], 12, 2501)
_C01_REJECT, _C01_RMASK = _right_padded([11, 12], 12, 2502)
_C01_PROMPT_LENS = [4, 5]
_C01_REJECT[:, :5] = _C01_CHOSEN[:, :5]  # each pair shares its prompt
_C01_BETA = 0.1


def _c01_concatenated_inputs(bug: bool) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    ids = torch.cat([_C01_CHOSEN, _C01_REJECT], dim=0)
    mask = torch.cat([_C01_CMASK, _C01_RMASK], dim=0)
    return ids, mask, (_C01_PROMPT_LENS if bug else _C01_PROMPT_LENS * 2)


def _c01_batch_logps(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor,
                     prompt_lens: list[int]) -> torch.Tensor:
    """OpenRLHF's _get_batch_logps: summed log-probs of the unmasked next tokens."""
    labels = ids[:, 1:].clone()
    logits = logits[:, :-1, :]
    loss_masks = mask.clone().bool()
    for m, source_len in zip(loss_masks, prompt_lens):
        m[:source_len] = False
    loss_masks = loss_masks[:, 1:]
    labels[~loss_masks] = 0
    per_token = torch.gather(logits.log_softmax(-1), 2, labels.unsqueeze(2)).squeeze(2)
    return (per_token * loss_masks).sum(-1)


def _c01_loss(policy: nn.Module, ref: nn.Module, bug: bool, keep: list[torch.Tensor] | None = None) -> torch.Tensor:
    ids, mask, prompt_lens = _c01_concatenated_inputs(bug)
    logits = policy(input_ids=ids, attention_mask=mask).logits
    if keep is not None:
        logits.retain_grad()
        keep.append(logits)
    logps = _c01_batch_logps(logits, ids, mask, prompt_lens)
    with torch.no_grad():
        ref_logps = _c01_batch_logps(ref(input_ids=ids, attention_mask=mask).logits, ids, mask, prompt_lens)
    b = _C01_CHOSEN.shape[0]
    pi_logratios = logps[:b] - logps[b:]
    ref_logratios = ref_logps[:b] - ref_logps[b:]
    return -F.logsigmoid(_C01_BETA * (pi_logratios - ref_logratios)).mean()


def _c01_build(bug: bool) -> Case:
    """Full DPO fine-tune of a tiny Llama against a frozen copy of itself, chosen and rejected in one forward."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    policy = LlamaForCausalLM(_llama_config()).train()
    ref = copy.deepcopy(policy).eval().requires_grad_(False)
    opt = torch.optim.AdamW(policy.parameters(), lr=5e-4)
    step = _sgd_step(policy, opt, lambda: _c01_loss(policy, ref, bug))
    ids, mask, _ = _c01_concatenated_inputs(bug)
    return policy, step, _kw(optimizer=opt, inputs={"input_ids": ids, "attention_mask": mask})


def _c01_proof(bug: bool) -> bool:
    """After two real steps, the DPO loss still sends gradient into the logits that score the rejected prompts."""
    policy, step, _ = _c01_build(bug)
    for _ in range(2):
        step()
    ref = copy.deepcopy(policy).eval().requires_grad_(False)
    keep: list[torch.Tensor] = []
    _c01_loss(policy, ref, bug, keep).backward()
    grad = keep[0].grad
    b = _C01_CHOSEN.shape[0]
    # logits at position t score token t+1; the prompt tokens 1..len-1 are scored by positions 0..len-2
    leaked = sum(float(grad[b + i, : n - 1].abs().sum()) for i, n in enumerate(_C01_PROMPT_LENS))
    chosen_leak = sum(float(grad[i, : n - 1].abs().sum()) for i, n in enumerate(_C01_PROMPT_LENS))
    assert chosen_leak == 0.0
    return leaked > 0.0


# --------------------------------------------------------------------------------------------- case-02
# huggingface/transformers PR #35927 ("layernorm_decay_fix"): Trainer.get_decay_parameter_names chose the parameters
# that get weight decay by layer type only, `get_parameter_names(model, ALL_LAYERNORM_LAYERS)` minus names containing
# "bias", and ALL_LAYERNORM_LAYERS holds nn.LayerNorm. Llama, Qwen2 and most recent models use their own RMSNorm
# class, so every RMSNorm weight of a Llama fine-tuned with `weight_decay > 0` landed in the decayed group and is
# pulled toward zero every step. Nothing fails; the norms' gains just shrink. Fix in the PR: name-based filtering as
# well (patterns "layernorm", "rmsnorm", "norm"), which is today's get_decay_parameter_names.

_C02_IDS = torch.randint(3, 40, (4, 12), generator=_gen(2503))
_C02_WD = 0.1
_C02_LR = 1e-3


def _c02_decay_names(model: nn.Module, bug: bool) -> list[str]:
    from transformers import Trainer
    from transformers.trainer_pt_utils import get_parameter_names

    if bug:  # the Trainer before the PR
        names = get_parameter_names(model, [nn.LayerNorm])
        return [n for n in names if "bias" not in n]
    return Trainer.get_decay_parameter_names(None, model)  # type: ignore[arg-type]


def _c02_optimizer(model: nn.Module, bug: bool) -> torch.optim.Optimizer:
    """Trainer.create_optimizer: a decayed group and a no-decay group, AdamW."""
    decay = set(_c02_decay_names(model, bug))
    groups = [
        {"params": [p for n, p in model.named_parameters() if n in decay and p.requires_grad],
         "weight_decay": _C02_WD},
        {"params": [p for n, p in model.named_parameters() if n not in decay and p.requires_grad],
         "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=_C02_LR, betas=(0.9, 0.999), eps=1e-8)


def _c02_build(bug: bool) -> Case:
    """Tiny Llama fine-tuned with the Trainer's optimizer grouping and weight_decay=0.1."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(_llama_config()).train()
    opt = _c02_optimizer(model, bug)
    step = _sgd_step(model, opt, lambda: model(input_ids=_C02_IDS, labels=_C02_IDS).loss)
    return model, step, _kw(optimizer=opt, inputs=_C02_IDS)


def _c02_proof(bug: bool) -> bool:
    """A first real AdamW step in which the RMSNorm weights get no gradient still shrinks them: decay alone."""
    model, _, kw = _c02_build(bug)
    opt = kw["optimizer"]
    norms = {n: p for n, p in model.named_parameters() if "norm" in n}
    assert norms
    before = {n: p.detach().clone() for n, p in norms.items()}
    opt.zero_grad()
    model(input_ids=_C02_IDS, labels=_C02_IDS).loss.backward()
    for p in norms.values():
        p.grad.zero_()  # no gradient signal on the norms: AdamW's moment update is zero for them
    opt.step()
    shrunk = [n for n, p in norms.items() if float(p.detach().abs().sum()) < float(before[n].abs().sum()) - 1e-9]
    return len(shrunk) == len(norms)


# --------------------------------------------------------------------------------------------- case-03
# huggingface/trl PR #1625 ("[ORPO] Correct label mask for pad tokens"): ORPOTrainer's NLL term on the chosen answers
# was switched to the whole sequence by copying `concatenated_input_ids` into the labels, and the copy kept the pad
# tokens. With right padding the chosen NLL then trains the model to predict pad after pad: the loss starts at a wrong
# value and keeps falling on the padding, while the odds-ratio term looks normal. Fix in the PR:
# `labels = torch.where(attention_mask == 1, labels, label_pad_token_id)`.

_C03_PROMPT = 4
_C03_CHOSEN, _C03_CMASK = _right_padded([9, 14], 14, 2504)
_C03_REJECT, _C03_RMASK = _right_padded([12, 7], 14, 2505)
_C03_REJECT[:, :_C03_PROMPT] = _C03_CHOSEN[:, :_C03_PROMPT]
_C03_BETA = 0.1


def _c03_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids = torch.cat([_C03_CHOSEN, _C03_REJECT], dim=0)
    mask = torch.cat([_C03_CMASK, _C03_RMASK], dim=0)
    completion_labels = ids.masked_fill(mask == 0, -100)
    completion_labels[:, :_C03_PROMPT] = -100
    return ids, mask, completion_labels


def _c03_loss(model: nn.Module, bug: bool, keep: list[torch.Tensor] | None = None) -> torch.Tensor:
    ids, mask, completion_labels = _c03_batch()
    b = _C03_CHOSEN.shape[0]
    logits = model(input_ids=ids, attention_mask=mask).logits
    if keep is not None:
        logits.retain_grad()
        keep.append(logits)
    labels = ids.clone()
    if not bug:
        labels = torch.where(mask == 1, labels, -100)
    # chosen NLL over the whole sequence (shifted)
    nll = F.cross_entropy(logits[:b, :-1].reshape(-1, logits.shape[-1]), labels[:b, 1:].reshape(-1),
                          ignore_index=-100)
    # average completion log-probs for the odds ratio
    lab = completion_labels[:, 1:].clone()
    keep_mask = lab != -100
    lab[~keep_mask] = 0
    per_token = torch.gather(logits[:, :-1].log_softmax(-1), 2, lab.unsqueeze(2)).squeeze(2)
    logps = (per_token * keep_mask).sum(-1) / keep_mask.sum(-1)
    c, r = logps[:b], logps[b:]
    log_odds = (c - r) - (torch.log1p(-torch.exp(c)) - torch.log1p(-torch.exp(r)))
    return nll - (_C03_BETA * F.logsigmoid(log_odds)).mean()


def _c03_build(bug: bool) -> Case:
    """ORPO on a tiny Llama: chosen NLL plus the odds-ratio term, chosen and rejected in one right-padded batch."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(_llama_config()).train()
    opt = torch.optim.AdamW(model.parameters(), lr=5e-4)
    step = _sgd_step(model, opt, lambda: _c03_loss(model, bug))
    ids, mask, _ = _c03_batch()
    return model, step, _kw(optimizer=opt, inputs={"input_ids": ids, "attention_mask": mask})


def _c03_proof(bug: bool) -> bool:
    """The loss sends gradient into the logits that predict the chosen answers' pad tokens."""
    model, step, _ = _c03_build(bug)
    step()
    keep: list[torch.Tensor] = []
    model.zero_grad()
    _c03_loss(model, bug, keep).backward()
    grad = keep[0].grad
    b = _C03_CHOSEN.shape[0]
    predicts_pad = torch.zeros_like(_C03_CMASK, dtype=torch.bool)
    predicts_pad[:, :-1] = _C03_CMASK[:, 1:] == 0  # position t predicts token t+1
    return float(grad[:b][predicts_pad].abs().sum()) > 0.0


# --------------------------------------------------------------------------------------------- case-04
# huggingface/transformers PR #27872 ("Fix lr_scheduler in no_trainer training scripts"): the run_*_no_trainer
# examples built the schedule with `num_warmup_steps=args.num_warmup_steps * args.gradient_accumulation_steps` and
# `num_training_steps=args.max_train_steps * args.gradient_accumulation_steps`, but the scheduler is prepared by
# accelerate, whose AcceleratedScheduler only steps when the optimizer really steps (once per accumulation cycle).
# The schedule is thus gradient_accumulation_steps times too long: warmup takes that many times more updates and the
# linear decay has barely started when training ends. Loss curves look fine. Fix in the PR: drop the
# gradient_accumulation_steps factor (multiply by accelerator.num_processes instead, 1 here).

_C04_GA = 4
_C04_MAX_TRAIN_STEPS = 8
_C04_WARMUP = 2
_C04_LR = 1e-3
_C04_IDS = torch.randint(3, 40, (2 * _C04_GA, 16), generator=_gen(2506))


def _c04_build(bug: bool) -> Case:
    """run_clm_no_trainer on a tiny GPT-2: accelerate with gradient_accumulation_steps=4, linear warmup schedule."""
    from accelerate import Accelerator
    from transformers import GPT2Config, GPT2LMHeadModel, get_scheduler

    torch.manual_seed(0)
    accelerator = Accelerator(gradient_accumulation_steps=_C04_GA)
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=40, n_positions=32, bos_token_id=1,
                     eos_token_id=2, pad_token_id=0)
    model = GPT2LMHeadModel(cfg).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=_C04_LR)
    factor = _C04_GA if bug else accelerator.num_processes
    lr_scheduler = get_scheduler("linear", optimizer=optimizer, num_warmup_steps=_C04_WARMUP * factor,
                                 num_training_steps=_C04_MAX_TRAIN_STEPS * factor)
    model, optimizer, lr_scheduler = accelerator.prepare(model, optimizer, lr_scheduler)
    micro = _C04_IDS.chunk(_C04_GA)

    def step() -> torch.Tensor:
        """One optimizer update: gradient_accumulation_steps micro-batches through accelerator.accumulate."""
        total = torch.zeros(())
        for batch in micro:
            with accelerator.accumulate(model):
                loss = model(input_ids=batch, labels=batch).loss
                accelerator.backward(loss)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            total = total + loss.detach() / _C04_GA
        return total

    return model, step, _kw(optimizer=optimizer, inputs={"input_ids": _C04_IDS, "labels": _C04_IDS},
                            lr_scheduler=lr_scheduler, total_steps=_C04_MAX_TRAIN_STEPS)


def _c04_proof(bug: bool) -> bool:
    """After all max_train_steps optimizer updates the linear schedule has not decayed to zero."""
    _, step, kw = _c04_build(bug)
    opt = kw["optimizer"]
    lrs = []
    for _ in range(_C04_MAX_TRAIN_STEPS):
        step()
        lrs.append(opt.param_groups[0]["lr"])
    return lrs[-1] > 0.1 * _C04_LR


# --------------------------------------------------------------------------------------------- case-05
# pytorch/rl PR #3887 ("[BugFix] Infer reward model pad token from model tokenizer"): GPT2RewardModel finds the end of
# each sequence at the first token equal to `self.pad_id` and reads the reward one position before it, but pad_id was
# always the GPT-2 tokenizer's eos id (50256), whatever model_path was loaded. For a checkpoint whose tokenizer pads
# with another id, no token matches, the "end" is the last column, and every shorter sequence's end score is read at
# a padding position. The pairwise reward loss trains on those pad-position scores and falls normally. Fix in the PR:
# take the pad id from the model's own tokenizer (then its eos, then the config), with an explicit override.

_C05_CHOSEN, _C05_CMASK = _right_padded([9, 16, 12, 7], 16, 2507)
_C05_REJECT, _C05_RMASK = _right_padded([13, 10, 16, 11], 16, 2508)
_C05_GPT2_EOS = 50256  # GPT2TokenizerFast.from_pretrained("gpt2").eos_token_id
_C05_PAD = 0  # the fine-tuned checkpoint's own tokenizer pads with 0


class _RewardModel(nn.Module):
    """GPT2RewardModel: GPT-2 body, a 1-output head, the score read before the first pad token."""

    def __init__(self, pad_id: int) -> None:
        from transformers import GPT2Config, GPT2LMHeadModel

        super().__init__()
        cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=40, n_positions=32, bos_token_id=1,
                         eos_token_id=2, pad_token_id=_C05_PAD)
        lm = GPT2LMHeadModel(cfg)
        self.config = lm.config
        self.transformer = lm.transformer
        self.lm_head = nn.Linear(cfg.n_embd, 1, bias=False)
        self.pad_id = pad_id

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.transformer(input_ids=input_ids, attention_mask=attention_mask)[0]
        rewards = self.lm_head(hidden).squeeze(-1)
        ends = []
        for i in range(input_ids.shape[0]):
            pad_inds = (input_ids[i] == self.pad_id).nonzero()
            first_pad = pad_inds[0].item() if len(pad_inds) > 0 else input_ids.shape[1]
            ends.append(rewards[i, first_pad - 1])
        return rewards, torch.stack(ends)


def _c05_loss(model: _RewardModel, keep: list[torch.Tensor] | None = None) -> torch.Tensor:
    c_rewards, c_end = model(_C05_CHOSEN, _C05_CMASK)
    _, r_end = model(_C05_REJECT, _C05_RMASK)
    if keep is not None:
        c_rewards.retain_grad()
        keep.append(c_rewards)
    return -F.logsigmoid(c_end - r_end).mean()


def _c05_build(bug: bool) -> Case:
    """Pairwise reward-model training on end scores of a GPT-2 reward model (tiny config, right padding with 0)."""
    torch.manual_seed(0)
    model = _RewardModel(_C05_GPT2_EOS if bug else _C05_PAD).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step = _sgd_step(model, opt, lambda: _c05_loss(model))
    return model, step, _kw(optimizer=opt, inputs={"input_ids": _C05_CHOSEN, "attention_mask": _C05_CMASK})


def _c05_proof(bug: bool) -> bool:
    """The reward loss's gradient lands on the per-token rewards at padding positions of the chosen batch."""
    model, step, _ = _c05_build(bug)
    step()
    keep: list[torch.Tensor] = []
    model.zero_grad()
    _c05_loss(model, keep).backward()
    grad = keep[0].grad
    return float(grad[_C05_CMASK == 0].abs().sum()) > 0.0


CASES: list[BlindCase] = [
    BlindCase("b25a-01", "https://github.com/OpenRLHF/OpenRLHF/issues/294", "preference loss over prompt tokens",
              "DPO masks the prompt only on the chosen half of the concatenated batch, so the rejected log-probs "
              "include the prompt and the policy is pushed to make the prompt less likely.", _c01_build, _c01_proof,
              known_miss="the prompt mask covers the chosen half only: per-row supervision of the two halves of one preference batch is not compared"),
    BlindCase("b25a-02", "https://github.com/huggingface/transformers/pull/35927", "weight decay on normalization",
              "The Trainer picks no-decay parameters by nn.LayerNorm type, so a Llama's RMSNorm weights are decayed "
              "toward zero every step.", _c02_build, _c02_proof),
    BlindCase("b25a-03", "https://github.com/huggingface/trl/pull/1625", "pad tokens in the LM loss",
              "ORPO's chosen NLL copies input_ids into labels without masking padding, so the model is trained to "
              "predict pad tokens.", _c03_build, _c03_proof),
    BlindCase("b25a-04", "https://github.com/huggingface/transformers/pull/27872",
              "schedule length vs gradient accumulation",
              "Warmup and total steps are multiplied by gradient_accumulation_steps while accelerate steps the "
              "scheduler once per update, so the schedule is 4x too long and the lr never decays.",
              _c04_build, _c04_proof),
    BlindCase("b25a-05", "https://github.com/pytorch/rl/pull/3887", "reward read at the wrong token",
              "The reward model looks for GPT-2's eos id as the pad token, finds none, and reads every shorter "
              "sequence's end score at a padding position.", _c05_build, _c05_proof),
]
