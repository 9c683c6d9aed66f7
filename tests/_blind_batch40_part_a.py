"""Blind batch 40 (part a): silent language-model training bugs from public threads, each with its fixed twin.

Every case builds the user's setup on a tiny model (transformers GPT-2 and T5 from tiny configs in code, small torch
heads; nothing is downloaded) and proves the bug without the audit on real tensors and real steps.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw


def _gpt2(seed: int = 0, **kw):
    from transformers import GPT2Config, GPT2LMHeadModel

    base = {"vocab_size": 40, "n_embd": 32, "n_layer": 1, "n_head": 2, "n_positions": 32, "resid_pdrop": 0.0,
            "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    base.update(kw)
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(**base)).train()


# --------------------------------------------------------------------------------------------- case-01
# huggingface/blog issue #1302: fine-tuning Falcon with `tokenizer.pad_token = tokenizer.eos_token` and
# DataCollatorForLanguageModeling(mlm=False). The collator sets every label equal to the pad id to -100, and since the
# pad id is the EOS id, the real EOS that ends each sample is masked too. The loss falls normally; the model just never
# learns to emit EOS and generation never stops. Fix in the thread: build the labels with a seq2seq-style collator and
# mask only the padding positions (attention_mask == 0), so the genuine EOS keeps its label.

_C01_EOS = 2
_C01_LENS = [9, 12, 7, 10]
_C01_IDS = torch.randint(3, 40, (4, 12), generator=_gen(4001))
_C01_MASK = torch.zeros(4, 12, dtype=torch.long)
for _i, _n in enumerate(_C01_LENS):
    _C01_IDS[_i, _n - 1] = _C01_EOS        # the sample's own EOS
    _C01_IDS[_i, _n:] = _C01_EOS           # padding with pad == eos
    _C01_MASK[_i, :_n] = 1


def _c01_labels(bug: bool) -> torch.Tensor:
    labels = _C01_IDS.clone()
    if bug:
        labels[labels == _C01_EOS] = -100  # what DataCollatorForLanguageModeling does with pad_token_id
    else:
        labels[_C01_MASK == 0] = -100      # mask only the padding
    return labels


def _c01_build(bug: bool) -> Case:
    model = _gpt2(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = {"input_ids": _C01_IDS, "attention_mask": _C01_MASK, "labels": _c01_labels(bug)}

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=batch)


def _c01_proof(bug: bool) -> bool:
    """Is the label at any sample's real EOS position ignored (-100)?"""
    labels = _c01_labels(bug)
    eos_pos = torch.tensor(_C01_LENS) - 1
    return bool((labels[torch.arange(4), eos_pos] == -100).any())


# --------------------------------------------------------------------------------------------- case-02
# ssbuild/t5_finetuning issue #2: the T5 preprocessing builds `labels = target[1:]` and feeds `target[:-1]` as the
# decoder input, GPT-style, with no decoder start token in front. T5 targets have no BOS, so the first target token is
# never a label: the model is never trained to produce the first word of the answer, while the loss on the rest falls
# normally. Fix (the author: "you are right, corrected"): keep the full target as labels and let the decoder input be
# the target shifted right with decoder_start_token_id in front, as T5's own `_shift_right` does.

_C02_SRC = torch.randint(3, 40, (4, 10), generator=_gen(4011))
_C02_TGT = torch.randint(3, 40, (4, 8), generator=_gen(4012))
_C02_TGT[:, 6] = 1   # eos
_C02_TGT[1:3, 7] = 0  # pad
_C02_TGT[0, 7] = 0


def _t5(seed: int = 0):
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(seed)
    cfg = T5Config(vocab_size=40, d_model=32, d_kv=16, d_ff=64, num_layers=1, num_decoder_layers=1, num_heads=2,
                   dropout_rate=0.0, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    return T5ForConditionalGeneration(cfg).train()


def _c02_batch(bug: bool) -> dict:
    if bug:
        dec_in = _C02_TGT[:, :-1].clone()
        labels = _C02_TGT[:, 1:].clone()
        labels[labels == 0] = -100
        return {"input_ids": _C02_SRC, "decoder_input_ids": dec_in, "labels": labels}
    labels = _C02_TGT.clone()
    labels[labels == 0] = -100
    return {"input_ids": _C02_SRC, "labels": labels}  # the model shifts right with decoder_start_token_id


def _c02_build(bug: bool) -> Case:
    model = _t5(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = _c02_batch(bug)

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=batch)


def _c02_proof(bug: bool) -> bool:
    """Is the first target token of some sample never a supervised label?"""
    labels = _c02_batch(bug)["labels"]
    return bool((labels[:, 0] != _C02_TGT[:, 0]).any())


# --------------------------------------------------------------------------------------------- case-03
# neuralmagic/sparseml PR #592: the distillation loss applies F.kl_div(..., reduction="batchmean") to logits of shape
# [batch, seq, vocab]. "batchmean" divides the summed KL by the batch size only, so the per-token KL is summed over
# the sequence: the distillation term is seq_len times too large against the task loss, and its weight silently
# depends on the sequence length. Training runs and the loss falls. Fix in the PR: reduction="sum" and divide by
# batch * seq (the number of token distributions).

_C03_IDS = torch.randint(3, 40, (4, 12), generator=_gen(4021))
_C03_TEMP = 2.0


def _c03_setup(bug: bool):
    student = _gpt2(0)
    teacher = _gpt2(1, n_layer=2).eval()
    teacher.requires_grad_(False)
    opt = torch.optim.AdamW(student.parameters(), lr=1e-3)
    labels = _C03_IDS.clone()

    def distill(s: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        logp = F.log_softmax(s / _C03_TEMP, dim=-1)
        q = F.softmax(t / _C03_TEMP, dim=-1)
        if bug:
            kl = F.kl_div(logp, q, reduction="batchmean")
        else:
            kl = F.kl_div(logp, q, reduction="sum") / (s.shape[0] * s.shape[1])
        return kl * _C03_TEMP ** 2

    def step() -> torch.Tensor:
        opt.zero_grad()
        out = student(input_ids=_C03_IDS, labels=labels)
        with torch.no_grad():
            t_logits = teacher(input_ids=_C03_IDS).logits
        loss = 0.5 * out.loss + 0.5 * distill(out.logits, t_logits)
        loss.backward()
        opt.step()
        return loss

    return student, teacher, opt, step, distill


def _c03_build(bug: bool) -> Case:
    student, _, opt, step, _ = _c03_setup(bug)
    return student, step, _kw(optimizer=opt, inputs={"input_ids": _C03_IDS, "labels": _C03_IDS})


def _c03_proof(bug: bool) -> bool:
    """Does the distillation term differ from T^2 times the mean per-token KL by far more than rounding?"""
    student, teacher, _, _, distill = _c03_setup(bug)
    with torch.no_grad():
        s = student(input_ids=_C03_IDS).logits
        t = teacher(input_ids=_C03_IDS).logits
        per_tok = (F.softmax(t / _C03_TEMP, -1) * (F.log_softmax(t / _C03_TEMP, -1)
                                                   - F.log_softmax(s / _C03_TEMP, -1))).sum(-1).mean()
        ref = per_tok * _C03_TEMP ** 2
        got = distill(s, t)
    return bool((got / ref - 1).abs() > 0.5)


# --------------------------------------------------------------------------------------------- case-04
# linkedin/Liger-Kernel PR #387: the DPO loss added in PR #378 had no reference model: it computed
# -logsigmoid(beta * (logp_chosen - logp_rejected)) from the policy alone, which is CPO, not DPO. It trains and the
# loss falls, but nothing keeps the policy near the reference. Fix in the PR: a frozen reference model and its
# ref_chosen_logps / ref_rejected_logps subtracted inside the sigmoid.

_C04_PROMPT = torch.randint(3, 40, (4, 5), generator=_gen(4031))
_C04_CHOSEN = torch.cat([_C04_PROMPT, torch.randint(3, 40, (4, 5), generator=_gen(4032))], 1)
_C04_REJECTED = torch.cat([_C04_PROMPT, torch.randint(3, 40, (4, 5), generator=_gen(4033))], 1)
_C04_BETA = 0.1


def _seq_logp(model: nn.Module, ids: torch.Tensor, start: int) -> torch.Tensor:
    logits = model(input_ids=ids).logits[:, :-1]
    lp = torch.gather(F.log_softmax(logits, -1), 2, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return lp[:, start - 1:].sum(-1)


def _c04_setup(bug: bool):
    policy = _gpt2(0)
    ref = copy.deepcopy(policy).eval()
    ref.requires_grad_(False)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    start = _C04_PROMPT.shape[1]

    def dpo_loss() -> torch.Tensor:
        pc = _seq_logp(policy, _C04_CHOSEN, start)
        pr = _seq_logp(policy, _C04_REJECTED, start)
        if bug:
            z = pc - pr
        else:
            with torch.no_grad():
                rc = _seq_logp(ref, _C04_CHOSEN, start)
                rr = _seq_logp(ref, _C04_REJECTED, start)
            z = (pc - rc) - (pr - rr)
        return -F.logsigmoid(_C04_BETA * z).mean()

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = dpo_loss()
        loss.backward()
        opt.step()
        return loss

    return policy, opt, step, dpo_loss


def _c04_build(bug: bool) -> Case:
    policy, opt, step, _ = _c04_setup(bug)
    return policy, step, _kw(optimizer=opt, inputs={"input_ids": _C04_CHOSEN})


def _c04_proof(bug: bool) -> bool:
    """With the policy still equal to the reference, DPO's loss must be exactly log 2. Is it not?"""
    _, _, _, dpo_loss = _c04_setup(bug)
    with torch.no_grad():
        loss = dpo_loss()
    return bool(abs(loss.item() - torch.log(torch.tensor(2.0)).item()) > 1e-5)


# --------------------------------------------------------------------------------------------- case-05
# pytorch/rl PR #1315: GPT2RewardModel takes the reward at the token before the first PAD_ID, with PAD_ID hard-coded
# as GPT-2's eos id from the "gpt2" tokenizer. For a model/tokenizer whose pad id differs, no PAD_ID is ever found and
# the end score is read at the last position, which for every padded sample is a padding token. The pairwise reward
# loss still falls (it learns something from pad-position states), but not on the answer's last token. Fix from the
# review: take the pad id from the model's own tokenizer (parametrised) instead of the GPT-2 constant.

_C05_PAD = 0
_C05_GPT2_EOS = 50256
_C05_LENS_C = [10, 7, 12, 8]
_C05_LENS_R = [9, 12, 6, 11]


def _c05_ids(lens, seed):
    ids = torch.randint(3, 40, (4, 12), generator=_gen(seed))
    for i, n in enumerate(lens):
        ids[i, n:] = _C05_PAD
    return ids


_C05_CHOSEN = _c05_ids(_C05_LENS_C, 4041)
_C05_REJECTED = _c05_ids(_C05_LENS_R, 4042)


class _C05RewardModel(nn.Module):
    def __init__(self, pad_id: int):
        super().__init__()
        self.transformer = _gpt2(0, pad_token_id=_C05_PAD).transformer
        self.lm_head = nn.Linear(32, 1, bias=False)
        self.PAD_ID = pad_id

    def end_index(self, ids: torch.Tensor) -> torch.Tensor:
        out = []
        for row in ids:
            pads = (row == self.PAD_ID).nonzero()
            first = pads[0].item() if len(pads) > 0 else ids.shape[1]
            out.append(first - 1)
        return torch.tensor(out)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.transformer(input_ids=ids, attention_mask=(ids != _C05_PAD).long()).last_hidden_state
        rewards = self.lm_head(h).squeeze(-1)
        return rewards[torch.arange(ids.shape[0]), self.end_index(ids)]


def _c05_build(bug: bool) -> Case:
    model = _C05RewardModel(_C05_GPT2_EOS if bug else _C05_PAD).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = -F.logsigmoid(model(_C05_CHOSEN) - model(_C05_REJECTED)).mean()
        loss.backward()
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs={"input_ids": _C05_CHOSEN})


def _c05_proof(bug: bool) -> bool:
    """Is the end score of some sample read at a padding position?"""
    model, step, _ = _c05_build(bug)
    step()
    hits = []
    for ids in (_C05_CHOSEN, _C05_REJECTED):
        idx = model.end_index(ids)
        hits.append((ids[torch.arange(4), idx] == _C05_PAD).any())
    return bool(torch.stack(hits).any())


CASES: list[BlindCase] = [
    BlindCase("b40a-01", "https://github.com/huggingface/blog/issues/1302", "EOS masked as padding label",
              "with pad_token = eos_token the LM collator sets the real EOS label to -100, so EOS is never learned",
              _c01_build, _c01_proof),
    BlindCase("b40a-02", "https://github.com/ssbuild/t5_finetuning/issues/2", "T5 decoder start token missing",
              "labels = target[1:] with decoder input target[:-1] and no start token: the first target token is "
              "never supervised", _c02_build, _c02_proof),
    BlindCase("b40a-03", "https://github.com/neuralmagic/sparseml/pull/592", "KD batchmean over token dim",
              "reduction='batchmean' on [B, T, V] logits sums the KL over the sequence, scaling distillation by T",
              _c03_build, _c03_proof,
              known_miss="a KD term averaged with batchmean over tokens: a term's weight against the others is not measured"),
    BlindCase("b40a-04", "https://github.com/linkedin/Liger-Kernel/pull/387", "DPO missing reference model",
              "the DPO loss uses policy log-probs only (CPO), with no reference log-ratio", _c04_build, _c04_proof,
              known_miss="a DPO loss computed without its reference model: an absent term is not measurable"),
    BlindCase("b40a-05", "https://github.com/pytorch/rl/pull/1315", "reward read at pad position",
              "hard-coded GPT-2 PAD_ID never matches, so the reward is taken at the last (padding) position",
              _c05_build, _c05_proof,
              known_miss="a reward read at a pad position inside a library loss module: the padding-read probe covers hand-written models only"),
]
