"""Blind batch 10: silent training bugs from public GitHub threads, each with its fixed twin.

Collected by someone who does not write the audit's checks. Every case builds the user's setup on a tiny real
model (a plain torch GCN question-answering scorer, a conv denoiser trained under a GradScaler and a DDPG
actor-critic; transformers Llama with PEFT LoRA, a GPT-2 student distilled from a GPT-2 teacher and a BERT
classifier with its pooler outside the head, all from tiny configs in code; nothing is downloaded) and proves
the bug without the audit on real runs and real tensors.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw, _llama_config, _sgd_step


# --------------------------------------------------------------------------------------------- case-01
# GCN entity-candidate scorer ends in a softmax and is trained with CrossEntropyLoss: softmax applied twice

_C01_B, _C01_N, _C01_D = 3, 6, 16
_C01_X = torch.randn(_C01_B, _C01_N, _C01_D, generator=_gen(1001))
_C01_ADJ = (torch.rand(_C01_B, _C01_N, _C01_N, generator=_gen(1002)) < 0.4).float()
_C01_ADJ = ((_C01_ADJ + _C01_ADJ.transpose(1, 2)).clamp(max=1) + torch.eye(_C01_N))
_C01_ADJ = _C01_ADJ.clamp(max=1) / _C01_ADJ.clamp(max=1).sum(-1, keepdim=True)
_C01_Y = torch.tensor([1, 4, 2])


class _GCNQA(nn.Module):
    """Candidate mentions as graph nodes: two GCN layers, then one score per node (the answer candidate)."""

    def __init__(self, softmax_out: bool) -> None:
        super().__init__()
        self.softmax_out = softmax_out
        self.gcn1, self.gcn2 = nn.Linear(_C01_D, 32), nn.Linear(32, 32)
        self.scorer = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor, adj: torch.Tensor) -> torch.Tensor:
        h = torch.relu(adj @ self.gcn1(x))
        h = torch.relu(adj @ self.gcn2(h)) + h
        scores = self.scorer(h).squeeze(-1)
        return F.softmax(scores, dim=-1) if self.softmax_out else scores


def _c01_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _GCNQA(softmax_out=bug).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    crit = nn.CrossEntropyLoss()
    return model, _sgd_step(model, opt, lambda: crit(model(_C01_X, _C01_ADJ), _C01_Y)), \
        _kw(optimizer=opt, inputs=(_C01_X, _C01_ADJ))


def _c01_proof(bug: bool) -> bool:
    """What CrossEntropyLoss receives is already a probability distribution: every row in [0, 1], summing to 1."""
    model, _, _ = _c01_build(bug)
    with torch.no_grad():
        out = model(_C01_X, _C01_ADJ)
    return bool((out >= 0).all() and (out <= 1).all() and torch.allclose(out.sum(-1), torch.ones(_C01_B)))


# --------------------------------------------------------------------------------------------- case-02
# LoRA LLM trainer never calls optimizer.zero_grad(): every step's gradient is added to all earlier ones

_C02_IDS = torch.randint(3, 40, (4, 12), generator=_gen(1011))


def _c02_build(bug: bool) -> Case:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    base = LlamaForCausalLM(_llama_config())
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, task_type="CAUSAL_LM",
                                            target_modules=["q_proj", "v_proj"])).train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)

    def step() -> torch.Tensor:
        if not bug:
            opt.zero_grad()
        loss = model(input_ids=_C02_IDS, labels=_C02_IDS).loss
        loss.backward()
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs={"input_ids": _C02_IDS, "labels": _C02_IDS})


def _c02_proof(bug: bool) -> bool:
    """On the second step the LoRA grads are not this step's gradient: the first step's gradient is still in them."""
    model, step, _ = _c02_build(bug)
    step()
    params = [p for p in model.parameters() if p.requires_grad]
    fresh = torch.autograd.grad(model(input_ids=_C02_IDS, labels=_C02_IDS).loss, params)
    step()
    return not all(p.grad is not None and torch.allclose(p.grad, g, rtol=1e-4, atol=1e-7)
                   for p, g in zip(params, fresh))


# --------------------------------------------------------------------------------------------- case-03
# mixed-precision denoiser training clips the *scaled* gradients: clip_grad_norm_ before scaler.unscale_

_C03_X = torch.randn(4, 3, 16, 16, generator=_gen(1021))
_C03_NOISE = torch.randn(4, 3, 16, 16, generator=_gen(1022))
_C03_MAX_NORM = 1.0


class _Denoiser(nn.Module):
    """A tiny UNet-like noise predictor: down conv, up conv, skip connection."""

    def __init__(self) -> None:
        super().__init__()
        self.inc = nn.Conv2d(3, 16, 3, padding=1)
        self.down = nn.Conv2d(16, 32, 3, stride=2, padding=1)
        self.up = nn.ConvTranspose2d(32, 16, 2, stride=2)
        self.out = nn.Conv2d(32, 3, 3, padding=1)
        self.norm = nn.GroupNorm(4, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h1 = F.silu(self.norm(self.inc(x)))
        h2 = F.silu(self.down(h1))
        return self.out(torch.cat([F.silu(self.up(h2)), h1], 1))


def _c03_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _Denoiser().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    noisy = 0.7 * _C03_X + 0.7 * _C03_NOISE

    def step() -> torch.Tensor:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.mse_loss(model(noisy).float(), _C03_NOISE)
        scaler.scale(loss).backward()
        if not bug:
            scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), _C03_MAX_NORM)
        scaler.step(opt)
        scaler.update()
        return loss

    return model, step, _kw(optimizer=opt, inputs=noisy)


def _c03_proof(bug: bool) -> bool:
    """The gradient the optimizer applies (unscaled by scaler.step) is ~max_norm / scale, not min(norm, max_norm)."""
    model, step, _ = _c03_build(bug)
    step()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None]))
    return bool(norm < 1e-3 * _C03_MAX_NORM)


# --------------------------------------------------------------------------------------------- case-04
# DDPG update_networks(tau=1.0) ignores its tau argument: the targets are never hard-copied from the online nets

_C04_S, _C04_A, _C04_BS = 6, 2, 16
_C04_STATE = torch.randn(_C04_BS, _C04_S, generator=_gen(1031))
_C04_ACTION = torch.rand(_C04_BS, _C04_A, generator=_gen(1032)) * 2 - 1
_C04_REWARD = torch.randn(_C04_BS, 1, generator=_gen(1033))
_C04_NEXT = torch.randn(_C04_BS, _C04_S, generator=_gen(1034))
_C04_DONE = (torch.rand(_C04_BS, 1, generator=_gen(1035)) < 0.1).float()


def _c04_policy() -> nn.Module:
    return nn.Sequential(nn.Linear(_C04_S, 32), nn.ReLU(), nn.Linear(32, _C04_A), nn.Tanh())


class _Q(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(_C04_S + _C04_A, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, s: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([s, a], -1))


class _DDPG(nn.Module):
    def __init__(self, bug: bool, tau: float = 0.005) -> None:
        super().__init__()
        self.bug, self.tau = bug, tau
        self.online_policy_model, self.target_policy_model = _c04_policy(), _c04_policy()
        self.online_value_model, self.target_value_model = _Q(), _Q()
        self.update_networks(tau=1.0)

    def update_networks(self, tau: float | None = None) -> None:
        tau = self.tau if tau is None else tau
        mix = self.tau if self.bug else tau  # the report: the body reads self.tau, not the tau argument
        with torch.no_grad():
            for tgt_m, on_m in ((self.target_value_model, self.online_value_model),
                                (self.target_policy_model, self.online_policy_model)):
                for target, online in zip(tgt_m.parameters(), on_m.parameters()):
                    target.copy_((1.0 - mix) * target + mix * online)


def _c04_build(bug: bool) -> Case:
    torch.manual_seed(0)
    agent = _DDPG(bug).train()
    v_opt = torch.optim.Adam(agent.online_value_model.parameters(), lr=1e-3)
    p_opt = torch.optim.Adam(agent.online_policy_model.parameters(), lr=1e-4)

    def step() -> torch.Tensor:
        with torch.no_grad():
            a_next = agent.target_policy_model(_C04_NEXT)
            target_q = _C04_REWARD + 0.99 * agent.target_value_model(_C04_NEXT, a_next) * (1 - _C04_DONE)
        value_loss = F.mse_loss(agent.online_value_model(_C04_STATE, _C04_ACTION), target_q)
        v_opt.zero_grad()
        value_loss.backward()
        v_opt.step()
        policy_loss = -agent.online_value_model(_C04_STATE, agent.online_policy_model(_C04_STATE)).mean()
        p_opt.zero_grad()
        policy_loss.backward()
        p_opt.step()
        agent.update_networks()
        return value_loss

    return agent, step, _kw(optimizer=v_opt, inputs=(_C04_STATE, _C04_ACTION))


def _c04_proof(bug: bool) -> bool:
    """Right after construction the target networks still differ from the online networks they should copy."""
    agent, _, _ = _c04_build(bug)
    assert isinstance(agent, _DDPG)
    pairs: list[tuple[nn.Module, nn.Module]] = [(agent.target_value_model, agent.online_value_model),
                                                (agent.target_policy_model, agent.online_policy_model)]
    return any(not torch.allclose(t, o) for tm, om in pairs for t, o in zip(tm.parameters(), om.parameters()))


# --------------------------------------------------------------------------------------------- case-05
# knowledge distillation with gradient accumulation: micro-batch losses summed, never divided by the step count

_C05_ACCUM, _C05_T, _C05_ALPHA = 4, 2.0, 0.5
_C05_IDS = torch.randint(3, 40, (_C05_ACCUM, 2, 10), generator=_gen(1041))


def _c05_gpt2(n_embd: int, n_layer: int) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=40, n_positions=32, n_embd=n_embd, n_layer=n_layer, n_head=2,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2)
    return GPT2LMHeadModel(cfg)


def _c05_kd(student: nn.Module, teacher: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    out = student(input_ids=ids, labels=ids)
    with torch.no_grad():
        t_logits = teacher(input_ids=ids).logits
    kd = F.kl_div(F.log_softmax(out.logits / _C05_T, -1), F.softmax(t_logits / _C05_T, -1),
                  reduction="batchmean") * _C05_T ** 2
    return _C05_ALPHA * kd + (1 - _C05_ALPHA) * out.loss


def _c05_build(bug: bool) -> Case:
    torch.manual_seed(0)
    teacher = _c05_gpt2(48, 3).eval()
    student = _c05_gpt2(32, 2).train()
    opt = torch.optim.AdamW(student.parameters(), lr=5e-4)

    def step() -> torch.Tensor:
        opt.zero_grad()
        total = torch.zeros(())
        for mb in _C05_IDS:
            loss = _c05_kd(student, teacher, mb)
            if not bug:
                loss = loss / _C05_ACCUM
            loss.backward()
            total = total + loss.detach()
        opt.step()
        return total

    return student, step, _kw(optimizer=opt, inputs={"input_ids": _C05_IDS[0], "labels": _C05_IDS[0]})


def _c05_proof(bug: bool) -> bool:
    """The accumulated gradient is 4x the gradient of the mean loss over the effective batch."""
    from transformers import GPT2LMHeadModel

    student, step, _ = _c05_build(bug)
    torch.manual_seed(0)
    teacher = _c05_gpt2(48, 3).eval()
    assert isinstance(student, GPT2LMHeadModel)
    ref = copy.deepcopy(student)
    mean = torch.stack([_c05_kd(ref, teacher, mb) for mb in _C05_IDS]).mean()
    g_ref = torch.autograd.grad(mean, [ref.transformer.wte.weight])[0]
    step()
    grad = student.transformer.wte.weight.grad
    assert grad is not None
    return bool(abs(grad.norm() / g_ref.norm() - 1.0) > 0.5)


# --------------------------------------------------------------------------------------------- case-06
# MMF transformer: the pooler moved out of the classifier is left out of get_optimizer_parameters

_C06_IDS = torch.randint(3, 40, (4, 10), generator=_gen(1051))
_C06_Y = torch.tensor([0, 2, 1, 2])


class _MMFTransformer(nn.Module):
    """BERT backbone, a pooler (dense + tanh on [CLS]) that now sits outside the head, and a classifier head."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import BertConfig, BertModel

        self.backbone = BertModel(BertConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2,
                                             num_attention_heads=2, intermediate_size=64,
                                             max_position_embeddings=32), add_pooling_layer=False)
        self.pooler = nn.Sequential(nn.Linear(32, 32), nn.Tanh())
        self.classifier = nn.Sequential(nn.Dropout(0.1), nn.Linear(32, 3))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.backbone(input_ids=input_ids).last_hidden_state
        return self.classifier(self.pooler(h[:, 0]))


def _c06_params(model: _MMFTransformer, lr: float, mult: float, bug: bool) -> list[dict[str, Any]]:
    head = [{"params": list(model.classifier.parameters()), "lr": lr}]
    if bug:  # the old list: backbone and classifier only
        return [{"params": list(model.backbone.parameters()), "lr": lr * mult}] + head
    rest = [p for n, p in model.named_parameters() if not n.startswith("classifier")]
    return [{"params": rest, "lr": lr * mult}] + head


def _c06_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _MMFTransformer().train()
    opt = torch.optim.AdamW(_c06_params(model, 5e-4, 0.1, bug))
    return model, _sgd_step(model, opt, lambda: F.cross_entropy(model(_C06_IDS), _C06_Y)), \
        _kw(optimizer=opt, inputs=_C06_IDS)


def _c06_proof(bug: bool) -> bool:
    """After three steps the pooler is bitwise unchanged though it receives non-zero gradients."""
    model, step, _ = _c06_build(bug)
    assert isinstance(model, _MMFTransformer)
    watched = list(model.pooler.parameters())
    before = [p.detach().clone() for p in watched]
    for _ in range(3):
        step()
    got_grad = all(p.grad is not None and p.grad.abs().sum() > 0 for p in watched)
    return got_grad and all(torch.equal(b, p) for b, p in zip(before, watched))


CASES: list[BlindCase] = [
    BlindCase("b10-case-01", "https://github.com/bowang-lab/Transformer-GCN-QA/pull/32", "loss / activations",
              "the GCN candidate scorer ends in a softmax and CrossEntropyLoss applies log_softmax again: the loss "
              "sees probabilities as logits, is bounded far from zero and its gradient is squashed", _c01_build,
              _c01_proof),
    BlindCase("b10-case-02", "https://github.com/tenstorrent/tt-blacksmith/pull/711", "optimizer / zero_grad",
              "the LoRA trainer never zeroes the gradients after optimizer.step(): each step applies the sum of all "
              "gradients so far instead of the current one", _c02_build, _c02_proof),
    BlindCase("b10-case-03", "https://github.com/victorchall/EveryDream2trainer/pull/175",
              "mixed precision / clipping",
              "clip_grad_norm_ runs on the GradScaler-scaled gradients: after unscaling, every update is about "
              "max_norm / 65536 in norm and training effectively halts", _c03_build, _c03_proof),
    BlindCase("b10-case-04", "https://github.com/mimoralea/gdrl/pull/14", "RL / target network",
              "update_networks(tau=1.0) mixes with self.tau instead of its tau argument: the DDPG target actor and "
              "critic start from their own random weights instead of copies of the online networks", _c04_build,
              _c04_proof, known_miss="the target networks train by polyak averaging outside any optimizer; that they "
              "started as independent random nets instead of copies is visible only against the online nets' "
              "weights at construction, which one step does not see"),
    BlindCase("b10-case-05", "https://github.com/agokrani/distillKitPlus/issues/5", "gradient accumulation",
              "the distillation loss of each micro-batch is back-propagated without dividing by the accumulation "
              "steps: the effective gradient (and learning rate) scales with gradient_accumulation_steps",
              _c05_build, _c05_proof),
    BlindCase("b10-case-06", "https://github.com/facebookresearch/mmf/pull/620", "optimizer param groups",
              "after the pooler moved out of the classifier, get_optimizer_parameters lists only the backbone and "
              "the classifier: the pooler gets gradients but is never updated", _c06_build, _c06_proof),
]
