"""Blind batch 27 (part a): silent language-model training bugs from public GitHub threads, each with its fixed twin.

Collected by someone who does not write the audit's checks. Every case builds the user's setup on a tiny model
(transformers GPT-2 and Llama models from tiny configs in code, a BERT-style encoder with DeepSpeed-kernel parameter
names; nothing is downloaded) and proves the bug without the audit on real tensors and real steps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw, _llama_config


def _gpt2_config(**kw: object) -> object:
    from transformers import GPT2Config

    base: dict[str, object] = {"vocab_size": 40, "n_embd": 32, "n_layer": 2, "n_head": 2, "n_positions": 32,
                              "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    base.update(kw)
    return GPT2Config(**base)


# --------------------------------------------------------------------------------------------- case-01
# sunzeyeah/RLHF issue #17: the pairwise reward model scores chosen and rejected answers with the reward of their
# last token. The training code finds the first pad of each (c_ind, r_ind) and then reads BOTH end scores at
# end_ind = max(c_ind, r_ind) - 1, so the shorter answer of every pair is scored at a padding position. The loss is
# finite and decreases (the model learns to score the padding), nothing warns. The maintainer confirmed ("if the last
# non-padding token is used, max(c_ind, r_ind) should indeed not be taken") and changed it to use c_ind and r_ind
# separately, which is the twin.

_C01_PAD = 0
_C01_PROMPT = torch.randint(3, 40, (4, 5), generator=_gen(2701))


def _c01_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen(2702)
    chosen = torch.full((4, 14), _C01_PAD)
    rejected = torch.full((4, 14), _C01_PAD)
    c_len = [9, 13, 8, 11]
    r_len = [12, 7, 13, 10]
    for i in range(4):
        chosen[i, :5] = _C01_PROMPT[i]
        rejected[i, :5] = _C01_PROMPT[i]
        chosen[i, 5:c_len[i]] = torch.randint(3, 40, (c_len[i] - 5,), generator=g)
        rejected[i, 5:r_len[i]] = torch.randint(3, 40, (r_len[i] - 5,), generator=g)
    return chosen, rejected


_C01_CHOSEN, _C01_REJECTED = _c01_batch()


class _C01RewardModel(nn.Module):
    """GPT-2 body with a scalar value head, one reward per token (as in the thread's RewardModel)."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Model

        self.transformer = GPT2Model(_gpt2_config())
        self.v_head = nn.Linear(32, 1, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        mask = input_ids.ne(_C01_PAD).long()
        h = self.transformer(input_ids, attention_mask=mask).last_hidden_state
        return self.v_head(h).squeeze(-1)


def _c01_loss(model: _C01RewardModel, bug: bool) -> torch.Tensor:
    chosen, rejected = _C01_CHOSEN, _C01_REJECTED
    rewards = model(torch.cat([chosen, rejected]))
    bs = chosen.shape[0]
    chosen_rewards, rejected_rewards = rewards[:bs], rewards[bs:]
    c_end, r_end = [], []
    for i in range(bs):
        c_inds = (chosen[i] == _C01_PAD).nonzero()
        c_ind = c_inds[0].item() if len(c_inds) > 0 else chosen.shape[1]
        r_inds = (rejected[i] == _C01_PAD).nonzero()
        r_ind = r_inds[0].item() if len(r_inds) > 0 else rejected.shape[1]
        if bug:
            end_ind = max(c_ind, r_ind)
            c_ind, r_ind = end_ind, end_ind
        c_end.append(chosen_rewards[i, c_ind - 1])
        r_end.append(rejected_rewards[i, r_ind - 1])
    return -F.logsigmoid(torch.stack(c_end) - torch.stack(r_end)).mean()


def _c01_build(bug: bool) -> Case:
    """Pairwise reward model on right-padded chosen/rejected pairs, end score per answer."""
    torch.manual_seed(0)
    model = _C01RewardModel().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = _c01_loss(model, bug)
        loss.backward()
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=torch.cat([_C01_CHOSEN, _C01_REJECTED]))


def _c01_proof(bug: bool) -> bool:
    """The pad token's embedding gets gradient: a score read at padding drives the loss (exactly 0 when fixed)."""
    model, _, _ = _c01_build(bug)
    model.zero_grad()
    _c01_loss(model, bug).backward()
    pad_grad = model.transformer.wte.weight.grad[_C01_PAD].abs().max().item()
    return pad_grad > 1e-8


# --------------------------------------------------------------------------------------------- case-02
# NVIDIA-NeMo/Megatron-Bridge PR #4660: the SFT dataset built its loss mask by value,
# `loss_mask[labels == pad_token_id] = 0`, while the tokenizer had no pad token and was given
# `pad_token = eos_token`. Every genuine EOS target is then dropped from the loss along with the padding, so the
# model is never trained to emit EOS (it learns not to stop); the loss looks normal. Fix in the PR (merged): mask
# the padding by position, from the last real token onward, so the real EOS keeps its loss.

_C02_EOS = 2
_C02_LENS = [10, 14, 7, 12]


def _c02_batch() -> tuple[torch.Tensor, list[int]]:
    g = _gen(2711)
    ids = torch.full((4, 16), _C02_EOS)  # pad_token = eos_token
    for i, n in enumerate(_C02_LENS):
        ids[i, 0] = 1
        ids[i, 1:n - 1] = torch.randint(3, 40, (n - 2,), generator=g)
        ids[i, n - 1] = _C02_EOS  # the genuine end of the answer
    return ids, _C02_LENS


_C02_IDS, _ = _c02_batch()


def _c02_labels_and_mask(bug: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """labels[i] = input_ids[i + 1]; the loss mask the dataset returns."""
    ids = _C02_IDS
    labels = torch.cat([ids[:, 1:], torch.full((ids.shape[0], 1), _C02_EOS)], dim=1)
    loss_mask = torch.ones_like(labels, dtype=torch.float)
    if bug:
        loss_mask[labels == _C02_EOS] = 0.0
    else:
        for i, n in enumerate(_C02_LENS):
            loss_mask[i, n - 1:] = 0.0  # from the last real token onward (its label is padding)
    return labels, loss_mask


def _c02_loss(model: nn.Module, bug: bool, logits_out: list[torch.Tensor] | None = None) -> torch.Tensor:
    labels, loss_mask = _c02_labels_and_mask(bug)
    attn = torch.zeros_like(_C02_IDS)
    for i, n in enumerate(_C02_LENS):
        attn[i, :n] = 1
    logits = model(input_ids=_C02_IDS, attention_mask=attn).logits
    if logits_out is not None:
        logits.retain_grad()
        logits_out.append(logits)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
    return (ce * loss_mask.reshape(-1)).sum() / loss_mask.sum()


def _c02_build(bug: bool) -> Case:
    """Tiny Llama SFT step with pad_token = eos_token and the dataset's loss mask."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(_llama_config(pad_token_id=_C02_EOS)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = _c02_loss(model, bug)
        loss.backward()
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=_C02_IDS)


def _c02_proof(bug: bool) -> bool:
    """The logits at the positions whose target is the genuine EOS get no gradient at all."""
    model, _, _ = _c02_build(bug)
    out: list[torch.Tensor] = []
    _c02_loss(model, bug, out).backward()
    grad = out[0].grad
    assert grad is not None
    eos_rows = torch.stack([grad[i, n - 2] for i, n in enumerate(_C02_LENS)])  # position n-2 predicts EOS at n-1
    return bool(eos_rows.abs().max().item() == 0.0)


# --------------------------------------------------------------------------------------------- case-03
# CarperAI/trlx PR #509 (issue #508): PPO on GPT-2 with left-padded prompts computed the log-probs of the
# responses (in make_experience and in the loss) with `model(tokens, attention_mask)` and no position_ids. GPT-2's
# learned absolute position embeddings then start at the padding, so every shorter prompt's tokens are scored at
# positions shifted by its pad count: the policy is trained on log-probs of inputs it never sees at generation time,
# silently. Fix in the PR (merged): position_ids = attention_mask.cumsum(-1) - 1, masked_fill(mask == 0, 1), passed
# to both forwards.

_C03_PAD = 0
_C03_QLEN = [6, 3, 5, 2]


def _c03_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen(2721)
    query = torch.full((4, 6), _C03_PAD)
    for i, n in enumerate(_C03_QLEN):
        query[i, 6 - n:] = torch.randint(3, 40, (n,), generator=g)  # left padding, as trlx's prompt pipeline
    response = torch.randint(3, 40, (4, 5), generator=g)
    return query, response


_C03_QUERY, _C03_RESPONSE = _c03_batch()


def _c03_logprobs(model: nn.Module, tokens: torch.Tensor, bug: bool) -> torch.Tensor:
    attention_mask = tokens.not_equal(_C03_PAD).long()
    if bug:
        logits = model(tokens, attention_mask=attention_mask).logits
    else:
        position_ids = attention_mask.cumsum(-1) - 1
        position_ids.masked_fill_(attention_mask == 0, 1)
        logits = model(tokens, attention_mask=attention_mask, position_ids=position_ids).logits
    lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)
    start = _C03_QUERY.shape[1] - 1
    return lp[:, start:start + _C03_RESPONSE.shape[1]]


def _c03_build(bug: bool) -> Case:
    """One PPO policy update (clipped ratio loss) on left-padded prompts and their responses."""
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(_gpt2_config()).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    tokens = torch.cat([_C03_QUERY, _C03_RESPONSE], dim=1)
    with torch.no_grad():
        old_logprobs = _c03_logprobs(model, tokens, bug)
    advantages = torch.randn(old_logprobs.shape, generator=_gen(2722))

    def step() -> torch.Tensor:
        opt.zero_grad()
        logprobs = _c03_logprobs(model, tokens, bug)
        ratio = torch.exp(logprobs - old_logprobs)
        loss = torch.max(-advantages * ratio, -advantages * ratio.clamp(0.8, 1.2)).mean()
        loss.backward()
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=tokens)


def _c03_proof(bug: bool) -> bool:
    """A left-padded row's response log-probs differ from the same row run with no padding."""
    model, _, _ = _c03_build(bug)
    model.eval()
    tokens = torch.cat([_C03_QUERY, _C03_RESPONSE], dim=1)
    with torch.no_grad():
        batched = _c03_logprobs(model, tokens, bug)
        i = 1  # three pad tokens
        alone = torch.cat([_C03_QUERY[i, 6 - _C03_QLEN[i]:], _C03_RESPONSE[i]]).unsqueeze(0)
        lg = model(alone).logits
        lp = torch.log_softmax(lg[:, :-1], dim=-1).gather(-1, alone[:, 1:].unsqueeze(-1)).squeeze(-1)
        ref = lp[0, _C03_QLEN[i] - 1:]
    return (batched[i] - ref).abs().max().item() > 1e-4



# --------------------------------------------------------------------------------------------- case-04
# deepspeedai/DeepSpeedExamples PR #75 (issue #68): BERT pre-training (bing_bert) with the DeepSpeed transformer
# kernel builds its AdamW/LAMB groups with `no_decay = ['bias', 'LayerNorm.bias', 'LayerNorm.weight']`. The kernel's
# layers name their parameters attn_qkvw, attn_qkvb, attn_ob, attn_nw, attn_nb, inter_b, output_b, norm_w, norm_b, so
# none of their biases and LayerNorm weights match and all of them are silently weight-decayed (the LayerNorm gains
# are pulled towards 0). Fix in the PR (merged, "Thanks for fixing this bug"): add the kernel's names
# "attn_nw", "attn_nb", "norm_w", "norm_b", "attn_qkvb", "attn_ob", "inter_b", "output_b" to no_decay.

_C04_H = 32
_C04_NO_DECAY_KERNEL = ["attn_nw", "attn_nb", "norm_w", "norm_b", "attn_qkvb", "attn_ob", "inter_b", "output_b"]


class _C04KernelLayer(nn.Module):
    """A post-LN encoder layer with DeepSpeedTransformerLayer's parameter names."""

    def __init__(self, h: int = _C04_H, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.attn_qkvw = nn.Parameter(torch.randn(3 * h, h) * 0.02)
        self.attn_qkvb = nn.Parameter(torch.zeros(3 * h))
        self.attn_ow = nn.Parameter(torch.randn(h, h) * 0.02)
        self.attn_ob = nn.Parameter(torch.zeros(h))
        self.attn_nw = nn.Parameter(torch.ones(h))
        self.attn_nb = nn.Parameter(torch.zeros(h))
        self.inter_w = nn.Parameter(torch.randn(4 * h, h) * 0.02)
        self.inter_b = nn.Parameter(torch.zeros(4 * h))
        self.output_w = nn.Parameter(torch.randn(h, 4 * h) * 0.02)
        self.output_b = nn.Parameter(torch.zeros(h))
        self.norm_w = nn.Parameter(torch.ones(h))
        self.norm_b = nn.Parameter(torch.zeros(h))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = F.linear(x, self.attn_qkvw, self.attn_qkvb).chunk(3, dim=-1)
        q, k, v = (z.view(b, t, self.heads, h // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :].bool())
        att = F.linear(att.transpose(1, 2).reshape(b, t, h), self.attn_ow, self.attn_ob)
        x = F.layer_norm(x + att, (h,), self.attn_nw, self.attn_nb)
        ff = F.linear(F.gelu(F.linear(x, self.inter_w, self.inter_b)), self.output_w, self.output_b)
        return F.layer_norm(x + ff, (h,), self.norm_w, self.norm_b)


class _C04Bert(nn.Module):
    """BERT-style MLM model: HF-named embeddings and head, DeepSpeed-kernel encoder layers."""

    def __init__(self, vocab: int = 40, h: int = _C04_H) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, h)
        self.position_embeddings = nn.Embedding(16, h)
        self.LayerNorm = nn.LayerNorm(h)
        self.layer = nn.ModuleList([_C04KernelLayer(h) for _ in range(2)])
        self.decoder = nn.Linear(h, vocab)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(input_ids.shape[1]).unsqueeze(0)
        x = self.LayerNorm(self.word_embeddings(input_ids) + self.position_embeddings(pos))
        for layer in self.layer:
            x = layer(x, attention_mask)
        return self.decoder(x)


def _c04_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = _gen(2731)
    ids = torch.randint(5, 40, (4, 16), generator=g)
    labels = torch.full_like(ids, -100)
    masked = torch.rand(ids.shape, generator=g) < 0.15
    masked[:, 3] = True
    labels[masked] = ids[masked]
    ids = ids.masked_fill(masked, 4)  # [MASK]
    return ids, torch.ones_like(ids), labels


_C04_IDS, _C04_ATTN, _C04_LABELS = _c04_batch()


def _c04_build(bug: bool) -> Case:
    """bing_bert-style grouped AdamW over a kernel-layer BERT, one MLM step."""
    torch.manual_seed(0)
    model = _C04Bert().train()
    no_decay = ["bias", "LayerNorm.bias", "LayerNorm.weight"]
    if not bug:
        no_decay += _C04_NO_DECAY_KERNEL
    param_optimizer = list(model.named_parameters())
    groups = [
        {"params": [p for n, p in param_optimizer if not any(nd in n for nd in no_decay)], "weight_decay": 0.01},
        {"params": [p for n, p in param_optimizer if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=1e-3)

    def step() -> torch.Tensor:
        opt.zero_grad()
        logits = model(_C04_IDS, _C04_ATTN)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), _C04_LABELS.reshape(-1), ignore_index=-100)
        loss.backward()
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=_C04_IDS)


def _c04_proof(bug: bool) -> bool:
    """With their gradients zeroed, the kernel LayerNorm gains still move in an AdamW step: decay alone moves them."""
    model, _, kw = _c04_build(bug)
    opt = kw["optimizer"]
    logits = model(_C04_IDS, _C04_ATTN)
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), _C04_LABELS.reshape(-1)).backward()
    gains = [layer.attn_nw for layer in model.layer] + [layer.norm_w for layer in model.layer]
    before = [g.detach().clone() for g in gains]
    for g in gains:
        assert g.grad is not None
        g.grad.zero_()
    opt.step()
    return any(not torch.equal(b, g.detach()) for b, g in zip(before, gains, strict=True))


# --------------------------------------------------------------------------------------------- case-05
# Blaizzy/mlx-vlm PR #846 (issue #845): the trainer's hand-written LoRaLayer returned `y + alpha * (x @ A @ B)`
# instead of `y + (alpha / rank) * (x @ A @ B)`. With the defaults rank=8, alpha=16 every adapter update is applied
# 8x stronger than the configured LoRA (and than PEFT for the same config); training runs, the loss moves, and the
# adapters come out over-scaled or the run degrades with no error. Fix in the PR (merged): store
# `scale = alpha / rank` and use it in the forward (and in the merge). Reproduced with the same layer in torch on a
# tiny Llama's q_proj / v_proj.

_C05_RANK, _C05_ALPHA = 8, 16.0
_C05_IDS = torch.randint(3, 40, (4, 12), generator=_gen(2741))


class _C05LoRaLayer(nn.Module):
    """The thread's LoRA layer: frozen base linear plus A (uniform init) and B (zeros)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, bug: bool) -> None:
        super().__init__()
        self.linear = base
        scale = 1.0 / base.in_features ** 0.5
        self.A = nn.Parameter(torch.empty(base.in_features, rank).uniform_(-scale, scale))
        self.B = nn.Parameter(torch.zeros(rank, base.out_features))
        self.scale = alpha if bug else alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + self.scale * ((x @ self.A) @ self.B)


def _c05_build(bug: bool) -> Case:
    """Tiny Llama, base frozen, LoRA (rank 8, alpha 16) on q_proj and v_proj, one causal-LM step."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(_llama_config())
    model.requires_grad_(False)
    for layer in model.model.layers:
        attn = layer.self_attn
        attn.q_proj = _C05LoRaLayer(attn.q_proj, _C05_RANK, _C05_ALPHA, bug)
        attn.v_proj = _C05LoRaLayer(attn.v_proj, _C05_RANK, _C05_ALPHA, bug)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = model(input_ids=_C05_IDS, labels=_C05_IDS).loss
        loss.backward()
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=_C05_IDS)


def _c05_proof(bug: bool) -> bool:
    """After a real step the adapter's contribution is alpha * (x A B), not (alpha / rank) * (x A B)."""
    model, step, _ = _c05_build(bug)
    step()
    layer = model.model.layers[0].self_attn.q_proj
    x = torch.randn(3, 32, generator=_gen(2742))
    with torch.no_grad():
        contrib = layer(x) - layer.linear(x)
        raw = (x @ layer.A) @ layer.B
        applied = (contrib.norm() / raw.norm()).item()
    return abs(applied - _C05_ALPHA / _C05_RANK) > 0.5

CASES: list[BlindCase] = [
    BlindCase("b27a-01", "https://github.com/sunzeyeah/RLHF/issues/17", "reward read at padding",
              "The pairwise reward loss reads both end scores at max(chosen_end, rejected_end), so the shorter answer "
              "of every pair is scored at a padding position.", _c01_build, _c01_proof),
    BlindCase("b27a-02", "https://github.com/NVIDIA-NeMo/Megatron-Bridge/pull/4660", "EOS dropped from the loss",
              "With pad_token = eos_token the SFT loss mask zeroes every label equal to the pad id, so the genuine EOS "
              "targets are never trained and the model does not learn to stop.", _c02_build, _c02_proof),
    BlindCase("b27a-03", "https://github.com/CarperAI/trlx/pull/509", "position ids under left padding",
              "PPO log-probs of left-padded GPT-2 prompts are computed without position_ids, so every shorter prompt "
              "is scored at absolute positions shifted by its padding.", _c03_build, _c03_proof),
    BlindCase("b27a-04", "https://github.com/deepspeedai/DeepSpeedExamples/pull/75", "weight decay on norms and biases",
              "The no_decay list matches only HF names ('bias', 'LayerNorm.weight'), so the DeepSpeed kernel layers' "
              "LayerNorm gains and biases (attn_nw, norm_w, attn_qkvb, ...) are all weight-decayed.",
              _c04_build, _c04_proof),
    BlindCase("b27a-05", "https://github.com/Blaizzy/mlx-vlm/pull/846", "LoRA scaling factor",
              "The hand-written LoRA layer scales its update by alpha instead of alpha / rank, so with rank 8 and "
              "alpha 16 every adapter update is applied 8x stronger than configured.", _c05_build, _c05_proof,
              known_miss="a hand-written LoRA layer scaled by alpha instead of alpha / r: the adapter's scale is read from peft configs only"),
]
