"""Blind batch 2: silent training bugs from forum / Q&A threads and blog posts, each with its fixed twin.

Collected by someone who does not write the audit's checks; see docs/blind-batch2.md for the figures. Every case
builds the user's setup on a tiny real model (real transformers models from tiny configs, real peft LoRA, real
optimizers, schedulers and GradScaler) and proves the bug without the audit on real runs.

``total_steps=`` (the planned run length) is part of what a user passes; the audit of the day may not accept it
yet, so ``_kw`` leaves it out when ``audit()`` has no such parameter (the figures then say so).
"""

from __future__ import annotations

import copy
import inspect
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from guardtower.preflight import audit
from tests._blind import BlindCase, Case

_AUDIT_PARAMS = set(inspect.signature(audit).parameters)


def _kw(**kwargs: Any) -> dict[str, Any]:
    """The audit arguments a user passes, less those today's ``audit()`` does not take."""
    return {k: v for k, v in kwargs.items() if k in _AUDIT_PARAMS}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _snapshot(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in tensors.items()}


# --------------------------------------------------------------------------------------------- what the loss supervises

def _class_weights_follow_frequency(bug: bool) -> Case:
    """84/16 labels; the weight vector is the class frequencies, so the majority class is weighted up."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    x = torch.randn(50, 8, generator=_gen(1))
    labels = torch.zeros(50, dtype=torch.long)
    labels[:8] = 1  # 16% positives
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    if bug:
        criterion = nn.BCEWithLogitsLoss(reduction="none")
        weight = torch.tensor([0.84, 0.16])

        def step() -> torch.Tensor:
            out = model(x)
            weight_ = weight[labels.view(-1).long()].view_as(labels)
            loss = criterion(out[:, 1] - out[:, 0], labels.float())
            return (loss * weight_).mean()
    else:
        criterion = nn.BCEWithLogitsLoss(pos_weight=torch.tensor(84 / 16))

        def step() -> torch.Tensor:
            out = model(x)
            return criterion(out[:, 1] - out[:, 0], labels.float())

    return model, step, _kw(optimizer=opt, inputs=(x, labels))


def _minority_gradient_share(bug: bool) -> bool:
    """From the real backward: the minority class's share of the logit gradient falls below its 16% frequency."""
    model, step, kw = _class_weights_follow_frequency(bug)
    _, labels = kw["inputs"]
    captured: dict[str, torch.Tensor] = {}

    def keep(_m: nn.Module, _i: Any, out: torch.Tensor) -> None:
        out.retain_grad()
        captured["out"] = out

    handle = model[2].register_forward_hook(keep)
    step().backward()
    handle.remove()
    g = captured["out"].grad.abs().sum(-1)
    minority = float(g[labels == 1].sum() / g.sum())
    return minority < 0.16


def _t5_label_padding(bug: bool) -> Case:
    """T5 targets padded with the pad id (0) instead of -100: the padding is a target."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    cfg = T5Config(vocab_size=40, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=1, num_heads=2,
                   pad_token_id=0, eos_token_id=1, decoder_start_token_id=0, dropout_rate=0.0)
    model = T5ForConditionalGeneration(cfg).train()
    input_ids = torch.tensor([[5, 6, 7, 8, 9, 1], [10, 11, 12, 1, 0, 0]])
    attention_mask = (input_ids != 0).long()
    labels = torch.tensor([[20, 21, 22, 23, 1], [24, 25, 1, 0, 0]])  # the tokenizer pads targets with 0
    if not bug:
        labels = labels.masked_fill(labels == 0, -100)  # the thread's fix
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, lambda: model(**batch), _kw(optimizer=opt, inputs=batch)


def _t5_padding_gets_loss_gradient(bug: bool) -> bool:
    model, _, kw = _t5_label_padding(bug)
    batch = kw["inputs"]
    out = model(**batch)
    out.logits.retain_grad()
    out.loss.backward()
    pad_positions = torch.tensor([[False] * 5, [False, False, False, True, True]])
    return bool(out.logits.grad[pad_positions].abs().sum() > 0)


_SORTED_X = torch.randn(64, 8, generator=_gen(2))
_SORTED_Y = torch.arange(4).repeat_interleave(16)  # the dataset is stored ordered by label


def _loader(bug: bool) -> torch.utils.data.DataLoader:
    ds = torch.utils.data.TensorDataset(_SORTED_X + _SORTED_Y[:, None].float(), _SORTED_Y)
    return torch.utils.data.DataLoader(ds, batch_size=16, shuffle=not bug, generator=_gen(3))


def _label_sorted_batches(bug: bool) -> Case:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    loader = _loader(bug)
    x, y = next(iter(loader))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    return model, lambda: F.cross_entropy(model(x), y), _kw(optimizer=opt, inputs=(x, y),
                                                            total_steps=10 * len(loader))


def _every_batch_one_class(bug: bool) -> bool:
    return all(int(y.unique().numel()) == 1 for _, y in _loader(bug))


# --------------------------------------------------------------------------------------------- what the update does

class _TiedLSTMLM(nn.Module):
    """An AWD-LSTM-like LM: embedding with padding_idx, LSTM, decoder tied to the embedding (fastai's default)."""

    def __init__(self, tie: bool) -> None:
        super().__init__()
        self.encoder = nn.Embedding(24, 16, padding_idx=0)
        with torch.no_grad():
            self.encoder.weight[0] = 0.0  # as the thread does
        self.rnn = nn.LSTM(16, 16, batch_first=True)
        self.decoder = nn.Linear(16, 24)
        if tie:
            self.decoder.weight = self.encoder.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(self.encoder(x))
        return self.decoder(h)


_LM_TOKENS = torch.randint(1, 24, (8, 12), generator=_gen(4))  # no padding token anywhere in the batches


def _padding_row_moves(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _TiedLSTMLM(tie=bug)
    xb, yb = _LM_TOKENS[:, :-1], _LM_TOKENS[:, 1:]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-2)

    def step() -> torch.Tensor:
        logits = model(xb)
        return F.cross_entropy(logits.reshape(-1, 24), yb.reshape(-1))

    return model, step, _kw(optimizer=opt, inputs=(xb, yb))


def _padding_row_changed(bug: bool) -> bool:
    model, step, kw = _padding_row_moves(bug)
    opt = kw["optimizer"]
    before = model.encoder.weight[0].detach().clone()
    for _ in range(3):
        opt.zero_grad()
        step().backward()
        opt.step()
    return not torch.equal(before, model.encoder.weight[0].detach())


class _CroppedConv(nn.Module):
    """A conv whose weight is only partly used in forward (a slimmable / cropped layer, as in the thread)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(16, 16, 3, 3))
        self.bias = nn.Parameter(torch.ones(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, self.weight[:8, :8], self.bias[:8], padding=1)


_CONV_X = torch.ones(2, 8, 6, 6)


def _unused_slice_decays(bug: bool) -> Case:
    model = _CroppedConv()
    if bug:
        opt = torch.optim.SGD(model.parameters(), lr=1e-2, weight_decay=1e-2)

        def step() -> torch.Tensor:
            return model(_CONV_X).pow(2).mean()
    else:  # the answer: an explicit L2 penalty on the part that is used, no optimizer weight_decay
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)

        def step() -> torch.Tensor:
            used = model.weight[:8, :8]
            return model(_CONV_X).pow(2).mean() + 0.5 * 1e-2 * used.pow(2).sum()

    return model, step, _kw(optimizer=opt, inputs=_CONV_X)


def _unused_slice_moved(bug: bool) -> bool:
    model, step, kw = _unused_slice_decays(bug)
    opt = kw["optimizer"]
    before = model.weight[8:].detach().clone()
    opt.zero_grad()
    step().backward()
    opt.step()
    return not torch.equal(before, model.weight[8:].detach())


# --------------------------------------------------------------------------------------------- mixed precision

_AMP_X = torch.randn(32, 8, generator=_gen(5))
_AMP_Y = torch.randn(32, 1, generator=_gen(6))


def _clip_before_unscale(bug: bool) -> Case:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)

    def step() -> torch.Tensor:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(_AMP_X)
        loss = F.mse_loss(out.float(), _AMP_Y)
        scaler.scale(loss).backward()
        if not bug:
            scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        return loss

    return model, step, _kw(optimizer=opt, inputs=(_AMP_X, _AMP_Y), scaler=scaler)


def _update_shrunk_by_scale(bug: bool) -> bool:
    """The real step's update is far smaller than lr * min(|g|, max_norm) of the true (unscaled) gradient."""
    model, step, _ = _clip_before_unscale(bug)
    ref = copy.deepcopy(model)
    with torch.autocast("cpu", dtype=torch.float16):
        out = ref(_AMP_X)
    F.mse_loss(out.float(), _AMP_Y).backward()
    true_norm = float(torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()]))
    expected = 0.1 * min(true_norm, 1.0)
    before = [p.detach().clone() for p in model.parameters()]
    step()
    moved = float(torch.sqrt(sum(((p.detach() - b) ** 2).sum() for p, b in zip(model.parameters(), before))))
    return moved < 0.01 * expected


# --------------------------------------------------------------------------------------------- the lr schedule

_SCHED_X = torch.randn(16, 8, generator=_gen(7))
_SCHED_Y = torch.randn(16, 1, generator=_gen(8))
_BATCHES_PER_EPOCH = 50
_EPOCHS = 100


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def _full_step(model: nn.Module, opt: torch.optim.Optimizer, sched: Any, step_sched: bool) -> Callable[[], Any]:
    def step() -> torch.Tensor:
        opt.zero_grad()
        loss = F.mse_loss(model(_SCHED_X), _SCHED_Y)
        loss.backward()
        opt.step()
        if step_sched:
            sched.step()
        return loss

    return step


def _steplr_per_batch(bug: bool) -> Case:
    """StepLR(step_size=30 epochs) stepped inside the batch loop (bug) or once per epoch (fix)."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=30, gamma=0.1)
    return model, _full_step(model, opt, sched, step_sched=bug), _kw(
        optimizer=opt, inputs=(_SCHED_X, _SCHED_Y), lr_scheduler=sched, total_steps=_EPOCHS * _BATCHES_PER_EPOCH)


def _lrs_over_run(opt: torch.optim.Optimizer, sched: Any, total: int, every: int) -> list[float]:
    """Walk a copy of the real scheduler over the planned run, stepped every ``every`` optimizer steps."""
    opt, sched = copy.deepcopy((opt, sched))
    lrs = []
    for i in range(total):
        lrs.append(opt.param_groups[0]["lr"])
        if (i + 1) % every == 0:
            sched.step()
    return lrs


def _steplr_dead(bug: bool) -> bool:
    _, _, kw = _steplr_per_batch(bug)
    opt = _mlp_opt_for(kw)
    lrs = _lrs_over_run(opt, kw["lr_scheduler"], _EPOCHS * _BATCHES_PER_EPOCH, 1 if bug else _BATCHES_PER_EPOCH)
    return sum(lr < 1e-8 for lr in lrs) > len(lrs) // 2


def _mlp_opt_for(kw: dict[str, Any]) -> torch.optim.Optimizer:
    opt = kw.get("optimizer")
    assert opt is not None
    return opt


def _linear_decay_one_epoch(bug: bool) -> Case:
    """get_linear_schedule_with_warmup with num_training_steps = batches of ONE epoch, for a 4-epoch run."""
    from transformers import get_linear_schedule_with_warmup

    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-5)
    epochs, batches = 4, 125
    total = batches if bug else batches * epochs
    sched = get_linear_schedule_with_warmup(opt, num_warmup_steps=0, num_training_steps=total)
    return model, _full_step(model, opt, sched, step_sched=True), _kw(
        optimizer=opt, inputs=(_SCHED_X, _SCHED_Y), lr_scheduler=sched, total_steps=epochs * batches)


def _lr_zero_most_of_run(bug: bool) -> bool:
    _, _, kw = _linear_decay_one_epoch(bug)
    lrs = _lrs_over_run(kw["optimizer"], kw["lr_scheduler"], 4 * 125, 1)
    return sum(lr == 0.0 for lr in lrs) > len(lrs) // 2


def _warmup_longer_than_run(bug: bool) -> Case:
    """A fixed warmup_steps=500 on a small dataset whose whole run is 200 steps (fix: a 10% warmup ratio)."""
    from transformers import get_cosine_schedule_with_warmup

    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=5e-5)
    total = 200
    sched = get_cosine_schedule_with_warmup(opt, num_warmup_steps=500 if bug else 20, num_training_steps=total)
    return model, _full_step(model, opt, sched, step_sched=True), _kw(
        optimizer=opt, inputs=(_SCHED_X, _SCHED_Y), lr_scheduler=sched, total_steps=total)


def _peak_never_reached(bug: bool) -> bool:
    _, _, kw = _warmup_longer_than_run(bug)
    lrs = _lrs_over_run(kw["optimizer"], kw["lr_scheduler"], 200, 1)
    return max(lrs) < 0.5 * 5e-5


# --------------------------------------------------------------------------------------------- modes and randomness

class _FrozenBackboneNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                      nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.fc = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.backbone(x))


_IMG = torch.randn(6, 3, 8, 8, generator=_gen(9)) * 2 + 1
_IMG_Y = torch.tensor([0, 1, 2, 0, 1, 2])


def _frozen_bn_stats(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _FrozenBackboneNet()
    for p in model.backbone.parameters():
        p.requires_grad = False
    opt = torch.optim.SGD(filter(lambda p: p.requires_grad, model.parameters()), lr=0.01)
    model.train()
    if not bug:
        model.backbone.eval()  # the answer: BatchNorm of the frozen part stays in eval mode
    return model, lambda: F.cross_entropy(model(_IMG), _IMG_Y), _kw(optimizer=opt, inputs=(_IMG, _IMG_Y))


def _frozen_stats_move(bug: bool) -> bool:
    model, step, kw = _frozen_bn_stats(bug)
    bn = model.backbone[1]
    before = _snapshot({"m": bn.running_mean, "v": bn.running_var})
    opt = kw["optimizer"]
    opt.zero_grad()
    step().backward()
    opt.step()
    return not (torch.equal(before["m"], bn.running_mean) and torch.equal(before["v"], bn.running_var))


class _PretrainedEncoderModel(nn.Module):
    """A pretrained submodule (frozen) with dropout, and a new trainable head."""

    def __init__(self, freeze_eval: bool) -> None:
        super().__init__()
        self.submodule = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 16))
        self.head = nn.Linear(16, 2)
        self.freeze_submodule = True
        self.freeze_eval = freeze_eval

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.freeze_submodule and self.freeze_eval:
            self.submodule.eval()  # the question's own fix: no dropout in the frozen part
        h = self.submodule(x)
        if self.freeze_submodule and self.freeze_eval and self.training:
            self.submodule.train()
        return self.head(h)


_ENC_X = torch.randn(16, 8, generator=_gen(10))
_ENC_Y = torch.randint(0, 2, (16,), generator=_gen(11))


def _dropout_in_frozen(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _PretrainedEncoderModel(freeze_eval=not bug)
    model.submodule.requires_grad_(False)
    model.train()
    opt = torch.optim.Adam(model.head.parameters(), lr=1e-3)
    return model, lambda: F.cross_entropy(model(_ENC_X), _ENC_Y), _kw(optimizer=opt, inputs=(_ENC_X, _ENC_Y))


def _frozen_features_random(bug: bool) -> bool:
    model, _, _ = _dropout_in_frozen(bug)
    feats = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        captured: list[torch.Tensor] = []
        h = model.submodule.register_forward_hook(lambda _m, _i, o: captured.append(o.detach()))
        model(_ENC_X)
        h.remove()
        feats.append(captured[0])
    return not torch.equal(feats[0], feats[1])


# --------------------------------------------------------------------------------------------- inputs against the model

_PAD = 0


def _gpt2(seed: int = 0) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=40, n_positions=32, bos_token_id=1,
                     eos_token_id=1, pad_token_id=_PAD, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


_SEQS = [[5, 6, 7, 8, 9, 10, 11, 1], [12, 13, 14, 1]]


def _left_padded() -> tuple[torch.Tensor, torch.Tensor]:
    """The batch as a tokenizer with padding_side="left" returns it: ids and attention mask."""
    width = max(map(len, _SEQS))
    ids = torch.tensor([[_PAD] * (width - len(s)) + s for s in _SEQS])
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in _SEQS])
    return ids, mask


def _left_padding_positions(bug: bool) -> Case:
    model = _gpt2().train()
    ids, mask = _left_padded()
    labels = ids.masked_fill(mask == 0, -100)
    batch: dict[str, torch.Tensor] = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    if not bug:  # the fix: positions counted from the first real token
        batch["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, lambda: model(**batch), _kw(optimizer=opt, inputs=batch)


def _padding_shifts_positions(bug: bool) -> bool:
    """The short sequence's logits in the left-padded batch differ from the same sequence fed alone."""
    model, _, kw = _left_padding_positions(bug)
    model.eval()
    batch = {k: v for k, v in kw["inputs"].items() if k != "labels"}
    with torch.no_grad():
        padded = model(**batch).logits[1, -len(_SEQS[1]):]
        alone = model(torch.tensor([_SEQS[1]])).logits[0]
    return not torch.allclose(padded, alone, atol=1e-5)


def _bert_left_padding(bug: bool) -> Case:
    """BERT sequence classification pools position 0; left padding puts [PAD] there for the short rows."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=32, pad_token_id=_PAD, num_labels=2)
    model = BertForSequenceClassification(cfg).train()
    cls, sep = 2, 3
    seqs = [[cls, 5, 6, 7, 8, 9, sep], [cls, 10, 11, sep], [cls, 12, sep]]
    width = max(map(len, seqs))
    rows = [[_PAD] * (width - len(s)) + s if bug else s + [_PAD] * (width - len(s)) for s in seqs]
    ids = torch.tensor(rows)
    batch = {"input_ids": ids, "attention_mask": (ids != _PAD).long(), "labels": torch.tensor([0, 1, 0])}
    opt = torch.optim.AdamW(model.parameters(), lr=2e-5)
    return model, lambda: model(**batch), _kw(optimizer=opt, inputs=batch)


def _pooled_token_is_padding(bug: bool) -> bool:
    """The classifier reads the hidden state at position 0; for some rows that token is [PAD], not [CLS]."""
    model, _, kw = _bert_left_padding(bug)
    return bool((kw["inputs"]["input_ids"][:, 0] == _PAD).any())


# --------------------------------------------------------------------------------------------- freezing and LoRA

class _SmallResNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.layer4 = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.fc = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.layer4(self.stem(x)))


def _unfrozen_not_in_optimizer(bug: bool) -> Case:
    torch.manual_seed(0)
    model = _SmallResNet()
    for p in model.parameters():
        p.requires_grad = False
    model.fc = nn.Linear(8, 3)
    opt = torch.optim.Adam(filter(lambda p: p.requires_grad, model.parameters()), lr=1e-3)
    # ... head-only epochs, then the last block is unfrozen for fine-tuning
    for p in model.layer4.parameters():
        p.requires_grad = True
    if not bug:  # the fix: recreate the optimizer with the newly trainable block
        opt = torch.optim.Adam([{"params": model.fc.parameters(), "lr": 1e-3},
                                {"params": model.layer4.parameters(), "lr": 1e-4}])
    return model, lambda: F.cross_entropy(model(_IMG), _IMG_Y), _kw(optimizer=opt, inputs=(_IMG, _IMG_Y))


def _unfrozen_block_stuck(bug: bool) -> bool:
    model, step, kw = _unfrozen_not_in_optimizer(bug)
    opt = kw["optimizer"]
    before = model.layer4[0].weight.detach().clone()
    for _ in range(2):
        opt.zero_grad()
        step().backward()
        opt.step()
    got_grad = model.layer4[0].weight.grad is not None and bool(model.layer4[0].weight.grad.abs().sum() > 0)
    return got_grad and torch.equal(before, model.layer4[0].weight.detach())


def _lora_init_not_identity(bug: bool) -> Case:
    """LoRA with init_lora_weights=False: A and B both random, so the adapted model starts away from the base."""
    from peft import LoraConfig, get_peft_model

    base = _gpt2(seed=1)
    torch.manual_seed(2)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0,
                     init_lora_weights=False if bug else True, task_type="CAUSAL_LM")
    model = get_peft_model(base, cfg)
    model.train()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 1], [12, 13, 14, 15, 16, 17, 18, 1]])
    batch = {"input_ids": ids, "labels": ids.clone()}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-4)
    return model, lambda: model(**batch), _kw(optimizer=opt, inputs=batch)


def _adapted_model_differs_at_init(bug: bool) -> bool:
    model, _, kw = _lora_init_not_identity(bug)
    model.eval()
    ids = kw["inputs"]["input_ids"]
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
        with model.disable_adapter():
            plain = model(input_ids=ids).logits
    return not torch.allclose(adapted, plain, atol=1e-6)


CASES: list[BlindCase] = [
    BlindCase("class-weights-follow-frequency",
              "https://discuss.pytorch.org/t/predictions-stuck-at-zero-when-positive-label-1-is-only-16-of-data/145203/2",
              "loss supervision", "the per-class loss weights are the class frequencies, so the rare class is "
              "weighted down further instead of up", _class_weights_follow_frequency, _minority_gradient_share),
    BlindCase("t5-label-padding-not-ignored",
              "https://discuss.huggingface.co/t/is-there-a-way-to-return-the-decoder-input-ids-from-tokenizer-"
              "prepare-seq2seq-batch/2929/6",
              "loss supervision", "seq2seq targets padded with the pad id instead of -100, so the decoder is trained "
              "to emit padding", _t5_label_padding, _t5_padding_gets_loss_gradient),
    BlindCase("label-sorted-single-class-batches",
              "https://dailydoseofds.beehiiv.com/p/why-is-it-important-to-shuffle-your",
              "loss supervision", "a label-ordered dataset without shuffling: every batch holds one class",
              _label_sorted_batches, _every_batch_one_class),
    BlindCase("tied-decoder-moves-padding-row",
              "https://forums.fast.ai/t/help-understanding-padding-in-language-model-learner/69305",
              "optimizer update", "the padding_idx embedding row never occurs in the data yet moves, through the "
              "decoder tied to it", _padding_row_moves, _padding_row_changed,
              known_miss="the padding row gets a real gradient through the tied decoder; no invariant compares "
                         "padding_idx with the rows the step moves (a decayed pad row is harmless in most models)"),
    BlindCase("weight-decay-shrinks-unused-slice",
              "https://discuss.pytorch.org/t/how-do-i-dynamically-swich-on-off-weight-decay/89270",
              "optimizer update", "weight decay moves the part of a weight that forward never uses",
              _unused_slice_decays, _unused_slice_moved,
              known_miss="the unused slice's gradient is zero from backward itself, which the update family does "
                         "not count as moved-without-gradient (LoRA factors and zero-initialised gates look alike)"),
    BlindCase("amp-clip-without-unscale", "https://kaijuan.co/qa/54716377",
              "mixed precision", "gradients clipped while still multiplied by the GradScaler's scale",
              _clip_before_unscale, _update_shrunk_by_scale),
    BlindCase("steplr-stepped-per-batch",
              "https://runebook.dev/en/docs/pytorch/generated/torch.optim.lr_scheduler.steplr/torch.optim.lr_scheduler.StepLR",
              "lr schedule", "an epoch-based StepLR stepped every batch decays the lr to ~0 early in the run",
              _steplr_per_batch, _steplr_dead),
    BlindCase("linear-schedule-one-epoch-of-steps",
              "https://openillumi.com/en/en-bert-adamw-scheduler-step-timing-fix",
              "lr schedule", "num_training_steps counts one epoch of a multi-epoch run, so the lr is 0 after it",
              _linear_decay_one_epoch, _lr_zero_most_of_run),
    BlindCase("warmup-longer-than-run",
              "https://theneuralbase.com/sft/learn/intermediate/learning-rate-warmup-strategies/",
              "lr schedule", "warmup_steps exceeds the planned run, so the peak lr is never reached",
              _warmup_longer_than_run, _peak_never_reached),
    BlindCase("frozen-backbone-batchnorm-stats",
              "https://discuss.pytorch.org/t/decreasing-weights-without-optimization/4268",
              "train/eval modes", "a frozen backbone left in train mode keeps updating its BatchNorm statistics",
              _frozen_bn_stats, _frozen_stats_move),
    BlindCase("dropout-in-frozen-submodule", "https://example-a.com/answer/63159701",
              "train/eval modes", "a frozen pretrained submodule keeps its dropout on, so its features are random",
              _dropout_in_frozen, _frozen_features_random),
    BlindCase("left-padding-absolute-positions",
              "http://blog.zerodtree.com/%E6%9C%BA%E5%99%A8%E5%AD%A6%E4%B9%A0/padding-size",
              "inputs vs model", "left padding with absolute position embeddings and no position_ids shifts every "
              "short sequence's positions", _left_padding_positions, _padding_shifts_positions),
    BlindCase("bert-left-padding-pools-pad",
              "https://tom-pollak.github.io/pages/left_vs_right_padding.html",
              "inputs vs model", "left padding for an encoder that pools position 0: short rows classify from [PAD]",
              _bert_left_padding, _pooled_token_is_padding),
    BlindCase("unfrozen-block-not-in-optimizer",
              "https://theneuralbase.com/pytorch/learn/intermediate/freezing-base-model-weights/",
              "freezing", "a block unfrozen after the optimizer was built from the trainable params never updates",
              _unfrozen_not_in_optimizer, _unfrozen_block_stuck),
    BlindCase("lora-init-not-identity",
              "https://ttsugriy.github.io/llm-first-principles/stages/stage-09/common-mistakes",
              "LoRA/PEFT", "LoRA initialised with both factors random: the model departs from the base before "
              "training", _lora_init_not_identity, _adapted_model_differs_at_init,
              known_miss="no invariant compares the adapted model's output at init with the base model's"),
]
