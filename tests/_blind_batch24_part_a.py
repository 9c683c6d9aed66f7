"""Blind batch 24 (part a): silent LLM fine-tuning bugs from public GitHub threads, each with its fixed twin.

Collected by someone who does not write the audit's checks. Every case builds the user's setup on a tiny model
(transformers Llama and GPT-2 models from tiny configs in code, peft LoRA adapters and hand-written LoRA layers;
nothing is downloaded) and proves the bug without the audit on real tensors and real steps.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw, _llama_config, _sgd_step

# --------------------------------------------------------------------------------------------- case-01
# huggingface/peft PR #2803 (solves #2777): a model with tied input embeddings and LM head (tie_word_embeddings=True)
# is LoRA-tuned with `modules_to_save=["embed_tokens", "lm_head"]`. PEFT wraps each module separately and gives each
# its own trainable copy, so the two start equal and drift apart during training: the tie the model was built on is
# silently broken, and whichever copy is dropped at merge time loses its training. Fix in the PR: the LoraConfig
# option `ensure_weight_tying=True`, which makes the tied LM head share the embedding's trainable copy.

_C01_IDS = torch.randint(3, 40, (4, 12), generator=_gen(2401))


def _c01_build(bug: bool) -> Case:
    """Tied-embedding Llama, LoRA on q/v plus embed_tokens and lm_head as fully trained modules_to_save."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    base = LlamaForCausalLM(_llama_config(tie_word_embeddings=True))
    extra = {} if bug else {"ensure_weight_tying": True}
    cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                     modules_to_save=["embed_tokens", "lm_head"], **extra)
    model = get_peft_model(base, cfg).train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    step = _sgd_step(model, opt, lambda: model(input_ids=_C01_IDS, labels=_C01_IDS).loss)
    return model, step, _kw(optimizer=opt, inputs=_C01_IDS)


def _c01_proof(bug: bool) -> bool:
    """After a few training steps the embedding the model reads and the LM head it predicts with are different."""
    model, step, _ = _c01_build(bug)
    for _ in range(3):
        step()
    inner = model.base_model.model
    emb = inner.model.embed_tokens.modules_to_save["default"].weight
    head = inner.lm_head.modules_to_save["default"].weight
    return not torch.equal(emb, head)

# --------------------------------------------------------------------------------------------- case-02
# unslothai/unsloth-zoo PR #832 (review thread on the DPO reference path): the DPO reference log-probs are taken from
# the live model with every LoRA scale set to 0 for the reference forward ("the adapter disabled"). When the run
# also trains full non-LoRA tensors (a trainable lm_head / embed_tokens), those keep moving with the policy, so the
# "reference" is no longer the frozen initial policy and the DPO regularisation towards it quietly weakens. Fix
# proposed in the thread: keep a frozen snapshot of the non-LoRA trainables for the reference pass (or refuse the
# mixed setup); the twin runs the reference forward with the lm_head held at its starting value.

class _ScaledLoRA(nn.Module):
    """LoRA around a frozen linear; `scale` is the knob the reference pass sets to 0."""

    def __init__(self, base: nn.Linear, r: int = 4, alpha: float = 8.0) -> None:
        super().__init__()
        self.base = base
        self.lora_a = nn.Parameter(torch.randn(r, base.in_features) / base.in_features ** 0.5)
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, r))
        self.scale = alpha / r

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.scale * (x @ self.lora_a.t() @ self.lora_b.t())


def _c02_pairs() -> tuple[torch.Tensor, torch.Tensor]:
    """Two preference pairs sharing a prompt: rows [chosen0, chosen1, rejected0, rejected1] and a response mask."""
    g = _gen(2402)
    prompt = torch.randint(3, 40, (2, 6), generator=g)
    chosen, rejected = torch.randint(3, 40, (2, 5), generator=g), torch.randint(3, 40, (2, 5), generator=g)
    ids = torch.cat([torch.cat([prompt, chosen], 1), torch.cat([prompt, rejected], 1)])
    mask = torch.zeros_like(ids, dtype=torch.float32)
    mask[:, 6:] = 1.0
    return ids, mask


_C02_IDS, _C02_MASK = _c02_pairs()
_C02_BETA = 0.1


def _seq_logps(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return (logp * mask[:, 1:]).sum(-1)


def _c02_model() -> nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(_llama_config())
    model.requires_grad_(False)
    for layer in model.model.layers:
        attn = layer.self_attn
        attn.q_proj, attn.v_proj = _ScaledLoRA(attn.q_proj), _ScaledLoRA(attn.v_proj)
    model.lm_head.weight.requires_grad_(True)  # a full module trained next to the adapters (modules_to_save)
    return model.train()


def _c02_reference(model: nn.Module, head_snapshot: torch.Tensor | None) -> torch.Tensor:
    """Reference log-probs: LoRA scales zeroed on the live model (and, in the fix, the lm_head at its start value)."""
    loras = [m for m in model.modules() if isinstance(m, _ScaledLoRA)]
    saved = [m.scale for m in loras]
    try:
        for m in loras:
            m.scale = 0.0
        with torch.no_grad():
            if head_snapshot is None:
                logits = model(input_ids=_C02_IDS).logits
            else:
                logits = torch.func.functional_call(model, {"lm_head.weight": head_snapshot}, (),
                                                    {"input_ids": _C02_IDS}).logits
    finally:
        for m, s in zip(loras, saved):
            m.scale = s
    return _seq_logps(logits, _C02_IDS, _C02_MASK)


def _c02_build(bug: bool) -> Case:
    """LoRA DPO where the lm_head is also trained and the reference is the live model with the adapters scaled to 0."""
    model = _c02_model()
    snapshot = None if bug else model.lm_head.weight.detach().clone()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-3)

    def loss_fn() -> torch.Tensor:
        ref = _c02_reference(model, snapshot)
        pol = _seq_logps(model(input_ids=_C02_IDS).logits, _C02_IDS, _C02_MASK)
        margin = (pol[:2] - ref[:2]) - (pol[2:] - ref[2:])
        return -F.logsigmoid(_C02_BETA * margin).mean()

    return model, _sgd_step(model, opt, loss_fn), _kw(optimizer=opt, inputs=_C02_IDS)


def _c02_proof(bug: bool) -> bool:
    """After training, the reference log-probs the loss uses differ from those of the initial (frozen) policy."""
    model, step, _ = _c02_build(bug)
    with torch.no_grad():
        initial = _seq_logps(_c02_model()(input_ids=_C02_IDS).logits, _C02_IDS, _C02_MASK)
    for _ in range(4):
        step()
    snapshot = None if bug else _c02_model().lm_head.weight.detach()
    ref = _c02_reference(model, snapshot)
    return float((ref - initial).abs().max()) > 1e-4


# --------------------------------------------------------------------------------------------- case-03
# hiyouga/LlamaFactory PR #10779: the (v1) DPO trainer runs its paired comparisons with the model still in training
# mode, so active dropout (the LoRA dropout and the attention dropout of the base model) makes the scores stochastic,
# including the adapter-disabled reference forward of LoRA DPO. The policy and reference log-probs of the same
# sequence then differ by dropout noise alone, and the DPO margin, which should start at exactly 0 when the adapter
# is the identity, is random noise that the optimiser fits. Fix in the PR: disable dropout for DPO (every
# nn.Dropout's p and the numeric dropout attributes used by functional attention set to 0).

_C03_BETA = 0.1


def _disable_dropout(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        for attr in ("attention_dropout", "dropout"):
            if isinstance(getattr(module, attr, None), float):
                setattr(module, attr, 0.0)


def _c03_dpo_margin(model: nn.Module) -> torch.Tensor:
    """DPO margin of each pair; the reference is the same LoRA model with its adapter disabled."""
    with torch.no_grad(), model.disable_adapter():
        ref = _seq_logps(model(input_ids=_C02_IDS).logits, _C02_IDS, _C02_MASK)
    pol = _seq_logps(model(input_ids=_C02_IDS).logits, _C02_IDS, _C02_MASK)
    return (pol[:2] - ref[:2]) - (pol[2:] - ref[2:])


def _c03_build(bug: bool) -> Case:
    """LoRA DPO on a Llama with attention dropout 0.1 and LoRA dropout 0.1, trained in train mode."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    base = LlamaForCausalLM(_llama_config(attention_dropout=0.1))
    cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "v_proj"])
    model = get_peft_model(base, cfg).train()
    if not bug:
        _disable_dropout(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-4)
    step = _sgd_step(model, opt, lambda: -F.logsigmoid(_C03_BETA * _c03_dpo_margin(model)).mean())
    return model, step, _kw(optimizer=opt, inputs=_C02_IDS)


def _c03_proof(bug: bool) -> bool:
    """Before any update the adapter is the identity, yet the margin the DPO loss sees is not 0."""
    model, _, _ = _c03_build(bug)
    torch.manual_seed(1)
    with torch.no_grad():
        margin = _c03_dpo_margin(model)
    return float(margin.abs().max()) > 1e-4


# --------------------------------------------------------------------------------------------- case-04
# Lightning-AI/lit-llama PR #357: finetune/lora.py accumulates gradients over `gradient_accumulation_iters`
# micro-batches (batch_size 128 / micro_batch_size 4 = 32) with `fabric.backward(loss)` on each micro-batch's mean
# loss and steps the optimizer every 32 iterations, without dividing the loss. The update is driven by the sum of 32
# mean-loss gradients, 32 times the gradient of the batch the run is configured for; training runs and the loss
# falls, but the step the optimiser takes (and any gradient clipping or weight-decay balance) is off by that factor.
# Fix in the PR: `fabric.backward(loss / gradient_accumulation_iters)` (plus no_backward_sync, a DDP-only speed-up).
# The tiny run keeps the script's AdamW and micro-batching and leaves out its separate lr warmup.

_C04_ACCUM = 4


def _c04_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Instruction-tuning rows padded right: inputs with 0, targets with -1 (the script's ignore_index)."""
    g = _gen(2404)
    lengths = [12, 9, 11, 7, 12, 10, 8, 12]
    ids = torch.zeros(len(lengths), 12, dtype=torch.long)
    tgt = torch.full((len(lengths), 12), -1, dtype=torch.long)
    for i, n in enumerate(lengths):
        row = torch.randint(3, 40, (n,), generator=g)
        ids[i, :n], tgt[i, :n] = row, row
        tgt[i, :4] = -1  # the prompt is not a target
    return ids, tgt


_C04_IDS, _C04_TGT = _c04_batch()


def _c04_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits, targets = logits[..., :-1, :], targets[..., 1:]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)


def _c04_setup(bug: bool) -> tuple[nn.Module, torch.optim.Optimizer, Callable[[], torch.Tensor]]:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    base = LlamaForCausalLM(_llama_config())
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                            target_modules=["q_proj", "v_proj"])).train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-4)
    micro = _C04_IDS.shape[0] // _C04_ACCUM

    def step() -> torch.Tensor:
        total = torch.zeros(())
        for i in range(_C04_ACCUM):
            x, y = _C04_IDS[i * micro:(i + 1) * micro], _C04_TGT[i * micro:(i + 1) * micro]
            loss = _c04_loss(model(input_ids=x).logits, y)
            (loss if bug else loss / _C04_ACCUM).backward()
            total = total + loss.detach() / _C04_ACCUM
        opt.step()
        opt.zero_grad()
        return total

    return model, opt, step


def _c04_build(bug: bool) -> Case:
    """LoRA instruction tuning of a Llama with gradient accumulation over 4 micro-batches of 2 rows."""
    model, opt, step = _c04_setup(bug)
    return model, step, _kw(optimizer=opt, inputs=_C04_IDS)


def _c04_proof(bug: bool) -> bool:
    """The gradient the optimizer steps on is far larger than the gradient of the accumulated batch's mean loss."""
    model, opt, step = _c04_setup(bug)
    params = [p for p in model.parameters() if p.requires_grad]
    micro = _C04_IDS.shape[0] // _C04_ACCUM
    mean_loss = sum(_c04_loss(model(input_ids=_C04_IDS[i * micro:(i + 1) * micro]).logits,
                              _C04_TGT[i * micro:(i + 1) * micro]) for i in range(_C04_ACCUM)) / _C04_ACCUM
    want = torch.cat([g.reshape(-1) for g in torch.autograd.grad(mean_loss, params)])
    seen: list[torch.Tensor] = []
    handle = opt.register_step_pre_hook(
        lambda *_: seen.append(torch.cat([p.grad.reshape(-1).clone() for p in params if p.grad is not None])))
    step()
    handle.remove()
    return float(seen[0].norm() / want.norm()) > 1.5

# --------------------------------------------------------------------------------------------- case-05
# pytorch/examples issue #1196: the minGPT-ddp trainer's AMP path does `scaler.scale(loss).backward()`, then
# `clip_grad_norm_(model.parameters(), grad_norm_clip)`, then `scaler.step(optimizer)`. The clip runs on the scaled
# gradients (about 65536 times the real ones), so the norm is almost always "too large" and cut to 1.0 in scaled
# units; scaler.step then unscales, and the optimizer sees a gradient of norm about 1/65536 instead of
# min(norm, 1.0). Training runs without error, but the clip threshold means nothing and the gradient the optimizer
# gets is shrunk by the loss scale. Fix in the issue (as in the AMP docs): `scaler.unscale_(optimizer)` before
# clipping. The tiny run uses CPU bf16 autocast and a CPU GradScaler in place of CUDA fp16.

_C05_SEQ = torch.randint(0, 48, (4, 17), generator=_gen(2405))
_C05_X, _C05_Y = _C05_SEQ[:, :-1], _C05_SEQ[:, 1:]
_C05_CLIP = 1.0


def _c05_setup(
    bug: bool,
) -> tuple[nn.Module, torch.optim.Optimizer, torch.amp.GradScaler, Callable[[], torch.Tensor]]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=48, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                       bos_token_id=0, eos_token_id=0)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    scaler = torch.amp.GradScaler("cpu")

    def step() -> torch.Tensor:
        with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
            logits = model(input_ids=_C05_X).logits
            loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), _C05_Y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        if not bug:
            scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), _C05_CLIP)
        scaler.step(opt)
        scaler.update()
        return loss

    return model, opt, scaler, step


def _c05_build(bug: bool) -> Case:
    """minGPT-style pre-training step with AMP autocast, a GradScaler and gradient-norm clipping at 1.0."""
    model, opt, scaler, step = _c05_setup(bug)
    return model, step, _kw(optimizer=opt, inputs=_C05_X, scaler=scaler)


def _c05_proof(bug: bool) -> bool:
    """The gradient the optimizer steps on is far smaller than the clipped real gradient, min(norm, clip)."""
    model, opt, _, step = _c05_setup(bug)
    params = list(model.parameters())
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        logits = model(input_ids=_C05_X).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), _C05_Y.reshape(-1))
    true_norm = float(torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)]).norm())
    seen: list[float] = []
    handle = opt.register_step_pre_hook(
        lambda *_: seen.append(float(torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None]).norm())))
    step()
    handle.remove()
    return seen[0] < 0.1 * min(true_norm, _C05_CLIP)


CASES: list[BlindCase] = [
    BlindCase("b24-case-01", "https://github.com/huggingface/peft/pull/2803", "tied weights under PEFT",
              "modules_to_save gives the tied embedding and LM head separate trainable copies, so the tie breaks and "
              "the two drift apart during training.", _c01_build, _c01_proof),
    BlindCase("b24-case-02", "https://github.com/unslothai/unsloth-zoo/pull/832",
              "DPO reference drifts with the policy",
              "The DPO reference is the live model with LoRA scales set to 0, but the trainable lm_head keeps moving, "
              "so the reference is no longer the frozen initial policy.", _c02_build, _c02_proof,
              known_miss="the DPO reference is the live model with its adapter scaled to 0 while a full lm_head trains: which tensors a reference pass should hold fixed is not measured"),
    BlindCase("b24-case-03", "https://github.com/hiyouga/LlamaFactory/pull/10779",
              "dropout active in preference scoring",
              "DPO runs its policy and adapter-disabled reference forwards in train mode with dropout on, so the "
              "preference margin is dropout noise even when policy and reference are identical.",
              _c03_build, _c03_proof,
              known_miss="the adapter-disabled reference forward runs with dropout on: MODE-002 judges frozen parts, and the reference here is the trained model itself"),
    BlindCase("b24-case-04", "https://github.com/Lightning-AI/lit-llama/pull/357", "gradient accumulation scaling",
              "Each micro-batch's mean loss is back-propagated undivided, so the accumulated gradient is the sum over "
              "the micro-batches, several times the gradient of the configured batch.", _c04_build, _c04_proof,
              known_alarm=("LOOP-005",)),
    BlindCase("b24-case-05", "https://github.com/pytorch/examples/issues/1196", "mixed precision / clipping order",
              "Gradients are clipped while still multiplied by the GradScaler's loss scale, so after unscaling the "
              "optimizer receives a gradient shrunk by that scale instead of the clipped real one.",
              _c05_build, _c05_proof),
]
