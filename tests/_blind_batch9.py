"""Blind batch 9: silent training bugs from public GitHub threads, each with its fixed twin.

Collected by someone who does not write the audit's checks. Every case builds the user's setup on a tiny real
model (plain torch CNNs, GRUs, MLPs, a GAN, a graph VAE, a ConvE knowledge-graph model, a dueling DQN, a
REINFORCE policy and an image-to-LaTeX encoder-decoder; transformers Llama and BERT from tiny configs in code, a
LLaDA-style masked diffusion LM with PEFT LoRA; nothing is downloaded) and proves the bug without the audit on real
runs and real tensors.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw, _llama_config, _sgd_step


# --------------------------------------------------------------------------------------------- case-01
# LoRA target_modules copied from Llama onto a LLaDA-style model: attn_out and ff_proj match nothing

_C01_VOCAB, _C01_MASK_ID, _C01_D = 40, 39, 32
_C01_IDS = torch.randint(3, 39, (4, 12), generator=_gen(901))
_C01_T = torch.rand(4, 1, generator=_gen(902)) * 0.8 + 0.1
_C01_MASKED = torch.rand(4, 12, generator=_gen(903)) < _C01_T
_C01_NOISY = torch.where(_C01_MASKED, torch.full_like(_C01_IDS, _C01_MASK_ID), _C01_IDS)
_C01_LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
_C01_LLADA_TARGETS = ["q_proj", "k_proj", "v_proj", "attn_out", "ff_proj", "up_proj"]


class _LLaDABlock(nn.Module):
    """A LLaDA block with its own module names (attn_out, ff_proj, up_proj, ff_out), bidirectional attention."""

    def __init__(self, d: int = _C01_D, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm, self.ff_norm = nn.RMSNorm(d), nn.RMSNorm(d)
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False), \
            nn.Linear(d, d, bias=False)
        self.attn_out = nn.Linear(d, d, bias=False)
        self.ff_proj, self.up_proj = nn.Linear(d, 2 * d, bias=False), nn.Linear(d, 2 * d, bias=False)
        self.ff_out = nn.Linear(2 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.attn_norm(x)
        q, k, v = (p(h).view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, d)
        x = x + self.attn_out(a)
        h = self.ff_norm(x)
        return x + self.ff_out(F.silu(self.ff_proj(h)) * self.up_proj(h))


class _LLaDA(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(_C01_VOCAB, _C01_D)
        self.wpe = nn.Embedding(16, _C01_D)
        self.blocks = nn.ModuleList([_LLaDABlock() for _ in range(2)])
        self.ln_f = nn.RMSNorm(_C01_D)
        self.ff_head = nn.Linear(_C01_D, _C01_VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(input_ids) + self.wpe(torch.arange(input_ids.shape[1]))
        for blk in self.blocks:
            x = blk(x)
        return self.ff_head(self.ln_f(x))


def _c01_build(bug: bool) -> Case:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = _LLaDA()
    cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                     target_modules=_C01_LLAMA_TARGETS if bug else _C01_LLADA_TARGETS)
    model = get_peft_model(base, cfg).train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)

    def loss() -> torch.Tensor:
        logits = model(_C01_NOISY)
        tok = F.cross_entropy(logits[_C01_MASKED], _C01_IDS[_C01_MASKED], reduction="none")
        weight = (1.0 / _C01_T).expand_as(_C01_IDS)[_C01_MASKED]
        return (tok * weight).sum() / _C01_IDS.numel()

    return model, _sgd_step(model, opt, loss), _kw(optimizer=opt, inputs=_C01_NOISY)


def _c01_proof(bug: bool) -> bool:
    """After three steps the attention output and gate projections are bitwise unchanged: no adapter reached them."""
    model, step, _ = _c01_build(bug)
    probe = torch.randn(2, 5, _C01_D, generator=_gen(904))
    mods = [m for n, m in model.named_modules() if n.endswith(("attn_out", "ff_proj"))]
    with torch.no_grad():
        before = [m(probe).clone() for m in mods]
    for _ in range(3):
        step()
    with torch.no_grad():
        return all(torch.equal(b, m(probe)) for b, m in zip(before, mods))


# --------------------------------------------------------------------------------------------- case-02
# DeepSpeed-Chat's no_decay list ("bias", "LayerNorm.weight") matches none of Llama's RMSNorm weights

_C02_IDS = torch.randint(3, 40, (4, 16), generator=_gen(911))
_C02_STEPS = 20


def _c02_groups(model: nn.Module, weight_decay: float, bug: bool) -> list[dict[str, Any]]:
    if bug:
        no_decay = ["bias", "LayerNorm.weight"]
        names = {n: n for n, _ in model.named_parameters()}
    else:
        no_decay = ["bias", "layer_norm.weight", "layernorm.weight", "norm.weight", "ln_f.weight"]
        names = {n: n.lower() for n, _ in model.named_parameters()}
    groups = [
        {"params": [p for n, p in model.named_parameters()
                    if not any(nd in names[n] for nd in no_decay) and p.requires_grad],
         "weight_decay": weight_decay},
        {"params": [p for n, p in model.named_parameters()
                    if any(nd in names[n] for nd in no_decay) and p.requires_grad],
         "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def _c02_build(bug: bool) -> Case:
    from transformers import LlamaForCausalLM, get_scheduler

    torch.manual_seed(0)
    model = LlamaForCausalLM(_llama_config()).train()
    opt = torch.optim.AdamW(_c02_groups(model, 0.1, bug), lr=1e-3, betas=(0.9, 0.95))
    sched = get_scheduler("cosine", optimizer=opt, num_warmup_steps=2, num_training_steps=_C02_STEPS)

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = model(input_ids=_C02_IDS, labels=_C02_IDS).loss
        loss.backward()
        opt.step()
        sched.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs={"input_ids": _C02_IDS, "labels": _C02_IDS}, lr_scheduler=sched,
                            total_steps=_C02_STEPS)


def _c02_proof(bug: bool) -> bool:
    """Some RMSNorm weight sits in a parameter group with weight_decay > 0."""
    model, _, kw = _c02_build(bug)
    norms = {id(p) for n, p in model.named_parameters() if n.endswith("norm.weight")}
    return any(g["weight_decay"] > 0 and any(id(p) in norms for p in g["params"])
               for g in kw["optimizer"].param_groups)


# --------------------------------------------------------------------------------------------- case-03
# multimodal emotion classifier: inverse-frequency class weights written in the wrong order

_C03_U, _C03_B = 12, 3
_C03_TEXT = torch.randn(_C03_U, _C03_B, 20, generator=_gen(921))
_C03_AUDIO = torch.randn(_C03_U, _C03_B, 8, generator=_gen(922))
_C03_VIDEO = torch.randn(_C03_U, _C03_B, 6, generator=_gen(923))
_C03_Y = (torch.rand(_C03_U, _C03_B, generator=_gen(924)) < 0.0816).long()
_C03_Y[2, 0] = _C03_Y[7, 1] = _C03_Y[10, 2] = 1  # "fear": about 8% of utterances are positive
_C03_POS_FRAC = 0.0816


class _MultilogueNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj_t, self.proj_a, self.proj_v = nn.Linear(20, 16), nn.Linear(8, 16), nn.Linear(6, 16)
        self.gru = nn.GRU(48, 24)
        self.dropout = nn.Dropout(0.1)
        self.smax_fc = nn.Linear(24, 2)

    def forward(self, t: torch.Tensor, a: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        x = torch.cat([torch.tanh(self.proj_t(t)), torch.tanh(self.proj_a(a)), torch.tanh(self.proj_v(v))], -1)
        h, _ = self.gru(x)
        return F.log_softmax(self.smax_fc(self.dropout(h)), -1)


def _c03_weights(bug: bool) -> torch.Tensor:
    if bug:
        return torch.FloatTensor([1 / _C03_POS_FRAC, 1 / (1 - _C03_POS_FRAC)])
    return torch.FloatTensor([1 / (1 - _C03_POS_FRAC), 1 / _C03_POS_FRAC])


def _c03_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _MultilogueNet().train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=1e-5)
    loss_fn = nn.NLLLoss(weight=_c03_weights(bug))

    def loss() -> torch.Tensor:
        logp = model(_C03_TEXT, _C03_AUDIO, _C03_VIDEO)
        return loss_fn(logp.view(-1, 2), _C03_Y.view(-1))

    return model, _sgd_step(model, opt, loss), _kw(optimizer=opt, inputs=(_C03_TEXT, _C03_AUDIO, _C03_VIDEO, _C03_Y))


def _c03_proof(bug: bool) -> bool:
    """The majority class of the training labels gets the larger loss weight."""
    counts = torch.bincount(_C03_Y.view(-1), minlength=2)
    weights = _c03_weights(bug)
    majority = int(counts.argmax())
    return bool(weights[majority] > weights[1 - majority])


# --------------------------------------------------------------------------------------------- case-04
# ConvE label smoothing adds 1/N instead of eps/N to every target

_C04_NE, _C04_NR, _C04_EPS = 20, 4, 0.1
_C04_E1 = torch.randint(0, _C04_NE, (8,), generator=_gen(931))
_C04_REL = torch.randint(0, _C04_NR, (8,), generator=_gen(932))
_C04_MULTI = (torch.rand(8, _C04_NE, generator=_gen(933)) < 0.1).float()
_C04_MULTI[torch.arange(8), torch.randint(0, _C04_NE, (8,), generator=_gen(934))] = 1.0


class _ConvE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb_e = nn.Embedding(_C04_NE, 32)
        self.emb_rel = nn.Embedding(_C04_NR, 32)
        self.inp_drop, self.hidden_drop, self.feature_map_drop = nn.Dropout(0.2), nn.Dropout(0.3), nn.Dropout2d(0.2)
        self.conv1 = nn.Conv2d(1, 8, 3)
        self.bn0, self.bn1, self.bn2 = nn.BatchNorm2d(1), nn.BatchNorm2d(8), nn.BatchNorm1d(32)
        self.fc = nn.Linear(8 * 6 * 6, 32)
        self.b = nn.Parameter(torch.zeros(_C04_NE))

    def forward(self, e1: torch.Tensor, rel: torch.Tensor) -> torch.Tensor:
        x = torch.cat([self.emb_e(e1).view(-1, 1, 4, 8), self.emb_rel(rel).view(-1, 1, 4, 8)], 2)
        x = self.inp_drop(self.bn0(x))
        x = self.feature_map_drop(F.relu(self.bn1(self.conv1(x))))
        x = F.relu(self.bn2(self.hidden_drop(self.fc(x.view(x.shape[0], -1)))))
        return torch.sigmoid(x @ self.emb_e.weight.t() + self.b)


def _c04_targets(bug: bool) -> torch.Tensor:
    n = _C04_MULTI.size(1)
    if bug:
        return ((1.0 - _C04_EPS) * _C04_MULTI) + (1.0 / n)
    return ((1.0 - _C04_EPS) * _C04_MULTI) + (_C04_EPS / n)


def _c04_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _ConvE().train()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    targets = _c04_targets(bug)
    loss_fn = nn.BCELoss()
    step = _sgd_step(model, opt, lambda: loss_fn(model(_C04_E1, _C04_REL), targets))
    return model, step, _kw(optimizer=opt, inputs=(_C04_E1, _C04_REL, targets))


def _c04_proof(bug: bool) -> bool:
    """The smoothed target of a true triple is not 1 - eps + eps/N (it gets 1/N, ten times the smoothing mass)."""
    targets = _c04_targets(bug)
    want = 1.0 - _C04_EPS + _C04_EPS / _C04_NE
    return not torch.allclose(targets[_C04_MULTI == 1], torch.full_like(targets[_C04_MULTI == 1], want))


# --------------------------------------------------------------------------------------------- case-05
# VGAE KL term written with exp(logstd) where the variance exp(logstd)**2 belongs

_C05_N = 12
_C05_X = torch.randn(_C05_N, 8, generator=_gen(941))
_C05_ADJ = (torch.rand(_C05_N, _C05_N, generator=_gen(942)) < 0.25).float()
_C05_ADJ = ((_C05_ADJ + _C05_ADJ.t()) > 0).float()
_C05_ADJ.fill_diagonal_(1.0)
_deg = _C05_ADJ.sum(1)
_C05_ADJ_NORM = _C05_ADJ / torch.sqrt(_deg[:, None] * _deg[None, :])
_C05_POS_W = float((_C05_N * _C05_N - _C05_ADJ.sum()) / _C05_ADJ.sum())
_C05_NORM = _C05_N * _C05_N / float((_C05_N * _C05_N - _C05_ADJ.sum()) * 2)


class _VGAE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.base_gcn = nn.Linear(8, 16, bias=False)
        self.gcn_mean = nn.Linear(16, 8, bias=False)
        self.gcn_logstddev = nn.Linear(16, 8, bias=False)
        self.mean = torch.zeros(0)
        self.logstd = torch.zeros(0)

    def forward(self, x: torch.Tensor, adj: torch.Tensor) -> torch.Tensor:
        hidden = F.relu(adj @ self.base_gcn(x))
        self.mean = adj @ self.gcn_mean(hidden)
        self.logstd = adj @ self.gcn_logstddev(hidden)
        z = torch.randn_like(self.mean) * torch.exp(self.logstd) + self.mean
        return torch.sigmoid(z @ z.t())


def _c05_kl(mean: torch.Tensor, logstd: torch.Tensor, bug: bool) -> torch.Tensor:
    var = torch.exp(logstd) if bug else torch.exp(logstd) ** 2
    return 0.5 / mean.size(0) * (1 + 2 * logstd - mean ** 2 - var).sum(1).mean()


def _c05_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _VGAE().train()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    weight = torch.where(_C05_ADJ > 0, torch.tensor(_C05_POS_W), torch.tensor(1.0))

    def loss() -> torch.Tensor:
        a_pred = model(_C05_X, _C05_ADJ_NORM)
        rec = _C05_NORM * F.binary_cross_entropy(a_pred.view(-1), _C05_ADJ.view(-1), weight=weight.view(-1))
        return rec - _c05_kl(model.mean, model.logstd, bug)

    return model, _sgd_step(model, opt, loss), _kw(optimizer=opt, inputs=(_C05_X, _C05_ADJ_NORM))


def _c05_proof(bug: bool) -> bool:
    """At the prior (mean 0, logstd 0) the KL penalty still has a gradient: its minimum is not at the prior."""
    mean = torch.zeros(_C05_N, 8)
    logstd = torch.zeros(_C05_N, 8, requires_grad=True)
    (-_c05_kl(mean, logstd, bug)).backward()
    assert logstd.grad is not None
    return float(logstd.grad.abs().max()) > 1e-6


# --------------------------------------------------------------------------------------------- case-06
# binary click head: a sigmoid output layer trained with BCEWithLogitsLoss (the sigmoid is applied twice)

_C06_X = torch.randn(64, 10, generator=_gen(951))
_C06_Y = (_C06_X[:, 0] + 0.5 * _C06_X[:, 1] > 0.3).float()


class _BinaryTabular(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU())
        self.binary_output = nn.Sequential(nn.Linear(16, 1), nn.Sigmoid())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.binary_output(self.body(x)).squeeze(-1)


def _c06_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _BinaryTabular().train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    loss_fn: nn.Module = nn.BCEWithLogitsLoss() if bug else nn.BCELoss()
    step = _sgd_step(model, opt, lambda: loss_fn(model(_C06_X), _C06_Y))
    return model, step, _kw(optimizer=opt, inputs=(_C06_X, _C06_Y))


def _c06_proof(bug: bool) -> bool:
    """After 60 steps the loss on the negatives has not gone below ln 2: the loss never sees a probability < 0.5."""
    model, step, _ = _c06_build(bug)
    for _ in range(60):
        step()
    loss_fn: nn.Module = nn.BCEWithLogitsLoss() if bug else nn.BCELoss()
    with torch.no_grad():
        neg = _C06_Y == 0
        return float(loss_fn(model(_C06_X)[neg], _C06_Y[neg])) >= math.log(2) - 1e-6


# --------------------------------------------------------------------------------------------- case-07
# VSE++: validation mid-epoch switches the encoders to eval and training continues without train_start()

_C07_VAL_STEP = 2
_C07_IMG = torch.randn(6, 3, 16, 16, generator=_gen(961))
_C07_CAP = torch.randint(1, 30, (6, 7), generator=_gen(962))
_C07_VAL_IMG = torch.randn(4, 3, 16, 16, generator=_gen(963))
_C07_VAL_CAP = torch.randint(1, 30, (4, 7), generator=_gen(964))


class _EncoderImage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cnn = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(2))
        self.drop = nn.Dropout(0.5)
        self.fc = nn.Linear(32, 16)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.fc(self.drop(self.cnn(images).flatten(1))), dim=1)


class _EncoderText(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(30, 16)
        self.rnn = nn.GRU(16, 16, batch_first=True)

    def forward(self, caps: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.embed(caps))
        return F.normalize(out[:, -1], dim=1)


class _VSE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.img_enc, self.txt_enc = _EncoderImage(), _EncoderText()
        self.Eiters = 0

    def train_start(self) -> None:
        self.img_enc.train()
        self.txt_enc.train()

    def val_start(self) -> None:
        self.img_enc.eval()
        self.txt_enc.eval()

    def forward(self, images: torch.Tensor, caps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.img_enc(images), self.txt_enc(caps)


def _contrastive_max_violation(im: torch.Tensor, s: torch.Tensor, margin: float = 0.2) -> torch.Tensor:
    scores = im @ s.t()
    diagonal = scores.diag().view(-1, 1)
    cost_s = (margin + scores - diagonal).clamp(min=0)
    cost_im = (margin + scores - diagonal.t()).clamp(min=0)
    eye = torch.eye(scores.size(0), dtype=torch.bool)
    cost_s, cost_im = cost_s.masked_fill(eye, 0), cost_im.masked_fill(eye, 0)
    return cost_s.max(1)[0].sum() + cost_im.max(0)[0].sum()


def _c07_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _VSE()
    opt = torch.optim.Adam(model.parameters(), lr=2e-4)

    def validate() -> None:
        model.val_start()
        with torch.no_grad():
            model(_C07_VAL_IMG, _C07_VAL_CAP)

    def step() -> torch.Tensor:
        model.Eiters += 1
        opt.zero_grad()
        img_emb, cap_emb = model(_C07_IMG, _C07_CAP)
        loss = _contrastive_max_violation(img_emb, cap_emb)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 2.0)
        opt.step()
        if model.Eiters % _C07_VAL_STEP == 0:
            validate()
            if not bug:
                model.train_start()
        return loss

    model.train_start()  # start of the epoch
    for _ in range(_C07_VAL_STEP):  # the run is past its first validation, still inside the epoch
        step()
    return model, step, _kw(optimizer=opt, inputs=(_C07_IMG, _C07_CAP))


def _c07_proof(bug: bool) -> bool:
    """The next training step leaves the image BatchNorm running mean bitwise unchanged (the encoder is in eval)."""
    model, step, _ = _c07_build(bug)
    assert isinstance(model, _VSE)
    bn = model.img_enc.cnn[1]
    assert isinstance(bn, nn.BatchNorm2d) and bn.running_mean is not None
    before = bn.running_mean.clone()
    step()
    return torch.equal(before, bn.running_mean)


# --------------------------------------------------------------------------------------------- case-08
# REINFORCE whose "discounted reward" scales each reward by gamma**t instead of summing the future rewards

_C08_T = 12
_C08_STATES = torch.randn(_C08_T, 4, generator=_gen(971))
_C08_ACTIONS = torch.randint(0, 2, (_C08_T,), generator=_gen(972))
_C08_REWARDS = torch.ones(_C08_T)
_C08_REWARDS[-1] = -1.0  # the pole fell


def _c08_discount(r: torch.Tensor, bug: bool, gamma: float = 0.99, normalize: bool = True) -> torch.Tensor:
    if bug:
        d = torch.stack([val * gamma ** i for i, val in enumerate(r)])
    else:
        d = torch.zeros_like(r)
        running = 0.0
        for t in reversed(range(len(r))):
            running = running * gamma + float(r[t])
            d[t] = running
    if normalize:
        d = (d - d.mean()) / d.std()
    return d


def _c08_build(bug: bool) -> Case:
    torch.manual_seed(0)
    policy = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.Adam(policy.parameters(), lr=1e-2)
    returns = _c08_discount(_C08_REWARDS, bug)

    def loss() -> torch.Tensor:
        logp = F.log_softmax(policy(_C08_STATES), -1).gather(1, _C08_ACTIONS[:, None]).squeeze(1)
        return -(logp * returns).sum()

    return policy, _sgd_step(policy, opt, loss), _kw(optimizer=opt, inputs=(_C08_STATES, _C08_ACTIONS, returns))


def _c08_proof(bug: bool) -> bool:
    """The credit of the first action does not change when the last reward of the episode changes."""
    other = _C08_REWARDS.clone()
    other[-1] = 5.0
    a = _c08_discount(_C08_REWARDS, bug, normalize=False)
    b = _c08_discount(other, bug, normalize=False)
    return bool(torch.equal(a[0], b[0]))


# --------------------------------------------------------------------------------------------- case-09
# MiniGPT-4 linear warmup indexed by the step inside the epoch: the lr restarts its warmup every epoch

_C09_IPE, _C09_EPOCHS, _C09_WARMUP = 4, 5, 10
_C09_INIT_LR, _C09_MIN_LR, _C09_WARMUP_LR = 1e-4, 8e-5, 1e-6
_C09_IMG = torch.randn(2, 3, 16, 16, generator=_gen(981))
_C09_TXT = torch.randint(3, 40, (2, 8), generator=_gen(982))


class _LinearWarmupCosineLRScheduler:
    def __init__(self, optimizer: torch.optim.Optimizer, max_epoch: int, iters_per_epoch: int, min_lr: float,
                 init_lr: float, warmup_steps: int, warmup_start_lr: float, bug: bool) -> None:
        self.optimizer, self.max_epoch, self.iters_per_epoch = optimizer, max_epoch, iters_per_epoch
        self.min_lr, self.init_lr, self.warmup_steps, self.warmup_start_lr = min_lr, init_lr, warmup_steps, \
            warmup_start_lr
        self.bug = bug

    def _set(self, lr: float) -> None:
        for param_group in self.optimizer.param_groups:
            param_group["lr"] = lr

    def step(self, cur_epoch: int, cur_step: int) -> None:
        total_cur_step = cur_epoch * self.iters_per_epoch + cur_step
        if total_cur_step < self.warmup_steps:
            s = cur_step if self.bug else total_cur_step
            self._set(min(self.init_lr, self.warmup_start_lr
                          + (self.init_lr - self.warmup_start_lr) * s / max(self.warmup_steps, 1)))
        else:
            self._set((self.init_lr - self.min_lr) * 0.5
                      * (1.0 + math.cos(math.pi * total_cur_step / (self.max_epoch * self.iters_per_epoch)))
                      + self.min_lr)


class _MiniGPT4(nn.Module):
    """A frozen visual encoder and a frozen Llama; only the llama_proj bridge is trained."""

    def __init__(self) -> None:
        from transformers import LlamaForCausalLM

        super().__init__()
        self.visual_encoder = nn.Sequential(nn.Conv2d(3, 16, 4, stride=4), nn.GELU())
        self.llama_model = LlamaForCausalLM(_llama_config())
        self.llama_proj = nn.Linear(16, 32)
        for p in list(self.visual_encoder.parameters()) + list(self.llama_model.parameters()):
            p.requires_grad_(False)

    def forward(self, image: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        img = self.visual_encoder(image).flatten(2).transpose(1, 2)[:, :4]  # 4 query tokens
        img_embeds = self.llama_proj(img)
        embeds = torch.cat([img_embeds, self.llama_model.get_input_embeddings()(text)], 1)
        labels = torch.cat([torch.full((text.shape[0], 4), -100), text], 1)
        return self.llama_model(inputs_embeds=embeds, labels=labels).loss


def _c09_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _MiniGPT4().train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=_C09_INIT_LR, weight_decay=0.05,
                            betas=(0.9, 0.999))
    sched = _LinearWarmupCosineLRScheduler(opt, _C09_EPOCHS, _C09_IPE, _C09_MIN_LR, _C09_INIT_LR, _C09_WARMUP,
                                           _C09_WARMUP_LR, bug)
    it = [0]

    def step() -> torch.Tensor:
        epoch, i = divmod(it[0], _C09_IPE)
        sched.step(cur_epoch=epoch, cur_step=i)
        loss = model(_C09_IMG, _C09_TXT)
        opt.zero_grad()
        loss.backward()
        opt.step()
        it[0] += 1
        return loss

    return model, step, _kw(optimizer=opt, inputs=(_C09_IMG, _C09_TXT), lr_scheduler=sched,
                            total_steps=_C09_IPE * _C09_EPOCHS)


def _c09_proof(bug: bool) -> bool:
    """During the warmup the lr falls back when the second epoch starts."""
    _, _, kw = _c09_build(bug)
    sched, opt = kw["lr_scheduler"], kw["optimizer"]
    lrs = []
    for t in range(_C09_WARMUP):
        sched.step(cur_epoch=t // _C09_IPE, cur_step=t % _C09_IPE)
        lrs.append(opt.param_groups[0]["lr"])
    return any(b < a for a, b in zip(lrs, lrs[1:]))


# --------------------------------------------------------------------------------------------- case-10
# video polyp segmentation: Normalize_video subtracts the channel means from image columns 0..2

_C10_MEAN, _C10_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
_C10_RAW = torch.rand(4, 3, 16, 16, generator=_gen(991))
_C10_MASK = (F.avg_pool2d(_C10_RAW[:, :1], 5, 1, 2) > 0.5).float()


def _c10_normalize(imgs: torch.Tensor, bug: bool) -> torch.Tensor:
    res_img = []
    for img in imgs.clone():  # img: [C, H, W], after toTensor_video
        for i in range(3):
            if bug:
                img[:, :, i] -= float(_C10_MEAN[i])
            else:
                img[i] -= float(_C10_MEAN[i])
        for i in range(3):
            if bug:
                img[:, :, i] /= float(_C10_STD[i])
            else:
                img[i] /= float(_C10_STD[i])
        res_img.append(img)
    return torch.stack(res_img)


class _PolypSeg(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                 nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.head = nn.Conv2d(8, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(x))


def _c10_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _PolypSeg().train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = _c10_normalize(_C10_RAW, bug)

    def loss() -> torch.Tensor:
        logits = model(x)
        wbce = F.binary_cross_entropy_with_logits(logits, _C10_MASK)
        p = torch.sigmoid(logits)
        wiou = 1 - ((p * _C10_MASK).sum() + 1) / ((p + _C10_MASK - p * _C10_MASK).sum() + 1)
        return wbce + wiou

    return model, _sgd_step(model, opt, loss), _kw(optimizer=opt, inputs=(x, _C10_MASK))


def _c10_proof(bug: bool) -> bool:
    """Image columns 3 and up reach the model as the raw [0, 1] pixels: they were never normalized."""
    return torch.equal(_c10_normalize(_C10_RAW, bug)[..., 3:], _C10_RAW[..., 3:])


# --------------------------------------------------------------------------------------------- case-11
# CSA-CDGAN: the discriminator's prediction on the fake map is detached inside the generator loss

_C11_X1 = torch.rand(4, 3, 16, 16, generator=_gen(1001))
_C11_X2 = torch.rand(4, 3, 16, 16, generator=_gen(1002))
_C11_GT = ((_C11_X1 - _C11_X2).abs().mean(1, keepdim=True) > 0.35).float()
_C11_G_WEIGHT, _C11_D_WEIGHT = 50.0, 1.0


class _NetG(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Conv2d(6, 16, 4, 2, 1), nn.LeakyReLU(0.2), nn.Conv2d(16, 32, 4, 2, 1),
                                     nn.BatchNorm2d(32), nn.LeakyReLU(0.2))
        self.decoder = nn.Sequential(nn.ConvTranspose2d(32, 16, 4, 2, 1), nn.BatchNorm2d(16), nn.ReLU(),
                                     nn.ConvTranspose2d(16, 1, 4, 2, 1), nn.Sigmoid())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x))


class _NetD(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 16, 4, 2, 1), nn.LeakyReLU(0.2), nn.Conv2d(16, 32, 4, 2, 1),
                                      nn.BatchNorm2d(32), nn.LeakyReLU(0.2), nn.Conv2d(32, 1, 4, 1, 0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.features(x)).view(-1)


class _CDGAN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.netg, self.netd = _NetG(), _NetD()


def _c11_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _CDGAN().train()
    netg, netd = model.netg, model.netd
    optimizer_d = torch.optim.Adam(netd.parameters(), lr=2e-4, betas=(0.5, 0.999))
    optimizer_g = torch.optim.Adam(netg.parameters(), lr=2e-4, betas=(0.5, 0.999))
    l_con, l_bce = nn.L1Loss(), nn.BCELoss()
    x = torch.cat((_C11_X1, _C11_X2), 1)
    real_label = torch.ones(x.shape[0])
    fake_label = torch.zeros(x.shape[0])

    def step() -> torch.Tensor:
        fake = netg(x)
        pred_real = netd(_C11_GT)
        pred_fake = netd(fake).detach() if bug else netd(fake)
        err_d_fake = l_bce(pred_fake, real_label)  # the generator wants its fakes judged real
        err_g = l_con(fake, _C11_GT)
        err_g_total = _C11_G_WEIGHT * err_g + _C11_D_WEIGHT * err_d_fake

        pred_fake_ = netd(fake.detach())
        err_d_total = (l_bce(pred_real, real_label) + l_bce(pred_fake_, fake_label)) * 0.5

        optimizer_g.zero_grad()
        err_g_total.backward(retain_graph=True)
        optimizer_g.step()
        optimizer_d.zero_grad()
        err_d_total.backward()
        optimizer_d.step()
        return err_g_total

    return model, step, _kw(optimizer=optimizer_g, inputs=(x, _C11_GT))


def _c11_proof(bug: bool) -> bool:
    """The generator's gradient from its full loss equals the one from the L1 term alone: the adversarial term adds
    nothing."""
    model, _, _ = _c11_build(bug)
    assert isinstance(model, _CDGAN)
    x = torch.cat((_C11_X1, _C11_X2), 1)
    grads = []
    for with_adv in (True, False):
        torch.manual_seed(1)
        model.netg.zero_grad()
        fake = model.netg(x)
        pred_fake = model.netd(fake).detach() if bug else model.netd(fake)
        total = _C11_G_WEIGHT * F.l1_loss(fake, _C11_GT)
        if with_adv:
            total = total + _C11_D_WEIGHT * F.binary_cross_entropy(pred_fake, torch.ones(x.shape[0]))
        total.backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.netg.parameters() if p.grad is not None]))
    return torch.allclose(grads[0], grads[1], atol=1e-7, rtol=0)


# --------------------------------------------------------------------------------------------- case-12
# BERT sentence classifier fed an attention mask with ones on the padding and zeros on the tokens

_C12_PAD = 0
_C12_IDS = torch.tensor([[1, 7, 12, 9, 15, 8, 2, 0, 0, 0],
                         [1, 22, 5, 31, 2, 0, 0, 0, 0, 0],
                         [1, 14, 6, 18, 27, 11, 19, 4, 13, 2],
                         [1, 9, 9, 25, 2, 0, 0, 0, 0, 0]])
_C12_Y = torch.tensor([1, 0, 1, 0])


class _BertClassifier(nn.Module):
    def __init__(self) -> None:
        from transformers import BertConfig, BertModel

        super().__init__()
        cfg = BertConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=64, max_position_embeddings=32, pad_token_id=_C12_PAD)
        self.bert = BertModel(cfg)
        self.classifier = nn.Linear(32, 2)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.classifier(h[:, 0])


def _c12_mask(ids: torch.Tensor, bug: bool) -> torch.Tensor:
    return (ids == _C12_PAD).long() if bug else (ids != _C12_PAD).long()


def _c12_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _BertClassifier().train()
    opt = torch.optim.Adam(model.parameters(), lr=2e-5)
    mask = _c12_mask(_C12_IDS, bug)
    step = _sgd_step(model, opt, lambda: F.cross_entropy(model(_C12_IDS, mask), _C12_Y))
    return model, step, _kw(optimizer=opt, inputs={"input_ids": _C12_IDS, "attention_mask": mask, "labels": _C12_Y})


def _c12_proof(bug: bool) -> bool:
    """Replacing a word of a padded sentence leaves its [CLS] logits unchanged: no token attends to the words."""
    model, _, _ = _c12_build(bug)
    model.eval()
    other = _C12_IDS.clone()
    other[0, 3] = 30
    with torch.no_grad():
        a = model(_C12_IDS, _c12_mask(_C12_IDS, bug))[0]
        b = model(other, _c12_mask(other, bug))[0]
    return torch.allclose(a, b, atol=1e-6)


# --------------------------------------------------------------------------------------------- case-13
# image-to-LaTeX decoder: AutoregressiveWrapper keeps ignore_index=-100 while the tokenizer pads with 0

_C13_PAD, _C13_BOS, _C13_EOS, _C13_V = 0, 1, 2, 30
_C13_IMG = torch.rand(3, 1, 16, 32, generator=_gen(1011))
_C13_LENS = [9, 5, 3]
_C13_SEQ = torch.zeros(3, 10, dtype=torch.long)
for _r, _n in enumerate(_C13_LENS):
    _C13_SEQ[_r, 0] = _C13_BOS
    _C13_SEQ[_r, 1:_n - 1] = torch.randint(3, _C13_V, (_n - 2,), generator=_gen(1012 + _r))
    _C13_SEQ[_r, _n - 1] = _C13_EOS


class _LatexOCR(nn.Module):
    def __init__(self, ignore_index: int) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Conv2d(1, 16, 4, 4), nn.GELU())
        self.token_emb = nn.Embedding(_C13_V, 16)
        self.pos_emb = nn.Embedding(16, 16)
        layer = nn.TransformerDecoderLayer(16, 2, 32, dropout=0.1, batch_first=True)
        self.decoder = nn.TransformerDecoder(layer, 2)
        self.to_logits = nn.Linear(16, _C13_V)
        self.pad_value, self.ignore_index = _C13_PAD, ignore_index

    def net(self, x: torch.Tensor, context: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        h = self.token_emb(x) + self.pos_emb(torch.arange(t))
        causal = torch.triu(torch.ones(t, t, dtype=torch.bool), 1)
        return self.to_logits(self.decoder(h, context, tgt_mask=causal, tgt_key_padding_mask=~mask))

    def forward(self, img: torch.Tensor, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        context = self.encoder(img).flatten(2).transpose(1, 2)
        xi, xo = x[:, :-1], x[:, 1:]
        out = self.net(xi, context, mask[:, :-1])
        return F.cross_entropy(out.transpose(1, 2), xo, ignore_index=self.ignore_index)


def _c13_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _LatexOCR(ignore_index=-100 if bug else _C13_PAD).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mask = _C13_SEQ != _C13_PAD
    return model, _sgd_step(model, opt, lambda: model(_C13_IMG, _C13_SEQ, mask)), \
        _kw(optimizer=opt, inputs=(_C13_IMG, _C13_SEQ, mask))


def _c13_proof(bug: bool) -> bool:
    """The loss has a gradient at decoder positions whose target is a padding token."""
    model, _, _ = _c13_build(bug)
    assert isinstance(model, _LatexOCR)
    model.eval()
    mask = _C13_SEQ != _C13_PAD
    context = model.encoder(_C13_IMG).flatten(2).transpose(1, 2)
    out = model.net(_C13_SEQ[:, :-1], context, mask[:, :-1]).detach().requires_grad_(True)
    F.cross_entropy(out.transpose(1, 2), _C13_SEQ[:, 1:], ignore_index=model.ignore_index).backward()
    assert out.grad is not None
    return float(out.grad[_C13_SEQ[:, 1:] == _C13_PAD].abs().max()) > 0


# --------------------------------------------------------------------------------------------- case-14
# dueling DQN whose advantage is centred on the mean over the whole minibatch instead of per sample

_C14_S = torch.randn(16, 10, generator=_gen(1021))
_C14_A = torch.randint(0, 3, (16,), generator=_gen(1022))
_C14_R = torch.randn(16, generator=_gen(1023)) * 0.1
_C14_NS = _C14_S + 0.05 * torch.randn(16, 10, generator=_gen(1024))
_C14_DONE = (torch.rand(16, generator=_gen(1025)) < 0.1)


class _DQNDueling(nn.Module):
    def __init__(self, bug: bool) -> None:
        super().__init__()
        self.bug = bug
        self.fc_val = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1))
        self.fc_adv = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        val, adv = self.fc_val(x), self.fc_adv(x)
        return val + adv - (adv.mean() if self.bug else adv.mean(dim=1, keepdim=True))


def _c14_build(bug: bool) -> Case:
    torch.manual_seed(0)
    net = _DQNDueling(bug).train()
    tgt_net = copy.deepcopy(net)
    opt = torch.optim.Adam(net.parameters(), lr=1e-4)

    def loss() -> torch.Tensor:
        q = net(_C14_S).gather(1, _C14_A[:, None]).squeeze(-1)
        next_v = tgt_net(_C14_NS).max(1)[0]
        next_v[_C14_DONE] = 0.0
        return F.mse_loss(q, (next_v.detach() * 0.99 + _C14_R))

    return net, _sgd_step(net, opt, loss), _kw(optimizer=opt, inputs=(_C14_S, _C14_A, _C14_R, _C14_NS, _C14_DONE))


def _c14_proof(bug: bool) -> bool:
    """A state's Q-values depend on which other states share its minibatch."""
    net, _, _ = _c14_build(bug)
    with torch.no_grad():
        return not torch.allclose(net(_C14_S)[:1], net(_C14_S[:1]), atol=1e-6)


# --------------------------------------------------------------------------------------------- case-15
# CrossScore: the input std is sliced from the same [:3] entries as the mean

_C15_IMG_MEAN_STD = torch.tensor([0.485, 0.456, 0.406, 0.229, 0.224, 0.225])
_C15_QUERY = torch.rand(2, 3, 16, 16, generator=_gen(1031))
_C15_REF = torch.rand(2, 3, 16, 16, generator=_gen(1032))
_C15_TARGET = 1 - (_C15_QUERY - _C15_REF).abs().mean(1, keepdim=True)


class _CrossScore(nn.Module):
    def __init__(self, bug: bool) -> None:
        super().__init__()
        self.register_buffer("img_mean_std", _C15_IMG_MEAN_STD.clone())
        self.bug = bug
        self.backbone = nn.Sequential(nn.Conv2d(3, 16, 4, 4), nn.GELU())
        self.cross = nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16))

    def normalize(self, img: torch.Tensor) -> torch.Tensor:
        mean_std = self.get_buffer("img_mean_std")
        img_mean = mean_std[None, :3, None, None]
        img_std = mean_std[None, :3, None, None] if self.bug else mean_std[None, 3:, None, None]
        return (img - img_mean) / img_std

    def forward(self, query: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
        q = self.backbone(self.normalize(query)).flatten(2).transpose(1, 2)  # (B, 16 patches, 16)
        r = self.backbone(self.normalize(ref)).flatten(2).transpose(1, 2)
        h, _ = self.cross(q, r, r)
        score = torch.sigmoid(self.head(h + q))  # 16 pixels per patch
        b = score.shape[0]
        return score.view(b, 4, 4, 4, 4).permute(0, 1, 3, 2, 4).reshape(b, 1, 16, 16)


def _c15_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _CrossScore(bug).train()
    opt = torch.optim.AdamW(model.parameters(), lr=5e-4)
    step = _sgd_step(model, opt, lambda: F.l1_loss(model(_C15_QUERY, _C15_REF), _C15_TARGET))
    return model, step, _kw(optimizer=opt, inputs=(_C15_QUERY, _C15_REF))


def _c15_proof(bug: bool) -> bool:
    """An image one ImageNet std above the ImageNet mean is not normalized to 1 in every channel."""
    model, _, _ = _c15_build(bug)
    assert isinstance(model, _CrossScore)
    img = (_C15_IMG_MEAN_STD[:3] + _C15_IMG_MEAN_STD[3:])[None, :, None, None].expand(1, 3, 4, 4)
    return not torch.allclose(model.normalize(img), torch.ones(1, 3, 4, 4), atol=1e-5)


CASES: list[BlindCase] = [
    BlindCase("b9-case-01", "https://github.com/dllm-reasoning/d1/issues/6", "LoRA / PEFT target modules",
              "the LoRA target_modules copied from Llama match only some of the LLaDA model's projections: "
              "attn_out and ff_proj get no adapter and PEFT raises nothing", _c01_build, _c01_proof),
    BlindCase("b9-case-02", "https://github.com/deepspeedai/DeepSpeedExamples/pull/755",
              "optimizer / weight decay groups",
              "the no-decay list (\"bias\", \"LayerNorm.weight\") matches none of Llama's RMSNorm weights: "
              "weight decay is applied to every norm scale", _c02_build, _c02_proof,
              known_miss="blind batch 9: with the empty no-decay group dropped, nothing says the norms were meant to escape weight decay; decaying them is OPT-005 (INFO)"),
    BlindCase("b9-case-03", "https://github.com/amanshenoy/multilogue-net/issues/21", "class imbalance / loss weights",
              "the inverse-frequency class weights are written in the wrong order: the majority class gets the "
              "large weight and the rare positive class the small one", _c03_build, _c03_proof),
    BlindCase("b9-case-04", "https://github.com/TimDettmers/ConvE/issues/55", "targets / label smoothing",
              "label smoothing adds 1/N instead of eps/N to every target: the smoothing mass is 1/eps times too "
              "large and the targets no longer match the intended distribution", _c04_build, _c04_proof,
              known_miss="blind batch 9: smoothed targets that stay inside [0, 1] are valid BCE targets; their smoothing amount is not judged"),
    BlindCase("b9-case-05", "https://github.com/DaehanKim/vgae_pytorch/issues/2", "VAE / KL term",
              "the VGAE KL term uses exp(logstd) where the variance exp(logstd)**2 belongs: its minimum is not at "
              "the prior and it pulls every posterior std toward 2", _c05_build, _c05_proof,
              known_miss="blind batch 9: the KL term's formula (std where the variance belongs) is arithmetic inside the loss; no invariant checks a KL's minimum"),
    BlindCase("b9-case-06", "https://github.com/NVIDIA-Merlin/models/pull/1175", "activation / loss mismatch",
              "the binary head already ends in a sigmoid and the loss is BCEWithLogitsLoss: the sigmoid is applied "
              "twice, every probability the loss sees is at least 0.5", _c06_build, _c06_proof),
    BlindCase("b9-case-07", "https://github.com/fartashf/vsepp/issues/4", "train / eval mode",
              "validation mid-epoch switches the encoders to eval mode and training resumes without train_start(): "
              "dropout and BatchNorm stay in inference mode for the rest of the epoch", _c07_build, _c07_proof),
    BlindCase("b9-case-08", "https://github.com/hunkim/ReinforcementZeroToAll/issues/1", "RL / returns",
              "the REINFORCE discounted reward multiplies each reward by gamma**t instead of summing the future "
              "rewards: an action gets no credit for what follows it", _c08_build, _c08_proof,
              known_miss="blind batch 9: how the returns are computed from rewards happens before the loss; no invariant knows a return should sum future rewards"),
    BlindCase("b9-case-09", "https://github.com/Vision-CAIR/MiniGPT-4/pull/263", "schedules",
              "the linear warmup is indexed by the step inside the epoch: when warmup spans several epochs the lr "
              "drops back to the warmup start at each new epoch", _c09_build, _c09_proof,
              known_miss="blind batch 9: the scheduler is not a torch LRScheduler, so the audit cannot walk it"),
    BlindCase("b9-case-10", "https://github.com/GewelsJI/VPS/issues/50", "data preprocessing / normalization",
              "Normalize_video indexes img[:, :, i] on [C, H, W] tensors: image columns 0-2 are normalized with the "
              "channel statistics and the channels are never normalized", _c10_build, _c10_proof,
              known_miss="blind batch 9: the normalisation indexes the wrong axis of an image; the inputs keep a plausible scale"),
    BlindCase("b9-case-11", "https://github.com/wangle53/CSA-CDGAN/issues/5", "GAN / gradient flow",
              "the discriminator's prediction on the fake map is detached inside the generator loss: the "
              "adversarial term gives the generator no gradient and it trains on L1 alone", _c11_build, _c11_proof),
    BlindCase("b9-case-12", "https://github.com/nyu-mll/jiant/pull/465", "masks / attention",
              "the BERT attention mask has ones on the padding and zeros on the tokens: words attend only to "
              "padding and the [CLS] classifier never sees the sentence", _c12_build, _c12_proof),
    BlindCase("b9-case-13", "https://github.com/lukas-blecher/LaTeX-OCR/issues/305", "masks / padding",
              "the autoregressive wrapper keeps cross_entropy's ignore_index=-100 while the tokenizer pads with 0: "
              "the decoder is also trained to predict the padding", _c13_build, _c13_proof),
    BlindCase("b9-case-14", "https://github.com/PacktPublishing/Deep-Reinforcement-Learning-Hands-On/pull/9",
              "RL / architecture",
              "the dueling DQN subtracts adv.mean() over the whole minibatch instead of per sample: each state's "
              "Q-values depend on the other states in its batch", _c14_build, _c14_proof),
    BlindCase("b9-case-15", "https://github.com/ActiveVisionLab/CrossScore/issues/3",
              "data preprocessing / normalization",
              "img_std is sliced from the same [:3] entries as img_mean: inputs are divided by the ImageNet mean "
              "instead of the std", _c15_build, _c15_proof,
              known_miss="blind batch 9: dividing by the mean instead of the std leaves inputs of a plausible scale"),
]
