"""Blind batch 1: silent training bugs from public GitHub issue and pull-request threads.

Collected and reproduced by someone who does not write the audit's checks. Each case builds the bug and the
fixed twin from its thread on a tiny model (real transformers models from configs in code, real optimizers
and schedulers, nothing from a hub) and proves the bug without the audit on real steps.
"""

from __future__ import annotations

import inspect
from collections import OrderedDict
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from guardtower.preflight import audit
from tests._blind import BlindCase, Case

_AUDIT_PARAMS = set(inspect.signature(audit).parameters)


def _kw(**kwargs: Any) -> dict[str, Any]:
    """What the user passes to audit(); a name this audit does not accept yet (``total_steps``) is left out."""
    return {k: v for k, v in kwargs.items() if k in _AUDIT_PARAMS}


def _mlp(d_in: int = 8, d_out: int = 3, hidden: int = 16) -> nn.Module:
    return nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, d_out))


def _batch(n: int, d: int, classes: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g), torch.randint(0, classes, (n,), generator=g)


def _snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def _moved(before: dict[str, torch.Tensor], module: nn.Module) -> bool:
    return any(not torch.equal(before[n], p.detach()) for n, p in module.named_parameters())


# --------------------------------------------------------------------------------------------------------------
# clip-before-unscale: https://github.com/milesial/Pytorch-UNet/issues/468
# clip_grad_norm_ runs on the GradScaler-scaled gradients, so they are clipped to max_norm * 1/scale.

def _clip_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    x, y = _batch(32, 16, 4, seed=0)

    def step() -> torch.Tensor:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x).float(), y)
        scaler.scale(loss).backward()
        if not bug:
            scaler.unscale_(opt)
        nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        scaler.step(opt)
        scaler.update()
        return loss

    return model, step, _kw(optimizer=opt, inputs=x, scaler=scaler)


def _clip_proof(bug: bool) -> bool:
    model, step, kw = _clip_build(bug)
    x, y = _batch(32, 16, 4, seed=0)
    with torch.autocast("cpu", dtype=torch.float16):
        F.cross_entropy(model(x).float(), y).backward()
    g = float(torch.sqrt(sum((p.grad ** 2).sum() for p in model.parameters())))  # the true gradient norm
    model.zero_grad()
    before = _snapshot(model)
    step()
    update = float(torch.sqrt(sum(((p.detach() - before[n]) ** 2).sum() for n, p in model.named_parameters())))
    lr = kw["optimizer"].param_groups[0]["lr"]
    return update < 0.01 * lr * min(g, 1.0)  # SGD: the update should be lr * the clipped gradient


# --------------------------------------------------------------------------------------------------------------
# frozen-backbone-bn-stats: https://github.com/lightly-ai/lightly/issues/1438
# deactivate_requires_grad freezes the backbone's parameters, but its BatchNorm stays in train mode and its
# running statistics keep moving with every batch.

def _bn_build(bug: bool) -> Case:
    torch.manual_seed(1)
    backbone = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten())
    head = nn.Linear(8, 5)
    model = nn.Sequential(OrderedDict(backbone=backbone, head=head))
    for p in backbone.parameters():  # lightly.models.utils.deactivate_requires_grad
        p.requires_grad = False
    model.train()
    if not bug:
        backbone.eval()  # the fix from the thread: frozen backbone's BatchNorm in eval mode
    opt = torch.optim.SGD(head.parameters(), lr=0.05, momentum=0.9)
    x, y = torch.randn(16, 3, 16, 16) * 2 + 1, torch.randint(0, 5, (16,))
    return model, lambda: F.cross_entropy(model(x), y), _kw(optimizer=opt, inputs=x)


def _bn_proof(bug: bool) -> bool:
    model, step, _ = _bn_build(bug)
    bn = model.backbone[1]
    before = bn.running_mean.clone(), bn.running_var.clone()
    step()
    return not (torch.equal(before[0], bn.running_mean) and torch.equal(before[1], bn.running_var))


# --------------------------------------------------------------------------------------------------------------
# frozen-text-encoder-dropout: https://github.com/nickgkan/butd_detr/issues/8
# the text encoder is frozen with requires_grad=False but left in train mode, so its dropout makes the frozen
# features random in every step.

class _Grounder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from transformers import BertConfig, BertModel
        cfg = BertConfig(vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.1,
                         attention_probs_dropout_prob=0.1)
        self.text_encoder = BertModel(cfg, add_pooling_layer=False)
        self.head = nn.Linear(32, 3)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        feats = self.text_encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.head(feats[:, 0])


def _text_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(5, 60, (6, 10), generator=g)
    mask = torch.ones_like(ids)
    ids[3:, 7:], mask[3:, 7:] = 0, 0
    return {"input_ids": ids, "attention_mask": mask}


def _dropout_build(bug: bool) -> Case:
    torch.manual_seed(2)
    model = _Grounder()
    for p in model.text_encoder.parameters():
        p.requires_grad = False
    model.train()
    if not bug:
        model.text_encoder.eval()
    opt = torch.optim.AdamW(model.head.parameters(), lr=1e-3)
    batch, y = _text_batch(), torch.tensor([0, 1, 2, 0, 1, 2])
    return model, lambda: F.cross_entropy(model(**batch), y), _kw(optimizer=opt, inputs=batch)


def _dropout_proof(bug: bool) -> bool:
    model, _, kw = _dropout_build(bug)
    batch = kw["inputs"]
    with torch.no_grad():
        torch.manual_seed(10)
        a = model.text_encoder(**batch).last_hidden_state
        torch.manual_seed(11)
        b = model.text_encoder(**batch).last_hidden_state
    return not torch.equal(a, b)


# --------------------------------------------------------------------------------------------------------------
# left-pad-gpt2-no-position-ids: https://github.com/huggingface/trl/issues/469
# left-padded batches go to GPT-2 (absolute position embeddings) without position_ids, so every padded row's
# real tokens are trained at positions shifted by its pad count.

_GPT2_PAD = 49


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50, n_positions=32, bos_token_id=_GPT2_PAD,
                     eos_token_id=_GPT2_PAD, pad_token_id=_GPT2_PAD)
    return GPT2LMHeadModel(cfg)


def _left_padded() -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 49, (n,), generator=g) for n in (8, 6, 4)]
    ids = torch.full((3, 8), _GPT2_PAD)
    mask = torch.zeros(3, 8, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, 8 - len(s):], mask[i, 8 - len(s):] = s, 1
    labels = ids.masked_fill(mask == 0, -100)
    return seqs, {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _gpt2_kwargs(batch: dict[str, torch.Tensor], bug: bool) -> dict[str, torch.Tensor]:
    if bug:
        return batch
    return {**batch, "position_ids": (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)}


def _leftpad_build(bug: bool) -> Case:
    torch.manual_seed(3)
    model = _gpt2()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _, batch = _left_padded()
    kwargs = _gpt2_kwargs(batch, bug)
    return model, lambda: model(**kwargs), _kw(optimizer=opt, inputs=kwargs)


def _leftpad_proof(bug: bool) -> bool:
    model, _, _ = _leftpad_build(bug)
    model.eval()
    seqs, batch = _left_padded()
    kwargs = {k: v for k, v in _gpt2_kwargs(batch, bug).items() if k != "labels"}
    with torch.no_grad():
        padded = model(**kwargs).logits[2, 8 - len(seqs[2]):]
        alone = model(input_ids=seqs[2][None]).logits[0]
    return not torch.allclose(padded, alone, atol=1e-5)


# --------------------------------------------------------------------------------------------------------------
# config-pad-id-mismatch: https://github.com/ymcui/Chinese-LLaMA-Alpaca-2/issues/160
# config.pad_token_id says 0 while the tokenizer pads with another id, so LlamaForSequenceClassification
# classifies every padded row from a padding position instead of its last real token.

_LLAMA_PAD = 99


def _seqcls_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(1, 99, (4, 8), generator=g)
    mask = torch.ones_like(ids)
    for i, n in enumerate((8, 5, 3, 6)):
        ids[i, n:], mask[i, n:] = _LLAMA_PAD, 0
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([0, 1, 1, 0])}


def _padid_build(bug: bool) -> Case:
    from transformers import LlamaConfig, LlamaForSequenceClassification
    torch.manual_seed(4)
    cfg = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32, num_labels=2,
                      pad_token_id=0 if bug else _LLAMA_PAD, bos_token_id=1, eos_token_id=2)
    model = LlamaForSequenceClassification(cfg)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = _seqcls_batch()
    return model, lambda: model(**batch), _kw(optimizer=opt, inputs=batch)


def _padid_proof(bug: bool) -> bool:
    model, step, kw = _padid_build(bug)
    kept: list[torch.Tensor] = []

    def hook(_m: nn.Module, _a: Any, out: Any) -> None:
        h = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        h.retain_grad()
        kept.append(h)

    handle = model.model.register_forward_hook(hook)
    step().loss.backward()
    handle.remove()
    grad = kept[0].grad.abs().sum(-1)  # (batch, seq): which positions the classifier read
    pad = kw["inputs"]["attention_mask"] == 0
    return bool((grad[pad] > 0).any())


# --------------------------------------------------------------------------------------------------------------
# freeze-overwritten: https://github.com/ultralytics/yolov5/issues/1213
# the freeze loop sets requires_grad=False, then the optimizer-group loop sets requires_grad=True on every
# parameter, so the "frozen" layers train.

def _conv(c_in: int, c_out: int) -> nn.Module:
    return nn.Sequential(OrderedDict(conv=nn.Conv2d(c_in, c_out, 3, padding=1, bias=False),
                                     bn=nn.BatchNorm2d(c_out), act=nn.SiLU()))


def _yolo_build(bug: bool) -> Case:
    torch.manual_seed(5)
    model = nn.Sequential(OrderedDict(m0=_conv(3, 8), m1=_conv(8, 8), head=nn.Conv2d(8, 5, 1)))
    freeze = ["m0."]
    for k, v in model.named_parameters():
        if any(f in k for f in freeze):
            v.requires_grad = False
    pg0, pg1, pg2 = [], [], []
    for k, v in model.named_parameters():
        if bug:
            v.requires_grad = True  # train.py line 97 in the thread
        if ".bias" in k:
            pg2.append(v)
        elif ".weight" in k and ".bn" not in k:
            pg1.append(v)
        else:
            pg0.append(v)
    opt = torch.optim.SGD(pg0, lr=0.01, momentum=0.937, nesterov=True)
    opt.add_param_group({"params": pg1, "weight_decay": 5e-4})
    opt.add_param_group({"params": pg2})
    model.train()
    x, y = torch.randn(8, 3, 16, 16), torch.randint(0, 5, (8,))
    return model, lambda: F.cross_entropy(model(x).mean((2, 3)), y), _kw(optimizer=opt, inputs=x)


def _yolo_proof(bug: bool) -> bool:
    model, step, kw = _yolo_build(bug)
    opt = kw["optimizer"]
    before = _snapshot(model.m0)
    for _ in range(2):
        opt.zero_grad()
        step().backward()
        opt.step()
    return _moved(before, model.m0)


# --------------------------------------------------------------------------------------------------------------
# no-grad-backbone-decayed: https://github.com/open-mmlab/OpenPCDet/issues/845
# the backbone is "frozen" by running it under torch.no_grad(), but the adam_onecycle wrapper applies its true
# weight decay to every parameter that has requires_grad=True, so the frozen weights shrink every step.

class _TrueWDAdam(torch.optim.Adam):
    """OpenPCDet's OptimWrapper(true_wd=True) around Adam: decoupled decay, skipping requires_grad=False."""

    def __init__(self, params: Any, lr: float, wd: float) -> None:
        super().__init__(params, lr=lr, weight_decay=0.0)
        self.true_wd = wd

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad is False:  # the fix referenced in the thread
                    continue
                p.mul_(1 - self.true_wd * group["lr"])
        return super().step(closure)


class _Detector(nn.Module):
    def __init__(self, no_grad_backbone: bool) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16))
        self.head = nn.Linear(16, 3)
        self.no_grad_backbone = no_grad_backbone

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.no_grad_backbone:
            with torch.no_grad():
                feats = self.backbone(x)
        else:
            feats = self.backbone(x)
        return self.head(feats)


def _nograd_build(bug: bool) -> Case:
    torch.manual_seed(6)
    model = _Detector(no_grad_backbone=bug)
    if not bug:
        model.backbone.requires_grad_(False)
    opt = _TrueWDAdam(model.parameters(), lr=3e-3, wd=0.01)
    x, y = _batch(16, 8, 3, seed=6)
    return model, lambda: F.cross_entropy(model(x), y), _kw(optimizer=opt, inputs=x)


def _nograd_proof(bug: bool) -> bool:
    model, step, kw = _nograd_build(bug)
    opt = kw["optimizer"]
    before = _snapshot(model.backbone)
    opt.zero_grad()
    step().backward()
    opt.step()
    return _moved(before, model.backbone)


# --------------------------------------------------------------------------------------------------------------
# textual-inversion-adamw-decay: https://github.com/huggingface/diffusers/issues/1176
# textual inversion zeroes the gradient of every token row but the new one, yet AdamW's decoupled weight decay
# still shrinks all the frozen word embeddings each step.

_PLACEHOLDER = 49


class _TextualInversion(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from transformers import CLIPTextConfig, CLIPTextModel
        cfg = CLIPTextConfig(vocab_size=50, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                             num_attention_heads=2, max_position_embeddings=16, pad_token_id=1,
                             bos_token_id=0, eos_token_id=2)
        self.text_encoder = CLIPTextModel(cfg)
        self.unet = nn.Linear(32, 32)  # frozen stand-in for the denoiser reading the text condition

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.unet(self.text_encoder(input_ids=input_ids).last_hidden_state.mean(1))


def _ti_build(bug: bool) -> Case:
    torch.manual_seed(7)
    model = _TextualInversion()
    te = model.text_encoder  # text_model.* in older transformers
    model.unet.requires_grad_(False)
    te.encoder.requires_grad_(False)
    te.final_layer_norm.requires_grad_(False)
    te.embeddings.position_embedding.requires_grad_(False)
    emb = model.text_encoder.get_input_embeddings()
    opt = torch.optim.AdamW(emb.parameters(), lr=5e-3, weight_decay=1e-2)
    orig = emb.weight.detach().clone()
    keep = torch.arange(emb.num_embeddings) != _PLACEHOLDER
    ids = torch.tensor([[0, 5, _PLACEHOLDER, 7, 2], [0, 9, _PLACEHOLDER, 11, 2]])
    target = torch.randn(2, 32)
    model.train()

    def step() -> torch.Tensor:
        loss = F.mse_loss(model(ids), target)
        loss.backward()
        if bug:  # the script at the time: zero the gradient of every row but the placeholder's
            emb.weight.grad[keep] = 0
        opt.step()
        opt.zero_grad()
        if not bug:  # the fix (diffusers#1665): put the original embeddings back after the step
            with torch.no_grad():
                emb.weight[keep] = orig[keep]
        return loss

    return model, step, _kw(optimizer=opt, inputs=ids)


def _ti_proof(bug: bool) -> bool:
    model, step, _ = _ti_build(bug)
    w = model.text_encoder.get_input_embeddings().weight
    before = w.detach().clone()
    for _ in range(3):
        step()
    keep = torch.arange(w.shape[0]) != _PLACEHOLDER
    return not torch.equal(before[keep], w.detach()[keep])


# --------------------------------------------------------------------------------------------------------------
# onecycle-stepped-per-epoch: https://github.com/CodefyUI/CodefyUI/issues/297
# a OneCycleLR(total_steps=1500) is stepped once per epoch by the training loop in a one-epoch, 1500-step run,
# so the run never leaves the schedule's starting lr (max_lr / 25).

_ONECYCLE_STEPS = 1500


def _onecycle_build(bug: bool) -> Case:
    torch.manual_seed(8)
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=_ONECYCLE_STEPS)
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if not bug:  # the fix: step the per-step schedule after every optimizer step
            sched.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=x, lr_scheduler=sched, total_steps=_ONECYCLE_STEPS)


def _onecycle_proof(bug: bool) -> bool:
    _, _, kw = _onecycle_build(bug)
    opt = kw["optimizer"]
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=_ONECYCLE_STEPS)
    used = []
    for _ in range(_ONECYCLE_STEPS):  # one epoch of 1500 batches, the lr each optimizer step uses
        used.append(opt.param_groups[0]["lr"])
        opt.step()
        if not bug:
            sched.step()
    if bug:
        sched.step()  # the loop's once-per-epoch step
    return max(used) < 0.5 * 1e-3


# --------------------------------------------------------------------------------------------------------------
# scheduler-stepped-per-microbatch: https://github.com/starVLA/starVLA/pull/210
# with gradient accumulation the scheduler is stepped on every micro-batch, so the cosine schedule built for
# the number of optimizer steps reaches zero half-way through the run.

_ACC_STEPS = 100


def _microbatch_build(bug: bool) -> Case:
    from transformers import get_cosine_schedule_with_warmup
    torch.manual_seed(9)
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = get_cosine_schedule_with_warmup(opt, num_warmup_steps=10, num_training_steps=_ACC_STEPS)
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    micro = list(zip(x.chunk(2), y.chunk(2)))

    def step() -> torch.Tensor:
        opt.zero_grad()
        for xb, yb in micro:
            loss = F.cross_entropy(model(xb), yb) / len(micro)
            loss.backward()
            if bug:
                sched.step()
        opt.step()
        if not bug:  # the fix: step only when the optimizer stepped (accelerator.sync_gradients)
            sched.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=x, lr_scheduler=sched, total_steps=_ACC_STEPS)


def _microbatch_proof(bug: bool) -> bool:
    from transformers import get_cosine_schedule_with_warmup
    opt = torch.optim.AdamW(_mlp().parameters(), lr=1e-3)
    sched = get_cosine_schedule_with_warmup(opt, num_warmup_steps=10, num_training_steps=_ACC_STEPS)
    used = []
    for _ in range(_ACC_STEPS):
        used.append(opt.param_groups[0]["lr"])
        opt.step()
        for _ in range(2 if bug else 1):
            sched.step()
    # the schedule's end: the first step after warmup whose lr is ~0 (the cosine rises again past its end)
    first_zero = next((i for i, lr in enumerate(used) if i > 10 and lr < 0.01 * 1e-3), _ACC_STEPS)
    return first_zero < 0.6 * _ACC_STEPS


# --------------------------------------------------------------------------------------------------------------
# schedule-stretched-by-accumulation: https://github.com/huggingface/diffusers/issues/4387
# warmup and length are multiplied by gradient_accumulation_steps although the scheduler steps once per
# optimizer step, so the planned run ends inside the warmup and the lr never decays.

_DIFF_STEPS, _DIFF_WARMUP, _DIFF_ACCUM = 1000, 300, 4


def _diffusers_sched(opt: torch.optim.Optimizer, bug: bool) -> Any:
    from transformers import get_scheduler
    k = _DIFF_ACCUM if bug else 1
    return get_scheduler("cosine", optimizer=opt, num_warmup_steps=_DIFF_WARMUP * k,
                         num_training_steps=_DIFF_STEPS * k)


def _stretched_build(bug: bool) -> Case:
    torch.manual_seed(10)
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sched = _diffusers_sched(opt, bug)
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    micro = list(zip(x.chunk(_DIFF_ACCUM), y.chunk(_DIFF_ACCUM)))

    def step() -> torch.Tensor:
        for xb, yb in micro:
            loss = F.cross_entropy(model(xb), yb) / _DIFF_ACCUM
            loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        return loss

    return model, step, _kw(optimizer=opt, inputs=x, lr_scheduler=sched, total_steps=_DIFF_STEPS)


def _stretched_proof(bug: bool) -> bool:
    opt = torch.optim.AdamW(_mlp().parameters(), lr=1e-4)
    sched = _diffusers_sched(opt, bug)
    used = []
    for _ in range(_DIFF_STEPS):
        used.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return max(used) < 0.99e-4 and used[-1] > 0.5e-4


# --------------------------------------------------------------------------------------------------------------
# mlm-labels-unmasked: https://github.com/huggingface/transformers/issues/20797
# the MLM labels are the original ids at every position instead of -100 at the unmasked ones, so most of the
# loss asks the model to copy its visible input.

_MASK_ID = 4


def _mlm_batch(bug: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    orig = torch.randint(5, 60, (4, 12), generator=g)
    masked = torch.rand(4, 12, generator=g) < 0.15
    masked[:, 3] = True
    ids = orig.masked_fill(masked, _MASK_ID)
    labels = orig.clone() if bug else torch.where(ids == _MASK_ID, orig, torch.full_like(orig, -100))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def _mlm_build(bug: bool) -> Case:
    from transformers import BertConfig, BertForMaskedLM
    torch.manual_seed(11)
    cfg = BertConfig(vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=32, pad_token_id=0)
    model = BertForMaskedLM(cfg)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = _mlm_batch(bug)
    return model, lambda: model(**batch), _kw(optimizer=opt, inputs=batch)


def _mlm_proof(bug: bool) -> bool:
    model, step, kw = _mlm_build(bug)
    batch = kw["inputs"]
    kept: list[torch.Tensor] = []

    def hook(_m: nn.Module, _a: Any, out: torch.Tensor) -> None:
        out.retain_grad()
        kept.append(out)

    handle = model.cls.register_forward_hook(hook)
    step().loss.backward()
    handle.remove()
    supervised = kept[0].grad.abs().sum(-1) > 0  # positions whose logits get loss gradient
    copy = batch["labels"] == batch["input_ids"]  # target is the visible input token
    return bool((supervised & copy).any())


# --------------------------------------------------------------------------------------------------------------
# focal-weights-twice: https://github.com/mathiaszinnen/focal_loss_torch/issues/13
# the class weights are applied once by the weighted NLL and again by the focal term, so each class is
# weighted by w**2 instead of w.

_CLASS_W = torch.tensor([0.25, 1.0, 4.0])


def _focal(probs: torch.Tensor, target: torch.Tensor, twice: bool, gamma: float = 2.0) -> torch.Tensor:
    w = _CLASS_W[target]
    pt = probs.gather(1, target[:, None]).squeeze(1)
    nll = -torch.log(pt + 1e-16) * w
    loss = (1 - pt) ** gamma * nll * (w if twice else 1.0)
    return loss.sum() / w.sum()


def _focal_build(bug: bool) -> Case:
    torch.manual_seed(12)
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(24, 8), torch.arange(24) % 3
    return model, lambda: _focal(model(x).softmax(-1), y, twice=bug), _kw(optimizer=opt, inputs=x)


def _focal_proof(bug: bool) -> bool:
    logits = torch.zeros(6, 3, requires_grad=True)
    target = torch.tensor([0, 0, 1, 1, 2, 2])
    _focal(logits.softmax(-1), target, twice=bug).backward()
    g = logits.grad.norm(dim=1)
    ratio = float(g[4] / g[0])  # same prediction, class 2 against class 0
    return ratio > 1.5 * float(_CLASS_W[2] / _CLASS_W[0])


# --------------------------------------------------------------------------------------------------------------
# weighted-ce-batch1: https://github.com/pytorch/pytorch/issues/50528
# CrossEntropyLoss(weight=...) with reduction='mean' divides by the summed weights of the batch, so with
# batch_size=1 the class weights cancel and do nothing.

_CE_W = torch.tensor([1.0, 10.0])


def _wce_build(bug: bool) -> Case:
    torch.manual_seed(13)
    model = _mlp(d_out=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = _batch(1, 8, 2, seed=13)
    y = torch.ones_like(y)  # a sample of the rare, up-weighted class

    def loss() -> torch.Tensor:
        if bug:
            return F.cross_entropy(model(x), y, weight=_CE_W)
        return F.cross_entropy(model(x), y, weight=_CE_W, reduction="none").mean()

    return model, loss, _kw(optimizer=opt, inputs=x)


def _wce_proof(bug: bool) -> bool:
    """The weighted loss's gradient equals the unweighted one: the class weight has no effect."""
    model, step, kw = _wce_build(bug)
    step().backward()
    weighted = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    F.cross_entropy(model(kw["inputs"]), torch.tensor([1])).backward()
    return all(torch.allclose(a, p.grad) for a, p in zip(weighted, model.parameters()))


# --------------------------------------------------------------------------------------------------------------
# accum-loss-not-divided: https://github.com/hirofumi0810/neural_sp/issues/168
# with gradient accumulation the loss is not divided by the number of accumulated steps, so each update is the
# sum of the micro-batch gradients: K times the intended step.

_K = 4


def _accum_build(bug: bool) -> Case:
    torch.manual_seed(14)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = _batch(16, 8, 3, seed=14)
    micro = list(zip(x.chunk(_K), y.chunk(_K)))

    def step() -> torch.Tensor:
        opt.zero_grad()
        for xb, yb in micro:
            loss = F.cross_entropy(model(xb), yb)
            (loss if bug else loss / _K).backward()
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=x)


def _accum_proof(bug: bool) -> bool:
    """The first real SGD update against lr * the gradient of the whole effective batch."""
    model, step, kw = _accum_build(bug)
    x, y = _batch(16, 8, 3, seed=14)
    F.cross_entropy(model(x), y).backward()
    intended = {n: 0.05 * p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    before = _snapshot(model)
    step()
    ratios = [float((before[n] - p.detach()).norm() / intended[n].norm()) for n, p in model.named_parameters()]
    return min(ratios) > 0.5 * _K


CASES: list[BlindCase] = [
    BlindCase("clip-before-unscale", "https://github.com/milesial/Pytorch-UNet/issues/468",
              "optimizer update (mixed precision)",
              "gradients are clipped while still multiplied by the GradScaler's scale, so every update is ~1/65536 "
              "of the clipped step", _clip_build, _clip_proof),
    BlindCase("frozen-backbone-bn-stats", "https://github.com/lightly-ai/lightly/issues/1438", "train/eval modes",
              "a backbone frozen with requires_grad=False keeps its BatchNorm in train mode, so its running "
              "statistics drift with every batch", _bn_build, _bn_proof),
    BlindCase("frozen-text-encoder-dropout", "https://github.com/nickgkan/butd_detr/issues/8", "train/eval modes",
              "a frozen BERT text encoder left in train mode applies dropout, so the features the head trains on "
              "are random every step", _dropout_build, _dropout_proof),
    BlindCase("left-pad-gpt2-no-position-ids", "https://github.com/huggingface/trl/issues/469",
              "inputs against the model",
              "left-padded batches reach GPT-2 without position_ids, so padded rows train at shifted absolute "
              "positions", _leftpad_build, _leftpad_proof),
    BlindCase("config-pad-id-mismatch", "https://github.com/ymcui/Chinese-LLaMA-Alpaca-2/issues/160",
              "inputs against the model",
              "config.pad_token_id differs from the id the tokenizer pads with, so LlamaForSequenceClassification "
              "classifies padded rows from a padding position", _padid_build, _padid_proof),
    BlindCase("freeze-overwritten", "https://github.com/ultralytics/yolov5/issues/1213", "freezing",
              "the optimizer-group loop sets requires_grad=True on every parameter after the freeze loop, so the "
              "frozen layers train", _yolo_build, _yolo_proof,
              known_miss="the freeze is undone before the audit sees the model: no frozen flag, group or "
                         "gradient is left that says those layers were meant to stay fixed"),
    BlindCase("no-grad-backbone-decayed", "https://github.com/open-mmlab/OpenPCDet/issues/845",
              "optimizer update",
              "a backbone frozen by torch.no_grad() keeps requires_grad=True, so the optimizer wrapper's true "
              "weight decay shrinks it every step", _nograd_build, _nograd_proof),
    BlindCase("textual-inversion-adamw-decay", "https://github.com/huggingface/diffusers/issues/1176",
              "optimizer update",
              "only the new token's gradient is kept, but AdamW weight decay shrinks every frozen word embedding",
              _ti_build, _ti_proof),
    BlindCase("onecycle-stepped-per-epoch", "https://github.com/CodefyUI/CodefyUI/issues/297", "lr schedule",
              "a 1500-step OneCycleLR is stepped once per epoch in a one-epoch run, so training never leaves "
              "max_lr/25", _onecycle_build, _onecycle_proof),
    BlindCase("scheduler-stepped-per-microbatch", "https://github.com/starVLA/starVLA/pull/210", "lr schedule",
              "the scheduler steps on every micro-batch of gradient accumulation, so the cosine schedule hits 0 "
              "half-way through the run", _microbatch_build, _microbatch_proof),
    BlindCase("schedule-stretched-by-accumulation", "https://github.com/huggingface/diffusers/issues/4387",
              "lr schedule",
              "warmup and length are multiplied by gradient_accumulation_steps, so the run ends inside the warmup "
              "and the lr never decays", _stretched_build, _stretched_proof),
    BlindCase("mlm-labels-unmasked", "https://github.com/huggingface/transformers/issues/20797",
              "loss supervision",
              "MLM labels keep the original ids at unmasked positions, so most of the loss trains the model to "
              "copy its visible input", _mlm_build, _mlm_proof),
    BlindCase("focal-weights-twice", "https://github.com/mathiaszinnen/focal_loss_torch/issues/13",
              "loss supervision",
              "the focal loss applies the class weights twice, so classes are weighted by w**2 instead of w",
              _focal_build, _focal_proof,
              known_miss="a focal loss's output gradient is not softmax-CE shaped, so no per-sample weight is "
                         "measured, and the intended weights w are not known to compare w**2 against"),
    BlindCase("weighted-ce-batch1", "https://github.com/pytorch/pytorch/issues/50528", "loss supervision",
              "weighted CrossEntropyLoss with reduction='mean' at batch size 1 divides the weight back out, so "
              "the class weights do nothing", _wce_build, _wce_proof),
    BlindCase("accum-loss-not-divided", "https://github.com/hirofumi0810/neural_sp/issues/168",
              "loss supervision",
              "the accumulated loss is not divided by the accumulation steps, so each SGD update is K times the "
              "intended one", _accum_build, _accum_proof),
]
