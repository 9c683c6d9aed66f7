"""Blind batch 21 (part a): silent training bugs from public GitHub threads, each with its fixed twin.

Focus: language-model training outside the HF Trainer (hand-written DPO and GRPO/PPO losses, embedding-model
contrastive batches, instruction-tuning label masks). Every case builds the user's setup on a tiny model built in
code (nothing is downloaded) and proves the bug without the audit.
"""

from __future__ import annotations

import copy
import random

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw, _llama_config, _sgd_step


class _TinyCausalLM(nn.Module):
    """Token embedding, a causal GRU and an LM head: logits[t] predicts token t+1."""

    def __init__(self, vocab: int = 20, d: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.rnn = nn.GRU(d, d, batch_first=True)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(self.emb(ids))
        return self.head(h)


# --------------------------------------------------------------------------------------------- case-01
# A from-scratch DPO implementation computes each response's log-probability with a gather over the shifted
# labels and sums over the whole response span, padding positions included. The thread points out that the
# padding tokens' log-probabilities enter the chosen/rejected sums (unlike TRL's DPOTrainer) and that they must
# be excluded: the fix masks the per-token log-probabilities with the non-padding mask before summing.

_C01_PAD = 0
_C01_PROMPT = 3


def _c01_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen(2101)
    chosen = torch.randint(3, 20, (4, 10), generator=g)
    rejected = torch.randint(3, 20, (4, 10), generator=g)
    for i, (lc, lr) in enumerate([(10, 6), (7, 9), (5, 10), (8, 4)]):
        chosen[i, lc:] = _C01_PAD
        rejected[i, lr:] = _C01_PAD
    return chosen, rejected


_C01_CHOSEN, _C01_REJECTED = _c01_batch()


def _c01_logp(model: nn.Module, ids: torch.Tensor, bug: bool) -> torch.Tensor:
    logits = model(ids)[:, :-1]
    labels = ids[:, 1:]
    tok = torch.gather(logits.log_softmax(-1), 2, labels.unsqueeze(2)).squeeze(2)
    span = torch.zeros_like(labels, dtype=torch.bool)
    span[:, _C01_PROMPT - 1:] = True  # response tokens only
    mask = span if bug else span & (labels != _C01_PAD)
    return (tok * mask).sum(-1)


def _c01_dpo_loss(policy: nn.Module, ref: nn.Module, bug: bool, beta: float = 0.1) -> torch.Tensor:
    pc, pr = _c01_logp(policy, _C01_CHOSEN, bug), _c01_logp(policy, _C01_REJECTED, bug)
    with torch.no_grad():
        rc, rr = _c01_logp(ref, _C01_CHOSEN, bug), _c01_logp(ref, _C01_REJECTED, bug)
    return -F.logsigmoid(beta * ((pc - rc) - (pr - rr))).mean()


def _c01_build(bug: bool) -> Case:
    """Hand-written DPO on a tiny causal LM whose response log-probabilities sum over the padding too."""
    torch.manual_seed(0)
    policy = _TinyCausalLM().train()
    ref = copy.deepcopy(policy).eval().requires_grad_(False)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    step = _sgd_step(policy, opt, lambda: _c01_dpo_loss(policy, ref, bug))
    return policy, step, _kw(optimizer=opt, inputs=torch.cat([_C01_CHOSEN, _C01_REJECTED]))


def _c01_proof(bug: bool) -> bool:
    """The response log-probability changes when only extra padding is appended to the sequences."""
    policy, _, _ = _c01_build(bug)
    padded = torch.cat([_C01_CHOSEN, torch.full((4, 5), _C01_PAD)], dim=1)
    with torch.no_grad():
        a = _c01_logp(policy, _C01_CHOSEN, bug)
        b = _c01_logp(policy, padded, bug)
    return float((a - b).abs().max()) > 1e-5


# --------------------------------------------------------------------------------------------- case-02
# Embedding-model InfoNCE training with a fixed number of hard negatives per query: when an example supplies
# fewer negatives than requested, the collator resamples to fill the slots. The group layout is
# [anchor, positive, negatives...], but the resampling indices were offset by one, so the positive is in the
# sampling population (and the last negative is not): the positive is also used as a negative in the InfoNCE
# denominator. Training continues silently. The fix offsets by two, sampling only among the real negatives.

_C02_HARD = 3


def _c02_groups() -> list[list[torch.Tensor]]:
    g = _gen(2201)
    groups = []
    for n_neg in (1, 2, 1, 3):
        groups.append([torch.randint(0, 30, (6,), generator=g) for _ in range(2 + n_neg)])
    return groups


_C02_GROUPS = _c02_groups()


def _c02_fill(group: list[torch.Tensor], bug: bool, rng: random.Random) -> list[torch.Tensor]:
    missing = 2 + _C02_HARD - len(group)
    if missing <= 0:
        return group[: 2 + _C02_HARD]
    # bug: a one-off window over [positive, negatives[:-1]]; fix: only the real negatives
    pool = list(range(1, len(group) - 1)) if bug else list(range(2, len(group)))
    return group + [group[i] for i in rng.choices(pool, k=missing)]


def _c02_batch(bug: bool) -> torch.Tensor:
    rng = random.Random(7)
    return torch.stack([torch.stack(_c02_fill(g, bug, rng)) for g in _C02_GROUPS])  # (B, 2+H, L)


class _BagEncoder(nn.Module):
    def __init__(self, vocab: int = 30, d: int = 16) -> None:
        super().__init__()
        self.emb = nn.EmbeddingBag(vocab, d, mode="mean")
        self.proj = nn.Linear(d, d)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.proj(self.emb(ids)), dim=-1)


def _c02_loss(model: _BagEncoder, batch: torch.Tensor, temp: float = 0.05) -> torch.Tensor:
    b, k, length = batch.shape
    emb = model(batch.reshape(b * k, length)).reshape(b, k, -1)
    q, cands = emb[:, 0], emb[:, 1:]
    scores = torch.einsum("bd,bkd->bk", q, cands) / temp
    return F.cross_entropy(scores, torch.zeros(b, dtype=torch.long))


def _c02_build(bug: bool) -> Case:
    """Query/positive/hard-negative contrastive training where short negative lists are filled by resampling."""
    torch.manual_seed(0)
    model = _BagEncoder().train()
    batch = _c02_batch(bug)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = _sgd_step(model, opt, lambda: _c02_loss(model, batch))
    return model, step, _kw(optimizer=opt, inputs=batch)


def _c02_proof(bug: bool) -> bool:
    """Some negative slot of the built batch holds the example's own positive."""
    batch = _c02_batch(bug)
    pos, negs = batch[:, 1:2], batch[:, 2:]
    return bool((negs == pos).all(-1).any())


# --------------------------------------------------------------------------------------------- case-03
# A PPO/GRPO actor loss with a KL-to-reference loss term: the code combined it as pg_loss - kl_coef * kl_loss,
# so the optimiser maximises the KL to the reference policy instead of penalising it. The thread (pointing at the
# upstream commit) reports rewards worsening and the loss blowing up early; the fix adds the term:
# pg_loss + kl_coef * kl_loss.

_C03_IDS = torch.randint(0, 20, (4, 8), generator=_gen(2301))
_C03_ADV = torch.randn(4, 1, generator=_gen(2302)).expand(4, 7)
_C03_KL_COEF = 1.0


def _c03_parts(policy: nn.Module, ref: nn.Module, old: torch.Tensor,
               adv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = policy(_C03_IDS)[:, :-1]
    logp = torch.gather(logits.log_softmax(-1), 2, _C03_IDS[:, 1:, None]).squeeze(2)
    with torch.no_grad():
        ref_logp = torch.gather(ref(_C03_IDS)[:, :-1].log_softmax(-1), 2, _C03_IDS[:, 1:, None]).squeeze(2)
    ratio = torch.exp(logp - old)
    pg = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv).mean()
    d = ref_logp - logp
    kl = (torch.exp(d) - d - 1).mean()  # k3 estimator
    return pg, kl


def _c03_loss(policy: nn.Module, ref: nn.Module, old: torch.Tensor, bug: bool, adv: torch.Tensor) -> torch.Tensor:
    pg, kl = _c03_parts(policy, ref, old, adv)
    return pg - _C03_KL_COEF * kl if bug else pg + _C03_KL_COEF * kl


def _c03_setup(bug: bool, adv: torch.Tensor) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer, object]:
    torch.manual_seed(0)
    ref = _TinyCausalLM().eval().requires_grad_(False)
    policy = copy.deepcopy(ref).requires_grad_(True).train()
    with torch.no_grad():
        g = _gen(2303)
        for p in policy.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
        old = torch.gather(policy(_C03_IDS)[:, :-1].log_softmax(-1), 2, _C03_IDS[:, 1:, None]).squeeze(2)
    opt = torch.optim.Adam(policy.parameters(), lr=1e-2)
    step = _sgd_step(policy, opt, lambda: _c03_loss(policy, ref, old, bug, adv))
    return policy, ref, opt, step


def _c03_build(bug: bool) -> Case:
    """Policy-gradient actor update with a KL-to-reference term subtracted from the loss."""
    policy, _, opt, step = _c03_setup(bug, _C03_ADV)
    return policy, step, _kw(optimizer=opt, inputs=_C03_IDS)  # type: ignore[return-value]


def _c03_kl(policy: nn.Module, ref: nn.Module) -> float:
    with torch.no_grad():
        lp = policy(_C03_IDS).log_softmax(-1)
        lq = ref(_C03_IDS).log_softmax(-1)
    return float((lp.exp() * (lp - lq)).sum(-1).mean())


def _c03_proof(bug: bool) -> bool:
    """With zero advantages (only the KL term acting), a few updates move the policy further from the reference."""
    policy, ref, _, step = _c03_setup(bug, torch.zeros_like(_C03_ADV))
    kl0 = _c03_kl(policy, ref)
    for _ in range(5):
        step()  # type: ignore[operator]
    return _c03_kl(policy, ref) > kl0


# --------------------------------------------------------------------------------------------- case-04
# GRPO-style training: each prompt gets a group of sampled completions, and each completion's advantage is its
# reward standardised by its group's mean and standard deviation. A refactor computed that mean and standard
# deviation from the first rollout group only and applied them to every group, so the other prompts' advantages
# are not centred (whole groups pushed up or down together). The author notes it "still kinda works"; the fix
# computes the statistics per group.

_C04_G = 4
_C04_IDS = torch.randint(0, 20, (3 * _C04_G, 8), generator=_gen(2401))
_C04_REWARDS = torch.tensor([[0.0, 1.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0]])


def _c04_adv(bug: bool) -> torch.Tensor:
    r = _C04_REWARDS
    if bug:
        mean, std = r[0].mean(), r[0].std()
        adv = (r - mean) / (std + 1e-4)
    else:
        adv = (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)
    return adv.reshape(-1)


def _c04_loss(policy: nn.Module, bug: bool) -> torch.Tensor:
    logits = policy(_C04_IDS)[:, :-1]
    logp = torch.gather(logits.log_softmax(-1), 2, _C04_IDS[:, 1:, None]).squeeze(2)
    return -(logp.sum(-1) * _c04_adv(bug)).mean() / logp.shape[1]


def _c04_build(bug: bool) -> Case:
    """Group-relative policy-gradient step whose reward normalisation statistics come from the first group only."""
    torch.manual_seed(0)
    policy = _TinyCausalLM().train()
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    step = _sgd_step(policy, opt, lambda: _c04_loss(policy, bug))
    return policy, step, _kw(optimizer=opt, inputs=_C04_IDS)


def _c04_proof(bug: bool) -> bool:
    """Some prompt's group of advantages does not average to zero."""
    adv = _c04_adv(bug).reshape(-1, _C04_G)
    return bool((adv.mean(1).abs() > 1e-3).any())


# --------------------------------------------------------------------------------------------- case-05
# SFT label masking with a left-padded batch (the processor's default): the prompt prefix is masked by setting
# labels[:, :prefix_length] = -100, i.e. the first prefix_length tensor columns. On left-padded rows those columns
# are padding, so real prompt tokens stay in the loss and the model is trained to predict the prompt. The fix
# masks by position among the non-padding tokens (works for left and right padding).

_C05_PAD = 0


def _c05_batch(bug: bool) -> dict[str, torch.Tensor]:
    g = _gen(2501)
    prefix_len = 4
    lengths = [12, 9, 7]
    width = max(lengths)
    ids = torch.full((3, width), _C05_PAD)
    attn = torch.zeros(3, width, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, width - n:] = torch.randint(3, 40, (n,), generator=g)
        attn[i, width - n:] = 1
    labels = ids.clone()
    labels[attn == 0] = -100
    if bug:
        labels[:, :prefix_len] = -100
    else:
        pos = attn.cumsum(1) - 1  # index among real tokens
        labels[(attn == 1) & (pos < prefix_len)] = -100
    return {"input_ids": ids, "attention_mask": attn, "labels": labels}


def _c05_build(bug: bool) -> Case:
    """Prompt-masked SFT of a tiny Llama on a left-padded batch, the prefix masked by tensor columns."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(_llama_config()).train()
    batch = _c05_batch(bug)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = _sgd_step(model, opt, lambda: model(**batch).loss)
    return model, step, _kw(optimizer=opt, inputs=batch)


def _c05_proof(bug: bool) -> bool:
    """Some real prompt token (among the first four non-padding tokens of a row) keeps a training label."""
    batch = _c05_batch(bug)
    attn = batch["attention_mask"]
    prompt = (attn == 1) & ((attn.cumsum(1) - 1) < 4)
    return bool((batch["labels"][prompt] != -100).any())


CASES: list[BlindCase] = [
    BlindCase("b21-case-01", "https://github.com/0xallam/Direct-Preference-Optimization/issues/4",
              "dpo-logprob-includes-padding",
              "Hand-written DPO sums response log-probabilities over padding tokens too, biasing the preference margin.",
              _c01_build, _c01_proof),
    BlindCase("b21-case-02", "https://github.com/modelscope/ms-swift/pull/10068",
              "infonce-positive-as-negative",
              "Resampled hard negatives include the example's own positive, so InfoNCE pushes query and positive apart.",
              _c02_build, _c02_proof),
    BlindCase("b21-case-03", "https://github.com/mll-lab-nu/RAGEN/issues/58",
              "kl-penalty-sign-flipped",
              "The KL-to-reference loss is subtracted from the actor loss, so training maximises divergence from the "
              "reference policy.",
              _c03_build, _c03_proof,
              known_miss="the KL-to-reference term is subtracted from the actor loss: the sign of a hand-computed loss term is arithmetic the audit does not judge"),
    BlindCase("b21-case-04", "https://github.com/ServiceNow/PipelineRL/pull/54",
              "grpo-advantage-wrong-group-stats",
              "Group-relative advantages are standardised with the first group's statistics, so other groups are not "
              "centred.",
              _c04_build, _c04_proof,
              known_miss="group advantages standardised with the first group's statistics: per-sample weights that come from the reward arithmetic are not compared with the rollout groups"),
    BlindCase("b21-case-05", "https://github.com/QwenLM/Qwen3-ASR/pull/212",
              "prompt-mask-wrong-with-left-padding",
              "Prompt masking by tensor columns on a left-padded batch leaves real prompt tokens in the SFT loss.",
              _c05_build, _c05_proof),
]
