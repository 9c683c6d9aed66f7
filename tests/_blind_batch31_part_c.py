"""Blind batch 31 (part c): silent bugs in training integrations and infrastructure, each with its fixed twin.

Collected by someone who does not write the audit's checks. Every case builds the user's setup on a tiny model
(activation checkpointing through torch's ``checkpoint_wrapper``, a BERT classifier from a tiny config, the real
transformers ``Trainer`` with a custom ``compute_loss`` and gradient accumulation over a tiny Llama, a diffusion
training loop with EMA and checkpoint saving, an EMA tracker over a ``torch.compile``-d model; nothing is
downloaded) and proves the bug without the audit on real tensors and real steps.
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.nn.functional as F
from torch import nn

from tests._blind import BlindCase, Case
from tests._blind_batch5 import _gen, _kw, _llama_config

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# --------------------------------------------------------------------------------------------- case-01
# allenai/OLMo-core PR #828 (merged): `TransformerModel.apply_activation_checkpointing` wrapped every block with
# torch's `checkpoint_wrapper(block, preserve_rng_state=False)` (hard-coded, under a "TODO: only preserve RNG state
# if dropout is active"). Once a model with residual dropout was trained with activation checkpointing on, the
# backward recompute of each block drew FRESH dropout masks, so the gradients were taken for a different network
# sample than the loss. Nothing errors (checkpoint's determinism check compares only shapes/dtypes), the loss still
# goes down, just to a clearly worse value (2.49 vs 2.19 CE in the PR's A/B). Fix in the PR: preserve_rng_state=True
# when dropout is active.

_C01_IDS = torch.randint(3, 40, (4, 16), generator=_gen(3101))


class _C01Block(nn.Module):
    """Pre-norm transformer block with residual dropout after attention and after the MLP."""

    def __init__(self, d: int = 32, p: float = 0.1) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.attn_out = nn.Linear(d, d)
        self.feed_forward_norm = nn.LayerNorm(d)
        self.ff_in = nn.Linear(d, 2 * d)
        self.ff_out = nn.Linear(2 * d, d)
        self.dropout = nn.Dropout(p)
        self.n_heads = 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.attention_norm(x)).chunk(3, dim=-1)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.dropout(self.attn_out(a))
        return x + self.dropout(self.ff_out(F.gelu(self.ff_in(self.feed_forward_norm(x)))))


class _C01LM(nn.Module):
    def __init__(self, vocab: int = 40, d: int = 32, n_layers: int = 2) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleDict({str(i): _C01Block(d) for i in range(n_layers)})
        self.norm = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embeddings(ids)
        for block in self.blocks.values():
            h = block(h)
        return self.lm_head(self.norm(h))

    def apply_activation_checkpointing(self, preserve_rng_state: bool) -> None:
        """Full activation checkpointing as OLMo-core applies it: each block wrapped in torch's checkpoint_wrapper."""
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            checkpoint_wrapper as ptd_checkpoint_wrapper,
        )

        for block_idx, block in enumerate(list(self.blocks.values())):
            block = ptd_checkpoint_wrapper(block, preserve_rng_state=preserve_rng_state)
            self.blocks.register_module(str(block_idx), block)


def _c01_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids)
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))


def _c01_model(bug: bool, checkpointed: bool = True) -> _C01LM:
    torch.manual_seed(0)
    model = _C01LM().train()
    if checkpointed:
        # the bug: preserve_rng_state hard-coded False; the fix: True because the model has dropout
        model.apply_activation_checkpointing(preserve_rng_state=not bug)
    return model


def _c01_build(bug: bool) -> Case:
    """Tiny dropout LM trained with full activation checkpointing (every block checkpoint-wrapped)."""
    model = _c01_model(bug)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)

    def step() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = _c01_loss(model, _C01_IDS)
        loss.backward()
        opt.step()
        return loss.detach()

    return model, step, _kw(optimizer=opt, inputs=_C01_IDS)


def _c01_proof(bug: bool) -> bool:
    """The checkpointed gradient differs from the gradient of the very forward pass (same seed) the loss came from."""
    ref = _c01_model(bug, checkpointed=False)
    ckpt = _c01_model(bug)
    grads = []
    for model in (ref, ckpt):
        torch.manual_seed(123)  # the same dropout masks for the forward pass of both
        _c01_loss(model, _C01_IDS).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    rel = ((grads[0] - grads[1]).norm() / grads[0].norm()).item()
    return rel > 1e-3


# --------------------------------------------------------------------------------------------- case-02
# namisan/mt-dnn PR #37 (merged, "bug fixing for seperating no_decay variables"): the optimizer groups were built with
# `no_decay = ['bias', 'gamma', 'beta', 'LayerNorm.bias', 'LayerNorm.weight']` and
# `[p for n, p in named_parameters() if n not in no_decay]` / `if n in no_decay`. The names are full dotted paths
# ("bert.encoder.layer.0.attention.output.LayerNorm.weight"), so the exact-membership test never matches: the
# no-decay group is empty and every bias and LayerNorm gain is weight-decayed. Training runs normally; the norms are
# quietly pulled towards zero. Fix in the PR: substring matching, `not any(nd in n for nd in no_decay)`.
# (MT-DNN's BertAdam took 'weight_decay_rate'; torch's AdamW takes 'weight_decay'.)

_C02_IDS = torch.randint(3, 40, (4, 12), generator=_gen(3102))
_C02_Y = torch.tensor([0, 1, 1, 0])


def _c02_groups(model: nn.Module, bug: bool) -> list[dict]:
    no_decay = ["bias", "gamma", "beta", "LayerNorm.bias", "LayerNorm.weight"]
    named = list(model.named_parameters())
    if bug:
        return [
            {"params": [p for n, p in named if n not in no_decay], "weight_decay": 0.01},
            {"params": [p for n, p in named if n in no_decay], "weight_decay": 0.0},
        ]
    return [
        {"params": [p for n, p in named if not any(nd in n for nd in no_decay)], "weight_decay": 0.01},
        {"params": [p for n, p in named if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ]


def _c02_model_opt(bug: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=32, num_labels=2)
    model = BertForSequenceClassification(cfg).train()
    opt = torch.optim.AdamW(_c02_groups(model, bug), lr=1e-3)
    return model, opt


def _c02_build(bug: bool) -> Case:
    """Tiny BERT classifier (MT-DNN's encoder) with the decay / no-decay parameter groups built by name."""
    model, opt = _c02_model_opt(bug)
    batch = {"input_ids": _C02_IDS, "attention_mask": torch.ones_like(_C02_IDS), "labels": _C02_Y}

    def step() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        return loss.detach()

    return model, step, _kw(optimizer=opt, inputs=batch)


def _c02_proof(bug: bool) -> bool:
    """With every gradient zeroed, an AdamW step still shrinks the LayerNorm gains: they sit in the decayed group."""
    model, opt = _c02_model_opt(bug)
    ln = dict(model.named_parameters())["bert.embeddings.LayerNorm.weight"]
    before = ln.detach().clone()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    return bool((ln.detach() < before).all())


# --------------------------------------------------------------------------------------------- case-03
# MakazhanAlpamys/Soup issue #720 (closed): the distillation trainer subclasses transformers' `Trainer` and overrides
# `compute_loss(model, inputs, return_outputs=False, num_items_in_batch=None)`, averaging CE and KD inside each
# micro-batch and ignoring `num_items_in_batch`, without setting `model_accepts_loss_kwargs = False`. The student
# (a causal LM whose forward takes **kwargs) makes the Trainer count `num_items_in_batch` from the labels and then
# treat the returned loss as already normalised over the whole accumulated batch, so it skips its division by the
# number of accumulation steps: the accumulated gradient is gradient_accumulation_steps times the effective batch's
# gradient (the issue measures 4.0x with 4 micro-batches). Nothing warns; the run just behaves like a larger lr.
# Fix named in the issue (the Trainer docstring's rule): set `self.model_accepts_loss_kwargs = False` in the
# subclass (or normalise by num_items_in_batch).

_C03_IDS = torch.randint(3, 40, (8, 12), generator=_gen(3103))
_C03_GA = 4


def _c03_trainer(bug: bool):
    from transformers import LlamaForCausalLM, Trainer, TrainingArguments

    class _DistillTrainer(Trainer):
        def __init__(self, *args, teacher: nn.Module, alpha: float = 0.5, temperature: float = 2.0, **kwargs):
            super().__init__(*args, **kwargs)
            self.teacher = teacher.eval()
            self.alpha = alpha
            self.temperature = temperature
            if not bug:
                self.model_accepts_loss_kwargs = False  # the fix: the loss below is a per-micro-batch mean

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            labels = inputs["labels"]
            out = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
            with torch.no_grad():
                t_logits = self.teacher(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
            s = out.logits[:, :-1]
            ce = F.cross_entropy(s.reshape(-1, s.size(-1)), labels[:, 1:].reshape(-1), ignore_index=-100)
            tmp = self.temperature
            kd = F.kl_div(F.log_softmax(s / tmp, -1), F.softmax(t_logits[:, :-1] / tmp, -1),
                          reduction="batchmean") * tmp * tmp
            loss = self.alpha * ce + (1 - self.alpha) * kd
            return (loss, out) if return_outputs else loss

    torch.manual_seed(0)
    student = LlamaForCausalLM(_llama_config()).train()
    torch.manual_seed(1)
    teacher = LlamaForCausalLM(_llama_config())
    for p in teacher.parameters():
        p.requires_grad_(False)
    opt = torch.optim.AdamW(student.parameters(), lr=1e-3)
    args = TrainingArguments(output_dir=tempfile.mkdtemp(prefix="b31c03_"), per_device_train_batch_size=2,
                             gradient_accumulation_steps=_C03_GA, learning_rate=1e-3, report_to="none",
                             use_cpu=True, save_strategy="no", disable_tqdm=True)
    trainer = _DistillTrainer(model=student, args=args, teacher=teacher, optimizers=(opt, None))
    return trainer, student, opt


def _c03_micro_batches() -> list[dict[str, torch.Tensor]]:
    return [{"input_ids": _C03_IDS[i:i + 2], "attention_mask": torch.ones_like(_C03_IDS[i:i + 2]),
             "labels": _C03_IDS[i:i + 2].clone()} for i in range(0, 8, 2)]


def _c03_update(trainer, model: nn.Module) -> None:
    """One optimizer update's forward/backward passes, as Trainer's inner loop runs them."""
    batch_samples, num_items_in_batch = trainer.get_batch_samples(iter(_c03_micro_batches()), _C03_GA,
                                                                  trainer.args.device)
    trainer.current_gradient_accumulation_steps = len(batch_samples)
    for inputs in batch_samples:
        trainer.training_step(model, inputs, num_items_in_batch)


def _c03_build(bug: bool) -> Case:
    """Distillation Trainer (custom compute_loss) over a tiny Llama student/teacher, 4 micro-batches per update."""
    trainer, model, opt = _c03_trainer(bug)
    batch = {"input_ids": _C03_IDS, "attention_mask": torch.ones_like(_C03_IDS), "labels": _C03_IDS.clone()}

    def step() -> None:
        _c03_update(trainer, model)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return model, step, _kw(optimizer=opt, inputs=batch)


def _c03_proof(bug: bool) -> bool:
    """The accumulated gradient is several times the gradient of the same loss over the full effective batch."""
    trainer, model, _ = _c03_trainer(bug)
    _c03_update(trainer, model)
    acc = torch.cat([p.grad.flatten() for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    full = {"input_ids": _C03_IDS, "attention_mask": torch.ones_like(_C03_IDS), "labels": _C03_IDS.clone()}
    trainer.compute_loss(model, full).backward()
    ref = torch.cat([p.grad.flatten() for p in model.parameters()])
    return (acc.norm() / ref.norm()).item() > 1.5


# --------------------------------------------------------------------------------------------- case-04
# harubaru/waifu-diffusion PR #31 (merged, "Restore non-EMA weights after saving checkpoint"): in
# diffusers_trainer.py, `save_checkpoint()` did `ema_unet.copy_to(unet.parameters())` so the saved pipeline held the
# EMA weights, but never put the trained weights back. From every save on, training continued from the EMA
# weights: each `save_steps` the optimizer's progress since the EMA was silently thrown away (and the optimizer's
# moments no longer match the weights). The loss keeps going down, only slower and dependent on save_steps. Fix in
# the PR: `ema_unet.store(...)` before `copy_to`, `ema_unet.restore(...)` after saving (CompVis LitEma store/restore).
# Reproduced with save_steps=1 so the one step shown includes a save; the EMA's decay warm-up is written without
# the original's mutation of `self.decay`, identical on both sides.

_C04_X0 = torch.randn(8, 16, generator=_gen(3104))


class _C04EMAModel:
    """EMA of model weights as in the trainer (adapted from torch-ema), with the fix's store/restore."""

    def __init__(self, parameters, decay: float = 0.9999) -> None:
        self.shadow_params = [p.clone().detach() for p in parameters]
        self.max_decay = decay
        self.optimization_step = 0
        self.collected_params: list[torch.Tensor] = []

    def get_decay(self, optimization_step: int) -> float:
        value = (1 + optimization_step) / (10 + optimization_step)
        return 1 - min(self.max_decay, value)

    @torch.no_grad()
    def step(self, parameters) -> None:
        self.optimization_step += 1
        decay = self.get_decay(self.optimization_step)
        for s_param, param in zip(self.shadow_params, list(parameters)):
            if param.requires_grad:
                s_param.sub_(decay * (s_param - param))
            else:
                s_param.copy_(param)

    def copy_to(self, parameters) -> None:
        for s_param, param in zip(self.shadow_params, list(parameters)):
            param.data.copy_(s_param.data)

    def store(self, parameters) -> None:
        self.collected_params = [param.clone() for param in parameters]

    def restore(self, parameters) -> None:
        for c_param, param in zip(self.collected_params, parameters):
            param.data.copy_(c_param.data)
        self.collected_params = []


class _C04Denoiser(nn.Module):
    """Tiny noise-prediction net standing in for the UNet: noisy latent plus a timestep embedding."""

    def __init__(self, d: int = 16, h: int = 64, n_t: int = 100) -> None:
        super().__init__()
        self.t_emb = nn.Embedding(n_t, h)
        self.inp = nn.Linear(d, h)
        self.mid = nn.Linear(h, h)
        self.out = nn.Linear(h, d)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.inp(x) + self.t_emb(t))
        return self.out(F.silu(self.mid(h)))


def _c04_setup(bug: bool):
    torch.manual_seed(0)
    unet = _C04Denoiser().train()
    optimizer = torch.optim.AdamW(unet.parameters(), lr=5e-3)
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)  # "constant" schedule
    scaler = torch.amp.GradScaler("cpu", enabled=False)  # --fp16 off on this machine
    ema_unet = _C04EMAModel(unet.parameters())
    alphas = torch.linspace(0.999, 0.01, 100)
    out_dir = tempfile.mkdtemp(prefix="b31c04_")
    state = {"global_step": 0}
    save_steps = 1
    gen = _gen(31040)

    def save_checkpoint(global_step: int) -> None:
        if not bug:
            ema_unet.store(unet.parameters())
        ema_unet.copy_to(unet.parameters())
        torch.save(unet.state_dict(), os.path.join(out_dir, f"unet_{global_step}.pt"))
        if not bug:
            ema_unet.restore(unet.parameters())

    def step() -> torch.Tensor:
        latents = _C04_X0
        noise = torch.randn(latents.shape, generator=gen)
        timesteps = torch.randint(0, 100, (latents.shape[0],), generator=gen)
        a = alphas[timesteps].unsqueeze(-1)
        noisy_latents = a.sqrt() * latents + (1 - a).sqrt() * noise
        noise_pred = unet(noisy_latents, timesteps)
        loss = F.mse_loss(noise_pred.float(), noise.float(), reduction="mean")
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        lr_scheduler.step()
        optimizer.zero_grad()
        ema_unet.step(unet.parameters())
        state["global_step"] += 1
        if state["global_step"] % save_steps == 0:
            save_checkpoint(state["global_step"])
        return loss.detach()

    return unet, optimizer, lr_scheduler, scaler, ema_unet, step


def _c04_build(bug: bool) -> Case:
    """Diffusion denoiser loop with EMA and a checkpoint save every save_steps."""
    unet, optimizer, lr_scheduler, scaler, _, step = _c04_setup(bug)
    return unet, step, _kw(optimizer=optimizer, inputs=_C04_X0, lr_scheduler=lr_scheduler, scaler=scaler)


def _c04_proof(bug: bool) -> bool:
    """After steps that saved, the live weights training continues from are the EMA weights, not the trained ones."""
    unet, _, _, _, ema_unet, step = _c04_setup(bug)
    for _ in range(3):
        step()
    return all(torch.equal(p.detach(), s) for p, s in zip(unet.parameters(), ema_unet.shadow_params))


# --------------------------------------------------------------------------------------------- case-05
# wandb/senpai PR #2899 (merged; the fix reported in the PR thread): the model is wrapped with `torch.compile`,
# which returns an `OptimizedModule` whose `named_parameters()` carry an `_orig_mod.` prefix. The EMA keeps its
# shadow weights in a dict keyed by the original (uncompiled) names and updates only names it knows, so
# `ema.update(compiled_model)` silently skipped every parameter: the shadow never moved from its initial weights and
# the EMA evaluations stayed frozen while training went on. Fix in the PR: a `_clean()` that strips the `_orig_mod.`
# prefix in every EMA method. (backend="eager" here keeps the compile fast on CPU; the wrapper and its parameter
# names are the same with inductor.)

_C05_X = torch.randn(8, 12, generator=_gen(3105))
_C05_Y = torch.randn(8, 3, generator=_gen(3106))


class _C05EMA:
    """Name-keyed EMA of a model's trainable parameters."""

    def __init__(self, model: nn.Module, decay: float, strip_compile_prefix: bool) -> None:
        self.decay = decay
        self.strip = strip_compile_prefix
        self.shadow = {self._clean(n): p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

    def _clean(self, name: str) -> str:
        return name.removeprefix("_orig_mod.") if self.strip else name

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        for name, p in model.named_parameters():
            name = self._clean(name)
            if name in self.shadow:
                self.shadow[name].mul_(self.decay).add_(p.detach(), alpha=1 - self.decay)


def _c05_setup(bug: bool):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(12, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 3))
    ema = _C05EMA(net, decay=0.9, strip_compile_prefix=not bug)  # built from the model before compiling
    model = torch.compile(net, backend="eager")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(_C05_X), _C05_Y)
        loss.backward()
        opt.step()
        ema.update(model)
        return loss.detach()

    return net, model, opt, ema, step


def _c05_build(bug: bool) -> Case:
    """Surrogate MLP compiled with torch.compile, trained with an EMA updated after every optimizer step."""
    _, model, opt, _, step = _c05_setup(bug)
    return model, step, _kw(optimizer=opt, inputs=_C05_X)


def _c05_proof(bug: bool) -> bool:
    """After real training steps the EMA shadow is still exactly the initial weights."""
    net, _, _, ema, step = _c05_setup(bug)
    init = {n: p.detach().clone() for n, p in net.named_parameters()}
    for _ in range(3):
        step()
    moved = any(not torch.equal(p, init[n]) for n, p in net.named_parameters())
    return moved and all(torch.equal(ema.shadow[n], init[n]) for n in init)


CASES: list[BlindCase] = [
    BlindCase("b31c-01", "https://github.com/allenai/OLMo-core/pull/828", "checkpoint recompute redraws dropout",
              "Activation checkpointing with preserve_rng_state=False on a model with dropout recomputes each block "
              "with fresh dropout masks, so the gradients belong to a different network sample than the loss.",
              _c01_build, _c01_proof,
              known_miss="a checkpoint recompute that redraws dropout: the recomputed forward's masks against the first are not compared"),
    BlindCase("b31c-02", "https://github.com/namisan/mt-dnn/pull/37", "weight decay on norms and biases",
              "The no-decay group is selected by exact name membership against short suffixes, so it is empty and "
              "every bias and LayerNorm gain is weight-decayed.", _c02_build, _c02_proof),
    BlindCase("b31c-03", "https://github.com/MakazhanAlpamys/Soup/issues/720", "gradient accumulation loss scaling",
              "A Trainer subclass's compute_loss returns a per-micro-batch mean while the Trainer believes it is "
              "normalised by num_items_in_batch, so the accumulated gradient is gradient_accumulation_steps times too "
              "large.", _c03_build, _c03_proof),
    BlindCase("b31c-04", "https://github.com/harubaru/waifu-diffusion/pull/31", "EMA weights overwrite trained weights",
              "Saving a checkpoint copies the EMA weights into the live model and never restores the trained "
              "weights, so training silently resumes from the EMA weights after every save.", _c04_build, _c04_proof,
              known_miss="an EMA copied into the trained weights at a save and never restored: what the step writes into the trained weights after their optimizer step is not judged"),
    BlindCase("b31c-05", "https://github.com/wandb/senpai/pull/2899", "EMA skipped under torch.compile",
              "The name-keyed EMA does not recognise the compiled module's _orig_mod. parameter names, so every "
              "update silently skips all parameters and the EMA stays at the initial weights.",
              _c05_build, _c05_proof,
              known_miss="an EMA update skipped under torch.compile: the copy's update is not followed through a compiled module"),
]
