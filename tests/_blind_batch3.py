"""Blind batch 3: silent training bugs from GitHub threads and forum pages, each with its fixed twin.

Collected by someone who does not write the audit's checks; see docs/blind-batch3.md for the figures. Every case
builds the user's setup on a tiny real model (transformers models from tiny configs in code, real peft LoRA, real
optimizers, schedulers and GradScaler; nothing is downloaded) and proves the bug without the audit on real runs.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from guardtower.preflight import audit
from tests._blind import BlindCase, Case

_AUDIT_PARAMS = set(inspect.signature(audit).parameters)


def _kw(**kwargs: Any) -> dict[str, Any]:
    """The audit arguments a user passes, less any this ``audit()`` does not take."""
    return {k: v for k, v in kwargs.items() if k in _AUDIT_PARAMS}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _mlp(d_in: int = 8, d_out: int = 3, hidden: int = 16) -> nn.Sequential:
    return nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, d_out))


def _xy(n: int = 32, d: int = 8, classes: int = 3, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen(seed)
    return torch.randn(n, d, generator=g), torch.randint(0, classes, (n,), generator=g)


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _gpt2(seed: int = 0, n_embd: int = 32) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=2, n_embd=n_embd, n_head=2, vocab_size=40, n_positions=32, bos_token_id=1,
                     eos_token_id=1, pad_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


# --------------------------------------------------------------------------------------------- case-01

def _c01_build(bug: bool) -> Case:
    """AMP loop: scaler.step(opt) and then a leftover opt.step(), so every batch is applied twice."""
    torch.manual_seed(0)
    model = _mlp(8, 3, 32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    x, y = _xy()

    def step() -> torch.Tensor:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        if bug:
            opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=(x, y), scaler=scaler)


def _c01_proof(bug: bool) -> bool:
    model, step, kw = _c01_build(bug)
    step()
    opt = kw["optimizer"]
    return int(opt.state[next(model.parameters())]["step"]) == 2  # two optimizer updates from one batch


# --------------------------------------------------------------------------------------------- case-02

class _EssayScorer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from transformers import BertConfig, BertModel

        cfg = BertConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=64, max_position_embeddings=32, pad_token_id=0)
        self.bert = BertModel(cfg)
        self.head = nn.Linear(32, 1)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        out = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state[:, 0]
        return torch.sigmoid(self.head(out)).squeeze(-1)


_ESSAYS = [[2, 5, 6, 7, 8, 9, 10, 11, 3], [2, 12, 13, 3], [2, 14, 15, 16, 3]]


def _pad_essays(pad: int, width: int) -> torch.Tensor:
    return torch.tensor([e + [pad] * (width - len(e)) for e in _ESSAYS])


def _c02_build(bug: bool) -> Case:
    """BERT essay scorer: padded with id 1 (the model's pad id is 0) and called without attention_mask."""
    torch.manual_seed(0)
    model = _EssayScorer().train()
    ids = _pad_essays(1 if bug else 0, 12)
    mask = (ids != 0).long()
    scores = torch.tensor([0.8, 0.3, 0.5])
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    if bug:
        return model, lambda: F.mse_loss(model(ids), scores), _kw(optimizer=opt, inputs=ids)
    batch = {"input_ids": ids, "attention_mask": mask}
    return model, lambda: F.mse_loss(model(**batch), scores), _kw(optimizer=opt, inputs=batch)


def _c02_proof(bug: bool) -> bool:
    """A short essay's score changes when more padding is appended: the model reads the padding."""
    model, _, _ = _c02_build(bug)
    model.eval()
    pad = 1 if bug else 0
    with torch.no_grad():
        outs = []
        for width in (12, 16):
            ids = _pad_essays(pad, width)
            outs.append(model(ids) if bug else model(ids, (ids != 0).long()))
    return not torch.allclose(outs[0], outs[1], atol=1e-5)


# --------------------------------------------------------------------------------------------- case-03

def _lm_microbatches() -> list[dict[str, torch.Tensor]]:
    """Four micro-batches of width 8 with very different numbers of trained tokens (-100 on padding)."""
    g = _gen(3)
    out = []
    for valid in ((8, 8), (2, 3), (7, 1), (4, 6)):
        ids = torch.randint(2, 40, (2, 8), generator=g)
        labels = ids.clone()
        mask = torch.ones_like(ids)
        for r, n in enumerate(valid):
            ids[r, n:] = 0
            labels[r, n:] = -100
            mask[r, n:] = 0
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


def _token_sum_loss(model: nn.Module, mb: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), mb["labels"][:, 1:].reshape(-1),
                           ignore_index=-100, reduction="sum")


def _c03_build(bug: bool) -> Case:
    """Gradient accumulation over variable-length micro-batches: each micro-batch's token mean, divided by K."""
    model = _gpt2(seed=3).train()
    mbs = _lm_microbatches()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    n_tokens = sum(int((mb["labels"][:, 1:] != -100).sum()) for mb in mbs)

    def step() -> torch.Tensor:
        opt.zero_grad()
        for mb in mbs:
            if bug:
                loss = model(**mb).loss / len(mbs)
            else:
                loss = _token_sum_loss(model, mb) / n_tokens
            loss.backward()
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=mbs[0], total_steps=1000)


def _full_batch_grads(model: nn.Module, mbs: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The gradient of the token mean over the whole accumulation window, in one backward."""
    model.zero_grad()
    full = {k: torch.cat([mb[k] for mb in mbs]) for k in mbs[0]}
    n = int((full["labels"][:, 1:] != -100).sum())
    (_token_sum_loss(model, full) / n).backward()
    grads = _grads(model)
    model.zero_grad()
    return grads


def _accumulated_differs(model: nn.Module, step: Any, opt: torch.optim.Optimizer,
                         mbs: list[dict[str, torch.Tensor]]) -> bool:
    ref = _full_batch_grads(model, mbs)
    saved = opt.step
    opt.step = lambda *a, **k: None  # type: ignore[method-assign]  # keep the accumulated gradient
    try:
        step()
    finally:
        opt.step = saved  # type: ignore[method-assign]
    got = _grads(model)
    return any(not torch.allclose(got[n], ref[n], rtol=1e-3, atol=1e-7) for n in ref)


def _c03_proof(bug: bool) -> bool:
    model, step, kw = _c03_build(bug)
    return _accumulated_differs(model, step, kw["optimizer"], _lm_microbatches())


# --------------------------------------------------------------------------------------------- case-04

class _SegNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inc = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())
        self.outc = nn.Conv2d(8, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.outc(self.inc(x))


_SEG_X = torch.randn(2, 1, 8, 8, generator=_gen(4))
_SEG_Y = torch.randint(0, 3, (2, 8, 8), generator=_gen(5))


def _c04_build(bug: bool) -> Case:
    """Source-free adaptation that should keep the last layer fixed: requires_grad set on the module object."""
    torch.manual_seed(0)
    model = _SegNet().train()
    if bug:
        model.outc.requires_grad = False
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    else:
        model.outc.requires_grad_(False)
        opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(model(_SEG_X), _SEG_Y)
        loss.backward()
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=_SEG_X)


def _c04_proof(bug: bool) -> bool:
    model, step, _ = _c04_build(bug)
    before = model.outc.weight.detach().clone()
    step()
    return not torch.equal(before, model.outc.weight.detach())  # the layer meant to stay fixed moved


# --------------------------------------------------------------------------------------------- case-05

def _c05_build(bug: bool) -> Case:
    """``if scheduler: scheduler.step() else: optimizer.step()``: with a scheduler the optimizer never steps."""
    torch.manual_seed(0)
    model = _mlp(8, 3, 32)
    opt = torch.optim.Adam(model.parameters(), lr=2e-4)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1000, gamma=0.5)
    x, y = _xy()

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if bug:
            if sched:
                sched.step()
            else:
                opt.step()
        else:
            if sched:
                sched.step()
            opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=(x, y), lr_scheduler=sched, total_steps=5000)


def _c05_proof(bug: bool) -> bool:
    import warnings

    model, step, _ = _c05_build(bug)
    before = [p.detach().clone() for p in model.parameters()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(3):
            step()
    return all(torch.equal(b, p.detach()) for b, p in zip(before, model.parameters()))


# --------------------------------------------------------------------------------------------- case-06

_RUN, _RESUME_AT = 400, 240


def _c06_build(bug: bool) -> Case:
    """Resuming at step 240 of 400: model and optimizer come from the checkpoint, the scheduler starts fresh."""
    x, y = _xy(seed=6)

    def fresh() -> tuple[nn.Module, torch.optim.Optimizer, Any]:
        torch.manual_seed(0)
        m = _mlp(8, 3, 16)
        o = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        return m, o, torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=_RUN)

    model, opt, sched = fresh()
    for _ in range(_RESUME_AT):  # the interrupted run
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        sched.step()
    ckpt = {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict()}

    model, opt, sched = fresh()  # the resumed run
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["optimizer"])
    if not bug:
        sched.load_state_dict(ckpt["scheduler"])

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        sched.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=(x, y), lr_scheduler=sched, total_steps=_RUN)


def _c06_proof(bug: bool) -> bool:
    """Walk the resumed scheduler over the rest of the run: the lr should end at ~0 and does not."""
    _, _, kw = _c06_build(bug)
    sched, opt = kw["lr_scheduler"], kw["optimizer"]
    for _ in range(_RUN - _RESUME_AT):
        opt.step()
        sched.step()
    return float(opt.param_groups[0]["lr"]) > 0.01 * 0.1


# --------------------------------------------------------------------------------------------- case-07

def _c07_build(bug: bool) -> Case:
    """LoRA r=64 with the config's lora_alpha left unset, so peft's default alpha=8 scales the update by 1/8."""
    from peft import LoraConfig, get_peft_model

    base = _gpt2(seed=7, n_embd=64)
    kwargs: dict[str, Any] = {} if bug else {"lora_alpha": 64}
    cfg = LoraConfig(r=64, target_modules=["c_attn"], lora_dropout=0.0, task_type="CAUSAL_LM", **kwargs)
    model = get_peft_model(base, cfg).train()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 1], [12, 13, 14, 15, 16, 17, 18, 1]])
    batch = {"input_ids": ids, "labels": ids.clone()}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    return model, lambda: model(**batch), _kw(optimizer=opt, inputs=batch)


def _c07_proof(bug: bool) -> bool:
    """The LoRA layers of the real model apply alpha/r = 1/8 to the learned update (1.0 intended)."""
    from peft.tuners.lora import LoraLayer

    model, _, _ = _c07_build(bug)
    scalings = [m.scaling["default"] for m in model.modules() if isinstance(m, LoraLayer)]
    return bool(scalings) and max(scalings) <= 0.125


# --------------------------------------------------------------------------------------------- case-08

def _poly_optimizer(bug: bool) -> type[torch.optim.SGD]:
    class PolyOptimizer(torch.optim.SGD):
        def __init__(self, params: Any, lr: float, weight_decay: float, max_step: int, momentum: float = 0.9):
            if bug:
                super().__init__(params, lr, weight_decay)  # the third positional of SGD is momentum
            else:
                super().__init__(params, lr, momentum=momentum, weight_decay=weight_decay)
            self.global_step = 0
            self.max_step = max_step
            self.momentum = momentum
            self._initial_lr = [group["lr"] for group in self.param_groups]

        def step(self, closure: Any = None) -> Any:
            if self.global_step < self.max_step:
                lr_mult = (1 - self.global_step / self.max_step) ** self.momentum
                for i, group in enumerate(self.param_groups):
                    group["lr"] = self._initial_lr[i] * lr_mult
            out = super().step(closure)
            self.global_step += 1
            return out

    return PolyOptimizer


def _c08_build(bug: bool) -> Case:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(8, 4))
    x = torch.randn(4, 3, 8, 8, generator=_gen(8))
    y = torch.tensor([0, 1, 2, 3])
    opt = _poly_optimizer(bug)(model.parameters(), lr=0.01, weight_decay=5e-4, max_step=8000)

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=(x, y), total_steps=8000)


def _c08_proof(bug: bool) -> bool:
    """After real steps the optimizer runs with momentum 5e-4 and no weight decay (0.9 and 5e-4 intended)."""
    _, step, kw = _c08_build(bug)
    step()
    step()
    group = kw["optimizer"].param_groups[0]
    return group["momentum"] < 0.01 and group["weight_decay"] == 0


# --------------------------------------------------------------------------------------------- case-09

_BOS = 2


def _c09_build(bug: bool) -> Case:
    """Reward model: the chat template already starts with BOS, then the tokenizer prepends another."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                      bos_token_id=_BOS, eos_token_id=3, pad_token_id=0, num_labels=1)
    model = LlamaForSequenceClassification(cfg).train()
    chosen = [[_BOS, 10, 11, 12, 20, 21, 3], [_BOS, 13, 14, 15, 22, 23, 3]]
    rejected = [[_BOS, 10, 11, 12, 30, 31, 3], [_BOS, 13, 14, 15, 32, 33, 3]]
    if bug:
        chosen = [[_BOS] + c for c in chosen]
        rejected = [[_BOS] + r for r in rejected]
    batch = {"input_ids_chosen": torch.tensor(chosen), "input_ids_rejected": torch.tensor(rejected)}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def step() -> torch.Tensor:
        r_c = model(input_ids=batch["input_ids_chosen"]).logits
        r_r = model(input_ids=batch["input_ids_rejected"]).logits
        return -F.logsigmoid(r_c - r_r).mean()

    return model, step, _kw(optimizer=opt, inputs=batch)


def _c09_proof(bug: bool) -> bool:
    _, _, kw = _c09_build(bug)
    ids = kw["inputs"]["input_ids_chosen"]
    return bool((ids[:, :2] == _BOS).all(dim=1).any())  # rows start with two BOS tokens


# --------------------------------------------------------------------------------------------- case-10

def _c10_build(bug: bool) -> Case:
    """Manual optimization (one optimizer step per batch): the per-epoch ExponentialLR is never stepped."""
    torch.manual_seed(0)
    model = _mlp(8, 3, 16)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-4, betas=(0.8, 0.99))
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.999875)
    batches = [_xy(16, seed=s) for s in (10, 11)]

    def epoch() -> torch.Tensor:
        for x, y in batches:
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
        if not bug:
            sched.step()
        return loss

    return model, epoch, _kw(optimizer=opt, inputs=batches[0], lr_scheduler=sched, total_steps=10000)


def _c10_proof(bug: bool) -> bool:
    _, epoch, kw = _c10_build(bug)
    lr0 = kw["optimizer"].param_groups[0]["lr"]
    for _ in range(3):
        epoch()
    return kw["optimizer"].param_groups[0]["lr"] == lr0  # the lr never decays


# --------------------------------------------------------------------------------------------- case-11

def _c11_build(bug: bool) -> Case:
    """The loss is already normalised by the window's item count, and the loop divides it by K again."""
    model = _gpt2(seed=11).train()
    mbs = _lm_microbatches()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    num_items = sum(int((mb["labels"][:, 1:] != -100).sum()) for mb in mbs)

    def step() -> torch.Tensor:
        opt.zero_grad()
        for mb in mbs:
            loss = model(**mb, num_items_in_batch=num_items).loss
            if bug:
                loss = loss / len(mbs)
            loss.backward()
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=mbs[0], total_steps=1000)


def _c11_proof(bug: bool) -> bool:
    model, step, kw = _c11_build(bug)
    return _accumulated_differs(model, step, kw["optimizer"], _lm_microbatches())


# --------------------------------------------------------------------------------------------- case-12

class _LaneHead(nn.Module):
    def __init__(self, num_classes: int, queries: int = 7) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
        self.class_embed = nn.Linear(32, queries * (num_classes + 1))
        self.queries, self.num_classes = queries, num_classes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.class_embed(self.backbone(x)).view(x.size(0), self.queries, self.num_classes + 1)


_LANE_X = torch.randn(4, 16, generator=_gen(12))
_MATCHED = (torch.tensor([0, 0, 1, 2, 3, 3]), torch.tensor([0, 3, 1, 5, 2, 4]))  # (image, query) of real lanes


def _lane_targets(num_classes: int, bug: bool) -> torch.Tensor:
    category = 1 if bug else 0  # the dataset writes lanes as category 1; class ids should start at 0
    target = torch.full((4, 7), num_classes, dtype=torch.long)  # every query starts as 'no lane'
    target[_MATCHED] = category
    return target


def _c12_build(bug: bool) -> Case:
    """DETR-style lane classification with one class: 'no lane' is index num_classes = 1, the lane label too."""
    torch.manual_seed(0)
    num_classes = 1
    model = _LaneHead(num_classes)
    empty_weight = torch.ones(num_classes + 1)
    empty_weight[-1] = 0.1
    target = _lane_targets(num_classes, bug)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> torch.Tensor:
        logits = model(_LANE_X)
        return F.cross_entropy(logits.transpose(1, 2), target, empty_weight)

    return model, step, _kw(optimizer=opt, inputs=_LANE_X)


def _c12_proof(bug: bool) -> bool:
    """The matched lanes get the same target as the unmatched queries: every target is one class."""
    target = _lane_targets(1, bug)
    return bool(target.unique().numel() == 1)


# --------------------------------------------------------------------------------------------- case-13

class _SimpleNet(nn.Module):
    def __init__(self, functional_dropout: bool) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                      nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.drp = nn.Dropout2d(0.1)
        self.classifier = nn.Linear(16, 10)
        self.functional_dropout = functional_dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.features(x)
        out = F.max_pool2d(out, kernel_size=out.size()[2:])
        out = F.dropout2d(out, 0.1, training=True) if self.functional_dropout else self.drp(out)
        return self.classifier(out.view(out.size(0), -1))


_IMG = torch.randn(8, 3, 8, 8, generator=_gen(13))
_IMG_Y = torch.randint(0, 10, (8,), generator=_gen(14))


def _c13_build(bug: bool) -> Case:
    """``F.dropout2d(out, 0.1, training=True)`` in forward: dropout stays on in eval mode."""
    torch.manual_seed(0)
    model = _SimpleNet(functional_dropout=bug).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(model(_IMG), _IMG_Y)
        loss.backward()
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=(_IMG, _IMG_Y))


def _c13_proof(bug: bool) -> bool:
    """In eval mode two forwards of the same images disagree: validation is scored with dropout on."""
    model, _, _ = _c13_build(bug)
    model.eval()
    with torch.no_grad():
        return not torch.equal(model(_IMG), model(_IMG))


# --------------------------------------------------------------------------------------------- case-14

class _PointRayNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.points = nn.Linear(64, 3)
        self.rays = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 3))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.trunk(x)
        return self.points(h), self.rays(h)


_PR_N = 1024
_PR_X = torch.randn(_PR_N, 16, generator=_gen(15))
_PR_POINTS = 20 * torch.randn(_PR_N, 3, generator=_gen(16))  # metres
_PR_RAYS = F.normalize(torch.randn(_PR_N, 3, generator=_gen(17)), dim=-1)


def _pr_loss(model: nn.Module, dtype: torch.dtype | None) -> torch.Tensor:
    if dtype is None:
        points, rays = model(_PR_X)
    else:
        with torch.autocast("cpu", dtype=dtype):
            points, rays = model(_PR_X)
    ray_term = (1 - F.cosine_similarity(rays.float(), _PR_RAYS, dim=-1)).mean()
    return F.mse_loss(points.float(), _PR_POINTS) + 1e-4 * ray_term


def _c14_build(bug: bool) -> Case:
    """Multi-task loss under fp16 autocast without a GradScaler (bf16, which needs none, in the fix)."""
    torch.manual_seed(0)
    model = _PointRayNet().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    dtype = torch.float16 if bug else torch.bfloat16

    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = _pr_loss(model, dtype)
        loss.backward()
        opt.step()
        return loss

    return model, step, _kw(optimizer=opt, inputs=_PR_X)


def _c14_proof(bug: bool) -> bool:
    """The ray head's gradient under this autocast is far from its fp32 gradient: the small terms are lost."""
    model, _, _ = _c14_build(bug)
    dtype = torch.float16 if bug else torch.bfloat16
    _pr_loss(model, None).backward()
    ref = model.rays[0].weight.grad.detach().clone()
    model.zero_grad()
    _pr_loss(model, dtype).backward()
    got = model.rays[0].weight.grad.detach()
    return float((got - ref).norm() / ref.norm()) > 0.3


# --------------------------------------------------------------------------------------------- case-15

_CLS, _SEP = 2, 3
# each sentence: (word -> sub-token ids, word labels)
_SENTS = [([[10], [11, 12], [13], [14, 15, 16]], [1, 0, 2, 0]),
          ([[17, 18], [19], [20]], [2, 2, 0])]


def _token_batch(bug: bool) -> dict[str, torch.Tensor]:
    width = 12
    ids, labels = [], []
    for words, word_labels in _SENTS:
        row = [_CLS] + [t for w in words for t in w] + [_SEP]
        if bug:  # one label per word, laid over the sub-tokens from position 0
            lab = list(word_labels)
        else:  # word_ids alignment: specials -100, the first sub-token gets the word's label, the rest -100
            lab = [-100]
            for w, y in zip(words, word_labels):
                lab += [y] + [-100] * (len(w) - 1)
            lab += [-100]
        ids.append(row + [0] * (width - len(row)))
        labels.append(lab + [-100] * (width - len(lab)))
    ids_t = torch.tensor(ids)
    return {"input_ids": ids_t, "attention_mask": (ids_t != 0).long(), "labels": torch.tensor(labels)}


def _c15_build(bug: bool) -> Case:
    """NER fine-tuning: word-level labels are not aligned with the sub-word tokens."""
    from transformers import BertConfig, BertForTokenClassification

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=32, pad_token_id=0, num_labels=3)
    model = BertForTokenClassification(cfg).train()
    batch = _token_batch(bug)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-5)
    return model, lambda: model(**batch), _kw(optimizer=opt, inputs=batch)


def _c15_proof(bug: bool) -> bool:
    """Some token is trained on a label that is not its word's (the [CLS] token, or a word's sub-token)."""
    labels = _token_batch(bug)["labels"]
    for r, (words, word_labels) in enumerate(_SENTS):
        want = [-100] + [y if i == 0 else -100 for w, y in zip(words, word_labels) for i in range(len(w))] + [-100]
        got = labels[r, :len(want)].tolist()
        if any(g != -100 and g != w for g, w in zip(got, want)):
            return True
    return False


CASES: list[BlindCase] = [
    BlindCase("case-01", "https://github.com/IAHispano/Applio/pull/860", "mixed precision",
              "after scaler.step(optimizer) a leftover optimizer.step() applies every batch's update twice",
              _c01_build, _c01_proof),
    BlindCase("case-02", "https://github.com/CarryCKW/AES-NPCR/issues/7", "inputs vs model",
              "BERT is called without attention_mask on batches padded with id 1 (its pad id is 0), so essays "
              "attend to their padding", _c02_build, _c02_proof),
    BlindCase("case-03", "https://github.com/karpathy/nanochat/pull/59", "gradient accumulation",
              "each micro-batch's token-mean loss is divided by the step count, so short micro-batches weigh "
              "as much as long ones", _c03_build, _c03_proof),
    BlindCase("case-04", "https://github.com/CSCYQJ/MICCAI23-ProtoContra-SFDA/issues/18", "freezing",
              "requires_grad=False is set on the nn.Module object, not its parameters, so the layer to keep "
              "fixed trains", _c04_build, _c04_proof),
    BlindCase("case-05", "https://github.com/ClementPinard/SfmLearner-Pytorch/issues/5", "optimizer update",
              "with a scheduler the loop calls scheduler.step() instead of optimizer.step(): no weight ever moves",
              _c05_build, _c05_proof),
    BlindCase("case-06", "https://github.com/victoresque/pytorch-template/issues/68", "lr schedule",
              "on resume the model and optimizer are restored but the scheduler starts again from step 0",
              _c06_build, _c06_proof),
    BlindCase("case-07", "https://github.com/huggingface/lerobot/pull/3573", "LoRA/PEFT",
              "lora_alpha is not passed, so peft's default alpha=8 with r=64 scales the adapter update by 1/8",
              _c07_build, _c07_proof,
              known_miss="no invariant compares the LoRA scale (alpha / r) with the usual range"),
    BlindCase("case-08", "https://github.com/YudeWang/SEAM/issues/21", "optimizer update",
              "an SGD subclass passes weight_decay positionally into SGD's momentum slot: momentum 5e-4, "
              "no decay", _c08_build, _c08_proof),
    BlindCase("case-09", "https://github.com/YangRui2015/Generalizable-Reward-Model/issues/6", "inputs vs model",
              "the chat template already holds BOS and the tokenizer adds another: every sequence starts with "
              "two", _c09_build, _c09_proof),
    BlindCase("case-10", "https://github.com/voicepaw/so-vits-svc-fork/pull/291", "lr schedule",
              "with manual optimization the lr scheduler is never stepped, so the lr never decays",
              _c10_build, _c10_proof),
    BlindCase("case-11", "https://github.com/unslothai/unsloth-zoo/pull/1023", "gradient accumulation",
              "the loss already divided by the window's item count is divided by the accumulation steps again: "
              "gradients 1/K", _c11_build, _c11_proof),
    BlindCase("case-12", "https://github.com/liuruijin17/LSTR/issues/50", "loss supervision",
              "with one class, the 'no object' index equals the lane label, so every query gets the same "
              "target", _c12_build, _c12_proof,
              known_miss="the one-class rule (DATA-007) covers per-sample outputs; per-query targets of a detector are not judged"),
    BlindCase("case-13", "https://github.com/Coderx7/SimpleNet/issues/2", "train/eval modes",
              "F.dropout2d(..., training=True) in forward keeps dropout on in eval mode", _c13_build, _c13_proof),
    BlindCase("case-14", "https://github.com/engichang1467/Open-Rig3R/issues/35", "mixed precision",
              "fp16 autocast without a GradScaler: the small loss term's gradients underflow and are lost",
              _c14_build, _c14_proof),
    BlindCase("case-15",
              "https://discuss.huggingface.co/t/why-is-my-token-classification-model-performing-poorly-on-"
              "custom-data/173536/2",
              "loss supervision", "word-level labels laid over sub-word tokens without word_ids alignment: "
              "labels land on the wrong tokens", _c15_build, _c15_proof,
              known_miss="no invariant aligns word-level labels with sub-word tokens"),
]
